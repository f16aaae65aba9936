"""Paged attention backends (engine/attention/) against the reference path (today's gather + SDPA).

Pools are built by the real codecs' encode, so every storage format is the real one. Each case walks a
shuffled block table with uneven context lengths (1, bs-1, bs, bs+1, several blocks) whose padding points at
a poisoned block, on layer 1 of a two-layer pool (layer 0 holds other data): reading past a context, the
wrong layer or the wrong table entry changes the output by far more than the tolerance.

The Triton kernel runs under TRITON_INTERPRET=1 in one subprocess (the interpreter mode is fixed when triton
is imported), started when collection ends so that it runs beside the rest of the suite (BACKGROUND
workers: tests/workers.py); it writes its outputs for every case, and the parent compares them here, case by case.
Run this file as a script (`python tests/attention/test_paged_attention.py OUT.pt`, TRITON_INTERPRET=1) to be that worker.
"""

from __future__ import annotations

import math
import os
import sys
import zlib
from dataclasses import dataclass, field

import pytest
import torch

from workers import background_result, interpreter_env  # first: as a worker, keeps KVSCOPE_TEST_WITHOUT's packages out
from engine.attention import KVFormat, PagedBatch, PagedKV, kv_formats, make_backend
from engine.attention.cpu_paged import gather_head_major
from engine.kv.codecs import Geometry, codecs_for, fp8_supported
from engine.config import KVDtype

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK_SIZES = (1, 7, 16, 100, 1024)
DTYPES = tuple(d for d in KVDtype if d is not KVDtype.FP8 or fp8_supported())
D = 16
ATOL = RTOL = 1e-5  # fp32 accumulation-order noise is ~1e-6 here; one key more or less moves outputs by ~1e-3


@dataclass(frozen=True)
class Case:
    """One decode batch. variant: causal (positions = indices), window (+ sliding window), key_pos (explicit,
    repeated and gapped positions, some queries before their last keys, + window), mha (key_pos with H = Hkv),
    window_edges (one row per offset of the window's first key within a block, the first row's first key the
    last of its block: skipping blocks before the window must stop exactly there)."""

    dtype: KVDtype
    bs: int
    variant: str
    # Backend options: small tiles / chunks and several splits make the walks cross block and tile edges.
    triton: dict = field(default_factory=dict, compare=False)
    cpu: dict = field(default_factory=dict, compare=False)

    @property
    def id(self) -> str:
        return f"{self.dtype.label}-bs{self.bs}-{self.variant}"

    @property
    def heads(self) -> tuple[int, int]:
        return (4, 4) if self.variant == "mha" else (9, 3)

    @property
    def lens(self) -> list[int]:
        bs = self.bs
        if bs == 1:
            return [1, 2, 5]
        if bs == 1024:
            return [1, 1023, 1024, 1025]
        if self.variant == "window_edges":
            return [3 * bs + r for r in range(bs)]
        return [1, bs - 1, bs, bs + 1, 2 * bs + 9]


def _options(variant: str, bs: int) -> tuple[dict, dict]:
    """(triton, cpu) backend options. Tiles smaller than a block (the delta keys' cumsum carried across
    them, a ragged last tile), several splits, and one-block chunks make the walks cross every edge;
    the interpreter's cost is per tile, so block size 1024 gets 8 tiles a block, not 64."""
    small_tile = 2048 if bs <= 100 else 8192  # BLOCK_T 32 / 128 at G = 3 (padded to 4), D = 16
    return {
        "causal": (dict(tile_elems=1 << 16), {}),  # one tile per block, one chunk
        "window": (dict(splits=2), dict(chunk_elems=1)),  # default tiles (BLOCK_T 128); one block per chunk
        "key_pos": (dict(tile_elems=small_tile, splits=3), dict(chunk_elems=3000)),
        "mha": (dict(tile_elems=1 << 14), dict(chunk_elems=1)),
        "window_edges": ({}, dict(chunk_elems=1)),
    }[variant]


