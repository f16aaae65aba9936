"""`kvscope policy-lab --validate`: the what-if curve against the real engine.

One workload is run on the real engine at a base device budget with a trace recorded; its LRU curve
(engine/lab/whatif.py, exact) predicts the device hit rate at other budgets; then the same requests are run
again at 0.5x, 2x and 4x the budget and the same hit rate is measured on each run's own trace
(`real_hit_rate`: the first read of each block by each sequence that found it computed and on the device tier).

The runs are set so that the device tier is a plain LRU cache, the thing the curve models: policy lru, no idle
demotion (demote_after_s 3600), no prefetch, a host tier large enough that nothing is preempted for room.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import numpy as np

from engine.lab.mrc import lru_curve
from engine.lab.whatif import real_hit_rate, stream_of
from engine.workloads.replay import Replay, ReplayClock, RunResult

FACTORS = (0.5, 2.0, 4.0)
PLAIN_LRU = dict(policy="lru", demote_after_s=3600.0, prefetch_depth=0)


@dataclass(frozen=True)
class CheckRow:
    workload: str
    factor: float
    budget_mib: float
    capacity: int  # device-tier blocks
    predicted: float
    real: float
    counted: int  # first reads the real rate is over

    @property
    def diff_points(self) -> float:
        return 100 * (self.predicted - self.real)


def run_traced(loaded, config, options, requests, cap: int | None, window: int | None = 2, time_scale: float = 0.0,
               clock: ReplayClock | None = None):
    """Run `requests` on a fresh engine with `config`, at most `window` of them in the engine at a time; all
    arrived at once (time_scale 0: the order of reads is the same at every budget) or at their arrival times
    divided by `time_scale`; (trace, device capacity, result). `clock`: the engine's clock (default: the wall
    clock's ReplayClock)."""
    from engine.runtime.engine import Engine

    gc.collect()
    clock = clock or ReplayClock()
    engine = Engine(loaded, config, options, clock=clock)
    engine.start_trace()
    result = Replay(engine, requests, time_scale, cap, clock, window=window).run(
        RunResult("check", config, len(requests)), lambda done, elapsed: None)
    trace = engine.stop_trace()
    capacity = int(engine.pool.sizes.dev_cap)
    return trace, capacity, result


def check_workload(loaded, options, base_config, name: str, requests: list, factors=FACTORS,
                   cap: int | None = 16, recency: str = "every", window: int | None = 2) -> list[CheckRow]:
    """The table's rows for one workload: the base run (factor 1) and one rerun per factor."""
    base = base_config.replace(**PLAIN_LRU)
    trace, cap0, _ = run_traced(loaded, base, options, requests, cap, window)
    stream = stream_of(trace, recency)
    reruns = []
    for f in factors:
        cfg = base.replace(device_budget_mb=base.device_budget_mb * f)
        t, c, _ = run_traced(loaded, cfg, options, requests, cap, window)
        reruns.append((f, cfg.device_budget_mb, c, t))
    caps = [cap0] + [c for _, _, c, _ in reruns]
    curve = lru_curve(stream.keys, caps, stream.counted, fresh=stream.fresh)
    rows = []
    for (f, mib, c, t), pred in zip([(1.0, base.device_budget_mb, cap0, trace)] + reruns, curve.hit_rate):
        real, n = real_hit_rate(t)
        rows.append(CheckRow(name, f, mib, c, float(pred), real, n))
    return rows


@dataclass(frozen=True)
class ConfiguredRow:
    """One budget of the as-configured check: the prediction made from the base run (engine/lab/kv_replay.py)
    against a real rerun at that budget, for both rates."""
    workload: str
    policy: str
    factor: float
    capacity: int
    predicted: float  # counted first reads on the device tier (real_hit_rate)
    real: float
    predicted_prefix: float  # prompt tokens served from the prefix cache
    real_prefix: float
    counted: int
    in_flight: int  # the most sequences one step of the real run read (the concurrency the check ran at)

    @property
    def diff_points(self) -> float:
        return 100 * (self.predicted - self.real)


def check_as_configured(loaded, options, config, name: str, requests: list, factors=FACTORS, cap: int | None = 16,
                        window: int | None = None, time_scale: float = 1.0, clock=ReplayClock) -> list[ConfiguredRow]:
    """The engine as `config` sets it (every knob as given), the requests arriving at their times with as many in
    flight as arrive: a base run with a trace, the prediction of the engine rerun at each factor's capacity
    (KVReplay, calibrated at the base run's measured point), and a real rerun at each factor's budget. `clock`
    makes each run's engine clock (default ReplayClock: the wall clock, idle gaps skipped)."""
    from engine.lab.kv_replay import KVReplay

    # A throwaway run first: the first steps of a process compile or load the attention kernels, seconds that a
    # wall-clock run spends with requests piling up, which neither the reruns (warm) nor a live engine see.
    run_traced(loaded, config, options, requests[:8], cap, window, 0.0, clock())
    trace, cap0, res0 = run_traced(loaded, config, options, requests, cap, window, time_scale, clock())
    measured, n0 = real_hit_rate(trace)
    prefix0 = _prefix_rate(res0)
    reruns = []
    for f in factors:
        c = max(1, int(round(cap0 * f)))
        t, got, res = run_traced(loaded, config.replace(device_budget_mb=budget_for_blocks(loaded, config, c)), options,
                                 requests, cap, window, time_scale, clock())
        reruns.append((f, got, t, res))
    pred = KVReplay(trace).calibrated([got for _, got, _, _ in reruns])
    assert pred.measured["hit_rate"] == measured and np.isclose(pred.measured["prefix_rate"], prefix0, equal_nan=True)
    rows = [ConfiguredRow(name, config.policy, 1.0, cap0, pred.at(cap0), measured, pred.at(cap0, "prefix_rate"),
                          prefix0, n0, in_flight(trace))]
    for f, got, t, res in reruns:
        real, n = real_hit_rate(t)
        rows.append(ConfiguredRow(name, config.policy, f, got, pred.at(got), real, pred.at(got, "prefix_rate"),
                                  _prefix_rate(res), n, in_flight(t)))
    return rows


