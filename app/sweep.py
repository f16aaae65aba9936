"""`kvscope bench --workload/--trace [--sweep KNOB=V1,V2 ...]`: replay one workload against several cache
configs and compare them in a table, JSON, CSV and a figure.

The model loads once; each config gets a fresh Engine on it, so runs share no cache state. A request enters
the engine once its (scaled) arrival time has passed on the engine clock. That clock is real time plus the
idle gaps it skipped: when the engine has nothing to do before the next arrival, time jumps there instead of
sleeping, so an idle user still ages past demote_after_s but the wait costs no wall time.

Every request generates exactly its max_new_tokens (EOS ignored), so every config does the same work and
throughputs compare. A later turn of a session waits for the reply before it, then arrives as a new request
whose prompt is the conversation so far (its blocks come back through the prefix cache). A fork `seq_cp`s
its parent once the parent has its first token, or runs as a plain request if the parent has finished.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gc
import itertools
import json
import math
import os
import sys
import time
import zlib
from dataclasses import dataclass, field

import numpy as np

from app.cli import cache_config

WORKLOADS = ("chat", "returning", "documents", "forks", "mixed")
DEFAULT_REQUESTS = 12
MIXED_DURATION_S = 30.0
DOC_TOKENS = 384
FORK_TEMPERATURE = 0.8  # nbest requests and their forks sample, so the forks diverge
RESIDENCY = ("reuse_gap", "age_at_hit", "age_at_eviction", "lifetime")
# 1-2-5 bin edges from 1 ms to 1000 s (values above the last edge land in the last bin).
BIN_EDGES_S = (0.0,) + tuple(m * 10.0**e for e in range(-3, 3) for m in (1, 2, 5)) + (1000.0,)


# -- flags ------------------------------------------------------------------------------------

def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return n


def _non_negative_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = -1.0
    if not (x >= 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return x


def _positive_float(text: str) -> float:
    x = _non_negative_float(text)
    if x == 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return x


def add_sweep_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload replay and config sweeps (instead of --compare)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--workload", choices=WORKLOADS,
                     help="replay a built-in workload: shared-system-prompt chat, returning users, long documents, "
                          "n-best forks, or a mix of all")
    src.add_argument("--trace", metavar="FILE.jsonl", help="replay a JSONL trace (see assets/example_trace.jsonl)")
    g.add_argument("--requests", type=_positive_int, metavar="N",
                   help=f"requests of a --workload (default {DEFAULT_REQUESTS}; mixed: every one within --duration)")
    g.add_argument("--seed", type=int, default=0, help="seed of a --workload")
    g.add_argument("--duration", type=_positive_float, metavar="S",
                   help=f"keep requests arriving before S seconds (mixed: default {MIXED_DURATION_S:g})")
    g.add_argument("--sweep", action="append", metavar="KNOB=V1,V2,...",
                   help="run once per value (repeatable: the cartesian product of all sweeps), e.g. "
                        "--sweep block_size=8,32 --sweep kv_dtype=fp32,int8")
    g.add_argument("--csv", metavar="OUT.csv", help="write one row per config")
    g.add_argument("--plot", metavar="OUT.png", help="write a figure comparing the configs")
    g.add_argument("--time-scale", type=_non_negative_float, default=1.0, metavar="X",
                   help="replay arrivals X times faster (default 1; 0: all at once)")
    g.add_argument("--max-new-tokens-cap", type=_positive_int, metavar="N",
                   help="generate at most N tokens per request (quick runs)")


# -- configs ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sweep:
    knob: str
    values: tuple[str, ...]


def parse_sweeps(specs: list[str] | None, base):
    """`KNOB=V1,V2,...` strings as Sweeps; every value is validated against `base` (raises ConfigError)."""
    from engine.config import ConfigError

    out: list[Sweep] = []
    for spec in specs or []:
        knob, sep, rest = spec.partition("=")
        knob = knob.strip().replace("-", "_")
        values = tuple(dict.fromkeys(v.strip() for v in rest.split(",") if v.strip()))
        if not sep or not knob or not values:
            raise ConfigError(f"--sweep {spec!r}: expected KNOB=V1,V2,... (e.g. block_size=8,16)")
        if any(s.knob == knob for s in out):
            raise ConfigError(f"--sweep: {knob} is swept twice; give all its values in one --sweep")
        for v in values:
            try:
                base.replace(**{knob: v})
            except ConfigError as e:
                raise ConfigError(f"--sweep {spec}: {e}") from None
        out.append(Sweep(knob, values))
    return out


def _show(value) -> str:
    label = getattr(value, "label", None)
    if isinstance(label, str):
        return label
    return f"{value:g}" if isinstance(value, float) else str(value)


def sweep_configs(base, sweeps: list[Sweep]) -> list[tuple[str, object]]:
    """(label, CacheConfig) for every combination, first sweep outermost; label "base" without sweeps."""
    if not sweeps:
        return [("base", base)]
    out = []
    for combo in itertools.product(*(s.values for s in sweeps)):
        config = base.replace(**{s.knob: v for s, v in zip(sweeps, combo)})
        out.append((" ".join(f"{s.knob}={_show(getattr(config, s.knob))}" for s in sweeps), config))
    return out


# -- workloads --------------------------------------------------------------------------------

def build_workload(args: argparse.Namespace, base) -> tuple[str, list]:
    """(name, requests) of --trace or --workload; raises RequestError for a bad trace."""
    from engine import workloads as w
    from engine.errors import RequestError

    if args.trace:
        try:
            reqs = w.load_trace(args.trace)
        except ValueError as e:
            raise RequestError(str(e)) from None
        name = os.path.basename(args.trace)
    else:
        n, seed = args.requests or DEFAULT_REQUESTS, args.seed
        sessions = max(1, math.ceil(n / 3))
        if args.workload == "chat":
            reqs = w.shared_system_chat(sessions, 3, seed)
        elif args.workload == "returning":
            reqs = w.returning_users(sessions, base.demote_after_s + 1.0, seed)  # idle past demotion
        elif args.workload == "documents":
            reqs = w.long_documents(n, DOC_TOKENS, seed)
        elif args.workload == "forks":
            reqs = w.forks(sessions, 3, seed)
        else:
            reqs = w.mixed(seed, args.duration or MIXED_DURATION_S)
        if args.workload != "mixed" or args.requests:
            reqs = reqs[:n]
        name = f"{args.workload} (seed {seed})"
    if args.duration:
        reqs = [r for r in reqs if r.arrival_s < args.duration]
    if not reqs:
        raise RequestError(f"{name}: no requests to replay")
    return name, reqs


# -- one replay -------------------------------------------------------------------------------

class ReplayClock:
    """The engine clock of a replay: real time plus the idle gaps skipped."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    def skip(self, seconds: float) -> None:
        self.offset += max(0.0, seconds)


