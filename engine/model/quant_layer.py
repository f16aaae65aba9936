"""A decoder layer's compute around attention in two compiled calls, for packed or fp32 weights on the CPU
(quant_ir.py's kernels: fp32 ones through its f32 kernels, which sum in another order than MKL's gemm).

A decode step of a small model is mostly dispatch: per layer a norm, the q/k/v matmul, two RoPE rotations, the o
matmul, a residual, a norm, gate/up, the activation, down and a residual, each a torch op or a numba call of
10-30 us around a kernel of similar length. Here the two stretches without attention are one call each:

    pre  = RMSNorm -> x @ W_qkv -> RoPE on q and k                       (then the KV write and attention: Python)
    post = attn @ W_o -> + x -> RMSNorm -> x @ W_gate_up -> silu(gate) * up -> @ W_down -> + x

with the matmuls through the same IR kernels and the same arithmetic as QuantWeight.matmul (quant_ir._drive), so
a fused layer computes what the unfused one does up to float rounding (tests/model/test_quant_layer.py).

A decode step over plain KV blocks on the CPU (fp32 / fp16 / bf16, the device tier only, no attention sinks, keys at
their index: LlamaFamily._decode_plan says when) runs each layer whole, in one call (decode_layer): pre, the new K/V
written into their blocks with what the fidelity probe measures (numba_kernel.write_plain), the decode attention
kernel over the blocks in place (numba_kernel.decode_plain, what the numba backend runs) and post. The same
arithmetic as the three calls and the Python between them, bit for bit; what it saves is that Python (the KV
write's scatters and the probe's read-back, ~1.5-3.5 ms of a ~10 ms step of the default model).

Only for the layers this shape describes (FusedLayer.of says which): pre-norm RMSNorm, no biases, no q/k norm, no
post-norms, SiLU, a dense MLP, rotate-half RoPE over the whole head, int4 weights or int8 ones without zeros or
fp32 ones (KVSCOPE_FUSE_FP32=0 leaves fp32 models layer by layer, through torch), fp32 activations and at most
quant.PREFILL_ROWS rows (a prompt chunk goes the unfused way, through gemm).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.model import quant_ir

try:
    from numba import njit

    from engine.attention import numba_kernel
except Exception:  # pragma: no cover - numba missing: no fused layers (quant_ir is unavailable too)
    njit = None


def operand(w, activations: str) -> tuple | None:
    """quant_ir.operand of a packed weight (quant_ir.operand_f32 of an fp32 tensor), or None where the fused path
    does not take it: no kernels, CUDA, int8 weights with zeros (the fused calls add no zero term), groups / inputs
    not in 16s, an fp32 tensor that is not C-contiguous."""
    if isinstance(w, torch.Tensor):  # fp32 weights: the f32 kernels
        if w.device.type != "cpu" or w.dtype != torch.float32 or w.requires_grad:
            return None
        return quant_ir.operand_f32(w.detach().numpy())
    if quant_ir.library() is None or w.q.device.type != "cpu" or (w.kind == "int8" and bool((w.zero != 0).any())):
        return None
    return quant_ir.operand(w.kind, w.q.numpy(), w.scale.numpy(), w.zero.numpy(), w.group, activations)


if njit is not None and quant_ir.llvm is not None:

    @njit(nogil=True, cache=True)
    def _rms(x, w, eps, out):  # pragma: no cover - compiled
        for t in range(x.shape[0]):
            ss = 0.0
            for i in range(x.shape[1]):
                ss += np.float64(x[t, i]) * np.float64(x[t, i])
            r = np.float32(1.0 / np.sqrt(ss / x.shape[1] + eps))
            for i in range(x.shape[1]):
                out[t, i] = w[i] * (x[t, i] * r)

    @njit(nogil=True, cache=True)
    def _rope(qkv, heads, D, cos, sin):  # pragma: no cover - compiled
        """Rotate-half RoPE in place on the first `heads` heads of each row of qkv [T, ...] (cos/sin [T, D])."""
        half = D // 2
        for t in range(qkv.shape[0]):
            for h in range(heads):
                base = h * D
                for i in range(half):
                    a = qkv[t, base + i]
                    b = qkv[t, base + half + i]
                    qkv[t, base + i] = a * cos[t, i] - b * sin[t, i]
                    qkv[t, base + half + i] = b * cos[t, half + i] + a * sin[t, half + i]

    @njit(nogil=True, cache=True, error_model="numpy")
    def _silu_mul(gu, inter, a, ebuf):  # pragma: no cover - compiled
        """a[t, i] = silu(gu[t, i]) * gu[t, inter + i], the exponential by numba_kernel.expf_parts (Cephes' expf,
        within 2 ulp; 2^k from its bits in ebuf, int32 [inter]) so that the loop vectorizes: numba's np.exp is a
        libm call per element. error_model "numpy": IEEE division (numba's default checks each divisor for zero,
        which keeps the loop scalar; 1 + e^-g is never zero). 34 -> 8 us at 8 x 1536."""
        efl = ebuf.view(np.float32)
        for t in range(gu.shape[0]):
            for i in range(inter):
                p, fx = numba_kernel.expf_parts(-gu[t, i])
                ebuf[i] = (np.int32(fx) + np.int32(127)) << 23
                a[t, i] = p
            for i in range(inter):
                g = gu[t, i]
                a[t, i] = g / (np.float32(1.0) + a[t, i] * efl[i]) * gu[t, inter + i]

    def _sources_stamp() -> str:
        """A hash of the other files whose compiled code the functions below link (quant_ir.py, numba_kernel.py).
        numba's disk cache checks only a function's own file, so a change there alone would leave these cached
        with the old code; each function below closes over this stamp, and a closure's values are part of numba's
        cache key: a new stamp compiles them afresh."""
        import hashlib

        h = hashlib.sha256()
        for mod in (quant_ir, numba_kernel):
            with open(mod.__file__, "rb") as f:
                h.update(f.read())
        return h.hexdigest()[:16]

    _STAMP = _sources_stamp()

    def _pre(stamp: str):
        @njit(nogil=True, cache=True)
        def pre_attention(x, norm_w, eps, w_qkv, cos, sin, rope_heads, D, out):  # pragma: no cover - compiled
            if len(stamp) == 0:  # never: ties the cache to the stamp
                return
            h = np.empty_like(x)
            _rms(x, norm_w, eps, h)
            quant_ir._mm(w_qkv, h, out)
            if rope_heads > 0:
                _rope(out, rope_heads, D, cos, sin)

        return pre_attention

    pre_attention = _pre(_STAMP)

    def _post(stamp: str):
        @njit(nogil=True, cache=True)
        def post_attention(x, attn, w_o, norm_w, eps, w_gu, w_down, inter, out):  # pragma: no cover - compiled
            if len(stamp) == 0:  # never: ties the cache to the stamp
                return
            T, n = x.shape
            o = np.empty((T, n), dtype=np.float32)
            quant_ir._mm(w_o, attn, o)
            for t in range(T):
                for i in range(n):
                    o[t, i] += x[t, i]  # o is now the residual stream after attention
            h = np.empty((T, n), dtype=np.float32)
            _rms(o, norm_w, eps, h)
            gu = np.empty((T, 2 * inter), dtype=np.float32)
            quant_ir._mm(w_gu, h, gu)
            a = np.empty((T, inter), dtype=np.float32)
            _silu_mul(gu, inter, a, np.empty(inter, dtype=np.int32))
            quant_ir._mm(w_down, a, out)
            for t in range(T):
                for i in range(n):
                    out[t, i] += o[t, i]

        return post_attention

    post_attention = _post(_STAMP)

    def _decode(stamp: str):
        @njit(nogil=True, cache=True)
        def decode_layer(x, norm_w, eps, w_qkv, cos, sin, rope_heads, H, Hkv, D, kv, scale, window, w_o, mlp_norm, w_gu,
                         w_down, inter, out):  # pragma: no cover - compiled
            """A whole decode layer in one call: pre_attention, the new K/V written into the pool's plain blocks (with
            the fidelity probe's measurements: numba_kernel.write_plain), decode attention over the blocks in place
            (numba_kernel.decode_plain) and post_attention. kv: the step's (slots, offsets, qpos, table, alt, ctx,
            dlut, segments, block loops) and this layer's (kd, vd, akd, avd, key absmax, errors, lossy)."""
            if len(stamp) == 0:  # never: ties the cache to the stamp
                return
            slots, offs, qpos, table, alt, ctx, dlut, S, fns, kd, vd, akd, avd, kmax, err, lossy = kv
            T = x.shape[0]
            qkv = np.empty((T, (H + 2 * Hkv) * D), dtype=np.float32)
            pre_attention(x, norm_w, eps, w_qkv, cos, sin, rope_heads, D, qkv)
            q = qkv[:, : H * D].copy().reshape(T, H, D)
            k = qkv[:, H * D: (H + Hkv) * D].copy().reshape(T, Hkv, D)
            v = qkv[:, (H + Hkv) * D:].copy().reshape(T, Hkv, D)
            numba_kernel.write_plain(k, v, slots, offs, kd, vd, dlut, kmax, err, lossy)
            attn = np.empty((T, H, D), dtype=np.float32)
            numba_kernel.decode_plain(q, scale, qpos, table, alt, ctx, window, kd, vd, akd, avd, dlut, attn, S, fns)
            post_attention(x, attn.reshape(T, H * D), w_o, mlp_norm, eps, w_gu, w_down, inter, out)

        return decode_layer

    decode_layer = _decode(_STAMP)


