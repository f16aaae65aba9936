"""Undo for a budget change applied in place (engine/kv/resize.py): a checkpoint of the pool's metadata and a
journal of the block copies the change made, so that any exception inside the change leaves the pool as it was.

The checkpoint copies what is small (per-slot and per-block arrays, free lists, the cached sets, the hash map,
the eviction policy's state: O(capacity) numbers, no K/V). K/V data is not copied: the change journals each copy
of slots (src -> dst) and the undo replays the journal backwards, copying each dst back onto its src. Read
backwards, every slot whose first use in the change was as a source gets back what it held (a slot is only
written again after its block was copied out). A slot whose first use was as a destination held no live block
or a cached block the change evicted to make room: such a cached block's data is gone, so the undo releases it
(an eviction, reported as one); owned blocks are never overwritten (the change makes room from cached blocks
only). A tier the change had grown goes back to its old number of slots, its null and sink slots zeroed again.

Events the change queued on the pool (demotions, evictions) are taken back when it is undone; the undo queues the
evictions of the cached blocks it lost.
"""

from __future__ import annotations

import copy

from engine.kv.block_pool import BlockPool
from engine.kv.tiers import RESERVED
from engine.kv.tiers import Tier, TierPool, copy_slots

_POOL = ("config", "sizes", "tier", "slot", "serial", "free_lids", "n_lids", "by_hash", "moves", "next_serial")
_TIER = TierPool.META + ("hist", "tokens", "free_slots", "cached", "capacity", "null_slot", "sink_slot")


class ResizeUndo:
    """`with ResizeUndo(pool):` around a change: on an exception the pool is restored and the exception re-raised."""

    def __init__(self, pool: BlockPool):
        self.pool = pool

    def __enter__(self) -> "ResizeUndo":
        pool = self.pool
        self.saved_pool = {n: copy.copy(getattr(pool, n)) for n in _POOL}  # arrays, lists, dicts: shallow copies
        self.saved_tiers = [{n: copy.deepcopy(getattr(t, n)) if n == "cached" else copy.copy(getattr(t, n))
                             for n in _TIER} for t in pool.tiers]
        self.policy = copy.deepcopy(pool.policy)
        self.queued = len(pool.events)  # the pool's events before the change (undrained: the change adds to them)
        pool.journal = []
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        pool = self.pool
        journal, pool.journal = pool.journal, None
        if exc_type is None:
            return False
        while len(pool.events) > self.queued:  # the change's events: undone with it
            pool.events.pop()
        self._undo_copies(journal)
        self._restore_rows()
        lost = self._lost(journal)
        for n, v in self.saved_pool.items():
            setattr(pool, n, v)
        for t, saved in zip(pool.tiers, self.saved_tiers):
            for n, v in saved.items():
                setattr(t, n, v)
        pool.policy = self.policy
        self._release(lost)
        return False  # the caller turns the exception into a refusal

    # -- data -------------------------------------------------------------------------------------
    def _undo_copies(self, journal: list) -> None:
        for src, ss, dst, ds in reversed(journal):
            copy_slots(dst, ds, src, ss, self.pool.copy_stream, self.pool.device)

    def _restore_rows(self) -> None:
        """Tiers the change grew back to their old number of slots (the first ones kept, null and sink zeroed)."""
        for t, saved in zip(self.pool.tiers, self.saved_tiers):
            if saved["null_slot"] is not None and t.null_slot is None:
                raise AssertionError("undo: the device tier lost its reserved slots")
            t.null_slot = saved["null_slot"]
            resize_storage(self.pool, t, saved["capacity"], view_on_failure=False)

    def _lost(self, journal: list) -> list[int]:
        """Blocks (by the checkpoint) whose slot the change wrote before reading it: their data is gone."""
        first: dict[tuple[int, int], bool] = {}  # (tier, slot) -> first use was a read
        for src, ss, dst, ds in journal:
            for s in ss.tolist():
                first.setdefault((int(src.tier), s), True)
            for s in ds.tolist():
                first.setdefault((int(dst.tier), s), False)
        out = []
        for (tier, s), read in first.items():
            saved = self.saved_tiers[tier]
            if read or s >= saved["capacity"] or saved["lid"][s] < 0:
                continue
            if saved["ref"][s] > 0:
                raise AssertionError(f"undo: an owned block's {Tier(tier).name.lower()} slot {s} was overwritten")
            out.append(int(saved["lid"][s]))
        return out

    def _release(self, lids: list[int]) -> None:
        pool = self.pool
        for lid in lids:
            t = pool.tiers[pool.tier[lid]]
            pool._emit("evict", lid=lid, tier=int(t.tier), age=0.0, gap=0.0, hash=int(t.hash[pool.slot[lid]]))
            pool._release(lid)


def resize_storage(pool: BlockPool, t: TierPool, cap: int, view_on_failure: bool) -> None:
    """Every part of tier `t` with room for `cap` blocks (the device tier: and its null and sink slots, zeroed), a
    layer at a time (each old layer is freed before the next is made), the first min(old, new) blocks kept, placed
    as the pool places the tier's layers.

    view_on_failure: a shrink that cannot allocate (a full GPU) keeps a view of the first rows instead, so that a
    change already committed is never left half done (the memory is freed when the tier is next resized)."""
    reserved = RESERVED if t.null_slot is not None else 0
    rows = cap + reserved
    for parts, codec in ((t.k, pool.kcodec), (t.v, pool.vcodec)):
        for layer in range(pool.geom.layers):
            cur = parts["data"][layer]
            if cur is None or cur.shape[0] == rows:
                continue
            keep = min(cap, cur.shape[0] - reserved)
            device = cur.device
            pin = device.type == "cpu" and cur.is_pinned()
            fresh = {name: [None] * pool.geom.layers for name in parts}
            try:
                codec.alloc_layer(fresh, pool.geom, rows, layer, device, pin)
            except (RuntimeError, MemoryError):  # torch.OutOfMemoryError is a RuntimeError
                if not (view_on_failure and rows < cur.shape[0]):
                    raise
                for layers in parts.values():
                    layers[layer] = layers[layer][:rows]
                    layers[layer][cap:].zero_()
                continue
            for name, layers in parts.items():  # fresh rows are zeros: the null and sink slots among them
                fresh[name][layer][:keep] = layers[layer][:keep]
                layers[layer] = fresh[name][layer]
