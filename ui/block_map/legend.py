"""The block map's legend: one line explaining the current colour mode, as swatches with names or a colour
bar with ticks (log ticks for heat and age)."""

from __future__ import annotations

import math

import numpy as np
from PySide6.QtCore import QPointF, QRectF, QSize
from PySide6.QtGui import QFont, QImage, QPainter
from PySide6.QtWidgets import QSizePolicy, QWidget

from ui import palette as pal


def _fmt_seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.0f} ms"
    if s < 120:
        return f"{s:g} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.0f} h"


def _fmt_value(v: float) -> str:
    return f"{v:g}" if v >= 0.01 else f"{v:.0e}"


def _log_ticks(lo: float, hi: float, fmt) -> list[tuple[float, str]]:
    span = math.log(hi / lo)
    out = []
    for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
        v = 10.0 ** e
        if lo * (1 - 1e-6) <= v <= hi * (1 + 1e-6):
            out.append((math.log(v / lo) / span, fmt(v)))
    if not out or out[-1][0] < 0.97:  # label the top of the range, in place of a decade crowding it
        if out and out[-1][0] > 0.8:
            out.pop()
        out.append((1.0, fmt(hi)))
    return out


def _same(a, b) -> bool:
    """Legend items equal, numpy colour arrays compared by value."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


class _Legend(QWidget):
    """One line explaining the current mode: swatches with names, or a colour bar with ticks."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self._items: list[tuple] = []
        self.drawn_width = 0
        self.setMinimumHeight(30)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        f = QFont(self.font())
        f.setPointSizeF(8.5)
        self.setFont(f)

    def set_items(self, items: list[tuple]) -> None:
        """items: ("swatch", rgb, label) | ("ramp", colors (n,3) uint8, ticks [(frac, label)], title)."""
        if _same(items, self._items):
            return  # the maps set their legend every frame; a repaint only when it changed
        self._items = items
        self.update()

    def text(self) -> str:
        parts = []
        for it in self._items:
            parts.append(it[2] if it[0] == "swatch" else f"{it[3]} {' '.join(t for _, t in it[2])}")
        return " | ".join(parts)

    def sizeHint(self) -> QSize:
        return QSize(400, 30)

    def _ramp_width(self, fm, short: bool = False) -> int:
        """220 px per colour bar, less (down to 100, or 70 in a short line) where the line would not fit the
        widget otherwise."""
        need, ramps = 6, 0
        for it in self._items:
            if it[0] == "swatch":
                need += 16 + fm.horizontalAdvance(_label(it[2], short)) + 14
            else:
                need += (0 if short else fm.horizontalAdvance(it[3]) + 8) + 220 + 18
                ramps += 1
        over = need - self.width()
        return 220 if over <= 0 or not ramps else int(max(70 if short else 100, 220 - over / ramps))

    @staticmethod
    def _item_width(fm, it, w: int) -> int:
        """The width of one item in a short line (its trailing gap not counted)."""
        if it[0] == "swatch":
            return 16 + fm.horizontalAdvance(_label(it[2], True))
        return w

    def _fits(self, fm, w: int) -> bool:
        """Whether the line with full labels and colour bars `w` wide fits the widget."""
        need = 6 + sum(16 + fm.horizontalAdvance(it[2]) + 14 if it[0] == "swatch"
                       else fm.horizontalAdvance(it[3]) + 8 + w + 18 for it in self._items)
        return need <= self.width()

    def paintEvent(self, _ev) -> None:
        p = QPainter(self)
        p.fillRect(self.rect(), pal.qcolor(pal.BACKGROUND))
        fm = p.fontMetrics()
        h = self.height()
        x = 6
        p.setPen(pal.qcolor(pal.TEXT))
        w = self._ramp_width(fm)
        short = not self._fits(fm, w)  # a narrow window: swatch labels without their "(...)" hints
        if short:
            w = self._ramp_width(fm, short=True)
        # Narrower still (kv error mode on a 1280 x 720 screen): what does not fit ends in "…", the whole
        # legend in the tooltip.
        self.setToolTip(self.text() if short else "")
        for i, it in enumerate(self._items):
            if short and x + self._item_width(fm, it, w) > self.width() - (0 if i == len(self._items) - 1 else 14):
                p.drawText(QPointF(x, h / 2 + fm.ascent() / 2 - 1), "…")
                x += fm.horizontalAdvance("…")
                break
            if it[0] == "swatch":
                _, rgb, label = it
                label = _label(label, short)
                p.fillRect(QRectF(x, h / 2 - 6, 12, 12), pal.qcolor(rgb))
                p.setPen(pal.qcolor(pal.FRAME))
                p.drawRect(QRectF(x, h / 2 - 6, 12, 12))
                p.setPen(pal.qcolor(pal.TEXT))
                x += 16
                p.drawText(QPointF(x, h / 2 + fm.ascent() / 2 - 1), label)
                x += fm.horizontalAdvance(label) + 14
            else:
                _, colors, ticks, title = it
                if not short:  # a short line leaves the title to the mode's combo box beside it
                    p.drawText(QPointF(x, h / 2 + fm.ascent() / 2 - 1), title)
                    x += fm.horizontalAdvance(title) + 8
                img = QImage(np.ascontiguousarray(colors[None, :, :]).tobytes(), len(colors), 1, 3 * len(colors),
                             QImage.Format.Format_RGB888)
                bar = QRectF(x, 3, w, h / 2 - 3)
                p.drawImage(bar, img)
                p.setPen(pal.qcolor(pal.FRAME))
                p.drawRect(bar)
                p.setPen(pal.qcolor(pal.TEXT))
                for i, (frac, label) in enumerate(ticks):
                    tx = x + frac * w
                    p.drawLine(QPointF(tx, bar.bottom()), QPointF(tx, bar.bottom() + 3))
                    tw = fm.horizontalAdvance(label)
                    lx = min(max(tx - tw / 2, x - 4), x + w - tw + 4)
                    p.drawText(QPointF(lx, h - 2), label)
                x += w + 18
        self.drawn_width = x  # how far the line reached (tests: it fits the widget)
        p.end()


def _label(label: str, short: bool) -> str:
    """A swatch's label; short: without a trailing "(...)" hint ("selected (click a block)" -> "selected")."""
    return label.split(" (")[0] if short else label
