"""The compiled loop of the numba paged backend (numba_paged.py has the backend, its docstring the design).

Kept apart from the backend so that numba's on-disk cache, which is keyed by this file, stays valid when the
backend's Python changes. Importing this module imports numba.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir as llir
from numba import njit, prange
from numba.core import types
from numba.extending import intrinsic, overload

from engine.attention.attn_ir import call as _call_ir

# The score and output sums may be reordered and fused (fp32 summation-order noise, as any matmul); the
# dequantization helpers are compiled strict, so a decoded value is the codec's bit for bit.
_FAST = {"reassoc", "contract", "nsz", "arcp"}


# The `lut` argument of to_f32 for 16-bit data: not a table but a marker whose dtype says the format, so the
# conversion is an instruction LLVM vectorizes (vcvtph2ps where the CPU has F16C; a shift for bf16), not a gather.
F16_BITS = np.zeros(1, dtype=np.int16)  # uint16 data are fp16 bits
BF16_BITS = np.zeros(1, dtype=np.int32)  # uint16 data are bf16 bits


def _unary(name: str, accepts, result, emit):
    """A numba intrinsic of one scalar argument x whose numba type `accepts` (else no match): result(x) is the type
    it returns, emit(builder, value, x) the LLVM instructions that compute it."""

    def typer(typingctx, x):  # pragma: no cover - compiled
        if not accepts(x):
            return None

        def codegen(context, builder, signature, args):
            return emit(builder, args[0], x)

        return result(x)(x), codegen

    typer.__name__ = typer.__qualname__ = name
    return intrinsic(typer)


def _is16(x) -> bool:
    return isinstance(x, types.Integer) and x.bitwidth == 16


_I32 = llir.IntType(32)
# fp16 bits (uint16) -> fp32, exact (fpext: every fp16 value, subnormals, inf and NaN, is an fp32 one).
_f16_to_f32 = _unary("_f16_to_f32", _is16, lambda x: types.float32,
                     lambda b, v, x: b.fpext(b.bitcast(v, llir.HalfType()), llir.FloatType()))
# bf16 bits (uint16) -> fp32, exact: the bits as the high half of an fp32.
_bf16_to_f32 = _unary("_bf16_to_f32", _is16, lambda x: types.float32,
                      lambda b, v, x: b.bitcast(b.shl(b.zext(v, _I32), llir.Constant(_I32, 16)), llir.FloatType()))
# fp32 (or fp64) -> fp16 bits (uint16): fptrunc, round to nearest even (what Tensor.half() does; overflow to inf).
_f32_to_f16 = _unary("_f32_to_f16", lambda x: isinstance(x, types.Float), lambda x: types.uint16,
                     lambda b, v, x: b.bitcast(b.fptrunc(v if x.bitwidth == 32 else b.fptrunc(v, llir.FloatType()),
                                                         llir.HalfType()), llir.IntType(16)))
# The bits of an fp32 (uint32).
_f32_bits = _unary("_f32_bits", lambda x: isinstance(x, types.Float) and x.bitwidth == 32, lambda x: types.uint32,
                   lambda b, v, x: b.bitcast(v, _I32))


def to_f32(x, lut):  # a stored element as fp32: float / int8 cast, fp16 / bf16 converted, uint8 through its table
    raise NotImplementedError


@overload(to_f32, inline="always")
def _to_f32_impl(x, lut):
    if isinstance(x, types.Float) or (isinstance(x, types.Integer) and x.signed):
        return lambda x, lut: np.float32(x)
    if isinstance(x, types.Integer) and x.bitwidth == 16 and lut.dtype == types.int16:
        return lambda x, lut: _f16_to_f32(x)
    if isinstance(x, types.Integer) and x.bitwidth == 16 and lut.dtype == types.int32:
        return lambda x, lut: _bf16_to_f32(x)
    return lambda x, lut: lut[x]


def from_f32(x, like, lut):  # an fp32 as the storage element `like` holds (to_f32's inverse, rounded)
    raise NotImplementedError


@overload(from_f32, inline="always")
def _from_f32_impl(x, like, lut):
    if isinstance(like, types.Float):
        return lambda x, like, lut: np.float32(x)
    if isinstance(like, types.Integer) and like.bitwidth == 16 and lut.dtype == types.int16:
        return lambda x, like, lut: _f32_to_f16(x)
    if isinstance(like, types.Integer) and like.bitwidth == 16 and lut.dtype == types.int32:
        def bf16(x, like, lut):  # round to nearest even, NaN kept quiet: torch's (c10's) fp32 -> bf16
            if x != x:
                return np.uint16(0x7FC0)
            b = _f32_bits(np.float32(x))
            return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        return bf16
    return None


@njit(cache=True, nogil=True)
def write_plain(k, v, slots, offs, kd, vd, dlut, kmax, err, lossy):  # pragma: no cover - compiled
    """One layer's new K/V (k, v [T, Hkv, D] fp32) into plain storage kd / vd [N, Hkv, bs, D] at (slots[t],
    offs[t]) as the codec stores them (fp32, or rounded to fp16 / bf16: from_f32), with what the fidelity probe
    measures (engine/fidelity/block_error.py), read back from the pool: kmax [Hkv, D] the running |key| max per
    channel, and where lossy, err [2, T] (K, V) the max over layers of each token's ||x - stored|| / ||x||.
    NaN wins every max, as torch.maximum's."""
    T, Hkv, D = k.shape
    for t in range(T):
        sl, o = slots[t], offs[t]
        for h in range(Hkv):
            for d in range(D):
                kd[sl, h, o, d] = from_f32(k[t, h, d], kd[0, 0, 0, 0], dlut)
                vd[sl, h, o, d] = from_f32(v[t, h, d], vd[0, 0, 0, 0], dlut)
                a = abs(k[t, h, d])
                if a != a or kmax[h, d] != kmax[h, d]:
                    kmax[h, d] = np.nan
                elif a > kmax[h, d]:
                    kmax[h, d] = a
        if not lossy:
            continue
        for side in range(2):
            x = k if side == 0 else v
            st = kd if side == 0 else vd
            num = 0.0
            den = 0.0
            for h in range(Hkv):
                for d in range(D):
                    e = np.float64(x[t, h, d]) - np.float64(to_f32(st[sl, h, o, d], dlut))
                    num += e * e
                    den += np.float64(x[t, h, d]) * np.float64(x[t, h, d])
            r = np.float32(np.sqrt(num) / max(np.sqrt(den), 1e-30))
            if r != r or err[side, t] != err[side, t]:
                err[side, t] = np.nan
            elif r > err[side, t]:
                err[side, t] = r


