"""The block map's code image: every slot of every tier as one uint8 code, written by numpy passes in place.

A frame is a few whole-array passes per tier (the codes of the current colour mode, then free slots and the
selected sequence's blocks drawn over them), into scratch buffers allocated once per layout. Codes above
palette.VALUE_MAX mean free / cached / selected / background in every mode; the widget (ui/block_map/widget.py)
shows the image through a lookup table. No widget here: numpy over the snapshot's arrays.
"""

from __future__ import annotations

import math

import numpy as np

from engine.telemetry.snapshot import Snapshot, TierSnapshot
from ui import palette as pal
from ui.block_map.grid import GridLayout


def _nice_ceil(v: float) -> float:
    if not np.isfinite(v) or v <= 0:
        return 1.0
    e = 10.0 ** math.floor(math.log10(v))
    for m in (1.0, 2.0, 5.0, 10.0):
        if v <= m * e * (1 + 1e-9):
            return m * e
    return 10 * e


class BlockCodes:
    """The code image (rows × cols uint8) of one grid layout, redrawn from a snapshot for a mode and a selection.

    `ranges` holds the log range of the heat and age modes, kept across frames so the colour bar holds still.
    """

    def __init__(self) -> None:
        self.layout: GridLayout | None = None
        self.codes = np.full((1, 1), pal.BACKGROUND_CODE, np.uint8)
        self.ranges: dict[str, tuple[float, float]] = {}
        self._block_size = 0
        self._sel_key: tuple | None = None
        self._sel_idx = np.zeros(0, np.intp)

    def relayout(self, lay: GridLayout) -> None:
        """A fresh image (all background) for `lay`: a view per tier on the flat buffer, and scratch buffers."""
        caps = lay.capacities
        self.layout = lay
        self.codes = np.full((lay.height, lay.cols), pal.BACKGROUND_CODE, np.uint8)
        self._flat = self.codes.reshape(-1)
        self._views = [self._flat[o:o + c] for o, c in zip(lay.offsets, caps)]
        n = max(caps) if caps else 1
        self._f32 = np.empty(n, np.float32)
        self._i32 = np.empty(n, np.int32)
        self._m = np.empty(n, np.bool_)
        self._u8a = np.empty(n, np.uint8)
        self._u8b = np.empty(n, np.uint8)
        self._sel_key = None

    def draw(self, snap: Snapshot, mode: str, block_size: int, selected: int) -> None:
        """Write every tier's codes for `mode`, then mark the selected sequence's blocks."""
        self._block_size = block_size
        if mode in ("heat", "age"):
            self._update_range(snap, mode)
        draw = getattr(self, f"_draw_{mode.replace(' ', '_')}")
        for i, t in enumerate(snap.tiers):
            if t.capacity:
                draw(t, self._views[i])
        idx = self._selection_index(snap, selected)
        if idx.size:
            self._flat[idx] = pal.SELECTED_CODE

    def _override(self, dst: np.ndarray, mask: np.ndarray, code: int) -> None:
        """dst[mask] = code, branch-free (a masked copy over a random mask is ~25× slower)."""
        n = dst.size
        ff, val = self._u8a[:n], self._u8b[:n]
        np.negative(mask.view(np.uint8), out=ff)  # 0xFF where mask
        np.bitwise_and(ff, code, out=val)
        np.invert(ff, out=ff)
        np.bitwise_and(dst, ff, out=dst)
        np.bitwise_or(dst, val, out=dst)

    def _free_override(self, t: TierSnapshot, dst: np.ndarray) -> None:
        m = self._m[:dst.size]
        np.equal(t.state, 0, out=m)
        self._override(dst, m, pal.FREE_CODE)

    def _draw_state(self, t: TierSnapshot, dst: np.ndarray) -> None:
        np.copyto(dst, t.state, casting="unsafe")

    def _draw_owner(self, t: TierSnapshot, dst: np.ndarray) -> None:
        n = dst.size
        i32, m = self._i32[:n], self._m[:n]
        np.bitwise_and(t.owner, pal.N_CATEGORICAL - 1, out=i32)
        np.copyto(dst, i32, casting="unsafe")
        np.less(t.owner, 0, out=m)
        np.logical_or(m, t.state != 2, out=m)
        self._override(dst, m, pal.CACHED_CODE)
        self._free_override(t, dst)

    def _draw_ref(self, t: TierSnapshot, dst: np.ndarray) -> None:
        i32 = self._i32[:dst.size]
        np.minimum(t.ref, 4, out=i32)
        np.maximum(i32, 0, out=i32)
        np.copyto(dst, i32, casting="unsafe")
        self._free_override(t, dst)

    def _draw_fill(self, t: TierSnapshot, dst: np.ndarray) -> None:
        bs = max(self._block_size, 1)
        i32 = self._i32[:dst.size]
        if bs <= pal.VALUE_MAX:
            np.clip(t.fill, 0, bs, out=i32)  # the LUT maps a token count straight to its colour
        else:
            np.clip(t.fill, 0, bs, out=i32)
            np.multiply(i32, pal.VALUE_MAX, out=i32)
            np.floor_divide(i32, bs, out=i32)
        np.copyto(dst, i32, casting="unsafe")
        self._free_override(t, dst)

    def _draw_log(self, values: np.ndarray, lo: float, hi: float, dst: np.ndarray) -> None:
        x = self._f32[:dst.size]
        np.maximum(values, np.float32(lo), out=x)  # also maps NaN to lo
        np.log(x, out=x)
        np.subtract(x, np.float32(math.log(lo)), out=x)
        np.multiply(x, np.float32(pal.VALUE_MAX / math.log(hi / lo)), out=x)
        np.minimum(x, np.float32(pal.VALUE_MAX), out=x)
        np.copyto(dst, x, casting="unsafe")

    def _draw_heat(self, t: TierSnapshot, dst: np.ndarray) -> None:
        lo, hi = self.ranges["heat"]
        self._draw_log(t.heat, lo, hi, dst)
        self._free_override(t, dst)

    def _draw_age(self, t: TierSnapshot, dst: np.ndarray) -> None:
        lo, hi = self.ranges["age"]
        self._draw_log(t.age, lo, hi, dst)
        self._free_override(t, dst)

    def _draw_kv_error(self, t: TierSnapshot, dst: np.ndarray) -> None:
        """The larger of the block's K and V error on a fixed log scale (palette.ERROR_RANGE, so formats compare);
        NO_DATA_CODE where a used block was not measured."""
        n = dst.size
        x, m = self._f32[:n], self._m[:n]
        if t.kerr is None or t.verr is None:
            x.fill(np.nan)
        else:
            np.fmax(t.kerr, t.verr, out=x)  # NaN only where both are
        lo, hi = pal.ERROR_RANGE
        np.isnan(x, out=m)
        np.fmax(x, np.float32(lo), out=x)  # NaN (no data) to lo: drawn over below
        self._draw_log(x, lo, hi, dst)
        self._override(dst, m, pal.NO_DATA_CODE)
        self._free_override(t, dst)

    def _update_range(self, snap: Snapshot, mode: str) -> None:
        """Log range [hi/1000, hi], hi a 1-2-5 step over the max; kept while the max stays within 5× below it,
        so the colour bar does not jitter from frame to frame."""
        peak = 0.0
        for t in snap.tiers:
            if not t.capacity:
                continue
            if mode == "heat":
                v = float(np.max(t.heat))
            else:  # age is meaningless where free: look at a strided sample of the used slots
                k = max(1, t.capacity // 65536)
                s = t.age[::k][t.state[::k] != 0]
                v = float(np.nanmax(s)) if s.size and not np.all(np.isnan(s)) else 0.0
            if np.isfinite(v):
                peak = max(peak, v)
        floor = 1e-3
        hi = _nice_ceil(max(peak, floor * 10))
        old = self.ranges.get(mode)
        if old is not None and old[1] >= hi and old[1] / 5 < max(peak, floor * 10) * (1 + 1e-9):
            return
        self.ranges[mode] = (max(hi / 1000, floor if mode == "age" else 1e-4), hi)

    def _selection_index(self, snap: Snapshot, sel: int) -> np.ndarray:
        """Flat code indices of the selected sequence's blocks: its block list when the snapshot has it,
        otherwise the slots it owns."""
        if sel < 0 or snap is None:
            return np.zeros(0, np.intp)
        key = (id(snap), sel, self.layout)
        if key == self._sel_key:
            return self._sel_idx
        lay = self.layout
        parts = []
        tier_arr = slot_arr = None
        seqs = snap.seqs
        hit = np.flatnonzero(np.asarray(seqs.id) == sel)
        if hit.size and hit[0] < len(seqs.block_slot) and len(seqs.block_slot[hit[0]]):
            tier_arr = np.asarray(seqs.block_tier[hit[0]])
            slot_arr = np.asarray(seqs.block_slot[hit[0]])
        for i, t in enumerate(snap.tiers):
            if slot_arr is not None:
                s = slot_arr[tier_arr == i]
                s = s[(s >= 0) & (s < t.capacity)]
            else:
                s = np.flatnonzero(t.owner == sel)
            parts.append(lay.offsets[i] + s.astype(np.intp))
        self._sel_idx = np.concatenate(parts) if parts else np.zeros(0, np.intp)
        self._sel_key = key
        return self._sel_idx
