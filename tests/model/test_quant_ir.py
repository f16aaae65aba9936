"""The LLVM IR kernels of the packed weights (engine/model/quant_ir.py), every build of them this CPU runs (AVX-512
VNNI, AVX2 intrinsics, the portable vector IR), against numpy doing the same arithmetic in float64:

  fp32 activations: x @ dequantize(W).T exactly (up to float32 rounding);
  int8 activations: x rounded to int8 per 32 inputs (scale max|x| / 127), each group's integer dot scaled by the
  weight's and x's scales, plus the zero term on the unrounded x: what llama.cpp's Q4_1 x Q8_1 dot computes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model import quant_ir
from engine.model.quant import QuantWeight, quantize, stack_rows

pytestmark = pytest.mark.skipif(quant_ir.llvm is None, reason=f"no llvmlite: {quant_ir.status()}")


@pytest.fixture(scope="module", params=["vnni", "avx2", "portable"])
def lib(request):
    built = quant_ir._Library(portable=request.param == "portable", vnni=request.param == "vnni")
    if request.param == "avx2" and not built.x86:
        pytest.skip("this CPU has no AVX2: the native build is the portable one")
    if request.param == "vnni" and not built.vnni:
        pytest.skip("this CPU has no AVX-512 VNNI")
    return built


def _rounded(x: np.ndarray) -> np.ndarray:
    """x as the integer kernels see it: int8 per 32 inputs times its scale (float64)."""
    xq, dx, _ = quant_ir.quantize_activations(x)
    B, K = x.shape
    return (xq.astype(np.float64).reshape(B, K // 32, 32) * dx.astype(np.float64)[..., None]).reshape(B, K)


def _want(x: np.ndarray, w: QuantWeight, activations: str) -> np.ndarray:
    W = w.dequantize().double().numpy()
    if activations == "fp32":
        return x.astype(np.float64) @ W.T
    Z = np.repeat(w.zero.double().numpy(), w.group, axis=1)  # the zero term multiplies the unrounded x
    return _rounded(x) @ (W - Z).T + x.astype(np.float64) @ Z.T


def _run(lib, x: np.ndarray, w: QuantWeight, activations: str) -> np.ndarray:
    op = quant_ir.operand(w.kind, w.q.numpy(), w.scale.numpy(), w.zero.numpy(), w.group, activations, lib=lib)
    return quant_ir.matmul(x, op, w.group if w.kind == "int8" and bool((w.zero != 0).any()) else 0)


def _weights(N: int, K: int, seed: int) -> dict[str, QuantWeight]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    i4 = quantize(w, "int4")
    return {
        "int4": i4,
        "int8 per row": quantize(w, "int8"),
        "int8 groups of 16 with zeros": i4.as_int8(16),  # what a mixed q/k/v stack becomes (zeros nonzero)
        "int8 groups of 32": QuantWeight("int8", torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8),
                                         torch.rand(N, K // 32, generator=g) * 0.01, torch.zeros(N, K // 32), 32),
    }


@pytest.mark.parametrize("activations", ["fp32", "int8"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13])  # tiles of 8, 4, 2, 1 rows and their mixes
# (K / 32 groups: the VNNI int4 kernel takes whole blocks of 8, then pairs, then an odd one): 18 = 2 blocks + a pair,
# 48 = 6 blocks, 2 = a pair, 3 = a pair + 1, 8 = one block, 15 = a block + 3 pairs + 1
@pytest.mark.parametrize("shape", [(96, 576), (200, 1536), (17, 64), (40, 96), (9, 256), (23, 480)])
def test_kernels_compute_their_arithmetic(lib, activations, rows, shape):
    N, K = shape
    x = np.random.default_rng(rows).standard_normal((rows, K), dtype=np.float32)
    x[0, :32] = 0.0  # an all-zero group: scale 0, no division by it
    for name, w in _weights(N, K, rows + K).items():
        got = _run(lib, x, w, activations)
        want = _want(x, w, activations)
        assert got.shape == (rows, N) and got.dtype == np.float32
        assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max(), name


@pytest.mark.parametrize("kind", ["int8 per row", "int4"])
def test_int8_activations_are_not_the_exact_product(lib, kind):
    """The integer path really rounds x (a kernel that ignored the mode would pass the test above for fp32 only):
    its error against the exact product is that rounding's size, ~1e-2 of the largest output, not float noise."""
    x = np.random.default_rng(0).standard_normal((4, 576), dtype=np.float32)
    w = _weights(64, 576, 1)[kind]
    exact = _want(x, w, "fp32")
    err = np.abs(_run(lib, x, w, "int8") - exact).max() / np.abs(exact).max()
    assert 1e-4 < err < 3e-2


