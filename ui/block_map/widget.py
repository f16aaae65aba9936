"""The block map: every slot of every tier as one cell of one uint8 code image.

Layout: each tier is a row-major grid with the same column count, device first, then a gap, then host, so a
tier's slots are one contiguous slice of the flat code buffer and a frame is a few whole-array numpy passes
written in place. The image is drawn by one ImageItem through a 256-entry LUT (pyqtgraph's Indexed8 fast
path); codes above palette.VALUE_MAX mean free / cached / selected / background in every mode.

This module holds the widget: view, layout, labels, legend, mouse. The grid is ui/block_map/grid.py, the code
image ui/block_map/codes.py, the legend strip ui/block_map/legend.py, fake snapshots and the bench
ui/block_map/bench.py.
"""

from __future__ import annotations

import time

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPoint, QPointF, QRectF, Qt, Signal
from PySide6.QtGui import QFont, QFontMetrics, QPainterPath, QPen
from PySide6.QtWidgets import QComboBox, QGraphicsPathItem, QHBoxLayout, QToolTip, QVBoxLayout, QWidget

from engine.telemetry.snapshot import SeqTable, Snapshot
from ui import palette as pal
from ui.block_map.codes import BlockCodes
from ui.block_map.code_image import CodeImage
from ui.block_map.grid import GridLayout, grid_layout
from ui.block_map.legend import _fmt_seconds, _fmt_value, _Legend, _log_ticks
from ui.panels.kv_cost import ERROR_MEANING, error_legend, error_lines

MODES = ("state", "owner", "heat", "ref", "fill", "age", "kv error")



WHY_HOST = {1: "demoted after idling past demote_after_s", 2: "no device room (written there, demoted for room, "
            "evicted or swapped out)", 3: "a re-lay or budget change"}
GONE = {1: "evicted", 2: "dropped by a config change"}


def history_lines(t, slot: int) -> list[str]:
    """A block's history (engine/kv/misses.py): why it is on the host tier, and its hash's earlier lives."""
    if t.stores is None or not int(t.state[slot]):
        return []
    out = []
    if t.name == "host" and int(t.why[slot]) in WHY_HOST:
        out.append(f"on the host tier: {WHY_HOST[int(t.why[slot])]}")
    if bool(t.hashed[slot]):
        n = int(t.stores[slot])
        if n == 0:
            out.append("history: first stored")
        else:
            by = GONE.get(int(t.gone_by[slot]))
            ago = float(t.gone_age[slot])
            last = f"; its last copy {by} {_fmt_age(ago)} ago, then re-stored" if by and ago == ago else ""
            out.append(f"history: stored {n} time{'s' if n != 1 else ''} before{last}")
    return out

