"""The policy lab: replay a block-access trace through eviction policies and compare them with OPT.

The simulators and `replay` are in engine/kv/eviction_sim.py. Here `run_lab` sweeps capacities and `format_table`
shows the result; the command line (`kvscope policy-lab`) and the figure are app/whatif/policy_lab.py.
An engine trace has a row for every read, and a running sequence reads all its blocks at every step;
those re-reads hit under any policy (the engine pins a sequence's blocks), so by default the lab
replays only the first read of each block by each sequence: the reads a cache can win or lose.
`scan_polluted_trace` makes a synthetic workload (hot chat prefixes plus long one-time document scans)
for checking scan resistance without a recorded trace.
"""

from __future__ import annotations

import numpy as np

from engine.kv.eviction_sim import POLICIES, SECONDS_PER_ACCESS, replay
from engine.kv.access_trace import MAX_TRACE_ROWS, AccessTrace

DEFAULT_DECAYS = (0.5, 0.9, 0.99)
MAX_CAPACITY = MAX_TRACE_ROWS  # more blocks than a trace can have accesses changes nothing


# -- the lab ------------------------------------------------------------------------------------------

def _label(policy: str, decay: float) -> str:
    return f"heat({decay:g})" if policy == "heat" else policy


def first_reads(trace: AccessTrace) -> tuple[np.ndarray, np.ndarray]:
    """Block ids and times of the first read of each block by each sequence, in trace order."""
    n = len(trace)
    order = np.lexsort((np.arange(n), trace.block, trace.seq))  # by sequence, block, then time
    s, b = trace.seq[order], trace.block[order]
    first = np.ones(n, dtype=bool)
    first[1:] = (s[1:] != s[:-1]) | (b[1:] != b[:-1])
    idx = np.sort(order[first])
    return np.asarray(trace.block[idx], dtype=np.int64), np.asarray(trace.t[idx], dtype=np.float64)


