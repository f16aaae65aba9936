"""A Triton paged-decode kernel: attention reads the pool's blocks in place, dequantized in registers.

One program per (sequence, kv head, split) handles the G = H // Hkv query heads that share that kv head: it
walks its share of the sequence's block table, loads each block's K and V in tiles of BLOCK_T tokens (any
block size 1..1024: a tile is a power of two, masked past the block's end), dequantizes them per format
(KVFormat), and folds them into an online softmax. Keys are masked by context length and by position (causal,
and the sliding window); padded tile rows never count. With more than one split (flash-decoding's split-K, so
that a small batch still fills the GPU) each program writes its running max, sum and output, and
`_merge_splits` combines them. Blocks a row does not reach (past its context, or wholly before its window when
positions are indices) are never loaded.

fp8 (e4m3fn) is loaded as bytes and decoded with integer ops, so the kernel needs no fp8 hardware (sm80 runs
it as sm90 does). Delta keys are anchor + a running cumsum of the steps along the block, carried across tiles.

Interpreter: with TRITON_INTERPRET=1 in the environment before triton is first imported (triton's own
tl.zeros, tl.cumsum... are jitted at its import, so the mode is per process), the same kernel runs on CPU
tensors; that is how the tests check it on a machine without a GPU (in a subprocess). Prefill (Q > 1) uses
the torch path of cpu_paged.py.

`partial` (host_reads="compute": the device tier's part of a split, engine/attention/tier_split.py) runs the
kernel in split mode however many splits there are, and merges its running max, sum and output into the output
and its log-sum-exp: the kernel itself is unchanged. A prefill's partial is the torch path's. Attention sinks
(GPT-OSS) are decoded the same way: the kernel's output and lse, the sink joined after as one more log-sum-exp
term (tier_split.add_sinks).
"""

from __future__ import annotations

import triton
import triton.language as tl
import torch

from engine.attention.interface import KVFormat, PagedBatch, PagedKV, kv_formats
from engine.attention.cpu_paged import ChunkedPagedBackend
from engine.attention.tier_split import add_sinks, lse_of

INTERPRET = bool(triton.knobs.runtime.interpret)  # TRITON_INTERPRET=1 when triton was imported

# The formats as kernel constants.
_CHANNEL = tl.constexpr(KVFormat.CHANNEL_SCALE.value)
_TOKEN = tl.constexpr(KVFormat.TOKEN_SCALE.value)
_DELTA = tl.constexpr(KVFormat.DELTA.value)


