"""The scheduler: which sequences run in a step, and how many tokens each computes.

Admission in arrival order while the device tier has room for the blocks a sequence's first chunk writes;
decodes first, then prompt chunks (chunked prefill) within the step's token budget; room for each scheduled
sequence from idle sequences first, then by reading blocks on the host tier where they are and writing there
(a device tier smaller than a sequence still serves), then by preempting the newest running ones. It decides;
the KV manager moves blocks. It never touches the pool's arrays.

Progress: the oldest running sequence can always get every device block that no scheduled sequence holds
(idle sequences are demoted or dropped, newer running ones preempted), so some sequence advances each
step. Should nothing advance for `stall_steps` steps anyway, the newest stuck sequence is aborted with a
reason instead of spinning.
"""

from __future__ import annotations

import collections
from typing import Callable

from engine.config import EngineOptions
from engine.errors import RequestError
from engine.kv_manager import KVManager
from engine.sequence import Sequence, SeqState

Scheduled = list[tuple[Sequence, int]]  # (sequence, tokens it computes this step)


class Scheduler:
    def __init__(self, kv: KVManager, seqs: dict[int, Sequence], options: EngineOptions, telemetry, counters,
                 context_limit: int, shift: Callable[[Sequence], None], abort: Callable[[Sequence, str, float], None]):
        self.kv = kv
        self.seqs = seqs
        self.options = options
        self.telemetry = telemetry
        self.counters = counters
        self.context_limit = context_limit
        self.shift = shift  # context shift of a sequence at the limit (a sequence operation)
        self.abort = abort  # finish a sequence with a reason
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
        """Admit waiting sequences in order while the device tier has room for their first chunk.

        A waiting sequence holds no reference it took while waiting: its prefix match is looked up here
        and taken only at admission. (Refs held by a waiting sequence pin blocks that the running ones
        need, and then the queue's head is admitted and preempted forever.)
        """
        for sid in list(self.waiting):
            if len(self.active()) >= self.options.max_batch:
                return
            seq = self.seqs[sid]
            fresh = seq.num_cached == 0 and not seq.blocks
            match: tuple[list[int], list[int]] = ([], [])
            if fresh:
                if self._prefix_in_flight(seq):
                    continue  # a running prefill is computing this prompt's first block: reuse it next step
                match = self.kv.find_prefix(seq)
            cached = len(match[0]) * self.kv.config.block_size if fresh else seq.num_cached
            first = min(len(seq.tokens) - cached, self.options.max_batched_tokens)
            if not self.kv.fits_admission(seq, match[0], first) and self.active():
                return  # wait for room; running sequences will finish, shift or be preempted
            if fresh:
                self.kv.take_prefix(seq, *match, now)
            self.waiting.remove(sid)
            self.add_running(seq)

    def _prefix_in_flight(self, seq: Sequence) -> bool:
        """Another sequence is prefilling the same first block right now (its hash is not registered yet)."""
        bs = self.kv.config.block_size
        if len(seq.tokens) <= bs:
            return False
        head = seq.tokens[:bs]
        return any(o.num_cached < bs and o.tokens[:bs] == head and o.canonical == o.num_cached
                   for o in (self.seqs[r] for r in self.active()))

    # -- the step's batch ---------------------------------------------------------------------
    def schedule(self, now: float) -> Scheduled:
        """Pick (sequence, tokens to compute) for this step and make their blocks resident and writable."""
        budget = self.options.max_batched_tokens
        active = [self.seqs[s] for s in self.active()]
        active.sort(key=lambda s: (s.pending > 1, s.arrival))  # decodes first, then prompt chunks by arrival
        sched: Scheduled = []
        pinned: set[int] = set()  # blocks the sequences scheduled so far write into: they stay on the device
        for seq in active:
            if seq.state != SeqState.RUNNING:
                continue  # preempted while making room for an earlier one
            if len(seq.tokens) > self.context_limit:
                try:
                    self.shift(seq)
                except RequestError:  # no room to re-lay its tail now: wait, unchanged, until blocks free up
                    self.preempt(seq, now)
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
            self.kv.make_resident(seq, n, now, minimal)
            pinned.update(self.kv.written(seq).tolist())
            sched.append((seq, n))
            budget -= n if n > 1 else 0
            if budget <= 0 and n > 1:
                break
        return sched

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
        kv = self.kv
        if not kv.streams() and self._make_room(kv.room_needed(seq, n), now, keep, preempt=False):
            return n, False
        readers = [seq] + [s for s, _ in sched]
        need = kv.room_needed(seq, n, minimal=True)
        if self._make_room(need, now, keep, preempt=False) or kv.demote_unwritten(
                need, readers, pinned | set(kv.written(seq).tolist()), now):
            return n, True
        for m in _shorter(n):  # the device tier cannot take all the writes: the rest go to the host tier
            if kv.fits_anywhere(seq, m):
                return m, True
        m = 1 if n == 1 else min(n, kv.config.block_size)
        if self._make_room(kv.room_needed(seq, m, minimal=True), now, keep):
            return m, True
        return None

    def _make_room(self, need: int, now: float, keep: set[int], preempt: bool = True) -> bool:
        """Ensure `need` device slots are obtainable: from idle sequences, then by preempting running ones."""
        if self.kv.can_allocate(need):
            return True
        idle = [s for s in self.seqs.values()
                if s.id not in keep and not s.done and s.state != SeqState.RUNNING and s.blocks]
        if self.kv.reclaim(need, now, idle, [self.seqs[k] for k in keep]):
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

    def preempt(self, seq: Sequence, now: float) -> None:
        """Stop a running sequence; its blocks go to the host tier, or are dropped and recomputed later."""
        mode = self.kv.swap_out(seq, now)
        seq.preemptions += 1
        self.counters.preemptions += 1
        self.running.remove(seq.id)
        self.add(seq, front=True)
        self.telemetry.emit("preempt", seq=seq.id, mode=mode)

    # -- progress -----------------------------------------------------------------------------
    def watch_progress(self, sched: Scheduled, now: float) -> None:
        """Progress is a sequence passing the furthest point it ever reached (tokens generated, then cached)
        or finishing. After `stall_steps` steps without any, the newest stuck sequence is aborted with
        finish_reason "stalled" and an error event."""
        moved = False
        for seq, _ in sched:
            mark = (len(seq.output), seq.num_cached)
            if mark > seq.best or seq.done:
                seq.best = max(mark, seq.best)
                moved = True
        stuck = [s for s in self.seqs.values() if not s.done and s.state in (SeqState.WAITING, SeqState.RUNNING)]
        if moved or not stuck:
            self.stalled = 0
            return
        self.stalled += 1
        if self.stalled < self.options.stall_steps:
            return
        victim = max(stuck, key=lambda s: s.arrival)
        message = (f"sequence {victim.id} aborted: no sequence made progress in {self.stalled} steps "
                   f"({self.kv.describe()}); raise the budgets or send fewer or shorter requests")
        self.telemetry.emit("error", seq=victim.id, message=message)
        victim.error = message
        self.abort(victim, "stalled", now)
        self.stalled = 0


def _shorter(n: int):
    """n, then halves of it down to 1: a prompt chunk shortened until its blocks fit."""
    while n >= 1:
        yield n
        if n == 1:
            return
        n = max(1, n // 2)
