"""The scheduler: which sequences run in a step, and how many tokens each computes.

Admission in arrival order, counted in blocks over both tiers: a sequence is admitted only when the blocks it
still needs to reach its peak (prompt + max_new_tokens, or the context limit), with those every running sequence
was promised, fit what the two tiers can still give (free and cached blocks; blocks shared with a running
sequence count once). What does not fit waits, holding no block, and the queue's head blocks the rest (FIFO);
while others run it also waits for device-tier room for its first chunk. Then decodes first, then prompt chunks
(chunked prefill) within the step's token budget; room for each scheduled sequence from idle sequences first, then
by reading blocks on the host tier where they are and writing there (a device tier smaller than a sequence still
serves). It decides; the KV manager moves blocks. It never touches the pool's arrays, and it calls nothing back
in the engine: `schedule` returns a `SchedulerOutput` (the batch, and the sequences past the context limit that
the engine shifts after the step), `watch_progress` a `Stall` (a sequence for the engine to finish).

Progress: what running sequences were promised is always there, so every admitted sequence reaches its end
without preempting another. Only something admission did not weigh (a fork, a longer max_new_tokens, smaller
budgets, a re-lay) can break that promise; then idle sequences' K/V is dropped, then the newest running ones are
preempted (recomputed later) until it holds again. A request larger than both tiers is refused when it is added.
Should nothing advance for `stall_steps` steps anyway, the newest stuck sequence is aborted with a reason (what it
needs, what is free) instead of spinning.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable

from engine.kv.block_pool import blocks_for
from engine.config import EngineOptions
from engine.kv.cache import KVCache
from engine.sequence import Sequence, SeqState
from engine.telemetry.counters import Counters
from engine.telemetry.snapshotter import Telemetry

Scheduled = list[tuple[Sequence, int]]  # (sequence, tokens it computes this step)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's decisions, for the engine to carry out (the scheduler calls nothing back up in it)."""

    batch: Scheduled  # what runs this step: decodes first, then prompt chunks
    # Running sequences past the context limit, left out of this batch: the engine context-shifts them after the
    # step (a shift re-lays their tail into new blocks, which must not happen under this batch's placements);
    # they are scheduled in the next step. One the engine cannot shift it hands back to `preempt`.
    to_shift: tuple[Sequence, ...] = ()


@dataclass(frozen=True)
class Stall:
    """No sequence advanced for stall_steps steps: the engine finishes `seq` ("stalled") with `message` as its
    error (the error event is already emitted)."""

    seq: Sequence
    message: str


