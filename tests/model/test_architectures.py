"""The families beyond Llama / Mistral / Qwen2 (issue 21 item 1): Qwen3, OLMo 2, Granite, SmolLM3, Gemma 2,
Gemma 3 (text), GPT-OSS, Phi-3 (a mini-128k-like and a Phi-4-mini-like checkpoint), Cohere and Cohere 2, each a
tiny random-weight checkpoint (tests/conftest.py). Ground truth is transformers' fp32 greedy `generate` on the same
directory, at several block sizes, through a device tier smaller than one request, and under live
reconfiguration; for SmolLM3 (NoPE layers), Gemma 3 (a RoPE base per layer type), GPT-OSS (YaRN), Phi-3 (LongRoPE,
partial rotation), Cohere (interleaved RoPE) and Cohere 2 (RoPE on its sliding layers only) also K-shifts, against
transformers with the shift replayed on its cache; GPT-OSS's attention sinks also through the Triton backend, under
the interpreter (this file as a script is that worker). Gemma 2's attention soft-capping runs on the reference
backend only: any other is refused. Any other architecture is refused by name."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from engine.config import CacheConfig, ConfigError, EngineOptions
from engine.kv.tiers import Tier
from engine.model.loader import ModelLoadError, load_model
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from tiny_models import Reference, _engine, _save_tiny, hf_layer_inv_freq, prompts, shifted_greedy

N = 16
SP = SamplingParams(max_new_tokens=N, ignore_eos=True)
PROMPTS = prompts(30, [7, 30, 75])  # past the sliding window (24) of tiny_qwen3_sliding
FAMILIES = ("tiny_qwen3", "tiny_qwen3_sliding", "tiny_olmo2", "tiny_granite", "tiny_smollm3", "tiny_gemma2",
            "tiny_gemma3", "tiny_gpt_oss", "tiny_phi3", "tiny_phi4", "tiny_cohere", "tiny_cohere2")
SOFTCAP_REFUSED = "attention soft-capping \\(Gemma 2\\) runs on the reference backend only"


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(LoadedModel, Reference) of one family's tiny checkpoint."""
    path = request.getfixturevalue(request.param)
    return load_model(path), Reference(path)


def run(eng: Engine, ps, sp=SP) -> list[list[int]]:
    out = eng.generate(ps, sp)
    eng.check_invariants()
    return out


def shift_by_hand(model):
    """A 40-token prompt prefilled with every key kept (kv_groups off), then a context shift by hand: positions
    [4, 14) dropped (seq_rm), the rest moved back by 10 (seq_add). (engine, sequence, its keys before [L, 40, Hkv,
    D], after [L, 30, Hkv, D])."""
    eng = Engine(model, CacheConfig(block_size=8), EngineOptions(kv_groups="off"))  # every layer keeps every key
    sid = eng.add_request(prompts(31, [40])[0], SamplingParams(max_new_tokens=5, ignore_eos=True))
    eng.step()
    seq = eng.seqs[sid]
    assert seq.num_cached == 40
    k_before, _ = eng.kv.tokens_kv(seq)
    eng.seq_rm(sid, 4, 14)
    eng.seq_add(sid, 14, None, -10)
    k_after, _ = eng.kv.tokens_kv(seq)  # [L, n, Hkv, D]
    return eng, seq, k_before, k_after


# -- what the spec says about each family ---------------------------------------------------------------------


def test_specs_carry_each_familys_differences(tiny_qwen3, tiny_qwen3_sliding, tiny_olmo2, tiny_granite, tiny_smollm3):
    q3 = load_model(tiny_qwen3).spec
    assert (q3.architecture, q3.qk_norm, q3.norm_placement, q3.head_dim) == ("Qwen3ForCausalLM", "head", "pre", 32)
    assert q3.sliding_window == (None,) * 3 and not q3.attention_bias and not q3.nope_layers
    assert load_model(tiny_qwen3_sliding).spec.sliding_window == (None, 24, 24)
    olmo = load_model(tiny_olmo2).spec
    assert (olmo.qk_norm, olmo.norm_placement, olmo.rms_scale_fp32) == ("proj", "post", True)
    granite = load_model(tiny_granite).spec
    assert (granite.embedding_multiplier, granite.residual_multiplier, granite.attention_multiplier,
            granite.logits_scaling) == (2.0, 0.5, 0.0625, 8.0)
    smol = load_model(tiny_smollm3).spec
    assert smol.nope_layers == frozenset({1}) and smol.qk_norm == "none" and smol.sliding_window == (None,) * 3
    assert load_model(tiny_olmo2).weights.keys() >= {"model.layers.0.post_feedforward_layernorm.weight",
                                                    "model.layers.0.self_attn.q_norm.weight"}


def test_nope_layers_follow_smollm3s_config_rules():
    from engine.model.spec import _nope_layers

    # no_rope_layers[i] == 1 means layer i USES RoPE; absent, every no_rope_layer_interval-th layer skips it.
    assert _nope_layers({"no_rope_layers": [1, 0, 1, 0]}, "smollm3", 4) == {1, 3}
    assert _nope_layers({}, "smollm3", 8) == {3, 7}
    assert _nope_layers({"no_rope_layer_interval": 3}, "smollm3", 6) == {2, 5}
    assert _nope_layers({"no_rope_layers": [0, 0]}, "llama", 2) == frozenset()
    with pytest.raises(ModelLoadError, match="no_rope_layers lists 2 layers"):
        _nope_layers({"no_rope_layers": [1, 0]}, "smollm3", 3)


# -- tokens against transformers ------------------------------------------------------------------------------


def test_logits_equal_transformers(family):
    """The last token's fp32 logits after a 75-token prompt (the engine's dense path, as the shadow step runs it):
    what greedy tokens cannot see, e.g. Granite's logits scaling, is checked here."""
    from engine.fidelity.shadow import dense_logits

    model, ref = family
    eng = Engine(model, CacheConfig(block_size=16))
    p = PROMPTS[2]
    with torch.inference_mode():
        want = ref.model(torch.tensor([p])).logits[0, -1]
    got = dense_logits(eng.model, p)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max(), (got - want).abs().max()


