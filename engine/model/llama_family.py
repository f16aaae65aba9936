"""A Llama-family forward pass (Llama, Mistral, Qwen2, Qwen3, OLMo 2, Granite, SmolLM3, Gemma 2, Gemma 3, GPT-OSS,
Phi-3, Cohere, Cohere 2) whose attention reads the paged KV cache. The families differ only by data on the ModelSpec
(engine/model/spec.py): q/k norms before RoPE (qk_norm), where the layer norms sit (norm_placement: pre, post,
Gemma's sandwich, Cohere's parallel block), the norm (norm_kind: RMSNorm, Cohere's LayerNorm), Gemma's (1 + w)
norms (norm_offset), GeGLU (mlp_act), scaled embeddings and soft-capping, Granite's multipliers and Cohere's logit
scale, the layers without RoPE (nope_layers: SmolLM3's, Cohere 2's full-attention ones), Gemma 3's own RoPE on the
sliding layers (local_rope), how RoPE rotates (rotary_dim: Phi-4-mini's partial rotation; rope_interleaved:
Cohere's pairs; LongRoPE's and YaRN's factors in rope_scaling), and GPT-OSS's o_proj bias (o_proj_bias), attention
sinks (attn_sinks: a logit per head that every attention backend joins to the softmax) and mixture-of-experts MLP
(moe: engine/model/moe.py); the layer below takes each as a small branch.

The model never holds K/V itself: each layer writes its new keys/values through the step's `KVStore` into the
device tier's blocks, then attends over each sequence's blocks in that same tier through an attention backend
(engine/attention/: `cpu` and `triton` read the blocks in place; `reference` is the original path, which
gathers every block of the table into a dense copy through the KVStore and runs SDPA under a mask, inline in
`_reference_attention`; that SDPA is engine/attention/reference.py's `dense_attention`, which ReferenceBackend
runs too). Blocks on the host tier are read from it (streamed), or with host_reads="compute" attended on the host
and merged with the device part by log-sum-exp (engine/attention/tier_split.py).
Shapes are written beside the code: T = tokens in the step, H = heads, Hkv = kv heads, D = head dim.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from engine.attention import AttentionBackend, PagedBatch, PagedKV, make_backend, visibility
from engine.attention.tier_split import TierSplit, attend_on_host, attend_split, split_by_tier
from engine.attention.reference import dense_attention
from engine.config import ConfigError, EngineOptions
from engine.model.loader import ModelSpec, resolve_weights_dtype, weights_quant
from engine.model import kernel_choice, quant_ir
from engine.model.quant import PREFILL_ROWS, QuantWeight, can_quantize, describe, quantize, stack_rows
from engine.model.quant_layer import FusedLayer, rms_rows
from engine.model.moe import MoeMLP
from engine.model.spec import LAYER_NORMS


def resolve_attention(name: str, device: "torch.device | str", dtype: torch.dtype = torch.float32,
                      soft_capped: bool = False) -> str:
    """The backend `name` runs as (ConfigError when it cannot run here); an explicit name is kept.

    auto: triton on CUDA when triton imports, else the in-place torch path (`cpu`, which runs on any device).
    On the CPU with bf16/fp16 weights auto keeps `reference`: half weights on a CPU are the mode that matches
    transformers in that dtype bit for bit (SDPA in the half type over exactly the valid keys), and the in-place
    path attends in fp32 instead (closer to fp32, but greedy tokens drift from transformers' half-precision ones).
    soft_capped (the model soft-caps its attention scores, spec.attn_softcap: Gemma 2): only the reference path
    computes that, so auto picks it and any other name is refused. Attention sinks (GPT-OSS) need nothing here:
    every backend takes them (decode / prefill's `sinks`, and tier_split.add_sinks after a host split).
    """
    if name not in EngineOptions.ATTENTION:
        raise ConfigError(f"attention: {name!r} is not one of {', '.join(EngineOptions.ATTENTION)}")
    if soft_capped:
        if name not in ("auto", "reference"):
            raise ConfigError(f"attention: {name!r} cannot run this model: attention soft-capping (Gemma 2) runs "
                              "on the reference backend only")
        return "reference"
    if name == "triton" and torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("attention: 'triton' needs a CUDA device (or TRITON_INTERPRET=1, the interpreter)")
    if name != "auto":
        return name
    if torch.device(device).type == "cuda":
        try:
            import triton  # noqa: F401
        except Exception:  # not installed, or broken for this build: the torch path still reads in place
            return "cpu"
        return "triton"
    return "cpu" if dtype == torch.float32 else "reference"


@dataclass
class AttnGroup:
    """Sequences attended together: one decode group (q_len 1 each) or one prefill sequence."""

    rows: torch.Tensor  # [B*Q] indices into the step's T tokens, row-major by sequence
    q_len: int
    table: torch.Tensor  # [B, NB] device slots of each sequence's blocks (padded with the null block)
    kpos: torch.Tensor  # [B, NB*bs] position of each gathered key; masked where kvalid is False
    kvalid: torch.Tensor  # [B, NB*bs] bool
    qpos: torch.Tensor  # [B, Q] positions of the queries
    ctx: torch.Tensor | None = None  # [B] keys of each row (its first ctx[b] table entries' tokens); None: kvalid.sum(1)
    key_pos: torch.Tensor | None = None  # kpos when some row is repositioned; None: key i sits at position i
    on_host: torch.Tensor | None = None  # [B, NB] bool: blocks read from the host tier (PagedBatch.on_host)
    host_table: torch.Tensor | None = None  # [B, NB] their host-tier slots (a CPU tensor)
    host_compute: bool = False  # host_reads="compute": attention over the host blocks runs on the host (split)
    staged_table: torch.Tensor | None = None  # [B, NB] each host block's row in the step's staging (streamed)

    def __post_init__(self):
        # Shapes and the None rules, held (no tensor value is read: no device sync).
        B = self.table.shape[0]
        assert self.rows.shape[0] == B * self.q_len, "rows is not [B*Q]"
        assert self.qpos.shape == (B, self.q_len), f"qpos {tuple(self.qpos.shape)} is not [B, Q]"
        assert self.kvalid.shape == self.kpos.shape and self.kpos.shape[0] == B, "kpos / kvalid are not [B, S]"
        assert self.ctx is None or self.ctx.shape == (B,), "ctx is not [B]"
        assert (self.on_host is None) == (self.host_table is None), "on_host and host_table come together"
        assert self.staged_table is None or self.on_host is not None, "staged_table needs on_host"

    def paged(self) -> PagedBatch:
        """The group as an attention backend reads it."""
        ctx = self.ctx if self.ctx is not None else self.kvalid.sum(1)
        return PagedBatch(block_table=self.table, context_lens=ctx, q_pos=self.qpos, key_pos=self.key_pos,
                          on_host=self.on_host, host_table=self.host_table, staged_table=self.staged_table)

    def split(self, block_size: int) -> TierSplit | None:
        """The group's device and host parts when its host blocks are attended on the host, else None (streamed)."""
        return split_by_tier(self.paged(), block_size) if self.host_compute and self.on_host is not None else None


@dataclass
class KVPart:
    """One KV-cache group's share of a step (engine/kv/groups.py): the model layers whose K/V its store holds (its
    layer i is model layer layers[i]), and its attention groups over its own block tables."""

    layers: tuple[int, ...]
    groups: list[AttnGroup]
    store: "KVStore"


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    groups: list[AttnGroup]
    logit_rows: torch.Tensor  # [R] rows of T whose next-token logits are wanted
    parts: list[KVPart] | None = None  # several KV-cache groups: each layer reads its group's part; None: one store


class KVStore(Protocol):
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new K/V [T, Hkv, D] for the step's tokens."""

    def gather(self, layer: int, group: "AttnGroup") -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K/V of the group's blocks, from the tier each is in: [B, NB, Hkv, bs, D] each."""

    def paged(self) -> PagedKV:
        """The tier's K/V parts as they lie, for the in-place backends."""


def rope_inv_freq(spec: ModelSpec, local: bool = False, longest: int | None = None) -> tuple[torch.Tensor, float]:
    """inv_freq [R/2] (R = spec.rotary_dim or head_dim) and the attention scaling for the model's RoPE variant
    (local: Gemma 3's sliding layers').

    LongRoPE (Phi-3) divides by short_factor for sequences up to original_max_position_embeddings and by long_factor
    past it. transformers picks by the length of the sequence in each forward, and generate recomputes the whole
    cache with the long factors when a sequence first passes that length. A paged cache is not recomputed, so the
    choice here is by `longest`, the longest sequence the engine holds (its context_limit; None:
    max_position_embeddings), as llama.cpp picks by its context size: with context_limit <= original every
    sequence equals transformers; past it, a sequence that is longer than original when it starts does too, and
    one that grows past it gets the long factors from its first token on (transformers only from that length)."""
    d = spec.rotary_dim or spec.head_dim
    base, scaling = spec.local_rope if local and spec.local_rope is not None else (spec.rope_theta, spec.rope_scaling)
    powers = base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)  # [R/2]
    inv = 1.0 / powers
    params = dict(scaling or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return inv, 1.0
    if kind == "longrope":
        longest = spec.max_position_embeddings if longest is None else longest
        factors = params["long_factor" if longest > params["original_max_position_embeddings"] else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * powers), params["attention_factor"]
    if kind == "linear":
        return inv / float(params["factor"]), 1.0
    if kind == "llama3":
        import math

        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_ctx = float(params["original_max_position_embeddings"])
        low_wl, high_wl = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(base, d, params, spec.max_position_embeddings)
    raise ValueError(f"RoPE type {kind!r} is not supported")


def _yarn_inv_freq(base: float, d: int, params: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' _compute_yarn_parameters, step for step): inv_freq blends the interpolated (/ factor)
    and the original frequencies by a linear ramp over the dims between the beta_fast and beta_slow rotation
    counts at original_max_position_embeddings; the attention scaling (cos and sin x it, so q.k x its square) is
    attention_factor, else 0.1 ln(factor) + 1 (DeepSeek's mscale / mscale_all_dim ratio when both are given)."""
    import math

    old_ctx = float(params["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = max_positions / old_ctx if factor is None else float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times over old_ctx
        return (d * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # as transformers: no singular ramp
    pos_freqs = base ** (torch.arange(0, d, 2).float() / d)
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: the original frequency (fast dims), 0: interpolated (slow dims)
    inv = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    return inv, float(attention)


SMALL_BATCH = 256  # rows up to which W @ x.T beats F.linear on CPU
FUSE_FP32 = os.environ.get("KVSCOPE_FUSE_FP32", "1") != "0"  # fp32 CPU models may take quant_layer's fused layers
F32_KERNEL_ROWS = 8  # rows up to which quant_ir's fp32 kernel may beat MKL (it reads the weight once for them)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ w[out, in].T, picking the fastest CPU kernel for the row count.

    Up to F32_KERNEL_ROWS rows (decode steps), quant_ir's fp32 kernel or MKL's gemm, whichever measured faster on
    this CPU for this weight's shape (engine/model/kernel_choice.py). Past that, MKL's gemm with the weight as the
    left operand (kernel_choice.mkl).
    """
    if isinstance(w, QuantWeight):  # --weights-dtype int8 / int4: the packed kernel (engine/model/quant.py)
        return w.matmul(x)
    T = x.shape[0]
    if x.device.type != "cpu" or T > SMALL_BATCH or x.dtype != torch.float32:
        # bf16/fp16: F.linear is transformers' kernel, and w @ x.T rounds differently there (greedy drifts).
        return F.linear(x, w)
    if T <= F32_KERNEL_ROWS and w.dtype == torch.float32 and not (w.requires_grad or x.requires_grad) \
            and kernel_choice.use_ir(w, T):
        out = quant_ir.matmul_f32(x.contiguous().numpy(), w.numpy())
        if out is not None:
            return torch.from_numpy(out)
    return kernel_choice.mkl(x, w)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """rotate_half for interleaved RoPE (Cohere): each pair (x[2i], x[2i+1]) -> (-x[2i+1], x[2i])."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


class LlamaFamily:
    """The forward pass, in the weights dtype (`dtype`: fp32, bf16, fp16 or auto = bf16 on CUDA, fp32 on CPU).

    Weights are used where they lie when the loaded dict already has this dtype and device (the loader fuses
    q/k/v and gate/up as consecutive rows of one buffer): no copy. Otherwise each is cast/moved once; fused
    copies replace the dict's entries when they hold the same values (same dtype and device), so the unfused
    originals are freed and every weight exists once.
    """

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: "str | torch.dtype" = "auto", attention: str = "auto", context_limit: int | None = None,
                 quant_activations: str = "int8"):
        self.spec = spec
        self.quant_activations = quant_activations  # the packed weights' CPU kernels' inputs (quant.ACTIVATIONS)
        self.device = device
        self.dtype = resolve_weights_dtype(dtype, device)
        # int8 / int4 (engine/model/quant.py): the linear weights and the embedding packed, all else fp32.
        self.quant = weights_quant(dtype)
        self.use_attention(attention)  # after self.dtype: auto depends on it
        self._dev = torch.empty(0, device=device).device  # concrete (cuda -> cuda:0), to compare with tensors'
        w = weights
        own = self._own
        norm = self._norm_weight
        packed = self._packed
        self.embed = packed(w, "model.embed_tokens.weight")
        self.lm_head = self.embed if spec.tie_word_embeddings else packed(w, "lm_head.weight")
        self.norm = norm(w["model.norm.weight"])
        # Gemma: embeddings x sqrt(hidden), the factor rounded to the weights dtype first (as transformers does).
        self.embed_scale = (torch.tensor(spec.embed_scale, dtype=self.dtype, device=self._dev)
                            if spec.embed_scale != 1.0 else None)
        names = LAYER_NORMS[spec.norm_placement]
        self.layers = []
        # per layer: the norms (attention input, attention output, MLP input, MLP output), None where none sits
        self.norms: list[tuple[torch.Tensor | None, ...]] = []
        self.qk_norms: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # per layer: q_norm, k_norm weights
        self.o_bias: list[torch.Tensor | None] = []  # per layer: o_proj's bias (spec.o_proj_bias), else None
        self.sinks: list[torch.Tensor | None] = []  # per layer: attention sinks [H] (spec.attn_sinks), else None
        self.moe: list[MoeMLP | None] = []  # per layer: the mixture-of-experts MLP (spec.moe), else None
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            # q, k and v in one matmul; gate and up in one: fewer, larger kernels per layer.
            qkv = self._fused(w, [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"])
            qkv_b = self._fused(w, [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]) if spec.attention_bias else None
            self.qk_norms.append((norm(w[a + "q_norm.weight"]), norm(w[a + "k_norm.weight"]))
                                 if spec.qk_norm != "none" else None)
            gate_up = (self._fused(w, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]) if spec.moe is None
                       else None)
            norms = tuple(None if n is None else norm(w[p + n + ".weight"]) for n in names)
            self.norms.append(norms)
            attn_in, attn_out, mlp_in, mlp_out = norms
            # (attention's norm, qkv, qkv bias, o_proj, MLP's norm, gate_up, down_proj): each branch's input norm,
            # else its output norm (OLMo 2); Gemma's output norms are in self.norms only. A mixture-of-experts
            # MLP (spec.moe) has no gate_up / down_proj here (None): its experts are in self.moe.
            self.layers.append(
                (attn_in if attn_in is not None else attn_out, qkv, qkv_b, packed(w, a + "o_proj.weight"),
                 mlp_in if mlp_in is not None else mlp_out, gate_up,
                 None if gate_up is None else packed(w, p + "mlp.down_proj.weight"))
            )
            self.o_bias.append(own(w[a + "o_proj.bias"]) if spec.o_proj_bias else None)
            self.sinks.append(own(w[a + "sinks"]) if spec.attn_sinks else None)
            self.moe.append(self._moe(w, p + "mlp.") if spec.moe is not None else None)
        # RoPE variants, (inv_freq [R/2], attention scaling): 0 the model's, 1 Gemma 3's for its sliding layers. Per
        # layer the index of its own, None for a NoPE layer. Each variant's cos/sin are computed once a step.
        # context_limit: the longest sequence the engine holds, which picks LongRoPE's factors (rope_inv_freq).
        local = spec.local_rope is not None
        variants = [rope_inv_freq(spec, longest=context_limit)] + ([rope_inv_freq(spec, local=True)] if local else [])
        self.ropes = [(inv.to(device), scaling) for inv, scaling in variants]
        self.layer_rope: list[int | None] = [
            None if i in spec.nope_layers else int(local and spec.sliding_window[i] is not None)
            for i in range(spec.num_layers)]
        self.scale = spec.head_dim**-0.5 if spec.attention_multiplier is None else spec.attention_multiplier
        # What the weights are held as: "fp32", or the packed kinds and where their values came from (quant.describe).
        names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
        self.weights_format = describe(w) or names[self.dtype]
        # Packed weights, or fp32 ones, on the CPU: a layer of the plain Llama shape runs its compute around attention
        # as two compiled calls (engine/model/quant_layer.py) in steps of fewer than quant.PREFILL_ROWS rows.
        packed_layers = any(isinstance(layer[1], QuantWeight) for layer in self.layers)
        fusable = packed_layers or (self.dtype == torch.float32 and self._dev.type == "cpu" and FUSE_FP32
                                    and self._f32_kernel_wins())
        self.fused = [FusedLayer.of(self, li) if fusable else None for li in range(spec.num_layers)]
        self.fused_enabled = True  # the tests compare both ways
        # Decode steps run each fused layer whole, its KV write and attention included (_decode_plan); the tests
        # compare both ways.
        self.whole_layers = True
        # Fixed at load: every layer fused and no attention sinks (else no step runs whole; _decode_plan not asked).
        self._can_run_whole = all(f is not None for f in self.fused) and all(x is None for x in self.sinks)
        # Steps of fused rows take the final norm as the fused layers take theirs (quant_layer.rms_rows): torch's
        # rms_norm on one row costs 11 us of dispatch, 150 between the compiled layers' thread-pool regions.
        self._fused_final_norm = (self._can_run_whole and spec.norm_kind != "layer" and self.norm.dim() == 1
                                  and self.norm.dtype == torch.float32)

    def _f32_kernel_wins(self) -> bool:
        """Whether quant_ir's f32 kernel beats MKL at one row on the first layer's four matmuls here (measured once
        per CPU: engine/model/kernel_choice.py); fp32 layers are fused only where it does."""
        _, qkv, _, o, _, gate_up, down = self.layers[0]
        ws = [qkv, o, gate_up, down]
        if quant_ir.library() is None or not all(isinstance(w, torch.Tensor) and w.dtype == torch.float32 for w in ws):
            return False
        return kernel_choice.fuse_layer(ws)

    def _moe(self, w: dict[str, torch.Tensor], p: str) -> MoeMLP:
        own, m = self._own, self.spec.moe
        return MoeMLP(router=own(w[p + "router.weight"]), router_bias=own(w[p + "router.bias"]),
                      gate_up=own(w[p + "experts.gate_up_proj"]), gate_up_bias=own(w[p + "experts.gate_up_proj_bias"]),
                      down=own(w[p + "experts.down_proj"]), down_bias=own(w[p + "experts.down_proj_bias"]),
                      top_k=m.top_k, alpha=m.swiglu_alpha, limit=m.swiglu_limit)

    def use_attention(self, name: str) -> None:
        """Pick the attention backend (EngineOptions.attention); `reference` is the inline gather + SDPA path."""
        self.attention = resolve_attention(name, self.device, self.dtype, self.spec.attn_softcap is not None)
        self.backend: AttentionBackend | None = None if self.attention == "reference" else make_backend(self.attention)
        # host_reads="compute": (device part, host part) backends, each with partial() -> (out, lse). The host part
        # is the CPU path (triton's too: the kernel is for the GPU); reference computes both by its formula.
        if self.backend is None:
            self.split_sides = (make_backend("reference"),) * 2
        else:
            self.split_sides = (self.backend, make_backend("cpu") if self.attention == "triton" else self.backend)

    def _packed(self, w: dict, name: str) -> "torch.Tensor | QuantWeight":
        """A linear weight (or the embedding) as the forward reads it: packed when the weights dtype is int8/int4
        (quantized here, and the dict's float entry replaced, when the loader gave a float tensor), else own()."""
        t = w[name]
        if not isinstance(t, QuantWeight):
            if self.quant is None or not can_quantize(t, self.quant):
                return self._own(t)
            t = quantize(t, self.quant)
        w[name] = t = t.to(self._dev)  # the dict names what the model holds: the float original can go
        if self._dev.type == "cuda" and "embed_tokens" not in name:
            try:  # torch's CUDA kernels take fewer layouts than the CPU's: refuse now, not at the first step
                t.prepare_cuda()
            except NotImplementedError as e:
                raise ConfigError(f"weights_dtype: {name}: {e}") from None
        return t.with_activations(self.quant_activations)  # a view of the same tensors where the mode differs

    def _fits(self, t: torch.Tensor) -> bool:
        return t.dtype == self.dtype and t.device == self._dev and t.is_contiguous()

    def _own(self, t: torch.Tensor) -> torch.Tensor:
        """t itself when it already has the model's dtype and device, else one converted copy."""
        return t if self._fits(t) else t.to(device=self._dev, dtype=self.dtype).contiguous()

    def _norm_weight(self, t: torch.Tensor) -> torch.Tensor:
        """A norm's scale: the weight (own), or with spec.norm_offset (Gemma) offset + weight in fp32, the
        dtype transformers' Gemma norms scale in (rms_scale_fp32)."""
        if self.spec.norm_offset == 0.0:
            return self._own(t)
        return t.to(device=self._dev, dtype=torch.float32) + self.spec.norm_offset

    def _fused(self, w: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
        """The tensors `names` stacked by rows: a view when they are consecutive rows of one buffer already."""
        parts = [w[n] for n in names]
        if names[0].endswith(".weight") and (self.quant is not None or isinstance(parts[0], QuantWeight)):
            return self._fused_packed(w, names)
        first = parts[0]
        rows = sum(t.shape[0] for t in parts)
        if all(self._fits(t) and t.shape[1:] == first.shape[1:] for t in parts) and all(
            t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and t.storage_offset() == prev.storage_offset() + prev.numel()
            for prev, t in zip(parts, parts[1:])
        ):
            return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())
        fused = torch.empty((rows, *first.shape[1:]), dtype=self.dtype, device=self._dev)
        row = 0
        for t in parts:
            fused[row: row + t.shape[0]].copy_(t)
            row += t.shape[0]
        if all(t.dtype == self.dtype and t.device == self._dev for t in parts):
            # Same values: the caller's dict now names rows of the fused buffer, and the originals can go.
            row = 0
            for n, t in zip(names, parts):
                w[n] = fused[row: row + t.shape[0]]
                row += t.shape[0]
        return fused

    def _fused_packed(self, w: dict, names: list[str]) -> QuantWeight:
        """_fused for int8/int4: the parts packed (quantized here where the loader gave floats), stacked by rows;
        the dict's entries become row views of the stacked weight, so the parts are freed."""
        parts = [self._packed(w, n) for n in names]
        if not all(isinstance(p, QuantWeight) for p in parts):
            parts = [p if isinstance(p, QuantWeight) else quantize(p, "int8").to(self._dev) for p in parts]
        fused = stack_rows(parts).with_activations(self.quant_activations)
        row = 0
        for n, p in zip(names, parts):
            w[n] = fused.row_view(row, row + p.shape[0])
            row += p.shape[0]
        return fused

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[T, hidden] the embeddings of token ids [T] (packed weights: those rows dequantized)."""
        return self.embed.lookup(ids) if isinstance(self.embed, QuantWeight) else self.embed[ids]

    # -- pieces -------------------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The model's norm (spec.norm_kind) of x [..., n] with weight w (broadcast over x's last dims)."""
        return self._layer_norm(x, w) if self.spec.norm_kind == "layer" else self._rms(x, w)

    def _layer_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Cohere's LayerNorm (no bias), as transformers' CohereLayerNorm: in fp32, then rounded to x's dtype."""
        h = x.float()
        h = h - h.mean(-1, keepdim=True)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps)
        return (w.float() * h).to(x.dtype)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused kernel; same result bit for bit as w * x * rsqrt(mean(x^2) + eps) in fp32. (A weight per
            # head, [H, D], scales after it.)
            if w.dim() > 1:
                return F.rms_norm(x, (x.shape[-1],), None, self.spec.rms_norm_eps) * w
            return F.rms_norm(x, (x.shape[-1],), w, self.spec.rms_norm_eps)
        # As transformers' LlamaRMSNorm for half types: normalize in fp32, round to the dtype, then scale in it
        # (OLMo 2's: scale in fp32, then round).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps)
        return (w * h).to(x.dtype) if self.spec.rms_scale_fp32 else w * h.to(x.dtype)

    def _qk_norm(self, qk: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor) -> torch.Tensor:
        """q and k [T, (H + Hkv) D] normed (spec.qk_norm): per head over D ("head": weights [D]; "each_head":
        weights [H, D] and [Hkv, D]), or over each whole projection, H*D and Hkv*D ("proj")."""
        s = self.spec
        T, q_width = qk.shape[0], s.num_heads * s.head_dim
        q, k = qk[:, :q_width], qk[:, q_width:]
        if s.qk_norm in ("head", "each_head"):
            q, k = q.view(T, s.num_heads, s.head_dim), k.view(T, s.num_kv_heads, s.head_dim)
        return torch.cat((self._norm(q, q_w).reshape(T, -1), self._norm(k, k_w).reshape(T, -1)), dim=1)

    def _angles(self, positions: torch.Tensor, rope: int) -> torch.Tensor:
        """[T, R] each rotated dim's angle: pairs (i, i + R/2) share one, or (2i, 2i + 1) (spec.rope_interleaved)."""
        freqs = positions.float()[:, None] * self.ropes[rope][0][None, :]  # [T, R/2]
        return freqs.repeat_interleave(2, dim=-1) if self.spec.rope_interleaved else torch.cat((freqs, freqs), dim=-1)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32,
                rope: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE variant `rope`'s (self.ropes) cos/sin [T, R], times its attention scaling (LongRoPE): computed in
        fp32, then rounded to `dtype` (as transformers' rotary embedding does)."""
        emb, scaling = self._angles(positions, rope), self.ropes[rope][1]
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated by per-token cos/sin [T, R]: the first R dims (R < D: Phi-4-mini's partial
        rotation; the rest pass through), interleaved pairs rotated in fp32 and rounded back (Cohere)."""
        R = cos.shape[-1]
        if R < x.shape[-1]:
            return torch.cat((self.rotate(x[..., :R], cos, sin), x[..., R:]), dim=-1)
        if self.spec.rope_interleaved:
            h = x.float()
            return (h * cos[:, None, :] + rotate_pairs(h) * sin[:, None, :]).to(x.dtype)
        return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]

    def shift_keys(self, k: torch.Tensor, delta: torch.Tensor, layer: int) -> torch.Tensor:
        """K-shift: re-rotate layer `layer`'s cached keys k [N, Hkv, D] by position deltas [N] (RoPE composes
        additively), with the layer's own RoPE (Gemma 3: its sliding layers' base), its rotated dims and pairing;
        a pure rotation, without the RoPE's attention scaling (YaRN's, LongRoPE's): cached keys carry that factor once
        already, and a rotation keeps it (LongRoPE's factors are fixed per engine: rope_inv_freq). A NoPE layer's keys
        carry no position: k itself."""
        rope = self.layer_rope[layer]
        if rope is None:
            return k
        emb = self._angles(delta, rope)
        return self.rotate(k, emb.cos(), emb.sin())

    # -- forward ------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, store: KVStore) -> torch.Tensor:
        s = self.spec
        H, Hkv, D = s.num_heads, s.num_kv_heads, s.head_dim
        x = self.embed_rows(batch.input_ids)  # [T, hidden], in the weights dtype from here on
        if s.embedding_multiplier != 1.0:
            x = x * s.embedding_multiplier
        if self.embed_scale is not None:
            x = x * self.embed_scale
        T = x.shape[0]
        rot = [self.cos_sin(batch.positions, x.dtype, r) for r in range(len(self.ropes))]  # (cos, sin) per variant
        act = F.silu if s.mlp_act == "silu" else partial(F.gelu, approximate="tanh")
        # Each layer's store, attention and index there: one store for all layers, or its KV-cache group's part.
        parts = batch.parts or [KVPart(tuple(range(s.num_layers)), batch.groups, store)]
        attends = []
        for part in parts:
            b = batch if part.groups is batch.groups else dataclasses.replace(batch, groups=part.groups)
            attends.append(self._reference_attention(b, part.store, x, part.layers) if self.backend is None
                           else self._paged_attention(b, part.store, x, part.layers))
        where = [(0, 0)] * s.num_layers
        for pi, part in enumerate(parts):
            for local, li in enumerate(part.layers):
                where[li] = (pi, local)
        parallel = s.norm_placement == "parallel"
        whole_layer = (self._decode_plan(batch, parts, T) if T < PREFILL_ROWS and self.fused_enabled and self.whole_layers
                       and self._can_run_whole else None)
        if whole_layer is not None:  # each layer, its KV write and attention in one compiled call
            x = self._decode_whole(x, rot, whole_layer)
        for li, (_, qkv_w, qkv_b, o_w, _, gu_w, down_w) in enumerate(self.layers if whole_layer is None else ()):
            attn_in, attn_out, mlp_in, mlp_out = self.norms[li]
            fused = self.fused[li] if T < PREFILL_ROWS and self.fused_enabled else None
            if fused is not None:  # the same steps as below, in two compiled calls (quant_layer.py)
                qkv = fused.pre(x, *(rot[self.layer_rope[li]] if self.layer_rope[li] is not None else (None, None)))
                qk = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)
                q, k = qk[:, :H], qk[:, H:]
                v = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
                pi, local = where[li]
                parts[pi].store.write(local, k, v)
                x = fused.post(x, attends[pi](local, q, s.sliding_window[li]).reshape(T, H * D))
                continue
            h = x if attn_in is None else self._norm(x, attn_in)
            qkv = linear(h, qkv_w)  # [T, (H + 2 Hkv) D]
            if qkv_b is not None:
                qkv = qkv + qkv_b
            qk = qkv[:, : (H + Hkv) * D]
            if self.qk_norms[li] is not None:
                qk = self._qk_norm(qk, *self.qk_norms[li])
            qk = qk.view(T, H + Hkv, D)
            if self.layer_rope[li] is not None:
                qk = self.rotate(qk, *rot[self.layer_rope[li]])  # q and k in one pass
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
            pi, local = where[li]
            parts[pi].store.write(local, k, v)
            attn = attends[pi](local, q, s.sliding_window[li])  # [T, H, D] in the weights dtype
            o = linear(attn.reshape(T, H * D), o_w)
            if self.o_bias[li] is not None:
                o = o + self.o_bias[li]
            if parallel:  # Cohere: the MLP reads the attention's normed input, and both outputs add to x
                gate, up = linear(h, gu_w).chunk(2, dim=-1)
                x = x + o + linear(act(gate) * up, down_w)
                continue
            x = self._residual(x, o, attn_out)
            h = x if mlp_in is None else self._norm(x, mlp_in)
            if self.moe[li] is not None:
                x = self._residual(x, self.moe[li](h), mlp_out)
                continue
            gate, up = linear(h, gu_w).chunk(2, dim=-1)
            x = self._residual(x, linear(act(gate) * up, down_w), mlp_out)
        if T < PREFILL_ROWS and self.fused_enabled and self._fused_final_norm:
            x = torch.from_numpy(rms_rows(x.numpy(), batch.logit_rows.numpy(), self.norm.numpy(), s.rms_norm_eps))
        else:
            x = self._norm(x[batch.logit_rows], self.norm)
        logits = linear(x, self.lm_head)
        if s.logit_scale != 1.0:
            logits = logits * s.logit_scale
        if s.logits_scaling != 1.0:
            logits = logits / s.logits_scaling
        if s.final_softcap is not None:
            logits = torch.tanh(logits / s.final_softcap) * s.final_softcap
        return logits.float()  # [R, vocab]

    def _decode_whole(self, x: torch.Tensor, rot: list, kv) -> torch.Tensor:
        """x after every layer, each one call of FusedLayer.decode_into (quant_layer.decode_layer), the residual
        stream kept in two numpy buffers between them and each RoPE variant's cos/sin converted once a step."""
        a = x.float().contiguous().numpy().copy()
        b = np.empty_like(a)
        trig = [(c.contiguous().numpy(), si.contiguous().numpy()) for c, si in rot]
        windows = self.spec.sliding_window
        for li, fused in enumerate(self.fused):
            r = self.layer_rope[li]
            cos, sin = trig[r] if r is not None else (None, None)
            fused.decode_into(a, cos, sin, kv(li), self.scale, windows[li], b)
            a, b = b, a
        return torch.from_numpy(a)

    def _decode_plan(self, batch: ForwardBatch, parts: list, T: int):
        """For a decode step the fused layers can run whole (FusedLayer.decode_into: layer, KV write and attention in
        one compiled call): kv(li) -> layer li's tuple of what that call reads and writes. None (the layer-by-layer path)
        unless every layer is fused, there are no attention sinks, one KV part and one group of T one-token rows,
        no host-tier split, the store's writes are plain device-tier ones on the CPU (StepKV.plain_writes), its
        fidelity probe can be fed directly (StepProbe.direct) and the backend reads plain blocks in place
        (NumbaPagedBackend.decode_plan)."""
        if len(parts) != 1 or not hasattr(self.backend, "decode_plan") or not self._can_run_whole:
            return None
        store = parts[0].store
        groups = parts[0].groups
        if not hasattr(store, "plain_writes") or len(groups) != 1:
            return None
        g = groups[0]
        if g.q_len != 1 or g.rows.shape[0] != T or g.table.shape[0] != T:
            return None
        paged = store.paged()
        if g.split(paged.block_size) is not None:
            return None
        writes = store.plain_writes()
        if writes is None:
            return None
        got = self.backend.decode_plan(paged, g.paged(), T, self.spec.num_heads)
        if got is None:
            return None
        if store.probe is not None:
            direct = store.probe.direct(T)
            if direct is None:
                return None
        else:  # nothing measured: scratch the kernel writes into
            direct = (np.zeros((self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim), np.float32),
                      np.empty((2, 0), np.float32), False)
        (slots, offs), ((qpos, table, alt, ctx, dlut, S, fns), layer) = writes, got
        absmax, err, lossy = direct
        ids = store.layer_ids

        def kv(li: int) -> tuple:
            return (slots, offs, qpos, table, alt, ctx, dlut, S, fns, *layer(li),
                    absmax[li if ids is None else ids[li]], err, lossy)

        return kv

    def _residual(self, x: torch.Tensor, out: torch.Tensor, post_norm: torch.Tensor | None) -> torch.Tensor:
        """x plus a branch's output, normed first where a norm sits on the branch's output (OLMo 2, Gemma) and
        scaled by spec.residual_multiplier (Granite)."""
        if post_norm is not None:
            out = self._norm(out, post_norm)
        if self.spec.residual_multiplier != 1.0:
            out = out * self.spec.residual_multiplier
        return x + out

    def _reference_attention(self, batch: ForwardBatch, store: KVStore, x: torch.Tensor,
                             layers: tuple[int, ...] | None = None):
        """attend(layer, q [T, H, D], window) -> [T, H, D]: every block of each table gathered into a dense fp32
        copy (store.gather), then engine.attention.reference.dense_attention, the SDPA-under-a-mask that
        ReferenceBackend runs too, here in the weights dtype over the keys up to each group's span (and the one
        path that soft-caps attention scores, spec.attn_softcap)."""
        s = self.spec
        H, D = s.num_heads, s.head_dim
        T = x.shape[0]
        # Half types: attend over the gathered keys up to the last valid one, not the padded blocks' tail.
        # The masked tail changes how bf16 SDPA rounds (fp32 is exact either way), so without the cut greedy
        # tokens drift from transformers', whose cache holds exactly the valid keys. dense_attention attends
        # the first mask.shape[-1] keys, so cutting the mask cuts the keys.
        spans = [None if x.dtype == torch.float32 else self._span(g) for g in batch.groups]
        masks = {None: [self._mask(g, None)[..., :n] for g, n in zip(batch.groups, spans)]}  # [B, 1, Q, n] each
        # host_reads="compute": groups with host blocks attended by the formula on each tier, merged. Not with
        # attention soft-capping (Gemma 2), which the partial formula lacks: its host blocks are gathered (streamed).
        softcap = s.attn_softcap
        paged = store.paged() if softcap is None and any(
            g.host_compute and g.on_host is not None for g in batch.groups) else None
        splits = [g.split(paged.block_size) if paged is not None else None for g in batch.groups]

        def attend(li: int, q: torch.Tensor, window: int | None) -> torch.Tensor:
            sinks = self.sinks[li if layers is None else layers[li]]  # li: the store's layer; sinks by model layer
            if window not in masks:
                masks[window] = [self._mask(g, window)[..., :n] for g, n in zip(batch.groups, spans)]
            attn = torch.empty((T, H, D), dtype=x.dtype, device=x.device)  # [T, H, D]
            for g, mask, split in zip(batch.groups, masks[window], splits):
                B = g.table.shape[0]
                qg = q[g.rows].view(B, g.q_len, H, D)  # [B, Q, H, D]
                if split is not None:
                    o = attend_split(*self.split_sides, qg, li, paged, split, scale=self.scale, window=window,
                                     sinks=sinks)
                    attn[g.rows] = o.reshape(B * g.q_len, H, D)
                    continue
                kb, vb = store.gather(li, g)  # [B, NB, Hkv, bs, D], fp32 (a layer kept in host memory: streamed here)
                kb, vb = kb.to(q.device), vb.to(q.device)
                # Attention in the weights dtype, as transformers computes it (a no-op cast for fp32).
                o = dense_attention(qg, kb, vb, mask, scale=self.scale, dtype=q.dtype, softcap=softcap,
                                    sinks=sinks)  # [B, Q, H, D]
                attn[g.rows] = o.reshape(B * g.q_len, H, D)
            return attn

        return attend

    def _paged_attention(self, batch: ForwardBatch, store: KVStore, x: torch.Tensor,
                         layers: tuple[int, ...] | None = None):
        """attend(layer, q [T, H, D], window) -> [T, H, D] through `self.backend`, reading the device tier's
        blocks where they lie: decode(...) for the decode group, prefill(...) for each prompt chunk.

        The backend computes in fp32 (online softmax over chunks or tiles) and returns q's dtype; it reads
        exactly the keys each row's context length and positions make visible, so no mask or span is built.
        """
        backend, scale = self.backend, self.scale
        T = x.shape[0]
        paged = store.paged()
        groups = [(g, g.paged(), g.split(paged.block_size)) for g in batch.groups]
        # One group holding every row in order (all decodes, or one prompt chunk): no gather/scatter of rows.
        whole = len(groups) == 1 and groups[0][0].rows.shape[0] == T
        sides = self.split_sides

        def run(li: int, q: torch.Tensor, g: AttnGroup, pb: PagedBatch, split: TierSplit | None,
                window: int | None) -> torch.Tensor:
            sinks = self.sinks[li if layers is None else layers[li]]  # li: the store's layer; sinks by model layer
            if paged.k["data"][li].device != q.device:  # device_layers: this layer's K/V are in host memory
                return attend_on_host(sides[1], q, li, paged, pb, g.q_len, scale=scale, window=window, sinks=sinks)
            if split is not None:  # host_reads="compute": device part here, host part on the host, merged
                qg = q.view(g.table.shape[0], g.q_len, *q.shape[1:])
                return attend_split(*sides, qg, li, paged, split, scale=scale, window=window,
                                    sinks=sinks).view(q.shape)
            if g.q_len == 1:
                return backend.decode(q, li, paged, pb, scale=scale, window=window, sinks=sinks)  # [B, H, D]
            B, Q, (_, H, D) = g.table.shape[0], g.q_len, q.shape
            return backend.prefill(q.view(B, Q, H, D), li, paged, pb, scale=scale, window=window,
                                   sinks=sinks).view(B * Q, H, D)

        def attend(li: int, q: torch.Tensor, window: int | None) -> torch.Tensor:
            if whole:
                return run(li, q, *groups[0], window)
            attn = torch.empty(q.shape, dtype=x.dtype, device=x.device)
            for g, pb, split in groups:
                attn[g.rows] = run(li, q[g.rows], g, pb, split, window)
            return attn

        return attend

    @staticmethod
    def _span(g: AttnGroup) -> int:
        """Gathered keys up to and including the group's last valid one (on CUDA: one host sync per group)."""
        valid = g.kvalid.any(dim=0)
        return int(torch.where(valid, torch.arange(valid.shape[0], device=valid.device), 0).max()) + 1

    @staticmethod
    def _mask(g: AttnGroup, window: int | None) -> torch.Tensor:
        """[B, 1, Q, S] bool: key visible to query, by the one visibility rule every backend uses
        (engine/attention/reading.py: within the row's context length, causal by position, inside the window
        if any). The group's kvalid is that context length as a mask (the runner sets kvalid[b, :ctx[b]]); the
        positions are the group's own kpos even where the backends are told "key i at position i"."""
        return visibility(dataclasses.replace(g.paged(), key_pos=g.kpos), g.q_len, g.kvalid.shape[1], window)[:, None]