def running_set(trace) -> int:
    """The most blocks one step read (rows at one time): below about that many device-tier blocks the tier
    thrashes on the running sequences' own tables, and a rerun's hit rate there turns on the exact timing."""
    if not len(trace):
        return 0
    return int(np.unique(trace.t, return_counts=True)[1].max())


def in_flight(trace) -> int:
    """The most sequences whose tables one step read (rows at one time)."""
    if not len(trace):
        return 0
    pairs = np.unique(np.stack([trace.t, trace.seq.astype(np.float64)]), axis=1)
    return int(np.unique(pairs[0], return_counts=True)[1].max())


def _prefix_rate(result) -> float:
    c = result.counters
    return c["prompt_reused"] / c["prompt_tokens"] if c.get("prompt_tokens") else float("nan")


def format_configured(rows: list[ConfiguredRow]) -> str:
    """The as-configured table, and per workload and policy the printed "at 2x" delta against the rerun's."""
    head = (f"{'workload':<16}{'policy':>8}{'budget':>8}{'blocks':>8}{'predicted %':>13}{'real %':>9}{'diff':>7}"
            f"{'prefix pred %':>15}{'prefix real %':>15}{'reads':>7}{'in flight':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.workload:<16}{r.policy:>8}{r.factor:>7g}×{r.capacity:>8,}{100 * r.predicted:>13.1f}"
                     f"{100 * r.real:>9.1f}{r.diff_points:>+7.1f}{100 * r.predicted_prefix:>15.1f}"
                     f"{100 * r.real_prefix:>15.1f}{r.counted:>7,}{r.in_flight:>10}")
    s = configured_summary(rows)
    for key, d in s["deltas"].items():
        lines.append(f"{key}: at 2x predicted {d['predicted']:+.1f} points, rerun {d['real']:+.1f} "
                     f"(off by {d['diff']:+.1f})")
    lines.append(f"largest |predicted - real| at the other budgets: {s['max_abs_diff_points']:.1f} points; "
                 f"largest |2x delta predicted - rerun|: {s['max_abs_delta_diff_points']:.1f} points")
    return "\n".join(lines)


def configured_summary(rows: list[ConfiguredRow]) -> dict:
    deltas = {}
    for r in rows:
        if r.factor != 2.0:
            continue
        base = next(b for b in rows if b.workload == r.workload and b.policy == r.policy and b.factor == 1.0)
        p, q = 100 * (r.predicted - base.real), 100 * (r.real - base.real)
        deltas[f"{r.workload}/{r.policy}"] = {"predicted": p, "real": q, "diff": p - q}
    other = [abs(r.diff_points) for r in rows if r.factor != 1.0]
    return {"rows": [dict(r.__dict__, diff_points=r.diff_points) for r in rows], "deltas": deltas,
            "max_abs_diff_points": max(other) if other else float("nan"),
            "max_abs_delta_diff_points": max((abs(d["diff"]) for d in deltas.values()), default=float("nan"))}


def format_rows(rows: list[CheckRow]) -> str:
    head = (f"{'workload':<22}{'budget':>10}{'MiB':>9}{'blocks':>8}{'predicted %':>13}{'real %':>9}"
            f"{'diff pts':>10}{'reads':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.workload:<22}{r.factor:>9g}×{r.budget_mib:>9.2f}{r.capacity:>8,}{100 * r.predicted:>13.1f}"
                     f"{100 * r.real:>9.1f}{r.diff_points:>+10.1f}{r.counted:>8,}")
    worst = max((abs(r.diff_points) for r in rows if r.factor != 1.0), default=float("nan"))
    lines.append(f"largest |predicted - real| at the other budgets: {worst:.1f} points")
    return "\n".join(lines)


def default_workloads(seed: int = 0, requests: int = 24) -> list[tuple[str, list]]:
    """Three built-in workloads with reuse of different shapes: shared-prefix chat, users who return, a mix."""
    from engine.workloads import requests as w

    sessions = max(1, requests // 3)
    return [("chat", w.shared_system_chat(sessions, 3, seed)[:requests]),
            ("returning", w.returning_users(sessions, 6.0, seed)[:requests]),
            ("forks", w.forks(max(1, requests // 4), 3, seed)[:requests])]


def budget_for_blocks(loaded, config, blocks: int) -> float:
    """The device budget (MiB) whose tier holds `blocks` blocks of `config`'s size, dtype and placement."""
    from engine.kv.block_pool import BlockPool
    from engine.kv.tiers import budget_for_blocks as kv_budget

    s = loaded.spec
    return kv_budget(config, s.num_layers, BlockPool.bytes_per_block(config, s.num_layers, s.num_kv_heads, s.head_dim),
                     blocks)


def summary(rows: list[CheckRow]) -> dict:
    other = [r for r in rows if r.factor != 1.0]
    return {"rows": [dict(r.__dict__, diff_points=r.diff_points) for r in rows],
            "max_abs_diff_points": float(np.max([abs(r.diff_points) for r in other])) if other else None}
