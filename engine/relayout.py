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
    """Move every live sequence's blocks into a fresh pool of `new`'s geometry and switch to it."""
    old_pool = kv.pool
    pool = kv.make_pool(new)
    if (new.block_size, new.kv_dtype) == (kv.config.block_size, kv.config.kv_dtype):
        tables = _copy_bytes(old_pool, pool, seqs, now)
    else:
        tables = _reencode(kv, pool, seqs, new, now)
    kv.use(pool)  # commit: nothing above touched a sequence
    for seq in seqs:
        if seq.id in tables:
            seq.blocks, seq.hashes = tables[seq.id]
            seq.table_version += 1


def _copy_bytes(old: BlockPool, pool: BlockPool, seqs: list[Sequence], now: float) -> dict:
    """A budget-only change: every live block is copied byte for byte (codes and scales), so even the formats
    whose encoding is not idempotent keep exactly what attention read."""
    mapping: dict[int, int] = {}
    tables = {}
    for seq in seqs:
        for lid in seq.blocks:
            if lid in mapping:
                pool.incref(mapping[lid])
                continue
            tier = Tier.DEVICE if pool.reclaimable(Tier.DEVICE) else Tier.HOST
            new_lid = pool.allocate(tier, seq.id, now)
            pool.copy_from(old, lid, new_lid)
            h = old.hash_of(lid)
            if h:
                t = old.tiers[old.tier[lid]]
                pool.set_hash(new_lid, h, t.tokens[old.slot[lid], :old.fill_of(lid)])
            mapping[lid] = new_lid
        if seq.blocks:
            tables[seq.id] = ([mapping[lid] for lid in seq.blocks], list(seq.hashes))
    return tables


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