VARIANTS = ("causal", "window", "key_pos", "mha")
CASES = [Case(d, bs, v, *_options(v, bs)) for d in DTYPES for bs in BLOCK_SIZES for v in VARIANTS] + [
    Case(d, bs, "window_edges", *_options("window_edges", bs)) for d in (KVDtype.FP32, KVDtype.INT8_DELTA)
    for bs in (7, 16)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Single-threaded torch: these are small ops, and on a shared two-core machine spinning threads cost 20x."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def build(case: Case):
    """(q [B, H, D], kv, batch, window, scale), the same in every process (seeded by the case id)."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))
    H, Hkv = case.heads
    bs, lens = case.bs, case.lens
    B = len(lens)
    nbs = [math.ceil(c / bs) for c in lens]
    nblocks = sum(nbs)
    poison = nblocks + 1  # slot 0: the pool's zero block, unused; 1..nblocks: the rows' blocks; then poison
    kc, vc = codecs_for(case.dtype)
    geom = Geometry(layers=2, kv_heads=Hkv, block_size=bs, head_dim=D)
    k = kc.alloc(geom, nblocks + 2, torch.device("cpu"), False)
    v = vc.alloc(geom, nblocks + 2, torch.device("cpu"), False)
    for layer in range(2):
        xk = torch.randn(nblocks + 1, Hkv, bs, D, generator=gen)
        xk[..., [0, 5]] *= 8  # outlier channels, as RoPE'd keys have: per-channel scales matter
        xv = torch.randn(nblocks + 1, Hkv, bs, D, generator=gen)
        xk[-1] *= 30  # the poisoned block: any read of it swamps the output
        xv[-1] = 50.0
        slots = torch.arange(1, nblocks + 2)
        kc.encode(k, layer, slots, xk)
        vc.encode(v, layer, slots, xv)
    if kv_formats(case.dtype)[0] is KVFormat.DELTA:
        # The encoder leaves token 0's codes at 0 and decode ignores them (the anchor is token 0): codes there
        # must stay ignored, whatever they are.
        first = k["data"][:, :, :, 0, :]
        first.copy_(torch.randint(-127, 128, first.shape, generator=gen).to(torch.int8))
    order = torch.randperm(nblocks, generator=gen) + 1
    table = torch.full((B, max(nbs)), poison, dtype=torch.int32)
    at = 0
    for b, n in enumerate(nbs):
        table[b, :n] = order[at : at + n]
        at += n
    ctx = torch.tensor(lens, dtype=torch.int32)
    S = table.shape[1] * bs
    key_pos = None
    window = None
    q_pos = (ctx - 1).long()
    if case.variant == "window":
        window = max(2, 2 * max(lens) // 3)
    elif case.variant == "window_edges":
        window = bs + 1  # row 0: first visible key 3bs - 1 - window + 1 = 2bs - 1, the last of block 1
    elif case.variant in ("key_pos", "mha"):
        steps = torch.randint(0, 4, (B, S), generator=gen)  # 0: a repeated position (after seq_div)
        key_pos = torch.randint(0, 50, (B, 1), generator=gen) + steps.cumsum(1)
        key_pos[torch.arange(S)[None, :] >= ctx[:, None].long()] = -7  # past the context: would be visible
        q_pos = torch.stack([key_pos[b, lens[b] - 1 if b % 2 == 0 else lens[b] // 2] for b in range(B)])
        span = int((q_pos - key_pos[:, 0]).max())
        window = max(2, 2 * span // 3)
    q = torch.randn(B, H, D, generator=gen)
    if case.variant in ("key_pos", "mha"):  # the engine's int64 tables, and q a strided view as the model slices it
        table, ctx = table.long(), ctx.long()
        q = torch.cat([q, torch.randn(B, 2, D, generator=gen)], dim=1)[:, 1 : H + 1]
    return q, PagedKV(k, v, case.dtype), PagedBatch(table, ctx, q_pos[:, None], key_pos), window, D**-0.5


def naive(q, kv: PagedKV, batch: PagedBatch, window, scale, layer=1, sinks=None):
    """Row by row, key by key rule, no shared helper: out [B, Q, H, D] (q [B, Q, H, D], q_pos [B, Q]). sinks [H]:
    each head's logit is one more softmax term, whose weight is then dropped (GPT-OSS's attention sinks)."""
    kc, vc = codecs_for(kv.dtype)
    B, Q, H, _ = q.shape
    Hkv, bs = kv.kv_heads, kv.block_size
    out = torch.zeros(B, Q, H, D)
    qp = batch.q_pos.reshape(B, Q)
    for b in range(B):
        c = int(batch.context_lens[b])
        nb = math.ceil(c / bs)
        slots = batch.block_table[b, :nb].long()
        keys = kc.decode(kv.k, layer, slots).permute(1, 0, 2, 3).reshape(Hkv, nb * bs, D)[:, :c]
        vals = vc.decode(kv.v, layer, slots).permute(1, 0, 2, 3).reshape(Hkv, nb * bs, D)[:, :c]
        pos = list(range(c)) if batch.key_pos is None else batch.key_pos[b, :c].tolist()
        for i in range(Q):
            p = int(qp[b, i])
            seen = [j for j in range(c) if pos[j] <= p and (window is None or pos[j] > p - window)]
            for h in range(H):
                kh = h // (H // Hkv)
                logits = (keys[kh, seen] @ q[b, i, h]) * scale
                if sinks is not None:
                    logits = torch.cat((logits, sinks[h : h + 1]))
                w = torch.softmax(logits, dim=0)[: len(seen)]
                out[b, i, h] = w @ vals[kh, seen]
    return out


def assert_close(got, want, what=""):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


# -- the reference and the shared pieces ---------------------------------------------------------------

@pytest.mark.parametrize("case", [c for c in CASES if c.bs in (1, 7, 16, 100)], ids=lambda c: c.id)
def test_reference_is_the_rule(case):
    q, kv, batch, window, scale = build(case)
    ref = make_backend("reference").decode(q, 1, kv, batch, scale=scale, window=window)
    assert_close(ref, naive(q[:, None], kv, batch, window, scale)[:, 0], case.id)


@pytest.mark.parametrize("variant", ["causal", "window", "key_pos"])
def test_reference_is_the_rule_at_block_size_1024(variant):
    case = Case(KVDtype.INT8_KIVI, 1024, variant)
    q, kv, batch, window, scale = build(case)
    ref = make_backend("reference").decode(q, 1, kv, batch, scale=scale, window=window)
    assert_close(ref, naive(q[:, None], kv, batch, window, scale)[:, 0], case.id)


def test_the_cases_discriminate():
    """The window, the explicit positions and one key more each move the answer far beyond the tolerance."""
    ref = make_backend("reference")

    def far(a, b):
        return (a - b).abs().amax(dim=(1, 2)) > 100 * ATOL  # [B]: per row

    q, kv, batch, window, scale = build(Case(KVDtype.FP32, 16, "window"))
    base = ref.decode(q, 1, kv, batch, scale=scale, window=window)
    assert far(base, ref.decode(q, 1, kv, batch, scale=scale)).any()
    one_more = PagedBatch(batch.block_table, batch.context_lens + 1, batch.q_pos + 1)
    assert far(ref.decode(q, 1, kv, batch, scale=scale), ref.decode(q, 1, kv, one_more, scale=scale)).all()

    q, kv, batch, window, scale = build(Case(KVDtype.FP32, 16, "key_pos"))
    base = ref.decode(q, 1, kv, batch, scale=scale, window=window)
    by_index = PagedBatch(batch.block_table, batch.context_lens, batch.context_lens.long()[:, None] - 1)
    assert far(base, ref.decode(q, 1, kv, by_index, scale=scale, window=window))[1::2].all()  # queries mid-row


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.label)
def test_head_major_gather_is_the_codec_decode_exactly(dtype):
    q, kv, batch, window, scale = build(Case(dtype, 7, "causal"))
    slots = batch.block_table.long()
    for parts, codec, fmt in zip((kv.k, kv.v), codecs_for(dtype), kv_formats(dtype)):
        want = codec.decode(parts, 1, slots).permute(0, 2, 1, 3, 4)  # [B, Hkv, NB, bs, D]
        assert torch.equal(gather_head_major(parts, fmt, 1, slots), want), (dtype, fmt)


def test_formats_cover_every_dtype():
    assert {kv_formats(d) for d in KVDtype} == {
        (KVFormat.PLAIN, KVFormat.PLAIN), (KVFormat.TOKEN_SCALE, KVFormat.TOKEN_SCALE),
        (KVFormat.DELTA, KVFormat.TOKEN_SCALE), (KVFormat.CHANNEL_SCALE, KVFormat.TOKEN_SCALE)}
    with pytest.raises(ValueError):
        make_backend("flash")


# -- the CPU path (chunked; the numba loop, `cpu`, on the same cases: test_numba_paged.py) ----------------

@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_cpu_decode_matches_reference(case):
    q, kv, batch, window, scale = build(case)
    want = make_backend("reference").decode(q, 1, kv, batch, scale=scale, window=window)
    got = make_backend("chunked", **case.cpu).decode(q, 1, kv, batch, scale=scale, window=window)
    assert_close(got, want, case.id)


@pytest.mark.parametrize("case", [c for c in CASES if c.bs in (1, 7, 100) and c.variant != "mha"], ids=lambda c: c.id)
def test_cpu_prefill_matches_reference(case):
    """Q queries per row, at the positions of its last Q keys (a prefill chunk), causal by position."""
    _, kv, batch, window, scale = build(case)
    H, _ = case.heads
    B = len(case.lens)
    Qn = 3
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(B, Qn, H, D, generator=gen)
    idx = (batch.context_lens.long()[:, None] - Qn + torch.arange(Qn)[None, :]).clamp_min(0)  # [B, Q]
    q_pos = idx if batch.key_pos is None else batch.key_pos.gather(1, idx)  # each query sees its own key
    pre = PagedBatch(batch.block_table, batch.context_lens, q_pos, batch.key_pos)
    want = make_backend("reference").prefill(q, 1, kv, pre, scale=scale, window=window)
    got = make_backend("chunked", **case.cpu).prefill(q, 1, kv, pre, scale=scale, window=window)
    assert_close(got, want, case.id)
    if case.bs == 7 and case.dtype is KVDtype.INT8_DELTA:
        assert_close(want, naive(q, kv, pre, window, scale), "reference prefill vs the rule")


@dataclass(frozen=True)
class FirstChunk(Case):
    """Rows that are each a prompt's first chunk: Q queries at positions 0..Q-1 over their own Q keys."""

    q_len: int = 1

    @property
    def lens(self) -> list[int]:
        return [self.q_len] * 3


