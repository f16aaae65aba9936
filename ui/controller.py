"""What the window asks of whatever stands behind it (`Controller`), and a saved snapshot behind it.

The window (ui/main_window.py) and its Controls panel (ui/panels/controls.py) never touch an engine: they read
snapshots and events from a controller and send it commands. Two controllers answer: the live engine's runner
(app/window/runner.py `EngineRunner`: commands run on the engine thread between two steps) and a saved snapshot
(`SnapshotController`: read-only, every command refused or ignored). No Qt here.
"""

from __future__ import annotations

from typing import Any, Protocol

from engine.config import CacheConfig
from engine.errors import ConfigError, RequestError
from engine.telemetry.snapshot import Snapshot
from engine.telemetry.snapshotter import Event
from ui.charts.rates import SavedRates


class Controller(Protocol):
    """The window's side of a controller. A controller may also have `rates` (the charts' rate lines, drawn as
    they are), `extra` (a saved snapshot's caption and other extras) and `what_if()` (the What if tab's service);
    the window looks for each and goes without it."""

    read_only: bool  # a saved snapshot: every control is disabled
    engine_paused: bool

    def snapshot(self, tables: str | set[int] = "auto", wait: bool = True) -> Snapshot | None:
        """The engine's state now ("all", a set of sequence ids, or "auto": which block lists to include);
        wait=False: the last one rather than wait on a busy engine (None before the first)."""
        ...

    def take_events(self) -> list[Event]:
        """The events since the last call."""
        ...

    def take_tokens(self) -> list[tuple[int, str]]:
        """(sequence id, text) of the prompt replies streamed since the last call."""
        ...

    def config(self) -> CacheConfig: ...

    def is_lossy(self, changes: dict[str, Any]) -> bool:
        """Whether applying these knob changes (name -> value, as reconfigure takes them) re-encodes stored K/V
        with less precision; False for a change reconfigure would refuse."""
        ...

    def reconfigure(self, **changes: Any) -> CacheConfig:
        """The config with `changes` applied; ConfigError with the reason if refused (nothing changed)."""
        ...

    def submit_prompt(self, text: str, chat: bool, max_new_tokens: int) -> int:
        """The new sequence's id; RequestError if it cannot run."""
        ...

    def pause_engine(self, paused: bool) -> None: ...

    def step_once(self) -> None: ...

    def set_workload_paused(self, paused: bool) -> None: ...

    def set_intensity(self, x: float) -> None: ...

    def workload_name(self) -> str: ...

    def replay_trace(self, path: str) -> str:
        """Replay the JSONL request trace at path instead of the workload; its name, or RequestError."""
        ...

    def use_demo_workload(self) -> None: ...

    def start_trace(self) -> None:
        """Record every block read from now on."""
        ...

    def stop_trace(self, path: str) -> int:
        """Stop recording and save the reads to path ("": discard them); how many were saved."""
        ...


class SnapshotController(Controller):
    """A saved snapshot behind the same interface as the live engine runner (read-only)."""

    read_only = True
    engine_paused = True

    def __init__(self, snap: Snapshot, extra: dict):
        self.snap, self.extra = snap, extra
        # Files from before the window saved its rates have none: the charts rebuild them from the engine's series.
        self.rates = SavedRates(extra["rates"]) if extra.get("rates") else None

    def snapshot(self, tables: str | set[int] = "auto", wait: bool = True) -> Snapshot:
        return self.snap

    def take_events(self) -> list[Event]:
        return []

    def take_tokens(self) -> list[tuple[int, str]]:
        return []

    def config(self) -> CacheConfig:
        return CacheConfig(**{k: v for k, v in self.snap.config.items()})

    def is_lossy(self, changes: dict[str, Any]) -> bool:
        return False

    def reconfigure(self, **changes: Any) -> CacheConfig:
        raise ConfigError("a saved snapshot is read-only")

    def submit_prompt(self, text: str, chat: bool, max_new_tokens: int) -> int:
        raise RequestError("a saved snapshot is read-only")

    def pause_engine(self, paused: bool) -> None: ...

    def step_once(self) -> None: ...

    def set_workload_paused(self, paused: bool) -> None: ...

    def set_intensity(self, x: float) -> None: ...

    def workload_name(self) -> str:
        saved = self.extra.get("workload")
        return f"{saved} (saved)" if saved else "not saved"

    def replay_trace(self, path: str) -> str:
        raise RequestError("a saved snapshot is read-only")

    def use_demo_workload(self) -> None: ...

    def start_trace(self) -> None: ...

    def stop_trace(self, path: str) -> int:
        return 0
