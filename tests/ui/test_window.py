"""The window on a real engine (tiny model) and a real Qt event loop, offscreen."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from app.window.runner import EngineRunner
from engine.config import CacheConfig, EngineOptions
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from tiny_models import prompts

pytest.importorskip("PySide6")


@pytest.fixture
def window(qtbot, runner):
    from ui.main_window import MainWindow

    win = MainWindow(runner, confirm_lossy=lambda dtype: True)
    qtbot.addWidget(win)
    win.show()
    return win


def busy(runner, n=3, new=400):
    return [runner.engine.add_request(p, SamplingParams(max_new_tokens=new, ignore_eos=True))
            for p in prompts(30, [40, 25, 60][:n])]


def test_window_builds_with_every_panel(window):
    assert set(window.docks) == {"Controls", "Prompt", "Sequences", "Events", "Hit rate", "Memory", "Heat",
                                 "Residency", "Cost", "Why missed", "Diagnostics", "What if"}
    window.refresh()
    assert "tiny" in window.status.text() or "on cpu" in window.status.text()
    # budgets count MiB, and say so (a "48 MB" budget held 50.1 million bytes)
    assert "dev 0.3 MiB host 1 MiB" in window.status.text() and " MB " not in window.caption()


def test_help_menu_shows_each_topic_that_kvscope_help_prints(window):
    """Help lists every topic of assets/help (as `kvscope help` does) and shows the one picked, its text rendered."""
    from ui.help_text import topic_text, topics

    menu = next(a.menu() for a in window.menuBar().actions() if a.text() == "&Help")
    names = [a.text() for a in menu.actions()]
    assert names == [n for n, _ in topics()] and "knobs" in names
    next(a for a in menu.actions() if a.text() == "knobs").trigger()
    dialog = window.help_dialog
    assert dialog.isVisible() and dialog.topic == "knobs" and "knobs" in dialog.windowTitle()
    shown = dialog.view.toPlainText()
    first = next(line for line in topic_text("knobs").splitlines()[1:] if line.strip() and not line.startswith("|"))
    assert first.split()[0].strip("`*") in shown


CHANGES = {"block_size": 8, "kv_dtype": "int8", "device_budget_mb": 0.5, "host_budget_mb": 2.0, "policy": "lru",
           "decay": 0.5, "demote_after_s": 2.0, "prefetch_depth": 4, "evict_batch": 16}


@pytest.mark.parametrize("name", list(CHANGES))
def test_each_control_changes_the_live_config(qtbot, window, runner, name):
    busy(runner)
    control = window.controls.controls[name]
    value = CHANGES[name]
    # Drive the widget the way a user does.
    if control.combo is not None:
        control.combo.setCurrentText(str(value))
        control.combo.activated.emit(control.combo.currentIndex())
    else:
        control.spin.setValue(value)
    qtbot.waitUntil(lambda: str(getattr(runner.engine.config, name).label if name == "kv_dtype" else
                                getattr(runner.engine.config, name)) == str(value), timeout=10_000)
    assert "applied" in window.controls.message.text()
    runner.engine.check_invariants()


def test_invalid_value_is_refused_visibly_and_config_unchanged(qtbot, window, runner):
    busy(runner, n=1)
    qtbot.waitUntil(lambda: runner.engine.seqs[0].num_cached > 30, timeout=10_000)
    # No host tier, then a device tier too small for the live sequence: in the knob's range, but refused.
    assert window.controls.apply("host_budget_mb", 0.0)
    before = runner.engine.config
    control = window.controls.controls["device_budget_mb"]
    control.spin.setValue(0.01)
    assert "refused" in window.controls.message.text()
    assert "device_budget_mb" in window.controls.message.text()
    assert runner.engine.config == before
    assert control.spin.value() == pytest.approx(before.device_budget_mb)
    # The refusal is in Events too, with the engine's reason.
    qtbot.waitUntil(lambda: (window.refresh() or True) and any(
        k == "config_error" and "device_budget_mb" in f for _, k, f in window.events.events), timeout=5_000)


def test_selecting_a_sequence_highlights_its_blocks(qtbot, window, runner):
    from ui.main_window import selected_cells

    ids = busy(runner)
    qtbot.waitUntil(lambda: all(runner.engine.seqs[i].num_cached > 20 for i in ids), timeout=10_000)
    runner.pause_engine(True)
    window.refresh()
    window.seqs.update_snapshot(window.snapshot)
    row = window.seqs._ids.index(ids[1])
    window.seqs.selectRow(row)
    assert window.selected == ids[1]
    snap = window.snapshot
    want = selected_cells(snap, ids[1])
    got = window.block_map.selected_cells()
    assert [np.array_equal(np.sort(g), w) for g, w in zip(got, want)] == [True, True]
    assert sum(len(w) for w in want) == len(runner.engine.seqs[ids[1]].blocks)

    # The table paints its rows itself: the selected row is highlighted, each row carries its sequence's
    # colour swatch, and the id text is there.
    from PySide6 import QtGui

    from ui.palette import seq_rgb

    vp = window.seqs.viewport()
    img = QtGui.QImage(vp.size(), QtGui.QImage.Format_ARGB32)
    vp.render(img)
    h = window.seqs.verticalHeader().defaultSectionSize()
    highlight = window.seqs.palette().color(QtGui.QPalette.Highlight).rgb() & 0xFFFFFF
    y_sel = window.seqs.rowViewportPosition(row) + h // 2
    assert img.pixel(vp.width() - 3, y_sel) & 0xFFFFFF == highlight
    other = (row + 1) % len(window.seqs._ids)
    assert img.pixel(vp.width() - 3, window.seqs.rowViewportPosition(other) + h // 2) & 0xFFFFFF != highlight
    for r, sid in enumerate(window.seqs._ids[:5]):
        x0 = window.seqs.horizontalHeader().sectionViewportPosition(0)
        got = QtGui.QColor(img.pixel(x0 + 7, window.seqs.rowViewportPosition(r) + h // 2))
        assert (got.red(), got.green(), got.blue()) == seq_rgb(sid)


def test_screenshot_and_json_round_trip_through_open_snapshot(qtbot, window, runner, tmp_path):
    from PySide6 import QtGui

    from ui.main_window import open_snapshot_window

    busy(runner)
    qtbot.waitUntil(lambda: runner.engine.counters.generated > 10, timeout=10_000)
    png = tmp_path / "shot.png"
    json_path = window.save_screenshot(str(png))
    img = QtGui.QImage(str(png))
    assert img.width() >= 1000 and img.height() > 600
    doc = json.loads(open(json_path).read())
    assert doc["format"] == "kvscope-snapshot" and "caption" in doc["extra"]
    ro = open_snapshot_window(json_path)
    qtbot.addWidget(ro)
    saved = ro.snapshot
    live_cfg = runner.engine.config.as_dict()
    assert saved.config == live_cfg
    assert ro.controller.read_only and not ro.controls.controls["block_size"].isEnabled()
    for a, b in zip(saved.tiers, ro.controller.snap.tiers):
        assert np.array_equal(a.state, b.state) and np.array_equal(a.heat, b.heat)
    assert os.path.basename(str(png)) == doc["extra"]["png"]
    # The Events panel opens as it was (issue 11: snapshots carried no events).
    assert len(window.events.events) > 0 and doc["extra"]["events"]
    assert [tuple(e) for e in doc["extra"]["events"]] == [tuple(e) for e in window.events.events[-2000:]]
    assert ro.events.events == [tuple(e) for e in doc["extra"]["events"]] and ro.events.list.count() > 0


def test_damaged_snapshot_file_gets_a_clear_error(tmp_path):
    from engine.telemetry import snapshot_io
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "kvscope-snapshot", "version": 1, "snapshot": {"tiers": 3}}')
    with pytest.raises(snapshot_io.SnapshotFileError, match="damaged"):
        snapshot_io.load(str(bad))
    with pytest.raises(snapshot_io.SnapshotFileError, match="not JSON"):
        snapshot_io.from_json("{", "x.json")
    from engine.telemetry.snapshot_fields import _Bad

    with pytest.raises(_Bad, match=r"extra.events\[0\]\[1\]"):
        snapshot_io._extra({"events": [[1.0, 2, "x"]]})
    with pytest.raises(_Bad, match=r"extra.events\[0\]"):
        snapshot_io._extra({"events": [["noon", "config"]]})


def test_block_size_and_dtype_sliders_during_the_demo_lose_nothing(qtbot, llama_model):
    """The demo workload runs; block size and dtype change from the controls; no sequence is lost and no
    block leaks."""
    from engine.sequence import SeqState
    from engine.workloads.demo import DemoWorkload
    from ui.main_window import MainWindow

    eng = Engine(llama_model, CacheConfig(block_size=16, device_budget_mb=0.5, host_budget_mb=2, demote_after_s=0.5),
                 EngineOptions(context_limit=128, n_keep=8))
    runner = EngineRunner(eng, DemoWorkload(eng, seed=1)).start()
    try:
        win = MainWindow(runner, confirm_lossy=lambda d: True)
        qtbot.addWidget(win)
        win.show()
        qtbot.waitUntil(lambda: sum(1 for s in eng.seqs.values() if s.state != SeqState.FINISHED) >= 3, timeout=20_000)
        for name, value in (("block_size", 5), ("kv_dtype", "int8"), ("block_size", 32), ("kv_dtype", "fp16")):
            runner.pause_engine(True)
            qtbot.wait(100)
            with eng.lock:
                live = {s.id: (list(s.tokens[: s.num_cached]), s.state) for s in eng.seqs.values()
                        if s.state != SeqState.FINISHED}
            runner.pause_engine(False)
            control = win.controls.controls[name]
            if control.combo is not None:
                control.combo.setCurrentText(value)
                control.combo.activated.emit(control.combo.currentIndex())
            else:
                control.spin.setValue(value)
            qtbot.waitUntil(lambda: str(getattr(eng.config, name).label if name == "kv_dtype"
                                        else getattr(eng.config, name)) == str(value), timeout=10_000)
            runner.pause_engine(True)
            qtbot.wait(100)
            with eng.lock:
                eng.check_invariants()
                for sid, (tokens, _) in live.items():
                    seq = eng.seqs.get(sid)
                    assert seq is not None, f"sequence {sid} vanished"
                    if seq.state != SeqState.FINISHED and not seq.shifts:
                        assert seq.tokens[: len(tokens)] == tokens, f"sequence {sid} lost tokens"
                    assert seq.finish_reason in ("", "eos", "length", "cancelled"), seq.finish_reason
            runner.pause_engine(False)
        runner.pause_engine(True)  # so no sequence arrives between the window's snapshot and the check
        qtbot.wait(300)
        win.refresh_all()
        shown = set(win.seqs._ids)
        assert {sid for sid, s in eng.seqs.items() if s.state != SeqState.FINISHED} <= shown
        assert eng.counters.config_changes >= 4
    finally:
        runner.stop()
    eng.check_invariants()


def test_record_trace_button_saves_a_trace_of_the_reads(qtbot, window, runner, tmp_path):
    from engine.kv.access_trace import AccessTrace

    path = str(tmp_path / "rec.npz")
    window.controls.trace_path = lambda: path
    window.controls.record.setChecked(True)
    busy(runner, n=2, new=20)
    qtbot.waitUntil(lambda: runner.engine.counters.generated >= 20, timeout=10_000)
    window.controls.record.setChecked(False)
    trace = AccessTrace.load(path)
    assert len(trace) > 0 and "saved" in window.controls.message.text()
    assert set(trace.seq.tolist()) <= set(runner.engine.seqs)


def test_residency_panel_shows_reuse_and_eviction_ages(qtbot, llama_model):
    from ui.main_window import MainWindow

    eng = Engine(llama_model, CacheConfig(block_size=4, device_budget_mb=0.03, host_budget_mb=0.02))
    shared = prompts(40, [30])[0]
    for p in [shared, shared] + prompts(41, [40, 40, 40]):  # a prefix hit, then pressure that evicts
        eng.generate([p], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert eng.counters.prompt_reused > 0 and eng.counters.evictions > 0
    runner = EngineRunner(eng)
    win = MainWindow(runner)
    qtbot.addWidget(win)
    win.refresh_all()
    lines = dict((line[:16].strip(), line[16:].strip())
                 for line in win.residency.summary.text().splitlines())
    assert lines["reuse gap"].startswith("n=") and lines["age at eviction"].startswith("n=")
    curve_y = win.residency.curves["age_at_eviction"].getData()[1]
    assert curve_y is not None and abs(float(np.sum(curve_y)) - 1.0) < 1e-6


def test_replacing_the_workload_with_a_trace_and_back(qtbot, window, runner, tmp_path):
    import json as _json

    from engine.sequence import SeqState

    c = window.controls
    assert c.workload_label.text() == "workload: none"
    ps = prompts(11, [10, 14])
    path = tmp_path / "traffic.jsonl"
    path.write_text("".join(_json.dumps({"arrival_s": 0.1 * i, "session": f"user{i}", "prompt_tokens": p,
                                         "max_new_tokens": 300}) + "\n" for i, p in enumerate(ps)))
    bad = tmp_path / "broken.jsonl"
    bad.write_text("{oops\n")
    assert not c.replay_trace(str(bad))  # refused visibly; nothing replaced
    assert "refused" in c.message.text() and "broken.jsonl:1" in c.message.text()
    assert c.workload_label.text() == "workload: none"

    c.workload_path = lambda: str(path)  # what the file dialog would return
    c.replay.click()
    assert c.workload_label.text() == "workload: traffic.jsonl"
    qtbot.waitUntil(lambda: {s.label for s in runner.engine.seqs.values()} >= {"user0", "user1"}, timeout=10_000)
    trace_ids = [s.id for s in runner.engine.seqs.values() if s.label.startswith("user")]
    c.demo.click()  # back to the demo: the trace's running sequences are cancelled, the demo starts
    assert c.workload_label.text() == "workload: demo"
    qtbot.waitUntil(lambda: all(runner.engine.seqs[i].state == SeqState.FINISHED for i in trace_ids), timeout=10_000)
    assert {runner.engine.seqs[i].finish_reason for i in trace_ids} == {"cancelled"}
    qtbot.waitUntil(lambda: any(s.label.startswith(("chat", "long-chat")) for s in runner.engine.seqs.values()),
                    timeout=10_000)
    runner.pause_engine(True)
    qtbot.wait(300)  # the engine thread finishes its step
    with runner.engine.lock:
        runner.engine.check_invariants()


def test_a_config_change_is_marked_on_the_time_series(qtbot, window, runner):
    busy(runner)
    qtbot.waitUntil(lambda: runner.engine.counters.generated > 5, timeout=10_000)
    assert window.controls.apply("block_size", 8)
    qtbot.waitUntil(lambda: runner.engine.config.block_size == 8, timeout=10_000)
    window.refresh_all()
    for chart in (window.hit.rates, window.hit.flow, window.memory.plot):
        assert [label for _, kind, label in chart.marks if kind == "config"] == ["block_size=8"]
        ago = chart.marks[-1][0]
        assert -5.0 < ago <= 0.0


def test_cost_panel_compares_since_start_with_since_the_last_change(qtbot, llama_model):
    """Issue 10's cost signals in the window: a tiny device tier streams from the host tier (device hit < 100 %,
    streamed > 0); after a change the second column starts afresh ("—" until something is read) and names it."""
    from ui.panels.cost import CostPanel

    eng = Engine(llama_model, CacheConfig(block_size=4, device_budget_mb=0.02, host_budget_mb=1, host_reads="stream"))
    eng.generate(prompts(41, [30, 45]), SamplingParams(max_new_tokens=6, ignore_eos=True))
    panel = CostPanel()
    qtbot.addWidget(panel)
    panel.update_snapshot(eng.snapshot())
    hit, streamed = panel.values[0], panel.values[1]
    assert hit[0].text().endswith("%") and float(hit[0].text()[:-2]) < 100
    share, mb = streamed[0].text(), panel.values[2][0].text()  # "70.6 %" of the keys, then MiB copied to staging
    c = eng.counters
    assert float(share[:-2]) > 0 and hit[1].text() == hit[0].text()
    assert mb == f"{c.streamed_bytes / 2**20 / c.generated:.3f}" and c.streamed_bytes > 0
    assert "staging a layer ahead" in panel.values[2][0].toolTip()
    from ui.panels.charts import MemoryPanel

    mem = MemoryPanel()
    qtbot.addWidget(mem)
    mem.update_snapshot(eng.snapshot())
    want = eng.runner.stream.nbytes() / 2**20
    assert want > 0 and f"stream staging {want:.1f} MiB" in mem.text.text()
    assert "stream staging: the buffers" in mem.text.toolTip()
    assert "keys attention read" in hit[0].toolTip()
    eng.reconfigure(host_reads="promote")
    panel.update_snapshot(eng.snapshot())
    assert hit[1].text() == "—" and hit[0].text().endswith("%")
    assert "host_reads stream -> promote" in panel.changed.text()
    eng.generate(prompts(42, [20]), SamplingParams(max_new_tokens=3, ignore_eos=True))
    panel.update_snapshot(eng.snapshot())
    assert hit[1].text().endswith("%")


def test_cost_since_the_last_change_counts_from_the_change_while_its_tab_was_hidden(qtbot, window, runner):
    """Issue 22 item 1: Heat is the tab on top, so the Cost panel gets no snapshot while a change is made; when its
    tab is shown later, "since the last change" counts from the engine's counters at the change (kept with the
    config event) and names it. Before, its first snapshot became the baseline: both columns were the same and no
    change was named."""
    from ui.panels.cost import BASE, cells

    busy(runner)
    qtbot.waitUntil(lambda: runner.engine.counters.generated > 10, timeout=10_000)
    qtbot.wait(400)  # several refreshes, each of which skips the hidden tab
    assert window.cost.visibleRegion().isEmpty() and window.cost.values[0][0].text() == "—"
    assert window.controls.apply("block_size", 8)
    at = runner.engine.counters.generated
    qtbot.waitUntil(lambda: runner.engine.counters.generated > at + 30, timeout=20_000)
    window.docks["Cost"].raise_()
    qtbot.waitUntil(lambda: not window.cost.visibleRegion().isEmpty(), timeout=5000)
    window.refresh_all()
    snap = window.snapshot
    assert "block_size 4 -> 8" in window.cost.changed.text()
    kept = snap.last_change["counters"]
    assert 10 < kept["generated"] <= at + 1  # (a step may end between the count read here and the change)
    c = {k: float(snap.counters[k]) for k in BASE}
    start = [v[0].text() for v in window.cost.values]
    since = [v[1].text() for v in window.cost.values]
    assert start == [t for t in cells(c)][:7] + start[7:9] + cells(c)[9:]  # 7, 8: TTFT and waiting, not split
    want = cells({k: c[k] - kept[k] for k in BASE})
    assert since[:7] == want[:7] and since[9:] == want[9:]
    assert start != since


def _charts(win) -> dict:
    """Every strip chart's plotted arrays, marks, span and y range, by chart and series."""
    out = {}
    for name, chart in (("hit rate", win.hit.rates), ("kv format", win.hit.shadow), ("flow", win.hit.flow),
                        ("tiers", win.memory.plot), ("process", win.memory.proc)):
        for key, s in chart.series.items():
            out[f"{name}.{key}"] = (np.array(s.x, dtype=np.float64), np.array(s.y, dtype=np.float64))
        out[f"{name} marks"] = list(chart.marks)
        out[f"{name} span"] = chart.span
    return out


