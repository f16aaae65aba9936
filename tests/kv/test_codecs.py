"""The KV storage formats on their own: error bounds, and appends that never re-encode a block."""

from __future__ import annotations

import pytest
import torch

from engine.kv.codecs import Appends, ChannelCodec, DeltaCodec, Geometry, TokenCodec, codecs_for, fp16_ceil
from engine.config import KVDtype

G = Geometry(layers=2, kv_heads=3, block_size=8, head_dim=16)
CPU = torch.device("cpu")
LOSSY = [d for d in KVDtype if d not in (KVDtype.FP32, KVDtype.FP16, KVDtype.BF16)]


def _keys_with_outlier_channels(n: int, seed: int = 0) -> torch.Tensor:
    """[n, H, B, D] keys whose channels 0 and 5 are ~50x larger than the rest, as RoPE'd keys often are."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, G.kv_heads, G.block_size, G.head_dim, generator=g)
    x[..., [0, 5]] *= 50
    return x


def _roundtrip(codec, x: torch.Tensor):
    parts = codec.alloc(G, len(x), CPU, False)
    slots = torch.arange(len(x))
    codec.encode(parts, 1, slots, x)
    return codec.decode(parts, 1, slots), parts


def _append_one(codec, parts, slots: torch.Tensor, t: int, x: torch.Tensor) -> None:
    """Token t of each block in `slots`, the way a decode step appends it (one token per block)."""
    n = len(slots)
    a = Appends.of(slots, torch.full((n,), t), slots, torch.arange(n), torch.full((n,), t), 0)
    codec.append(parts, 0, a, x)


def test_per_channel_key_scales_keep_the_small_channels():
    x = _keys_with_outlier_channels(6)
    small = [c for c in range(G.head_dim) if c not in (0, 5)]
    per_token, _ = _roundtrip(TokenCodec(), x)
    per_channel, parts = _roundtrip(ChannelCodec(), x)
    err_tok = (per_token - x)[..., small].abs().mean()
    err_chan = (per_channel - x)[..., small].abs().mean()
    assert err_chan < err_tok / 10, (float(err_chan), float(err_tok))
    # Every element within half a step: its channel's scale times its token's (both rounded up, never down).
    step = parts["scale"][1].float()[:, :, None, :] * parts["tscale"][1].float()[..., None]
    assert ((per_channel - x).abs() <= step / 2 * (1 + 1e-6)).all()
    assert parts["scale"].dtype == parts["tscale"].dtype == torch.float16


@pytest.mark.parametrize("codec", [TokenCodec(), TokenCodec(getattr(torch, "float8_e4m3fn", torch.int8))], ids=["int8", "fp8"])
def test_per_token_scales_follow_each_token(codec):
    g = torch.Generator().manual_seed(1)
    v = torch.randn(4, G.kv_heads, G.block_size, G.head_dim, generator=g)
    v[:, :, 0] *= 100  # one loud token per block: the quiet ones keep their own precision
    got, parts = _roundtrip(codec, v)
    scale = parts["scale"][1].float()[..., None]
    rel = 1 / 127 / 2 if codec.storage == torch.int8 else 2.0**-4  # int8: half a step; e4m3: half an ulp (3 bits)
    assert ((got - v).abs() <= scale * codec.qmax * rel * (1 + 1e-5) + 1e-7).all()
    quiet = (got - v)[:, :, 1:].abs().max()
    assert quiet < v[:, :, 1:].abs().max() * 2 * rel * 1.01


@pytest.mark.parametrize("dtype", LOSSY, ids=lambda d: d.label)
def test_appending_token_by_token_stores_what_whole_block_encoding_does(dtype):
    """encode writes blocks exactly as a run of decode steps appending one token at a time would."""
    for codec in codecs_for(dtype):
        x = _keys_with_outlier_channels(3, seed=2) * torch.linspace(0.1, 3, G.block_size)[:, None]
        whole = codec.alloc(G, 3, CPU, False)
        codec.encode(whole, 0, torch.arange(3), x)
        bit = codec.alloc(G, 3, CPU, False)
        slots = torch.arange(3)
        if isinstance(codec, ChannelCodec):
            # Its channel scales come from a block's first write (here: all of it, as encode has it); after that
            # each token is coded against them alone. Same scales, then token by token as blocks that hold tokens.
            bit["scale"][0] = whole["scale"][0]
            for t in range(G.block_size):
                a = Appends.of(slots, torch.full((3,), t), slots, torch.arange(3), torch.ones(3, dtype=torch.long), 0)
                codec.append(bit, 0, a, x[:, :, t])
        else:
            for t in range(G.block_size):
                _append_one(codec, bit, slots, t, x[:, :, t])
        for name in whole:
            assert torch.equal(whole[name][0], bit[name][0]), (dtype, type(codec).__name__, name)


@pytest.mark.parametrize("dtype", LOSSY, ids=lambda d: d.label)
def test_an_append_leaves_every_other_token_byte_for_byte(dtype):
    """No re-encoding: appending token t (louder than everything before it) changes only token t's codes and
    scales, and, for a new block, its block-wide parts."""
    for codec in codecs_for(dtype):
        x = _keys_with_outlier_channels(2, seed=4)
        parts = codec.alloc(G, 2, CPU, False)
        slots = torch.arange(2)
        for t in range(5):
            _append_one(codec, parts, slots, t, x[:, :, t])
        before = {k: v.stacked() for k, v in parts.items()}
        decoded = codec.decode(parts, 0, slots)[:, :, :5].clone()
        _append_one(codec, parts, slots, 5, x[:, :, 5] * 40)
        for name, old in before.items():
            new = parts[name].stacked()
            if new.shape[3:4] == (G.block_size,):  # per-token parts [L, N, H, bs, ...]
                assert torch.equal(new[:, :, :, :5], old[:, :, :, :5]) and torch.equal(new[:, :, :, 6:], old[:, :, :, 6:])
            else:  # block-wide parts (channel scales, anchors) of blocks that already hold tokens
                assert torch.equal(new, old), (dtype, name)
        assert torch.equal(codec.decode(parts, 0, slots)[:, :, :5], decoded)
        got = codec.decode(parts, 0, slots)[:, :, 5]
        assert ((got - x[:, :, 5] * 40).abs() <= (x[:, :, 5] * 40).abs().amax(-1, keepdim=True) * 0.07).all()


def test_delta_keys_stay_within_half_a_step_of_each_token():
    x = torch.cumsum(torch.randn(4, G.kv_heads, G.block_size, G.head_dim, generator=torch.Generator().manual_seed(5)), 2)
    got, parts = _roundtrip(DeltaCodec(), x)
    step = parts["scale"][1].float()[..., None]
    err = (got - x).abs()
    assert (err[:, :, 1:] <= step[:, :, 1:] / 2 * (1 + 1e-5) + 1e-6).all()  # closed loop: no random walk
    assert (err[:, :, 0] <= x[:, :, 0].abs() * 2.0**-11 + 1e-7).all()  # the fp16 anchor


def test_fp16_ceil_is_the_smallest_fp16_at_or_above():
    # Inside fp16's normal range, the function's domain (below 2^-14 it clamps): an unbounded draw failed 1 run in ~25.
    x = torch.cat([torch.rand(10_000).clamp_min(2.0**-14 / 10) * 10, torch.tensor([1.0, 2.0**-14, 0.5, 65504.0])])
    h = fp16_ceil(x)
    assert h.dtype == torch.float16 and (h.float() >= x).all()
    below = (h.view(torch.int16) - 1).view(torch.float16).float()
    assert (below < x).all()
    assert torch.equal(fp16_ceil(h.float()), h)  # an fp16 value maps to itself


@pytest.mark.parametrize("dtype", [KVDtype.INT8, KVDtype.FP8], ids=lambda d: d.label)
def test_token_scaled_blocks_decode_and_encode_to_the_same_bytes(dtype):
    codec = codecs_for(dtype)[0]
    x = _keys_with_outlier_channels(3, seed=6)
    _, parts = _roundtrip(codec, x)
    again = codec.alloc(G, 3, CPU, False)
    codec.encode(again, 1, torch.arange(3), codec.decode(parts, 1, torch.arange(3)))
    for name in parts:
        assert torch.equal(parts[name][1].view(torch.uint8) if parts[name].dtype != torch.float16 else parts[name][1],
                           again[name][1].view(torch.uint8) if parts[name].dtype != torch.float16 else again[name][1])


def test_int8_kivi_layout_and_bytes():
    k, v = codecs_for(KVDtype.INT8_KIVI)
    assert isinstance(k, ChannelCodec) and type(v) is TokenCodec
    g16 = Geometry(layers=30, kv_heads=3, block_size=16, head_dim=64)  # the default model's geometry
    fp32 = sum(sum(c.block_bytes(g16).values()) for c in codecs_for(KVDtype.FP32))
    kivi = sum(k.block_bytes(g16).values()) + sum(v.block_bytes(g16).values())
    assert kivi == fp32 * 2240 // 8192  # per head: K 1024 codes + 128 channel + 32 token scales; V 1024 + 32
    int8 = sum(sum(c.block_bytes(g16).values()) for c in codecs_for(KVDtype.INT8))
    assert int8 == fp32 * 2112 // 8192 < kivi