@pytest.mark.parametrize("block_size", [1, 16, 100])
def test_greedy_equals_transformers_at_block_sizes(family, block_size):
    model, ref = family
    eng = Engine(model, CacheConfig(block_size=block_size), EngineOptions(max_batched_tokens=32))
    assert run(eng, PROMPTS) == [ref.greedy(p, N) for p in PROMPTS]


@pytest.mark.parametrize("attention", ["cpu", "reference"])
def test_device_tier_smaller_than_one_request_stays_exact(family, attention):
    """Two 8-token blocks on the device tier, requests of 23 to 91 tokens: the rest is read on the host tier.
    Gemma 2 (attention soft-capping) runs on the reference path only: `cpu` is refused."""
    model, ref = family
    if model.spec.attn_softcap is not None and attention != "reference":
        with pytest.raises(ConfigError, match=SOFTCAP_REFUSED):
            _engine(model, 8, 2, "stream", attention)
        return
    eng = _engine(model, 8, 2, "stream", attention)
    assert eng.pool.tiers[Tier.DEVICE].capacity == 2
    assert run(eng, PROMPTS) == [ref.greedy(p, N) for p in PROMPTS]
    c = eng.counters
    assert c.read_tokens_streamed > 0 and c.preemptions == 0


def test_live_reconfiguration_keeps_tokens(family):
    model, ref = family
    eng = Engine(model, CacheConfig(block_size=16))
    ids = [eng.add_request(p, SP) for p in PROMPTS]
    for i in range(200):
        if not eng.has_work():
            break
        if i == 3:
            eng.reconfigure(block_size=48)
        if i == 6:
            eng.reconfigure(block_size=5, policy="lru", demote_after_s=0.0, prefetch_depth=0)
        if i == 9:
            eng.reconfigure(device_budget_mb=0.2, host_budget_mb=3)
        eng.step()
        eng.check_invariants()
    assert eng.config.block_size == 5
    assert [eng.seqs[i].output for i in ids] == [ref.greedy(p, N) for p in PROMPTS]


def test_bf16_reference_path_equals_transformers_bf16(family):
    """bf16 weights and KV on the CPU: the reference path follows transformers' half-precision order (OLMo 2's
    norms scale before rounding, the others after), so greedy tokens equal bf16 `generate` exactly, up to an exact
    bf16 tie (equal_up_to_a_bf16_tie). One request
    at a time: in a decode group of two lengths the shorter row attends over masked padding, which rounds
    differently in bf16 (tiny_qwen3_sliding then flips a one-ulp near-tie: 20 of 24 tokens)."""
    _, ref = family
    path = ref.model.name_or_path
    hf = type(ref.model).from_pretrained(path, dtype=torch.bfloat16).eval()
    ps = prompts(24, [10, 40])
    with torch.inference_mode():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in ps]
    eng = Engine(load_model(path, dtype=torch.bfloat16), CacheConfig(block_size=7, kv_dtype="bf16"),
                 EngineOptions(attention="reference", weights_dtype="bf16"))
    for p, w in zip(ps, want):
        equal_up_to_a_bf16_tie(hf, p, w, run(eng, [p], SamplingParams(max_new_tokens=12, ignore_eos=True))[0])


def equal_up_to_a_bf16_tie(hf, prompt: list[int], want: list[int], got: list[int]) -> None:
    """Greedy tokens equal, or equal up to a step where transformers' bf16 logits tie the two tokens within one bf16
    ulp of the top logit (an exact tie's argmax follows the last rounding: with KV-cache groups a window layer's
    attention sums over fewer keys, and on this machine's AVX2 kernels tiny_qwen3_sliding meets a three-way tie at
    2.703125 at its 4th token). The tokens after a tie legitimately differ; a divergence elsewhere fails."""
    i = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), None)
    if i is None:
        assert len(got) == len(want)
        return
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + want[:i]])).logits[0, -1].float()
    top = float(logits.max())
    ulp = 2.0 ** (math.floor(math.log2(abs(top))) - 7) if top else 2.0 ** -133
    assert float(logits[got[i]]) >= top - ulp, (i, want, got, top, float(logits[got[i]]))


# -- SmolLM3: the K-shift leaves NoPE layers alone ------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm3(tiny_smollm3):
    return load_model(tiny_smollm3), Reference(tiny_smollm3)


def test_kshift_rotates_rope_layers_only(smollm3):
    model, ref = smollm3
    assert model.spec.nope_layers == {1}
    eng, seq, k_before, k_engine = shift_by_hand(model)
    keep_idx = torch.tensor(list(range(4)) + list(range(14, 40)))
    # Layer 0 (RoPE) depends on the token and its position only: equal to a fresh prefill's keys.
    k_ref = ref.keys(seq.tokens[: seq.num_cached])[0]
    assert (k_engine[0].transpose(0, 1) - k_ref).norm() / k_ref.norm() <= 1e-4
    # Layer 1 (NoPE): its keys carry no position, so the shift leaves them exactly as they were.
    assert torch.equal(k_engine[1], k_before[1][keep_idx])
    # Layer 2 (RoPE): the old keys rotated from their old positions to their new ones.
    old_pos = torch.tensor(list(range(4)) + list(range(14, 14 + seq.num_cached - 4)))
    fresh = eng.model.shift_keys(eng.model.shift_keys(k_before[2][keep_idx], -old_pos, 2), torch.arange(seq.num_cached), 2)
    assert (k_engine[2] - fresh).norm() / fresh.norm() <= 1e-4
    nope_keys = k_before[1]
    assert eng.model.shift_keys(nope_keys, torch.full((nope_keys.shape[0],), 5), 1) is nope_keys


