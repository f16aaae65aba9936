"""The attach window's side panels: metrics charts and histograms, per-source stream health, events.

Each takes plain values from the session (statuses, rates, samples) and never reads a socket.
"""

from __future__ import annotations

import math
import time

import numpy as np
from PySide6 import QtWidgets

from engine.attach.metrics import MetricsSample, Rates
from engine.attach.subscriber import SourceStatus
from ui.panels.lists import EventsPanel
from ui.charts.strip_chart import StripChart

COLOURS = ("#4fc3f7", "#ffb74d", "#81c784", "#e57373", "#ba68c8", "#fff176", "#4db6ac", "#f06292")
NO_DATA = "no data"
HIST_ROWS = ("lifetime", "idle_before_evict", "reuse_gap")
HIST_COLUMNS = (("lifetime", "Block lifetime: stored → removed."),
                ("idle before evict", "Idle before eviction: last touch → removed."),
                ("reuse gap", "Time between two touches of a block. From events a touch is a store naming the "
                              "block as its parent, which includes a request's own next block (its next decode "
                              "block or prefill chunk), so short gaps weigh more there than in vLLM's histogram."))


def _resample(hist: list[Rates], field: str, grid: np.ndarray, interval_s: float) -> np.ndarray:
    """The series at each grid time: the latest sample at or before it, NaN where none is recent enough."""
    if not hist:
        return np.full(len(grid), np.nan)
    t = np.asarray([r.t for r in hist])
    y = np.asarray([getattr(r, field) for r in hist], dtype=np.float64)
    i = np.searchsorted(t, grid, side="right") - 1
    ok = (i >= 0) & (grid - t[np.maximum(i, 0)] <= 2.5 * interval_s)
    return np.where(ok, y[np.maximum(i, 0)], np.nan)


