"""`Workload`: what drives a running engine from the engine thread, as the window's runner (app/window/runner.py) uses it.

On the engine thread, around each step: `tick(now)` before it (start what is due by the engine clock's `now`),
`observe(outs)` after it (that step's tokens), and `close()` once when the workload is replaced (its live
sequences are cancelled). From any thread: `name`, `paused` (no ticks come while it is set), `intensity` and
`set_intensity` (how fast requests arrive, within INTENSITY_RANGE), `stats()` (counters for the window).

`DemoWorkload` (demo.py) and `TraceWorkload` (trace_workload.py) are the two; a trace's whole-run replay for the
benches (`Replay`, replay.py) is what a `TraceWorkload` runs a round at a time.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

INTENSITY_RANGE = (0.1, 3.0)


def check_intensity(value: object) -> float:
    """A workload intensity as float, or ValueError naming the range."""
    lo, hi = INTENSITY_RANGE
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (lo <= value <= hi):
        raise ValueError(f"intensity: {value!r} is outside [{lo:g}, {hi:g}]")
    return float(value)


@runtime_checkable
class Workload(Protocol):
    name: str
    paused: bool

    @property
    def intensity(self) -> float: ...

    def set_intensity(self, value: float) -> None:
        """ValueError (check_intensity's) for a value outside INTENSITY_RANGE."""

    def stats(self) -> dict[str, int]: ...

    def tick(self, now: float) -> None: ...

    def observe(self, outs: list) -> None: ...

    def close(self) -> None: ...