@pytest.mark.parametrize("dtype", [KVDtype.FP32, KVDtype.FP16, KVDtype.INT8_DELTA], ids=lambda d: d.label)
@pytest.mark.parametrize("bs,q_len", [(1, 5), (7, 7), (7, 16), (16, 9)])
def test_cpu_prefill_of_first_chunks_is_causal_sdpa(monkeypatch, dtype, bs, q_len):
    """Every row a first chunk: the dense path hands SDPA is_causal (its flash kernel skips the blocks above the
    diagonal) and gets what the reference and the rule get; a batch with one row further on keeps the mask."""
    case = FirstChunk(dtype, bs, "causal", q_len=q_len)
    _, kv, batch, _, scale = build(case)
    H, _ = case.heads
    q = torch.randn(3, q_len, H, D, generator=torch.Generator().manual_seed(q_len))
    pos = torch.arange(q_len).expand(3, q_len).contiguous()
    first = PagedBatch(batch.block_table, batch.context_lens, pos, None)
    later = pos.clone()  # row 1 a later chunk: its queries at 1.., the last one twice
    later[1] = (torch.arange(q_len) + 1).clamp_max(q_len - 1)
    later = PagedBatch(batch.block_table, batch.context_lens, later, None)
    want = {name: make_backend("reference").prefill(q, 1, kv, b, scale=scale) for name, b in (("first", first),
                                                                                               ("later", later))}
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*a, **k):
        calls.append(bool(k.get("is_causal")))
        return real(*a, **k)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    got = make_backend("chunked").prefill(q, 1, kv, first, scale=scale)
    assert calls == [True]
    assert_close(got, want["first"], case.id)
    got = make_backend("chunked").prefill(q, 1, kv, later, scale=scale)
    assert calls == [True, False]
    assert_close(got, want["later"], case.id + " later")
    monkeypatch.undo()
    for name, b in (("first", first), ("later", later)):
        assert_close(want[name], naive(q, kv, b, None, scale), f"{name} chunks: the reference vs the rule")


