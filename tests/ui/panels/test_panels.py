"""The window's panels one at a time, on made-up snapshots (no engine): sliders, the sequences table, the
event feed, the rate charts, the heat plot. Each test is a defect a user met (issue 11)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from PySide6 import QtCore, QtGui, QtWidgets
from PySide6.QtTest import QTest

from engine.config import KNOBS
from engine.telemetry.snapshot import SeqTable


# -- sliders ------------------------------------------------------------------------------------------


def _knob(qtbot, name: str, value, width: int = 230):
    """A knob control as wide as in the Controls dock (its label takes the rest), showing `value`."""
    from ui.panels.knob import KnobControl

    c = KnobControl(KNOBS[name])
    qtbot.addWidget(c)
    c.resize(width, 26)
    c.show()
    qtbot.waitExposed(c)
    c.show_value(value)
    return c


def _drag(slider: QtWidgets.QSlider, dx: int) -> None:
    """Press on the slider's handle, move dx pixels, release: what a user's hand does."""
    opt = QtWidgets.QStyleOptionSlider()
    slider.initStyleOption(opt)
    handle = slider.style().subControlRect(QtWidgets.QStyle.CC_Slider, opt, QtWidgets.QStyle.SC_SliderHandle, slider)
    start = handle.center()
    QTest.mousePress(slider, QtCore.Qt.LeftButton, QtCore.Qt.NoModifier, start)
    for i in range(1, abs(dx) + 1):
        QTest.mouseMove(slider, start + QtCore.QPoint(i if dx > 0 else -i, 0))
    QTest.mouseRelease(slider, QtCore.Qt.LeftButton, QtCore.Qt.NoModifier, start + QtCore.QPoint(dx, 0))


def test_a_small_drag_moves_the_block_size_one_power_of_two_at_most(qtbot, app_style):
    c = _knob(qtbot, "block_size", 16)
    got = []
    c.changed.connect(lambda name, v: got.append(v))
    _drag(c.slider, 5)  # guards against: 16 -> 41
    assert got in ([], [32]), got
    assert c.spin.value() in (16, 32)
    c.show_value(16)
    _drag(c.slider, 40)
    assert got[-1] in (32, 64, 128, 256, 512, 1024) and got[-1] & (got[-1] - 1) == 0, got


def test_a_budget_drag_moves_along_a_log_scale_of_round_sizes(qtbot, app_style):
    c = _knob(qtbot, "device_budget_mb", 4.0)
    got = []
    c.changed.connect(lambda name, v: got.append(v))
    _drag(c.slider, 19)  # guards against: 4 -> 328 MB
    assert len(got) == 1 and got[0] > 4 and math.log2(got[0]).is_integer(), got  # a round size, in MB
    # At the dock's width a stop is at least 5 px, so 19 px is at most 4 doublings.
    opt = QtWidgets.QStyleOptionSlider()
    c.slider.initStyleOption(opt)
    handle = c.slider.style().subControlRect(QtWidgets.QStyle.CC_Slider, opt, QtWidgets.QStyle.SC_SliderHandle,
                                             c.slider)
    per_stop = (c.slider.width() - handle.width()) / (len(c.stops) - 1)
    assert per_stop >= 5 and math.log2(got[0] / 4) <= math.ceil(19 / per_stop), (per_stop, got)
    # The wheel moves one doubling a notch.
    c.show_value(got[0])
    event = QtGui.QWheelEvent(QtCore.QPointF(5, 5), QtCore.QPointF(5, 5), QtCore.QPoint(0, 0), QtCore.QPoint(0, 120),
                              QtCore.Qt.NoButton, QtCore.Qt.NoModifier, QtCore.Qt.NoScrollPhase, False)
    QtWidgets.QApplication.sendEvent(c.slider, event)
    assert c.spin.value() == 2 * got[0]


def test_arrow_keys_step_one_stop_and_a_typed_value_is_kept(qtbot, app_style):
    c = _knob(qtbot, "block_size", 16)
    c.slider.setFocus()
    with qtbot.waitSignal(c.changed, timeout=3000) as sig:
        QTest.keyClick(c.slider, QtCore.Qt.Key_Right)
    assert sig.args == ["block_size", 32]
    c.show_value(32)
    with qtbot.waitSignal(c.changed, timeout=3000) as sig:
        QTest.keyClick(c.slider, QtCore.Qt.Key_PageDown)  # Page Down/Up: two stops
    assert sig.args == ["block_size", 8]
    # Any value in range can be typed; the slider shows the nearest stop without emitting.
    with qtbot.waitSignal(c.changed, timeout=3000) as sig:
        c.spin.setValue(5)
    assert sig.args == ["block_size", 5]
    c.show_value(5)
    assert c.stops[c.slider.value()] == 4 and c.spin.value() == 5
    # Every stop is inside the knob's range, for every slider.
    from ui.panels.knob import slider_stops

    for knob in KNOBS.values():
        if not knob.choices:
            stops = slider_stops(knob)
            assert len(stops) >= 8 and list(stops) == sorted(set(stops))
            assert all(knob.lo <= v <= knob.hi for v in stops)


# -- sequences table ----------------------------------------------------------------------------------


def _seqs(ids, states=None) -> SimpleNamespace:
    n = len(ids)
    states = states if states is not None else [1] * n
    i32 = lambda v: np.asarray(v, np.int32)  # noqa: E731
    table = SeqTable(id=i32(ids), state=np.asarray(states, np.int8), tokens=i32([350] * n), generated=i32([12] * n),
                     blocks_device=i32([22] * n), blocks_host=i32([3] * n), tokens_per_s=np.full(n, 9.5, np.float32),
                     ttft=np.full(n, 0.25, np.float32), prefix_reused=i32([128] * n),
                     labels=tuple(f"chat-{i}" for i in ids), block_tier=(), block_slot=())
    return SimpleNamespace(seqs=table)


@pytest.fixture
def seq_table(qtbot, app_style):
    from ui.panels.lists import SequencesPanel

    t = SequencesPanel()
    qtbot.addWidget(t)
    t.resize(520, 200)  # about the Sequences dock's width at 1280 x 720
    # The pointer elsewhere (an earlier test's click may leave Qt's cursor where this table now is, and rows
    # under the pointer keep their places): each test that wants it there says so.
    QtGui.QCursor.setPos(QtCore.QPoint(5000, 5000))
    t.show()
    qtbot.waitExposed(t)
    QtWidgets.QApplication.sendEvent(t.viewport(), QtCore.QEvent(QtCore.QEvent.Leave))
    return t


def test_a_selected_row_does_not_pull_the_scroll_back(seq_table):
    ids = list(range(100, 180))
    seq_table.update_snapshot(_seqs(ids))
    seq_table.select_id(170)  # newest first: row 9
    bar = seq_table.verticalScrollBar()
    bar.setValue(bar.maximum())  # the user scrolls away to read the oldest rows
    for _ in range(3):  # three refreshes, a second of the window's time: new sequences arrive on top
        ids.append(ids[-1] + 1)
        seq_table.update_snapshot(_seqs(ids))
        assert bar.value() == bar.maximum()
    assert [r.row() for r in seq_table.selectionModel().selectedRows()] == [ids[::-1].index(170)]


def test_the_highlight_leaves_with_the_selected_sequence(seq_table):
    seq_table.update_snapshot(_seqs([100, 101, 102, 103]))
    seq_table.select_id(102)
    assert seq_table._ids[seq_table.selectionModel().selectedRows()[0].row()] == 102
    seq_table.update_snapshot(_seqs([100, 101, 103, 104]))  # 102 is gone from the list
    assert seq_table.selectionModel().selectedRows() == []
    seq_table.update_snapshot(_seqs([99, 100, 101, 102, 103, 104]))  # back, at another row
    rows = seq_table.selectionModel().selectedRows()
    assert [seq_table._ids[r.row()] for r in rows] == [102]


def test_ids_values_and_headers_fit_their_columns(seq_table):
    ids = [9, 99, 999, 12345]
    seq_table.update_snapshot(_seqs(ids, states=[3, 1, 2, 4]))
    header = seq_table.horizontalHeader()
    head_fm = header.fontMetrics()
    cell_fm = QtGui.QFontMetrics(seq_table.font())
    for c, name in enumerate(seq_table.COLS):
        width = header.sectionSize(c)
        assert head_fm.horizontalAdvance(name) + 8 <= width, (name, width)  # the header's 4 px padding a side
        widest = max(cell_fm.horizontalAdvance(row[c]) for row in seq_table._rows)
        inset = 2 * seq_table.PAD + (seq_table.SWATCH if c == 0 else 0)
        assert widest + inset <= width, (name, widest, width)
    # Live rows' values are drawn in the text colour (finished ones dimmed), every cell of every row.
    vp = seq_table.viewport()
    img = QtGui.QImage(vp.size(), QtGui.QImage.Format_ARGB32)
    vp.render(img)
    h = seq_table.verticalHeader().defaultSectionSize()
    for r in range(2):  # the preempted and running rows
        for c in (1, 3, 9):
            x0, w = header.sectionViewportPosition(c), header.sectionSize(c)
            y0 = seq_table.rowViewportPosition(r)
            brightest = max(QtGui.QColor(img.pixel(x, y)).lightness() for x in range(x0, x0 + w)
                            for y in range(y0, y0 + h))
            assert brightest > 160, (r, seq_table.COLS[c], brightest)


# -- events -------------------------------------------------------------------------------------------


def test_events_show_byte_counts_in_binary_units_and_config_lists_refusals(qtbot):
    from engine.telemetry.snapshotter import Event
    from ui.panels.lists import EventsPanel

    p = EventsPanel()
    qtbot.addWidget(p)
    p.add([Event(1.0, "demote", {"n": 8, "reason": "evict", "nbytes": 5898240}),
           Event(2.0, "promote", {"n": 1, "nbytes": 737280}),
           Event(3.0, "config_error", {"changes": {"device_budget_mb": "0.01"}, "message": "too small"})])
    lines = [p.list.item(i).text() for i in range(p.list.count())]
    assert any("nbytes=5.6 MiB" in line for line in lines) and any("nbytes=720.0 KiB" in line for line in lines)
    assert not any("5898240" in line for line in lines)
    p.kind.setCurrentText("config")  # a refused change is what happened to a config change
    assert [p.list.item(i).text().split()[1] for i in range(p.list.count())] == ["config_error"]


# -- charts -------------------------------------------------------------------------------------------


def _series_snapshot(t: np.ndarray, **cols) -> SimpleNamespace:
    series = {"t": t} | {k: np.asarray(v, np.float64) for k, v in cols.items()}
    return SimpleNamespace(t=float(t[-1]), series=series, marks=())


def test_rates_after_an_idle_gap_are_a_gap_not_a_zero(qtbot):
    """The engine's series after 20 s of idling: the first sample after the gap is exactly 0 (its window
    emptied) and the line would ramp across the gap. The chart shows no data there instead."""
    from ui.panels.charts import HitRatePanel

    t = np.concatenate((np.arange(0, 5, 0.1), np.arange(25, 30, 0.1)))
    n, first_after = len(t), 50
    ones = np.full(n, 0.9)
    rate = ones.copy()
    rate[first_after] = 0.0
    flow = np.full(n, 12.0)
    flow[first_after] = 0.0
    snap = _series_snapshot(t, device_hit_rate_w=rate, prefix_hit_rate_w=rate, device_hit_rate=ones,
                            prefix_hit_rate=ones, evictions_per_s=flow, promotions_per_s=flow, demotions_per_s=flow,
                            tokens_per_s=flow)
    panel = HitRatePanel()
    qtbot.addWidget(panel)
    panel.update_snapshot(snap)
    for chart, key in ((panel.rates, "device_hit_rate_w"), (panel.flow, "evictions_per_s")):
        y = chart.series[key].y
        assert not np.any(y == 0.0), key  # no invented zeros
        assert np.isnan(y[first_after]), key  # the line breaks at the gap: no ramp
        assert np.all(np.isfinite(y[:first_after])) and np.all(np.isfinite(y[first_after + 1:]))


def test_the_heat_key_covers_no_bars(qtbot):
    from ui.panels.charts import HeatPanel

    p = HeatPanel()
    qtbot.addWidget(p)
    p.resize(320, 300)
    p.show()
    qtbot.waitExposed(p)
    vb = p.plot.getPlotItem().getViewBox()
    # Nothing but the bars inside the plot's view: the series' names are in a line above it.
    assert p.plot.getPlotItem().legend is None
    assert all(isinstance(item, type(p.bars["device"])) for item in vb.addedItems)
    assert "device" in p.key.text() and "host" in p.key.text()
    assert not p.key.geometry().intersects(p.plot.geometry())


@pytest.mark.parametrize("name, zero, other", [("device_layers", "all layers", "4 layers"),
                                               ("shadow_every_s", "off", "2.00 s")])
def test_a_zero_that_means_something_says_so(qtbot, app_style, name, zero, other):
    """device_layers 0 keeps every layer on the device and shadow_every_s 0 turns shadow steps off: the box says
    that, not "0 layers" / "0.00 s"."""
    c = _knob(qtbot, name, 0)
    assert c.spin.text() == zero
    c.show_value(4 if name == "device_layers" else 2.0)
    assert c.spin.text() == other


@pytest.mark.parametrize("unit", ["MB", "MiB"])
def test_a_budget_says_what_it_counts_mib_whether_the_knob_says_mb_or_mib(qtbot, app_style, unit):
    """A "48 MB" budget held 50.1 million bytes: it counts MiB, and the box, the tooltip and the status line say
    so (engine.config's unit for it goes from "MB" to "MiB"; either is shown as MiB, on the same log scale)."""
    import dataclasses

    from ui.panels.knob import KnobControl, slider_stops

    knob = dataclasses.replace(KNOBS["device_budget_mb"], unit=unit)
    c = KnobControl(knob)
    qtbot.addWidget(c)
    c.show_value(48.0)
    assert c.spin.suffix() == " MiB" and c.spin.text().endswith(" MiB")
    assert "MiB" in c.slider.toolTip() and " MB" not in c.slider.toolTip()
    assert slider_stops(knob)[:3] == (0.0, 1.0, 2.0) and slider_stops(knob)[-1] == 2.0**17


def _row_of(table, sid: int) -> int:
    return table._ids.index(sid)


def _click_row(table, row: int) -> None:
    y = table.rowViewportPosition(row) + table.verticalHeader().defaultSectionSize() // 2
    QTest.mouseClick(table.viewport(), QtCore.Qt.LeftButton, QtCore.Qt.NoModifier, QtCore.QPoint(60, y))


def _enter(table, inside: bool) -> None:
    vp = table.viewport()
    if inside:
        pos = QtCore.QPointF(60, 10)
        QtWidgets.QApplication.sendEvent(vp, QtGui.QEnterEvent(pos, pos, QtCore.QPointF(vp.mapToGlobal(pos.toPoint()))))
    else:
        QtWidgets.QApplication.sendEvent(vp, QtCore.QEvent(QtCore.QEvent.Leave))


def test_rows_under_the_pointer_stay_put_when_a_new_sequence_arrives(seq_table):
    """A click aimed at chat-17 selected chat-18: the newest sequence, inserted on top between the aim and the
    click, had moved every row down. Under the pointer the rows keep their places (new ones join at the bottom);
    once it leaves, newest first again."""
    ids = list(range(10, 20))
    seq_table.update_snapshot(_seqs(ids))
    row = _row_of(seq_table, 17)  # where the user aims
    _enter(seq_table, True)
    seq_table.update_snapshot(_seqs(ids + [20]))  # chat-20 arrives before the click
    _click_row(seq_table, row)
    assert seq_table.selected_id == 17
    assert seq_table._ids[-1] == 20 and seq_table._rows[row][1] == "chat-17"
    _enter(seq_table, False)
    seq_table.update_snapshot(_seqs(ids + [20]))
    assert seq_table._ids[0] == 20  # newest first once the pointer has left
    assert seq_table._ids[seq_table.selectionModel().selectedRows()[0].row()] == 17  # the selection follows the id


def test_while_the_engine_is_paused_no_sequence_shows_running_or_a_rate(seq_table):
    seq_table.update_snapshot(_seqs([1, 2, 3, 4], states=[1, 0, 2, 4]))
    states = {int(r[0]): (r[2], r[7]) for r in seq_table._rows}
    assert states[1] == ("running", "9.5")
    seq_table.update_snapshot(_seqs([1, 2, 3, 4], states=[1, 0, 2, 4]), engine_paused=True)
    states = {int(r[0]): (r[2], r[7]) for r in seq_table._rows}
    assert states[1] == ("paused", "0.0") and states[2] == ("waiting", "0.0") and states[3] == ("paused", "0.0")
    assert states[4] == ("finished", "9.5")  # a finished one keeps the rate it had
    seq_table.update_snapshot(_seqs([1, 2, 3, 4], states=[1, 0, 2, 4]))
    assert {int(r[0]): r[2] for r in seq_table._rows}[1] == "running"


def test_a_typed_prompt_says_it_is_queued_until_its_first_token(qtbot, app_style):
    """A prompt waiting 25 s for its first token gave no sign it was queued."""
    from ui.panels.prompt import PromptPanel

    p = PromptPanel()
    qtbot.addWidget(p)
    p.show()
    def table(ids, states):
        return SimpleNamespace(id=np.asarray(ids, np.int32), state=np.asarray(states, np.int8))

    p.started(12, "hello")
    p.update_snapshot(table([9, 10, 11, 12, 13], [1, 3, 0, 0, 0]))  # 10 preempted, 11 ahead of us, 13 behind
    assert p.queue.isVisible() and p.queue.text() == "queued (position 3 of 4 waiting)"
    p.update_snapshot(table([9, 10, 11, 12, 13], [1, 3, 0, 0, 0]), engine_paused=True)
    assert p.queue.text().endswith("the engine is paused")
    p.update_snapshot(table([9, 10, 11, 12, 13], [1, 1, 1, 1, 0]))
    assert p.queue.text() == "prefill…"
    p.stream([(12, "Hi")])
    assert not p.queue.isVisible()
    p.update_snapshot(table([12], [1]))
    assert not p.queue.isVisible()  # answered: nothing more to say


@pytest.mark.parametrize("name, one, two", [("block_size", "1 token", "2 tokens"),
                                            ("prefetch_depth", "1 block", "2 blocks"),
                                            ("demote_after_s", "1.00 s", "2.00 s")])
def test_a_value_of_one_reads_in_the_singular(qtbot, app_style, name, one, two):
    """The block size box read '1 tokens' (seen under Xvfb after a change to block size 1)."""
    c = _knob(qtbot, name, 1)
    assert c.spin.text() == one
    c.show_value(2)
    assert c.spin.text() == two
    c.spin.setValue(1)  # typed: the same
    assert c.spin.text() == one


@pytest.mark.parametrize("kv_dtype, per_value", [("fp32", 4.0), ("bf16", 2.0)])
def test_the_sizing_formula_counts_each_groups_layers_and_tokens_kept(tiny_gemma3, tiny_llama, kv_dtype, per_value):
    """Gemma 3 (layers S S F S S, window 24): B was the first pool's block bytes over every layer (0.8 B for fp32,
    one layer of five), and every layer counted the whole context. Now B is the format's, and each group counts its
    own layers and the tokens it keeps."""
    from engine.config import CacheConfig
    from engine.model.loader import load_model
    from engine.runtime.engine import Engine
    from ui.panels.charts import sizing_text

    bs = 4
    snap = Engine(load_model(tiny_gemma3), CacheConfig(block_size=bs, kv_dtype=kv_dtype)).snapshot()
    ctx = snap.model["context_limit"]
    (full, window) = snap.kv_groups
    assert len(full["layers"]) == 1 and len(window["layers"]) == 4 and window["window"] == 24
    total = 8 * (1 * ctx + 4 * min(ctx, 24 + bs)) * snap.model["kv_heads"] * snap.model["head_dim"] * 2 * per_value
    text = sizing_text(snap)
    assert f"8 × (1 × {ctx} + 4 × {24 + bs}) × " in text and f" × 2 × {per_value:.3g} B = " in text
    assert text.endswith(f"= {total / 2**20:,.0f} MiB")
    one = Engine(load_model(tiny_llama), CacheConfig(block_size=bs, kv_dtype=kv_dtype)).snapshot()
    assert f"8 × {one.model['context_limit']} × {one.model['layers']} × " in sizing_text(one)
    assert f" × 2 × {per_value:.3g} B = " in sizing_text(one)
