"""The block map: every slot of every tier as one cell of one uint8 code image.

Layout: each tier is a row-major grid with the same column count, device first, then a gap, then host, so a
tier's slots are one contiguous slice of the flat code buffer and a frame is a few whole-array numpy passes
written in place. The image is drawn by one ImageItem through a 256-entry LUT (pyqtgraph's Indexed8 fast
path); codes above palette.VALUE_MAX mean free / cached / selected / background in every mode.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPoint, QPointF, QRectF, QSize, Qt, Signal
from PySide6.QtGui import QFont, QImage, QPainter, QPainterPath, QPen
from PySide6.QtWidgets import (QApplication, QComboBox, QGraphicsPathItem, QHBoxLayout, QSizePolicy, QToolTip,
                               QVBoxLayout, QWidget)

from engine.telemetry import SeqTable, Snapshot, TierSnapshot
from ui import palette as pal

MODES = ("state", "owner", "heat", "ref", "fill", "age")
GAP_FRACTION = 0.06  # gap between tiers (and the label band above the first) as a share of all rows


@dataclass(frozen=True)
class GridLayout:
    """Where each tier's slots sit in the code image (rows × cols, row-major)."""

    cols: int
    capacities: tuple[int, ...]
    tops: tuple[int, ...]  # first image row of each tier
    rows: tuple[int, ...]  # rows each tier spans (its last row may be partly filled)
    gap: int  # background rows between tiers; the same band sits above the first tier, outside the image
    height: int  # image rows

    @property
    def offsets(self) -> tuple[int, ...]:
        """Flat index of each tier's slot 0."""
        return tuple(t * self.cols for t in self.tops)


