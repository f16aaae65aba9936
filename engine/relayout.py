"""Re-laying live K/V into a pool of another geometry (block size, format, budgets).

The new pool is built and filled before the old one is dropped, so a failure leaves the engine exactly
as it was. Shared prefixes stay shared: a block another sequence already re-laid is referenced, not copied.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.block_pool import BlockPool, Tier, blocks_for, chain_hash
from engine.config import CacheConfig
from engine.kv_manager import KVManager
from engine.sequence import Sequence


def relayout(kv: KVManager, seqs: list[Sequence], new: CacheConfig, now: float) -> None:
    """Move every live sequence's blocks into a fresh pool of `new`'s geometry and switch to it. A dtype change
    (same block size) also re-lays the prefix cache: each cached block is re-encoded with its hash and history.
    (Budget-only changes never come here: they resize the pool in place, engine/tier_resize.py.)"""
    old_pool = kv.pool
    pool = kv.make_pool(new)
    tables = _reencode(kv, pool, seqs, new, now)
    if new.block_size == old_pool.config.block_size:
        _relay_cached(old_pool, pool, now)
    kv.use(pool)  # commit: nothing above touched a sequence
    for seq in seqs:
        if seq.id in tables:
            seq.blocks, seq.hashes = tables[seq.id]
            seq.table_version += 1


def _relay_cached(old: BlockPool, pool: BlockPool, now: float) -> None:
    """Cached (unowned) blocks of `old`, hottest first, re-encoded into `pool` while it has room; each keeps its
    hash, tokens and access history, so the prefix cache and the eviction order survive the change."""
    cand = [(t, int(s)) for t in old.tiers for s in t.cached.view()]
    cand.sort(key=lambda ts: -ts[0].last[ts[1]])
    for t, s in cand:
        h = int(t.hash[s])
        if h in pool.by_hash:  # a live sequence's block, re-laid already
            continue
        free = [tt for tt in (Tier.DEVICE, Tier.HOST) if pool.tiers[tt].free_slots]  # never evict one re-laid already
        if not free:
            return
        tier = free[0]
        lid = int(t.lid[s])
        new_lid = pool.allocate(tier, -1, now)
        fill = int(t.fill[s])
        pool.set_fill([new_lid], [fill])
        k, v = old.read_blocks([lid])
        pool.write_blocks([new_lid], k, v)
        pool.set_hash(new_lid, h, t.tokens[s, :fill])
        nt, ns = pool.tiers[pool.tier[new_lid]], pool.slot[new_lid]
        for m in ("last", "heat", "born", "hist"):
            getattr(nt, m)[ns] = getattr(t, m)[s]
        pool.decref(new_lid)  # unowned and hashed: cached


def _reencode(kv: KVManager, pool: BlockPool, seqs: list[Sequence], new: CacheConfig, now: float) -> dict:
    """Decode each sequence's K/V and encode it into blocks of the new size and format."""
    tables = {}
    written: dict[int, int] = {}
    bs = new.block_size
    for seq in seqs:
        if seq.num_cached == 0:
            tables[seq.id] = ([], [])
            continue
        k, v = kv.tokens_kv(seq)  # [L, n, Hkv, D]
        blocks, hashes = [], []
        parent = 0
        for b in range(blocks_for(seq.num_cached, bs)):
            lo, hi = b * bs, min((b + 1) * bs, seq.num_cached)
            toks = np.asarray(seq.tokens[lo:hi], dtype=np.int32)
            full_canon = hi - lo == bs and hi <= seq.canonical
            h = chain_hash(parent, toks) if full_canon else 0
            parent = h
            if h and h in written:
                lid = written[h]
                pool.incref(lid)
            else:
                tier = Tier.DEVICE if pool.reclaimable(Tier.DEVICE) else Tier.HOST
                lid = pool.allocate(tier, seq.id, now)
                pool.set_fill([lid], [hi - lo])
                kb = torch.zeros((k.shape[0], 1, k.shape[2], bs, k.shape[3]), device=k.device)
                vb = torch.zeros_like(kb)
                kb[:, 0, :, : hi - lo] = k[:, lo:hi].transpose(1, 2)
                vb[:, 0, :, : hi - lo] = v[:, lo:hi].transpose(1, 2)
                pool.write_blocks([lid], kb, vb)
                if h:
                    pool.set_hash(lid, h, toks)
                    written[h] = lid
            blocks.append(lid)
            hashes.append(h)
        tables[seq.id] = (blocks, hashes)
    return tables
