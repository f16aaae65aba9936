"""CPU matmul kernels for weight-only quantized linear layers (engine/model/quant.py), compiled with numba.

torch's own packed kernels (aten._weight_int8pack_mm, _weight_int4pack_mm_for_cpu) are vectorized for AVX-512;
on an AVX2 CPU (this machine's AMD EPYC) they run 2-3x slower than the fp32 matmul they would replace (measured:
SmolLM2's 49152 x 576 head, one row: fp32 11.5 ms, int8 27 ms, int4 42 ms), so the CPU path is these loops
instead: each reads the packed weight once per call and never writes a dequantized copy.

Layouts (N output rows, K inputs, G = K / group groups per row, both parts row-major):
  int8: q [N, K] int8; w[n, k] = scale[n, g] * q[n, k] + zero[n, g], g = k // group.
  int4: q [N, K / 2] uint8, per group of 32 inputs 16 bytes: byte j's low nibble is input 32g + j, its high
        nibble input 32g + 16 + j (GGUF's Q4_0 / Q4_1 block order); w[n, k] = scale[n, g] * nib + zero[n, g].
The zero term is folded per group: sum_k w x = scale * sum_k q x + zero * sum_k x, with sum_k x per group computed
once per call. Rows are split over threads (prange); each output is one float32 accumulator per group.
"""

from __future__ import annotations

import numpy as np

try:
    import numba
    from numba import njit, prange
except Exception:  # numba missing or broken: quant.py falls back to dequantize-and-matmul (slow, still exact)
    numba = None

AVAILABLE = numba is not None

