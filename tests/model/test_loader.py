"""engine.model.loader / engine.model.tokenizer: tiny random HF models, refusals, and the default GGUF's cache.

The default model is converted once per module into a temporary cache (~20 s on 2 cores), so the
suite never depends on, or writes to, the user's ~/.cache/kvscope.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models as tok_models
from tokenizers import pre_tokenizers

from engine.model import gguf_cache, loader
from engine.model.gguf_cache import CONVERT_STAGE
from engine.model.loader import ModelLoadError, hf_reference_dir, load_model
from engine.model.safetensors_io import read_safetensors
from engine.model.tokenizer import StreamDecoder, Tokenizer

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


# -- tiny models ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A word-level tokenizer: enough for the loader, independent of the default model."""
    folder = tmp_path_factory.mktemp("tiny_tokenizer")
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "hello", "world", "kv", "scope"])}
    backend = BackendTokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>", "</s>"])
    backend.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "tokenizer_class": "TokenizersBackend"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def make_tiny(folder: Path, tokenizer_dir: Path, kind: str = "llama", max_shard_size: str | None = None,
              **overrides: object) -> dict[str, torch.Tensor]:
    """Save a random tiny model of `kind` as a HF safetensors dir; returns its transformers state dict."""
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    kwargs = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = model_class(config_class(**kwargs)).eval()
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    return {k: v.detach().float() for k, v in model.state_dict().items()}


def assert_same_weights(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == reference.keys()
    for key, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous() and tensor.device.type == "cpu", key
        assert torch.equal(tensor, reference[key]), key


def test_tiny_llama(tmp_path: Path, tiny_tokenizer: Path) -> None:
    reference = make_tiny(tmp_path, tiny_tokenizer, "llama", tie_word_embeddings=True, rope_theta=5000.0)
    model = load_model(str(tmp_path))
    s = model.spec
    assert (s.architecture, s.model_type, s.vocab_size, s.hidden_size, s.intermediate_size) == (
        "LlamaForCausalLM", "llama", 128, 64, 96)
    assert (s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) == (2, 4, 2, 16)
    assert s.rope_theta == 5000.0 and s.rope_scaling is None
    assert s.tie_word_embeddings and not s.attention_bias
    assert s.sliding_window == (None, None)
    assert s.bos_token_id == 1 and s.eos_token_ids == (2,)
    assert s.name == tmp_path.name and model.cache_dir == model.source == str(tmp_path.resolve())
    assert_same_weights(model.weights, reference)
    assert model.weights["lm_head.weight"] is model.weights["model.embed_tokens.weight"]
    assert model.tokenizer.encode("hello kv world") == [3, 5, 4]


def test_tiny_llama3_rope_scaling_and_shards(tmp_path: Path, tiny_tokenizer: Path) -> None:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    reference = make_tiny(tmp_path, tiny_tokenizer, "llama", rope_parameters=rope, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    s = load_model(str(tmp_path)).spec
    assert s.rope_theta == 500000.0
    assert s.rope_scaling is not None
    assert (s.rope_scaling["rope_type"], s.rope_scaling["factor"]) == ("llama3", 8.0)
    assert_same_weights(load_model(str(tmp_path)).weights, reference)


def test_v4_style_rope_keys(tmp_path: Path, tiny_tokenizer: Path) -> None:
    make_tiny(tmp_path, tiny_tokenizer, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.update(rope_theta=250000.0, rope_scaling={"type": "linear", "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps(config))
    s = load_model(str(tmp_path)).spec
    assert s.rope_theta == 250000.0
    assert s.rope_scaling == {"rope_type": "linear", "factor": 2.0, "rope_theta": 250000.0}


def test_tiny_qwen2_bias_and_windows(tmp_path: Path, tiny_tokenizer: Path) -> None:
    reference = make_tiny(tmp_path, tiny_tokenizer, "qwen2", use_sliding_window=True, sliding_window=32,
                          max_window_layers=1)
    model = load_model(str(tmp_path))
    s = model.spec
    assert (s.architecture, s.model_type, s.attention_bias) == ("Qwen2ForCausalLM", "qwen2", True)
    assert s.sliding_window == (None, 32)  # HF: sliding only for layers >= max_window_layers
    assert not s.tie_word_embeddings
    assert "model.layers.1.self_attn.k_proj.bias" in model.weights
    assert_same_weights(model.weights, reference)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["layer_types"]  # a transformers 4 config: max_window_layers decides
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_model(str(tmp_path)).spec.sliding_window == (None, 32)


def test_qwen2_window_off_and_layer_types(tmp_path: Path, tiny_tokenizer: Path) -> None:
    make_tiny(tmp_path / "off", tiny_tokenizer, "qwen2", sliding_window=32, max_window_layers=0)
    assert load_model(str(tmp_path / "off")).spec.sliding_window == (None, None)  # use_sliding_window is False
    make_tiny(tmp_path / "types", tiny_tokenizer, "qwen2", use_sliding_window=True, sliding_window=32,
              layer_types=["sliding_attention", "full_attention"])
    assert load_model(str(tmp_path / "types")).spec.sliding_window == (32, None)


def test_tiny_mistral_sliding_window(tmp_path: Path, tiny_tokenizer: Path) -> None:
    reference = make_tiny(tmp_path, tiny_tokenizer, "mistral", sliding_window=16)
    model = load_model(str(tmp_path))
    assert (model.spec.architecture, model.spec.model_type) == ("MistralForCausalLM", "mistral")
    assert model.spec.sliding_window == (16, 16)
    assert_same_weights(model.weights, reference)


# -- refusals -------------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match=re.escape(f"model not found: {missing}")):
        load_model(str(missing))


def test_pickle_only_dir_refused(tmp_path: Path, tiny_tokenizer: Path) -> None:
    make_tiny(tmp_path, tiny_tokenizer)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ModelLoadError, match="only safetensors are loaded.*convert with"):
        load_model(str(tmp_path))


def test_truncated_safetensors(tmp_path: Path, tiny_tokenizer: Path) -> None:
    make_tiny(tmp_path, tiny_tokenizer)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match=re.escape(str(weights))):
        load_model(str(tmp_path))


def test_wrong_shapes_and_missing_tensors(tmp_path: Path, tiny_tokenizer: Path) -> None:
    make_tiny(tmp_path, tiny_tokenizer)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 80}))
    with pytest.raises(ModelLoadError, match="wrong shapes"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ModelLoadError, match="missing tensors.*model.layers.2"):
        load_model(str(tmp_path))


