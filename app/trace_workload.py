"""A recorded or hand-written request trace (JSONL, the `bench --trace` format), replayed live in the window
in place of the demo workload: the user's own traffic, at its own arrival times, looping so the cache stays
busy while the knobs are tuned."""

from __future__ import annotations

import os

from app.replay import Replay, RunResult
from engine.demo_workload import check_intensity
from engine.errors import RequestError
from engine.workloads import load_trace


MAX_STEP_S = 1.0


class TraceWorkload:
    """Same interface as engine.demo_workload.DemoWorkload: `tick(now)` and `observe(outs)` on the engine thread
    around each step; `paused`, `set_intensity` and `stats()` from any thread; `close()` when replaced.

    Intensity scales the trace's clock (2.0 replays it twice as fast). A round ends when every request has
    finished or been refused; the next round starts at once with fresh sessions.
    """

    def __init__(self, engine, path: str, cap: int | None = None):
        try:
            self.requests = load_trace(path)
        except OSError as e:
            raise RequestError(f"{path}: {e.strerror or e}") from None
        except ValueError as e:
            raise RequestError(str(e)) from None
        if not self.requests:
            raise RequestError(f"{path}: no requests in the trace")
        self.engine = engine
        self.name = os.path.basename(path)
        self.cap = cap
        self._paused = False
        self._intensity = 1.0
        self.rounds = 0
        self._totals = {"requests": 0, "finished": 0, "refused": 0, "forked": 0}
        self._vt = 0.0  # trace seconds replayed in this round
        self._last: float | None = None
        self._replay: Replay | None = None
        self._result: RunResult | None = None

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
        return out

    @property
    def refusals(self) -> list[str]:
        return list(self._result.refused) if self._result is not None else []

    # -- the engine thread ----------------------------------------------------------------------
    def tick(self, now: float) -> None:
        if self._replay is None or self._replay.done:
            self._new_round()
        if self._last is None:
            self._last = now
        # At most MAX_STEP_S of trace time per tick: a paused engine (no ticks) does not bring a burst of
        # every arrival it missed when it resumes.
        self._vt += min(max(0.0, now - self._last), MAX_STEP_S) * self._intensity
        self._last = now
        self._replay.feed(self._vt, self._result)

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

    def _new_round(self) -> None:
        r = self._result
        if r is not None:
            self._totals["finished"] += r.finished
            self._totals["refused"] += len(r.refused)
            self._totals["forked"] += r.forked
        self.rounds += 1
        self._totals["requests"] += len(self.requests)
        self._vt = 0.0
        self._result = RunResult(self.name, None, len(self.requests))
        self._replay = Replay(self.engine, self.requests, 1.0, self.cap, self.engine.clock)
