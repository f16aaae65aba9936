"""Weights: held once (loaded straight into their final, fused buffers), `--weights-dtype` (bf16 / fp16 forward
passes that agree with transformers in the same dtype), and KV tiers whose memory is committed as it is used."""

from __future__ import annotations

import math
import resource
import subprocess
import sys

import psutil
import pytest
import torch

from engine.config import CacheConfig, ConfigError, EngineOptions
from engine.runtime.engine import Engine
from engine.model.loader import load_model, resolve_weights_dtype
from engine.model.spec import expected_shapes
from engine.sequence import SamplingParams
from tiny_models import prompts

MB = 2**20


# -- helpers ----------------------------------------------------------------------------------------


def model_tensors(engine: Engine) -> list[torch.Tensor]:
    m = engine.model
    out = [m.embed, m.lm_head, m.norm]
    for layer in m.layers:
        out.extend(t for t in layer if t is not None)
    return out


def storages(tensors) -> dict[int, int]:
    """data_ptr -> nbytes of each distinct storage the tensors use."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def weight_bytes(spec, dtype: torch.dtype) -> int:
    """One copy of the model's weights (a tied lm_head counted once)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(torch.Size(shape).numel() * itemsize for shape in expected_shapes(spec).values())


# -- weights held once ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_weights_are_held_once(tiny_llama, dtype):
    """Loaded in the engine's dtype, the engine uses the loaded tensors as they are: every byte the model and
    the LoadedModel reference is one copy of the weights, and q/k/v, gate/up are rows of the fused buffers."""
    torch_dtype = resolve_weights_dtype(dtype)
    loaded = load_model(tiny_llama, dtype=torch_dtype)
    engine = Engine(loaded, CacheConfig(device_budget_mb=1, host_budget_mb=0), EngineOptions(weights_dtype=dtype))
    model = engine.model
    assert model.dtype == torch_dtype and all(t.dtype == torch_dtype for t in model_tensors(engine))
    one_copy = weight_bytes(loaded.spec, torch_dtype)
    both = storages([*model_tensors(engine), *engine.loaded.weights.values()])
    assert sum(both.values()) == one_copy
    assert storages(model_tensors(engine)).keys() == storages(engine.loaded.weights.values()).keys()
    for i, (_, qkv, _, _, _, gate_up, _) in enumerate(model.layers):
        p = f"model.layers.{i}."
        for names, fused in (([p + f"self_attn.{x}_proj.weight" for x in "qkv"], qkv),
                             ([p + f"mlp.{x}_proj.weight" for x in ("gate", "up")], gate_up)):
            assert torch.equal(torch.cat([loaded.weights[n] for n in names]), fused)
            assert {loaded.weights[n].untyped_storage().data_ptr() for n in names} == {fused.untyped_storage().data_ptr()}


def test_in_memory_weights_are_fused_in_place(tiny_llama):
    """A state dict built in memory (separate q/k/v tensors, as app/bench/throughput.py makes one): the engine fuses them
    once and re-points the dict at the fused rows, so the unfused originals are freed, not kept beside them."""
    loaded = load_model(tiny_llama)
    loaded.weights = {k: v.clone() for k, v in loaded.weights.items()}  # separate storages, like a fresh dict
    loaded.weights["lm_head.weight"] = loaded.weights["model.embed_tokens.weight"]
    reference = {k: v.clone() for k, v in loaded.weights.items()}
    engine = Engine(loaded, CacheConfig(device_budget_mb=1, host_budget_mb=0), EngineOptions(weights_dtype="fp32"))
    both = storages([*model_tensors(engine), *loaded.weights.values()])
    assert sum(both.values()) == weight_bytes(loaded.spec, torch.float32)
    assert all(torch.equal(loaded.weights[k], v) for k, v in reference.items())
    # A second engine from the same LoadedModel now shares the same buffers (no copy at all).
    second = Engine(loaded, CacheConfig(device_budget_mb=1, host_budget_mb=0), EngineOptions(weights_dtype="fp32"))
    assert storages(model_tensors(second)) == storages(model_tensors(engine))


