"""The reference backend: today's model path, kept as the ground truth the fast backends are checked against.

Every block of the table is decoded into a dense fp32 copy (codec.decode), permuted head-major, and attended
with SDPA under a bool mask. Two full copies of the context per layer and step: simple, not fast.

`dense_attention` is that SDPA-under-a-visibility-mask step, written once: `ReferenceBackend.prefill` (and so
decode) calls it on the decoded table in fp32, and the model's inline `reference` path
(engine/model/llama_family.py, `LlamaFamily._reference_attention`, also the shadow's dense forward pass) calls it
on its KVStore's gathered blocks in the weights dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.interface import DecodeAsPrefill, PagedBatch, PagedKV
from engine.attention.reading import read_blocks, visibility
from engine.kv.codecs import codecs_for


def head_major(blocks: torch.Tensor) -> torch.Tensor:
    """blocks [B, NB, Hkv, bs, D] -> [B, Hkv, NB*bs, D]: each kv head's keys in table order (one copy)."""
    B, NB, Hkv, bs, D = blocks.shape
    return blocks.permute(0, 2, 1, 3, 4).reshape(B, Hkv, NB * bs, D)


def dense_attention(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, mask: torch.Tensor, *, scale: float,
                    dtype: torch.dtype = torch.float32, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA of q over dense K/V blocks under a bool visibility mask, computed in `dtype`.

    q [B, Q, H, D]; kb, vb [B, NB, Hkv, bs, D] (any float dtype: a decoded table, or a KVStore's gather), on q's
    device; mask [B, 1, Q, n] bool, True where a key is visible (reading.visibility), n <= NB*bs: only the first
    n keys of the table are attended (the model's half-type span cut; n = NB*bs attends them all). Returns
    [B, Q, H, D] in `dtype`: q, K and V are cast to it, and SDPA runs in it (fp32 for ReferenceBackend, the
    weights dtype for the model's inline path).

    softcap (Gemma 2's attn_logit_softcapping): scores -> tanh(scores / softcap) * softcap before the mask and
    the softmax, as transformers' eager attention computes it (matmul in `dtype`, softmax in fp32, rounded back).
    sinks [H] (GPT-OSS's attention sinks): each head's logit is one more column of the scores, the softmax runs
    over scores and sink (max subtracted, in `dtype`, as transformers' eager GPT-OSS attention) and the sink's
    column is dropped: the rows' weights sum to less than 1.
    """
    H = q.shape[2]
    n = mask.shape[-1]
    k = head_major(kb)[:, :, :n].to(dtype)  # [B, Hkv, n, D]
    v = head_major(vb)[:, :, :n].to(dtype)  # [B, Hkv, n, D]
    Hkv = k.shape[1]
    qh = q.to(dtype).transpose(1, 2)  # [B, H, Q, D]
    if q.is_cuda and H != Hkv:
        # On CUDA, grouped-query SDPA with a mask runs on the slow "math" path (a dozen kernels);
        # with K/V heads expanded it takes the memory-efficient kernel, mask and fp32 included.
        k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)  # [B, H, n, D]
    if softcap is not None or sinks is not None:  # the eager formula, as transformers writes it
        if k.shape[1] != H:  # (not yet expanded above)
            k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)  # [B, H, n, D]
        s = torch.matmul(qh, k.transpose(-1, -2)) * scale  # [B, H, Q, n]
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~mask, torch.finfo(s.dtype).min)  # no visible key (a padding row): finite, as transformers'
        if sinks is None:
            p = torch.softmax(s, dim=-1, dtype=torch.float32).to(dtype)
        else:
            s = torch.cat((s, sinks.to(s)[None, :, None, None].expand(*s.shape[:-1], 1)), dim=-1)  # [B, H, Q, n + 1]
            p = torch.softmax(s - s.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]  # the sink's weight dropped
        return torch.matmul(p, v).transpose(1, 2)  # [B, Q, H, D]
    o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=H != k.shape[1])
    return o.transpose(1, 2)  # [B, Q, H, D]


def decoded_table(paged: PagedKV, layer: int, batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block of the batch's table decoded to fp32 (codec.decode): K, V [B, NB, Hkv, bs, D] each."""
    kc, vc = codecs_for(paged.dtype)
    every = slice(None)
    kb = read_blocks(paged, "k", batch, every, lambda p, sl: kc.decode(p, layer, sl), False)  # [B, NB, Hkv, bs, D]
    vb = read_blocks(paged, "v", batch, every, lambda p, sl: vc.decode(p, layer, sl), False)  # [B, NB, Hkv, bs, D]
    return kb, vb


class ReferenceBackend(DecodeAsPrefill):
    name = "reference"

    def prefill(self, q: torch.Tensor, layer: int, paged: PagedKV, batch: PagedBatch, *, scale: float,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, Q, H, D] -> [B, Q, H, D] in q's dtype: dense_attention in fp32 over the decoded table."""
        kb, vb = decoded_table(paged, layer, batch)  # [B, NB, Hkv, bs, D] fp32
        S = kb.shape[1] * kb.shape[3]
        mask = visibility(batch, q.shape[1], S, window)[:, None]  # [B, 1, Q, S]
        sinks = None if sinks is None else sinks.float()
        return dense_attention(q, kb, vb, mask, scale=scale, sinks=sinks).to(q.dtype)  # [B, Q, H, D]

    def partial(self, q: torch.Tensor, layer: int, paged: PagedKV, batch: PagedBatch, *, scale: float,
                window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, Q, H, D] -> (out [B, Q, H, D], lse [B, Q, H]), fp32, by the textbook formula over the decoded table:
        lse = logsumexp(q.k * scale) over the visible keys, out = exp(scores - lse) @ v; no visible key: 0, -inf."""
        B, Q, H, D = q.shape
        kb, vb = decoded_table(paged, layer, batch)  # [B, NB, Hkv, bs, D] fp32
        S = kb.shape[1] * kb.shape[3]
        G = H // paged.kv_heads
        k = head_major(kb).repeat_interleave(G, dim=1)  # [B, H, S, D]
        v = head_major(vb).repeat_interleave(G, dim=1)  # [B, H, S, D]
        s = torch.matmul(q.float().transpose(1, 2) * scale, k.transpose(-1, -2))  # [B, H, Q, S]
        s = s.masked_fill(~visibility(batch, Q, S, window)[:, None], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [B, H, Q]
        o = torch.matmul(torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None]), v)  # [B, H, Q, D]
        return o.transpose(1, 2), lse.transpose(1, 2)