def lab_input(trace: AccessTrace | np.ndarray, every_read: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """(keys, times) the lab replays: an array as it is; a trace's first reads, or every read if asked."""
    if not isinstance(trace, AccessTrace):
        return np.asarray(trace), None
    if trace.group is not None and (trace.group != 0).any():  # serials are per pool: the full-attention group's
        g0 = trace.group == 0
        trace = AccessTrace(trace.t[g0], trace.seq[g0], trace.block[g0], trace.tier[g0], trace.hit[g0])
    if every_read:
        return np.asarray(trace.block, dtype=np.int64), np.asarray(trace.t, dtype=np.float64)
    return first_reads(trace)


LAB_REASONS = ("cold", "evicted")  # a replayed miss's reasons: the simulated cache holds whole blocks, so the
# engine's partial / diverged / reconfigured / preempted cannot arise here, and every capacity miss is an eviction


class Reuse:
    """Per access of `keys`: is it the key's first (a `cold` miss under any policy), and how long since the key's
    previous access (in accesses and in seconds of `times`, or of the lab's 0.01 s per access clock)."""

    def __init__(self, keys: np.ndarray, times: np.ndarray | None):
        n = len(keys)
        order = np.argsort(keys, kind="stable")
        same = keys[order][1:] == keys[order][:-1]
        self.prev = np.full(n, -1, dtype=np.int64)
        self.prev[order[1:][same]] = order[:-1][same]
        self.first = self.prev < 0
        self.times = np.arange(n) * SECONDS_PER_ACCESS if times is None else np.asarray(times, dtype=np.float64)
        self.timed = times is not None


def miss_reasons(reuse: Reuse, hit: np.ndarray, opt_hit: np.ndarray) -> dict:
    """Why a replay's misses missed: `cold` (the key's first access: no cache holds what it never saw) or `evicted`
    (the key was cached before and this policy evicted it at full occupancy: a simulated cache only evicts when
    full). cold + evicted = misses, exactly. Of the evicted: how many OPT would have kept (the policy's choice cost
    them; the rest no policy of this capacity could keep), and the median time since the key's previous access."""
    miss = ~hit
    ev = miss & ~reuse.first
    idx = np.flatnonzero(ev)
    gap_n = idx - reuse.prev[idx]
    gap_s = reuse.times[idx] - reuse.times[reuse.prev[idx]]
    return {"cold": int((miss & reuse.first).sum()), "evicted": int(idx.size),
            "evicted_opt_keeps": int((ev & opt_hit).sum()),
            "evicted_gap_p50_accesses": float(np.median(gap_n)) if idx.size else None,
            "evicted_gap_p50_s": float(np.median(gap_s)) if idx.size and reuse.timed else None}


def run_lab(trace: AccessTrace | np.ndarray, capacities: list[int], decays=DEFAULT_DECAYS,
            policies=POLICIES, *, every_read: bool = False) -> list[dict]:
    """One row per (policy, capacity): hit rate, its fraction of OPT's hit rate at that capacity, and why the
    misses missed (`why_missed`: cold / evicted, see `miss_reasons`).

    A trace is replayed as its first reads (see `first_reads`) unless every_read; an array of block
    ids as it is. Heat gets one row per decay, labelled like "heat(0.9)". OPT is always simulated (it is
    the denominator) but only listed if asked for. fraction_of_opt is 1.0 where OPT hits nothing.
    """
    keys, times = lab_input(trace, every_read)
    keys = np.asarray(keys).astype(np.int64, copy=False).ravel()
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"unknown policy {p!r}; choose one of {', '.join(POLICIES)}")
    reuse = Reuse(keys, times)
    rows = []
    for cap in capacities:
        opt = replay(keys, cap, "opt", per_access=True)
        runs = []
        for p in policies:
            for d in (decays if p == "heat" else (None,)):
                r = opt if p == "opt" else replay(keys, cap, p, decay=d if d is not None else 0.9, times=times,
                                                   per_access=True)
                runs.append((_label(p, d), d, r))
        for label, d, r in runs:
            why = miss_reasons(reuse, r["hit"], opt["hit"])
            rows.append({"policy": label, "decay": d, "capacity": int(cap), "hits": r["hits"],
                         "misses": r["misses"], "hit_rate": r["hit_rate"],
                         "fraction_of_opt": r["hits"] / opt["hits"] if opt["hits"] else 1.0,
                         "why_missed": {k: why[k] for k in LAB_REASONS},
                         **{k: v for k, v in why.items() if k not in LAB_REASONS}})
    return rows


def format_reasons(rows: list[dict], capacity: int) -> list[str]:
    """Lines saying why each policy missed at `capacity`: cold and evicted counts, how many of the evicted OPT
    would have kept, and the median time since an evicted block's previous use."""
    at = [r for r in rows if r["capacity"] == capacity and "why_missed" in r]
    if not at:
        return []
    lines = [f"why missed at {capacity:,} blocks (cold: first use of the block; evicted: cached before, evicted "
             f"when full)"]
    w0 = max(len(r["policy"]) for r in at) + 2
    for r in at:
        w, n = r["why_missed"], r["misses"]
        pct = (lambda k: f"{100 * k / n:.1f}%") if n else (lambda k: "no data")
        line = f"  {r['policy'].ljust(w0)}{n:,} misses: cold {w['cold']:,} ({pct(w['cold'])}), " \
               f"evicted {w['evicted']:,} ({pct(w['evicted'])})"
        if w["evicted"] and r["policy"] != "opt":
            line += f", OPT would have kept {r['evicted_opt_keeps']:,} of them"
        if r["evicted_gap_p50_s"] is not None:
            line += f"; last used p50 {r['evicted_gap_p50_s']:.3g} s before"
        elif r["evicted_gap_p50_accesses"] is not None:
            line += f"; last used p50 {r['evicted_gap_p50_accesses']:,.0f} accesses before"
        lines.append(line)
    return lines


def default_capacities(keys: np.ndarray, points: int = 8) -> list[int]:
    """`points` capacities spaced geometrically from 5 % to 100 % of the trace's distinct blocks."""
    distinct = len(np.unique(keys))
    caps = np.geomspace(0.05, 1.0, points) * distinct
    return sorted({max(1, int(round(c))) for c in caps})


