"""The miss-ratio curves' inner loops compiled with numba: Mattson's stack distances over a Fenwick tree, and the
LRU, heat and S3-FIFO simulators of engine/kv/eviction_sim.py over arrays.

Each kernel gives the same answer as its plain counterpart (engine/lab/mrc.py `stack_distances`, eviction_sim's
`_lru`, `_heat`, `_s3fifo`: the same rules, the same tie-breaks), access for access; tests/lab/test_mrc.py checks
that on random traces. Keys are dense ids 0 .. m-1 (`dense`), so a cache's state is a few arrays of m entries and
every step is O(1) (heat: O(log C)) with no Python object in the loop. Compiled once and cached on disk
(numba's cache=True); importing this module compiles nothing.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit


def dense(keys: np.ndarray) -> tuple[np.ndarray, int]:
    """Keys renamed 0 .. m-1 (int64), and m."""
    u, inv = np.unique(np.asarray(keys), return_inverse=True)
    return inv.astype(np.int64).ravel(), len(u)


@njit(cache=True, nogil=True)
def stack_distances(ids: np.ndarray, m: int) -> np.ndarray:
    """LRU stack distance of every access (-1: first access), one pass: a Fenwick tree over access indices marks
    each key's latest access; the distinct keys since key k's previous access p are the marks in (p, i)."""
    n = len(ids)
    tree = np.zeros(n + 1, dtype=np.int32)
    last = np.full(m, -1, dtype=np.int64)
    out = np.empty(n, dtype=np.int64)
    marked = 0
    for i in range(n):
        k = ids[i]
        p = last[k]
        if p < 0:
            out[i] = -1
        else:
            # marks at indices <= p: prefix sum over tree positions 1 .. p + 1
            s = 0
            j = p + 1
            while j > 0:
                s += tree[j]
                j -= j & -j
            out[i] = marked - s  # every mark is at an index < i: those after p are the distinct keys since
            j = p + 1  # unmark p
            while j <= n:
                tree[j] -= 1
                j += j & -j
            marked -= 1
        j = i + 1
        while j <= n:
            tree[j] += 1
            j += j & -j
        marked += 1
        last[k] = i
    return out


@njit(cache=True, nogil=True)
def lru(ids: np.ndarray, m: int, cap: int) -> np.ndarray:
    """Per-access hit (uint8) of an LRU cache of `cap` keys: a doubly linked list, most recent at the tail."""
    n = len(ids)
    hit = np.zeros(n, dtype=np.uint8)
    nxt = np.full(m, -1, dtype=np.int64)
    prv = np.full(m, -1, dtype=np.int64)
    cached = np.zeros(m, dtype=np.uint8)
    head = -1
    tail = -1
    size = 0
    for i in range(n):
        k = ids[i]
        if cached[k]:
            hit[i] = 1
            if k == tail:
                continue
            a, b = prv[k], nxt[k]  # unlink (k is not the tail, so b >= 0)
            if a >= 0:
                nxt[a] = b
            else:
                head = b
            prv[b] = a
        else:
            if size >= cap:
                old = head
                head = nxt[old]
                if head >= 0:
                    prv[head] = -1
                else:
                    tail = -1
                cached[old] = 0
                size -= 1
            cached[k] = 1
            size += 1
        prv[k] = tail  # append at the tail
        nxt[k] = -1
        if tail >= 0:
            nxt[tail] = k
        else:
            head = k
        tail = k
    return hit


@njit(cache=True, nogil=True, inline="always")
def _less(s1, p1, i1, s2, p2, i2) -> bool:
    if s1 != s2:
        return s1 < s2
    if p1 != p2:
        return p1 < p2
    return i1 < i2


@njit(cache=True, nogil=True)
def _sift_down(hs, hp, hi, hk, n, pos):
    s, p, q, k = hs[pos], hp[pos], hi[pos], hk[pos]
    while True:
        c = 2 * pos + 1
        if c >= n:
            break
        if c + 1 < n and _less(hs[c + 1], hp[c + 1], hi[c + 1], hs[c], hp[c], hi[c]):
            c += 1
        if not _less(hs[c], hp[c], hi[c], s, p, q):
            break
        hs[pos], hp[pos], hi[pos], hk[pos] = hs[c], hp[c], hi[c], hk[c]
        pos = c
    hs[pos], hp[pos], hi[pos], hk[pos] = s, p, q, k


@njit(cache=True, nogil=True)
def heat(ids: np.ndarray, times: np.ndarray, m: int, cap: int, decay: float) -> np.ndarray:
    """Per-access hit of eviction_sim._heat: heat = heat·decay^dt + 1 per access (a miss: 2); evict the lowest
    current heat, ties by older second-to-last access (then by insertion), through a min-heap on the time-invariant
    score log(heat) - t·ln(decay) with lazily deleted stale entries (compacted when the heap outgrows the cache)."""
    n = len(ids)
    hit = np.zeros(n, dtype=np.uint8)
    lnd = math.log(decay)
    h_of = np.zeros(m, dtype=np.float64)
    last_of = np.zeros(m, dtype=np.float64)
    sid_of = np.full(m, -1, dtype=np.int64)  # -1: not cached
    limit = 2 * cap + 1024
    hs = np.empty(limit + 2, dtype=np.float64)
    hp = np.empty(limit + 2, dtype=np.float64)
    hi = np.empty(limit + 2, dtype=np.int64)
    hk = np.empty(limit + 2, dtype=np.int64)
    hn = 0
    size = 0
    serial = 0
    for i in range(n):
        k = ids[i]
        t = times[i]
        if sid_of[k] >= 0:
            hit[i] = 1
            dt = t - last_of[k]
            if dt < 0.0:
                dt = 0.0
            h = h_of[k] * math.exp(lnd * dt) + 1.0
            prev = last_of[k]
        else:
            if size >= cap:
                while True:  # pop until a live entry
                    old, osid = hk[0], hi[0]
                    hn -= 1
                    if hn > 0:
                        hs[0], hp[0], hi[0], hk[0] = hs[hn], hp[hn], hi[hn], hk[hn]
                        _sift_down(hs, hp, hi, hk, hn, 0)
                    if sid_of[old] == osid:
                        break
                sid_of[old] = -1
                size -= 1
            h = 2.0
            prev = t
            size += 1
        serial += 1
        h_of[k] = h
        last_of[k] = t
        sid_of[k] = serial
        # push
        s = math.log(h) - t * lnd
        pos = hn
        hn += 1
        while pos > 0:
            par = (pos - 1) >> 1
            if not _less(s, prev, serial, hs[par], hp[par], hi[par]):
                break
            hs[pos], hp[pos], hi[pos], hk[pos] = hs[par], hp[par], hi[par], hk[par]
            pos = par
        hs[pos], hp[pos], hi[pos], hk[pos] = s, prev, serial, k
        if hn > limit:  # drop the stale entries and heapify what is left (the order of live ones is unchanged)
            w = 0
            for r in range(hn):
                if sid_of[hk[r]] == hi[r]:
                    hs[w], hp[w], hi[w], hk[w] = hs[r], hp[r], hi[r], hk[r]
                    w += 1
            hn = w
            for r in range(hn // 2 - 1, -1, -1):
                _sift_down(hs, hp, hi, hk, hn, r)
    return hit


@njit(cache=True, nogil=True, inline="always")
def _unlink(x, prev, nxt, head, tail):
    """Take x out of the doubly linked ghost list (prev / nxt links, -1 at the ends): the list's new (head, tail)."""
    a, b = prev[x], nxt[x]
    if a >= 0:
        nxt[a] = b
    else:
        head = b
    if b >= 0:
        prev[b] = a
    else:
        tail = a
    return head, tail


