"""The inspector's panels. Each reads snapshots (numpy arrays, frozen dataclasses) and nothing else."""

from __future__ import annotations

import html
import math
import time

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtGui, QtWidgets

from engine.telemetry import SERIES_LEN, SERIES_PERIOD_S, Snapshot
from ui.palette import seq_color
from ui.strip_chart import StripChart

STATE_NAMES = {0: "waiting", 1: "running", 2: "paused", 3: "preempted", 4: "finished"}
MB = 2**20
SPAN_S = SERIES_LEN * SERIES_PERIOD_S  # the time-series charts show everything the engine keeps

pg.setConfigOptions(antialias=False, background="#15181d", foreground="#c8ccd4")


def _plot(title: str, y_label: str, legend_cols: int = 2) -> pg.PlotWidget:
    w = pg.PlotWidget()
    w.setTitle(title, size="9pt")
    w.setLabel("left", y_label)
    w.setLabel("bottom", "seconds ago")
    # No grid: pyqtgraph's grid lines cost ~3.5 ms per plot per frame, more than the curves themselves.
    w.setMouseEnabled(x=False, y=False)
    w.setMenuEnabled(False)
    w.getPlotItem().setContentsMargins(2, 2, 6, 2)
    legend = w.addLegend(offset=(4, 2), labelTextSize="7pt", brush=pg.mkBrush(21, 24, 29, 210),
                         verSpacing=-6, horSpacing=12, colCount=legend_cols)
    legend.setLabelTextColor("#c8ccd4")
    return w


def _marks(snap: Snapshot) -> list[tuple[float, str, str]]:
    """The snapshot's marks as (seconds ago, kind, label)."""
    return [(t - snap.t, kind, label) for t, kind, label in snap.marks]


def _ago(series: dict, snap_t: float) -> np.ndarray:
    t = series.get("t", np.zeros(0))
    return t - snap_t


class HitRatePanel(QtWidgets.QWidget):
    """Device and prefix hit rate (windowed and cumulative), and evictions/migrations per second beneath."""

    def __init__(self):
        super().__init__()
        lay = QtWidgets.QVBoxLayout(self)
        lay.setContentsMargins(2, 2, 2, 2)
        self.rates = StripChart("Hit rate", "rate", span_s=SPAN_S, y_range=(0.0, 1.0),
                                y_ticks=(0.0, 0.2, 0.4, 0.6, 0.8, 1.0))
        self.rates.add_series("device_hit_rate_w", "device (5 s)", "#4fc3f7", width=2)
        self.rates.add_series("device_hit_rate", "device (all)", "#4fc3f7", dashed=True)
        self.rates.add_series("prefix_hit_rate_w", "prefix (5 s)", "#ffb74d", width=2)
        self.rates.add_series("prefix_hit_rate", "prefix (all)", "#ffb74d", dashed=True)
        self.flow = StripChart("Evictions and migrations", "blocks / s", span_s=SPAN_S)
        self.flow.add_series("evictions_per_s", "evictions", "#e57373", width=2)
        self.flow.add_series("promotions_per_s", "promotions", "#81c784", width=2)
        self.flow.add_series("demotions_per_s", "demotions", "#ba68c8", width=2)
        lay.addWidget(self.rates, 3)
        lay.addWidget(self.flow, 2)

    def update_snapshot(self, snap: Snapshot, part: str = "all") -> None:
        """part: "rates", "flow" or "all" (the window alternates halves, so one frame paints one chart)."""
        x = _ago(snap.series, snap.t)
        marks = _marks(snap)
        for chart in (self.rates, self.flow):
            if part == "all" or (chart is self.flow) == (part == "flow"):
                chart.set_marks(marks)
                chart.set_data(x, {k: snap.series[k] for k in chart.series if k in snap.series})