def test_shifting_every_position_keeps_the_fresh_runs_tokens(smollm3):
    """seq_add of the whole sequence mid-generation: RoPE layers' keys are re-rotated (relative positions kept),
    NoPE layers' left alone, so the tokens stay those of a fresh run."""
    model, ref = smollm3
    ps = prompts(32, [20, 45])
    for block_size in (1, 16):
        eng = Engine(model, CacheConfig(block_size=block_size))
        ids = [eng.add_request(p, SP) for p in ps]
        for _ in range(3):
            eng.step()
        for sid in ids:
            eng.seq_add(sid, 0, None, 7)
            assert eng.seqs[sid].repositioned
        eng.run_until_done()
        eng.check_invariants()
        assert [eng.seqs[i].output for i in ids] == [ref.greedy(p, N) for p in ps]


# -- Gemma 2 / Gemma 3 ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma2(tiny_gemma2):
    return load_model(tiny_gemma2), Reference(tiny_gemma2)


@pytest.fixture(scope="module")
def gemma3(tiny_gemma3):
    return load_model(tiny_gemma3), Reference(tiny_gemma3)


def test_gemma_specs(gemma2, gemma3):
    g2, g3 = gemma2[0].spec, gemma3[0].spec
    assert (g2.architecture, g2.model_type, g2.norm_placement, g2.norm_offset, g2.mlp_act, g2.qk_norm) == (
        "Gemma2ForCausalLM", "gemma2", "sandwich", 1.0, "gelu_tanh", "none")
    assert (g2.attn_softcap, g2.final_softcap, g2.attention_multiplier, g2.embed_scale) == (4.0, 6.0, 0.25, 8.0)
    assert g2.sliding_window == (24, None, 24) and g2.local_rope is None and g2.tie_word_embeddings
    assert (g3.architecture, g3.model_type, g3.norm_placement, g3.qk_norm, g3.head_dim) == (
        "Gemma3ForCausalLM", "gemma3_text", "sandwich", "head", 16)
    assert g3.attn_softcap is None and g3.final_softcap is None and g3.attention_multiplier == 32 ** -0.5
    assert g3.sliding_window == (24, 24, None, 24, 24)
    assert (g3.rope_theta, g3.rope_scaling["rope_type"], g3.rope_scaling["factor"]) == (1e6, "linear", 8.0)
    assert g3.local_rope == (10_000.0, None)
    assert gemma3[0].weights.keys() >= {"model.layers.0.pre_feedforward_layernorm.weight",
                                        "model.layers.0.post_feedforward_layernorm.weight",
                                        "model.layers.0.self_attn.q_norm.weight"}


def test_gemma3_rope_parameters_in_either_config_format():
    from engine.model.spec import _layer_ropes

    v5 = {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    v4 = {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"type": "linear", "factor": 8.0}}
    for config in (v5, v4):
        (theta, scaling), local = _layer_ropes(config, "gemma3_text")
        assert (theta, scaling["rope_type"], scaling["factor"], local) == (1e6, "linear", 8.0, (1e4, None))
    assert _layer_ropes({}, "gemma3_text") == ((1e6, None), (1e4, None))
    assert _layer_ropes({"rope_theta": 5e5}, "llama") == ((5e5, None), None)


@pytest.mark.parametrize("field, value", [("attn_softcap", None), ("final_softcap", None), ("norm_offset", 0.0),
                                          ("embed_scale", 1.0), ("mlp_act", "silu"), ("attention_multiplier", None),
                                          ("local_rope", None), ("norm_placement", "pre")])
def test_each_gemma_difference_shows_in_the_logits(gemma2, gemma3, field, value):
    """The tiny checkpoints are sensitive to every Gemma datum: with any one left at Llama's value the logits
    move far from transformers' (so the equality tests above check each of them)."""
    import dataclasses

    from engine.fidelity.shadow import dense_logits
    from engine.model.llama_family import LlamaFamily

    # tiny_gemma2's query_pre_attn_scalar is its head_dim: the scale is checked on tiny_gemma3 (32 vs 16)
    model, ref = gemma3 if field in ("local_rope", "attention_multiplier") else gemma2
    p = PROMPTS[2]
    with torch.inference_mode():
        want = ref.model(torch.tensor([p])).logits[0, -1]
    weights = dict(model.weights)
    if field == "norm_placement":  # Llama's two norms: drop Gemma's two output norms
        weights = {k: v for k, v in weights.items() if "post_feedforward" not in k}
        weights |= {k.replace("pre_feedforward", "post_attention"): v for k, v in model.weights.items()
                    if "pre_feedforward" in k}
    wrong = LlamaFamily(dataclasses.replace(model.spec, **{field: value}), weights, torch.device("cpu"), "fp32")
    assert (dense_logits(wrong, p) - want).abs().max() > 1e-2 * want.abs().max()


def test_gemma2_soft_capping_runs_on_the_reference_backend_only(gemma2):
    model, ref = gemma2
    eng = Engine(model, CacheConfig(block_size=16))  # attention auto
    assert eng.model.attention == "reference" and eng.model.backend is None
    assert run(eng, PROMPTS[:2]) == [ref.greedy(p, N) for p in PROMPTS[:2]]
    for name in ("cpu", "triton"):
        with pytest.raises(ConfigError, match=f"attention: '{name}' cannot run this model: " + SOFTCAP_REFUSED):
            Engine(model, CacheConfig(block_size=16), EngineOptions(attention=name))
        with pytest.raises(ConfigError, match=SOFTCAP_REFUSED):
            eng.model.use_attention(name)
    assert eng.model.attention == "reference"
    # host_reads="compute" (the host part attended by the partial formula, which has no soft-capping): the host
    # blocks are gathered instead, and the tokens stay exact.
    eng = _engine(model, 8, 2, "compute", "reference")
    assert run(eng, PROMPTS) == [ref.greedy(p, N) for p in PROMPTS]


@pytest.mark.parametrize("attention", ["cpu", "reference"])
def test_gemma3_runs_on_every_backend(gemma3, attention):
    """No attention soft-capping in Gemma 3: the in-place backends run it (and auto picks `cpu` on the CPU)."""
    model, ref = gemma3
    eng = Engine(model, CacheConfig(block_size=16), EngineOptions(attention=attention))
    assert eng.model.attention == attention
    assert Engine(model, CacheConfig(block_size=16)).model.attention == "cpu"
    assert run(eng, PROMPTS) == [ref.greedy(p, N) for p in PROMPTS]


