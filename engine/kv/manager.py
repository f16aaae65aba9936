"""The KV manager: the block pool behind a narrow door.

The scheduler asks it questions (does this prefix match, can this sequence be admitted, is there room
for n tokens) and gives it orders (take the prefix, make the sequence resident, swap it out, drop its
K/V); it never touches the pool's arrays. Pools (making, resizing, memory checks), prefix matching by chain
hash and the per-step hashing of full blocks live here; residency (promotion, demotion, room, copy-on-write) in
engine/kv/residency.py.
"""

from __future__ import annotations


import numpy as np
import torch

from engine.kv.block_pool import BlockPool, CacheFull, PoolEvent, Tier, blocks_for
from engine.kv.tiers import chain_hash, tier_sizes
from engine.config import CacheConfig, ConfigError, KVDtype
from engine.kv.shape import KVShape
from engine.kv.residency import DEVICE, HOST, EventSink, KVCounters, Residency
from engine.sequence import Sequence


__all__ = ["KVManager", "CacheFull", "DEVICE", "HOST"]


class KVManager:
    """The pool and what is done to it by sequence: pools, prefix matching, hashing, sharing, re-laying a tail,
    release; `residency` (engine/kv/residency.py) decides where blocks are when a step runs."""

    def __init__(self, spec: KVShape, device: torch.device, config: CacheConfig, events: EventSink,
                 counters: KVCounters, layers: tuple[int, ...] | None = None):
        """`layers`: the model layers this pool holds (a KV-cache group's, engine/kv/groups.py); None: all of them."""
        self.spec = spec
        self.layers = tuple(range(spec.num_layers)) if layers is None else tuple(layers)
        self.num_layers = len(self.layers)
        self.device = device
        self.events = events
        self.counters = counters
        self.pool = self.make_pool(config)
        self.residency = Residency(self.pool, counters, events)

    @property
    def trace(self):
        """The TraceRecorder while one records (engine/kv/access_trace.py), else None."""
        return self.residency.trace

    @trace.setter
    def trace(self, recorder) -> None:
        self.residency.trace = recorder

    # -- pools --------------------------------------------------------------------------------
    @staticmethod
    def require_supported(config: CacheConfig) -> None:
        if config.kv_dtype is KVDtype.FP8:
            from engine.kv.codecs import fp8_supported

            if not fp8_supported():
                raise ConfigError("kv_dtype fp8: this torch build cannot store float8_e4m3fn")

    def bytes_per_block(self, config: CacheConfig) -> int:
        return BlockPool.bytes_per_block(config, self.num_layers, self.spec.num_kv_heads, self.spec.head_dim)

    def make_pool(self, config: CacheConfig, storage: bool = True, replacing: BlockPool | None = None) -> BlockPool:
        """A new, empty pool of `config`'s geometry (ConfigError if this machine cannot hold it). storage=False:
        metadata only (a re-lay allocates its layers one at a time while freeing those of `replacing`)."""
        self.require_supported(config)
        self.check_memory(config, replacing)
        first = self.pool.next_serial if getattr(self, "pool", None) is not None else 0
        try:
            pool = BlockPool((self.num_layers, self.spec.num_kv_heads, self.spec.head_dim), config, self.device,
                             first_serial=first, storage=storage)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            raise ConfigError(f"cannot allocate the KV tiers ({config.summary()}): {str(e).splitlines()[0]}") from None
        return pool

    def check_memory(self, config: CacheConfig, replacing: BlockPool | None = None) -> None:
        """Refuse budgets this machine cannot hold, before allocating them. CPU tiers without CUDA are
        committed as blocks are written (lazy zero pages), so they are held against the machine's memory;
        a pinned host tier (with CUDA) is committed at once, so it is held against what is available now.
        `replacing`: a pool the new one replaces a layer at a time (a re-lay): its tiers count as available,
        less one layer of each (held beside them while that layer is copied)."""
        import psutil

        sizes = tier_sizes(config, self.num_layers, self.bytes_per_block(config))
        dev, host = sizes.device_bytes, sizes.host_bytes
        vm = psutil.virtual_memory()
        gib = 2**30
        if self.device.type == "cpu":
            if dev + host > vm.total:
                raise ConfigError(
                    f"device_budget_mb {config.device_budget_mb:g} + host_budget_mb {config.host_budget_mb:g} need "
                    f"{(dev + host) / gib:.2f} GiB of CPU memory but this machine has {vm.total / gib:.2f} GiB; "
                    "lower the budgets")
            return
        held_dev = held_host = 0
        if replacing is not None:
            keep = 1.0 - 1.0 / max(1, replacing.geom.layers)  # one layer of the old tiers is still held
            held_dev, held_host = (int(sum(t.nbytes().values()) * keep) for t in replacing.tiers)
        if host > vm.available + held_host:
            raise ConfigError(f"host_budget_mb {config.host_budget_mb:g} needs {host / gib:.2f} GiB of pinned CPU memory "
                              f"but {vm.available / gib:.2f} GiB is available; lower it")
        free, _ = torch.cuda.mem_get_info(self.device)
        free += held_dev
        if dev > free:
            raise ConfigError(f"device_budget_mb {config.device_budget_mb:g} needs {dev / gib:.2f} GiB of GPU memory "
                              f"but {free / gib:.2f} GiB is free; lower it")

    @property
    def config(self) -> CacheConfig:
        """The live config: the pool's own (one copy; a re-lay or a policy change replaces it there)."""
        return self.pool.config

    def use(self, pool: BlockPool) -> None:
        """Switch to a re-laid pool (see relayout.py), built for the new config; the old pool's undrained events
        go first in the new one's queue."""
        old = self.pool
        pool.events.extendleft(reversed(old.take_events()))
        pool.ledger, pool.now = old.ledger, max(pool.now, old.now)  # the hashes' histories go on
        for h in old.by_hash.keys() - pool.by_hash.keys():  # cached blocks the new pool had no room for
            pool.ledger.gone(h, pool.now, "reconfigured")
        self.pool = self.residency.pool = pool

    def take_events(self) -> list[PoolEvent]:
        """The pool's events since the last call (evictions, promotions, demotions), oldest first."""
        return self.pool.take_events()

    def resize(self, config: CacheConfig, now: float) -> None:
        """A budget-only change, in place (engine/kv/resize.py): CacheFull with nothing changed if the blocks
        sequences own cannot fit, ConfigError if this machine cannot hold the new budgets."""
        from engine.kv.resize import resize

        self.check_memory(config)
        with self.pool.ledger.cause("reconfigured"):  # what the new budgets cannot hold was dropped by the change
            resize(self.pool, config, now)

    def set_policy(self, config: CacheConfig) -> None:
        """A change that keeps the geometry and the budgets: the pool keeps its blocks; the policy keeps its state
        unless the change names another one (which starts from the blocks as they are)."""
        from engine.kv.eviction import make_policy

        policy = self.pool.policy if config.policy == self.pool.config.policy else make_policy(config.policy, config.decay)
        self.pool.config, self.pool.policy = config, policy

    # -- queries ------------------------------------------------------------------------------
    def capacity(self, tier: Tier) -> int:
        return self.pool.tiers[tier].capacity

    def describe(self) -> str:
        dev, host = self.pool.tiers
        return f"device tier {dev.capacity} blocks, {dev.used} in use; host tier {host.capacity} blocks"

    def can_allocate(self, need: int) -> bool:
        return self.pool.can_allocate(Tier.DEVICE, need)

    def blocks_at_peak(self, tokens: int) -> int:
        """Blocks one sequence of `tokens` tokens holds at most."""
        return blocks_for(tokens, self.config.block_size)

    def snapshot_groups(self) -> tuple:
        """One pool for every layer: no KV-cache groups to show apart."""
        return ()

    def device_bytes(self) -> int:
        return self.pool.tiers[Tier.DEVICE].used * self.pool.block_bytes

    def host_bytes(self) -> int:
        return self.pool.tiers[Tier.HOST].used * self.pool.block_bytes

    def relayout(self, seqs: list[Sequence], new: CacheConfig, now: float) -> dict:
        """Re-lay every live sequence and the prefix cache into `new`'s geometry (engine/kv/relayout.py)."""
        from engine.kv.relayout import relayout

        return relayout(self, seqs, new, now)

    # -- prefix cache -------------------------------------------------------------------------
    def find_prefix(self, seq: Sequence, limit: int | None = None) -> tuple[list[int], list[int]]:
        """Cached blocks (and their hashes) for the longest cached prefix of the prompt, at most `limit` blocks;
        takes no reference.

        The last token is always computed. Cached blocks hold keys at positions 0..n-1, so the match stops
        where the sequence's positions stop being its indices (after a shift, seq_add or seq_div).
        """
        bs = self.config.block_size
        parent = 0
        lids: list[int] = []
        hashes: list[int] = []
        for b in range(self.reusable_blocks(seq, limit)):
            toks = np.asarray(seq.tokens[b * bs:(b + 1) * bs], dtype=np.int32)
            h = chain_hash(parent, toks)
            lid = self.pool.lookup(h, toks)
            if lid is None:
                break
            lids.append(lid)
            hashes.append(h)
            parent = h
        return lids, hashes

    def reusable_blocks(self, seq: Sequence, limit: int | None = None) -> int:
        """How many leading blocks of the sequence a cached prefix may give (at most `limit`): full blocks before its
        last token, whose positions are still their indices."""
        bs = self.config.block_size
        reusable = (len(seq.tokens) - 1) // bs
        if seq.repositioned:
            canon = next((i for i, q in enumerate(seq.pos) if q != i), len(seq.pos))
            reusable = min(reusable, canon // bs)
        return reusable if limit is None else min(reusable, limit)

    def fits_admission(self, seq: Sequence, match: list[int], first: int) -> bool:
        """Room on the device tier for the blocks the sequence's first chunk of `first` tokens writes.

        `match` is a prefix found for a sequence holding no blocks. Blocks it only reads may stay on the host tier
        (promote mode promotes them at schedule time as room allows); matched blocks that sit unowned on the
        device stop being reclaimable once taken.
        """
        p = self.pool
        bs = self.config.block_size
        lids = np.asarray(match or seq.blocks, dtype=np.int64)
        cached = len(match) * bs if match else seq.num_cached
        need = blocks_for(cached + first, bs) - len(lids)
        written = lids[cached // bs:]
        on_host = int(np.count_nonzero(p.tier[written] == HOST))
        dev = lids[p.tier[lids] == DEVICE]
        pinned = int(np.count_nonzero(p._meta("ref", dev) == 0)) if match else 0
        return p.reclaimable(Tier.DEVICE) - pinned >= need + on_host

    def free_blocks(self) -> int:
        """Blocks both tiers can still give without touching one a sequence owns: free and cached ones."""
        return self.pool.reclaimable(Tier.DEVICE) + self.pool.reclaimable(Tier.HOST)

    def still_needs(self, seq: Sequence, tokens: int, match: list[int] | None = None) -> int:
        """Blocks the sequence still takes out of `free_blocks()` to hold K/V for `tokens` tokens: those it does not
        hold yet, and a copy of a shared partial tail it will write into. With `match` (a prefix a sequence holding
        no blocks is about to take): the blocks past it, and those of it that are cached (unowned: taking them
        takes them out of the free ones; owned ones are counted already, once however many share them)."""
        p = self.pool
        bs = self.config.block_size
        held = seq.blocks if match is None else match
        need = max(blocks_for(tokens, bs) - len(held), 0)
        if match:
            need += int(np.count_nonzero(p._meta("ref", np.asarray(match, dtype=np.int64)) == 0))
        elif match is None and seq.num_cached % bs and seq.blocks and p.ref_of(seq.blocks[seq.num_cached // bs]) > 1:
            need += 1
        return need

    def take_prefix(self, seq: Sequence, lids: list[int], hashes: list[int], now: float) -> None:
        """Reference the matched blocks and count the reuse."""
        for lid in lids:
            self.pool.incref(lid)
        seq.blocks, seq.hashes = list(lids), list(hashes)
        seq.table_version += 1
        self.count_reuse(seq, len(seq.blocks) * self.config.block_size, seq.blocks, now)

    def count_reuse(self, seq: Sequence, cached: int, lids: list[int], now: float) -> None:
        """The sequence starts with `cached` tokens from the prefix cache, held in `lids` (their ages recorded)."""
        if lids:
            self.events.record_prefix_hit(now - self.pool.last_of(lids), now - self.pool.born_of(lids))
        seq.num_cached = cached
        seq.canonical = seq.num_cached
        if seq.first_token_at is None and seq.preemptions == 0:  # count a prompt once, not at each recompute
            seq.prefix_reused = seq.num_cached
            self.counters.prompt_tokens += len(seq.tokens)
            self.counters.prompt_reused += seq.num_cached

    def chain(self, seq: Sequence, n: int) -> list[int]:
        """Chain hashes of the sequence's first n blocks, from its tokens."""
        bs, parent, out = self.config.block_size, 0, []
        for b in range(n):
            parent = chain_hash(parent, np.asarray(seq.tokens[b * bs:(b + 1) * bs], dtype=np.int32))
            out.append(parent)
        return out

    def explain_misses(self, seq: Sequence) -> None:
        """A sequence holding no blocks was just admitted with its cached prefix (take_prefix): count the lookup, and
        give each token it did not serve one reason (engine/kv/misses.py)."""
        hashes = self.chain(seq, self.reusable_blocks(seq))
        pool = self.pool

        def reason(b: int) -> str:
            r = pool.ledger.classify(hashes[b], hashes[b - 1] if b else 0, pool.by_hash.__contains__)
            return "cold" if r == "cached" else r  # cached, not served: a collision's tokens differ

        def detail(b: int) -> dict:
            return pool.ledger.detail(hashes[b], pool.now)

        self.count_misses(seq, len(hashes), reason, lambda b: hashes[b] in pool.by_hash, detail)

    def count_misses(self, seq: Sequence, reusable: int, reason, cached, detail, group_of=None,
                     split: dict | None = None) -> None:
        """explain_misses' counting, given each block's reason, whether it is cached and its removal's details
        (KV-cache groups: over every group, engine/kv/cache.py). One "lookup" event says what the lookup served and
        why its first missed block missed (a debug record per prefix lookup)."""
        from engine.kv.misses import counter_name, explain_prompt

        c = self.counters
        c.lookup_tokens += len(seq.tokens)
        c.lookup_served += seq.num_cached
        readmitted = not (seq.first_token_at is None and seq.preemptions == 0)
        why = explain_prompt(len(seq.tokens), seq.num_cached, self.config.block_size, reusable, readmitted, reason,
                             cached, group_of, split)
        for r, n in why.items():
            setattr(c, counter_name(r), getattr(c, counter_name(r)) + n)
            seq.why_missed[r] = seq.why_missed.get(r, 0) + n
        m = seq.num_cached // self.config.block_size
        first = {}
        if why and not readmitted and m < reusable:
            first = {"first_miss_block": m, "first_miss": reason(m), **detail(m)}
        self.events.emit("lookup", seq=seq.id, tokens=len(seq.tokens), served=seq.num_cached,
                         **{r: n for r, n in why.items() if n}, **first)

    def hash_full_blocks(self, seq: Sequence, old: int) -> None:
        """Register the blocks that became full and canonical since `old` tokens were cached."""
        bs = self.config.block_size
        for b in range(old // bs, seq.num_cached // bs):
            if (b + 1) * bs > seq.canonical or seq.hashes[b]:
                continue
            parent = seq.hashes[b - 1] if b else seq.base_hash  # a window group's view: the last block it dropped
            if (b or seq.base) and not parent:
                break
            toks = np.asarray(seq.tokens[b * bs:(b + 1) * bs], dtype=np.int32)
            h = chain_hash(parent, toks)
            seq.hashes[b] = h
            self.pool.set_hash(seq.blocks[b], h, toks, parent)

    def reset_prefix_cache(self) -> int:
        return self.pool.drop_cached()

    def release(self, seq: Sequence) -> None:
        """A finished sequence lets go of its blocks (hashed ones stay cached for reuse)."""
        for lid in seq.blocks:
            self.pool.decref(lid)
        seq.blocks, seq.hashes = [], []
        seq.table_version += 1

    def share(self, dst: Sequence, src: Sequence) -> None:
        """seq_cp: dst references every block of src (copy-on-write at the first divergent write)."""
        dst.blocks, dst.hashes = list(src.blocks), list(src.hashes)
        dst.table_version += 1
        for lid in dst.blocks:
            self.pool.incref(lid)

    # -- after a step -------------------------------------------------------------------------
    def commit_step(self, written: np.ndarray, fills: np.ndarray) -> None:
        self.pool.set_fill(written, fills)

    def touch(self, tables: list[np.ndarray], now: float) -> None:
        if tables:
            self.pool.touch(np.unique(np.concatenate(tables)), now)

    def touch_seqs(self, seqs: list[Sequence], now: float) -> None:
        self.touch([s.table() for s in seqs], now)

    def trim(self, seqs, now: float) -> None:
        """Nothing to drop: every layer here attends over every key (engine/kv/cache.py trims window groups)."""

    # -- block contents -----------------------------------------------------------------------
    def tokens_kv(self, seq: Sequence, pool: BlockPool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K/V of a sequence's cached tokens: [L, n, Hkv, D] each."""
        k, v = (pool or self.pool).read_blocks(seq.blocks)  # [L, nb, Hkv, bs, D]
        L, nb, Hkv, bs, D = k.shape
        k = k.permute(0, 1, 3, 2, 4).reshape(L, nb * bs, Hkv, D)[:, : seq.num_cached]
        v = v.permute(0, 1, 3, 2, 4).reshape(L, nb * bs, Hkv, D)[:, : seq.num_cached]
        return k, v

    def room_to_relay(self, seq: Sequence, b0: int, need: int) -> bool:
        """Whether `need` fresh blocks can be had once the sequence lets go of its blocks from b0 on."""
        p = self.pool
        own = sum(1 for lid in seq.blocks[b0:] if p.ref_of(lid) == 1)
        return need <= p.reclaimable(Tier.DEVICE) + p.reclaimable(Tier.HOST) + own

    def relay(self, seq: Sequence, keep: list[int], old_pos: list[int], new_pos: list[int], first: int,
              shift, now: float) -> None:
        """Re-lay the sequence's blocks from the one holding token `first` (the first kept token that changed) for a
        change keeping tokens `keep` (old indices, ascending) at `new_pos` (its token-level part is already on
        `seq`): the kept cached keys read back, those whose position changed re-rotated by `shift(k, delta, layer)`
        (K-shift), written into fresh blocks; shared blocks are never written (copy-on-write for free)."""
        bs = self.config.block_size
        b0 = first // bs
        cached_keep = [i for i in keep if i < seq.num_cached]
        k_tail = v_tail = None
        if seq.num_cached and len(cached_keep) > b0 * bs:
            k, v = self.tokens_kv(seq)  # [L, n, Hkv, D]
            idx = torch.as_tensor(cached_keep[b0 * bs:], device=k.device)
            k_tail, v_tail = k[:, idx], v[:, idx]
            delta = torch.as_tensor([new_pos[j] - old_pos[i] for j, i in enumerate(keep)
                                     if i < seq.num_cached][b0 * bs:], device=k.device)
            if bool((delta != 0).any()):
                for i, layer in enumerate(self.layers):
                    k_tail[i] = shift(k_tail[i], delta, layer)
        self.relay_tail(seq, b0, k_tail, v_tail, len(cached_keep), now)

    def relay_tail(self, seq: Sequence, b0: int, k_tail: torch.Tensor | None, v_tail: torch.Tensor | None,
                   new_cached: int, now: float) -> None:
        """Replace the sequence's blocks from b0 on by fresh blocks holding k_tail/v_tail [L, n, Hkv, D]."""
        self.relay_blocks(seq, b0, k_tail, v_tail, now)
        seq.num_cached = new_cached
        self.hash_full_blocks(seq, 0)

    def relay_blocks(self, seq, b0: int, k_tail: torch.Tensor | None, v_tail: torch.Tensor | None, now: float) -> None:
        """The blocks part of relay_tail: the table cut at b0, then fresh blocks holding k_tail/v_tail."""
        p = self.pool
        bs = self.config.block_size
        for lid in seq.blocks[b0:]:
            p.decref(lid)
        seq.blocks, seq.hashes = seq.blocks[:b0], seq.hashes[:b0]
        seq.table_version += 1
        if k_tail is not None:
            n = k_tail.shape[1]
            nb = blocks_for(n, bs)
            lids = []
            for b in range(nb):
                tier = Tier.DEVICE if p.reclaimable(Tier.DEVICE) else Tier.HOST
                lid = p.allocate(tier, seq.id, now)
                p.set_fill([lid], [min(bs, n - b * bs)])
                lids.append(lid)
            pad = nb * bs - n
            kt = torch.nn.functional.pad(k_tail, (0, 0, 0, 0, 0, pad))  # [L, nb*bs, Hkv, D]
            vt = torch.nn.functional.pad(v_tail, (0, 0, 0, 0, 0, pad))
            L, _, Hkv, D = kt.shape
            p.write_blocks(lids, kt.view(L, nb, bs, Hkv, D).transpose(2, 3), vt.view(L, nb, bs, Hkv, D).transpose(2, 3))
            seq.blocks += lids
            seq.table_version += 1
            seq.hashes += [0] * nb

    # -- checks -------------------------------------------------------------------------------
    def check(self, seqs) -> None:
        owners: dict[int, int] = {}
        for s in seqs:
            for lid in s.blocks:
                owners[lid] = owners.get(lid, 0) + 1
        self.pool.check(owners)
