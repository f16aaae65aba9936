"""Weight-only quantized linear weights (`--weights-dtype int8|int4`): packed integers plus per-group float scales
and zeros, multiplied by kernels that read them packed (engine/model/quant_kernels.py on the CPU; torch's
_weight_int8pack_mm / _weight_int4pack_mm on CUDA), never dequantized into a float copy of the weight.

A weight W [N, K] (N output rows, K inputs) is held as groups of `group` consecutive inputs of one row:
    W[n, k] = scale[n, g] * q[n, k] + zero[n, g],   g = k // group
  int8: q int8 [N, K]. Quantized here per row (group = K, symmetric: zero 0), as gpt-fast and torchao's int8
        weight-only; a GGUF's Q8_0 (group 32), Q5_0 (32, q - 16) and Q6_K (16, its sub-block scales) load exactly.
  int4: q uint8 [N, K/2], two 4-bit values a byte (GGUF Q4_0/Q4_1's order in each group of 32: byte j holds
        input j in its low nibble, input 16 + j in its high one). Quantized here per group of 32, asymmetric
        (scale = (max - min) / 15, zero = min: GGUF's Q4_1); a GGUF's Q4_1 and Q4_K load exactly, Q4_0 as
        scale d, zero -8 d (equal to its d (q - 8) up to one rounding).
Activations and everything else (norms, biases, attention) stay fp32: the weights dtype is fp32 apart from these.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from engine.model import quant_ir, quant_kernels

QUANT_KINDS = ("int8", "int4")
ACTIVATIONS = ("int8", "fp32")  # what the CPU kernels multiply the packed weights by (quant_ir.py)
INT4_GROUP = 32
PREFILL_ROWS = 32  # rows of x from which a matmul dequantizes the weight and runs gemm (prompt chunks)
PREFILL_TILE_BYTES = 32 << 20  # ... when the weight's fp32 copy is at most this (never the LM head's 113 MB)


def _bf16_gemm_is_fast() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX: torch's oneDNN gemm runs 2.5x fp32's; measured
    415 vs 167 GFLOP/s on a Zen 4 core pair); elsewhere bf16 gemm is emulated and slower than fp32."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except Exception:
        return False


BF16_PREFILL = _bf16_gemm_is_fast()


@dataclass
class QuantWeight:
    kind: str  # "int8" or "int4"
    q: torch.Tensor  # int8 [N, K] or uint8 [N, K/2], contiguous
    scale: torch.Tensor  # float32 [N, K/group]
    zero: torch.Tensor  # float32 [N, K/group]
    group: int
    source: str = ""  # where the values came from: "quantized" here, or the GGUF type ("Q4_1", "Q8_0", ...)
    # The CPU kernels' activations (quant_ir.py): "int8" rounds x to int8 per 32 inputs and takes integer dots
    # (llama.cpp's Q8 math, ~1e-2 of a row's largest output), "fp32" multiplies x as it is (exact: the
    # dequantized weight's matmul up to float rounding). Set per model (EngineOptions.quant_activations).
    activations: str = "fp32"
    _cuda: tuple | None = None  # the CUDA kernel's own packing, built on first use there
    _cpu: tuple | None = None  # the IR kernels' (quant_ir.operand, zero-term group), built on first use

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1] * (2 if self.kind == "int4" else 1))

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.zero))

    # -- math ------------------------------------------------------------------------------------
    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] float32 -> x @ W.T [T, N] float32."""
        if x.device.type == "cuda":
            return self._cuda_matmul(x)
        x = x.float().contiguous()
        if not quant_kernels.AVAILABLE:
            return F.linear(x, self.dequantize())  # no numba: correct, slow (a dequantized copy per call)
        N, K = self.shape
        if x.shape[0] >= PREFILL_ROWS and N * K * 4 <= PREFILL_TILE_BYTES:
            # A prompt chunk is compute-bound: the weight dequantized once into a scratch buffer (one layer's
            # matrix, freed after) and multiplied by MKL's gemm, as llama.cpp hands large batches to BLAS. With
            # int8 activations (already approximate) in bf16 where the CPU has bf16 arithmetic: inputs and weights
            # rounded to bf16's 8-bit mantissa, sums in fp32.
            if self.activations == "int8" and BF16_PREFILL:
                return F.linear(x.bfloat16(), self.lookup_bf16(torch.arange(N))).float()
            return F.linear(x, self.lookup(torch.arange(N)))
        xn, q, s, z = x.numpy(), self.q.numpy(), self.scale.numpy(), self.zero.numpy()
        if quant_ir.library() is not None:
            if self._cpu is None:  # (operand or None, the zero term's group: int8 weights with zeros only)
                op = quant_ir.operand(self.kind, q, s, z, self.group, self.activations)
                self._cpu = (op, self.group if self.kind == "int8" and bool((self.zero != 0).any()) else 0)
            if self._cpu[0] is not None:
                return torch.from_numpy(quant_ir.matmul(xn, *self._cpu))
        out = (quant_kernels.int8_mm(xn, q, s, z, self.group) if self.kind == "int8"
               else quant_kernels.int4_mm(xn, q, s, z))
        return torch.from_numpy(out)

    def with_activations(self, activations: str) -> "QuantWeight":
        """This weight (same tensors) with the CPU kernels' activations `activations` (ACTIVATIONS)."""
        if activations not in ACTIVATIONS:
            raise ValueError(f"quantized weights' activations {activations!r} are not one of {', '.join(ACTIVATIONS)}")
        return self if activations == self.activations else replace(self, activations=activations, _cpu=None)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W, dequantized [len(ids), K] float32 (an embedding lookup)."""
        if ids.device.type != "cpu" or not quant_kernels.AVAILABLE:
            return self.take_rows(ids).dequantize()
        i, q, s, z = ids.to(torch.int64).contiguous().numpy(), self.q.numpy(), self.scale.numpy(), self.zero.numpy()
        out = (quant_kernels.int8_rows(q, s, z, self.group, i) if self.kind == "int8"
               else quant_kernels.int4_rows(q, s, z, i))
        return torch.from_numpy(out)

    def lookup_bf16(self, ids: torch.Tensor) -> torch.Tensor:
        """lookup(ids) rounded to bfloat16 (to nearest, ties to even, as Tensor.bfloat16()), computed row by row
        without an fp32 copy of the rows."""
        if ids.device.type != "cpu" or not quant_kernels.AVAILABLE:
            return self.lookup(ids).bfloat16()
        i, q, s, z = ids.to(torch.int64).contiguous().numpy(), self.q.numpy(), self.scale.numpy(), self.zero.numpy()
        bits = (quant_kernels.int8_rows_bf16(q, s, z, self.group, i) if self.kind == "int8"
                else quant_kernels.int4_rows_bf16(q, s, z, i))
        return torch.from_numpy(bits).view(torch.bfloat16)

    def dequantize(self) -> torch.Tensor:
        """W as float32 [N, K]: the reference the kernels are checked against (never used on the hot path)."""
        N, K = self.shape
        vals = unpack_int4(self.q).float() if self.kind == "int4" else self.q.float()
        g = vals.view(N, K // self.group, self.group)
        return (g * self.scale[..., None] + self.zero[..., None]).view(N, K)

    # -- rows ------------------------------------------------------------------------------------
    def take_rows(self, rows: torch.Tensor) -> "QuantWeight":
        """A new weight of rows `rows` (a permutation, a subset) of this one."""
        return replace(self, q=self.q[rows].contiguous(), scale=self.scale[rows].contiguous(),
                       zero=self.zero[rows].contiguous(), _cuda=None, _cpu=None)

    def row_view(self, lo: int, hi: int) -> "QuantWeight":
        """Rows lo..hi sharing this weight's storage (no copy)."""
        return replace(self, q=self.q[lo:hi], scale=self.scale[lo:hi], zero=self.zero[lo:hi], _cuda=None, _cpu=None)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q, self.scale, self.zero

    def to(self, device: torch.device) -> "QuantWeight":
        if self.q.device == torch.device(device):
            return self
        return replace(self, q=self.q.to(device), scale=self.scale.to(device), zero=self.zero.to(device), _cuda=None, _cpu=None)

    def as_int8(self, group: int) -> "QuantWeight":
        """The same values in the int8 layout with groups of `group` (dividing this one's): exact."""
        assert self.group % group == 0
        rep = self.group // group
        q = unpack_int4(self.q) if self.kind == "int4" else self.q
        if self.kind == "int4":  # scale q + zero with q in 0..15 -> scale (q - 8) + (zero + 8 scale): q - 8 fits int8
            return replace(self, kind="int8", q=(q.to(torch.int16) - 8).to(torch.int8),
                           scale=self.scale.repeat_interleave(rep, 1), group=group,
                           zero=(self.zero + 8 * self.scale).repeat_interleave(rep, 1), _cuda=None, _cpu=None)
        return replace(self, scale=self.scale.repeat_interleave(rep, 1), zero=self.zero.repeat_interleave(rep, 1),
                       group=group, _cuda=None, _cpu=None)

    # -- CUDA --------------------------------------------------------------------------------------
    def _cuda_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """torch's CUDA weight-only kernels (gpt-fast's): int4 through tinygemm (_weight_int4pack_mm, bf16
        activations, its dequant (q - 8) scale + zero), int8 through _weight_int8pack_mm (per-row scales only).
        Written to torch 2.13's signatures; not run on this project's CPU-only machines."""
        if self._cuda is None:
            self._cuda = self._pack_cuda()
        if self.kind == "int4":
            packed, sz = self._cuda
            out = torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16).contiguous(), packed, self.group, sz)
            return out.float()
        q, s = self._cuda
        return torch.ops.aten._weight_int8pack_mm(x.float().contiguous(), q, s)

    def prepare_cuda(self) -> None:
        """Build the CUDA kernels' packing now (NotImplementedError for a layout they do not take)."""
        if self._cuda is None:
            self._cuda = self._pack_cuda()

    def _pack_cuda(self) -> tuple:
        N, K = self.shape
        if self.kind == "int8":
            if self.group != K or bool((self.zero != 0).any()):
                raise NotImplementedError("int8 weights on CUDA: torch's _weight_int8pack_mm takes one symmetric "
                                          "scale per row; this weight has groups of "
                                          f"{self.group} (a GGUF's Q8_0/Q6_K/Q5_0): load it as fp32/bf16 instead")
            return self.q, self.scale[:, 0].contiguous()
        nib = unpack_int4(self.q).to(torch.int32)  # [N, K] values 0..15
        # tinygemm's packing takes uint8 [N, K/2] with the even input in the high nibble.
        pairs = nib.view(N, K // 2, 2)
        tiles = next((t for t in (8, 4, 2) if K % (16 * t) == 0), None)  # tinygemm: K in tiles of 16 x innerKTiles
        if tiles is None or N % 8:
            raise NotImplementedError(f"int4 weights on CUDA: tinygemm needs inputs in multiples of 32 and outputs "
                                      f"in multiples of 8; this weight is {N} x {K}")
        packed = torch.ops.aten._convert_weight_to_int4pack((pairs[..., 0] << 4 | pairs[..., 1]).to(torch.uint8),
                                                            tiles)
        sz = torch.stack((self.scale.t(), (self.zero + 8 * self.scale).t()), dim=-1)  # [K/g, N, 2]
        return packed, sz.to(torch.bfloat16).contiguous()


# -- packing ---------------------------------------------------------------------------------------


def unpack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 [N, K] nibble values, in input order (groups of 32: low nibbles, then high)."""
    N, half = q.shape
    g = q.view(N, half // 16, 16)
    return torch.cat((g & 15, g >> 4), dim=-1).view(N, half * 2)


def pack_int4(vals: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values 0..15 -> [N, K/2] (unpack_int4's inverse)."""
    N, K = vals.shape
    g = vals.to(torch.uint8).view(N, K // 32, 32)
    return (g[..., :16] | (g[..., 16:] << 4)).reshape(N, K // 2).contiguous()


def quantize(w: torch.Tensor, kind: str) -> QuantWeight:
    """A float weight [N, K] quantized: int8 per row symmetric, int4 per group of 32 asymmetric (min, max)."""
    w = w.detach().to(device="cpu", dtype=torch.float32)
    N, K = w.shape
    if kind == "int8":
        scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        return QuantWeight("int8", q.contiguous(), scale.contiguous(), torch.zeros_like(scale), K, "quantized")
    if kind != "int4":
        raise ValueError(f"quantized weights kind {kind!r} is not one of {', '.join(QUANT_KINDS)}")
    if K % INT4_GROUP:
        raise ValueError(f"int4 weights need inputs in groups of {INT4_GROUP}; this weight has {K}")
    g = w.view(N, K // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    vals = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).view(N, K)
    return QuantWeight("int4", pack_int4(vals), scale.contiguous(), lo.contiguous(), INT4_GROUP, "quantized")


def can_quantize(w: torch.Tensor, kind: str) -> bool:
    return w.dim() == 2 and (kind == "int8" or w.shape[1] % INT4_GROUP == 0)


def stack_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Weights of the same inputs stacked by rows (q/k/v, gate/up) into one; mixed formats become int8 at the
    smallest group (exact)."""
    kinds = {p.kind for p in parts}
    groups = {p.group for p in parts}
    if len(kinds) > 1 or len(groups) > 1:
        g = min(groups)
        parts = [p.as_int8(g) for p in parts]
    return replace(parts[0], q=torch.cat([p.q for p in parts]), scale=torch.cat([p.scale for p in parts]),
                   zero=torch.cat([p.zero for p in parts]),
                   source="+".join(dict.fromkeys(p.source for p in parts)), _cuda=None, _cpu=None)


def describe(weights: dict) -> str:
    """'int4 (Q4_1 x210, Q8_0 x1)': what the model's packed weights are, for info and snapshots."""
    counts: dict[str, int] = {}
    kinds = set()
    for w in {id(w): w for w in weights.values()}.values():  # a tied head is the embedding: once
        if isinstance(w, QuantWeight):
            kinds.add(w.kind)
            counts[w.source] = counts.get(w.source, 0) + 1
    if not kinds:
        return ""
    return "+".join(sorted(kinds)) + " (" + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) + ")"