@njit(cache=True, nogil=True)
def dequant(dst, n, data, s1, s2, slot, h, fmt, dlut, hlut, cum):
    """Tokens [0, n) of block `slot`, kv head h, into dst [bs, D] fp32 (codecs.py's decode). s1, s2: per
    format (CHANNEL: scale [N, H, D], tscale [N, H, bs]; TOKEN: scale [N, H, bs]; DELTA: scale [N, H, bs],
    anchor [N, H, D]); fp16 read as uint16 through hlut; cum [D] float64 (DELTA's running sum)."""
    D = dst.shape[1]
    if fmt == 0:  # PLAIN
        for t in range(n):
            for d in range(D):
                dst[t, d] = to_f32(data[slot, h, t, d], dlut)
    elif fmt == 3:  # TOKEN_SCALE: data * scale[token]
        for t in range(n):
            sc = hlut[s1[slot, h, t]]
            for d in range(D):
                dst[t, d] = to_f32(data[slot, h, t, d], dlut) * sc
    elif fmt == 2:  # CHANNEL_SCALE: data * scale[channel] * tscale[token], in that order
        for t in range(n):
            ts = hlut[s2[slot, h, t]]
            for d in range(D):
                dst[t, d] = (to_f32(data[slot, h, t, d], dlut) * hlut[s1[slot, h, d]]) * ts
    else:  # DELTA: anchor + running sum of data * scale[token] (token 0's step is 0); torch's CPU cumsum
        # of fp32 accumulates in float64 and rounds each prefix sum to fp32
        for d in range(D):
            cum[d] = 0.0
            dst[0, d] = hlut[s2[slot, h, d]] + np.float32(0.0)
        for t in range(1, n):
            sc = hlut[s1[slot, h, t]]
            for d in range(D):
                cum[d] += np.float64(to_f32(data[slot, h, t, d], dlut) * sc)
                dst[t, d] = hlut[s2[slot, h, d]] + np.float32(cum[d])