def test_a_reopened_snapshot_draws_the_charts_and_caption_it_was_saved_with(qtbot, window, runner, tmp_path):
    """Issue 22 item 3: `--open-snapshot` of a screenshot's JSON draws what the PNG shows: the same snapshot (the file
    held one taken after the picture), the rates' lines the window drew (rebuilt from the engine's series they
    were shifted and had gaps), the capture time in the caption (not the reopening's), read-only controls, the
    workload that ran."""
    import datetime
    import re

    from ui.main_window import open_snapshot_window

    busy(runner)
    qtbot.waitUntil(lambda: runner.engine.counters.generated > 10, timeout=10_000)
    assert window.controls.apply("block_size", 8)  # a mark on every chart
    qtbot.wait(2500)  # some history of the window's own rates
    window.docks["Cost"].raise_()  # its tab in front, as the file reopens
    qtbot.waitUntil(lambda: window.front_tabs() == ["Hit rate", "Memory", "Cost"], timeout=5000)
    before = datetime.datetime.now().replace(microsecond=0)
    json_path = window.save_screenshot(str(tmp_path / "shot.png"))
    live = _charts(window)  # what the PNG shows (no refresh ran since)
    caption = json.load(open(json_path))["extra"]["caption"]
    assert len(live["hit rate.device_hit_rate_w"][0]) > 10 and live["hit rate marks"]
    qtbot.wait(1100)  # a second later: a caption of the reopening's time would differ
    ro = open_snapshot_window(json_path)
    qtbot.addWidget(ro)
    ro.show()
    ro.refresh_all()
    again = _charts(ro)
    assert again.keys() == live.keys()
    for key, value in live.items():
        if isinstance(value, tuple):
            np.testing.assert_array_equal(again[key][0], value[0], err_msg=key)  # NaN (a gap) where the PNG has one
            np.testing.assert_array_equal(again[key][1], value[1], err_msg=key)
        else:
            assert again[key] == value, key
    assert ro.caption() == caption
    qtbot.waitUntil(lambda: ro.front_tabs() == ["Hit rate", "Memory", "Cost"], timeout=5000)
    assert ro.cost.changed.text().startswith("last change (#1, ") and "block_size 4 -> 8" in ro.cost.changed.text()
    stamp = datetime.datetime.strptime(re.search(r"— (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)$", caption).group(1),
                                       "%Y-%m-%d %H:%M:%S")
    assert before <= stamp < datetime.datetime.now() - datetime.timedelta(seconds=1)
    # Read-only, and it says so; the workload label names the saved workload, whole.
    assert all(not c.isEnabled() for c in ro.controls.controls.values())
    label = ro.controls.workload_label
    assert label.text() == f"workload: {runner.workload_name()} (saved)" == label.toolTip()
    assert label.fontMetrics().horizontalAdvance(label.text()) <= label.width()


