"""Block-access traces: every block read by attention, with time, sequence, tier and hit/miss.

A trace is what the policy lab replays. Blocks are named by a serial number given at allocation, unique
for the engine's lifetime (a block keeps it across migrations and prefix reuse; a re-laid block gets a new
one), so a replay sees exactly the reuse the engine saw. Saved as .npz with one array per column.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

COLUMNS = ("t", "seq", "block", "tier", "hit")


@dataclass(frozen=True)
class AccessTrace:
    t: np.ndarray  # float64 seconds (engine clock)
    seq: np.ndarray  # int32 sequence id
    block: np.ndarray  # int64 block serial
    tier: np.ndarray  # int8: where the block was when read (0 device, 1 host)
    hit: np.ndarray  # bool: served from the device tier (a prefetched block counts as a hit)

    def __len__(self) -> int:
        return len(self.t)

    def save(self, path: str) -> None:
        np.savez_compressed(path, **{c: getattr(self, c) for c in COLUMNS})

    @staticmethod
    def load(path: str) -> "AccessTrace":
        try:
            with np.load(path) as z:
                cols = {c: z[c] for c in COLUMNS}
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"{path}: not a KV Scope access trace ({e})") from None
        n = {len(v) for v in cols.values()}
        if len(n) != 1:
            raise ValueError(f"{path}: columns of different lengths")
        return AccessTrace(**cols)


class TraceRecorder:
    """Collects reads in chunks (one per step and sequence) and concatenates them once at the end."""

    def __init__(self):
        self._chunks: list[tuple[float, int, np.ndarray, np.ndarray, np.ndarray]] = []
        self.rows = 0

    def add(self, t: float, seq: int, blocks: np.ndarray, tiers: np.ndarray, hits: np.ndarray) -> None:
        self._chunks.append((t, seq, blocks.copy(), tiers.astype(np.int8), hits.astype(bool)))
        self.rows += len(blocks)

    def trace(self) -> AccessTrace:
        if not self._chunks:
            z = np.zeros(0)
            return AccessTrace(z, z.astype(np.int32), z.astype(np.int64), z.astype(np.int8), z.astype(bool))
        lens = [len(c[2]) for c in self._chunks]
        return AccessTrace(
            t=np.repeat([c[0] for c in self._chunks], lens).astype(np.float64),
            seq=np.repeat([c[1] for c in self._chunks], lens).astype(np.int32),
            block=np.concatenate([c[2] for c in self._chunks]).astype(np.int64),
            tier=np.concatenate([c[3] for c in self._chunks]),
            hit=np.concatenate([c[4] for c in self._chunks]),
        )
