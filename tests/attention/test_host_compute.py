"""host_reads="compute" (issue 10 item 1): attention over host-resident blocks is computed where they are, on the host,
and merged with the device tier's part by log-sum-exp (engine/attention/tier_split.py).

Three levels: the merge alone against one softmax over the concatenated keys; a split table (device and host
tiers, each poisoned where the other holds the block) against the unsplit reference, every storage format; and
engines at tiny device budgets against transformers' greedy tokens. The Triton kernel's partial (its lse) runs
under TRITON_INTERPRET=1 in one subprocess (`python tests/attention/test_host_compute.py OUT.pt` is that worker).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from workers import interpreter_env  # first: as a worker, keeps KVSCOPE_TEST_WITHOUT's packages out
from engine.attention import PagedBatch, PagedKV, make_backend
from engine.runtime import step_kv
from engine.attention import cpu_paged, reference, tier_split
from engine.attention.tier_split import attend_split, merge_partials, split_by_tier
from engine.kv.block_pool import RESERVED
from engine.config import CacheConfig, ConfigError, EngineOptions, KVDtype
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from engine.kv.tiers import Tier
from test_paged_attention import DTYPES, Case, build, sinks_for
from tiny_models import Reference, _engine, _mb, prompts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 16


# -- the merge -------------------------------------------------------------------------------------------------

def _partial(s: torch.Tensor, v: torch.Tensor, seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Textbook partial: scores s [R, S], values v [R, S, D], visible keys seen [R, S] -> (o [R, D], lse [R])."""
    s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    w = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[:, None])
    return torch.einsum("rs,rsd->rd", w, v), lse


@pytest.mark.parametrize("seed", range(4))
def test_merge_equals_one_softmax_over_the_concatenated_keys(seed):
    """Rows: random sides; every visible key on one side; a fully masked side; nothing visible at all; a window
    (only recent keys visible) falling on one side or across both."""
    g = torch.Generator().manual_seed(seed)
    R, Sa, Sb, D = 12, 9, 14, 8
    s = torch.randn(R, Sa + Sb, generator=g) * 4
    v = torch.randn(R, Sa + Sb, D, generator=g)
    seen = torch.rand(R, Sa + Sb, generator=g) < 0.6
    seen[:, 0] = True
    seen[1, Sa:] = False  # all on side a
    seen[2, :Sa] = False  # all on side b
    seen[3] = False  # nothing visible: (0, -inf), no NaN
    pos = torch.arange(Sa + Sb)
    seen[4] = pos > Sa + Sb - 6  # a window of 5 inside side b
    seen[5] = (pos > Sa - 4) & (pos <= Sa + 2)  # a window across the two sides
    o_a, lse_a = _partial(s[:, :Sa], v[:, :Sa], seen[:, :Sa])
    o_b, lse_b = _partial(s[:, Sa:], v[:, Sa:], seen[:, Sa:])
    o, lse = merge_partials(o_a, lse_a, o_b, lse_b)
    want_o, want_lse = _partial(s, v, seen)
    assert not o.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(o, want_o, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-6, rtol=1e-5)
    assert lse[3] == float("-inf") and (o[3] == 0).all()
    assert torch.equal(o[1], o_a[1]) and torch.equal(o[2], o_b[2])  # an empty side weighs exactly 0
    o2, lse2 = merge_partials(o_b, lse_b, o_a, lse_a)  # symmetric
    torch.testing.assert_close(o2, o, atol=1e-6, rtol=1e-6)
    # Three sides in either grouping: the merge is associative, so split-K and the tier split compose.
    third = torch.arange(Sa + Sb) % 3
    parts = [_partial(s, v, seen & (third == i)) for i in range(3)]
    left = merge_partials(*merge_partials(*parts[0], *parts[1]), *parts[2])
    right = merge_partials(*parts[0], *merge_partials(*parts[1], *parts[2]))
    for got in (left, right):
        torch.testing.assert_close(got[0], want_o, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got[1], want_lse, atol=1e-6, rtol=1e-5)


