"""Two snapshots side by side (`kvscope --compare A.json B.json`, File → Compare…): "before / after my change" as
one file pair.

Each side shows its caption, its block maps (one per KV-cache group), its "why missed" bars and the what-if curves
it carries (hit rate against capacity, per KV-cache group; "no data" where it carries none); beneath them one
table lists every knob that differs and every counter of either snapshot with A, B, B − A and the change in %
(rates as a difference in points). `compare_rows` computes that table from the two snapshots alone (no Qt), so the
window, its screenshot JSON and a test read the same rows.
"""

from __future__ import annotations

import json
import math

import numpy as np
from PySide6 import QtCore, QtGui, QtWidgets

from engine.telemetry.snapshot import Snapshot
from ui.block_map.groups import GroupMaps
from ui.panels.what_if import WhatIfPanel
from ui.panels.why_missed import WhyMissedPanel

RATES = ("device_hit_rate", "prefix_hit_rate")


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float):
        return f"{v:,.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _num(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def compare_rows(a: Snapshot, b: Snapshot) -> list[tuple[str, str, str, str, str, str]]:
    """(section, name, A, B, B − A, change) for every knob that differs and every counter either has; "—" where a
    side has no value (or a rate had nothing to divide by). Rates: the difference in points; counts: in % of A."""
    rows = []
    for k in sorted(set(a.config) | set(b.config)):
        va, vb = a.config.get(k), b.config.get(k)
        if va != vb:
            rows.append(("config", k, _fmt(va), _fmt(vb), "", "changed"))
    rows.append(("time", "engine clock (s)", _fmt(a.t), _fmt(b.t), _fmt(b.t - a.t), ""))
    keys = [k for k in RATES if k in a.counters or k in b.counters]
    keys += sorted((set(a.counters) | set(b.counters)) - set(RATES))
    for k in keys:
        va, vb = _num(a.counters.get(k)), _num(b.counters.get(k))
        d = vb - va
        if k in RATES:
            change = "—" if math.isnan(d) else f"{100 * d:+.1f} points"
            pct = lambda x: "—" if math.isnan(x) else f"{100 * x:.1f} %"  # noqa: E731
            rows.append(("rates", k, pct(va), pct(vb), "—" if math.isnan(d) else f"{100 * d:+.1f}", change))
        else:
            change = "—" if math.isnan(d) or not va else f"{100 * d / va:+.1f} %"
            section = "why missed" if k.startswith(("miss_", "read_miss_", "lookup_")) else "counters"
            rows.append((section, k, _fmt(_int(va)), _fmt(_int(vb)), _fmt(_int(d)), change))
    return rows + what_if_rows(a, b)


def what_if_rows(a: Snapshot, b: Snapshot) -> list[tuple[str, str, str, str, str, str]]:
    """Per KV-cache group and policy either snapshot has curves of: the hit rate its curve reads at the capacity
    that snapshot had (Snapshot.what_if; "—" where a side has no curve)."""
    def at(snap: Snapshot) -> dict:
        out = {}
        for g in snap.what_if.get("groups", []):
            for c in g["curves"]:
                caps, hit = np.asarray(c["capacities"], dtype=np.float64), np.asarray(c["hit_rate"])
                x = np.log(max(g["current_blocks"], 1))
                out[(g["group"], c["policy"])] = float(np.interp(x, np.log(caps), hit)) if len(caps) else math.nan
        return out

    va, vb = at(a), at(b)
    rows = []
    for g, policy in sorted(set(va) | set(vb)):
        x, y = va.get((g, policy), math.nan), vb.get((g, policy), math.nan)
        pct = lambda v: "—" if math.isnan(v) else f"{100 * v:.1f} %"  # noqa: E731
        d = "—" if math.isnan(y - x) else f"{100 * (y - x):+.1f}"
        rows.append(("what if", f"group {g} {policy} at its capacity", pct(x), pct(y), d,
                     "—" if d == "—" else f"{d} points"))
    return rows


def _int(v: float):
    return int(v) if v == v and float(v).is_integer() else v


class _Side(QtWidgets.QWidget):
    """One snapshot: its caption, block maps and why-missed bars."""

    def __init__(self, name: str, snap: Snapshot, caption: str):
        super().__init__()
        lay = QtWidgets.QVBoxLayout(self)
        lay.setContentsMargins(2, 2, 2, 2)
        self.title = QtWidgets.QLabel(f"<b>{name}</b>  {caption}")
        self.title.setToolTip(caption)
        self.title.setSizePolicy(QtWidgets.QSizePolicy.Ignored, QtWidgets.QSizePolicy.Preferred)
        lay.addWidget(self.title)
        self.maps = GroupMaps()
        self.maps.set_snapshot(snap)
        lay.addWidget(self.maps, 3)
        self.why = WhyMissedPanel()
        self.why.update_snapshot(snap)
        lay.addWidget(self.why, 1)
        self.what_if = WhatIfPanel(None)  # the what-if curves the snapshot carries (Snapshot.what_if), if any
        self.what_if.show_saved(snap.what_if)
        lay.addWidget(self.what_if, 1)


class CompareWindow(QtWidgets.QMainWindow):
    def __init__(self, a: Snapshot, b: Snapshot, names: tuple[str, str] = ("A", "B"),
                 captions: tuple[str, str] = ("", "")):
        super().__init__()
        self.setWindowTitle(f"KV Scope — compare {names[0]} and {names[1]}")
        self.a, self.b, self.names = a, b, names
        split = QtWidgets.QSplitter(QtCore.Qt.Vertical)
        sides = QtWidgets.QSplitter(QtCore.Qt.Horizontal)
        self.sides = [_Side(n, s, c) for n, s, c in zip(names, (a, b), captions)]
        for side in self.sides:
            sides.addWidget(side)
        split.addWidget(sides)
        self.rows = compare_rows(a, b)
        self.table = QtWidgets.QTableWidget(len(self.rows), 6)
        self.table.setHorizontalHeaderLabels(["", "counter", names[0], names[1], f"{names[1]} − {names[0]}",
                                              "change"])
        self.table.horizontalHeaderItem(5).setToolTip("rates: the difference in points; counts: B − A in % of A; "
                                                      "— where a side has no value or A is 0")
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QtWidgets.QAbstractItemView.NoEditTriggers)
        for r, row in enumerate(self.rows):
            for c, text in enumerate(row):
                item = QtWidgets.QTableWidgetItem(text)
                if c >= 2:
                    item.setTextAlignment(QtCore.Qt.AlignRight | QtCore.Qt.AlignVCenter)
                self.table.setItem(r, c, item)
        self.table.resizeColumnsToContents()
        split.addWidget(self.table)
        split.setSizes([520, 260])
        self.setCentralWidget(split)
        self.resize(1260, 700)

    def show_fitted(self) -> None:
        avail = (self.screen() or QtGui.QGuiApplication.primaryScreen()).availableGeometry()
        if self.width() > avail.width() or self.height() > avail.height():
            self.setGeometry(avail)
        self.show()

    def refresh_all(self) -> None:
        for side in self.sides:
            side.why.update()

    def save_screenshot(self, path: str) -> str:
        """The window as PNG and, beside it, the comparison's rows as JSON; returns the JSON's path."""
        if not self.grab().save(path):
            raise OSError(f"cannot write {path}")
        json_path = path.rsplit(".", 1)[0] + ".json"
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump({"compare": list(self.names), "rows": [list(r) for r in self.rows]}, f, indent=1)
        return json_path
