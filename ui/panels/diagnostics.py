"""The Diagnostics tab: the MemOS troubleshooting checklist, live, from Snapshot.health (engine/telemetry/health.py).

Growing memory: are ref counts released (leaks), does eviction run (evictions by tier, a full device tier that evicts
nothing)? A throughput drop: lock contention (the engine step's and the snapshot reader's waits for the engine lock, a
histogram by decade), hit-rate swings, memory-bandwidth utilization; the drops themselves are marked on the charts
with the findings at that moment. "no data" wherever nothing was counted.
"""

from __future__ import annotations

import html
import math
import time

import numpy as np
from PySide6 import QtCore, QtGui, QtWidgets

from engine.telemetry.health import LOCK_BINS, LOCK_SAMPLES, MEANING
from engine.telemetry.snapshot import Snapshot
from engine.telemetry.snapshotter import SERIES_LEN, SERIES_PERIOD_S
from ui.charts.strip_chart import StripChart
from ui.panels.charts import FitLabel
from ui.panels.health import GRADE_COLOURS, ms, pct

WHO_COLOURS = {"step": "#4fc3f7", "snapshot": "#ffb74d"}


def _gb(bps) -> str:
    return "no data" if bps is None or not math.isfinite(bps) else f"{bps / 1e9:.1f} GB/s"


def _mb(n) -> str:
    return "no data" if n is None or not math.isfinite(n) else f"{n / 2**20:,.1f} MiB"


def rows(h: dict) -> list[tuple[str, str, str, str]]:
    """(check, grade, what it found, what it counts) per row of the checklist."""
    if not h:
        return [(name, "none", "no data (a snapshot from before health was counted)", MEANING[key])
                for name, key in (("ref-count leaks", "leaks"), ("evictions", "eviction_check"),
                                  ("lock wait", "lock_wait"), ("bandwidth", "bandwidth"),
                                  ("throughput", "throughput"))]
    out = []
    lk = h.get("leaks", {})
    if not lk.get("checks"):
        found, grade = "no data (not checked yet)", "none"
    elif lk.get("blocks"):
        named = "; ".join(f"block {lid} ({('device', 'host')[tier]} slot {slot}, count {r}, held by {hd})"
                          for _, lid, tier, slot, r, hd in lk.get("named", [])[:5])
        found, grade = f"{lk['blocks']} block(s) leaked: {named}", "red"
    else:
        found, grade = f"none in {lk['checks']} checks", "green"
    out.append(("ref-count leaks", grade, found, MEANING["leaks"]))
    e = h.get("eviction_rate", {})
    d, ho = e.get("device", {}), e.get("host", {})
    ec = h.get("eviction_check", {})
    full = "; ".join(f"{f['title'] or 'device tier'} full for {f['full_s']:.0f} s"
                     + (" with blocks wanted" if f.get("pressure") else "") for f in ec.get("full", []))
    found = (f"device: {d.get('allocated', 0):,} allocated, {d.get('to_host', 0):,} evicted to host, "
             f"{d.get('dropped', 0):,} dropped · host: {ho.get('allocated', 0):,} allocated, "
             f"{ho.get('dropped', 0):,} dropped" + (f"; {full}" if full else "")
             + (f"; warning: {ec['warning']}" if ec.get("warning") else ""))
    grade = "amber" if ec.get("warning") else "green" if ec.get("steps") else "none"
    if not ec.get("steps"):
        found = "no data (no step yet)"
    out.append(("evictions", grade, found, MEANING["eviction_check"]))
    lw = h.get("lock_wait", {})
    parts = [f"{who} p99 {ms(lw.get(who, {}).get('p99_s'), True)}, max {ms(lw.get(who, {}).get('max_s'), True)} "
             f"({lw.get(who, {}).get('n', 0):,})" for who in ("step", "snapshot")]
    if lw.get("gave_up"):
        parts.append(f"{lw['gave_up']} snapshots gave up waiting")
    grade = "none" if not lw.get("step", {}).get("n") else "green"
    out.append(("lock wait", grade, " · ".join(parts), MEANING["lock_wait"]))
    bw = h.get("bandwidth", {})
    peak = bw.get("peak", "")
    source = ("NVML peak" if "NVML" in peak else "weights read" if "weights read" in peak
              else "streaming read" if "streaming read" in peak else "measured" if peak else "no data")
    found = (f"{pct(bw.get('w'))} over 5 s, {pct(bw.get('minute'))} over a minute of {_gb(bw.get('peak_bytes_per_s'))} "
             f"({source}); last decode step {_mb(bw.get('last_bytes'))} in {ms(bw.get('last_step_s'), True)}")
    meaning = (f"{MEANING['bandwidth']}; medians of the decode steps; the peak: {peak or 'not measured'}; weights "
               f"{_mb(bw.get('weights_bytes'))} a step")
    out.append(("bandwidth", "none" if not bw.get("steps") else "green", found, meaning))
    tp = h.get("throughput", {})
    drops = tp.get("last_drops", [])
    found = f"{_num(tp.get('tokens_per_s'))} tokens/s over 5 s, minute median {_num(tp.get('median_minute'))}"
    if drops:
        last = drops[-1]
        f = last.get("findings", {})
        found += (f"; {tp.get('drops', 0)} drop(s), the last -{100 * last['drop']:.0f} % "
                  f"({_num(last['tokens_per_s'])} vs {_num(last['median_tokens_per_s'])}): "
                  + "; ".join(f"{k}: {v}" for k, v in f.items()))
    elif tp.get("checks"):
        found += "; no drop"
    else:
        found += "; drops: no data (not checked yet: 30 s of history needed)"
    grade = "amber" if drops else "green" if tp.get("checks") else "none"
    out.append(("throughput", grade, found, MEANING["throughput"]))
    return out


