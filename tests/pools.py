"""Small hand-made block pools (one-token blocks, 1 layer, 1 head, head dim 2) whose blocks are named by a key:
shared by the eviction tests (tests/kv/) and the lab's parity tests (tests/lab/)."""

from __future__ import annotations

import numpy as np
import torch

from engine.config import CacheConfig
from engine.kv.block_pool import RESERVED, BlockPool
from engine.kv.tiers import Tier

BLOCK_BYTES = 16  # geometry (1 layer, 1 head, head_dim 2), block_size 1, fp32: K and V of 8 bytes each


def make_pool(cap: int, policy: str, decay: float = 0.9, host: int = 0, evict_batch: int = 1) -> BlockPool:
    cfg = CacheConfig(block_size=1, device_budget_mb=(cap + RESERVED) * BLOCK_BYTES / 2**20,
                      host_budget_mb=host * BLOCK_BYTES / 2**20, policy=policy, decay=decay, evict_batch=evict_batch)
    pool = BlockPool((1, 1, 2), cfg, torch.device("cpu"))
    assert pool.tiers[Tier.DEVICE].capacity == cap and pool.tiers[Tier.HOST].capacity == host
    return pool


# Blocks are named by a key (their hash is key + 1): a lid is reused once its block is evicted.

def lid_of(pool: BlockPool, key: int) -> int | None:
    return pool.by_hash.get(key + 1)


def new_block(pool: BlockPool, key: int, now: float) -> int:
    """A full, hashed block read once (the read of the step that wrote it), still owned."""
    lid = pool.allocate(Tier.DEVICE, 0, now)
    pool.set_hash(lid, key + 1, np.array([key], np.int32))
    pool.touch(np.array([lid]), now)
    return lid


def cached_block(pool: BlockPool, key: int, now: float) -> int:
    pool.decref(new_block(pool, key, now))
    return key


def read(pool: BlockPool, key: int, now: float) -> None:
    """A later request reuses a cached block: own it, read it, release it."""
    lid = lid_of(pool, key)
    pool.incref(lid)
    pool.touch(np.array([lid]), now)
    pool.decref(lid)
