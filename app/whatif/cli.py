"""`kvscope policy-lab --curve | --block-sizes | --thresholds | --validate`: the what-if curves on the command line.

The curves are engine/lab/mrc.py and engine/lab/whatif.py; the validation against the real engine is
app/whatif/check.py. A TRACE is an engine access trace (.npz) or a Mooncake / Bailian block-hash trace (.jsonl).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from engine.lab.mrc import Curve, curve_capacities, what_if_line
from engine.telemetry.health import json_safe
from engine.lab.whatif import BLOCK_SIZES, Stream, block_size_curves, groups_of, policy_curves, stream_of, threshold_curve

TARGET = 0.75  # the seeds' monitoring target: device hit rate >= 75 %
THRESHOLDS = (0.0, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)


def add_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("what-if curves (hit rate against capacity; README: Tuning your cache)")
    g.add_argument("--curve", action="store_true",
                   help="hit rate against capacity. First the engine as configured: for a trace recorded by this "
                        "version (its tokens, knobs and capacity are in it), the engine's own scheduler and KV layer "
                        "rerun on its requests at 1/4 to 8x the recorded device capacity (heat decay on the run's "
                        "seconds, eviction batches, prefetch, idle demotion, the host tier), calibrated so the "
                        "recorded capacity gives the run's own rates; three rates each: FIRST READS (each sequence's "
                        "first read of a block found on the device tier: what the curves count), PREFIX (prompt "
                        "tokens served from the prefix cache, a block on the host tier included: the health strip's "
                        "number and its 75%% target) and KEYS READ (keys attention read straight from the device "
                        "tier: the window's blue hit-rate line). Then each policy alone as a demand-paged cache "
                        "(first reads): LRU exact (Mattson stack distances), heat and S3-FIFO by SHARDS-sampled "
                        "simulation, with no batches, prefetch, demotion or host tier")
    g.add_argument("--no-rerun", action="store_true",
                   help="--curve without the engine-as-configured reruns (the policy curves only)")
    g.add_argument("--current", type=int, metavar="BLOCKS",
                   help="the device tier's capacity in blocks to read the curves at (default: --capacity's first "
                        "value, else the capacity the trace was recorded at, else where LRU is nearest 50%%)")
    g.add_argument("--block-mib", type=float, metavar="MIB", help="MiB per block, to say capacities in MiB")
    g.add_argument("--recency", choices=("every", "first"), default="every",
                   help="what moves a block in LRU's order: every read (as the engine's LRU) or only the counted "
                        "first reads (the policy lab's replay)")
    g.add_argument("--group", metavar="G",
                   help="the KV-cache group whose reads the curves replay (a trace of a grouped model records each "
                        "group's), or 'all' (default: every group the trace read, each with its own rows)")
    g.add_argument("--block-sizes", action="store_true",
                   help="LRU curves at block sizes 8/16/32/64 by re-cutting the trace's recorded tokens (an .npz "
                        "recorded by this version), or at 1/2/4x a block-hash trace's block")
    g.add_argument("--thresholds", action="store_true",
                   help="LRU hit rate at --current blocks against the demotion threshold (demote_after_s)")
    g.add_argument("--validate", action="store_true",
                   help="check the engine-as-configured prediction on the real engine (needs no TRACE): a help desk's "
                        "requests arriving at their times (many in flight), the default knobs with each policy, a "
                        "base run traced at a budget 2.5x the blocks the running sequences read at once, the "
                        "prediction from its trace against real reruns at 0.5x, 2x and 4x that budget, on the wall "
                        "clock (run it on a quiet machine); then the LRU curve against plain-LRU reruns of 3 more "
                        "workloads")
    g.add_argument("--time", type=int, nargs="?", const=1_000_000, metavar="ACCESSES",
                   help="instead: time the curves (LRU, heat, S3-FIFO) of a synthetic Zipf trace of ACCESSES reads "
                        "(default 1,000,000) and print seconds per policy beside the load average (needs no TRACE)")
    g.add_argument("--backend", choices=("numba", "numpy"),
                   help="the curves' inner loops: compiled with numba (the default where it imports) or numpy / "
                        "Python (the fallback)")
    g.add_argument("--model", help="--validate: the model (default: SmolLM2-135M-Instruct)")
    g.add_argument("--requests", type=int, default=24, help="--validate: requests per workload (default 24)")
    g.add_argument("--rate", type=float, default=2.0,
                   help="--validate: the help desk's requests a second (default 2: several in flight on the default "
                        "model)")
    g.add_argument("--window", type=int, default=2, help="--validate: requests in the engine at once (default 2)")
    g.add_argument("--max-new-tokens-cap", type=int, default=16, help="--validate: cap on generated tokens")


def wants_what_if(args: argparse.Namespace) -> bool:
    return bool(args.curve or args.block_sizes or args.thresholds or args.validate or args.time is not None
                or (args.trace and args.trace.endswith(".jsonl")))


def load_stream(args: argparse.Namespace, group: int = 0):
    """(stream, source text, trace or None, block-hash requests or None)."""
    from engine.kv.access_trace import AccessTrace
    from engine.lab.policy_lab import scan_polluted_trace
    from engine.lab.whatif import block_stream
    from engine.workloads.public_traces import read_block_trace

    if args.synthetic:
        k = scan_polluted_trace(args.seed)
        s = Stream(k, np.arange(len(k)) * 0.01, np.ones(len(k), dtype=bool), None, False)
        return s, f"synthetic scan-polluted chat trace (seed {args.seed})", None, None
    if args.trace.endswith(".jsonl"):
        reqs = read_block_trace(args.trace)
        return block_stream(reqs), f"{args.trace} ({reqs[0].fmt}, {reqs[0].block_tokens}-token blocks)", None, reqs
    trace = AccessTrace.load(args.trace)
    if len(trace) == 0:
        raise ValueError(f"{args.trace}: the trace is empty")
    s = stream_of(trace, args.recency, group)
    if len(s.keys) == 0:
        raise ValueError(f"{args.trace}: no reads of KV-cache group {group} (it has groups "
                         f"{', '.join(map(str, groups_of(trace)))})")
    named = "by contents" if s.content else "by serial (no tokens recorded)"
    return s, f"{args.trace} ({len(trace):,} reads; blocks named {named})", trace, None


def _configured(args: argparse.Namespace, trace, current: int, group: int) -> tuple[list[str], dict | None]:
    """The engine-as-configured lines and JSON (engine/lab/kv_replay.py), or a line saying why there are none."""
    if trace is None or args.no_rerun or group != 0:
        return [], None
    from engine.lab.kv_replay import KVReplay, KVReplayError, configured_lines, default_capacities, knobs_text

    try:
        replay = KVReplay(trace)
        if replay.recorded_capacity is None:
            raise KVReplayError("the trace does not say the device tier's capacity (recorded by an older version)")
        t0 = time.perf_counter()
        caps = default_capacities(int(replay.recorded_capacity), current)
        if getattr(args, "capacity", None):
            caps = sorted(set(caps) | set(args.capacity))
        cal = replay.calibrated(caps)
    except KVReplayError as e:
        return [f"engine as configured: not predicted ({e})"], None
    took = time.perf_counter() - t0
    lines = configured_lines(cal, knobs_text(replay.config), current, args.block_mib)
    lines.append(f"  ({len(cal.runs)} reruns in {took:.1f} s; a step's time fitted to the recorded steps: "
                 f"{1e3 * replay.cost.fixed_s:.2f} ms + {1e6 * replay.cost.per_token_s:.1f} us a token + "
                 f"{1e6 * replay.cost.per_seq_s:.1f} us a sequence)")
    doc = {"policy": replay.config.policy, "knobs": replay.config.as_dict(), "recorded_capacity": cal.recorded_capacity,
           "capacities": cal.capacities().tolist(), "measured": cal.measured, "offset": cal.offset,
           "step_cost": {"fixed_s": replay.cost.fixed_s, "per_token_s": replay.cost.per_token_s,
                         "per_seq_s": replay.cost.per_seq_s}, "seconds": took,
           **{rate: cal.predicted(rate).tolist() for rate in cal.RATES}}
    return lines, json_safe(doc)


def _curve_table(curves: list[Curve], mib: float | None) -> str:
    caps = curves[-1].capacities  # the simulated policies' (fewer) capacities, where every curve has a point
    pick = np.unique(np.linspace(0, len(caps) - 1, min(len(caps), 12)).round().astype(int))
    w = 10
    head = "capacity".ljust(12) + "".join(f"{int(caps[i]):,}".rjust(w) for i in pick)
    lines = ["hit rate (%) of the counted reads by capacity in blocks" + (f" ({mib:g} MiB a block)" if mib else ""),
             head]
    for c in curves:
        mark = "" if c.exact else " ~"
        at = dict(zip(c.capacities.tolist(), c.hit_rate.tolist()))
        vals = [at.get(int(caps[i]), float("nan")) for i in pick]
        lines.append((c.policy + mark).ljust(12) + "".join(
            ("—" if np.isnan(v) else f"{100 * v:.1f}").rjust(w) for v in vals))
    lines.append("(~: SHARDS-sampled estimate; LRU is exact at every capacity)")
    return "\n".join(lines)


def _nearest_half(c: Curve) -> int:
    return int(c.capacities[int(np.nanargmin(np.abs(c.hit_rate - 0.5)))])


def plot_curves(curves: list[Curve], path: str, current: int, title: str, mib: float | None) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    scale = mib or 1.0
    for c in curves:
        ax.plot(c.capacities * scale, 100 * c.hit_rate, label=c.policy + ("" if c.exact else " (sampled)"),
                linewidth=2.0 if c.policy == "lru" else 1.4)
    ax.axvline(current * scale, color="black", linestyle=":", label="current capacity")
    ax.axhline(100 * TARGET, color="tab:red", linestyle="--", linewidth=1, label="target 75 %")
    ax.set_xscale("log")
    ax.set_xlabel("device capacity (MiB)" if mib else "device capacity (blocks)")
    ax.set_ylabel("hit rate of first reads (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=9, loc="lower right")
    ax.set_title(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path)


def main(args: argparse.Namespace) -> int:
    if args.time is not None:
        return time_command(args)
    if args.backend:
        from engine.lab.mrc import set_backend

        set_backend(args.backend)
    if args.validate:
        return validate(args)
    groups = _groups(args)
    outs, text = [], []
    for g in groups:
        out, lines = _one_group(args, g, len(groups) > 1)
        outs.append(out)
        text += lines
    doc = dict(outs[0])
    if len(groups) > 1:  # the first group's curves at the top (as a one-group trace has them), then every group's
        doc["groups"] = outs
    print(json.dumps(doc) if args.json else "\n".join(text))
    return 0


def _groups(args: argparse.Namespace) -> list[int]:
    """--group: one KV-cache group, or every group the trace read (the default; a block-hash trace has one)."""
    if args.synthetic or (args.trace and args.trace.endswith(".jsonl")):
        if args.group not in (None, "all", "0"):
            raise ValueError(f"--group {args.group}: this trace has one group (0)")
        return [0]
    from engine.kv.access_trace import AccessTrace

    have = groups_of(AccessTrace.load(args.trace))
    if args.group in (None, "all"):
        return have
    try:
        g = int(args.group)
    except ValueError:
        raise ValueError(f"--group must be a KV-cache group number or 'all', got {args.group!r}") from None
    if g not in have:
        raise ValueError(f"--group {g}: the trace has groups {', '.join(map(str, have))}")
    return [g]


def _one_group(args: argparse.Namespace, group: int, several: bool) -> tuple[dict, list[str]]:
    t0 = time.perf_counter()
    stream, source, trace, reqs = load_stream(args, group)
    caps = curve_capacities(stream.distinct)
    policies = tuple(p for p in (args.policy or ("lru", "heat", "s3fifo")) if p != "opt")
    decay = (args.decay or [0.9])[0]
    curves = policy_curves(stream, caps, policies=policies, decay=decay, seed=args.seed)
    took = time.perf_counter() - t0
    lru = next((c for c in curves if c.policy == "lru"), curves[0])
    recorded = ((trace.meta or {}).get("capacity", {}).get("device") if trace is not None else None)
    current = args.current or (args.capacity[0] if getattr(args, "capacity", None) else None) or recorded or \
        _nearest_half(lru)
    out: dict = {"trace": source, "group": group, "accesses": int(len(stream.keys)), "counted": int(stream.counted.sum()),
                 "distinct_blocks": stream.distinct, "current": current, "seconds": took,
                 "curves": [{"policy": c.policy, "exact": c.exact, "capacities": c.capacities.tolist(),
                             "hit_rate": c.hit_rate.tolist()} for c in curves]}
    text = [f"— KV-cache group {group} —"] if several else []
    text += [f"{source}: {len(stream.keys):,} accesses, {int(stream.counted.sum()):,} counted (each sequence's first "
            f"read of a block), {stream.distinct:,} distinct blocks; curves in {took:.2f} s",
            _curve_table(curves, args.block_mib)]
    conf_lines, conf = _configured(args, trace, current, group)
    if conf is not None:
        out["configured"] = conf
    text += conf_lines
    text.append("each policy alone (a demand-paged cache of the first reads: no eviction batches, prefetch, idle "
                "demotion or host tier):")
    text += ["  " + what_if_line(c, current, args.block_mib, TARGET) for c in curves]
    if args.block_sizes:
        rows = _block_size_rows(args, trace, reqs, group)
        out["block_sizes"] = rows
        text.append("LRU by block size (same bytes: capacity in MiB = blocks × block size × MiB per token)")
        for r in rows:
            text.append(f"  block {r['block_size']:>3}: " + ", ".join(
                f"{x:g} {'MiB' if args.block_mib else 'x current bytes'}: {100 * h:.1f} %"
                for x, h in zip(r["at"], r["hit_rate_at"])))
    if args.thresholds:
        th = threshold_curve(stream, current, THRESHOLDS)
        out["thresholds"] = {"demote_after_s": list(THRESHOLDS), "hit_rate": th.tolist(), "capacity": current}
        text.append(f"LRU at {current:,} blocks by demotion threshold: " + ", ".join(
            f"{t:g} s {100 * h:.1f} %" for t, h in zip(THRESHOLDS, th)))
    if args.plot:
        stem, dot, ext = args.plot.rpartition(".")
        path = args.plot if not group else (f"{stem}.g{group}.{ext}" if dot else f"{args.plot}.g{group}")
        plot_curves(curves, path, current, f"What if: {source}" + (f", KV-cache group {group}" if several else ""),
                    args.block_mib)
        text.append(f"figure: {path}")
    return out, text


def time_command(args: argparse.Namespace) -> int:
    """`--time [N]`: seconds per policy on a synthetic N-access trace (app/bench/curves.py)."""
    from app.bench.curves import format_timing, time_curves

    r = time_curves(args.time, args.backend, args.seed)
    print(json.dumps(r) if args.json else format_timing(r))
    return 0


def _block_size_rows(args, trace, reqs, group: int = 0) -> list[dict]:
    """Per block size: the hit rate at 0.5, 1, 2 and 4 times the current bytes."""
    from engine.lab.mrc import lru_curve
    from engine.lab.whatif import block_stream

    current = args.current
    factors = (0.5, 1.0, 2.0, 4.0)
    rows = []
    if reqs is not None:
        base = reqs[0].block_tokens
        for m in (1, 2, 4):
            s = block_stream(reqs, merge=m)
            cur = current or max(1, s.distinct // 4)
            caps = [max(1, round(cur * f / m)) for f in factors]  # same bytes: 1/m as many blocks
            c = lru_curve(s.keys, caps, s.counted)
            rows.append({"block_size": base * m, "at": list(factors), "capacities": caps, "hit_rate_at": c.hit_rate.tolist()})
        return rows
    if trace is None:
        raise ValueError("--block-sizes needs a TRACE (an .npz with recorded tokens, or a block-hash .jsonl)")
    bs0 = trace.block_size
    tokens_cap = (current or max(1, stream_of(trace, args.recency, group).distinct // 4)) * (bs0 or 16)
    per_token = (args.block_mib / bs0) if (args.block_mib and bs0) else None
    for b, _, _ in [(b, None, None) for b in BLOCK_SIZES]:
        from engine.lab.whatif import rebin

        s = rebin(trace, b, args.recency, group)
        caps = [max(1, round(tokens_cap * f / b)) for f in factors]
        c = lru_curve(s.keys, caps, s.counted, fresh=s.fresh)
        at = [round(tokens_cap * f * per_token, 2) for f in factors] if per_token else list(factors)
        rows.append({"block_size": b, "at": at, "capacities": caps, "hit_rate_at": c.hit_rate.tolist()})
    return rows


def validate(args: argparse.Namespace) -> int:
    """The engine-as-configured check (app/whatif/check.py check_as_configured: a help desk, each policy with the
    default knobs, on the wall clock), then the LRU curve against plain-LRU reruns of 3 workloads."""
    from app.whatif.check import (budget_for_blocks, check_as_configured, check_workload, configured_summary,
                                  default_workloads, format_configured, format_rows, run_traced, running_set, summary,
                                  PLAIN_LRU)
    from engine.config import CacheConfig, EngineOptions
    from engine.model.loader import load_model
    from engine.workloads.requests import reference_desk

    loaded = load_model(args.model)
    options = EngineOptions(attention="auto")
    t0 = time.perf_counter()
    roomy = _roomy_blocks(loaded)  # the sizing runs' device tier: everything fits, a quarter of the memory at most
    desk = reference_desk(args.requests, args.seed, rate_per_s=args.rate, n_docs=max(3, args.requests // 4))
    configured = []
    for policy in ("heat", "lru", "s3fifo"):
        base = CacheConfig(block_size=16, policy=policy)  # every other knob at its default
        run_traced(loaded, base, options, desk[:4], args.max_new_tokens_cap, None, 0.0)  # kernels loaded
        sizing, _, _ = run_traced(loaded, base.replace(device_budget_mb=budget_for_blocks(loaded, base, roomy)),
                                  options, desk, args.max_new_tokens_cap, None, 1.0)
        blocks = args.current or int(2.5 * running_set(sizing))
        cfg = base.replace(device_budget_mb=budget_for_blocks(loaded, base, blocks))
        configured += check_as_configured(loaded, options, cfg, "desk", desk, cap=args.max_new_tokens_cap)
        print(f"[validate] desk, {policy}: done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    rows = []
    base = CacheConfig(block_size=16, host_budget_mb=256.0)
    for name, reqs in default_workloads(args.seed, args.requests):
        # Base capacity: a quarter of the distinct blocks (the curve's knee is below it on these workloads), but
        # at 0.5x still more than the blocks the running sequences hold at once (below that the tier thrashes on
        # its running set, which no cache curve models).
        trace, _, _ = run_traced(loaded, base.replace(**PLAIN_LRU, device_budget_mb=budget_for_blocks(loaded, base, roomy)),
                                 options, reqs, args.max_new_tokens_cap, args.window)
        s = stream_of(trace)
        blocks = args.current or max(int(2.5 * running_set(trace)), s.distinct // 4)
        cfg = base.replace(device_budget_mb=budget_for_blocks(loaded, base, blocks))
        rows += check_workload(loaded, options, cfg, name, reqs, cap=args.max_new_tokens_cap, window=args.window)
        print(f"[validate] {name}: done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(json_safe({"configured": configured_summary(configured), **summary(rows)})))
    else:
        print("the engine as configured (default knobs but the policy), a help desk's requests at their times:")
        print(format_configured(configured))
        print()
        print("the LRU curve against plain-LRU reruns (policy lru, no demotion, no prefetch, two requests at a time):")
        print(format_rows(rows))
    return 0


def _roomy_blocks(loaded, block_size: int = 16) -> int:
    """Device-tier blocks for a run where nothing is evicted: 65,536, or as many as a quarter of the memory holds."""
    import psutil

    from engine.config import CacheConfig
    from engine.kv.block_pool import BlockPool

    s = loaded.spec
    per = BlockPool.bytes_per_block(CacheConfig(block_size=block_size), s.num_layers, s.num_kv_heads, s.head_dim)
    return max(64, min(1 << 16, psutil.virtual_memory().total // 4 // per))