class BlockMap(QWidget):
    """Every block of both tiers, coloured by a mode; click a block to select its sequence."""

    sequenceSelected = Signal(int)

    def __init__(self, parent: QWidget | None = None, mode: str = "state"):
        super().__init__(parent)
        self._snap: Snapshot | None = None
        self._layout: GridLayout | None = None
        self._cells = BlockCodes()
        self._mode = "state"
        self._selected = -1
        self._block_size = 0
        self._legend_key: tuple | None = None
        self._hover: tuple[int, int] | None = None
        self._hover_scene: QPointF | None = None
        self.hover_text = ""
        self.frame_ms = 0.0  # cost of the last set_snapshot (codes, labels, legend), paint excluded

        self.view = pg.GraphicsView(background=pal.qcolor(pal.BACKGROUND))
        self.vb = pg.ViewBox(lockAspect=1.0, invertY=True, enableMenu=False, defaultPadding=0.01)
        self.vb.disableAutoRange()
        self.view.setCentralItem(self.vb)
        self.image = CodeImage(axisOrder="row-major")
        self.image.setImage(self._cells.codes, autoLevels=False, levels=(0, 256))
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
        self.mode_box.setToolTip("colour the blocks by; kv error: " + ERROR_MEANING)
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
        v = self._cells.codes.view()
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
        return None if self._layout is None else self._layout.at(x, y)

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
                 f"fill: {int(t.fill[slot])}/{bs} token{'' if bs == 1 else 's'}",
                 f"heat: {float(t.heat[slot]):.3g}",
                 f"age: {_fmt_age(float(t.age[slot])) if st else '—'}",
                 f"hashed: {'yes' if bool(t.hashed[slot]) else 'no'}"]
        return "<br>".join(lines + history_lines(t, slot) + error_lines(t, slot, str(snap.config.get("kv_dtype", ""))))

    # -- layout -----------------------------------------------------------------------------------
    def _aspect(self) -> float:
        w, h = self.view.width(), self.view.height()
        return w / h if w > 50 and h > 50 else 2.0

    def _label_share(self) -> float:
        """The share of the view's height a tier's gap needs: the label (its text and the text item's
        margins) sits 0.15 gap above its tier, so the gap is the label's height / 0.85, and a margin."""
        h = self.view.height()
        return ((QFontMetrics(self._label_font).height() + 10) / 0.85 + 3) / h if h > 50 else 0.0

    def _relayout(self, caps: tuple[int, ...]) -> None:
        lay = grid_layout(caps, self._aspect(), self._label_share())
        self._layout = lay
        self._cells.relayout(lay)
        self.image.setImage(self._cells.codes, autoLevels=False, levels=(0, 256))
        self._frames, self._labels = frame_tiers(self.vb, lay, len(caps), self._frames + self._labels,
                                                 self._frame_pen, self._label_font)
        self._label_texts = [""] * len(caps)
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
        want = grid_layout(self._layout.capacities, self._aspect(), self._label_share())
        if abs(want.cols - self._layout.cols) > 0.15 * self._layout.cols or want.gap != self._layout.gap:
            self._relayout(self._layout.capacities)
            self._redraw()
            self._update_labels()

    # -- drawing ----------------------------------------------------------------------------------
    def _apply_lut(self) -> None:
        self.image.setLookupTable(pal.mode_lut(self._mode, self._block_size or 16), update=True)

    def _redraw(self) -> None:
        self._cells.draw(self._snap, self._mode, self._block_size, self._selected)
        self.image.updateImage()
        self._update_legend()

    def _update_labels(self) -> None:
        for i, t in enumerate(self._snap.tiers):
            used = t.used
            mib = t.block_bytes / 2 ** 20
            text = f"{t.name}   {used:,} / {t.capacity:,} blocks"
            if t.block_bytes:
                text += f"   ({used * mib:,.1f} / {t.capacity * mib:,.1f} MiB)"
            if text != self._label_texts[i]:
                self._label_texts[i] = text
                self._labels[i].setText(text)  # its colour is set once, in frame_tiers

    def label_texts(self) -> list[str]:
        return list(getattr(self, "_label_texts", []))

    def _update_legend(self) -> None:
        mode = self._mode
        dtype = str(self._snap.config.get("kv_dtype", "")) if self._snap is not None else ""
        key = (mode, self._cells.ranges.get(mode), self._block_size, self._selected, self._seq_label(self._selected),
               dtype)
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
            lo, hi = self._cells.ranges.get(mode, (1e-3, 1.0))
            fmt = _fmt_value if mode == "heat" else _fmt_seconds
            title = "heat (log)" if mode == "heat" else "age since last access (log)"
            items = [("ramp", pal.ramp(mode), _log_ticks(lo, hi, fmt), title), ("swatch", pal.FREE, "free")]
        elif mode == "fill":
            bs = self._block_size or 16
            ticks = [(0.0, "0")] + ([(0.5, f"{bs // 2}")] if bs >= 4 else []) + [
                (1.0, f"{bs} token{'' if bs == 1 else 's'}")]
            items = [("ramp", pal.ramp("fill"), ticks, "fill"), ("swatch", pal.FREE, "free")]
        elif mode == "kv error":
            items = error_legend(dtype)
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


def frame_tiers(vb, lay, n: int, old: list, pen, font) -> tuple[list, list]:
    """Replace the `old` frame and label items in `vb` by a frame (BlockMap._outline) and an empty label above each
    of the n areas of layout `lay`, and bound the view to the layout; (frames, labels)."""
    for it in old:
        vb.removeItem(it)
    frames, labels = [], []
    for i in range(n):
        item = QGraphicsPathItem(BlockMap._outline(lay, i))
        item.setPen(pen)
        item.setZValue(5)
        vb.addItem(item)
        frames.append(item)
        label = pg.TextItem(anchor=(0, 1), color=pal.qcolor(pal.TEXT))
        label.setFont(font)
        label.setPos(0, lay.tops[i] - 0.15 * lay.gap)
        label.setZValue(6)
        vb.addItem(label)
        labels.append(label)
    vb.setLimits(xMin=-lay.cols, xMax=2 * lay.cols, yMin=-lay.height - lay.gap, yMax=2 * lay.height,
                 minXRange=4, minYRange=4)
    return frames, labels