def test_gemma3_kshift_rotates_each_layer_with_its_own_base(gemma3):
    """Sliding layers (base 10k) and the full layer (1M, linear x8) re-rotate each with their own RoPE: after a
    context shift by hand each layer's keys are the old ones rotated by the position change with transformers'
    inv_freq of that layer's type (and, on layer 0, which sees no context, equal a fresh prefill's: transformers'
    cache keeps the last window - 1 keys of a sliding layer, those are compared); with the other type's, not."""
    from engine.model.llama_family import rotate_half

    model, ref = gemma3
    eng, seq, k_before, k_engine = shift_by_hand(model)
    assert eng.model.layer_rope == [1, 1, 0, 1, 1]  # ropes: 0 the full layer's, 1 the sliding ones'
    keep_idx = torch.tensor(list(range(4)) + list(range(14, 40)))
    delta = torch.tensor([0] * 4 + [-10] * 26)
    layer_inv = hf_layer_inv_freq(ref.model)
    assert not torch.equal(layer_inv[0], layer_inv[2])

    def rotated(k, inv):
        freqs = delta.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return k * emb.cos()[:, None] + rotate_half(k) * emb.sin()[:, None]

    for li in range(model.spec.num_layers):
        want = rotated(k_before[li][keep_idx], layer_inv[li])
        assert (k_engine[li] - want).norm() / want.norm() <= 1e-5, li
        other = layer_inv[2 if li != 2 else 0]
        assert (k_engine[li] - rotated(k_before[li][keep_idx], other)).norm() / want.norm() > 1e-2, li
    fresh = ref.keys(seq.tokens[: seq.num_cached])[0].transpose(0, 1)  # [n', Hkv, D], layer 0: no context
    assert (k_engine[0][-fresh.shape[0]:] - fresh).norm() / fresh.norm() <= 1e-4


# -- GPT-OSS ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_oss(tiny_gpt_oss):
    return load_model(tiny_gpt_oss), Reference(tiny_gpt_oss)


def test_gpt_oss_spec(gpt_oss):
    from engine.model.spec import MoeSpec

    model, ref = gpt_oss
    s = model.spec
    assert (s.architecture, s.model_type, s.norm_placement, s.rms_scale_fp32, s.qk_norm) == (
        "GptOssForCausalLM", "gpt_oss", "pre", True, "none")
    assert s.attention_bias and s.o_proj_bias and s.attn_sinks and not s.tie_word_embeddings
    assert s.moe == MoeSpec(num_experts=4, top_k=2, swiglu_alpha=1.702, swiglu_limit=7.0)
    assert s.sliding_window == (24, None, 24) and s.attention_multiplier is None
    assert (s.rope_theta, s.rope_scaling["rope_type"], s.rope_scaling["factor"], s.rope_scaling["truncate"]) == (
        150000.0, "yarn", 8.0, False)
    assert model.weights["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 128)  # plain fp32, no mxfp4
    assert model.weights["model.layers.0.self_attn.sinks"].shape == (4,)
    # YaRN: the same inv_freq and attention scaling as transformers', bit for bit
    from engine.model.llama_family import rope_inv_freq

    inv, scaling = rope_inv_freq(s)
    assert torch.equal(inv, ref.model.model.rotary_emb.inv_freq) and scaling == ref.model.model.rotary_emb.attention_scaling


@pytest.mark.parametrize("params", [
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
    {"factor": 4.0, "original_max_position_embeddings": 128},  # truncate (default True), default betas
    {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},  # DeepSeek's
    {"factor": 2.0, "attention_factor": 1.5, "beta_fast": 8.0, "original_max_position_embeddings": 256},
])
def test_yarn_equals_transformers(params):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.model.llama_family import _yarn_inv_freq

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, **params}
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=131072,
                         rope_parameters=dict(rope))
    want_inv, want_scaling = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    inv, scaling = _yarn_inv_freq(150000.0, 64, rope, 131072)
    assert torch.equal(inv, want_inv) and scaling == pytest.approx(want_scaling, rel=1e-12)


@pytest.mark.parametrize("change", ["no sinks", "zero sinks", "plain rope", "no yarn scaling", "top 1", "top 3",
                                    "no o_proj bias", "no swiglu limit", "swiglu alpha 1", "no window"])
def test_each_gpt_oss_difference_shows_in_the_logits(gpt_oss, change):
    """Every GPT-OSS datum moves the logits far from transformers' when left out (the sinks, dropped or zeroed: a
    zero sink still weighs exp(0); YaRN's frequencies and its attention scaling; the router's top-k; o_proj's
    bias; the clamped SwiGLU's limit and alpha; the sliding window, which the 75-token prompt passes)."""
    import dataclasses

    from engine.fidelity.shadow import dense_logits
    from engine.model.llama_family import LlamaFamily

    model, ref = gpt_oss
    s, p = model.spec, PROMPTS[2]
    with torch.inference_mode():
        want = ref.model(torch.tensor([p])).logits[0, -1]
    weights = dict(model.weights)
    moe = dataclasses.replace
    changes = {
        "no sinks": dict(attn_sinks=False), "plain rope": dict(rope_scaling=None),
        "no yarn scaling": dict(rope_scaling={**s.rope_scaling, "attention_factor": 1.0}),
        "top 1": dict(moe=moe(s.moe, top_k=1)), "top 3": dict(moe=moe(s.moe, top_k=3)),
        "no o_proj bias": dict(o_proj_bias=False), "no swiglu limit": dict(moe=moe(s.moe, swiglu_limit=1e9)),
        "swiglu alpha 1": dict(moe=moe(s.moe, swiglu_alpha=1.0)), "no window": dict(sliding_window=(None,) * 3),
    }
    if change == "zero sinks":
        weights = {k: torch.zeros_like(v) if k.endswith("sinks") else v for k, v in weights.items()}
    wrong = LlamaFamily(dataclasses.replace(s, **changes.get(change, {})), weights, torch.device("cpu"), "fp32")
    assert (dense_logits(wrong, p) - want).abs().max() > 5e-3 * want.abs().max()


