"""The reference backend: today's model path, kept as the ground truth the fast backends are checked against.

Every block of the table is decoded into a dense fp32 copy (codec.decode), permuted head-major, and attended
with SDPA under a bool mask. Two full copies of the context per layer and step: simple, not fast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.interface import DecodeAsPrefill, PagedBatch, PagedKV
from engine.attention.reading import read_blocks, visibility
from engine.kv.codecs import codecs_for


class ReferenceBackend(DecodeAsPrefill):
    name = "reference"

    def prefill(self, q: torch.Tensor, layer: int, kv: PagedKV, batch: PagedBatch, *, scale: float,
                window: int | None = None) -> torch.Tensor:
        B, Q, H, D = q.shape
        Hkv = kv.kv_heads
        kc, vc = codecs_for(kv.dtype)
        every = slice(None)
        kb = read_blocks(kv, "k", batch, every, lambda p, sl: kc.decode(p, layer, sl), False)  # [B, NB, Hkv, bs, D] fp32
        vb = read_blocks(kv, "v", batch, every, lambda p, sl: vc.decode(p, layer, sl), False)
        S = kb.shape[1] * kb.shape[3]
        kb = kb.permute(0, 2, 1, 3, 4).reshape(B, Hkv, S, D)  # [B, Hkv, S, D]
        vb = vb.permute(0, 2, 1, 3, 4).reshape(B, Hkv, S, D)
        mask = visibility(batch, Q, S, window)[:, None]  # [B, 1, Q, S]
        qg = q.float().transpose(1, 2)  # [B, H, Q, D]
        o = F.scaled_dot_product_attention(qg, kb, vb, attn_mask=mask, scale=scale, enable_gqa=H != Hkv)
        return o.transpose(1, 2).to(q.dtype)  # [B, Q, H, D]

    def partial(self, q: torch.Tensor, layer: int, kv: PagedKV, batch: PagedBatch, *, scale: float,
                window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, Q, H, D] -> (out [B, Q, H, D], lse [B, Q, H]), fp32, by the textbook formula over the decoded table:
        lse = logsumexp(q.k * scale) over the visible keys, out = exp(scores - lse) @ v; no visible key: 0, -inf."""
        B, Q, H, D = q.shape
        Hkv = kv.kv_heads
        kc, vc = codecs_for(kv.dtype)
        every = slice(None)
        kb = read_blocks(kv, "k", batch, every, lambda p, sl: kc.decode(p, layer, sl), False)  # [B, NB, Hkv, bs, D]
        vb = read_blocks(kv, "v", batch, every, lambda p, sl: vc.decode(p, layer, sl), False)
        S = kb.shape[1] * kb.shape[3]
        kb = kb.permute(0, 2, 1, 3, 4).reshape(B, Hkv, S, D).repeat_interleave(H // Hkv, dim=1)  # [B, H, S, D]
        vb = vb.permute(0, 2, 1, 3, 4).reshape(B, Hkv, S, D).repeat_interleave(H // Hkv, dim=1)
        s = torch.matmul(q.float().transpose(1, 2) * scale, kb.transpose(-1, -2))  # [B, H, Q, S]
        s = s.masked_fill(~visibility(batch, Q, S, window)[:, None], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [B, H, Q]
        o = torch.matmul(torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None]), vb)  # [B, H, Q, D]
        return o.transpose(1, 2), lse.transpose(1, 2)
