"""What the "What if" tab draws, as plain data (no Qt): one KV-cache group's curves as a snapshot carries them.
app/whatif_worker.py's WhatIfResult extends it with every view computed; importing it pulls in no widget toolkit, so
the command-line benches that compute curves stay Qt-free."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SavedResult:
    """One KV-cache group's curves as a snapshot carries them (Snapshot.what_if): what the tab draws, without the
    block-size and threshold views when read from a file (saved_only). app/whatif_worker.py's WhatIfResult is this
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
