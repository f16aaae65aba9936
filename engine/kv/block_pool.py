"""Two slab-allocated tiers of fixed-size KV blocks and the metadata of every block.

A block has a logical id (lid) that never changes while it lives; block tables hold lids. Where a
block sits (tier, slot) is metadata, so a migration rewrites two numbers, not every table that
shares the block. All per-block metadata lives in numpy arrays indexed by lid, so a snapshot is a
handful of vectorized gathers and no Python object exists per block. A tier's slab and per-slot arrays
are a `TierPool` (engine/kv/tiers.py); this module holds `BlockPool`, which owns both tiers.
"""

from __future__ import annotations

import collections
import math
from typing import NamedTuple

import numpy as np
import torch

from engine.kv.codecs import Codec, Geometry, codecs_for
from engine.config import CacheConfig
from engine.kv.eviction import EvictionPolicy, heat_now, make_policy
from engine.kv.misses import GONE_NONE, WHY_NONE, WHY_OF_MOVE, WHY_OTHER, WHY_ROOM, HashLedger
from engine.kv.tiers import NO_HASH, RESERVED, CacheFull, Tier, TierPool, copy_slots, tier_sizes


class PoolEvent(NamedTuple):
    """evict: lid, tier, age (s since allocation), gap (s since last read), hash (its chain hash, 0 if none);
    promote / demote: n blocks, reason, nbytes."""
    kind: str
    fields: dict