@njit(cache=True, nogil=True)
def s3fifo(ids: np.ndarray, m: int, cap: int, small_target: int, ghost_len: int) -> np.ndarray:
    """Per-access hit of eviction_sim._s3fifo: small and main FIFOs as rings of cap + 1 slots, the ghost FIFO as a
    linked list over key ids (a re-entered key moves to its newest end)."""
    n = len(ids)
    hit = np.zeros(n, dtype=np.uint8)
    freq = np.full(m, -1, dtype=np.int8)  # -1: not cached
    ring = cap + 1
    small = np.empty(ring, dtype=np.int64)
    main = np.empty(ring, dtype=np.int64)
    s_head = s_len = 0
    m_head = m_len = 0
    g_next = np.full(m, -1, dtype=np.int64)
    g_prev = np.full(m, -1, dtype=np.int64)
    in_ghost = np.zeros(m, dtype=np.uint8)
    g_head = g_tail = -1
    g_len = 0
    size = 0
    for i in range(n):
        k = ids[i]
        f = freq[k]
        if f >= 0:
            hit[i] = 1
            if f < 3:
                freq[k] = f + 1
            continue
        if size >= cap:
            old = -1
            if s_len > 0 and (s_len >= small_target or m_len == 0):
                while s_len > 0:
                    x = small[s_head]
                    s_head = (s_head + 1) % ring
                    s_len -= 1
                    if freq[x] > 0:
                        main[(m_head + m_len) % ring] = x
                        m_len += 1
                    else:
                        old = x
                        if in_ghost[x]:  # move to the newest end
                            g_head, g_tail = _unlink(x, g_prev, g_next, g_head, g_tail)
                            g_len -= 1
                        in_ghost[x] = 1
                        g_prev[x] = g_tail
                        g_next[x] = -1
                        if g_tail >= 0:
                            g_next[g_tail] = x
                        else:
                            g_head = x
                        g_tail = x
                        g_len += 1
                        while g_len > ghost_len:
                            y = g_head
                            g_head = g_next[y]
                            if g_head >= 0:
                                g_prev[g_head] = -1
                            else:
                                g_tail = -1
                            in_ghost[y] = 0
                            g_len -= 1
                        break
            while old < 0:
                x = main[m_head]
                m_head = (m_head + 1) % ring
                m_len -= 1
                fx = freq[x]
                if fx > 0:
                    freq[x] = fx - 1
                    main[(m_head + m_len) % ring] = x
                    m_len += 1
                else:
                    old = x
            freq[old] = -1
            size -= 1
        freq[k] = 0
        size += 1
        if in_ghost[k]:
            g_head, g_tail = _unlink(k, g_prev, g_next, g_head, g_tail)
            in_ghost[k] = 0
            g_len -= 1
            main[(m_head + m_len) % ring] = k
            m_len += 1
        else:
            small[(s_head + s_len) % ring] = k
            s_len += 1
    return hit
