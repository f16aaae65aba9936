"""What KV Scope knows about a model before running it: the spec read from a HF config.json, checked against
the state dict, and the one error every loading failure raises."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from engine.model.tokenizer import Tokenizer


class ModelLoadError(Exception):
    """Any failure to load a model; the message is one line naming the path or architecture."""


SUPPORTED_ARCHITECTURES: frozenset[str] = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Olmo2ForCausalLM",
    "GraniteForCausalLM", "SmolLM3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM",
    "Phi3ForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM",
})

# Values transformers' config classes use when a key is absent from config.json (rms_norm_eps: 1e-6 unless listed).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "sliding_window": 4096},
    "qwen3": {"max_position_embeddings": 32768, "sliding_window": 4096, "head_dim": 128},
    "olmo2": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5},
    "granite": {"max_position_embeddings": 2048},
    "smollm3": {"max_position_embeddings": 32768, "sliding_window": None, "no_rope_layer_interval": 4},
    "gemma2": {"max_position_embeddings": 8192, "sliding_window": 4096, "head_dim": 256, "tie_word_embeddings": True,
               "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "sliding_window_pattern": 2},
    "gemma3_text": {"max_position_embeddings": 131072, "sliding_window": 4096, "head_dim": 256,
                    "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "attn_logit_softcapping": None,
                    "final_logit_softcapping": None, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
                    "rope_local_base_freq": 10_000.0},
    "gpt_oss": {"max_position_embeddings": 131072, "sliding_window": 128, "head_dim": 64, "rms_norm_eps": 1e-5,
                "attention_bias": True, "rope_theta": 150000.0, "sliding_window_pattern": 2,
                "num_local_experts": 128, "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
                # GptOssConfig's RoPE when config.json has none
                "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 4096}},
    "phi3": {"max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "sliding_window": None,
             "rms_norm_eps": 1e-5},
    "cohere": {"max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
               "logit_scale": 0.0625},  # rms_norm_eps: Cohere's layer_norm_eps
    "cohere2": {"max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                "logit_scale": 0.0625, "sliding_window": 4096, "sliding_window_pattern": 4},
}
_GEMMA = ("gemma2", "gemma3_text")
_COHERE = ("cohere", "cohere2")
# The families whose layer differs from Llama's: architecture and model_type must name the same one (the forward
# pass follows model_type, transformers the architecture).
_OWN_MODEL_TYPE = {"Qwen3ForCausalLM": "qwen3", "Olmo2ForCausalLM": "olmo2", "GraniteForCausalLM": "granite",
                   "SmolLM3ForCausalLM": "smollm3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
                   "GptOssForCausalLM": "gpt_oss", "Phi3ForCausalLM": "phi3", "CohereForCausalLM": "cohere",
                   "Cohere2ForCausalLM": "cohere2"}

# Each layer's norms by spec.norm_placement: (attention input, attention output, MLP input, MLP output), the
# checkpoint's names; None: no norm there. An output norm is applied to the branch's output before its residual add.
LAYER_NORMS: dict[str, tuple[str | None, str | None, str | None, str | None]] = {
    "pre": ("input_layernorm", None, "post_attention_layernorm", None),
    "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),  # OLMo 2
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",  # Gemma 2 / 3
                 "post_feedforward_layernorm"),
    "parallel": ("input_layernorm", None, None, None),  # Cohere: x + attn(n(x)) + mlp(n(x)), the one norm
}


@dataclass(frozen=True)
class MoeSpec:
    """A top-k mixture-of-experts MLP (GPT-OSS): a router linear (+ bias) picks top_k of num_experts per token and
    softmaxes their logits; each expert is gate_up (+ bias, gate and up interleaved by column) -> the clamped
    SwiGLU (up + 1) * gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit -> down (+ bias)."""

    num_experts: int
    top_k: int
    swiglu_alpha: float
    swiglu_limit: float


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float  # every norm's eps (Cohere's LayerNorms: layer_norm_eps)
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # normalized rope parameters (rope_type, factor, ...); None for plain RoPE
    max_position_embeddings: int
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    tie_word_embeddings: bool
    sliding_window: tuple[int | None, ...]  # per layer: attention window, None for full attention
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    name: str
    # How the families differ from Llama's layer (rms -> qkv -> RoPE -> attend -> o_proj -> rms -> SwiGLU), as data:
    qk_norm: str = "none"  # a norm (norm_kind) on q and k before RoPE: "none"; "head" (Qwen3: over each head's D,
    #                        weight [D]); "each_head" (Cohere: over each head's D, a weight per head, [H, D] and
    #                        [Hkv, D]); "proj" (OLMo 2: over the whole projection, weights [H*D] and [Hkv*D])
    norm_kind: str = "rms"  # "rms": RMSNorm; "layer" (Cohere): LayerNorm, mean subtracted, weight and no bias,
    #                         computed in fp32 and then rounded
    norm_placement: str = "pre"  # "pre": each branch's input is normed (input_layernorm, post_attention_layernorm);
    #                              "post" (OLMo 2): each branch's output is, before its residual add
    #                              (post_attention_layernorm, post_feedforward_layernorm), and no input_layernorm;
    #                              "sandwich" (Gemma): both, four norms a layer (LAYER_NORMS);
    #                              "parallel" (Cohere): one input norm, both branches read it: x + attn + mlp
    rms_scale_fp32: bool = False  # half types: weight x normalized in fp32, then rounded (OLMo 2, Gemma); else
    #                               rounded first
    norm_offset: float = 0.0  # every RMSNorm scales by (offset + weight), in fp32 (Gemma: 1; checkpoints store w - 1)
    mlp_act: str = "silu"  # the gate's activation: "silu" (SwiGLU) | "gelu_tanh" (Gemma's GeGLU, tanh-approximated)
    embed_scale: float = 1.0  # embeddings x it, the factor rounded to the weights dtype first (Gemma: sqrt(hidden))
    attn_softcap: float | None = None  # attention scores -> tanh(s / c) * c before the softmax (Gemma 2)
    final_softcap: float | None = None  # logits -> tanh(l / c) * c (Gemma 2)
    local_rope: tuple[float, dict[str, Any] | None] | None = None  # (theta, scaling) of the sliding-window layers'
    #                      RoPE (Gemma 3: rope_local_base_freq); None: every layer uses rope_theta and rope_scaling
    embedding_multiplier: float = 1.0  # embeddings x it (Granite)
    residual_multiplier: float = 1.0  # each branch's output x it before its residual add (Granite)
    attention_multiplier: float | None = None  # the softmax scale (Granite; Gemma: query_pre_attn_scalar ** -0.5);
    #                                            None: head_dim ** -0.5
    logits_scaling: float = 1.0  # logits / it (Granite)
    nope_layers: frozenset[int] = frozenset()  # layers whose q and k are not rotated (SmolLM3's NoPE layers)
    o_proj_bias: bool = False  # o_proj carries a bias (GPT-OSS)
    attn_sinks: bool = False  # a learned logit per head (self_attn.sinks [H]) joins each softmax's denominator and
    #                           is dropped from its output (GPT-OSS)
    moe: MoeSpec | None = None  # the MLP is a top-k mixture of experts (GPT-OSS); None: one dense gated MLP
    rotary_dim: int | None = None  # the leading dims of each head that RoPE rotates, the rest pass through
    #                                (Phi-4-mini: partial_rotary_factor 0.75); None: all head_dim
    rope_interleaved: bool = False  # RoPE rotates the pairs (2i, 2i + 1), in fp32 (Cohere); else (i, i + dims/2)
    logit_scale: float = 1.0  # logits x it (Cohere)
    fused_checkpoint: bool = False  # the checkpoint stores qkv_proj and gate_up_proj (Phi-3): check_weights
    #                                 checks those and names their row ranges q/k/v_proj and gate/up_proj


def unsupported(architecture: str, path: str) -> ModelLoadError:
    served = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    return ModelLoadError(f"unsupported architecture '{architecture}' in {path}; KV Scope serves: {served}")


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"cannot read {path}: not a JSON object")
    return data


def model_eos_ids(directory: str, config: dict[str, Any]) -> tuple[int, ...]:
    # generation_config.json may list extra stop ids (e.g. <|eot_id|>) that config.json lacks.
    ids: list[int] = []
    sources = [config]
    generation_path = os.path.join(directory, "generation_config.json")
    if os.path.isfile(generation_path):
        sources.append(read_json(generation_path))
    for data in sources:
        eos = data.get("eos_token_id")
        ids.extend([eos] if isinstance(eos, int) else [i for i in eos or [] if isinstance(i, int)])
    return tuple(dict.fromkeys(ids))


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 writes `rope_parameters` (with rope_theta inside); v4 configs have top-level
    # `rope_theta` plus `rope_scaling` (sometimes with the old key "type"). Same merge rules as v5.
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.pop("type", None) or params.get("rope_type") or "default"
    if rope_type == "default":
        return theta, None
    params.update(rope_type=rope_type, rope_theta=theta)
    if rope_type in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    return theta, params


def _layer_ropes(config: dict[str, Any], model_type: str
                 ) -> tuple[tuple[float, dict[str, Any] | None], tuple[float, dict[str, Any] | None] | None]:
    """(theta, scaling) of the full-attention layers (every layer's but Gemma 3's), and of Gemma 3's sliding ones.

    Gemma 3 in transformers 5 writes rope_parameters keyed by layer type ({"full_attention": {...},
    "sliding_attention": {...}}); v4 configs have rope_theta and rope_scaling (the full layers') and
    rope_local_base_freq (the sliding layers', plain RoPE)."""
    if model_type == "gpt_oss" and not (config.get("rope_scaling") or config.get("rope_parameters")):
        config = {**config, "rope_parameters": _DEFAULTS["gpt_oss"]["rope_parameters"]}  # GptOssConfig's YaRN
    if model_type != "gemma3_text":
        if model_type in _DEFAULTS and "rope_theta" in _DEFAULTS[model_type]:
            config = {"rope_theta": _DEFAULTS[model_type]["rope_theta"], **config}  # the family's default base
        return _rope(config), None
    params = config.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:
        full, local = dict(config.get("rope_scaling") or params), {}
    defaults = _DEFAULTS["gemma3_text"]
    full.setdefault("rope_theta", config.get("rope_theta", defaults["rope_theta"]))
    local.setdefault("rope_theta", config.get("rope_local_base_freq", defaults["rope_local_base_freq"]))
    rest = {k: v for k, v in config.items() if k not in ("rope_scaling", "rope_parameters", "rope_theta")}
    return _rope({**rest, "rope_parameters": full}), _rope({**rest, "rope_parameters": local})


def _phi3_rope(config: dict[str, Any], head_dim: int, rope_scaling: dict[str, Any] | None
               ) -> tuple[dict[str, Any] | None, int | None]:
    """Phi-3's RoPE as transformers resolves it: the scaling (LongRoPE: the old names "su" and "yarn" are it, its
    original_max_position_embeddings the config's top-level one, which Phi3Config always has, and the cos/sin
    scaling attention_factor, by default sqrt(1 + ln(factor) / ln(original)) with factor by default
    max_position_embeddings / original, 1 when factor <= 1), and the rotated dims (partial_rotary_factor, in the
    RoPE parameters or at the top level; None: all)."""
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    partial = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ModelLoadError(f"partial_rotary_factor {partial} leaves {rotary_dim} of {head_dim} head dims to rotate")
    if rope_scaling is not None:
        rope_scaling = dict(rope_scaling)
        if rope_scaling["rope_type"] in ("su", "yarn"):
            rope_scaling["rope_type"] = "longrope"
        if rope_scaling["rope_type"] != "longrope":
            raise ModelLoadError(f"Phi-3 RoPE type {rope_scaling['rope_type']!r}: transformers' Phi3Config allows "
                                 "default or longrope only")
        original = int(config.get("original_max_position_embeddings",
                                  _DEFAULTS["phi3"]["original_max_position_embeddings"]))
        factor = rope_scaling.get("factor") or (
            config.get("max_position_embeddings", _DEFAULTS["phi3"]["max_position_embeddings"]) / original)
        if rope_scaling.get("attention_factor") is None:
            rope_scaling["attention_factor"] = (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
        for key in ("short_factor", "long_factor"):
            if len(rope_scaling.get(key) or ()) != rotary_dim // 2:
                raise ModelLoadError(f"LongRoPE {key} lists {len(rope_scaling.get(key) or ())} factors; the "
                                     f"{rotary_dim} rotated dims need {rotary_dim // 2}")
        rope_scaling["original_max_position_embeddings"] = original
    return rope_scaling, (None if rotary_dim == head_dim else rotary_dim)


def _nope_layers(config: dict[str, Any], model_type: str, num_layers: int) -> frozenset[int]:
    """SmolLM3: config.no_rope_layers[i] is 1 where layer i USES RoPE; absent, every no_rope_layer_interval-th
    layer (i + 1 a multiple of it) skips RoPE. Other families rotate every layer."""
    if model_type != "smollm3":
        return frozenset()
    interval = int(config.get("no_rope_layer_interval") or _DEFAULTS["smollm3"]["no_rope_layer_interval"])
    uses_rope = config.get("no_rope_layers")
    if uses_rope is None:
        uses_rope = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(uses_rope) != num_layers:
        raise ModelLoadError(f"no_rope_layers lists {len(uses_rope)} layers but num_hidden_layers is {num_layers}")
    return frozenset(i for i, rope in enumerate(uses_rope) if not rope)


def _sliding_windows(config: dict[str, Any], model_type: str, num_layers: int,
                     nope: frozenset[int]) -> tuple[int | None, ...]:
    if model_type in ("llama", "olmo2", "granite", "cohere"):
        return (None,) * num_layers
    window = config.get("sliding_window", _DEFAULTS[model_type]["sliding_window"])
    if model_type in ("mistral", "phi3"):
        # MistralModel and Phi3Model apply config.sliding_window to every layer (and ignore layer_types).
        return (window,) * num_layers
    if model_type in (*_GEMMA, "cohere2", "gpt_oss"):
        # Always sliding layers: layer_types, or every layer but each sliding_window_pattern-th (Gemma 2: 2).
        pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern")
                      or _DEFAULTS[model_type]["sliding_window_pattern"])
        layer_types = config.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        if len(layer_types) != num_layers:
            raise ModelLoadError(f"layer_types lists {len(layer_types)} layers but num_hidden_layers is {num_layers}")
        if window is None and "sliding_attention" in layer_types:
            raise ModelLoadError(f"{model_type}: sliding_attention layers without a sliding_window")
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    # Qwen2 / Qwen3 / SmolLM3: the window only exists with use_sliding_window; layer_types picks the layers, and
    # without it max_window_layers does (layers from it on slide; Qwen), or RoPE does (the NoPE layers; SmolLM3).
    if not config.get("use_sliding_window", False):
        window = None
    if model_type == "smollm3":
        default_sliding = [i in nope for i in range(num_layers)]
    else:
        first_sliding = config.get("max_window_layers", 28)
        default_sliding = [i >= first_sliding for i in range(num_layers)]
    layer_types = config.get("layer_types") or [
        "sliding_attention" if window is not None and sliding else "full_attention" for sliding in default_sliding
    ]
    if len(layer_types) != num_layers:
        raise ModelLoadError(f"layer_types lists {len(layer_types)} layers but num_hidden_layers is {num_layers}")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def spec_from_config(
    config: dict[str, Any], architecture: str, tokenizer: Tokenizer, name: str, directory: str
) -> ModelSpec:
    model_type = config.get("model_type", "")
    if model_type not in _DEFAULTS:
        raise ModelLoadError(
            f"unsupported model_type '{model_type}' in {directory}; expected one of {sorted(_DEFAULTS)}"
        )
    own_type = _OWN_MODEL_TYPE.get(architecture)
    if (own_type is not None or model_type in _OWN_MODEL_TYPE.values()) and own_type != model_type:
        raise ModelLoadError(f"architecture '{architecture}' with model_type '{model_type}' in {directory}: "
                             "they name different families")
    gemma, phi3, cohere = model_type in _GEMMA, model_type == "phi3", model_type in _COHERE
    defaults = _DEFAULTS[model_type]
    if gemma:
        # transformers' Gemma layers read hidden_activation only (old configs also carry a hidden_act).
        act = config.get("hidden_activation") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ModelLoadError(f"hidden_activation '{act}' in {directory}; KV Scope's Gemma forward uses "
                                 "gelu_pytorch_tanh")
        if config.get("use_bidirectional_attention"):
            raise ModelLoadError(f"use_bidirectional_attention in {directory} is not supported (causal only)")
    elif config.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"hidden_act '{config['hidden_act']}' in {directory}; KV Scope's forward uses SiLU")
    if config.get("quantization_config"):
        method = (config["quantization_config"] or {}).get("quant_method", "?")
        raise ModelLoadError(f"quantized checkpoint ({method}) in {directory} is not supported; KV Scope reads "
                             "float weights (dequantize it first, e.g. from_pretrained then save_pretrained)")
    if config.get("mlp_bias"):
        raise ModelLoadError(f"mlp_bias in {directory} is not supported")
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        num_layers = int(config["num_hidden_layers"])
        vocab, intermediate = int(config["vocab_size"]), int(config["intermediate_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"config.json in {directory} lacks a valid {e}") from None
    head_dim = int(config.get("head_dim") or defaults.get("head_dim") or hidden // heads)
    (theta, rope_scaling), local_rope = _layer_ropes(config, model_type)
    rotary_dim = None
    if phi3:
        rope_scaling, rotary_dim = _phi3_rope(config, head_dim, rope_scaling)
    bos = config.get("bos_token_id")
    nope = _nope_layers(config, model_type, num_layers)
    sliding = _sliding_windows(config, model_type, num_layers, nope)
    if model_type == "cohere2":  # RoPE on the sliding layers only: the full-attention ones are NoPE
        nope = frozenset(i for i, window in enumerate(sliding) if window is None)
    granite = model_type == "granite"
    gpt_oss = model_type == "gpt_oss"
    attention_bias = model_type == "qwen2" or bool(_get(config, defaults, "attention_bias"))
    return ModelSpec(
        architecture=architecture,
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(config.get("layer_norm_eps" if cohere else "rms_norm_eps",
                                      defaults.get("rms_norm_eps", 1e-6))),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(
            config.get("max_position_embeddings", defaults["max_position_embeddings"])
        ),
        # Qwen2 always has q/k/v bias and no attention_bias key; Llama's key would also bias o_proj,
        # which check_weights then rejects as an unexpected tensor.
        attention_bias=attention_bias,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", defaults.get("tie_word_embeddings", False))),
        sliding_window=sliding,
        bos_token_id=bos if isinstance(bos, int) else tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        name=name,
        qk_norm=("each_head" if cohere and config.get("use_qk_norm") else
                 {"qwen3": "head", "olmo2": "proj", "gemma3_text": "head"}.get(model_type, "none")),
        norm_kind="layer" if cohere else "rms",
        norm_placement="post" if model_type == "olmo2" else "parallel" if cohere else "sandwich" if gemma else "pre",
        rms_scale_fp32=model_type == "olmo2" or gemma or gpt_oss,
        embedding_multiplier=float(config.get("embedding_multiplier", 1.0)) if granite else 1.0,
        residual_multiplier=float(config.get("residual_multiplier", 1.0)) if granite else 1.0,
        attention_multiplier=float(config.get("attention_multiplier", 1.0)) if granite else (
            float(_get(config, defaults, "query_pre_attn_scalar")) ** -0.5 if gemma else None),
        logits_scaling=float(config.get("logits_scaling", 1.0)) if granite else 1.0,
        nope_layers=nope,
        norm_offset=1.0 if gemma else 0.0,
        mlp_act="gelu_tanh" if gemma else "silu",
        embed_scale=hidden**0.5 if gemma else 1.0,
        attn_softcap=_softcap(_get(config, defaults, "attn_logit_softcapping")) if gemma else None,
        final_softcap=_softcap(_get(config, defaults, "final_logit_softcapping")) if gemma else None,
        local_rope=local_rope,
        o_proj_bias=gpt_oss and attention_bias,
        attn_sinks=gpt_oss,
        moe=_moe(config, defaults) if gpt_oss else None,
        rotary_dim=rotary_dim,
        rope_interleaved=cohere,
        logit_scale=float(_get(config, defaults, "logit_scale") or 1.0) if cohere else 1.0,
        fused_checkpoint=phi3,
    )


def _moe(config: dict[str, Any], defaults: dict[str, Any]) -> MoeSpec:
    experts, top_k = int(_get(config, defaults, "num_local_experts")), int(_get(config, defaults, "num_experts_per_tok"))
    if not 0 < top_k <= experts:
        raise ModelLoadError(f"num_experts_per_tok {top_k} with {experts} experts")
    return MoeSpec(num_experts=experts, top_k=top_k, swiglu_alpha=float(_get(config, defaults, "swiglu_alpha")),
                   swiglu_limit=float(_get(config, defaults, "swiglu_limit")))


def _get(config: dict[str, Any], defaults: dict[str, Any], key: str) -> Any:
    """config[key], the family's default where the key is absent (an explicit null stays None)."""
    return config[key] if key in config else defaults.get(key)


def _softcap(value: Any) -> float | None:
    return None if value is None else float(value)


# A fused checkpoint's tensors (Phi-3) and the ones whose rows they hold, in order.
_FUSED_NAMES = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                              "self_attn.v_proj.weight"),
                "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    h, i = spec.hidden_size, spec.intermediate_size
    q, kv_width = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    norms = [n for n in LAYER_NORMS[spec.norm_placement] if n is not None]
    qk_norm_shapes = {"none": {}, "head": {"q_norm": (spec.head_dim,), "k_norm": (spec.head_dim,)},
                      "each_head": {"q_norm": (spec.num_heads, spec.head_dim),
                                    "k_norm": (spec.num_kv_heads, spec.head_dim)},
                      "proj": {"q_norm": (q,), "k_norm": (kv_width,)}}[spec.qk_norm]
    for n in range(spec.num_layers):
        p = f"model.layers.{n}."
        shapes |= {p + norm + ".weight": (h,) for norm in norms}
        shapes |= {p + "self_attn." + norm + ".weight": shape for norm, shape in qk_norm_shapes.items()}
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv_width, h),
            p + "self_attn.v_proj.weight": (kv_width, h),
            p + "self_attn.o_proj.weight": (h, q),
        }
        if spec.moe is None:
            shapes |= {p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)}
        else:  # transformers' GptOssMLP: experts stored [E, in, out] (x @ w), gate and up interleaved by column
            e = spec.moe.num_experts
            shapes |= {p + "mlp.router.weight": (e, h), p + "mlp.router.bias": (e,),
                       p + "mlp.experts.gate_up_proj": (e, h, 2 * i), p + "mlp.experts.gate_up_proj_bias": (e, 2 * i),
                       p + "mlp.experts.down_proj": (e, i, h), p + "mlp.experts.down_proj_bias": (e, h)}
        if spec.fused_checkpoint:  # Phi-3: one tensor each, q/k/v and gate/up by rows
            for fused, parts in _FUSED_NAMES.items():
                shapes[p + fused] = (sum(shapes.pop(p + part)[0] for part in parts), h)
        if spec.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv_width,),
                p + "self_attn.v_proj.bias": (kv_width,),
            }
        if spec.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if spec.attn_sinks:
            shapes[p + "self_attn.sinks"] = (spec.num_heads,)
    return shapes


