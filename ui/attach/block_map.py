"""The attach window's block map: one framed grid per endpoint × data-parallel rank × medium, each cell a block
placed by its hash, coloured by a mode; hover for what the events say about a block.

One ImageItem draws every group through a 256-entry LUT (the same fast path and grid as the engine's block map,
ui/block_map/widget.py); the codes are ui/attach/codes.py. The widget never touches the session: the window gives it
snapshots and a function that looks a block up.
"""

from __future__ import annotations

import html
import math
import time
from typing import Callable

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QFont, QFontMetrics, QPen
from PySide6.QtWidgets import QComboBox, QGraphicsPathItem, QHBoxLayout, QLabel, QToolTip, QVBoxLayout, QWidget

from engine.attach.cluster import MODES, ClusterSnapshot
from engine.attach.events import plain
from ui import palette as pal
from ui.attach.codes import LOG_MODES, AttachCodes, mode_lut
from ui.block_map.code_image import CodeImage
from ui.block_map.grid import GridLayout, grid_layout
from ui.block_map.legend import _fmt_seconds, _fmt_value, _Legend, _log_ticks
from ui.block_map.widget import frame_tiers

def _short(v, n: int = 80) -> str:
    t = v if isinstance(v, str) else repr(v)
    return html.escape(t if len(t) <= n else t[: n - 1] + "…", quote=False)


def meta_lines(info: dict) -> list[str]:
    """Tooltip lines (HTML, escaped) for what the block's event said beyond the map's columns: LoRA, session,
    cache salt, locality / ownership, its own extra hash keys and lookahead tokens, an EAGLE bigram page, a
    hash-only placeholder."""
    m = info.get("meta") or {}
    lines = []
    lora = info.get("lora", -1)
    if m.get("lora_name") or lora >= 0:
        lines.append("LoRA " + " ".join(x for x in (_short(m["lora_name"]) if m.get("lora_name") else "",
                                                     f"(id {lora})" if lora >= 0 else "") if x))
    if m.get("session_id"):
        lines.append(f"session {_short(m['session_id'])}")
    if m.get("cache_salt"):
        lines.append(f"cache salt {_short(m['cache_salt'])}")
    where = [f"{k} {_short(m[k])}" for k in ("locality", "ownership") if m.get(k)]
    if where:
        lines.append(", ".join(where))
    i = info.get("index", 0)
    for key, what in (("extra_keys", "extra hash keys"), ("lookahead_token_ids", "lookahead tokens")):
        v = plain(m.get(key))
        if isinstance(v, list) and v:
            v = v[i] if i < len(v) else None  # one entry per block of the event
        if v:
            lines.append(f"{what} {_short(v)}")
    if m.get("bigram"):
        lines.append("<i>EAGLE bigram page: its token ids came as (token, next token) pairs; the tokens shown are "
                     "the first of each</i>")
    if m.get("placeholder"):
        lines.append("<i>placeholder: the offloading connector published this block's hash only (no tokens, "
                     "no parent)</i>")
    return lines


