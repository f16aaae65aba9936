"""A recorded or hand-written request trace (JSONL, the `bench --trace` format), replayed live in the window
in place of the demo workload: the user's own traffic, at its own arrival times, looping so the cache stays
busy while the knobs are tuned.

The file is read twice, lazily, as `generate --prompt-file` reads its own: once when the workload is made,
to check every line (its shape, and whether this engine would take the request: token ids in the vocabulary,
a prompt within the context limit and the tiers), and then a round at a time, streamed, with at most WINDOW
requests in the engine or waiting for their turn; memory does not grow with the file. A line that fails the
check is named, skipped and counted (`skipped`, which the window's runner says on stderr, and the Events
panel); only a trace with no request left to replay is refused. A trace out of arrival order is held in memory,
sorted, as `bench --trace` holds it."""

from __future__ import annotations

import os
from typing import Iterator

from engine.errors import RequestError
from engine.workloads.prompts import RequestCheck
from engine.workloads.replay import Replay, RunResult
from engine.workloads.requests import Request, read_trace
from engine.workloads.workload import check_intensity

MAX_STEP_S = 1.0
WINDOW = 64  # requests in the engine or waiting for their turn at once (generate --prompt-file's window)
SHOWN = 10  # skipped lines named one by one on stderr and in the events; the rest are counted


def check_trace_file(path: str) -> None:
    """Refuse (RequestError, naming the file's first problem) a trace of which no line passes the checks that
    need no model, so that a command can refuse it before loading one. Reads up to the first good line."""
    bad, first = 0, None
    try:
        for number, r in read_trace(path):
            if not isinstance(r, str):
                return
            bad += 1
            first = first or f"{path}:{number}: {r}"
    except ValueError as e:  # the file itself: not a regular file, too large
        raise RequestError(str(e)) from None
    if first is None:
        raise RequestError(f"{path}: no requests in the trace")
    raise RequestError(first + (f" (and {bad - 1:,} more lines that cannot run)" if bad > 1 else ""))


