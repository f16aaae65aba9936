"""One block map section per KV-cache group (issue 21 item 4): titled with the group, its blocks per tier and its
device hit rate; each section draws its own group's pool."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineOptions
from engine.model.loader import load_model
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from tiny_models import prompts

pytest.importorskip("PySide6")


@pytest.fixture(scope="module")
def grouped_snapshot(tiny_gemma3):
    eng = Engine(load_model(tiny_gemma3), CacheConfig(block_size=4, device_budget_mb=0.5, host_budget_mb=0.5))
    eng.generate(prompts(60, [70, 40]), SamplingParams(max_new_tokens=5, ignore_eos=True))
    return eng, eng.snapshot()


def test_a_section_per_group_titled_with_its_blocks_and_hit_rate(qtbot, grouped_snapshot):
    from ui.block_map.groups import GroupMaps, group_title

    eng, snap = grouped_snapshot
    maps = GroupMaps()
    qtbot.addWidget(maps)
    maps.show()
    maps.set_snapshot(snap)
    (t0, m0), (t1, m1) = maps.sections
    assert t0.isVisible() and t1.isVisible()
    assert t0.text().startswith("full attention · 1 layer") and t1.text().startswith("sliding window 24 · 4 layers")
    wpool = eng.kv.pools[1]
    assert f"dev {wpool.tiers[0].used:,}/{wpool.tiers[0].capacity:,}, host {wpool.tiers[1].used:,}/" in t1.text()
    g = snap.kv_groups[1]
    assert f"hit {100 * (1 - g['read_tokens_missed'] / g['read_tokens']):.1f} %" in t1.text()
    # Each map draws its own pool: its layout is its tiers' capacities.
    assert m0._layout.capacities == tuple(t.capacity for t in eng.kv.pools[0].tiers)
    assert m1._layout.capacities == tuple(t.capacity for t in wpool.tiers)
    assert group_title({**g, "read_tokens": 0, "read_tokens_missed": 0}).endswith("hit no data")
    # Selecting in one section selects in every section.
    maps.set_selected(0)
    assert [m._selected for m in maps.maps()] == [0, 0]


def test_one_pool_draws_one_untitled_map(qtbot, tiny_gemma3):
    from ui.block_map.groups import GroupMaps

    eng = Engine(load_model(tiny_gemma3), CacheConfig(block_size=4, device_budget_mb=0.5, host_budget_mb=0.5),
                 EngineOptions(kv_groups="off"))
    eng.generate(prompts(61, [30]), SamplingParams(max_new_tokens=3, ignore_eos=True))
    maps = GroupMaps()
    qtbot.addWidget(maps)
    maps.show()
    maps.set_snapshot(eng.snapshot())
    assert len(maps.sections) == 1 and not maps.sections[0][0].isVisible()


def test_the_window_draws_a_map_per_group(qtbot, tiny_gemma3):
    from app.window.runner import EngineRunner
    from ui.main_window import MainWindow

    eng = Engine(load_model(tiny_gemma3), CacheConfig(block_size=4, device_budget_mb=0.5, host_budget_mb=0.5),
                 EngineOptions(context_limit=256))
    runner = EngineRunner(eng).start()
    try:
        sid = eng.add_request(prompts(62, [60])[0], SamplingParams(max_new_tokens=40, ignore_eos=True))
        win = MainWindow(runner, confirm_lossy=lambda d: True)
        qtbot.addWidget(win)
        win.show()
        qtbot.waitUntil(lambda: eng.seqs[sid].num_cached > 60, timeout=60_000)
        win.refresh(every_panel=True)
        titles = [t.text() for t, _ in win.maps.sections if t.isVisible()]
        assert [x.split("  ·  ")[0] for x in titles] == ["full attention · 1 layer", "sliding window 24 · 4 layers"]
        assert win.maps.sections[1][1]._layout.capacities == tuple(t.capacity for t in eng.kv.pools[1].tiers)
        win.select_sequence(sid)
        assert [m._selected for m in win.maps.maps()] == [sid, sid]
    finally:
        runner.stop()
