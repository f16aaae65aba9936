"""Every cache knob in one frozen dataclass, with its valid range beside it.

The CLI, the window's sliders, presets and validation all read `KNOBS`; nothing else knows a range.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any


class KVDtype(enum.IntEnum):
    FP32 = 0
    FP16 = 1
    BF16 = 2
    INT8 = 3
    INT8_DELTA = 4  # int8 values, keys stored as closed-loop deltas between consecutive tokens
    FP8 = 5  # e4m3 with a scale per token and head
    INT8_KIVI = 6  # int8, keys with per-channel (x per-token) scales, values with per-token scales (KIVI's layout)

    @property
    def label(self) -> str:
        return _DTYPE_LABELS[self]

    @property
    def lossless(self) -> bool:
        return self is KVDtype.FP32

    @classmethod
    def parse(cls, value: "str | KVDtype") -> "KVDtype":
        if isinstance(value, KVDtype):
            return value
        for member, label in _DTYPE_LABELS.items():
            if label == str(value).lower():
                return member
        raise ConfigError(f"kv_dtype: unknown dtype {value!r}; choose one of {', '.join(_DTYPE_LABELS.values())}")


_DTYPE_LABELS = {
    KVDtype.FP32: "fp32",
    KVDtype.FP16: "fp16",
    KVDtype.BF16: "bf16",
    KVDtype.INT8: "int8",
    KVDtype.INT8_DELTA: "int8-delta",
    KVDtype.FP8: "fp8",
    KVDtype.INT8_KIVI: "int8-kivi",
}

# Formats that store each value on its own (no shared scale): re-laying them into other block sizes
# copies values exactly.
ELEMENTWISE = frozenset({KVDtype.FP32, KVDtype.FP16, KVDtype.BF16})


def change_is_lossy(old: "CacheConfig", new: "CacheConfig") -> bool:
    """Whether moving stored K/V from `old`'s layout to `new`'s can change a value attention reads.

    Same format and block size: blocks are copied byte for byte. To fp32: every format decodes exactly
    to fp32, and that decoded value is what attention read before. An element-wise format into other
    block sizes: values are copied one by one. Anything else re-encodes (re-quantizes, or rounds to a
    narrower float) and is lossy, even from one 8-bit format to another or int8 -> fp16.
    """
    if old.kv_dtype is new.kv_dtype and old.block_size == new.block_size:
        return False
    if new.kv_dtype is KVDtype.FP32:
        return False
    return not (old.kv_dtype is new.kv_dtype and new.kv_dtype in ELEMENTWISE)

POLICIES = ("lru", "heat", "s3fifo")
HOST_READS = ("promote", "stream", "compute")


class ConfigError(ValueError):
    """A knob value the engine refuses; the message names the knob and its valid range."""


@dataclass(frozen=True)
class Knob:
    name: str
    kind: type
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] = ()
    unit: str = ""
    help: str = ""


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_dtype: KVDtype = KVDtype.FP32
    device_budget_mb: float = 256.0
    host_budget_mb: float = 1024.0
    policy: str = "heat"
    decay: float = 0.9
    demote_after_s: float = 5.0
    prefetch_depth: int = 2
    evict_batch: int = 8
    host_reads: str = "promote"
    device_layers: int = 0  # the device tier keeps layers [0, N) of its blocks in device memory, the rest on the host; 0: all
    shadow_every_s: float = 2.0  # engine seconds between shadow reference steps (engine/fidelity/shadow.py); 0: off

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_dtype", KVDtype.parse(self.kv_dtype))

    def replace(self, **changes: Any) -> "CacheConfig":
        """A validated copy with `changes` applied (values may be strings, as from a CLI or a TOML file)."""
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - fields)
        if unknown:
            raise ConfigError(f"unknown knob(s): {', '.join(unknown)}; knobs are {', '.join(sorted(fields))}")
        coerced = {name: coerce(name, value) for name, value in changes.items()}
        new = dataclasses.replace(self, **coerced)
        new.validate()
        return new

    def validate(self) -> None:
        for knob in KNOBS.values():
            check(knob, getattr(self, knob.name))

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["kv_dtype"] = self.kv_dtype.label
        return d

    def summary(self) -> str:
        return (
            f"bs={self.block_size} {self.kv_dtype.label} dev={self.device_budget_mb:g}MiB "
            f"host={self.host_budget_mb:g}MiB {self.policy}(decay {self.decay:g}) "
            f"demote>{self.demote_after_s:g}s prefetch={self.prefetch_depth} batch={self.evict_batch} "
            f"host-reads={self.host_reads}" + (f" device-layers={self.device_layers}" if self.device_layers else "")
        )


KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob("block_size", int, 1, 1024, unit="tokens", help="tokens per block (all layers' K and V)"),
        Knob("kv_dtype", KVDtype, choices=tuple(_DTYPE_LABELS.values()), help="storage format of cached K/V"),
        Knob("device_budget_mb", float, 0.0, 1 << 20, unit="MiB",
             help="device-tier pool size in MiB (2^20 bytes; the knob keeps its _mb name): its blocks and two "
                  "reserved ones; 0: every block on the host tier"),
        Knob("host_budget_mb", float, 0.0, 1 << 22, unit="MiB", help="host-tier pool size in MiB (2^20 bytes)"),
        Knob("policy", str, choices=POLICIES, help="eviction order for cold cached blocks"),
        Knob("decay", float, 0.01, 1.0, unit="/s", help="heat decay per second: heat = heat*decay^dt + 1"),
        Knob("demote_after_s", float, 0.0, 3600.0, unit="s", help="idle time before a block moves device -> host"),
        Knob("prefetch_depth", int, 0, 64, unit="blocks", help="blocks promoted along with a device-tier miss"),
        Knob("evict_batch", int, 1, 4096, unit="blocks", help="cold blocks evicted at once"),
        Knob("host_reads", str, choices=HOST_READS,
             help="how attention reads a block on the host tier: promote (copied to the device tier first, as room "
                  "allows; blocks that cannot fit are streamed), stream (read where it is, one layer at a time: copied "
                  "as stored to staging on the compute device, the next layer's copy running while this layer "
                  "computes; only blocks being written are promoted), compute (attended where it is, on the host CPU, and "
                  "merged with the device tier's part by log-sum-exp: only queries and partial results cross; "
                  "only blocks being written are promoted)"),
        Knob("device_layers", int, 0, 4096, unit="layers",
             help="per-layer placement: a device-tier block keeps the K/V of the first N layers in device memory and "
                  "of the other layers in host memory (read from there one layer at a time, as streamed), so the "
                  "device budget holds layers/N times as many blocks; the host memory they take comes out of the "
                  "host budget. 0: every layer on the device"),
        Knob("shadow_every_s", float, 0.0, 3600.0, unit="s",
             help="engine seconds between shadow reference steps: one running sequence's decode step recomputed "
                  "with lossless (fp32) KV and compared with the engine's logits (KL divergence, top-1 flip, max "
                  "logit error); 0: off. The first comes that long after the engine's first step; one that cost c "
                  "seconds delays the next by at least 19c, so shadowing takes at most 5 percent of the engine's "
                  "time"),
    )
}


def coerce(name: str, value: Any) -> Any:
    knob = KNOBS.get(name)
    if knob is None:
        raise ConfigError(f"unknown knob {name!r}")
    if knob.kind is KVDtype:
        return KVDtype.parse(value)
    if knob.kind is str:
        return str(value)
    try:
        if knob.kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            if isinstance(value, bool):
                raise ValueError
            return int(str(value)) if isinstance(value, str) else int(value)
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: {value!r} is not a valid {knob.kind.__name__}") from None


def check(knob: Knob, value: Any) -> None:
    if knob.choices and knob.kind is str and value not in knob.choices:
        raise ConfigError(f"{knob.name}: {value!r} is not one of {', '.join(knob.choices)}")
    if knob.lo is not None and knob.hi is not None:
        if not isinstance(value, (int, float)) or value != value or not (knob.lo <= value <= knob.hi):
            raise ConfigError(f"{knob.name}: {value!r} is outside [{knob.lo:g}, {knob.hi:g}] {knob.unit}".rstrip())


@dataclass(frozen=True)
class EngineOptions:
    """Settings fixed for an engine's lifetime (not live knobs)."""

    device: str = "cpu"
    max_batch: int = 16  # running sequences per step
    max_batched_tokens: int = 1024  # prompt tokens computed per step (chunked prefill)
    context_limit: int | None = None  # tokens per sequence before a context shift; None: the model's
    n_keep: int = 0  # context shift keeps these first tokens (e.g. a system prompt)
    n_discard: int | None = None  # tokens dropped per shift; None: half of what is not kept
    keep_finished: int = 1024  # finished sequences kept for inspection before they are forgotten
    stall_steps: int = 256  # steps without progress after which the newest stuck sequence is aborted
    weights_dtype: str = "auto"  # fp32, bf16, fp16; auto: bf16 on CUDA, fp32 on CPU (engine.model.loader.resolve_weights_dtype); int8 / int4: packed linear weights, fp32 math (engine/model/quant.py)
    # Attention backend (engine/attention/): reference (dense gather + SDPA), cpu (chunked, reads blocks in place),
    # triton (paged-decode kernel, CUDA); auto: triton on CUDA when triton imports, else cpu (on the CPU with
    # bf16/fp16 weights: reference, transformers' half-precision arithmetic; engine.model.llama_family.resolve_attention).
    attention: str = "auto"
    # Decode steps replayed from CUDA graphs (engine/runtime/cuda_graphs.py): auto (on with CUDA and a paged backend),
    # on, off; "static" runs the graphs' static-shaped step eagerly (how the CPU tests check it).
    cuda_graphs: str = "auto"
    # KV-cache groups (engine/kv/groups.py): auto (one pool per attention type: full layers, each sliding window;
    # a sliding-window group frees blocks that leave every window), off (one pool for every layer, as a model
    # without sliding layers has: sliding windows are then only an attention mask).
    kv_groups: str = "auto"
    # int8 / int4 weights on the CPU (engine/model/quant_ir.py): "int8" rounds each matmul's input to int8 per 32
    # values and takes integer dot products (llama.cpp's Q8 activations: its speed, ~1e-2 of a row's largest
    # output); "fp32" multiplies the input as it is (the dequantized weights' exact math, slower).
    quant_activations: str = "int8"
    extra: dict = field(default_factory=dict)

    WEIGHTS_DTYPES = ("auto", "fp32", "bf16", "fp16", "int8", "int4")  # not a field (no annotation): the values weights_dtype takes
    ATTENTION = ("auto", "reference", "cpu", "chunked", "triton")  # not a field: the values attention takes
    CUDA_GRAPHS = ("auto", "on", "off", "static")  # not a field: the values cuda_graphs takes
    KV_GROUPS = ("auto", "off")  # not a field: the values kv_groups takes
    QUANT_ACTIVATIONS = ("int8", "fp32")  # not a field: the values quant_activations takes

    def validate(self, max_positions: int | None = None) -> None:
        """Raise ConfigError (naming the option and its range) for values no model, or this model (whose
        positions are `max_positions`), can run with."""
        def bad(name: str, value: Any, rule: str) -> ConfigError:
            return ConfigError(f"{name}: {value!r} {rule}")

        if self.device not in ("cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise bad("device", self.device, "is not cpu or cuda")
        if self.cuda_graphs not in self.CUDA_GRAPHS:
            raise bad("cuda_graphs", self.cuda_graphs, f"is not one of {', '.join(self.CUDA_GRAPHS)}")
        if self.weights_dtype not in self.WEIGHTS_DTYPES:
            raise bad("weights_dtype", self.weights_dtype, f"is not one of {', '.join(self.WEIGHTS_DTYPES)}")
        if self.attention not in self.ATTENTION:
            raise bad("attention", self.attention, f"is not one of {', '.join(self.ATTENTION)}")
        if self.kv_groups not in self.KV_GROUPS:
            raise bad("kv_groups", self.kv_groups, f"is not one of {', '.join(self.KV_GROUPS)}")
        if self.quant_activations not in self.QUANT_ACTIVATIONS:
            raise bad("quant_activations", self.quant_activations, f"is not one of {', '.join(self.QUANT_ACTIVATIONS)}")
        for name in ("max_batch", "max_batched_tokens", "keep_finished", "stall_steps"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise bad(name, v, "must be a positive integer")
        limit = self.context_limit
        if limit is not None and (not _is_int(limit) or limit < 2):
            raise bad("context_limit", limit, "must be an integer >= 2")
        if limit is not None and max_positions is not None and limit > max_positions:
            raise bad("context_limit", limit, f"must be an integer in [2, {max_positions}] (the model's positions)")
        if not _is_int(self.n_keep) or self.n_keep < 0:
            raise bad("n_keep", self.n_keep, "must be an integer >= 0")
        if self.n_discard is not None and (not _is_int(self.n_discard) or self.n_discard < 1):
            raise bad("n_discard", self.n_discard, "must be an integer >= 1")
        limit = limit or max_positions
        if limit is None:
            return
        if self.n_keep > limit - 2:
            raise bad("n_keep", self.n_keep, f"must be an integer in [0, {limit - 2}] (context limit {limit} - 2)")
        if self.n_discard is not None and self.n_discard >= limit:
            raise bad("n_discard", self.n_discard, f"must be an integer in [1, {limit - 1}]")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