@triton.jit
def _paged_decode(
    Q, Out,  # [B, H, D]
    Mw, Lw, Aw,  # split-K partials: [B, Hkv, splits, BLOCK_G] running max and sum, [.., BLOCK_G, BLOCK_D] output
    K, KS, KX,  # one layer: data [N, Hkv, BS, D]; scale [N, Hkv, BS] per token / [N, Hkv, D] per channel / unused;
                # KX: anchor [N, Hkv, D] (delta keys) or per-token scale [N, Hkv, BS] (channel keys) / unused
    V, VS,  # data [N, Hkv, BS, D]; scale [N, Hkv, BS] / unused
    Table, Ctx, QPos, KPos,  # [B, NB], [B], [B], [B, NB*BS]
    sm_scale, window, blocks_per_split,
    s_qb, s_qh, s_qd, s_ob, s_oh, s_od,
    s_kn, s_kh, s_kt, s_kd, s_ksn, s_ksh, s_ksx, s_kxn, s_kxh, s_kxx,
    s_vn, s_vh, s_vt, s_vd, s_vsn, s_vsh, s_vsx,
    s_tb, s_tn, s_pb, s_pn,
    G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    K_FMT: tl.constexpr, V_FMT: tl.constexpr, K_FP8: tl.constexpr, V_FP8: tl.constexpr,
    HAS_KPOS: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)  # this program's share of the row: blocks [split * blocks_per_split, +blocks_per_split)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    tt = tl.arange(0, BLOCK_T)
    gm = g < G
    dm = d < D
    heads = kvh * G + g
    q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + d[None, :] * s_qd, mask=gm[:, None] & dm[None, :], other=0.0)
    q = q.to(tl.float32) * sm_scale  # [BLOCK_G, BLOCK_D]
    ctx = tl.load(Ctx + b).to(tl.int32)
    qpos = tl.load(QPos + b).to(tl.int64)

    m = tl.full([BLOCK_G], -1.0e30, tl.float32)  # finite: exp(-inf - m) is 0, never NaN
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(ctx, BS))
    if HAS_WINDOW:
        if not HAS_KPOS:  # key i sits at position i: blocks wholly before the window are skipped
            first = tl.maximum(first, (tl.maximum(qpos - window + 1, 0) // BS).to(tl.int32))
    for j in range(first, last):
        slot = tl.load(Table + b * s_tb + j * s_tn).to(tl.int64)
        kb = K + slot * s_kn + kvh * s_kh
        vb = V + slot * s_vn + kvh * s_vh
        kch = tl.zeros([BLOCK_D], tl.float32) + 1.0
        carry = tl.zeros([BLOCK_D], tl.float32)  # delta keys: anchor + steps of the tiles before this one
        if K_FMT == _CHANNEL:
            kch = tl.load(KS + slot * s_ksn + kvh * s_ksh + d * s_ksx, mask=dm, other=0.0).to(tl.float32)
        if K_FMT == _DELTA:
            carry = tl.load(KX + slot * s_kxn + kvh * s_kxh + d * s_kxx, mask=dm, other=0.0).to(tl.float32)
        for t0 in range(0, BS, BLOCK_T):
            t = t0 + tt
            tm = t < BS
            idx = j * BS + t  # key index in the row
            valid = tm & (idx < ctx)
            # -- K tile [BLOCK_T, BLOCK_D], dequantized --
            kx = tl.load(kb + t[:, None] * s_kt + d[None, :] * s_kd, mask=tm[:, None] & dm[None, :], other=0)
            if K_FP8:  # e4m3fn bytes -> fp32 exactly: sign, 4 exponent bits (bias 7), 3 mantissa bits
                u = kx.to(tl.int32)
                e = (u >> 3) & 15
                mag = tl.where(e == 0, (u & 7).to(tl.float32) * 0.001953125,  # subnormal: mantissa * 2^-9
                               (((e + 120) << 23) | ((u & 7) << 20)).to(tl.float32, bitcast=True))
                mag = tl.where((u & 127) == 127, float("nan"), mag)
                kx = tl.where((u & 128) != 0, -mag, mag)
            else:
                kx = kx.to(tl.float32)
            if K_FMT == _TOKEN:
                ktok = tl.load(KS + slot * s_ksn + kvh * s_ksh + t * s_ksx, mask=tm, other=0.0).to(tl.float32)
                kx = kx * ktok[:, None]
            if K_FMT == _CHANNEL:
                ktok = tl.load(KX + slot * s_kxn + kvh * s_kxh + t * s_kxx, mask=tm, other=0.0).to(tl.float32)
                kx = kx * kch[None, :] * ktok[:, None]
            if K_FMT == _DELTA:
                ktok = tl.load(KS + slot * s_ksn + kvh * s_ksh + t * s_ksx, mask=tm, other=0.0).to(tl.float32)
                steps = tl.where((t != 0)[:, None], kx * ktok[:, None], 0.0)  # token 0 is the anchor itself
                kx = carry[None, :] + tl.cumsum(steps, axis=0)
                carry = carry + tl.sum(steps, axis=0)
            # -- scores [BLOCK_G, BLOCK_T], masked --
            if HAS_KPOS:
                pos = tl.load(KPos + b * s_pb + idx * s_pn, mask=valid, other=0).to(tl.int64)
            else:
                pos = idx.to(tl.int64)
            vis = valid & (pos <= qpos)
            if HAS_WINDOW:
                vis = vis & (pos > qpos - window)
            s = tl.sum(q[:, None, :] * kx[None, :, :], axis=2)
            s = tl.where(vis[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            # -- V tile, dequantized; rows past the context load as 0 (p is 0 there too) --
            vx = tl.load(vb + t[:, None] * s_vt + d[None, :] * s_vd, mask=valid[:, None] & dm[None, :], other=0)
            if V_FP8:  # as for keys
                u = vx.to(tl.int32)
                e = (u >> 3) & 15
                mag = tl.where(e == 0, (u & 7).to(tl.float32) * 0.001953125,  # subnormal: mantissa * 2^-9
                               (((e + 120) << 23) | ((u & 7) << 20)).to(tl.float32, bitcast=True))
                mag = tl.where((u & 127) == 127, float("nan"), mag)
                vx = tl.where((u & 128) != 0, -mag, mag)
            else:
                vx = vx.to(tl.float32)
            if V_FMT == _TOKEN:
                vtok = tl.load(VS + slot * s_vsn + kvh * s_vsh + t * s_vsx, mask=valid, other=0.0).to(tl.float32)
                vx = vx * vtok[:, None]
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vx[None, :, :], axis=1)
            m = m_new
    if not SPLIT:
        out = acc / l[:, None]
        tl.store(Out + b * s_ob + heads[:, None] * s_oh + d[None, :] * s_od, out.to(Out.dtype.element_ty),
                 mask=gm[:, None] & dm[None, :])
    else:  # partials, merged by _merge_splits (a split past the row's context leaves m = -1e30, l = 0)
        w = (b * tl.num_programs(1) + kvh) * tl.num_programs(2) + split
        tl.store(Mw + w * BLOCK_G + g, m)
        tl.store(Lw + w * BLOCK_G + g, l)
        tl.store(Aw + (w * BLOCK_G + g[:, None]) * BLOCK_D + d[None, :], acc)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class TritonPagedBackend:
    """decode: the kernel; prefill: the chunked torch path. `tile_elems` bounds BLOCK_G * BLOCK_T * BLOCK_D."""

    name = "triton"

    def __init__(self, tile_elems: int = 8192, num_warps: int = 4, splits: int | None = None,
                 split_tokens: int = 512):
        self.tile_elems = tile_elems
        self.num_warps = num_warps
        self.splits = splits  # None: enough to fill the GPU (1 in the interpreter), at least split_tokens each
        self.split_tokens = split_tokens
        self._prefill = ChunkedPagedBackend()

    def num_splits(self, B: int, Hkv: int, NB: int, bs: int, device: torch.device) -> int:
        """Programs per (sequence, kv head) row (flash-decoding's split-K): a static function of the shapes."""
        if self.splits is not None:
            return max(1, min(self.splits, NB))
        if device.type != "cuda":
            return 1
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        want = -(-2 * sms // (B * Hkv))  # about two programs per SM
        return max(1, min(want, -(-NB * bs // self.split_tokens), NB))

    def block_t(self, G: int, D: int, bs: int) -> int:
        """Tokens per tile: a power of two, at most the block size's next power of two."""
        per_token = _next_pow2(G) * _next_pow2(D)
        return max(1, min(_next_pow2(bs), _prev_pow2(max(1, self.tile_elems // per_token))))

    def decode(self, q: torch.Tensor, layer: int, paged: PagedKV, batch: PagedBatch, *, scale: float,
               window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if batch.on_host is not None:  # blocks on the host tier: streamed per layer by the torch path
            return self._prefill.decode(q, layer, paged, batch, scale=scale, window=window, sinks=sinks)
        if sinks is not None:  # attention sinks: the kernel's output and lse, the sink joined after (add_sinks)
            o, lse = self._run(q, layer, paged, batch, scale, window, with_lse=True)
            return add_sinks(o, lse, sinks)[0].to(q.dtype)
        return self._run(q, layer, paged, batch, scale, window, with_lse=False)

    def partial(self, q: torch.Tensor, layer: int, paged: PagedKV, batch: PagedBatch, *, scale: float,
                window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, Q, H, D] -> (out [B, Q, H, D], lse [B, Q, H]) fp32 (engine/attention/tier_split.py): decode (Q = 1)
        from the kernel's split partials, however many splits; prefill from the torch path's."""
        if q.shape[1] != 1 or batch.on_host is not None:
            return self._prefill.partial(q, layer, paged, batch, scale=scale, window=window)
        o, lse = self._run(q[:, 0], layer, paged, batch, scale, window, with_lse=True)
        return o[:, None], lse[:, None]

    def _run(self, q: torch.Tensor, layer: int, paged: PagedKV, batch: PagedBatch, scale: float, window: int | None,
             with_lse: bool):
        """The kernel over q [B, H, D]: out in q's dtype, or (out, lse) fp32 when `with_lse` (split partials kept)."""
        B, H, D = q.shape
        Hkv, bs = paged.kv_heads, paged.block_size
        G = H // Hkv
        if G * Hkv != H:
            raise ValueError(f"{H} query heads do not group over {Hkv} kv heads")
        kfmt, vfmt = kv_formats(paged.dtype)
        if not q.is_cuda and not INTERPRET:
            raise RuntimeError("the Triton paged kernel needs CUDA tensors "
                               "(or TRITON_INTERPRET=1 set before triton is imported)")
        kd, vd = _bytes_if_fp8(paged.k["data"][layer]), _bytes_if_fp8(paged.v["data"][layer])  # [N, Hkv, bs, D]
        ks = paged.k["scale"][layer] if "scale" in paged.k else kd
        kx = paged.k["anchor"][layer] if "anchor" in paged.k else paged.k["tscale"][layer] if "tscale" in paged.k else kd
        vs = paged.v["scale"][layer] if "scale" in paged.v else vd
        table = batch.block_table
        ctx = batch.context_lens
        qpos = batch.q_pos.reshape(B)
        kpos = batch.key_pos if batch.key_pos is not None else table
        NB = table.shape[1]
        splits = self.num_splits(B, Hkv, NB, bs, q.device)
        BG, BD = _next_pow2(G), _next_pow2(D)
        out = torch.empty_like(q)
        split = splits > 1 or with_lse  # the partials carry the lse
        if split:
            mw = torch.empty((B, Hkv, splits, BG), dtype=torch.float32, device=q.device)
            lw = torch.empty_like(mw)
            aw = torch.empty((B, Hkv, splits, BG, BD), dtype=torch.float32, device=q.device)
        else:
            mw = lw = aw = out  # unused
        _paged_decode[(B, Hkv, splits)](
            q, out, mw, lw, aw, kd, ks, kx, vd, vs, table, ctx, qpos, kpos,
            float(scale), int(window or 0), -(-NB // splits),
            *q.stride(), *out.stride(),
            *kd.stride(), *_strides3(ks), *_strides3(kx),
            *vd.stride(), *_strides3(vs),
            *table.stride(), *kpos.stride(),
            G=G, D=D, BS=bs,
            BLOCK_G=BG, BLOCK_D=BD, BLOCK_T=self.block_t(G, D, bs),
            K_FMT=int(kfmt), V_FMT=int(vfmt), K_FP8=kd.dtype == torch.uint8, V_FP8=vd.dtype == torch.uint8,
            HAS_KPOS=batch.key_pos is not None, HAS_WINDOW=window is not None, SPLIT=split,
            num_warps=self.num_warps, enable_fp_fusion=True,  # FMA, triton's default so far, said out loud
        )
        if with_lse:
            o, lse = _merge_splits(mw, lw, aw, with_lse=True)  # [B, Hkv, BG, BD], [B, Hkv, BG]
            return o[:, :, :G, :D].reshape(B, H, D), lse[:, :, :G].reshape(B, H)
        if splits > 1:
            out.copy_(_merge_splits(mw, lw, aw)[:, :, :G, :D].reshape(B, H, D))
        return out

    def prefill(self, q: torch.Tensor, layer: int, paged: PagedKV, batch: PagedBatch, *, scale: float,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        return self._prefill.prefill(q, layer, paged, batch, scale=scale, window=window, sinks=sinks)


def _merge_splits(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, with_lse: bool = False):
    """Merge split-K partials m, l [B, Hkv, S, G'] and acc [B, Hkv, S, G', D'] into [B, Hkv, G', D'].

    with_lse: (out, lse [B, Hkv, G']) instead, and a row with no visible key (every split's l = 0) gets out 0 and
    lse -inf rather than 0/0."""
    top = m.amax(dim=2, keepdim=True)
    w = torch.exp(m - top)  # [B, Hkv, S, G']; an empty split weighs 0
    total = (w * l).sum(dim=2)  # [B, Hkv, G']
    if not with_lse:
        return (w[..., None] * acc).sum(dim=2) / total[..., None]
    out = (w[..., None] * acc).sum(dim=2) / torch.where(total > 0, total, 1.0)[..., None]
    return out, lse_of(top[:, :, 0], total)


def _prev_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _bytes_if_fp8(x: torch.Tensor) -> torch.Tensor:
    fp8 = getattr(torch, "float8_e4m3fn", None)
    return x.view(torch.uint8) if fp8 is not None and x.dtype == fp8 else x


def _strides3(x: torch.Tensor) -> tuple[int, int, int]:
    """(slot, head, last) strides of a per-layer scale/anchor part; the last is 0 for [N, Hkv] parts."""
    s = x.stride()
    return (s[0], s[1], s[2] if x.dim() == 3 else 0)
