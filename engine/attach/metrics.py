"""A server's /metrics, scraped over HTTP and parsed with prometheus_client.

What is read (every name under the names it had in earlier releases too):
- usage: vLLM `vllm:kv_cache_usage_perc` (formerly `vllm:gpu_cache_usage_perc`), SGLang `sglang:token_usage`;
  fractions 0..1, averaged over the label sets (engines / ranks) one server exposes;
- prefix cache: vLLM counters `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` (tokens; formerly
  `vllm:gpu_prefix_cache_*`), summed over label sets; SGLang's gauge `sglang:cache_hit_rate`;
- `vllm:num_preemptions` (counter, summed); `num_gpu_blocks` (per engine) from `vllm:cache_config_info`'s labels;
- the histograms `vllm:kv_block_lifetime_seconds`, `vllm:kv_block_idle_before_evict_seconds`,
  `vllm:kv_block_reuse_gap_seconds` (only where the server runs with --kv-cache-metrics; sampled there).
A metric the server does not expose is absent from the sample (the window says "no data"), never 0. Nor is a
value that cannot be true shown: a fraction outside 0..1, a negative or non-finite counter, more hits than
queries, a block count no GPU holds, a histogram whose buckets fall: such a value is left out, and the sample's
`notes` say which and why (the window shows them beside the charts). A scrape has a deadline as a whole and a
body cap, and follows no redirect (engine/attach/http_get.py).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from engine.attach.http_get import FetchError, get

GAUGES = {"usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
          "sglang_hit_rate": ("sglang:cache_hit_rate",)}
COUNTERS = {"prefix_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
            "prefix_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
            "preemptions": ("vllm:num_preemptions",)}
HISTOGRAMS = {"lifetime": "vllm:kv_block_lifetime_seconds",
              "idle_before_evict": "vllm:kv_block_idle_before_evict_seconds",
              "reuse_gap": "vllm:kv_block_reuse_gap_seconds"}
MAX_BODY = 8 << 20  # bytes of /metrics read at most (vLLM's is tens of KB; a body over this is refused)
SCRAPE_DEADLINE_S = 3.0  # one scrape, connecting to the last byte
MAX_COUNTER = float(1 << 53)  # past this a float counter no longer counts by ones
MAX_GPU_BLOCKS = 1 << 28  # a 268M-block pool: more than any GPU holds at the smallest block
FRACTIONS = ("usage", "sglang_hit_rate")
_WANTED = tuple(sorted({n for names in GAUGES.values() for n in names} | {n for names in COUNTERS.values()
                                                                             for n in names}
                       | set(HISTOGRAMS.values()) | {"vllm:cache_config_info"}))


@dataclass(frozen=True)
class Histogram:
    count: float
    sum: float
    buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count), ascending, +Inf last

    def quantile(self, q: float) -> float:
        """Prometheus' histogram_quantile: linear within the bucket; NaN when empty."""
        if not self.buckets or self.buckets[-1][1] <= 0:
            return math.nan
        rank = q * self.buckets[-1][1]
        lo_b, lo_c = 0.0, 0.0
        for b, c in self.buckets:
            if c >= rank:
                if math.isinf(b):
                    return lo_b
                return lo_b + (b - lo_b) * ((rank - lo_c) / (c - lo_c) if c > lo_c else 1.0)
            lo_b, lo_c = b, c
        return lo_b

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else math.nan


@dataclass(frozen=True)
class MetricsSample:
    t: float
    values: dict[str, float] = field(default_factory=dict)  # keys of GAUGES / COUNTERS, plus num_gpu_blocks
    histograms: dict[str, Histogram] = field(default_factory=dict)
    error: str | None = None
    notes: tuple[str, ...] = ()  # values left out because they cannot be true (the window says "no data")