def test_open_snapshot_of_a_png_opens_the_json_beside_it(qtbot, tmp_path):
    from engine.telemetry import snapshot_io
    from ui.main_window import snapshot_path

    png = tmp_path / "shot.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(snapshot_io.SnapshotFileError, match=r"shot.png: a screenshot, not a snapshot: open the .json "
                                                             r"saved beside it \(shot.json is not in"):
        snapshot_path(str(png))
    (tmp_path / "shot.json").write_text("{}")
    assert snapshot_path(str(png)) == str(tmp_path / "shot.json")
    assert snapshot_path(str(tmp_path / "other.json")) == str(tmp_path / "other.json")


def test_a_saved_snapshots_controls_look_disabled(qtbot, qapp, window, runner, tmp_path):
    """Issue 22 item 3: the app's style drew a disabled slider's handle in its bright live colour: a reopened
    snapshot's sliders looked as if they could be moved."""
    from PySide6 import QtGui

    from app.window.launch import _style
    from ui.main_window import open_snapshot_window

    busy(runner)
    qtbot.waitUntil(lambda: runner.engine.counters.generated > 3, timeout=10_000)
    json_path = window.save_screenshot(str(tmp_path / "shot.png"))
    old_sheet, old_palette, old_font = qapp.styleSheet(), qapp.palette(), qapp.font()
    _style(qapp)
    try:
        ro = open_snapshot_window(json_path)
        qtbot.addWidget(ro)
        ro.show()
        live_handle = QtGui.QColor("#4fc3f7").rgb() & 0xFFFFFF

        def handle_pixels(slider) -> int:
            img = slider.grab().toImage()
            return sum((img.pixel(x, y) & 0xFFFFFF) == live_handle for x in range(img.width()) for y in range(img.height()))

        assert handle_pixels(window.controls.controls["block_size"].slider) > 20  # the live window's: bright
        for name, c in ro.controls.controls.items():
            if c.slider is not None:
                assert not c.slider.isEnabled() and handle_pixels(c.slider) == 0, name
        assert "read-only" in ro.controls.message.text() and "read-only" in ro.windowTitle()
    finally:
        qapp.setStyleSheet(old_sheet)
        qapp.setPalette(old_palette)
        qapp.setFont(old_font)