def test_an_engine_in_another_dtype_converts_once_and_leaves_the_loaded_model_alone(tiny_llama, llama_model):
    """fp32 LoadedModel (shared by other engines), bf16 engine: the engine holds one bf16 copy of its own;
    the caller's fp32 tensors are not touched (a later fp32 engine must still be exact)."""
    before = {k: v.clone() for k, v in llama_model.weights.items()}
    engine = Engine(llama_model, CacheConfig(device_budget_mb=1, host_budget_mb=0), EngineOptions(weights_dtype="bf16"))
    own = storages(model_tensors(engine))
    assert sum(own.values()) == weight_bytes(llama_model.spec, torch.bfloat16)
    assert not own.keys() & storages(llama_model.weights.values()).keys()
    assert all(v.dtype == torch.float32 and torch.equal(v, before[k]) for k, v in llama_model.weights.items())


# -- bf16 / fp16 forward passes ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_shaped(tmp_path_factory, tokenizer_files) -> str:
    """A 2-layer random Llama with SmolLM2's widths (576 hidden, 1536 MLP, 9 heads, 3 KV heads): at these sizes
    bf16 rounding tells kernels apart (the tiny 64-wide models agree even with the wrong ones)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiny_models import _save_tiny

    return _save_tiny(tmp_path_factory.mktemp("smol-shaped"), LlamaConfig, LlamaForCausalLM, tokenizer_files, 3,
                      hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_weights_match_transformers_in_the_same_dtype(smol_shaped, dtype):
    """Half-precision weights and KV of the same dtype against transformers loaded in that dtype: norms in fp32
    then rounded (LlamaRMSNorm), RoPE tables rounded, matmuls with F.linear, attention over exactly the valid
    keys. Measured: every step's logits equal bit for bit, so every token too (each prompt run alone;
    batching changes how bf16 matmuls round, in transformers as here). Guards against: w @ x.T for one-row decode steps
    and SDPA over the padded block tail each broke the equality."""
    from transformers import AutoModelForCausalLM

    torch_dtype = resolve_weights_dtype(dtype)
    hf = AutoModelForCausalLM.from_pretrained(smol_shaped, dtype=torch_dtype).eval()
    # shadow_every_s=0: a shadow reference step (every 2 engine-seconds by default, reached on a loaded machine)
    # would be one more forward in the count below.
    engine = Engine(load_model(smol_shaped, dtype=torch_dtype),
                    CacheConfig(block_size=8, kv_dtype=dtype, shadow_every_s=0), EngineOptions(weights_dtype=dtype))
    forward = engine.model.forward
    logits: list[torch.Tensor] = []
    engine.model.forward = lambda batch, store: (lambda out: logits.append(out[-1].clone()) or out)(forward(batch, store))
    for p in prompts(7, [5, 23, 40]):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
        logits.clear()
        got = engine.generate([p], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
        assert got == ref.sequences[0, len(p):].tolist()
        assert len(logits) == 12
        for step, (ours, theirs) in enumerate(zip(logits, ref.logits)):
            assert torch.equal(ours, theirs[0].float()), (len(p), step)


def bf16_ulp(x: float) -> float:
    """The spacing of bf16 values at |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0 ** -133


def at_a_bf16_tie(logits: torch.Tensor, a: int, b: int) -> bool:
    """Tokens a and b both within one bf16 ulp of the top logit: which of them greedy takes is decided by the last
    rounding of the arithmetic (a CPU's bf16 kernels: AVX-512 BF16 here, AMX on an Intel Xeon), not by the model."""
    top = float(logits.max())
    return min(float(logits[a]), float(logits[b])) >= top - bf16_ulp(top)


def test_a_bf16_tie_is_one_ulp_of_the_top_logit():
    """At a top logit of 20.0 (bf16 spacing 0.125): 19.875 ties it, 19.75 (two spacings down) does not; both tokens
    must be at the top."""
    logits = torch.tensor([20.0, 19.875, 19.75, 0.0])
    assert bf16_ulp(20.0) == 0.125 and bf16_ulp(-0.75) == 2.0 ** -8
    assert at_a_bf16_tie(logits, 0, 1) and at_a_bf16_tie(logits, 1, 0)
    assert not at_a_bf16_tie(logits, 0, 2) and not at_a_bf16_tie(logits, 1, 3)