class FusedLayer:
    """One layer's operands for pre_attention / post_attention."""

    def __init__(self, qkv: tuple, o: tuple, gu: tuple, down: tuple, attn_norm: torch.Tensor, mlp_norm: torch.Tensor,
                 eps: float, heads: int, kv_heads: int, head_dim: int, inter: int, rope: bool):
        self.qkv, self.o, self.gu, self.down = qkv, o, gu, down
        self.attn_norm, self.mlp_norm = attn_norm.numpy(), mlp_norm.numpy()
        self.eps = eps
        self.H, self.Hkv, self.D, self.inter = heads, kv_heads, head_dim, inter
        self.width = (heads + 2 * kv_heads) * head_dim
        self.rope_heads = heads + kv_heads if rope else 0

    @staticmethod
    def of(model, li: int) -> "FusedLayer | None":
        """Layer li of a LlamaFamily as a FusedLayer, or None where its shape is not the one fused here."""
        from engine.model.quant import QuantWeight

        s = model.spec
        _, qkv_w, qkv_b, o_w, _, gu_w, down_w = model.layers[li]
        attn_in, attn_out, mlp_in, mlp_out = model.norms[li]
        weights = (qkv_w, o_w, gu_w, down_w)
        if njit is None or quant_ir.llvm is None or quant_ir.library() is None:
            return None
        packed = all(isinstance(w, QuantWeight) for w in weights)
        if not (packed or all(isinstance(w, torch.Tensor) and w.dtype == torch.float32 for w in weights)) \
                or model.dtype != torch.float32:
            return None
        if (qkv_b is not None or model.o_bias[li] is not None or model.qk_norms[li] is not None
                or attn_in is None or mlp_in is None or attn_out is not None or mlp_out is not None
                or model.moe[li] is not None or s.norm_kind == "layer" or s.norm_placement == "parallel"
                or s.mlp_act != "silu" or s.residual_multiplier != 1.0 or attn_in.dim() != 1):
            return None
        rope = model.layer_rope[li] is not None
        if rope and (s.rope_interleaved or model.ropes[model.layer_rope[li]][0].shape[0] * 2 != s.head_dim):
            return None
        ops = [operand(w, w.activations if packed else "fp32") for w in weights]
        if any(op is None for op in ops):
            return None
        inter = gu_w.shape[0] // 2
        return FusedLayer(*ops, attn_in.float().contiguous(), mlp_in.float().contiguous(), s.rms_norm_eps,
                          s.num_heads, s.num_kv_heads, s.head_dim, inter, rope)

    def pre(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        """[T, (H + 2 Hkv) D]: q, k (rotated) and v of the normed x."""
        T = x.shape[0]
        out = torch.empty((T, self.width), dtype=torch.float32)
        c = cos.contiguous().numpy() if cos is not None else _EMPTY
        s = sin.contiguous().numpy() if sin is not None else _EMPTY
        pre_attention(x.contiguous().numpy(), self.attn_norm, self.eps, self.qkv, c, s, self.rope_heads, self.D,
                      out.numpy())
        return out

    def post(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x after the layer: attention's output projected and added, then the MLP's."""
        out = torch.empty_like(x)
        post_attention(x.contiguous().numpy(), attn.contiguous().numpy(), self.o, self.mlp_norm, self.eps, self.gu,
                       self.down, self.inter, out.numpy())
        return out

    def decode_into(self, x: np.ndarray, cos: np.ndarray | None, sin: np.ndarray | None, kv: tuple, scale: float,
                    window: int | None, out: np.ndarray) -> None:
        """out = x after the layer, attention and the KV write included (decode_layer): x, out [T, hidden] float32
        C-contiguous, cos / sin [T, R] or None; kv: the decode plan's tuple for this layer."""
        decode_layer(x, self.attn_norm, self.eps, self.qkv, _EMPTY if cos is None else cos,
                     _EMPTY if sin is None else sin, self.rope_heads, self.H, self.Hkv, self.D, kv, scale,
                     int(window or 0), self.o, self.mlp_norm, self.gu, self.down, self.inter, out)


_EMPTY = np.zeros((1, 1), dtype=np.float32)


def rms_rows(x: np.ndarray, rows: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """The RMS norm (weight w [n]) of rows `rows` of x [T, n] float32, as the fused layers norm theirs (_rms: the
    squares summed in float64): [len(rows), n]."""
    picked = np.ascontiguousarray(x[rows])
    out = np.empty_like(picked)
    _rms(picked, w, eps, out)
    return out