def test_after_a_pause_the_rates_lines_end_at_now_beside_their_marks(qtbot, window, runner):
    """The window's rates were sampled on the wall clock and drawn against the engine's, which stands still while
    the engine is paused: after a pause of P seconds every line ended P seconds right of "now" (off the chart) and
    was shifted from the marks by P. They are drawn on the engine's clock, as everything else; the status bar still
    reads 0 tok/s after a pause longer than its window."""
    busy(runner)
    qtbot.waitUntil(lambda: runner.engine.counters.generated > 5, timeout=10_000)
    runner.pause_engine(True)
    qtbot.wait(6000)  # longer than the rates' 5 s window
    window.refresh_all()
    assert "| 0.0 tok/s |" in window.status.text() and "engine paused" in window.status.text()
    runner.pause_engine(False)
    assert window.controls.apply("block_size", 8)  # a mark at the engine's time of the change
    qtbot.waitUntil(lambda: runner.engine.config.block_size == 8, timeout=10_000)
    qtbot.wait(1500)
    window.refresh_all()
    chart = window.hit.rates
    x = chart.series["device_hit_rate"].x
    assert -0.5 < x[-1] <= 0.05, x[-1]  # the newest sample is now (it was +6 s)
    mark = [ago for ago, kind, _ in chart.marks if kind == "config"][-1]
    # The windowed rate's samples step at the refresh rate through the change's moment, not 3 s away from it.
    assert np.min(np.abs(x - mark)) < 0.5


