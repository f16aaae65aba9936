"""The blocks one cache holds (one endpoint, data-parallel rank, medium and KV-cache group), as events tell it.

Events name blocks by hash, never by slot, so a block is placed in a cell chosen by its hash: an open-addressed
table (Fibonacci hashing of Python's hash of the block hash, linear probing) whose cells are the block map's
cells. A block keeps its cell while it is resident, and within a session the same hash lands in the same place
on every rank's map, so a prefix shared across ranks shows as the same pattern. The table doubles (every block
moves once) when it is half full. Lookups go through a dict (hash -> cell), so a removal just empties its cell.

Per cell: when the block was stored and last touched (stored, or named as the parent of a later store: the
request that stored the child read this block), a heat that decays with a half-life, how many later stores
named it as their parent, its depth in the prefix tree (-1 where the chain above it was never seen), its
family (the root of its chain), and where its token ids are (the event's token list, decoded only for a
tooltip). Numeric columns are numpy arrays written through memoryviews: cheap scalar writes from the
subscriber thread, whole-array reads for snapshots.
"""

from __future__ import annotations

import hashlib
import math

import msgspec
import numpy as np

from engine.attach.restores import ReStores

MIN_CELLS = 1024
KEEP_TOKENS = 8  # token ids a tooltip shows per block
_M64 = (1 << 64) - 1
_FIB = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads consecutive keys over the table


def _key(h) -> int:
    """A block hash as an int that is the same in every process, so a block lands in the same cell run after
    run (Python's hash() of bytes and str is salted per process: the map's layout, and which blocks collide,
    changed between runs)."""
    if isinstance(h, int):
        return h
    return int.from_bytes(hashlib.blake2b(h.encode() if isinstance(h, str) else h, digest_size=8).digest(), "little")
_TOKENS = msgspec.msgpack.Decoder(list[int])
_PAIRS = msgspec.msgpack.Decoder(list[tuple[int, int]])


def token_list(src) -> list[int]:
    """Token ids from an event's token_ids: a list, or the raw msgpack the fast decoder left undecoded."""
    if isinstance(src, list):
        return src
    try:
        return _TOKENS.decode(src)
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError, RecursionError):
        pass
    try:  # an EAGLE "bigram" page (SGLang): (token, next token) pairs; the block's tokens are the first of each
        return [p[0] for p in _PAIRS.decode(src)]
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError, RecursionError):
        return []


