"""The inspector's list panels: the sequences table and the event feed. Each reads snapshots (numpy arrays,
frozen dataclasses) or engine events and nothing else, and paints its visible rows itself (one `drawText` per
cell or line), at a fraction of what style-drawn items cost.
"""

from __future__ import annotations

import math
import time

import numpy as np
from PySide6 import QtCore, QtGui, QtWidgets

from engine.kv.misses import PROMPT_REASONS, READ_REASONS
from engine.telemetry.snapshot import Snapshot
from ui.palette import seq_color

STATE_NAMES = {0: "waiting", 1: "running", 2: "paused", 3: "preempted", 4: "finished"}


def _visible_rows(view: QtWidgets.QAbstractItemView, count: int) -> range:
    """The rows of a uniform-height item view that intersect its viewport."""
    if count == 0:
        return range(0)
    first = view.indexAt(QtCore.QPoint(1, 1)).row()
    last = view.indexAt(QtCore.QPoint(1, view.viewport().height() - 1)).row()
    first = 0 if first < 0 else first
    last = count - 1 if last < 0 else last
    return range(first, last + 1)


class SequencesPanel(QtWidgets.QTableWidget):
    """Every live sequence and the latest finished ones. The items hold the texts (selection, keyboard,
    accessibility, tests read them); the viewport paints the visible rows itself, straight from the row
    texts, at a fraction of what a style-drawn cell costs (one `drawText` per cell)."""

    COLS = ("id", "label", "state", "tokens", "gen", "dev", "host", "tok/s", "TTFT", "reused")
    TIPS = ("sequence id (the swatch is its colour in the block map's owner mode)", "workload label",
            "running, paused (or the engine is), preempted, waiting or finished",
            "tokens in the sequence (prompt + generated)",
            "tokens generated", "blocks on the device tier", "blocks on the host tier", "decode tokens per second",
            "time to first token, ms", "prompt tokens reused from the prefix cache")
    # The widest text each column must show whole (besides its header): 5-digit ids and counts, a
    # workload label, the longest state, a rate, a time in ms.
    SAMPLES = ("99999", "long-chat-99", "preempted", "99999", "9999", "9999", "9999", "999.9", "99999", "99999")
    SWATCH = 12  # the id column's colour swatch
    PAD = 3  # text inset, each side of a cell
    LABEL = 1  # the column that gives way (elided) when the table is narrower than its contents
    NUMERIC = frozenset(range(3, 10))
    STATE_COLOURS = {"running": "#81c784", "paused": "#ffb74d", "preempted": "#e57373", "waiting": "#aab0b8",
                     "finished": "#737a84"}
    sequenceSelected = QtCore.Signal(int)

    def __init__(self):
        super().__init__(0, len(self.COLS))
        self.setHorizontalHeaderLabels(self.COLS)
        for c, tip in enumerate(self.TIPS):
            self.horizontalHeaderItem(c).setToolTip(tip)
        self.verticalHeader().setVisible(False)
        self.setSelectionBehavior(QtWidgets.QAbstractItemView.SelectRows)
        self.setSelectionMode(QtWidgets.QAbstractItemView.SingleSelection)
        self.setEditTriggers(QtWidgets.QAbstractItemView.NoEditTriggers)
        self.setShowGrid(False)
        # Fixed widths, measured once from the fonts: ResizeToContents re-measures every row on each setText,
        # a frame-time spike.
        header = self.horizontalHeader()
        header.setSectionResizeMode(QtWidgets.QHeaderView.Interactive)
        header.setSectionResizeMode(self.LABEL, QtWidgets.QHeaderView.Stretch)
        header.setStretchLastSection(False)
        header.setMinimumSectionSize(8)
        self.setFont(_small_font(8))  # a font, not a style sheet: style-sheeted item views paint slower
        header.setFont(_small_font(8))
        self.verticalHeader().setDefaultSectionSize(QtGui.QFontMetrics(self.font()).height() + 5)
        self.fit_columns()
        self.itemSelectionChanged.connect(self._selected)
        self._ids: list[int] = []
        self._rows: list[tuple[str, ...]] = []  # texts on screen, per row
        self._updating = False
        self.selected_id = -1
        self.hovered = False  # the pointer is over the rows: they keep their places (see _order)
        self.viewport().installEventFilter(self)

    def header_widths(self) -> list[int]:
        """The width each header needs (its text, the section's padding of 4 a side, a border)."""
        head = self.horizontalHeader().fontMetrics()
        return [head.horizontalAdvance(name) + 10 for name in self.COLS]

    def column_widths(self) -> list[int]:
        """Each column's width: its header or its widest sample text, whichever is wider."""
        cell = QtGui.QFontMetrics(self.font())
        return [max(cell.horizontalAdvance(sample) + 2 * self.PAD + (self.SWATCH if c == 0 else 0) + 1, head)
                for c, (sample, head) in enumerate(zip(self.SAMPLES, self.header_widths()))]

    def _chrome(self) -> int:
        return self.verticalScrollBar().sizeHint().width() + 2 * self.frameWidth() + 2

    def natural_width(self) -> int:
        """The width that shows every column whole, with the vertical scroll bar."""
        return sum(self.column_widths()) + self._chrome()

    def least_width(self) -> int:
        """The narrowest that still shows every column but the label whole (labels are then elided)."""
        widths = self.column_widths()
        widths[self.LABEL] = self.header_widths()[self.LABEL]
        return sum(widths) + self._chrome()

    def fit_columns(self) -> None:
        for c, w in enumerate(self.column_widths()):
            if c != self.LABEL:
                self.setColumnWidth(c, w)
        self.setMinimumWidth(self.least_width())

    def changeEvent(self, event) -> None:
        super().changeEvent(event)
        if event.type() in (QtCore.QEvent.FontChange, QtCore.QEvent.StyleChange):
            self.fit_columns()

    def eventFilter(self, obj, event) -> bool:
        if obj is self.viewport() and event.type() in (QtCore.QEvent.Enter, QtCore.QEvent.Leave):
            self.hovered = event.type() == QtCore.QEvent.Enter
        return super().eventFilter(obj, event)

    def _order(self, s, engine_paused: bool) -> np.ndarray:
        """Rows: live sequences first (newest first), then the most recent finished ones. Under the pointer the
        rows stay where they are (a new sequence on top moved the row being clicked: a click aimed at chat-17
        selected chat-18): the sequences shown keep their rows, new ones join at the bottom, until it leaves."""
        live = np.flatnonzero(s.state != 4)
        done = np.flatnonzero(s.state == 4)
        order = np.concatenate((live[np.argsort(-s.id[live])], done[np.argsort(-s.id[done])][:40]))
        if not self.hovered or not self._ids:
            return order
        index = {int(sid): i for i, sid in enumerate(s.id)}
        kept = [index[sid] for sid in self._ids if sid in index]
        shown = set(self._ids)
        new = [i for i in order if int(s.id[i]) not in shown]
        return np.asarray(kept + new, dtype=np.int64)

    def update_snapshot(self, snap: Snapshot, engine_paused: bool = False) -> None:
        """engine_paused: the engine is paused, so no sequence runs (its state says "running": admitted) and
        none generates; they show "paused" and 0.0 tok/s."""
        s = snap.seqs
        self._why = dict(zip((int(i) for i in s.id), s.why_missed)) if s.why_missed else {}
        order = self._order(s, engine_paused)
        self._updating = True
        if self.rowCount() != len(order):
            self.setRowCount(len(order))
            self._rows = self._rows[: len(order)]
        self._ids = [int(s.id[i]) for i in order]
        for r, i in enumerate(order):
            ttft = s.ttft[i]
            state = STATE_NAMES.get(int(s.state[i]), "?")
            stopped = engine_paused and state != "finished"
            vals = (str(int(s.id[i])), s.labels[i], "paused" if stopped and state == "running" else state,
                    str(int(s.tokens[i])), str(int(s.generated[i])), str(int(s.blocks_device[i])),
                    str(int(s.blocks_host[i])), "0.0" if stopped else f"{s.tokens_per_s[i]:.1f}",
                    "" if math.isnan(ttft) else f"{ttft * 1e3:.0f}",
                    str(int(s.prefix_reused[i])))
            old = self._rows[r] if r < len(self._rows) else None
            if old == vals:
                continue  # touching a cell, even with the same text, costs a relayout of the row
            for c, text in enumerate(vals):
                if old is not None and old[c] == text:
                    continue
                item = self.item(r, c)
                if item is None:
                    item = QtWidgets.QTableWidgetItem()
                    self.setItem(r, c, item)
                item.setText(text)
                if c == self.LABEL:
                    item.setToolTip(text)  # the whole label, where the column is too narrow for it
            if r < len(self._rows):
                self._rows[r] = vals
            else:
                self._rows.append(vals)
        self._mark_selected()
        self._updating = False

    def why_text(self, sid: int) -> str:
        """The hover of a sequence's row: its missed tokens by reason (engine/kv/misses.py)."""
        why = getattr(self, "_why", {}).get(sid)
        if why is None:
            return f"sequence {sid}: no miss reasons recorded (a snapshot from before they were kept)"
        prompt = {r: n for r, n in why.items() if r in PROMPT_REASONS and n}
        reads = {r: n for r, n in why.items() if r in READ_REASONS and n}
        line = lambda d: ", ".join(f"{r} {n:,}" for r, n in sorted(d.items(), key=lambda x: -x[1])) or "none"  # noqa
        return (f"<b>sequence {sid}</b>: why it missed<br>prompt tokens not served by the prefix cache: "
                f"{line(prompt)}<br>keys not read straight from the device tier: {line(reads)}")

    def viewportEvent(self, e: QtCore.QEvent) -> bool:
        if e.type() == QtCore.QEvent.ToolTip:
            row = self.rowAt(e.pos().y())
            if 0 <= row < len(self._ids) and self.columnAt(e.pos().x()) != self.LABEL:
                QtWidgets.QToolTip.showText(e.globalPos(), self.why_text(self._ids[row]), self.viewport())
                return True
        return super().viewportEvent(e)

    def _mark_selected(self) -> None:
        """Highlight the selected sequence's row, wherever it is now, without scrolling (the user may be
        reading another part of the list); no row when it left the list."""
        model = self.selectionModel()
        rows = model.selectedRows()
        want = self._ids.index(self.selected_id) if self.selected_id in self._ids else -1
        if want < 0:
            if rows:
                model.clearSelection()
            return
        if [r.row() for r in rows] != [want]:
            model.select(self.model().index(want, 0),
                         QtCore.QItemSelectionModel.ClearAndSelect | QtCore.QItemSelectionModel.Rows)

    def paintEvent(self, event) -> None:
        p = QtGui.QPainter(self.viewport())
        pal = self.palette()
        p.fillRect(event.rect(), pal.color(QtGui.QPalette.Base))
        p.setFont(self.font())
        text, dim = pal.color(QtGui.QPalette.Text), QtGui.QColor("#737a84")
        states = {k: QtGui.QColor(v) for k, v in self.STATE_COLOURS.items()}
        header = self.horizontalHeader()
        cols = [(c, header.sectionViewportPosition(c), header.sectionSize(c)) for c in range(len(self.COLS))
                if not header.isSectionHidden(c)]
        h = self.verticalHeader().defaultSectionSize()
        right = QtCore.Qt.AlignRight | QtCore.Qt.AlignVCenter
        left = QtCore.Qt.AlignLeft | QtCore.Qt.AlignVCenter
        selected = self.selectionModel().selectedRows()
        sel_row = selected[0].row() if selected else -1
        for r in _visible_rows(self, min(len(self._rows), self.rowCount())):
            y = self.rowViewportPosition(r)
            vals = self._rows[r]
            if r == sel_row:
                p.fillRect(0, y, self.viewport().width(), h, pal.color(QtGui.QPalette.Highlight))
            finished = vals[2] == "finished"
            for c, x, w in cols:
                if c == 0:  # the sequence's colour, as the block map's owner mode draws it
                    p.fillRect(x + 3, y + h // 2 - 4, 8, 8, seq_color(self._ids[r]))
                    x, w = x + 12, w - 12
                if c == 2:
                    p.setPen(states.get(vals[2], text))
                else:
                    p.setPen(dim if finished and r != sel_row else text)
                cell = vals[c] if c != self.LABEL else p.fontMetrics().elidedText(vals[c], QtCore.Qt.ElideRight,
                                                                                    w - 2 * self.PAD)
                p.drawText(x + self.PAD, y, w - 2 * self.PAD, h, right if c in self.NUMERIC else left, cell)
        p.end()

    def select_id(self, sid: int) -> None:
        self.selected_id = sid
        self._updating = True
        self._mark_selected()
        self._updating = False

    def _selected(self) -> None:
        if self._updating:
            return
        rows = self.selectionModel().selectedRows()
        if rows:
            self.selected_id = self._ids[rows[0].row()]
            self.sequenceSelected.emit(self.selected_id)


class EventsPanel(QtWidgets.QWidget):
    """Evictions, migrations, preemptions, context shifts, config changes and errors, newest first."""

    KINDS = ("all", "evict", "promote", "demote", "preempt", "context_shift", "config", "config_error", "error",
             "cow", "request", "finish", "seq_cp", "workload", "lookup", "warning", "throughput_drop", "self_check")
    MAX = 3000
    SHOWN = 400

    def __init__(self):
        super().__init__()
        lay = QtWidgets.QVBoxLayout(self)
        lay.setContentsMargins(2, 2, 2, 2)
        row = QtWidgets.QHBoxLayout()
        self.kind = QtWidgets.QComboBox()
        self.kind.addItems(self.KINDS)
        self.text = QtWidgets.QLineEdit()
        self.text.setPlaceholderText("filter text")
        row.addWidget(self.kind)
        row.addWidget(self.text, 1)
        lay.addLayout(row)
        self.list = _EventList()
        self.list.setFont(_small_font(8, mono=True))
        self.list.setUniformItemSizes(True)
        lay.addWidget(self.list, 1)
        self.events: list[tuple[float, str, str]] = []
        self.kind.currentTextChanged.connect(self._refilter)
        self.text.textChanged.connect(self._refilter)
        self._pending_evictions = 0

    def add(self, events) -> None:
        if not events:
            return
        new = []
        for e in events:
            fields = " ".join(f"{k}={_bytes(v) if k.endswith('bytes') else _short(v)}" for k, v in e.fields.items()
                              if k != "trace")
            new.append((e.t, e.kind, fields))
        self._append(new)

    def add_evictions(self, n: int) -> None:
        """Evictions come as a counter (too many to list one by one); each tick's batch is one line."""
        if n > 0:
            self._append([(time.time(), "evict", f"{n} cold blocks evicted")])

    def _append(self, new: list[tuple[float, str, str]]) -> None:
        self.events.extend(new)
        del self.events[: max(0, len(self.events) - self.MAX)]
        shown = [e for e in new if self._passes(e)]
        if not shown:
            return
        # Newest first: insert at the top and trim, instead of rebuilding the list every frame.
        for e in shown:
            self.list.insertItem(0, self._line(e))
        while self.list.count() > self.SHOWN:
            self.list.takeItem(self.list.count() - 1)

    def add_lines(self, lines: list[tuple[float, str, str]]) -> None:
        """(time, kind, text) lines as the panel shows them: a saved snapshot's events."""
        self._append(list(lines))

    def add_local(self, kind: str, text: str) -> None:
        """An event the window itself saw (a refusal that never reached the engine)."""
        self._append([(time.time(), kind, text)])

    def _passes(self, e) -> bool:
        kind, needle = self.kind.currentText(), self.text.text().lower()
        # "config" lists refused changes (config_error) too: both are what happened to a change.
        return (kind == "all" or e[1] == kind or e[1].startswith(kind + "_")) and (
            not needle or needle in e[2].lower() or needle in e[1])

    @staticmethod
    def _line(e) -> str:
        t, k, f = e
        return f"{time.strftime('%H:%M:%S', time.localtime(t))} {k:<13} {f}"

    def _refilter(self) -> None:
        rows = [e for e in reversed(self.events) if self._passes(e)][: self.SHOWN]
        self.list.clear()
        self.list.addItems([self._line(e) for e in rows])


class _EventList(QtWidgets.QListWidget):
    """A list of one-line events whose viewport paints the visible lines itself (one `drawText` each)."""

    COLOURS = {"evict": "#e57373", "preempt": "#ff8a65", "config": "#4fc3f7", "config_error": "#ff5252",
               "error": "#ff5252", "self_check": "#ff5252", "context_shift": "#ffd54f", "promote": "#81c784",
               "demote": "#ba68c8", "warning": "#ffb300", "throughput_drop": "#ef5350"}

    def paintEvent(self, event) -> None:
        p = QtGui.QPainter(self.viewport())
        pal = self.palette()
        p.fillRect(event.rect(), pal.color(QtGui.QPalette.Base))
        p.setFont(self.font())
        colours = {k: QtGui.QColor(v) for k, v in self.COLOURS.items()}
        text = pal.color(QtGui.QPalette.Text)
        flags = QtCore.Qt.AlignLeft | QtCore.Qt.AlignVCenter
        current = self.currentRow() if self.selectionModel().hasSelection() else -1
        for r in _visible_rows(self, self.count()):
            item = self.item(r)
            rect = self.visualItemRect(item)
            if r == current:
                p.fillRect(rect, pal.color(QtGui.QPalette.Highlight))
            line = item.text()
            kind = line[9:].split(" ", 1)[0]  # "HH:MM:SS kind…" (EventsPanel._line); a kind has no space
            p.setPen(colours.get(kind, text))
            p.drawText(rect.adjusted(3, 0, 0, 0), flags, line)
        p.end()


def _small_font(points: int, mono: bool = False) -> QtGui.QFont:
    f = QtGui.QFontDatabase.systemFont(QtGui.QFontDatabase.FixedFont) if mono else QtGui.QFont()
    f.setPointSize(points)
    return f


def _bytes(v) -> str:
    """A byte count as people read it: 512 B, 3.0 KiB, 5.6 MiB, 1.20 GiB."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return _short(v)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= size:
            q = v / size
            return f"{q:.2f} {unit}" if unit == "GiB" else f"{q:.1f} {unit}"
    return f"{v:g} B"


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}:{_short(x)}" for k, x in v.items()) + "}"
    if hasattr(v, "__len__") and not isinstance(v, str) and len(v) > 6:
        return f"[{len(v)} items]"
    return str(v)