def test_a_slow_reconfigure_leaves_the_window_responsive_and_busy(qtbot, window, runner, monkeypatch):
    """A block-size change to 1 froze the window ~3 s with the confirmation dialog still drawn: the engine's
    re-layout ran on the window's thread. It runs on a worker now; the window keeps painting (its refresh timer
    fires), the controls are disabled and a busy bar shows until the change is in."""
    from PySide6 import QtCore

    real = runner.reconfigure

    def slow(**changes):
        time.sleep(1.5)  # a re-layout of a full pool on a loaded CPU
        return real(**changes)

    monkeypatch.setattr(runner, "reconfigure", slow)
    ticks, seen = [], []
    timer = QtCore.QTimer(interval=50)
    timer.timeout.connect(lambda: (ticks.append(1), seen.append((window.controls.controls["block_size"].isEnabled(),
                                                                  window.controls.progress.isVisible(),
                                                                  window.controls.message.text()))))
    timer.start()
    frames = window.frames
    assert window.controls.apply("block_size", 8)
    timer.stop()
    assert len(ticks) >= 15 and window.frames - frames >= 10  # the event loop ran: timers, the window's refresh
    assert any(not enabled and bar and msg.startswith("applying block_size=8") for enabled, bar, msg in seen), seen[:3]
    assert runner.config().block_size == 8
    assert window.controls.controls["block_size"].isEnabled() and not window.controls.progress.isVisible()
    assert window.controls.message.text().startswith("applied block_size=8")