class Scheduler:
    def __init__(self, kv: KVCache, seqs: dict[int, Sequence], options: EngineOptions, telemetry: Telemetry,
                 counters: Counters, context_limit: int):
        self.kv = kv
        self.residency = kv.residency  # the same object for the engine's life (a re-lay swaps its pool)
        self.seqs = seqs
        self.options = options
        self.telemetry = telemetry
        self.counters = counters
        self.context_limit = context_limit
        self.waiting: collections.deque[int] = collections.deque()
        self.running: list[int] = []
        self.stalled = 0  # consecutive steps in which no sequence passed its furthest point

    # -- queues -------------------------------------------------------------------------------
    def add(self, seq: Sequence, front: bool = False) -> None:
        seq.state = SeqState.WAITING
        (self.waiting.appendleft if front else self.waiting.append)(seq.id)

    def add_running(self, seq: Sequence) -> None:
        seq.state = SeqState.RUNNING
        self.running.append(seq.id)

    def remove(self, seq: Sequence) -> None:
        if seq.id in self.running:
            self.running.remove(seq.id)
        if seq.id in self.waiting:
            self.waiting.remove(seq.id)

    def active(self) -> list[int]:
        return [s for s in self.running if self.seqs[s].state == SeqState.RUNNING]

    def has_work(self) -> bool:
        return bool(self.waiting or any(self.seqs[s].state == SeqState.RUNNING for s in self.running))

    # -- admission ----------------------------------------------------------------------------
    def admit(self, now: float) -> None:
        """Admit waiting sequences in order while the blocks they still need fit beside what the running ones were
        promised (and, while others run, the device tier has room for their first chunk); the first that does not
        fit waits, and so does everything behind it.

        A waiting sequence holds no reference it took while waiting: its prefix match is looked up here
        and taken only at admission. (Refs held by a waiting sequence pin blocks that the running ones
        need, and then the queue's head is admitted and preempted forever.)
        """
        self.keep_promise(now)
        promised = self.promised()
        for sid in list(self.waiting):
            if len(self.active()) >= self.options.max_batch:
                return
            seq = self.seqs[sid]
            fresh = seq.num_cached == 0 and not seq.blocks
            if fresh and self._prefix_in_flight(seq):
                continue  # a running prefill is computing this prompt's first block: reuse it next step
            if not self._fits(seq, fresh, promised):
                # Nothing running: only idle sequences' K/V stands in the way (the head fits both tiers alone:
                # refused when added otherwise); they recompute when they run again.
                if self.active() or not self._drop_idle(lambda: self._fits(seq, fresh, 0), spare=seq):
                    return  # wait: running sequences finish and give their blocks back
            match = self._find_prefix(seq, fresh)
            cached = len(match[0]) * self.kv.config.block_size if fresh else seq.num_cached
            first = min(len(seq.tokens) - cached, self.options.max_batched_tokens)
            if not self.kv.fits_admission(seq, match[0], first) and self.active():
                return  # wait for device room; running sequences will finish or shift
            if fresh:
                self.kv.take_prefix(seq, *match, now)
                self.kv.explain_misses(seq)
            self.waiting.remove(sid)
            self.add_running(seq)
            promised += self.kv.still_needs(seq, self.peak(seq))

    def _fits(self, seq: Sequence, fresh: bool, promised: int) -> bool:
        """What the sequence still needs to reach its peak (taking its cached prefix, if it holds no blocks) fits
        in the free blocks beside `promised` ones."""
        match = self._find_prefix(seq, fresh)[0] if fresh else None
        return promised + self.kv.still_needs(seq, self.peak(seq), match) <= self.kv.free_blocks()

    def peak(self, seq: Sequence) -> int:
        """Tokens the sequence holds K/V for at most before it finishes (as SequenceOps.check_fits counts them): its
        tokens plus those it may still generate, at most the context limit (a shift keeps it under)."""
        left = max(seq.sampling.max_new_tokens - len(seq.output), 0)
        return min(len(seq.tokens) + left, max(self.context_limit, len(seq.tokens)))

    def promised(self, running: list[Sequence] | None = None) -> int:
        """Blocks the running sequences still need to reach their peaks."""
        running = [self.seqs[s] for s in self.active()] if running is None else running
        return sum(self.kv.still_needs(s, self.peak(s)) for s in running)

    def _find_prefix(self, seq: Sequence, fresh: bool) -> tuple[list[int], list[int]]:
        """The cached prefix a sequence holding no blocks would take ([] for one holding blocks). One past the
        context limit is shifted before it computes: only the blocks the shift keeps (n_keep) are worth taking;
        the rest would be re-laid into fresh blocks while still held (by this or another sequence)."""
        if not fresh:
            return [], []
        limit = self.options.n_keep // self.kv.config.block_size if len(seq.tokens) > self.context_limit else None
        return self.kv.find_prefix(seq, limit)

    def keep_promise(self, now: float) -> None:
        """Restore `promised() <= free` where something admission did not weigh broke it (a fork of a running
        sequence, a longer max_new_tokens, smaller budgets, a re-lay): idle sequences' K/V is dropped first
        (coldest first), then the newest running sequences are preempted and recompute later. The oldest is never
        preempted here: alone it fits both tiers (checked when it was added, and at every budget change)."""
        running = sorted((self.seqs[s] for s in self.active()), key=lambda s: s.arrival)

        def kept() -> bool:
            return self.promised(running) <= self.kv.free_blocks()

        if kept() or self._drop_idle(kept):
            return
        while len(running) > 1 and not kept():
            self.preempt(running.pop(), now, recompute=True)

    def _drop_idle(self, fits: Callable[[], bool], spare: Sequence | None = None) -> bool:
        """Drop the K/V of sequences that hold blocks but are not running (paused, preempted), coldest first,
        until `fits()`; `spare` keeps its own."""
        active = set(self.active())
        idle = [s for s in self.seqs.values() if s.blocks and not s.done and s.id not in active and s is not spare]
        for seq in sorted(idle, key=self.residency.last_read):
            if fits():
                return True
            self.residency.drop_kv(seq)
            seq.preemptions += 1
            self.telemetry.emit("preempt", seq=seq.id, mode="recompute", reason="no room for the running sequences")
        return fits()

    def _prefix_in_flight(self, seq: Sequence) -> bool:
        """Another sequence is prefilling the same first block right now (its hash is not registered yet)."""
        bs = self.kv.config.block_size
        if len(seq.tokens) <= bs:
            return False
        head = seq.tokens[:bs]
        return any(o.num_cached < bs and o.tokens[:bs] == head and o.canonical == o.num_cached
                   for o in (self.seqs[r] for r in self.active()))

    # -- the step's batch ---------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        """Pick (sequence, tokens to compute) for this step and make their blocks resident and writable; name the
        sequences that need a context shift first."""
        budget = self.options.max_batched_tokens
        active = [self.seqs[s] for s in self.active()]
        active.sort(key=lambda s: (s.pending > 1, s.arrival))  # decodes first, then prompt chunks by arrival
        sched: Scheduled = []
        to_shift: list[Sequence] = []
        pinned: set[int] = set()  # blocks the sequences scheduled so far write into: they stay on the device
        for seq in active:
            if seq.state != SeqState.RUNNING:
                continue  # preempted while making room for an earlier one
            if len(seq.tokens) > self.context_limit:
                to_shift.append(seq)
                continue
            n = min(seq.pending, budget) if seq.pending > 1 else seq.pending
            if n <= 0:
                continue
            keep = {seq.id} | {s.id for s, _ in sched}
            placed = self._place(seq, n, now, keep, pinned, sched)
            if placed is None:
                self.preempt(seq, now)
                continue
            n, minimal = placed
            self.residency.make_resident(seq, n, now, minimal)
            pinned.update(self.residency.written(seq).tolist())
            sched.append((seq, n))
            budget -= n if n > 1 else 0
            if budget <= 0 and n > 1:
                break
        return SchedulerOutput(sched, tuple(to_shift))

    def _place(self, seq: Sequence, n: int, now: float, keep: set[int], pinned: set[int],
               sched: Scheduled) -> tuple[int, bool] | None:
        """(tokens, minimal) the sequence can compute this step with room made for them; None: preempt it.

        Every host block resident first (host_reads promote), with room from idle sequences; else (and always with
        host_reads stream or compute) only the blocks it writes, the rest read from the host tier where they are
        (streamed, or attended there), with room also from the device blocks that
        scheduled sequences (itself included) only read, moved to the host tier; else its writes go to host-tier
        blocks (a prompt chunk whose new blocks fit neither tier is shortened). Last, room from preempting newer
        running sequences. Nothing here preempts a sequence while the host tier can still serve it.
        """
        res = self.residency
        if not res.streams() and self._make_room(res.room_needed(seq, n), now, keep, preempt=False):
            return n, False
        readers = [seq] + [s for s, _ in sched]
        need = res.room_needed(seq, n, minimal=True)
        if self._make_room(need, now, keep, preempt=False) or res.demote_unwritten(
                need, readers, pinned | set(res.written(seq).tolist()), now):
            return n, True
        for m in _shorter(n):  # the device tier cannot take all the writes: the rest go to the host tier
            if res.fits_anywhere(seq, m):
                return m, True
        m = 1 if n == 1 else min(n, res.config.block_size)
        if self._make_room(res.room_needed(seq, m, minimal=True), now, keep):
            return m, True
        return None

    def _make_room(self, need: int, now: float, keep: set[int], preempt: bool = True) -> bool:
        """Ensure `need` device slots are obtainable: from idle sequences, then by preempting running ones."""
        if self.kv.can_allocate(need):
            return True
        idle = [s for s in self.seqs.values()
                if s.id not in keep and not s.done and s.state != SeqState.RUNNING and s.blocks]
        if self.residency.reclaim(need, now, idle, [self.seqs[k] for k in keep]):
            return True
        if not preempt:
            return False
        for sid in reversed(self.active()):  # newest first, never one already scheduled this step
            if sid in keep:
                continue
            self.preempt(self.seqs[sid], now)
            if self.kv.can_allocate(need):
                return True
        return self.kv.can_allocate(need)

    def preempt(self, seq: Sequence, now: float, recompute: bool = False) -> None:
        """Stop a running sequence; its blocks go to the host tier, or are dropped and recomputed later (always
        with `recompute`: blocks kept anywhere would still take the room it was stopped for)."""
        if recompute:
            self.residency.drop_kv(seq)
            mode = "recompute"
        else:
            mode = self.residency.swap_out(seq, now)
        seq.preemptions += 1  # the engine's counter counts the event (Telemetry.emit)
        self.running.remove(seq.id)
        self.add(seq, front=True)
        self.telemetry.emit("preempt", seq=seq.id, mode=mode)

    # -- progress -----------------------------------------------------------------------------
    def watch_progress(self, sched: Scheduled, now: float) -> Stall | None:
        """Progress is a sequence passing the furthest point it ever reached (tokens generated, then cached)
        or finishing. After `stall_steps` steps without any, the newest stuck sequence is named (a Stall, with
        an error event) for the engine to finish with finish_reason "stalled"."""
        moved = False
        for seq, _ in sched:
            mark = (len(seq.output), seq.num_cached)
            if mark > seq.best or seq.done:
                seq.best = max(mark, seq.best)
                moved = True
        stuck = [s for s in self.seqs.values() if not s.done and s.state in (SeqState.WAITING, SeqState.RUNNING)]
        if moved or not stuck:
            self.stalled = 0
            return None
        self.stalled += 1
        if self.stalled < self.options.stall_steps:
            return None
        victim = max(stuck, key=lambda s: s.arrival)
        bs = self.kv.config.block_size
        peak = self.peak(victim)
        message = (f"sequence {victim.id} aborted: no sequence made progress in {self.stalled} steps; it needs "
                   f"{blocks_for(peak, bs)} blocks of {bs} tokens at its peak ({peak} tokens), holds "
                   f"{len(victim.blocks)}; {self.kv.free_blocks()} are free and running sequences were promised "
                   f"{self.promised()} ({self.kv.describe()}); raise the budgets or send fewer or shorter requests")
        self.telemetry.emit("error", seq=victim.id, message=message)
        self.stalled = 0
        return Stall(victim, message)


def _shorter(n: int):
    """n, then halves of it down to 1: a prompt chunk shortened until its blocks fit."""
    while n >= 1:
        yield n
        if n == 1:
            return
        n = max(1, n // 2)
