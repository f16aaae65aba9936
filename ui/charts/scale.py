"""Round numbers for a chart's y axis: the range's top and the tick step."""

from __future__ import annotations

import math


def nice_ceiling(v: float, steps: tuple[float, ...] = (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10)) -> float:
    """The smallest of `steps` × 10^k at or above v (v > 0); 1 for anything else."""
    if not v > 0 or not math.isfinite(v):
        return 1.0
    e = 10.0 ** math.floor(math.log10(v))
    for m in steps:
        if m * e >= v * (1 - 1e-9):
            return m * e
    return 10.0 * e


def tick_step(top: float) -> float:
    """The smallest 1-2-5 step that divides [0, top] into at most 5 intervals."""
    return nice_ceiling(top / 5.0, (1, 2, 5, 10))


def tick_label(v: float, step: float) -> str:
    if step >= 1:
        return f"{v:,.0f}"
    digits = max(0, -math.floor(math.log10(step) + 1e-9))
    return f"{v:.{digits}f}"
