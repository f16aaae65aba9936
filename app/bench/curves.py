"""`kvscope policy-lab --time [N]`: how long the what-if curves take on a synthetic trace of N accesses.

The trace: N reads of Zipf(1.1)-popular block ids out of N/2 (a 1,000,000-access one has ~170,000 distinct
blocks), 1 ms apart. Timed per policy as the What-if tab computes them (engine/lab/whatif.py policy_curves): LRU
exact at every capacity of curve_capacities (48 or more), heat and S3-FIFO SHARDS-sampled at 32. With the numba
backend the first call compiles the loops or loads them from numba's on-disk cache; that is timed apart, on a
tiny trace, so the per-policy seconds are the curves' own. Then the What-if tab's whole computation on an
engine-like access trace of N reads (`engine_like_trace`: naming each block by its tokens' chained hash, then the
three curves). The load average is printed beside them: on a shared
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


def engine_like_trace(rows: int, seed: int = 0, block_size: int = 16):
    """An AccessTrace shaped like the engine's (engine/kv/access_trace.py) of about `rows` rows: sequences whose
    prompts start with one of 64 shared prefixes (Zipf-popular, 64 .. 1,024 tokens) and a tail of 8 .. 200, each
    reading its whole table at each of 16 decode steps, with its tokens and prompt length recorded; every block a
    new serial (a prefix is named by its contents only)."""
    from engine.kv.access_trace import AccessTrace

    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(3, 50_000, int(rng.integers(64, 1025))) for _ in range(64)]
    pop = 1.0 / np.arange(1, 65)
    t, seq, blk, pos, toks, plen = [], [], [], [], {}, {}
    serial = n = step = s = 0
    while n < rows:
        prompt = np.concatenate([prefixes[rng.choice(64, p=pop / pop.sum())], rng.integers(3, 50_000, int(rng.integers(8, 201)))])
        toks[s], plen[s] = np.concatenate([prompt, rng.integers(3, 50_000, 16)]), len(prompt)
        serials = np.arange(serial, serial + -(-len(toks[s]) // block_size))
        serial += len(serials)
        for d in range(16):
            m = -(-(len(prompt) + d) // block_size)
            t.append(np.full(m, step * 0.01))
            seq.append(np.full(m, s))
            blk.append(serials[:m])
            pos.append(np.arange(m))
            step += 1
            n += m
        s += 1
    k = len(np.concatenate(t))
    return AccessTrace(np.concatenate(t), np.concatenate(seq).astype(np.int32), np.concatenate(blk).astype(np.int64),
                       np.zeros(k, np.int8), np.ones(k, bool), pos=np.concatenate(pos).astype(np.int32),
                       group=np.zeros(k, np.int8), tok_seq=np.array(list(toks), dtype=np.int64),
                       tok_len=np.array([len(v) for v in toks.values()], dtype=np.int64),
                       tok_prompt=np.array([plen[x] for x in toks], dtype=np.int64),
                       tokens=np.concatenate(list(toks.values())), block_size=block_size)


def time_trace(rows: int = 1_000_000, seed: int = 0) -> dict:
    """The What-if tab's whole computation on an engine-like trace of `rows` reads: the stream (blocks named by
    their contents) and the three curves. {"rows", "sequences", "counted", "distinct", "seconds": {stage: s}}."""
    from engine.lab.whatif import stream_of

    trace = engine_like_trace(rows, seed)
    out = {"rows": len(trace), "sequences": len(trace.tok_seq), "seconds": {}}
    t0 = time.perf_counter()
    s = stream_of(trace)
    out["seconds"]["stream"] = time.perf_counter() - t0
    caps = mrc.curve_capacities(s.distinct)
    for p in ("lru", "heat", "s3fifo"):
        t0 = time.perf_counter()
        policy_curves(s, caps, policies=(p,))
        out["seconds"][p] = time.perf_counter() - t0
    from app.whatif.worker import what_if_result

    t0 = time.perf_counter()  # all of it again as the tab runs it, with the block-size and threshold views
    r = what_if_result(trace, max(1, s.distinct // 4), 0.0625)
    out["tab_s"] = time.perf_counter() - t0
    out.update(counted=int(s.counted.sum()), distinct=s.distinct, total=sum(out["seconds"].values()),
               views=len(r.curves) + len(r.block_sizes) + (r.thresholds is not None))
    return out


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
        trace = time_trace(accesses, seed)
        return {"backend": mrc.backend(), "accesses": accesses, "distinct": distinct, "compile_s": compile_s,
                "seconds": seconds, "points": points, "trace": trace, "load_before": load_before,
                "load_after": os.getloadavg()}
    finally:
        mrc.set_backend(old)


def format_timing(r: dict) -> str:
    la = lambda v: " ".join(f"{x:.2f}" for x in v)  # noqa: E731
    lines = [f"what-if curves of a synthetic Zipf trace: {r['accesses']:,} accesses, {r['distinct']:,} distinct "
             f"blocks; backend {r['backend']} (first call, compile or cache load: {r['compile_s']:.2f} s)"]
    for p, sec in r["seconds"].items():
        how = "exact (Mattson)" if p == "lru" else "SHARDS-sampled"
        lines.append(f"  {p:<7} {sec:6.2f} s  {r['points'][p]} capacities, {how}")
    tr = r["trace"]
    lines.append(f"the What-if tab's whole computation on an engine-like trace of {tr['rows']:,} reads "
                 f"({tr['sequences']:,} sequences, {tr['counted']:,} counted, {tr['distinct']:,} distinct blocks): "
                 f"{tr['total']:.2f} s (" + ", ".join(f"{k} {v:.2f} s" for k, v in tr["seconds"].items()) + "); "
                 f"with the block-size (8/16/32/64) and demote-after views, as the tab computes them: "
                 f"{tr['tab_s']:.2f} s")
    lines.append(f"load average (1, 5, 15 min) before: {la(r['load_before'])}; after: {la(r['load_after'])}; "
                 f"{os.cpu_count()} CPUs")
    return "\n".join(lines)
