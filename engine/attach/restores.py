"""Re-stores: what an attached server's KV events say about its misses (issue 23 item 4).

A `BlockStored` of a hash this cache (one endpoint, rank, medium and KV-cache group) stored and removed before is a
**re-store**: the prefill that wrote it was recomputed because the block had been evicted. Its *gap* is the time
since the removal; its *need* is how many blocks the cache would have needed beyond its size to still hold it: the
removals from its own up to the re-store (under LRU the k blocks evicted last are the ones k more slots would keep,
while none of them is read again). A hash never seen before is *compulsory* (or was stored before KV Scope attached).

The miss-ratio figures are **lower bounds**: events show stores and removals, not lookups that hit, so a block
that stayed resident and was read again is invisible, and so is a request that missed a block the server then did
not store again. "With N more blocks, at least M of these re-stores would have been hits."
"""

from __future__ import annotations

import time

import numpy as np

SLOW_PARTS_EVERY_S = 0.5  # the curve and gap percentiles (a sort of up to KEEP values) at most this often
GONE_CAP = 1 << 17  # removed hashes remembered per cache (the oldest forgotten first: then a re-store reads compulsory)
KEEP = 1 << 16  # re-stores whose need and gap are kept for the curve and percentiles (the newest)


class ReStores:
    """Per cache: removed hashes (hash -> (removal number, time)) and the re-stores seen."""

    def __init__(self):
        self.gone: dict = {}
        self.compulsory = 0
        self.re_stores = 0
        self._need = np.zeros(KEEP, np.int64)
        self._gap = np.zeros(KEEP, np.float64)
        self._slow: tuple[float, int, dict] | None = None  # (when, re_stores then, the sorted parts)

    def removed(self, h, t: float | None, n_removed: int) -> None:
        """The cache removed block h, its n_removed-th removal."""
        self.gone.pop(h, None)
        self.gone[h] = (n_removed, t)
        while len(self.gone) > GONE_CAP:
            del self.gone[next(iter(self.gone))]

    def stored(self, h, t: float, n_removed: int) -> bool:
        """The cache stored block h (not resident) after n_removed removals; True if it is a re-store."""
        was = self.gone.pop(h, None)
        if was is None:
            self.compulsory += 1
            return False
        i = self.re_stores % KEEP
        self._need[i] = n_removed - was[0] + 1
        self._gap[i] = max(t - was[1], 0.0) if was[1] is not None else np.nan  # a clock stepping back: no time
        self.re_stores += 1
        return True

    def needs(self) -> np.ndarray:
        return self._need[:min(self.re_stores, KEEP)]

    def curve(self, capacities=None) -> list[tuple[int, int]]:
        """(extra blocks, re-stores of the kept ones that would have been hits) at powers of two up to the largest
        need: a lower bound on the hits that many more blocks buy."""
        need = np.sort(self.needs())
        if not len(need):
            return []
        if capacities is None:
            top = int(need[-1])
            capacities = [1 << i for i in range(max(top - 1, 0).bit_length() + 1)]  # up to the first >= top
        return [(int(k), int(np.searchsorted(need, k, side="right"))) for k in capacities]

    def summary(self, now: float | None = None) -> dict:
        """Counts, share of stores that were re-stores (NaN: no store), gap percentiles (NaN: none), the curve.

        The counts are current; the sorted parts (gap percentiles, kept, curve) are worked out again at most every
        SLOW_PARTS_EVERY_S while re-stores arrive (every snapshot asks, under the cluster's lock)."""
        now = time.monotonic() if now is None else now
        stores = self.compulsory + self.re_stores
        if self._slow is None or (self._slow[1] != self.re_stores and now - self._slow[0] >= SLOW_PARTS_EVERY_S):
            gaps = self._gap[:min(self.re_stores, KEEP)]
            gaps = gaps[np.isfinite(gaps)]
            self._slow = (now, self.re_stores, {
                "gap_p50_s": float(np.percentile(gaps, 50)) if len(gaps) else float("nan"),
                "gap_p90_s": float(np.percentile(gaps, 90)) if len(gaps) else float("nan"),
                "kept": int(min(self.re_stores, KEEP)), "curve": self.curve()})
        return {"stores": stores, "compulsory": self.compulsory, "re_stores": self.re_stores,
                "re_store_share": self.re_stores / stores if stores else float("nan"), **self._slow[2]}


def curve_text(summary: dict) -> str:
    """The curve in words, at the extra blocks that would have turned half, 90 % and all of the re-stores kept into
    hits: "+64 blocks: ≥ 150 of 300 re-stores would have hit; ...". """
    curve, kept = summary.get("curve", []), summary.get("kept", 0)
    if not kept:
        return "no re-stores seen"
    out = []
    for frac in (0.5, 0.9, 1.0):
        k, m = next((k, m) for k, m in curve if m >= frac * kept)
        if not out or out[-1][0] != k:
            out.append((k, m))
    return "; ".join(f"+{k:,} blocks: ≥ {m:,} of {kept:,} re-stores would have hit" for k, m in out)
