"""`--weights-dtype int8|int4` (engine/model/quant.py, quant_kernels.py, gguf_direct.py): the packed kernels compute
the matmul of the weight they hold (checked against the dequantized weight's matmul), GGUF blocks unpack to exactly
the values gguf's own dequantize gives, a Llama GGUF's packed q/k rows come back in transformers' order, and an
engine on packed weights computes what an fp32 engine on those same (dequantized) weights computes, for every
architecture the engine serves. Quality against the fp32 original is measured by `kvscope bench --quality`, not
asserted here."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from engine.config import CacheConfig, ConfigError, EngineOptions
from engine.fidelity.shadow import dense_logits
from engine.model import gguf_direct, quant_kernels
from engine.model.loader import load_model, resolve_weights_dtype, weights_quant
from engine.model.quant import QuantWeight, pack_int4, quantize, stack_rows, unpack_int4
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from tiny_models import prompts
from workers import KEPT_OUT

KINDS = ("int8", "int4")


# -- kernels ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17, 40])  # 40: the prompt-chunk path (quant.PREFILL_ROWS)
def test_packed_matmul_equals_the_dequantized_weights_matmul(kind, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 576, generator=g) * 0.05
    x = torch.randn(rows, 576, generator=g)
    qw = quantize(w, kind)
    want = x.double() @ qw.dequantize().double().t()
    got = qw.matmul(x)
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    # and it is the quantized weight, not the original: quantization error is far larger than that tolerance
    assert (x.double() @ w.double().t() - want).abs().max() > 1e-3 * want.abs().max()


@pytest.mark.parametrize("kind", KINDS)
def test_embedding_lookup_is_the_dequantized_rows(kind):
    qw = quantize(torch.randn(50, 64), kind)
    ids = torch.tensor([0, 49, 7, 7])
    assert torch.equal(qw.lookup(ids), qw.dequantize()[ids])


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_rows_are_the_dequantized_rows_rounded(kind):
    """lookup_bf16 (a prompt chunk's bf16 gemm operand): bit for bit Tensor.bfloat16() of the fp32 rows, ties to
    even included (values built to sit exactly halfway between two bf16 numbers)."""
    qw = quantize(torch.randn(40, 96), kind)
    ids = torch.tensor([0, 39, 7, 7, 12])
    assert torch.equal(qw.lookup_bf16(ids).view(torch.int16), qw.lookup(ids).bfloat16().view(torch.int16))
    ties = QuantWeight("int8", torch.full((2, 32), 1, dtype=torch.int8),
                       torch.tensor([[1.0 + 2 ** -8], [1.0 + 3 * 2 ** -8]]), torch.zeros(2, 1), 32)
    got = ties.lookup_bf16(torch.tensor([0, 1])).float()[:, 0]
    assert got.tolist() == [1.0, 1.0 + 2 ** -6]  # halfway: to the even neighbour, down then up


def test_quantization_rounds_to_the_nearest_level():
    """int4: each group's 16 levels span its min..max; every value lands on its nearest level (error <= scale/2)."""
    w = torch.randn(8, 64)
    qw = quantize(w, "int4")
    err = (qw.dequantize() - w).abs().view(8, 2, 32)
    assert (err <= qw.scale[..., None] / 2 * (1 + 1e-5)).all()
    i8 = quantize(w, "int8")
    assert ((i8.dequantize() - w).abs() <= i8.scale / 2 * (1 + 1e-5)).all()


def test_int4_pack_round_trips_and_keeps_ggufs_nibble_order():
    vals = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = pack_int4(vals)
    assert torch.equal(unpack_int4(packed), vals)
    assert int(packed[0, 0]) == int(vals[0, 0]) | int(vals[0, 16]) << 4  # byte j: input j low, input 16 + j high


def test_stacked_rows_of_mixed_formats_hold_the_same_values():
    a, b = quantize(torch.randn(64, 64), "int4"), quantize(torch.randn(32, 64), "int8")
    s = stack_rows([a, b])
    assert s.kind == "int8"
    want = torch.cat([a.dequantize(), b.dequantize()])
    assert torch.allclose(s.dequantize(), want, rtol=0, atol=1e-6 * want.abs().max())


def test_kernels_compiled_here():
    """The packed kernels run compiled (numba); without it (a run with numba kept out, test_other_builds.py)
    quant.py falls back to dequantize + matmul."""
    assert quant_kernels.AVAILABLE == ("numba" not in KEPT_OUT)


# -- GGUF blocks ------------------------------------------------------------------------------------


def _random_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes in `kind`'s block layout (every byte pattern is a valid block), with finite fp16 scales."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    halves = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q5_0": [0], "Q4_K": [0, 2], "Q6_K": [size - 2]}[kind]
    for at in halves:  # fp16 scales from a sane range (random bits could be inf / NaN)
        data[..., at: at + 2] = (rng.uniform(-0.1, 0.1, (rows, cols // block)).astype(np.float16)
                                 .view(np.uint8).reshape(rows, cols // block, 2))
    return data.reshape(rows, -1)


@pytest.mark.parametrize("kind,exact", [("Q4_1", True), ("Q8_0", True), ("Q4_K", True), ("Q6_K", True),
                                        ("Q5_0", True), ("Q4_0", False)])
def test_gguf_blocks_unpack_to_ggufs_own_dequantize(kind, exact):
    """gguf_direct's packed weight, dequantized, equals gguf.quants.dequantize of the same bytes: bit for bit,
    except Q4_0, whose d (q - 8) is held as d q + (-8 d) (one rounding apart)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rows, cols = 6, 512
    data = _random_blocks(kind, rows, cols, seed=len(kind))
    t = types.SimpleNamespace(name="blk.0.ffn_up.weight", tensor_type=GGMLQuantizationType[kind], shape=[cols, rows],
                              data=data)
    w = gguf_direct.unpack_tensor(t, "int4")
    assert isinstance(w, QuantWeight) and w.shape == (rows, cols) and w.source == kind
    want = torch.from_numpy(dequantize(data, GGMLQuantizationType[kind]).reshape(rows, cols).astype(np.float32))
    got = w.dequantize()
    if exact:
        assert torch.equal(got, want)
    else:
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    x = torch.randn(3, cols)
    assert torch.allclose(w.matmul(x), x @ want.t(), rtol=1e-4, atol=1e-4 * (x @ want.t()).abs().max())


# -- the engine -------------------------------------------------------------------------------------


def test_the_option_is_checked_and_resolves_to_fp32_math():
    EngineOptions(weights_dtype="int4").validate()
    with pytest.raises(ConfigError, match="weights_dtype: 'int3' is not one of"):
        EngineOptions(weights_dtype="int3").validate()
    assert resolve_weights_dtype("int8") is torch.float32 and weights_quant("int4") == "int4"
    assert weights_quant("fp32") is None and weights_quant(torch.float32) is None


def _dequantized_twin(loaded):
    """A LoadedModel of the same spec whose every packed weight is replaced by its dequantized fp32 values."""
    import dataclasses

    seen: dict[int, torch.Tensor] = {}
    weights = {}
    for k, v in loaded.weights.items():
        if isinstance(v, QuantWeight):
            v = seen.setdefault(id(v), v.dequantize())
        weights[k] = v
    return dataclasses.replace(loaded, weights=weights)


FAMILIES = ("tiny_llama", "tiny_mistral", "tiny_qwen2", "tiny_qwen3", "tiny_olmo2", "tiny_granite", "tiny_smollm3",
            "tiny_gemma2", "tiny_gemma3", "tiny_gpt_oss", "tiny_phi3", "tiny_cohere")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", KINDS)
def test_packed_engine_computes_what_fp32_computes_on_the_same_values(request, family, kind):
    """Quantized at load (tensor by tensor from safetensors), every family runs: its logits equal an fp32 engine's on
    the dequantized weights, and greedy decoding through the paged cache gives the same tokens."""
    path = request.getfixturevalue(family)
    packed = load_model(path, dtype=kind)
    linear = [v for k, v in packed.weights.items() if k.endswith(("o_proj.weight", "down_proj.weight"))]
    assert linear and all(isinstance(v, QuantWeight) and v.kind == kind for v in linear)
    eng = Engine(packed, CacheConfig(block_size=16), EngineOptions(weights_dtype=kind, quant_activations="fp32"))
    twin = _dequantized_twin(packed)  # after the engine: what it packed itself (Phi-3's split qkv) is in the dict
    ref = Engine(twin, CacheConfig(block_size=16), EngineOptions(weights_dtype="fp32"))
    p = prompts(40, [75])[0]
    got, want = dense_logits(eng.model, p), dense_logits(ref.model, p)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max(), (got - want).abs().max()
    ps = prompts(41, [9, 30])
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    assert eng.generate(ps, sp) == ref.generate(ps, sp)


def test_fp32_loaded_weights_are_packed_by_the_engine(llama_model):
    """An engine asked for int4 on a LoadedModel in fp32 packs the float tensors itself (and replaces the dict's
    entries, so the floats can be freed)."""
    import copy

    loaded = copy.copy(llama_model)
    loaded.weights = dict(llama_model.weights)
    eng = Engine(loaded, CacheConfig(block_size=16), EngineOptions(weights_dtype="int4"))
    assert isinstance(eng.model.layers[0][1], QuantWeight) and isinstance(eng.model.embed, QuantWeight)
    assert isinstance(loaded.weights["model.layers.0.self_attn.q_proj.weight"], QuantWeight)
    assert eng.generate(prompts(3, [12]), SamplingParams(max_new_tokens=4, ignore_eos=True))[0]


# -- the default model's GGUF, direct ---------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_int4():
    return load_model(None, dtype="int4")


def test_gguf_direct_weights_equal_the_converted_checkpoint(smollm2_int4):
    """The default model's Q4_1 tensors, read packed from the GGUF, dequantize to exactly the fp32 tensors of its
    converted checkpoint (transformers: gguf's dequantize, then q/k rows un-permuted), and the Q8_0 embedding too."""
    from engine.model.safetensors_io import read_safetensors

    fp32 = read_safetensors(smollm2_int4.cache_dir)
    w = smollm2_int4.weights
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.29.self_attn.v_proj.weight", "model.layers.7.mlp.down_proj.weight",
                 "model.embed_tokens.weight"):
        assert isinstance(w[name], QuantWeight)
        assert torch.equal(w[name].dequantize(), fp32[name]), name
    assert w["model.embed_tokens.weight"].source == "Q8_0" and w["model.layers.0.mlp.up_proj.weight"].source == "Q4_1"
    assert torch.equal(w["model.norm.weight"], fp32["model.norm.weight"])


TEXT = ("The capital of France is a city that has been the home of many famous artists and writers. In the summer the "
        "streets along the river fill with visitors, and the museums stay open late into the evening. Its bakeries, "
        "markets and small theatres are as much a part of its life as the monuments people come to see.")
CHUNK_ROWS = 16  # rows a forward pass: fewer than quant.PREFILL_ROWS, so every matmul takes the decode kernels


def _int8_math(self: QuantWeight, x: torch.Tensor) -> torch.Tensor:
    """QuantWeight.matmul as the int8-activation arithmetic says, in float64 numpy: x rounded to int8 per 32 inputs
    (quant_ir's rounding), times the dequantized weight, the zero term on the unrounded x."""
    from engine.model import quant_ir

    x = x.float().contiguous()
    xq, dx, _ = quant_ir.quantize_activations(x.numpy())
    T, K = x.shape
    xr = (xq.astype(np.float64).reshape(T, K // 32, 32) * dx.astype(np.float64)[..., None]).reshape(T, K)
    W = self.dequantize().double().numpy()
    if not bool((self.zero != 0).any()):  # (Q8_0, the LM head's 49,152 rows: no zero term)
        return torch.from_numpy((xr @ W.T).astype(np.float32))
    Z = np.repeat(self.zero.double().numpy(), self.group, axis=1)
    return torch.from_numpy((xr @ (W - Z).T + x.double().numpy() @ Z.T).astype(np.float32))


def _mean_kl(p: torch.Tensor, q: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(p.double(), -1), torch.log_softmax(q.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1).mean().item()


def test_int8_activations_cost_what_their_arithmetic_costs(smollm2_int4, monkeypatch):
    """The default model, its GGUF's Q4_1/Q8_0 weights, 65 positions of text: the engine with int8 activations (the
    default, llama.cpp's math: the compiled kernels) is as far from fp32 activations as the int8 arithmetic itself is
    (the same matmuls in float64 numpy, the model's other code unchanged): mean KL within 2x.
    Why a ratio: rounding every matmul's input to int8 is chaotic across 30 layers. A last-bit difference anywhere
    moves some activation to the next level, so two exact implementations of the same arithmetic differ from each
    other by as much as either differs from fp32 (measured: kernels against the float64 reference, mean KL 0.022;
    each against fp32 0.019; one position's KL ranges 0-0.14, which made a one-position bound of 0.01 pass or fail
    by the order of a sum). Over 65 positions, whose KLs spread about as widely as their mean, each mean is known to
    about 1/sqrt(65) = 12 %, so 2x is some 5 standard errors; a kernel that got a scale, a zero or a rounding wrong is
    far past it. Without numba there is no int8 kernel: the fallback multiplies in fp32, the logits are equal."""
    p = smollm2_int4.tokenizer.encode(TEXT)
    logits = {}
    for act in ("int8", "fp32"):
        eng = Engine(smollm2_int4, CacheConfig(block_size=16), EngineOptions(weights_dtype="int4", quant_activations=act))
        logits[act] = dense_logits(eng.model, p, chunk=CHUNK_ROWS, every_row=True)
    if not quant_kernels.AVAILABLE:
        assert torch.equal(logits["int8"], logits["fp32"])
        return
    eng = Engine(smollm2_int4, CacheConfig(block_size=16), EngineOptions(weights_dtype="int4", quant_activations="int8"))
    eng.model.fused_enabled = False  # every packed matmul through QuantWeight.matmul, here the float64 arithmetic
    monkeypatch.setattr(QuantWeight, "matmul", _int8_math)
    reference = dense_logits(eng.model, p, chunk=CHUNK_ROWS, every_row=True)
    kernels, arithmetic = _mean_kl(logits["fp32"], logits["int8"]), _mean_kl(logits["fp32"], reference)
    assert arithmetic > 1e-4 and (logits["int8"] - logits["fp32"]).abs().max() > 0  # the options really differ
    assert kernels < 2 * arithmetic, (kernels, arithmetic)


def test_gguf_direct_engine_reports_its_format(smollm2_int4):
    eng = Engine(smollm2_int4, CacheConfig(block_size=16), EngineOptions(weights_dtype="int4"))
    assert eng.model.weights_format == "int4+int8 (Q4_1 x210, Q8_0 x1)"
    out = eng.generate([smollm2_int4.tokenizer.encode("The capital of France is")],
                       SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert "Paris" in smollm2_int4.tokenizer.decode(out[0])


def test_cuda_int8_packing_is_what_torchs_int8pack_kernel_multiplies():
    """The CUDA path of int8 weights (QuantWeight._pack_cuda -> aten._weight_int8pack_mm) has not run on a GPU here;
    torch's CPU kernel of the same op takes the same operands, so the packing's layout and scales are checked on it:
    equal to the dequantized weight's matmul up to float rounding. A weight with groups (a GGUF's Q8_0) is refused by
    name, not multiplied wrongly."""
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(48, 160, generator=g), torch.randn(3, 160, generator=g)
    q = quantize(w, "int8")
    qi, s = q._pack_cuda()
    got = torch.ops.aten._weight_int8pack_mm(x, qi, s)
    want = x.double() @ q.dequantize().double().T
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    grouped = QuantWeight("int8", qi, torch.rand(48, 5, generator=g), torch.zeros(48, 5), 32)
    with pytest.raises(NotImplementedError, match="groups of 32"):
        grouped._pack_cuda()
