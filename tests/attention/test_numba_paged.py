"""The numba paged backend (engine/attention/numba_paged.py: `cpu` when numba imports) against the reference.

Kernel level, on test_paged_attention.py's pools (real codecs, shuffled tables, a poisoned block behind every
padding entry, layer 1 of two): decode for every storage format, block sizes 1, 7, 16, 100 and 1024, GQA and MHA,
windows (with a window's first key at every offset of a block), explicit key positions and mixed-length rows;
attention sinks; Q > 1 (a prefill chunk) through the loop; the partial's output and log-sum-exp; host-tier blocks
read where they are in the same walk (from the host tier, or from the staging buffer) and the host_reads=compute
split (test_host_compute.py's poisoned two-tier pools). The chunked fallback is patched to raise in those tests, so
each one runs the compiled loop. Engine level: greedy tokens equal transformers' `generate` with fp32 KV (GQA,
Mistral's sliding window, block sizes 1, 7 and 16, a host tier); a kernel that disagrees is caught by the self-check
and the chunked path serves; with numba not importable, `cpu` is the chunked path.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from engine.attention import PagedBatch, PagedKV, make_backend, numba_paged
from engine.attention.cpu_paged import ChunkedPagedBackend
from engine.attention.interface import KVFormat, kv_formats
from engine.attention.tier_split import attend_split, split_by_tier
from engine.config import CacheConfig, EngineOptions, KVDtype
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from test_host_compute import SPLIT_CASES, split_case
from test_paged_attention import CASES, DTYPES, SINK_CASES, D, Case, assert_close, build, sinks_for
from test_paged_attention import one_thread  # noqa: F401 - autouse here too: one torch thread (two in one test)
from tiny_models import Reference, _engine, prompts

N = 12  # new tokens per request


@pytest.fixture
def compiled(monkeypatch):
    """The numba backend with its chunked fallback made to raise: whatever these tests compare ran the loop."""

    def no_fallback(*a, **kw):
        raise AssertionError("the numba backend fell back to the chunked path")

    monkeypatch.setattr(ChunkedPagedBackend, "_online", no_fallback)
    monkeypatch.setattr(ChunkedPagedBackend, "prefill", no_fallback)
    be = make_backend("cpu")
    assert isinstance(be, numba_paged.NumbaPagedBackend) and be.name == "numba"
    return be


# -- the kernel -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_decode_matches_reference(case, compiled):
    q, kv, batch, window, scale = build(case)
    want = make_backend("reference").decode(q, 1, kv, batch, scale=scale, window=window)
    assert_close(compiled.decode(q, 1, kv, batch, scale=scale, window=window), want, case.id)


@pytest.mark.parametrize("case", SINK_CASES, ids=lambda c: c.id)
def test_decode_with_sinks_matches_reference(case, compiled):
    q, kv, batch, window, scale = build(case)
    sinks = sinks_for(case)
    want = make_backend("reference").decode(q, 1, kv, batch, scale=scale, window=window, sinks=sinks)
    assert_close(compiled.decode(q, 1, kv, batch, scale=scale, window=window, sinks=sinks), want, case.id)


def _chunk(case: Case, q_len: int = 3):
    """A prefill chunk: q [B, Q, H, D] at the positions of each row's last Q keys."""
    _, kv, batch, window, scale = build(case)
    H, _ = case.heads
    q = torch.randn(len(case.lens), q_len, H, D, generator=torch.Generator().manual_seed(11))
    idx = (batch.context_lens.long()[:, None] - q_len + torch.arange(q_len)[None, :]).clamp_min(0)
    q_pos = idx if batch.key_pos is None else batch.key_pos.gather(1, idx)
    return q, kv, PagedBatch(batch.block_table, batch.context_lens, q_pos, batch.key_pos), window, scale


@pytest.mark.parametrize("case", [c for c in CASES if c.bs in (1, 7, 16) and c.variant != "window_edges"],
                         ids=lambda c: c.id)
