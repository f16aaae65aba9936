"""The engine: continuous batching over the paged, tiered block cache, with llama.cpp-style
sequence operations and live reconfiguration.

One way through a step: the scheduler (scheduler.py) picks the sequences and their token counts and,
through the KV manager's residency (engine/kv/manager.py, residency.py), makes their blocks resident; the model
runner (model_runner.py) turns that into tensors, runs the model and samples; the engine commits the tokens,
carries out what the scheduler's SchedulerOutput decided (context shifts, a stalled sequence), drains the pool's
queued events into telemetry and hands it a StepSample. Nothing below calls back up. The engine's sequence
operations are one-line calls into `self.ops` (seq_ops.py's SequenceOps, which owns the table of sequences);
re-laying the cache for a new geometry is engine/kv/relayout.py.

Threading: `step()` and the sequence operations run on one thread (the engine thread). Other threads
may call `submit()` (a command run between steps), `reconfigure()` (applied between two steps: it
waits for the step in flight, then applies or raises), `snapshot()` and `take_events()`.
Two locks: `lock` guards the engine's state and is released while the model runs; `step_lock` is held
for a whole step, so whatever takes it runs between two steps.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine.kv.block_pool import BlockPool, blocks_for
from engine.config import CacheConfig, ConfigError, EngineOptions, KVDtype, change_is_lossy
from engine.errors import RequestError
from engine.kv.cache import KVCache
from engine.kv.groups import kv_groups
from engine.kv.shape import KVShape
from engine.model.loader import LoadedModel
from engine.model.llama_family import LlamaFamily
from engine.runtime.bandwidth import peak_bandwidth, weight_bytes
from engine.runtime.model_runner import ModelRunner
from engine.runtime.scheduler import Scheduled, Scheduler, SchedulerOutput, Stall
from engine.runtime.seq_ops import SequenceOps
from engine.fidelity.shadow import Measured, Shadow
from engine.sequence import SamplingParams, Sequence, SeqState, check_token_ids
from engine.runtime.clock import PausableClock
from engine.telemetry.counters import Counters
from engine.telemetry.health import leak_input
from engine.telemetry.snapshot import Snapshot
from engine.telemetry.snapshotter import EngineState, Event, StepSample, Telemetry

__all__ = ["Engine", "TokenOut", "RequestError", "ConfigError"]


@dataclass(frozen=True)
class TokenOut:
    seq_id: int
    token: int
    finished: bool


class Engine:
    def __init__(self, model: LoadedModel, config: CacheConfig | None = None, options: EngineOptions | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.loaded = model
        self.spec = model.spec
        self.tokenizer = model.tokenizer
        self.options = options or EngineOptions()
        config = config or CacheConfig()
        config.validate()
        self.device = torch.device(self.options.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device cuda requested but torch sees no CUDA device")
        self.clock = PausableClock(clock)  # the engine's time: stands still while the engine is paused
        self.options.validate(self.spec.max_position_embeddings)
        self.context_limit = self.options.context_limit or self.spec.max_position_embeddings
        self.model = LlamaFamily(self.spec, model.weights, self.device, self.options.weights_dtype,
                                 context_limit=self.context_limit,  # the limit picks LongRoPE's factors (Phi-3)
                                 quant_activations=self.options.quant_activations)
        self.model.use_attention(self.options.attention)
        self.counters = Counters()
        self.runner = ModelRunner(self.model, self.device, self.options.max_batch, self.options.cuda_graphs,
                                  self.context_limit, self.counters)
        self.shadow = Shadow(self.model)  # lossless reference steps, sampled (engine/fidelity/shadow.py)
        self.lock = threading.RLock()
        self.step_lock = threading.RLock()
        # A step loop re-takes step_lock at once, and locks are not fair: a waiting reconfigure would starve.
        # Waiting changes are counted here, and step() lets them go first.
        self._turn = threading.Condition()
        self._changes_waiting = 0
        self.telemetry = Telemetry(self.counters, self.clock, str(self.device),
                                   self.cuda_memory if self.device.type == "cuda" else None)
        # Cache health (engine/telemetry/health.py): the lock's waits, a decode step's bytes against the peak.
        self.lock_waits = self.telemetry.health.locks
        self.telemetry.health.set_bandwidth(weight_bytes(self.model), *peak_bandwidth(self.device, self.model))
        self.seqs: dict[int, Sequence] = {}  # every sequence by id, finished ones until forgotten
        # KV-cache groups (engine/kv/groups.py): with full and sliding-window layers, a pool per attention type.
        shape = KVShape.of(self.spec)  # all the KV layer knows of the model
        self.kv_groups = kv_groups(shape, self.options.kv_groups)
        self.kv = KVCache(shape, self.device, config, self.telemetry, self.counters, self.kv_groups,
                          self.context_limit, self.options.max_batched_tokens)
        self.telemetry.health.titles = self.kv.titles
        self.scheduler = Scheduler(self.kv, self.seqs, self.options, self.telemetry, self.counters,
                                   self.context_limit)
        # The table's operations: llama.cpp's seq_* calls, the context shift, the lifecycle (engine/runtime/seq_ops.py)
        self.ops = SequenceOps(self.kv, self.scheduler, self.model, self.telemetry, self.clock, self.options,
                               self.context_limit, self.device)
        self._pending: collections.deque[Callable[[], None]] = collections.deque()
        self.eos = set(self.spec.eos_token_ids)
        self.runner.check_attention(self.pool)  # the attention self-check at start-up (engine/runtime/self_check.py)
        self._drain_pool_events()

    # -- views for callers (telemetry, tests, the window) --------------------------------------
    @property
    def config(self) -> CacheConfig:
        return self.kv.config

    @property
    def pool(self) -> BlockPool:
        return self.kv.pool

    @property
    def grouped(self) -> bool:
        """Whether some KV-cache group drops what left its window (a pool per attention type)."""
        return self.kv.grouped

    @property
    def trace(self):
        return self.kv.trace

    @property
    def waiting(self) -> collections.deque[int]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[int]:
        return self.scheduler.running

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], sampling: SamplingParams | None = None, label: str = "",
                    waited_s: float = 0.0) -> int:
        """A new sequence; `waited_s`: how long before now the request arrived (a driver that adds requests between
        steps says so), which its arrival time, TTFT and a trace's rerun count from."""
        sampling = sampling or SamplingParams()
        if not isinstance(waited_s, (int, float)) or isinstance(waited_s, bool) or not 0.0 <= waited_s < math.inf:
            raise RequestError(f"waited_s: {waited_s!r} must be a finite number of seconds >= 0")
        with self.lock:
            prompt_ids = self.check_request(prompt_ids, sampling)
            seq = self.ops.new_seq(prompt_ids, sampling, label)
            seq.arrival -= waited_s
            self.scheduler.add(seq)
            self.telemetry.emit("request", seq=seq.id, prompt_tokens=len(prompt_ids))
            return seq.id

    def check_request(self, prompt_ids, sampling: SamplingParams) -> list[int]:
        """The prompt as a list of ints if this engine can serve it now; else RequestError naming why."""
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
            raise RequestError("the prompt must be a non-empty list of token ids")
        check_token_ids(prompt_ids, self.spec.vocab_size)
        if not isinstance(sampling, SamplingParams):
            raise RequestError("sampling must be SamplingParams")
        bad = next((t for t in sampling.forced if t >= self.spec.vocab_size), None)
        if bad is not None:  # a forced token is fed back as the next input: it must embed
            raise RequestError(f"forced token {bad} is outside the vocabulary (0..{self.spec.vocab_size - 1})")
        self.check_fits(len(prompt_ids), sampling.max_new_tokens)
        return [int(t) for t in prompt_ids]

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """RequestError naming why a request of this many prompt and new tokens cannot fit this engine (its context
        limit, its budgets); the one fit rule every caller asks (SequenceOps.check_fits)."""
        self.ops.check_fits(prompt_len, max_new_tokens)

    # -- sequence operations (engine/runtime/seq_ops.py), under the lock, pool events drained after ---------
    def _op(self, fn, *args):
        with self.lock:
            try:
                return fn(*args)
            finally:
                self._drain_pool_events()

    def seq_rm(self, sid: int, p0: int, p1: int | None = None) -> None:
        """Remove the tokens whose positions are in [p0, p1) (p1 None: to the end)."""
        self._op(self.ops.seq_rm, sid, p0, p1)

    def seq_add(self, sid: int, p0: int, p1: int | None, delta: int) -> None:
        """Shift positions in [p0, p1) by delta, re-rotating the cached keys (K-shift)."""
        self._op(self.ops.seq_add, sid, p0, p1, delta)

    def seq_div(self, sid: int, p0: int, p1: int | None, d: int) -> None:
        """Integer-divide positions in [p0, p1) by d (self-extend), re-rotating keys."""
        self._op(self.ops.seq_div, sid, p0, p1, d)

    def seq_cp(self, sid: int, sampling: SamplingParams | None = None, label: str = "") -> int:
        """Fork: a new sequence sharing every block (ref counts); copy-on-write at the first divergent write."""
        return self._op(self.ops.seq_cp, sid, sampling, label)

    def seq_keep(self, sid: int) -> None:
        """Drop every sequence but this one."""
        self._op(self.ops.seq_keep, sid)

    def cancel(self, sid: int) -> None:
        self._op(self.ops.cancel, sid)

    def pause(self, sid: int) -> None:
        self._op(self.ops.pause, sid)

    def resume(self, sid: int) -> None:
        self._op(self.ops.resume, sid)

    def extend(self, sid: int, tokens: list[int], max_new_tokens: int) -> None:
        """Append a new user turn to a finished or paused sequence and generate again (multi-turn chat)."""
        self._op(self.ops.extend, sid, tokens, max_new_tokens)

    def keep(self, sid: int) -> None:
        """Keep this sequence in `seqs` after it finishes, whatever keep_finished says, until forget(sid):
        for a caller that reads its output later (only the newest keep_finished others are kept)."""
        self._op(self.ops.keep, sid)

    def forget(self, sid: int) -> None:
        """Drop a finished sequence that keep() held."""
        self._op(self.ops.forget, sid)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    def submit(self, fn: Callable[[], None]) -> None:
        """Run fn on the engine thread between steps."""
        with self.lock:
            self._pending.append(fn)

    def _apply_pending(self) -> None:
        while True:
            with self.lock_waits.held(self.lock):
                if not self._pending:
                    return
                fn = self._pending.popleft()
                fn()

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
            self._apply_config(new, changes)
        except ConfigError as e:
            self._drain_pool_events()  # an undone change takes its own back; what the undo lost is in the queue
            self.telemetry.emit("config_error", changes={k: _label(v) for k, v in changes.items()}, message=str(e))
            raise
        return new

    def is_lossy_change(self, changes: "dict | KVDtype | str") -> bool:
        """Whether applying `changes` (knob -> value; a bare dtype means {"kv_dtype": it}) can alter stored K/V."""
        if not isinstance(changes, dict):
            changes = {"kv_dtype": changes}
        return change_is_lossy(self.config, self.config.replace(**changes))

    def _apply_config(self, new: CacheConfig, changes: dict) -> None:
        """Under both locks. Raises ConfigError with the engine unchanged if the KV layer refuses the change."""
        old = self.config
        held = self.kv.apply_change(new, [s for s in self.seqs.values() if not s.done], self.clock())
        self._drain_pool_events()
        self.telemetry.emit("config", changes={k: _label(v) for k, v in changes.items()}, lossy=change_is_lossy(old, new),
                            summary=new.summary(), **held)

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[TokenOut]:
        with self._turn:
            self._turn.wait_for(lambda: self._changes_waiting == 0, timeout=5.0)
        with self.step_lock:
            return self._step()

    def _step(self) -> list[TokenOut]:
        self._apply_pending()
        with self.lock_waits.held(self.lock):
            t0 = time.perf_counter()
            now = self.clock()
            self.kv.residency.demote_idle(now)
            self.scheduler.admit(now)
            plan = self.scheduler.schedule(now)
            sched = plan.batch
            if not sched:
                self._carry_out(plan, self.scheduler.watch_progress([], now), now)
                self._drain_pool_events()
                return []
            if self.kv.trace is not None:  # the step's clock and work, for a rerun of the trace (engine/lab/kv_replay.py)
                self.kv.trace.step(now, sum(n for _, n in sched), len(sched))
            run, writes = self.runner.prepare(self.kv, sched)
            t1 = time.perf_counter()
        logits = run()
        shadow = self.shadow.pick(sched, logits, now, self.config.shadow_every_s)
        with self.lock_waits.held(self.lock):
            t2 = time.perf_counter()
            outs = self._commit(sched, writes, self.runner.sample(sched, logits))
            t3 = time.perf_counter()
            self.counters.forward_s += t2 - t1
            self.counters.bookkeeping_s += (t1 - t0) + (t3 - t2)
            self.counters.steps += 1
            self._carry_out(plan, self.scheduler.watch_progress(sched, now), now)
            self._drain_pool_events()
            self.telemetry.after_step(StepSample(
                now, self.kv.device_bytes(), self.kv.host_bytes(), step_s=time.perf_counter() - t0,
                decode=all(n == 1 for _, n in sched), batch=len(sched), waiting=len(self.waiting),
                pools=tuple((p, reads[0]) for _, p, reads in self.kv.snapshot_groups())
                or ((self.pool, self.counters.read_tokens),)))
        measured = self.shadow.measure(shadow)  # outside the lock: snapshots go on meanwhile
        if measured is not None:
            with self.lock:
                self._record_shadow(measured)
        return outs

    def _record_shadow(self, m: Measured) -> None:
        if m.error:
            self.telemetry.emit("error", seq=m.pick.seq_id, message=m.error)
            return
        self.counters.count_shadow(m.kld, m.flip, m.logit_err, m.cost_s)
        self.telemetry.shadow_point(*self.shadow.record(m, self.config.kv_dtype.label))

    def _drain_pool_events(self) -> None:
        """Under the lock: the pool's queued events into telemetry's counters and feed; the self-checks' verdicts
        recorded, each feature's first failure said once (engine/runtime/self_check.py)."""
        checks = self.runner.checks
        self.telemetry.pool_events(checks.absorb(self.kv.take_events()))
        for v in checks.take_failures():
            self.telemetry.emit("self_check", feature=v.feature, message=v.message(), detail=v.detail,
                                fallback=v.fallback)

    def _carry_out(self, plan: SchedulerOutput, stall: Stall | None, now: float) -> None:
        """What the scheduler decided beyond the batch, after the step: context shifts, then a stalled sequence."""
        for seq in plan.to_shift:
            if seq.state != SeqState.RUNNING or len(seq.tokens) <= self.context_limit:
                continue  # preempted or finished since
            try:
                self.ops.context_shift(seq)
            except RequestError:  # no room to re-lay its tail while others share it: recompute it later
                self.scheduler.preempt(seq, now, recompute=True)
        if stall is not None and not stall.seq.done:
            stall.seq.error = stall.message
            self.ops.finish(stall.seq, "stalled", now)

    def _commit(self, sched: Scheduled, writes, tokens: list[int]) -> list[TokenOut]:
        """The step's K/V are in their blocks: advance each sequence, append its sampled token, finish it."""
        now = self.clock()
        self.kv.commit_step(*writes)
        touched = []
        outs = []
        for (seq, n), tok in zip(sched, tokens):
            old = seq.num_cached
            seq.num_cached += n
            if seq.num_cached > seq.canonical and seq.canonical == old and seq.pos[old:seq.num_cached] == list(
                    range(old, seq.num_cached)):
                seq.canonical = seq.num_cached
            self.kv.hash_full_blocks(seq, old)
            touched.append(seq)
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
                self.ops.finish(seq, "eos" if tok in self.eos else "length", now)
            outs.append(TokenOut(seq.id, tok, finished))
        self.kv.touch_seqs(touched, now)
        self.kv.trim(touched, now)  # window groups let go of blocks that left every window
        return outs

    # -- traces and the prefix cache --------------------------------------------------------------
    def start_trace(self) -> None:
        """Record every block read from now on (see engine/kv/access_trace.py)."""
        from engine.kv.access_trace import TraceRecorder

        with self.lock:
            # the sequences' tokens ride along, so the what-if curves can re-cut them (engine/lab/mrc.py)
            self.kv.trace = TraceRecorder(self.scheduler.seqs.get, self.config.block_size)
            self._trace_counts0 = self._rate_counts()
            self.telemetry.emit("trace", recording=True)

    def stop_trace(self, path: str | None = None):
        """Stop recording; save to path (.npz) if given; return the AccessTrace."""
        with self.lock:
            rec, self.kv.trace = self.kv.trace, None
        if rec is None:
            return None
        rec.meta = self.trace_meta()
        trace = rec.trace()
        if path:
            trace.save(path)
        self.telemetry.emit("trace", recording=False, rows=len(trace), path=path or "")
        return trace

    def trace_meta(self) -> dict:
        """What a trace carries of this engine (AccessTrace.meta): its knobs, the scheduling options a rerun of
        its requests needs, and the tiers' capacities in blocks (KV-cache group 0's)."""
        o = self.options
        sizes = self.pool.sizes
        return {"config": self.config.as_dict(),
                "options": {"max_batch": o.max_batch, "max_batched_tokens": o.max_batched_tokens,
                            "context_limit": self.context_limit, "n_keep": o.n_keep, "n_discard": o.n_discard},
                "capacity": {"device": int(sizes.dev_cap), "host": int(sizes.host_cap)},
                "grouped": bool(self.grouped),
                # what the rates the window charts count, over the recording (engine/telemetry/counters.py)
                "counts": {k: v - getattr(self, "_trace_counts0", {}).get(k, 0) for k, v in self._rate_counts().items()}}

    def _rate_counts(self) -> dict:
        c = self.counters
        return {"prompt_tokens": c.prompt_tokens, "prompt_reused": c.prompt_reused, "read_tokens": c.read_tokens,
                "read_tokens_missed": c.read_tokens_missed}

    def reset_prefix_cache(self) -> int:
        with self.lock:
            n = self.kv.reset_prefix_cache()
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
    def snapshot(self, tables: str | set[int] = "auto", timeout: float | None = None) -> Snapshot | None:
        """An immutable snapshot (engine/telemetry/snapshot.py). tables: which sequences' block lists (tier, slot)
        to include: "all", a set of ids, or "auto" (all while the tables hold at most AUTO_TABLES_MAX entries).

        timeout: wait at most this long for the engine lock (a step's bookkeeping, a context shift or a re-layout
        holds it) and return None if it stays busy; None waits as long as it takes."""
        if not self.lock_waits.acquire(self.lock, -1 if timeout is None else timeout, "snapshot"):
            return None
        try:
            self._drain_pool_events()
            return self.telemetry.snapshot(self._state(), tables)
        finally:
            self.lock.release()

    def memory(self) -> dict:
        """The memory breakdown a snapshot carries (per tier: K, V, scales, metadata; RSS, staging, GPU)."""
        with self.lock:
            return self.telemetry.memory(self._state())

    def cost_signals(self) -> dict[str, float]:
        """What a change costs (Telemetry.cost_signals): TTFT percentiles, queue lengths, traffic per token."""
        with self.lock:
            self._drain_pool_events()
            return self.telemetry.cost_signals(len(self.waiting), len(self.running))

    def _state(self) -> EngineState:
        """Under the lock: what a snapshot reads."""
        return EngineState(now=self.clock(), pool=self.pool, seqs=self.seqs, spec=self.spec, device=str(self.device),
                           context_limit=self.context_limit, waiting=len(self.waiting), running=len(self.running),
                           key_errors=self.runner.errors, shadow=self.shadow.last,
                           stream_staging_bytes=self.runner.stream.nbytes(), groups=self.kv.snapshot_groups(),
                           cache_config=self.config, self_checks=self.runner.checks.summary(),
                           weights=self.model.weights_format)

    def check_health(self) -> dict:
        """The ref-count leak check, now (engine/telemetry/health.py): the tables and counts are copied under the lock
        and compared outside it; a leak seen in two checks in a row is an error event. Returns the leaks summary."""
        with self.lock:
            held = leak_input([p for _, p, _ in self.kv.snapshot_groups()] or [self.pool], self.seqs)
        return self.telemetry.health.check_leaks(held)

    def health(self) -> dict:
        """The health figures now (Snapshot.health), after two leak checks (an idle engine's two are one state)."""
        self.check_health()
        self.check_health()
        with self.lock:
            self._drain_pool_events()
            return self.telemetry.health_summary(self.clock())

    def take_events(self) -> list[Event]:
        with self.lock:
            self._drain_pool_events()
        return self.telemetry.take_events()

    def cuda_memory(self) -> tuple[int, int]:
        """torch's CUDA allocator: (allocated, reserved) bytes on the engine's device."""
        return torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)

    def check_invariants(self) -> None:
        with self.lock:
            self.kv.check(self.seqs.values())
            for s in self.seqs.values():
                assert len(s.tokens) == len(s.pos), f"seq {s.id}: tokens/positions out of step"
                if s.done:
                    assert not s.blocks, f"finished seq {s.id} holds blocks"
                    continue
                want = blocks_for(s.num_cached, self.config.block_size) - s.base  # base: a window group's dropped
                assert len(s.blocks) == want or s.state == SeqState.RUNNING, (
                    f"seq {s.id}: {len(s.blocks)} blocks for {s.num_cached} cached tokens")
                assert len(s.blocks) == len(s.hashes)


def _label(value) -> str:
    """A knob value as events show it: a dtype by its name ("int8-kivi", not "6")."""
    return value.label if isinstance(value, KVDtype) else str(value)
