"""The block pool's invariants, checked by tests and the hypothesis state machines (BlockPool.check)."""

from __future__ import annotations

import numpy as np
import torch

from engine.kv.tiers import NO_HASH


def check_pool(pool, owners: dict[int, int]) -> None:
    """Invariants of a BlockPool; `owners` maps lid -> number of block-table entries that hold it."""
    live = set(np.flatnonzero(pool.tier >= 0).tolist())
    free = set(pool.free_lids)
    assert not (live & free), "block both free and live"
    assert len(live) + len(free) == pool.n_lids, "lost a logical block"
    for lid in owners:
        assert lid in live, f"a block table holds freed block {lid}"
    for t in pool.tiers:
        used = np.flatnonzero(t.lid >= 0)
        assert len(used) + len(t.free_slots) == t.capacity, f"{t.tier.name}: slots leaked"
        assert not (set(used.tolist()) & set(t.free_slots)), f"{t.tier.name}: slot both free and used"
        if t.null_slot is not None:
            assert t.null_slot not in t.free_slots and all(
                not bool(p[:, t.null_slot].view(torch.uint8).any()) for p in (*t.k.values(), *t.v.values())), \
                "the null block was handed out or written"
        for s in used.tolist():
            lid = int(t.lid[s])
            assert pool.tier[lid] == t.tier and pool.slot[lid] == s, f"block {lid} not where it says"
            assert t.ref[s] == owners.get(lid, 0), f"block {lid}: ref {t.ref[s]} != owners {owners.get(lid, 0)}"
            if t.ref[s] == 0:
                assert s in t.cached and t.hash[s] != NO_HASH, f"unowned block {lid} is neither cached nor free"
            else:
                assert s not in t.cached, f"owned block {lid} listed as cached"
    for h, lid in pool.by_hash.items():
        assert pool.hash_of(lid) == h, "hash index stale"