def grid_layout(capacities: tuple[int, ...], aspect: float) -> GridLayout:
    """Columns chosen so the whole map (gaps and label band included) is about `aspect` wide per unit tall."""
    total = max(sum(capacities), 1)
    aspect = min(max(aspect, 0.2), 20.0)
    cols = max(1, math.ceil(math.sqrt(total * aspect * (1 + 2 * GAP_FRACTION))))
    cols = min(cols, 32000)  # QImage and ImageItem limits
    rows = tuple(-(-c // cols) for c in capacities)
    gap = max(1, math.ceil(GAP_FRACTION * sum(rows)))
    tops, r = [], 0
    for i, n in enumerate(rows):
        tops.append(r)
        r += n + (gap if i < len(rows) - 1 else 0)
    return GridLayout(cols=cols, capacities=tuple(capacities), tops=tuple(tops), rows=rows, gap=gap, height=max(r, 1))


def _nice_ceil(v: float) -> float:
    if not np.isfinite(v) or v <= 0:
        return 1.0
    e = 10.0 ** math.floor(math.log10(v))
    for m in (1.0, 2.0, 5.0, 10.0):
        if v <= m * e * (1 + 1e-9):
            return m * e
    return 10 * e


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


class _CodeImage(pg.ImageItem):
    """The ImageItem, counting its paints (the bench and the tests check a frame was really drawn)."""

    paints = 0

    def paint(self, painter, *args):
        self.paints += 1
        super().paint(painter, *args)


class _Legend(QWidget):
    """One line explaining the current mode: swatches with names, or a colour bar with ticks."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self._items: list[tuple] = []
        self.setMinimumHeight(30)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        f = QFont(self.font())
        f.setPointSizeF(8.5)
        self.setFont(f)

    def set_items(self, items: list[tuple]) -> None:
        """items: ("swatch", rgb, label) | ("ramp", colors (n,3) uint8, ticks [(frac, label)], title)."""
        self._items = items
        self.update()

    def text(self) -> str:
        parts = []
        for it in self._items:
            parts.append(it[2] if it[0] == "swatch" else f"{it[3]} {' '.join(t for _, t in it[2])}")
        return " | ".join(parts)

    def sizeHint(self) -> QSize:
        return QSize(400, 30)

    def paintEvent(self, _ev) -> None:
        p = QPainter(self)
        p.fillRect(self.rect(), pal.qcolor(pal.BACKGROUND))
        fm = p.fontMetrics()
        h = self.height()
        x = 6
        p.setPen(pal.qcolor(pal.TEXT))
        for it in self._items:
            if it[0] == "swatch":
                _, rgb, label = it
                p.fillRect(QRectF(x, h / 2 - 6, 12, 12), pal.qcolor(rgb))
                p.setPen(pal.qcolor(pal.FRAME))
                p.drawRect(QRectF(x, h / 2 - 6, 12, 12))
                p.setPen(pal.qcolor(pal.TEXT))
                x += 16
                p.drawText(QPointF(x, h / 2 + fm.ascent() / 2 - 1), label)
                x += fm.horizontalAdvance(label) + 14
            else:
                _, colors, ticks, title = it
                p.drawText(QPointF(x, h / 2 + fm.ascent() / 2 - 1), title)
                x += fm.horizontalAdvance(title) + 8
                w = 220
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
        p.end()


class BlockMap(QWidget):
    """Every block of both tiers, coloured by a mode; click a block to select its sequence."""

    sequenceSelected = Signal(int)

    def __init__(self, parent: QWidget | None = None, mode: str = "state"):
        super().__init__(parent)
        self._snap: Snapshot | None = None
        self._layout: GridLayout | None = None
        self._codes = np.full((1, 1), pal.BACKGROUND_CODE, np.uint8)
        self._mode = "state"
        self._selected = -1
        self._sel_key: tuple | None = None
        self._sel_idx = np.zeros(0, np.intp)
        self._block_size = 0
        self._ranges: dict[str, tuple[float, float]] = {}
        self._legend_key: tuple | None = None
        self._hover: tuple[int, int] | None = None
        self._hover_scene: QPointF | None = None
        self.hover_text = ""
        self.frame_ms = 0.0  # cost of the last set_snapshot (codes, labels, legend), paint excluded

        self.view = pg.GraphicsView(background=pal.qcolor(pal.BACKGROUND))
        self.vb = pg.ViewBox(lockAspect=1.0, invertY=True, enableMenu=False, defaultPadding=0.01)
        self.vb.disableAutoRange()
        self.view.setCentralItem(self.vb)
        self.image = _CodeImage(axisOrder="row-major")
        self.image.setImage(self._codes, autoLevels=False, levels=(0, 256))
        self.vb.addItem(self.image)
        frame_pen = QPen(pal.qcolor(pal.FRAME))
        frame_pen.setCosmetic(True)
        frame_pen.setWidthF(1.0)
        self._frame_pen = frame_pen
        self._frames: list[QGraphicsPathItem] = []
        self._labels: list[pg.TextItem] = []
        self._label_font = QFont(self.font())
        self._label_font.setPointSizeF(9.5)
        self._label_font.setBold(True)

        self.mode_box = QComboBox()
        self.mode_box.addItems(MODES)
        self.mode_box.setToolTip("colour the blocks by")
        self.mode_box.currentTextChanged.connect(self.set_mode)
        self.legend = _Legend()
        bar = QHBoxLayout()
        bar.setContentsMargins(4, 0, 4, 2)
        bar.addWidget(self.mode_box)
        bar.addWidget(self.legend, 1)
        self.setAutoFillBackground(True)
        bg = self.palette()
        bg.setColor(self.backgroundRole(), pal.qcolor(pal.BACKGROUND))
        self.setPalette(bg)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(2)
        lay.addWidget(self.view, 1)
        lay.addLayout(bar)

        scene = self.view.scene()
        scene.sigMouseMoved.connect(self._on_mouse_moved)
        scene.sigMouseClicked.connect(self._on_mouse_clicked)
        self.set_mode(mode)

    # -- public API -------------------------------------------------------------------------------
    def set_snapshot(self, snapshot: Snapshot) -> None:
        t0 = time.perf_counter()
        self._snap = snapshot
        caps = tuple(int(t.capacity) for t in snapshot.tiers)
        if self._layout is None or caps != self._layout.capacities:
            self._relayout(caps)
        bs = int(snapshot.config.get("block_size", 16))
        if bs != self._block_size:
            self._block_size = bs
            self._apply_lut()
        self._redraw()
        self._update_labels()
        if self._hover is not None and QToolTip.isVisible():
            self._show_hover(self._hover_scene)
        self.frame_ms = 1e3 * (time.perf_counter() - t0)

    def set_mode(self, name: str) -> None:
        if name not in MODES:
            raise ValueError(f"unknown mode {name!r}; one of {MODES}")
        self._mode = name
        if self.mode_box.currentText() != name:
            self.mode_box.blockSignals(True)
            self.mode_box.setCurrentText(name)
            self.mode_box.blockSignals(False)
        self._apply_lut()
        if self._snap is not None:
            self._redraw()
        else:
            self._update_legend()

    def mode(self) -> str:
        return self._mode

    def set_selected(self, seq_id: int) -> None:
        """Highlight a sequence's blocks on both tiers (-1 clears); emits nothing."""
        seq_id = int(seq_id)
        if seq_id == self._selected:
            return
        self._selected = seq_id
        if self._snap is not None:
            self._redraw()
        else:
            self._update_legend()

    def selected(self) -> int:
        return self._selected

    def reset_view(self) -> None:
        lay = self._layout
        if lay is None:
            return
        self.vb.setRange(QRectF(0, -lay.gap, lay.cols, lay.height + lay.gap), padding=0.01)

    @property
    def codes(self) -> np.ndarray:
        """The code image (rows × cols uint8), read-only."""
        v = self._codes.view()
        v.flags.writeable = False
        return v

    @property
    def layout_info(self) -> GridLayout | None:
        return self._layout

    def tier_codes(self, tier: int) -> np.ndarray:
        """The codes of one tier's slots, slot order."""
        lay = self._layout
        off = lay.offsets[tier]
        return self.codes.reshape(-1)[off:off + lay.capacities[tier]]

    def selected_cells(self) -> list[np.ndarray]:
        """Per tier, the slots drawn as selected."""
        return [np.flatnonzero(self.tier_codes(i) == pal.SELECTED_CODE) for i in range(len(self._layout.capacities))]

    def block_at(self, x: float, y: float) -> tuple[int, int] | None:
        """(tier, slot) of the cell at view coordinates (x: column, y: row), or None."""
        lay = self._layout
        if lay is None or not (0 <= x < lay.cols):
            return None
        col, row = int(x), math.floor(y)
        for i, (top, n) in enumerate(zip(lay.tops, lay.rows)):
            if top <= row < top + n:
                slot = (row - top) * lay.cols + col
                return (i, slot) if slot < lay.capacities[i] else None
        return None

    def cell_rect(self, tier: int, slot: int) -> QRectF:
        lay = self._layout
        r, c = divmod(slot, lay.cols)
        return QRectF(c, lay.tops[tier] + r, 1, 1)

    def cell_pos(self, tier: int, slot: int) -> QPoint:
        """The centre of a cell in the coordinates of `self.view.viewport()` (for tests and tools)."""
        scene = self.vb.mapViewToScene(self.cell_rect(tier, slot).center())
        return self.view.mapFromScene(scene)

    def tooltip_text(self, tier: int, slot: int) -> str:
        snap = self._snap
        t = snap.tiers[tier]
        st = int(t.state[slot])
        bs = self._block_size
        owner = int(t.owner[slot])
        owner_s = "none" if owner < 0 else f"{owner}{self._seq_label(owner)}"
        lines = [f"<b>{t.name}</b> slot {slot:,}",
                 f"state: {pal.STATE_NAMES[st] if st < 3 else st}",
                 f"owner: {owner_s}",
                 f"ref: {int(t.ref[slot])}",
                 f"fill: {int(t.fill[slot])}/{bs} tokens",
                 f"heat: {float(t.heat[slot]):.3g}",
                 f"age: {_fmt_age(float(t.age[slot])) if st else '—'}",
                 f"hashed: {'yes' if bool(t.hashed[slot]) else 'no'}"]
        return "<br>".join(lines)

    # -- layout -----------------------------------------------------------------------------------
    def _aspect(self) -> float:
        w, h = self.view.width(), self.view.height()
        return w / h if w > 50 and h > 50 else 2.0

    def _relayout(self, caps: tuple[int, ...]) -> None:
        lay = grid_layout(caps, self._aspect())
        self._layout = lay
        self._codes = np.full((lay.height, lay.cols), pal.BACKGROUND_CODE, np.uint8)
        self._flat = self._codes.reshape(-1)
        self._views = [self._flat[o:o + c] for o, c in zip(lay.offsets, caps)]
        n = max(caps) if caps else 1
        self._f32 = np.empty(n, np.float32)
        self._i32 = np.empty(n, np.int32)
        self._m = np.empty(n, np.bool_)
        self._u8a = np.empty(n, np.uint8)
        self._u8b = np.empty(n, np.uint8)
        self._sel_key = None
        self.image.setImage(self._codes, autoLevels=False, levels=(0, 256))
        for it in self._frames + self._labels:
            self.vb.removeItem(it)
        self._frames, self._labels = [], []
        for i, cap in enumerate(caps):
            item = QGraphicsPathItem(self._outline(lay, i))
            item.setPen(self._frame_pen)
            item.setZValue(5)
            self.vb.addItem(item)
            self._frames.append(item)
            label = pg.TextItem(anchor=(0, 1), color=pal.qcolor(pal.TEXT))
            label.setFont(self._label_font)
            label.setPos(0, lay.tops[i] - 0.15 * lay.gap)
            label.setZValue(6)
            self.vb.addItem(label)
            self._labels.append(label)
        self._label_texts = [""] * len(caps)
        self.vb.setLimits(xMin=-lay.cols, xMax=2 * lay.cols, yMin=-lay.height - lay.gap, yMax=2 * lay.height,
                          minXRange=4, minYRange=4)
        self.reset_view()

    @staticmethod
    def _outline(lay: GridLayout, i: int) -> QPainterPath:
        """The capacity outline of tier i: a rectangle, stepped where the last row is partial."""
        path = QPainterPath()
        cap, top, cols = lay.capacities[i], lay.tops[i], lay.cols
        if cap == 0:
            path.addRect(QRectF(0, top, cols, 0.0001))
            return path
        full, rem = divmod(cap, cols)
        pts = [(0, top), (cols, top), (cols, top + full)]
        if rem:
            pts += [(rem, top + full), (rem, top + full + 1), (0, top + full + 1)]
        else:
            pts += [(0, top + full)]
        path.moveTo(*pts[0])
        for p in pts[1:]:
            path.lineTo(*p)
        path.closeSubpath()
        return path

    def resizeEvent(self, ev) -> None:
        super().resizeEvent(ev)
        if self._snap is None or self._layout is None:
            return
        want = grid_layout(self._layout.capacities, self._aspect()).cols
        if abs(want - self._layout.cols) > 0.15 * self._layout.cols:
            self._relayout(self._layout.capacities)
            self._redraw()
            self._update_labels()

    # -- drawing ----------------------------------------------------------------------------------
    def _apply_lut(self) -> None:
        self.image.setLookupTable(pal.mode_lut(self._mode, self._block_size or 16), update=True)

    def _redraw(self) -> None:
        snap = self._snap
        mode = self._mode
        if mode in ("heat", "age"):
            self._update_range(mode)
        draw = getattr(self, f"_draw_{mode}")
        for i, t in enumerate(snap.tiers):
            if t.capacity:
                draw(t, self._views[i])
        idx = self._selection_index()
        if idx.size:
            self._flat[idx] = pal.SELECTED_CODE
        self.image.updateImage()
        self._update_legend()

    def _override(self, dst: np.ndarray, mask: np.ndarray, code: int) -> None:
        """dst[mask] = code, branch-free (a masked copy over a random mask is ~25× slower)."""
        n = dst.size
        ff, val = self._u8a[:n], self._u8b[:n]
        np.negative(mask.view(np.uint8), out=ff)  # 0xFF where mask
        np.bitwise_and(ff, code, out=val)
        np.invert(ff, out=ff)
        np.bitwise_and(dst, ff, out=dst)
        np.bitwise_or(dst, val, out=dst)

    def _free_override(self, t: TierSnapshot, dst: np.ndarray) -> None:
        m = self._m[:dst.size]
        np.equal(t.state, 0, out=m)
        self._override(dst, m, pal.FREE_CODE)

    def _draw_state(self, t: TierSnapshot, dst: np.ndarray) -> None:
        np.copyto(dst, t.state, casting="unsafe")

    def _draw_owner(self, t: TierSnapshot, dst: np.ndarray) -> None:
        n = dst.size
        i32, m = self._i32[:n], self._m[:n]
        np.bitwise_and(t.owner, pal.N_CATEGORICAL - 1, out=i32)
        np.copyto(dst, i32, casting="unsafe")
        np.less(t.owner, 0, out=m)
        np.logical_or(m, t.state != 2, out=m)
        self._override(dst, m, pal.CACHED_CODE)
        self._free_override(t, dst)

    def _draw_ref(self, t: TierSnapshot, dst: np.ndarray) -> None:
        i32 = self._i32[:dst.size]
        np.minimum(t.ref, 4, out=i32)
        np.maximum(i32, 0, out=i32)
        np.copyto(dst, i32, casting="unsafe")
        self._free_override(t, dst)

    def _draw_fill(self, t: TierSnapshot, dst: np.ndarray) -> None:
        bs = max(self._block_size, 1)
        i32 = self._i32[:dst.size]
        if bs <= pal.VALUE_MAX:
            np.clip(t.fill, 0, bs, out=i32)  # the LUT maps a token count straight to its colour
        else:
            np.clip(t.fill, 0, bs, out=i32)
            np.multiply(i32, pal.VALUE_MAX, out=i32)
            np.floor_divide(i32, bs, out=i32)
        np.copyto(dst, i32, casting="unsafe")
        self._free_override(t, dst)

    def _draw_log(self, values: np.ndarray, lo: float, hi: float, dst: np.ndarray) -> None:
        x = self._f32[:dst.size]
        np.maximum(values, np.float32(lo), out=x)  # also maps NaN to lo
        np.log(x, out=x)
        np.subtract(x, np.float32(math.log(lo)), out=x)
        np.multiply(x, np.float32(pal.VALUE_MAX / math.log(hi / lo)), out=x)
        np.minimum(x, np.float32(pal.VALUE_MAX), out=x)
        np.copyto(dst, x, casting="unsafe")

    def _draw_heat(self, t: TierSnapshot, dst: np.ndarray) -> None:
        lo, hi = self._ranges["heat"]
        self._draw_log(t.heat, lo, hi, dst)
        self._free_override(t, dst)

    def _draw_age(self, t: TierSnapshot, dst: np.ndarray) -> None:
        lo, hi = self._ranges["age"]
        self._draw_log(t.age, lo, hi, dst)
        self._free_override(t, dst)

    def _update_range(self, mode: str) -> None:
        """Log range [hi/1000, hi], hi a 1-2-5 step over the max; kept while the max stays within 5× below it,
        so the colour bar does not jitter from frame to frame."""
        peak = 0.0
        for t in self._snap.tiers:
            if not t.capacity:
                continue
            if mode == "heat":
                v = float(np.max(t.heat))
            else:  # age is meaningless where free: look at a strided sample of the used slots
                k = max(1, t.capacity // 65536)
                s = t.age[::k][t.state[::k] != 0]
                v = float(np.nanmax(s)) if s.size and not np.all(np.isnan(s)) else 0.0
            if np.isfinite(v):
                peak = max(peak, v)
        floor = 1e-3
        hi = _nice_ceil(max(peak, floor * 10))
        old = self._ranges.get(mode)
        if old is not None and old[1] >= hi and old[1] / 5 < max(peak, floor * 10) * (1 + 1e-9):
            return
        self._ranges[mode] = (max(hi / 1000, floor if mode == "age" else 1e-4), hi)

    def _selection_index(self) -> np.ndarray:
        """Flat code indices of the selected sequence's blocks: its block list when the snapshot has it,
        otherwise the slots it owns."""
        sel, snap = self._selected, self._snap
        if sel < 0 or snap is None:
            return np.zeros(0, np.intp)
        key = (id(snap), sel, self._layout)
        if key == self._sel_key:
            return self._sel_idx
        lay = self._layout
        parts = []
        tier_arr = slot_arr = None
        seqs = snap.seqs
        hit = np.flatnonzero(np.asarray(seqs.id) == sel)
        if hit.size and hit[0] < len(seqs.block_slot) and len(seqs.block_slot[hit[0]]):
            tier_arr = np.asarray(seqs.block_tier[hit[0]])
            slot_arr = np.asarray(seqs.block_slot[hit[0]])
        for i, t in enumerate(snap.tiers):
            if slot_arr is not None:
                s = slot_arr[tier_arr == i]
                s = s[(s >= 0) & (s < t.capacity)]
            else:
                s = np.flatnonzero(t.owner == sel)
            parts.append(lay.offsets[i] + s.astype(np.intp))
        self._sel_idx = np.concatenate(parts) if parts else np.zeros(0, np.intp)
        self._sel_key = key
        return self._sel_idx

    def _update_labels(self) -> None:
        for i, t in enumerate(self._snap.tiers):
            used = t.used
            mib = t.block_bytes / 2 ** 20
            text = f"{t.name}   {used:,} / {t.capacity:,} blocks"
            if t.block_bytes:
                text += f"   ({used * mib:,.1f} / {t.capacity * mib:,.1f} MiB)"
            if text != self._label_texts[i]:
                self._label_texts[i] = text
                self._labels[i].setText(text, color=pal.qcolor(pal.TEXT))

    def label_texts(self) -> list[str]:
        return list(getattr(self, "_label_texts", []))

    def _update_legend(self) -> None:
        mode = self._mode
        key = (mode, self._ranges.get(mode), self._block_size, self._selected, self._seq_label(self._selected))
        if key == self._legend_key:
            return
        self._legend_key = key
        items: list[tuple] = []
        if mode == "state":
            items = [("swatch", c, n) for c, n in zip(pal.STATE_COLORS, pal.STATE_NAMES)]
        elif mode == "owner":
            ramp = np.repeat(pal.CATEGORICAL, 4, axis=0)
            items = [("ramp", ramp, [(0.0, "0"), (1.0, str(pal.N_CATEGORICAL - 1))], "sequence id mod 32"),
                     ("swatch", pal.CACHED, "cached / no owner"), ("swatch", pal.FREE, "free")]
        elif mode == "ref":
            items = [("swatch", c, n) for c, n in zip(pal.REF_COLORS, pal.REF_NAMES)]
            items += [("swatch", pal.CACHED, "cached (ref 0)"), ("swatch", pal.FREE, "free")]
        elif mode in ("heat", "age"):
            lo, hi = self._ranges.get(mode, (1e-3, 1.0))
            fmt = _fmt_value if mode == "heat" else _fmt_seconds
            title = "heat (log)" if mode == "heat" else "age since last access (log)"
            items = [("ramp", pal.ramp(mode), _log_ticks(lo, hi, fmt), title), ("swatch", pal.FREE, "free")]
        elif mode == "fill":
            bs = self._block_size or 16
            ticks = [(0.0, "0"), (0.5, f"{bs // 2}"), (1.0, f"{bs} tokens")]
            items = [("ramp", pal.ramp("fill"), ticks, "fill"), ("swatch", pal.FREE, "free")]
        sel = self._selected
        items.append(("swatch", pal.SELECTED, f"selected: seq {sel}{self._seq_label(sel)}" if sel >= 0
                      else "selected (click a block)"))
        self.legend.set_items(items)

    def _seq_label(self, seq_id: int) -> str:
        if self._snap is None or seq_id < 0:
            return ""
        seqs: SeqTable = self._snap.seqs
        hit = np.flatnonzero(np.asarray(seqs.id) == seq_id)
        if hit.size and hit[0] < len(seqs.labels) and seqs.labels[hit[0]]:
            return f" ({seqs.labels[hit[0]]})"
        return ""

    # -- mouse ------------------------------------------------------------------------------------
    def _on_mouse_moved(self, scene_pos: QPointF) -> None:
        self._hover_scene = scene_pos
        self._show_hover(scene_pos)

    def _show_hover(self, scene_pos: QPointF | None) -> None:
        if self._snap is None or scene_pos is None:
            return
        p = self.vb.mapSceneToView(scene_pos)
        cell = self.block_at(p.x(), p.y())
        self._hover = cell
        if cell is None:
            self.hover_text = ""
            QToolTip.hideText()
            return
        self.hover_text = self.tooltip_text(*cell)
        gpos = self.view.mapToGlobal(self.view.mapFromScene(scene_pos))
        QToolTip.showText(gpos, self.hover_text, self.view)

    def _on_mouse_clicked(self, ev) -> None:
        if ev.button() != Qt.MouseButton.LeftButton or self._snap is None:
            return
        if ev.double():
            self.reset_view()
            return
        p = self.vb.mapSceneToView(ev.scenePos())
        cell = self.block_at(p.x(), p.y())
        owner = -1
        if cell is not None:
            t = self._snap.tiers[cell[0]]
            if t.state[cell[1]] != 0:
                owner = int(t.owner[cell[1]])
        self.set_selected(owner)
        self.sequenceSelected.emit(owner)


def _fmt_age(s: float) -> str:
    if not np.isfinite(s):
        return "—"
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


# -- fake snapshots and the bench -------------------------------------------------------------------
def fake_snapshot(capacities: tuple[int, int] = (24_000, 72_000), *, block_size: int = 16, n_seqs: int = 40,
                  seed: int = 0, t: float = 0.0, tables: bool = True, used: tuple[float, float] = (0.85, 0.6)
                  ) -> Snapshot:
    """A plausible snapshot built from numpy alone: runs of blocks per sequence, a shared prefix, cached
    blocks with decaying heat, free slots. For demos, screenshots and the bench."""
    rng = np.random.default_rng(seed)
    tiers = []
    slots_of: dict[int, list[tuple[int, np.ndarray]]] = {}
    for ti, (cap, frac) in enumerate(zip(capacities, used)):
        state = np.zeros(cap, np.uint8)
        owner = np.full(cap, -1, np.int32)
        ref = np.zeros(cap, np.int32)
        fill = np.zeros(cap, np.int32)
        n_used = int(cap * frac)
        if n_used:
            # allocations come in runs (one sequence's blocks), scattered by churn
            pick = np.sort(rng.choice(cap, n_used, replace=False))
            run = max(8, n_used // (3 * n_seqs))
            run_owner = np.repeat(rng.integers(0, n_seqs, n_used // run + 1), run)[:n_used]
            state[pick] = np.where(rng.random(n_used) < 0.7, 2, 1)
            owner[pick] = run_owner
            ref[pick] = np.where(state[pick] == 2, 1 + (rng.random(n_used) < 0.15) * rng.integers(1, 5, n_used), 0)
            fill[pick] = np.where(rng.random(n_used) < 0.85, block_size, rng.integers(0, block_size + 1, n_used))
        age = rng.exponential(2.0 if ti == 0 else 20.0, cap).astype(np.float32)
        heat = (rng.gamma(1.2, 3.0, cap) * np.exp(-age / 30)).astype(np.float32)
        heat[state == 0] = 0
        owner[state == 1] = np.where(rng.random(int((state == 1).sum())) < 0.5, -1, owner[state == 1])
        hashed = (fill == block_size) & (state != 0)
        tiers.append(TierSnapshot(name=("device", "host")[ti], capacity=cap, block_bytes=2 * block_size * 8 * 64 * 2
                                  * 24, state=state, owner=owner, ref=ref, fill=fill, heat=heat, age=age,
                                  hashed=hashed))
        inuse = np.flatnonzero(owner >= 0)
        order = np.argsort(owner[inuse], kind="stable")
        ids, starts = np.unique(owner[inuse][order], return_index=True)
        for sid, part in zip(ids, np.split(inuse[order], starts[1:])):
            slots_of.setdefault(int(sid), []).append((ti, part))
    ids = np.arange(n_seqs, dtype=np.int32)
    bt, bsl = [], []
    for sid in ids:
        parts = slots_of.get(int(sid), [])
        bt.append(np.concatenate([np.full(len(p), ti, np.int8) for ti, p in parts]) if parts and tables
                  else np.zeros(0, np.int8))
        bsl.append(np.concatenate([p for _, p in parts]).astype(np.int64) if parts and tables
                   else np.zeros(0, np.int64))
    z = np.zeros(n_seqs, np.int32)
    seqs = SeqTable(id=ids, state=np.ones(n_seqs, np.int8), tokens=z, generated=z,
                    blocks_device=np.array([sum(len(p) for ti, p in slots_of.get(int(s), []) if ti == 0) for s in ids],
                                           np.int32),
                    blocks_host=np.array([sum(len(p) for ti, p in slots_of.get(int(s), []) if ti == 1) for s in ids],
                                         np.int32),
                    tokens_per_s=np.zeros(n_seqs, np.float32), ttft=np.zeros(n_seqs, np.float32),
                    prefix_reused=z, labels=tuple(f"req-{i}" for i in ids), block_tier=tuple(bt),
                    block_slot=tuple(bsl))
    return Snapshot(t=t, model={}, config={"block_size": block_size}, tiers=tuple(tiers), seqs=seqs, counters={},
                    windowed={}, memory={}, series={}, residency={})


def bench_block_map(n_blocks: int, frames: int = 30) -> dict:
    """Median / max ms per frame (set_snapshot + the event loop's repaint of a shown 1400×700 map) per mode,
    over `frames` frames alternating between three random snapshots of n_blocks (¼ device, ¾ host), with a
    sequence selected. Also splits each frame into set_snapshot (numpy codes) and paint."""
    app = QApplication.instance() or QApplication([])
    dev = n_blocks // 4
    snaps = [fake_snapshot((dev, n_blocks - dev), n_seqs=500, seed=s, tables=False) for s in range(3)]
    w = BlockMap()
    w.resize(1400, 700)
    w.show()
    app.processEvents()
    w.set_snapshot(snaps[0])
    w.set_selected(7)
    app.processEvents()
    out: dict = {"n_blocks": n_blocks, "frames": frames, "image_shape": w.codes.shape, "modes": {}}
    for mode in MODES:
        w.set_mode(mode)
        app.processEvents()
        total, setsnap, paints = [], [], 0
        for f in range(frames):
            p0 = w.image.paints
            t0 = time.perf_counter()
            w.set_snapshot(snaps[f % 3])
            t1 = time.perf_counter()
            app.processEvents()
            if w.image.paints == p0:  # the event loop did not paint: force it, and count that too
                w.view.viewport().repaint()
            t2 = time.perf_counter()
            paints += w.image.paints - p0
            total.append(1e3 * (t2 - t0))
            setsnap.append(1e3 * (t1 - t0))
        out["modes"][mode] = {"median_ms": float(np.median(total)), "max_ms": float(np.max(total)),
                              "set_snapshot_median_ms": float(np.median(setsnap)),
                              "paint_median_ms": float(np.median(np.subtract(total, setsnap))),
                              "paints_per_frame": paints / frames}
    w.close()
    w.deleteLater()
    app.processEvents()
    return out


if __name__ == "__main__":
    import json
    import sys

    for n in (int(a) for a in sys.argv[1:] or ["1000000", "100000"]):
        print(json.dumps(bench_block_map(n), indent=1))
