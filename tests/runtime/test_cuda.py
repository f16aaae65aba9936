"""CUDA-only checks (skipped without a GPU; `python3 -m app.stress.gpu_check` runs them on a lent one)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kv.block_pool import BlockPool, Tier
from engine.config import CacheConfig, KVDtype

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("dtype", [KVDtype.FP32, KVDtype.INT8_KIVI], ids=lambda d: d.label)
def test_demote_and_promote_under_a_running_batch_keep_every_byte(dtype):
    # 8 layers x 4 KV heads x 64 tokens x 128 dims: 2 MiB per fp32 block. The compute stream is kept busy
    # (a running batch) while blocks demote to pinned host memory and come back on the side stream; a host
    # read before the device->host copy landed, or a copy that read before the compute stream wrote, would
    # show as a changed byte.
    g = (8, 4, 128)
    cfg = CacheConfig(block_size=64, kv_dtype=dtype, device_budget_mb=48, host_budget_mb=48)
    dev = torch.device("cuda")
    pool = BlockPool(g, cfg, dev)
    assert pool.block_bytes >= 2**20 * (1 if dtype is KVDtype.FP32 else 0.25)
    n = 12
    lids = [pool.allocate(Tier.DEVICE, 0, 0.0) for _ in range(n)]
    pool.set_fill(lids, [64] * n)
    busy = torch.randn(4096, 4096, device=dev)
    for round_ in range(5):
        torch.manual_seed(round_)
        k = torch.randn(g[0], n, g[1], 64, g[2], device=dev)
        v = torch.randn_like(k)
        for _ in range(4):
            busy = busy @ busy / 64  # a running batch on the compute stream, queued before the writes
        pool.write_blocks(lids, k, v)  # written on the compute stream, behind the matmuls
        want = [t.clone() for t in pool.read_blocks(lids)]
        pool.move(np.asarray(lids[: n // 2]), Tier.HOST, 1.0, reason="test")  # demote while the GPU is busy
        for _ in range(4):
            busy = busy @ busy / 64
        pool.move(np.asarray(lids[: n // 2]), Tier.DEVICE, 2.0, reason="test")  # and promote back
        pool.move(np.asarray(lids[n // 2:]), Tier.HOST, 3.0, reason="test")
        got = pool.read_blocks(lids)
        torch.cuda.synchronize()
        for w, g_ in zip(want, got):
            assert torch.equal(w, g_), f"round {round_}: a migrated block changed"
        pool.move(np.asarray(lids[n // 2:]), Tier.DEVICE, 4.0, reason="test")
    assert pool.tiers[Tier.HOST].k["data"].is_pinned()
