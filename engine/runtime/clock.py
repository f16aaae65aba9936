"""The engine's clock."""

from __future__ import annotations

from typing import Callable


class PausableClock:
    """A clock that stops while paused: ages, idle times (the demotion rule) and heat decay count only running
    time, so the first step after a long pause does not find every block idle and demote it."""

    def __init__(self, base: Callable[[], float]):
        self.base = base
        self._held_at: float | None = None
        self._held = 0.0  # total time spent paused

    def __call__(self) -> float:
        t = self._held_at if self._held_at is not None else self.base()
        return t - self._held

    def pause(self) -> None:
        if self._held_at is None:
            self._held_at = self.base()

    def resume(self) -> None:
        if self._held_at is not None:
            self._held += self.base() - self._held_at
            self._held_at = None

    @property
    def paused(self) -> bool:
        return self._held_at is not None
