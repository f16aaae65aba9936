"""A budget change applied to the pool in place: tiers grow or shrink, every block keeps its id.

Shrinking the device tier demotes its coldest blocks to the host tier (owned ones too: attention reads them
there), dropping cached ones the host tier cannot take; shrinking the host tier evicts its coldest cached blocks
and promotes owned ones the device tier has room for. Blocks left in slots past a tier's new capacity move down
into free ones, then each part is reallocated at the new size a layer at a time and the kept slots copied over.
Sequences, prefix hashes, heat, ages and the eviction policy's state (S3-FIFO's queues too) are kept.

Refused (CacheFull, before anything moves) when the blocks sequences own cannot fit both tiers' new capacities.
Any exception inside the change (a full GPU while a tier grows, a defect) undoes it (engine/kv/resize_undo.py): the
pool is as it was, the exception is re-raised for the engine to turn into a refusal. A shrinking tier's storage
is cut last, after the change has committed; should that allocation fail it keeps a view of the first slots.
"""

from __future__ import annotations

import numpy as np

from engine.kv.block_pool import BlockPool
from engine.config import CacheConfig
from engine.kv.resize_undo import ResizeUndo, resize_storage
from engine.kv.tiers import HIST_K, NO_HASH, CacheFull, IndexedSet, Tier, TierPool, tier_sizes

_FILL = {"lid": -1, "owner": -1}  # metadata defaults of an empty slot (the rest: 0)


def resize(pool: BlockPool, config: CacheConfig, now: float) -> None:
    sizes = tier_sizes(config, pool.geom.layers, pool.block_bytes)
    dev_cap, host_cap = sizes.dev_cap, sizes.host_cap
    dev, host = pool.tiers
    owned = sum(int(np.count_nonzero((t.lid >= 0) & (t.ref > 0))) for t in pool.tiers)
    if owned > dev_cap + host_cap:
        raise CacheFull(f"sequences own {owned} blocks but the new budgets hold {dev_cap} + {host_cap}")
    with ResizeUndo(pool):
        _resize(pool, config, sizes, now)
    for t in (dev, host):  # committed: shrinking tiers' storage cut to size (a grown one is already)
        resize_storage(pool, t, t.capacity, view_on_failure=True)


def _resize(pool: BlockPool, config: CacheConfig, sizes, now: float) -> None:
    dev_cap, host_cap = sizes.dev_cap, sizes.host_cap
    dev, host = pool.tiers
    pool.config, pool.sizes = config, sizes
    for t, cap in ((dev, dev_cap), (host, host_cap)):
        if cap > t.capacity:  # growing tiers first: room for what the shrinking one hands over
            resize_storage(pool, t, cap, view_on_failure=False)
            _resize_meta(t, cap)
    # The device tier down to its new capacity: coldest blocks to the host tier (which makes room by evicting its
    # own coldest cached blocks, but must keep room for the owned blocks it has to hold).
    over = dev.used - dev_cap
    if over > 0:
        used = np.flatnonzero(dev.lid >= 0)
        order = used[np.lexsort((dev.last[used], dev.ref[used] > 0))]  # cached first, then owned; coldest first
        victims = dev.lid[order[:over]]
        is_owned = dev.ref[order[:over]] > 0
        owned, cached = victims[is_owned], victims[~is_owned]
        _host_room(pool, host_cap, len(victims), now)
        # Owned blocks first: they must reach the host tier (the check above left room for them); cached ones take
        # what room is left, and those it cannot take are dropped.
        if pool.move(owned, Tier.HOST, now, reason="resize") < len(owned):
            raise AssertionError(f"the host tier took fewer than the {len(owned)} owned blocks the device tier hands it")
        moved = pool.move(cached, Tier.HOST, now, reason="resize") if host.capacity and len(cached) else 0
        for lid in cached[moved:].tolist():  # cached blocks the host tier cannot take
            pool._release(lid)
    # The host tier down to its new capacity: cached blocks evicted, owned ones promoted while the device has room.
    over = host.used - host_cap
    if over > 0:
        pool.evict(Tier.HOST, min(over, len(host.cached)), now)
        over = host.used - host_cap
        if over > 0:
            room = dev_cap - dev.used
            if room < over and len(dev.cached):  # cached device blocks give way to owned host ones
                victims = dev.cached.view()[:over - room].copy()
                for lid in dev.lid[victims].tolist():
                    pool._release(lid)
            owned_host = np.flatnonzero((host.lid >= 0) & (host.ref > 0))
            pool.move(host.lid[owned_host[:min(over, dev_cap - dev.used)]], Tier.DEVICE, now, reason="resize")
    for t, cap in ((dev, dev_cap), (host, host_cap)):
        if t.used > cap:  # cannot happen after the check above; never leave a half-resized tier silently
            raise AssertionError(f"{t.tier.name} tier still holds {t.used} blocks for {cap} slots")
        _compact(pool, t, cap)
        if cap < t.capacity:
            _resize_meta(t, cap)  # the storage is cut once the change has committed
    _grow_lids(pool, dev_cap + host_cap)
    pool.moves += 1


