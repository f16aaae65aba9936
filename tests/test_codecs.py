"""The KV storage formats on their own: error bounds, scale growth, and the scatter fast path."""

from __future__ import annotations

import torch

from engine.codecs import Geometry, Int8ChannelCodec, Int8Codec, Int8TokenCodec, codecs_for
from engine.config import KVDtype

G = Geometry(layers=2, kv_heads=3, block_size=8, head_dim=16)


def _keys_with_outlier_channels(n: int, seed: int = 0) -> torch.Tensor:
    """[n, H, B, D] keys whose channels 0 and 5 are ~50x larger than the rest, as RoPE'd keys often are."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, G.kv_heads, G.block_size, G.head_dim, generator=g)
    x[..., [0, 5]] *= 50
    return x


def _roundtrip(codec, x: torch.Tensor) -> torch.Tensor:
    parts = codec.alloc(G, len(x), torch.device("cpu"), False)
    slots = torch.arange(len(x))
    codec.encode(parts, 1, slots, x, torch.zeros(len(x), dtype=torch.bool))
    return codec.decode(parts, 1, slots), parts


def test_per_channel_key_scales_keep_the_small_channels():
    x = _keys_with_outlier_channels(6)
    small = [c for c in range(G.head_dim) if c not in (0, 5)]
    per_head, _ = _roundtrip(Int8Codec(), x)
    per_channel, parts = _roundtrip(Int8ChannelCodec(), x)
    err_head = (per_head - x)[..., small].abs().mean()
    err_chan = (per_channel - x)[..., small].abs().mean()
    assert err_chan < err_head / 10, (float(err_chan), float(err_head))
    # Every element within half a step of its own channel's scale (the fp16 scale is rounded up, never down).
    scale = parts["scale"][1].float()[:, :, None, :]
    assert ((per_channel - x).abs() <= scale / 2 + 1e-6).all()
    assert parts["scale"].dtype == torch.float16


def test_per_token_value_scales_follow_each_token():
    g = torch.Generator().manual_seed(1)
    v = torch.randn(4, G.kv_heads, G.block_size, G.head_dim, generator=g)
    v[:, :, 0] *= 100  # one loud token per block
    per_head, _ = _roundtrip(Int8Codec(), v)
    per_token, parts = _roundtrip(Int8TokenCodec(), v)
    quiet = slice(1, None)
    assert (per_token - v)[:, :, quiet].abs().mean() < (per_head - v)[:, :, quiet].abs().mean() / 10
    scale = parts["scale"][1].float()[..., None]
    assert ((per_token - v).abs() <= scale / 2 + 1e-6).all()


def test_token_scatter_equals_whole_block_encoding():
    """Appending values token by token (the decode fast path) stores exactly what encoding the block does."""
    codec = Int8TokenCodec()
    g = torch.Generator().manual_seed(2)
    v = torch.randn(3, G.kv_heads, G.block_size, G.head_dim, generator=g) * torch.linspace(0.1, 10, G.block_size)[:, None]
    whole = codec.alloc(G, 3, torch.device("cpu"), False)
    codec.encode(whole, 0, torch.arange(3), v, torch.zeros(3, dtype=torch.bool))
    bit = codec.alloc(G, 3, torch.device("cpu"), False)
    for t in range(G.block_size):
        assert codec.scatter(bit, 0, torch.arange(3), torch.full((3,), t), v[:, :, t])
    for name in ("data", "scale"):
        assert torch.equal(whole[name][0], bit[name][0]), name


def test_channel_scales_only_grow_as_a_block_fills():
    codec = Int8ChannelCodec()
    x = _keys_with_outlier_channels(2, seed=3)
    parts = codec.alloc(G, 2, torch.device("cpu"), False)
    slots = torch.arange(2)
    half = x.clone()
    half[:, :, 4:] = 0
    codec.encode(parts, 0, slots, half * 0.01, torch.zeros(2, dtype=torch.bool))  # a quiet first half
    first = parts["scale"][0].clone()
    codec.encode(parts, 0, slots, x, torch.ones(2, dtype=torch.bool))  # the rest arrives, louder
    assert (parts["scale"][0] >= first).all()
    assert ((codec.decode(parts, 0, slots) - x).abs() <= parts["scale"][0].float()[:, :, None, :] / 2 + 1e-6).all()


def test_int8_kivi_layout_and_bytes():
    k, v = codecs_for(KVDtype.INT8_KIVI)
    assert isinstance(k, Int8ChannelCodec) and isinstance(v, Int8TokenCodec)
    g16 = Geometry(layers=30, kv_heads=3, block_size=16, head_dim=64)  # the default model's geometry
    fp32 = sum(sum(c.block_bytes(g16).values()) for c in codecs_for(KVDtype.FP32))
    kivi = sum(k.block_bytes(g16).values()) + sum(v.block_bytes(g16).values())
    assert kivi <= 0.27 * fp32  # int8 codes + fp16 scales: 0.2695x at block size 16
    assert kivi > sum(sum(c.block_bytes(g16).values()) for c in codecs_for(KVDtype.INT8))
