"""The time-series chart of the hit-rate and memory panels: scales, spans, gaps, hover, and what it paints."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from PySide6 import QtCore, QtGui

from ui.charts.strip_chart import StripChart, nice_ceiling


@given(st.floats(min_value=1e-6, max_value=1e12, allow_nan=False))
def test_nice_ceiling_is_the_next_round_value(v):
    c = nice_ceiling(v)
    assert c >= v * (1 - 1e-9)
    assert c <= v * 4 / 3 * (1 + 1e-9)  # neighbouring steps (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10) differ by ≤ 4/3
    mantissa = c / 10 ** math.floor(math.log10(c) + 1e-12)
    assert any(math.isclose(mantissa, m, rel_tol=1e-9) for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10))


def _chart(qtbot, **kw) -> StripChart:
    c = StripChart("test", "units", **kw)
    c.add_series("a", "series a", "#ff0000", width=2)
    c.add_series("b", "series b", "#00ff00")
    c.resize(500, 240)
    qtbot.addWidget(c)
    return c


def _paint(c: StripChart) -> QtGui.QImage:
    img = QtGui.QImage(c.size(), QtGui.QImage.Format_ARGB32)
    c.render(img)
    return img


def _count(img: QtGui.QImage, rgb: tuple[int, int, int], rect: QtCore.QRectF | None = None) -> int:
    """Pixels of exactly this colour, in `rect` (the plot area) or the whole image."""
    if rect is not None:
        img = img.copy(rect.toRect())
    ptr = img.constBits()
    a = np.frombuffer(ptr, np.uint8).reshape(img.height(), img.bytesPerLine())[:, : img.width() * 4]
    px = a.reshape(img.height(), img.width(), 4)  # BGRA
    return int(((px[..., 2] == rgb[0]) & (px[..., 1] == rgb[1]) & (px[..., 0] == rgb[2])).sum())


def test_y_range_grows_at_once_and_shrinks_only_far_below(qtbot):
    c = _chart(qtbot)
    x = np.linspace(-10, 0, 50)
    c.set_data(x, {"a": np.full(50, 90.0), "b": np.zeros(50)})
    assert c.top == 100.0  # 90 with headroom → 100
    c.set_data(x, {"a": np.full(50, 130.0), "b": np.zeros(50)})
    assert c.top == 150.0
    c.set_data(x, {"a": np.full(50, 60.0), "b": np.zeros(50)})
    assert c.top == 150.0  # not rebuilt for a small fall
    c.set_data(x, {"a": np.full(50, 20.0), "b": np.zeros(50)})
    assert c.top == 25.0
    old = np.concatenate(([-500.0], x))  # a sample older than the span does not set the range
    c.set_data(old, {"a": np.concatenate(([1e6], np.full(50, 20.0))), "b": np.zeros(51)})
    assert c.top == 25.0
    c.set_level("cap", 300.0, "#0000ff")  # a capacity line stays in range
    c.set_data(x, {"a": np.full(50, 20.0), "b": np.zeros(50)})
    assert c.top >= 300.0


def test_span_follows_the_history_up_to_the_maximum(qtbot):
    c = _chart(qtbot, span_s=120.0)
    for covered, span in ((5, 30), (29, 30), (45, 60), (100, 120), (400, 120)):
        x = np.linspace(-covered, 0, 100)
        c.set_data(x, {"a": np.ones(100), "b": np.ones(100)})
        assert c.span == span, covered


def test_lines_are_painted_and_nan_breaks_them(qtbot):
    c = _chart(qtbot)
    x = np.linspace(-20, 0, 200)
    a = np.full(200, 5.0)
    b = np.full(200, 2.0)
    c.set_data(x, {"a": a, "b": b})
    img = _paint(c)
    r = c._rect
    red, green = _count(img, (255, 0, 0), r), _count(img, (0, 255, 0), r)
    assert red > 0.8 * 2 * r.width() * 20 / 30  # a 2 px line across the 20 s of data in a 30 s span
    assert green > 0.8 * r.width() * 20 / 30
    b[50:150] = np.nan  # half the samples unreadable: that part of the line is not drawn
    c.set_data(x, {"a": a, "b": b})
    green_gap = _count(_paint(c), (0, 255, 0), r)
    assert green_gap < 0.6 * green
    c.set_data(x, {"a": np.full(200, np.nan), "b": b})  # nothing finite: no line, no error
    assert _count(_paint(c), (255, 0, 0), r) == 0


def test_hover_reads_the_nearest_sample(qtbot):
    c = _chart(qtbot)
    x = np.linspace(-30, 0, 301)
    c.set_data(x, {"a": -x, "b": np.zeros(301)})
    assert c.value_at("a", -12.04) == pytest.approx(12.0)
    assert c.value_at("a", 5.0) == pytest.approx(0.0)
    c.show()
    _paint(c)
    qtbot.mouseMove(c, QtCore.QPoint(int(c._rect.center().x()), int(c._rect.center().y())))
    before = _paint(c)
    assert c._hover_x is not None
    c.leaveEvent(None)
    after = _paint(c)
    assert before != after  # the cursor line and readout are drawn, then gone


def test_note_and_title_rebuild_the_frame(qtbot):
    c = _chart(qtbot)
    c.set_data(np.linspace(-5, 0, 10), {"a": np.ones(10), "b": np.ones(10)})
    plain = _paint(c)
    c.set_note("no GPU")
    assert _paint(c) != plain


def test_marks_are_drawn_where_they_happened_and_read_on_hover(qtbot):
    c = _chart(qtbot)
    x = np.linspace(-20, 0, 100)
    c.set_data(x, {"a": np.full(100, 1.0), "b": np.full(100, 1.0)})
    c.set_marks([(-10.0, "config", "block_size=32"), (-5.0, "context_shift", "context shift, seq 3"),
                 (-400.0, "config", "too old to show"), (-3.0, "unknown", "ignored")])
    assert [m[1] for m in c.marks] == ["config", "context_shift", "config"]
    img = _paint(c)
    r = c._rect
    x_cfg = int(round(r.left() + (-10.0 + c.span) / c.span * r.width()))
    column = img.copy(QtCore.QRect(x_cfg - 1, int(r.top()), 3, int(r.height())))
    assert _count(column, (0x4F, 0xC3, 0xF7)) > r.height() / 4  # a dashed line down the plot
    x_shift = r.left() + (-5.0 + c.span) / c.span * r.width()
    assert c.marks_near(x_cfg) == ["block_size=32"]
    assert c.marks_near(x_shift) == ["context shift, seq 3"]
    assert c.marks_near(r.left() + 2) == []  # the 400 s old mark is outside the span


def test_mark_labels_stay_readable_and_apart(qtbot):
    """Config changes close together (issue 11: their labels collided with each other and ran under other
    marks' lines and the curves): one label per few pixels, boxes that overlap no other, inside the plot,
    with no curve drawn through the text."""
    c = StripChart("Hit rate", "rate", span_s=120, y_range=(0.0, 1.0))
    c.add_series("a", "series a", "#ff0000", width=2)
    c.resize(330, 200)
    qtbot.addWidget(c)
    x = np.linspace(-25, 0, 250)
    c.set_data(x, {"a": np.full(250, 0.93)})  # a curve through the labels' rows
    c.set_marks([(-20.0, "config", "block_size=8"), (-19.95, "config", "kv_dtype=int8"),
                 (-19.0, "workload", "workload: demo"), (-18.5, "config", "policy=lru"),
                 (-10.0, "config", "block_size=16, kv_dtype=fp32, device_budget_mb=256"),
                 (-2.0, "config", "decay=0.5")])
    img = _paint(c)
    labels = c.mark_labels()
    texts = [t for _, t, _ in labels]
    assert "block_size=8; kv_dtype=int8" in texts  # marks a pixel apart share one label
    assert len(labels) >= 4
    r = c._rect
    for i, (box, _, _) in enumerate(labels):
        assert r.contains(box)
        assert not any(box.intersects(other) for other, _, _ in labels[i + 1:])
        assert _count(img, (255, 0, 0), box) == 0  # the curve passes behind the label, not through it


def test_the_unit_text_clears_the_legend(qtbot):
    """A narrow chart whose legend fills its last row (issue 11: "demotions" ran into "blocks / s")."""
    c = StripChart("Evictions and migrations", "blocks / s", span_s=120)
    for key, label in (("e", "evictions"), ("p", "promotions"), ("d", "demotions")):
        c.add_series(key, label, "#ff0000", tip=f"{label}: what is counted")
    qtbot.addWidget(c)
    for width in (240, 300, 330, 420, 600):
        c.resize(width, 160)
        unit = c.unit_rect()
        assert unit.left() >= 0 and unit.right() <= width
        assert not any(unit.intersects(e) for e in c.legend_rects()), width
        assert unit.bottom() <= c._plot_rect().top()
    # A legend entry's tooltip says what its series counts.
    entry = c.legend_rects()[2]
    assert c.legend_tip(entry.center()) == "demotions: demotions: what is counted"
    assert c.legend_tip(QtCore.QPointF(2, 150)) == ""


def test_the_newest_changes_keep_their_labels_when_many_pile_up(qtbot):
    """Seven changes a few seconds apart on a chart ~260 px wide: the labels filled the rows oldest first, so
    the newest (the one a user just made) was shortened to '…' or left out. The newest are placed first."""
    c = StripChart("Hit rate", "rate", span_s=60, y_range=(0.0, 1.0))
    c.resize(260, 200)
    qtbot.addWidget(c)
    c.set_data(np.linspace(-60, 0, 100), {})
    names = ["block_size=8", "kv_dtype=int8", "policy=lru", "decay=0.5", "block_size=16", "kv_dtype=fp32",
             "device_budget_mb=32"]
    c.set_marks([(-30.0 + 4 * i, "config", n) for i, n in enumerate(names)])
    _paint(c)
    texts = [t for _, t, _ in c.mark_labels()]
    assert "device_budget_mb=32" in texts and "kv_dtype=fp32" in texts, texts