def test_the_value_boxes_step_arrows_show(qtbot, qapp, window):
    """At 1280x720 the spin boxes' arrows were invisible (drawn dark on the dark style): each box's step buttons
    carry a light arrow."""
    from PySide6 import QtGui

    from app.window.launch import _style

    saved = (qapp.styleSheet(), qapp.palette(), qapp.font())
    _style(qapp)
    try:
        for spin in (window.controls.controls["block_size"].spin, window.prompt.max_new):
            spin.setEnabled(True)
            img = spin.grab().toImage()
            w, h = img.width(), img.height()
            for y0, y1 in ((2, h // 2 - 1), (h // 2 + 1, h - 2)):  # the up button, then the down one
                light = max(QtGui.QColor(img.pixel(x, y)).lightness() for x in range(w - 13, w - 2)
                            for y in range(y0, y1))
                assert light > 150, (spin, y0, light)
    finally:
        qapp.setStyleSheet(saved[0])
        qapp.setPalette(saved[1])
        qapp.setFont(saved[2])


def test_memory_table_counts_the_blocks_the_map_counts_in_every_frame(qtbot, window, runner):
    """A screenshot shows both: the Memory panel's tier rows and the block map's tier labels come from the same
    snapshot in every frame, not only in the frames whose turn the Memory panel has (before, its text was re-rendered
    at most once a second, and the two disagreed while the engine ran)."""
    import re

    busy(runner)
    qtbot.waitUntil(lambda: runner.engine.counters.generated > 5, timeout=20_000)
    seen = set()
    for _ in range(40):
        qtbot.wait(40)
        window.refresh()
        labels = window.block_map.label_texts()
        table = window.memory.text.text()
        for name in ("device", "host"):
            used, cap = re.search(rf"{name}\s+([\d,]+) / ([\d,]+) blocks", " ".join(labels)).groups()
            row = re.search(rf"<b>{name}</b></td><td>([\d,]+)/([\d,]+)</td>", table).groups()
            assert row == (used, cap), (name, labels, row)
            seen.add((name, used))
    assert len(seen) > 2, seen  # the counts moved while the frames were drawn
