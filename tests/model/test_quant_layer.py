"""The fused decoder-layer segments of packed weights (engine/model/quant_layer.py): each computes what the unfused
steps (torch's RMSNorm, QuantWeight.matmul, the model's RoPE, SiLU) compute, and the engine takes them exactly for
the layers of the shape they describe."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.config import CacheConfig, EngineOptions
from engine.model import quant_ir
from engine.model.llama_family import rotate_half
from engine.model.loader import load_model
from engine.model.quant import quantize
from engine.model.quant_layer import FusedLayer, operand
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from tiny_models import prompts

pytestmark = pytest.mark.skipif(quant_ir.llvm is None, reason=f"no llvmlite: {quant_ir.status()}")

H, HKV, D, HID, INTER = 4, 2, 32, 128, 96


def _layer(kind: str, act: str, seed: int):
    g = torch.Generator().manual_seed(seed)

    def w(n, k):
        return quantize(torch.randn(n, k, generator=g) * 0.1, kind).with_activations(act)

    ws = dict(qkv=w((H + 2 * HKV) * D, HID), o=w(HID, H * D), gu=w(2 * INTER, HID), down=w(HID, INTER))
    norms = (torch.rand(HID, generator=g) + 0.5, torch.rand(HID, generator=g) + 0.5)
    layer = FusedLayer(*(operand(ws[k], act) for k in ("qkv", "o", "gu", "down")), *norms, 1e-5, H, HKV, D, INTER, True)
    return layer, ws, norms


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("act", ["fp32", "int8"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_segments_compute_the_unfused_steps(kind, act, rows):
    layer, ws, (n1, n2) = _layer(kind, act, rows)
    g = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, HID, generator=g) * 3
    ang = torch.rand(rows, D // 2, generator=g) * 6
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()

    qkv = ws["qkv"].matmul(F.rms_norm(x, (HID,), n1, 1e-5))
    qk = qkv[:, : (H + HKV) * D].view(rows, H + HKV, D)
    qk = qk * cos[:, None] + rotate_half(qk) * sin[:, None]
    want = torch.cat((qk.reshape(rows, -1), qkv[:, (H + HKV) * D:]), 1)
    got = layer.pre(x, cos, sin)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()

    attn = torch.randn(rows, H * D, generator=g)
    x1 = x + ws["o"].matmul(attn)
    gate, up = ws["gu"].matmul(F.rms_norm(x1, (HID,), n2, 1e-5)).chunk(2, -1)
    want = x1 + ws["down"].matmul(F.silu(gate) * up)
    got = layer.post(x, attn)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_int8_weights_with_zeros_are_not_fused():
    """operand refuses what its kernels would get wrong: int8 weights with zeros (the q8 kernels read none)."""
    w = quantize(torch.randn(64, 96), "int4").as_int8(32)
    assert bool((w.zero != 0).any()) and operand(w, "fp32") is None
    assert operand(quantize(torch.randn(64, 96), "int8"), "fp32") is not None


@pytest.mark.parametrize("act", ["fp32"])
def test_engine_decodes_the_same_tokens_fused_or_not(tiny_llama, act):
    """fp32 activations: the fused and unfused layers differ by float rounding only, so greedy tokens agree. (With
    int8 ones a rounding-level difference can move an input across a rounding boundary of the int8 grid, a step
    of 1/127 of its group's largest value, and a random tiny model's near-ties then flip: the segments test
    checks that arithmetic instead.)"""
    loaded = load_model(tiny_llama, dtype="int4")
    engines = [Engine(loaded, CacheConfig(block_size=16), EngineOptions(weights_dtype="int4", quant_activations=act))
               for _ in range(2)]
    assert all(f is not None for f in engines[0].model.fused)  # a Llama: every layer takes the fused path
    engines[1].model.fused_enabled = False
    ps = prompts(7, [5, 21, 40])
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    assert engines[0].generate(ps, sp) == engines[1].generate(ps, sp)


def test_layers_of_other_shapes_keep_the_unfused_path(tiny_gemma3):
    """Gemma 3 (post-norms, q/k norms): no fused layer, and its packed engine still runs."""
    eng = Engine(load_model(tiny_gemma3, dtype="int4"), CacheConfig(block_size=16), EngineOptions(weights_dtype="int4"))
    assert eng.model.fused == [None] * eng.spec.num_layers
    assert np.asarray(eng.generate(prompts(2, [9]), SamplingParams(max_new_tokens=3, ignore_eos=True))).size == 3



class _Count:
    """Counts FusedLayer.decode_into calls (whole decode layers) while active."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = FusedLayer.decode_into

        def counted(layer, *a, **k):
            self.n += 1
            return real(layer, *a, **k)

        monkeypatch.setattr(FusedLayer, "decode_into", counted)


def _engine(loaded, whole: bool, weights: str = "int4", **cache) -> Engine:
    e = Engine(loaded, CacheConfig(shadow_every_s=0.0, **cache), EngineOptions(weights_dtype=weights,
                                                                             quant_activations="fp32"))
    e.model.whole_layers = whole
    return e