class BlockTable:
    """Resident blocks of one cache, placed by hash. Not thread-safe: the owner (ClusterState) locks."""

    COLUMNS = (("occ", np.uint8), ("stored_t", np.float64), ("touch_t", np.float64), ("heat", np.float32),
               ("named", np.int32), ("depth", np.int32), ("family", np.int32), ("parent", np.int32),
               ("lora", np.int32))

    def __init__(self, cells: int = MIN_CELLS, half_life_s: float = 10.0):
        assert cells & (cells - 1) == 0, "cells must be a power of two"
        self.half_life_s = half_life_s
        self.index: dict = {}  # hash -> cell
        self.block_size = 0
        self.stored = 0  # blocks ever stored here
        self.removed = 0
        self.removed_unknown = 0  # removals of a hash not resident here (stored before we attached, or lost)
        self.restored = 0  # stores of a hash already resident (a duplicate event)
        self.high_water = 0
        self.on_evict = None  # f(lifetime_s, idle_s) for every 8th removed block
        self.on_reuse = None  # f(gap_s) for about every 8th touch of a resident block
        self.spec: tuple[str, int | None] | None = None  # the KV-cache group's kind and sliding window (vLLM)
        self.restores = ReStores()  # stores of hashes removed before: prefills recomputed after an eviction
        self._alloc(cells)

    # -- storage --------------------------------------------------------------------------------------
    def _alloc(self, cells: int) -> None:
        self.cells = cells
        self._shift = 64 - (cells.bit_length() - 1)
        self.a = {name: np.zeros(cells, dt) for name, dt in self.COLUMNS}
        self.a["parent"][:] = -1
        self.a["lora"][:] = -1
        (self._occ, self._st, self._tt, self._heat, self._named, self._depth, self._fam, self._par,
         self._lora) = (memoryview(self.a[name]) for name, _ in self.COLUMNS)
        self.hash_at: list = [None] * cells
        self.phash_at: list = [None] * cells  # the parent's hash: a parent cell is trusted only if it still holds it
        self.tok_at: list = [None] * cells  # (the event's token_ids, index of the block in the event)
        self.meta_at: list = [None] * cells  # what else the event said, for the tooltip (events.event_meta)

    def __len__(self) -> int:
        return len(self.index)

    def _free_cell(self, h) -> int:
        occ, mask = self._occ, self.cells - 1
        c = ((_key(h) & _M64) * _FIB & _M64) >> self._shift
        while occ[c]:
            c = (c + 1) & mask
        return c

    def _grow(self) -> None:
        old_a, old_cells = self.a, self.cells
        old_lists = (self.hash_at, self.phash_at, self.tok_at, self.meta_at)
        self._alloc(old_cells * 2)
        occupied = np.flatnonzero(old_a["occ"]).tolist()
        new_cell = np.full(old_cells, -1, np.int64)
        hash_at = old_lists[0]
        for c in occupied:
            n = self._free_cell(hash_at[c])
            self._occ[n] = 1
            new_cell[c] = n
            self.index[hash_at[c]] = n
            self.hash_at[n], self.phash_at[n], self.tok_at[n] = hash_at[c], old_lists[1][c], old_lists[2][c]
            self.meta_at[n] = old_lists[3][c]
        src = np.asarray(occupied, np.int64)
        dst = new_cell[src]
        for name, _ in self.COLUMNS:
            self.a[name][dst] = old_a[name][src]
        par = old_a["parent"][src]
        self.a["parent"][dst] = np.where(par >= 0, new_cell[np.maximum(par, 0)], -1)

    # -- events ---------------------------------------------------------------------------------------
    def touch(self, cell: int, t: float) -> None:
        """The block was read (named as the parent of a new store). A batch time earlier than the last touch
        (a peer's clock stepping back, a batch time of 0) is no time at all: no decay, and never a growth."""
        gap = t - self._tt[cell]
        if gap > 0:
            self._heat[cell] = self._heat[cell] * math.exp2(-gap / self.half_life_s) + 1.0
            self._tt[cell] = t
        else:
            gap = 0.0
            self._heat[cell] += 1.0
        n = self._named[cell] = self._named[cell] + 1
        if self.on_reuse is not None and not (n + cell) & 7:  # sampled: about 1 in 8
            self.on_reuse(gap)

    def store(self, h, parent_cell: int, parent_hash, depth: int, family: int, tokens, i: int, t: float,
              lora: int | None, meta: dict | None = None) -> int:
        """Place a newly stored block (the i-th of an event whose token ids are `tokens`); returns its cell.
        A hash already resident is touched, not placed twice."""
        cell = self.index.get(h)
        if cell is not None:
            self.restored += 1
            gap = t - self._tt[cell]
            if gap > 0:  # as touch: a time going back is not heat
                self._heat[cell] = self._heat[cell] * math.exp2(-gap / self.half_life_s) + 1.0
                self._tt[cell] = t
            else:
                self._heat[cell] += 1.0
            return cell
        if 2 * (len(self.index) + 1) > self.cells:
            self._grow()
        cell = self._free_cell(h)
        self._occ[cell] = 1
        self._st[cell] = t
        self._tt[cell] = t
        self._heat[cell] = 1.0
        self._named[cell] = 0
        self._depth[cell] = depth
        self._fam[cell] = family
        self._par[cell] = parent_cell
        self._lora[cell] = -1 if lora is None else lora
        self.hash_at[cell] = h
        self.phash_at[cell] = parent_hash
        self.tok_at[cell] = (tokens, i)
        self.meta_at[cell] = meta
        self.index[h] = cell
        self.stored += 1
        self.restores.stored(h, t, self.removed)
        if len(self.index) > self.high_water:
            self.high_water = len(self.index)
        return cell

    def remove(self, h, t: float | None = None) -> int | None:
        """Remove a resident block; returns its family (None: the hash was not resident here)."""
        cell = self.index.pop(h, None)
        if cell is None:
            self.removed_unknown += 1
            return None
        if t is not None and self.on_evict is not None and not self.removed & 7:  # sampled: 1 in 8
            self.on_evict(max(t - self._st[cell], 0.0), max(t - self._tt[cell], 0.0))
        self._occ[cell] = 0
        self.hash_at[cell] = self.phash_at[cell] = self.tok_at[cell] = self.meta_at[cell] = None
        self.removed += 1
        self.restores.removed(h, t, self.removed)
        return self._fam[cell]

    def resident_families(self) -> list[int]:
        """The family of every resident block (one entry per block)."""
        return self.a["family"][self.a["occ"].astype(bool)].tolist()

    def clear(self) -> int:
        n = len(self.index)
        self.removed += n
        self._alloc(MIN_CELLS)
        self.index.clear()
        return n

    # -- views ----------------------------------------------------------------------------------------
    def values(self, mode: str, now: float) -> np.ndarray:
        """One float32 per cell for a colour mode (garbage where no block is resident: mask with occ)."""
        a = self.a
        if mode == "age":
            return (now - a["stored_t"]).astype(np.float32)
        if mode == "idle":
            return (now - a["touch_t"]).astype(np.float32)
        if mode == "heat":
            # A touch later than now (a peer's clock ahead of ours) has not decayed yet: never a growth (nor inf).
            return (a["heat"] * np.exp2(-np.maximum(now - a["touch_t"], 0.0) / self.half_life_s)).astype(np.float32)
        if mode == "reuse":
            return a["named"].astype(np.float32)
        if mode == "family":
            return a["family"].astype(np.float32)
        if mode == "depth":
            return a["depth"].astype(np.float32)
        raise ValueError(f"unknown mode {mode!r}")

    def parent_of(self, cell: int) -> int:
        """The parent's cell while the parent is still resident, else -1."""
        p = int(self.a["parent"][cell])
        if p < 0 or not self._occ[p] or self.hash_at[p] != self.phash_at[cell]:
            return -1
        return p

    def tokens(self, cell: int) -> list[int]:
        """The block's first KEEP_TOKENS token ids (decoded now, from the event that stored it)."""
        ref = self.tok_at[cell]
        if ref is None:
            return []
        bs = self.block_size or 1
        toks = token_list(ref[0])
        return list(toks[ref[1] * bs: ref[1] * bs + min(bs, KEEP_TOKENS)])

    def info(self, cell: int, now: float) -> dict | None:
        """What is known of the block in a cell (None where the cell is empty)."""
        a = self.a
        if not (0 <= cell < self.cells) or not a["occ"][cell]:
            return None
        path, c = [], cell
        while len(path) < 64:  # the visible chain above, nearest first
            c = self.parent_of(c)
            if c < 0:
                break
            path.append(c)
        return {"hash": self.hash_at[cell], "cell": cell, "age_s": now - float(a["stored_t"][cell]),
                "idle_s": now - float(a["touch_t"][cell]),
                "heat": float(a["heat"][cell] * math.exp2(-max(now - float(a["touch_t"][cell]), 0.0)
                                                          / self.half_life_s)),
                "named": int(a["named"][cell]), "depth": int(a["depth"][cell]), "family": int(a["family"][cell]),
                "lora": int(a["lora"][cell]), "tokens": self.tokens(cell), "parent": self.phash_at[cell],
                "path_tokens": [self.tokens(p) for p in reversed(path[:8])], "meta": self.meta_at[cell],
                "index": self.tok_at[cell][1] if self.tok_at[cell] is not None else 0}
