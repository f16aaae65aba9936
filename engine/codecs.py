"""Storage formats of cached K/V. Every codec turns whole blocks to and from fp32.

A tier stores, for K and for V, a dict of "parts", each a tensor whose first two dims are
[layers, blocks]: `data` [L, N, kv_heads, block_size, head_dim] always; `scale` [L, N, kv_heads]
for the scaled formats ([L, N, kv_heads, head_dim] per channel for int8-kivi keys, [L, N, kv_heads,
block_size] per token for its values); `anchor` [L, N, kv_heads, head_dim] for delta-encoded keys.
Blocks are encoded whole: appending to a block decodes it, adds the tokens and re-encodes it with
a scale that never shrinks, so codes already written round-trip to themselves.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch

from engine.config import KVDtype

Parts = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv_heads: int
    block_size: int
    head_dim: int


class Codec:
    storage: torch.dtype = torch.float32
    scaled = False
    qmax = 1.0

    def __init__(self, storage: torch.dtype | None = None):
        if storage is not None:
            self.storage = storage

    def parts_shapes(self, g: Geometry, n: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        shapes = {"data": ((g.layers, n, g.kv_heads, g.block_size, g.head_dim), self.storage)}
        if self.scaled:
            shapes["scale"] = ((g.layers, n, g.kv_heads), torch.float32)
        return shapes

    def block_bytes(self, g: Geometry) -> dict[str, int]:
        """Bytes one block takes in each part (all layers)."""
        out = {}
        for name, (shape, dtype) in self.parts_shapes(g, 1).items():
            numel = 1
            for s in shape:
                numel *= s
            out[name] = numel * _itemsize(dtype)
        return out

    def alloc(self, g: Geometry, n: int, device: torch.device, pin: bool) -> Parts:
        parts = {}
        for name, (shape, dtype) in self.parts_shapes(g, n).items():
            # Zeroed, not empty: padded gathers read unused slots, and stale NaN there would leak
            # through a masked softmax.
            if torch.device(device).type == "cpu" and not pin:
                parts[name] = _lazy_zeros(shape, dtype)
            else:  # CUDA memory and pinned host memory are committed when allocated: no lazy zeros there
                parts[name] = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
        return parts

    # -- whole blocks -------------------------------------------------------------------------
    def decode(self, parts: Parts, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """fp32 [*slots.shape, kv_heads, block_size, head_dim]."""
        data = parts["data"][layer][slots].float()
        if self.scaled:
            data = data * parts["scale"][layer][slots][..., None, None]
        return data

    def encode(self, parts: Parts, layer: int, slots: torch.Tensor, x: torch.Tensor, keep_scale: torch.Tensor) -> None:
        """Write x (fp32 [n, kv_heads, block_size, head_dim]) into blocks `slots` [n].

        keep_scale [n] bool: the block already holds tokens, so its scale may only grow.
        """
        if not self.scaled:
            parts["data"][layer][slots] = x.to(self.storage)
            return
        need = x.abs().amax(dim=(-1, -2)) / self.qmax  # [n, kv_heads]
        scale = self._grow(parts["scale"][layer][slots], need, keep_scale)
        parts["scale"][layer][slots] = scale
        parts["data"][layer][slots] = self._quantize(x / scale[..., None, None])

    def scatter(self, parts: Parts, layer: int, slots: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor) -> bool:
        """Fast path: write tokens x [T, kv_heads, head_dim] at (slot, offset) without touching the rest.

        Returns False when the format needs whole-block re-encoding instead.
        """
        if self.scaled:
            return False
        parts["data"][layer][slots, :, offsets] = x.to(self.storage)
        return True

    # -- helpers ------------------------------------------------------------------------------
    @staticmethod
    def _grow(old: torch.Tensor, need: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        old = torch.where(keep[:, None], old, torch.zeros_like(old))
        return torch.maximum(old, need).clamp_min(1e-12)

    def _quantize(self, y: torch.Tensor) -> torch.Tensor:
        return y.to(self.storage)


class Int8Codec(Codec):
    storage = torch.int8
    scaled = True
    qmax = 127.0

    def _quantize(self, y: torch.Tensor) -> torch.Tensor:
        return y.round().clamp_(-127, 127).to(torch.int8)


class Fp8Codec(Codec):
    storage = getattr(torch, "float8_e4m3fn", torch.float32)
    scaled = True
    qmax = 448.0


class DeltaInt8Codec(Int8Codec):
    """Keys as closed-loop deltas: token t stores round((k_t - k̂_{t-1}) / s), k̂ the reconstruction.

    The first token of each block is kept in fp16 (`anchor`) so the scale fits the deltas, not the
    keys; closing the loop on the reconstruction keeps the error of every token within s/2 instead
    of letting it random-walk along the block.
    """

    def parts_shapes(self, g: Geometry, n: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        shapes = super().parts_shapes(g, n)
        shapes["anchor"] = ((g.layers, n, g.kv_heads, g.head_dim), torch.float16)
        return shapes

    def decode(self, parts: Parts, layer: int, slots: torch.Tensor) -> torch.Tensor:
        q = parts["data"][layer][slots].float()  # [..., H, B, D]
        scale = parts["scale"][layer][slots][..., None, None]
        anchor = parts["anchor"][layer][slots].float()[..., None, :]  # [..., H, 1, D]
        steps = q * scale
        steps[..., 0, :] = 0
        return anchor + torch.cumsum(steps, dim=-2)

    def encode(self, parts: Parts, layer: int, slots: torch.Tensor, x: torch.Tensor, keep_scale: torch.Tensor) -> None:
        anchor = x[:, :, 0, :].to(torch.float16)
        need = (x[:, :, 1:, :] - x[:, :, :-1, :]).abs().amax(dim=(-1, -2)) / self.qmax if x.shape[2] > 1 else x.new_zeros(x.shape[:2])
        scale = self._grow(parts["scale"][layer][slots], need, keep_scale)  # [n, H]
        s = scale[..., None]  # [n, H, 1]
        codes = torch.zeros(x.shape, dtype=torch.int8, device=x.device)
        recon = anchor.float()
        for t in range(1, x.shape[2]):  # sequential by construction: each delta is taken from the reconstruction
            q = ((x[:, :, t, :] - recon) / s).round_().clamp_(-127, 127)
            codes[:, :, t, :] = q.to(torch.int8)
            recon = recon + q * s
        parts["anchor"][layer][slots] = anchor
        parts["scale"][layer][slots] = scale
        parts["data"][layer][slots] = codes


class Int8ChannelCodec(Int8Codec):
    """Keys with one scale per channel (head dim), block and head (KIVI's key layout).

    After RoPE a few channels of a key carry most of its magnitude; one scale per head is set by them and
    leaves the other channels a handful of levels. Scales are stored in fp16, rounded up, so a stored scale
    always covers the values it was computed from.
    """

    def parts_shapes(self, g: Geometry, n: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"data": ((g.layers, n, g.kv_heads, g.block_size, g.head_dim), torch.int8),
                "scale": ((g.layers, n, g.kv_heads, g.head_dim), torch.float16)}

    def decode(self, parts: Parts, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return parts["data"][layer][slots].float() * parts["scale"][layer][slots].float()[..., None, :]

    def encode(self, parts: Parts, layer: int, slots: torch.Tensor, x: torch.Tensor, keep_scale: torch.Tensor) -> None:
        need = x.abs().amax(dim=-2) / self.qmax  # [n, H, D]: over the block's tokens
        old = parts["scale"][layer][slots].float()
        old = torch.where(keep_scale[:, None, None], old, torch.zeros_like(old))
        scale = _fp16_up(torch.maximum(old, need))
        parts["scale"][layer][slots] = scale
        parts["data"][layer][slots] = self._quantize(x / scale.float()[..., None, :])


class Int8TokenCodec(Int8Codec):
    """Values with one scale per token and head (KIVI's value layout). A token's codes and scale never
    change once written, so appending tokens takes the scatter fast path: no block is re-encoded."""

    def parts_shapes(self, g: Geometry, n: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"data": ((g.layers, n, g.kv_heads, g.block_size, g.head_dim), torch.int8),
                "scale": ((g.layers, n, g.kv_heads, g.block_size), torch.float16)}

    def decode(self, parts: Parts, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return parts["data"][layer][slots].float() * parts["scale"][layer][slots].float()[..., None]

    def encode(self, parts: Parts, layer: int, slots: torch.Tensor, x: torch.Tensor, keep_scale: torch.Tensor) -> None:
        scale = _fp16_up(x.abs().amax(dim=-1) / self.qmax)  # [n, H, B]
        parts["scale"][layer][slots] = scale
        parts["data"][layer][slots] = self._quantize(x / scale.float()[..., None])

    def scatter(self, parts: Parts, layer: int, slots: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor) -> bool:
        scale = _fp16_up(x.abs().amax(dim=-1) / self.qmax)  # [T, H]
        parts["scale"][layer][slots, :, offsets] = scale
        parts["data"][layer][slots, :, offsets] = self._quantize(x.float() / scale.float()[..., None])
        return True


def _fp16_up(scale: torch.Tensor) -> torch.Tensor:
    """fp16 scales at or above `scale` (fp32), and at least fp16's smallest normal number: rounding to
    nearest after a 2^-10 nudge never lands below, since the rounding error is at most 2^-11 relative."""
    return (scale.clamp(2.0**-14, 6.0e4) * (1 + 2.0**-10)).to(torch.float16)


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """CPU zeros whose memory the OS commits page by page as it is first written, not up front.

    torch.zeros writes every byte (a 16 GB host tier would commit 16 GB at start). A private anonymous
    mapping is zero pages until written. Not numpy's calloc'd zeros: numpy asks for transparent huge pages on
    large arrays, and since a tier is laid out [layers, blocks, ...], the first block written would commit a
    2 MB page in every layer of K and of V (~120 MB per tier on SmolLM2). Bytes reinterpreted as `dtype` (bf16 and fp8
    have no numpy dtype); the mapping lives as long as the tensor.
    """
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)
    nbytes = numel * _itemsize(dtype)
    if hasattr(mmap, "MAP_PRIVATE"):
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:  # Windows: pagefile-backed, also committed lazily
        buf = mmap.mmap(-1, nbytes)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def fp8_supported() -> bool:
    if not hasattr(torch, "float8_e4m3fn"):
        return False
    try:
        torch.ones(2).to(torch.float8_e4m3fn).float()
        return True
    except (RuntimeError, TypeError):
        return False


def codecs_for(dtype: KVDtype) -> tuple[Codec, Codec]:
    """(key codec, value codec)."""
    if dtype is KVDtype.FP32:
        return Codec(), Codec()
    if dtype is KVDtype.FP16:
        return Codec(torch.float16), Codec(torch.float16)
    if dtype is KVDtype.BF16:
        return Codec(torch.bfloat16), Codec(torch.bfloat16)
    if dtype is KVDtype.INT8:
        return Int8Codec(), Int8Codec()
    if dtype is KVDtype.INT8_DELTA:
        return DeltaInt8Codec(), Int8Codec()
    if dtype is KVDtype.FP8:
        return Fp8Codec(), Fp8Codec()
    if dtype is KVDtype.INT8_KIVI:
        return Int8ChannelCodec(), Int8TokenCodec()
    raise ValueError(dtype)