@dataclass
class RunResult:
    label: str
    config: object
    requests: int
    finished: int = 0
    forked: int = 0  # forks served by seq_cp of a live parent
    refused: list[str] = field(default_factory=list)
    generated: int = 0
    wall_s: float = 0.0
    idle_skipped_s: float = 0.0  # engine-clock time jumped over while nothing was running (costs no wall time)
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    peak_device_bytes: int = 0
    peak_host_bytes: int = 0
    counters: dict = field(default_factory=dict)
    residency: dict[str, np.ndarray] = field(default_factory=dict)


class Replay:
    """Feeds a request list to one engine by arrival time and records what each step produced."""

    def __init__(self, engine, requests: list, time_scale: float, cap: int | None, clock: ReplayClock):
        from engine.workloads import ChatFormat

        self.engine, self.clock = engine, clock
        self.cap = cap
        at = (lambda r: r.arrival_s / time_scale) if time_scale > 0 else (lambda r: 0.0)
        # Sorted by arrival: load_trace and the generators sort.
        self.queue = collections.deque((at(r), r) for r in requests)
        self.ready: list = []  # arrived, waiting for their session's reply or their fork parent
        self.fmt = ChatFormat(engine.tokenizer)
        self.session_sid: dict[str, int | None] = {}  # session -> its latest sequence (None: refused)
        self.history: dict[str, list[int]] = {}  # session -> tokens so far, once its latest reply is done
        self.submitted: dict[int, float] = {}
        self.tokens_at: dict[int, list[float]] = {}
        self.live: set[int] = set()

    # -- the loop --------------------------------------------------------------------------------
    def run(self, result: RunResult, on_progress) -> RunResult:
        e, clock = self.engine, self.clock
        t0, w0, skipped0 = clock(), time.perf_counter(), clock.offset
        while True:
            self.feed(clock() - t0, result)
            if e.has_work():
                outs = e.step()
                self.observe(outs, clock(), result)
                pool = e.pool
                result.peak_device_bytes = max(result.peak_device_bytes, pool.tiers[0].used * pool.block_bytes)
                result.peak_host_bytes = max(result.peak_host_bytes, pool.tiers[1].used * pool.block_bytes)
            elif self.queue:
                clock.skip(self.queue[0][0] - (clock() - t0))  # idle until the next arrival: jump there
            elif self.ready:
                self._submit_ready(result, force=True)  # nothing left to wait for
            else:
                break
            on_progress(result.finished + len(result.refused), time.perf_counter() - w0)
        result.wall_s = time.perf_counter() - w0
        result.idle_skipped_s = clock.offset - skipped0
        for sid, times in self.tokens_at.items():
            if times:
                result.ttft_s.append(times[0] - self.submitted[sid])
                result.itl_s.extend(np.diff(times).tolist())
        result.counters = e.counters.as_dict()
        result.residency = {k: np.asarray(e.telemetry.residency[k], dtype=np.float64) for k in RESIDENCY}
        return result

    def feed(self, now: float, result: RunResult) -> None:
        """Submit what has arrived by `now` (seconds since the replay began) and can start."""
        while self.queue and self.queue[0][0] <= now:
            self.ready.append(self.queue.popleft()[1])
        self._submit_ready(result, force=False)

    def observe(self, outs, t: float, result: RunResult) -> None:
        """Record one engine step's tokens (at time t) of this replay's sequences."""
        for out in outs:
            times = self.tokens_at.get(out.seq_id)
            if times is None:
                continue  # not ours (a prompt typed in the window)
            times.append(t)
            result.generated += 1
            if out.finished:
                self._finished(out.seq_id, result)

    @property
    def done(self) -> bool:
        return not (self.queue or self.ready or self.live)

    def _submit_ready(self, result: RunResult, force: bool) -> None:
        for r in list(self.ready):
            if force or self._can_start(r):
                self.ready.remove(r)
                self._start(r, result)

    def _can_start(self, r) -> bool:
        if r.fork_of is not None:
            if r.fork_of not in self.session_sid:
                return False  # the parent has not arrived (or is itself waiting)
            parent = self.session_sid[r.fork_of]
            return parent is None or parent not in self.live or bool(self.tokens_at[parent])
        return self.session_sid.get(r.session) not in self.live  # a later turn waits for the reply

    # -- requests --------------------------------------------------------------------------------
    def _sampling(self, r):
        from engine.sequence import SamplingParams

        n = min(r.max_new_tokens, self.cap) if self.cap else r.max_new_tokens
        if r.kind in ("nbest", "fork"):
            return SamplingParams(max_new_tokens=n, temperature=FORK_TEMPERATURE, seed=zlib.crc32(r.session.encode()),
                                  ignore_eos=True)
        return SamplingParams(max_new_tokens=n, ignore_eos=True)

    def _prompt(self, r) -> list[int]:
        history = self.history.get(r.session) if r.kind == "turn" else None
        if r.prompt_tokens is not None:
            return (history or []) + list(r.prompt_tokens)
        if r.kind == "chat":
            return self.fmt.first(None, self.fmt.encode(r.prompt))
        if r.kind == "turn":
            body = self.fmt.encode(r.prompt)
            if not history:
                return self.fmt.first(None, body)
            ended = history[-1] if history[-1] in self.engine.eos else None
            return history + self.fmt.next_turn(body, ended)
        return self.engine.tokenizer.encode(r.prompt)

    def _start(self, r, result: RunResult) -> None:
        from engine.errors import RequestError

        e = self.engine
        parent = self.session_sid.get(r.fork_of) if r.fork_of is not None else None
        try:
            if parent is not None and parent in self.live and self.tokens_at[parent]:
                sid = e.seq_cp(parent, self._sampling(r), label=r.session)
                result.forked += 1
            else:
                sid = e.add_request(self._prompt(r), self._sampling(r), label=r.session)
        except RequestError as ex:
            self.session_sid[r.session] = None
            result.refused.append(f"{r.session} at {r.arrival_s:g} s: {ex}")
            return
        self.session_sid[r.session] = sid
        self.submitted[sid] = self.clock()
        self.tokens_at[sid] = []
        self.live.add(sid)

    def _finished(self, sid: int, result: RunResult) -> None:
        seq = self.engine.seqs[sid]
        self.live.discard(sid)
        self.history[seq.label] = list(seq.tokens)  # prompt + reply (what a context shift kept)
        result.finished += 1