def _run_both(monkeypatch, path: str, ps, n: int, weights: str = "int4", **cache):
    """The same requests through an engine taking whole decode layers (FusedLayer.decode_into) and one going layer by
    layer: (the engines, their tokens, the whole-layer calls each made)."""
    loaded = load_model(path, dtype=weights)
    count = _Count(monkeypatch)
    engines, out, calls = [_engine(loaded, True, weights, **cache), _engine(loaded, False, weights, **cache)], [], []
    for e in engines:
        before = count.n
        out.append(e.generate(ps, SamplingParams(max_new_tokens=n, ignore_eos=True)))
        calls.append(count.n - before)
    return engines, out, calls


@pytest.mark.parametrize("weights", ["int4", "fp32"])
@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_whole_decode_layers_equal_the_layer_by_layer_path(monkeypatch, tiny_llama, kv_dtype, block_size, weights):
    """A decode step whose layers run whole (layer + KV write + attention in one compiled call) computes what the
    layer-by-layer path computes, bit for bit: the same tokens, the same stored K/V (the fp16 / bf16 rounding of
    numba_kernel.from_f32 is torch's), and the same measurements of the fidelity probe (each block's K and V
    error, the key channels' absmax)."""
    from engine.kv.block_pool import Tier

    # fp32 layers are fused only where the f32 kernel beats MKL, measured at load (kernel_choice.fuse_layer): on a
    # tiny model under CI load MKL can win, and then no layer runs whole. Forced here: the subject is the two paths.
    monkeypatch.setenv("KVSCOPE_F32_KERNEL", "ir")
    engines, out, calls = _run_both(monkeypatch, tiny_llama, prompts(11, [5, 21, 40]), 12, weights,
                                    block_size=block_size, kv_dtype=kv_dtype)
    layers = engines[0].spec.num_layers
    assert calls[1] == 0 and calls[0] >= 11 * layers  # decode steps took the whole-layer path, the other never
    assert out[0] == out[1]
    d0, d1 = (e.pool.tiers[Tier.DEVICE] for e in engines)
    for side in ("k", "v"):
        for li in range(layers):
            assert torch.equal(getattr(d0, side)["data"][li], getattr(d1, side)["data"][li])
    np.testing.assert_allclose(d0.kerr, d1.kerr, rtol=2e-6, atol=0, equal_nan=True)
    np.testing.assert_allclose(d0.verr, d1.verr, rtol=2e-6, atol=0, equal_nan=True)
    measured = np.isfinite(d0.kerr)
    assert measured.any()
    if kv_dtype == "fp32":
        assert (d0.kerr[measured] == 0).all()
    else:  # a lossy format: the rounding shows
        assert (d0.kerr[measured] > 0).any() and (d0.verr[np.isfinite(d0.verr)] > 0).any()
    np.testing.assert_array_equal(engines[0].runner.errors.key_absmax, engines[1].runner.errors.key_absmax)
    assert engines[0].runner.errors.key_absmax.max() > 0


def test_host_blocks_leave_the_whole_layer_path(monkeypatch, tiny_llama):
    """A device tier too small for the batch (blocks written to or read from the host tier): those steps run layer
    by layer (StepKV.plain_writes / decode_plan say no), and the tokens equal an unbudgeted engine's."""
    loaded = load_model(tiny_llama, dtype="int4")
    ps, sp = prompts(13, [40, 40, 40]), SamplingParams(max_new_tokens=8, ignore_eos=True)
    count = _Count(monkeypatch)
    want = _engine(loaded, True, block_size=4).generate(ps, sp)
    steps = count.n // load_model(tiny_llama).spec.num_layers
    count.n = 0
    small = _engine(loaded, True, block_size=4, device_budget_mb=0.02, host_budget_mb=4)
    assert small.generate(ps, sp) == want
    assert count.n < steps * small.spec.num_layers  # some steps went layer by layer


def test_fp32_weights_run_whole_layers_with_transformers_tokens(monkeypatch, llama_model, llama_ref):
    """fp32 weights on the CPU take the fused layers too (the f32 kernels: quant_ir.operand_f32), so a decode step
    of a Llama runs each layer as one call; the sums' order is not MKL's, and greedy tokens still equal
    transformers' generate. KVSCOPE_FUSE_FP32=0's switch (llama_family.FUSE_FP32) keeps them out."""
    from engine.model import llama_family
    from engine.model.llama_family import LlamaFamily

    monkeypatch.setenv("KVSCOPE_F32_KERNEL", "ir")  # fused where the kernel wins on this CPU: here forced to win
    count = _Count(monkeypatch)
    eng = Engine(llama_model, CacheConfig(block_size=8, shadow_every_s=0.0), EngineOptions())
    assert all(f is not None for f in eng.model.fused)
    ps = prompts(21, [6, 19, 33])
    out = eng.generate(ps, SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert out == [llama_ref.greedy(p, 10) for p in ps]
    assert count.n >= 9 * eng.spec.num_layers  # the decode steps ran whole layers
    monkeypatch.setattr(llama_family, "FUSE_FP32", False)
    plain = Engine(llama_model, CacheConfig(block_size=8), EngineOptions())
    assert isinstance(plain.model, LlamaFamily) and plain.model.fused == [None] * plain.spec.num_layers
