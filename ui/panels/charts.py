"""The inspector's chart panels: hit rates, memory, heat and residency. Each reads snapshots (numpy arrays,
frozen dataclasses) and nothing else.

The panels that list things (sequences, events) are in ui/panels/lists.py, the prompt box in ui/panels/prompt.py.
"""

from __future__ import annotations

import html
import time

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtWidgets

from engine.telemetry.snapshot import Snapshot
from engine.telemetry.snapshotter import SERIES_LEN, SERIES_PERIOD_S, WINDOW_S
from ui.panels import kv_cost
from ui.charts.prediction import Prediction
from ui.charts.rates import MEANING, RateHistory
from ui.charts.strip_chart import StripChart

MB = 2**20
SPAN_S = SERIES_LEN * SERIES_PERIOD_S  # the time-series charts show everything the engine keeps

pg.setConfigOptions(antialias=False, background="#15181d", foreground="#c8ccd4")


def _plot(y_label: str) -> pg.PlotWidget:
    w = pg.PlotWidget()
    w.setLabel("left", y_label)
    w.setLabel("bottom", "seconds ago")
    # No grid: pyqtgraph's grid lines cost ~3.5 ms per plot per frame, more than the curves themselves.
    w.setMouseEnabled(x=False, y=False)
    w.setMenuEnabled(False)
    w.getPlotItem().setContentsMargins(2, 2, 6, 2)
    return w


def _key(title: str, names: tuple[tuple[str, str], ...]) -> QtWidgets.QLabel:
    """A plot's title and its series' names in their colours, in a line above it (names: (label, colour)):
    a legend box inside the view would cover the data."""
    key = "&nbsp;&nbsp; ".join(f"<span style='color:{c}'>&#9632;</span>&nbsp;{html.escape(n)}" for n, c in names)
    label = QtWidgets.QLabel(f"<b>{html.escape(title)}</b>&nbsp;&nbsp;&nbsp; {key}")
    label.setTextFormat(QtCore.Qt.RichText)
    label.setWordWrap(True)
    label.setStyleSheet("font-size: 8pt; color: #c8ccd4;")
    label.setContentsMargins(6, 0, 0, 0)
    return label


def _marks(snap: Snapshot) -> list[tuple[float, str, str]]:
    """The snapshot's marks as (seconds ago, kind, label)."""
    return [(t - snap.t, kind, label) for t, kind, label in snap.marks]


def _ago(series: dict, snap_t: float) -> np.ndarray:
    t = series.get("t", np.zeros(0))
    return t - snap_t


