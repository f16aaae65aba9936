"""The fused decoder-layer segments of packed weights (engine/model/quant_layer.py): each computes what the unfused
steps (torch's RMSNorm, QuantWeight.matmul, the model's RoPE, SiLU) compute, and the engine takes them exactly for
the layers of the shape they describe."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import prompts
from engine.config import CacheConfig, EngineOptions
from engine.model import quant_ir
from engine.model.llama_family import rotate_half
from engine.model.loader import load_model
from engine.model.quant import quantize
from engine.model.quant_layer import FusedLayer, operand
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams

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