# -- a split table against the unsplit reference -----------------------------------------------------------------

def split_case(case: Case, q_len: int = 1):
    """(q [B, Q, H, D], kv with a host tier, PagedBatch with on_host, the unsplit kv and batch, window, scale).

    Block j of row b is on the host with probability 1/2 (row 0: all of them, row 1: none). Each tier is a copy of
    the pool whose blocks held by the *other* tier are overwritten with the poisoned block, and the device table
    points at the poison where the block is on the host (as at the engine's null block): a read from the wrong
    tier, or a key shown to both sides, moves the output far beyond the tolerance."""
    q, kv, batch, window, scale = build(case)
    B, NB = batch.block_table.shape
    g = torch.Generator().manual_seed(len(case.id) * 31 + q_len)
    on_host = torch.rand(B, NB, generator=g) < 0.5
    on_host[0] = True
    on_host[1] = False
    table = batch.block_table.long()
    poison = int(table.max())  # every row's padding points at the poisoned block

    def tier(own: torch.Tensor) -> dict:  # the pool with the blocks it does not own poisoned, layer by layer
        other = table[~own & (table != poison)]

        def poisoned(layers):  # a part: parts[name][layer] is one layer's [N, ...] tensor
            copy = type(layers)(t.clone() for t in layers)
            for t in copy:
                t[other] = t[poison].clone()
            return copy

        return {side: {n: poisoned(x) for n, x in parts.items()} for side, parts in (("k", kv.k), ("v", kv.v))}

    dev, host = tier(~on_host), tier(on_host)
    host_kv = PagedKV(host["k"], host["v"], kv.dtype)
    split_kv = PagedKV(dev["k"], dev["v"], kv.dtype, host=host_kv)
    qpos = batch.q_pos.reshape(B, 1)
    if q_len > 1:  # a prefill chunk: the last q_len keys' positions
        idx = (batch.context_lens.long()[:, None] - q_len + torch.arange(q_len)[None, :]).clamp_min(0)
        qpos = idx if batch.key_pos is None else batch.key_pos.gather(1, idx)
        q = torch.randn(B, q_len, q.shape[1], q.shape[2], generator=g)
    else:
        q = q[:, None]
    pb = PagedBatch(torch.where(on_host, poison, table), batch.context_lens, qpos, batch.key_pos,
                    on_host=on_host, host_table=torch.where(on_host, table, poison))
    whole = PagedBatch(table, batch.context_lens, qpos, batch.key_pos)
    return q, split_kv, pb, kv, whole, window, scale


SPLIT_CASES = [Case(d, bs, v) for d in DTYPES for bs in (1, 7, 16) for v in ("causal", "window", "key_pos", "mha")]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: c.id)
def test_split_attention_equals_the_unsplit_reference(case):
    """Decode (Q = 1) and a prefill chunk (Q = 3), GQA and MHA, windows, explicit positions, every storage format:
    the chunked, numba (cpu) and reference partials merged equal the reference over the whole table."""
    ref = make_backend("reference")
    for q_len in (1, 3):
        q, kv, pb, whole_kv, whole, window, scale = split_case(case, q_len)
        split = split_by_tier(pb, case.bs)
        assert split.host.block_table.shape[1] == int(pb.on_host.any(0).sum())  # host columns only
        assert split.device is not None  # row 1 has only device blocks
        want = ref.prefill(q, 1, whole_kv, whole, scale=scale, window=window)
        for name in ("chunked", "cpu", "reference"):
            be = make_backend(name, **({"chunk_elems": 1} if name == "chunked" else {}))  # one block per chunk
            got = attend_split(be, be, q, 1, kv, split, scale=scale, window=window)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{case.id} {name} Q={q_len}: {m}")


@pytest.mark.parametrize("case", [c for c in SPLIT_CASES if c.dtype in (KVDtype.FP32, KVDtype.INT8_KIVI)],
                         ids=lambda c: c.id)
