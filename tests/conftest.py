"""Shared fixtures: tiny random-weight models saved as HF directories, and transformers references."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest
import torch

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

# KVSCOPE_TEST_WITHOUT=numba,llvmlite: those packages cannot be imported in this run, as on a machine without
# them (tests/model/test_other_builds.py runs the kernel tests so). Installed before any engine import.
KEPT_OUT = _WITHOUT = tuple(m for m in os.environ.get("KVSCOPE_TEST_WITHOUT", "").split(",") if m)
if _WITHOUT:
    import sys

    class _Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in _WITHOUT:
                raise ImportError(f"{name} is kept out of this run (KVSCOPE_TEST_WITHOUT)")
            return None

    sys.meta_path.insert(0, _Refuse())

# The suite converts the default model into a cache of its own, never the user's ~/.cache/kvscope:
# a temporary one for the session (removed at its end), or $KVSCOPE_TEST_CACHE_DIR to reuse one across
# runs. Set before any engine import; subprocesses inherit it.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
_SESSION_CACHE = os.environ.get("KVSCOPE_TEST_CACHE_DIR") or tempfile.mkdtemp(prefix="kvscope-test-cache-")
os.environ["KVSCOPE_CACHE_DIR"] = _SESSION_CACHE


def pytest_sessionfinish(session, exitstatus) -> None:
    if not os.environ.get("KVSCOPE_TEST_CACHE_DIR"):
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


TINY_TOKENIZER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tiny_tokenizer")
TINY_VOCAB = 49152


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


def _save_tiny(path, cfg_cls, model_cls, tokenizer_dir: str, seed: int, **overrides) -> str:
    torch.manual_seed(seed)
    base = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1,
                eos_token_id=2)
    base.update(overrides)
    model = model_cls(cfg_cls(**base))
    # Random init is near-uniform; a larger spread makes greedy argmaxes decisive, as in a real model.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(path)
    for f in os.listdir(tokenizer_dir):
        if f.startswith("tokenizer") or f == "special_tokens_map.json":
            shutil.copy(os.path.join(tokenizer_dir, f), path)
    return str(path)


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


@pytest.fixture
def runner(llama_model):
    """A started EngineRunner on the tiny Llama, for the window tests: small pools (block size 4, 0.3 MiB device,
    1 MiB host) so that a test's few prompts fill, evict and migrate; stopped after the test."""
    from app.runner import EngineRunner
    from engine.config import CacheConfig, EngineOptions
    from engine.runtime.engine import Engine

    eng = Engine(llama_model, CacheConfig(block_size=4, device_budget_mb=0.3, host_budget_mb=1),
                 EngineOptions(context_limit=256))
    r = EngineRunner(eng).start()
    yield r
    r.stop()


class Reference:
    """transformers' greedy `generate` on the same directory: the ground truth for fp32 KV."""

    def __init__(self, path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self._memo: dict[tuple, list[int]] = {}

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in self._memo:
            self._memo[key] = self._greedy(prompt, n)
        return list(self._memo[key])

    def _greedy(self, prompt: list[int], n: int) -> list[int]:
        with torch.inference_mode():
            # eos_token_id=None: generate exactly n tokens, EOS included, like the engine's ignore_eos
            # (min_new_tokens would instead suppress EOS and change the tokens).
            out = self.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)
        return out[0, len(prompt):].tolist()

    def keys(self, prompt: list[int]) -> list[torch.Tensor]:
        """Post-RoPE keys per layer for a fresh prefill: [kv_heads, T, head_dim]."""
        with torch.inference_mode():
            out = self.model(torch.tensor([prompt]), use_cache=True)
        cache = getattr(out, "cache", None) or out.past_key_values
        return [layer.keys[0] for layer in cache.layers]


@pytest.fixture(scope="session")
def llama_ref(tiny_llama) -> Reference:
    return Reference(tiny_llama)


def prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


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


@pytest.fixture
def bm(qtbot):
    """A block map widget at 800 x 420, shown (tests/ui/test_block_map.py, tests/ui/test_kv_cost_window.py)."""
    from ui.block_map.widget import BlockMap

    w = BlockMap()
    qtbot.addWidget(w)
    w.resize(800, 420)
    w.show()
    qtbot.waitExposed(w)
    return w


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