def _num(x) -> str:
    return "no data" if x is None or not math.isfinite(x) else f"{x:.1f}"


class LockHistogram(QtWidgets.QWidget):
    """Lock waits by decade: the engine step's and the snapshot reader's bars side by side, height log(1 + count),
    each count written above its bar."""

    def __init__(self):
        super().__init__()
        self.hist: dict[str, list[int]] = {}
        self.setMinimumHeight(74)
        self.setMaximumHeight(96)
        self._font = QtGui.QFont(self.font())
        self._font.setPointSize(7)
        self.setToolTip("time the engine step (per step, every acquisition summed) and the snapshot reader (per "
                        "snapshot) waited for the engine lock, counted by decade since the engine started: a reader "
                        "that holds the lock long shows as steps in the right-hand bins")

    def set_hist(self, lock_wait: dict) -> None:
        hist = {w: list(lock_wait.get(w, {}).get("hist", [])) for w in WHO_COLOURS}
        if hist != self.hist:
            self.hist = hist
            self.update()

    def paintEvent(self, event) -> None:
        p = QtGui.QPainter(self)
        p.fillRect(self.rect(), QtGui.QColor("#15181d"))
        p.setFont(self._font)
        fm = QtGui.QFontMetrics(self._font)
        line = fm.height()
        p.setPen(QtGui.QColor("#c8ccd4"))
        title = "Engine-lock wait (count per bin)"
        p.drawText(QtCore.QPointF(6, line), title)
        x = 10 + fm.horizontalAdvance(title)
        for who, colour in WHO_COLOURS.items():
            p.fillRect(QtCore.QRectF(x, line - 7, 8, 8), QtGui.QColor(colour))
            p.drawText(QtCore.QPointF(x + 11, line), who)
            x += 18 + fm.horizontalAdvance(who)
        top, bottom = line + 4 + line, self.height() - line - 2
        n = len(LOCK_BINS)
        w = (self.width() - 12) / n
        counts = [c for v in self.hist.values() for c in v]
        peak = math.log1p(max(counts)) if counts and max(counts) else 1.0
        for i, label in enumerate(LOCK_BINS):
            x0 = 6 + i * w
            for j, (who, colour) in enumerate(WHO_COLOURS.items()):
                v = self.hist.get(who, [])
                c = v[i] if i < len(v) else 0
                bh = (bottom - top) * math.log1p(c) / peak
                r = QtCore.QRectF(x0 + 2 + j * (w - 4) / 2, bottom - bh, (w - 6) / 2, bh)
                p.fillRect(r, QtGui.QColor(colour))
                if c:
                    p.setPen(QtGui.QColor("#aab0b8"))
                    text = f"{c:,}" if c < 10_000 else f"{c / 1000:.0f}k"
                    p.drawText(QtCore.QRectF(r.left() - 6, r.top() - line, r.width() + 12, line),
                               QtCore.Qt.AlignHCenter | QtCore.Qt.AlignBottom, text)
            p.setPen(QtGui.QColor("#aab0b8"))
            p.drawText(QtCore.QRectF(x0, bottom + 1, w, line), QtCore.Qt.AlignHCenter, label)
        if not counts or not max(counts):
            p.drawText(QtCore.QRectF(0, top, self.width(), bottom - top), QtCore.Qt.AlignCenter, "no data")
        p.end()


