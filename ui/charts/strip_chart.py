"""A scrolling time-series chart painted with QPainter, for the panels that redraw several times a second.

pyqtgraph's PlotWidget re-lays out its axes, legend and title text on every data change; with four such plots
on screen that was a third of a full window refresh. Here the frame (axes, ticks, labels, legend) is drawn
once into a cached pixmap, rebuilt only when the size, the y range or the title changes, and a refresh draws
just the polylines over it. The x axis is "seconds ago" over a span that changes only as history grows
(30, 60, 120 s); the y range snaps to round values with hysteresis, so it moves rarely.

Marks (config changes, workload switches: labelled dashed lines; context shifts, preemptions: ticks at the
bottom) put causes next to their effects. A prediction (set_prediction: what the What-if tab predicted for an
applied change) is a line at the change, short dashed levels from it on and a label at the bottom of the plot, so
the eye compares the predicted levels with the measured lines. Hovering shows a cursor line, every series' value at
that time and the marks under the cursor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PySide6 import QtCore, QtGui, QtWidgets
from pyqtgraph.functions import create_qpolygonf, ndarray_from_qpolygonf

from ui.charts import mark_labels
from ui.charts.scale import nice_ceiling, tick_label, tick_step  # noqa: F401  (nice_ceiling: for tests)

BG = QtGui.QColor("#15181d")
AXIS = QtGui.QColor("#5c626b")
TICK_TEXT = QtGui.QColor("#aab0b8")
TITLE = QtGui.QColor("#c8ccd4")
CURSOR = QtGui.QColor(200, 204, 212, 140)
# Marks on the time axis, by kind: colour, and whether it is a labelled full-height line (a change the user
# or the workload made) or a short tick at the bottom (something the engine did).
MARK_STYLE = {"config": ("#4fc3f7", True), "workload": ("#aab0b8", True), "context_shift": ("#ffd54f", False),
              "preempt": ("#ff8a65", False), "throughput_drop": ("#ef5350", True)}


@dataclass
class _Prediction:
    ago: float  # seconds before now of the change it is for
    levels: list  # (value, colour): the predicted levels
    parts: list  # (text, colour) runs of the label
    short: list  # the same, shorter, where the label does not fit
    tip: str


PREDICTION_LINE = QtGui.QColor(224, 224, 224, 170)


@dataclass
class _Series:
    key: str
    label: str
    pen: QtGui.QPen
    x: np.ndarray
    y: np.ndarray
    tip: str = ""
    dots: bool = False  # sparse samples (NaN between them): a dot each, no line


class StripChart(QtWidgets.QWidget):
    """Series over the recent past (x = seconds ago, 0 at the right edge): the span grows through 30, 60,
    120 ... seconds as history accumulates, up to `span_s`.

    y_range: a fixed (low, high) with its tick values, or None to follow the data (low is 0). tick_format and
    value_format (y -> text) replace the default labels of the ticks and of the hover (a log axis plots log10 y).
    """

    SPANS = (30.0, 60.0, 120.0, 300.0, 600.0)

    def __init__(self, title: str, unit: str, span_s: float = 120.0,
                 y_range: tuple[float, float] | None = None, y_ticks: tuple[float, ...] | None = None,
                 tick_format=None, value_format=None):
        super().__init__()
        self.setAttribute(QtCore.Qt.WA_OpaquePaintEvent)  # the frame pixmap covers every pixel
        self.setMouseTracking(True)
        self.setMinimumSize(200, 80)
        self.title, self.note, self.unit = title, "", unit
        self.max_span = float(span_s)
        self.span = min(self.SPANS[0], self.max_span)
        self.fixed = y_range
        self.fixed_ticks = y_ticks
        self.tick_format, self.value_format = tick_format, value_format
        self.top = y_range[1] if y_range else 1.0
        self.series: dict[str, _Series] = {}
        self.levels: dict[str, tuple[float, QtGui.QPen]] = {}  # horizontal lines (capacities)
        self.marks: list[tuple[float, str, str]] = []  # (seconds ago, kind, label)
        self._mark_pens = {}
        for kind, (colour, full) in MARK_STYLE.items():
            pen = QtGui.QPen(QtGui.QColor(colour), 1, QtCore.Qt.DashLine if full else QtCore.Qt.SolidLine)
            pen.setCosmetic(True)
            self._mark_pens[kind] = pen
        self.prediction: _Prediction | None = None
        self._frame: QtGui.QPixmap | None = None
        self._frame_key = None
        self._rect = QtCore.QRectF()
        self._hover_x: float | None = None
        self._font = QtGui.QFont(self.font())
        self._font.setPointSize(7)
        self._title_font = QtGui.QFont(self.font())
        self._title_font.setPointSize(8)
        self._title_font.setBold(True)
        fm = QtGui.QFontMetrics(self._font)
        self._line_h = fm.height()
        self._poly = create_qpolygonf(0)

    def sizeHint(self) -> QtCore.QSize:
        return QtCore.QSize(520, 200)

    # -- data -----------------------------------------------------------------------------------
    def add_series(self, key: str, label: str, colour: str, width: float = 1.0, dashed: bool = False,
                   tip: str = "", dots: bool = False) -> None:
        """tip: what the series counts, shown as the tooltip of its legend entry; dots: a dot per sample, no line
        (samples far apart, NaN between them)."""
        pen = QtGui.QPen(QtGui.QColor(colour), width)
        pen.setCosmetic(True)
        if dashed:
            pen.setStyle(QtCore.Qt.DashLine)
        self.series[key] = _Series(key, label, pen, np.zeros(0), np.zeros(0), tip, dots)
        self._frame = None

    def set_level(self, key: str, value: float, colour: str) -> None:
        """A dotted horizontal line (a capacity), kept inside the y range."""
        old = self.levels.get(key)
        if old is not None and old[0] == value:
            return
        pen = QtGui.QPen(QtGui.QColor(colour), 1, QtCore.Qt.DotLine)
        self.levels[key] = (float(value), pen)
        self.update()

    def set_marks(self, marks: list[tuple[float, str, str]]) -> None:
        """(seconds ago, kind, label) moments to mark; kinds as in MARK_STYLE, others are ignored."""
        marks = [m for m in marks if m[1] in MARK_STYLE]
        if marks != self.marks:
            self.marks = marks
            self.update()

    def set_prediction(self, ago: float | None, levels=(), parts=(), short=(), tip: str = "") -> None:
        """A prediction made for a change `ago` seconds before now (None: no prediction): a line there, each
        (value, colour) of `levels` as a short dashed line from it to now, and a label of (text, colour) `parts`
        (`short` where those do not fit) whose tooltip is `tip`."""
        new = None if ago is None else _Prediction(float(ago), list(levels), list(parts), list(short or parts), tip)
        if new != self.prediction:
            self.prediction = new
            self.update()

    def heading(self) -> tuple[str, str]:
        """The title and the note as drawn: cut with "…" to the chart's width (at 1280 x 720 "KV format vs
        lossless (shadow steps)" ran past its chart's edge); the note only where some of it fits."""
        fm = QtGui.QFontMetrics(self._title_font)
        room = self.width() - 12
        title = fm.elidedText(self.title, QtCore.Qt.ElideRight, room)
        left = room - fm.horizontalAdvance(title + "  ")
        note = fm.elidedText(self.note, QtCore.Qt.ElideRight, left) if self.note and left > 40 else ""
        return title, note if note != "…" else ""

    def set_note(self, note: str) -> None:
        """A short red remark after the title ("no GPU")."""
        if note != self.note:
            self.note = note
            self._frame = None
            self.update()

    def set_data(self, x_ago: np.ndarray, ys: dict[str, np.ndarray]) -> None:
        """x_ago: seconds before now (≤ 0); ys: per series key, same length as x_ago. NaN breaks a line."""
        for key, y in ys.items():
            s = self.series.get(key)
            if s is not None and len(y) == len(x_ago):
                s.x, s.y = x_ago, y
        covered = -float(x_ago[0]) if len(x_ago) else 0.0
        self.span = next((sp for sp in self.SPANS if covered <= sp <= self.max_span), self.max_span)
        if self.fixed is None:
            shown = [s.y[s.x >= -self.span] for s in self.series.values()]  # what is older is clipped away
            peak = max((float(np.nanmax(y)) for y in shown if len(y) and np.isfinite(y).any()), default=0.0)
            peak = max([peak] + [v for v, _ in self.levels.values()])
            want = nice_ceiling(peak * 1.08)  # a little headroom above the peak
            # Grow at once, shrink only when the data fell well below: the frame is rebuilt rarely.
            if want > self.top or want < self.top / 4:
                self.top = want
        self.update()

    def value_at(self, key: str, ago: float) -> float:
        """The series' value at `ago` seconds before now (the nearest sample; for dots the nearest one within
        span/40 that has a value), NaN when there is none."""
        s = self.series[key]
        if not len(s.x):
            return float("nan")
        if s.dots:
            near = np.flatnonzero(np.isfinite(s.y) & (np.abs(s.x - ago) <= self.span / 40))
            return float(s.y[near[np.argmin(np.abs(s.x[near] - ago))]]) if len(near) else float("nan")
        i = int(np.clip(np.searchsorted(s.x, ago), 0, len(s.x) - 1))
        if i > 0 and abs(s.x[i - 1] - ago) < abs(s.x[i] - ago):
            i -= 1
        return float(s.y[i])

    # -- geometry -------------------------------------------------------------------------------
    def _plot_rect(self) -> QtCore.QRectF:
        fm = QtGui.QFontMetrics(self._font)
        widest = max((self._tick_text(v) for v in self._ticks()), key=fm.horizontalAdvance)
        left = fm.horizontalAdvance(widest + "0") + 8
        top = self._line_h * (1 + self._legend_rows()) + 6
        bottom = self._line_h + 6
        return QtCore.QRectF(left, top, max(10.0, self.width() - left - 8), max(10.0, self.height() - top - bottom))

    def _legend_layout(self) -> list[tuple[_Series, float, int]]:
        """(series, x, row) for each legend entry, wrapped into rows under the title."""
        fm = QtGui.QFontMetrics(self._font)
        out, x, row = [], 8.0, 1
        for s in self.series.values():
            w = fm.horizontalAdvance(s.label) + 30
            if x + w > self.width() - 8 and x > 8:
                x, row = 8.0, row + 1
            out.append((s, x, row))
            x += w
        return out

    def _unit_row(self) -> int:
        """The legend row whose right end holds the unit text: the last, or a row of its own below it when
        the last row's entries would reach into it."""
        fm = QtGui.QFontMetrics(self._font)
        layout = self._legend_layout()
        if not layout:
            return 1
        s, x, row = layout[-1]
        end = x + fm.horizontalAdvance(s.label) + 22
        return row if end + 12 + fm.horizontalAdvance(self._unit_text()) <= self.width() - 8 else row + 1

    def _unit_text(self) -> str:
        return f"{self.unit}  ·  seconds ago"

    def unit_rect(self) -> QtCore.QRectF:
        """Where the unit text is drawn."""
        fm = QtGui.QFontMetrics(self._font)
        w = fm.horizontalAdvance(self._unit_text())
        return QtCore.QRectF(self.width() - 8 - w, self._line_h * self._unit_row() + 2, w, self._line_h)

    def legend_rects(self) -> list[QtCore.QRectF]:
        """Where each legend entry (swatch and label) is drawn."""
        fm = QtGui.QFontMetrics(self._font)
        return [QtCore.QRectF(x, self._line_h * row + 2, 22 + fm.horizontalAdvance(s.label), self._line_h)
                for s, x, row in self._legend_layout()]

    def _legend_rows(self) -> int:
        return max(max((row for _, _, row in self._legend_layout()), default=1), self._unit_row())

    def _ticks(self) -> list[float]:
        if self.fixed_ticks:
            return list(self.fixed_ticks)
        step = tick_step(self.top)
        lo = self.fixed[0] if self.fixed else 0.0
        return [lo + i * step for i in range(int(round((self.top - lo) / step)) + 1)]

    def _y_to_px(self, r: QtCore.QRectF, y):
        lo = self.fixed[0] if self.fixed else 0.0
        return r.bottom() - (y - lo) / max(self.top - lo, 1e-12) * r.height()

    # -- painting -------------------------------------------------------------------------------
    def _build_frame(self) -> QtGui.QPixmap:
        dpr = self.devicePixelRatioF()
        pm = QtGui.QPixmap(QtCore.QSize(int(self.width() * dpr), int(self.height() * dpr)))
        pm.setDevicePixelRatio(dpr)
        pm.fill(BG)
        p = QtGui.QPainter(pm)
        r = self._rect = self._plot_rect()
        p.setFont(self._title_font)
        p.setPen(TITLE)
        title, note = self.heading()
        p.drawText(QtCore.QPointF(6, self._line_h), title)
        if note:
            x = 6 + QtGui.QFontMetrics(self._title_font).horizontalAdvance(title + "  ")
            p.setPen(QtGui.QColor("#ff8a80"))
            p.drawText(QtCore.QPointF(x, self._line_h), note)
        # Legend: a swatch and a label per series, wrapped into rows under the title.
        p.setFont(self._font)
        fm = QtGui.QFontMetrics(self._font)
        for s, x, row in self._legend_layout():
            y = self._line_h * (row + 1)
            p.setPen(s.pen)
            p.drawLine(QtCore.QPointF(x, y - fm.ascent() / 2 + 1), QtCore.QPointF(x + 18, y - fm.ascent() / 2 + 1))
            p.setPen(TICK_TEXT)
            p.drawText(QtCore.QPointF(x + 22, y), s.label)
        # Axes, y ticks with faint grid lines, x ticks every span/6 seconds.
        p.setPen(QtGui.QPen(AXIS, 1))
        p.drawLine(r.bottomLeft(), r.bottomRight())
        p.drawLine(r.bottomLeft(), r.topLeft())
        step = tick_step(self.top) if not self.fixed_ticks else 1.0
        grid = QtGui.QPen(QtGui.QColor(255, 255, 255, 18), 1)
        for v in self._ticks():
            py = self._y_to_px(r, v)
            p.setPen(grid)
            p.drawLine(QtCore.QPointF(r.left() + 1, py), QtCore.QPointF(r.right(), py))
            p.setPen(TICK_TEXT)
            label = self._tick_text(v, step)
            p.drawText(QtCore.QRectF(0, py - self._line_h / 2, r.left() - 4, self._line_h),
                       QtCore.Qt.AlignRight | QtCore.Qt.AlignVCenter, label)
        for i in range(7):
            ago = -self.span + i * self.span / 6
            px = r.left() + (ago + self.span) / self.span * r.width()
            p.setPen(AXIS)
            p.drawLine(QtCore.QPointF(px, r.bottom()), QtCore.QPointF(px, r.bottom() + 3))
            p.setPen(TICK_TEXT)
            text = f"{ago:.0f}" if i < 6 else "now"
            tw = fm.horizontalAdvance(text)
            p.drawText(QtCore.QPointF(min(max(px - tw / 2, r.left()), self.width() - tw - 2), r.bottom() + 3 + fm.ascent()),
                       text)
        p.setPen(TICK_TEXT)
        p.drawText(QtCore.QPointF(self.unit_rect().left(), self._line_h * (self._unit_row() + 1)), self._unit_text())
        p.end()
        return pm

    def _tick_text(self, v: float, step: float | None = None) -> str:
        if self.tick_format is not None:
            return self.tick_format(v)
        return tick_label(v, 0.1 if self.fixed_ticks else step or tick_step(self.top))

    def paintEvent(self, event) -> None:
        key = (self.width(), self.height(), self.top, self.span, self.title, self.note, self.devicePixelRatioF())
        if self._frame is None or self._frame_key != key:
            self._frame, self._frame_key = self._build_frame(), key
        p = QtGui.QPainter(self)
        p.drawPixmap(0, 0, self._frame)
        r = self._rect
        p.setClipRect(r.adjusted(0, -1, 1, 0))
        for value, pen in self.levels.values():
            py = self._y_to_px(r, value)
            p.setPen(pen)
            p.drawLine(QtCore.QPointF(r.left(), py), QtCore.QPointF(r.right(), py))
        sx = r.width() / self.span
        for s in self.series.values():
            n = len(s.x)
            if n < 2 - s.dots:
                continue
            px = r.left() + (s.x + self.span) * sx
            py = self._y_to_px(r, s.y)
            finite = np.isfinite(py)
            p.setPen(s.pen)
            if s.dots:  # x px and y py of every sample; NaN ones skipped
                p.setBrush(s.pen.color())
                for x, y in zip(px[finite], py[finite]):
                    p.drawEllipse(QtCore.QPointF(x, y), 2.2, 2.2)
                p.setBrush(QtCore.Qt.NoBrush)
            elif finite.all():
                self._polyline(p, px, py)
            else:  # NaN (an unreadable sample) breaks the line into runs
                edges = np.flatnonzero(np.diff(np.concatenate(([0], finite.view(np.int8), [0]))))
                for a, b in zip(edges[::2], edges[1::2]):
                    if b - a >= 2:
                        self._polyline(p, px[a:b], py[a:b])
        self._paint_marks(p, r)
        self._paint_prediction(p, r)
        if self._hover_x is not None and r.left() <= self._hover_x <= r.right():
            self._paint_hover(p, r)
        p.end()

    def _mark_x(self, r: QtCore.QRectF, ago: float) -> float:
        return r.left() + (ago + self.span) / self.span * r.width()

    def _paint_marks(self, p: QtGui.QPainter, r: QtCore.QRectF) -> None:
        if not self.marks:
            return
        for ago, kind, _ in self.marks:
            if not -self.span <= ago <= 0:
                continue
            x = self._mark_x(r, ago)
            p.setPen(self._mark_pens[kind])
            if MARK_STYLE[kind][1]:
                p.drawLine(QtCore.QPointF(x, r.top()), QtCore.QPointF(x, r.bottom()))
            else:
                p.drawLine(QtCore.QPointF(x, r.bottom() - 7), QtCore.QPointF(x, r.bottom()))
        # Labels after every line, each on a box of the background, so no line or curve runs through a text.
        p.setFont(self._font)
        fm = QtGui.QFontMetrics(self._font)
        box = QtGui.QColor(BG)
        box.setAlpha(235)
        for rect, text, kind in self.mark_labels(r):
            p.fillRect(rect, box)
            p.setPen(QtGui.QColor(MARK_STYLE[kind][0]))
            p.drawText(QtCore.QPointF(rect.left() + 2, rect.top() + fm.ascent()), text)

    def _paint_prediction(self, p: QtGui.QPainter, r: QtCore.QRectF) -> None:
        pred = self.prediction
        if pred is None:
            return
        x = max(self._mark_x(r, pred.ago), r.left())  # a change older than the span: its levels fill the plot
        if pred.ago >= -self.span:
            pen = QtGui.QPen(PREDICTION_LINE, 1)
            pen.setCosmetic(True)
            p.setPen(pen)
            p.drawLine(QtCore.QPointF(x, r.top()), QtCore.QPointF(x, r.bottom()))
        for value, colour in pred.levels:
            # A wide, translucent dash: apart from the thin dashed cumulative lines of the same colour, which a
            # steady workload puts at the same level, and from the measured lines it is read against.
            c = QtGui.QColor(colour)
            c.setAlpha(150)
            pen = QtGui.QPen(c, 4)
            pen.setCosmetic(True)
            pen.setCapStyle(QtCore.Qt.FlatCap)
            pen.setDashPattern([2, 1])  # in pen widths: 8 px on, 4 off
            p.setPen(pen)
            py = self._y_to_px(r, value)
            p.drawLine(QtCore.QPointF(x, py), QtCore.QPointF(r.right(), py))
        got = self.prediction_label(r)
        if got is None:
            return
        box, parts = got
        fill = QtGui.QColor(BG)
        fill.setAlpha(235)
        p.fillRect(box, fill)
        p.setFont(self._font)
        fm = QtGui.QFontMetrics(self._font)
        tx = box.left() + 2
        for text, colour in parts:
            p.setPen(QtGui.QColor(colour))
            p.drawText(QtCore.QPointF(tx, box.top() + fm.ascent()), text)
            tx += fm.horizontalAdvance(text)

    def prediction_label(self, r: QtCore.QRectF | None = None) -> tuple[QtCore.QRectF, list] | None:
        """(box, (text, colour) runs) of the prediction's label: in the plot's bottom row above the engine's ticks,
        right of the change's line, else left of it, else at the plot's right edge; the short form where the long
        one does not fit the plot. None without a prediction or where neither fits."""
        pred = self.prediction
        if pred is None:
            return None
        r = self._rect if r is None else r
        fm = QtGui.QFontMetrics(self._font)
        x = max(self._mark_x(r, pred.ago), r.left())
        top = r.bottom() - 9 - self._line_h  # above the 7-pixel ticks of context shifts and preemptions
        for parts in (pred.parts, pred.short):
            w = sum(fm.horizontalAdvance(t) for t, _ in parts) + 4
            if w > r.width():
                continue
            left = x + 2 if x + 2 + w <= r.right() else (x - 2 - w if x - 2 - w >= r.left() else r.right() - w)
            return QtCore.QRectF(left, top, w, self._line_h), parts
        return None

    def prediction_text(self) -> str:
        """The prediction's label as drawn ("" where there is none or it does not fit)."""
        got = self.prediction_label()
        return "" if got is None else "".join(t for t, _ in got[1])

    def mark_labels(self, r: QtCore.QRectF | None = None) -> list[tuple[QtCore.QRectF, str, str]]:
        """(box, text, kind) of each label drawn for the labelled marks (ui/charts/mark_labels.py)."""
        r = self._rect if r is None else r
        shown = [(self._mark_x(r, ago), kind, label) for ago, kind, label in self.marks
                 if -self.span <= ago <= 0 and MARK_STYLE[kind][1]]
        return mark_labels.place(shown, r, QtGui.QFontMetrics(self._font), self._line_h)

    def marks_near(self, x: float, px: float = 4.0) -> list[str]:
        """Labels of the marks within px pixels of x (widget coordinates)."""
        r = self._rect
        return [label for ago, _, label in self.marks
                if -self.span <= ago <= 0 and abs(self._mark_x(r, ago) - x) <= px]

    def _polyline(self, p: QtGui.QPainter, px: np.ndarray, py: np.ndarray) -> None:
        if self._poly.size() != len(px):
            self._poly = create_qpolygonf(len(px))
        buf = ndarray_from_qpolygonf(self._poly)
        buf[:, 0] = px
        buf[:, 1] = py
        p.drawPolyline(self._poly)

    def _paint_hover(self, p: QtGui.QPainter, r: QtCore.QRectF) -> None:
        hx = self._hover_x
        ago = (hx - r.left()) / r.width() * self.span - self.span
        p.setPen(QtGui.QPen(CURSOR, 1))
        p.drawLine(QtCore.QPointF(hx, r.top()), QtCore.QPointF(hx, r.bottom()))
        lines = [f"{-ago:.1f} s ago"]
        for s in self.series.values():
            v = self.value_at(s.key, ago)
            text = tick_label(v, 0.001 if abs(v) < 10 else 1) if self.value_format is None else self.value_format(v)
            lines.append(f"{s.label}: " + ("no data" if math.isnan(v) else text))
        lines += [f"▲ {label}" for label in self.marks_near(hx)]
        if self.prediction is not None and ago >= self.prediction.ago:
            lines.append("◆ " + "".join(t for t, _ in self.prediction.parts))
        p.setClipping(False)
        p.setFont(self._font)
        fm = QtGui.QFontMetrics(self._font)
        w = max(fm.horizontalAdvance(t) for t in lines) + 10
        h = self._line_h * len(lines) + 6
        x = hx + 8 if hx + 8 + w < self.width() else hx - 8 - w
        box = QtCore.QRectF(x, r.top() + 2, w, h)
        p.fillRect(box, QtGui.QColor(37, 41, 48, 235))
        p.setPen(TICK_TEXT)
        for i, t in enumerate(lines):
            p.drawText(QtCore.QPointF(x + 5, r.top() + 2 + fm.ascent() + 3 + i * self._line_h), t)

    def event(self, event) -> bool:
        # A legend entry's tooltip says what its series counts.
        if event.type() == QtCore.QEvent.ToolTip:
            tip = self.legend_tip(event.position() if hasattr(event, "position") else QtCore.QPointF(event.pos()))
            if tip:
                QtWidgets.QToolTip.showText(event.globalPos(), tip, self)
            else:
                QtWidgets.QToolTip.hideText()
                event.ignore()
            return True
        return super().event(event)

    def legend_tip(self, pos: QtCore.QPointF) -> str:
        """The tooltip of the legend entry under pos (widget coordinates), or the prediction's under its label or
        near its line, or ""."""
        if self.prediction is not None and self.prediction.tip:
            got = self.prediction_label()
            near = abs(pos.x() - max(self._mark_x(self._rect, self.prediction.ago), self._rect.left())) <= 3 and \
                self._rect.top() <= pos.y() <= self._rect.bottom()
            if near or (got is not None and got[0].contains(pos)):
                return self.prediction.tip
        for s, rect in zip(self.series.values(), self.legend_rects()):
            if rect.contains(pos):
                return f"{s.label}: {s.tip}" if s.tip else ""
        return ""

    def mouseMoveEvent(self, event) -> None:
        self._hover_x = event.position().x()
        self.update()

    def leaveEvent(self, event) -> None:
        self._hover_x = None
        self.update()

    def resizeEvent(self, event) -> None:
        self._frame = None
        super().resizeEvent(event)