@pytest.mark.parametrize("name", ["chunked", "cpu"])
def test_cpu_keeps_the_query_dtype(name):
    q, kv, batch, window, scale = build(Case(KVDtype.FP16, 16, "causal"))
    got = make_backend(name).decode(q.half(), 1, kv, batch, scale=scale)
    want = make_backend("reference").decode(q.half(), 1, kv, batch, scale=scale)
    assert got.dtype == want.dtype == torch.float16
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


# -- attention sinks (GPT-OSS): a logit per head in every softmax's denominator ---------------------------------

SINK_CASES = [c for c in CASES if c.bs in (1, 7, 16, 100) and c.dtype in (KVDtype.FP32, KVDtype.INT8_KIVI)]
TRITON_SINK_CASES = [Case(KVDtype.FP32, 7, "causal", *_options("causal", 7)),
                     Case(KVDtype.FP32, 16, "window", *_options("window", 16)),
                     Case(KVDtype.INT8_DELTA, 7, "key_pos", *_options("key_pos", 7)),
                     Case(KVDtype.FP16, 16, "mha", *_options("mha", 16))]


def sinks_for(case: Case) -> torch.Tensor:
    """[H] sink logits about as large as the rows' scores (some heads' sinks take most of the weight)."""
    H, _ = case.heads
    return 1.0 + 2.0 * torch.randn(H, generator=torch.Generator().manual_seed(zlib.crc32(case.id.encode()) + 1))


