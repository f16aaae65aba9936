"""Residency: where a sequence's blocks are when a step runs (the KV manager's collaborator, engine/kv/manager.py,
that the scheduler asks for room and orders to make a sequence resident).

Idle demotion (the MemOS hybrid rule), the device slots a step needs, room from idle sequences or from blocks
scheduled sequences only read, promotion with prefetch (or none: host_reads=stream or compute), new blocks on the device
tier while it has room and on the host tier after, copy-on-write of a shared tail, swap-out and drop. Attention
reads counted per key: hits, misses (blocks on the host tier when the step began) and keys streamed.
"""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from engine.config import CacheConfig
from engine.kv.block_pool import NO_HASH, BlockPool, Tier, blocks_for
from engine.kv.misses import READ_REASON_OF_WHY, counter_name
from engine.sequence import Sequence

DEVICE, HOST = int(Tier.DEVICE), int(Tier.HOST)  # plain ints: enum attribute lookups are slow in hot loops


class EventSink(Protocol):
    """Where the KV layer reports what it did (engine/telemetry/snapshotter.py's Telemetry is one)."""

    def emit(self, kind: str, **fields) -> None: ...

    def record_prefix_hit(self, gaps: np.ndarray, ages: np.ndarray) -> None: ...


class KVCounters(Protocol):
    """The running totals the KV layer adds to (engine/telemetry/counters.py's Counters is one)."""

    block_reads: int
    block_misses: int
    read_tokens: int
    read_tokens_missed: int
    read_tokens_streamed: int
    promote_stall_s: float
    preemptions: int
    prompt_tokens: int
    prompt_reused: int
    lookup_tokens: int
    lookup_served: int


