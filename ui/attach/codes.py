"""The attach block map's code image: every group's codes (computed with the events, engine/attach/codes.py)
copied into one uint8 image, groups stacked like the engine map's tiers (ui/block_map/grid.py), and the LUT per
colour mode."""

from __future__ import annotations

import numpy as np

from engine.attach import codes as ac
from engine.attach.cluster import ClusterSnapshot
from ui import palette as pal
from ui.block_map.grid import GridLayout

# The codes the ingest side computes must mean what this palette draws.
assert (ac.VALUE_MAX, ac.EMPTY_CODE, ac.UNKNOWN_CODE, ac.N_CATEGORICAL) == \
    (pal.VALUE_MAX, pal.FREE_CODE, pal.CACHED_CODE, pal.N_CATEGORICAL)
LOG_MODES = ac.LOG_MODES


def mode_lut(mode: str) -> np.ndarray:
    """(256, 3) uint8."""
    if mode in ("age", "idle"):
        lut = pal.mode_lut("age")
    elif mode == "heat":
        lut = pal.mode_lut("heat")
    elif mode == "reuse":
        lut = pal.mode_lut("ref")  # code 0 = never named as a parent; 1..4 = 1, 2, 3, 4+ times
    elif mode == "family":
        lut = pal.mode_lut("owner")
    elif mode == "depth":
        lut = pal.mode_lut("fill", pal.VALUE_MAX + 1)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    lut[ac.EMPTY_CODE] = pal.FREE
    lut[ac.UNKNOWN_CODE] = pal.CACHED
    return lut


class AttachCodes:
    def __init__(self) -> None:
        self.codes = np.full((1, 1), pal.BACKGROUND_CODE, np.uint8)
        self.layout: GridLayout | None = None

    def relayout(self, lay: GridLayout) -> None:
        self.layout = lay
        self.codes = np.full((lay.height, lay.cols), pal.BACKGROUND_CODE, np.uint8)
        flat = self.codes.reshape(-1)
        for off, cap in zip(lay.offsets, lay.capacities):
            flat[off:off + cap] = ac.EMPTY_CODE

    def draw(self, snap: ClusterSnapshot) -> None:
        flat = self.codes.reshape(-1)
        for g, off, cap in zip(snap.groups, self.layout.offsets, self.layout.capacities):
            flat[off:off + cap] = g.codes