def _base(name: str) -> str:
    for suffix in ("_total", "_bucket", "_count", "_sum", "_created"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _wanted_lines(text: str) -> str:
    """Only the lines of the metrics read here (and their # TYPE / # HELP): a server's other metrics are never
    parsed, which is most of the time of a big exposition."""
    lines = text.splitlines()
    keep = []
    for line in lines:
        name = line[7:] if line.startswith(("# TYPE ", "# HELP ")) else line
        if name.startswith(_WANTED):
            keep.append(line)
    if not keep:  # none of ours: the first lines are parsed anyway, so text that is not an exposition raises
        keep = lines[:200]
    return "\n".join(keep) + "\n"


def _note_bad(values: dict, hists: dict, notes: list[str]) -> None:
    """Drop (and say) the values that cannot be true."""
    for k in FRACTIONS:
        v = values.get(k)
        if v is not None and not 0.0 <= v <= 1.0:
            notes.append(f"{k} {v:g} is not a fraction 0..1")
            del values[k]
    for k in COUNTERS:
        v = values.get(k)
        if v is not None and not 0.0 <= v <= MAX_COUNTER:
            notes.append(f"{k} {v:g} is not a count (0..2^53)")
            del values[k]
    q, h = values.get("prefix_queries"), values.get("prefix_hits")
    if q is not None and h is not None and h > q:
        notes.append(f"prefix_hits {h:g} is more than prefix_queries {q:g}")
        del values["prefix_queries"], values["prefix_hits"]
    b = values.get("num_gpu_blocks")
    if b is not None and not (1 <= b <= MAX_GPU_BLOCKS and b == int(b)):
        notes.append(f"num_gpu_blocks {b:g} is not a block count (1..{MAX_GPU_BLOCKS:,})")
        del values["num_gpu_blocks"]
    for k in list(hists):
        hs = hists[k]
        counts = [c for _, c in hs.buckets]
        ok = (all(math.isfinite(c) and c >= 0 for c in counts) and all(a <= b for a, b in zip(counts, counts[1:]))
              and 0 <= hs.count <= MAX_COUNTER and math.isfinite(hs.sum) and hs.sum >= 0
              and not any(math.isnan(le) for le, _ in hs.buckets))
        if not ok:
            notes.append(f"histogram {k}: buckets or counts that cannot be true")
            del hists[k]


def parse_metrics(text: str, t: float | None = None) -> MetricsSample:
    """The sample in a Prometheus text exposition. ValueError when the text does not parse."""
    t = time.time() if t is None else t
    text = _wanted_lines(text)
    gauge_of = {n: k for k, names in GAUGES.items() for n in names}
    counter_of = {n: k for k, names in COUNTERS.items() for n in names}
    hist_of = {n: k for k, n in HISTOGRAMS.items()}
    gauges: dict[str, list[float]] = {}
    values: dict[str, float] = {}
    hist: dict[str, dict] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name, v = s.name, float(s.value)
            if name.endswith("_created"):
                continue
            base = _base(name)
            if name in gauge_of:
                gauges.setdefault(gauge_of[name], []).append(v)
            elif base in counter_of and (name.endswith("_total") or name == base):
                key = counter_of[base]
                values[key] = values.get(key, 0.0) + v
            elif base == "vllm:cache_config_info" and "num_gpu_blocks" in s.labels:
                try:
                    values["num_gpu_blocks"] = max(values.get("num_gpu_blocks", 0.0), float(s.labels["num_gpu_blocks"]))
                except ValueError:
                    pass
            elif base in hist_of:
                h = hist.setdefault(hist_of[base], {"count": 0.0, "sum": 0.0, "buckets": {}})
                if name.endswith("_bucket"):
                    le = float(s.labels.get("le", "inf"))
                    h["buckets"][le] = h["buckets"].get(le, 0.0) + v
                elif name.endswith("_count"):
                    h["count"] += v
                elif name.endswith("_sum"):
                    h["sum"] += v
    for key, vs in gauges.items():
        finite = [v for v in vs if math.isfinite(v)]
        if finite:
            values[key] = sum(finite) / len(finite)
    hists = {k: Histogram(h["count"], h["sum"], tuple(sorted(h["buckets"].items()))) for k, h in hist.items()}
    notes: list[str] = []
    _note_bad(values, hists, notes)
    return MetricsSample(t, values, hists, notes=tuple(notes))


def fetch(url: str, timeout: float = SCRAPE_DEADLINE_S, max_body: int = MAX_BODY) -> str:
    """GET url's body as text: `timeout` for the whole scrape, at most max_body bytes, no redirects."""
    return get(url, deadline_s=timeout, max_body=max_body).decode("utf-8", "replace")


@dataclass(frozen=True)
class Rates:
    """What a chart draws, from two consecutive samples (NaN where the server gave no data)."""

    t: float
    usage: float  # fraction
    hit_rate: float  # prefix-cache hits / queries over the interval (vLLM) or SGLang's gauge
    hit_rate_total: float  # cumulative hits / queries since the server started (vLLM)
    preemptions_per_s: float


def rates(prev: MetricsSample | None, cur: MetricsSample) -> Rates:
    v, nan = cur.values, math.nan
    hit, total, pre = nan, nan, nan
    q, h = v.get("prefix_queries"), v.get("prefix_hits")
    if q is not None and h is not None:
        total = h / q if q > 0 else nan
        if prev is not None and "prefix_queries" in prev.values and "prefix_hits" in prev.values:
            dq, dh = q - prev.values["prefix_queries"], h - prev.values["prefix_hits"]
            hit = dh / dq if dq > 0 else nan  # counters reset on a server restart: dq < 0 draws nothing
            if not 0.0 <= hit <= 1.0:  # one counter reset and not the other, or counters that lie
                hit = nan
    elif "sglang_hit_rate" in v:
        hit = v["sglang_hit_rate"]
    if prev is not None and "preemptions" in v and "preemptions" in prev.values and cur.t > prev.t:
        d = v["preemptions"] - prev.values["preemptions"]
        pre = d / (cur.t - prev.t) if d >= 0 else nan
    return Rates(cur.t, v.get("usage", nan), hit, total, pre)


class Scraper(threading.Thread):
    """GET `url` every `interval_s` on its own thread; the window reads `history()` and `latest()`."""

    def __init__(self, url: str, label: str, interval_s: float = 1.0, keep: int = 900,
                 deadline_s: float = SCRAPE_DEADLINE_S, max_body: int = MAX_BODY):
        super().__init__(name=f"kvscope-metrics-{label}", daemon=True)
        self.url, self.label, self.interval_s = url, label, interval_s
        self.deadline_s, self.max_body = deadline_s, max_body
        self._lock = threading.Lock()
        self._samples: deque[MetricsSample] = deque(maxlen=keep)
        self._rates: deque[Rates] = deque(maxlen=keep)
        self._stop_ev = threading.Event()
        self.scrapes = self.failures = 0
        self.last_error: str | None = None

    def stop(self, timeout: float = 3.0) -> None:
        self._stop_ev.set()
        if self.is_alive():
            self.join(timeout)

    def scrape_once(self) -> MetricsSample:
        t = time.time()
        try:
            sample = parse_metrics(fetch(self.url, self.deadline_s, self.max_body), t)
            self.last_error = None
        except (OSError, ValueError, UnicodeError) as e:
            self.failures += 1
            self.last_error = str(e) if isinstance(e, FetchError) else f"{type(e).__name__}: {e}"
            return MetricsSample(t, error=self.last_error)
        finally:
            self.scrapes += 1
        with self._lock:
            prev = self._samples[-1] if self._samples else None
            self._samples.append(sample)
            self._rates.append(rates(prev, sample))
        return sample

    def run(self) -> None:
        while not self._stop_ev.is_set():
            self.scrape_once()
            self._stop_ev.wait(self.interval_s)

    def latest(self) -> MetricsSample | None:
        with self._lock:
            return self._samples[-1] if self._samples else None

    def history(self) -> list[Rates]:
        with self._lock:
            return list(self._rates)