class HitRatePanel(QtWidgets.QWidget):
    """Device and prefix hit rate (windowed and cumulative), and evictions/migrations per second beneath.

    The values come from a RateHistory (ui/charts/rates.py) the window feeds from every snapshot: "no data" is a
    gap in a line, never a 0. `prediction` (ui/charts/prediction.py, set by the window): what the What if tab
    predicted for the device-budget change applied last, marked on the rates chart beside what was measured since."""

    def __init__(self, rates: RateHistory | None = None):
        super().__init__()
        self.history = rates if rates is not None else RateHistory()
        self.drawn: dict[str, np.ndarray] = {}
        self.prediction: Prediction | None = None
        lay = QtWidgets.QVBoxLayout(self)
        lay.setContentsMargins(2, 2, 2, 2)
        self.rates = StripChart("Hit rate", "rate", span_s=SPAN_S, y_range=(0.0, 1.0),
                                y_ticks=(0.0, 0.2, 0.4, 0.6, 0.8, 1.0))
        w = f"{WINDOW_S:g} s"
        for key, label, colour, width, dashed in (("device_hit_rate_w", f"device ({w})", "#4fc3f7", 2, False),
                                                  ("device_hit_rate", "device (all)", "#4fc3f7", 1, True),
                                                  ("prefix_hit_rate_w", f"prefix ({w})", "#ffb74d", 2, False),
                                                  ("prefix_hit_rate", "prefix (all)", "#ffb74d", 1, True)):
            self.rates.add_series(key, label, colour, width=width, dashed=dashed, tip=MEANING[key])
        self.rates.add_series("shadow_flip_rate", "top-1 flips", "#f06292", tip=kv_cost.FLIP_TIP, dots=True)
        self.shadow = kv_cost.shadow_chart(SPAN_S)  # what the KV format costs, on sampled steps
        self.flow = StripChart("Evictions and migrations", "blocks / s", span_s=SPAN_S)
        self.flow.add_series("evictions_per_s", "evictions", "#e57373", width=2, tip=MEANING["evictions_per_s"])
        self.flow.add_series("promotions_per_s", "promotions", "#81c784", width=2, tip=MEANING["promotions_per_s"])
        self.flow.add_series("demotions_per_s", "demotions", "#ba68c8", width=2, tip=MEANING["demotions_per_s"])
        lay.addWidget(self.rates, 3)
        lay.addWidget(self.shadow, 2)
        lay.addWidget(self.flow, 2)

    def update_snapshot(self, snap: Snapshot, part: str = "all") -> None:
        """part: "rates", "flow" or "all" (the window alternates: one frame paints the rates and the shadow chart,
        another the flow). The shadow series are the engine's own (a point per shadow step, NaN between)."""
        series = self.history.series(snap.series)
        self.drawn = series  # what the lines show: a screenshot's JSON keeps it, so the file redraws the same
        x = series["t"] - snap.t
        marks = _marks(snap)
        for chart in (self.rates, self.flow):
            if part == "all" or (chart is self.flow) == (part == "flow"):
                chart.set_marks(marks)
                chart.set_data(x, {k: series[k] for k in chart.series if k in series})
        if part in ("all", "rates"):
            self.show_prediction(snap.t)
            sx, sy = kv_cost.shadow_points(snap, self.shadow)
            flips = snap.series.get("shadow_flip_rate", np.full(len(sx), np.nan))
            self.rates.series["shadow_flip_rate"].x, self.rates.series["shadow_flip_rate"].y = sx, flips
            self.shadow.set_note(kv_cost.note(snap))
            self.shadow.set_marks(marks)
            self.shadow.set_data(sx, sy)


    def set_prediction(self, prediction: Prediction | None, snap_t: float | None = None) -> None:
        """Keep `prediction` (None: none) on the rates chart; drawn now if snap_t (the snapshot's time) is given."""
        self.prediction = prediction
        if snap_t is not None or prediction is None:
            self.show_prediction(snap_t)

    def show_prediction(self, snap_t: float | None) -> None:
        p = self.prediction
        if p is None or snap_t is None:
            self.rates.set_prediction(None)
            return
        self.rates.set_prediction(p.t - snap_t, p.levels(), p.parts(), p.short_parts(), p.tip())


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
        self.text = FitLabel("font-size: 8pt;")
        self.text.setTextFormat(QtCore.Qt.RichText)
        self._text_at, self._text_key = 0.0, None
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
        self.update_text(snap, force=part == "all")

    def update_text(self, snap: Snapshot, force: bool = False) -> None:
        """The breakdown under the charts. Its tier rows count the blocks the block map counts, so they are
        rendered in the frame their numbers change (the window calls this every frame, with the map: a screenshot
        shows both from one snapshot); the rest (RSS, GPU, sizing) changes slowly and re-rendering is not free:
        once a second otherwise, and at every full refresh (force)."""
        tiers, gpu = snap.memory["tiers"], snap.memory["gpu"]
        key = tuple((t["used_blocks"], t["capacity_blocks"], t["k_bytes"], t["v_bytes"], t["scale_bytes"],
                     t["metadata_bytes"], t["device"]) for t in tiers.values())
        if not force and key == self._text_key and time.monotonic() - self._text_at < 1.0:
            return
        self._text_at, self._text_key = time.monotonic(), key
        rows = []
        for name, t in tiers.items():
            rows.append(
                f"<tr><td><b>{name}</b></td><td>{t['used_blocks']:,}/{t['capacity_blocks']:,}</td>"
                f"<td>{t['k_bytes'] / MB:.1f}</td><td>{t['v_bytes'] / MB:.1f}</td><td>{t['scale_bytes'] / MB:.2f}</td>"
                f"<td>{t['metadata_bytes'] / MB:.2f}</td><td>{t['device']}{' pinned' if t.get('pinned') else ''}</td></tr>")
        rss = (f"process RSS {snap.memory['rss_bytes'] / MB:,.0f} MiB; system "
               f"{snap.memory['system_used_bytes'] / 2**30:.1f}/{snap.memory['system_total_bytes'] / 2**30:.1f} GiB")
        if snap.memory.get("stream_staging_bytes"):  # host blocks streamed through it (host_reads=stream)
            rss += f"; stream staging {snap.memory['stream_staging_bytes'] / MB:.1f} MiB"
        if gpu.get("available"):
            gline = (f"GPU {gpu.get('name', '')}: NVML {gpu.get('nvml_used_bytes', 0) / 2**30:.2f}/"
                     f"{gpu.get('nvml_total_bytes', 0) / 2**30:.1f} GiB; torch allocated "
                     f"{gpu['torch_allocated_bytes'] / MB:.0f} MiB, reserved {gpu['torch_reserved_bytes'] / MB:.0f} MiB"
                     + (f" ({gpu['nvml_error']})" if gpu.get("nvml_error") else "") + f"; {rss}")
        else:  # the chart above says "no GPU"; the reason is the tooltip
            gline = rss
        self.text.setToolTip(
            "tiers: blocks in use / capacity, and the bytes of their K, V, scales and metadata as allocated: the "
            "device tier's include its two reserved slots (the null and sink blocks), which the block map's "
            "capacity (usable blocks) leaves out\n"
            "stream staging: the buffers on the compute device that host-tier blocks are copied into, a layer "
            "ahead, to be read there (host_reads=stream); not part of either tier's budget\n"
            + ("" if gpu.get("available") else f"{gpu.get('reason', 'no GPU')}\n")
            + "sizing: the KV of a batch of 8 sequences at the context limit, in the live block format "
              "(B = bytes per K or V value, scales included); with KV-cache groups each group's layers times the "
              "tokens it keeps (a window group: at most its window and the block it starts in)")
        self.text.setText(
            "<table cellspacing=2><tr><th></th><th>blocks used</th><th>K MiB</th><th>V MiB</th><th>scales</th>"
            "<th>meta</th><th>on</th></tr>" + "".join(rows) + "</table>"
            f"{gline}<br>" + sizing_text(snap))


