"""The "What if" tab: the live engine's reads recorded, the curves computed on a worker thread and drawn."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("pytestqt")

from app.window.runner import EngineRunner  # noqa: E402
from app.whatif.worker import what_if_result  # noqa: E402
from ui.panels.what_if import WhatIfPanel  # noqa: E402


def _engine(model):
    from engine.config import CacheConfig, EngineOptions
    from engine.runtime.engine import Engine

    return Engine(model, CacheConfig(block_size=16, device_budget_mb=1.0), EngineOptions(attention="cpu"))


def test_record_compute_and_draw(qtbot, llama_model):
    from engine.sequence import SamplingParams

    runner = EngineRunner(_engine(llama_model))  # not started: the test steps the engine itself
    panel = WhatIfPanel(runner.what_if())
    qtbot.addWidget(panel)
    assert "no data" in panel.text.text()
    panel._record_clicked()
    assert runner.recording and "Recording" in panel.record.text()
    shared = list(range(20, 84))
    runner.engine.generate([shared + [5, 6, 7], shared + [8, 9]], SamplingParams(max_new_tokens=4))
    runner.engine.generate([shared + [10]], SamplingParams(max_new_tokens=2))
    with qtbot.waitSignal(panel.resultReady, timeout=60_000):
        panel._record_clicked()  # stop early: take the trace, compute on the worker thread
    assert not runner.recording and panel.result is not None
    r = panel.result
    assert [c[0] for c in r.curves] == ["lru", "heat(0.9)", "s3fifo"]
    lru = r.curves[0]
    assert set(range(1, r.distinct + 1)) <= set(lru[1].tolist())  # every capacity up to the distinct blocks
    assert np.nanmax(lru[2]) > 0  # the later requests reuse the shared prefix
    assert r.current_blocks == runner.engine.pool.sizes.dev_cap
    assert "2× budget:" in panel.text.text()
    # the engine as configured leads: drawn as its own curve through the measured point, its sentences first
    conf = r.configured
    assert conf is not None and conf.recorded_capacity == r.current_blocks
    drawn = [item for item in panel.plot.listDataItems() if item.name() == "engine as configured"]
    assert len(drawn) == 1 and len(drawn[0].xData) == int(np.isfinite(conf.hit_rate).sum()) >= 8
    assert panel.text.text().index("engine as configured") < panel.text.text().index("2× budget:")
    assert "PREFIX, the prompt tokens served from the prefix cache" in panel.plot.toolTip()
    assert r.block_sizes and [b for b, _, _ in r.block_sizes] == [8, 16, 32, 64]
    for i in (1, 2):
        panel.view.setCurrentIndex(i)
        assert "no data" not in panel.text.text()


def test_a_bad_file_is_refused_in_one_line(qtbot, tmp_path, llama_model):
    runner = EngineRunner(_engine(llama_model))
    panel = WhatIfPanel(runner.what_if())
    qtbot.addWidget(panel)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"timestamp": 0}) + "\n")
    with qtbot.waitSignal(panel.resultReady, timeout=30_000):
        panel.start(str(bad))
    assert f"{bad}:1:" in panel.text.text() and panel.result is None and panel.open.isEnabled()


def test_a_saved_snapshot_has_no_what_if(qtbot):
    panel = WhatIfPanel(None)
    qtbot.addWidget(panel)
    assert not panel.record.isEnabled() and "need the live engine" in panel.text.text()


def test_block_hash_trace_has_no_threshold_view(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text("".join(json.dumps({"timestamp": i * 100, "input_length": 1024, "output_length": 1,
                                     "hash_ids": [0, i % 3 + 1]}) + "\n" for i in range(12)))
    r = what_if_result(str(p), 2, None)
    assert r.thresholds is None and r.block_sizes == [] and r.curves[0][2][-1] > 0


def test_a_grouped_engine_gets_curves_per_kv_cache_group(qtbot, tiny_qwen3_sliding):
    """Tiny Qwen3 with a window-24 group: the tab's group selector lists both groups; each group's curves are read
    at that group's own device capacity, and the window group's differ from the full group's."""
    from engine.config import CacheConfig, EngineOptions
    from engine.model.loader import load_model
    from engine.runtime.engine import Engine
    from engine.sequence import SamplingParams

    eng = Engine(load_model(tiny_qwen3_sliding), CacheConfig(block_size=4, device_budget_mb=1.0),
                 EngineOptions(attention="cpu"))
    runner = EngineRunner(eng)
    panel = WhatIfPanel(runner.what_if())
    qtbot.addWidget(panel)
    panel._record_clicked()
    shared = list(range(20, 80))
    for tail in ([5, 6, 7], [8, 9], [10], [5, 6, 7]):
        eng.generate([shared + tail], SamplingParams(max_new_tokens=4, ignore_eos=True))
    with qtbot.waitSignal(panel.resultReady, timeout=120_000):
        panel._record_clicked()
    assert [r.group for r in panel.results] == [0, 1]
    assert not panel.group.isHidden() and panel.group.count() == 2
    assert "sliding window 24" in panel.group.itemText(1)
    assert [r.current_blocks for r in panel.results] == [int(p.sizes.dev_cap) for p in eng.kv.pools]
    full, window = panel.results
    assert window.distinct < full.distinct  # the window group holds the last window's blocks only
    panel.group.setCurrentIndex(1)
    assert panel.result is window and "KV-cache group 1" in panel.text.text()
    saved = panel.saved()
    assert [g["group"] for g in saved["groups"]] == [0, 1]
    assert saved["groups"][1]["curves"][0]["hit_rate"].tolist() == window.curves[0][2].tolist()
