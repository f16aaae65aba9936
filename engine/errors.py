"""Errors the engine raises for bad input. Torch-free, so the window can catch them by type."""

from __future__ import annotations

from engine.config import ConfigError


class RequestError(ValueError):
    """A request or sequence operation the engine cannot serve (e.g. it cannot fit); nothing was changed."""


__all__ = ["ConfigError", "RequestError"]