def test_unsupported_architecture_dir(tmp_path: Path) -> None:
    gpt2 = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0)
    gpt2.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'GPT2LMHeadModel' in .*KV Scope serves"):
        load_model(str(tmp_path))


def gguf_header(path: Path, architecture: str) -> None:
    """A GGUF v3 header with two metadata keys and no tensors."""
    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s)) + s.encode()
    body = string("general.name") + struct.pack("<I", 8) + string("x")
    body += string("general.architecture") + struct.pack("<I", 8) + string(architecture)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + body)


def test_unsupported_and_truncated_gguf(tmp_path: Path) -> None:
    gguf_header(tmp_path / "gpt.gguf", "gpt2")
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'gpt2' in .*gpt\.gguf"):
        load_model(str(tmp_path / "gpt.gguf"))
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "gpt.gguf").read_bytes()[:30])
    with pytest.raises(ModelLoadError, match=r"corrupt or truncated GGUF file .*cut\.gguf"):
        load_model(str(tmp_path / "cut.gguf"))


# -- the default model ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_model(tmp_path_factory: pytest.TempPathFactory):
    """Cold conversion into a private cache; the env var stays set for the module's tests."""
    cache = tmp_path_factory.mktemp("kvscope_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSCOPE_CACHE_DIR", str(cache))
        stages: list[tuple[str, float]] = []
        start = time.perf_counter()
        model = load_model(progress=lambda stage, fraction: stages.append((stage, fraction)))
        print(f"\ncold load of the default model: {time.perf_counter() - start:.1f} s")
        yield model, stages, cache