class MemoryPanel(QtWidgets.QWidget):
    """Tier use against capacity, process RSS and GPU memory over time; the breakdown and sizing formula."""

    def __init__(self):
        super().__init__()
        lay = QtWidgets.QVBoxLayout(self)
        lay.setContentsMargins(2, 2, 2, 2)
        self.plot = StripChart("KV tiers: used, and capacity (dotted)", "MiB", span_s=SPAN_S)
        self.plot.add_series("device_used_bytes", "device tier", "#4fc3f7", width=2)
        self.plot.add_series("host_used_bytes", "host tier", "#ba68c8", width=2)
        self.proc = StripChart("Process and GPU", "MiB", span_s=SPAN_S)
        self.proc.add_series("rss_bytes", "process RSS", "#9e9e9e", width=2)
        self.text = QtWidgets.QLabel()
        self.text.setTextFormat(QtCore.Qt.RichText)
        self.text.setWordWrap(True)
        self.text.setStyleSheet("font-size: 8pt;")
        # A fixed height: a label whose size hint changes with its text re-lays out (and repaints) the
        # whole window each time.
        self.text.setFixedHeight(92)
        self.text.setAlignment(QtCore.Qt.AlignTop | QtCore.Qt.AlignLeft)
        self._text_at = 0.0
        lay.addWidget(self.plot, 5)
        lay.addWidget(self.proc, 4)
        lay.addWidget(self.text, 0)

    def update_snapshot(self, snap: Snapshot, part: str = "all") -> None:
        """part: "tiers", "process" or "all" (the window alternates halves, so one frame paints one chart)."""
        x = _ago(snap.series, snap.t)
        gpu = snap.memory["gpu"]
        if gpu.get("available") and "gpu_used_bytes" not in self.proc.series:
            self.proc.add_series("gpu_used_bytes", "GPU used (NVML)", "#81c784", width=2)
            self.proc.add_series("torch_allocated_bytes", "torch allocated", "#ffb74d")
        tiers = snap.memory["tiers"]
        self.plot.set_level("device", tiers["device"]["capacity_bytes"] / MB, "#4fc3f7")
        self.plot.set_level("host", tiers["host"]["capacity_bytes"] / MB, "#ba68c8")
        changes = [m for m in _marks(snap) if m[1] in ("config", "workload")]
        for chart in (self.plot, self.proc):
            if part == "all" or (chart is self.plot) == (part == "tiers"):
                chart.set_marks(changes)
                # NaN where NVML could not be read: the chart breaks the line there.
                chart.set_data(x, {k: snap.series[k] / MB for k in chart.series if k in snap.series})
        self.proc.set_note("" if gpu.get("available") else "no GPU")
        # The text changes slowly and re-rendering it is not free: once a second, and at every full refresh
        # (a screenshot must agree with itself).
        if part != "all" and time.monotonic() - self._text_at < 1.0:
            return
        self._text_at = time.monotonic()
        rows = []
        for name, t in tiers.items():
            rows.append(
                f"<tr><td><b>{name}</b></td><td>{t['used_blocks']:,}/{t['capacity_blocks']:,}</td>"
                f"<td>{t['k_bytes'] / MB:.1f}</td><td>{t['v_bytes'] / MB:.1f}</td><td>{t['scale_bytes'] / MB:.2f}</td>"
                f"<td>{t['metadata_bytes'] / MB:.2f}</td><td>{t['device']}{' pinned' if t.get('pinned') else ''}</td></tr>")
        if gpu.get("available"):
            gline = (f"GPU {gpu.get('name', '')}: NVML {gpu.get('nvml_used_bytes', 0) / 2**30:.2f}/"
                     f"{gpu.get('nvml_total_bytes', 0) / 2**30:.1f} GiB; torch allocated "
                     f"{gpu['torch_allocated_bytes'] / MB:.0f} MiB, reserved {gpu['torch_reserved_bytes'] / MB:.0f} MiB"
                     + (f" ({gpu['nvml_error']})" if gpu.get("nvml_error") else ""))
        else:
            gline = f"<b>{gpu.get('reason', 'no GPU')}</b>"
        m = snap.model
        cfg = snap.config
        dsize = snap.memory["block_bytes"] / (cfg["block_size"] * m["layers"] * m["kv_heads"] * m["head_dim"] * 2)
        ctx = m.get("context_limit", 2048)
        total = 8 * ctx * m["layers"] * m["kv_heads"] * m["head_dim"] * 2 * dsize
        self.text.setText(
            "<table cellspacing=4><tr><th></th><th>blocks used</th><th>K MiB</th><th>V MiB</th><th>scales</th>"
            "<th>meta</th><th>on</th></tr>" + "".join(rows) + "</table>"
            f"{gline}; RSS {snap.memory['rss_bytes'] / MB:.0f} MiB; system "
            f"{snap.memory['system_used_bytes'] / 2**30:.1f}/{snap.memory['system_total_bytes'] / 2**30:.1f} GiB<br>"
            f"batch × context × layers × kv_heads × head_dim × 2 × dtype = 8 × {ctx} × {m['layers']} × "
            f"{m['kv_heads']} × {m['head_dim']} × 2 × {dsize:.3g} B = {total / MB:,.0f} MiB")


