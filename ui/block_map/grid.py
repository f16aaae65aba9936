"""The block map's grid: where each tier's slots sit in the code image (rows × cols, row-major).

Each tier is a row-major grid with the same column count, device first, then a gap, then host, so a tier's
slots are one contiguous slice of the flat code buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GAP_FRACTION = 0.06  # gap between tiers (and the label band above the first) as a share of all rows


@dataclass(frozen=True)
class GridLayout:
    """Where each tier's slots sit in the code image (rows × cols, row-major)."""

    cols: int
    capacities: tuple[int, ...]
    tops: tuple[int, ...]  # first image row of each tier
    rows: tuple[int, ...]  # rows each tier spans (its last row may be partly filled)
    gap: int  # background rows between tiers; the same band sits above the first tier, outside the image
    height: int  # image rows

    @property
    def offsets(self) -> tuple[int, ...]:
        """Flat index of each tier's slot 0."""
        return tuple(t * self.cols for t in self.tops)

    def at(self, x: float, y: float) -> tuple[int, int] | None:
        """(tier, slot) of the cell at image coordinates (x: column, y: row), or None outside every tier's slots
        (left or right of the grid, in a gap, past a tier's last slot)."""
        if not 0 <= x < self.cols:
            return None
        col, row = int(x), math.floor(y)
        for i, (top, n) in enumerate(zip(self.tops, self.rows)):
            if top <= row < top + n:
                slot = (row - top) * self.cols + col
                return (i, slot) if slot < self.capacities[i] else None
        return None


def grid_layout(capacities: tuple[int, ...], aspect: float, label_share: float = 0.0) -> GridLayout:
    """Columns chosen so the whole map (gaps and label band included) is about `aspect` wide per unit tall.

    label_share: the share of the map's height a tier's label needs (its pixel height over the view's); the
    gaps grow to it, so a label never overlaps the tier above it on a short view."""
    total = max(sum(capacities), 1)
    aspect = min(max(aspect, 0.2), 20.0)
    cols = max(1, math.ceil(math.sqrt(total * aspect * (1 + 2 * GAP_FRACTION))))
    cols = min(cols, 32000)  # QImage and ImageItem limits
    rows = tuple(-(-c // cols) for c in capacities)
    share = min(max(label_share, 0.0), 0.3)
    # g >= share * (rows + 2 g): the map's height includes the band above the first tier and the gap.
    gap = max(1, math.ceil(GAP_FRACTION * sum(rows)), math.ceil(share * sum(rows) / (1 - 2 * share)))
    tops, r = [], 0
    for i, n in enumerate(rows):
        tops.append(r)
        r += n + (gap if i < len(rows) - 1 else 0)
    return GridLayout(cols=cols, capacities=tuple(capacities), tops=tuple(tops), rows=rows, gap=gap, height=max(r, 1))