def sizing_text(snap: Snapshot) -> str:
    """The KV of a batch of 8 sequences at the context limit, in the live block format. With KV-cache groups each
    group counts its own layers and the tokens it keeps: the context, or for a window group at most its window and
    the block it starts in. B (bytes per K or V value, scales included) is read off the first pool's block size,
    which holds the first group's layers only."""
    m, cfg = snap.model, snap.config
    bs = cfg["block_size"]
    ctx = m.get("context_limit", 2048)
    groups = snap.kv_groups or ({"layers": list(range(m["layers"])), "window": None},)
    dsize = snap.memory["block_bytes"] / (bs * len(groups[0]["layers"]) * m["kv_heads"] * m["head_dim"] * 2)
    kept = [(len(g["layers"]), ctx if g["window"] is None else min(ctx, g["window"] + bs)) for g in groups]
    per_token_layers = sum(n * t for n, t in kept)
    total = 8 * per_token_layers * m["kv_heads"] * m["head_dim"] * 2 * dsize
    tail = f"{m['kv_heads']} × {m['head_dim']} × 2 × {dsize:.3g} B = {total / MB:,.0f} MiB"
    if len(kept) == 1 and groups[0]["window"] is None:
        return f"KV = batch × context × layers × kv_heads × head_dim × 2 × B = 8 × {ctx} × {m['layers']} × {tail}"
    terms = " + ".join(f"{n} × {t}" for n, t in kept)
    return (f"KV = batch × Σ<sub>groups</sub>(layers × tokens kept) × kv_heads × head_dim × 2 × B = "
            f"8 × ({terms}) × {tail}")


class HeatPanel(QtWidgets.QWidget):
    """Heat distribution per tier (log-spaced bins), and the hottest and coldest live blocks."""

    BINS = np.concatenate(([0.0], np.geomspace(0.05, 64, 24)))

    def __init__(self):
        super().__init__()
        lay = QtWidgets.QVBoxLayout(self)
        lay.setContentsMargins(2, 2, 2, 2)
        self.plot = _plot("blocks")
        self.key = _key("Heat distribution (live blocks)", (("device", "#4fc3f7"), ("host", "#ba68c8")))
        self.plot.setLabel("bottom", "heat (log bins)")
        self.plot.setLogMode(x=True, y=False)
        self.bars = {}
        for i, (name, colour) in enumerate((("device", "#4fc3f7"), ("host", "#ba68c8"))):
            item = pg.BarGraphItem(x0=[], x1=[], height=[], brush=pg.mkBrush(colour), pen=None, name=name)
            self.plot.addItem(item)
            self.bars[name] = item
        self.table = FitLabel(MONO)
        lay.addWidget(self.key)
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
        # Counts from 0 up (pyqtgraph's auto range centres an empty plot on 0, with negative counts).
        peak = max((int(item.opts["height"].max()) for item in self.bars.values() if len(item.opts["height"])),
                   default=0)
        self.plot.setYRange(0, max(peak, 1) * 1.05, padding=0)
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
        self.plot = _plot("share of samples")
        self.key = _key("Residency (newest samples)", tuple((label, c) for _, label, c in self.SERIES))
        self.plot.setLabel("bottom", "seconds (log)")
        self.plot.setLogMode(x=True, y=False)
        self.curves = {k: self.plot.plot(stepMode="center", pen=pg.mkPen(c, width=2), name=label)
                       for k, label, c in self.SERIES}
        self.summary = FitLabel(MONO)
        lay.addWidget(self.key)
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


MONO = "font-size: 8pt; font-family: monospace;"


class FitLabel(QtWidgets.QLabel):
    """Wrapped text at a fixed height that is set to what the text needs at the label's width, only when
    that changes (a resize, a line that now wraps): no line is cut off, and a new text of the same shape
    does not re-lay out the window (a label whose size hint follows its text would, on every change)."""

    def __init__(self, style: str):
        super().__init__()
        self.setStyleSheet(style)
        self.setWordWrap(True)
        self.setAlignment(QtCore.Qt.AlignTop | QtCore.Qt.AlignLeft)
        self.setFixedHeight(self.fontMetrics().lineSpacing() + 4)

    def setText(self, text: str) -> None:
        super().setText(text)
        self.fit()

    def fit(self) -> None:
        need = self.heightForWidth(self.width())
        if need > 0 and need != self.height():
            self.setFixedHeight(need)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self.fit()


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
