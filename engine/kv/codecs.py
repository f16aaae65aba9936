"""Storage formats of cached K/V, and how tokens are appended to them.

A tier stores, for K and for V, a dict of "parts", each one tensor per layer (`Layers`), indexed [layer][block, ...]:
`data` [L][N, kv_heads, block_size, head_dim] always; per format:

| codec            | formats                   | parts besides `data`                                               |
|------------------|---------------------------|--------------------------------------------------------------------|
| `Codec`          | fp32, fp16, bf16          | none                                                               |
| `TokenCodec`     | int8, fp8 (K and V); int8-kivi and int8-delta values | `scale` [L, N, H, bs] fp16: one per token and head |
| `ChannelCodec`   | int8-kivi keys            | `scale` [L, N, H, D] fp16 per channel of the block, `tscale` [L, N, H, bs] fp16 per token |
| `DeltaCodec`     | int8-delta keys           | `anchor` [L, N, H, D] fp16 (token 0), `scale` [L, N, H, bs] fp16 per token's step |

Appending is the hot path (`append`): a token's codes and scales are computed from the token alone (and, for
the block-scoped parts, from what the block already holds, which is read and never rewritten), so appending one
token never re-encodes its block. `encode` writes whole blocks (relayout, restores) and stores exactly what
appending their tokens one by one would.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.config import KVDtype
from engine import hugepages

class Layers(list):
    """A part's tensors, one per layer: `parts[name][layer]` is layer `layer`'s [N, ...] tensor.

    One tensor per layer, not one [L, N, ...] tensor, so that a re-lay can replace a tier's storage a layer at a
    time (engine/kv/relayout.py: the old layer is freed as soon as the new one is written, so a change holds one
    layer's worth of memory beside the tier, not a second tier), and so that layers can sit on different devices.
    An entry is None while a re-lay has not allocated it yet (or has freed it). `[:, ...]` reads every layer
    stacked (a copy) and `[:, ...] = x` writes every layer: for tests and checks, never on a hot path.
    """

    def _any(self) -> torch.Tensor:
        """A layer that is allocated (during a re-lay some are not)."""
        return next(t for t in self if t is not None)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self._any().shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._any().dtype

    @property
    def device(self) -> torch.device:
        return self._any().device

    def is_pinned(self) -> bool:
        t = self._any()
        return t.device.type == "cpu" and t.is_pinned()

    def nbytes(self) -> int:
        """Bytes allocated for the layers that are (None ones: nothing)."""
        return sum(t.numel() * t.element_size() for t in self if t is not None)

    def stacked(self) -> torch.Tensor:
        """Every layer in one [L, N, ...] tensor (a copy)."""
        return torch.stack(list(self))

    def layer_ptrs(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self)

    def __getitem__(self, idx):
        if isinstance(idx, tuple) and idx and idx[0] == slice(None):
            return torch.stack([t[idx[1:]] for t in self])
        return super().__getitem__(idx)

    def __setitem__(self, idx, value):
        if isinstance(idx, tuple) and idx and idx[0] == slice(None):
            for layer, t in enumerate(self):
                t[idx[1:]] = value[layer] if isinstance(value, torch.Tensor) and value.dim() > 0 else value
            return
        super().__setitem__(idx, value)


Parts = dict[str, Layers]


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv_heads: int
    block_size: int
    head_dim: int


@dataclass(frozen=True)
class Appends:
    """Where a step's T new tokens go: the distinct blocks written (U) and each token's place among them.

    Writes are appends, so `prev_fill[u]` tokens of block u were valid before the step (0: the block is new)
    and the step's tokens for it sit at offsets prev_fill[u], prev_fill[u] + 1, ... in order.
    """

    slots: torch.Tensor  # [T] slot of each token's block (the slot_mapping, with offsets)
    offsets: torch.Tensor  # [T] offset of each token in its block
    wslots: torch.Tensor  # [U] distinct slots written
    tok_block: torch.Tensor  # [T] index into wslots
    prev_fill: torch.Tensor  # [U] int64
    rank: torch.Tensor  # [T] offset - prev_fill of the token's block: 0 for the first token a block gets this step
    max_rank: int  # most tokens any one block gets this step, minus 1
    rows: torch.Tensor | None = None  # [T] the step's rows these tokens are (when a step's writes span two tiers)

    def with_rows(self, rows: torch.Tensor) -> "Appends":
        return dataclasses.replace(self, rows=rows)

    def to(self, device: torch.device) -> "Appends":
        """The same appends with every index on `device` (a layer kept in host memory, device_layers)."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})

    @staticmethod
    def of(slots: torch.Tensor, offsets: torch.Tensor, wslots: torch.Tensor, tok_block: torch.Tensor,
           prev_fill: torch.Tensor, max_rank: int) -> "Appends":
        return Appends(slots, offsets, wslots, tok_block, prev_fill, offsets - prev_fill[tok_block], max_rank)

    @staticmethod
    def whole_blocks(slots: torch.Tensor, block_size: int) -> "Appends":
        """Every token of blocks `slots` [n], written from offset 0 (what `encode` appends)."""
        n, dev = len(slots), slots.device
        off = torch.arange(block_size, device=dev).repeat(n)
        tb = torch.arange(n, device=dev).repeat_interleave(block_size)
        return Appends(slots[tb], off, slots, tb, torch.zeros(n, dtype=torch.long, device=dev), off, block_size - 1)


class Codec:
    """Plain storage: data cast to `storage`."""

    storage: torch.dtype = torch.float32

    def __init__(self, storage: torch.dtype | None = None):
        if storage is not None:
            self.storage = storage

    def parts_shapes(self, g: Geometry, n: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"data": ((g.layers, n, g.kv_heads, g.block_size, g.head_dim), self.storage)}

    def block_bytes(self, g: Geometry) -> dict[str, int]:
        """Bytes one block takes in each part (all layers)."""
        out = {}
        for name, (shape, dtype) in self.parts_shapes(g, 1).items():
            numel = 1
            for s in shape:
                numel *= s
            out[name] = numel * _itemsize(dtype)
        return out

    def alloc(self, g: Geometry, n: int, device: torch.device, pin: bool, layers: bool = True) -> Parts:
        """Parts for n blocks; `layers=False`: no layer allocated yet (every entry None, see `alloc_layer`)."""
        parts = {name: Layers([None] * g.layers) for name in self.parts_shapes(g, n)}
        if layers:
            for layer in range(g.layers):
                self.alloc_layer(parts, g, n, layer, device, pin)
        return parts

    def alloc_layer(self, parts: Parts, g: Geometry, n: int, layer: int, device: torch.device, pin: bool) -> None:
        """Allocate layer `layer` of every part (zeroed)."""
        for name, (shape, dtype) in self.parts_shapes(g, n).items():
            # Zeroed, not empty: padded gathers read unused slots, and stale NaN there would leak
            # through a masked softmax.
            if torch.device(device).type == "cpu" and not pin:
                parts[name][layer] = _lazy_zeros(shape[1:], dtype)
            else:  # CUDA memory and pinned host memory are committed when allocated: no lazy zeros there
                parts[name][layer] = torch.zeros(shape[1:], dtype=dtype, device=device, pin_memory=pin)

    def decode(self, parts: Parts, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """fp32 [*slots.shape, kv_heads, block_size, head_dim], on the layer's device."""
        return self._decode(parts, layer, slots.to(parts["data"][layer].device))  # a layer may sit in host memory

    def _decode(self, parts: Parts, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return parts["data"][layer][slots].float()

    def append(self, parts: Parts, layer: int, a: Appends, x: torch.Tensor) -> None:
        """Write tokens x [T, kv_heads, head_dim] at (a.slots, a.offsets): one scatter per part."""
        parts["data"][layer][a.slots, :, a.offsets] = x.to(self.storage)

    def encode(self, parts: Parts, layer: int, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Write whole blocks x (fp32 [n, kv_heads, block_size, head_dim]) into `slots` [n], as appended from empty."""
        bs = x.shape[2]
        a = Appends.whole_blocks(slots, bs)
        self.append(parts, layer, a, x.permute(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3]))


class TokenCodec(Codec):
    """One scale per token and head (int8, fp8; KIVI's value layout): data * scale[token]."""

    storage = torch.int8
    qmax = 127.0

    def __init__(self, storage: torch.dtype | None = None):
        super().__init__(storage)
        self.qmax = 127.0 if self.storage == torch.int8 else 448.0  # e4m3fn's largest finite value

    def parts_shapes(self, g: Geometry, n: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"data": ((g.layers, n, g.kv_heads, g.block_size, g.head_dim), self.storage),
                "scale": ((g.layers, n, g.kv_heads, g.block_size), torch.float16)}

    def _decode(self, parts: Parts, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return parts["data"][layer][slots].float() * parts["scale"][layer][slots].float()[..., None]

    def append(self, parts: Parts, layer: int, a: Appends, x: torch.Tensor) -> None:
        x = x.float()
        scale = fp16_ceil(x.abs().amax(dim=-1) / self.qmax)  # [T, H]
        parts["scale"][layer][a.slots, :, a.offsets] = scale
        parts["data"][layer][a.slots, :, a.offsets] = self.quantize(x / scale.float()[..., None])

    def quantize(self, y: torch.Tensor) -> torch.Tensor:
        if self.storage == torch.int8:
            return y.round_().clamp_(-127, 127).to(torch.int8)
        return y.to(self.storage)


class ChannelCodec(TokenCodec):
    """Keys with a scale per channel of the block (KIVI's key layout) times a scale per token: data * c[d] * t[token].

    After RoPE a few channels carry most of a key's magnitude; a scale per token alone is set by them and
    leaves the others a handful of levels. The channel scales `c` are fixed when the block gets its first
    tokens: each channel's largest magnitude among them, floored at the median channel's (one token's
    near-zero channel must not get a near-zero scale that every later token then overflows). Each token's
    scale `t` then fits that token to c, so a later, louder token costs only its own precision and no token
    is ever re-encoded.
    """

    def parts_shapes(self, g: Geometry, n: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"data": ((g.layers, n, g.kv_heads, g.block_size, g.head_dim), torch.int8),
                "scale": ((g.layers, n, g.kv_heads, g.head_dim), torch.float16),
                "tscale": ((g.layers, n, g.kv_heads, g.block_size), torch.float16)}

    def _decode(self, parts: Parts, layer: int, slots: torch.Tensor) -> torch.Tensor:
        c = parts["scale"][layer][slots].float()[..., None, :]  # [..., H, 1, D]
        t = parts["tscale"][layer][slots].float()[..., None]  # [..., H, bs, 1]
        return parts["data"][layer][slots].float() * c * t

    def append(self, parts: Parts, layer: int, a: Appends, x: torch.Tensor) -> None:
        x = x.float()
        mag = x.abs()  # [T, H, D]
        U, (H, D) = len(a.wslots), x.shape[1:]
        amax = torch.zeros((U, H, D), device=x.device).scatter_reduce_(0, a.tok_block[:, None, None].expand_as(mag), mag, "amax")
        floor = amax.median(dim=-1, keepdim=True).values
        fresh = fp16_ceil(torch.maximum(amax, floor).clamp_min(1e-30))  # [U, H, D]
        new = (a.prev_fill == 0)[:, None, None]
        c = torch.where(new, fresh, parts["scale"][layer][a.wslots])  # blocks with tokens keep their channel scales
        parts["scale"][layer][a.wslots] = c
        ct = c.float()[a.tok_block]  # [T, H, D]
        t = fp16_ceil((mag / ct).amax(dim=-1) / self.qmax)  # [T, H]
        parts["tscale"][layer][a.slots, :, a.offsets] = t
        parts["data"][layer][a.slots, :, a.offsets] = self.quantize(x / (ct * t.float()[..., None]))


class DeltaCodec(TokenCodec):
    """Keys as closed-loop deltas: token t stores round((k_t - k̂_{t-1}) / s_t), k̂ the reconstruction, s_t its
    own step scale; token 0 of each block is kept in fp16 (`anchor`).

    Closing the loop on the reconstruction keeps each token's error within s_t / 2 instead of letting it
    random-walk along the block; a step scale per token means appending reads the block's last
    reconstruction and writes only the new token.
    """

    def parts_shapes(self, g: Geometry, n: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        shapes = super().parts_shapes(g, n)
        shapes["anchor"] = ((g.layers, n, g.kv_heads, g.head_dim), torch.float16)
        return shapes

    def _decode(self, parts: Parts, layer: int, slots: torch.Tensor) -> torch.Tensor:
        steps = parts["data"][layer][slots].float() * parts["scale"][layer][slots].float()[..., None]  # [..., H, B, D]
        steps[..., 0, :] = 0
        anchor = parts["anchor"][layer][slots].float()[..., None, :]  # [..., H, 1, D]
        return anchor + torch.cumsum(steps, dim=-2)

    def append(self, parts: Parts, layer: int, a: Appends, x: torch.Tensor) -> None:
        x = x.float()
        U = len(a.wslots)
        # Each block's reconstruction so far as decode computes it, anchor + running sum of steps (the same fp32
        # additions in the same order), taken at its last valid token: read, never rewritten.
        w = a.wslots
        steps = parts["data"][layer][w].float() * parts["scale"][layer][w].float()[..., None]  # [U, H, bs, D]
        steps[:, :, 0] = 0
        last = (a.prev_fill - 1).clamp_min(0)
        has = (a.prev_fill > 0)[:, None, None]
        csum = torch.where(has, torch.cumsum(steps, dim=2)[torch.arange(U, device=x.device), :, last], 0.0)
        anc = torch.where(has, parts["anchor"][layer][w].float(), 0.0)
        # No host sync when each block gets one token (decode: CUDA-graph capturable); prefill loops over ranks.
        for r in range(a.max_rank + 1):  # sequential by construction: each delta is taken from the reconstruction
            sel = None if a.max_rank == 0 else torch.nonzero(a.rank == r).flatten()
            pick = (lambda t: t) if sel is None else (lambda t: t[sel])
            u, xs, slots, offs = pick(a.tok_block), pick(x), pick(a.slots), pick(a.offsets)  # [n], [n, H, D], [n], [n]
            first = (offs == 0)[:, None, None]
            x16 = xs.to(torch.float16)
            parts["anchor"][layer][slots] = torch.where(first, x16, parts["anchor"][layer][slots])
            anc[u] = torch.where(first, x16.float(), anc[u])
            d = xs - (anc[u] + csum[u])
            s = fp16_ceil(d.abs().amax(dim=-1) / self.qmax)  # [n, H]
            q = torch.where(first, 0.0, (d / s.float()[..., None]).round_().clamp_(-127, 127))
            parts["scale"][layer][slots, :, offs] = s
            parts["data"][layer][slots, :, offs] = q.to(torch.int8)
            csum[u] = csum[u] + q * s.float()[..., None]


def fp16_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 at or above x (fp32), within fp16's normal range [2^-14, 65504].

    A stored scale always covers the values it was computed from, and a value already in fp16 maps to itself, so
    decoding and encoding again gives back the same codes and scales.
    """
    x = x.float().clamp(2.0**-14, 65504.0)
    h = x.to(torch.float16)
    return torch.where(h.float() < x, (h.view(torch.int16) + 1).view(torch.float16), h)  # no host sync


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """CPU zeros committed as they are first written; a layer of hugepages.POOL_MIN or more on 2 MiB pages where the
    system allows (engine/hugepages.py: a decode step's scattered block reads miss the TLB less)."""
    return hugepages.zeros(shape, dtype, min_bytes=hugepages.POOL_MIN)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


_FP8 = getattr(torch, "float8_e4m3fn", torch.float32)


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
        return TokenCodec(), TokenCodec()
    if dtype is KVDtype.INT8_DELTA:
        return DeltaCodec(), TokenCodec()
    if dtype is KVDtype.FP8:
        return TokenCodec(_FP8), TokenCodec(_FP8)
    if dtype is KVDtype.INT8_KIVI:
        return ChannelCodec(), TokenCodec()
    raise ValueError(dtype)
