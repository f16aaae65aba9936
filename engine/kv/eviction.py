"""Eviction policies: which cached (unowned) blocks of a tier go first.

A policy sees a tier's per-slot metadata and the slots of its cached blocks, and returns the n to evict.
Blocks owned by a sequence are never candidates. Adding a policy means adding a class here and a
name to `POLICIES` in config.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from engine.kv.tiers import TierPool


class EvictionPolicy(Protocol):
    """Hooks (all optional beyond `victims`): the pool calls on_insert when it allocates a slot, on_access
    when blocks are read, and on_move when blocks change slot (another tier, or the same tier when a resize
    packs a shrinking tier: per-slot state follows them). A tier's capacity can change under a policy (a budget
    change resizes it in place, the first slots kept): per-slot state must follow `tier.capacity`, never assume
    it fixed. A policy holds no reference to a tier, so a resize can checkpoint it with copy.deepcopy."""

    name: str

    def on_insert(self, tier: "TierPool", slot: int, now: float) -> None: ...

    def on_access(self, tier: "TierPool", slots: np.ndarray, now: float) -> None: ...

    def on_move(self, src: "TierPool", src_slots: np.ndarray, dst: "TierPool", dst_slots: np.ndarray) -> None: ...

    def victims(self, tier: "TierPool", candidates: np.ndarray, n: int, now: float, decay: float) -> np.ndarray:
        """The n slots of `tier` to evict first, from `candidates` (slots of cached blocks); decay: the heat
        decay per second (the pool's config), for policies that read heat."""


def heat_now(tier: "TierPool", slots: np.ndarray | slice, now: float, decay: float) -> np.ndarray:
    """The slots' heat decayed to `now`: heat · decay^(now − last access). The stored heat is updated on each
    access as heat = heat · decay^dt + 1 (BlockPool.touch); this is the one place that reads it decayed."""
    return tier.heat[slots] * np.exp(np.log(decay) * np.maximum(now - tier.last[slots], 0.0))


def _lowest(score: np.ndarray, candidates: np.ndarray, n: int) -> np.ndarray:
    """The n candidates with the lowest score, lowest first (argpartition keeps a batch O(len))."""
    if n >= len(candidates):
        order = np.argsort(score, kind="stable")
    else:
        part = np.argpartition(score, n - 1)[:n]
        order = part[np.argsort(score[part], kind="stable")]
    return candidates[order]


class _Stateless:
    def on_insert(self, tier: "TierPool", slot: int, now: float) -> None:
        pass

    def on_access(self, tier: "TierPool", slots: np.ndarray, now: float) -> None:
        pass

    def on_move(self, src: "TierPool", src_slots: np.ndarray, dst: "TierPool", dst_slots: np.ndarray) -> None:
        pass


class LRU(_Stateless):
    name = "lru"

    def victims(self, tier: "TierPool", candidates: np.ndarray, n: int, now: float, decay: float) -> np.ndarray:
        return _lowest(tier.last[candidates], candidates, n)


class Heat(_Stateless):
    """LRU-K with decay: lowest current heat first (heat*decay^idle), ties broken by the K-th last access."""

    name = "heat"

    def victims(self, tier: "TierPool", candidates: np.ndarray, n: int, now: float, decay: float) -> np.ndarray:
        heat = heat_now(tier, candidates, now, decay)
        kth = tier.hist[candidates, -1]
        # lexsort's last key is primary: heat first, then the older K-th access goes first.
        order = np.lexsort((kth, heat))[:n]
        return candidates[order]


def s3fifo_sizes(capacity: int) -> tuple[int, int]:
    """(small-queue target, ghost length) for a cache of `capacity` blocks: 10 % and the main queue's 90 %."""
    small = max(1, capacity // 10)
    return small, max(1, capacity - small)


class _S3State:
    """S3-FIFO's per-slot state for one tier, plus the tier's ghost FIFO of block hashes."""

    def __init__(self, tier: "TierPool"):
        n = tier.capacity
        self.freq = np.zeros(n, dtype=np.uint8)  # re-accesses since insertion, capped at 3
        self.in_main = np.zeros(n, dtype=bool)
        self.pos = np.zeros(n, dtype=np.int64)  # queue order: a smaller number is nearer the head
        self.live = tier.lid >= 0  # in one of this tier's queues (a victim leaves before the pool frees it)
        self.checked = np.zeros(n, dtype=bool)  # its hash was looked up in the ghost
        self.small, self.ghost_len = s3fifo_sizes(n)
        self.ghost: OrderedDict[int, None] = OrderedDict()
        # Blocks already here (the policy was switched at run time) enter the small queue, oldest first.
        used = np.flatnonzero(self.live)
        self.pos[used[np.argsort(tier.born[used], kind="stable")]] = np.arange(len(used)) - len(used)

    @property
    def capacity(self) -> int:
        return len(self.freq)

    def resize(self, n: int) -> None:
        """The tier now has n slots (a budget change in place): the first min(old, n) slots keep their state and
        their place in the queues, new slots are free, and the queue targets follow the new size (the ghost keeps
        its newest entries)."""
        keep = min(n, self.capacity)
        for name in ("freq", "in_main", "pos", "live", "checked"):
            old = getattr(self, name)
            new = np.zeros(n, dtype=old.dtype)
            new[:keep] = old[:keep]
            setattr(self, name, new)
        self.small, self.ghost_len = s3fifo_sizes(n)
        while len(self.ghost) > self.ghost_len:
            self.ghost.popitem(last=False)


class S3FIFO:
    """S3-FIFO (Yang et al., SOSP 2023): a small probationary FIFO, a main FIFO with second chance, a ghost.

    New blocks enter the small queue (~10 % of the tier). When the small queue evicts, a block read again
    while there moves to main; a block read only once leaves, and its hash goes to a ghost FIFO, so if it
    comes back soon it goes straight to main. Main evicts in FIFO order, but a block read since its last
    pass (freq > 0) gets its freq decremented and goes to the tail instead.

    Why here: long documents are scans. Their blocks are read once, sit in the small queue, and leave
    from it: a sweep of one-hit blocks never reaches the main queue, where the reused chat prefixes live.
    LRU lets every such block push a hot prefix out; decayed heat protects hot blocks only for as long
    as their heat outweighs the scan's recency. It is also cheap: an access is a capped counter increment
    (no reordering, unlike LRU's move-to-front or ARC's four lists), and an eviction walks a FIFO.

    Adapted to the pool: only cached (unowned) blocks can leave, so the queues are walked over the
    candidates only; owned blocks keep their place. Queue order is a sequence number per slot, so a
    batch of evictions is a few sorts over the candidates. A running sequence reads all its blocks at
    every step, so counting every read would make every block of a long document look reused; a read
    counts only when the cache served it to someone other than the block's writer: the block is shared
    (ref > 1) or its writer let it go (owner -1) and a later sequence picked it up. A block's hash is
    known only once it is full, so the ghost is consulted on its first read with a hash (or when the
    block moves to a tier).
    """

    name = "s3fifo"

    def __init__(self):
        self._states: dict[int, _S3State] = {}  # by tier (Tier value): a pool's tiers are resized, never replaced
        self._tick = 0

    # -- state --------------------------------------------------------------------------------
    def _state(self, tier: "TierPool") -> _S3State:
        st = self._states.get(int(tier.tier))
        if st is None:
            st = self._states[int(tier.tier)] = _S3State(tier)
        elif st.capacity != tier.capacity:  # the tier was resized in place (engine/kv/resize.py)
            st.resize(tier.capacity)
        return st

    def _ticks(self, n: int) -> np.ndarray:
        out = np.arange(self._tick, self._tick + n, dtype=np.int64)
        self._tick += n
        return out

    def _to_main(self, st: _S3State, slots: np.ndarray) -> np.ndarray:
        st.in_main[slots] = True
        st.pos[slots] = self._ticks(len(slots))
        return slots

    def _check_ghost(self, tier: "TierPool", st: _S3State, slots: np.ndarray) -> None:
        todo = slots[~st.checked[slots] & (tier.hash[slots] != 0)]
        if len(todo) == 0:
            return
        st.checked[todo] = True
        back = []
        for s, h in zip(todo.tolist(), tier.hash[todo].tolist()):
            if h in st.ghost:  # evicted from the small queue a short while ago: it earned main
                del st.ghost[h]
                back.append(s)
        if back:
            back_arr = np.asarray(back, dtype=np.int64)
            self._to_main(st, back_arr[~st.in_main[back_arr]])

    def queues(self, tier: "TierPool") -> np.ndarray:
        """Per slot of `tier`: 0 free (or leaving), 1 small queue, 2 main queue (int8; for views and tests)."""
        st = self._state(tier)
        live = st.live & (tier.lid >= 0)
        return np.where(live, np.where(st.in_main, 2, 1), 0).astype(np.int8)

    # -- hooks --------------------------------------------------------------------------------
    def on_insert(self, tier: "TierPool", slot: int, now: float) -> None:
        st = self._state(tier)
        st.freq[slot] = 0
        st.in_main[slot] = False
        st.pos[slot] = self._ticks(1)[0]
        st.live[slot] = True
        st.checked[slot] = False

    def on_access(self, tier: "TierPool", slots: np.ndarray, now: float) -> None:
        st = self._state(tier)
        slots = np.asarray(slots, dtype=np.int64)
        reuse = (tier.ref[slots] > 1) | (tier.owner[slots] < 0)  # not its writer's own re-reads
        st.freq[slots] = np.minimum(st.freq[slots] + reuse, 3)
        self._check_ghost(tier, st, slots)

    def on_move(self, src: "TierPool", src_slots: np.ndarray, dst: "TierPool", dst_slots: np.ndarray) -> None:
        a, b = self._state(src), self._state(dst)
        src_slots = np.asarray(src_slots, dtype=np.int64)
        dst_slots = np.asarray(dst_slots, dtype=np.int64)
        b.freq[dst_slots] = a.freq[src_slots]
        b.in_main[dst_slots] = a.in_main[src_slots]
        if a is b:  # packed into other slots of its tier (a resize): it keeps its place in its queue
            b.pos[dst_slots] = a.pos[src_slots]
            b.live[dst_slots] = a.live[src_slots]
            b.checked[dst_slots] = a.checked[src_slots]
            a.live[src_slots] = False
            return
        b.pos[dst_slots] = self._ticks(len(dst_slots))  # a block entering a tier joins its queue's tail
        b.live[dst_slots] = True
        b.checked[dst_slots] = False
        a.live[src_slots] = False
        self._check_ghost(dst, b, dst_slots)

    # -- eviction -----------------------------------------------------------------------------
    def victims(self, tier: "TierPool", candidates: np.ndarray, n: int, now: float, decay: float) -> np.ndarray:
        """n victims, exactly as n single evictions in a row would pick them (and the queues end the same).

        Each eviction goes to the small queue while it holds >= 10 % of the tier (or main has no
        candidate); there it walks from the head, moving re-accessed blocks to main, until a block read
        once is found. Otherwise main evicts with second chance. The small queue never grows during a
        batch, so the batch is a run of small-queue evictions and then main-queue ones (and back to the
        small queue only if main runs dry); each run is done with array operations.
        """
        st = self._state(tier)
        cand = np.asarray(candidates, dtype=np.int64)
        self._check_ghost(tier, st, cand)
        in_main = st.in_main[cand]
        small = cand[~in_main]
        small = small[np.argsort(st.pos[small], kind="stable")]
        main = cand[in_main]
        main = main[np.argsort(st.pos[main], kind="stable")]
        s_len = int(np.count_nonzero(st.live & ~st.in_main & (tier.lid >= 0)))  # owned blocks count too
        out: list[np.ndarray] = []
        need = n
        while need > 0:
            if len(small) and (s_len >= st.small or len(main) == 0):
                hot = st.freq[small] > 0
                once = np.flatnonzero(~hot)
                if len(once) == 0:  # every small candidate was read again: all move to main
                    main = np.concatenate([main, self._to_main(st, small)])
                    s_len -= len(small)
                    small = small[:0]
                    continue
                # Eviction j pops up to once[j]; it goes to the small queue while that queue is still
                # >= its target (or main is still empty): a prefix of the j's.
                popped_before = np.concatenate(([0], once[:-1] + 1))
                moved_before = popped_before - np.arange(len(once))
                ok = (s_len - popped_before >= st.small) | ((len(main) == 0) & (moved_before == 0))
                k = min(need, int(np.count_nonzero(ok)))
                popped = int(once[k - 1]) + 1
                gone = small[once[:k]]
                out.append(gone)
                main = np.concatenate([main, self._to_main(st, small[:popped][hot[:popped]])])
                small = small[popped:]
                s_len -= popped
                need -= k
                self._to_ghost(tier, st, gone)
            else:
                assert len(main), "fewer candidates than victims asked for"
                m = min(need, len(main))
                gone, main = self._evict_main(st, main, m)
                out.append(gone)
                need -= m
        res = np.concatenate(out)
        st.live[res] = False
        st.freq[res] = 0  # a victim's passes used up its freq (it follows the block if it is demoted)
        return res

    def _evict_main(self, st: _S3State, q: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
        """m victims of main's second-chance FIFO `q` (candidates in queue order), and the survivors in order.

        Pass r over the queue evicts the blocks whose freq was r (each pass decrements the rest and sends
        them to the tail), so the eviction order is by (freq, queue position).
        """
        f = st.freq[q].astype(np.int64)
        idx = np.arange(len(q))
        order = np.lexsort((idx, f))
        gone = order[:m]
        if m == len(q):
            return q[gone], q[:0]
        last = int(order[m - 1])
        r = int(f[last])  # the pass the last victim fell in
        keep = np.ones(len(q), dtype=bool)
        keep[gone] = False
        passed = keep & (idx < last)  # seen r + 1 times: now at the tail
        ahead = keep & (idx > last)  # seen r times
        st.freq[q[keep]] = (f - r - passed)[keep]
        survivors = np.concatenate([q[ahead], q[passed]])
        rotated = q[passed] if r == 0 else survivors
        st.pos[rotated] = self._ticks(len(rotated))
        return q[gone], survivors

    def _to_ghost(self, tier: "TierPool", st: _S3State, slots: np.ndarray) -> None:
        g = st.ghost
        for h in tier.hash[slots].tolist():
            if h:
                g.pop(h, None)
                g[h] = None
        while len(g) > st.ghost_len:
            g.popitem(last=False)


def make_policy(name: str, decay: float) -> EvictionPolicy:
    if name == "lru":
        return LRU()
    if name == "heat":
        return Heat()
    if name == "s3fifo":
        return S3FIFO()
    raise ValueError(f"unknown policy {name!r}")
