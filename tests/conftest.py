"""Shared fixtures: tiny random-weight models saved as HF directories, and transformers references; the markers;
the workers started when collection ends. What a test imports is in plain modules beside this file:
tests/tiny_models.py, tests/workers.py, tests/kvscope_cli.py."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

from workers import WORKERS, start_worker, stop_workers  # first: it keeps KVSCOPE_TEST_WITHOUT's packages out
from tiny_models import TINY_TOKENIZER, TINY_VOCAB, Reference, _save_tiny

# Tests import shared helpers from plain modules (tests/tiny_models.py, tests/kvscope_cli.py, tests/workers.py),
# never from a conftest: `conftest` names whichever conftest.py pytest loaded last.

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


# The suite converts the default model into a cache of its own, never the user's ~/.cache/kvscope:
# a temporary one for the session (removed at its end), or $KVSCOPE_TEST_CACHE_DIR to reuse one across
# runs. Set before any engine import; subprocesses inherit it.
_SESSION_CACHE = os.environ.get("KVSCOPE_TEST_CACHE_DIR") or tempfile.mkdtemp(prefix="kvscope-test-cache-")
os.environ["KVSCOPE_CACHE_DIR"] = _SESSION_CACHE


def pytest_sessionfinish(session, exitstatus) -> None:
    if not os.environ.get("KVSCOPE_TEST_CACHE_DIR"):
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def tokenizer_files(tmp_path_factory) -> str:
    """The tiny models' tokenizer: tests/data/tiny_tokenizer (a byte-level BPE of 2,048 ids with SmolLM2's special
    tokens at its ids: 0, bos 1, eos 2; and its chat template; built by tests/data/make_tiny_tokenizer.py), its
    vocab padded here to the tiny models' 49,152 ids so that every id a random-weight model generates decodes to
    text, as it did with SmolLM2's tokenizer (an id past the vocab decodes to nothing). The padding ids are never
    produced by encode (no merge makes them): encodings are the committed tokenizer's. No conversion of the
    default model: tests that need its tokenizer or weights ask the loader's hf_reference_dir() themselves."""
    import json

    with open(os.path.join(TINY_TOKENIZER, "tokenizer.json"), encoding="utf-8") as f:
        data = json.load(f)
    vocab = data["model"]["vocab"]
    # Two-piece strings of the trained pieces that are plain printable ASCII (Ġ is a space, Ċ a newline).
    pieces = [p for p in sorted(vocab, key=vocab.get)
              if not p.startswith("<|") and all((c.isascii() and c.isprintable()) or c in "ĠĊ" for c in p)]
    k = 0
    while len(vocab) < TINY_VOCAB:
        s = pieces[k % len(pieces)] + pieces[(k // len(pieces) * 7 + k) % len(pieces)]
        k += 1
        vocab.setdefault(s, len(vocab))
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    with open(out / "tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False)
    for name in os.listdir(TINY_TOKENIZER):
        if name != "tokenizer.json":
            shutil.copy(os.path.join(TINY_TOKENIZER, name), out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tokenizer_files) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"), LlamaConfig, LlamaForCausalLM, tokenizer_files, 0)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory, tokenizer_files) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen2"), Qwen2Config, Qwen2ForCausalLM, tokenizer_files, 1)


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory, tokenizer_files) -> str:
    from transformers import MistralConfig, MistralForCausalLM

    return _save_tiny(tmp_path_factory.mktemp("tiny-mistral"), MistralConfig, MistralForCausalLM, tokenizer_files, 2,
                      sliding_window=24, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def llama_model(tiny_llama):
    from engine.model.loader import load_model

    return load_model(tiny_llama)


@pytest.fixture(scope="session")
def llama_ref(tiny_llama) -> Reference:
    return Reference(tiny_llama)


@pytest.fixture(scope="session")
def deep_llama(tmp_path_factory, tokenizer_files) -> str:
    """A 12-layer tiny Llama: enough layers for per-layer effects (a re-lay holds one layer; per-layer placement)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _save_tiny(tmp_path_factory.mktemp("deep-llama"), LlamaConfig, LlamaForCausalLM, tokenizer_files, 3,
                      num_hidden_layers=12)


@pytest.fixture(scope="session")
def deep_model(deep_llama):
    from engine.model.loader import load_model

    return load_model(deep_llama)


@pytest.fixture(scope="session")
def deep_ref(deep_llama) -> Reference:
    return Reference(deep_llama)


# -- markers (registered in pyproject.toml) ----------------------------------------------------------------------
# qt: every test that uses qtbot (directly or through a fixture); gpu: every test skipped without CUDA (a skipif
# whose reason names CUDA); triton, subprocess and slow: the tests named below, by file and test function (all of
# its parameters) or by node id with parameters; every subprocess test is slow too. slow is also set in the test files (test_default_model.py,
# test_loader.py, test_weights.py). Timings: --durations on 2 shared CPUs (load 3-6), 2026-12-01.
TRITON = {
    "test_architectures.py": ["test_gpt_oss_triton_backend_tokens_equal_transformers"],
    "test_attention_wiring.py": ["test_triton_backend_tokens_equal_transformers"],
    "test_host_compute.py": ["test_triton_partial_merges_with_the_host_part"],
    "test_paged_attention.py": ["test_triton_decode_matches_reference", "test_triton_prefill_falls_back_to_the_cpu_path",
                                "test_triton_decode_with_sinks_matches_reference", "test_triton_kernel_compiles_for_the_gpu"],
}
SUBPROCESS = {
    "test_architecture.py": ["test_import_contracts_hold"],
    "test_architectures.py": ["test_gpt_oss_triton_backend_tokens_equal_transformers"],
    "test_attach_state.py": ["test_a_block_lands_in_the_same_cell_in_every_process"],
    "test_attach_torchfree.py": ["test_every_attach_module_imports_without_torch", "test_kvscope_attach_runs_without_torch",
                                 "test_bad_endpoints_are_one_line_errors"],
    "test_attention_wiring.py": ["test_triton_backend_tokens_equal_transformers"],
    "test_cli.py": ["test_plain_kvscope_without_a_display_explains_headless",
                    "test_headless_screenshot_and_open_snapshot_round_trip",
                    "test_headless_window_replays_a_trace_and_refuses_a_bad_one"],
    "test_default_model.py": ["test_cli_json_tokens_equal_generate", "test_concurrent_requests_migrate_and_stay_exact",
                              "test_shared_prefix_is_reused_and_output_unchanged",
                              "test_ui_bench_runs_every_part_and_reports_frames"],
    "test_gpu_check.py": ["test_the_dry_run_reports_every_target_and_self_check"],
    "test_host_compute.py": ["test_cli_host_reads_compute_end_to_end", "test_triton_partial_merges_with_the_host_part"],
    "test_loader.py": ["test_warm_load_never_imports_transformers", "test_orphaned_build_dirs_are_removed"],
    "test_paged_attention.py": ["test_triton_decode_matches_reference", "test_triton_prefill_falls_back_to_the_cpu_path",
                                "test_triton_decode_with_sinks_matches_reference"],
    "test_platform_check.py": ["test_a_display_with_no_server_exits_2_with_advice",
                               "test_attach_checks_the_display_the_same_way",
                               "test_a_plugin_whose_libraries_are_missing_is_named_with_the_packages"],
    "test_policy_lab.py": ["test_a_small_zip_bomb_keeps_memory_small"],
    "test_snapshot_files.py": ["test_open_snapshot_refuses_a_bad_file_in_one_line",
                               "test_open_snapshot_refuses_a_fifo_without_blocking",
                               "test_open_snapshot_still_opens_a_good_file"],
    "test_user_files.py": ["test_headless_replay_of_a_fifo_and_of_an_unrunnable_prompt_exit_2"],
    "test_weights.py": ["test_generate_peak_rss_is_one_copy_of_the_weights"],
}
SLOW = {
    "test_admission.py": ["test_forks_and_pauses_preempt_a_bounded_number_of_times",
                          "test_any_mix_every_request_that_fits_alone_finishes_without_preemption"],
    "test_attach_stream.py": ["test_short_soak_three_publishers_counts_match_through_the_ingest_process"],
    "test_attention_wiring.py": ["test_triton_backend_tokens_equal_transformers"],
    "test_cache_state.py": ["test_random_operations_keep_the_cache_consistent"],
    "test_cli.py": ["test_three_thousand_requests_stream_in_input_order_with_bounded_memory",
                    "test_headless_screenshot_and_open_snapshot_round_trip",
                    "test_headless_window_replays_a_trace_and_refuses_a_bad_one"],
    "test_engine.py": ["test_tight_device_budget_migrates_and_stays_exact[0.01-recompute]",
                       "test_tight_device_budget_migrates_and_stays_exact[2.0-swap]",
                       "test_kshift_keys_equal_fresh_keys_and_generation_passes_context",
                       "test_greedy_equals_transformers_at_any_block_size[1]",
                       "test_fork_shares_blocks_then_diverges_like_two_runs", "test_live_reconfiguration_keeps_tokens"],
    "test_hardening.py": ["test_any_small_budget_every_request_finishes_or_is_refused",
                          "test_a_paused_sequence_on_a_full_device_tier_does_not_starve_the_others"],
    "test_host_compute.py": ["test_cli_host_reads_compute_end_to_end", "test_triton_partial_merges_with_the_host_part",
                             "test_compute_mode_tokens_equal_transformers[2-8-reference]",
                             "test_compute_mode_tokens_equal_transformers[2-8-cpu]",
                             "test_compute_mode_tokens_equal_transformers[2-16-cpu]"],
    "test_host_tier.py": ["test_device_tier_smaller_than_one_sequence_keeps_tokens_exact[8-2-cpu-stream]",
                          "test_device_tier_smaller_than_one_sequence_keeps_tokens_exact[8-2-cpu-promote]",
                          "test_device_tier_smaller_than_one_sequence_keeps_tokens_exact[8-1-reference-stream]"],
    "test_kv_cost_window.py": ["test_the_shadow_chart_beside_the_hit_rate"],
    "test_layer_placement.py": ["test_tokens_are_exact_with_layers_on_the_host[reference]"],
    "test_paged_attention.py": ["test_triton_decode_matches_reference",  # with the next two: one 100 s interpreted run
                                "test_triton_prefill_falls_back_to_the_cpu_path",
                                "test_triton_decode_with_sinks_matches_reference"],
    "test_storm.py": ["test_a_short_storm_breaks_nothing", "test_the_storm_counts_what_it_claims"],
    "test_sweep.py": ["test_two_by_two_sweep_table_csv_json_and_plot_agree",
                      "test_example_trace_replays_in_real_time_with_forks_and_demotion",
                      "test_residency_histograms_fill_when_a_small_cache_evicts"],
    "test_user_files.py": ["test_a_replay_streams_its_file",
                           "test_headless_replay_of_a_fifo_and_of_an_unrunnable_prompt_exit_2"],
    "test_window.py": ["test_residency_panel_shows_reuse_and_eviction_ages"],
    "test_workloads.py": ["test_demo_workload_exercises_the_cache"],
}
_NAMED = {"triton": TRITON, "subprocess": SUBPROCESS, "slow": SLOW}


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items) -> None:
    modules = {}
    for item in items:
        file = os.path.basename(str(item.path))
        name = item.name.split("[")[0]
        modules.setdefault(file, getattr(item, "module", None))
        if "qtbot" in item.fixturenames:
            item.add_marker(pytest.mark.qt)
        if any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.gpu)
        for marker, table in _NAMED.items():
            if name in table.get(file, ()) or item.name in table.get(file, ()):
                item.add_marker(getattr(pytest.mark, marker))
                if marker == "subprocess":  # a process start costs ~2 s of imports here: out of the fast lane
                    item.add_marker(pytest.mark.slow)
    # A renamed test must not drop out of its marker silently: every name listed for a collected file exists.
    for marker, table in _NAMED.items():
        for file, names in table.items():
            module = modules.get(file)
            missing = [n for n in names if module is not None and not hasattr(module, n.split("[")[0])]
            if missing:
                raise pytest.UsageError(f"tests/conftest.py marks {marker} on tests that {file} no longer has: {missing}")


# -- workers beside the main process (tests/workers.py) -----------------------------------------------------------
def pytest_collection_finish(session) -> None:
    for item in session.items:
        for name, build in getattr(getattr(item, "module", None), "BACKGROUND", {}).items():
            if name in item.fixturenames and name not in WORKERS:
                start_worker(name, build)


def pytest_unconfigure(config) -> None:
    stop_workers()


# -- the other families KV Scope serves (tests/model/test_architectures.py) -------------------------------------
@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory, tokenizer_files) -> str:
    """Qwen3: per-head q/k RMSNorm, an explicit head_dim (32: q_proj is 128 wide on a hidden size of 64)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen3"), Qwen3Config, Qwen3ForCausalLM, tokenizer_files, 4,
                      num_hidden_layers=3, head_dim=32)