@njit(inline="always")
def expf_parts(x):
    """Cephes' expf (a degree-6 polynomial after Cody-Waite reduction, within 2 ulp) of x clamped to fp32's range, in
    two parts: (p, k) with exp(x) = p * 2^k, k a whole float. The caller builds 2^k from its bits ((k + 127) << 23 in
    an int32 buffer read as float32: exp_row), which keeps a loop of these vectorized; libm's expf is a call per
    element."""
    x = min(max(x, np.float32(-87.33654)), np.float32(88.72283))
    fx = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
    x = x - fx * np.float32(0.693359375)
    x = x + fx * np.float32(2.12194440e-4)
    y = np.float32(1.9875691500e-4) * x + np.float32(1.3981999507e-3)
    y = y * x + np.float32(8.3334519073e-3)
    y = y * x + np.float32(4.1665795894e-2)
    y = y * x + np.float32(1.6666665459e-1)
    y = y * x + np.float32(5.0000001201e-1)
    return y * (x * x) + x + np.float32(1.0), fx


@njit(cache=True, nogil=True)
def exp_row(s, r, n, m, ebuf, efl):
    """s[r, :n] <- exp(s[r, :n] - m), 0 where s is -inf (a hidden key), vectorized (expf_parts), 2^k built from its
    bits in ebuf (int32), read through efl (ebuf seen as float32)."""
    for t in range(n):
        p, fx = expf_parts(s[r, t] - m)
        ebuf[t] = (np.int32(fx) + np.int32(127)) << 23
        s[r, t] = p if s[r, t] != -np.inf else np.float32(0.0)
    for t in range(n):
        s[r, t] = s[r, t] * efl[t]