def replay(loaded, config, options, requests: list, label: str = "base", time_scale: float = 1.0,
           cap: int | None = None, on_progress=lambda done, elapsed: None) -> RunResult:
    """Replay `requests` on a fresh engine with `config`; raises ConfigError if the engine refuses the config."""
    from engine.engine import Engine

    gc.collect()  # an engine and its telemetry refer to each other: free the last run's pools and weights now
    clock = ReplayClock()
    engine = Engine(loaded, config, options, clock=clock)
    return Replay(engine, requests, time_scale, cap, clock).run(RunResult(label, config, len(requests)), on_progress)


# -- results ----------------------------------------------------------------------------------

def _pct(values, q: float, scale: float = 1.0) -> float:
    return float(np.percentile(values, q)) * scale if len(values) else float("nan")


def histogram(values: np.ndarray) -> dict:
    edges = np.asarray(BIN_EDGES_S)
    counts, _ = np.histogram(np.clip(values, 0.0, edges[-1]), bins=edges)
    return {"n": int(len(values)), "p50_s": _pct(values, 50), "p90_s": _pct(values, 90),
            "edges_s": edges.tolist(), "counts": counts.tolist()}


def row_of(r: RunResult) -> dict:
    """One flat row of scalars: the table, the CSV and the JSON all show these."""
    c = r.counters
    row = {
        "config": r.label, "requests": r.requests, "finished": r.finished, "refused": len(r.refused),
        "forked": r.forked, "generated_tokens": r.generated, "wall_s": r.wall_s,
        "idle_skipped_s": r.idle_skipped_s,
        "tokens_per_s": r.generated / r.wall_s if r.wall_s > 0 else 0.0,
        "ttft_p50_ms": _pct(r.ttft_s, 50, 1e3), "ttft_p95_ms": _pct(r.ttft_s, 95, 1e3),
        "itl_p50_ms": _pct(r.itl_s, 50, 1e3), "itl_p95_ms": _pct(r.itl_s, 95, 1e3),
        "device_hit_rate": c["device_hit_rate"], "prefix_hit_rate": c["prefix_hit_rate"],
        "evictions": c["evictions"], "promotions": c["promotions"], "promoted_bytes": c["promoted_bytes"],
        "demotions": c["demotions"], "demoted_bytes": c["demoted_bytes"],
        "peak_device_bytes": r.peak_device_bytes, "peak_host_bytes": r.peak_host_bytes,
        "preemptions": c["preemptions"],
    }
    for k in RESIDENCY:
        row[f"{k}_p50_s"] = _pct(r.residency[k], 50)
        row[f"{k}_p90_s"] = _pct(r.residency[k], 90)
    return row


