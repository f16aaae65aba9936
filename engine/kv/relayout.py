"""Re-laying the cache into another geometry (block size, storage format), a layer at a time.

A change runs in two phases:

1. **Plan** (nothing moves): a pool of the new geometry is built with metadata only (no layer allocated) and every
   block the change keeps is allocated in it: each live sequence's tokens cut into blocks of the new size, shared
   prefixes still shared, then the prefix cache (a dtype change keeps each cached block with its hash and
   history; a block-size change rebuilds each cached prefix chain into blocks of the new size) while the new pool
   has free slots. The result is a token map: for each new block, where each of its tokens sits in the old pool.
   Anything that cannot fit raises CacheFull here, with the engine untouched.
2. **Copy**, one layer and one side (K, V) at a time: the new layer is allocated, the mapped tokens are decoded
   from the old layer and encoded into it in bounded chunks, and the old layer is freed. So the change holds one
   layer of one side beside the tiers (1 / (2 × layers) of them: 1.7 % on a 30-layer model), never a second pool.
   Should an allocation fail mid-way (a full GPU), the layers already copied are copied back through the inverse
   map, cached blocks the plan dropped are released, and the change is refused (ConfigError) with every sequence
   intact (values of a copied layer went through the new format once: exact when it is lossless).

`relayout` returns what the change held: `peak_extra_bytes` (the most bytes of tier storage and scratch held at
once beyond the larger of the old and new tiers) and the tiers' bytes before and after.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from engine.kv.block_pool import BlockPool, Tier, blocks_for
from engine.kv.tiers import chain_hash
from engine.config import CacheConfig
from engine.errors import ConfigError
from engine.sequence import Sequence
from engine.kv.tiers import TierPool

CHUNK_TOKENS = 8192  # tokens decoded and encoded at once within a layer (bounds the scratch)


class RelaidKV(Protocol):
    """What a re-lay needs of the KV manager (engine/kv/manager.py's KVManager, which calls relayout): its pool, a new
    one of another geometry, and switching to it."""

    pool: BlockPool

    def make_pool(self, config: CacheConfig, storage: bool = True, replacing: BlockPool | None = None) -> BlockPool: ...

    def use(self, pool: BlockPool) -> None: ...


def relayout(kv: RelaidKV, seqs: list[Sequence], new: CacheConfig, now: float) -> dict:
    """Move every live sequence's blocks and the prefix cache into a pool of `new`'s geometry and switch to it."""
    old = kv.pool
    pool = kv.make_pool(new, storage=False, replacing=old)
    plan = _Plan(old, pool)
    tables = {seq.id: plan.sequence(seq, now) for seq in seqs}
    if new.block_size == old.config.block_size:
        plan.cached_blocks(now)
    else:
        plan.cached_chains(now)
    report = _Copier(old, pool, plan.token_map()).run(plan)
    kv.use(pool)
    for seq in seqs:
        seq.blocks, seq.hashes = tables[seq.id]
        seq.table_version += 1
    return report


@dataclass
class _Plan:
    """The new pool's blocks and, for each one written, the old (tier, slot, offset) of each of its tokens."""

    old: BlockPool
    pool: BlockPool
    sources: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)  # new lid -> src
    written: dict[int, int] = field(default_factory=dict)  # hash -> new lid, for sharing

    # -- what is kept --------------------------------------------------------------------------------------------
    def sequence(self, seq: Sequence, now: float) -> tuple[list[int], list[int]]:
        """A sequence's tokens cut into new blocks. A window group's view (engine/kv/groups.py) starts at its table's
        first block: its chain continues from `base_hash`; re-based to another block size (grouped.Rebased) its first
        `lead` tokens are ones the group dropped, read as zeros from the old null block (never visible)."""
        n = seq.num_cached
        if n == 0:
            return [], []
        bs = self.old.geom.block_size
        lead = getattr(seq, "lead", 0)
        lids = np.asarray(seq.blocks, dtype=np.int64)
        held = np.arange(n) - lead  # each token's index in the old table
        ok = held >= 0
        tier = np.full(n, int(Tier.DEVICE), dtype=np.int64)
        slot = np.full(n, self.old.tiers[Tier.DEVICE].null_slot, dtype=np.int64)
        off = np.zeros(n, dtype=np.int64)
        tier[ok] = self.old.tier[lids[held[ok] // bs]]
        slot[ok] = self.old.slot[lids[held[ok] // bs]]
        off[ok] = held[ok] % bs
        canonical = seq.canonical if seq.base_hash or not (seq.base or lead > 0) else 0  # a chain that cannot go on
        blocks, hashes, _ = self._run((tier, slot, off), seq.tokens[:n], canonical, seq.id, now, free_only=False,
                                      parent=seq.base_hash)
        return blocks, hashes

    def cached_blocks(self, now: float) -> None:
        """Same block size: each cached block, hottest first, into a free slot with its hash and history."""
        cand = [(t, int(s)) for t in self.old.tiers for s in t.cached.view()]
        cand.sort(key=lambda ts: -ts[0].last[ts[1]])
        pool = self.pool
        for t, s in cand:
            h = int(t.hash[s])
            if h in pool.by_hash:  # a live sequence's block, planned already
                continue
            tier = self._free_tier()
            if tier is None:
                return
            lid = pool.allocate(tier, -1, now)
            fill = int(t.fill[s])
            pool.set_fill([lid], [fill])
            pool.set_hash(lid, h, t.tokens[s, :fill], int(t.parent[s]))
            nt, ns = pool.tiers[pool.tier[lid]], pool.slot[lid]
            for m in ("last", "heat", "born", "hist"):
                getattr(nt, m)[ns] = getattr(t, m)[s]
            self.sources[lid] = (np.full(fill, int(t.tier)), np.full(fill, s), np.arange(fill))
            pool.decref(lid)  # unowned and hashed: cached

    def cached_chains(self, now: float) -> None:
        """A block-size change: each cached prefix (a chain of blocks linked by parent hashes, most recently used
        first) cut anew into blocks of the new size, kept while the new pool has free slots. A prefix whose head
        was evicted cannot be rebuilt (its tokens are gone) and is dropped."""
        old = self.old
        where = {}  # hash -> (tier, slot) of every hashed block in the old pool
        for t in old.tiers:
            for s in np.flatnonzero((t.lid >= 0) & (t.hash != 0)).tolist():
                where[int(t.hash[s])] = (t, s)
        parents = {int(t.parent[s]) for t, s in where.values()}
        ends = [(t, s) for t, s in where.values() if t.ref[s] == 0 and int(t.hash[s]) not in parents]  # cached leaves
        ends.sort(key=lambda ts: -ts[0].last[ts[1]])
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
            fills = [int(ct.fill[cs]) for ct, cs in chain]
            src = (np.concatenate([np.full(f, int(ct.tier)) for (ct, _), f in zip(chain, fills)]),
                   np.concatenate([np.full(f, cs) for (_, cs), f in zip(chain, fills)]),
                   np.concatenate([np.arange(f) for f in fills]))
            tokens = np.concatenate([ct.tokens[cs, :f] for (ct, cs), f in zip(chain, fills)])
            blocks, _, done = self._run(src, tokens.tolist(), len(tokens), -1, now, free_only=True)
            for lid in blocks:  # unowned: full hashed blocks stay cached, a partial tail is released
                self.pool.decref(lid)
            if not done:
                return

    # -- helpers -------------------------------------------------------------------------------------------------
    def _free_tier(self) -> Tier | None:
        return next((t for t in (Tier.DEVICE, Tier.HOST) if self.pool.tiers[t].free_slots), None)

    def _run(self, src, tokens, canonical: int, owner: int, now: float, free_only: bool, parent: int = 0):
        """Tokens (their old places `src`) cut into blocks of the new size: a full block within the first
        `canonical` tokens is hashed (chained) and shared with one planned already; the rest are fresh blocks owned
        by `owner`. free_only: take only free slots (never evict) and stop when none is.
        Returns (blocks, hashes, all planned)."""
        pool, bs = self.pool, self.pool.geom.block_size
        n = len(tokens)
        blocks, hashes = [], []
        for b in range(blocks_for(n, bs)):
            lo, hi = b * bs, min((b + 1) * bs, n)
            toks = np.asarray(tokens[lo:hi], dtype=np.int32)
            h = chain_hash(parent, toks) if hi - lo == bs and hi <= canonical else 0
            if h and h in self.written:
                lid = self.written[h]
                pool.incref(lid)
            else:
                if free_only:
                    tier = self._free_tier()
                    if tier is None:
                        return blocks, hashes, False
                else:
                    tier = Tier.DEVICE if pool.reclaimable(Tier.DEVICE) else Tier.HOST
                lid = pool.allocate(tier, owner, now)
                pool.set_fill([lid], [hi - lo])
                self.sources[lid] = (src[0][lo:hi], src[1][lo:hi], src[2][lo:hi])
                if h:
                    pool.set_hash(lid, h, toks, parent)
                    self.written[h] = lid
            parent = h
            blocks.append(lid)
            hashes.append(h)
        return blocks, hashes, True

    def token_map(self) -> "_TokenMap":
        """Every token of every new block still allocated: new (tier, slot, offset) <- old (tier, slot, offset)."""
        pool = self.pool
        live = [(lid, s) for lid, s in self.sources.items() if pool.tier[lid] >= 0]
        if not live:
            e = np.zeros(0, dtype=np.int64)
            return _TokenMap(e, e, e, e, e, e)
        parts = [[], [], [], [], [], []]
        for lid, (st, ss, so) in live:
            n = len(so)
            parts[0].append(np.full(n, int(pool.tier[lid])))
            parts[1].append(np.full(n, int(pool.slot[lid])))
            parts[2].append(np.arange(n))
            parts[3].append(st)
            parts[4].append(ss)
            parts[5].append(so)
        return _TokenMap(*(np.concatenate(p).astype(np.int64) for p in parts))


@dataclass(frozen=True)
class _TokenMap:
    """Token i goes from (src_tier, src_slot, src_off) to (dst_tier, dst_slot, dst_off)."""

    dst_tier: np.ndarray
    dst_slot: np.ndarray
    dst_off: np.ndarray
    src_tier: np.ndarray
    src_slot: np.ndarray
    src_off: np.ndarray

    def inverse(self) -> "_TokenMap":
        return _TokenMap(self.src_tier, self.src_slot, self.src_off, self.dst_tier, self.dst_slot, self.dst_off)


class _Copier:
    """The copy phase: layer by layer, side by side, counting the bytes held."""

    def __init__(self, old: BlockPool, new: BlockPool, tmap: _TokenMap):
        self.old, self.new, self.tmap = old, new, tmap
        self.held = _storage_bytes(old)
        self.peak = self.held
        self.old_bytes = self.held
        self.new_bytes = _planned_bytes(new)

    def run(self, plan: _Plan) -> dict:
        L = self.old.geom.layers
        done: list[tuple[int, str]] = []
        try:
            for layer in range(L):
                for side in ("k", "v"):
                    self._layer(self.old, self.new, self.tmap, layer, side)
                    done.append((layer, side))
        except Exception as e:  # torch.OutOfMemoryError is a RuntimeError; anything else is undone the same way
            self._revert(done, plan)
            what = "ran out of memory" if isinstance(e, (RuntimeError, MemoryError)) else f"failed ({type(e).__name__})"
            raise ConfigError(f"re-laying the cache {what} at layer {len(done) // 2}: "
                              f"{(str(e) or type(e).__name__).splitlines()[0]}; the change was undone and nothing else "
                              "changed") from None
        return {"peak_extra_bytes": int(self.peak - max(self.old_bytes, self.new_bytes)),
                "old_tier_bytes": int(self.old_bytes), "new_tier_bytes": int(self.new_bytes)}

    def _layer(self, src: BlockPool, dst: BlockPool, tmap: _TokenMap, layer: int, side: str) -> None:
        """Allocate `dst`'s layer, fill it from `src`'s through `tmap`, free `src`'s layer."""
        codec = dst.kcodec if side == "k" else dst.vcodec
        for t in dst.tiers:
            parts = getattr(t, side)
            if parts["data"][layer] is None:
                codec.alloc_layer(parts, dst.geom, _slots(t), layer, *dst.layer_place(t.tier, layer))
                self._hold(_layer_bytes(parts, layer))
        self._copy(src, dst, tmap, layer, side)
        for t in src.tiers:
            parts = getattr(t, side)
            self.held -= _layer_bytes(parts, layer)
            for name in parts:
                parts[name][layer] = None

    def _copy(self, src: BlockPool, dst: BlockPool, tmap: _TokenMap, layer: int, side: str) -> None:
        if (src.config.kv_dtype, src.geom.block_size) == (dst.config.kv_dtype, dst.geom.block_size):
            self._copy_bytes(src, dst, tmap, layer, side)
            return
        scodec = src.kcodec if side == "k" else src.vcodec
        dcodec = dst.kcodec if side == "k" else dst.vcodec
        g, bs = dst.geom, dst.geom.block_size
        for dt in dst.tiers:
            sel = np.flatnonzero(tmap.dst_tier == int(dt.tier))
            if len(sel) == 0:
                continue
            dev = getattr(dt, side)["data"][layer].device
            blocks, inv = np.unique(tmap.dst_slot[sel], return_inverse=True)
            per_chunk = max(1, CHUNK_TOKENS // bs)
            for c0 in range(0, len(blocks), per_chunk):
                in_chunk = (inv >= c0) & (inv < c0 + per_chunk)
                rows = sel[in_chunk]
                nb = min(per_chunk, len(blocks) - c0)
                x = torch.zeros((nb, g.kv_heads, bs, g.head_dim), device=dev)
                scratch = x.numel() * 4
                for st in src.tiers:
                    m = tmap.src_tier[rows] == int(st.tier)
                    if not m.any():
                        continue
                    r = rows[m]
                    sblocks, sinv = np.unique(tmap.src_slot[r], return_inverse=True)
                    sdev = getattr(st, side)["data"][layer].device
                    dec = scodec.decode(getattr(st, side), layer, torch.as_tensor(sblocks, device=sdev))
                    scratch += dec.numel() * 4
                    tok = dec[torch.as_tensor(sinv, device=sdev), :, torch.as_tensor(tmap.src_off[r], device=sdev)]
                    x[torch.as_tensor(inv[in_chunk][m] - c0, device=dev), :,
                      torch.as_tensor(tmap.dst_off[r], device=dev)] = tok.to(dev)
                self.peak = max(self.peak, self.held + scratch)
                dcodec.encode(getattr(dt, side), layer, torch.as_tensor(blocks[c0:c0 + nb], device=dev), x)

    @staticmethod
    def _copy_bytes(src: BlockPool, dst: BlockPool, tmap: _TokenMap, layer: int, side: str) -> None:
        """Same format and block size (a placement change): each block's parts copied byte for byte."""
        first = tmap.dst_off == 0  # blocks map whole onto blocks: a block's token 0 names both slots
        for dt in dst.tiers:
            for st in src.tiers:
                m = first & (tmap.dst_tier == int(dt.tier)) & (tmap.src_tier == int(st.tier))
                if not m.any():
                    continue
                for name, layers in getattr(dt, side).items():
                    s_t = getattr(st, side)[name][layer]
                    d_t = layers[layer]
                    d_t[torch.as_tensor(tmap.dst_slot[m], device=d_t.device)] = \
                        s_t[torch.as_tensor(tmap.src_slot[m], device=s_t.device)].to(d_t.device)

    def _hold(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def _revert(self, done: list[tuple[int, str]], plan: _Plan) -> None:
        """Copy the layers done back into the old pool (through the inverse map) and free them in the new one, then
        release the old pool's cached blocks the plan did not keep (their copied layers are gone)."""
        inv = self.tmap.inverse()
        for layer, side in done:
            self._layer(self.new, self.old, inv, layer, side)
        for t in self.new.tiers:  # a layer allocated but not finished
            for side in ("k", "v"):
                for name in getattr(t, side):
                    getattr(t, side)[name][:] = [None] * self.new.geom.layers
        if done:
            kept = set(zip(self.tmap.src_tier.tolist(), self.tmap.src_slot.tolist()))
            for t in self.old.tiers:
                for s in list(t.cached.view().tolist()):
                    if (int(t.tier), s) not in kept:
                        self.old._release(int(t.lid[s]))


def _slots(t: TierPool) -> int:
    return t.capacity + (2 if t.null_slot is not None else 0)


def _storage_bytes(pool: BlockPool) -> int:
    return sum(sum(t.nbytes().values()) for t in pool.tiers)


def _layer_bytes(parts, layer: int) -> int:
    return sum(parts[name][layer].numel() * parts[name][layer].element_size() for name in parts)


def _planned_bytes(pool: BlockPool) -> int:
    """Bytes `pool`'s tiers take once every layer is allocated."""
    return sum(_slots(t) * pool.block_bytes for t in pool.tiers)
