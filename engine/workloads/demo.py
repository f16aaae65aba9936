"""The live demo workload: `DemoWorkload` drives a running `Engine` from the engine thread.

Chat users sharing a system prompt, users who go idle past `demote_after_s` and come back, long documents,
a forked request and one long chat that reaches the context limit; prompts come from the built-in corpus
(engine/workloads/corpus.py).

This module does not import torch at load time (the engine it drives arrives as an object).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from engine.model.chat_format import ChatFormat
from engine.sequence import SamplingParams, SeqState, Sequence
from engine.workloads.corpus import STORIES, SYSTEM_SENTENCES, _follow_up, _message, _passage, _question
from engine.workloads.workload import check_intensity

if TYPE_CHECKING:
    from engine.runtime.engine import Engine


# -- the live demo ------------------------------------------------------------------------------

MAX_LIVE = 8  # live sequences (paused ones included) the demo keeps at most
_RATES = {"chat": 1 / 6, "document": 1 / 30, "nbest": 1 / 20, "long_chat": 1 / 15}  # arrivals per second at 1.0
# The opening minute is scripted so that every phenomenon shows within ~20 s: (seconds from start, kind).
_OPENING = ((0.0, "chat"), (0.0, "long_chat"), (0.6, "chat"), (1.2, "nbest"), (1.8, "chat"), (3.0, "document"))
_STEADY_AFTER_S = 10.0  # intensity-seconds before the random arrival streams start
_HEADROOM = 8  # extra max_new_tokens beyond a turn, so the engine never finishes a session on its own
_DOC_TOKENS = 320
_FORK_AFTER = 4  # tokens an nbest request generates before it is forked
_LONG_CHAT_SHIFTS = 2  # the long chat ends after this many context shifts
_STAT_OF = {"chat": "chats", "long_chat": "long_chats", "document": "documents", "nbest": "nbest"}
_REFUSED = object()  # what _call returns when the engine refuses a request


@dataclass
class _Session:
    kind: str  # "chat" | "long_chat" | "document" | "nbest" | "fork"
    sid: int
    turn_start: int = 0  # len(output) when the current turn began
    turn_len: int = 0  # tokens this turn generates before the user speaks again
    turns_left: int = 0  # user turns still to come
    return_at: float | None = None  # while paused: when the user comes back
    long_idle: bool = False  # the current idle is longer than demote_after_s
    idles: int = 0
    forked: bool = False
    shifts: int = 0  # seq.shifts already counted


class DemoWorkload:
    """A live, deterministic mix of requests that keeps the cache busy: a `Workload` (workload.py). `tick(now)`
    on the engine thread before each step; `intensity`, `paused` and `stats()` from any thread."""

    def __init__(self, engine: Engine, seed: int = 0, intensity: float = 1.0) -> None:
        self.engine = engine
        self.paused = False
        self._intensity = 1.0
        self.set_intensity(intensity)
        self._rng = random.Random(f"demo:{seed}")
        self._fmt = ChatFormat(engine.tokenizer)
        self._sessions: dict[int, _Session] = {}
        self._t0: float | None = None
        self._last = 0.0
        self._opening = list(_OPENING)
        self._countdown = {k: _STEADY_AFTER_S + self._rng.expovariate(r) for k, r in _RATES.items()}
        self._serial = {k: 0 for k in ("chat", "long_chat", "document", "nbest")}
        # Every key exists from the start, so stats() can copy the dict from another thread safely.
        self._stats = {k: 0 for k in ("requests", "chats", "long_chats", "documents", "nbest", "forks", "turns",
                                      "returns", "shifts", "ended", "refused")}
        self._system = self._fit_system(max(16, min(160, engine.context_limit // 4)))

    # -- knobs ----------------------------------------------------------------------------------
    @property
    def intensity(self) -> float:
        return self._intensity

    @intensity.setter
    def intensity(self, value: float) -> None:
        self.set_intensity(value)

    def set_intensity(self, value: float) -> None:
        self._intensity = check_intensity(value)

    def stats(self) -> dict[str, int]:
        out = dict(self._stats)
        out["live"] = len(self._sessions)
        return out

    name = "demo"

    def observe(self, outs) -> None:
        """Called with each step's tokens; the demo tends its sessions from the engine's state in tick()."""

    def close(self) -> None:
        """End every session (cancel its sequence): the workload is being replaced."""
        for s in list(self._sessions.values()):
            self._end(s)

    # -- the tick -------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        if self._t0 is None:
            self._t0 = self._last = now
        dt = max(0.0, now - self._last)
        self._last = now
        for session in list(self._sessions.values()):
            self._tend(session, now)
        if not self.paused:
            self._arrivals(now - self._t0, dt)

    def _live(self) -> int:
        return sum(1 for s in self.engine.seqs.values() if not s.done)

    def _arrivals(self, elapsed: float, dt: float) -> None:
        while self._opening and self._opening[0][0] <= elapsed and self._start(self._opening[0][1]):
            self._opening.pop(0)
        for kind, rate in _RATES.items():
            if kind == "long_chat" and any(s.kind == "long_chat" for s in self._sessions.values()):
                continue  # one long chat at a time; its clock waits meanwhile
            self._countdown[kind] -= dt * self._intensity
            if self._countdown[kind] <= 0 and self._start(kind):
                self._countdown[kind] = self._rng.expovariate(rate)

    def _start(self, kind: str) -> bool:
        """Start a session of this kind; False when there is no room now (the arrival waits)."""
        if self._live() + (2 if kind == "nbest" else 1) > MAX_LIVE:
            return False
        self._serial[kind] += 1
        ids, sampling, turn_len, turns_left = self._first_prompt(kind)
        label = f"{kind.replace('_', '-')}-{self._serial[kind]}"
        sid = self._call(lambda: self.engine.add_request(ids, sampling, label=label))
        if sid is _REFUSED:
            return True  # counted; the arrival is spent
        self._sessions[sid] = _Session(kind, sid, turn_len=turn_len, turns_left=turns_left)
        self._stats["requests"] += 1
        self._stats[_STAT_OF[kind]] += 1
        return True

    def _first_prompt(self, kind: str) -> tuple[list[int], SamplingParams, int, int]:
        """Prompt ids, sampling, first turn length and follow-up turns of a new session."""
        rng, fmt, limit = self._rng, self._fmt, self.engine.context_limit
        if kind == "document":
            n_body = max(8, min(_DOC_TOKENS, limit - 24 - len(fmt.first(None, []))))
            body = fmt.encode("Summarize this document in three sentences.\n\n" + _passage(rng, n_body))[:n_body]
            return fmt.first(None, body), SamplingParams(max_new_tokens=16), 0, 0
        if kind == "nbest":
            body = fmt.encode(f"{rng.choice(STORIES)}\n\nWrite an ending for this story.")
            # Plain temperature sampling: a top-p cut sorts the whole vocabulary at every step, which costs
            # more than the model's forward on CPU.
            sampling = SamplingParams(max_new_tokens=rng.randint(24, 32), temperature=0.8, seed=rng.randrange(2**31))
            return fmt.first(self._system, body), sampling, 0, 0
        if kind == "chat":
            ids = fmt.first(self._system, fmt.encode(_message(rng, rng.randint(0, 2) if limit >= 384 else 0)))
            turns_left = rng.randint(1, 3)
        else:  # long_chat: a first turn of about a third of the context, so that the next turns reach the limit
            question = fmt.encode(" " + _question(rng))
            room = limit - 1 - len(fmt.first(self._system, question))
            ids = fmt.first(self._system, fmt.encode(_passage(rng, limit // 2))[:max(0, min(room, limit // 3))]
                            + question)
            turns_left = 12
        turn_len = self._turn_len(kind)
        # Sessions ignore EOS and are paused by _tend at the end of each turn (at EOS or turn_len), so the
        # engine never finishes them and their blocks stay for the next turn.
        return ids, SamplingParams(max_new_tokens=turn_len + _HEADROOM, ignore_eos=True), turn_len, turns_left

    def _call(self, fn: Callable[[], Any]) -> Any:
        """fn(), or _REFUSED when the engine refuses it (counted)."""
        from engine.runtime.engine import RequestError  # lazy: keeps torch out of this module's import

        try:
            return fn()
        except RequestError:
            self._stats["refused"] += 1
            return _REFUSED

    def _turn_len(self, kind: str) -> int:
        if kind == "long_chat":
            return self._rng.randint(16, 24)
        return min(self._rng.randint(16, 32), max(8, self.engine.context_limit // 8))

    def _tend(self, s: _Session, now: float) -> None:
        seq = self.engine.seqs.get(s.sid)
        if seq is not None and seq.shifts > s.shifts:
            self._stats["shifts"] += seq.shifts - s.shifts
            s.shifts = seq.shifts
        if seq is None or seq.done:
            del self._sessions[s.sid]
            return
        if seq.state == SeqState.PAUSED:
            if s.return_at is not None and now >= s.return_at and not self.paused:
                self._next_turn(s, seq)
            return
        produced = len(seq.output) - s.turn_start
        if s.kind == "nbest" and not s.forked and produced >= _FORK_AFTER and not self.paused:
            self._fork(s, seq)
        if s.kind in ("chat", "long_chat") and produced > 0 and (
                produced >= s.turn_len or seq.output[-1] in self.engine.eos):
            self._end_turn(s, seq, now)

    def _fork(self, s: _Session, seq: Sequence) -> None:
        if seq.state != SeqState.RUNNING or self._live() >= MAX_LIVE:
            return
        s.forked = True
        sampling = SamplingParams(max_new_tokens=seq.sampling.max_new_tokens, temperature=0.8,
                                  seed=self._rng.randrange(2**31))
        sid = self._call(lambda: self.engine.seq_cp(s.sid, sampling, label=f"{seq.label}/fork"))
        if sid is not _REFUSED:
            self._sessions[sid] = _Session("fork", sid)
            self._stats["forks"] += 1

    def _end_turn(self, s: _Session, seq: Sequence, now: float) -> None:
        if s.turns_left <= 0 or (s.kind == "long_chat" and seq.shifts >= _LONG_CHAT_SHIFTS):
            self._end(s)
            return
        self.engine.pause(s.sid)
        demote = self.engine.config.demote_after_s
        s.long_idle = s.kind == "chat" and (s.idles == 0 or self._rng.random() < 0.5)
        if s.long_idle:
            gap = min(demote * self._rng.uniform(1.2, 1.6) + 0.5, 120.0)
        elif s.kind == "chat":
            gap = self._rng.uniform(0.5, 2.5)
        else:
            gap = self._rng.uniform(0.2, 1.0)
        s.idles += 1
        s.return_at = now + gap

    def _next_turn(self, s: _Session, seq: Sequence) -> None:
        fmt, limit = self._fmt, self.engine.context_limit
        ended_with = seq.output[-1] if seq.output and seq.output[-1] in self.engine.eos else None
        turn_len = self._turn_len(s.kind)
        if s.kind == "chat":
            ext = fmt.next_turn(fmt.encode(_follow_up(self._rng)), ended_with)
            if len(seq.tokens) + len(ext) + turn_len + _HEADROOM > limit:
                self._end(s)  # a short chat never shifts; the long chat is there for that
                return
        else:
            # Long user turns push the long chat past the context limit; the engine then shifts it.
            room = limit - len(seq.tokens) - len(fmt.next_turn([], ended_with))
            if room >= 4:
                ext = fmt.next_turn(fmt.encode(_passage(self._rng, limit // 2))[:min(room, limit // 3)], ended_with)
            elif len(seq.tokens) <= limit:
                ext = []  # no room for a user turn: the assistant goes on, past the limit
            else:  # it stopped just past the limit, before the engine could shift it; extend would refuse
                self._end(s)
                return
        if self._call(lambda: self.engine.extend(s.sid, ext, turn_len + _HEADROOM)) is _REFUSED:
            self._end(s)
            return
        s.turn_start, s.turn_len = len(seq.output), turn_len
        s.turns_left -= 1
        s.return_at = None
        self._stats["turns"] += 1
        if s.long_idle:
            self._stats["returns"] += 1

    def _end(self, s: _Session) -> None:
        self._sessions.pop(s.sid, None)
        seq = self.engine.seqs.get(s.sid)
        if seq is not None and not seq.done:
            self.engine.cancel(s.sid)
        self._stats["ended"] += 1

    def _fit_system(self, n_tokens: int) -> str:
        """The longest whole-sentence prefix of the system prompt within n_tokens (at least one sentence)."""
        text = SYSTEM_SENTENCES[0]
        for k in range(2, len(SYSTEM_SENTENCES) + 1):
            cand = " ".join(SYSTEM_SENTENCES[:k])
            if len(self._fmt.encode(cand)) > n_tokens:
                break
            text = cand
        return text