@pytest.mark.parametrize("case", [c for c in SINK_CASES if c.bs in (1, 7)], ids=lambda c: c.id)
def test_reference_with_sinks_is_the_rule(case):
    q, kv, batch, window, scale = build(case)
    sinks = sinks_for(case)
    ref = make_backend("reference").decode(q, 1, kv, batch, scale=scale, window=window, sinks=sinks)
    assert_close(ref, naive(q[:, None], kv, batch, window, scale, sinks=sinks)[:, 0], case.id)


def test_sinks_move_every_row():
    q, kv, batch, window, scale = build(Case(KVDtype.FP32, 16, "window"))
    ref = make_backend("reference")
    plain = ref.decode(q, 1, kv, batch, scale=scale, window=window)
    sunk = ref.decode(q, 1, kv, batch, scale=scale, window=window, sinks=sinks_for(Case(KVDtype.FP32, 16, "window")))
    assert ((plain - sunk).abs().amax(dim=(1, 2)) > 100 * ATOL).all()
    # A sink far below every score weighs nothing: the plain softmax.
    assert_close(ref.decode(q, 1, kv, batch, scale=scale, window=window, sinks=torch.full((9,), -1e4)), plain)


@pytest.mark.parametrize("case", SINK_CASES, ids=lambda c: c.id)
def test_cpu_decode_with_sinks_matches_reference(case):
    q, kv, batch, window, scale = build(case)
    sinks = sinks_for(case)
    want = make_backend("reference").decode(q, 1, kv, batch, scale=scale, window=window, sinks=sinks)
    got = make_backend("chunked", **case.cpu).decode(q, 1, kv, batch, scale=scale, window=window, sinks=sinks)
    assert_close(got, want, case.id)


