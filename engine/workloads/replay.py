"""One replay: feed a request list to a fresh engine by arrival time and record what each step produced.

A request enters the engine once its (scaled) arrival time has passed on the engine clock. That clock is real
time plus the idle gaps it skipped: when the engine has nothing to do before the next arrival, time jumps there
instead of sleeping, so an idle user still ages past demote_after_s but the wait costs no wall time.

Every request generates exactly its max_new_tokens (EOS ignored), so every config does the same work and
throughputs compare. A later turn of a session waits for the reply before it, then arrives as a new request
whose prompt is the conversation so far (its blocks come back through the prefix cache). A fork `seq_cp`s
its parent once the parent has its first token, or runs as a plain request if the parent has finished.

The requests may be any iterable in arrival order, pulled one at a time as they arrive (a trace streamed from
its file); with a `window`, at most that many are in the engine or waiting for their turn at once. A request
the engine refuses (when it arrives, or when the trace is read: `RequestCheck.refusal`, prompts.py) is listed in
`RunResult.refused` with its trace line and why; one the engine aborts, likewise.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from engine.workloads.prompts import RequestCheck

RESIDENCY = ("reuse_gap", "age_at_hit", "age_at_eviction", "lifetime")


class ReplayClock:
    """The engine clock of a replay: real time plus the idle gaps skipped."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    def skip(self, seconds: float) -> None:
        self.offset += max(0.0, seconds)


@dataclass
class RunResult:
    label: str
    config: object
    requests: int
    finished: int = 0
    forked: int = 0  # forks served by seq_cp of a live parent
    refused: list[str] = field(default_factory=list)
    generated: int = 0
    wall_s: float = 0.0
    idle_skipped_s: float = 0.0  # engine-clock time jumped over while nothing was running (costs no wall time)
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    peak_device_bytes: int = 0
    peak_host_bytes: int = 0
    counters: dict = field(default_factory=dict)
    residency: dict[str, np.ndarray] = field(default_factory=dict)
    live_change: dict | None = None  # with a LiveChange: the split at its step and what the change held
    health: dict = field(default_factory=dict)  # Engine.health() at the end of the run


@dataclass(frozen=True)
class LiveChange:
    """Reconfigure the running engine once it has run `at_step` steps (`changes` empty: only mark the split, the
    control run of an A/B). The prefix hit rate is then counted apart before and after that step."""

    at_step: int
    changes: dict


def where(r, source: str | None = None) -> str:
    """A request named for a message: "FILE:LINE (session 'a' at 0.5 s)", "line LINE (...)" without the file's
    name, or the session alone for a request that was not read from a file."""
    session = f"session {r.session!r} at {r.arrival_s:g} s"
    line = getattr(r, "line", None)
    if not line:
        return session
    return f"{source}:{line} ({session})" if source else f"line {line} ({session})"


class _Arrivals:
    """The requests yet to arrive, (arrival time, request) in order, pulled from an iterable one at a time."""

    def __init__(self, requests: Iterable, at):
        self._it, self._at = iter(requests), at
        self._next: tuple[float, object] | None = None
        self._pull()

    def _pull(self) -> None:
        r = next(self._it, None)
        self._next = None if r is None else (self._at(r), r)

    def __bool__(self) -> bool:
        return self._next is not None

    def first_at(self) -> float:
        return self._next[0]

    def pop(self):
        r = self._next[1]
        self._pull()
        return r