@pytest.mark.slow
def test_default_model_bf16_greedy_agrees_with_transformers_bf16(capsys):
    """SmolLM2 with bf16 weights and bf16 KV against transformers in bf16 on the same weights: 64 greedy tokens on
    each of 3 chat prompts (each run alone, as transformers' generate runs it). Every token is checked: equal to
    transformers' greedy token after the same prefix, or, where the two differ, the two tokens are at a bf16 tie in
    both (at_a_bf16_tie on transformers' logits after that prefix and on the engine's logits of that step); the
    reference then continues from the engine's prefix, so the tokens after a tie are checked too."""
    from transformers import AutoModelForCausalLM

    from engine.model.loader import hf_reference_dir

    loaded = load_model(None, dtype=torch.bfloat16)
    texts = ["What is the capital of France, and why is it famous?", "Write a short poem about the sea.",
             "Explain how a key-value cache speeds up transformer inference."]
    ps = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
          for t in texts]
    hf = AutoModelForCausalLM.from_pretrained(hf_reference_dir(), dtype=torch.bfloat16).eval()
    engine = Engine(loaded, CacheConfig(kv_dtype="bf16", shadow_every_s=0), EngineOptions(weights_dtype="bf16"))
    forward = engine.model.forward
    logits: list[torch.Tensor] = []
    engine.model.forward = lambda batch, store: (lambda out: logits.append(out[-1].float()) or out)(forward(batch, store))
    n, ties = 64, []
    for p in ps:
        logits.clear()
        got = engine.generate([p], SamplingParams(max_new_tokens=n, ignore_eos=True))[0]
        mine = logits[-n:]  # the step that chose each token (a prefill in chunks records its earlier chunks first)
        i = 0
        while i < n:
            with torch.inference_mode():
                out = hf.generate(torch.tensor([p + got[:i]]), max_new_tokens=n - i, do_sample=False, eos_token_id=None,
                                  pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            want = out.sequences[0, len(p) + i:].tolist()
            j = next((k for k, (a, b) in enumerate(zip(want, got[i:])) if a != b), None)
            if j is None:
                break
            at = i + j
            theirs = out.logits[j][0].float()
            assert at_a_bf16_tie(theirs, want[j], got[at]) and at_a_bf16_tie(mine[at], want[j], got[at]), (
                f"prompt {ps.index(p)} token {at}: transformers {want[j]} (logit {float(theirs[want[j]]):.4f}, "
                f"{float(theirs[got[at]]):.4f} for ours), engine {got[at]} (logits {float(mine[at][got[at]]):.4f}, "
                f"{float(mine[at][want[j]]):.4f} for theirs): not a bf16 tie")
            ties.append((ps.index(p), at))
            i = at + 1
    with capsys.disabled():
        print(f"\nbf16 weights + bf16 KV vs transformers bf16: {3 * n} tokens, ties at (prompt, token) {ties}")


# -- lazily committed tiers --------------------------------------------------------------------------


def rss() -> int:
    return psutil.Process().memory_info().rss


def test_codec_alloc_commits_memory_as_it_is_written():
    from engine.kv.codecs import Geometry, codecs_for
    from engine.config import KVDtype

    g = Geometry(layers=4, kv_heads=2, block_size=16, head_dim=64)
    for kv_dtype in KVDtype:
        kc, vc = codecs_for(kv_dtype)
        for codec in (kc, vc):
            parts = codec.alloc(g, 8, torch.device("cpu"), pin=False)
            for name, (shape, dtype) in codec.parts_shapes(g, 8).items():
                t = parts[name]
                assert t.shape == shape and t.dtype == dtype and not t.stacked().float().any()
                assert all(layer.is_contiguous() for layer in t)
    kc, _ = codecs_for(KVDtype.BF16)
    n = (512 * MB) // sum(kc.block_bytes(g).values())
    before = rss()
    parts = kc.alloc(g, n, torch.device("cpu"), pin=False)
    allocated = rss() - before
    parts["data"][:, :4] = 1.0  # four blocks in every layer: committed now, and only those
    written = rss() - before
    assert allocated < 32 * MB, allocated / MB
    assert written < 32 * MB, written / MB
    assert parts["data"][:, :4].float().eq(1).all() and not parts["data"][:, 4:].float().any()


def test_engine_tiers_are_committed_as_they_are_used(llama_model):
    """A 256 MB device + 1 GB host tier on CPU: creating the engine commits far less than the tiers' size."""
    before = rss()
    engine = Engine(llama_model, CacheConfig(device_budget_mb=256, host_budget_mb=1024), EngineOptions())
    created = rss() - before
    engine.generate(prompts(3, [40]), SamplingParams(max_new_tokens=8, ignore_eos=True))
    used = rss() - before
    tiers = (256 + 1024) * MB
    assert created < 0.5 * tiers, created / MB
    assert used < 0.5 * tiers, used / MB


# -- the flag and its resolution ---------------------------------------------------------------------


def test_auto_resolves_by_device():
    assert resolve_weights_dtype("auto", "cpu") is torch.float32
    assert resolve_weights_dtype("auto", "cuda") is torch.bfloat16
    assert resolve_weights_dtype("auto", torch.device("cuda:1")) is torch.bfloat16
    assert [resolve_weights_dtype(n, "cuda") for n in ("fp32", "bf16", "fp16")] == [
        torch.float32, torch.bfloat16, torch.float16]
    with pytest.raises(ValueError, match="fp64"):
        resolve_weights_dtype("fp64")


def test_engine_options_refuse_a_bad_weights_dtype(llama_model):
    EngineOptions(weights_dtype="bf16").validate()
    with pytest.raises(ConfigError, match="weights_dtype: 'fp64' is not one of auto, fp32, bf16, fp16"):
        EngineOptions(weights_dtype="fp64").validate()
    engine = Engine(llama_model, CacheConfig(device_budget_mb=1, host_budget_mb=0), EngineOptions())
    assert engine.model.dtype is torch.float32  # auto on CPU


def test_cli_flag_loads_straight_into_the_dtype(tiny_llama, capsys):
    from app.cli import build_parser, main
    from app.commands import open_engine

    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--model", tiny_llama, "--weights-dtype", "fp64"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.splitlines()[-1].endswith(
        "argument --weights-dtype: invalid choice: 'fp64' (choose from 'auto', 'fp32', 'bf16', 'fp16', 'int8', 'int4')")
    args = build_parser().parse_args(["generate", "hi", "--model", tiny_llama, "--weights-dtype", "bf16",
                                      "--device-budget-mb", "1", "--host-budget-mb", "0"])
    engine, _ = open_engine(args)
    assert engine.options.weights_dtype == "bf16" and engine.model.dtype is torch.bfloat16
    assert engine.model.embed is engine.loaded.weights["model.embed_tokens.weight"]  # no conversion copy
    assert engine.loaded.weights["model.norm.weight"].dtype is torch.bfloat16
    auto, _ = open_engine(build_parser().parse_args(["generate", "hi", "--model", tiny_llama]))
    assert auto.model.dtype is torch.float32