@pytest.fixture(scope="session")
def tiny_qwen3_sliding(tmp_path_factory, tokenizer_files) -> str:
    """Qwen3 with a sliding window of 24 on layers 1 and 2 (max_window_layers 1), full attention on layer 0."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen3-sliding"), Qwen3Config, Qwen3ForCausalLM, tokenizer_files, 5,
                      num_hidden_layers=3, head_dim=16, use_sliding_window=True, sliding_window=24, max_window_layers=1)


@pytest.fixture(scope="session")
def tiny_olmo2(tmp_path_factory, tokenizer_files) -> str:
    """OLMo 2: q/k RMSNorm over the whole projections, norms after each branch (no input_layernorm)."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    return _save_tiny(tmp_path_factory.mktemp("tiny-olmo2"), Olmo2Config, Olmo2ForCausalLM, tokenizer_files, 6,
                      num_hidden_layers=3, pad_token_id=0)


@pytest.fixture(scope="session")
def tiny_granite(tmp_path_factory, tokenizer_files) -> str:
    """Granite: embedding, residual and attention multipliers and logits scaling (the softmax scale 1/16 is not
    head_dim ** -0.5 = 1/4). Untied, and multipliers small enough that the embedding does not drown the layers:
    with any one of the three multipliers left out, most greedy tokens change."""
    from transformers import GraniteConfig, GraniteForCausalLM

    return _save_tiny(tmp_path_factory.mktemp("tiny-granite"), GraniteConfig, GraniteForCausalLM, tokenizer_files, 7,
                      num_hidden_layers=3, tie_word_embeddings=False, embedding_multiplier=2.0,
                      residual_multiplier=0.5, attention_multiplier=0.0625, logits_scaling=8.0)


