"""Shared fixtures: tiny random-weight models saved as HF directories, and transformers references."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

# The suite converts the default model into a cache of its own, never the user's ~/.cache/kvscope:
# a temporary one for the session (removed at its end), or $KVSCOPE_TEST_CACHE_DIR to reuse one across
# runs. Set before any engine import; subprocesses inherit it.
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
    """A block map widget at 800 x 420, shown (tests/test_block_map.py, tests/test_kv_cost_window.py)."""
    from ui.block_map.widget import BlockMap

    w = BlockMap()
    qtbot.addWidget(w)
    w.resize(800, 420)
    w.show()
    qtbot.waitExposed(w)
    return w
