"""What the "What if" tab draws, as plain data (no Qt): one KV-cache group's curves as a snapshot carries them.
app/whatif/worker.py's WhatIfResult extends it with every view computed; importing it pulls in no widget toolkit, so
the command-line benches that compute curves stay Qt-free."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ConfiguredPrediction:
    """The engine as configured, rerun on the trace at several device-tier capacities (engine/lab/kv_replay.py),
    calibrated so the recorded capacity gives the run's own rates. Per capacity (blocks, ascending): `hit_rate`, the
    share of counted first reads (each sequence's first read of a block) found on the device tier, what the curves
    count; `prefix_rate`, prompt tokens served from the prefix cache (the health strip's number and its 75 %
    target; a block found on the host tier counts); `device_rate`, keys attention read straight from the device
    tier (the hit-rate chart's blue line). `measured`: the recorded run's three rates (nan: not known)."""
    policy: str
    knobs: str  # the knobs it was rerun with (CacheConfig.summary without the budgets)
    recorded_capacity: int
    capacities: np.ndarray
    hit_rate: np.ndarray
    prefix_rate: np.ndarray
    device_rate: np.ndarray
    measured: dict = field(default_factory=dict)

    def at(self, capacity: int, rate: str = "prefix_rate") -> float:
        """`rate` predicted at `capacity` blocks: linear between the reruns, the nearest end's outside them."""
        y = np.asarray(getattr(self, rate), dtype=np.float64)
        ok = np.isfinite(y)
        if not ok.any():
            return float("nan")
        return float(np.interp(capacity, np.asarray(self.capacities)[ok], y[ok]))


@dataclass(frozen=True)
class SavedResult:
    """One KV-cache group's curves as a snapshot carries them (Snapshot.what_if): what the tab draws, without the
    block-size and threshold views when read from a file (saved_only). app/whatif/worker.py's WhatIfResult is this
    with every view computed."""
    source: str
    accesses: int
    counted: int
    distinct: int
    current_blocks: int
    block_mib: float | None
    demote_after_s: float | None = None
    curves: list = field(default_factory=list)
    block_sizes: list = field(default_factory=list)
    thresholds: tuple | None = None
    lines: list = field(default_factory=list)
    seconds: float = float("nan")
    group: int = 0
    group_title: str = ""
    saved_only: bool = True
    configured: ConfiguredPrediction | None = None  # the engine rerun as configured (a live trace of one group)

    def saved(self) -> dict:
        """The curves as a snapshot carries them (Snapshot.what_if's per-group entry; engine/telemetry/
        snapshot_schema.py checks it): plain JSON and float64 / int64 arrays."""
        return {"group": self.group, "title": self.group_title, "current_blocks": int(self.current_blocks),
                "block_mib": None if self.block_mib is None else float(self.block_mib),
                "accesses": int(self.accesses), "counted": int(self.counted), "distinct": int(self.distinct),
                "curves": [{"policy": str(label), "exact": bool(exact),
                            "capacities": np.asarray(caps, dtype=np.int64),
                            "hit_rate": np.asarray(hit, dtype=np.float64)} for label, caps, hit, exact in self.curves],
                "lines": [str(x) for x in self.lines]}


def saved_results(what_if: dict) -> list[SavedResult]:
    """Snapshot.what_if as the tab's results, one per group ([] for a snapshot without curves)."""
    out = []
    for g in (what_if or {}).get("groups", []):
        out.append(SavedResult(str(what_if.get("source", "")), g.get("accesses", 0), g.get("counted", 0),
                               g.get("distinct", 0), g["current_blocks"], g.get("block_mib"),
                               curves=[(c["policy"], np.asarray(c["capacities"]), np.asarray(c["hit_rate"]),
                                        bool(c.get("exact", False))) for c in g["curves"]],
                               lines=list(g.get("lines", [])), group=g["group"], group_title=g.get("title", "")))
    return out