def _finite(x):
    return None if isinstance(x, float) and not math.isfinite(x) else x


def report(meta: dict, results: list[RunResult]) -> dict:
    """The --json object: what ran, one row per config, and residency histograms per config."""
    rows = [{k: _finite(v) for k, v in row_of(r).items()} for r in results]
    residency = {r.label: {k: {kk: _finite(vv) for kk, vv in histogram(r.residency[k]).items()} for k in RESIDENCY}
                 for r in results}
    return {**meta, "configs": [{"label": r.label, **r.config.as_dict()} for r in results], "rows": rows,
            "residency": residency}


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _ms(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.0f}" if x >= 10 else f"{x:.1f}"


def _secs(x: float) -> str:
    if not math.isfinite(x):
        return "-"
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s" if x < 100 else f"{x:.0f} s"


TABLE = (  # header (units in it), cell
    ("config", lambda r: r["config"]),
    ("done", lambda r: f"{r['finished']}/{r['requests']}"),
    ("wall s", lambda r: f"{r['wall_s']:.1f}"),
    ("tok/s", lambda r: f"{r['tokens_per_s']:.1f}"),
    ("TTFT p50/p95 ms", lambda r: f"{_ms(r['ttft_p50_ms'])} / {_ms(r['ttft_p95_ms'])}"),
    ("ITL p50/p95 ms", lambda r: f"{_ms(r['itl_p50_ms'])} / {_ms(r['itl_p95_ms'])}"),
    ("dev hit %", lambda r: f"{100 * r['device_hit_rate']:.1f}"),
    ("prefix hit %", lambda r: f"{100 * r['prefix_hit_rate']:.1f}"),
    ("evict", lambda r: str(r["evictions"])),
    ("promote n/MB", lambda r: f"{r['promotions']} / {_mb(r['promoted_bytes'])}"),
    ("demote n/MB", lambda r: f"{r['demotions']} / {_mb(r['demoted_bytes'])}"),
    ("peak dev/host MB", lambda r: f"{_mb(r['peak_device_bytes'])} / {_mb(r['peak_host_bytes'])}"),
    ("preempt", lambda r: str(r["preemptions"])),
)


