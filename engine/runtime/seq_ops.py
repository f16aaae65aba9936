"""The engine's sequences and what is done to them: the table of sequences (new, finish, keep, forget), llama.cpp's
operations (seq_rm, seq_add (K-shift), seq_div, seq_cp (fork), seq_keep), the context shift, and the lifecycle
calls (cancel, pause, resume, extend).

`SequenceOps` is handed its collaborators (the KV manager, the scheduler, the model for K-shifts, telemetry, the
clock, the options) and calls none of the engine. Callers hold the engine's lock (Engine's methods of the same
names take it); each operation works through the KV manager and the scheduler, and either completes or raises
RequestError with nothing changed.
"""

from __future__ import annotations

import collections

import torch

from engine.config import EngineOptions
from engine.errors import RequestError
from engine.kv.block_pool import Tier, blocks_for
from engine.kv.cache import KVCache
from engine.model.llama_family import LlamaFamily
from engine.runtime.clock import PausableClock
from engine.runtime.scheduler import Scheduler
from engine.sequence import SamplingParams, Sequence, SeqState
from engine.telemetry.snapshotter import Telemetry


class SequenceOps:
    def __init__(self, kv: KVCache, scheduler: Scheduler, model: LlamaFamily, telemetry: Telemetry,
                 clock: PausableClock, options: EngineOptions, context_limit: int, device: torch.device):
        self.kv = kv
        self.scheduler = scheduler
        self.model = model
        self.telemetry = telemetry
        self.clock = clock
        self.options = options
        self.context_limit = context_limit
        self.device = device
        self.seqs: dict[int, Sequence] = scheduler.seqs  # one table: the scheduler's queues hold its ids
        self.next_id = 0
        # Finished ids, oldest first: past options.keep_finished of them the oldest is forgotten.
        self.finished: collections.deque[int] = collections.deque()
        self.kept: set[int] = set()  # finished sequences a caller still has to read (see keep/forget)

    # -- the table ------------------------------------------------------------------------------
    def check_fits(self, prompt_len: int, max_new: int) -> None:
        """RequestError unless a sequence of prompt_len tokens generating max_new can ever be held."""
        bs = self.kv.config.block_size
        peak = min(prompt_len + max_new, max(self.context_limit, prompt_len))
        need = self.kv.blocks_at_peak(peak)  # per KV-cache group with several (engine/kv/cache.py)
        dev, host = self.kv.capacity(Tier.DEVICE), self.kv.capacity(Tier.HOST)
        if need > dev + host:  # blocks that do not fit the device tier are read from the host tier
            raise RequestError(
                f"request needs {need} blocks of {bs} tokens ({peak} tokens) but the device and "
                f"host tiers hold {dev} + {host}{self._groups_note()}; raise device_budget_mb or host_budget_mb, or "
                "shorten the prompt"
            )
        if prompt_len > self.context_limit:
            raise RequestError(f"prompt of {prompt_len} tokens exceeds the context limit of {self.context_limit}")

    def _groups_note(self) -> str:
        groups = getattr(self.kv, "groups", None)
        return f" (per KV-cache group: {', '.join(g.title for g in groups)})" if groups else ""

    def new_seq(self, tokens: list[int], sampling: SamplingParams, label: str) -> Sequence:
        sid = self.next_id
        self.next_id += 1
        seq = Sequence(id=sid, prompt_len=len(tokens), sampling=sampling, tokens=tokens, pos=list(range(len(tokens))),
                       arrival=self.clock(), label=label)
        if not sampling.greedy:
            g = torch.Generator(device="cpu")
            g.manual_seed(sampling.seed if sampling.seed is not None else sid)
            seq.rng = g
        self.seqs[sid] = seq
        return seq

    def finish(self, seq: Sequence, reason: str, now: float) -> None:
        """The sequence is done: out of the queues, its blocks released; forgotten once keep_finished newer ones
        have finished, unless kept."""
        seq.state = SeqState.FINISHED
        seq.finish_reason = reason
        seq.finished_at = now
        self.scheduler.remove(seq)
        self.kv.release(seq)
        self.telemetry.emit("finish", seq=seq.id, reason=reason, tokens=len(seq.output))
        if seq.id not in self.kept:
            self.finished.append(seq.id)
        while len(self.finished) > self.options.keep_finished:
            self.seqs.pop(self.finished.popleft(), None)

    # -- llama.cpp's operations -----------------------------------------------------------------
    def seq_rm(self, sid: int, p0: int, p1: int | None = None) -> None:
        """Remove the tokens whose positions are in [p0, p1) (p1 None: to the end)."""
        seq = self.live(sid)
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
        seq = self.live(sid)
        p1 = float("inf") if p1 is None or p1 < 0 else p1
        new = [q + delta if p0 <= q < p1 else q for q in seq.pos]
        self._reposition(seq, new)
        self.telemetry.emit("seq_add", seq=sid, p0=p0, delta=delta)

    def seq_div(self, sid: int, p0: int, p1: int | None, d: int) -> None:
        """Integer-divide positions in [p0, p1) by d (self-extend), re-rotating keys."""
        if d < 1:
            raise RequestError("seq_div needs d >= 1")
        seq = self.live(sid)
        p1 = float("inf") if p1 is None or p1 < 0 else p1
        new = [q // d if p0 <= q < p1 else q for q in seq.pos]
        self._reposition(seq, new)
        self.telemetry.emit("seq_div", seq=sid, p0=p0, d=d)

    def seq_cp(self, sid: int, sampling: SamplingParams | None = None, label: str = "") -> int:
        """Fork: a new sequence sharing every block (ref counts); copy-on-write at the first divergent write."""
        src = self.live(sid)
        dst = self.new_seq(list(src.tokens), sampling or src.sampling, label or f"fork of {sid}")
        dst.prompt_len = src.prompt_len
        dst.pos = list(src.pos)
        dst.repositioned = src.repositioned
        dst.output = list(src.output)
        self.kv.share(dst, src)
        dst.num_cached, dst.canonical = src.num_cached, src.canonical
        dst.first_token_at, dst.ttft = src.first_token_at, src.ttft
        if src.state == SeqState.RUNNING:
            self.scheduler.add_running(dst)
        else:
            self.scheduler.add(dst)
        self.telemetry.emit("seq_cp", seq=sid, new=dst.id, shared=len(dst.blocks))
        return dst.id

    def seq_keep(self, sid: int) -> None:
        """Drop every sequence but this one."""
        self.live(sid)
        for other in list(self.seqs.values()):
            if other.id != sid and not other.done:
                self.finish(other, "seq_keep", self.clock())

    # -- lifecycle --------------------------------------------------------------------------------
    def cancel(self, sid: int) -> None:
        self.finish(self.live(sid), "cancelled", self.clock())

    def pause(self, sid: int) -> None:
        seq = self.live(sid)
        self.scheduler.remove(seq)
        seq.state = SeqState.PAUSED
        self.telemetry.emit("pause", seq=sid)

    def resume(self, sid: int) -> None:
        seq = self.live(sid)
        if seq.state != SeqState.PAUSED:
            return
        self.scheduler.add(seq)
        self.telemetry.emit("resume", seq=sid)

    def extend(self, sid: int, tokens: list[int], max_new_tokens: int) -> None:
        """Append a new user turn to a finished or paused sequence and generate again (multi-turn chat)."""
        seq = self.seqs[sid]
        if seq.done:
            raise RequestError(f"sequence {sid} has finished and released its blocks")
        self.check_fits(len(seq.tokens) + len(tokens), max_new_tokens)
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
        self.kept.add(sid)

    def forget(self, sid: int) -> None:
        """Drop a finished sequence that keep() held."""
        self.kept.discard(sid)
        seq = self.seqs.get(sid)
        if seq is not None and seq.done:
            del self.seqs[sid]

    def live(self, sid: int) -> Sequence:
        seq = self.seqs.get(sid)
        if seq is None or seq.done:
            raise RequestError(f"no live sequence {sid}")
        return seq

    # -- re-laying a sequence's tail ----------------------------------------------------------------
    def context_shift(self, seq: Sequence) -> None:
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
        bs = self.kv.config.block_size
        now = self.clock()
        old_pos = seq.pos
        if new_pos is None:
            new_pos = [old_pos[i] + (deltas if deltas is not None and shift_from is not None and j >= shift_from else 0)
                       for j, i in enumerate(keep)]
        # The first kept index that differs from before: everything from there is rewritten.
        first = 0
        while first < len(keep) and keep[first] == first and new_pos[first] == old_pos[first]:
            first += 1
        b0 = first // bs
        cached_keep = [i for i in keep if i < seq.num_cached]
        # Refuse before touching anything if the re-laid tail cannot get blocks.
        need = blocks_for(max(len(cached_keep) - b0 * bs, 0), bs)
        if not self.kv.room_to_relay(seq, b0, need):
            raise RequestError(f"sequence {seq.id}: no room to re-lay {need} blocks (both tiers full of owned "
                               "blocks); nothing was changed")
        # Commit the token-level change, then the blocks: kept cached keys re-laid from block b0 on, those whose
        # position changed re-rotated (K-shift) with their layer's RoPE.
        seq.tokens = [seq.tokens[i] for i in keep]
        seq.pos = new_pos
        seq.repositioned = any(q != i for i, q in enumerate(new_pos))
        seq.canonical = min(seq.canonical, first)
        self.kv.relay(seq, keep, old_pos, new_pos, first, self.model.shift_keys, now)
