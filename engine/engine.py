"""The engine: continuous batching over the paged, tiered block cache, with llama.cpp-style
sequence operations and live reconfiguration.

Threading: `step()` and the sequence operations run on one thread (the engine thread). Other threads
may call `submit()` (a command run between steps), `reconfigure()` (applied between two steps: it
waits for the step in flight, then applies or raises), `snapshot()` and `take_events()`.
Two locks: `lock` guards the engine's state and is released while the model runs; `step_lock` is held
for a whole step, so whatever takes it runs between two steps.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from engine.block_pool import NO_HASH, BlockPool, CacheFull, Tier, blocks_for, chain_hash

DEVICE, HOST = int(Tier.DEVICE), int(Tier.HOST)  # plain ints: enum attribute lookups are slow in hot loops
from engine.config import CacheConfig, ConfigError, EngineOptions, KVDtype, change_is_lossy
from engine.errors import RequestError
from engine.loader import LoadedModel
from engine.model import AttnGroup, ForwardBatch, LlamaFamily
from engine.sequence import SamplingParams, Sequence, SeqState
from engine.telemetry import Counters, Event, Telemetry


@dataclass(frozen=True)
class TokenOut:
    seq_id: int
    token: int
    finished: bool


class StepKV:
    """The model's view of the cache for one step: where new K/V go, and the device tier to read."""

    def __init__(self, pool: BlockPool, slots: torch.Tensor, offsets: torch.Tensor, write_blocks: np.ndarray,
                 tok_block: torch.Tensor, prev_fill: np.ndarray, new_fill: np.ndarray):
        self.pool = pool
        self.dev = pool.tiers[Tier.DEVICE]
        self.slots, self.offsets = slots, offsets  # [T]
        dev = self.dev.k["data"].device
        self.wslots = torch.as_tensor(write_blocks, device=dev)  # [U] distinct slots written
        self.tok_block = tok_block  # [T] index into wslots
        self.keep = torch.as_tensor(prev_fill > 0, device=dev)
        bs = pool.geom.block_size
        self.fill_mask = (torch.arange(bs, device=dev)[None, :] < torch.as_tensor(new_fill, device=dev)[:, None])
        self.fill_mask = self.fill_mask.float()[:, None, :, None]  # [U, 1, bs, 1]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for codec, parts, x in ((self.pool.kcodec, self.dev.k, k), (self.pool.vcodec, self.dev.v, v)):
            if codec.scatter(parts, layer, self.slots, self.offsets, x):
                continue
            blocks = codec.decode(parts, layer, self.wslots)  # [U, Hkv, bs, D]
            blocks[self.tok_block, :, self.offsets] = x.float()
            codec.encode(parts, layer, self.wslots, blocks * self.fill_mask, self.keep)

    def gather(self, layer: int, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.pool.kcodec.decode(self.dev.k, layer, table), self.pool.vcodec.decode(self.dev.v, layer, table))