@pytest.mark.slow
def test_cold_conversion_cache(default_model) -> None:
    model, stages, cache = default_model
    assert (CONVERT_STAGE, 0.0) in stages and stages[-1] == (CONVERT_STAGE, 1.0)
    assert model.source == loader.default_model_path()
    assert model.cache_dir is not None and Path(model.cache_dir).parent == cache / "models"
    files = set(os.listdir(model.cache_dir))
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
            "kvscope-complete.json"} <= files
    config = json.loads((Path(model.cache_dir) / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    s = model.spec
    assert (s.architecture, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) == (
        "LlamaForCausalLM", 30, 9, 3, 64)
    assert s.tie_word_embeddings and s.bos_token_id == 1 and 2 in s.eos_token_ids
    assert s.name == "SmolLM2-135M-Instruct.Q4_1"
    assert hf_reference_dir() == model.cache_dir
    assert json.loads((cache / "hashes.json").read_text())[model.source]["sha256"] == Path(model.cache_dir).name


@pytest.mark.slow
def test_warm_load_skips_conversion(default_model) -> None:
    cold, _, _ = default_model
    stages: list[tuple[str, float]] = []
    start = time.perf_counter()
    warm = load_model(progress=lambda stage, fraction: stages.append((stage, fraction)))
    elapsed = time.perf_counter() - start
    print(f"\nwarm load_model() in-process: {elapsed:.2f} s")
    assert not any(stage == CONVERT_STAGE for stage, _ in stages)
    assert_same_weights(warm.weights, cold.weights)


@pytest.mark.slow
def test_warm_load_never_imports_transformers(default_model) -> None:
    code = (
        "import sys, time; import torch; t = time.perf_counter()\n"
        "from engine.model.loader import load_model; m = load_model()\n"
        "print(round(time.perf_counter() - t, 3), 'transformers' in sys.modules, m.spec.num_layers)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ), capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    print(f"\nwarm load in a fresh process (after torch import): {out[0]} s")
    assert out[1:] == ["False", "30"]


@pytest.mark.slow
def test_weights_match_transformers_reference(default_model) -> None:
    model, _, _ = default_model
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_reference_dir(), dtype=torch.float32)
    assert_same_weights(model.weights, {k: v.detach() for k, v in reference.state_dict().items()})


@pytest.fixture
def relinked_conversion(default_model, tmp_path: Path, monkeypatch) -> list[str]:
    """The 20 s conversion replaced by hard links to the pristine converted files; returns the calls made."""
    model, _, _ = default_model
    pristine = tmp_path / "pristine"
    pristine.mkdir()
    for f in Path(model.cache_dir).iterdir():
        if f.name not in ("kvscope-complete.json", "kvscope-builder.json"):  # written by the loader itself
            os.link(f, pristine / f.name)  # hard links: instant, and survive the cache being deleted
    calls: list[str] = []

    def fake_convert(gguf_path: str, out_dir: str, report) -> None:
        calls.append(gguf_path)
        report(CONVERT_STAGE, 0.0)
        for f in pristine.iterdir():
            os.link(f, Path(out_dir) / f.name)

    monkeypatch.setattr(gguf_cache, "_convert_gguf", fake_convert)
    return calls


@pytest.mark.slow
def test_corrupt_or_incomplete_cache_is_rebuilt(default_model, relinked_conversion: list[str]) -> None:
    """The rebuild path, with the 20 s conversion replaced by a copy of the pristine converted files."""
    model, _, _ = default_model
    cache_dir = Path(model.cache_dir)
    calls = relinked_conversion
    weights = cache_dir / "model.safetensors"
    truncated = weights.read_bytes()[: 1 << 20]
    weights.unlink()  # a new inode, so the pristine link keeps the good bytes
    weights.write_bytes(truncated)
    stages: list[str] = []
    rebuilt = load_model(progress=lambda stage, fraction: stages.append(stage))
    assert calls and CONVERT_STAGE in stages
    assert weights.stat().st_size > len(truncated) and (cache_dir / "kvscope-complete.json").exists()
    assert_same_weights(rebuilt.weights, model.weights)

    (cache_dir / "kvscope-complete.json").unlink()  # an interrupted build: no marker
    load_model()
    assert len(calls) == 2 and (cache_dir / "kvscope-complete.json").exists()
    assert not [p for p in cache_dir.parent.iterdir() if p.name.startswith(".building-")]


def flip_bytes_in_tensor(weights: Path, name: str, offset: int, count: int) -> None:
    """Invert `count` bytes of tensor `name` in a new inode: same size, still a valid safetensors file."""
    with weights.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        start = 8 + header_len + json.loads(f.read(header_len))[name]["data_offsets"][0] + offset
    damaged = weights.with_name("damaged.tmp")
    shutil.copyfile(weights, damaged)  # a copy, so mmap-backed weights of earlier loads keep their bytes
    with damaged.open("r+b") as f:
        f.seek(start)
        flipped = bytes(b ^ 0xFF for b in f.read(count))
        f.seek(start)
        f.write(flipped)
    os.replace(damaged, weights)


@pytest.mark.slow
def test_flipped_bytes_in_cached_weights_are_detected_and_rebuilt(default_model, relinked_conversion: list[str],
                                                                  capsys) -> None:
    model, _, _ = default_model
    cache_dir = Path(model.cache_dir)
    weights = cache_dir / "model.safetensors"
    size = weights.stat().st_size
    name = "model.layers.7.mlp.down_proj.weight"
    flip_bytes_in_tensor(weights, name, offset=4096, count=16)
    assert weights.stat().st_size == size
    # safetensors loads the damaged file without complaint: only the checksums can tell.
    assert not torch.equal(read_safetensors(str(cache_dir))[name], model.weights[name])
    capsys.readouterr()
    rebuilt = load_model()
    assert relinked_conversion == [model.source]
    err = capsys.readouterr().err
    assert f"checksum mismatch in {weights}: {name}" in err and "converting it again" in err
    assert_same_weights(rebuilt.weights, model.weights)
    gguf_cache.verify_checksums(str(cache_dir))  # the rebuilt entry carries checksums that match it

    marker = cache_dir / "kvscope-complete.json"  # an entry without checksums is not trusted either
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "checksums": {}}))
    assert_same_weights(load_model().weights, model.weights)
    assert len(relinked_conversion) == 2 and "records no checksums" in capsys.readouterr().err