def test_prefill_chunk_and_partial_match_reference(case, compiled):
    """Q = 3 queries per row through the loop (a prefill with attention sinks takes it; the partial always does):
    output, and the partial's output and log-sum-exp."""
    q, kv, pre, window, scale = _chunk(case)
    ref = make_backend("reference")
    sinks = sinks_for(case)
    want = ref.prefill(q, 1, kv, pre, scale=scale, window=window, sinks=sinks)
    assert_close(compiled.prefill(q, 1, kv, pre, scale=scale, window=window, sinks=sinks), want, case.id)
    (o, lse), (ro, rlse) = (be.partial(q, 1, kv, pre, scale=scale, window=window) for be in (compiled, ref))
    assert_close(o, ro, f"{case.id} partial")
    assert_close(lse, rlse, f"{case.id} lse")


def test_a_partial_with_no_visible_key_is_zero_and_minus_infinity(compiled):
    q, kv, batch, window, scale = build(Case(KVDtype.INT8, 7, "key_pos"))
    blind = PagedBatch(batch.block_table, batch.context_lens, torch.full_like(batch.q_pos, -100), batch.key_pos)
    o, lse = compiled.partial(q[:, None], 1, kv, blind, scale=scale, window=window)
    assert (o == 0).all() and (lse == float("-inf")).all()


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: c.id)
def test_host_blocks_are_read_where_they_are(case, compiled):
    """Blocks on the host tier (PagedBatch.on_host): read from the host tier in the same walk (host_reads stream on
    the CPU), and attended as a separate partial merged by log-sum-exp (host_reads compute): both equal the reference
    over the unsplit pool. Each tier is poisoned where the other holds the block."""
    ref = make_backend("reference")
    for q_len in (1, 3):
        q, kv, pb, whole_kv, whole, window, scale = split_case(case, q_len)
        want = ref.prefill(q, 1, whole_kv, whole, scale=scale, window=window)
        if q_len == 1:
            assert_close(compiled.decode(q[:, 0], 1, kv, pb, scale=scale, window=window), want[:, 0], case.id)
        else:
            o, lse = compiled.partial(q, 1, kv, pb, scale=scale, window=window)
            assert_close(o, want, f"{case.id} partial over both tiers")
        got = attend_split(compiled, compiled, q, 1, kv, split_by_tier(pb, case.bs), scale=scale, window=window)
        assert_close(got, want, f"{case.id} split Q={q_len}")


def test_host_blocks_are_read_from_the_staging_buffer_when_there_is_one(compiled):
    """With a staging buffer (paged.staged, staged_table) the host blocks are read there, as read_blocks does: here
    the host tier itself is all poison, so a read of it would show."""
    case = Case(KVDtype.INT8_KIVI, 7, "window")
    q, kv, pb, whole_kv, whole, window, scale = split_case(case)
    host = kv.host
    poison = int(pb.block_table.max())
    rotten = {side: {n: type(x)(t[poison].expand_as(t).clone() for t in x) for n, x in parts.items()}
              for side, parts in (("k", host.k), ("v", host.v))}
    staged_kv = PagedKV(kv.k, kv.v, kv.dtype, host=PagedKV(rotten["k"], rotten["v"], kv.dtype), staged=host)
    staged = PagedBatch(pb.block_table, pb.context_lens, pb.q_pos, pb.key_pos, on_host=pb.on_host,
                        host_table=pb.host_table, staged_table=pb.host_table)
    want = make_backend("reference").decode(q[:, 0], 1, whole_kv, whole, scale=scale, window=window)
    assert_close(compiled.decode(q[:, 0], 1, staged_kv, staged, scale=scale, window=window), want, "staged")
    unstaged = PagedBatch(pb.block_table, pb.context_lens, pb.q_pos, pb.key_pos, on_host=pb.on_host,
                          host_table=pb.host_table)
    wrong = compiled.decode(q[:, 0], 1, staged_kv, unstaged, scale=scale, window=window)
    assert (wrong - want).abs().max() > 1e-2  # the host tier read instead: the poison shows


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.label)
def test_threads_split_the_work_without_changing_a_bit(dtype, compiled):
    """The (sequence, kv head) items split across threads: each item's arithmetic is the same on any thread."""
    q, kv, batch, window, scale = build(Case(dtype, 16, "key_pos"))
    one = compiled.decode(q, 1, kv, batch, scale=scale, window=window)
    torch.set_num_threads(2)  # restored by the module's one_thread fixture
    try:
        assert torch.equal(compiled.decode(q, 1, kv, batch, scale=scale, window=window), one)
    finally:
        torch.set_num_threads(1)


