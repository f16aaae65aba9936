"""A Llama-family forward pass (Llama, Mistral, Qwen2) whose attention reads the paged KV cache.

The model never holds K/V itself: each layer writes its new keys/values through `KVWriter` into the
device tier's blocks, then gathers every block of each sequence's context from that same tier.
Shapes are written beside the code: T = tokens in the step, H = heads, Hkv = kv heads, D = head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.loader import ModelSpec


@dataclass
class AttnGroup:
    """Sequences attended together: one decode group (q_len 1 each) or one prefill sequence."""

    rows: torch.Tensor  # [B*Q] indices into the step's T tokens, row-major by sequence
    q_len: int
    table: torch.Tensor  # [B, NB] device slots of each sequence's blocks (padded with slot 0)
    kpos: torch.Tensor  # [B, NB*bs] position of each gathered key; masked where kvalid is False
    kvalid: torch.Tensor  # [B, NB*bs] bool
    qpos: torch.Tensor  # [B, Q] positions of the queries


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    groups: list[AttnGroup]
    logit_rows: torch.Tensor  # [R] rows of T whose next-token logits are wanted


class KVStore(Protocol):
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new K/V [T, Hkv, D] for the step's tokens."""

    def gather(self, layer: int, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K/V of the blocks in table [B, NB]: [B, NB, Hkv, bs, D] each."""


def rope_inv_freq(spec: ModelSpec) -> tuple[torch.Tensor, float]:
    """inv_freq [D/2] and the attention scaling for the model's RoPE variant."""
    d = spec.head_dim
    base = spec.rope_theta
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    params = dict(spec.rope_scaling or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return inv, 1.0
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
    raise ValueError(f"RoPE type {kind!r} is not supported")


SMALL_BATCH = 256  # rows up to which W @ x.T beats F.linear on CPU


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ w[out, in].T, picking the fastest CPU kernel for the row count.

    Decode steps have a handful of rows. For those, MKL's gemm with the weight as the left operand
    (w @ x.T) streams the weight up to 3x faster than F.linear's x @ w.T, and a single row is fastest
    padded to two (the one-column case takes a slow gemv path). Measured in `kvscope bench`.
    """
    T = x.shape[0]
    if x.device.type != "cpu" or T > SMALL_BATCH:
        return F.linear(x, w)
    if T == 1:
        return torch.mm(w, torch.cat((x, x)).t())[:, :1].t()
    return torch.mm(w, x.t()).t().contiguous()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaFamily:
    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], device: torch.device):
        self.spec = spec
        self.device = device
        w = {k: v.to(device=device, dtype=torch.float32) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = self.embed if spec.tie_word_embeddings else w["lm_head.weight"]
        self.norm = w["model.norm.weight"]
        self.layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            # q, k and v in one matmul; gate and up in one: fewer, larger kernels per layer.
            qkv = torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]).contiguous()
            qkv_b = (
                torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]])
                if spec.attention_bias
                else None
            )
            gate_up = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]).contiguous()
            self.layers.append(
                (w[p + "input_layernorm.weight"], qkv, qkv_b, w[a + "o_proj.weight"],
                 w[p + "post_attention_layernorm.weight"], gate_up, w[p + "mlp.down_proj.weight"])
            )
        inv, self.attn_scaling = rope_inv_freq(spec)
        self.inv_freq = inv.to(device)
        self.scale = spec.head_dim**-0.5

    # -- pieces -------------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # One fused kernel; same result bit for bit as w * x * rsqrt(mean(x^2) + eps) in fp32.
        return F.rms_norm(x, (x.shape[-1],), w, self.spec.rms_norm_eps)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attn_scaling, emb.sin() * self.attn_scaling

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated by per-token cos/sin [T, D]."""
        return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]

    def shift_keys(self, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """K-shift: re-rotate cached keys k [N, Hkv, D] by position deltas [N] (RoPE composes additively)."""
        freqs = delta.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return self.rotate(k, emb.cos(), emb.sin())

    # -- forward ------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVStore) -> torch.Tensor:
        s = self.spec
        H, Hkv, D = s.num_heads, s.num_kv_heads, s.head_dim
        x = self.embed[batch.input_ids]  # [T, hidden]
        T = x.shape[0]
        cos, sin = self.cos_sin(batch.positions)
        masks = [self._mask(g, None) for g in batch.groups]
        window_masks: dict[int, list[torch.Tensor]] = {}
        for li, (ln1, qkv_w, qkv_b, o_w, ln2, gu_w, down_w) in enumerate(self.layers):
            h = self._rms(x, ln1)
            qkv = linear(h, qkv_w)  # [T, (H + 2 Hkv) D]
            if qkv_b is not None:
                qkv = qkv + qkv_b
            qk = self.rotate(qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D), cos, sin)  # q and k in one pass
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
            kv.write(li, k, v)
            window = s.sliding_window[li]
            if window is None:
                layer_masks = masks
            else:
                if window not in window_masks:
                    window_masks[window] = [self._mask(g, window) for g in batch.groups]
                layer_masks = window_masks[window]
            attn = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
            for g, mask in zip(batch.groups, layer_masks):
                B, NB = g.table.shape
                kb, vb = kv.gather(li, g.table)  # [B, NB, Hkv, bs, D]
                S = NB * kb.shape[3]
                kb = kb.permute(0, 2, 1, 3, 4).reshape(B, Hkv, S, D)
                vb = vb.permute(0, 2, 1, 3, 4).reshape(B, Hkv, S, D)
                qg = q[g.rows].view(B, g.q_len, H, D).transpose(1, 2)  # [B, H, Q, D]
                if x.is_cuda and H != Hkv:
                    # On CUDA, grouped-query SDPA with a mask runs on the slow "math" path (a dozen kernels);
                    # with K/V heads expanded it takes the memory-efficient kernel, mask and fp32 included.
                    kb, vb = kb.repeat_interleave(H // Hkv, dim=1), vb.repeat_interleave(H // Hkv, dim=1)
                o = F.scaled_dot_product_attention(qg, kb, vb, attn_mask=mask, scale=self.scale,
                                                   enable_gqa=H != kb.shape[1])
                attn[g.rows] = o.transpose(1, 2).reshape(B * g.q_len, H, D)
            x = x + linear(attn.view(T, H * D), o_w)
            h = self._rms(x, ln2)
            gate, up = linear(h, gu_w).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, down_w)
        x = self._rms(x[batch.logit_rows], self.norm)
        return linear(x, self.lm_head)  # [R, vocab]

    @staticmethod
    def _mask(g: AttnGroup, window: int | None) -> torch.Tensor:
        """[B, 1, Q, S] bool: key visible to query (causal by position, inside the window if any)."""
        kpos = g.kpos[:, None, :]  # [B, 1, S]
        qpos = g.qpos[:, :, None]  # [B, Q, 1]
        m = g.kvalid[:, None, :] & (kpos <= qpos)
        if window is not None:
            m = m & (kpos > qpos - window)
        return m[:, None]
