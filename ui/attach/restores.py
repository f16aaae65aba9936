"""The attach window's "Re-stores" panel (issue 23 item 4): per cache, how many stores were re-stores (a hash the
cache stored and removed before: a prefill recomputed because of an eviction) and the lower-bound curve of what more
blocks would have bought: at +N blocks, the share of the re-stores kept (the newest 65,536) whose removal→re-store
need was ≤ N, i.e. that an LRU cache N blocks larger would still have held. Lower bound: events show stores and
removals, not the lookups that hit, nor a missed block the server did not store again.
Plain values from the session's snapshot (engine/attach/restores.py ReStores.summary); no engine object is read.
"""

from __future__ import annotations


import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtWidgets

COLOURS = ("#4fc3f7", "#ffb74d", "#81c784", "#e57373", "#ba68c8", "#fff176", "#4db6ac", "#f06292")
TIP = ("Re-stores, from KV events alone. A BlockStored of a hash this cache (endpoint × rank × medium × group) "
       "stored and removed before is a re-store: the prefill that wrote it was recomputed because the block had "
       "been evicted. Share = re-stores ÷ stores seen (a hash never seen before is compulsory). The curve: at +N "
       "blocks (log axis), the % of the kept re-stores whose need was ≤ N — need = the cache's removals from this "
       "block's own removal up to its re-store, the extra LRU slots that would have kept it. A LOWER BOUND on what "
       "more blocks buy: events do not show lookups that hit, nor misses the server did not store again.")


def _pct(x: float) -> str:
    return "no data" if x != x else f"{100 * x:.1f} %"


def _secs(x: float) -> str:
    return "no data" if x != x else (f"{x:.2f} s" if x < 60 else f"{x / 60:.1f} min")


def line_text(label: str, rs: dict | None) -> str:
    """One cache's figures in words (what the panel lists; tests read it)."""
    if not rs or not rs.get("stores"):
        return f"{label}: no data (no store seen)"
    head = (f"{label}: re-stored {rs['re_stores']:,} of {rs['stores']:,} stores ({_pct(rs['re_store_share'])}), "
            f"gap p50 {_secs(rs['gap_p50_s'])}")
    if not rs.get("kept"):
        return head + "; no re-stores: nothing more blocks would buy that events can show"
    from engine.attach.restores import curve_text

    return head + "; " + curve_text(rs) + " (lower bound)"


class RestoresPanel(QtWidgets.QWidget):
    """The re-store curve of every cache that has re-stores, and one line of figures per cache."""

    def __init__(self):
        super().__init__()
        self.setToolTip(TIP)
        lay = QtWidgets.QHBoxLayout(self)  # the chart beside the figures: a short dock keeps the chart's height
        lay.setContentsMargins(2, 2, 2, 2)
        self.plot = pg.PlotWidget()
        self.plot.setLogMode(x=True, y=False)
        self.plot.setYRange(0, 100, padding=0.02)
        self.plot.setLabel("bottom", "extra blocks (log scale)")
        self.plot.setLabel("left", "would hit (%)")
        self.plot.showGrid(x=True, y=True, alpha=0.25)
        self.plot.setMouseEnabled(x=False, y=False)
        self.plot.setToolTip(TIP)
        self.plot.setMinimumWidth(160)
        self.legend = self.plot.addLegend(offset=(8, 4))  # top left: the curves rise to the right
        self.note = pg.TextItem("no data: no re-stores seen yet", color="#8a919c", anchor=(0.5, 0.5))
        self.plot.addItem(self.note, ignoreBounds=True)
        self.note.setPos(1.0, 50)
        self.text = QtWidgets.QListWidget()  # one row per cache, wrapped; scrolls when the caches outgrow the dock
        self.text.setWordWrap(True)
        self.text.setToolTip(TIP)
        self.text.setHorizontalScrollBarPolicy(QtCore.Qt.ScrollBarAlwaysOff)
        self.text.setMinimumWidth(120)
        lay.addWidget(self.plot, 3)
        lay.addWidget(self.text, 2)
        self._curves: dict[str, pg.PlotDataItem] = {}
        self._shown: tuple = ()
        self._lines: list[str] = []

    def update_groups(self, groups) -> None:
        """groups: the snapshot's GroupViews (label, restores). Redraws only when a figure changed."""
        key = tuple((g.label, (g.restores or {}).get("stores"), (g.restores or {}).get("re_stores")) for g in groups)
        if key == self._shown:
            return
        self._shown = key
        self._lines = [line_text(g.label, g.restores) for g in groups]
        self.text.clear()
        self.text.addItems(self._lines or ["no caches yet"])
        drawn = set()
        for i, g in enumerate(groups):
            rs = g.restores or {}
            curve, kept = rs.get("curve") or [], rs.get("kept", 0)
            if not kept or not curve:
                continue
            x = np.array([max(k, 1) for k, _ in curve], dtype=float)
            y = np.array([100.0 * m / kept for _, m in curve])
            item = self._curves.get(g.label)
            if item is None:
                c = COLOURS[i % len(COLOURS)]
                item = self.plot.plot(x, y, pen=pg.mkPen(c, width=2), symbol="o", symbolSize=5, symbolBrush=c,
                                      name=" ".join(g.label.replace("full attention", "").split())[:48])
                self._curves[g.label] = item
            else:
                item.setData(x, y)
            drawn.add(g.label)
        for label in list(self._curves):
            if label not in drawn:
                self.plot.removeItem(self._curves.pop(label))
        self.note.setVisible(not drawn)

    def lines(self) -> list[str]:
        return list(self._lines)

    def curve_points(self, label: str) -> tuple[np.ndarray, np.ndarray] | None:
        item = self._curves.get(label)
        return None if item is None else item.getData()