PLAIN_CASES = [c for c in CASES if kv_formats(c.dtype) == (KVFormat.PLAIN, KVFormat.PLAIN)
               and c.variant in ("causal", "window", "window_edges")]


@pytest.mark.parametrize("segments_for", [2, 8, 64], ids=lambda n: f"threads{n}")
@pytest.mark.parametrize("case", PLAIN_CASES, ids=lambda c: c.id)
def test_decode_split_into_key_segments_matches_reference(case, segments_for, compiled, monkeypatch):
    """Plain storage, keys at their index: decode's two-pass kernel (numba_kernel.decode_plain), each row's keys cut
    into as many segments as thread counts of 2, 8, 64 ask for (segments shorter than a block, empty ones), the
    partial softmaxes merged: the reference's output. The general loop is made to raise, so the split one ran."""
    monkeypatch.setattr(numba_paged.torch, "get_num_threads", lambda: segments_for)
    monkeypatch.setattr(numba_paged.numba_kernel, "attend", None)
    q, kv, batch, window, scale = build(case)
    want = make_backend("reference").decode(q, 1, kv, batch, scale=scale, window=window)
    assert_close(compiled.decode(q, 1, kv, batch, scale=scale, window=window), want, case.id)


def test_cuda_tensors_and_a_dense_prefill_go_to_the_chunked_path(monkeypatch):
    """The loop is for CPU memory; SDPA's flash kernel serves a CPU prefill chunk without sinks (its one gather
    amortized over the chunk's queries)."""
    calls = []
    real = ChunkedPagedBackend.prefill
    monkeypatch.setattr(ChunkedPagedBackend, "prefill", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    q, kv, pre, window, scale = _chunk(Case(KVDtype.FP16, 7, "window"))
    be = make_backend("cpu")
    want = make_backend("reference").prefill(q, 1, kv, pre, scale=scale, window=window)
    assert_close(be.prefill(q, 1, kv, pre, scale=scale, window=window), want, "dense prefill")
    assert calls == [1]
    be.decode(q[:, 0], 1, kv, PagedBatch(pre.block_table, pre.context_lens, pre.q_pos[:, :1]), scale=scale)
    assert calls == [1]  # decode: the loop


# -- engines ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mistral(tiny_mistral):
    from engine.model.loader import load_model

    return load_model(tiny_mistral), Reference(tiny_mistral)


@pytest.mark.parametrize("bs", [1, 7, 16])
def test_tokens_equal_transformers(llama_model, llama_ref, mistral, bs):
    """fp32 KV, greedy: GQA (tiny Llama: 4 heads on 2 kv heads) and a sliding window of 24 (tiny Mistral: prompts
    and generations past it), mixed lengths in one decode batch."""
    for model, ref, lengths in ((llama_model, llama_ref, [5, 33, 18]), (mistral[0], mistral[1], [30, 9, 41])):
        eng = Engine(model, CacheConfig(block_size=bs), EngineOptions(attention="cpu"))
        assert eng.model.backend.name == "numba"
        ps = prompts(bs, lengths)
        assert eng.generate(ps, SamplingParams(max_new_tokens=N, ignore_eos=True)) == [ref.greedy(p, N) for p in ps]
        eng.check_invariants()
        check = eng.runner.checks.summary()["attention"]
        assert check["state"] in ("passed", "not run")  # not run: this variant was checked earlier in the process


@pytest.mark.parametrize("mode", ["stream", "compute"])
def test_tokens_equal_transformers_with_host_tier_reads(llama_model, llama_ref, mode):
    eng = _engine(llama_model, 8, 2, mode)
    assert eng.model.backend.name == "numba"
    ps = prompts(3, [37, 50, 21])
    assert eng.generate(ps, SamplingParams(max_new_tokens=N, ignore_eos=True)) == [llama_ref.greedy(p, N) for p in ps]
    assert eng.counters.read_tokens_streamed > 0


def test_a_kernel_that_disagrees_is_caught_and_the_chunked_path_serves(llama_model, llama_ref):
    from app.stress.faults import WrongBackend

    eng = Engine(llama_model, CacheConfig(block_size=8, host_budget_mb=0), EngineOptions(attention="cpu"))
    eng.model.backend = WrongBackend(eng.model.backend)  # checked at the first step
    ps = prompts(4, [9, 27, 40])
    assert eng.generate(ps, SamplingParams(max_new_tokens=N, ignore_eos=True)) == [llama_ref.greedy(p, N) for p in ps]
    assert eng.model.attention == "chunked" and eng.model.backend.name == "chunked"
    said = [e for e in eng.take_events() if e.kind == "self_check"]
    assert len(said) == 1
    msg = said[0].fields["message"]
    assert msg.startswith("numba paged decode disagreed with the reference (max |Δ| 0.01")
    assert msg.endswith("): using cpu paged attention")
    assert eng.snapshot().self_checks["attention"]["fallback"] == "cpu paged attention"


def test_without_numba_cpu_is_the_chunked_path(monkeypatch, llama_model, llama_ref):
    """numba missing (its import fails): make_backend('cpu') and the engine's default are the chunked path, and the
    tokens stay exact."""
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` raises ImportError
    try:
        importlib.reload(numba_paged)
        assert not numba_paged.available() and "import of numba halted" in numba_paged.IMPORT_ERROR
        assert type(make_backend("cpu")) is ChunkedPagedBackend
        eng = Engine(llama_model, CacheConfig(block_size=8), EngineOptions())
        assert eng.model.attention == "cpu" and eng.model.backend.name == "chunked"
        ps = prompts(2, [14, 31])
        out = eng.generate(ps, SamplingParams(max_new_tokens=N, ignore_eos=True))
        assert out == [llama_ref.greedy(p, N) for p in ps]
    finally:
        monkeypatch.undo()
        importlib.reload(numba_paged)
    assert numba_paged.available() and make_backend("cpu").name == "numba"


# -- 16-bit storage conversions ------------------------------------------------------------------------------------

def _conversions():
    import numpy as np
    from numba import njit

    from engine.attention.numba_kernel import from_f32, to_f32

    @njit
    def read(bits, lut, out):
        for i in range(bits.shape[0]):
            out[i] = to_f32(bits[i], lut)

    @njit
    def write(x, like, lut, out):
        for i in range(x.shape[0]):
            out[i] = from_f32(x[i], like[0], lut)

    return np, read, write


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_data_read_as_torch_converts_every_pattern(dtype):
    """to_f32 on fp16 / bf16 bits (an fpext / a shift, in place of the old table) equals torch's conversion for all
    65,536 patterns: subnormals, infinities and NaNs included (NaNs as NaN)."""
    np, read, _ = _conversions()
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    want = bits.view(dtype).float().numpy()
    got = np.empty(1 << 16, dtype=np.float32)
    read(bits.numpy().view(np.uint16), numba_paged._data_lut(bits.view(dtype)), got)
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    assert (got[~nan].view(np.uint32) == want[~nan].view(np.uint32)).all()  # bit for bit: -0.0 too


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp32_written_as_16_bit_rounds_as_torch(dtype):
    """from_f32 (the whole-layer decode path's KV write, numba_kernel.write_plain) rounds fp32 to fp16 / bf16 as
    Tensor.to does: to nearest, ties to even, overflow to inf, subnormals, NaN; checked on the exact midpoints
    between neighbouring 16-bit values (ties), just either side of them, and random values of every exponent."""
    np, _, write = _conversions()
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    vals = bits.view(dtype).float()
    vals = vals[torch.isfinite(vals)].unique()  # sorted
    mid = (vals[:-1].double() + vals[1:].double()) / 2
    g = torch.Generator().manual_seed(5)
    rnd = torch.randn(200_000, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-140, 128, (200_000,),
                                                                                                 generator=g)).double()
    x = torch.cat([mid, torch.nextafter(mid, torch.full_like(mid, np.inf)), torch.nextafter(mid, -torch.full_like(mid, np.inf)),
                   rnd]).float()
    x = torch.cat([x, torch.tensor([np.inf, -np.inf, np.nan, 0.0, -0.0, 3.4e38, -3.4e38, 1e-45, 65520.0, 65519.0])])
    want = x.to(dtype).view(torch.int16).numpy().view(np.uint16)
    got = np.empty(len(x), dtype=np.uint16)
    write(x.numpy(), np.zeros(1, np.uint16), numba_paged._data_lut(vals.to(dtype)), got)
    back = torch.from_numpy(got.view(np.int16)).view(dtype).float()
    same = (got == want) | (torch.isnan(back) & torch.isnan(x)).numpy()
    assert same.all(), x[~torch.from_numpy(same)][:5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_plain_write_measures_as_the_probe_does(dtype):
    """numba_kernel.write_plain (the whole-layer decode path's KV write) stores what Codec.append stores and measures
    what the fidelity probe measures (block_error: the key channels' running absmax; each token's
    ||x - stored|| / max(||x||, 1e-30), max over layers), on hostile values too: a zero token (error 0), a token
    past fp16's range (inf stored: error inf), a NaN (NaN wins both maxes, as torch.maximum)."""
    import numpy as np

    from engine.attention.numba_kernel import write_plain
    from engine.kv.codecs import Appends, Codec

    g = torch.Generator().manual_seed(3)
    T, Hkv, bs, D, N = 5, 2, 4, 8, 6
    k = torch.randn(T, Hkv, D, generator=g) * 3
    v = torch.randn(T, Hkv, D, generator=g)
    k[1] = 0.0
    v[2, 1, 3] = 1e6  # fp16: inf
    k[3, 0, 5] = float("nan")
    slots = torch.tensor([4, 4, 1, 0, 5])
    offs = torch.tensor([2, 3, 0, 1, 3])
    codec = Codec(dtype)
    want = {side: {"data": torch.zeros(1, N, Hkv, bs, D, dtype=dtype)} for side in "kv"}
    a = Appends(slots, offs, slots.unique(), torch.zeros(T, dtype=torch.long), torch.zeros(N, dtype=torch.long),
                torch.zeros(T, dtype=torch.long), 0)
    codec.append(want["k"], 0, a, k)
    codec.append(want["v"], 0, a, v)
    got = {side: torch.zeros(N, Hkv, bs, D, dtype=dtype) for side in "kv"}
    kmax = np.zeros((Hkv, D), np.float32)
    kmax[1, 2] = 100.0  # an earlier layer's / step's max stays
    err = np.full((2, T), -np.inf, np.float32)
    err[1, 0] = 7.0  # an earlier layer's error stays where it is larger
    lut = numba_paged._data_lut(got["k"])
    write_plain(k.numpy(), v.numpy(), slots.numpy(), offs.numpy(), numba_paged._np(got["k"]),
                numba_paged._np(got["v"]), lut, kmax, err, dtype != torch.float32)
    for side in "kv":  # bit for bit, but for a NaN's payload (torch's vectorized bf16 rounding gives 0xFFFF)
        a, b = got[side], want[side]["data"][0]
        nan = torch.isnan(b.float())
        assert torch.equal(torch.isnan(a.float()), nan)
        bits = torch.int16 if dtype != torch.float32 else torch.int32
        assert torch.equal(a.view(bits)[~nan], b.view(bits)[~nan])
    want_max = torch.maximum(torch.from_numpy(np.where(np.arange(Hkv * D).reshape(Hkv, D) == D + 2, 100.0, 0.0)
                                              .astype(np.float32)), k.abs().amax(0))
    np.testing.assert_array_equal(np.isnan(kmax), torch.isnan(want_max).numpy())
    np.testing.assert_array_equal(np.nan_to_num(kmax), torch.nan_to_num(want_max).numpy())
    if dtype == torch.float32:
        assert err[1, 0] == 7.0 and np.isneginf(np.delete(err.reshape(-1), T)).all()  # nothing measured
        return
    for side, x in ((0, k), (1, v)):
        stored = want["kv"[side]]["data"][0][slots, :, offs].float()
        e = torch.linalg.vector_norm(x - stored, dim=(-2, -1)) / torch.linalg.vector_norm(x, dim=(-2, -1)).clamp_min(1e-30)
        if side == 1:
            e[0] = torch.maximum(e[0], torch.tensor(7.0))
        np.testing.assert_allclose(err[side], e.numpy(), rtol=1e-5, equal_nan=True)
    assert err[0, 1] == 0.0 and np.isnan(err[0, 3])
    assert np.isinf(err[1, 2]) if dtype == torch.float16 else np.isfinite(err[1, 2])  # 1e6: past fp16's range only
