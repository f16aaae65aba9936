"""The KV cache: the one door the engine, the scheduler and the model runner use to the KV layer.

The model's layers fall into KV-cache groups (engine/kv/groups.py) by what their attention keeps; each group has a
KVManager and pool of its own. A model whose every layer attends over every key is one group, the plain case: its
answers are the manager's own (counts as ints, its residency, its prefix match). Budget rules and config changes
are decided here too (`check_change` / `apply_change`): whether a change re-lays the cache, resizes the tiers or
only swaps the policy, and whether the budgets hold the live sequences.

With sliding-window layers, group 0 uses the sequence's own table (Sequence.blocks): it holds the full-attention
layers or, in a model whose every layer slides (Mistral, Phi-3), the first window size's. Each sliding-window group
holds its layers' K/V in its own pool, with its own budgets (a share of each tier: groups.split_config), eviction
and tiers, and a table per sequence (Sequence.groups; group 0's is the sequence's own, its start in Sequence.base)
that starts at the first block some query can still see: after each step `trim` drops the blocks that left every
window (a hashed one stays cached in its group for prefix reuse; the rest is freed). Questions the scheduler asks
in blocks are answered per group (`Need`: one count per group, a fit only when every group fits); orders go to
every group, over the group's view of the sequence (SeqView).

Prefix reuse follows vLLM's hybrid manager: a cached prefix of L blocks is taken only when the full group holds all
L and every window group holds the blocks its layers still read from there (the last window before token L x bs);
without a full group, the window groups alone decide.
What changes the sequence itself (its cached count, its canonical prefix, dropping its K/V) is done here once for
all groups.
"""

from __future__ import annotations

from collections import Counter

from typing import Callable, Iterable

import numpy as np
import torch

from engine.config import CacheConfig, ConfigError
from engine.kv.shape import KVShape
from engine.kv.block_pool import BlockPool, CacheFull, PoolEvent, Tier, blocks_for
from engine.kv.tiers import chain_hash, tier_sizes
from engine.kv.groups import KVGroupSpec, SeqView, split_config
from engine.kv.manager import KVManager
from engine.kv.misses import group_summary
from engine.kv.residency import EventSink, KVCounters, Residency
from engine.sequence import GroupTable, Sequence


TAG = 40  # written(seq) tags each lid with its group: lid + (group << TAG)
NO_BLOCK = -1  # a Match's entry where no group holds every block (a model without full-attention layers)


class Need(tuple):
    """Blocks per group. `a <= b` when every group's count fits; `a > b` when some group's does not; an int is
    every group's count."""

    def _pair(self, other) -> Iterable[tuple[int, int]]:
        return zip(self, other if isinstance(other, tuple) else (other,) * len(self))

    def __add__(self, other) -> "Need":
        return Need(a + b for a, b in self._pair(other))

    __radd__ = __add__

    def __sub__(self, other) -> "Need":
        return Need(a - b for a, b in self._pair(other))

    def __le__(self, other) -> bool:
        return all(a <= b for a, b in self._pair(other))

    def __ge__(self, other) -> bool:
        return all(a >= b for a, b in self._pair(other))

    def __gt__(self, other) -> bool:
        return not self.__le__(other)

    def __lt__(self, other) -> bool:
        return not self.__ge__(other)

    def __str__(self) -> str:
        return "[" + " | ".join(str(int(a)) for a in self) + "]"  # one per KV-cache group, full attention first


class Match(list):
    """A cached prefix over every group: one entry per prefix block, the full group's lids (a list, as
    KVManager.find_prefix returns them; NO_BLOCK each where no group is full), and, per window group, the blocks its
    layers read (`window[g]`: lids of blocks first[g]..len(self)-1)."""

    def __init__(self, lids: list[int], first: dict[int, int], window: dict[int, list[int]]):
        super().__init__(lids)
        self.first = first
        self.window = window