def test_split_attention_with_sinks_equals_the_unsplit_reference(case):
    """GPT-OSS's attention sinks: never in a partial, joined once after the device and host parts are merged (one more
    log-sum-exp term): equal to the reference's softmax over all the keys and the sink; decode and a prefill chunk."""
    ref = make_backend("reference")
    sinks = sinks_for(case)
    for q_len in (1, 3):
        q, kv, pb, whole_kv, whole, window, scale = split_case(case, q_len)
        split = split_by_tier(pb, case.bs)
        want = ref.prefill(q, 1, whole_kv, whole, scale=scale, window=window, sinks=sinks)
        assert (want - ref.prefill(q, 1, whole_kv, whole, scale=scale, window=window)).abs().max() > 1e-3
        for name in ("chunked", "cpu", "reference"):
            be = make_backend(name, **({"chunk_elems": 1} if name == "chunked" else {}))
            got = attend_split(be, be, q, 1, kv, split, scale=scale, window=window, sinks=sinks)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{case.id} {name} Q={q_len}: {m}")


def test_add_sinks_is_one_more_term_of_the_softmax():
    g = torch.Generator().manual_seed(5)
    s, v = torch.randn(6, 10, generator=g) * 3, torch.randn(6, 10, 4, generator=g)
    seen = torch.ones(6, 10, dtype=torch.bool)
    seen[5] = False  # nothing visible: the sink takes all the weight, the output is 0
    sinks = torch.randn(6, generator=g) * 2
    o, lse = tier_split.add_sinks(*_partial(s, v, seen), sinks)
    w = torch.softmax(torch.cat((s.masked_fill(~seen, float("-inf")), sinks[:, None]), dim=1), dim=1)[:, :10]
    torch.testing.assert_close(o, torch.einsum("rs,rsd->rd", w, v), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, torch.logaddexp(_partial(s, v, seen)[1], sinks))
    assert (o[5] == 0).all() and lse[5] == sinks[5]


def test_partials_of_rows_with_no_visible_key_are_zero_and_minus_infinity():
    """A side that holds none of a row's visible keys (here: every query before every key) returns out 0 and lse
    -inf, from the chunked, numba (cpu), reference and (through _merge_splits) triton paths alike."""
    q, kv, batch, window, scale = build(Case(KVDtype.INT8, 7, "key_pos"))
    blind = PagedBatch(batch.block_table, batch.context_lens, torch.full_like(batch.q_pos, -100), batch.key_pos)
    for name in ("chunked", "cpu", "reference"):
        o, lse = make_backend(name).partial(q[:, None], 1, kv, blind, scale=scale, window=window)
        assert (o == 0).all() and (lse == float("-inf")).all(), name
    o, lse = make_backend("cpu").partial(q[:, None], 1, kv, batch, scale=scale, window=window)
    assert torch.isfinite(lse).all()


def test_a_batch_without_host_blocks_is_not_split():
    q, kv, batch, window, scale = build(Case(KVDtype.FP32, 7, "causal"))
    assert split_by_tier(batch, 7) is None
    on_host = torch.zeros(batch.block_table.shape, dtype=torch.bool)
    assert split_by_tier(PagedBatch(batch.block_table, batch.context_lens, batch.q_pos, on_host=on_host,
                                    host_table=batch.block_table), 7) is None


# -- engines ---------------------------------------------------------------------------------------------------

@pytest.fixture
def spy(monkeypatch):
    """Counts merges and host partials, and fails any read of a host block through the streaming path."""
    seen = {"merges": 0, "host_partials": 0}
    merge = tier_split.merge_partials

    def counting_merge(*a):
        seen["merges"] += 1
        return merge(*a)

    def no_streaming(read):
        def wrapped(kv, side, batch, cols, fetch, head_major):
            assert batch.on_host is None, "host_reads=compute streamed a host block"
            return read(kv, side, batch, cols, fetch, head_major)
        return wrapped

    monkeypatch.setattr(tier_split, "merge_partials", counting_merge)
    for mod in (cpu_paged, reference, step_kv):
        monkeypatch.setattr(mod, "read_blocks", no_streaming(mod.read_blocks))
    real = tier_split.attend_split

    def counting_split(device_side, host_side, q, layer, kv, split, **kw):
        seen["host_partials"] += 1
        assert split.host.block_table.device.type == "cpu"
        return real(device_side, host_side, q, layer, kv, split, **kw)

    import engine.model.llama_family
    monkeypatch.setattr(engine.model.llama_family, "attend_split", counting_split)
    return seen