class Residency:
    """Placement decisions over one pool. `pool` is replaced by the KV manager when the cache is re-laid (use());
    `trace` is a TraceRecorder (engine/kv/access_trace.py) while one records, else None."""

    def __init__(self, pool: BlockPool, counters: KVCounters, events: EventSink):
        self.pool = pool
        self.counters = counters
        self.events = events
        self.trace = None

    @property
    def config(self) -> CacheConfig:
        return self.pool.config

    def holds_device_blocks(self, seq: Sequence) -> bool:
        return bool(seq.blocks) and bool((self.pool.tier[seq.table()] == DEVICE).any())

    def last_read(self, seq: Sequence) -> float:
        return float(self.pool.last_of(seq.table()).max()) if seq.blocks else float("-inf")

    def demote_idle(self, now: float) -> None:
        """MemOS hybrid rule: device blocks idle longer than demote_after_s move to the host tier."""
        p = self.pool
        dev = p.tiers[Tier.DEVICE]
        idle = dev.lid[(dev.lid >= 0) & (now - dev.last > self.config.demote_after_s)]
        if len(idle) and p.tiers[Tier.HOST].capacity:
            p.move(idle, Tier.HOST, now, reason="idle")

    def streams(self) -> bool:
        """Host blocks are read where they are, never promoted for reads: streamed per layer or attended on the host
        (host_reads stream or compute; the residency is the same, only the attention differs)."""
        return self.config.host_reads in ("stream", "compute")

    def written(self, seq: Sequence) -> np.ndarray:
        """The sequence's existing blocks its next tokens go into (its partial tail, if any)."""
        return seq.table()[seq.num_cached // self.config.block_size:]

    def room_needed(self, seq: Sequence, n: int, minimal: bool = False) -> int:
        """Device slots the sequence needs to compute n more tokens: its host blocks (only those it writes into
        when `minimal` or host_reads is stream/compute: the rest are read where they are), new blocks, and a copy of a
        shared partial tail it is about to write into."""
        p = self.pool
        bs = self.config.block_size
        new_blocks = blocks_for(seq.num_cached + n, bs) - len(seq.blocks)
        read = self.written(seq) if minimal or self.streams() else seq.table()
        on_host = int(np.count_nonzero(p.tier[read] == HOST))
        tail_cow = 0
        if seq.num_cached % bs and seq.blocks:
            tail_cow = 1 if p.ref_of(seq.blocks[seq.num_cached // bs]) > 1 else 0
        return on_host + max(new_blocks, 0) + tail_cow

    def fits_anywhere(self, seq: Sequence, n: int) -> bool:
        """The new blocks for n more tokens (and a copy of a shared tail) can be had on either tier: with a
        device tier full of blocks that are only read, writes go to the host tier."""
        p = self.pool
        bs = self.config.block_size
        need = max(blocks_for(seq.num_cached + n, bs) - len(seq.blocks), 0)
        if seq.num_cached % bs and seq.blocks and p.ref_of(seq.blocks[seq.num_cached // bs]) > 1:
            need += 1
        return p.reclaimable(Tier.DEVICE) + p.reclaimable(Tier.HOST) >= need

    def _place_new(self) -> Tier:
        """Where a new block goes: the device tier while it has room, else the host tier."""
        return Tier.DEVICE if self.pool.reclaimable(Tier.DEVICE) else Tier.HOST

    def demote_unwritten(self, need: int, seqs: list[Sequence], pinned: set[int], now: float) -> bool:
        """Room by moving device blocks that `seqs` hold but do not write this step (not in `pinned`) to the host
        tier, coldest first: attention then reads them there. For sequences larger than the device tier."""
        p = self.pool
        if p.can_allocate(Tier.DEVICE, need):
            return True
        tables = [s.table() for s in seqs if s.blocks]
        if not tables:
            return False
        cand = np.unique(np.concatenate(tables))
        cand = cand[p.tier[cand] == DEVICE]
        if pinned and len(cand):
            cand = cand[~np.isin(cand, np.fromiter(pinned, dtype=np.int64))]
        if len(cand):
            cand = cand[np.argsort(p.last_of(cand), kind="stable")]
            p.move(cand[:max(need - p.reclaimable(Tier.DEVICE), 0)], Tier.HOST, now, reason="room")
        return p.can_allocate(Tier.DEVICE, need)

    def reclaim(self, need: int, now: float, idle: list[Sequence], keep: list[Sequence]) -> bool:
        """Make `need` device slots obtainable from sequences that are not running: demote their blocks to
        the host tier (coldest first, sparing blocks shared with `keep`); where the host tier cannot take
        them, drop their K/V (they recompute when they run again; nothing they generated is lost)."""
        p = self.pool
        if p.can_allocate(Tier.DEVICE, need):
            return True
        tables = [s.table() for s in idle if s.blocks]
        if tables:
            cand = np.unique(np.concatenate(tables))
            cand = cand[p.tier[cand] == DEVICE]
            kept = [s.table() for s in keep]
            if kept and len(cand):
                cand = cand[~np.isin(cand, np.concatenate(kept))]
            if len(cand):
                cand = cand[np.argsort(p.last_of(cand), kind="stable")]
                short = need - p.reclaimable(Tier.DEVICE)
                p.move(cand[:max(short, 0)], Tier.HOST, now, reason="room")
        if p.can_allocate(Tier.DEVICE, need) or p.reclaimable(Tier.HOST):
            # Enough room, or moving ran out of idle blocks the host tier could take: dropping K/V would free
            # nothing more on the device tier (what it holds there is shared with `keep`).
            return p.can_allocate(Tier.DEVICE, need)
        for seq in sorted((s for s in idle if self.holds_device_blocks(s)), key=self.last_read):
            self.drop_kv(seq)
            seq.preemptions += 1
            self.events.emit("preempt", seq=seq.id, mode="recompute", reason="no host room")
            if p.can_allocate(Tier.DEVICE, need):
                return True
        return p.can_allocate(Tier.DEVICE, need)

    def make_resident(self, seq: Sequence, n: int, now: float, minimal: bool = False) -> None:
        """With room ensured: promote the sequence's host blocks (only those it writes into when `minimal` or
        host_reads is stream or compute), copy a shared tail, add blocks for n tokens.

        Promoting a host block brings the next prefetch_depth host blocks of the sequence along. Attention reads
        are counted per token: a key in a block that was on the host tier when the step began is a device-tier
        miss, whether it was promoted for the step or is read where it is (streamed, or attended on the host with
        host_reads=compute: `read_tokens_streamed` counts both).
        """
        p = self.pool
        bs = self.config.block_size
        table = seq.table()
        tiers = p.tier[table]
        host_rows = np.flatnonzero(tiers == HOST)
        whys = p._meta("why", table[host_rows]) if len(host_rows) else None  # why each went to the host tier
        minimal = minimal or self.streams()
        group = 1 if minimal else 1 + self.config.prefetch_depth
        promote = host_rows[host_rows >= seq.num_cached // bs] if minimal else host_rows
        if minimal:  # as the device tier has room; a written block left on the host tier is written there
            promote = promote[:p.reclaimable(Tier.DEVICE)]
        if self.trace is not None:
            hits = np.ones(len(table), dtype=bool)
            hits[host_rows] = False
            self.trace.add(now, seq.id, p.serial[table], tiers.copy(), hits, first=seq.base)  # a window's table starts at base
        if len(promote):
            t0 = time.perf_counter()
            for j in range(0, len(promote), group):
                p.move(table[promote[j:j + group]], Tier.DEVICE, now, reason="miss")
            self.counters.promote_stall_s += time.perf_counter() - t0
        self.counters.block_reads += len(table)
        self.counters.block_misses += len(host_rows)
        if seq.num_cached % bs and seq.blocks:
            self.ensure_writable(seq, seq.num_cached // bs, now)
        while len(seq.blocks) < blocks_for(seq.num_cached + n, bs):
            seq.blocks.append(p.allocate(self._place_new() if minimal else Tier.DEVICE, seq.id, now))
            seq.hashes.append(0)
            seq.table_version += 1
        # Keys attention reads this step, per block of the table: full blocks, then the tail up to the new tokens.
        read = seq.num_cached + n
        keys = np.full(len(seq.blocks), bs, dtype=np.int64)
        keys[-1] = read - (len(seq.blocks) - 1) * bs
        self.counters.read_tokens += read
        # A miss: a key not read from the device tier without a copy first, i.e. in a block that was on the host tier
        # when the step began (promoted since, or read there) or that is on the host tier now (written there).
        now_host = p.tier[seq.table()] == HOST
        missed = now_host.copy()
        missed[host_rows] = True
        self.counters.read_tokens_missed += int(keys[missed].sum())
        self.counters.read_tokens_streamed += int(keys[now_host].sum())
        if missed.any():
            self.count_read_reasons(seq, keys, now_host, host_rows, whys)

    def count_read_reasons(self, seq: Sequence, keys: np.ndarray, now_host: np.ndarray, host_rows: np.ndarray,
                           whys: np.ndarray | None) -> None:
        """Each missed key's reason (engine/kv/misses.py): read where it sits on the host tier with host_reads stream
        or compute, `streamed`; otherwise (promoted for the step, or left on the host tier for want of device room)
        by why its block went to the host tier."""
        out: dict[str, int] = {}
        rows, codes = host_rows[~now_host[host_rows]], (whys[~now_host[host_rows]] if whys is not None else None)
        if now_host.any():
            if self.streams():
                out["streamed"] = int(keys[now_host].sum())
            else:
                here = np.flatnonzero(now_host)
                rows = np.concatenate([rows, here])
                now_codes = self.pool._meta("why", seq.table()[here])
                codes = now_codes if codes is None else np.concatenate([codes, now_codes])
        if codes is not None and len(rows):
            for code in np.unique(codes).tolist():
                reason = READ_REASON_OF_WHY[code]
                out[reason] = out.get(reason, 0) + int(keys[rows[codes == code]].sum())
        mine = seq.why_missed
        for reason, n in out.items():
            if n:
                name = counter_name(reason)
                setattr(self.counters, name, getattr(self.counters, name) + n)
                mine[reason] = mine.get(reason, 0) + n

    def ensure_writable(self, seq: Sequence, bi: int, now: float) -> None:
        """Copy-on-write of block bi if shared; forget its hash if cached (its content is about to change)."""
        p = self.pool
        lid = seq.blocks[bi]
        if p.ref_of(lid) > 1:
            new = p.allocate(self._place_new(), seq.id, now)
            p.copy_block(lid, new)
            p.decref(lid)
            seq.blocks[bi] = new
            seq.table_version += 1
            seq.hashes[bi] = 0
            self.events.emit("cow", seq=seq.id, block=int(lid), new=int(new))
        elif p.hash_of(lid) != NO_HASH:
            p.clear_hash(lid)
            seq.hashes[bi] = 0

    def swap_out(self, seq: Sequence, now: float) -> str:
        """Move the device blocks only this sequence holds to the host tier ("swap"); if the host tier cannot
        take them all, drop the sequence's K/V instead ("recompute"). Shared blocks stay: a sequence
        scheduled in this step may need them resident."""
        p = self.pool
        table = seq.table()
        on_dev = table[p.tier[table] == DEVICE]
        own = on_dev[p._meta("ref", on_dev) == 1] if len(on_dev) else on_dev
        moved = p.move(own, Tier.HOST, now, reason="preempt") if len(own) else 0
        if moved < len(own):
            self.drop_kv(seq)
            return "recompute"
        return "swap"

    def drop_kv(self, seq: Sequence) -> None:
        for lid in seq.blocks:
            self.pool.decref(lid)
        seq.blocks, seq.hashes = [], []
        seq.table_version += 1
        seq.num_cached = 0
        seq.canonical = 0