def format_table(rows: list[dict]) -> str:
    cells = [[h for h, _ in TABLE]] + [[cell(r) for _, cell in TABLE] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(TABLE))]
    lines = []
    for n, line in enumerate(cells):
        parts = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        out = csv.DictWriter(f, fieldnames=list(rows[0]))
        out.writeheader()
        out.writerows({k: "" if isinstance(v, float) and not math.isfinite(v) else v for k, v in r.items()}
                      for r in rows)


def best_of(results: list[RunResult]) -> RunResult:
    return max(results, key=lambda r: row_of(r)["tokens_per_s"])


def plot_sweep(results: list[RunResult], title: str, path: str) -> None:
    """A 2x2 figure: throughput, TTFT, hit rates per config; residency histograms of the fastest config."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    rows = [row_of(r) for r in results]
    best = best_of(results)
    n = len(rows)
    parts = [r["config"].split(" ") for r in rows]
    knobs = [p.partition("=")[0] for p in parts[0]] if "=" in rows[0]["config"] else []
    compact = n > 4 and knobs  # many configs: values only, the knob names once in the axis label
    names = ["\n".join(p.partition("=")[2] if compact else p for p in ps) for ps in parts]
    xlabel = " / ".join(knobs) + " (top to bottom)" if compact else ""
    x = np.arange(n)
    fig = Figure(figsize=(max(12.0, 1.3 * n + 5), 9.5), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title, fontsize=14)
    (a_tp, a_ttft), (a_hit, a_res) = fig.subplots(2, 2)
    blue, orange, grey = "#3b75af", "#ef8636", "#9aa5b1"

    def config_axis(ax) -> None:
        ax.set_xticks(x, names, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=9)
        ax.set_xlim(-0.5 - 0.5 * max(0, 3 - n), n - 0.5 + 0.5 * max(0, 3 - n))  # no bar wider than a third
        ax.spines[["top", "right"]].set_visible(False)

    tps = [r["tokens_per_s"] for r in rows]
    bars = a_tp.bar(x, tps, color=[blue if r is best else grey for r in results])
    a_tp.bar_label(bars, fmt="%.1f", fontsize=9, padding=2)
    a_tp.set_title("Throughput (generated tokens per wall second; blue: fastest)")
    a_tp.set_ylabel("tokens / s")
    a_tp.set_ylim(0, max(tps + [1e-9]) * 1.15)
    config_axis(a_tp)

    wd = 0.38
    for dx, key, color, lab in ((-wd / 2, "ttft_p50_ms", blue, "p50"), (wd / 2, "ttft_p95_ms", orange, "p95")):
        vals = [r[key] if math.isfinite(r[key]) else 0.0 for r in rows]
        bars = a_ttft.bar(x + dx, vals, wd, color=color, label=lab)
        a_ttft.bar_label(bars, fmt=_ms, fontsize=8, padding=2)
    a_ttft.set_title("Time to first token")
    a_ttft.set_ylabel("ms")
    a_ttft.set_ylim(0, 1.35 * max([r["ttft_p95_ms"] for r in rows if math.isfinite(r["ttft_p95_ms"])] + [1.0]))
    a_ttft.legend(frameon=False, loc="upper center", ncols=2)
    config_axis(a_ttft)

    for dx, key, color, lab in ((-wd / 2, "device_hit_rate", blue, "device tier (block reads)"),
                                (wd / 2, "prefix_hit_rate", orange, "prefix cache (prompt tokens)")):
        bars = a_hit.bar(x + dx, [100 * r[key] for r in rows], wd, color=color, label=lab)
        a_hit.bar_label(bars, fmt="%.0f", fontsize=8, padding=2)
    a_hit.set_title("Hit rates")
    a_hit.set_ylabel("%")
    a_hit.set_ylim(0, 118)
    a_hit.legend(frameon=False, loc="upper left", ncols=2)
    config_axis(a_hit)

    edges = np.asarray(BIN_EDGES_S)
    plot_edges = edges.copy()
    plot_edges[0] = edges[1] / 2  # the [0, 1 ms) bin, drawn on a log axis
    shown, top = [], 0
    for key, color, lab in (("reuse_gap", blue, "reuse gap (idle before a prefix hit)"),
                            ("age_at_eviction", orange, "age at eviction")):
        h = histogram(best.residency[key])
        if h["n"]:
            a_res.stairs(h["counts"], plot_edges, color=color, fill=True, alpha=0.3)
            a_res.stairs(h["counts"], plot_edges, color=color, linewidth=2,
                         label=f"{lab}\nn={h['n']}, p50 {_secs(h['p50_s'])}, p90 {_secs(h['p90_s'])}")
            shown.append(np.flatnonzero(h["counts"]))
            top = max(top, max(h["counts"]))
    a_res.set_xscale("log")
    a_res.set_title(f"Block residency in the fastest config\n{best.label}")
    a_res.set_xlabel("seconds (log scale; 1-2-5 bins)")
    a_res.set_ylabel("blocks")
    a_res.spines[["top", "right"]].set_visible(False)
    if shown:
        nz = np.concatenate(shown)
        lo, hi = max(nz.min() - 1, 0), min(nz.max() + 2, len(plot_edges) - 1)
        a_res.set_xlim(plot_edges[lo], plot_edges[hi])
        a_res.set_ylim(0, top * 1.6)
        a_res.legend(frameon=False, fontsize=9, loc="upper left")
    else:
        lo, hi = 1, len(plot_edges) - 1
        a_res.set_xlim(plot_edges[lo], plot_edges[hi])
        a_res.text(0.5, 0.5, "no prefix hits and no evictions in this run", ha="center", va="center",
                   transform=a_res.transAxes, color="#555555")
        a_res.set_yticks([])
    ticks = plot_edges[lo + (lo == 0):hi + 1]
    if len(ticks) > 10:
        ticks = ticks[np.isclose(np.log10(ticks) % 1, 0) | np.isclose(np.log10(ticks) % 1, 1)]  # decades only
    a_res.xaxis.set_major_locator(FixedLocator(ticks))
    a_res.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _secs(v)))
    a_res.xaxis.set_minor_locator(NullLocator())
    fig.savefig(path, dpi=150)


# -- progress ---------------------------------------------------------------------------------

class Progress:
    """One stderr line, rewritten with \\r: config i/N, requests done/total, elapsed."""

    def __init__(self, n_configs: int, stream=None, every_s: float = 0.1):
        self.n = n_configs
        self.stream = stream or sys.stderr
        self.every_s = every_s
        self._last = -1.0
        self._width = 0

    def update(self, i: int, label: str, done: int, total: int, elapsed: float, final: bool = False) -> None:
        if not final and elapsed - self._last < self.every_s:
            return
        self._last = elapsed
        k = round(20 * done / max(total, 1))
        line = (f"[sweep] config {i}/{self.n} {label}  [{'#' * k}{'.' * (20 - k)}] requests {done}/{total}  "
                f"{elapsed:.1f} s")
        pad = max(0, self._width - len(line))
        self._width = len(line)
        print("\r" + line + " " * pad, end="\n" if final else "", file=self.stream, flush=True)
        if final:
            self._last, self._width = -1.0, 0


# -- the command ------------------------------------------------------------------------------

def _warm_up(engine) -> None:
    """One short request, so that the first config does not pay one-off allocation and kernel selection."""
    from engine.sequence import SamplingParams

    ids = engine.tokenizer.encode(" ".join(["The tide in the harbour rises twice a day."] * 6))
    engine.generate([[t % engine.spec.vocab_size for t in ids]], SamplingParams(max_new_tokens=2))


def run_sweep(args: argparse.Namespace) -> int:
    from engine.config import ConfigError
    from engine.errors import RequestError

    try:  # everything a user can get wrong is checked before the (slow) model load
        base = cache_config(args)
        configs = sweep_configs(base, parse_sweeps(getattr(args, "sweep", None), base))
        name, requests = build_workload(args, base)
    except (ConfigError, RequestError, OSError) as e:
        print(f"kvscope: error: {e}", file=sys.stderr)
        return 2

    from app.commands import open_engine

    engine, load_s = open_engine(args)
    _warm_up(engine)
    loaded, options = engine.loaded, engine.options
    del engine  # each config gets its own engine; don't hold this one's pools meanwhile
    time_scale = getattr(args, "time_scale", 1.0)
    cap = getattr(args, "max_new_tokens_cap", None)
    progress = Progress(len(configs))
    results: list[RunResult] = []
    for i, (label, config) in enumerate(configs, 1):
        def tick(done: int, elapsed: float, i=i, label=label) -> None:
            progress.update(i, label, done, len(requests), elapsed)

        try:
            res = replay(loaded, config, options, requests, label, time_scale, cap, tick)
        except ConfigError as e:
            print(f"\n[sweep] config {label} skipped: {e}", file=sys.stderr)
            continue
        progress.update(i, label, res.finished + len(res.refused), len(requests), res.wall_s, final=True)
        if res.refused:
            print(f"[sweep] config {label}: {len(res.refused)} request(s) refused, e.g. {res.refused[0]}",
                  file=sys.stderr)
        results.append(res)
    if not results:
        print("kvscope: error: no config could run", file=sys.stderr)
        return 2

    meta = {"model": loaded.spec.name, "device": options.device, "workload": name, "requests": len(requests),
            "time_scale": time_scale, "max_new_tokens_cap": cap, "model_load_s": load_s}
    rows = [row_of(r) for r in results]
    if getattr(args, "json", False):
        print(json.dumps(report(meta, results)))
    else:
        scale = "all at once" if time_scale == 0 else f"time x{time_scale:g}"
        print(f"model {meta['model']} on {meta['device']}, workload {name}: {len(requests)} requests ({scale}"
              f"{f', at most {cap} new tokens each' if cap else ''})")
        print(format_table(rows))
    if getattr(args, "csv", None):
        write_csv(rows, args.csv)
        print(f"[sweep] wrote {args.csv}", file=sys.stderr)
    if getattr(args, "plot", None):
        plot_sweep(results, f"KV Scope sweep: {meta['model']}, {name}, {len(requests)} requests", args.plot)
        print(f"[sweep] wrote {args.plot}", file=sys.stderr)
    return 0