class MetricsPanel(QtWidgets.QWidget):
    """Hit rate, usage and preemptions per /metrics URL over the last minutes; the residency histograms."""

    def __init__(self, labels: list[str], span_s: float = 300.0):
        super().__init__()
        self.labels = list(labels)
        lay = QtWidgets.QVBoxLayout(self)
        lay.setContentsMargins(2, 2, 2, 2)
        self.hit = StripChart("prefix cache hit rate", "%", span_s, y_range=(0.0, 100.0))
        self.hit.setToolTip("vLLM: Δ vllm:prefix_cache_hits / Δ vllm:prefix_cache_queries between two scrapes "
                            "(tokens; dashed: since the server started). SGLang: the sglang:cache_hit_rate gauge. "
                            "Summed over the engines one URL serves.")
        self.usage = StripChart("KV cache usage", "%", span_s, y_range=(0.0, 100.0))
        self.usage.setToolTip("vllm:kv_cache_usage_perc (or sglang:token_usage) × 100, averaged over the engines "
                              "one URL serves. Counts every allocated block, in flight ones too.")
        self.preempt = StripChart("preemptions", "/s", span_s)
        self.preempt.setToolTip("Δ vllm:num_preemptions per second between two scrapes (vLLM only).")
        for i, lab in enumerate(self.labels):
            c = COLOURS[i % len(COLOURS)]
            self.hit.add_series(f"h{i}", lab, c, 1.5)
            self.hit.add_series(f"t{i}", f"{lab} total", c, 1.0, dashed=True)
            self.usage.add_series(f"u{i}", lab, c, 1.5)
            self.preempt.add_series(f"p{i}", lab, c, 1.2)
        self.table = QtWidgets.QTableWidget(1 + len(self.labels), len(HIST_ROWS))
        self.table.setHorizontalHeaderLabels([short for short, _ in HIST_COLUMNS])
        for c, (_, tip) in enumerate(HIST_COLUMNS):
            self.table.horizontalHeaderItem(c).setToolTip(tip + "  Cells: p50 / p90.")
        self.table.setVerticalHeaderLabels(["events"] + self.labels)
        self.table.verticalHeaderItem(0).setToolTip("Computed here from BlockStored / BlockRemoved events of every "
                                                    "GPU cache: the latest 8,192 removed blocks whose store was seen, "
                                                    "and the latest 8,192 touches (a store naming a resident parent).")
        for i in range(len(self.labels)):
            self.table.verticalHeaderItem(1 + i).setToolTip(
                "vLLM's sampled histograms vllm:kv_block_lifetime_seconds, _idle_before_evict_seconds, "
                "_reuse_gap_seconds (served only with --kv-cache-metrics); p50 / p90 interpolated in the buckets.")
        self.table.setEditTriggers(QtWidgets.QAbstractItemView.NoEditTriggers)
        self.table.horizontalHeader().setSectionResizeMode(QtWidgets.QHeaderView.Stretch)
        self.table.setMaximumHeight(40 + 26 * (1 + len(self.labels)))
        self.status = QtWidgets.QLabel()
        self.status.setWordWrap(True)
        for w in (self.hit, self.usage, self.preempt):
            lay.addWidget(w, 1)
        lay.addWidget(self.table)
        lay.addWidget(self.status)
        if not self.labels:
            for w in (self.hit, self.usage, self.preempt):
                w.set_note("no /metrics URL given (--metrics)")

    def update_metrics(self, now: float, histories: list[list[Rates]], latest: list[MetricsSample | None],
                       errors: list[str | None], event_times: dict[str, np.ndarray], interval_s: float) -> None:
        self.update_charts(now, histories, interval_s)
        self.update_table(latest, errors, event_times)

    def update_charts(self, now: float, histories: list[list[Rates]], interval_s: float) -> None:
        """The three strip charts (the window gives them a frame of their own: the table takes another)."""
        first = min((h[0].t for h in histories if h), default=now)
        n = int(min(self.hit.max_span, max(now - first, interval_s)) / interval_s) + 1
        grid = now - np.arange(n)[::-1] * interval_s
        x = grid - now
        ys_h, ys_u, ys_p = {}, {}, {}
        notes = {"h": [], "u": [], "p": []}
        for i, hist in enumerate(histories):
            for key, field, ys in (("h", "hit_rate", ys_h), ("t", "hit_rate_total", ys_h), ("u", "usage", ys_u),
                                   ("p", "preemptions_per_s", ys_p)):
                y = _resample(hist, field, grid, interval_s)
                ys[f"{key}{i}"] = 100.0 * y if key in "htu" else y
                if key in notes and not np.isfinite(y).any():
                    notes[key].append(self.labels[i])
        for chart, key, ys in ((self.hit, "h", ys_h), (self.usage, "u", ys_u), (self.preempt, "p", ys_p)):
            if self.labels:
                chart.set_note(f"{NO_DATA}: {', '.join(notes[key])}" if notes[key] else "")
                chart.set_data(x, ys)

    def update_table(self, latest: list[MetricsSample | None], errors: list[str | None],
                     event_times: dict[str, np.ndarray]) -> None:
        """The residency histograms' p50 / p90 and the scrape's own notes."""
        for c, key in enumerate(HIST_ROWS):
            self._cell(0, c, _summary_events(event_times.get(key)))
            for i, s in enumerate(latest):
                h = s.histograms.get(key) if s is not None else None
                self._cell(1 + i, c, NO_DATA if h is None or not h.count else
                           f"{_s(h.quantile(0.5))} / {_s(h.quantile(0.9))}", f"{h.count:,.0f} samples" if h else "")
        bad = [f"{lab}: {e}" for lab, e in zip(self.labels, errors) if e]
        odd = [f"{lab}: {'; '.join(s.notes)}" for lab, s in zip(self.labels, latest) if s is not None and s.notes]
        text = ("scrape failing — " + "; ".join(bad)) if bad else ""
        if odd:
            text += ("\n" if text else "") + f"{NO_DATA} (values that cannot be true) — " + "; ".join(odd)
        self.status.setText(text)

    def _cell(self, r: int, c: int, text: str, tip: str = "") -> None:
        it = self.table.item(r, c)
        if it is None:
            it = QtWidgets.QTableWidgetItem()
            self.table.setItem(r, c, it)
        if it.text() != text:
            it.setText(text)
            it.setToolTip(tip)

    def text_of(self, r: int, c: int) -> str:
        it = self.table.item(r, c)
        return it.text() if it else ""


def _s(v: float) -> str:
    if not math.isfinite(v):
        return "—"
    return f"{v * 1e3:.0f} ms" if v < 1 else f"{v:.1f} s"


def _summary_events(v: np.ndarray | None) -> str:
    if v is None or not len(v):
        return NO_DATA
    p50, p90 = np.percentile(v, (50, 90))
    return f"{_s(float(p50))} / {_s(float(p90))}"


SOURCE_COLUMNS = (
    ("source", "the endpoint's label (host:port, /dpN for a data-parallel rank)"),
    ("frames", "ZMQ messages received on the live stream"),
    ("batches", "event batches applied, live and replayed"),
    ("events", "events applied: BlockStored + BlockRemoved + AllBlocksCleared"),
    ("malformed", "frames skipped: wrong frame count, a sequence number that is not 8 bytes, or a payload that is "
                  "not a KVEventBatch; plus events inside good batches whose fields made no sense"),
    ("gaps", "jumps in the sequence numbers / batches recovered from the replay socket / batches lost "
             "(not in the replay buffer any more, or no replay endpoint): their events are missing"),
    ("history", "batches published before we attached: got from the replay buffer / no longer there"),
    ("behind", "how far behind the live stream this source is: how long the oldest frame received and not yet "
               "applied has waited, and how many are queued (frames wait while a replay request is open, at most "
               "its deadline). Past 60 s or 200,000 frames the oldest are shed (dropped unread, counted lost); "
               "'replay resting': the replay socket did not answer, gaps are counted lost unasked for 30 s"),
    ("last frame", "time since the last live frame"),
)


