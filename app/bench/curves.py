"""`kvscope policy-lab --time [N]`: how long the what-if curves take on a synthetic trace of N accesses.

The trace: N reads of Zipf(1.1)-popular block ids out of N/2 (a 1,000,000-access one has ~170,000 distinct
blocks), 1 ms apart. Timed per policy as the What-if tab computes them (engine/lab/whatif.py policy_curves): LRU
exact at every capacity of curve_capacities (48 or more), heat and S3-FIFO SHARDS-sampled at 32. With the numba
backend the first call compiles the loops or loads them from numba's on-disk cache; that is timed apart, on a
tiny trace, so the per-policy seconds are the curves' own. The load average is printed beside them: on a shared
machine it says how much of the CPU the run had.
"""

from __future__ import annotations

import os
import time

import numpy as np

from engine.lab import mrc
from engine.lab.whatif import Stream, policy_curves


def zipf_stream(accesses: int, seed: int = 0, a: float = 1.1) -> Stream:
    rng = np.random.default_rng(seed)
    ids = max(accesses // 2, 1)
    w = 1.0 / np.arange(1, ids + 1) ** a
    keys = rng.choice(ids, size=accesses, p=w / w.sum()).astype(np.int64)
    keys = rng.permutation(ids)[keys]  # popularity unrelated to the id's value
    return Stream(keys, np.arange(accesses) * 0.001, np.ones(accesses, dtype=bool), None, False)


def time_curves(accesses: int = 1_000_000, backend: str | None = None, seed: int = 0,
                policies=("lru", "heat", "s3fifo")) -> dict:
    """{"backend", "accesses", "distinct", "compile_s", "seconds": {policy: s}, "points": {policy: n},
    "load_before", "load_after"}."""
    old = mrc.set_backend(backend) if backend else mrc.backend()
    try:
        s = zipf_stream(accesses, seed)
        distinct = s.distinct
        t0 = time.perf_counter()
        tiny = zipf_stream(2_000, seed)
        policy_curves(tiny, policies=policies)  # compiles (or loads) every kernel the timed runs use
        compile_s = time.perf_counter() - t0
        load_before = os.getloadavg()
        seconds, points = {}, {}
        caps = mrc.curve_capacities(distinct)
        for p in policies:
            t0 = time.perf_counter()
            (c,) = policy_curves(s, caps, policies=(p,))
            seconds[p] = time.perf_counter() - t0
            points[p] = int(len(c.capacities))
        return {"backend": mrc.backend(), "accesses": accesses, "distinct": distinct, "compile_s": compile_s,
                "seconds": seconds, "points": points, "load_before": load_before, "load_after": os.getloadavg()}
    finally:
        mrc.set_backend(old)


def format_timing(r: dict) -> str:
    la = lambda v: " ".join(f"{x:.2f}" for x in v)  # noqa: E731
    lines = [f"what-if curves of a synthetic Zipf trace: {r['accesses']:,} accesses, {r['distinct']:,} distinct "
             f"blocks; backend {r['backend']} (first call, compile or cache load: {r['compile_s']:.2f} s)"]
    for p, sec in r["seconds"].items():
        how = "exact (Mattson)" if p == "lru" else "SHARDS-sampled"
        lines.append(f"  {p:<7} {sec:6.2f} s  {r['points'][p]} capacities, {how}")
    lines.append(f"load average (1, 5, 15 min) before: {la(r['load_before'])}; after: {la(r['load_after'])}; "
                 f"{os.cpu_count()} CPUs")
    return "\n".join(lines)
