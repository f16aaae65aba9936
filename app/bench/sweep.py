"""`kvscope bench --workload/--trace [--sweep KNOB=V1,V2 ...]`: replay one workload against several cache
configs and compare them in a table, JSON, CSV and a figure.

The model loads once; each config gets a fresh Engine on it, so runs share no cache state. This module holds
the flags, the configs, the workload and the command; one run is engine/workloads/replay.py, the report app/bench/sweep_report.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from dataclasses import dataclass

from app.options import cache_config
from engine.workloads.replay import LiveChange, RunResult, replay
from app.bench.sweep_report import (format_health, format_live_change, format_table, plot_sweep, report, row_of,
                                     write_csv)

WORKLOADS = ("chat", "returning", "documents", "forks", "mixed")
DEFAULT_REQUESTS = 12
MIXED_DURATION_S = 30.0
DOC_TOKENS = 384


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
    g.add_argument("--live-change", action="append", metavar="KNOB=V",
                   help="an A/B of a change made while the workload runs (repeatable: one change of several "
                        "knobs): a control run, and a run reconfigured after --change-at-step steps; prints the "
                        "prefix hit rate before and after that step in both, and the memory the change held")
    g.add_argument("--change-at-step", type=_positive_int, default=200, metavar="N",
                   help="with --live-change: the engine step after which the change is made (default 200)")
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


def parse_live_change(specs: list[str] | None, base) -> dict:
    """`KNOB=V` strings as one change {knob: value}, validated against `base` (raises ConfigError)."""
    from engine.config import ConfigError

    changes: dict = {}
    for spec in specs or []:
        knob, sep, value = (x.strip() for x in spec.partition("="))
        knob = knob.replace("-", "_")
        if not sep or not knob or not value or "," in value:
            raise ConfigError(f"--live-change {spec!r}: expected KNOB=V (one value, e.g. block_size=32)")
        changes[knob] = value
    if changes:
        try:
            new = base.replace(**changes)
        except ConfigError as e:
            raise ConfigError(f"--live-change: {e}") from None
        if new == base:
            raise ConfigError("--live-change: that is the base config already; nothing would change")
    return changes


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
    from engine.workloads import requests as w
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

    if getattr(args, "shadow_every_s", None) is None:
        args.shadow_every_s = 0.0  # replays compare configs on the engine alone unless shadow steps are asked for
    try:  # everything a user can get wrong is checked before the (slow) model load
        base = cache_config(args)
        configs = sweep_configs(base, parse_sweeps(getattr(args, "sweep", None), base))
        live = parse_live_change(getattr(args, "live_change", None), base)
        if live and len(configs) > 1:
            raise ConfigError("--live-change and --sweep: use one or the other")
        name, requests = build_workload(args, base)
    except (ConfigError, RequestError, OSError) as e:
        print(f"kvscope: error: {e}", file=sys.stderr)
        return 2
    from app.bench.machine_line import announce_machine

    announce_machine(args)  # the input read and checked: now the figures' machine
    from app.commands import open_engine

    engine, load_s = open_engine(args)
    _warm_up(engine)
    loaded, options = engine.loaded, engine.options
    del engine  # each config gets its own engine; don't hold this one's pools meanwhile
    time_scale = getattr(args, "time_scale", 1.0)
    cap = getattr(args, "max_new_tokens_cap", None)
    changes: list[LiveChange | None] = [None] * len(configs)
    if live:
        at = getattr(args, "change_at_step", 200)
        label = " ".join(f"{k}={v}" for k, v in live.items())
        configs = [("control", configs[0][1]), (f"live {label}", configs[0][1])]
        changes = [LiveChange(at, {}), LiveChange(at, live)]
    progress = Progress(len(configs))
    results: list[RunResult] = []
    for i, (label, config) in enumerate(configs, 1):
        def tick(done: int, elapsed: float, i=i, label=label) -> None:
            progress.update(i, label, done, len(requests), elapsed)

        try:
            res = replay(loaded, config, options, requests, label, time_scale, cap, tick, changes[i - 1])
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
    if live:
        meta["live_change"] = {r.label: r.live_change for r in results}
    if getattr(args, "json", False):
        print(json.dumps({"machine": getattr(args, "machine", None), **report(meta, results)}))
    else:
        scale = "all at once" if time_scale == 0 else f"time x{time_scale:g}"
        print(f"model {meta['model']} on {meta['device']}, workload {name}: {len(requests)} requests ({scale}"
              f"{f', at most {cap} new tokens each' if cap else ''})")
        print(format_table(rows))
        print(format_health(results))
        if live:
            print(format_live_change(results))
    if getattr(args, "csv", None):
        write_csv(rows, args.csv)
        print(f"[sweep] wrote {args.csv}", file=sys.stderr)
    if getattr(args, "plot", None):
        plot_sweep(results, f"KV Scope sweep: {meta['model']}, {name}, {len(requests)} requests", args.plot)
        print(f"[sweep] wrote {args.plot}", file=sys.stderr)
    if not any(r.finished for r in results):  # every request refused or aborted in every config (said above)
        print(f"kvscope: error: no request of {name} finished in any config", file=sys.stderr)
        return 2
    return 0