class DiagnosticsPanel(QtWidgets.QWidget):
    """The checklist (one line per check, coloured as the strip's), the lock-wait histogram, and tokens/s with the
    throughput drops marked."""

    def __init__(self):
        super().__init__()
        lay = QtWidgets.QVBoxLayout(self)
        lay.setContentsMargins(2, 2, 2, 2)
        lay.setSpacing(2)
        self.text = FitLabel("font-size: 8pt;")
        self.text.setTextFormat(QtCore.Qt.RichText)
        self.lock = LockHistogram()
        self.chart = StripChart("Throughput (drops marked)", "tokens / s", span_s=SERIES_LEN * SERIES_PERIOD_S)
        self.chart.add_series("tokens_per_s", "tokens/s (5 s)", "#81c784", width=2,
                              tip="tokens generated per second over the last 5 s, on the engine's clock")
        self.chart.add_series("bandwidth_util", "bandwidth × 100", "#ba68c8", dots=True,
                              tip="a decode step's bytes (weights + K/V read) ÷ its time, as a share of the peak, × 100 "
                                  "to share the axis")
        self.chart.setMinimumHeight(90)
        inner = QtWidgets.QWidget()
        il = QtWidgets.QVBoxLayout(inner)
        il.setContentsMargins(0, 0, 0, 0)
        il.setSpacing(2)
        il.addWidget(self.text)
        il.addWidget(self.lock)
        il.addWidget(self.chart, 1)
        scroll = QtWidgets.QScrollArea()
        scroll.setWidget(inner)
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QtWidgets.QFrame.NoFrame)
        scroll.setHorizontalScrollBarPolicy(QtCore.Qt.ScrollBarAlwaysOff)
        lay.addWidget(scroll)
        self.rows: list[tuple[str, str, str, str]] = []
        self._text_at = 0.0

    def minimumSizeHint(self) -> QtCore.QSize:
        return QtCore.QSize(200, 120)

    def update_snapshot(self, snap: Snapshot) -> None:
        h = snap.health
        self.rows = rows(h)
        self.lock.set_hist(h.get("lock_wait", {}))
        x = snap.series.get("t", np.zeros(0)) - snap.t
        ys = {"tokens_per_s": snap.series.get("tokens_per_s", np.full(len(x), np.nan))}
        if "bandwidth_util" in snap.series:
            ys["bandwidth_util"] = snap.series["bandwidth_util"] * 100
        self.chart.set_marks([(t - snap.t, kind, label) for t, kind, label in snap.marks])
        self.chart.set_data(x, ys)
        if time.monotonic() - self._text_at < 0.5 and self.text.text():
            return
        self._text_at = time.monotonic()
        lines = []
        for name, grade, found, meaning in self.rows:
            lines.append(f"<tr><td><span style='color:{GRADE_COLOURS[grade]}'>&#9679;</span>&nbsp;<b>{html.escape(name)}"
                         f"</b></td><td>{html.escape(found)}</td></tr>")
        self.text.setText("<table cellspacing=1>" + "".join(lines) + "</table>")
        self.text.setToolTip("\n".join(f"{name}: {meaning}" for name, _, _, meaning in self.rows)
                             + f"\nlock wait p99 / max: of the last {LOCK_SAMPLES} waits; (n): waits since start")
