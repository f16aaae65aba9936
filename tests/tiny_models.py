"""Tiny random-weight models and what checks them: saving one as an HF directory with the committed tiny tokenizer,
transformers' greedy decoding as the reference (and with a context shift replayed on its cache), seeded prompts, and
budgets in MiB that hold an exact number of a model's blocks. The fixtures that build the models are
tests/conftest.py's."""

from __future__ import annotations

import os
import shutil

import torch

TINY_TOKENIZER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tiny_tokenizer")
TINY_VOCAB = 49152


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


def prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


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


def _engine(model, bs: int, dev_blocks: int, mode: str, attention: str = "cpu", host_blocks: int = 400, **cfg):
    """An engine whose device tier holds dev_blocks blocks (and the reserved two), host tier host_blocks, host_reads=mode."""
    from engine.config import CacheConfig, EngineOptions
    from engine.kv.block_pool import RESERVED
    from engine.runtime.engine import Engine

    config = CacheConfig(block_size=bs, device_budget_mb=_mb(model, dev_blocks + RESERVED, bs),
                         host_budget_mb=_mb(model, host_blocks, bs), host_reads=mode, **cfg)
    return Engine(model, config, EngineOptions(attention=attention))


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
    (engine/kv/cache.py): a key is dropped once it leaves the window of the next query and never comes back, a
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