class GroupCounters:
    """A group's residency counts: its own totals (read by snapshots per group), each increment also added to the
    engine's counters (which count every group)."""

    def __init__(self, shared: KVCounters):
        object.__setattr__(self, "_shared", shared)
        object.__setattr__(self, "_own", {})

    def __getattr__(self, name: str):
        if not hasattr(self._shared, name):
            raise AttributeError(name)
        return self._own.get(name, 0)

    def __setattr__(self, name: str, value) -> None:
        delta = value - self._own.get(name, 0)
        self._own[name] = value
        setattr(self._shared, name, getattr(self._shared, name) + delta)

    def reads(self) -> tuple[int, int, int]:
        """Keys attention read in this group, those not from the device tier, those read where they are."""
        return self.read_tokens, self.read_tokens_missed, self.read_tokens_streamed


class GroupResidency(Residency):
    """A group's residency whose drop of a sequence's K/V drops it in every group (a sequence recomputes as a whole)."""

    def __init__(self, pool: BlockPool, counters: KVCounters, events: EventSink, drop_all: Callable[[Sequence], None]):
        super().__init__(pool, counters, events)
        self.drop_all = drop_all

    def drop_kv(self, seq) -> None:
        self.drop_all(seq.seq if isinstance(seq, SeqView) else seq)