@pytest.mark.parametrize("attention", ["cpu", "reference"])
def test_gpt_oss_host_compute_equals_transformers(gpt_oss, attention, monkeypatch):
    """host_reads="compute": the host blocks attended on the host, the sinks joined once, after the device and host
    parts are merged. auto picks `cpu` (it honours sinks), as for every model without soft-capping."""
    import engine.model.llama_family as llama_family

    model, ref = gpt_oss
    assert Engine(model, CacheConfig(block_size=16)).model.attention == "cpu"
    splits = []
    real = llama_family.attend_split
    monkeypatch.setattr(llama_family, "attend_split", lambda *a, **kw: splits.append(kw["sinks"]) or real(*a, **kw))
    eng = _engine(model, 8, 2, "compute", attention)
    assert run(eng, PROMPTS) == [ref.greedy(p, N) for p in PROMPTS]
    assert splits and all(s is not None for s in splits)


def test_gpt_oss_triton_backend_tokens_equal_transformers(gpt_oss, tiny_gpt_oss, tmp_path):
    """The paged-decode kernel with the sinks joined after it (prefill: the cpu path), in an engine, under the
    interpreter (this file as a script is the worker)."""
    import json
    import os
    import subprocess

    from workers import ROOT, interpreter_env

    try:
        import triton  # noqa: F401
    except ImportError as e:
        pytest.skip(f"triton is not installed ({e})")
    _, ref = gpt_oss
    out = tmp_path / "tokens.json"
    env = interpreter_env(KVSCOPE_TEST_CACHE_DIR=os.environ["KVSCOPE_CACHE_DIR"])
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(out), tiny_gpt_oss], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"interpreter worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    assert json.loads(out.read_text()) == [ref.greedy(p, 8) for p in TRITON_PROMPTS]


TRITON_PROMPTS = prompts(34, [7, 30])  # past the window (24) once decoding


def _triton_worker(out: str, path: str) -> None:
    import json

    from engine.attention.triton_paged import INTERPRET

    assert INTERPRET, "run with TRITON_INTERPRET=1"
    torch.set_num_threads(1)
    eng = Engine(load_model(path), CacheConfig(block_size=5), EngineOptions(attention="triton", max_batched_tokens=16))
    assert eng.model.backend.name == "triton"
    with open(out, "w") as f:
        json.dump(eng.generate(TRITON_PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True)), f)


def test_gpt_oss_kshift_is_a_pure_rotation_with_yarns_frequencies(gpt_oss):
    """Cached keys carry YaRN's attention scaling once (cos and sin x it); a K-shift rotates them by the position
    change with YaRN's inv_freq and without the scaling (a second factor would scale them twice): after a shift by
    hand each layer's keys are the old ones so rotated, and layer 0's equal a fresh prefill's (transformers keeps a
    sliding layer's last window - 1 keys: those are compared)."""
    from engine.model.llama_family import rotate_half

    model, ref = gpt_oss
    eng, seq, k_before, k_engine = shift_by_hand(model)
    keep_idx = torch.tensor(list(range(4)) + list(range(14, 40)))
    delta = torch.tensor([0] * 4 + [-10] * 26)
    inv = hf_layer_inv_freq(ref.model)[0]
    scaling = ref.model.model.rotary_emb.attention_scaling
    assert scaling > 1.2

    def rotated(k, factor=1.0):
        freqs = delta.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return k * (emb.cos() * factor)[:, None] + rotate_half(k) * (emb.sin() * factor)[:, None]

    for li in range(model.spec.num_layers):
        want = rotated(k_before[li][keep_idx])
        assert (k_engine[li] - want).norm() / want.norm() <= 1e-5, li
        assert (k_engine[li] - rotated(k_before[li][keep_idx], scaling)).norm() / want.norm() > 1e-1, li
    fresh = ref.keys(seq.tokens[: seq.num_cached])[0].transpose(0, 1)  # [n', Hkv, D]
    assert (k_engine[0][-fresh.shape[0]:] - fresh).norm() / fresh.norm() <= 1e-4