class TraceWorkload:
    """A `Workload` (workload.py), as the demo is: `tick(now)` and `observe(outs)` on the engine thread around
    each step; `paused`, `set_intensity` and `stats()` from any thread; `close()` when replaced.

    Intensity scales the trace's clock (2.0 replays it twice as fast). A round ends when every request has
    finished or been refused; the next round starts at once with fresh sessions. `skipped` names the lines
    refused when the file was read (the first SHOWN of them; `n_skipped` counts all).
    """

    def __init__(self, engine, path: str, cap: int | None = None):
        self.engine = engine
        self.path = path
        self.name = os.path.basename(path)
        self.cap = cap
        self.skipped: list[str] = []
        self.n_skipped = 0
        self._bad: set[int] = set()  # line numbers the check refused, skipped in every round
        self._held: list[Request] | None = None  # the requests, sorted, if the file is out of arrival order
        self.n_requests = self._check(RequestCheck(engine, cap))
        self._paused = False
        self._intensity = 1.0
        self.rounds = 0
        self._totals = {"requests": 0, "finished": 0, "refused": 0, "forked": 0}
        self._vt = 0.0  # trace seconds replayed in this round
        self._last: float | None = None
        self._replay: Replay | None = None
        self._result: RunResult | None = None
        self._reported = False  # the skipped lines, and the first round's refusals, are events once
        self._refusals_seen = 0

    def _check(self, check: RequestCheck) -> int:
        good, last, in_order = 0, 0.0, True
        try:
            for number, r in read_trace(self.path):
                problem = r if isinstance(r, str) else check.refusal(r)
                if problem is not None:
                    self._bad.add(number)
                    self.n_skipped += 1
                    if len(self.skipped) < SHOWN:
                        self.skipped.append(f"{self.path}:{number}: {problem}")
                    continue
                good += 1
                in_order = in_order and r.arrival_s >= last
                last = r.arrival_s
        except ValueError as e:  # the file itself: not a regular file, too large, grown past the cap
            raise RequestError(str(e)) from None
        if not good:
            if self.skipped:
                more = f" (and {self.n_skipped - 1:,} more lines that cannot run)" if self.n_skipped > 1 else ""
                raise RequestError(f"{self.skipped[0]}{more}; nothing to replay")
            raise RequestError(f"{self.path}: no requests in the trace")
        if not in_order:
            self._held = sorted(self._requests(), key=lambda r: r.arrival_s)
        return good

    def _requests(self) -> Iterator[Request]:
        """The requests that passed the check, read from the file again (or held, sorted). A line changed since
        is skipped too."""
        if self._held is not None:
            yield from self._held
            return
        try:
            for number, r in read_trace(self.path):
                if number not in self._bad and not isinstance(r, str):
                    yield r
        except ValueError:
            return  # the file was replaced by one that cannot be read: this round ends early

    # -- knobs (any thread) ---------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        return self._paused

    @paused.setter
    def paused(self, value: bool) -> None:
        """While paused (no ticks come) the trace's clock stands still; it resumes where it stopped."""
        if self._paused and not value:
            self._last = None
        self._paused = bool(value)

    @property
    def intensity(self) -> float:
        return self._intensity

    def set_intensity(self, value: float) -> None:
        self._intensity = check_intensity(value)

    def stats(self) -> dict[str, int]:
        out = dict(self._totals)
        r = self._result
        if r is not None:
            out["finished"] += r.finished
            out["refused"] += len(r.refused)
            out["forked"] += r.forked
        out["rounds"] = self.rounds
        out["live"] = len(self._replay.live) if self._replay is not None else 0
        out["skipped_lines"] = self.n_skipped
        return out

    @property
    def refusals(self) -> list[str]:
        return list(self._result.refused) if self._result is not None else []

    # -- the engine thread ----------------------------------------------------------------------
    def tick(self, now: float) -> None:
        if not self._reported:
            self._reported = True
            for line in self.skipped:
                self.engine.telemetry.emit("error", message=f"{line} (skipped)")
            if self.n_skipped:
                self.engine.telemetry.emit("error", message=f"{self.path}: {self.n_skipped:,} lines skipped, "
                                                            f"{self.n_requests:,} replayed")
        if self._replay is not None and not self.engine.has_work():
            self._replay.reap(self._result)
        if self._replay is None or self._replay.done:
            self._new_round()
        if self._last is None:
            self._last = now
        # At most MAX_STEP_S of trace time per tick: a paused engine (no ticks) does not bring a burst of
        # every arrival it missed when it resumes.
        self._vt += min(max(0.0, now - self._last), MAX_STEP_S) * self._intensity
        self._last = now
        self._replay.feed(self._vt, self._result)
        self._report_refusals()

    def observe(self, outs) -> None:
        if self._replay is not None:
            self._replay.observe(outs, self.engine.clock(), self._result)

    def close(self) -> None:
        """Cancel this replay's live sequences (the workload is being replaced)."""
        if self._replay is None:
            return
        for sid in list(self._replay.live):
            seq = self.engine.seqs.get(sid)
            if seq is not None and not seq.done:
                self.engine.cancel(sid)
        self._replay.live.clear()

    def _report_refusals(self) -> None:
        """The first round's refusals when a request started (a later turn past the context limit, say), as
        events: each of the first SHOWN, once."""
        refused = self._result.refused
        if self.rounds == 1:
            while self._refusals_seen < min(len(refused), SHOWN):
                self.engine.telemetry.emit("error", message=f"refused: {refused[self._refusals_seen]}")
                self._refusals_seen += 1

    def _new_round(self) -> None:
        r = self._result
        if r is not None:
            self._totals["finished"] += r.finished
            self._totals["refused"] += len(r.refused)
            self._totals["forked"] += r.forked
        self.rounds += 1
        self._totals["requests"] += self.n_requests
        self._vt = 0.0
        self._result = RunResult(self.name, None, self.n_requests)
        self._replay = Replay(self.engine, self._requests(), 1.0, self.cap, self.engine.clock, window=WINDOW,
                              source=self.path)

