"""The eviction-policy simulators: `replay` one cache of `capacity` blocks over a sequence of block ids.

Demand paging: every miss inserts the block, evicting one if the cache is full. Policies are the engine's
(lru, heat, s3fifo, with the same rules) and Belady's OPT, the best any demand-paging policy can do on the
trace. The simulators are plain Python over ints (dicts, deques, heaps): about a microsecond per access.
The policy lab (engine/lab/policy_lab.py) sweeps them over capacities and reports.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque

import numpy as np

from engine.kv.eviction import s3fifo_sizes

POLICIES = ("lru", "heat", "s3fifo", "opt")
SECONDS_PER_ACCESS = 0.01  # the clock of a trace given without times


# -- simulators: each returns the hit count; `log`, if given, collects evicted keys in order ----------

def _lru(keys: list, cap: int, log: list | None, hitlog: bytearray | None = None) -> int:
    cache: OrderedDict = OrderedDict()
    hits = 0
    for i, k in enumerate(keys):
        if k in cache:
            hits += 1
            if hitlog is not None:
                hitlog[i] = 1
            cache.move_to_end(k)
            continue
        if len(cache) >= cap:
            old, _ = cache.popitem(last=False)
            if log is not None:
                log.append(old)
        cache[k] = None
    return hits


def _heat(keys: list, times: list, cap: int, decay: float, log: list | None, hitlog: bytearray | None = None) -> int:
    """heat = heat*decay^dt + 1 per access (a miss: 2, the insert and its read); evict the lowest current heat, ties by
    older second-to-last access.

    Current heat at time T is h*decay^(T-last), so log(h) - last*ln(decay) orders blocks the same way at
    every T: a heap on it needs no updates as time passes. An access pushes a new entry; entries whose
    id is no longer their key's are stale and skipped when popped (lazy deletion).
    """
    lnd = math.log(decay)
    state: dict = {}  # key -> (heat at its last access, last access, second-to-last access, entry id)
    heap: list = []  # (time-invariant score, second-to-last access, entry id, key)
    serial = 0
    hits = 0
    for i, (k, t) in enumerate(zip(keys, times)):
        e = state.get(k)
        if e is not None:
            hits += 1
            if hitlog is not None:
                hitlog[i] = 1
            h, last, _, _ = e
            h = h * math.exp(lnd * max(t - last, 0.0)) + 1.0
            prev = last
        else:
            if len(state) >= cap:
                while True:
                    _, _, sid, old = heapq.heappop(heap)
                    v = state.get(old)
                    if v is not None and v[3] == sid:
                        break
                del state[old]
                if log is not None:
                    log.append(old)
            # Like the pool: a new block is allocated with heat 1 and read by the step that wrote it (+1, at the
            # same time); its access history is that time, twice.
            h, prev = 2.0, t
        serial += 1
        state[k] = (h, t, prev, serial)
        heapq.heappush(heap, (math.log(h) - t * lnd, prev, serial, k))
        if len(heap) > 2 * cap + 1024:
            heap = [(math.log(hh) - tt * lnd, pp, sid, kk) for kk, (hh, tt, pp, sid) in state.items()]
            heapq.heapify(heap)
    return hits


def _s3fifo(keys: list, cap: int, log: list | None, hitlog: bytearray | None = None) -> int:
    """S3-FIFO as engine.kv.eviction.S3FIFO runs it when every block is a candidate and each hit is a new
    request's read (the engine counts those, not a sequence's re-reads of blocks it wrote)."""
    small_target, ghost_len = s3fifo_sizes(cap)
    small: deque = deque()
    main: deque = deque()
    freq: dict = {}  # key -> re-accesses (0..3); membership = cached
    ghost: OrderedDict = OrderedDict()
    hits = 0
    for i, k in enumerate(keys):
        f = freq.get(k)
        if f is not None:
            hits += 1
            if hitlog is not None:
                hitlog[i] = 1
            if f < 3:
                freq[k] = f + 1
            continue
        if len(freq) >= cap:
            old = None
            if small and (len(small) >= small_target or not main):
                while small:
                    x = small.popleft()
                    if freq[x]:
                        main.append(x)
                    else:
                        old = x
                        ghost.pop(x, None)
                        ghost[x] = None
                        while len(ghost) > ghost_len:
                            ghost.popitem(last=False)
                        break
            while old is None:
                x = main.popleft()
                fx = freq[x]
                if fx:
                    freq[x] = fx - 1
                    main.append(x)
                else:
                    old = x
            del freq[old]
            if log is not None:
                log.append(old)
        freq[k] = 0
        if k in ghost:
            del ghost[k]
            main.append(k)
        else:
            small.append(k)
    return hits


def _next_use(keys: np.ndarray) -> list:
    """For each access, the index of the next access to the same key (len(keys) if none)."""
    n = len(keys)
    order = np.argsort(keys, kind="stable")
    ks = keys[order]
    same = ks[1:] == ks[:-1]
    nxt = np.full(n, n, dtype=np.int64)
    nxt[order[:-1][same]] = order[1:][same]
    return nxt.tolist()


def _opt(keys_arr: np.ndarray, cap: int, log: list | None, hitlog: bytearray | None = None) -> int:
    """Belady's MIN: evict the cached block used again furthest in the future. O(N log C).

    A max-heap of (next use, key); a hit pushes the key's new next use and leaves the old entry,
    which is skipped when popped (it no longer matches the key's current next use).
    """
    nxt = _next_use(keys_arr)
    cached: dict = {}  # key -> index of its next use
    heap: list = []  # (-next use, key)
    hits = 0
    for i, k in enumerate(keys_arr.tolist()):
        if k in cached:
            hits += 1
            if hitlog is not None:
                hitlog[i] = 1
        elif len(cached) >= cap:
            while True:
                negn, old = heapq.heappop(heap)
                if cached.get(old) == -negn:
                    break
            del cached[old]
            if log is not None:
                log.append(old)
        nu = nxt[i]
        cached[k] = nu
        heapq.heappush(heap, (-nu, k))
        if len(heap) > 2 * cap + 1024:
            heap = [(-v, kk) for kk, v in cached.items()]
            heapq.heapify(heap)
    return hits


def replay(keys: np.ndarray, capacity: int, policy: str, decay: float = 0.9, times: np.ndarray | None = None,
           *, evictions: bool = False, per_access: bool = False) -> dict:
    """Hits, misses and hit rate of `policy` on a cache of `capacity` blocks over the accesses `keys`.

    times: access times in seconds (heat's decay clock); None: access i happens at i*0.01 s.
    evictions: also return "evicted", the evicted keys in order.
    per_access: also return "hit", a bool array with the outcome of every access.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"decay must be in (0, 1], got {decay}")
    keys = np.asarray(keys).astype(np.int64, copy=False).ravel()
    log: list | None = [] if evictions else None
    hl: bytearray | None = bytearray(len(keys)) if per_access else None
    if policy == "lru":
        hits = _lru(keys.tolist(), capacity, log, hl)
    elif policy == "heat":
        if times is None:
            times = np.arange(len(keys)) * SECONDS_PER_ACCESS
        times = np.asarray(times, dtype=np.float64)
        if len(times) != len(keys):
            raise ValueError(f"{len(times)} times for {len(keys)} accesses")
        hits = _heat(keys.tolist(), times.tolist(), capacity, decay, log, hl)
    elif policy == "s3fifo":
        hits = _s3fifo(keys.tolist(), capacity, log, hl)
    else:
        hits = _opt(keys, capacity, log, hl)
    n = len(keys)
    out = {"hits": hits, "misses": n - hits, "hit_rate": hits / n if n else 0.0}
    if evictions:
        out["evicted"] = log
    if hl is not None:
        out["hit"] = np.frombuffer(bytes(hl), dtype=np.uint8).astype(bool)
    return out
