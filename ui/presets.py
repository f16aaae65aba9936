"""A cache preset file: every knob's value and the health strip's targets, as TOML.

    # KV Scope cache preset
    block_size = 16
    kv_dtype = "fp32"
    ...

    # the health strip's targets, shares (0.75 = 75 %)
    [health]
    prefix_hit_rate = 0.75
    ...

Read with tomllib, written with tomli_w. No Qt here: the Controls panel (ui/panels/controls.py) picks the file, applies
the knobs through the engine (which checks them) and shows a `PresetError` as the one line it is.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from typing import Any

import tomli_w

from engine.telemetry.health import HealthTargets
from engine.user_file import UserFileError, read_bytes

MAX_BYTES = 2**20  # a regular file of at most 1 MiB (a FIFO would block the window, /dev/zero never end)
HEADER = "# KV Scope cache preset\n"
HEALTH_NOTE = "# the health strip's targets, shares (0.75 = 75 %)\n"


class PresetError(ValueError):
    """A preset that cannot be read, or whose [health] table is not targets; the message says why (without the
    file's path)."""


@dataclass(frozen=True)
class Preset:
    knobs: dict[str, Any]  # name -> value as the file writes it (a dtype by its name); the engine checks them
    targets: HealthTargets | None  # the [health] table; None where the file has none


def read_preset(path: str) -> Preset:
    """The preset at path; PresetError if it is not a small regular file of UTF-8 TOML, or its [health] table is
    not the strip's targets (checked here, before any knob is applied)."""
    try:
        data = tomllib.loads(read_bytes(path, MAX_BYTES, "a preset").decode("utf-8"))
    except (UserFileError, UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as e:
        why = (str(e).removeprefix(f"{path}: ") if isinstance(e, UserFileError) else
               "not TOML: nested too deeply" if isinstance(e, RecursionError) else str(e))
        raise PresetError(why) from None
    health = data.pop("health", None)
    if health is not None and not isinstance(health, dict):
        raise PresetError("health: expected a [health] table of targets")
    try:
        targets = None if health is None else HealthTargets.from_dict(health)
    except ValueError as e:
        raise PresetError(str(e)) from None
    return Preset(knobs=data, targets=targets)


def preset_text(knobs: dict[str, Any], targets: HealthTargets) -> str:
    """The TOML of a preset: the knobs (CacheConfig.as_dict: a dtype by its name), then the [health] table."""
    return HEADER + tomli_w.dumps(knobs) + "\n" + HEALTH_NOTE + tomli_w.dumps({"health": targets.as_dict()})


def write_preset(path: str, knobs: dict[str, Any], targets: HealthTargets) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(preset_text(knobs, targets))