def test_activation_rounding_is_to_the_nearest_level():
    x = np.random.default_rng(3).standard_normal((3, 96), dtype=np.float32) * 5
    xq, dx, xs = quant_ir.quantize_activations(x)
    g = x.reshape(3, 3, 32)
    assert np.allclose(dx, np.abs(g).max(-1) / 127, rtol=1e-6)
    assert np.abs(xq).max() == 127
    assert (np.abs(_rounded(x) - x).reshape(3, 3, 32) <= dx[..., None] / 2 * (1 + 1e-5)).all()
    assert np.allclose(xs, g.sum(-1), rtol=1e-5, atol=1e-5)


def test_packed_weights_pick_the_mode_per_model():
    """QuantWeight.matmul runs the mode the weight carries; with_activations gives the other mode over the same
    tensors (two engines on one loaded model can differ); a mode that does not exist is refused."""
    w = quantize(torch.randn(64, 96), "int4")
    x = torch.randn(2, 96)
    fast = w.with_activations("int8")
    assert fast.q is w.q and w.activations == "fp32" and fast.with_activations("int8") is fast
    for weight, act in ((w, "fp32"), (fast, "int8")):
        want = _want(x.numpy(), w, act)
        assert np.abs(weight.matmul(x).numpy() - want).max() <= 2e-6 * np.abs(want).max()
    assert stack_rows([fast, fast]).activations == "int8"
    with pytest.raises(ValueError, match="activations 'int4'"):
        w.with_activations("int4")


def test_status_names_the_build():
    """Where llvmlite imports the kernels compile (an IR that LLVM refuses fails here, not as skipped tests)."""
    assert quant_ir.library() is not None, quant_ir.status()
    assert quant_ir.status().startswith("LLVM IR kernels for ")
    assert "x86" not in quant_ir.module_ir(x86=False)  # the portable build calls no x86 intrinsic


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("shape", [(96, 576), (203, 1536), (7, 1552), (17, 64), (5, 16), (1, 48)])  # rows past a
def test_fp32_kernel_is_the_product(lib, rows, shape):  # multiple of F32_ROWS; 2 and 3 (unequal) panels; 1 or 3 steps
    """The fp32-weight kernel (decode steps of fp32 models): x @ W.T up to float32 rounding, every tile of x rows
    and weight-row grouping, into rows of its own; what it cannot take (K not in 16s, strided, other dtypes) it
    returns None for, for the caller's gemm."""
    N, K = shape
    rng = np.random.default_rng(rows + K)
    x = rng.standard_normal((rows, K), dtype=np.float32)
    w = rng.standard_normal((N, K), dtype=np.float32)
    got = quant_ir.matmul_f32(x, w, lib=lib)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    assert got.shape == (rows, N) and got.dtype == np.float32
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()
    wide = np.zeros((N, K + 16), dtype=np.float32)
    wide[:, :K] = w
    if N > 1:  # (numpy calls one row contiguous whatever its stride)
        assert quant_ir.matmul_f32(x, wide[:, :K], lib=lib) is None  # rows strided
    assert quant_ir.matmul_f32(x[:, :K - 1], w[:, :K - 1].copy(), lib=lib) is None  # K not in 16s
    assert quant_ir.matmul_f32(x.astype(np.float64), w, lib=lib) is None


@pytest.mark.parametrize("kernel", ["ir", "mkl"])
def test_fp32_linear_takes_the_kernel_for_decode_rows(monkeypatch, kernel):
    """llama_family.linear sends fp32 CPU rows up to F32_KERNEL_ROWS to the fp32 kernel where the kernel is chosen
    (here forced: which one wins is the CPU's, measured by engine/model/kernel_choice.py and tested there), more
    rows always to MKL; its result is the product either way."""
    from engine.model import llama_family

    monkeypatch.setenv("KVSCOPE_F32_KERNEL", kernel)
    calls = []
    real = quant_ir.matmul_f32
    monkeypatch.setattr(quant_ir, "matmul_f32", lambda x, w, lib=None: calls.append(x.shape[0]) or real(x, w, lib))
    w = torch.randn(40, 96)
    for rows in (1, 8, 9, 300):
        x = torch.randn(rows, 96)
        got = llama_family.linear(x, w)
        assert torch.allclose(got, x.double().matmul(w.double().T).float(), rtol=1e-5, atol=1e-5)
    assert calls == ([1, 8] if kernel == "ir" else [])