@pytest.mark.parametrize("case", [c for c in SINK_CASES if c.bs in (1, 7, 100) and c.variant != "mha"],
                         ids=lambda c: c.id)
def test_cpu_prefill_with_sinks_matches_reference(case):
    """Q = 3 queries per row (a prefill chunk): the cpu backend's chunk loop (its SDPA path has no sink term)."""
    _, kv, batch, window, scale = build(case)
    H, _ = case.heads
    B = len(case.lens)
    q = torch.randn(B, 3, H, D, generator=torch.Generator().manual_seed(8))
    idx = (batch.context_lens.long()[:, None] - 3 + torch.arange(3)[None, :]).clamp_min(0)  # [B, Q]
    q_pos = idx if batch.key_pos is None else batch.key_pos.gather(1, idx)
    pre = PagedBatch(batch.block_table, batch.context_lens, q_pos, batch.key_pos)
    sinks = sinks_for(case)
    want = make_backend("reference").prefill(q, 1, kv, pre, scale=scale, window=window, sinks=sinks)
    got = make_backend("chunked", **case.cpu).prefill(q, 1, kv, pre, scale=scale, window=window, sinks=sinks)
    assert_close(got, want, case.id)
    if case.bs == 7:
        assert_close(want, naive(q, kv, pre, window, scale, sinks=sinks), "reference prefill vs the rule")


# -- the Triton kernel, under the interpreter ----------------------------------------------------------

def _triton_missing() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not installed ({e}); pip install -e .[test] installs it on Linux x86_64"
    return None


def _triton_worker(out: str) -> tuple[list[str], dict] | None:
    """This file as a TRITON_INTERPRET=1 script writing every case's kernel output to `out` (None: no triton)."""
    if _triton_missing():
        return None
    return [sys.executable, os.path.abspath(__file__), out], interpreter_env()


BACKGROUND = {"triton_outputs": _triton_worker}  # started beside the suite when collection ends (tests/conftest.py)


@pytest.fixture(scope="module")
def triton_outputs():
    """{case id: kernel output} from one TRITON_INTERPRET=1 subprocess running every case."""
    reason = _triton_missing()
    if reason:
        pytest.skip(reason)
    return torch.load(background_result("triton_outputs", _triton_worker))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_triton_decode_matches_reference(case, triton_outputs):
    q, kv, batch, window, scale = build(case)
    want = make_backend("reference").decode(q, 1, kv, batch, scale=scale, window=window)
    assert_close(triton_outputs[case.id], want, case.id)


@pytest.mark.parametrize("case", TRITON_SINK_CASES, ids=lambda c: c.id)
def test_triton_decode_with_sinks_matches_reference(case, triton_outputs):
    q, kv, batch, window, scale = build(case)
    want = make_backend("reference").decode(q, 1, kv, batch, scale=scale, window=window, sinks=sinks_for(case))
    assert_close(triton_outputs["sinks", case.id], want, case.id)


def test_triton_prefill_falls_back_to_the_cpu_path(triton_outputs):
    case = Case(KVDtype.INT8_KIVI, 7, "window")
    _, kv, batch, window, scale = build(case)
    q = torch.randn(len(case.lens), 2, 9, D, generator=torch.Generator().manual_seed(3))
    pre = PagedBatch(batch.block_table, batch.context_lens, (batch.context_lens.long()[:, None] - 1).expand(-1, 2))
    want = make_backend("reference").prefill(q, 1, kv, pre, scale=scale, window=window)
    assert_close(triton_outputs["prefill"], want, "prefill")


