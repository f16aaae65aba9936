"""Colours shared by the panels: block states, a categorical palette for sequences, and the code LUTs of
the block map.

The block map draws uint8 codes through a 256-entry LUT. Codes 0..VALUE_MAX carry the mode's value (a
state, a sequence colour, a quantized heat ...); the top codes are reserved and mean the same in every mode.
"""

from __future__ import annotations

import colorsys

import functools

import numpy as np
import pyqtgraph as pg
from PySide6.QtGui import QColor

RGB = tuple[int, int, int]

# -- block states ---------------------------------------------------------------------------------
BACKGROUND: RGB = (13, 14, 18)  # outside any tier; darker than a free slot so capacity stays visible
FREE: RGB = (40, 44, 54)
CACHED: RGB = (92, 108, 140)  # unowned, kept for prefix reuse
IN_USE: RGB = (62, 178, 118)
SELECTED: RGB = (0, 236, 255)  # no colormap or categorical entry comes near pure cyan
FRAME: RGB = (150, 156, 172)
TEXT: RGB = (214, 218, 228)
STATE_COLORS: tuple[RGB, RGB, RGB] = (FREE, CACHED, IN_USE)  # indexed by TierSnapshot.state
STATE_NAMES = ("free", "cached", "in use")

# -- reserved codes of the block-map image --------------------------------------------------------
VALUE_MAX = 250  # codes 0..VALUE_MAX carry values; continuous modes quantize onto them
SELECTED_CODE = 251
CACHED_CODE = 252
FREE_CODE = 253
BACKGROUND_CODE = 254
NO_DATA_CODE = 255  # a block with no value in the mode (its K/V error was not measured)
NO_DATA: RGB = (128, 64, 120)  # dim magenta: far from every ramp below and the state colours

# -- sequences ------------------------------------------------------------------------------------
N_CATEGORICAL = 32  # a power of two: the block map takes `id & (N - 1)` straight from the owner bytes


def _categorical(n: int) -> np.ndarray:
    """n colours, hue by golden-ratio steps so neighbouring ids differ; the cyan band is left to SELECTED."""
    out = np.zeros((n, 3), np.uint8)
    band0, band1 = 0.42, 0.60  # hues kept free for the selection colour
    for i in range(n):
        h = (i * 0.618033988749895) % 1.0
        h = h * (1 - (band1 - band0))
        if h >= band0:
            h += band1 - band0
        s = (0.78, 0.55, 0.70)[i % 3]
        v = (0.95, 0.80, 0.68)[(i // 3) % 3]
        out[i] = [round(255 * c) for c in colorsys.hsv_to_rgb(h, s, v)]
    return out


CATEGORICAL: np.ndarray = _categorical(N_CATEGORICAL)  # (N, 3) uint8


def seq_rgb(seq_id: int) -> RGB:
    """The colour of a sequence, the same in every panel (the block map's owner mode uses it too)."""
    if seq_id < 0:
        return CACHED
    r, g, b = CATEGORICAL[int(seq_id) & (N_CATEGORICAL - 1)]
    return int(r), int(g), int(b)


def seq_color(seq_id: int) -> QColor:
    return QColor(*seq_rgb(seq_id))


def qcolor(rgb: RGB, alpha: int = 255) -> QColor:
    return QColor(rgb[0], rgb[1], rgb[2], alpha)


# -- ref counts -----------------------------------------------------------------------------------
REF_COLORS: tuple[RGB, ...] = ((72, 168, 98), (228, 204, 64), (244, 132, 40), (232, 52, 72))  # 1, 2, 3, 4+
REF_NAMES = ("ref 1", "ref 2", "ref 3", "ref 4+")

# -- continuous maps (pyqtgraph ships the matplotlib maps) ---------------------------------------
COLORMAPS = {"heat": ("inferno", 0.12, 1.0), "age": ("viridis", 1.0, 0.0), "fill": ("plasma", 0.0, 0.95),
             "kv error": ("cividis", 0.0, 1.0)}
ERROR_RANGE = (1e-4, 1.0)  # the "kv error" mode's colour bar: 0.01 % to 100 % relative RMS error


@functools.lru_cache(maxsize=64)
def ramp(mode: str, n: int = VALUE_MAX + 1) -> np.ndarray:
    """(n, 3) uint8 colours of a continuous mode, low value first. Ends are trimmed so the low end is never
    as dark as a free slot. Computed once per (mode, n) (the legends ask every frame) and read-only: copy to
    change it."""
    name, start, stop = COLORMAPS[mode]
    out = pg.colormap.get(name).getLookupTable(start, stop, nPts=n, mode="byte")[:, :3].astype(np.uint8)
    out.flags.writeable = False
    return out


def _base_lut() -> np.ndarray:
    lut = np.zeros((256, 3), np.uint8)
    lut[:] = BACKGROUND
    lut[SELECTED_CODE] = SELECTED
    lut[CACHED_CODE] = CACHED
    lut[FREE_CODE] = FREE
    lut[BACKGROUND_CODE] = BACKGROUND
    lut[NO_DATA_CODE] = NO_DATA
    return lut


def mode_lut(mode: str, block_size: int = 16) -> np.ndarray:
    """(256, 3) uint8 LUT for a block-map mode. Value codes per mode:
    state: the state itself (0 free, 1 cached, 2 in use); owner: id & (N_CATEGORICAL-1);
    ref: min(ref, 4) (0 = cached); heat, age, kv error: 0..VALUE_MAX on a log scale;
    fill: the token count itself when block_size <= VALUE_MAX, else fill * VALUE_MAX // block_size."""
    lut = _base_lut()
    if mode == "state":
        lut[:3] = STATE_COLORS
    elif mode == "owner":
        lut[:N_CATEGORICAL] = CATEGORICAL
    elif mode == "ref":
        lut[0] = CACHED
        lut[1:5] = REF_COLORS
    elif mode in ("heat", "age", "kv error"):
        lut[:VALUE_MAX + 1] = ramp(mode)
    elif mode == "fill":
        if block_size <= VALUE_MAX:
            r = ramp("fill")
            idx = np.minimum(np.arange(VALUE_MAX + 1) * VALUE_MAX // max(block_size, 1), VALUE_MAX)
            lut[:VALUE_MAX + 1] = r[idx]
        else:
            lut[:VALUE_MAX + 1] = ramp("fill")
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return lut