# -- workers beside the main process ----------------------------------------------------------------------------
# A test module may map a fixture name to a worker command in BACKGROUND ({fixture: build(out_path) -> (argv, env)
# or None when it cannot run here}). When collection ends and a selected test uses that fixture, the worker starts
# then, on the other CPU, while the suite goes on; the fixture calls background_result and waits only for what is
# left (the Triton interpreter's 1.5 minutes in tests/attention/test_paged_attention.py).
_WORKERS: dict[str, tuple[subprocess.Popen, str, str]] = {}
_WORKER_DIR: list[str] = []  # made when the first worker starts (workers import this file too)


def interpreter_env(**extra: str) -> dict[str, str]:
    """The environment of a test worker that runs a test file as a script under the Triton interpreter (one
    thread; the repository and tests/ importable, so the file can import conftest and its neighbours)."""
    return dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]),
                **extra)


def _start_worker(name: str, build) -> None:
    if not _WORKER_DIR:
        _WORKER_DIR.append(tempfile.mkdtemp(prefix="kvscope-test-workers-"))
    out = os.path.join(_WORKER_DIR[0], name + ".out")
    spec = build(out)
    if spec is None:
        return
    argv, env = spec
    log = open(os.path.join(_WORKER_DIR[0], name + ".log"), "w")
    _WORKERS[name] = (subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), out, log.name)
    log.close()


def pytest_collection_finish(session) -> None:
    for item in session.items:
        for name, build in getattr(getattr(item, "module", None), "BACKGROUND", {}).items():
            if name in item.fixturenames and name not in _WORKERS:
                _start_worker(name, build)


def background_result(name: str, build, timeout: float = 1200) -> str:
    """The output file of worker `name` (started now if collection did not start it), once it has exited 0."""
    if name not in _WORKERS:
        _start_worker(name, build)
    proc, out, log = _WORKERS[name]
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"worker {name} ran past {timeout:.0f} s") from None
    if rc != 0:
        with open(log) as f:
            raise AssertionError(f"worker {name} exited {rc}:\n{f.read()[-8000:]}")
    return out


def pytest_unconfigure(config) -> None:
    for proc, _, _ in _WORKERS.values():
        if proc.poll() is None:
            proc.kill()
    for d in _WORKER_DIR:
        shutil.rmtree(d, ignore_errors=True)


# -- helpers shared across the test packages ---------------------------------------------------------------------
def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """`kvscope ARGS` in this process (the model loads in well under a second): (exit code, stdout, stderr).
    argparse's exits (--help: 0, a usage error: 2) are exit codes here too."""
    from app.cli import main

    try:
        rc = main(list(args))
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return rc, out, err


def _mb(model, blocks: int, block_size: int, dtype: str = "fp32") -> float:
    """The budget in MiB that holds `blocks` blocks of this model's geometry."""
    from engine.config import CacheConfig
    from engine.kv.block_pool import BlockPool

    s = model.spec
    return blocks * BlockPool.bytes_per_block(CacheConfig(block_size=block_size, kv_dtype=dtype), s.num_layers,
                                              s.num_kv_heads, s.head_dim) / 2**20


def budget_mb(model, blocks: int, block_size: int, dtype="fp32", device: bool = True) -> float:
    """The budget in MiB that gives exactly `blocks` blocks: on the device tier (device=True) the two reserved
    slots are added, on the host tier none."""
    from engine.kv.block_pool import RESERVED

    return _mb(model, blocks + (RESERVED if device else 0), block_size, dtype)


def hf_layer_inv_freq(hf, nope: frozenset[int] = frozenset()) -> list:
    """Each layer's RoPE inv_freq [D/2] in transformers' model (Gemma 3: by layer type), None for a NoPE layer."""
    rotary, types = hf.model.rotary_emb, getattr(hf.config, "layer_types", None)
    if types is not None and hasattr(rotary, f"{types[0]}_inv_freq"):  # one RoPE per layer type
        return [getattr(rotary, f"{t}_inv_freq").float() for t in types]
    return [None if li in nope else rotary.inv_freq.float() for li in range(hf.config.num_hidden_layers)]


