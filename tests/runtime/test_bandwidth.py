"""The streaming reads a decode step is held against (engine/runtime/bandwidth.py): the read with arithmetic beside
it that `kvscope bench --long` reports as attainable reads every byte once and does its k fused multiply-adds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.attention import attn_ir
from engine.runtime import bandwidth

pytestmark = pytest.mark.skipif(attn_ir.llvm is None, reason=f"no llvmlite: {attn_ir.status()}")


@pytest.mark.parametrize("k", [0, 1, 5, 8, 9, 17])
@pytest.mark.parametrize("parts", [1, 3])
def test_stream_fma_reads_every_float_once_with_k_fmas(k, parts):
    """The kernel's sum is each float times 1 (the plain sum) plus its k products with the 8 constants in turn (each
    FMA's product added into a sum): a count of reads or FMAs off by one changes it by far more than rounding. The
    pieces (one a thread) cover the buffer whatever it divides into. Tolerance: all terms positive, each of the
    9 x 16 lane sums adds n/16 of them in fp32, then 16 lanes and 9 sums: (n/16 + 25) ulp of the total."""
    n = (1 << 16) + 16 * 3
    x = torch.from_numpy(np.random.default_rng(k).random(n, dtype=np.float32) + np.float32(0.5))
    fn = bandwidth._fma_kernel(k)
    got = bandwidth._fma_driver()(fn, x.data_ptr(), n, parts)
    consts = [np.float64(np.float32(1.0 + (j % 8 + 1) / 1024)) for j in range(k)]
    want = x.double().sum().item() * (1.0 + sum(consts))
    assert abs(got - want) <= (n / 16 + 25) * np.finfo(np.float32).eps * want
    if k:  # one FMA fewer would be this far off
        assert abs(want / (1.0 + sum(consts)) * consts[-1]) > 100 * abs(got - want)


def test_rate_with_fma_times_a_pass_over_the_probe_buffer():
    probe = bandwidth.StreamRead("cpu", 4)
    assert probe.rate_with_fma(0) > 0 and probe.rate_with_fma(6) > 0
    assert bandwidth._fma_kernel(6) == bandwidth._fma_kernel(6)  # compiled once