class Replay:
    """Feeds requests (in arrival order) to one engine by arrival time and records what each step produced."""

    def __init__(self, engine, requests: Iterable, time_scale: float, cap: int | None, clock: ReplayClock,
                 change: LiveChange | None = None, window: int | None = None, source: str | None = None):
        self.engine, self.clock = engine, clock
        self.change = change
        self.cap = cap
        self.window = window  # at most this many requests in the engine or waiting for their turn (None: any)
        self.source = source  # the trace's path, to name a refused request's line
        self.check = RequestCheck(engine, cap)
        self.fmt = self.check.fmt
        at = (lambda r: r.arrival_s / time_scale) if time_scale > 0 else (lambda r: 0.0)
        self._at = at
        self._now = 0.0  # seconds since the replay began, as of the last feed
        self.queue = _Arrivals(requests, at)  # in arrival order: load_trace and the generators sort
        self.ready: list = []  # arrived, waiting for their session's reply or their fork parent
        self.session_sid: dict[str, int | None] = {}  # session -> its latest sequence (None: refused)
        self.history: dict[str, list[int]] = {}  # session -> tokens so far, once its latest reply is done
        self.submitted: dict[int, float] = {}
        self.tokens_at: dict[int, list[float]] = {}
        self.live: set[int] = set()
        self._requests: dict[int, object] = {}  # live sid -> its request (to name it if the engine aborts it)

    # -- the loop --------------------------------------------------------------------------------
    def run(self, result: RunResult, on_progress) -> RunResult:
        e, clock = self.engine, self.clock
        t0, w0, skipped0 = clock(), time.perf_counter(), clock.offset
        while True:
            self.feed(clock() - t0, result)
            if e.has_work():
                outs = e.step()
                self.observe(outs, clock(), result)
                if self.change is not None and result.live_change is None and e.counters.steps >= self.change.at_step:
                    result.live_change = self._apply_change()
                pool = e.pool
                result.peak_device_bytes = max(result.peak_device_bytes, pool.tiers[0].used * pool.block_bytes)
                result.peak_host_bytes = max(result.peak_host_bytes, pool.tiers[1].used * pool.block_bytes)
            elif self.live and self.reap(result):
                pass  # nothing ran, yet some were live: the engine had ended them
            elif self.queue and not self._full():
                clock.skip(self.queue.first_at() - (clock() - t0))  # idle until the next arrival: jump there
            elif self.ready:
                self._submit_ready(result, force=True)  # nothing left to wait for
            else:
                break
            on_progress(result.finished + len(result.refused), time.perf_counter() - w0)
        result.wall_s = time.perf_counter() - w0
        result.idle_skipped_s = clock.offset - skipped0
        for sid, times in self.tokens_at.items():
            if times:
                result.ttft_s.append(times[0] - self.submitted[sid])
                result.itl_s.extend(np.diff(times).tolist())
        result.counters = e.counters.as_dict()
        result.health = e.health()  # the MemOS targets and checklist at the end (engine/telemetry/health.py)
        if result.live_change is not None:
            lc = result.live_change
            lc["prefix_after"] = _rate(e.counters.prompt_reused - lc.pop("_reused"),
                                       e.counters.prompt_tokens - lc.pop("_prompt"))
        result.residency = {k: np.asarray(e.telemetry.residency[k], dtype=np.float64) for k in RESIDENCY}
        return result

    def _apply_change(self) -> dict:
        """The split (and, unless a control, the change): prefix hits so far, and what the change held."""
        from engine.config import ConfigError

        e, c = self.engine, self.engine.counters
        out = {"at_step": c.steps, "changes": dict(self.change.changes), "error": None,
               "prefix_before": _rate(c.prompt_reused, c.prompt_tokens), "_reused": c.prompt_reused,
               "_prompt": c.prompt_tokens}
        if self.change.changes:
            try:
                e.reconfigure(**self.change.changes)
            except ConfigError as ex:
                out["error"] = str(ex)
            else:
                ev = next((x.fields for x in reversed(e.telemetry.events) if x.kind == "config"), {})
                out.update({k: ev[k] for k in ("peak_extra_bytes", "old_tier_bytes", "new_tier_bytes") if k in ev})
        return out

    def feed(self, now: float, result: RunResult) -> None:
        """Submit what has arrived by `now` (seconds since the replay began) and can start."""
        self._now = now
        while self.queue and self.queue.first_at() <= now and not self._full():
            self.ready.append(self.queue.pop())
        self._submit_ready(result, force=False)
        if self._full() and not self.live:  # every slot waits on a fork parent that has not arrived: go on
            self._submit_ready(result, force=True)

    def _full(self) -> bool:
        return self.window is not None and len(self.ready) + len(self.live) >= self.window

    def reap(self, result: RunResult) -> int:
        """Settle the live sequences the engine has ended without this replay seeing their last token: one that
        ran out of tokens finished; one aborted (or cancelled, or dropped) is listed as refused. How many."""
        n = 0
        for sid in list(self.live):
            seq = self.engine.seqs.get(sid)
            if seq is not None and not seq.done:
                continue
            n += 1
            if seq is not None and seq.finish_reason in ("eos", "length"):
                self._finished(sid, result)
                continue
            self.live.discard(sid)
            reason = (seq.error or seq.finish_reason) if seq is not None else "dropped by the engine"
            result.refused.append(f"{self._where(self._requests.pop(sid))}: aborted: {reason}")
        return n

    def observe(self, outs, t: float, result: RunResult) -> None:
        """Record one engine step's tokens (at time t) of this replay's sequences."""
        for out in outs:
            times = self.tokens_at.get(out.seq_id)
            if times is None:
                continue  # not ours (a prompt typed in the window)
            times.append(t)
            result.generated += 1
            if out.finished:
                self._finished(out.seq_id, result)

    @property
    def done(self) -> bool:
        return not (self.queue or self.ready or self.live)

    def _submit_ready(self, result: RunResult, force: bool) -> None:
        waiting, self.ready = self.ready, []
        for r in waiting:  # in order, so a session's later turn sees the earlier one just started
            if force or self._can_start(r):
                self._start(r, result)
            else:
                self.ready.append(r)

    def _can_start(self, r) -> bool:
        if r.fork_of is not None:
            if r.fork_of not in self.session_sid:
                return False  # the parent has not arrived (or is itself waiting)
            parent = self.session_sid[r.fork_of]
            return parent is None or parent not in self.live or bool(self.tokens_at[parent])
        return self.session_sid.get(r.session) not in self.live  # a later turn waits for the reply

    # -- requests --------------------------------------------------------------------------------
    def _where(self, r) -> str:
        return where(r, self.source)

    def _start(self, r, result: RunResult) -> None:
        from engine.errors import RequestError

        e = self.engine
        parent = self.session_sid.get(r.fork_of) if r.fork_of is not None else None
        try:
            if parent is not None and parent in self.live and self.tokens_at[parent]:
                sid = e.seq_cp(parent, self.check.sampling(r), label=r.session)
                result.forked += 1
            else:
                history = self.history.get(r.session) if r.kind == "turn" else None
                # A request that waited for nothing but the step to end arrived that long before it is added: the
                # engine's clock of its arrival (TTFT, and a trace's rerun: engine/lab/kv_replay.py). A later turn
                # or a fork arrives when what it waits for is done: now.
                waited = max(0.0, self._now - self._at(r)) if r.kind not in ("turn", "fork") else 0.0
                sid = e.add_request(self.check.prompt(r, history), self.check.sampling(r), label=r.session,
                                    waited_s=waited)
        except (RequestError, TypeError, ValueError) as ex:  # (a tokenizer that cannot take the text)
            self.session_sid[r.session] = None
            result.refused.append(f"{self._where(r)}: {ex}")
            return
        self.session_sid[r.session] = sid
        self.submitted[sid] = self.clock()
        self.tokens_at[sid] = []
        self.live.add(sid)
        self._requests[sid] = r

    def _finished(self, sid: int, result: RunResult) -> None:
        seq = self.engine.seqs[sid]
        self.live.discard(sid)
        self._requests.pop(sid, None)
        self.history[seq.label] = list(seq.tokens)  # prompt + reply (what a context shift kept)
        result.finished += 1


def _rate(hits: int, total: int) -> float:
    return hits / total if total else float("nan")


def replay(loaded, config, options, requests: list, label: str = "base", time_scale: float = 1.0,
           cap: int | None = None, on_progress=lambda done, elapsed: None, change: LiveChange | None = None) -> RunResult:
    """Replay `requests` on a fresh engine with `config`; raises ConfigError if the engine refuses the config."""
    from engine.runtime.engine import Engine

    gc.collect()  # an engine and its telemetry refer to each other: free the last run's pools and weights now
    clock = ReplayClock()
    engine = Engine(loaded, config, options, clock=clock)
    return Replay(engine, requests, time_scale, cap, clock, change).run(RunResult(label, config, len(requests)),
                                                                        on_progress)
