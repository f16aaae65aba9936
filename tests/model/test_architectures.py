"""The families beyond Llama / Mistral / Qwen2 (issue 21 item 1): Qwen3, OLMo 2, Granite and SmolLM3, each a tiny
random-weight checkpoint (tests/conftest.py). Ground truth is transformers' fp32 greedy `generate` on the same
directory, at several block sizes, through a device tier smaller than one request, and under live
reconfiguration; for SmolLM3 (NoPE layers) also K-shifts, against transformers with the shift replayed on its
cache. Any other architecture is refused by name."""

from __future__ import annotations

import pytest
import torch

from conftest import Reference, _engine, _save_tiny, prompts
from engine.config import CacheConfig, EngineOptions
from engine.kv.tiers import Tier
from engine.model.loader import ModelLoadError, load_model
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams

N = 16
SP = SamplingParams(max_new_tokens=N, ignore_eos=True)
PROMPTS = prompts(30, [7, 30, 75])  # past the sliding window (24) of tiny_qwen3_sliding
FAMILIES = ("tiny_qwen3", "tiny_qwen3_sliding", "tiny_olmo2", "tiny_granite", "tiny_smollm3")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(LoadedModel, Reference) of one family's tiny checkpoint."""
    path = request.getfixturevalue(request.param)
    return load_model(path), Reference(path)


def run(eng: Engine, ps, sp=SP) -> list[list[int]]:
    out = eng.generate(ps, sp)
    eng.check_invariants()
    return out


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
    """Two 8-token blocks on the device tier, requests of 23 to 91 tokens: the rest is read on the host tier."""
    model, ref = family
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
    norms scale before rounding, the others after), so greedy tokens equal bf16 `generate` exactly. One request
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
    assert [run(eng, [p], SamplingParams(max_new_tokens=12, ignore_eos=True))[0] for p in ps] == want


# -- SmolLM3: the K-shift leaves NoPE layers alone ------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm3(tiny_smollm3):
    return load_model(tiny_smollm3), Reference(tiny_smollm3)


def test_kshift_rotates_rope_layers_only(smollm3):
    model, ref = smollm3
    assert model.spec.nope_layers == {1}
    p = prompts(31, [40])[0]
    eng = Engine(model, CacheConfig(block_size=8))
    sid = eng.add_request(p, SamplingParams(max_new_tokens=5, ignore_eos=True))
    eng.step()
    seq = eng.seqs[sid]
    k_before, _ = eng.kv.tokens_kv(seq)
    keep_idx = torch.tensor(list(range(4)) + list(range(14, seq.num_cached)))
    eng.seq_rm(sid, 4, 14)  # a context shift by hand: drop positions [4, 14), move the rest back by 10
    eng.seq_add(sid, 14, None, -10)
    k_engine, _ = eng.kv.tokens_kv(seq)  # [L, n, Hkv, D]
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


def _shifted_greedy(hf, nope: frozenset[int], prompt: list[int], n: int, limit: int, n_keep: int) -> list[int]:
    """transformers' greedy decoding with llama.cpp's context shift replayed on its cache, as the engine does it
    (engine/runtime/seq_ops.py): before a token whose context would pass `limit`, keep the first n_keep tokens,
    drop the next (len - n_keep) // 2, and re-rotate the remaining cached keys back by that many positions —
    on the RoPE layers only."""
    from transformers import DynamicCache

    from engine.model.llama_family import rotate_half

    inv = hf.model.rotary_emb.inv_freq.float()  # [D/2], default RoPE
    toks, out = list(prompt), []
    cache = DynamicCache()
    with torch.inference_mode():
        logits = hf(torch.tensor([toks]), cache=cache, use_cache=True).logits[0, -1]
        while True:
            out.append(int(logits.argmax()))
            if len(out) == n:
                return out
            toks.append(out[-1])
            if len(toks) > limit:
                n_discard = max(1, min((len(toks) - n_keep) // 2, len(toks) - n_keep - 1))
                freqs = torch.full((1,), -float(n_discard))[:, None] * inv[None, :]
                emb = torch.cat((freqs, freqs), dim=-1)
                cos, sin = emb.cos(), emb.sin()
                for li, layer in enumerate(cache.layers):
                    k, v = layer.keys, layer.values  # [1, Hkv, S, D]
                    tail = k[:, :, n_keep + n_discard:]
                    if li not in nope:
                        tail = tail * cos + rotate_half(tail) * sin
                    layer.keys = torch.cat((k[:, :, :n_keep], tail), dim=2)
                    layer.values = torch.cat((v[:, :, :n_keep], v[:, :, n_keep + n_discard:]), dim=2)
                toks = toks[:n_keep] + toks[n_keep + n_discard:]
            pos = len(toks) - 1
            logits = hf(torch.tensor([[toks[-1]]]), cache=cache, use_cache=True,
                        position_ids=torch.tensor([[pos]]), cache_position=torch.tensor([pos])).logits[0, -1]


@pytest.mark.parametrize("block_size", [1, 16])
def test_context_shift_tokens_equal_transformers(smollm3, block_size):
    """context_limit 32, n_keep 4, 60 new tokens: several shifts per sequence."""
    model, ref = smollm3
    ps = prompts(33, [20, 9])
    eng = Engine(model, CacheConfig(block_size=block_size), EngineOptions(context_limit=32, n_keep=4))
    want = [_shifted_greedy(ref.model, model.spec.nope_layers, p, 60, 32, 4) for p in ps]
    assert run(eng, ps, SamplingParams(max_new_tokens=60, ignore_eos=True)) == want
    assert all(s.shifts >= 2 for s in eng.seqs.values())


# -- refusals -------------------------------------------------------------------------------------------------


def test_other_architectures_are_refused_by_name(tmp_path, tokenizer_files):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    path = _save_tiny(tmp_path / "gemma3", Gemma3TextConfig, Gemma3ForCausalLM, tokenizer_files, 9, head_dim=16)
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'Gemma3ForCausalLM' in .*KV Scope serves: "
                                             r".*Olmo2ForCausalLM.*Qwen3ForCausalLM.*SmolLM3ForCausalLM") as e:
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