def titled_layout(caps: tuple[int, ...], w: float, h: float, title: float) -> GridLayout:
    """The maps' grid for a view of w × h pixels: every map shown (the view spans all rows and a gap above
    each map) with a gap of at least `title` pixels for its title, at the largest cell the view allows.
    (grid_layout sizes its gap against one map's rows, so with more than a couple of maps the titles sat on
    the maps above, and a larger share there makes the layout taller than its columns assume.) Where n
    titles cannot fit the height at all, grid_layout's layout: the maps stay in view, titles may touch."""
    n = len(caps)
    if w <= 50 or h <= 50 or not n or n * title >= 0.9 * h:
        return grid_layout(caps, w / h if w > 50 and h > 50 else 2.0, title / h if h > 50 else 0.0)
    t = 1.03 * title  # the view's 1 % padding on each side
    c0 = max(1.0, math.sqrt(max(sum(caps), 1) * w / h))
    best = None
    for c in sorted({min(32000, max(1, round(c0 * 2 ** (k / 8)))) for k in range(-48, 49)}):
        rows = tuple(-(-cap // c) for cap in caps)
        r = sum(rows)
        gap = max(1, math.ceil(t * c / w), math.ceil(t * r / (h - n * t)))  # wide enough, and tall enough
        scale = min(w / c, h / (r + n * gap))  # pixels per cell
        if best is None or scale > best[0]:
            best = (scale, c, rows, gap)
    _, cols, rows, gap = best
    tops = tuple(sum(rows[:i]) + i * gap for i in range(n))
    return GridLayout(cols=cols, capacities=tuple(caps), tops=tops, rows=rows, gap=gap,
                      height=max(sum(rows) + (n - 1) * gap, 1))


def title_fitted(fm: QFontMetrics, label: str, count: str, note: str, room: int) -> str:
    """A map's title in `room` pixels: the label, its block count, and what frames the count (`note`); where
    that does not fit, the note goes, then the label is cut in the middle (the count always stays; the
    tooltip of any block names the map in full)."""
    whole = f"{label}   {count}{note}"
    if fm.horizontalAdvance(whole) <= room:
        return whole
    tail = f"   {count}"
    if fm.horizontalAdvance(label + tail) <= room:
        return label + tail
    return fm.elidedText(label, Qt.TextElideMode.ElideMiddle, max(room - fm.horizontalAdvance(tail), 0)) + tail


MODE_TIPS = {
    "age": "seconds since the block was stored (this residency)",
    "idle": "seconds since the block was last touched: stored, or named as the parent of a later store",
    "heat": "touches with exponential decay (half-life set by --half-life): heat = heat·2^(−Δt/half-life) + 1",
    "reuse": "how many later BlockStored events named this block as their parent (each is a request that read "
             "it just before computing new blocks; hits that computed nothing are not published)",
    "family": "the root of the block's prefix chain (same colour = same system prompt / shared prefix); "
              "with --tokenizer the tooltip shows the root's text",
    "depth": "blocks above this one in its prefix chain (grey: the chain above was never seen)",
}


class AttachMap(QWidget):
    def __init__(self, parent: QWidget | None = None, mode: str = "age"):
        super().__init__(parent)
        self._snap: ClusterSnapshot | None = None
        self._cells = AttachCodes()
        self._mode = mode
        self._labels_text: list[str] = []  # each map's whole title
        self._labels_shown: list[tuple] = []  # (whole title, room in pixels, the text shown: cut to the room)
        self.info_fn: Callable[[tuple, int], dict | None] | None = None  # (group key, cell) -> block info
        self.describe_fn: Callable[[dict], str] | None = None  # block info -> tooltip HTML
        self.capacity_fn: Callable[[tuple], int | None] | None = None  # group key -> blocks (from /metrics)
        self.decode_fn: Callable[[list[int]], str] | None = None  # token ids -> text (given a tokenizer)
        self.hover_text = ""
        self.frame_ms = 0.0

        self.view = pg.GraphicsView(background=pal.qcolor(pal.BACKGROUND))
        self.vb = pg.ViewBox(lockAspect=1.0, invertY=True, enableMenu=False, defaultPadding=0.01)
        self.vb.disableAutoRange()
        self.view.setCentralItem(self.vb)
        self.image = CodeImage(axisOrder="row-major")
        self.image.setImage(self._cells.codes, autoLevels=False, levels=(0, 256))
        self.vb.addItem(self.image)
        self._frame_pen = QPen(pal.qcolor(pal.FRAME))
        self._frame_pen.setCosmetic(True)
        self._frames: list[QGraphicsPathItem] = []
        self._labels: list[pg.TextItem] = []
        self._font = QFont(self.font())
        self._font.setPointSizeF(9.0)
        self._font.setBold(True)

        self.mode_box = QComboBox()
        self.mode_box.addItems(MODES)
        for i, m in enumerate(MODES):
            self.mode_box.setItemData(i, MODE_TIPS[m], Qt.ItemDataRole.ToolTipRole)
        self.mode_box.setToolTip("colour the blocks by")
        self.mode_box.setCurrentText(mode)
        self.mode_box.currentTextChanged.connect(self.set_mode)
        self.legend = _Legend()
        self.placement = QLabel("placed by hash, not slot")
        self.placement.setToolTip("KV events name blocks by hash only. A block keeps its cell while resident, and "
                                  "the same hash takes the same place on every rank's map.")
        bar = QHBoxLayout()
        bar.setContentsMargins(4, 0, 4, 2)
        bar.addWidget(self.mode_box)
        bar.addWidget(self.legend, 1)
        bar.addWidget(self.placement)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(2)
        lay.addWidget(self.view, 1)
        lay.addLayout(bar)
        self.view.scene().sigMouseMoved.connect(self._on_mouse_moved)
        self.set_mode(mode)

    # -- public ---------------------------------------------------------------------------------------
    def mode(self) -> str:
        return self._mode

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; one of {MODES}")
        self._mode = mode
        if self.mode_box.currentText() != mode:
            self.mode_box.setCurrentText(mode)
        self.image.setLookupTable(mode_lut(mode), update=True)
        self.mode_box.setToolTip(MODE_TIPS[mode])
        self._update_legend()

    @property
    def codes(self) -> np.ndarray:
        v = self._cells.codes.view()
        v.flags.writeable = False
        return v

    def group_codes(self, i: int) -> np.ndarray:
        lay = self._cells.layout
        return self.codes.reshape(-1)[lay.offsets[i]:lay.offsets[i] + lay.capacities[i]]

    def label_texts(self) -> list[str]:
        return list(self._labels_text)

    def set_snapshot(self, snap: ClusterSnapshot) -> None:
        t0 = time.perf_counter()
        self._snap = snap
        caps = tuple(len(g.codes) for g in snap.groups)
        lay = self._cells.layout
        if lay is None or caps != lay.capacities:
            self._relayout(caps)
        if snap.groups:
            self._cells.draw(snap)
        self.image.updateImage()
        self._update_labels()
        self._update_legend()
        self.frame_ms = 1e3 * (time.perf_counter() - t0)

    def reset_view(self) -> None:
        lay = self._cells.layout
        if lay is not None:
            self.vb.setRange(QRectF(0, -lay.gap, lay.cols, lay.height + lay.gap), padding=0.01)

    def cell_at(self, x: float, y: float) -> tuple[int, int] | None:
        """(group index, cell) at view coordinates, or None."""
        lay = self._cells.layout
        return None if lay is None or self._snap is None else lay.at(x, y)

    def tooltip_for(self, group: int, cell: int) -> str:
        g = self._snap.groups[group]
        info = self.info_fn(g.key, cell) if self.info_fn else None
        if info is None:
            return f"<b>{html.escape(g.label)}</b><br>no block at this hash position (not a free slot: slots are " \
                   f"not published)"
        return f"<b>{html.escape(g.label)}</b><br>" + (self.describe_fn(info) if self.describe_fn
                                                      else html.escape(str(info)))

    # -- drawing --------------------------------------------------------------------------------------
    def _layout(self, caps: tuple[int, ...]) -> GridLayout:
        title = (QFontMetrics(self._font).height() + 10) / 0.85 + 3  # a title sits 0.15 gap above its map
        return titled_layout(caps, self.view.width(), self.view.height(), title)

    def _relayout(self, caps: tuple[int, ...]) -> None:
        lay = self._layout(caps)
        self._cells.relayout(lay)
        self.image.setImage(self._cells.codes, autoLevels=False, levels=(0, 256))
        self._frames, self._labels = frame_tiers(self.vb, lay, len(caps), self._frames + self._labels,
                                                 self._frame_pen, self._font)
        self._labels_text = [""] * len(caps)
        self._labels_shown = [()] * len(caps)
        self.reset_view()

    def resizeEvent(self, ev) -> None:
        """A new shape of the view lays the maps out afresh (columns for its aspect, gaps for the titles)."""
        super().resizeEvent(ev)
        lay = self._cells.layout
        if self._snap is None or lay is None:
            return
        want = self._layout(lay.capacities)
        if abs(want.cols - lay.cols) > 0.15 * lay.cols or want.gap != lay.gap:
            self._relayout(lay.capacities)
            if self._snap.groups:
                self._cells.draw(self._snap)
            self.image.updateImage()
            self._update_labels()

    def _update_labels(self) -> None:
        fm = QFontMetrics(self._font)
        right = self.view.width() - 6
        for i, g in enumerate(self._snap.groups):
            cap = self.capacity_fn(g.key) if self.capacity_fn else None
            n = g.resident
            count = f"{n:,} block{'' if n == 1 else 's'}"
            rs = g.restores or {}
            if rs.get("re_stores"):  # engine/attach/restores.py: stores of a hash this cache removed before
                count += f" · {rs['re_stores']:,} re-stored ({100 * rs['re_store_share']:.1f} % of stores)"
            # More resident than the server holds: removals this session did not see (lost events, stores
            # counted twice across a restart); the server itself never holds more than num_gpu_blocks.
            over = f", {n - cap:,} over: removals not seen" if cap and n > cap else ""
            note = f" (num_gpu_blocks, /metrics{over})" if cap else " (capacity: not in the events)"
            text = f"{g.label}   {count}{f' of {cap:,}' if cap else ''}{note}"
            self._labels_text[i] = text
            room = int(right - self.vb.mapViewToScene(QPointF(0, 0)).x() - 10)  # the text item's margins
            if self._labels_shown[i][:2] == (text, room):
                continue
            shown = title_fitted(fm, g.label, count + (f" of {cap:,}" if cap else ""), note, room)
            self._labels_shown[i] = (text, room, shown)
            self._labels[i].setText(shown)  # its colour is set once, in frame_tiers

    def _update_legend(self) -> None:
        mode = self._mode
        empty = ("swatch", pal.FREE, "no block here")
        rng = self._snap.range if self._snap is not None and self._snap.mode == mode else None
        if mode in LOG_MODES:
            lo, hi = rng if rng and rng[1] > rng[0] > 0 else (LOG_MODES[mode], 1000 * LOG_MODES[mode])
            fmt = _fmt_value if mode == "heat" else _fmt_seconds
            title = {"age": "age since stored (log)", "idle": "idle since last touch (log)", "heat": "heat (log)"}
            items = [("ramp", pal.ramp("heat" if mode == "heat" else "age"), _log_ticks(lo, hi, fmt), title[mode]),
                     empty]
        elif mode == "reuse":
            items = [("swatch", pal.CACHED, "never a parent")]
            items += [("swatch", c, n) for c, n in zip(pal.REF_COLORS, ("1×", "2×", "3×", "4+× named as parent"))]
            items.append(empty)
        elif mode == "family":
            n = self._snap.families if self._snap else 0
            top = self._snap.top_families if self._snap is not None and self._snap.mode == "family" else ()
            items = [("swatch", pal.seq_rgb(fid), f"{self._family_label(fid, toks)} ({blocks:,})")
                     for fid, blocks, toks in top[:3]]
            items.append(("swatch", pal.CACHED, f"{n:,} families (colour: id mod 32)"))
            items.append(empty)
        else:
            hi = rng[1] if rng else 1.0
            items = [("ramp", pal.ramp("fill"), [(0.0, "0"), (1.0, f"{hi:g} blocks")], "depth in prefix chain"),
                     ("swatch", pal.CACHED, "chain above unseen"), empty]
        self.legend.set_items(items)

    def _family_label(self, fid: int, toks) -> str:
        """A family's root text (with a tokenizer), else its first token ids."""
        text = self.decode_fn(list(toks)) if self.decode_fn and toks else " ".join(map(str, toks[:3]))
        text = " ".join(text.split())
        return (text[:16] + "…") if len(text) > 17 else (text or f"family {fid}")

    # -- mouse ----------------------------------------------------------------------------------------
    def _on_mouse_moved(self, scene_pos: QPointF) -> None:
        if self._snap is None:
            return
        p = self.vb.mapSceneToView(scene_pos)
        cell = self.cell_at(p.x(), p.y())
        if cell is None:
            self.hover_text = ""
            QToolTip.hideText()
            return
        self.hover_text = self.tooltip_for(*cell)
        QToolTip.showText(self.view.mapToGlobal(self.view.mapFromScene(scene_pos)), self.hover_text, self.view)
