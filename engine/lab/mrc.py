"""Miss-ratio curves: the hit rate a cache of every capacity would have had on a recorded access stream.

LRU is exact in one pass (Mattson's stack algorithm): an access hits an LRU cache of C blocks iff fewer than C
distinct other blocks were accessed since the previous access to its block (its *stack distance*), so one
histogram of stack distances gives the hit count at every capacity at once. `stack_distances` counts them for
the whole stream with numpy, O(n log² n) in vectorised passes (no per-access Python loop): the distinct blocks
in (prev, i) are the accesses j in that window whose own previous access is at or before prev.

Heat and S3-FIFO have no stack property, so their curves are simulated (engine/kv/eviction_sim.py), on a spatial
sample of the blocks (SHARDS, Waldspurger et al., FAST '15): a block is kept iff a hash of its id falls below
rate·2^32, and the sample is replayed at capacity rate·C. Each block is in or out with all its accesses, so the
sample is a cache's traffic in miniature and its hit rate estimates the full one's; the error shrinks as
1/sqrt(sampled blocks). Small capacities, where rate·C would be a handful of blocks, are simulated at a higher
rate (at least MIN_SAMPLED_CAPACITY sampled blocks) or in full.

The inner loops (the stack distances, the sampled simulations) run compiled with numba where it imports
(engine/lab/mrc_jit.py: a Fenwick-tree Mattson pass, array simulators), the same answers access for access; the
numpy / Python path below is the fallback (`set_backend("numpy")`, or KVSCOPE_NO_JIT=1 in the environment).

Every curve counts what the policy lab counts (engine/lab/policy_lab.py): by default the first read of each
block by each sequence. `counted` lets every access move a block in the LRU stack while only some are counted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from engine.kv.eviction import s3fifo_sizes
from engine.kv.eviction_sim import SECONDS_PER_ACCESS, replay

MIN_CURVE_POINTS = 32
MIN_SAMPLED_CAPACITY = 32  # the smallest sampled cache SHARDS simulates; below it the rate goes up
DEFAULT_SAMPLE_BLOCKS = 4096  # distinct blocks a sampled simulation aims to keep
MAX_SAMPLED_ACCESSES = 25_000  # and the most accesses one capacity's simulation replays (its rate is capped)
_P = np.uint64(0x9E3779B97F4A7C15)


_backend: str | None = None  # "numba" or "numpy"; None: decided at first use


def backend() -> str:
    """"numba" where numba imports (and KVSCOPE_NO_JIT is not set), else "numpy"."""
    global _backend
    if _backend is None:
        _backend = "numpy"
        if os.environ.get("KVSCOPE_NO_JIT", "") in ("", "0"):
            try:
                import engine.lab.mrc_jit  # noqa: F401

                _backend = "numba"
            except ImportError:
                pass
    return _backend


def set_backend(name: str) -> str:
    """Use the compiled loops ("numba") or the numpy / Python ones ("numpy"); returns the previous choice."""
    global _backend
    if name not in ("numba", "numpy"):
        raise ValueError(f"backend must be 'numba' or 'numpy', got {name!r}")
    if name == "numba":
        import engine.lab.mrc_jit  # noqa: F401  (ImportError where numba is missing)
    old, _backend = backend(), name
    return old


def replay_hits(keys: np.ndarray, capacity: int, policy: str, decay: float = 0.9,
                times: np.ndarray | None = None) -> np.ndarray:
    """Per-access hit (bool) of `policy` (lru, heat, s3fifo) at `capacity` over `keys`: eviction_sim.replay's
    answer, computed by the compiled simulators where the backend is numba."""
    keys = np.asarray(keys, dtype=np.int64)
    if backend() == "numpy" or policy not in ("lru", "heat", "s3fifo"):
        return replay(keys, capacity, policy, decay=decay, times=times, per_access=True)["hit"]
    from engine.lab import mrc_jit

    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"decay must be in (0, 1], got {decay}")
    ids, m = mrc_jit.dense(keys)
    if policy == "lru":
        hit = mrc_jit.lru(ids, m, int(capacity))
    elif policy == "heat":
        t = np.arange(len(keys)) * SECONDS_PER_ACCESS if times is None else np.asarray(times, dtype=np.float64)
        if len(t) != len(keys):
            raise ValueError(f"{len(t)} times for {len(keys)} accesses")
        hit = mrc_jit.heat(ids, np.ascontiguousarray(t), m, int(capacity), float(decay))
    else:
        small, ghost = s3fifo_sizes(int(capacity))
        hit = mrc_jit.s3fifo(ids, m, int(capacity), small, ghost)
    return hit.view(bool)


def _prev_index(keys: np.ndarray) -> np.ndarray:
    """For each access, the index of the previous access to the same key (-1 if none)."""
    n = len(keys)
    order = np.argsort(keys, kind="stable")
    ks = keys[order]
    same = np.zeros(n, dtype=bool)
    same[1:] = ks[1:] == ks[:-1]
    prev = np.full(n, -1, dtype=np.int64)
    prev[order[1:][same[1:]]] = order[:-1][same[1:]]
    return prev


def stack_distances(keys: np.ndarray) -> np.ndarray:
    """LRU stack distance of every access: the number of distinct other keys accessed since the previous
    access to its key; -1 for a first access (a miss at every capacity). Access i hits an LRU cache of C
    blocks iff 0 <= d[i] < C.

    d[i] = #{j in (p, i): prev[j] <= p} where p = prev[i] (j is the first access of its key in the window).
    As prev[j] < j, the j <= p all count, so d[i] = #{j < i: prev[j] <= p} - (p + 1). The left count is a
    dominance count, done over the dyadic blocks of [0, i): at level k, if bit k of i is set, the block
    [(i>>k)-1)·2^k, (i>>k)·2^k) lies wholly before i; one global sort per level (keys block·(n+1) + prev)
    and one searchsorted answer every i at once.
    """
    keys = np.asarray(keys)
    n = len(keys)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if backend() == "numba":
        from engine.lab import mrc_jit

        return mrc_jit.stack_distances(*mrc_jit.dense(keys))
    prev = _prev_index(keys)
    shifted = prev + 1  # 0 .. n
    big = np.int64(n + 1)
    idx = np.arange(n, dtype=np.int64)
    count = np.zeros(n, dtype=np.int64)
    rep = prev >= 0
    qi, qv = idx[rep], shifted[rep]  # only reuses need an answer
    k = 0
    while (1 << k) <= n:
        w = np.int64(1 << k)
        blk = qi >> k
        on = (blk & 1) == 1
        if on.any():
            sorted_keys = np.sort((idx >> k) * big + shifted)
            left = blk[on] - 1
            pos = np.searchsorted(sorted_keys, left * big + qv[on], side="right")
            count[qi[on]] += pos - left * w
        k += 1
    d = np.full(n, -1, dtype=np.int64)
    d[rep] = count[rep] - (prev[rep] + 1)
    return d


def lru_hits(distances: np.ndarray, capacities, weights: np.ndarray | None = None) -> np.ndarray:
    """Hits (or hit weight) of an LRU cache at each capacity, from `stack_distances` (of the counted accesses)."""
    caps = np.asarray(capacities, dtype=np.int64)
    d = np.asarray(distances)
    reuse = d >= 0
    if weights is None:
        srt = np.sort(d[reuse])
        return np.searchsorted(srt, caps, side="left").astype(np.float64)  # #{d < C}
    w = np.asarray(weights, dtype=np.float64)[reuse]
    order = np.argsort(d[reuse], kind="stable")
    srt, cum = d[reuse][order], np.concatenate(([0.0], np.cumsum(w[order])))
    return cum[np.searchsorted(srt, caps, side="left")]


def curve_capacities(distinct: int, points: int = 48, low: int = 1) -> np.ndarray:
    """At least `points` (>= MIN_CURVE_POINTS where there are that many) capacities, geometric from `low` to
    the number of distinct blocks (past it every curve is flat)."""
    top, low = max(int(distinct), 1), max(int(low), 1)
    want = max(points, MIN_CURVE_POINTS)
    if top - low + 1 <= want:  # few distinct blocks: every capacity
        return np.arange(low, top + 1, dtype=np.int64)
    n = want
    while True:  # rounding merges the small ones: ask for more until `want` remain
        caps = np.unique(np.round(np.geomspace(low, top, n)).astype(np.int64))
        if len(caps) >= want:
            return caps
        n += want - len(caps)


def key_hash(keys: np.ndarray, seed: int = 0) -> np.ndarray:
    """A fixed multiply-xorshift hash of each key to 0 .. 2^32 - 1 (uint64), so a seed gives the same sample
    every run."""
    x = np.asarray(keys).astype(np.int64).view(np.uint64) ^ np.uint64(seed * 0x632BE59BD9B4E019 & (2**64 - 1))
    with np.errstate(over="ignore"):
        x = x * _P
        x ^= x >> np.uint64(29)
        x = x * _P
        x ^= x >> np.uint64(32)
    return x & np.uint64(0xFFFFFFFF)


def sample_mask(keys: np.ndarray, rate: float, seed: int = 0, hashed: np.ndarray | None = None) -> np.ndarray:
    """SHARDS' spatial filter: True for the accesses whose key hashes below rate·2^32 (a key is in or out with
    every one of its accesses)."""
    if rate >= 1.0:
        return np.ones(len(keys), dtype=bool)
    h = key_hash(keys, seed) if hashed is None else hashed
    return h < np.uint64(int(rate * 2**32))


def sampled_hit_rate(keys: np.ndarray, times: np.ndarray | None, counted: np.ndarray | None, capacity: int,
                     policy: str, rate: float, decay: float = 0.9, seed: int = 0,
                     hashed: np.ndarray | None = None, fresh: np.ndarray | None = None) -> float:
    """SHARDS estimate of `policy`'s hit rate at `capacity` (simulated at rate·capacity on the sampled keys).
    With `counted`, the sampled stream is still every sampled access; the rate is over the counted ones. A `fresh`
    access counts as a miss (its block is computed by its reader)."""
    m = sample_mask(keys, rate, seed, hashed)
    k = keys[m]
    if len(k) == 0:
        return float("nan")
    cap = max(1, int(round(capacity * min(rate, 1.0))))
    t = times[m] if times is not None else None
    hit = replay_hits(k, cap, policy, decay, t)
    if fresh is not None:
        hit &= ~fresh[m]
    if counted is None:
        hits, got, total = int(hit.sum()), len(k), len(keys)
    else:
        c = counted[m]
        if not c.any():
            return float("nan")
        hits = int(hit[c].sum())
        got, total = int(c.sum()), int(np.count_nonzero(counted))
    if rate >= 1.0:
        return hits / got
    # SHARDS-adj: a sample that caught more (fewer) accesses than rate x total did so through its popular
    # blocks, whose accesses are nearly all hits; count the difference as hits (or take it off them).
    expected = rate * total
    return float(np.clip((hits + expected - got) / expected, 0.0, 1.0))


def windowed_hit_rate(keys: np.ndarray, times: np.ndarray | None, counted: np.ndarray | None, capacity: int,
                      policy: str, decay: float = 0.9, windows: int = 8, fresh: np.ndarray | None = None) -> float:
    """A small cache's hit rate from full-rate simulation of `windows` evenly spaced slices of the stream
    (MAX_SAMPLED_ACCESSES in all), each warmed by the 4·capacity + 1000 accesses before it (not counted): where
    SHARDS would shrink the cache to a handful of slots, time sampling is the better estimate, as a small cache
    forgets its past within a few times its size in accesses."""
    n = len(keys)
    per = max(1, MAX_SAMPLED_ACCESSES // windows)
    warm = 4 * capacity + 1000
    hits = total = 0
    for start in np.linspace(0, max(n - per, 0), windows).astype(np.int64):
        lo, hi = max(0, int(start) - warm), min(n, int(start) + per)
        hit = replay_hits(keys[lo:hi], capacity, policy, decay, None if times is None else times[lo:hi])
        if fresh is not None:
            hit &= ~fresh[lo:hi]
        c = np.zeros(hi - lo, dtype=bool)
        c[int(start) - lo:] = True
        if counted is not None:
            c &= counted[lo:hi]
        hits += int(hit[c].sum())
        total += int(c.sum())
    return hits / total if total else float("nan")


def sample_rate_for(distinct: int, capacity: int, sample_blocks: int = DEFAULT_SAMPLE_BLOCKS,
                    accesses: int = 0) -> float:
    """The sampling rate at one capacity: about `sample_blocks` distinct blocks, and at least MIN_SAMPLED_CAPACITY
    sampled cache slots as long as that replays at most MAX_SAMPLED_ACCESSES of the `accesses`; 1.0 (no
    sampling) for a small trace."""
    r = min(1.0, sample_blocks / max(distinct, 1))
    r = max(r, MIN_SAMPLED_CAPACITY / max(capacity, 1))
    if accesses:
        r = min(r, max(MAX_SAMPLED_ACCESSES / accesses, sample_blocks / max(distinct, 1)))
    return min(1.0, r)


@dataclass
class Curve:
    """One policy's hit rate against capacity in blocks. `exact`: Mattson (LRU) or a full simulation;
    else a SHARDS estimate, with the rate used at each capacity in `rates`."""
    policy: str
    capacities: np.ndarray
    hit_rate: np.ndarray
    exact: bool
    rates: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def at(self, capacity: float) -> float:
        """Hit rate at any capacity: exact points joined linearly in log capacity (LRU's is a step function,
        so this interpolates only between the curve's points)."""
        c = np.log(np.maximum(self.capacities, 1).astype(np.float64))
        return float(np.interp(np.log(max(capacity, 1.0)), c, self.hit_rate))

    def capacity_for(self, target: float) -> float | None:
        """The smallest capacity (blocks) at which the curve reaches `target`, None if it never does."""
        ok = np.flatnonzero(self.hit_rate >= target)
        return float(self.capacities[ok[0]]) if len(ok) else None


def lru_curve(keys: np.ndarray, capacities, counted: np.ndarray | None = None,
              weights: np.ndarray | None = None, distances: np.ndarray | None = None,
              fresh: np.ndarray | None = None) -> Curve:
    """The exact LRU curve: every access moves its key to the top of the stack; the hit rate is over the
    `counted` accesses (all if None), weighted by `weights` (e.g. tokens per block) if given; a `fresh` access
    misses at every capacity (its block is computed by its reader) and still moves its key to the top."""
    d = stack_distances(keys) if distances is None else distances
    if fresh is not None and fresh.any():
        d = np.where(fresh, -1, d)
    sel = np.ones(len(d), dtype=bool) if counted is None else np.asarray(counted, dtype=bool)
    w = None if weights is None else np.asarray(weights, dtype=np.float64)[sel]
    total = float(sel.sum()) if w is None else float(w.sum())
    hits = lru_hits(d[sel], capacities, w)
    rate = hits / total if total else np.full(len(hits), np.nan)
    return Curve("lru", np.asarray(capacities, dtype=np.int64), rate, True)


def sampled_curve(keys: np.ndarray, times: np.ndarray | None, capacities, policy: str,
                  counted: np.ndarray | None = None, decay: float = 0.9, seed: int = 0,
                  sample_blocks: int = DEFAULT_SAMPLE_BLOCKS, fresh: np.ndarray | None = None) -> Curve:
    """`policy`'s curve by SHARDS-sampled simulation (exact where the rate comes out 1.0)."""
    keys = np.asarray(keys, dtype=np.int64)
    distinct = len(np.unique(keys))
    caps = np.asarray(capacities, dtype=np.int64)
    rates = np.array([sample_rate_for(distinct, int(c), sample_blocks, len(keys)) for c in caps])
    hashed = key_hash(keys, seed)
    hr = np.array([windowed_hit_rate(keys, times, counted, int(c), policy, decay, fresh=fresh)
                   if r < 1.0 and r * c < MIN_SAMPLED_CAPACITY else
                   sampled_hit_rate(keys, times, counted, int(c), policy, float(r), decay, seed, hashed, fresh)
                   for c, r in zip(caps, rates)])
    return Curve(policy if policy != "heat" else f"heat({decay:g})", caps, hr, bool((rates >= 1.0).all()), rates)


# -- reading a curve: what a change would buy -------------------------------------------------------------

def what_if_short(curve: Curve, current: int, block_mib: float | None = None, target: float = 0.75,
                  factor: float = 2.0) -> str:
    """The same as what_if_line in a few words, for the window's tab."""
    now, then = curve.at(current), curve.at(current * factor)
    need = curve.capacity_for(target)
    unit = (lambda c: f"{c * block_mib:,.1f} MiB") if block_mib else (lambda c: f"{c:,.0f} blocks")
    reach = f"{100 * target:.0f} % needs ≈ {unit(need)}" if need is not None else \
        f"{100 * target:.0f} % not reached (max {100 * np.nanmax(curve.hit_rate):.1f} %)"
    return f"{curve.policy}: {100 * now:.1f} % now · {factor:g}× budget: {100 * (then - now):+.1f} pts · {reach}"


def what_if_line(curve: Curve, current: int, block_mib: float | None = None, target: float = 0.75,
                 factor: float = 2.0) -> str:
    """"at 2× the device budget: +N points; 75 % needs ≈ M MiB" for `curve` around `current` blocks."""
    now, then = curve.at(current), curve.at(current * factor)
    parts = [f"{curve.policy} at {current:,} blocks: {100 * now:.1f} %",
             f"at {factor:g}× the device budget: {100 * (then - now):+.1f} points"]
    need = curve.capacity_for(target)
    unit = (lambda c: f"{c * block_mib:,.1f} MiB") if block_mib else (lambda c: f"{c:,.0f} blocks")
    if need is None:
        parts.append(f"{100 * target:.0f} % is not reached at any capacity on this trace "
                     f"(at most {100 * np.nanmax(curve.hit_rate):.1f} %)")
    else:
        parts.append(f"{100 * target:.0f} % needs ≈ {unit(need)}")
    return "; ".join(parts)