def shifted_greedy(hf, layer_inv: list, prompt: list[int], n: int, limit: int, n_keep: int,
                   interleaved: bool = False, windows: list | None = None) -> list[int]:
    """transformers' greedy decoding with llama.cpp's context shift replayed on its cache, as the engine does it
    (engine/runtime/seq_ops.py): before a token whose context would pass `limit`, keep the first n_keep tokens,
    drop the next (len - n_keep) // 2, and re-rotate the remaining cached keys back by that many positions —
    each layer with its own RoPE (layer_inv: hf_layer_inv_freq), the NoPE layers not at all; the first
    2 * len(inv) dims only (Phi-4-mini's partial rotation), by the model module's own rotate_half, on the pairs
    (2i, 2i + 1) where `interleaved` (Cohere). The cache keeps every key (no per-layer window cut), so key
    index = position, and the sliding layers' mask is by position.

    `windows` (spec.sliding_window, one per layer): the sliding layers keep keys as a KV-cache group of them does
    (engine/kv/grouped.py): a key is dropped once it leaves the window of the next query and never comes back, a
    shift moving it closer or not (as transformers' sliding-window cache and llama.cpp's iSWA cache hold them);
    given to the model as precomputed masks per layer type (full: causal; sliding: causal, inside the window, not
    dropped), or one mask where every layer slides."""
    import sys

    from transformers import DynamicCache

    from engine.model.llama_family import rotate_half as llama_rotate_half

    # The model module's own (Cohere's pairs); GPT-OSS's has none: it rotates halves, as Llama's.
    rotate_half = getattr(sys.modules[type(hf).__module__], "rotate_half", llama_rotate_half)
    window = None if windows is None else next(w for w in windows if w is not None)
    assert windows is None or all(w in (None, window) for w in windows)
    dropped = 0  # leading tokens the sliding layers dropped

    def masks(q0: int, q: int) -> dict | None:
        if window is None:
            return None  # transformers' own
        qi = torch.arange(q0, q0 + q)[:, None]
        kj = torch.arange(q0 + q)[None, :]
        causal = kj <= qi
        sliding = causal & (kj > qi - window) & (kj >= dropped)
        add = lambda m: torch.where(m, 0.0, float("-inf"))[None, None]  # noqa: E731
        if all(w is not None for w in windows):  # every layer slides (Phi-3): one mask, as the model takes it
            return add(sliding)
        return {"full_attention": add(causal), "sliding_attention": add(sliding)}

    toks, out = list(prompt), []
    cache = DynamicCache()
    with torch.inference_mode():
        logits = hf(torch.tensor([toks]), cache=cache, use_cache=True, attention_mask=masks(0, len(toks))).logits[0, -1]
        while True:
            out.append(int(logits.argmax()))
            if len(out) == n:
                return out
            toks.append(out[-1])
            if window is not None:
                dropped = max(dropped, len(toks) - window)  # out of the window of the next query
            if len(toks) > limit:
                n_discard = max(1, min((len(toks) - n_keep) // 2, len(toks) - n_keep - 1))
                for li, layer in enumerate(cache.layers):
                    k, v = layer.keys, layer.values  # [1, Hkv, S, D]
                    tail = k[:, :, n_keep + n_discard:]
                    if layer_inv[li] is not None:
                        freqs = torch.full((1,), -float(n_discard))[:, None] * layer_inv[li][None, :]
                        emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat((freqs, freqs), dim=-1)
                        r = emb.shape[-1]
                        rot = tail[..., :r] * emb.cos() + rotate_half(tail[..., :r]) * emb.sin()
                        tail = torch.cat((rot, tail[..., r:]), dim=-1)
                    layer.keys = torch.cat((k[:, :, :n_keep], tail), dim=2)
                    layer.values = torch.cat((v[:, :, :n_keep], v[:, :, n_keep + n_discard:]), dim=2)
                kept = list(range(n_keep)) + list(range(n_keep + n_discard, len(toks) - 1))  # the cached ones
                dropped = sum(1 for i in kept if i < dropped)
                toks = toks[:n_keep] + toks[n_keep + n_discard:]
            pos = len(toks) - 1
            logits = hf(torch.tensor([[toks[-1]]]), cache=cache, use_cache=True, attention_mask=masks(pos, 1),
                        position_ids=torch.tensor([[pos]]), cache_position=torch.tensor([pos])).logits[0, -1]


def _engine(model, bs: int, dev_blocks: int, mode: str, attention: str = "cpu", host_blocks: int = 400, **cfg):
    """An engine whose device tier holds dev_blocks blocks (and the reserved two), host tier host_blocks, host_reads=mode."""
    from engine.config import CacheConfig, EngineOptions
    from engine.kv.block_pool import RESERVED
    from engine.runtime.engine import Engine

    config = CacheConfig(block_size=bs, device_budget_mb=_mb(model, dev_blocks + RESERVED, bs),
                         host_budget_mb=_mb(model, host_blocks, bs), host_reads=mode, **cfg)
    return Engine(model, config, EngineOptions(attention=attention))


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
