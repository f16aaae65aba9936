"""Why tokens missed, in the window (issue 23 item 1): the stacked bars add up to the engine's counts, say "no data"
where nothing was counted, and the sequences table and the block map say each sequence's reasons and each block's
history on hover."""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import CacheConfig
from engine.model.loader import load_model
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from tiny_models import budget_mb, prompts

pytest.importorskip("PySide6")


@pytest.fixture(scope="module")
def engine_after_misses(tiny_llama):
    """A repeated prompt after a prefix-cache reset (reconfigured), and a request larger than the device tier
    (its blocks on the host tier for room: capacity)."""
    model = load_model(tiny_llama)
    eng = Engine(model, CacheConfig(block_size=4, device_budget_mb=budget_mb(model, 6, 4), host_budget_mb=1.0))
    a = prompts(70, [20])[0]
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    eng.generate([a], sp)
    eng.kv.reset_prefix_cache()
    eng.generate([a, prompts(71, [40])[0]], sp)
    return eng


def test_the_bars_are_the_engines_counts_and_no_data_before_any(qtbot, engine_after_misses, tiny_llama):
    from engine.kv.misses import PROMPT_REASONS, READ_REASONS, counter_name
    from ui.panels.why_missed import WhyMissedPanel

    panel = WhyMissedPanel()
    qtbot.addWidget(panel)
    fresh = Engine(load_model(tiny_llama), CacheConfig(block_size=4)).snapshot()
    panel.update_snapshot(fresh)
    assert panel.texts() == ["prompt · last 5 s: no data", "keys · last 5 s: no data",
                             "prompt · since start: no data", "keys · since start: no data"]
    eng = engine_after_misses
    snap = eng.snapshot()
    panel.update_snapshot(snap)
    panel.show()
    qtbot.waitExposed(panel)
    panel.grab()  # paints the segments (and their hovers)
    c = eng.counters
    prompt = {r: getattr(c, counter_name(r)) for r in PROMPT_REASONS if getattr(c, counter_name(r))}
    reads = {r: getattr(c, counter_name(r)) for r in READ_REASONS if getattr(c, counter_name(r))}
    assert prompt["reconfigured"] == 16 and reads.get("capacity", 0) > 0
    lines = panel.texts()
    want_p = ", ".join(f"{r} {n:,}" for r, n in prompt.items())
    want_r = ", ".join(f"{r} {n:,}" for r, n in reads.items())
    assert lines[2] == f"prompt · since start: {c.lookup_tokens - c.lookup_served:,} missed of " \
                       f"{c.lookup_tokens:,} ({want_p})"
    assert lines[3] == f"keys · since start: {c.read_tokens_missed:,} missed of {c.read_tokens:,} ({want_r})"
    painted = [tip for _, tip in panel._hits if "missed" in tip]
    assert len(painted) >= len(prompt) + len(reads)  # a segment per reason since start (and the last 5 s's)


def test_a_sequences_row_and_a_blocks_hover_say_why(qtbot, engine_after_misses):
    from ui.block_map.widget import BlockMap
    from ui.panels.lists import SequencesPanel

    eng = engine_after_misses
    snap = eng.snapshot()
    table = SequencesPanel()
    qtbot.addWidget(table)
    table.update_snapshot(snap)
    sid = 1  # the repeated prompt
    assert eng.seqs[sid].why_missed["reconfigured"] == 16
    assert "reconfigured 16" in table.why_text(sid) and "partial 4" in table.why_text(sid)
    bmap = BlockMap()
    qtbot.addWidget(bmap)
    bmap.set_snapshot(snap)
    restored = [(k, int(s)) for k, t in enumerate(snap.tiers) for s in np.flatnonzero(t.stores > 0)]
    assert restored
    text = bmap.tooltip_text(*restored[0])
    assert "stored 1 time before; its last copy dropped by a config change" in text
    host = snap.tiers[1]
    on_host = np.flatnonzero(host.state > 0)
    assert len(on_host) and "on the host tier: no device room" in bmap.tooltip_text(1, int(on_host[0]))


def test_groups_get_a_bar_each_that_adds_up_to_the_engines(qtbot, tiny_gemma3):
    """Gemma 3 (a full and a window group): one bar per group, since start; the groups' reasons plus the sequences'
    partial and preempted tokens are the engine's reasons."""
    from engine.kv.misses import PROMPT_REASONS, READ_REASONS, counter_name
    from ui.panels.why_missed import WhyMissedPanel

    model = load_model(tiny_gemma3)
    eng = Engine(model, CacheConfig(block_size=4, device_budget_mb=budget_mb(model, 24, 4), host_budget_mb=1.0))
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    a = prompts(72, [40])[0]
    eng.generate([a], sp)
    eng.generate([prompts(73, [60])[0]], sp)
    eng.generate([a], sp)
    snap = eng.snapshot()
    panel = WhyMissedPanel()
    qtbot.addWidget(panel)
    panel.update_snapshot(snap)
    panel.resize(700, 200)
    panel.show()
    qtbot.waitExposed(panel)
    panel.grab()
    lines = panel.texts()
    assert len(lines) == 4 + len(snap.kv_groups) == 6
    summed = {}
    for g, line in zip(snap.kv_groups, lines[4:]):
        assert line.startswith(f"{g['title']} · since start: ")
        for r, n in g["why_missed"].items():
            assert f"{r} {n:,}" in line
            summed[r] = summed.get(r, 0) + n
    c = eng.counters
    whole = {r: getattr(c, counter_name(r)) for r in PROMPT_REASONS + READ_REASONS if getattr(c, counter_name(r))}
    for r in ("partial", "preempted"):
        if whole.get(r):
            summed[r] = whole[r]
    assert summed == whole and sum(whole.values()) > 0
    assert any("because of group" in tip for _, tip in panel._hits)
