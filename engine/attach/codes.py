"""A block table's cells as uint8 colour codes for one mode, computed where the events are (so the window only
copies bytes into its image). The code values are the block map's (ui/palette.py, checked there): 0..VALUE_MAX
carry the mode's value, EMPTY_CODE is a cell with no block (not a free slot: slots are not published),
UNKNOWN_CODE a block whose value the events cannot give (depth where the chain above was never seen).
"""

from __future__ import annotations

import math

import numpy as np

VALUE_MAX = 250
UNKNOWN_CODE = 252
EMPTY_CODE = 253
N_CATEGORICAL = 32
LOG_MODES = {"age": 0.1, "idle": 0.1, "heat": 0.01}  # mode -> the smallest value the colour bar shows


def nice_ceil(v: float) -> float:
    if not v > 0 or not math.isfinite(v):
        return 1.0
    e = 10.0 ** math.floor(math.log10(v))
    for m in (1, 2, 5, 10):
        if m * e >= v:
            return m * e
    return 10 * e


class Ranges:
    """The colour bar's range per continuous mode: grows at once, shrinks only when the data fell well below."""

    def __init__(self) -> None:
        self.r: dict[str, tuple[float, float]] = {}

    def update(self, mode: str, peak: float) -> tuple[float, float]:
        lo = LOG_MODES.get(mode, 0.0)
        want = nice_ceil(max(peak, 10 * lo if lo else 1.0))
        old = self.r.get(mode)
        if old is None or want > old[1] or want < old[1] / 8:
            self.r[mode] = (lo, want)
        return self.r[mode]


def peak(values: np.ndarray, occ: np.ndarray) -> float:
    v = values[occ]
    return float(v.max()) if len(v) else 0.0


def to_codes(mode: str, values: np.ndarray, occ: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """uint8 per cell: log-scaled for age / idle / heat, 0..4 for reuse (4 = 4 or more), id mod 32 for family,
    linear for depth."""
    if mode in LOG_MODES:
        x = np.log(np.maximum(values, lo) / lo) * (VALUE_MAX / math.log(hi / lo))
        out = np.clip(x, 0, VALUE_MAX).astype(np.uint8)
    elif mode == "reuse":
        out = np.minimum(values, 4).astype(np.uint8)
    elif mode == "family":
        out = (values.astype(np.int64) & (N_CATEGORICAL - 1)).astype(np.uint8)
    elif mode == "depth":
        out = np.clip(values * (VALUE_MAX / max(hi, 1.0)), 0, VALUE_MAX).astype(np.uint8)
        out[values < 0] = UNKNOWN_CODE
    else:
        raise ValueError(f"unknown mode {mode!r}")
    out[~occ] = EMPTY_CODE
    return out