def test_gpt_oss_config_defaults_are_transformers(tmp_path, tiny_gpt_oss):
    """A config.json without rope_parameters, layer_types, sliding_window or attention_bias: GptOssConfig's values
    (YaRN x32 over 4096 positions, base 150k, truncate off; sliding layers 0, 2, window 128; biases on)."""
    import json
    import shutil

    from transformers import GptOssConfig

    path = tmp_path / "defaults"
    shutil.copytree(tiny_gpt_oss, path)
    config = json.loads((path / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "sliding_window", "attention_bias"):
        config.pop(key)
    (path / "config.json").write_text(json.dumps(config))
    s = load_model(str(path)).spec
    hf = GptOssConfig.from_pretrained(str(path))
    assert s.sliding_window == (128, None, 128) and hf.layer_types[::2] == ["sliding_attention"] * 2
    assert s.attention_bias and s.o_proj_bias and hf.attention_bias
    assert s.rope_theta == hf.rope_parameters["rope_theta"] == 150000.0
    assert {k: s.rope_scaling[k] for k in hf.rope_parameters} == hf.rope_parameters


def test_quantized_checkpoints_are_refused(tmp_path, tiny_gpt_oss):
    """gpt-oss as published stores its experts in mxfp4 (quantization_config): refused in one line, by name."""
    import json
    import shutil

    path = tmp_path / "mxfp4"
    shutil.copytree(tiny_gpt_oss, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(ModelLoadError, match=r"quantized checkpoint \(mxfp4\) in .* is not supported"):
        load_model(str(path))


# -- Phi-3 / Phi-4-mini and Cohere ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def phi3(tiny_phi3):
    return load_model(tiny_phi3), Reference(tiny_phi3)


@pytest.fixture(scope="module")
def phi4(tiny_phi4):
    return load_model(tiny_phi4), Reference(tiny_phi4)


@pytest.fixture(scope="module")
def cohere(tiny_cohere):
    return load_model(tiny_cohere), Reference(tiny_cohere)


@pytest.fixture(scope="module")
def cohere2(tiny_cohere2):
    return load_model(tiny_cohere2), Reference(tiny_cohere2)


def test_phi_and_cohere_specs(phi3, phi4, cohere, cohere2):
    p3, p4, co, co2 = phi3[0].spec, phi4[0].spec, cohere[0].spec, cohere2[0].spec
    assert (p3.architecture, p3.model_type, p3.fused_checkpoint, p3.rotary_dim, p3.tie_word_embeddings) == (
        "Phi3ForCausalLM", "phi3", True, None, False)
    assert p3.sliding_window == (24, 24, 24) and p3.norm_kind == "rms" and p3.rms_norm_eps == 1e-5
    assert (p3.rope_scaling["rope_type"], p3.rope_scaling["original_max_position_embeddings"]) == ("longrope", 4)
    assert p3.rope_scaling["attention_factor"] == pytest.approx((1 + math.log(128) / math.log(4)) ** 0.5)
    assert (p4.rotary_dim, p4.tie_word_embeddings, p4.sliding_window, p4.num_kv_heads) == (12, True, (None,) * 3, 1)
    assert p4.rope_scaling["attention_factor"] == pytest.approx((1 + math.log(32) / math.log(128)) ** 0.5)
    assert (co.architecture, co.model_type, co.norm_kind, co.norm_placement, co.qk_norm) == (
        "CohereForCausalLM", "cohere", "layer", "parallel", "each_head")
    assert (co.logit_scale, co.rope_interleaved, co.tie_word_embeddings, co.rotary_dim) == (0.0625, True, True, None)
    assert (co2.architecture, co2.model_type, co2.norm_kind, co2.norm_placement, co2.qk_norm) == (
        "Cohere2ForCausalLM", "cohere2", "layer", "parallel", "none")
    assert (co2.sliding_window, co2.nope_layers, co2.logit_scale, co2.rope_interleaved) == (
        (24, None, 24), {1}, 0.25, True)
    # Phi-3's fused tensors are checked as they are stored, then named by their row ranges, which LlamaFamily takes
    # as one view again: no copy.
    w = phi3[0].weights
    assert "model.layers.0.self_attn.qkv_proj.weight" not in w
    q, k, v = (w[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    assert (q.shape, k.shape, v.shape) == ((64, 64), (32, 64), (32, 64))
    assert k.data_ptr() == q.data_ptr() + q.numel() * q.element_size()
    from engine.model.llama_family import LlamaFamily

    fam = LlamaFamily(p3, w, torch.device("cpu"), "fp32")
    assert fam.layers[0][1].data_ptr() == q.data_ptr() and fam.layers[0][5].data_ptr() == (
        w["model.layers.0.mlp.gate_proj.weight"].data_ptr())


def test_phi3_rope_config_forms():
    from engine.model.spec import _phi3_rope, _rope

    def resolve(config, head_dim=16):
        return _phi3_rope(config, head_dim, _rope(config)[1])

    short, long = [1.0] * 8, [2.0] * 8
    v4 = {"rope_scaling": {"type": "su", "short_factor": short, "long_factor": long},
          "max_position_embeddings": 131072, "original_max_position_embeddings": 4096}
    scaling, rotary = resolve(v4)
    assert (scaling["rope_type"], scaling["original_max_position_embeddings"], rotary) == ("longrope", 4096, None)
    assert scaling["attention_factor"] == pytest.approx((1 + math.log(32) / math.log(4096)) ** 0.5)
    # v5: rope_parameters with the partial factor inside; the top-level original length wins over the inner one
    v5 = {"rope_parameters": {"rope_type": "longrope", "short_factor": short[:6], "long_factor": long[:6],
                              "partial_rotary_factor": 0.75, "original_max_position_embeddings": 64,
                              "rope_theta": 1e4},
          "max_position_embeddings": 64, "original_max_position_embeddings": 32}
    scaling, rotary = resolve(v5)
    assert (scaling["original_max_position_embeddings"], rotary, scaling["attention_factor"]) == (32, 12, (
        1 + math.log(2) / math.log(32)) ** 0.5)
    assert resolve({"partial_rotary_factor": 0.5}) == (None, 8)
    assert resolve({"rope_scaling": {"rope_type": "longrope", "short_factor": short, "long_factor": long,
                                     "attention_factor": 1.5}})[0]["attention_factor"] == 1.5
    with pytest.raises(ModelLoadError, match="short_factor lists 8 factors; the 12 rotated dims need 6"):
        resolve({**v5, "rope_parameters": {**v5["rope_parameters"], "short_factor": short}})
    with pytest.raises(ModelLoadError, match="default or longrope only"):
        resolve({"rope_scaling": {"rope_type": "linear", "factor": 2.0}})


def test_longrope_factors_follow_the_context_limit(phi3, phi4):
    """The engine's context limit picks LongRoPE's factors (rope_inv_freq): up to original_max_position_embeddings
    the short ones, past it the long ones, each transformers' own, with its cos/sin scaling."""
    from engine.model.llama_family import LlamaFamily

    for (model, ref), long_limit in ((phi3, 512), (phi4, 129)):
        rotary = ref.model.model.rotary_emb
        orig = model.spec.rope_scaling["original_max_position_embeddings"]
        with torch.inference_mode():
            ref.model(torch.tensor([list(range(3, 3 + orig + 1))]))  # transformers switches to the long factors
        hf_long, hf_short = rotary.inv_freq.clone(), rotary.original_inv_freq
        assert not torch.equal(hf_long, hf_short)
        for limit, want in ((orig, hf_short), (long_limit, hf_long)):
            inv, scaling = LlamaFamily(model.spec, model.weights, torch.device("cpu"), "fp32",
                                       context_limit=limit).ropes[0]
            assert torch.equal(inv, want) and scaling == rotary.attention_scaling
    assert Engine(phi3[0]).model.ropes[0][0].equal(LlamaFamily(
        phi3[0].spec, phi3[0].weights, torch.device("cpu"), "fp32", context_limit=512).ropes[0][0])
    assert Engine(phi3[0], options=EngineOptions(context_limit=4)).model.ropes[0][0].equal(
        phi3[1].model.model.rotary_emb.original_inv_freq)


def test_longrope_past_the_original_length_uses_the_long_factors_from_the_first_token(phi3):
    """The known difference from transformers (rope_inv_freq): tiny_phi3's engine (context limit 512 > original
    length 4) rotates a 3-token prompt with the long factors from its first token on, where transformers uses the
    short ones until the sequence passes 4 tokens and then recomputes its cache with the long ones. The engine's
    tokens are transformers' with the long factors throughout; its first logits are not plain transformers'."""
    from engine.fidelity.shadow import dense_logits

    model, ref = phi3
    p = prompts(34, [3])[0]
    eng = Engine(model, CacheConfig(block_size=4))
    got = run(eng, [p])[0]
    long_ref = Reference(ref.model.name_or_path)
    rotary = long_ref.model.model.rotary_emb
    with torch.inference_mode():
        want_first = long_ref.model(torch.tensor([p])).logits[0, -1]  # 3 tokens: the short factors
        long_ref.model(torch.tensor([list(range(3, 9))]))  # past 4: rotary.inv_freq now holds the long factors
        rotary.original_inv_freq.copy_(rotary.inv_freq)  # the short set replaced by the long one
    assert got == long_ref.greedy(p, N)
    assert (dense_logits(eng.model, p) - want_first).abs().max() > 1e-2 * want_first.abs().max()


def _phi4_all_rotated(spec):
    import dataclasses

    scaling = {**spec.rope_scaling, "short_factor": spec.rope_scaling["short_factor"] + [1.0, 1.0],
               "long_factor": spec.rope_scaling["long_factor"] + [1.0, 1.0]}
    return dataclasses.replace(spec, rotary_dim=None, rope_scaling=scaling)


@pytest.mark.parametrize("name, field, value", [
    ("phi3", "rope_scaling", None), ("phi3", "attention_factor", 1.0), ("phi3", "context_limit", 4),
    ("phi3", "sliding_window", (None,) * 3), ("phi4", "rotary_dim", None), ("phi4", "context_limit", 129),
    ("cohere", "logit_scale", 1.0), ("cohere", "rope_interleaved", False), ("cohere", "norm_kind", "rms"),
    ("cohere", "qk_norm", "none"), ("cohere", "norm_placement", "pre"), ("cohere2", "nope_layers", frozenset()),
    ("cohere2", "rope_interleaved", False)])
def test_each_phi_and_cohere_difference_shows_in_the_logits(request, name, field, value):
    """With any one datum left at Llama's value (context_limit: LongRoPE's other factors; rotary_dim: every dim
    rotated) the logits move far from transformers' (so the equality tests above check each of them)."""
    import dataclasses

    from engine.fidelity.shadow import dense_logits
    from engine.model.llama_family import LlamaFamily

    model, ref = request.getfixturevalue(name)
    p = PROMPTS[2]
    with torch.inference_mode():
        want = ref.model(torch.tensor([p])).logits[0, -1]
    spec, weights, limit = model.spec, dict(model.weights), None
    if field == "context_limit":
        limit = value
    elif field == "attention_factor":
        spec = dataclasses.replace(spec, rope_scaling={**spec.rope_scaling, "attention_factor": value})
    elif field == "rotary_dim":
        spec = _phi4_all_rotated(spec)
    else:
        spec = dataclasses.replace(spec, **{field: value})
    if field == "norm_placement":  # Llama's second norm: the same weights as the first
        weights |= {k.replace("input_layernorm", "post_attention_layernorm"): v for k, v in weights.items()
                    if "input_layernorm" in k}
    right = LlamaFamily(model.spec, dict(model.weights), torch.device("cpu"), "fp32")
    assert (dense_logits(right, p) - want).abs().max() <= 1e-4 * want.abs().max()
    wrong = LlamaFamily(spec, weights, torch.device("cpu"), "fp32", context_limit=limit)
    assert (dense_logits(wrong, p) - want).abs().max() > 1e-2 * want.abs().max()


@pytest.mark.parametrize("name", ["phi3", "phi4", "cohere", "cohere2"])
def test_kshift_keys_equal_a_fresh_prefills(request, name):
    """After a context shift by hand, layer 0's keys (which see no context) equal transformers' fresh prefill of
    the kept tokens at their new positions: LongRoPE's scaling kept, only the rotated dims re-rotated (Phi-4-mini),
    the interleaved pairs rotated as pairs (Cohere). transformers' cache keeps a sliding layer's last window - 1
    keys (tiny_phi3, tiny_cohere2): those are compared. Every other layer: the old keys re-rotated by the position
    change; a NoPE layer's (Cohere 2's full-attention layer) left as they were."""
    model, ref = request.getfixturevalue(name)
    eng, seq, k_before, k_engine = shift_by_hand(model)
    fresh = ref.keys(seq.tokens[: seq.num_cached])[0].transpose(0, 1)  # [n', Hkv, D]
    assert (k_engine[0][-fresh.shape[0]:] - fresh).norm() / fresh.norm() <= 1e-4
    keep_idx = torch.tensor(list(range(4)) + list(range(14, 40)))
    delta = torch.tensor([0] * 4 + [-10] * 26)
    rotary_dim = model.spec.rotary_dim or model.spec.head_dim
    for li in range(model.spec.num_layers):
        old = k_before[li][keep_idx]
        if li in model.spec.nope_layers:
            assert torch.equal(k_engine[li], old)
            continue
        assert (k_engine[li] - eng.model.shift_keys(old, delta, li)).norm() / old.norm() <= 1e-6
        assert not torch.allclose(k_engine[li][4:, :, :rotary_dim], old[4:, :, :rotary_dim])
        assert torch.equal(k_engine[li][:, :, rotary_dim:], old[:, :, rotary_dim:])  # Phi-4-mini: passed through


# -- context shifts, replayed on transformers' cache (every family with something to re-rotate) -------------------


def reference_inv_freq(model, ref, first: list[int]) -> list:
    """transformers' inv_freq per layer (None: a NoPE layer) once it has seen `first`: tiny_phi3's prompts pass its
    original length, so LongRoPE's long factors."""
    with torch.inference_mode():
        ref.model(torch.tensor([first]))
    return [None if inv is None else inv.clone() for inv in hf_layer_inv_freq(ref.model, model.spec.nope_layers)]


@pytest.mark.parametrize("name", ["smollm3", "gemma3", "gpt_oss", "phi3", "phi4", "cohere", "cohere2"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_context_shift_tokens_equal_transformers(request, name, block_size):
    """context_limit 32, n_keep 4, 60 new tokens: several shifts per sequence, replayed on transformers' cache with
    each layer's own inv_freq: SmolLM3's and Cohere 2's NoPE layers not rotated, Gemma 3's layers each with the base
    of its type, GPT-OSS's YaRN keys (sinks and window on), Phi-3's LongRoPE (tiny_phi3: the long factors, original
    length 4 < 32; tiny_phi4: the short ones, 32 <= 128) on the rotated dims only (Phi-4-mini), Cohere's by pairs.
    One pool for every layer (kv_groups off): every key is kept, so the kept first tokens come back into the sliding
    layers' window after a shift."""
    model, ref = request.getfixturevalue(name)
    ps = prompts(33, [20, 9])
    layer_inv = reference_inv_freq(model, ref, ps[0])
    interleaved = model.spec.rope_interleaved
    assert shifted_greedy(ref.model, layer_inv, ps[0], N, 10**6, 4, interleaved) == ref.greedy(ps[0], N)  # the replay
    eng = Engine(model, CacheConfig(block_size=block_size), EngineOptions(context_limit=32, n_keep=4, kv_groups="off"))
    assert torch.equal(eng.model.ropes[eng.model.layer_rope[0]][0], layer_inv[0])  # layer 0: the same frequencies
    want = [shifted_greedy(ref.model, layer_inv, p, 60, 32, 4, interleaved) for p in ps]
    assert run(eng, ps, SamplingParams(max_new_tokens=60, ignore_eos=True)) == want
    assert all(s.shifts >= 2 for s in eng.seqs.values())


@pytest.mark.parametrize("name, block_size", [("gemma3", 1), ("gemma3", 5), ("gemma3", 16), ("gpt_oss", 1),
                                              ("gpt_oss", 16), ("cohere2", 1), ("cohere2", 16), ("phi3", 1),
                                              ("phi3", 16)])
def test_grouped_context_shift_equals_the_window_cache_replay(request, name, block_size):
    """With KV-cache groups (the default) the sliding layers' pool drops keys as they leave the window and never
    brings them back: after a shift the kept first tokens stay out of the sliding layers' sight, as transformers'
    sliding-window cache and llama.cpp's iSWA cache have it (replayed with masks per layer type: shifted_greedy's
    windows); a full group, where a layer does not slide, keeps every key. Gemma 3 (a RoPE base per layer type),
    GPT-OSS (sinks, YaRN and MoE on), Cohere 2 (interleaved RoPE on its sliding layers, a NoPE full layer), Phi-3
    (every layer slides: one window group, the sequence's own table starting at its window, LongRoPE's factors).
    The same tokens at every block size; different from the every-key replay."""
    model, ref = request.getfixturevalue(name)
    ps = prompts(33, [20, 9])
    layer_inv = reference_inv_freq(model, ref, ps[0])
    interleaved, windows = model.spec.rope_interleaved, list(model.spec.sliding_window)
    # The replay with masks equals transformers' own generate where no shift happens.
    assert shifted_greedy(ref.model, layer_inv, ps[0], N, 10**6, 4, interleaved, windows) == ref.greedy(ps[0], N)
    eng = Engine(model, CacheConfig(block_size=block_size), EngineOptions(context_limit=32, n_keep=4))
    assert eng.grouped and eng.kv.full == (None in windows)
    want = [shifted_greedy(ref.model, layer_inv, p, 60, 32, 4, interleaved, windows) for p in ps]
    every = [shifted_greedy(ref.model, layer_inv, p, 60, 32, 4, interleaved) for p in ps]
    assert want != every  # the kept first tokens stay dropped: not what one pool keeping every key gives
    assert run(eng, ps, SamplingParams(max_new_tokens=60, ignore_eos=True)) == want
    assert all(s.shifts >= 2 for s in eng.seqs.values())


# -- refusals -------------------------------------------------------------------------------------------------


def test_other_architectures_are_refused_by_name(tmp_path, tokenizer_files):
    from transformers import PhiConfig, PhiForCausalLM

    path = _save_tiny(tmp_path / "phi", PhiConfig, PhiForCausalLM, tokenizer_files, 9, pad_token_id=0)
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'PhiForCausalLM' in .*KV Scope serves: "
                                             r"Cohere2ForCausalLM, CohereForCausalLM.*Gemma2ForCausalLM"
                                             r".*Gemma3ForCausalLM.*Olmo2ForCausalLM.*Phi3ForCausalLM.*Qwen3ForCausalLM"
                                             r".*SmolLM3ForCausalLM") as e:
        load_model(path)
    assert "GraniteForCausalLM" in str(e.value) and "\n" not in str(e.value)


def test_architecture_and_model_type_must_name_the_same_family(tmp_path, tiny_qwen3):
    import json
    import shutil

    path = tmp_path / "mixed"
    shutil.copytree(tiny_qwen3, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    with pytest.raises(ModelLoadError, match="architecture 'Qwen3ForCausalLM' with model_type 'qwen2'"):
        load_model(str(path))


if __name__ == "__main__":
    _triton_worker(sys.argv[1], sys.argv[2])