class BlockPool:
    """Blocks of both tiers: allocation, ref counts, hashes, heat, eviction, migration.

    `tier[lid]`/`slot[lid]` say where a logical block sits; everything else about it is in its
    tier's per-slot arrays. Free slots are a stack and cached blocks an indexed set: O(1) each.
    """

    def __init__(self, geometry_no_bs: tuple[int, int, int], config: CacheConfig, device: torch.device,
                 first_serial: int = 0, storage: bool = True):
        """storage=False: metadata only, no layer of K/V allocated (a re-lay allocates them one at a time)."""
        layers, kv_heads, head_dim = geometry_no_bs
        self.device = device
        self.config = config
        self.geom = Geometry(layers, kv_heads, config.block_size, head_dim)
        self.kcodec, self.vcodec = codecs_for(config.kv_dtype)
        self.block_bytes = self._block_bytes(self.kcodec, self.vcodec, self.geom)
        # The budget holds the device tier's blocks and its two reserved slots (the null and sink blocks); with
        # per-layer placement only their first `device_layers` layers, the rest in host memory (engine/kv/tiers.py).
        self.sizes = tier_sizes(config, layers, self.block_bytes)
        cap_dev, cap_host = self.sizes.dev_cap, self.sizes.host_cap
        self.policy: EvictionPolicy = make_policy(config.policy, config.decay)
        n = cap_dev + cap_host
        self.tiers = [self._make_tier(Tier.DEVICE, cap_dev, n, storage), self._make_tier(Tier.HOST, cap_host, n, storage)]
        self.n_lids = n
        self.free_lids = list(range(n - 1, -1, -1))
        self.tier = np.full(n, -1, dtype=np.int8)
        self.slot = np.full(n, -1, dtype=np.int64)
        self.moves = 0  # bumped whenever a live block changes tier (snapshots cache per-sequence placement on it)
        self.serial = np.full(n, -1, dtype=np.int64)  # allocation serial: names a block in access traces
        self.next_serial = first_serial
        self.allocated = [0, 0]  # blocks allocated per tier (Tier.DEVICE, Tier.HOST), for the eviction rate
        self.by_hash: dict[int, int] = {}
        # Side stream for tier copies on CUDA, so migrations overlap compute.
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # How tier copies run (a seam: tests put a faulty one here), and whether the first was checked byte for byte
        # (engine/kv/copy_check.py: a failed check leaves synchronous copies).
        self.copier = copy_slots
        self.copy_checked = False
        # What happened to blocks (evict, promote, demote), queued here and drained by the owner with take_events()
        # (the engine, after each step and operation, into telemetry's counters and feed): the pool calls no one.
        self.events: collections.deque[PoolEvent] = collections.deque()
        self.journal: list | None = None  # block copies of a resize in progress (engine/kv/resize_undo.py)
        # What became of every hash stored here (engine/kv/misses.py): why a later lookup missed. A re-laid pool
        # takes its predecessor's (KVManager.use).
        self.ledger = HashLedger()
        self.now = 0.0  # the engine time of the latest allocation, access or eviction (when a removal is recorded)

    # -- construction -------------------------------------------------------------------------
    @staticmethod
    def _block_bytes(kc: Codec, vc: Codec, g: Geometry) -> int:
        return sum(kc.block_bytes(g).values()) + sum(vc.block_bytes(g).values())

    @staticmethod
    def bytes_per_block(config: CacheConfig, layers: int, kv_heads: int, head_dim: int) -> int:
        kc, vc = codecs_for(config.kv_dtype)
        return BlockPool._block_bytes(kc, vc, Geometry(layers, kv_heads, config.block_size, head_dim))

    def layer_place(self, tier: Tier, layer: int) -> tuple[torch.device, bool]:
        """(device, pinned) of a tier's layer: the device tier's first `sizes.dev_layers` layers on the engine's device,
        every other layer in host memory (pinned when the device is CUDA)."""
        if tier is Tier.DEVICE and layer < self.sizes.dev_layers:
            return self.device, False
        return torch.device("cpu"), self.device.type == "cuda"

    def _make_tier(self, tier: Tier, cap: int, universe: int, storage: bool) -> TierPool:
        # The device tier has two slots past its blocks, never allocated: the null block (slot `cap`), zeros that pad
        # block tables (attention reads it only where keys are masked), and the sink (slot `cap + 1`), written by a
        # CUDA graph's padding rows and never read (engine/runtime/cuda_graphs.py).
        dev = tier is Tier.DEVICE
        slots = cap + RESERVED if dev else cap
        k = self.kcodec.alloc(self.geom, slots, self.device, False, layers=False)
        v = self.vcodec.alloc(self.geom, slots, self.device, False, layers=False)
        for layer in range(self.geom.layers if storage else 0):
            for codec, parts in ((self.kcodec, k), (self.vcodec, v)):
                codec.alloc_layer(parts, self.geom, slots, layer, *self.layer_place(tier, layer))
        return TierPool(tier, cap, k, v, self.geom.block_size, universe, null_slot=cap if dev else None)

    # -- per-block accessors (by lid) ---------------------------------------------------------
    def _meta(self, name: str, lids) -> np.ndarray:
        lids = np.atleast_1d(np.asarray(lids, dtype=np.int64))
        out = np.zeros(len(lids), dtype=getattr(self.tiers[0], name).dtype)
        for t in self.tiers:
            m = self.tier[lids] == t.tier
            if m.any():
                out[m] = getattr(t, name)[self.slot[lids[m]]]
        return out

    def ref_of(self, lid: int) -> int:
        return int(self.tiers[self.tier[lid]].ref[self.slot[lid]])

    def hash_of(self, lid: int) -> int:
        return int(self.tiers[self.tier[lid]].hash[self.slot[lid]])

    def set_fill(self, lids: np.ndarray, fills: np.ndarray) -> None:
        lids = np.asarray(lids, dtype=np.int64)
        for t in self.tiers:
            m = self.tier[lids] == t.tier
            if m.any():
                t.fill[self.slot[lids[m]]] = np.asarray(fills)[m]

    def last_of(self, lids) -> np.ndarray:
        return self._meta("last", lids)

    def born_of(self, lids) -> np.ndarray:
        return self._meta("born", lids)

    # -- queries ------------------------------------------------------------------------------
    def free_slots(self, tier: Tier) -> int:
        return len(self.tiers[tier].free_slots)

    def reclaimable(self, tier: Tier) -> int:
        """Slots obtainable on `tier` without touching any block a sequence owns."""
        t = self.tiers[tier]
        return len(t.free_slots) + len(t.cached)

    def can_allocate(self, tier: Tier, n: int) -> bool:
        return self.reclaimable(tier) >= n

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self, tier: Tier, owner: int, now: float) -> int:
        """A fresh block with ref 1 on `tier`; evicts cold cached blocks if the tier is full."""
        t = self.tiers[tier]
        if not t.free_slots:
            self.evict(tier, max(1, self.config.evict_batch), now)
        if not t.free_slots:
            raise CacheFull(f"{tier.name.lower()} tier full: {t.capacity} blocks, all owned by sequences")
        s = t.free_slots.pop()
        lid = self.free_lids.pop()
        self.serial[lid] = self.next_serial
        self.next_serial += 1
        self.allocated[tier] += 1
        self.tier[lid], self.slot[lid] = tier, s
        t.lid[s] = lid
        t.ref[s] = 1
        t.fill[s] = 0
        t.owner[s] = owner
        t.last[s] = now
        t.hist[s] = now
        t.heat[s] = 1.0
        t.born[s] = now
        t.hash[s] = NO_HASH
        t.why[s] = WHY_ROOM if tier == Tier.HOST else WHY_NONE  # on the host tier: the device tier had no room
        t.stores[s], t.gone_t[s], t.gone_by[s] = 0, np.nan, GONE_NONE
        self.now = now
        self.policy.on_insert(t, s, now)
        return lid

    def incref(self, lid: int) -> None:
        t, s = self.tiers[self.tier[lid]], self.slot[lid]
        if t.ref[s] == 0:
            t.cached.discard(s)
        t.ref[s] += 1

    def decref(self, lid: int) -> None:
        t, s = self.tiers[self.tier[lid]], self.slot[lid]
        assert t.ref[s] > 0, f"block {lid} freed twice"
        t.ref[s] -= 1
        if t.ref[s] > 0:
            return
        t.owner[s] = -1
        if t.hash[s] != NO_HASH:
            t.cached.add(s)  # lazy eviction: keep it for prefix reuse
        else:
            self._release(lid)

    def _release(self, lid: int, cause: str = "reconfigured", **detail) -> None:
        """Free the block. A hashed one leaves the prefix cache: the ledger records why (a caller that is not evicting
        is a config change: a reset of the prefix cache, a budget change, a re-lay)."""
        t, s = self.tiers[self.tier[lid]], int(self.slot[lid])
        t.cached.discard(s)
        h = int(t.hash[s])
        if h and self.by_hash.get(h) == lid:
            del self.by_hash[h]
            self.ledger.gone(h, self.now, cause, **detail)
        t.lid[s] = -1
        t.ref[s] = 0
        t.fill[s] = 0
        t.owner[s] = -1
        t.heat[s] = 0.0
        t.hash[s] = NO_HASH
        t.parent[s] = NO_HASH
        t.free_slots.append(s)
        self.tier[lid] = -1
        self.slot[lid] = -1
        self.free_lids.append(lid)

    def drop_cached(self) -> int:
        """Forget every cached (unowned) block on both tiers; owned blocks are untouched."""
        n = 0
        for t in self.tiers:
            for s in t.cached.view().copy().tolist():
                self._release(int(t.lid[s]))
                n += 1
        return n

    # -- hashing ------------------------------------------------------------------------------
    def set_hash(self, lid: int, h: int, tokens: np.ndarray, parent: int = 0) -> None:
        t, s = self.tiers[self.tier[lid]], self.slot[lid]
        if t.hash[s] != NO_HASH or h in self.by_hash:  # already hashed, or an identical block is cached
            return
        t.tokens[s, : len(tokens)] = tokens
        t.hash[s] = np.uint64(h)
        t.parent[s] = np.uint64(parent)
        self.by_hash[h] = lid
        t.stores[s], t.gone_t[s], t.gone_by[s] = self.ledger.stored(h, parent)

    def clear_hash(self, lid: int) -> None:
        t, s = self.tiers[self.tier[lid]], self.slot[lid]
        h = int(t.hash[s])
        if h and self.by_hash.get(h) == lid:
            del self.by_hash[h]
        t.hash[s] = NO_HASH
        if t.ref[s] == 0:
            self._release(lid)

    def lookup(self, h: int, tokens: np.ndarray) -> int | None:
        """The cached block with hash h, confirmed token by token (a collision never returns a wrong block)."""
        lid = self.by_hash.get(h)
        if lid is None:
            return None
        t, s = self.tiers[self.tier[lid]], self.slot[lid]
        if not np.array_equal(t.tokens[s, : len(tokens)], tokens):
            return None
        return lid

    # -- access -------------------------------------------------------------------------------
    def touch(self, lids: np.ndarray, now: float) -> None:
        """Record an access: heat = heat*decay^dt + 1 (the MemOS rule); the LRU-K history shifts."""
        lids = np.asarray(lids, dtype=np.int64)
        for t in self.tiers:
            sl = self.slot[lids[self.tier[lids] == t.tier]]
            if len(sl) == 0:
                continue
            dt = np.maximum(now - t.last[sl], 0.0)
            t.heat[sl] = t.heat[sl] * np.exp(np.log(self.config.decay) * dt) + 1.0
            t.hist[sl, 1:] = t.hist[sl, :-1]
            t.hist[sl, 0] = now
            t.last[sl] = now
            self.policy.on_access(t, sl, now)
        self.now = max(self.now, now)

    def current_heat(self, t: TierPool, slots: np.ndarray | slice, now: float) -> np.ndarray:
        return heat_now(t, slots, now, self.config.decay)

    # -- eviction and migration ---------------------------------------------------------------
    def evict(self, tier: Tier, n: int, now: float) -> int:
        """Free up to n slots on `tier` from cached (unowned) blocks, coldest first.

        Device victims move to the host tier when it has room (they stay cached there); host
        victims, or device victims the host cannot take, are dropped.
        """
        t = self.tiers[tier]
        cand = t.cached.view()
        if len(cand) == 0:
            return 0
        self.now = max(self.now, now)
        occupancy = t.used / t.capacity if t.capacity else 1.0
        victims = self.policy.victims(t, cand.copy(), min(n, len(cand)), now, self.config.decay)
        lids = t.lid[victims]
        if tier == Tier.DEVICE and self._host_room(len(lids), now):
            moved = self.move(lids, Tier.HOST, now, reason="evict")
            lids = lids[moved:]
        for lid in lids.tolist():
            s = self.slot[lid]
            self._emit("evict", lid=lid, tier=int(tier), age=now - t.born[s], gap=now - t.last[s], hash=int(t.hash[s]))
            self._release(lid, "evicted", policy=self.config.policy, tier=int(tier), occupancy=occupancy)
        return len(victims)

    def _host_room(self, n: int, now: float) -> bool:
        host = self.tiers[Tier.HOST]
        if len(host.free_slots) < n and len(host.cached):
            self.evict(Tier.HOST, max(n - len(host.free_slots), self.config.evict_batch), now)
        return bool(host.free_slots)

    def move(self, lids: np.ndarray, to: Tier, now: float, reason: str) -> int:
        """Copy blocks to tier `to` (all layers: K, V, scales) with their metadata; free the old slots.

        Returns how many moved (a prefix of lids); stops early if `to` runs out of slots.
        """
        lids = np.asarray(lids, dtype=np.int64)
        lids = lids[self.tier[lids] != to]
        if len(lids) == 0:
            return 0
        self.moves += 1
        dst = self.tiers[to]
        if len(dst.free_slots) < len(lids):
            self.evict(to, max(len(lids) - len(dst.free_slots), self.config.evict_batch), now)
        lids = lids[: len(dst.free_slots)]
        if len(lids) == 0:
            return 0
        src = self.tiers[1 - to]
        src_slots = self.slot[lids].copy()
        dst_slots = np.asarray([dst.free_slots.pop() for _ in range(len(lids))], dtype=np.int64)
        self._copy(src, src_slots, dst, dst_slots)
        src.copy_meta(dst, src_slots, dst_slots)
        self.policy.on_move(src, src_slots, dst, dst_slots)
        for lid, so, sn in zip(lids.tolist(), src_slots.tolist(), dst_slots.tolist()):
            if so in src.cached:
                src.cached.discard(so)
                dst.cached.add(sn)
            src.lid[so] = -1
            src.ref[so] = 0
            src.heat[so] = 0.0
            src.fill[so] = 0
            src.hash[so] = NO_HASH
            src.owner[so] = -1
            src.free_slots.append(so)
            self.tier[lid], self.slot[lid] = to, sn
        if to == Tier.HOST:
            dst.why[dst_slots] = WHY_OF_MOVE.get(reason, WHY_OTHER)
        kind = "promote" if to == Tier.DEVICE else "demote"
        self._emit(kind, n=len(lids), reason=reason, nbytes=len(lids) * self.block_bytes)
        return len(lids)

    def _copy(self, src: TierPool, src_slots: np.ndarray, dst: TierPool, dst_slots: np.ndarray) -> None:
        """Copy slots between tiers (or pools), every part; on CUDA on the side stream (see tiers.copy_slots). Inside
        a resize each copy is journaled, so that the resize can be undone (engine/kv/resize_undo.py)."""
        if self.journal is not None:
            self.journal.append((src, np.array(src_slots, dtype=np.int64), dst, np.array(dst_slots, dtype=np.int64)))
        if not self.copy_checked:
            from engine.kv.copy_check import first_copy

            first_copy(self, src, src_slots, dst, dst_slots)
            return
        self.copier(src, src_slots, dst, dst_slots, self.copy_stream, self.device)

    def copy_block(self, src_lid: int, dst_lid: int) -> None:
        """Copy-on-write: dst gets src's data and fill (any tiers)."""
        src, dst = self.tiers[self.tier[src_lid]], self.tiers[self.tier[dst_lid]]
        ss, ds = np.array([self.slot[src_lid]]), np.array([self.slot[dst_lid]])
        self._copy(src, ss, dst, ds)
        dst.fill[ds] = src.fill[ss]

    # -- block contents -----------------------------------------------------------------------
    def read_blocks(self, lids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K and V of blocks (any tier): [layers, n, kv_heads, block_size, head_dim] each."""
        g = self.geom
        shape = (g.layers, len(lids), g.kv_heads, g.block_size, g.head_dim)
        k = torch.zeros(shape, device=self.device)
        v = torch.zeros(shape, device=self.device)
        lids_np = np.asarray(lids, dtype=np.int64)
        for t in self.tiers:
            rows = np.flatnonzero(self.tier[lids_np] == t.tier)
            if len(rows) == 0:
                continue
            sl = self.slot[lids_np[rows]]
            r = torch.as_tensor(rows, device=self.device)
            on: dict[torch.device, torch.Tensor] = {}  # the slots on each layer's device (layers may differ)
            for layer in range(g.layers):
                dev = t.k["data"][layer].device
                if dev not in on:
                    on[dev] = torch.as_tensor(sl, device=dev)
                slots = on[dev]
                k[layer, r] = self.kcodec.decode(t.k, layer, slots).to(self.device)
                v[layer, r] = self.vcodec.decode(t.v, layer, slots).to(self.device)
        return k, v

    def write_blocks(self, lids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode fp32 K/V [layers, n, kv_heads, block_size, head_dim] into fresh blocks (any tier).

        Slots at or past each block's fill are zeroed so they cannot inflate a block's channel scales.
        """
        lids_np = np.asarray(lids, dtype=np.int64)
        for t in self.tiers:
            rows = np.flatnonzero(self.tier[lids_np] == t.tier)
            if len(rows) == 0:
                continue
            sl = self.slot[lids_np[rows]]
            r = torch.as_tensor(rows, device=k.device)
            fill = torch.as_tensor(t.fill[sl])
            mask = (torch.arange(self.geom.block_size)[None, :] < fill[:, None]).float()[:, None, :, None]
            on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # slots and mask on each layer's device
            for layer in range(self.geom.layers):
                dev = t.k["data"][layer].device  # layers may sit on different devices
                if dev not in on:
                    on[dev] = (torch.as_tensor(sl, device=dev), mask.to(dev))
                slots, m = on[dev]
                self.kcodec.encode(t.k, layer, slots, k[layer][r].to(dev) * m)
                self.vcodec.encode(t.v, layer, slots, v[layer][r].to(dev) * m)

    # -- accounting ---------------------------------------------------------------------------
    def metadata_bytes(self) -> int:
        return self.tier.nbytes + self.slot.nbytes + 8 * self.n_lids + sum(t.metadata_bytes() for t in self.tiers)

    def check(self, owners: dict[int, int]) -> None:
        """Invariants; `owners` maps lid -> number of block-table entries that hold it (engine/kv/invariants.py)."""
        from engine.kv.invariants import check_pool

        check_pool(self, owners)

    def _emit(self, kind: str, **fields) -> None:
        self.events.append(PoolEvent(kind, fields))

    def take_events(self) -> list[PoolEvent]:
        """The events queued since the last call, oldest first (and the queue emptied)."""
        out = list(self.events)
        self.events.clear()
        return out


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)