class HeatPanel(QtWidgets.QWidget):
    """Heat distribution per tier (log-spaced bins), and the hottest and coldest live blocks."""

    BINS = np.concatenate(([0.0], np.geomspace(0.05, 64, 24)))

    def __init__(self):
        super().__init__()
        lay = QtWidgets.QVBoxLayout(self)
        lay.setContentsMargins(2, 2, 2, 2)
        self.plot = _plot("Heat distribution (live blocks)", "blocks")
        self.plot.setLabel("bottom", "heat (log bins)")
        self.plot.setLogMode(x=True, y=False)
        self.bars = {}
        for i, (name, colour) in enumerate((("device", "#4fc3f7"), ("host", "#ba68c8"))):
            item = pg.BarGraphItem(x0=[], x1=[], height=[], brush=pg.mkBrush(colour), pen=None, name=name)
            self.plot.addItem(item)
            self.bars[name] = item
        self.table = _text_block(62)
        lay.addWidget(self.plot, 3)
        lay.addWidget(self.table, 1)

    def update_snapshot(self, snap: Snapshot) -> None:
        edges = self.BINS[1:]
        lo, hi = np.log10(edges[:-1]), np.log10(edges[1:])
        width = hi - lo
        log_lo, step = np.log10(edges[0]), lo[1] - lo[0]  # geometric bins: equal steps in log space
        nb = len(edges) - 1
        lines = []
        for k, t in enumerate(snap.tiers):
            live = t.state > 0
            h = t.heat[live]
            # Bin by arithmetic on log10 (np.histogram's searchsorted is ~10x slower at 100k blocks).
            idx = ((np.log10(np.maximum(h, edges[0])) - log_lo) / step).astype(np.int64)
            counts = np.bincount(np.clip(idx, 0, nb - 1), minlength=nb)
            # Side by side: device in the left half of each bin, host in the right half.
            self.bars[t.name].setOpts(x0=lo + k * width / 2, x1=lo + (k + 1) * width / 2, height=counts)
            if len(h):
                slots = np.flatnonzero(live)
                top, low = _extremes(h, 3)
                hot = ", ".join(f"#{slots[i]} {h[i]:.1f}" for i in top)
                cold = ", ".join(f"#{slots[i]} {h[i]:.2f}" for i in low)
                lines.append(f"{t.name:<6} hottest {hot}\n{'':<6} coldest {cold}")
            else:
                lines.append(f"{t.name:<6} no live blocks")
        self.table.setText("\n".join(lines))


class ResidencyPanel(QtWidgets.QWidget):
    """Residency metrics as histograms over log-spaced seconds: reuse gap and age at a prefix hit, age at
    eviction, block lifetime (the newest samples the engine keeps)."""

    EDGES = np.geomspace(1e-3, 1e4, 29)
    SERIES = (("reuse_gap", "reuse gap", "#4fc3f7"), ("age_at_hit", "age at hit", "#81c784"),
              ("age_at_eviction", "age at eviction", "#e57373"), ("lifetime", "lifetime", "#ffb74d"))

    def __init__(self):
        super().__init__()
        lay = QtWidgets.QVBoxLayout(self)
        lay.setContentsMargins(2, 2, 2, 2)
        self.plot = _plot("Residency (newest samples)", "share of samples")
        self.plot.setLabel("bottom", "seconds (log)")
        self.plot.setLogMode(x=True, y=False)
        self.curves = {k: self.plot.plot(stepMode="center", pen=pg.mkPen(c, width=2), name=label)
                       for k, label, c in self.SERIES}
        self.summary = _text_block(62)
        lay.addWidget(self.plot, 1)
        lay.addWidget(self.summary)

    def update_snapshot(self, snap: Snapshot) -> None:
        lines = []
        for key, label, _ in self.SERIES:
            v = snap.residency.get(key, np.zeros(0))
            counts, _ = np.histogram(np.clip(v, self.EDGES[0], self.EDGES[-1]), bins=self.EDGES)
            self.curves[key].setData(self.EDGES, counts / max(len(v), 1), skipFiniteCheck=True)
            if len(v):
                p50, p90 = np.percentile(v, [50, 90])
                lines.append(f"{label:<16} n={len(v):<5} p50 {p50:8.2f} s  p90 {p90:8.2f} s")
            else:
                lines.append(f"{label:<16} no samples yet")
        self.summary.setText("\n".join(lines))


