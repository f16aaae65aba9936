"""Paged attention in torch ops, for the CPU (it runs on any device).

The reference decodes the whole table into [B, NB, Hkv, bs, D] and then copies it again into [B, Hkv, S, D]
for SDPA. Here a chunk of blocks at a time is gathered straight into head-major order (one index_select of
(slot, head) rows writes [B, Hkv, c, bs, D], which views as [B, Hkv, c*bs, D] without a copy), dequantized in that
chunk, and folded into an online softmax (running max m, sum l, output acc). The chunk is sized to stay
in cache; the context is never materialized whole. Prefill on the CPU is the exception (see ChunkedPagedBackend).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.interface import DecodeAsPrefill, KVFormat, PagedBatch, PagedKV, kv_formats
from engine.attention.reading import query_positions, read_blocks, visibility
from engine.attention.tier_split import lse_of
from engine.kv.codecs import Parts

_NEG = -1.0e30  # running-max start: finite, so exp(-inf - m) is 0 and never NaN


def gather_head_major(parts: Parts, fmt: KVFormat, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """fp32 [B, Hkv, c, bs, D] of blocks slots [B, c]: the codec's decode, laid out head-major.

    Same arithmetic as engine/kv/codecs.py's decode, element for element (the tests compare them exactly).
    Each part is read as rows of (slot, head) with index_select, a row copy about 3x faster on the CPU than
    advanced indexing over two dims.
    """
    N, Hkv = parts["data"].shape[1:3]
    B, c = slots.shape
    rows = (slots[:, None, :] * Hkv + torch.arange(Hkv, device=slots.device)[None, :, None]).reshape(-1)

    def take(name: str) -> torch.Tensor:  # part [N, Hkv, *rest] -> [B, Hkv, c, *rest]
        x = parts[name][layer]
        return x.reshape(N * Hkv, -1).index_select(0, rows).view(B, Hkv, c, *x.shape[2:])

    x = take("data").float()  # [B, Hkv, c, bs, D]
    if fmt is KVFormat.PLAIN:
        return x
    scale = take("scale").float()
    if fmt is KVFormat.CHANNEL_SCALE:
        return x * scale[..., None, :] * take("tscale").float()[..., None]  # scale [B, Hkv, c, D], tscale [.., bs]
    if fmt is KVFormat.TOKEN_SCALE:
        return x * scale[..., None]  # scale [B, Hkv, c, bs] fp16
    steps = x * scale[..., None]  # DELTA
    steps[..., 0, :] = 0
    return take("anchor").float()[..., None, :] + torch.cumsum(steps, dim=-2)  # anchor [B, Hkv, c, 1, D]


class ChunkedPagedBackend(DecodeAsPrefill):
    """Online-softmax attention over chunks of blocks; `chunk_elems` bounds one chunk's K (and score) size.

    Prefill on the CPU (`dense_prefill`, Q > 1): the visible blocks are gathered head-major once and attended with
    SDPA (its CPU flash kernel) instead. With Q queries per key the one copy is amortized, and the kernel is
    ~3x faster than the chunk loop at 1024 queries x 2048 keys (34 vs 109 ms a layer): `kvscope bench --long`'s
    prefill of 8 x 2048 tokens of SmolLM2-135M took 59 s chunked, 37 s so (the reference path: 36 s).
    The chunk loop stays for decode, for prefill on CUDA (the triton backend's fallback), and for `partial` (its
    running max and sum give the lse that host_reads="compute" merges by: SDPA does not return it).
    """

    name = "chunked"

    def __init__(self, chunk_elems: int = 1 << 20, dense_prefill: bool = True):
        self.chunk_elems = chunk_elems
        self.dense_prefill = dense_prefill

    def prefill(self, q: torch.Tensor, layer: int, paged: PagedKV, batch: PagedBatch, *, scale: float,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, Q, H, D] -> [B, Q, H, D] in q's dtype. With attention sinks [H] the chunk loop runs (SDPA has no
        term for them) and each head's exp(sink) joins the softmax's sum, scaled by the running max as the keys."""
        B, Q, H, D = q.shape
        Hkv, bs = paged.kv_heads, paged.block_size
        G = H // Hkv
        kfmt, vfmt = kv_formats(paged.dtype)
        table = batch.block_table.long()  # [B, NB]
        NB = table.shape[1]
        visible = visibility(batch, Q, NB * bs, window)  # [B, Q, S]
        first, last = 0, NB
        if batch.key_pos is None and not q.is_cuda:  # key i at position i; .item() is free on the CPU
            qpos = query_positions(batch, B, Q)
            last = min(NB, int(qpos.max()) // bs + 1)  # blocks wholly after every query: never visible
            if window is not None:
                first = max(0, int(qpos.min()) - window + 1) // bs  # blocks wholly before every window
        if Q > 1 and self.dense_prefill and not q.is_cuda and sinks is None:
            n = (last - first) * bs
            cols = slice(first, last)
            k = read_blocks(paged, "k", batch, cols, lambda p, sl: gather_head_major(p, kfmt, layer, sl), True).view(B, Hkv, n, D)
            v = read_blocks(paged, "v", batch, cols, lambda p, sl: gather_head_major(p, vfmt, layer, sl), True).view(B, Hkv, n, D)
            if (first == 0 and window is None and batch.key_pos is None and bool((qpos == torch.arange(Q)).all())
                    and bool((batch.context_lens >= Q).all())):
                # Every row a prompt's first chunk (query i at position i, key j at j): what it sees is the causal
                # mask aligned top-left (key j <= query i; the keys past the chunk are none of them), which SDPA's
                # flash kernel takes as is_causal and skips the blocks above the diagonal: the same sums (the
                # masked keys add exp(-inf) = 0), 1.32 vs 1.56 ms at 275 queries, 12.1 vs 18.2 at 1024 (9 heads,
                # 3 KV heads, D 64; EPYC znver4, 2026-12-07).
                o = F.scaled_dot_product_attention(q.float().transpose(1, 2), k, v, is_causal=True, scale=scale,
                                                   enable_gqa=H != Hkv)  # [B, H, Q, D]
                return o.transpose(1, 2).to(q.dtype)
            mask = visible[:, None, :, first * bs : last * bs]  # [B, 1, Q, n]
            o = F.scaled_dot_product_attention(q.float().transpose(1, 2), k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=H != Hkv)  # [B, H, Q, D]
            return o.transpose(1, 2).to(q.dtype)
        # Rows (g, q) of each kv head: [B, Hkv, G*Q, D], pre-scaled.
        qg = (q.float() * scale).view(B, Q, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * Q, D)
        hidden = ~visible[:, None, None]  # [B, 1, 1, Q, S]
        acc, l, m = self._online(qg, layer, paged, batch, (kfmt, vfmt), hidden, first, last)
        if sinks is not None:  # rows (g, q) of each kv head, as qg's: [1, Hkv, G*Q, 1]
            sink = sinks.float().to(q.device).view(1, Hkv, G, 1).repeat_interleave(Q, dim=2)
            l = l + torch.exp(sink - m)
        out = (acc / l).view(B, Hkv, G, Q, D).permute(0, 3, 1, 2, 4).reshape(B, Q, H, D)
        return out.to(q.dtype)

    def partial(self, q: torch.Tensor, layer: int, paged: PagedKV, batch: PagedBatch, *, scale: float,
                window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, Q, H, D] -> (out [B, Q, H, D] fp32, lse [B, Q, H] fp32) over the keys of `batch` (the chunk loop
        on every device); a query with no visible key gets out 0 and lse -inf (engine/attention/tier_split.py)."""
        B, Q, H, D = q.shape
        Hkv, bs = paged.kv_heads, paged.block_size
        G = H // Hkv
        NB = batch.block_table.shape[1]
        hidden = ~visibility(batch, Q, NB * bs, window)[:, None, None]  # [B, 1, 1, Q, S]
        qg = (q.float() * scale).view(B, Q, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * Q, D)
        acc, l, m = self._online(qg, layer, paged, batch, kv_formats(paged.dtype), hidden, 0, NB)
        out = acc / torch.where(l > 0, l, 1.0)  # [B, Hkv, G*Q, D]: 0 where nothing was visible
        out = out.view(B, Hkv, G, Q, D).permute(0, 3, 1, 2, 4).reshape(B, Q, H, D)
        lse = lse_of(m, l).view(B, Hkv, G, Q).permute(0, 3, 1, 2).reshape(B, Q, H)
        return out, lse

    def _online(self, qg: torch.Tensor, layer: int, paged: PagedKV, batch: PagedBatch, fmts, hidden: torch.Tensor,
                first: int, last: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The online softmax over table columns [first, last): (acc [B, Hkv, G*Q, D], l and m [.., 1]); qg
        [B, Hkv, G*Q, D] pre-scaled, hidden [B, 1, 1, Q, S] the keys each query does not see."""
        B, Hkv, GQ, D = qg.shape
        bs, Q = paged.block_size, hidden.shape[3]
        G = GQ // Q
        kfmt, vfmt = fmts
        step = max(1, self.chunk_elems // (B * Hkv * bs * max(D, GQ)))
        m = l = acc = None
        for j in range(first, last, step):
            cols = slice(j, min(j + step, last))  # [B, c] blocks
            n = (cols.stop - cols.start) * bs
            k = read_blocks(paged, "k", batch, cols, lambda p, sl: gather_head_major(p, kfmt, layer, sl), True).view(B, Hkv, n, D)
            v = read_blocks(paged, "v", batch, cols, lambda p, sl: gather_head_major(p, vfmt, layer, sl), True).view(B, Hkv, n, D)
            s = torch.matmul(qg, k.transpose(-1, -2))  # [B, Hkv, G*Q, n]
            s = s.view(B, Hkv, G, Q, n).masked_fill_(hidden[..., j * bs : j * bs + n], float("-inf"))
            s = s.view(B, Hkv, GQ, n)
            cmax = s.amax(dim=-1, keepdim=True)  # [B, Hkv, G*Q, 1]
            if m is None:
                m = cmax.clamp_min(_NEG)
                p = torch.exp(s - m)
                l = p.sum(dim=-1, keepdim=True)
                acc = torch.matmul(p, v)  # [B, Hkv, G*Q, D]
                continue
            m_new = torch.maximum(m, cmax)
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new)
            l = l * alpha + p.sum(dim=-1, keepdim=True)
            acc = acc * alpha + torch.matmul(p, v)
            m = m_new
        return acc, l, m
