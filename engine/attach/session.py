"""An attach session: a subscriber thread per publisher endpoint, a scraper thread per /metrics URL, one
ClusterState they feed, and optionally a Recorder. Read-only: every socket connects, HTTP is GET.

What a reader gets is a `Frame`: one immutable bundle per redraw (the block snapshot for a colour mode, the
stream health of every source, the notes since the last frame, and on slow frames the metrics). The window
asks for frames the same way whether the session runs on threads of its own process (this class) or in an
ingest process of its own (engine/attach/worker.py), which keeps the decoding off the window's GIL.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import zmq

from engine.attach import bounds
from engine.attach.cluster import ClusterSnapshot, ClusterState, GroupKey
from engine.attach.metrics import MetricsSample, Rates, Scraper
from engine.attach.recorder import Recorder
from engine.attach.source import SourceSpec
from engine.attach.subscriber import SourceStatus, Subscriber

# What the events cannot tell, said in the window beside the map (and in the README).
LIMITS = (
    "Cells are placed by block hash, not by physical slot: KV events never name a slot.",
    "Only full blocks that entered the prefix cache are published: blocks being filled by running requests "
    "(in flight) are not shown. /metrics' usage counts blocks held by running requests (a cached block nobody "
    "holds counts as free there), so it and the map's count measure different things.",
    "Events carry no request ids: per-request block tables and owners are unknown.",
    "Cache hits are not published: reuse and heat count later stores that named a block as their parent.",
    "Blocks stored before attaching are shown only if the server's replay buffer still held them.",
)


@dataclass(frozen=True)
class MetricsView:
    label: str
    url: str
    interval_s: float
    history: tuple[Rates, ...]
    latest: MetricsSample | None
    error: str | None


@dataclass(frozen=True)
class Frame:
    snap: ClusterSnapshot
    statuses: tuple[SourceStatus, ...]
    notes: tuple[tuple[float, str, str], ...]  # (time, kind, text) since the previous frame
    capacities: dict[int, int]  # source index -> num_gpu_blocks from its /metrics
    metrics: tuple[MetricsView, ...] | None = None  # slow frames only
    event_times: dict[str, np.ndarray] | None = None  # slow frames only: residency times from events


class AttachSession:
    def __init__(self, specs: list[SourceSpec], metrics_urls: list[str] = (), *, half_life_s: float = 10.0,
                 replay_timeout_s: float = 2.0, scrape_interval_s: float = 1.0, record: bool = False):
        if not specs and not metrics_urls:
            raise ValueError("nothing to attach to: give at least one --vllm / --sglang endpoint or --metrics URL")
        if len(specs) > bounds.MAX_SOURCES or len(metrics_urls) > bounds.MAX_SOURCES:
            raise ValueError(f"{len(specs):,} endpoints and {len(metrics_urls):,} /metrics URLs: at most "
                             f"{bounds.MAX_SOURCES:,} of each in one session")
        self.specs = list(specs)
        self.cluster = ClusterState([s.label for s in self.specs], half_life_s=half_life_s)
        self.recorder = Recorder(self.cluster.labels) if record else None
        self.cluster.recorder = self.recorder
        self._ctx = zmq.Context()
        self.subscribers = [Subscriber(s, i, self.cluster, self._ctx, replay_timeout_s=replay_timeout_s)
                            for i, s in enumerate(self.specs)]
        named = {}
        for s in self.specs:
            if s.metrics:
                named.setdefault(s.metrics, s.name or s.label)
        urls = list(dict.fromkeys(list(named) + list(metrics_urls)))
        self.scrapers = [Scraper(u, named.get(u) or _url_label(u), interval_s=scrape_interval_s) for u in urls]
        self.started_at: float | None = None
        self._stopped = False

    # -- what every session offers the window --------------------------------------------------------------
    @property
    def labels(self) -> list[str]:
        return list(self.cluster.labels)

    @property
    def metrics_labels(self) -> list[str]:
        return [x.label for x in self.scrapers]

    @property
    def recording(self) -> bool:
        return self.recorder is not None

    def start(self) -> "AttachSession":
        self.started_at = time.time()
        for t in self.subscribers + self.scrapers:
            t.start()
        return self

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for t in self.subscribers + self.scrapers:
            t.stop()
        self._ctx.term()

    def frame(self, mode: str = "age", slow: bool = False, wait: bool = True) -> Frame:
        """The frame now (`wait` is for AttachClient's signature: here every frame is fresh)."""
        snap = self.cluster.snapshot(mode)
        caps = {}
        for i in range(len(self.specs)):
            x = self.scraper_for(i)
            v = x.latest().values.get("num_gpu_blocks") if x is not None and x.latest() is not None else None
            if v:
                caps[i] = int(v)
        metrics = times = None
        if slow:
            metrics = tuple(MetricsView(x.label, x.url, x.interval_s, tuple(x.history()), x.latest(), x.last_error)
                            for x in self.scrapers)
            times = self.cluster.event_times()
        return Frame(snap, tuple(self.statuses()), tuple(self.cluster.take_notes()), caps, metrics, times)

    def block_info(self, key: GroupKey, cell: int) -> dict | None:
        return self.cluster.block_info(key, cell)

    def save_recording(self, path: str) -> dict:
        if self.recorder is None:
            raise ValueError("this session is not recording (kvscope attach --record FILE.npz)")
        with self.cluster.lock:  # a copy of the columns; the reads are worked out after, unlocked
            cols = self.recorder.columns()
        return self.recorder.save(path, cols)

    # -- in-process extras (tests, the worker) ------------------------------------------------------------
    def snapshot(self, mode: str = "age") -> ClusterSnapshot:
        return self.cluster.snapshot(mode)

    def statuses(self) -> list[SourceStatus]:
        return [s.status() for s in self.subscribers]

    def scraper_for(self, source: int) -> Scraper | None:
        """The /metrics scraper of a source: the one given with it, else the only one on the same host."""
        spec = self.specs[source]
        if spec.metrics:
            return next(x for x in self.scrapers if x.url == spec.metrics)
        host = _host(spec.endpoint)
        match = [x for x in self.scrapers if _host(x.url) == host]
        return match[0] if len(match) == 1 else None

    def events_received(self) -> int:
        return sum(a.events for a in self.cluster.activity())


def _host(url: str) -> str:
    return url.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]


def _url_label(url: str) -> str:
    rest = url.split("://", 1)[-1]
    return rest.split("/", 1)[0]