@pytest.mark.parametrize("attention", ["cpu", "reference"])
@pytest.mark.parametrize("bs", [1, 8, 16])
@pytest.mark.parametrize("dev_blocks", [0, 1, 2])
def test_compute_mode_tokens_equal_transformers(llama_model, llama_ref, spy, attention, bs, dev_blocks):
    ps = prompts(3, [37, 50, 21])
    eng = _engine(llama_model, bs, dev_blocks, "compute", attention)
    assert eng.pool.tiers[Tier.DEVICE].capacity == dev_blocks
    out = eng.generate(ps, SamplingParams(max_new_tokens=N, ignore_eos=True))
    assert out == [llama_ref.greedy(p, N) for p in ps]
    eng.check_invariants()
    c = eng.counters
    assert c.read_tokens_streamed > 0 and c.preemptions == 0
    assert spy["host_partials"] > 0
    if dev_blocks:  # some steps had a device part to merge with
        assert spy["merges"] > 0
    else:
        assert c.read_tokens_missed == c.read_tokens_streamed == c.read_tokens


def test_compute_mode_reads_a_demoted_prefix_on_the_host(llama_model, llama_ref, spy):
    """A prefix demoted to the host tier is attended there, never promoted; a roomy device tier takes the rest."""
    p = prompts(9, [60])[0]
    eng = _engine(llama_model, 8, 40, "compute")
    eng.generate([p], SamplingParams(max_new_tokens=4, ignore_eos=True))
    eng.kv.residency.demote_idle(eng.clock() + 3600)
    promotions = eng.counters.promotions
    out = eng.generate([p + [7, 8]], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    assert out == llama_ref.greedy(p + [7, 8], 6)
    assert eng.counters.promotions == promotions and spy["merges"] > 0


@pytest.mark.parametrize("attention", ["cpu", "reference"])
def test_compute_mode_sliding_window_equals_transformers(tiny_mistral, attention):
    """The tiny Mistral's window of 24, contexts past it, a device tier of 1 block of 7: windows over both tiers."""
    from engine.model.loader import load_model

    model, ref = load_model(tiny_mistral), Reference(tiny_mistral)
    ps = prompts(20, [10, 31, 57])
    eng = _engine(model, 7, 1, "compute", attention)
    out = eng.generate(ps, SamplingParams(max_new_tokens=N, ignore_eos=True))
    assert out == [ref.greedy(p, N) for p in ps]


@pytest.mark.parametrize("kv_dtype", ["fp16", "bf16", "int8", "int8-delta", "int8-kivi", "fp8"])
def test_quantized_formats_give_the_tokens_stream_mode_gives(llama_model, kv_dtype):
    from engine.kv.codecs import fp8_supported

    if kv_dtype == "fp8" and not fp8_supported():
        pytest.skip("no float8_e4m3fn in this torch")
    ps = prompts(12, [30, 45])
    outs = {}
    for mode in ("stream", "compute"):
        eng = Engine(llama_model, CacheConfig(block_size=8, kv_dtype=kv_dtype,
                                              device_budget_mb=_mb(llama_model, 1 + RESERVED, 8, kv_dtype),
                                              host_budget_mb=_mb(llama_model, 400, 8, kv_dtype), host_reads=mode),
                     EngineOptions(attention="cpu"))
        outs[mode] = eng.generate(ps, SamplingParams(max_new_tokens=12, ignore_eos=True))
        eng.check_invariants()
    assert outs["compute"] == outs["stream"]


def test_the_knob_takes_compute_and_rejects_bad_values(llama_model, llama_ref):
    assert CacheConfig(host_reads="compute").host_reads == "compute"
    for bad in ("gpu", "Compute", "", "host"):
        with pytest.raises(ConfigError, match=r"host_reads: .* is not one of promote, stream, compute"):
            CacheConfig().replace(host_reads=bad)
    # Live: a running engine switched from promote to compute between requests keeps exact tokens.
    eng = _engine(llama_model, 8, 2, "promote")
    p = prompts(5, [40])[0]
    assert eng.generate([p], SamplingParams(max_new_tokens=8, ignore_eos=True))[0] == llama_ref.greedy(p, 8)
    eng.reconfigure(host_reads="compute")
    assert eng.config.host_reads == "compute"
    assert eng.generate([p + [9]], SamplingParams(max_new_tokens=8, ignore_eos=True))[0] == llama_ref.greedy(p + [9], 8)


def _kvscope(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)


def test_cli_host_reads_compute_end_to_end(tiny_llama):
    """A device tier of a few blocks: `--host-reads compute` answers what `--host-reads stream` answers, and reads
    keys on the host; a bad value is refused with the choices."""
    common = ["generate", "Name three uses of a KV cache and explain one.", "--model", tiny_llama, "--block-size", "4",
              "--device-budget-mb", "0.008", "--max-new-tokens", "12", "--ignore-eos", "--json"]
    outs = {}
    for mode in ("stream", "compute"):
        proc = _kvscope(*common, "--host-reads", mode)
        assert proc.returncode == 0, proc.stderr
        outs[mode] = json.loads(proc.stdout)
    got = outs["compute"]
    assert got["token_ids"] == outs["stream"]["token_ids"] and len(got["token_ids"]) == 12
    assert got["stats"]["config"]["host_reads"] == "compute" and got["stats"]["device_blocks"] == 2
    assert got["stats"]["read_tokens_streamed"] > 0 and got["stats"]["preemptions"] == 0
    bad = _kvscope(*common, "--host-reads", "gpu")
    assert bad.returncode == 2 and "compute" in bad.stderr and "Traceback" not in bad.stderr


# -- the Triton kernel's partial, interpreted ---------------------------------------------------------------------

TRITON_CASES = [Case(KVDtype.FP32, 7, "key_pos"), Case(KVDtype.INT8_DELTA, 16, "window"),
                Case(KVDtype.INT8_KIVI, 1, "causal"), Case(KVDtype.FP16, 7, "mha")]


def test_triton_partial_merges_with_the_host_part(tmp_path):
    """The kernel's split-K partials give the device part's lse (1 split and 3); merged with the cpu path's host part
    they equal the unsplit reference."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        pytest.skip(f"triton is not installed ({e})")
    out = tmp_path / "outputs.pt"
    env = interpreter_env()  # with this session's KVSCOPE_CACHE_DIR: the worker reuses the conversion cache
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"interpreter worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    got = torch.load(out)
    ref = make_backend("reference")
    for case in TRITON_CASES:
        q, _, _, whole_kv, whole, window, scale = split_case(case)
        want = ref.prefill(q, 1, whole_kv, whole, scale=scale, window=window)
        for splits in (1, 3):
            torch.testing.assert_close(got[case.id, splits], want, atol=1e-5, rtol=1e-5)


def _worker(path: str) -> None:
    from engine.attention.triton_paged import INTERPRET

    assert INTERPRET, "run with TRITON_INTERPRET=1"
    outs = {}
    for case in TRITON_CASES:
        q, kv, pb, *_, window, scale = split_case(case)
        for splits in (1, 3):
            dev, host = make_backend("triton", splits=splits), make_backend("cpu")
            outs[case.id, splits] = attend_split(dev, host, q, 1, kv, split_by_tier(pb, case.bs), scale=scale,
                                                 window=window)
    torch.save(outs, path)


if __name__ == "__main__":
    _worker(sys.argv[1])