def _text_block(height: int) -> QtWidgets.QLabel:
    """A few lines of small monospace text under a plot, at a fixed height (a label whose size hint follows
    its text re-lays out the window on every change)."""
    label = QtWidgets.QLabel()
    label.setStyleSheet("font-size: 8pt; font-family: monospace;")
    label.setFixedHeight(height)
    label.setAlignment(QtCore.Qt.AlignTop | QtCore.Qt.AlignLeft)
    return label


def _extremes(h: np.ndarray, k: int) -> tuple[list[int], list[int]]:
    """Indices of the k largest and k smallest values; repeated argmax is ~10x faster than argpartition
    for a handful of extremes of a large array."""
    k = min(k, len(h))
    hi, lo = h.astype(np.float64), h.astype(np.float64)
    top, low = [], []
    for _ in range(k):
        i, j = int(np.argmax(hi)), int(np.argmin(lo))
        top.append(i)
        low.append(j)
        hi[i], lo[j] = -np.inf, np.inf
    return top, low


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
            "running, paused, preempted, waiting or finished", "tokens in the sequence (prompt + generated)",
            "tokens generated", "blocks on the device tier", "blocks on the host tier", "decode tokens per second",
            "time to first token, ms", "prompt tokens reused from the prefix cache")
    WIDTHS = (38, 76, 58, 46, 32, 32, 36, 38, 40, 46)
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
        # Fixed widths: ResizeToContents re-measures every row on each setText, a frame-time spike.
        self.horizontalHeader().setSectionResizeMode(QtWidgets.QHeaderView.Interactive)
        self.horizontalHeader().setStretchLastSection(True)
        for c, w in enumerate(self.WIDTHS):
            self.setColumnWidth(c, w)
        self.verticalHeader().setDefaultSectionSize(18)
        self.setFont(_small_font(8))  # a font, not a style sheet: style-sheeted item views paint slower
        self.itemSelectionChanged.connect(self._selected)
        self._ids: list[int] = []
        self._rows: list[tuple[str, ...]] = []  # texts on screen, per row
        self._updating = False
        self.selected_id = -1

    def update_snapshot(self, snap: Snapshot) -> None:
        s = snap.seqs
        # Live sequences first (newest first), then the most recent finished ones.
        live = np.flatnonzero(s.state != 4)
        done = np.flatnonzero(s.state == 4)
        order = np.concatenate((live[np.argsort(-s.id[live])], done[np.argsort(-s.id[done])][:40]))
        self._updating = True
        if self.rowCount() != len(order):
            self.setRowCount(len(order))
            self._rows = self._rows[: len(order)]
        self._ids = [int(s.id[i]) for i in order]
        for r, i in enumerate(order):
            ttft = s.ttft[i]
            vals = (str(int(s.id[i])), s.labels[i], STATE_NAMES.get(int(s.state[i]), "?"), str(int(s.tokens[i])),
                    str(int(s.generated[i])), str(int(s.blocks_device[i])), str(int(s.blocks_host[i])),
                    f"{s.tokens_per_s[i]:.1f}", "" if math.isnan(ttft) else f"{ttft * 1e3:.0f}",
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
            if r < len(self._rows):
                self._rows[r] = vals
            else:
                self._rows.append(vals)
        if self.selected_id in self._ids:
            self.selectRow(self._ids.index(self.selected_id))
        self._updating = False

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
                p.drawText(x + 4, y, w - 8, h, right if c in self.NUMERIC else left, vals[c])
        p.end()

    def select_id(self, sid: int) -> None:
        self.selected_id = sid
        self._updating = True
        if sid in self._ids:
            self.selectRow(self._ids.index(sid))
        else:
            self.clearSelection()
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
             "cow", "request", "finish", "seq_cp", "workload")
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
            fields = " ".join(f"{k}={_short(v)}" for k, v in e.fields.items() if k != "trace")
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

    def _passes(self, e) -> bool:
        kind, needle = self.kind.currentText(), self.text.text().lower()
        return (kind == "all" or e[1] == kind) and (not needle or needle in e[2].lower() or needle in e[1])

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
               "error": "#ff5252", "context_shift": "#ffd54f", "promote": "#81c784", "demote": "#ba68c8"}

    def paintEvent(self, event) -> None:
        p = QtGui.QPainter(self.viewport())
        pal = self.palette()
        p.fillRect(event.rect(), pal.color(QtGui.QPalette.Base))
        p.setFont(self.font())
        colours = {k: QtGui.QColor(v) for k, v in self.COLOURS.items()}
        text = pal.color(QtGui.QPalette.Text)
        width = self.viewport().width()
        flags = QtCore.Qt.AlignLeft | QtCore.Qt.AlignVCenter
        current = self.currentRow() if self.selectionModel().hasSelection() else -1
        for r in _visible_rows(self, self.count()):
            item = self.item(r)
            rect = self.visualItemRect(item)
            if r == current:
                p.fillRect(rect, pal.color(QtGui.QPalette.Highlight))
            line = item.text()
            kind = line[9:22].rstrip()  # "HH:MM:SS kind…" (EventsPanel._line)
            p.setPen(colours.get(kind, text))
            p.drawText(rect.adjusted(3, 0, 0, 0), flags, line)
        p.end()