def policy_order(rows: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for r in rows:
        seen.setdefault(r["policy"], None)
    return list(seen)


def format_table(rows: list[dict]) -> str:
    """Hit rate and fraction of OPT, one line per policy, one column per capacity."""
    caps = sorted({r["capacity"] for r in rows})
    cell = {(r["policy"], r["capacity"]): r for r in rows}
    names = policy_order(rows)
    w0 = max([len("policy")] + [len(p) for p in names]) + 2
    w = max(14, max(len(f"{c:,}") for c in caps) + 2)
    lines = ["hit rate (fraction of OPT) by cache capacity in blocks",
             "policy".ljust(w0) + "".join(f"{c:,}".rjust(w) for c in caps)]
    for p in names:
        parts = []
        for c in caps:
            r = cell.get((p, c))
            parts.append((f"{100 * r['hit_rate']:.1f}% ({r['fraction_of_opt']:.2f})" if r else "-").rjust(w))
        lines.append(p.ljust(w0) + "".join(parts))
    return "\n".join(lines)


def near_half(rows: list[dict], policy: str = "lru", target: float = 0.5) -> int | None:
    """The capacity at which `policy`'s hit rate is nearest `target`."""
    mine = [r for r in rows if r["policy"] == policy]
    if not mine:
        return None
    return min(mine, key=lambda r: (abs(r["hit_rate"] - target), r["capacity"]))["capacity"]


# -- a synthetic workload -----------------------------------------------------------------------------

def scan_polluted_trace(seed: int = 0, n_hot: int = 2048, n_scan: int = 2048, n_requests: int = 3000,
                        scan_every: int = 100, n_prefixes: int = 64, zipf_a: float = 1.0, system_blocks: int = 4,
                        tail_blocks: tuple[int, int] = (1, 8), scan_chunk: int = 64) -> np.ndarray:
    """Block ids of a chat service whose prefix cache is swept by long documents.

    Chat: `n_prefixes` conversation prefixes (system prompt + few-shot / history; lengths log-normal,
    `n_hot` blocks in all) with Zipf(`zipf_a`) popularity. Every request reads a shared system prompt
    of `system_blocks` blocks, its prefix's blocks, and a tail of new blocks (the new turn, read once).
    Scans: every `scan_every` requests a document of `n_scan` new blocks is read once, in chunks of
    `scan_chunk` blocks (chunked prefill), each chunk interleaved with a chat request, as an engine
    serving both would read them. One access per block per request: the prefix-cache lookups, not
    every decode step's re-read of a running sequence's own blocks (those hit under any policy).
    """
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean=0.0, sigma=0.6, size=n_prefixes)
    lengths = np.maximum(1, np.round(lengths / lengths.sum() * n_hot)).astype(np.int64)
    starts = system_blocks + np.concatenate(([0], np.cumsum(lengths)[:-1]))
    weights = 1.0 / np.arange(1, n_prefixes + 1) ** zipf_a
    choice = rng.choice(n_prefixes, size=n_requests, p=weights / weights.sum())
    tails = rng.integers(tail_blocks[0], tail_blocks[1] + 1, size=n_requests)
    next_id = int(starts[-1] + lengths[-1])
    system = np.arange(system_blocks, dtype=np.int64)
    out: list[np.ndarray] = []
    scan_left = 0
    for i in range(n_requests):
        if scan_every and i % scan_every == scan_every - 1:
            scan_left += n_scan
        if scan_left:
            chunk = min(scan_chunk, scan_left)
            out.append(np.arange(next_id, next_id + chunk, dtype=np.int64))
            next_id += chunk
            scan_left -= chunk
        p = choice[i]
        out.append(system)
        out.append(np.arange(starts[p], starts[p] + lengths[p], dtype=np.int64))
        out.append(np.arange(next_id, next_id + tails[i], dtype=np.int64))
        next_id += int(tails[i])
    return np.concatenate(out)