def test_checksums_cover_every_byte(tmp_path: Path, tiny_tokenizer: Path) -> None:
    """Damage to the header, to any tensor, to a json file, or bytes appended: each is a mismatch."""
    make_tiny(tmp_path, tiny_tokenizer)
    checksums = gguf_cache._checksums(str(tmp_path), gguf_cache._entry_files(str(tmp_path)))
    (tmp_path / "kvscope-complete.json").write_text(json.dumps({"checksums": checksums}))
    gguf_cache.verify_checksums(str(tmp_path))
    weights = tmp_path / "model.safetensors"
    pristine = weights.read_bytes()
    (header_len,) = struct.unpack("<Q", pristine[:8])
    for at in (20, 8 + header_len, len(pristine) - 1):  # header, first tensor byte, last tensor byte
        weights.write_bytes(pristine[:at] + bytes([pristine[at] ^ 1]) + pristine[at + 1:])
        with pytest.raises(ModelLoadError, match="checksum mismatch|cannot checksum"):  # or a header json broke
            gguf_cache.verify_checksums(str(tmp_path))
    weights.write_bytes(pristine + b"\0")
    with pytest.raises(ModelLoadError, match="checksum mismatch.*tail"):
        gguf_cache.verify_checksums(str(tmp_path))
    weights.write_bytes(pristine)
    config = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(config.replace('"num_hidden_layers": 2', '"num_hidden_layers": 3'))
    with pytest.raises(ModelLoadError, match=r"checksum mismatch in .*config\.json"):
        gguf_cache.verify_checksums(str(tmp_path))


