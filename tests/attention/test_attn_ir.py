"""Decode attention's block loops in LLVM IR (engine/attention/attn_ir.py) against numba_kernel.decode_plain's own
loops and against float64 numpy, at the head shapes real models have (D 32, 64 and 128, 1 to 8 query rows a kv head),
for fp32, fp16 and bf16 blocks, partial last blocks, blocks read from the other tier, a window, and key segments
(split-K), compiled for this CPU and without AVX-512. The attention wiring's tests (test_numba_paged.py) run the
same kernel through the backend at D 16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.attention import attn_ir, numba_kernel

pytestmark = pytest.mark.skipif(attn_ir.llvm is None, reason=f"no llvmlite: {attn_ir.status()}")

FORMATS = {"f32": (torch.float32, np.zeros((1, 1), np.float32)), "f16": (torch.float16, numba_kernel.F16_BITS),
           "bf16": (torch.bfloat16, numba_kernel.BF16_BITS)}


def _blocks(x: torch.Tensor, fmt: str) -> tuple[np.ndarray, torch.Tensor]:
    """x (fp32) stored as format fmt: (the array decode_plain reads, the stored values as fp32)."""
    t = x.to(FORMATS[fmt][0]).contiguous()
    arr = t.numpy() if fmt == "f32" else t.view(torch.int16).numpy().view(np.uint16)
    return arr, t.float()


def _case(fmt: str, G: int, D: int, bs: int, lens: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    Hkv, B = 2, len(lens)
    nb = max(-(-n // bs) for n in lens)
    N = B * nb + 3  # slots, a few unused
    perm = torch.randperm(N, generator=g)[: B * nb].view(B, nb)
    on_alt = torch.rand(B, nb, generator=g) < 0.3  # these blocks are read from the other tier's slots
    k32, v32 = torch.randn(N, Hkv, bs, D, generator=g), torch.randn(N, Hkv, bs, D, generator=g)
    ak32, av32 = torch.randn(N, Hkv, bs, D, generator=g), torch.randn(N, Hkv, bs, D, generator=g)
    (kd, kf), (vd, vf), (akd, akf), (avd, avf) = (_blocks(t, fmt) for t in (k32, v32, ak32, av32))
    table = perm.numpy().astype(np.int64)
    alt = np.where(on_alt.numpy(), (perm.numpy() + 1) % N, -1).astype(np.int64)
    ctx = np.array(lens, dtype=np.int64)
    qpos = (ctx - 1)[:, None].astype(np.int64)
    q = torch.randn(B, Hkv * G, D, generator=g).numpy()
    return q, qpos, table, alt, ctx, (kd, vd, akd, avd), (kf, vf, akf, avf)


def _want(q, qpos, table, alt, ctx, window, stored, scale, bs):
    kf, vf, akf, avf = (t.double().numpy() for t in stored)
    B, H, D = q.shape
    Hkv = kf.shape[1]
    G = H // Hkv
    out = np.zeros((B, H, D))
    for b in range(B):
        p = int(qpos[b, 0])
        hi, lo = min(int(ctx[b]), p + 1), (max(0, p - window + 1) if window > 0 else 0)
        for h in range(Hkv):
            keys = []
            vals = []
            for i in range(lo, hi):
                j, t = divmod(i, bs)
                a = alt[b, j]
                keys.append((akf if a >= 0 else kf)[a if a >= 0 else table[b, j], h, t])
                vals.append((avf if a >= 0 else vf)[a if a >= 0 else table[b, j], h, t])
            K, V = np.array(keys), np.array(vals)
            for r in range(G):
                s = K @ q[b, h * G + r].astype(np.float64) * scale
                w = np.exp(s - s.max())
                out[b, h * G + r] = (w / w.sum()) @ V
    return out


def _has_avx2() -> bool:
    return bool(attn_ir.llvm.get_host_cpu_features().get("avx2"))


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("G,D", [(3, 64), (1, 64), (4, 64), (8, 32), (2, 128)])
@pytest.mark.parametrize("bs,window,S", [(16, 0, 1), (16, 40, 3), (5, 0, 4), (32, 0, 2)])
def test_block_loops_compute_decode_attention(isa, fmt, G, D, bs, window, S):
    """isa avx2: the same IR compiled without AVX-512 (a CPU with AVX2 only: each 16-lane vector two halves)."""
    if isa == "avx2" and not _has_avx2():
        pytest.skip("this CPU has no AVX2")
    fns = attn_ir.kernels(G, D) if isa == "native" else attn_ir._compile(G, D // 16, isa)
    assert fns.any(), attn_ir.status()  # this shape has kernels: the comparison below is of the IR loops
    code = list(FORMATS).index(fmt)
    q, qpos, table, alt, ctx, data, stored = _case(fmt, G, D, bs, [1, bs - 1 or 1, bs + 1, 3 * bs + 7, 70], G * D + bs)
    scale = D ** -0.5
    lut = FORMATS[fmt][1]
    got, loops = (np.empty(q.shape, np.float32) for _ in range(2))
    numba_kernel.decode_plain(q, scale, qpos, table, alt, ctx, window, *data, lut, got, S, fns[code])
    numba_kernel.decode_plain(q, scale, qpos, table, alt, ctx, window, *data, lut, loops, S, attn_ir.NONE[code])
    want = _want(q, qpos, table, alt, ctx, window, stored, scale, bs)
    # fp32 sums of D products and of up to 70 weighted values, in another order: a few ulp of the largest term
    tol = 64 * np.finfo(np.float32).eps * np.abs(want).max()
    assert np.abs(got - want).max() <= tol
    assert np.abs(loops - want).max() <= tol
    assert np.abs(got - loops).max() <= tol


def test_shapes_past_the_registers_and_the_switch_have_no_kernels(monkeypatch):
    assert not attn_ir.kernels(8, 256).any()  # 8 x 16 sums: more than MAX_VECTORS
    assert not attn_ir.kernels(3, 72).any()  # head dim not in 16s
    monkeypatch.setenv("KVSCOPE_ATTN_IR", "off")
    assert not attn_ir.kernels(3, 64).any()


def test_describe_says_which_loops_run_and_why(monkeypatch):
    assert attn_ir.describe(3, 64) == "LLVM IR kernels (3 query rows x head dim 64)"
    assert attn_ir.describe(3, 72) == "numba's loops (head dim 72 not in 16s)"
    assert attn_ir.describe(8, 256) == "numba's loops (8 x 16 sums past the 16 registers kept)"
    monkeypatch.setenv("KVSCOPE_ATTN_IR", "off")
    assert attn_ir.describe(3, 64) == "numba's loops (KVSCOPE_ATTN_IR=off)"


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("n", [1, 7, 16, 17, 100, 2056])
def test_softmax_kernel_computes_exp_rows_max_exps_and_sum(isa, n):
    """The max, exps and sum of a row of scores: the max exact, each exp Cephes' expf as exp_row computes it (within
    4 ulp of float64's exp of the same fp32 difference, and within 2 of exp_row's), the sum within n ulp of the exps'
    float64 sum; -inf scores (hidden keys) give 0, and a difference past fp32's exp range is clamped as exp_row
    clamps it."""
    if isa == "avx2" and not _has_avx2():
        pytest.skip("this CPU has no AVX2")
    fns = attn_ir.kernels(3, 64) if isa == "native" else attn_ir._compile(3, 4, isa)
    g = np.random.default_rng(n)
    s = (g.standard_normal(n) * 30).astype(np.float32)
    if n > 2:
        s[1] = -np.inf
        s[2] = np.float32(-200.0)  # 200 below the others: past the clamp
    got = s.copy()
    m, tot = np.zeros(1, np.float32), np.zeros(1, np.float32)
    _softmax(fns[0, 2], got, m, tot)
    assert m[0] == s.max()
    d = s - s.max()  # fp32, as both compute it
    ebuf = np.empty(n, np.int32)
    rows = s.reshape(1, n).copy()
    numba_kernel.exp_row(rows, 0, n, s.max(), ebuf, ebuf.view(np.float32))
    eps = float(np.finfo(np.float32).eps)
    inside = d >= np.float32(-87.33654)
    want = np.exp(d.astype(np.float64))
    assert np.all(np.abs(got[inside] - want[inside]) <= 4 * eps * want[inside])
    assert np.all(np.abs(got - rows[0]) <= 2 * eps * rows[0])
    if n > 2:
        assert got[1] == 0.0 and got[2] == rows[0, 2] > 0.0
    exact = got.astype(np.float64).sum()
    assert abs(float(tot[0]) - exact) <= n * eps * exact


def _softmax(fn: int, s: np.ndarray, m: np.ndarray, tot: np.ndarray) -> None:
    _call_softmax(np.int64(fn), s, m, tot)


@numba_kernel.njit
def _call_softmax(fn, s, m, tot):
    attn_ir.call(fn, (np.int64(s.ctypes.data), np.int64(s.shape[0]), np.int64(m.ctypes.data),
                      np.int64(tot.ctypes.data)))
