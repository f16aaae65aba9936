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
    else:
        _relay_cached_chains(old_pool, pool, now)
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
        pool.set_hash(new_lid, h, t.tokens[s, :fill], int(t.parent[s]))
        nt, ns = pool.tiers[pool.tier[new_lid]], pool.slot[new_lid]
        for m in ("last", "heat", "born", "hist"):
            getattr(nt, m)[ns] = getattr(t, m)[s]
        pool.decref(new_lid)  # unowned and hashed: cached


def _reencode(kv: KVManager, pool: BlockPool, seqs: list[Sequence], new: CacheConfig, now: float) -> dict:
    """Decode each sequence's K/V and encode it into blocks of the new size and format."""
    tables = {}
    written: dict[int, int] = {}
    for seq in seqs:
        if seq.num_cached == 0:
            tables[seq.id] = ([], [])
            continue
        k, v = kv.tokens_kv(seq)  # [L, n, Hkv, D]
        blocks, hashes, _ = _write_run(pool, k, v, seq.tokens[:seq.num_cached], seq.canonical, now, seq.id, written)
        tables[seq.id] = (blocks, hashes)
    return tables


def _write_run(pool: BlockPool, k: torch.Tensor, v: torch.Tensor, tokens: list[int], canonical: int, now: float,
               owner: int, written: dict[int, int], free_only: bool = False) -> tuple[list[int], list[int], bool]:
    """Tokens (K/V [L, n, Hkv, D]) cut into blocks of the pool's size: a full block within the first `canonical`
    tokens is hashed (chained) and shared with one already `written`; the rest are fresh blocks owned by `owner`.
    free_only: take only free slots (never evict), and stop when none is. Returns (blocks, hashes, all written)."""
    bs = pool.geom.block_size
    n = len(tokens)
    blocks, hashes = [], []
    parent = 0
    for b in range(blocks_for(n, bs)):
        lo, hi = b * bs, min((b + 1) * bs, n)
        toks = np.asarray(tokens[lo:hi], dtype=np.int32)
        h = chain_hash(parent, toks) if hi - lo == bs and hi <= canonical else 0
        if h and h in written:
            lid = written[h]
            pool.incref(lid)
        else:
            if free_only:
                free = [t for t in (Tier.DEVICE, Tier.HOST) if pool.tiers[t].free_slots]
                if not free:
                    return blocks, hashes, False
                tier = free[0]
            else:
                tier = Tier.DEVICE if pool.reclaimable(Tier.DEVICE) else Tier.HOST
            lid = pool.allocate(tier, owner, now)
            pool.set_fill([lid], [hi - lo])
            kb = torch.zeros((k.shape[0], 1, k.shape[2], bs, k.shape[3]), device=k.device)
            vb = torch.zeros_like(kb)
            kb[:, 0, :, : hi - lo] = k[:, lo:hi].transpose(1, 2)
            vb[:, 0, :, : hi - lo] = v[:, lo:hi].transpose(1, 2)
            pool.write_blocks([lid], kb, vb)
            if h:
                pool.set_hash(lid, h, toks, parent)
                written[h] = lid
        parent = h
        blocks.append(lid)
        hashes.append(h)
    return blocks, hashes, True


def _relay_cached_chains(old: BlockPool, pool: BlockPool, now: float) -> None:
    """A block-size change: the prefix cache's chains, rebuilt. Each cached block is the end of a prefix whose
    blocks are linked by their parents' hashes; the prefix's tokens and K/V (decoded once per block) are cut into
    blocks of the new size, hashed and chained anew, and kept as cached blocks while the pool has free slots.
    A prefix whose head was evicted cannot be rebuilt (its tokens are gone) and is dropped."""
    where = {}  # hash -> (tier, slot) of every hashed block in the old pool
    for t in old.tiers:
        for s in np.flatnonzero((t.lid >= 0) & (t.hash != 0)).tolist():
            where[int(t.hash[s])] = (t, s)
    parents = {int(t.parent[s]) for t, s in where.values()}
    ends = [(t, s) for t, s in where.values() if t.ref[s] == 0 and int(t.hash[s]) not in parents]  # cached leaves
    ends.sort(key=lambda ts: -ts[0].last[ts[1]])  # the most recently used prefixes first
    written = {h: lid for h, lid in pool.by_hash.items()}
    kv_of: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for t, s in ends:
        chain = []
        h = int(t.hash[s])
        while h:
            if h not in where:
                chain = None  # the head was evicted
                break
            chain.append(where[h])
            h = int(where[h][0].parent[where[h][1]])
        if not chain:
            continue
        chain.reverse()
        tokens, ks, vs = [], [], []
        for ct, cs in chain:
            lid = int(ct.lid[cs])
            if lid not in kv_of:
                kb, vb = old.read_blocks([lid])  # [L, 1, Hkv, bs, D]
                kv_of[lid] = (kb[:, 0].transpose(1, 2), vb[:, 0].transpose(1, 2))  # [L, bs, Hkv, D]
            fill = int(ct.fill[cs])
            tokens.extend(ct.tokens[cs, :fill].tolist())
            ks.append(kv_of[lid][0][:, :fill])
            vs.append(kv_of[lid][1][:, :fill])
        blocks, _, done = _write_run(pool, torch.cat(ks, 1), torch.cat(vs, 1), tokens, len(tokens), now, -1, written,
                                     free_only=True)
        for lid in blocks:  # unowned: full hashed blocks stay cached, a partial tail is released
            pool.decref(lid)
        if not done:
            return