if AVAILABLE:

    @njit(inline="always")
    def _dot_rows(w, x, out, n):  # pragma: no cover - compiled
        """out[b, n] = w . x[b] for every row b of x (w: one dequantized weight row, in L1)."""
        for b in range(x.shape[0]):
            acc = np.float32(0.0)
            for k in range(w.shape[0]):
                acc += w[k] * x[b, k]
            out[b, n] = acc

    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def _int8_mm(x, q, scale, zero, group, out):  # pragma: no cover - compiled
        K = x.shape[1]
        for n in prange(q.shape[0]):
            w = np.empty(K, dtype=np.float32)  # row n dequantized, reused by every row of x
            for g in range(K // group):
                s, z, base = scale[n, g], zero[n, g], g * group
                for k in range(group):
                    w[base + k] = s * np.float32(q[n, base + k]) + z
            _dot_rows(w, x, out, n)

    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def _int4_mm(x, q, scale, zero, half, out):  # pragma: no cover - compiled
        # half = 16, passed at run time: with a constant trip count LLVM unrolls the group loop into scalar code
        K = x.shape[1]
        for n in prange(q.shape[0]):
            w = np.empty(K, dtype=np.float32)
            for g in range(K // (2 * half)):
                s, z, base, at = scale[n, g], zero[n, g], g * 2 * half, g * half
                for j in range(half):  # int32 arithmetic: what AVX2 converts to float 8 at a time
                    w[base + j] = s * np.float32(np.int32(q[n, at + j]) & np.int32(15)) + z
                for j in range(half):
                    w[base + half + j] = s * np.float32(np.int32(q[n, at + j]) >> np.int32(4)) + z
            _dot_rows(w, x, out, n)

    @njit(inline="always")
    def _group_sums(x, group):  # pragma: no cover - compiled
        """[G] sums of x[0]'s groups: the zero term of every row is zero . these."""
        G = x.shape[1] // group
        xs = np.empty(G, dtype=np.float32)
        for g in range(G):
            s = np.float32(0.0)
            for k in range(g * group, (g + 1) * group):
                s += x[0, k]
            xs[g] = s
        return xs

    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def _int8_mv(x, q, scale, zero, group, out):  # pragma: no cover - compiled
        """One row of x: lane-wise accumulators across groups (scale folded per group), one horizontal sum a row."""
        G = x.shape[1] // group
        xs = _group_sums(x, group)
        for n in prange(q.shape[0]):
            acc = np.zeros(group, dtype=np.float32)
            for g in range(G):
                s, base = scale[n, g], g * group
                for j in range(group):
                    acc[j] += s * (np.float32(q[n, base + j]) * x[0, base + j])
            t = np.float32(0.0)
            for j in range(group):
                t += acc[j]
            for g in range(G):
                t += zero[n, g] * xs[g]
            out[0, n] = t

    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def _int4_mv(x, q, scale, zero, half, out):  # pragma: no cover - compiled
        G = x.shape[1] // (2 * half)
        xs = _group_sums(x, 2 * half)
        for n in prange(q.shape[0]):
            acc = np.zeros(2 * half, dtype=np.float32)
            for g in range(G):
                s, base, at = scale[n, g], g * 2 * half, g * half
                for j in range(half):
                    b = np.int32(q[n, at + j])
                    acc[j] += s * (np.float32(b & np.int32(15)) * x[0, base + j])
                    acc[half + j] += s * (np.float32(b >> np.int32(4)) * x[0, base + half + j])
            t = np.float32(0.0)
            for j in range(2 * half):
                t += acc[j]
            for g in range(G):
                t += zero[n, g] * xs[g]
            out[0, n] = t

    @njit(inline="always")
    def _int8_row(q, scale, zero, group, r, dst):  # pragma: no cover - compiled
        """dst = row r of the dequantized int8 weight."""
        for g in range(q.shape[1] // group):
            s, z, base = scale[r, g], zero[r, g], g * group
            for k in range(base, base + group):
                dst[k] = s * np.float32(q[r, k]) + z

    @njit(inline="always")
    def _int4_row(q, scale, zero, half, r, dst):  # pragma: no cover - compiled
        """dst = row r of the dequantized int4 weight (half = 16, at run time: see _int4_mm)."""
        for g in range(q.shape[1] // half):
            s, z, base, at = scale[r, g], zero[r, g], g * 2 * half, g * half
            for j in range(half):
                dst[base + j] = s * np.float32(np.int32(q[r, at + j]) & np.int32(15)) + z
            for j in range(half):
                dst[base + half + j] = s * np.float32(np.int32(q[r, at + j]) >> np.int32(4)) + z

    @njit(parallel=True, cache=True, nogil=True)
    def _int8_rows(q, scale, zero, group, ids, out):  # pragma: no cover - compiled
        """Embedding lookup: rows ids of the dequantized weight."""
        for i in prange(ids.shape[0]):
            _int8_row(q, scale, zero, group, ids[i], out[i])

    @njit(parallel=True, cache=True, nogil=True)
    def _int4_rows(q, scale, zero, ids, out):  # pragma: no cover - compiled
        half = ids.shape[0] * 0 + 16  # a run-time 16: a constant trip count is unrolled into scalar code
        for i in prange(ids.shape[0]):
            _int4_row(q, scale, zero, half, ids[i], out[i])

    @njit(inline="always")
    def _bf16_bits(row, out, i):  # pragma: no cover - compiled
        """out[i] = row (float32) rounded to bfloat16, as bits: to nearest, ties to even (torch's rounding)."""
        bits = row.view(np.uint32)
        for k in range(bits.shape[0]):
            b = bits[k]
            out[i, k] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))

    @njit(parallel=True, cache=True, nogil=True)
    def _int8_rows_bf16(q, scale, zero, group, ids, out):  # pragma: no cover - compiled
        """_int8_rows into bfloat16 bits (uint16): a prompt chunk's bf16 gemm operand without an fp32 copy."""
        for i in prange(ids.shape[0]):
            row = np.empty(q.shape[1], dtype=np.float32)
            _int8_row(q, scale, zero, group, ids[i], row)
            _bf16_bits(row, out, i)

    @njit(parallel=True, cache=True, nogil=True)
    def _int4_rows_bf16(q, scale, zero, ids, out):  # pragma: no cover - compiled
        half = ids.shape[0] * 0 + 16
        for i in prange(ids.shape[0]):
            row = np.empty(q.shape[1] * 2, dtype=np.float32)
            _int4_row(q, scale, zero, half, ids[i], row)
            _bf16_bits(row, out, i)


def int8_mm(x: np.ndarray, q: np.ndarray, scale: np.ndarray, zero: np.ndarray, group: int) -> np.ndarray:
    out = np.empty((x.shape[0], q.shape[0]), dtype=np.float32)
    (_int8_mv if x.shape[0] == 1 else _int8_mm)(x, q, scale, zero, group, out)
    return out


def int4_mm(x: np.ndarray, q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    out = np.empty((x.shape[0], q.shape[0]), dtype=np.float32)
    (_int4_mv if x.shape[0] == 1 else _int4_mm)(x, q, scale, zero, 16, out)
    return out


def int8_rows(q, scale, zero, group, ids) -> np.ndarray:
    out = np.empty((ids.shape[0], q.shape[1]), dtype=np.float32)
    _int8_rows(q, scale, zero, group, ids, out)
    return out


def int4_rows(q, scale, zero, ids) -> np.ndarray:
    out = np.empty((ids.shape[0], q.shape[1] * 2), dtype=np.float32)
    _int4_rows(q, scale, zero, ids, out)
    return out


def int8_rows_bf16(q, scale, zero, group, ids) -> np.ndarray:
    """int8_rows rounded to bfloat16, as uint16 bits [len(ids), K]."""
    out = np.empty((ids.shape[0], q.shape[1]), dtype=np.uint16)
    _int8_rows_bf16(q, scale, zero, group, ids, out)
    return out


def int4_rows_bf16(q, scale, zero, ids) -> np.ndarray:
    out = np.empty((ids.shape[0], q.shape[1] * 2), dtype=np.uint16)
    _int4_rows_bf16(q, scale, zero, ids, out)
    return out