def _worker(path: str) -> None:
    """Run every case through the Triton backend (TRITON_INTERPRET=1 must be set) and save the outputs."""
    from engine.attention.triton_paged import INTERPRET

    assert INTERPRET, "run with TRITON_INTERPRET=1"
    outs = {}
    for case in CASES:
        q, kv, batch, window, scale = build(case)
        outs[case.id] = make_backend("triton", **case.triton).decode(q, 1, kv, batch, scale=scale, window=window)
    for case in TRITON_SINK_CASES:
        q, kv, batch, window, scale = build(case)
        outs["sinks", case.id] = make_backend("triton", **case.triton).decode(q, 1, kv, batch, scale=scale,
                                                                             window=window, sinks=sinks_for(case))
    case = Case(KVDtype.INT8_KIVI, 7, "window")
    _, kv, batch, window, scale = build(case)
    q = torch.randn(len(case.lens), 2, 9, D, generator=torch.Generator().manual_seed(3))
    pre = PagedBatch(batch.block_table, batch.context_lens, (batch.context_lens.long()[:, None] - 1).expand(-1, 2))
    outs["prefill"] = make_backend("triton").prefill(q, 1, kv, pre, scale=scale, window=window)
    torch.save(outs, path)


# -- the Triton kernel, compiled for real GPUs (ahead of time: no GPU needed) ---------------------------

@pytest.mark.parametrize("arch", [80, 90])
def test_triton_kernel_compiles_for_the_gpu(arch):
    """The interpreter accepts code the compiler rejects; compile every format for sm80 and sm90 (to a cubin)."""
    reason = _triton_missing()
    if reason:
        pytest.skip(reason)
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.attention import triton_paged

    if triton_paged.INTERPRET:
        pytest.skip("TRITON_INTERPRET=1 in this process: the kernel is the interpreted one")
    names = list(inspect.signature(triton_paged._paged_decode.fn).parameters)
    data = {KVDtype.FP32: "fp32", KVDtype.FP16: "fp16", KVDtype.BF16: "bf16", KVDtype.INT8: "i8",
            KVDtype.INT8_DELTA: "i8", KVDtype.FP8: "u8", KVDtype.INT8_KIVI: "i8"}
    for dtype in KVDtype:
        kf, vf = kv_formats(dtype)
        sig = {n: ("i32" if n.startswith("s_") or n in ("window", "blocks_per_split") else "*fp32") for n in names}
        sig.update(K=f"*{data[dtype]}", V=f"*{data[dtype]}", KX="*fp16", Table="*i32", Ctx="*i32", QPos="*i64",
                   KPos="*i64", sm_scale="fp32",
                   KS="*fp16" if kf is not KVFormat.PLAIN else "*fp32",
                   VS="*fp16" if vf is KVFormat.TOKEN_SCALE else "*fp32")
        split = dtype in (KVDtype.INT8_DELTA, KVDtype.FP8)
        consts = dict(G=3, D=64, BS=100, BLOCK_G=4, BLOCK_D=64, BLOCK_T=32, K_FMT=int(kf), V_FMT=int(vf),
                      K_FP8=dtype is KVDtype.FP8, V_FP8=dtype is KVDtype.FP8, HAS_KPOS=split, HAS_WINDOW=True,
                      SPLIT=split)
        for n in consts:
            sig[n] = "constexpr"
        src = ASTSource(triton_paged._paged_decode, sig, constexprs={(names.index(n),): v for n, v in consts.items()})
        try:
            kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                    options={"num_warps": 4, "enable_fp_fusion": True})
        except Exception as e:  # a missing toolchain is a skip; a kernel the compiler rejects is a failure
            if "ptxas" in str(e).lower() and ("not found" in str(e).lower() or "no such file" in str(e).lower()):
                pytest.skip(f"no ptxas here: {e}")
            raise
        assert "cubin" in kernel.asm, dtype


if __name__ == "__main__":
    _worker(sys.argv[1])