# -- the whole process -------------------------------------------------------------------------------


def peak_rss_of(code: str) -> int:
    """Peak RSS in bytes of a fresh `python -c code` (its children's max, read in a wrapper process)."""
    wrapper = ("import resource, subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1]], check=True, "
               "stdout=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", wrapper, code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return int(out.stdout) * 1024  # Linux: KiB


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_generate_peak_rss_is_one_copy_of_the_weights(default_model_loaded, dtype, capsys):
    """`kvscope generate "hi" --max-new-tokens 8`: peak RSS minus the RSS of the same imports without a model
    stays within 1.4x the weight bytes (the KV tiers, 1.25 GB configured, are committed as used: ~MBs)."""
    if sys.platform != "linux":
        pytest.skip("ru_maxrss units are Linux's")
    base = peak_rss_of("import torch, engine.runtime.engine, app.commands")
    peak = peak_rss_of("import sys; from app.cli import main; "
                       f"sys.exit(main(['generate', 'hi', '--max-new-tokens', '8', '--weights-dtype', '{dtype}']))")
    weights = weight_bytes(default_model_loaded.spec, resolve_weights_dtype(dtype))
    with capsys.disabled():
        print(f"\n{dtype}: peak RSS {peak / MB:.0f} MiB, imports alone {base / MB:.0f} MiB, "
              f"weights {weights / MB:.0f} MiB: (peak - imports) / weights = {(peak - base) / weights:.2f}")
    assert peak - base <= 1.4 * weights


@pytest.fixture(scope="module")
def default_model_loaded():
    return load_model(None)


@pytest.mark.slow
def test_generate_peak_rss_int4_is_the_packed_weights(capsys):
    """`kvscope generate "hi" --max-new-tokens 8 --weights-dtype int4` on the default GGUF: its Q4_1 / Q8_0 tensors
    are read one at a time into their packed form (engine/model/gguf_direct.py), never into float, so peak RSS over
    the same imports (numba's compiled kernels loaded and the attention self-check run, the tokenizer read) stays within
    1.2x the packed weights + the KV the run holds."""
    if sys.platform != "linux":
        pytest.skip("ru_maxrss units are Linux's")
    from engine.config import CacheConfig
    from engine.model.quant import QuantWeight
    from engine.runtime.bandwidth import weight_bytes as model_weight_bytes

    warm = ("import torch; from engine.model.quant import quantize; "
            "[quantize(torch.randn(64, 64), k).matmul(torch.randn(n, 64)) for k in ('int8', 'int4') for n in (1, 2)]; "
            "[quantize(torch.randn(64, 64), k).lookup(torch.tensor([1])) for k in ('int8', 'int4')]; "
            # the engine's attention self-check at start-up, on scratch pools of other heads than the model's: its
            # kernels loaded and its buffers (~7 MiB, the same at 4 x 32 as at the model's 9 x 64 heads)
            "from engine.attention import make_backend; from engine.attention.check import check_backend; "
            "from engine.config import KVDtype; assert check_backend(make_backend('cpu'), KVDtype.FP32, 16, 4, 2, 32, "
            "torch.device('cpu'), torch.float32, (), False).ok")
    # The baseline also holds the tokenizer as the loader builds it (~38 MiB here, the same for every weights dtype).
    tokenizer = ("import os; from engine.model.tokenizer import Tokenizer; from engine.model.loader import hf_reference_dir; "
                 "from engine.model.spec import model_eos_ids, read_json; d = hf_reference_dir(None); "
                 "t = Tokenizer(d, model_eos_ids(d, read_json(os.path.join(d, 'config.json')))); ")
    from engine.model.loader import hf_reference_dir

    hf_reference_dir(None)  # the first start's conversion done here, not in the baseline (it peaked at 1.2 GiB there)
    base = peak_rss_of("import torch, engine.runtime.engine, app.commands, gguf; " + tokenizer + warm)
    peak = peak_rss_of("import sys; from app.cli import main; "
                       "sys.exit(main(['generate', 'hi', '--max-new-tokens', '8', '--weights-dtype', 'int4']))")
    loaded = load_model(None, dtype="int4")
    engine = Engine(loaded, CacheConfig(), EngineOptions(weights_dtype="int4"))
    assert isinstance(engine.model.embed, QuantWeight)
    packed = model_weight_bytes(engine.model)
    # the KV of the run: every block the prompt and 8 tokens touch, rounded up, plus one block per layer group
    kv = engine.pool.block_bytes * (2 + 16 // engine.config.block_size + 1)
    with capsys.disabled():
        print(f"\nint4: peak RSS {peak / MB:.0f} MiB, imports alone {base / MB:.0f} MiB, packed weights "
              f"{packed / MB:.1f} MiB + KV {kv / MB:.2f} MiB: (peak - imports) / that = {(peak - base) / (packed + kv):.2f}")
    # The goal is 1.2x: measured 1.16-1.18x (without the self-check in the baseline 1.20-1.23x); the
    # rest over the packed bytes is the engine's runner buffers and the allocator's slack, which move a few MiB run
    # to run, so the assertion keeps a margin: 1.25x, against the 4.7x an fp32 copy would cost. The baseline is
    # checked too: one that converted the GGUF itself passed vacuously (peak - imports < 0).
    assert 0 < peak - base <= 1.25 * (packed + kv)