def test_user_hf_dir_is_never_checked_or_rebuilt(tmp_path: Path, tiny_tokenizer: Path, monkeypatch) -> None:
    """A user's own directory has no recorded checksums and no source to rebuild from: loaded as it is."""
    reference = make_tiny(tmp_path / "model", tiny_tokenizer)
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    flip_bytes_in_tensor(tmp_path / "model" / "model.safetensors", "model.norm.weight", offset=0, count=4)
    weights = load_model(str(tmp_path / "model")).weights
    assert not torch.equal(weights["model.norm.weight"], reference["model.norm.weight"])
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_orphaned_build_dirs_are_removed(default_model) -> None:
    model, _, cache = default_model
    models = cache / "models"

    def building() -> set[str]:
        return {p.name for p in models.iterdir() if p.name.startswith(".building-")}

    # A conversion killed midway, in a process that has exited since: its directory is an orphan.
    code = ("import os, signal\nfrom engine.model import gguf_cache, loader\n"
            "gguf_cache._convert_gguf = lambda *args: os.kill(os.getpid(), signal.SIGKILL)\n"
            "gguf_cache.converted_dir(loader.default_model_path(), None, rebuild=True)\n")
    killed = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ))
    assert killed.wait(timeout=120) == -signal.SIGKILL
    left = building()
    try:
        assert len(left) == 1
        load_model()
        assert building() == set(), "the killed conversion's directory survived a load"

        live = Path(gguf_cache._new_build_dir(str(models)))  # this process, alive: maybe converting right now
        reused = Path(gguf_cache._new_build_dir(str(models)))  # its pid now belongs to another process
        record = json.loads((reused / "kvscope-builder.json").read_text())
        (reused / "kvscope-builder.json").write_text(json.dumps({**record, "started": record["started"] - 1000}))
        old, young = models / ".building-legacy-old", models / ".building-legacy-young"  # no record at all
        old.mkdir(), young.mkdir()
        hours_ago = time.time() - 2 * 3600
        os.utime(old, (hours_ago, hours_ago))
        load_model()
        assert building() == {live.name, young.name}
    finally:
        for name in building():
            shutil.rmtree(models / name)


# -- tokenizer ------------------------------------------------------------------------------------

TEXTS = ["Hello world", "", "  leading spaces and trailing ", "Ünïcödé ✓ 日本語 🙂🙃", "line\n\n\ttab",
         "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x ** 2  # ok"]

CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "🙂 ok"}],
]


@pytest.fixture(scope="module")
def hf_tokenizer(default_model):
    return transformers.AutoTokenizer.from_pretrained(hf_reference_dir())


@pytest.mark.slow
def test_encode_decode_match_transformers(default_model, hf_tokenizer) -> None:
    tok: Tokenizer = default_model[0].tokenizer
    for text in TEXTS:
        assert tok.encode(text) == hf_tokenizer(text).input_ids, text
        assert tok.encode(text, add_special_tokens=False) == hf_tokenizer(text, add_special_tokens=False).input_ids
        ids = tok.encode(text)
        assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids, skip_special_tokens=False)
    assert tok.bos_token_id == hf_tokenizer.bos_token_id
    assert hf_tokenizer.eos_token_id in tok.eos_token_ids
    assert tok.vocab_size == len(hf_tokenizer)


@pytest.mark.slow
def test_chat_template_matches_transformers(default_model, hf_tokenizer) -> None:
    tok: Tokenizer = default_model[0].tokenizer
    for messages in CHATS:
        for generation_prompt in (True, False):
            expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                        tokenize=True)["input_ids"]
            assert tok.apply_chat_template(messages, add_generation_prompt=generation_prompt) == expected
            assert tok.render_chat_template(messages, generation_prompt) == hf_tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation_prompt, tokenize=False)


@pytest.mark.slow
def test_stream_decoder_never_splits_characters(default_model) -> None:
    tok: Tokenizer = default_model[0].tokenizer
    text = "Ünïcödé ✓ 日本語 🙂🙃 done"
    ids = tok.encode(text)
    stream = StreamDecoder(tok)
    chunks = [stream.push(i) for i in ids]
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) + stream.flush() == tok.decode(ids) == text
    held = StreamDecoder(tok)
    partial = "".join(held.push(i) for i in tok.encode("🙂")[:1])
    assert partial == "" and held.flush() == "\ufffd"  # a cut-off character surfaces only on flush


def test_the_suite_never_writes_to_the_users_cache() -> None:
    # conftest points KVSCOPE_CACHE_DIR at a session directory before anything is imported.
    root = os.path.realpath(gguf_cache.cache_root())
    assert not root.startswith(os.path.realpath(os.path.expanduser("~/.cache")))
    assert root == os.path.realpath(os.environ["KVSCOPE_CACHE_DIR"])