def check_weights(spec: ModelSpec, weights: dict[str, torch.Tensor], directory: str) -> None:
    """Make the state dict match the spec exactly, so the forward pass can index it blindly."""
    for key in [k for k in weights if k.endswith("rotary_emb.inv_freq")]:
        del weights[key]  # old checkpoints saved this recomputable buffer
    if spec.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # tied models use the embedding, as transformers does
    expected = expected_shapes(spec)
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    wrong = [
        f"{k} {tuple(weights[k].shape)}!={v}"
        for k, v in expected.items()
        if k in weights and tuple(weights[k].shape) != v
    ]
    problems = (("missing tensors", missing), ("unexpected tensors", unexpected), ("wrong shapes", wrong))
    for label, items in problems:
        if items:
            more = f" (+{len(items) - 3} more)" if len(items) > 3 else ""
            raise ModelLoadError(f"{label} in {directory} for {spec.architecture}: {', '.join(items[:3])}{more}")
    if spec.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    if spec.fused_checkpoint:  # the parts as row views of the fused tensor: LlamaFamily uses them without a copy
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        rows = {"self_attn.qkv_proj.weight": [q, kv, kv], "mlp.gate_up_proj.weight": [spec.intermediate_size] * 2}
        for n in range(spec.num_layers):
            p = f"model.layers.{n}."
            for fused, parts in _FUSED_NAMES.items():
                weights |= {p + part: t for part, t in zip(parts, weights.pop(p + fused).split(rows[fused]))}