@pytest.fixture(scope="session")
def tiny_smollm3(tmp_path_factory, tokenizer_files) -> str:
    """SmolLM3: layer 1 of 3 is a NoPE layer (no_rope_layer_interval 2: no_rope_layers = [1, 0, 1])."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    return _save_tiny(tmp_path_factory.mktemp("tiny-smollm3"), SmolLM3Config, SmolLM3ForCausalLM, tokenizer_files, 8,
                      num_hidden_layers=3, no_rope_layer_interval=2, pad_token_id=0)


def _perturb_norms(path: str, seed: int) -> str:
    """Norm weights initialize to 0 (Gemma's (1 + weight) RMSNorms) or 1: give them random values, so the offset,
    the kind of norm and every norm's placement show in the tokens."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    g = torch.Generator().manual_seed(seed)
    for name, t in weights.items():
        if name.endswith("norm.weight"):
            weights[name] = t + 0.5 * torch.randn(t.shape, generator=g)
    save_file(weights, file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def tiny_gemma2(tmp_path_factory, tokenizer_files) -> str:
    """Gemma 2: sandwich (1 + w) norms, GeGLU, scaled embeddings, sliding window 24 on layers 0 and 2, softmax scale
    query_pre_attn_scalar ** -0.5 = 1/4 (head_dim 16), attention and final logit soft-capping small enough to act."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    path = _save_tiny(tmp_path_factory.mktemp("tiny-gemma2"), Gemma2Config, Gemma2ForCausalLM, tokenizer_files, 10,
                      num_hidden_layers=3, head_dim=16, sliding_window=24, query_pre_attn_scalar=16,
                      attn_logit_softcapping=4.0, final_logit_softcapping=6.0, pad_token_id=0)
    return _perturb_norms(path, 10)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory, tokenizer_files) -> str:
    """Gemma 3 text: layers S S F S S (sliding_window_pattern 3, window 24), per-head (1 + w) q/k norms, one kv
    head, query_pre_attn_scalar 32 (head_dim 16), RoPE base 10k on the sliding layers and 1M with linear scaling
    x8 on the full one."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    path = _save_tiny(tmp_path_factory.mktemp("tiny-gemma3"), Gemma3TextConfig, Gemma3ForCausalLM, tokenizer_files, 11,
                      num_hidden_layers=5, num_key_value_heads=1, head_dim=16, sliding_window=24,
                      sliding_window_pattern=3, query_pre_attn_scalar=32, rope_theta=1_000_000.0,
                      rope_local_base_freq=10_000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
                      pad_token_id=0)
    return _perturb_norms(path, 11)


@pytest.fixture(scope="session")
def tiny_gpt_oss(tmp_path_factory, tokenizer_files) -> str:
    """GPT-OSS: layers S F S (layer_types alternating, sliding window 24), attention sinks, q/k/v and o_proj biases,
    YaRN RoPE (factor 8 over an original 64 positions, truncate off, as gpt-oss-20b's), and a mixture of 4 experts,
    top 2, each a clamped SwiGLU with biases. Untied. transformers saves the experts as plain fp32 tensors
    (mlp.experts.gate_up_proj [E, hidden, 2I], no mxfp4). The sinks, biases and experts are initialized to 0 or
    near it: given random values here, so a wrong sink, bias or expert shows in the tokens."""
    from safetensors.torch import load_file, save_file
    from transformers import GptOssConfig, GptOssForCausalLM

    path = _save_tiny(tmp_path_factory.mktemp("tiny-gpt-oss"), GptOssConfig, GptOssForCausalLM, tokenizer_files, 12,
                      num_hidden_layers=3, head_dim=16, intermediate_size=64, num_local_experts=4,
                      num_experts_per_tok=2, sliding_window=24, tie_word_embeddings=False, pad_token_id=0,
                      rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                       "truncate": False, "original_max_position_embeddings": 64,
                                       "rope_theta": 150000.0})
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    g = torch.Generator().manual_seed(12)
    for name, t in weights.items():
        if name.endswith("sinks"):
            weights[name] = 2.0 + 2.0 * torch.randn(t.shape, generator=g)
        elif name.endswith("bias"):
            weights[name] = 0.5 * torch.randn(t.shape, generator=g)
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            weights[name] = 0.3 * torch.randn(t.shape, generator=g)
    save_file(weights, file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def tiny_phi3(tmp_path_factory, tokenizer_files) -> str:
    """Phi-3 (mini-128k-like): fused qkv_proj / gate_up_proj, untied, a sliding window of 24 on every layer, and
    LongRoPE with original_max_position_embeddings 4 of 512: every prompt is longer, so transformers uses the long
    factors throughout, as the engine does (its context limit, 512, is past 4), and the cos/sin scaling is
    sqrt(1 + ln 128 / ln 4). Randomized RMSNorm weights."""
    from transformers import Phi3Config, Phi3ForCausalLM

    rope = {"rope_type": "longrope", "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5, 2.0],
            "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0]}
    path = _save_tiny(tmp_path_factory.mktemp("tiny-phi3"), Phi3Config, Phi3ForCausalLM, tokenizer_files, 12,
                      num_hidden_layers=3, sliding_window=24, tie_word_embeddings=False, rope_scaling=rope,
                      original_max_position_embeddings=4, pad_token_id=0)
    return _perturb_norms(path, 12)


@pytest.fixture(scope="session")
def tiny_phi4(tmp_path_factory, tokenizer_files) -> str:
    """Phi-4-mini-like: Phi3ForCausalLM with partial_rotary_factor 0.75 (12 of head_dim 16 rotated), tied
    embeddings, LongRoPE whose original length is max_position_embeddings (128): the short factors, as transformers
    uses for every sequence up to it, and factor 32 gives the scaling sqrt(1 + ln 32 / ln 128). One kv head."""
    from transformers import Phi3Config, Phi3ForCausalLM

    rope = {"rope_type": "longrope", "factor": 32.0, "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 3.0],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}
    path = _save_tiny(tmp_path_factory.mktemp("tiny-phi4"), Phi3Config, Phi3ForCausalLM, tokenizer_files, 13,
                      num_hidden_layers=3, num_key_value_heads=1, partial_rotary_factor=0.75, rope_scaling=rope,
                      max_position_embeddings=128, original_max_position_embeddings=128, pad_token_id=0)
    return _perturb_norms(path, 13)


@pytest.fixture(scope="session")
def tiny_cohere(tmp_path_factory, tokenizer_files) -> str:
    """Cohere (Command R-like): LayerNorm, the parallel block, per-head q/k LayerNorms with a weight per head
    (use_qk_norm), logit_scale 1/16, interleaved RoPE, tied embeddings. Randomized norm weights."""
    from transformers import CohereConfig, CohereForCausalLM

    path = _save_tiny(tmp_path_factory.mktemp("tiny-cohere"), CohereConfig, CohereForCausalLM, tokenizer_files, 14,
                      num_hidden_layers=3, use_qk_norm=True, logit_scale=0.0625, rope_theta=10_000.0,
                      pad_token_id=0)
    return _perturb_norms(path, 14)


@pytest.fixture(scope="session")
def tiny_cohere2(tmp_path_factory, tokenizer_files) -> str:
    """Cohere 2 (Command R7B-like): Cohere's layer without q/k norms, layers S F S (sliding_window_pattern 2, window
    24), RoPE (interleaved) on the sliding layers only, the full-attention layer NoPE. Randomized norm weights."""
    from transformers import Cohere2Config, Cohere2ForCausalLM

    path = _save_tiny(tmp_path_factory.mktemp("tiny-cohere2"), Cohere2Config, Cohere2ForCausalLM, tokenizer_files,
                      15, num_hidden_layers=3, sliding_window=24, sliding_window_pattern=2, logit_scale=0.25,
                      rope_theta=10_000.0, pad_token_id=0)
    return _perturb_norms(path, 15)