def behind_text(s: SourceStatus) -> str:
    """'0.0 s, 0 queued', with shedding and a resting replay socket said."""
    text = f"{s.behind_s:.1f} s, {s.queued:,} queued"
    if s.shed:
        recent = s.shed_age_s is not None and s.shed_age_s < 10.0
        text += f"; {'SHEDDING: ' if recent else ''}{s.shed:,} shed"
    if s.replay_state == "backoff":
        text += "; replay resting"
    return text


class SourcesPanel(QtWidgets.QTableWidget):
    def __init__(self):
        super().__init__(0, len(SOURCE_COLUMNS))
        self.setHorizontalHeaderLabels([c for c, _ in SOURCE_COLUMNS])
        for i, (_, tip) in enumerate(SOURCE_COLUMNS):
            self.horizontalHeaderItem(i).setToolTip(tip)
        self.setEditTriggers(QtWidgets.QAbstractItemView.NoEditTriggers)
        self.verticalHeader().setVisible(False)
        # Columns sized by the code below, not ResizeToContents: that mode measured every cell again on each
        # setText (a frame of the soak's 4 updates a second). A column widens when a text needs more room and
        # narrows only when the rows change.
        self.horizontalHeader().setSectionResizeMode(QtWidgets.QHeaderView.Interactive)
        self.horizontalHeader().setStretchLastSection(True)
        self._fit_rows = -1

    def update_status(self, statuses: list[SourceStatus], events: list[int], bad_events: list[int]) -> None:
        if self.rowCount() != len(statuses):
            self.setRowCount(len(statuses))
        fm = self.fontMetrics()
        pad = 2 * self.style().pixelMetric(QtWidgets.QStyle.PM_FocusFrameHMargin, None, self) + 8
        refit = self._fit_rows != len(statuses)
        need = [self.horizontalHeader().sectionSizeHint(c) for c in range(self.columnCount())] if refit else None
        for r, s in enumerate(statuses):
            age = "never" if s.last_frame_age_s is None else f"{s.last_frame_age_s:.1f} s ago"
            row = (s.label, f"{s.frames:,}", f"{s.batches:,}", f"{events[r]:,}", f"{s.malformed + bad_events[r]:,}",
                   f"{s.gaps:,} / {s.recovered:,} / {s.lost:,}", f"{s.history:,} / {s.history_missing:,}",
                   behind_text(s), age)
            for c, text in enumerate(row):
                it = self.item(r, c)
                if it is None:
                    it = QtWidgets.QTableWidgetItem()
                    self.setItem(r, c, it)
                changed = it.text() != text
                if changed:
                    it.setText(text)
                if need is None and not changed:
                    continue
                w = fm.horizontalAdvance(text) + pad
                if need is not None:
                    need[c] = max(need[c], w)
                elif w > self.columnWidth(c):
                    self.setColumnWidth(c, w)
            self.item(r, 0).setToolTip(f"{s.endpoint}\nreplay: {s.replay or 'none'}\nlost seqs: "
                                       + (", ".join(f"{a}..{b}" for a, b in s.lost_ranges) or "none"))
        if need is not None:
            for c, w in enumerate(need):
                self.setColumnWidth(c, w)
            self._fit_rows = len(statuses)


class AttachEventsPanel(EventsPanel):
    """Notable events one by one (gaps, replays, malformed frames, clears), the block traffic as one line per
    source per second (tens of thousands of events a second cannot be read one by one)."""

    KINDS = ("all", "stored", "removed", "cleared", "gap", "replay", "behind", "shed", "malformed", "source", "error")

    def __init__(self):
        super().__init__()
        self.list.COLOURS = {"removed": "#e57373", "gap": "#ff5252", "shed": "#ff5252", "behind": "#ffb74d",
                             "malformed": "#ff8a65", "error": "#ff5252",
                             "cleared": "#ffd54f", "replay": "#4fc3f7", "stored": "#81c784", "source": "#aab0b8"}
        self.setToolTip("stored / removed: one line per source per second with the blocks and events of that second")

    def add_lines(self, lines: list[tuple[float, str, str]]) -> None:
        if lines:
            self._append(lines)

    def lines(self) -> list[str]:
        return [self.list.item(i).text() for i in range(self.list.count())]


def traffic_lines(labels: list[str], prev: tuple, cur: tuple, now: float | None = None) -> list[tuple[float, str, str]]:
    """One "stored" and one "removed" line per source with what changed between two activity snapshots."""
    now = time.time() if now is None else now
    out = []
    for lab, a, b in zip(labels, prev, cur):
        if b.stored_events > a.stored_events:
            out.append((now, "stored", f"{lab}: {b.stored_blocks - a.stored_blocks:,} blocks in "
                                       f"{b.stored_events - a.stored_events:,} events"))
        if b.removed_events > a.removed_events:
            out.append((now, "removed", f"{lab}: {b.removed_blocks - a.removed_blocks:,} blocks in "
                                        f"{b.removed_events - a.removed_events:,} events"))
    return out