class KVCache:
    """The KV layer's interface: one KVManager per KV-cache group (see the module docstring)."""

    def __init__(self, spec: KVShape, device: torch.device, config: CacheConfig, events: EventSink,
                 counters: KVCounters, groups: tuple[KVGroupSpec, ...], context: int, chunk: int):
        assert groups and all(g.window for g in groups[1:])
        self.spec, self.device, self.events, self.counters = spec, device, events, counters
        self.groups = groups
        self.full = groups[0].window is None  # group 0 holds every key (else it is a window group too)
        self.grouped = any(g.window for g in groups)  # some group drops what left its window
        self.context, self.chunk = context, chunk
        self._config = config
        self.mgrs = [KVManager(spec, device, c, events, counters, layers=g.layers)
                     for g, c in zip(groups, self.configs(config))]
        self._windows = [(g, groups[g], self.mgrs[g]) for g in range(0 if not self.full else 1, len(groups))]
        if self.grouped:
            for m in self.mgrs:
                m.residency = GroupResidency(m.pool, GroupCounters(counters), events, self.drop_all)
            self.residency: "Residency | GroupedResidencies" = GroupedResidencies(self)
        else:  # one pool for every layer: its residency counts into the engine's counters itself
            self.residency = self.mgrs[0].residency
        # Per group, the prompt tokens whose miss its missing block caused, by reason (engine/kv/misses.py); its key
        # reads' reasons are in its GroupCounters.
        self.prompt_why: list[Counter] = [Counter() for _ in groups]

    def _need(self, counts) -> "Need | int":
        """Per-group block counts as the scheduler reads them: a Need with groups, the one count without."""
        counts = list(counts)
        return Need(counts) if self.grouped else counts[0]

    @property
    def titles(self) -> list[str]:
        """Each group's title where there are groups to tell apart (cache health's per-group rows), else none."""
        return [g.title for g in self.groups] if self.grouped else []

    # -- the groups ---------------------------------------------------------------------------
    @property
    def config(self) -> CacheConfig:
        """The config the user set (each group's pool has its share of the budgets)."""
        return self._config

    @property
    def pool(self) -> BlockPool:
        """The full-attention group's pool."""
        return self.mgrs[0].pool

    @property
    def pools(self) -> list[BlockPool]:
        return [m.pool for m in self.mgrs]

    @property
    def trace(self):
        return self.mgrs[0].trace

    @trace.setter
    def trace(self, recorder) -> None:
        """Every group records into `recorder`, its rows tagged with the group (access_trace.TraceRecorder.for_group)."""
        for g, m in enumerate(self.mgrs):
            m.trace = recorder if recorder is None or g == 0 else recorder.for_group(g)

    def table(self, seq: Sequence, g: int) -> GroupTable | Sequence:
        """Window group g's table of the sequence (group 0's is the sequence itself: its blocks, base, dropped)."""
        if g == 0:
            return seq
        while len(seq.groups) < len(self.groups) - 1:
            seq.groups.append(GroupTable())
        return seq.groups[g - 1]

    def view(self, seq: Sequence, g: int):
        """The sequence as group g's pool sees it (a full group 0: the sequence itself)."""
        return seq if g == 0 and self.full else SeqView(seq, self.table(seq, g), self._config.block_size)

    def views(self, seqs: Iterable[Sequence], g: int) -> list:
        return [self.view(s, g) for s in seqs]

    def windows(self):
        """(g, group, manager) of each sliding-window group."""
        return self._windows

    # -- pools --------------------------------------------------------------------------------

    def bytes_per_block(self, config: CacheConfig) -> int:
        return sum(m.bytes_per_block(config) for m in self.mgrs)

    def configs(self, config: CacheConfig) -> list[CacheConfig]:
        """Each group's share of `config`'s budgets (groups.split_config)."""
        return split_config(config, self.groups, self.context, self.chunk, self.spec.num_kv_heads, self.spec.head_dim)

    def take_events(self) -> list[PoolEvent]:
        out = []
        for g, m in enumerate(self.mgrs):
            for e in m.take_events():
                out.append(PoolEvent(e.kind, {**e.fields, "group": g}) if g else e)
        return out

    def resize(self, config: CacheConfig, now: float) -> None:
        """Each group to its share of the new budgets; should one refuse, those already resized go back."""
        done: list[tuple[KVManager, CacheConfig]] = []
        try:
            for m, c in zip(self.mgrs, self.configs(config)):
                old = m.config
                m.resize(c, now)
                done.append((m, old))
        except Exception:
            for m, old in reversed(done):
                m.resize(old, now)
            raise
        self._config = config

    def set_policy(self, config: CacheConfig) -> None:
        for m, c in zip(self.mgrs, self.configs(config)):
            m.set_policy(c)
        self._config = config

    def relayout(self, seqs: list[Sequence], new: CacheConfig, now: float) -> dict:
        """Every group re-laid into `new`'s geometry (engine/kv/relayout.py), one after the other."""
        from engine.kv.relayout import relayout

        report: dict = {}
        configs = self.configs(new)
        bs, nbs = self._config.block_size, new.block_size
        for g, (m, c) in enumerate(zip(self.mgrs, configs)):
            whole = self.groups[g].window is None
            views = self.views(seqs, g) if whole or nbs == bs else [Rebased(s, self.table(s, g), bs, nbs) for s in seqs]
            held = relayout(m, views, c, now)
            if not whole and nbs != bs:
                for v in views:
                    v.commit()
            for k, v in held.items():
                report[k] = report.get(k, 0) + v if isinstance(v, (int, float)) else v
        self._config = new
        return report

    # -- config changes -------------------------------------------------------------------------
    def check_change(self, new: CacheConfig, live: list[Sequence]) -> None:
        """ConfigError, naming why, when `new` cannot hold the live sequences (nothing changed): this torch build
        cannot store its format, its budgets give fewer blocks than one live sequence needs at its end (prompt and
        tokens still to come, to the context limit), or than the live sequences hold now."""
        KVManager.require_supported(new)
        per = self.bytes_per_block(new)
        sizes = tier_sizes(new, self.spec.num_layers, per)
        dev, host = sizes.dev_cap, sizes.host_cap
        need = max((blocks_for(min(len(s.tokens) + s.sampling.max_new_tokens - len(s.output), self.context),
                               new.block_size) for s in live), default=0)
        if dev + host < need:
            raise ConfigError(
                f"budgets give {dev} + {host} blocks of {per} bytes (device + host); a live sequence needs {need}: "
                "raise a budget or finish that sequence first; nothing was changed")
        held = sum(blocks_for(s.num_cached, new.block_size) for s in live)
        if dev + host < held:
            raise ConfigError(f"budgets give {dev + host} blocks but live sequences hold {held}; nothing was changed")

    def apply_change(self, new: CacheConfig, live: list[Sequence], now: float) -> dict:
        """Check `new` (check_change), then apply it: a new block size, format or placement re-lays the cache
        (engine/kv/relayout.py: what it held, for the config event), new budgets alone resize the tiers in place
        (blocks and the prefix cache stay), anything else only swaps the policy's knobs. ConfigError with the cache
        unchanged when it cannot be done."""
        self.check_change(new, live)
        old = self._config
        layout = (new.block_size, new.kv_dtype, new.device_layers) != (old.block_size, old.kv_dtype, old.device_layers)
        budgets = (new.device_budget_mb, new.host_budget_mb) != (old.device_budget_mb, old.host_budget_mb)
        if layout:
            try:
                return self.relayout(live, new, now)
            except CacheFull as e:  # the old pool is kept: nothing was touched before the switch
                raise ConfigError(f"cannot re-lay the live sequences: {e}; nothing was changed") from None
            except ConfigError:
                raise
            except Exception as e:  # the plan only builds the new pool; the copy phase undoes itself (relayout.py)
                raise ConfigError(f"re-laying the cache failed ({_why(e)}); nothing was changed") from e
        if budgets:
            try:
                self.resize(new, now)
            except CacheFull as e:
                raise ConfigError(f"cannot resize the tiers: {e}; nothing was changed") from None
            except ConfigError:
                raise
            except Exception as e:  # undone by engine/kv/resize_undo.py before it got here
                raise ConfigError(f"resizing the tiers failed ({_why(e)}); the change was undone, nothing was changed") from e
            return {}
        self.set_policy(new)
        return {}

    # -- queries ------------------------------------------------------------------------------
    def capacity(self, tier: Tier) -> "Need | int":
        return self._need(m.capacity(tier) for m in self.mgrs)

    def blocks_at_peak(self, tokens: int) -> "Need | int":
        """Blocks one sequence of `tokens` tokens holds at most in each group."""
        bs = self._config.block_size
        return self._need(g.live_blocks(tokens, self.chunk, bs) for g in self.groups)

    def describe(self) -> str:
        if not self.grouped:
            return self.mgrs[0].describe()
        return "; ".join(f"{g.title}: {m.describe()}" for g, m in zip(self.groups, self.mgrs))

    def can_allocate(self, need) -> bool:
        counts = need if isinstance(need, tuple) else (need,) * len(self.mgrs)
        return all(m.can_allocate(n) for m, n in zip(self.mgrs, counts))

    def free_blocks(self) -> "Need | int":
        return self._need(m.free_blocks() for m in self.mgrs)

    # -- prefix cache -------------------------------------------------------------------------
    def find_prefix(self, seq: Sequence, limit: int | None = None) -> tuple[list[int], list[int]]:
        """The longest cached prefix the full group holds whose last window every window group holds too (a Match
        with window groups, else the full group's lids)."""
        if not self.grouped:
            return self.mgrs[0].find_prefix(seq, limit)
        bs = self._config.block_size
        if self.full:
            lids, hashes = self.mgrs[0].find_prefix(seq, limit)
        else:  # the chain over every reusable block: the window groups hold only the ends of prefixes
            hashes, parent = [], 0
            for b in range(self.mgrs[0].reusable_blocks(seq, limit)):
                parent = chain_hash(parent, np.asarray(seq.tokens[b * bs:(b + 1) * bs], dtype=np.int32))
                hashes.append(parent)
            lids = [NO_BLOCK] * len(hashes)
        for n in range(len(lids), 0, -1):
            first, window = {}, {}
            for g, grp, m in self.windows():
                b0 = max(0, n * bs - grp.window + 1) // bs  # the first block a query at token n*bs still sees
                got = []
                for b in range(b0, n):
                    lid = m.pool.lookup(hashes[b], np.asarray(seq.tokens[b * bs:(b + 1) * bs], dtype=np.int32))
                    if lid is None:
                        break
                    got.append(lid)
                if len(got) < n - b0:
                    break
                first[g], window[g] = b0, got
            else:
                return Match(lids[:n], first, window), hashes[:n]
        return Match([], {}, {}), []

    def fits_admission(self, seq: Sequence, match: list[int], first: int) -> bool:
        if self.full and not self.mgrs[0].fits_admission(seq, list(match), first):
            return False
        for g, _, m in self.windows():
            part = match.window.get(g, []) if isinstance(match, Match) and match else []
            if not m.fits_admission(self.view(seq, g), part, first):
                return False
        return True

    def still_needs(self, seq: Sequence, tokens: int, match: list[int] | None = None) -> "Need | int":
        """KVManager.still_needs per group; a window group's over the tokens from its table's start (or `match`'s),
        at most the blocks its window and a prompt chunk span (live_blocks)."""
        if not self.grouped:
            return self.mgrs[0].still_needs(seq, tokens, match)
        out = [self.mgrs[0].still_needs(seq, tokens, None if match is None else list(match))] if self.full else []
        bs = self._config.block_size
        for g, grp, m in self.windows():
            v = self.view(seq, g)
            part, start = None, v.base
            if match is not None:  # a sequence holding no blocks about to take `match`
                part = match.window.get(g, []) if isinstance(match, Match) else []
                start = match.first.get(g, 0) if isinstance(match, Match) else 0
            live = grp.live_blocks(max(tokens - start * bs, 0), self.chunk, bs)
            out.append(m.still_needs(v, live * bs, part))
        return Need(out)

    def take_prefix(self, seq: Sequence, lids: list[int], hashes: list[int], now: float) -> None:
        if self.full:
            self.mgrs[0].take_prefix(seq, list(lids), hashes, now)
        for g, _, m in self.windows():
            t = self.table(seq, g)
            first = lids.first.get(g, 0) if isinstance(lids, Match) else 0
            part = lids.window.get(g, []) if isinstance(lids, Match) else []
            for lid in part:
                m.pool.incref(lid)
            t.blocks, t.hashes = list(part), list(hashes[first:first + len(part)])
            t.base, t.base_hash = first, (hashes[first - 1] if first else 0)
            t.dropped = max(0, len(lids) * self._config.block_size - self.groups[g].window + 1) if part else 0
            t.table_version += 1
        if not self.full:
            self.mgrs[0].count_reuse(seq, len(lids) * self._config.block_size, list(seq.blocks), now)

    def explain_misses(self, seq: Sequence) -> None:
        """KVManager.explain_misses over every group: a block the full group holds missed for the first block of its
        last window some window group lacks (that block's reason, in that group's ledger)."""
        m0 = self.mgrs[0]
        if not self.grouped:
            m0.explain_misses(seq)
            return
        hashes = m0.chain(seq, m0.reusable_blocks(seq))
        bs = self._config.block_size

        def where(m: KVManager, b: int) -> str:
            p = m.pool
            return p.ledger.classify(hashes[b], hashes[b - 1] if b else 0, p.by_hash.__contains__)

        def first_gap(b: int) -> tuple[str, KVManager, int]:
            """The reason of the first block a prefix ending with block b lacks, its group's manager and index."""
            if self.full and (r := where(m0, b)) != "cached":
                return r, m0, b
            for _, grp, m in self.windows():
                for x in range(max(0, (b + 1) * bs - grp.window + 1) // bs, b + 1):
                    if (r := where(m, x)) != "cached":
                        return r, m, x
            return "cold", m0, b  # cached everywhere, not served: a collision's tokens differ

        def detail(b: int) -> dict:
            _, m, x = first_gap(b)
            return {**m.pool.ledger.detail(hashes[x], m.pool.now), **({"group": self.mgrs.index(m)} if m is not m0
                                                                      else {})}

        m0.count_misses(seq, len(hashes), lambda b: first_gap(b)[0], lambda b: hashes[b] in m0.pool.by_hash,
                        detail, lambda b: self.mgrs.index(first_gap(b)[1]), split := {})
        for g, why in split.items():
            self.prompt_why[g].update(why)

    def chain(self, seq: Sequence, n: int) -> list[int]:
        """The chain hashes of the sequence's first n blocks (the full group's, or group 0's)."""
        return self.mgrs[0].chain(seq, n)

    def hash_full_blocks(self, seq: Sequence, old: int) -> None:
        if self.full:
            self.mgrs[0].hash_full_blocks(seq, old)
        for g, _, m in self.windows():
            v = self.view(seq, g)
            m.hash_full_blocks(v, max(old - v.off, 0))

    def reset_prefix_cache(self) -> int:
        return sum(m.reset_prefix_cache() for m in self.mgrs)

    # -- a sequence's blocks ------------------------------------------------------------------
    def release(self, seq: Sequence) -> None:
        if self.full:
            self.mgrs[0].release(seq)
        for g, _, m in self.windows():
            m.release(self.view(seq, g))
            t = self.table(seq, g)
            t.base = t.dropped = t.base_hash = 0

    def share(self, dst: Sequence, src: Sequence) -> None:
        if self.full:
            self.mgrs[0].share(dst, src)
        for g, _, m in self.windows():
            m.share(self.view(dst, g), self.view(src, g))
            ts, td = self.table(src, g), self.table(dst, g)
            td.base, td.dropped, td.base_hash = ts.base, ts.dropped, ts.base_hash

    def drop_all(self, seq: Sequence) -> None:
        """Drop the sequence's K/V in every group (it recomputes when it runs again)."""
        if self.full:
            Residency.drop_kv(self.mgrs[0].residency, seq)
        for g, _, m in self.windows():
            t = self.table(seq, g)
            for lid in t.blocks:
                m.pool.decref(lid)
            t.blocks, t.hashes, t.base, t.dropped, t.base_hash = [], [], 0, 0, 0
            t.table_version += 1
        seq.num_cached = seq.canonical = 0

    def commit_step(self, *writes) -> None:
        """Each group's written blocks and their fills (one (lids, fills) per group, ModelRunner.prepare's)."""
        for m, (written, fills) in zip(self.mgrs, writes):
            m.commit_step(written, fills)

    def touch_seqs(self, seqs: list[Sequence], now: float) -> None:
        for g, m in enumerate(self.mgrs):
            m.touch_seqs(self.views(seqs, g), now)

    def trim(self, seqs: Iterable[Sequence], now: float) -> None:
        """Each window group drops the keys that left the window of the sequence's next query (position at or before
        its position minus the window: positions only grow from there), and lets go of its blocks that hold only
        dropped keys (a hashed one stays cached in its group for prefix reuse; the rest is freed)."""
        if not self._windows:
            return
        bs = self._config.block_size
        for seq in seqs:
            n = seq.num_cached
            if n == 0 or seq.done:
                continue
            nxt = seq.pos[n] if n < len(seq.pos) else seq.pos[-1] + 1
            for g, grp, m in self.windows():
                t = self.table(seq, g)
                edge = nxt - grp.window  # keys at or before this position are out of every later window
                d = t.dropped
                if seq.repositioned:
                    while d < n - 1 and seq.pos[d] <= edge:
                        d += 1
                else:
                    d = max(d, min(edge + 1, n - 1))
                t.dropped = d
                if (t.base + 1) * bs > d:
                    continue
                while len(t.blocks) > 1 and (t.base + 1) * bs <= d:
                    m.pool.decref(t.blocks.pop(0))
                    t.base_hash = t.hashes.pop(0)
                    t.base += 1
                t.table_version += 1

    # -- re-laying a tail (seq_rm, seq_add, seq_div, context shift) --------------------------
    def room_to_relay(self, seq: Sequence, b0: int, need: int) -> bool:
        if self.full and not self.mgrs[0].room_to_relay(seq, b0, need):
            return False
        bs = self._config.block_size
        for g, grp, m in self.windows():
            v = self.view(seq, g)
            lb0 = max(b0 - v.base, 0)
            wneed = min(need, grp.live_blocks(max(seq.num_cached - v.off, 0), self.chunk, bs) + 1)
            if not m.room_to_relay(v, lb0, wneed):
                return False
        return True

    def relay(self, seq: Sequence, keep: list[int], old_pos: list[int], new_pos: list[int], first: int,
              shift, now: float) -> None:
        """Every group's blocks from the first changed one on re-laid for the change (its token-level part is already
        on `seq`; num_cached is not yet). A window group keeps dropped keys dropped: the kept tokens it had dropped
        stay before (or hidden at the start of) its table, whatever their new positions; a re-laid first block
        holds zeros for them, never read."""
        n_old = seq.num_cached
        bs = self._config.block_size
        cached_keep = [i for i in keep if i < n_old]
        for g, grp, m in self.windows():
            t = self.table(seq, g)
            d, start = t.dropped, t.base * bs
            new_d = sum(1 for i in cached_keep if i < d)
            base = new_d // bs
            b0 = max(first // bs, base) if base == t.base else base  # the first new block whose content changes
            # Old held K/V, read before any block is let go: [L, n_old - start, Hkv, D].
            k_old = v_old = None
            if n_old > start and len(cached_keep) > b0 * bs:
                k_old, v_old = m.tokens_kv(_Counted(SeqView(seq, t, bs), n_old - start))
            cut = b0 - t.base if base == t.base else 0
            for lid in t.blocks[cut:]:
                m.pool.decref(lid)
            t.blocks, t.hashes = t.blocks[:cut], t.hashes[:cut]
            if first < d:  # the tokens before the table changed: its chain cannot go on
                t.base_hash = 0
            t.base, t.dropped = base, new_d
            t.table_version += 1
            if k_old is not None:
                src = cached_keep[b0 * bs:]
                L, _, H, D = k_old.shape
                k_tail = torch.zeros((L, len(src), H, D), dtype=k_old.dtype, device=k_old.device)
                v_tail = torch.zeros_like(k_tail)
                rows = [j for j, i in enumerate(src) if i >= max(d, start)]
                if rows:
                    r = torch.as_tensor(rows, device=k_old.device)
                    o = torch.as_tensor([src[j] - start for j in rows], device=k_old.device)
                    k_tail[:, r], v_tail[:, r] = k_old[:, o], v_old[:, o]
                    delta = torch.as_tensor([new_pos[b0 * bs + j] - old_pos[src[j]] for j in rows],
                                            device=k_old.device)
                    if bool((delta != 0).any()):
                        for i, layer in enumerate(grp.layers):
                            k_tail[i, r] = shift(k_tail[i, r], delta, layer)
                m.relay_blocks(SeqView(seq, t, bs), b0 - base, k_tail, v_tail, now)
        if self.full:
            self.mgrs[0].relay(seq, keep, old_pos, new_pos, first, shift, now)  # sets num_cached, hashes group 0
        else:
            seq.num_cached = len(cached_keep)
        for g, _, m in self.windows():
            m.hash_full_blocks(self.view(seq, g), 0)

    def tokens_kv(self, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K/V of a sequence's cached tokens in every model layer: [L, n, Hkv, D] each; keys a window group
        dropped (or never held: the zeros before its first block's dropped ones) read NaN."""
        if not self.grouped:
            return self.mgrs[0].tokens_kv(seq)
        n = seq.num_cached
        k = torch.full((self.spec.num_layers, n, self.spec.num_kv_heads, self.spec.head_dim), float("nan"),
                       device=self.pool.device)
        v = torch.full_like(k, float("nan"))
        if self.full:
            k0, v0 = self.mgrs[0].tokens_kv(seq)
            idx0 = torch.as_tensor(self.groups[0].layers, device=k.device)
            k[idx0], v[idx0] = k0, v0
        bs = self._config.block_size
        for g, grp, m in self.windows():
            view = SeqView(seq, self.table(seq, g), bs)
            if view.num_cached <= 0:
                continue
            kg, vg = m.tokens_kv(view)
            idx = torch.as_tensor(grp.layers, device=k.device)
            k[idx, view.off:], v[idx, view.off:] = kg, vg
        return k, v

    # -- checks -------------------------------------------------------------------------------
    def check(self, seqs) -> None:
        seqs = list(seqs)
        if self.full:
            self.mgrs[0].check(seqs)
        bs = self._config.block_size
        for g, _, m in self.windows():
            views = [self.view(s, g) for s in seqs]
            m.check(views)
            for s, v in zip(seqs, views):
                if s.done:
                    continue
                want = blocks_for(s.num_cached, bs) - v.base
                assert len(v.blocks) == want, \
                    f"sequence {s.id}: group {g} holds {len(v.blocks)} blocks from block {v.base}, {s.num_cached} cached"

    def snapshot_groups(self) -> tuple:
        """(KVGroupSpec, pool, key reads) per group, for EngineState.groups; key reads are (read, missed, streamed,
        why) with why the group's reasons (engine/kv/misses.py group_summary); none for one pool of every layer."""
        if not self.grouped:
            return ()
        return tuple((g, m.pool, (*m.residency.counters.reads(), group_summary(why, m.residency.counters)))
                     for g, m, why in zip(self.groups, self.mgrs, self.prompt_why))

    def device_bytes(self) -> int:
        return sum(p.tiers[Tier.DEVICE].used * p.block_bytes for p in self.pools)

    def host_bytes(self) -> int:
        return sum(p.tiers[Tier.HOST].used * p.block_bytes for p in self.pools)


class _Counted:
    """A view whose cached count is `n` (tokens_kv reads a view's first num_cached tokens)."""

    def __init__(self, view: SeqView, n: int):
        self.blocks, self.num_cached = view.blocks, n


class Rebased:
    """A sequence as a window group holds it, cut anew for block size `new_bs` (a block-size change re-lays it,
    engine/kv/relayout.py): the table starts at block `base` = dropped tokens // new_bs; its first `lead` tokens are
    ones the old table no longer held (read as zeros from the old null block; hidden, never visible). `commit()`
    puts the new start on the table once the re-lay has set the new blocks."""

    def __init__(self, seq: Sequence, table: GroupTable, bs: int, new_bs: int):
        self.seq, self.t = seq, table
        self.base = table.dropped // new_bs
        start, old_start = self.base * new_bs, table.base * bs
        self.lead = old_start - start  # < 0: the old table's first tokens are not re-laid
        self.id = seq.id
        self.blocks = table.blocks
        self.hashes = table.hashes
        self.table_version = table.table_version
        self.num_cached = seq.num_cached - start if seq.num_cached else 0
        self.tokens = seq.tokens[start:]
        # The chain over the blocks before the table, in the new size, from the tokens (while they are canonical).
        self.base_hash = 0
        if self.base and seq.canonical >= start:
            for b in range(self.base):
                self.base_hash = chain_hash(self.base_hash,
                                            np.asarray(seq.tokens[b * new_bs:(b + 1) * new_bs], dtype=np.int32))
        self.canonical = max(seq.canonical - start, 0) if self.lead <= 0 else 0

    def commit(self) -> None:
        t = self.t
        t.blocks, t.hashes, t.base, t.base_hash = self.blocks, self.hashes, self.base, self.base_hash
        t.table_version += 1


class GroupedResidencies:
    """Residency's interface over every group's (the scheduler's `residency`)."""

    def __init__(self, kv: KVCache):
        self.kv = kv

    @property
    def config(self) -> CacheConfig:
        return self.kv.config

    @property
    def trace(self):
        return self.kv.mgrs[0].residency.trace

    def _each(self):
        return [(g, m.residency) for g, m in enumerate(self.kv.mgrs)]

    def demote_idle(self, now: float) -> None:
        for _, r in self._each():
            r.demote_idle(now)

    def streams(self) -> bool:
        return self.kv.mgrs[0].residency.streams()

    def holds_device_blocks(self, seq: Sequence) -> bool:
        return any(r.holds_device_blocks(self.kv.view(seq, g)) for g, r in self._each())

    def last_read(self, seq: Sequence) -> float:
        return max(r.last_read(self.kv.view(seq, g)) for g, r in self._each())

    def written(self, seq: Sequence) -> np.ndarray:
        return np.concatenate([r.written(self.kv.view(seq, g)) + (g << TAG) for g, r in self._each()])

    def room_needed(self, seq: Sequence, n: int, minimal: bool = False) -> Need:
        return Need(r.room_needed(self.kv.view(seq, g), n, minimal) for g, r in self._each())

    def fits_anywhere(self, seq: Sequence, n: int) -> bool:
        return all(r.fits_anywhere(self.kv.view(seq, g), n) for g, r in self._each())

    def demote_unwritten(self, need: Need, seqs: list[Sequence], pinned: set[int], now: float) -> bool:
        ok = True
        for g, r in self._each():
            mine = {p - (g << TAG) for p in pinned if p >> TAG == g}
            ok = r.demote_unwritten(need[g], self.kv.views(seqs, g), mine, now) and ok
        return ok

    def reclaim(self, need: Need, now: float, idle: list[Sequence], keep: list[Sequence]) -> bool:
        ok = True
        for g, r in self._each():
            ok = r.reclaim(need[g], now, self.kv.views(idle, g), self.kv.views(keep, g)) and ok
        return ok

    def make_resident(self, seq: Sequence, n: int, now: float, minimal: bool = False) -> None:
        for g, r in self._each():
            r.make_resident(self.kv.view(seq, g), n, now, minimal)

    def swap_out(self, seq: Sequence, now: float) -> str:
        modes = [r.swap_out(self.kv.view(seq, g), now) for g, r in self._each()]
        if "recompute" in modes:
            self.kv.drop_all(seq)
            return "recompute"
        return "swap"

    def drop_kv(self, seq: Sequence) -> None:
        self.kv.drop_all(seq)


def _why(e: BaseException) -> str:
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__
