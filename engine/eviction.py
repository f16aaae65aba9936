"""Eviction policies: which cached (unowned) blocks of a tier go first.

A policy sees a tier's per-slot metadata and the slots of its cached blocks, and returns the n to evict.
Blocks owned by a sequence are never candidates. Adding a policy means adding a class here and a
name to `POLICIES` in config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from engine.block_pool import BlockPool, TierPool


class EvictionPolicy(Protocol):
    """Hooks (all optional beyond `victims`): the pool calls on_insert when it allocates a slot, on_access
    when blocks are read, and on_move when blocks change tier (so per-slot state can follow them)."""

    name: str

    def on_insert(self, tier: "TierPool", slot: int, now: float) -> None: ...

    def on_access(self, tier: "TierPool", slots: np.ndarray, now: float) -> None: ...

    def on_move(self, src: "TierPool", src_slots: np.ndarray, dst: "TierPool", dst_slots: np.ndarray) -> None: ...

    def victims(self, pool: "BlockPool", tier: "TierPool", candidates: np.ndarray, n: int, now: float) -> np.ndarray:
        """The n slots of `tier` to evict first, from `candidates` (slots of cached blocks)."""


def _lowest(score: np.ndarray, candidates: np.ndarray, n: int) -> np.ndarray:
    """The n candidates with the lowest score, lowest first (argpartition keeps a batch O(len))."""
    if n >= len(candidates):
        order = np.argsort(score, kind="stable")
    else:
        part = np.argpartition(score, n - 1)[:n]
        order = part[np.argsort(score[part], kind="stable")]
    return candidates[order]


class _Stateless:
    def on_insert(self, tier: "TierPool", slot: int, now: float) -> None:
        pass

    def on_access(self, tier: "TierPool", slots: np.ndarray, now: float) -> None:
        pass

    def on_move(self, src: "TierPool", src_slots: np.ndarray, dst: "TierPool", dst_slots: np.ndarray) -> None:
        pass


class LRU(_Stateless):
    name = "lru"

    def victims(self, pool: "BlockPool", tier: "TierPool", candidates: np.ndarray, n: int, now: float) -> np.ndarray:
        return _lowest(tier.last[candidates], candidates, n)


class Heat(_Stateless):
    """LRU-K with decay: lowest current heat first (heat*decay^idle), ties broken by the K-th last access."""

    name = "heat"

    def victims(self, pool: "BlockPool", tier: "TierPool", candidates: np.ndarray, n: int, now: float) -> np.ndarray:
        heat = pool.current_heat(tier, candidates, now)
        kth = tier.hist[candidates, -1]
        # lexsort's last key is primary: heat first, then the older K-th access goes first.
        order = np.lexsort((kth, heat))[:n]
        return candidates[order]


def make_policy(name: str, decay: float) -> EvictionPolicy:
    if name == "lru":
        return LRU()
    if name == "heat":
        return Heat()
    raise ValueError(f"unknown policy {name!r}")