class Engine:
    def __init__(self, model: LoadedModel, config: CacheConfig | None = None, options: EngineOptions | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.loaded = model
        self.spec = model.spec
        self.tokenizer = model.tokenizer
        self.options = options or EngineOptions()
        self.config = config or CacheConfig()
        self.config.validate()
        self.device = torch.device(self.options.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device cuda requested but torch sees no CUDA device")
        self.clock = clock
        self.options.validate(self.spec.max_position_embeddings)
        self.model = LlamaFamily(self.spec, model.weights, self.device)
        self.context_limit = self.options.context_limit or self.spec.max_position_embeddings
        self.lock = threading.RLock()
        self.step_lock = threading.RLock()
        # A step loop re-takes step_lock at once, and locks are not fair: a waiting reconfigure would starve.
        # Waiting changes are counted here, and step() lets them go first.
        self._turn = threading.Condition()
        self._changes_waiting = 0
        self._stalled = 0  # consecutive steps in which no sequence passed its furthest point
        self.counters = Counters()
        self.telemetry = Telemetry(self)
        self.pool = self._make_pool(self.config)
        self.seqs: dict[int, Sequence] = {}
        self.waiting: collections.deque[int] = collections.deque()
        self.running: list[int] = []
        self._next_id = 0
        self._pending: collections.deque[Callable[[], None]] = collections.deque()
        self._finished: collections.deque[int] = collections.deque()
        self._kept: set[int] = set()  # finished sequences a caller still has to read (see keep/forget)
        self.trace = None  # TraceRecorder while recording
        self.eos = set(self.spec.eos_token_ids)

    # -- set-up -------------------------------------------------------------------------------
    @staticmethod
    def _require_supported(config: CacheConfig) -> None:
        if config.kv_dtype is KVDtype.FP8:
            from engine.codecs import fp8_supported

            if not fp8_supported():
                raise ConfigError("kv_dtype fp8: this torch build cannot store float8_e4m3fn")

    def _make_pool(self, config: CacheConfig) -> BlockPool:
        self._require_supported(config)
        self._check_memory(config)
        first = self.pool.next_serial if getattr(self, "pool", None) is not None else 0
        try:
            pool = BlockPool((self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim), config, self.device,
                             first_serial=first)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            raise ConfigError(f"cannot allocate the KV tiers ({config.summary()}): {str(e).splitlines()[0]}") from None
        pool.listener = self.telemetry.on_pool_event
        return pool

    def _check_memory(self, config: CacheConfig) -> None:
        """Refuse budgets this machine cannot hold before allocating them (pools are zero-filled up front)."""
        import psutil

        per = BlockPool.bytes_per_block(config, self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim)
        dev = max(1, int(config.device_budget_mb * 2**20) // per) * per
        host = int(config.host_budget_mb * 2**20) // per * per
        cpu_need = host + (dev if self.device.type == "cpu" else 0)
        avail = psutil.virtual_memory().available
        gib = 2**30
        if cpu_need > avail:
            raise ConfigError(
                f"device_budget_mb {config.device_budget_mb:g} + host_budget_mb {config.host_budget_mb:g} need "
                f"{cpu_need / gib:.2f} GiB of CPU memory but {avail / gib:.2f} GiB is available; lower the budgets"
                if self.device.type == "cpu" else
                f"host_budget_mb {config.host_budget_mb:g} needs {cpu_need / gib:.2f} GiB of CPU memory but "
                f"{avail / gib:.2f} GiB is available; lower it")
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            if dev > free:
                raise ConfigError(f"device_budget_mb {config.device_budget_mb:g} needs {dev / gib:.2f} GiB of GPU memory "
                                  f"but {free / gib:.2f} GiB is free; lower it")

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], sampling: SamplingParams | None = None, label: str = "") -> int:
        sampling = sampling or SamplingParams()
        with self.lock:
            prompt_ids = self.check_request(prompt_ids, sampling)
            seq = self._new_seq(prompt_ids, sampling, label)
            self.waiting.append(seq.id)
            self.telemetry.emit("request", seq=seq.id, prompt_tokens=len(prompt_ids))
            return seq.id

    def check_request(self, prompt_ids, sampling: SamplingParams) -> list[int]:
        """The prompt as a list of ints if this engine can serve it now; else RequestError naming why."""
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
            raise RequestError("the prompt must be a non-empty list of token ids")
        for i, t in enumerate(prompt_ids):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise RequestError(f"token {i} of the prompt is {t!r}, not an integer token id")
            if not 0 <= t < self.spec.vocab_size:
                raise RequestError(f"token {i} of the prompt is {t}, outside the vocabulary (0..{self.spec.vocab_size - 1})")
        if not isinstance(sampling, SamplingParams):
            raise RequestError("sampling must be SamplingParams")
        self._check_fits(len(prompt_ids), sampling.max_new_tokens)
        return [int(t) for t in prompt_ids]

    def _check_fits(self, prompt_len: int, max_new: int) -> None:
        peak = min(prompt_len + max_new, max(self.context_limit, prompt_len))
        need = blocks_for(peak, self.config.block_size)
        cap = self.pool.tiers[Tier.DEVICE].capacity
        if need > cap:
            raise RequestError(
                f"request needs {need} blocks of {self.config.block_size} tokens ({peak} tokens) but the device tier "
                f"holds {cap}; raise device_budget_mb or shorten the prompt"
            )
        if prompt_len > self.context_limit:
            raise RequestError(f"prompt of {prompt_len} tokens exceeds the context limit of {self.context_limit}")

    def _new_seq(self, tokens: list[int], sampling: SamplingParams, label: str) -> Sequence:
        sid = self._next_id
        self._next_id += 1
        seq = Sequence(id=sid, prompt_len=len(tokens), sampling=sampling, tokens=tokens, pos=list(range(len(tokens))),
                       arrival=self.clock(), label=label)
        if not sampling.greedy:
            g = torch.Generator(device="cpu")
            g.manual_seed(sampling.seed if sampling.seed is not None else sid)
            seq.rng = g
        self.seqs[sid] = seq
        return seq

    def has_work(self) -> bool:
        return bool(self.waiting or any(self.seqs[s].state == SeqState.RUNNING for s in self.running) or self._pending)

    def submit(self, fn: Callable[[], None]) -> None:
        """Run fn on the engine thread between steps."""
        with self.lock:
            self._pending.append(fn)

    # -- configuration ------------------------------------------------------------------------
    def reconfigure(self, **changes) -> CacheConfig:
        """Apply a config change between two steps and return the new config, or raise ConfigError.

        From any thread: it waits for the step in flight (if any) and applies under the engine's lock,
        so nothing it accepts is dropped and nothing it refuses has changed. A refusal is also an event.
        """
        with self._turn:
            self._changes_waiting += 1
        try:
            with self.step_lock, self.lock:
                return self._reconfigure(changes)
        finally:
            with self._turn:
                self._changes_waiting -= 1
                self._turn.notify_all()

    def _reconfigure(self, changes: dict) -> CacheConfig:
        try:
            new = self.config.replace(**changes)
            self._require_supported(new)
            self._check_budget(new)
            self._apply_config(new, changes)
        except ConfigError as e:
            self.telemetry.emit("config_error", changes={k: str(v) for k, v in changes.items()}, message=str(e))
            raise
        return new

    def _check_budget(self, new: CacheConfig) -> None:
        per = BlockPool.bytes_per_block(new, self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim)
        dev = int(new.device_budget_mb * 2**20) // per
        host = int(new.host_budget_mb * 2**20) // per
        need_dev = max((blocks_for(min(len(s.tokens) + s.sampling.max_new_tokens - len(s.output), self.context_limit),
                                   new.block_size) for s in self.seqs.values() if not s.done), default=1)
        if dev < need_dev:
            raise ConfigError(
                f"device_budget_mb {new.device_budget_mb:g} gives {dev} blocks of {per} bytes; a live sequence needs "
                f"{need_dev}: raise the budget or finish that sequence first")
        live = sum(blocks_for(s.num_cached, new.block_size) for s in self.seqs.values() if not s.done)
        if dev + host < live:
            raise ConfigError(f"budgets give {dev + host} blocks but live sequences hold {live}; nothing was changed")

    def is_lossy_change(self, changes: "dict | KVDtype | str") -> bool:
        """Whether applying `changes` (knob -> value; a bare dtype means {"kv_dtype": it}) can alter stored K/V."""
        if not isinstance(changes, dict):
            changes = {"kv_dtype": changes}
        return change_is_lossy(self.config, self.config.replace(**changes))

    def _apply_pending(self) -> None:
        while True:
            with self.lock:
                if not self._pending:
                    return
                fn = self._pending.popleft()
                fn()

    def _apply_config(self, new: CacheConfig, changes: dict) -> None:
        """Under both locks. Raises ConfigError with the engine unchanged if the new layout cannot be built."""
        old = self.config
        geometry = (new.block_size, new.kv_dtype, new.device_budget_mb, new.host_budget_mb) != (
            old.block_size, old.kv_dtype, old.device_budget_mb, old.host_budget_mb)
        lossy = change_is_lossy(old, new)
        if geometry:
            try:
                self._relayout(new)
            except CacheFull as e:  # the old pool is kept: nothing was touched before the swap
                raise ConfigError(f"cannot re-lay the live sequences: {e}; nothing was changed") from None
        else:
            self.pool.config = new
            from engine.eviction import make_policy

            self.pool.policy = make_policy(new.policy, new.decay)
        self.config = new
        self.telemetry.emit("config", changes={k: str(v) for k, v in changes.items()}, lossy=lossy,
                            summary=new.summary())

    def _relayout(self, new: CacheConfig) -> None:
        """Re-lay every live sequence's K/V into a fresh pool of the new geometry/format.

        The new pool is built and filled before the old one is dropped, so a failure leaves
        the engine exactly as it was. Shared prefixes stay shared: sequences are re-laid in order
        and a block whose chain hash a previous sequence already wrote is reused, not copied.
        """
        old_pool = self.pool
        pool = self._make_pool(new)
        now = self.clock()
        if (new.block_size, new.kv_dtype) == (self.config.block_size, self.config.kv_dtype):
            self._relayout_same_format(old_pool, pool, now)
            return
        plans: list[tuple[Sequence, list[int], list[int]]] = []
        written: dict[tuple, int] = {}
        for seq in self.seqs.values():
            if seq.done or seq.num_cached == 0:
                plans.append((seq, [], []))
                continue
            k, v = self._tokens_kv(old_pool, seq)  # [L, n, Hkv, D]
            blocks, hashes = [], []
            bs = new.block_size
            parent = 0
            for b in range(blocks_for(seq.num_cached, bs)):
                lo, hi = b * bs, min((b + 1) * bs, seq.num_cached)
                toks = np.asarray(seq.tokens[lo:hi], dtype=np.int32)
                full_canon = hi - lo == bs and hi <= seq.canonical
                h = chain_hash(parent, toks) if full_canon else 0
                parent = h
                key = ("h", h) if h else None
                if key is not None and key in written:
                    lid = written[key]
                    pool.incref(lid)
                else:
                    tier = Tier.DEVICE if pool.reclaimable(Tier.DEVICE) else Tier.HOST
                    lid = pool.allocate(tier, seq.id, now)
                    pool.set_fill([lid], [hi - lo])
                    kb = torch.zeros((k.shape[0], 1, k.shape[2], bs, k.shape[3]), device=self.device)
                    vb = torch.zeros_like(kb)
                    kb[:, 0, :, : hi - lo] = k[:, lo:hi].transpose(1, 2)
                    vb[:, 0, :, : hi - lo] = v[:, lo:hi].transpose(1, 2)
                    pool.write_blocks([lid], kb, vb)
                    if h:
                        pool.set_hash(lid, h, toks)
                        written[key] = lid
                blocks.append(lid)
                hashes.append(h)
            plans.append((seq, blocks, hashes))
        # Commit: nothing above touched the engine's state.
        self.pool = pool
        for seq, blocks, hashes in plans:
            seq.blocks, seq.hashes = blocks, hashes
            seq.table_version += 1
        del old_pool

    def _relayout_same_format(self, old: BlockPool, pool: BlockPool, now: float) -> None:
        """A budget-only change: every live block is copied byte for byte (codes and scales), so even the
        formats whose encoding is not idempotent keep exactly what attention read. Shared blocks stay shared."""
        mapping: dict[int, int] = {}
        for seq in self.seqs.values():
            if seq.done:
                continue
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
        self.pool = pool
        for seq in self.seqs.values():
            if not seq.done and seq.blocks:
                seq.blocks = [mapping[lid] for lid in seq.blocks]
                seq.table_version += 1

    def _tokens_kv(self, pool: BlockPool, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K/V of a sequence's cached tokens: [L, n, Hkv, D] each."""
        k, v = pool.read_blocks(seq.blocks)  # [L, nb, Hkv, bs, D]
        L, nb, Hkv, bs, D = k.shape
        k = k.permute(0, 1, 3, 2, 4).reshape(L, nb * bs, Hkv, D)[:, : seq.num_cached]
        v = v.permute(0, 1, 3, 2, 4).reshape(L, nb * bs, Hkv, D)[:, : seq.num_cached]
        return k, v

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[TokenOut]:
        with self._turn:
            self._turn.wait_for(lambda: self._changes_waiting == 0, timeout=5.0)
        with self.step_lock:
            return self._step()

    def _step(self) -> list[TokenOut]:
        self._apply_pending()
        with self.lock:
            t0 = time.perf_counter()
            now = self.clock()
            self._demote_idle(now)
            self._admit(now)
            sched = self._schedule(now)
            if not sched:
                self._watch_progress([], now)
                return []
            batch, kv, writes = self._build(sched)
            t1 = time.perf_counter()
        logits = self.model.forward(batch, kv)
        with self.lock:
            t2 = time.perf_counter()
            outs = self._finish_step(sched, writes, logits)
            t3 = time.perf_counter()
            self.counters.forward_s += t2 - t1
            self.counters.bookkeeping_s += (t1 - t0) + (t3 - t2)
            self.counters.steps += 1
            self._watch_progress(sched, now)
            self.telemetry.after_step(now)
        return outs

    def _watch_progress(self, sched: list[tuple[Sequence, int]], now: float) -> None:
        """Progress is a sequence passing the furthest point it ever reached (tokens generated, then cached)
        or finishing. The scheduler is built so the oldest running sequence always progresses; should a
        state arise where nothing does for `stall_steps` steps, the newest stuck sequence is aborted with
        finish_reason "stalled" and an error event, instead of spinning forever."""
        moved = False
        for seq, _ in sched:
            mark = (len(seq.output), seq.num_cached)
            if mark > seq.best or seq.done:
                seq.best = max(mark, seq.best)
                moved = True
        stuck = [s for s in self.seqs.values() if not s.done and s.state in (SeqState.WAITING, SeqState.RUNNING)]
        if moved or not stuck:
            self._stalled = 0
            return
        self._stalled += 1
        if self._stalled < self.options.stall_steps:
            return
        victim = max(stuck, key=lambda s: s.arrival)
        dev = self.pool.tiers[Tier.DEVICE]
        message = (f"sequence {victim.id} aborted: no sequence made progress in {self._stalled} steps (device tier "
                   f"{dev.capacity} blocks, {dev.used} in use; host tier {self.pool.tiers[Tier.HOST].capacity} "
                   f"blocks); raise the budgets or send fewer or shorter requests")
        self.telemetry.emit("error", seq=victim.id, message=message)
        victim.error = message
        self._finish(victim, "stalled", now)
        self._stalled = 0

    def _demote_idle(self, now: float) -> None:
        """MemOS hybrid rule: device blocks idle longer than demote_after_s move to the host tier."""
        p = self.pool
        dev = p.tiers[Tier.DEVICE]
        idle = dev.lid[(dev.lid >= 0) & (now - dev.last > self.config.demote_after_s)]
        if len(idle) and p.tiers[Tier.HOST].capacity:
            p.move(idle, Tier.HOST, now, reason="idle")

    def _admit(self, now: float) -> None:
        """Admit waiting sequences in order while the device tier has room for their first chunk.

        A waiting sequence holds no reference it took while waiting: its prefix match is looked up here
        and taken only at admission. (Refs held by a waiting sequence pin blocks that the running ones
        need, and then the queue's head is admitted and preempted forever.)
        """
        p = self.pool
        for sid in list(self.waiting):
            if len(self._active()) >= self.options.max_batch:
                return
            seq = self.seqs[sid]
            match: tuple[list[int], list[int]] = ([], [])
            if seq.num_cached == 0 and not seq.blocks:
                if self._prefix_in_flight(seq):
                    continue  # a running prefill is computing this prompt's first block: reuse it next step
                match = self._find_prefix(seq)
            lids = np.asarray(match[0] or seq.blocks, dtype=np.int64)
            cached = len(match[0]) * self.config.block_size if match[0] else seq.num_cached
            first = min(len(seq.tokens) - cached, self.options.max_batched_tokens)
            need = blocks_for(cached + first, self.config.block_size) - len(lids)
            tiers = p.tier[lids]
            on_host = int(np.count_nonzero(tiers == HOST))
            # Matched blocks that sit unowned on the device stop being reclaimable once taken.
            pinned = int(np.count_nonzero(p._meta("ref", lids[tiers == DEVICE]) == 0)) if match[0] else 0
            if p.reclaimable(Tier.DEVICE) - pinned < need + on_host and self._active():
                return  # wait for room; running sequences will finish, shift or be preempted
            if seq.num_cached == 0 and not seq.blocks:
                self._take_prefix(seq, *match)
            self.waiting.remove(sid)
            seq.state = SeqState.RUNNING
            self.running.append(seq.id)

    def _prefix_in_flight(self, seq: Sequence) -> bool:
        """Another sequence is prefilling the same first block right now (its hash is not registered yet)."""
        bs = self.config.block_size
        if len(seq.tokens) <= bs:
            return False
        head = seq.tokens[:bs]
        return any(o.num_cached < bs and o.tokens[:bs] == head and o.canonical == o.num_cached
                   for o in (self.seqs[r] for r in self._active()))

    def _active(self) -> list[int]:
        return [s for s in self.running if self.seqs[s].state == SeqState.RUNNING]

    def _find_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Cached blocks (and their hashes) for the longest cached prefix of the prompt; takes no reference.

        The last token is always computed. Cached blocks hold keys at positions 0..n-1, so the match stops
        where the sequence's positions stop being its indices (after a shift, seq_add or seq_div).
        """
        bs = self.config.block_size
        parent = 0
        lids: list[int] = []
        hashes: list[int] = []
        reusable = (len(seq.tokens) - 1) // bs
        if seq.repositioned:
            canon = next((i for i, q in enumerate(seq.pos) if q != i), len(seq.pos))
            reusable = min(reusable, canon // bs)
        for b in range(reusable):
            toks = np.asarray(seq.tokens[b * bs:(b + 1) * bs], dtype=np.int32)
            h = chain_hash(parent, toks)
            lid = self.pool.lookup(h, toks)
            if lid is None:
                break
            lids.append(lid)
            hashes.append(h)
            parent = h
        return lids, hashes

    def _take_prefix(self, seq: Sequence, lids: list[int], hashes: list[int]) -> None:
        """Reference the matched blocks and count the reuse."""
        bs = self.config.block_size
        for lid in lids:
            self.pool.incref(lid)
        seq.blocks, seq.hashes = list(lids), list(hashes)
        seq.table_version += 1
        if seq.blocks:
            now = self.clock()
            self.telemetry.record_prefix_hit(now - self.pool.last_of(seq.blocks), now - self.pool.born_of(seq.blocks))
        seq.num_cached = len(seq.blocks) * bs
        seq.canonical = seq.num_cached
        if seq.first_token_at is None and seq.preemptions == 0:  # count a prompt once, not at each recompute
            seq.prefix_reused = seq.num_cached
            self.counters.prompt_tokens += len(seq.tokens)
            self.counters.prompt_reused += seq.num_cached

    def _schedule(self, now: float) -> list[tuple[Sequence, int]]:
        """Pick (sequence, tokens to compute) for this step and make their blocks resident and writable."""
        budget = self.options.max_batched_tokens
        active = [self.seqs[s] for s in self._active()]
        # Decodes first (one token each), then prompt chunks in arrival order.
        active.sort(key=lambda s: (s.pending > 1, s.arrival))
        sched: list[tuple[Sequence, int]] = []
        for seq in active:
            if seq.state != SeqState.RUNNING:
                continue  # preempted while making room for an earlier one
            if self._needs_shift(seq):
                try:
                    self._context_shift(seq)
                except RequestError:  # no room to re-lay its tail now: wait, unchanged, until blocks free up
                    self._preempt(seq, now)
                    continue
            n = min(seq.pending, budget) if seq.pending > 1 else seq.pending
            if n <= 0:
                continue
            if not self._make_resident(seq, n, now, sched):
                continue
            sched.append((seq, n))
            budget -= n if n > 1 else 0
            if budget <= 0 and n > 1:
                break
        return sched

    def _needs_shift(self, seq: Sequence) -> bool:
        return len(seq.tokens) > self.context_limit

    def _make_resident(self, seq: Sequence, n: int, now: float, sched: list) -> bool:
        """Promote the sequence's host blocks and give it room for n new tokens on the device tier."""
        p = self.pool
        bs = self.config.block_size
        new_blocks = blocks_for(seq.num_cached + n, bs) - len(seq.blocks)
        table = seq.table()
        on_host = table[p.tier[table] == HOST]
        tail_cow = 0
        if seq.num_cached % bs and seq.blocks:
            tail = seq.blocks[seq.num_cached // bs]
            tail_cow = 1 if p.ref_of(tail) > 1 else 0
        need = len(on_host) + max(new_blocks, 0) + tail_cow
        if not self._make_room(need, now, keep={seq.id} | {s.id for s, _ in sched}):
            self._preempt(seq, now)
            return False
        # Device-tier reads: a host block is a miss; promoting it brings the next prefetch_depth host
        # blocks of the sequence along, so they are hits when attention reaches them.
        reads = len(table)
        group = 1 + self.config.prefetch_depth
        misses = 0
        if self.trace is not None:
            tiers = p.tier[table].copy()
            hits = np.ones(len(table), dtype=bool)
            hits[np.flatnonzero(tiers == HOST)[::group]] = False  # the first of each promoted group misses
            self.trace.add(now, seq.id, p.serial[table], tiers, hits)
        for j in range(0, len(on_host), group):
            misses += 1
            p.move(on_host[j:j + group], Tier.DEVICE, now, reason="miss")
        self.counters.block_reads += reads
        self.counters.block_misses += misses
        # Copy-on-write of a shared (or cached) partial tail before writing into it.
        if seq.num_cached % bs and seq.blocks:
            self._ensure_writable(seq, seq.num_cached // bs, now)
        while len(seq.blocks) < blocks_for(seq.num_cached + n, bs):
            seq.blocks.append(p.allocate(Tier.DEVICE, seq.id, now))
            seq.hashes.append(0)
            seq.table_version += 1
        return True

    def _ensure_writable(self, seq: Sequence, bi: int, now: float) -> None:
        p = self.pool
        lid = seq.blocks[bi]
        if p.ref_of(lid) > 1:
            new = p.allocate(Tier.DEVICE, seq.id, now)
            p.copy_block(lid, new)
            p.decref(lid)
            seq.blocks[bi] = new
            seq.table_version += 1
            seq.hashes[bi] = 0
            self.telemetry.emit("cow", seq=seq.id, block=int(lid), new=int(new))
        elif p.hash_of(lid) != NO_HASH:
            p.clear_hash(lid)  # its content is about to change; the prefix cache must forget it
            seq.hashes[bi] = 0

    def _make_room(self, need: int, now: float, keep: set[int]) -> bool:
        """Ensure `need` device slots are obtainable: demote idle owners' blocks, then preempt running ones."""
        p = self.pool
        if p.can_allocate(Tier.DEVICE, need):
            return True
        # 1. Blocks of sequences not running now (paused, preempted, waiting with a prefix), coldest first,
        #    except blocks they share with a sequence that must stay resident.
        idle = [s.table() for s in self.seqs.values()
                if s.id not in keep and not s.done and s.state != SeqState.RUNNING and s.blocks]
        if idle:
            cand = np.unique(np.concatenate(idle))
            cand = cand[p.tier[cand] == DEVICE]
            kept = [self.seqs[sid].table() for sid in keep]
            if kept and len(cand):
                cand = cand[~np.isin(cand, np.concatenate(kept))]
            if len(cand):
                cand = cand[np.argsort(p.last_of(cand), kind="stable")]
                short = need - p.reclaimable(Tier.DEVICE)
                p.move(cand[:max(short, 0)], Tier.HOST, now, reason="room")
        if p.can_allocate(Tier.DEVICE, need):
            return True
        # 2. The host tier could not take them: drop those sequences' K/V (they recompute when they run
        #    again; nothing they generated is lost), least recently used first.
        for seq in sorted((s for s in self.seqs.values() if s.id not in keep and not s.done
                           and s.state != SeqState.RUNNING and s.blocks and (p.tier[s.table()] == DEVICE).any()),
                          key=lambda s: float(p.last_of(s.table()).max())):
            self._drop_kv(seq)
            seq.preemptions += 1
            self.telemetry.emit("preempt", seq=seq.id, mode="recompute", reason="no host room")
            if p.can_allocate(Tier.DEVICE, need):
                return True
        # 3. Preempt running sequences not yet scheduled this step, newest first.
        for sid in reversed(self._active()):
            if sid in keep:
                continue
            self._preempt(self.seqs[sid], now)
            if p.can_allocate(Tier.DEVICE, need):
                return True
        return p.can_allocate(Tier.DEVICE, need)

    def _preempt(self, seq: Sequence, now: float) -> None:
        """Stop a running sequence; its blocks go to the host tier, or are dropped and recomputed later.

        Only blocks it owns alone move: a block shared with another sequence (a fork, a reused
        prefix) may already be resident for a sequence scheduled in this step.
        """
        p = self.pool
        table = seq.table()
        on_dev = table[p.tier[table] == DEVICE]
        own = on_dev[p._meta("ref", on_dev) == 1] if len(on_dev) else on_dev
        moved = p.move(own, Tier.HOST, now, reason="preempt") if len(own) else 0
        mode = "swap"
        if moved < len(own):
            mode = "recompute"
            self._drop_kv(seq)
        seq.preemptions += 1
        self.counters.preemptions += 1
        self.running.remove(seq.id)
        self.waiting.appendleft(seq.id)
        seq.state = SeqState.WAITING
        self.telemetry.emit("preempt", seq=seq.id, mode=mode)

    def _drop_kv(self, seq: Sequence) -> None:
        for lid in seq.blocks:
            self.pool.decref(lid)
        seq.blocks, seq.hashes = [], []
        seq.table_version += 1
        seq.num_cached = 0
        seq.canonical = 0

    def _build(self, sched: list[tuple[Sequence, int]]):
        """The step's flat token batch, where each token's K/V goes, and the attention groups."""
        bs = self.config.block_size
        p = self.pool
        dev = p.device
        ids, pos, lids, offs = [], [], [], []
        decode_rows, decode = [], []
        groups: list[AttnGroup] = []
        logit_rows = []
        row = 0
        for seq, n in sched:
            lo, hi = seq.num_cached, seq.num_cached + n
            idx = np.arange(lo, hi)
            ids.extend(seq.tokens[lo:hi])
            pos.append(idx if not seq.repositioned else np.asarray(seq.pos[lo:hi], dtype=np.int64))
            lids.append(seq.table()[idx // bs])
            offs.append(idx % bs)
            if n == 1:
                decode.append(seq)
                decode_rows.append(row)
            else:
                groups.append(self._group([seq], [row], dev, q_len=n, ctx=[hi], qpos=[pos[-1]]))
            row += n
            logit_rows.append(row - 1)
        if decode:
            groups.insert(0, self._group(decode, decode_rows, dev))
        lids_np, offs_np = np.concatenate(lids), np.concatenate(offs)
        # Writes are appends: the first offset written into a block is how many of its slots were
        # already valid, and the block's fill afterwards is the last offset written + 1.
        wl, tok_block = np.unique(lids_np, return_inverse=True)
        prev_fill = np.full(len(wl), bs, dtype=np.int64)
        np.minimum.at(prev_fill, tok_block, offs_np)
        new_fill = np.zeros(len(wl), dtype=np.int64)
        np.maximum.at(new_fill, tok_block, offs_np + 1)
        t = lambda a: torch.as_tensor(a, device=dev)  # noqa: E731
        kv = StepKV(p, t(p.slot[lids_np]), t(offs_np), p.slot[wl], t(tok_block), prev_fill, new_fill)
        batch = ForwardBatch(input_ids=t(np.asarray(ids, dtype=np.int64)), positions=t(np.concatenate(pos)),
                             groups=groups, logit_rows=t(np.asarray(logit_rows, dtype=np.int64)))
        return batch, kv, (wl, new_fill)

    def _group(self, seqs: list[Sequence], first_rows: list[int], dev, q_len: int = 1,
               ctx: list[int] | None = None, qpos: list[np.ndarray] | None = None) -> AttnGroup:
        """Sequences attended together, their block tables padded to the longest (pad: slot 0, masked)."""
        bs = self.config.block_size
        p = self.pool
        ctx = ctx or [s.num_cached + 1 for s in seqs]
        nb = max(blocks_for(c, bs) for c in ctx)
        B = len(seqs)
        table = np.zeros((B, nb), dtype=np.int64)
        kpos = np.zeros((B, nb * bs), dtype=np.int64)
        kvalid = np.zeros((B, nb * bs), dtype=bool)
        qp = np.zeros((B, q_len), dtype=np.int64)
        for b, (seq, c) in enumerate(zip(seqs, ctx)):
            k = blocks_for(c, bs)
            table[b, :k] = p.slot[seq.table()[:k]]
            kp = seq.key_positions(c)
            kpos[b, :c] = kp
            kvalid[b, :c] = True
            qp[b] = qpos[b] if qpos is not None else kp[c - 1]
        rows = (np.asarray(first_rows, dtype=np.int64)[:, None] + np.arange(q_len)[None, :]).reshape(-1)
        t = lambda a: torch.as_tensor(a, device=dev)  # noqa: E731
        return AttnGroup(rows=t(rows), q_len=q_len, table=t(table), kpos=t(kpos), kvalid=t(kvalid), qpos=t(qp))

    def _finish_step(self, sched, writes, logits: torch.Tensor) -> list[TokenOut]:
        p = self.pool
        now = self.clock()
        wl, new_fill = writes
        p.set_fill(wl, new_fill)
        bs = self.config.block_size
        touched = []
        outs = []
        next_tokens = self._sample(sched, logits)
        for (seq, n), tok in zip(sched, next_tokens):
            old = seq.num_cached
            seq.num_cached += n
            if seq.num_cached > seq.canonical and seq.canonical == old and seq.pos[old:seq.num_cached] == list(
                    range(old, seq.num_cached)):
                seq.canonical = seq.num_cached
            self._hash_full_blocks(seq, old)
            touched.append(seq.table())
            if seq.pending > 0:  # a prompt chunk that is not the last: no token yet
                continue
            seq.tokens.append(tok)
            seq.pos.append(seq.pos[-1] + 1)
            seq.output.append(tok)
            self.counters.generated += 1
            if seq.first_token_at is None:
                seq.first_token_at = now
                seq.ttft = now - seq.arrival
                self.telemetry.ttft(seq.ttft)
            finished = (tok in self.eos and not seq.sampling.ignore_eos) or len(seq.output) >= seq.sampling.max_new_tokens
            if finished:
                self._finish(seq, "eos" if tok in self.eos else "length", now)
            outs.append(TokenOut(seq.id, tok, finished))
        if touched:
            p.touch(np.unique(np.concatenate(touched)), now)
        return outs

    def _hash_full_blocks(self, seq: Sequence, old: int) -> None:
        bs = self.config.block_size
        p = self.pool
        for b in range(old // bs, seq.num_cached // bs):
            if (b + 1) * bs > seq.canonical or seq.hashes[b]:
                continue
            parent = seq.hashes[b - 1] if b else 0
            if b and not parent:
                break
            toks = np.asarray(seq.tokens[b * bs:(b + 1) * bs], dtype=np.int32)
            h = chain_hash(parent, toks)
            seq.hashes[b] = h
            p.set_hash(seq.blocks[b], h, toks)

    def _sample(self, sched, logits: torch.Tensor) -> list[int]:
        out = []
        greedy = logits.argmax(dim=-1).tolist()
        for i, (seq, _) in enumerate(sched):
            sp = seq.sampling
            if sp.greedy:
                out.append(greedy[i])
                continue
            probs = torch.softmax(logits[i].float() / sp.temperature, dim=-1).cpu()
            if sp.top_p < 1.0:
                sorted_p, idx = probs.sort(descending=True)
                cut = torch.cumsum(sorted_p, 0) - sorted_p > sp.top_p
                sorted_p[cut] = 0
                probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
            out.append(int(torch.multinomial(probs / probs.sum(), 1, generator=seq.rng)))
        return out

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        seq.state = SeqState.FINISHED
        seq.finish_reason = reason
        seq.finished_at = now
        if seq.id in self.running:
            self.running.remove(seq.id)
        if seq.id in self.waiting:
            self.waiting.remove(seq.id)
        for lid in seq.blocks:
            self.pool.decref(lid)
        seq.blocks, seq.hashes = [], []
        seq.table_version += 1
        self.telemetry.emit("finish", seq=seq.id, reason=reason, tokens=len(seq.output))
        if seq.id not in self._kept:
            self._finished.append(seq.id)
        while len(self._finished) > self.options.keep_finished:
            self.seqs.pop(self._finished.popleft(), None)

    # -- llama.cpp-style sequence operations --------------------------------------------------
    def seq_rm(self, sid: int, p0: int, p1: int | None = None) -> None:
        """Remove the tokens whose positions are in [p0, p1) (p1 None: to the end)."""
        with self.lock:
            seq = self._live(sid)
            p1 = float("inf") if p1 is None or p1 < 0 else p1
            keep = [i for i, q in enumerate(seq.pos) if not (p0 <= q < p1)]
            if len(keep) == len(seq.tokens):
                return
            if not keep:
                raise RequestError("seq_rm would remove every token; finish the sequence instead")
            self._rewrite(seq, keep, deltas=None)
            self.telemetry.emit("seq_rm", seq=sid, p0=p0, p1=None if p1 == float("inf") else p1)

    def seq_add(self, sid: int, p0: int, p1: int | None, delta: int) -> None:
        """Shift positions in [p0, p1) by delta, re-rotating the cached keys (K-shift)."""
        with self.lock:
            seq = self._live(sid)
            p1 = float("inf") if p1 is None or p1 < 0 else p1
            new = [q + delta if p0 <= q < p1 else q for q in seq.pos]
            self._reposition(seq, new)
            self.telemetry.emit("seq_add", seq=sid, p0=p0, delta=delta)

    def seq_div(self, sid: int, p0: int, p1: int | None, d: int) -> None:
        """Integer-divide positions in [p0, p1) by d (self-extend), re-rotating keys."""
        if d < 1:
            raise RequestError("seq_div needs d >= 1")
        with self.lock:
            seq = self._live(sid)
            p1 = float("inf") if p1 is None or p1 < 0 else p1
            new = [q // d if p0 <= q < p1 else q for q in seq.pos]
            self._reposition(seq, new)
            self.telemetry.emit("seq_div", seq=sid, p0=p0, d=d)

    def seq_cp(self, sid: int, sampling: SamplingParams | None = None, label: str = "") -> int:
        """Fork: a new sequence sharing every block (ref counts); copy-on-write at the first divergent write."""
        with self.lock:
            src = self._live(sid)
            dst = self._new_seq(list(src.tokens), sampling or src.sampling, label or f"fork of {sid}")
            dst.prompt_len = src.prompt_len
            dst.pos = list(src.pos)
            dst.repositioned = src.repositioned
            dst.output = list(src.output)
            dst.blocks = list(src.blocks)
            dst.table_version += 1
            dst.hashes = list(src.hashes)
            dst.num_cached, dst.canonical = src.num_cached, src.canonical
            dst.first_token_at, dst.ttft = src.first_token_at, src.ttft
            for lid in dst.blocks:
                self.pool.incref(lid)
            if src.state == SeqState.RUNNING:
                dst.state = SeqState.RUNNING
                self.running.append(dst.id)
            else:
                dst.state = SeqState.WAITING
                self.waiting.append(dst.id)
            self.telemetry.emit("seq_cp", seq=sid, new=dst.id, shared=len(dst.blocks))
            return dst.id

    def seq_keep(self, sid: int) -> None:
        """Drop every sequence but this one."""
        with self.lock:
            self._live(sid)
            for other in list(self.seqs.values()):
                if other.id != sid and not other.done:
                    self._finish(other, "seq_keep", self.clock())

    def cancel(self, sid: int) -> None:
        with self.lock:
            self._finish(self._live(sid), "cancelled", self.clock())

    def pause(self, sid: int) -> None:
        with self.lock:
            seq = self._live(sid)
            if seq.id in self.running:
                self.running.remove(seq.id)
            if seq.id in self.waiting:
                self.waiting.remove(seq.id)
            seq.state = SeqState.PAUSED
            self.telemetry.emit("pause", seq=sid)

    def resume(self, sid: int) -> None:
        with self.lock:
            seq = self._live(sid)
            if seq.state != SeqState.PAUSED:
                return
            seq.state = SeqState.WAITING
            self.waiting.append(sid)
            self.telemetry.emit("resume", seq=sid)

    def extend(self, sid: int, tokens: list[int], max_new_tokens: int) -> None:
        """Append a new user turn to a finished or paused sequence and generate again (multi-turn chat)."""
        with self.lock:
            seq = self.seqs[sid]
            if seq.done:
                raise RequestError(f"sequence {sid} has finished and released its blocks")
            self._check_fits(len(seq.tokens) + len(tokens), max_new_tokens)
            for t in tokens:
                seq.tokens.append(t)
                seq.pos.append(seq.pos[-1] + 1)
            seq.sampling = SamplingParams(max_new_tokens=len(seq.output) + max_new_tokens,
                                          temperature=seq.sampling.temperature, top_p=seq.sampling.top_p,
                                          seed=seq.sampling.seed, ignore_eos=seq.sampling.ignore_eos)
            if seq.state == SeqState.PAUSED:
                self.resume(sid)

    def keep(self, sid: int) -> None:
        """Keep this sequence in `seqs` after it finishes, whatever keep_finished says, until forget(sid):
        for a caller that reads its output later (only the newest keep_finished others are kept)."""
        with self.lock:
            self._kept.add(sid)

    def forget(self, sid: int) -> None:
        """Drop a finished sequence that keep() held."""
        with self.lock:
            self._kept.discard(sid)
            seq = self.seqs.get(sid)
            if seq is not None and seq.done:
                del self.seqs[sid]

    def _live(self, sid: int) -> Sequence:
        seq = self.seqs.get(sid)
        if seq is None or seq.done:
            raise RequestError(f"no live sequence {sid}")
        return seq

    def _context_shift(self, seq: Sequence) -> None:
        """llama.cpp context shift: keep n_keep tokens, drop the next n_discard, K-shift the rest back."""
        n_keep = min(self.options.n_keep, len(seq.tokens) - 2)
        n_discard = self.options.n_discard or (len(seq.tokens) - n_keep) // 2
        n_discard = max(1, min(n_discard, len(seq.tokens) - n_keep - 1))
        p0 = seq.pos[n_keep]
        keep = list(range(n_keep)) + list(range(n_keep + n_discard, len(seq.tokens)))
        self._rewrite(seq, keep, deltas=-n_discard, shift_from=n_keep)
        seq.shifts += 1
        self.telemetry.emit("context_shift", seq=seq.id, n_keep=n_keep, n_discard=n_discard, at=p0)

    def _reposition(self, seq: Sequence, new_pos: list[int]) -> None:
        self._rewrite(seq, list(range(len(seq.tokens))), deltas=None, new_pos=new_pos)

    def _rewrite(self, seq: Sequence, keep: list[int], deltas: int | None, shift_from: int | None = None,
                 new_pos: list[int] | None = None) -> None:
        """Keep tokens `keep` (indices, ascending) and re-lay the changed tail into new blocks.

        Positions: if new_pos is given, use it; if deltas is given, tokens at kept index >= shift_from move
        by deltas. Keys whose position changes are re-rotated (K-shift). Shared blocks are never written:
        the tail gets fresh blocks, which is copy-on-write for free.
        """
        p = self.pool
        bs = self.config.block_size
        now = self.clock()
        old_pos = seq.pos
        if new_pos is None:
            new_pos = [old_pos[i] + (deltas if deltas is not None and shift_from is not None and j >= shift_from else 0)
                       for j, i in enumerate(keep)]
        src_idx = keep
        # The first kept index that differs from before: everything from there is rewritten.
        first = 0
        while first < len(src_idx) and src_idx[first] == first and new_pos[first] == old_pos[first]:
            first += 1
        b0 = first // bs
        cached_keep = [i for i in src_idx if i < seq.num_cached]
        # Refuse before touching anything if the re-laid tail cannot get blocks: the tail's old blocks that
        # only this sequence holds come back when it lets go of them, the rest must be reclaimable already.
        need = blocks_for(max(len(cached_keep) - b0 * bs, 0), bs)
        own = sum(1 for lid in seq.blocks[b0:] if p.ref_of(lid) == 1)
        if need > p.reclaimable(Tier.DEVICE) + p.reclaimable(Tier.HOST) + own:
            raise RequestError(f"sequence {seq.id}: no room to re-lay {need} blocks (both tiers full of owned "
                               "blocks); nothing was changed")
        k_tail = v_tail = None
        if seq.num_cached and len(cached_keep) > b0 * bs:
            k, v = self._tokens_kv(p, seq)  # [L, n, Hkv, D]
            idx = torch.as_tensor(cached_keep[b0 * bs:], device=self.device)
            k_tail, v_tail = k[:, idx], v[:, idx]
            delta = torch.as_tensor([new_pos[j] - old_pos[i] for j, i in enumerate(src_idx)
                                     if i < seq.num_cached][b0 * bs:], device=self.device)
            if bool((delta != 0).any()):
                for layer in range(k_tail.shape[0]):
                    k_tail[layer] = self.model.shift_keys(k_tail[layer], delta)
        # Commit the token-level change.
        seq.tokens = [seq.tokens[i] for i in src_idx]
        seq.pos = new_pos
        seq.repositioned = any(q != i for i, q in enumerate(new_pos))
        new_cached = len(cached_keep)
        seq.canonical = min(seq.canonical, first)
        for lid in seq.blocks[b0:]:
            p.decref(lid)
        seq.blocks, seq.hashes = seq.blocks[:b0], seq.hashes[:b0]
        seq.table_version += 1
        seq.num_cached = b0 * bs
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
            kt = kt.view(L, nb, bs, Hkv, D).transpose(2, 3)
            vt = vt.view(L, nb, bs, Hkv, D).transpose(2, 3)
            p.write_blocks(lids, kt, vt)
            seq.blocks += lids
            seq.table_version += 1
            seq.hashes += [0] * nb
        seq.num_cached = new_cached
        self._hash_full_blocks(seq, 0)

    def start_trace(self) -> None:
        """Record every block read from now on (see engine/trace.py)."""
        from engine.trace import TraceRecorder

        with self.lock:
            self.trace = TraceRecorder()
            self.telemetry.emit("trace", recording=True)

    def stop_trace(self, path: str | None = None):
        """Stop recording; save to path (.npz) if given; return the AccessTrace."""
        with self.lock:
            rec, self.trace = self.trace, None
        if rec is None:
            return None
        trace = rec.trace()
        if path:
            trace.save(path)
        self.telemetry.emit("trace", recording=False, rows=len(trace), path=path or "")
        return trace

    def reset_prefix_cache(self) -> int:
        with self.lock:
            n = self.pool.drop_cached()
            self.telemetry.emit("prefix_cache_reset", blocks=n)
            return n

    # -- run helpers ----------------------------------------------------------------------------
    def run_until_done(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if not self.has_work():
                return
            self.step()

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        sps = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, sps)]
        self.run_until_done()
        return [self.seqs[i].output for i in ids]

    # -- observation ----------------------------------------------------------------------------
    def snapshot(self, tables: str | set[int] = "auto", timeout: float | None = None):
        return self.telemetry.snapshot(tables, timeout)

    def take_events(self) -> list[Event]:
        return self.telemetry.take_events()

    def cuda_memory(self) -> tuple[int, int]:
        """torch's CUDA allocator: (allocated, reserved) bytes on the engine's device."""
        return torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)

    def owners(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for s in self.seqs.values():
            for lid in s.blocks:
                out[lid] = out.get(lid, 0) + 1
        return out

    def check_invariants(self) -> None:
        with self.lock:
            self.pool.check(self.owners())
            for s in self.seqs.values():
                assert len(s.tokens) == len(s.pos), f"seq {s.id}: tokens/positions out of step"
                if s.done:
                    assert not s.blocks, f"finished seq {s.id} holds blocks"
                    continue
                assert len(s.blocks) == blocks_for(s.num_cached, self.config.block_size) or s.state == SeqState.RUNNING, (
                    f"seq {s.id}: {len(s.blocks)} blocks for {s.num_cached} cached tokens")
                assert len(s.blocks) == len(s.hashes)