def _host_room(pool: BlockPool, host_cap: int, n: int, now: float) -> None:
    """Evict cached host blocks so that n more fit under the host tier's new capacity."""
    host = pool.tiers[Tier.HOST]
    short = host.used + n - min(host_cap, host.capacity)
    if short > 0 and len(host.cached):
        pool.evict(Tier.HOST, min(short, len(host.cached)), now)


def _compact(pool: BlockPool, t: TierPool, cap: int) -> None:
    """Blocks in slots >= cap move into free slots below it (same tier: one copy per part)."""
    high = np.flatnonzero(t.lid[cap:] >= 0) + cap
    if len(high) == 0:
        return
    low = np.asarray(sorted(s for s in t.free_slots if s < cap)[:len(high)], dtype=np.int64)
    pool._copy(t, high, t, low)
    t.copy_meta(t, high, low)
    pool.policy.on_move(t, high, t, low)
    for s_old, s_new in zip(high.tolist(), low.tolist()):
        lid = int(t.lid[s_new])
        pool.slot[lid] = s_new
        if s_old in t.cached:
            t.cached.discard(s_old)
            t.cached.add(s_new)
        t.lid[s_old] = -1
        t.ref[s_old] = 0
        t.hash[s_old] = NO_HASH
    taken = set(low.tolist())
    t.free_slots = [s for s in t.free_slots if s not in taken] + high.tolist()


def _resize_meta(t: TierPool, cap: int) -> None:
    """Per-slot metadata at the new capacity, the first min(old, new) slots kept (the policy's state follows the
    capacity on its next use: engine/kv/eviction.py)."""
    keep = min(cap, t.capacity)
    for name in TierPool.META + ("hist", "tokens"):
        old = getattr(t, name)
        new = np.full((cap,) + old.shape[1:], _FILL.get(name, 0), dtype=old.dtype)
        new[:keep] = old[:keep]
        setattr(t, name, new)
    t.capacity = cap
    used = t.lid >= 0
    t.free_slots = [int(s) for s in np.flatnonzero(~used)[::-1]]  # stack: lowest slot first
    t.cached = IndexedSet(max(cap, 1))
    for s in np.flatnonzero(used & (t.ref == 0) & (t.hash != NO_HASH)).tolist():
        t.cached.add(s)
    if t.null_slot is not None:
        t.null_slot, t.sink_slot = cap, cap + 1
    assert t.hist.shape[1] == HIST_K


def _grow_lids(pool: BlockPool, n: int) -> None:
    """Room for n logical blocks (ids are never renumbered; the id space only grows)."""
    if n <= pool.n_lids:
        return
    extra = n - pool.n_lids
    pool.tier = np.concatenate([pool.tier, np.full(extra, -1, dtype=pool.tier.dtype)])
    pool.slot = np.concatenate([pool.slot, np.full(extra, -1, dtype=pool.slot.dtype)])
    pool.serial = np.concatenate([pool.serial, np.full(extra, -1, dtype=pool.serial.dtype)])
    pool.free_lids = list(range(n - 1, pool.n_lids - 1, -1)) + pool.free_lids
    pool.n_lids = n