def _small_font(points: int, mono: bool = False) -> QtGui.QFont:
    f = QtGui.QFontDatabase.systemFont(QtGui.QFontDatabase.FixedFont) if mono else QtGui.QFont()
    f.setPointSize(points)
    return f


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}:{_short(x)}" for k, x in v.items()) + "}"
    if hasattr(v, "__len__") and not isinstance(v, str) and len(v) > 6:
        return f"[{len(v)} items]"
    return str(v)


class PromptPanel(QtWidgets.QWidget):
    submitted = QtCore.Signal(str, bool, int)

    def __init__(self):
        super().__init__()
        lay = QtWidgets.QVBoxLayout(self)
        lay.setContentsMargins(2, 2, 2, 2)
        self.transcript = QtWidgets.QTextBrowser()
        self.transcript.setStyleSheet("font-size: 9pt;")
        self.input = QtWidgets.QPlainTextEdit()
        self.input.setPlaceholderText("Type a prompt and press Send (Ctrl+Enter)")
        self.input.setMaximumHeight(70)
        row = QtWidgets.QHBoxLayout()
        self.chat = QtWidgets.QCheckBox("chat")
        self.chat.setChecked(True)
        self.max_new = QtWidgets.QSpinBox()
        self.max_new.setRange(1, 4096)
        self.max_new.setValue(96)
        self.max_new.setPrefix("max ")
        self.send = QtWidgets.QPushButton("Send")
        row.addWidget(self.chat)
        row.addWidget(self.max_new)
        row.addStretch(1)
        row.addWidget(self.send)
        lay.addWidget(self.transcript, 3)
        lay.addWidget(self.input)
        lay.addLayout(row)
        self.send.clicked.connect(self._send)
        QtGui.QShortcut(QtGui.QKeySequence("Ctrl+Return"), self.input, activated=self._send)
        self.current = -1

    def _send(self) -> None:
        text = self.input.toPlainText()
        self.submitted.emit(text, self.chat.isChecked(), self.max_new.value())

    def started(self, sid: int, text: str) -> None:
        self.current = sid
        self.input.clear()
        self.transcript.append(f"<p><b>you (seq {sid}):</b> {html.escape(text)}</p><p><b>model:</b> ")

    def stream(self, pieces: list[tuple[int, str]]) -> None:
        text = "".join(p for sid, p in pieces if sid == self.current)
        if text:
            cur = self.transcript.textCursor()
            cur.movePosition(QtGui.QTextCursor.End)
            cur.insertText(text)
            self.transcript.setTextCursor(cur)

    def error(self, message: str) -> None:
        self.transcript.append(f"<p style='color:#e57373'>{message}</p>")