@njit(cache=True, nogil=True, fastmath=_FAST)
def attend(q, qpos, table, alt, ctx, key_pos, has_kpos, window,
            kd, ks1, ks2, kfmt, vd, vs1, vs2, vfmt, akd, aks1, aks2, avd, avs1, avs2,
            dlut, hlut, acc_out, m_out, l_out, w0, wstep):
    """Online softmax over each row's visible keys.

    q [B, Hkv, R, D] fp32 pre-scaled, R = G*Q rows per kv head (row g*Q + i: query i of the head's g-th
    query head); qpos [B, Q] int64; table [B, NB] int64 slots; alt [B, NB] int64: -1, or the block's slot in
    the alternative tier (akd..avs2: the staging buffer or the host tier) where it is read from instead;
    ctx [B]; key_pos [B, S] (has_kpos) else keys sit at their index; window 0: none.
    Writes acc_out [B, Hkv, R, D] (unnormalized), m_out, l_out [B, Hkv, R] (running max, sum; m -inf where
    nothing was visible). Work items w = b*Hkv + h for w in w0, w0 + wstep, ... (one call per thread)."""
    B, Hkv, R, D = q.shape
    Q = qpos.shape[1]
    bs = kd.shape[2]
    NB = table.shape[1]
    for w in range(w0, B * Hkv, wstep):
        b = w // Hkv
        h = w - b * Hkv
        acc = np.zeros((R, D), dtype=np.float32)
        m = np.full(R, -np.inf, dtype=np.float32)
        lsum = np.zeros(R, dtype=np.float32)
        kb = np.empty((bs, D), dtype=np.float32)
        vb = np.empty((bs, D), dtype=np.float32)
        s = np.empty((R, bs), dtype=np.float32)
        vis = np.empty((Q, bs), dtype=np.bool_)
        cum = np.empty(D, dtype=np.float64)
        ebuf = np.empty(bs, dtype=np.int32)
        efl = ebuf.view(np.float32)
        n_ctx = ctx[b]
        qmin = qpos[b, 0]
        qmax = qpos[b, 0]
        for i in range(1, Q):
            qmin = min(qmin, qpos[b, i])
            qmax = max(qmax, qpos[b, i])
        j0 = 0
        j1 = min(NB, (n_ctx + bs - 1) // bs)
        if not has_kpos:  # key i at position i: blocks wholly after every query, or before every window
            j1 = min(j1, qmax // bs + 1)
            if window > 0:
                j0 = max(0, qmin - window + 1) // bs
        for j in range(j0, j1):
            n = min(bs, n_ctx - j * bs)
            seen = False
            for t in range(n):
                kp = key_pos[b, j * bs + t] if has_kpos else j * bs + t
                for i in range(Q):
                    p = qpos[b, i]
                    v_ = kp <= p and (window <= 0 or kp > p - window)
                    vis[i, t] = v_
                    seen = seen or v_
            if not seen:  # no byte of a block no query sees is read
                continue
            a = alt[b, j]
            if a >= 0:  # the block's home for this read: the alternative tier, or the table's
                sl, kdat, k1, k2, vdat, v1, v2 = a, akd, aks1, aks2, avd, avs1, avs2
            else:
                sl, kdat, k1, k2, vdat, v1, v2 = table[b, j], kd, ks1, ks2, vd, vs1, vs2
            if kfmt == 0:  # plain storage: scores straight from the pool's bytes
                for r in range(R):
                    i = r % Q
                    for t in range(n):
                        if vis[i, t]:
                            x = np.float32(0.0)
                            for d in range(D):
                                x += q[b, h, r, d] * to_f32(kdat[sl, h, t, d], dlut)
                            s[r, t] = x
                        else:
                            s[r, t] = -np.inf
            else:
                dequant(kb, n, kdat, k1, k2, sl, h, kfmt, dlut, hlut, cum)
                for r in range(R):
                    i = r % Q
                    for t in range(n):
                        if vis[i, t]:
                            x = np.float32(0.0)
                            for d in range(D):
                                x += q[b, h, r, d] * kb[t, d]
                            s[r, t] = x
                        else:
                            s[r, t] = -np.inf
            for r in range(R):
                bm = -np.inf
                for t in range(n):
                    bm = max(bm, s[r, t])
                if bm == -np.inf:
                    for t in range(n):
                        s[r, t] = 0.0
                    continue
                m_new = max(m[r], bm)
                alpha = np.exp(m[r] - m_new)  # m -inf before the row's first visible key: alpha 0
                if alpha != 1.0:
                    lsum[r] *= alpha
                    for d in range(D):
                        acc[r, d] *= alpha
                m[r] = m_new
                exp_row(s, r, n, m_new, ebuf, efl)  # hidden keys: 0
                tot = np.float32(0.0)
                for t in range(n):
                    tot += s[r, t]
                lsum[r] += tot
            if vfmt == 0:
                for t in range(n):
                    for r in range(R):
                        p_ = s[r, t]
                        if p_ != 0.0:
                            for d in range(D):
                                acc[r, d] += p_ * to_f32(vdat[sl, h, t, d], dlut)
            else:
                dequant(vb, n, vdat, v1, v2, sl, h, vfmt, dlut, hlut, cum)
                for t in range(n):
                    for r in range(R):
                        p_ = s[r, t]
                        if p_ != 0.0:
                            for d in range(D):
                                acc[r, d] += p_ * vb[t, d]
        for r in range(R):
            m_out[b, h, r] = m[r]
            l_out[b, h, r] = lsum[r]
            for d in range(D):
                acc_out[b, h, r, d] = acc[r, d]


@njit(cache=True, nogil=True, parallel=True)
def attend_threads(q, qpos, table, alt, ctx, key_pos, has_kpos, window,
                   kd, ks1, ks2, kfmt, vd, vs1, vs2, vfmt, akd, aks1, aks2, avd, avs1, avs2,
                   dlut, hlut, acc_out, m_out, l_out, n):
    """attend over n threads (numba's pool, as the packed weights' matmuls use): thread i takes work items
    i, i + n, ... One launch from compiled code instead of a Python thread pool's submit and wait per layer."""
    for i in prange(n):
        attend(q, qpos, table, alt, ctx, key_pos, has_kpos, window, kd, ks1, ks2, kfmt, vd, vs1, vs2, vfmt,
               akd, aks1, aks2, avd, avs1, avs2, dlut, hlut, acc_out, m_out, l_out, i, n)


@njit(inline="always")
def _block_span(b, j, lo, hi, bs, alt, table):
    """Block j of row b in a pass over keys [lo, hi): (read from the alternative tier?, its slot there or in the
    table, its first and past-last token in the range)."""
    a = alt[b, j]
    return a >= 0, a if a >= 0 else table[b, j], max(lo, j * bs) - j * bs, min(hi, j * bs + bs) - j * bs


@njit(cache=True, nogil=True, fastmath=_FAST)
def _decode_part(q, scale, b, G, lo, hi, table, alt, kd, vd, akd, avd, dlut, acc, mo, lo_, seg, S, fns):
    """Sequence b's keys [lo, hi), every kv head, in two passes: every score first into a buffer (K read once, no
    per-key visibility test: the range is the visible one), one max and one exp per score, then V read once (no
    per-block rescaling of the sums, as attend's online softmax does). A block's heads are read together (the
    slot's K, then its V, are one contiguous run: a stream the prefetcher follows). Writes item (b, h)'s segment
    seg of S: acc [U, G, D] unnormalized, mo [U, G] max score, lo_ [U, G] sum of exp(score - max), U = b*Hkv*S +
    h*S + seg; scores are q . k * scale (q [B, H, D] as the model gives it, unscaled). fns: the block loops of
    engine/attention/attn_ir.py for this data's format ([kscore, vacc, softmax] addresses: a row of
    attn_ir.kernels), or zeros: the loops below."""
    D = q.shape[2]
    Hkv = kd.shape[1]
    bs = kd.shape[2]
    L = hi - lo
    for h in range(Hkv):
        u = (b * Hkv + h) * S + seg
        for r in range(G):
            mo[u, r] = -np.inf
            lo_[u, r] = 0.0
            for d in range(D):
                acc[u, r, d] = 0.0
    if L <= 0:
        return
    qs = np.empty((Hkv, G, D), dtype=np.float32)
    for h in range(Hkv):
        for r in range(G):
            for d in range(D):
                qs[h, r, d] = q[b, h * G + r, d] * scale
    s = np.empty((Hkv * G, L), dtype=np.float32)
    kf, vf, sf, isz = fns[0], fns[1], fns[2], kd.itemsize
    ebuf = np.empty(L if sf == 0 else 0, dtype=np.int32)  # exp_row's 2^k (the softmax kernel needs none)
    efl = ebuf.view(np.float32)
    for j in range(lo // bs, (hi + bs - 1) // bs):
        on_alt, sl, t0, t1 = _block_span(b, j, lo, hi, bs, alt, table)
        kdat = akd if on_alt else kd
        if kf != 0:
            for h in range(Hkv):
                _call_ir(kf, (np.int64(qs.ctypes.data + h * G * D * 4),
                              np.int64(kdat.ctypes.data + ((sl * Hkv + h) * bs + t0) * D * isz), np.int64(t1 - t0),
                              np.int64(s.ctypes.data + (h * G * L + j * bs + t0 - lo) * 4), np.int64(L)))
            continue
        for h in range(Hkv):
            for t in range(t0, t1):
                c = j * bs + t - lo
                for r in range(G):
                    x = np.float32(0.0)
                    for d in range(D):
                        x += qs[h, r, d] * to_f32(kdat[sl, h, t, d], dlut)
                    s[h * G + r, c] = x
    for h in range(Hkv):
        u = (b * Hkv + h) * S + seg
        for r in range(G):
            row = h * G + r
            if sf != 0:  # the same max, exps and sum, as vector code
                _call_ir(sf, (np.int64(s.ctypes.data + row * L * 4), np.int64(L),
                              np.int64(mo.ctypes.data + (u * G + r) * 4), np.int64(lo_.ctypes.data + (u * G + r) * 4)))
                continue
            mx = s[row, 0]
            for c in range(1, L):
                mx = max(mx, s[row, c])
            exp_row(s, row, L, mx, ebuf, efl)
            tot = np.float32(0.0)
            for c in range(L):
                tot += s[row, c]
            mo[u, r] = mx
            lo_[u, r] = tot
    for j in range(lo // bs, (hi + bs - 1) // bs):
        on_alt, sl, t0, t1 = _block_span(b, j, lo, hi, bs, alt, table)
        vdat = avd if on_alt else vd
        if vf != 0:
            for h in range(Hkv):
                u = (b * Hkv + h) * S + seg
                _call_ir(vf, (np.int64(s.ctypes.data + (h * G * L + j * bs + t0 - lo) * 4), np.int64(L),
                              np.int64(vdat.ctypes.data + ((sl * Hkv + h) * bs + t0) * D * isz), np.int64(t1 - t0),
                              np.int64(acc.ctypes.data + u * G * D * 4)))
            continue
        for h in range(Hkv):
            u = (b * Hkv + h) * S + seg
            for t in range(t0, t1):
                c = j * bs + t - lo
                for r in range(G):
                    p_ = s[h * G + r, c]
                    for d in range(D):
                        acc[u, r, d] += p_ * to_f32(vdat[sl, h, t, d], dlut)


@njit(cache=True, nogil=True, parallel=True)
def decode_plain(q, scale, qpos, table, alt, ctx, window, kd, vd, akd, avd, dlut, out, S, fns):
    """Decode attention over plain storage, normalized: out [B, H, D] fp32 for q [B, H, D] (one query per
    sequence at qpos[b, 0], keys at their index, [lo, hi) visible). Each sequence's keys are cut into S segments
    (work units (b, segment): a batch of one still gives every thread equal work: split-K, as flash-decoding),
    then the segments' partial softmaxes are merged. A row with no visible key gets zeros. fns: _decode_part's."""
    B, H, D = q.shape
    Hkv = kd.shape[1]
    G = H // Hkv
    U = B * Hkv * S
    pacc = np.empty((U, G, D), dtype=np.float32)
    pm = np.empty((U, G), dtype=np.float32)
    pl = np.empty((U, G), dtype=np.float32)
    for w in prange(B * S):
        b = w // S
        seg = w - b * S
        p = qpos[b, 0]
        hi = min(ctx[b], p + 1)
        lo = max(0, p - window + 1) if window > 0 else 0
        L = max(0, hi - lo)
        _decode_part(q, scale, b, G, lo + L * seg // S, lo + L * (seg + 1) // S, table, alt, kd, vd, akd, avd,
                     dlut, pacc, pm, pl, seg, S, fns)
    for item in range(B * Hkv):
        b = item // Hkv
        h = item - b * Hkv
        for r in range(G):
            mx = -np.inf
            for seg in range(S):
                mx = max(mx, pm[item * S + seg, r])
            tot = np.float32(0.0)
            for d in range(D):
                out[b, h * G + r, d] = 0.0
            if mx == -np.inf:
                continue
            for seg in range(S):
                u = item * S + seg
                f = np.float32(np.exp(pm[u, r] - mx)) if pm[u, r] != -np.inf else np.float32(0.0)
                tot += pl[u, r] * f
                for d in range(D):
                    out[b, h * G + r, d] += pacc[u, r, d] * f
            inv = np.float32(1.0) / tot
            for d in range(D):
                out[b, h * G + r, d] *= inv
