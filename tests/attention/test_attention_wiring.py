"""The attention backends wired into the forward pass (EngineOptions.attention, `--attention`).

`reference` is the original path (dense gather of every block + SDPA under a mask); `cpu` reads the blocks in
place (chunked online softmax); `triton` is checked under TRITON_INTERPRET=1 in a subprocess (the interpreter
mode is fixed when triton is first imported). Ground truth is transformers' greedy decoding on the same fp32
weights, with a context shift replayed on its DynamicCache by hand, and, for quantized KV (where transformers
has no equivalent), the reference path run side by side.

Run as a script (`python tests/attention/test_attention_wiring.py OUT.json MODEL_DIR...`, TRITON_INTERPRET=1) to be the
Triton worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from workers import KEPT_OUT, interpreter_env  # first: as a worker, keeps KVSCOPE_TEST_WITHOUT's packages out
from engine.config import CacheConfig, ConfigError, EngineOptions
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from tiny_models import Reference, hf_layer_inv_freq, prompts, shifted_greedy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BACKENDS = ("reference", "cpu")
BLOCK_SIZES = (1, 7, 16)
N = 24  # new tokens per request


@pytest.fixture(scope="module")
def mistral(tiny_mistral):
    """(LoadedModel, Reference) of the sliding-window model (window 24)."""
    from engine.model.loader import load_model

    return load_model(tiny_mistral), Reference(tiny_mistral)


def greedy(eng: Engine, ps: list[list[int]], n: int) -> list[list[int]]:
    out = eng.generate(ps, SamplingParams(max_new_tokens=n, ignore_eos=True))
    eng.check_invariants()
    return out


# -- selection ---------------------------------------------------------------------------------------


def test_option_is_checked_and_each_backend_is_selectable(llama_model):
    from engine.model.llama_family import resolve_attention

    EngineOptions(attention="cpu").validate()
    with pytest.raises(ConfigError, match="attention: 'flash' is not one of auto, reference, cpu, chunked, triton"):
        EngineOptions(attention="flash").validate()
    assert resolve_attention("auto", "cpu") == "cpu"
    small = CacheConfig(device_budget_mb=1, host_budget_mb=0)
    assert Engine(llama_model, small).model.attention == "cpu"  # the default: auto, on the CPU
    for name in BACKENDS + ("chunked",):
        eng = Engine(llama_model, small, EngineOptions(attention=name))
        assert eng.model.attention == name
        # reference: the model's inline gather + SDPA, no backend object; cpu: the numba loop (numba is a
        # dependency; without it, in a run that keeps it out, the chunked path); chunked: the torch path
        cpu = "chunked" if "numba" in KEPT_OUT else "numba"
        assert eng.model.backend is None if name == "reference" else \
            eng.model.backend.name == {"cpu": cpu}.get(name, name)
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ConfigError, match="'triton' needs a CUDA device"):
            Engine(llama_model, small, EngineOptions(attention="triton"))


def test_attention_flag_is_a_model_flag():
    from app.cli import build_parser

    ap = build_parser()
    for cmd in (["generate", "hi"], ["info"], ["bench"]):
        assert ap.parse_args(cmd).attention == "auto"
        assert ap.parse_args(cmd + ["--attention", "reference"]).attention == "reference"
    with pytest.raises(SystemExit):
        ap.parse_args(["generate", "hi", "--attention", "flash"])
    import argparse

    from app.options import add_model_flags

    p = argparse.ArgumentParser()
    add_model_flags(p)
    helps = [a.help for a in p._actions if "--attention" in a.option_strings]
    assert helps and "in place" in helps[0]


# -- tokens against transformers ---------------------------------------------------------------------


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sliding_window_tokens_equal_transformers(mistral, backend, block_size):
    """Three requests at once (decode group + chunked prefill groups in the same steps), contexts past the
    window of 24, on every block size."""
    model, ref = mistral
    ps = prompts(20, [10, 31, 57])
    eng = Engine(model, CacheConfig(block_size=block_size), EngineOptions(attention=backend, max_batched_tokens=16))
    assert greedy(eng, ps, N) == [ref.greedy(p, N) for p in ps]


def mistral_shifted_greedy(path: str, prompt: list[int], n: int, limit: int, n_keep: int,
                           windows: list | None = None) -> list[int]:
    """tiny_models.shifted_greedy on the checkpoint at `path` (every layer with the model's one RoPE); `windows`: the
    window cache's semantics (a dropped key never comes back), else every key kept."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return shifted_greedy(hf, hf_layer_inv_freq(hf), prompt, n, limit, n_keep, False, windows)


@pytest.fixture(scope="module")
def shift_refs(tiny_mistral, mistral):
    ps = prompts(21, [20, 9])
    windows = list(mistral[0].spec.sliding_window)
    return ps, {"off": [mistral_shifted_greedy(tiny_mistral, p, 60, 32, 4) for p in ps],
                "auto": [mistral_shifted_greedy(tiny_mistral, p, 60, 32, 4, windows) for p in ps]}


@pytest.mark.parametrize("kv_groups", ["off", "auto"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_context_shift_tokens_equal_transformers(mistral, shift_refs, backend, block_size, kv_groups):
    """context_limit 32, n_keep 4, 60 new tokens: several shifts per sequence (K-shifted keys, re-laid tails),
    with the window of 24 inside the limit. One pool keeping every key (kv_groups off): the kept first tokens
    come back into the window after a shift; Mistral's one window group (auto) drops a key for good, as
    transformers' sliding-window cache does: each equals its own replay, and the two differ."""
    model, _ = mistral
    ps, want = shift_refs
    assert want["off"] != want["auto"]
    eng = Engine(model, CacheConfig(block_size=block_size),
                 EngineOptions(attention=backend, context_limit=32, n_keep=4, kv_groups=kv_groups))
    assert eng.grouped == (kv_groups == "auto")
    assert greedy(eng, ps, 60) == want[kv_groups]
    assert all(s.shifts >= 2 for s in eng.seqs.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_repositioned_keys_equal_transformers(llama_model, llama_ref, backend):
    """Positions with a gap (seq_add before the prompt is computed: tokens 10.. sit at 15..): the backends get
    key positions (PagedBatch.key_pos), and transformers the same position_ids."""
    p = prompts(22, [30])[0]
    eng = Engine(llama_model, CacheConfig(block_size=7), EngineOptions(attention=backend))
    sid = eng.add_request(p, SamplingParams(max_new_tokens=N, ignore_eos=True))
    eng.seq_add(sid, 10, None, 5)
    assert eng.seqs[sid].repositioned
    eng.run_until_done()
    eng.check_invariants()
    hf = llama_ref.model
    pos = list(range(10)) + list(range(15, 15 + len(p) - 10))
    toks, want = list(p), []
    with torch.inference_mode():
        from transformers import DynamicCache

        cache = DynamicCache()
        logits = hf(torch.tensor([toks]), position_ids=torch.tensor([pos]), past_key_values=cache).logits[0, -1]
        for i in range(N):
            want.append(int(logits.argmax()))
            pos.append(pos[-1] + 1)
            logits = hf(torch.tensor([[want[-1]]]), position_ids=torch.tensor([[pos[-1]]]), past_key_values=cache,
                        cache_position=torch.tensor([len(p) + i])).logits[0, -1]
    assert eng.seqs[sid].output == want


def test_repositioned_window_cpu_equals_reference(mistral):
    """Gapped positions under a sliding window, where a window by key index and one by key position differ
    (tokens 20.. moved 10 on: the window of 24 ends at a different key): the cpu path must mask by position, as
    the reference path does. A second gap mid-run re-rotates cached keys. Logits within fp32_order_bound every step."""
    model, _ = mistral
    engines, logits = _side_by_side(model, CacheConfig(block_size=7), [30, 45])
    for eng in engines:
        for sid in eng.seqs:
            eng.seq_add(sid, 20, None, 10)
    _step_together(engines, logits, until=lambda: engines[0].counters.generated >= 10)
    for eng in engines:
        for sid in eng.seqs:
            eng.seq_add(sid, 50, None, 7)
            assert eng.seqs[sid].repositioned
    _step_together(engines, logits)


# -- quantized KV: the cpu path against the reference path -------------------------------------------


def _side_by_side(model, config: CacheConfig, lengths: list[int], backends: tuple[str, str] = ("reference", "cpu")
                  ) -> tuple[list[Engine], list[list[torch.Tensor]]]:
    """Two engines (a reference-path and a cpu-path one by default) with the same requests, each recording its
    logits."""
    engines, logits = [], []
    config = config.replace(shadow_every_s=0)  # a shadow step is a forward pass of its own: not recorded here
    for backend in backends:
        eng = Engine(model, config, EngineOptions(attention=backend, max_batched_tokens=16))
        logits.append([])
        _recording(eng, logits[-1])
        for p in prompts(23, lengths):
            eng.add_request(p, SamplingParams(max_new_tokens=N, ignore_eos=True))
        engines.append(eng)
    return engines, logits


def fp32_order_bound(eng: Engine, logits: torch.Tensor, keys: int) -> float:
    """The most two fp32 evaluations of the same forward pass in different summation orders can differ by at a
    logit: eps32 x the logits' magnitude x the terms summed along one path through the network (each layer's
    attention over `keys` keys and head_dim channels, its hidden-size and intermediate-size products), the worst
    case of Higham's gamma_n bound for a sum of n terms, taken once per term. On the tiny models it is ~200x
    what is measured (1.3e-6 at logits of 3.6)."""
    spec = eng.model.spec
    terms = spec.num_layers * (keys + spec.head_dim + spec.hidden_size + spec.intermediate_size)
    return torch.finfo(torch.float32).eps * float(logits.abs().max()) * terms


def _step_together(engines: list[Engine], logits: list[list[torch.Tensor]], until=None, tol: float | None = None
                   ) -> None:
    """Step both engines until done (or `until()`), every step's logits within `tol` (None: fp32_order_bound at
    the longest context in the step), then the same tokens."""
    steps = 0
    while engines[0].has_work() and not (until and until()):
        for eng in engines:
            eng.step()
        ref, got = logits[0][-1], logits[1][-1]
        assert got.shape == ref.shape
        err = float((got - ref).abs().max())
        keys = max(s.num_cached for s in engines[0].seqs.values())
        bound = fp32_order_bound(engines[0], ref, keys) if tol is None else tol
        assert err <= bound, f"step {steps}: max logit difference {err:.2e} (bound {bound:.2e}, logit range " \
                             f"{float(ref.abs().max()):.1f})"
        steps += 1
    assert engines[1].has_work() == engines[0].has_work() and steps > 0
    assert [s.output for s in engines[0].seqs.values()] == [s.output for s in engines[1].seqs.values()]


def _recording(eng: Engine, out: list) -> None:
    forward = eng.model.forward

    def wrapped(batch, store):
        logits = forward(batch, store)
        out.append(logits.clone())
        return logits

    eng.model.forward = wrapped


def _format_steps(name: str, got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(how far two stored versions of one write are apart, the most two fp32 computations of its input can put
    them apart), in the part's own unit. An int8 code is x / s rounded, s a token's (or a delta's) largest
    magnitude over 127: inputs apart by fp32 rounding (a relative 1e-7 of that magnitude, far under one step) round
    to codes at most one apart. An fp16 scale is an fp16_ceil of that largest magnitude: at most one fp16 apart.
    An fp16 value (plain data, a delta block's anchor) is apart by the inputs' difference plus one rounding: at most
    two fp16 spacings of the token's largest element (an element near zero can be several of its own spacings
    apart, which is why the token's spacing is the unit)."""
    if got.dtype == torch.int8:
        return float((got.int() - want.int()).abs().max()), 1.0
    if name in ("scale", "tscale"):
        return float((got.view(torch.int16).int() - want.view(torch.int16).int()).abs().max()), 1.0
    top = want.float().abs().amax(dim=-1, keepdim=True).clamp_min(2.0 ** -14)
    spacing = 2.0 ** (torch.floor(torch.log2(top)) - 10)
    return float(((got.float() - want.float()).abs() / spacing).max()), 2.0


def _attend_the_same_codes(engines: list[Engine]) -> list[tuple[str, int, int, float]]:
    """Engine 1 attends what engine 0 stored: each of its writes is compared with engine 0's write of the same
    step (the same slots: both allocate alike), held to _format_steps' bound, and replaced by engine 0's, so the
    two attend the same stored K/V and their logits differ only by the order of fp32 sums. Returns (part, layer,
    elements differing, distance) of each write whose parts differed."""
    ref, other = engines
    twin = {}
    for mine, theirs in zip(other.pool.tiers, ref.pool.tiers):
        twin[id(mine.k)], twin[id(mine.v)] = theirs.k, theirs.v
    flips: list[tuple[str, int, int, float]] = []
    for codec in (other.pool.kcodec, other.pool.vcodec):
        def append(parts, layer, a, x, own=codec.append):
            own(parts, layer, a, x)
            theirs = twin[id(parts)]
            for name in parts:
                got, want = parts[name][layer][a.wslots], theirs[name][layer][a.wslots]
                if torch.equal(got, want):
                    continue
                apart, bound = _format_steps(name, got, want)
                assert apart <= bound, f"layer {layer} {name}: stored {apart:g} steps apart (at most {bound:g})"
                flips.append((name, layer, int((got != want).sum()), apart))
                parts[name][layer][a.wslots] = want

        codec.append = append
    return flips


@pytest.mark.parametrize("kv_dtype", ["int8", "int8-delta", "int8-kivi", "fp16"])
def test_quantized_kv_cpu_logits_equal_reference(mistral, kv_dtype):
    """Two engines side by side, stepped together, the cpu path attending the codes the reference path stored
    (_attend_the_same_codes): every difference in what the two store is one step of the format, and every step's
    logits are within the fp32 bound of two summation orders (_step_together's default), so the same tokens.
    Without the shared codes an element at a rounding boundary takes the next code in one engine and that code is
    attended for the rest of the run: a difference no fp32 tolerance bounds."""
    model, _ = mistral
    engines, logits = _side_by_side(model, CacheConfig(block_size=7, kv_dtype=kv_dtype), [12, 40, 70])
    flips = _attend_the_same_codes(engines)
    _step_together(engines, logits)
    print(f"\n{kv_dtype}: {len(flips)} writes stored differently, {sum(f[2] for f in flips)} elements")
    assert len(logits[1]) > N


def test_half_weights_run_on_the_cpu_path(mistral):
    """bf16 weights: the cpu backend attends in fp32 and returns bf16 (the reference path keeps transformers'
    bf16 arithmetic, tests/model/test_weights.py); both run, and agree on most tokens."""
    from engine.model.loader import load_model

    _, ref = mistral
    model = load_model(ref.model.name_or_path, dtype=torch.bfloat16)
    ps = prompts(24, [10, 40])
    out = {b: greedy(Engine(model, CacheConfig(block_size=7, kv_dtype="bf16"),
                            EngineOptions(attention=b, weights_dtype="bf16")), ps, 12) for b in BACKENDS}
    same = sum(a == b for x, y in zip(out["reference"], out["cpu"]) for a, b in zip(x, y))
    assert same >= 0.75 * sum(map(len, out["cpu"])), out


# -- the inline reference path and ReferenceBackend: one dense_attention -------------------------------


@pytest.mark.parametrize("bs,kv_dtype", [(1, "fp32"), (7, "fp32"), (16, "fp32"), (7, "int8"), (16, "int8")])
def test_inline_reference_path_is_the_reference_backend_bit_for_bit(mistral, bs, kv_dtype):
    """fp32 weights: the model's inline path (attention="reference": store.gather + dense_attention) and the same
    model reading through ReferenceBackend (decode/prefill over the paged table + dense_attention) give identical
    logits at every step, on the sliding-window model (window 24, prompts past it, chunked prefill)."""
    from engine.attention import make_backend

    model, _ = mistral
    engines, logits = _side_by_side(model, CacheConfig(block_size=bs, kv_dtype=kv_dtype), [12, 40, 70],
                                    backends=("reference", "reference"))
    engines[1].model.backend = make_backend("reference")  # the paged path, with the reference backend in it
    assert engines[0].model.backend is None
    _step_together(engines, logits, tol=0.0)
    assert len(logits[1]) > N


# -- the cpu backend's two prefill paths ---------------------------------------------------------------


def _prefill_cases():
    from test_paged_attention import CASES

    return [c for c in CASES if c.bs in (1, 7, 100) and c.variant != "mha"]


@pytest.mark.parametrize("dense", [True, False], ids=["sdpa", "chunked"])
@pytest.mark.parametrize("case", _prefill_cases(), ids=lambda c: c.id)
def test_cpu_prefill_both_paths_match_reference(case, dense):
    """Prefill on the CPU gathers the visible blocks once and runs SDPA (dense_prefill); the chunked online
    softmax is what a CUDA tensor (triton's prefill fallback) takes. Both against the reference backend, on the
    cases of tests/attention/test_paged_attention.py (every format, windows, explicit key positions)."""
    from engine.attention import PagedBatch, make_backend
    from test_paged_attention import D, assert_close, build

    _, store, batch, window, scale = build(case)
    H, _ = case.heads
    B, Qn = len(case.lens), 3
    q = torch.randn(B, Qn, H, D, generator=torch.Generator().manual_seed(7))
    idx = (batch.context_lens.long()[:, None] - Qn + torch.arange(Qn)[None, :]).clamp_min(0)
    q_pos = idx if batch.key_pos is None else batch.key_pos.gather(1, idx)
    pre = PagedBatch(batch.block_table, batch.context_lens, q_pos, batch.key_pos)
    want = make_backend("reference").prefill(q, 1, store, pre, scale=scale, window=window)
    got = make_backend("cpu", dense_prefill=dense, **case.cpu).prefill(q, 1, store, pre, scale=scale, window=window)
    assert_close(got, want, case.id)


# -- kvscope bench --long ---------------------------------------------------------------------------


def test_long_bench_reports_step_time_floor_and_top_ops(tiny_llama):
    """The bench's arithmetic on a tiny model (no timing asserted): KV read per step is every row's blocks."""
    from app.bench.throughput import FloorError, long_context_bench
    from app.cli import build_parser

    args = build_parser().parse_args(["bench", "--long", "40", "--batch", "2", "--model", tiny_llama,
                                      "--block-size", "16", "--attention", "cpu", "--json"])
    assert args.long == 40
    try:
        res = long_context_bench(args, say=lambda *a: None, read_mb=64, steps=3)
    except FloorError as e:  # a tiny model's weights sit in the cache: its steps may beat a read from memory
        res = e.result
        assert min(res["step_over_floor_each"]) < 1.0 and "not a floor" in str(e)
    assert res["attention"] == "cpu" and res["sequences"] == 2 and res["decode_steps"] == 3
    # 2 rows of 40 + 1 warm-up + 3 timed steps (+ the token being computed) = 45 keys = 3 blocks of 16 each
    assert res["kv_bytes_read"] == 2 * 3 * _block_bytes(tiny_llama, 16)
    assert res["floor_ms"] > 0 and res["step_ms_median"] > 0 and res["step_over_floor"] > 0
    # each step is held against the floor at the faster of the streaming reads just before and just after it; the
    # ratio is their median, and the floor shown is the bytes over those rates' median
    each, reads = res["step_over_floor_each"], res["reads_gbps"]
    assert len(each) == 3 and res["step_over_floor"] == pytest.approx(sorted(each)[1])
    assert len(reads) == 4 and res["read_gbps"] == pytest.approx(sorted(max(a, b) for a, b in zip(reads, reads[1:]))[1])
    assert res["read_gbps_min"] <= res["read_gbps"] <= res["read_gbps_max"] and res["read_mib"] == 64
    assert res["floor_ms"] == pytest.approx((res["weights_bytes"] + res["kv_bytes_read"]) / res["read_gbps"] / 1e6)
    # the compute floor: 2 FLOP per weight of each matrix per row, 4 per attended key per head dimension per
    # query head per layer, over the rate of a large fp32 gemm measured in the run
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(tiny_llama)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    h, q, kv = c.hidden_size, c.num_attention_heads * hd, c.num_key_value_heads * hd
    matrices = c.num_hidden_layers * (h * q + 2 * h * kv + q * h + 3 * h * c.intermediate_size) + c.vocab_size * h
    want = 2 * 2 * matrices + 4 * (2 * 45) * c.num_attention_heads * hd * c.num_hidden_layers
    assert res["step_gflop"] * 1e9 == pytest.approx(want)
    assert res["gemm_gflops"] > 0.1
    assert res["compute_floor_ms"] == pytest.approx(res["step_gflop"] / res["gemm_gflops"] * 1e3)
    assert res["step_over_compute_floor"] == pytest.approx(res["step_ms_median"] / res["compute_floor_ms"])
    # between the floors: their sum, the share of the compute floor the step hid, the share 1.3x needs hidden
    m, c, st = res["floor_ms"], res["compute_floor_ms"], res["step_ms_median"]
    assert res["serial_floor_ms"] == pytest.approx(m + c)
    assert res["compute_hidden_share"] == pytest.approx((m + c - st) / c)
    assert res["compute_hidden_share_needed"] == pytest.approx(min(1.0, max(0.0, (c - 0.3 * m) / c)))
    # the attainable yardstick: the step's FLOPs as FMAs of 16 lanes per 64 bytes read, rounded up, and 5 pairs of
    # the read with them against the read without
    import numpy as np

    from engine.attention import attn_ir

    lines = (res["weights_bytes"] + res["kv_bytes_read"]) / 64
    assert res["attainable_fma_per_64_bytes"] == int(np.ceil(want / 32 / lines))
    if attn_ir.llvm is not None:
        assert len(res["attainable_over_floor_each"]) == 5 and all(r > 0 for r in res["attainable_over_floor_each"])
        assert res["attainable_over_floor"] == pytest.approx(sorted(res["attainable_over_floor_each"])[2])
    assert res["outside_torch_ops_ms_per_step"] >= 0
    assert res["profile_top_ops"] and all({"op", "ms_per_step", "share"} <= set(op) for op in res["profile_top_ops"])
    assert build_parser().parse_args(["bench", "--long"]).long == 2048


def test_long_bench_refuses_a_step_faster_than_its_floor(tiny_llama, monkeypatch, capsys):
    """Counted as reading a terabyte, a step beats any memory's read rate: the bench says the floor is wrong and
    exits 1, with the numbers, rather than printing a ratio below 1."""
    import app.bench.throughput as bench
    from app.cli import build_parser

    real = bench.long_context_bench
    monkeypatch.setattr(bench, "model_weight_bytes", lambda model: 10**12)
    monkeypatch.setattr(bench, "long_context_bench", lambda a, say: real(a, say, read_mb=64, steps=2))
    args = build_parser().parse_args(["bench", "--long", "20", "--batch", "1", "--model", tiny_llama,
                                      "--attention", "cpu", "--json"])
    assert bench.cmd_bench_long(args) == 1
    out = capsys.readouterr()
    assert "faster than the streaming reads just before and after it" in out.err
    assert "the floor is not a floor" in out.err
    res = json.loads(out.out.strip().splitlines()[-1])
    assert min(res["step_over_floor_each"]) < 1.0 and res["error"]


def _block_bytes(path: str, bs: int) -> int:
    from engine.model.loader import load_model

    return Engine(load_model(path), CacheConfig(block_size=bs, device_budget_mb=1, host_budget_mb=0)).pool.block_bytes


# -- triton, interpreted -----------------------------------------------------------------------------


TRITON_CASES = ((7, [10, 31, 57]), (16, [5, 40]))  # (block size, prompt lengths) on the sliding-window model


def test_triton_backend_tokens_equal_transformers(mistral, tiny_mistral, tmp_path):
    """The paged-decode kernel (prefill: the cpu path) in an engine, under the interpreter."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        pytest.skip(f"triton is not installed ({e})")
    _, ref = mistral
    out = tmp_path / "tokens.json"
    env = interpreter_env()  # with this session's KVSCOPE_CACHE_DIR: the worker reuses the conversion cache
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(out), tiny_mistral], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"interpreter worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    got = json.loads(out.read_text())
    for i, (bs, lengths) in enumerate(TRITON_CASES):
        ps = prompts(25 + i, lengths)
        assert got[i] == [ref.greedy(p, 12) for p in ps], f"block size {bs}"


def _triton_worker(out: str, path: str) -> None:
    from engine.attention.triton_paged import INTERPRET
    from engine.model.loader import load_model

    assert INTERPRET, "run with TRITON_INTERPRET=1"
    model = load_model(path)
    res = []
    for i, (bs, lengths) in enumerate(TRITON_CASES):
        eng = Engine(model, CacheConfig(block_size=bs), EngineOptions(attention="triton", max_batched_tokens=16))
        assert eng.model.backend.name == "triton"
        res.append(greedy(eng, prompts(25 + i, lengths), 12))
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/tiny_models.py
    _triton_worker(sys.argv[1], sys.argv[2])
