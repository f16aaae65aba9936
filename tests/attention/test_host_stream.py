"""Streaming host blocks a layer ahead (issue 10 item 1; engine/attention/host_stream.py): with host_reads=stream,
a step's host-tier blocks are copied as stored into staging on the compute device, the next layer's copy issued
when this layer begins, and attention reads the staging. On the CPU the copies run inline in the same program
order as CUDA's side-stream copies, so the ordering (issue ahead, wait before reading, re-copy what the step
wrote) is checked here; tests/runtime/test_cuda.py and app/stress/gpu_check.py check it where the copies are asynchronous."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kv.block_pool import RESERVED, BlockPool
from engine.config import CacheConfig, EngineOptions
from engine.runtime.engine import Engine
from engine.model.loader import load_model
from engine.sequence import SamplingParams
from engine.kv.tiers import Tier
from tiny_models import prompts


def _engine(model, dev_blocks: int, kv_dtype: str = "fp32", bs: int = 8, mode: str = "stream",
            attention: str = "cpu", **cfg) -> Engine:
    s = model.spec

    def mb(n):
        return n * BlockPool.bytes_per_block(CacheConfig(block_size=bs, kv_dtype=kv_dtype), s.num_layers,
                                             s.num_kv_heads, s.head_dim) / 2**20

    config = CacheConfig(block_size=bs, kv_dtype=kv_dtype, device_budget_mb=mb(dev_blocks + RESERVED),
                         host_budget_mb=mb(400), host_reads=mode, **cfg)
    return Engine(model, config, EngineOptions(attention=attention))


def _steps(log: list[tuple[str, int]]) -> list[list[tuple[str, int]]]:
    """The log cut into steps: each begins by issuing its first staged layer (layer 0)."""
    out: list[list[tuple[str, int]]] = []
    for e in log:
        if e == ("issue", 0):
            out.append([])
        out[-1].append(e)
    return out


@pytest.mark.parametrize("attention", ["cpu", "reference"])
def test_the_next_layers_copy_is_issued_before_this_layer_reads(deep_model, deep_ref, attention):
    ps = prompts(31, [29, 41])
    eng = _engine(deep_model, 1, attention=attention)
    L = deep_model.spec.num_layers
    eng.runner.stream.log = log = []
    out = eng.generate(ps, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert out == [deep_ref.greedy(p, 8) for p in ps]
    steps = _steps(log)
    assert len(steps) >= 8  # every step read host blocks (a device tier of one block)
    for st in steps:
        at = {e: i for i, e in enumerate(st)}
        assert [e for e in st if e[0] == "issue"] == [("issue", li) for li in range(L)]  # each layer copied once
        assert [e for e in st if e[0] == "ready"] == [("ready", li) for li in range(L)]
        for li in range(1, L):
            assert at[("issue", li)] < at[("ready", li - 1)]  # in flight while layer li-1 computes
            if li >= 2:
                assert at[("ready", li - 2)] < at[("issue", li)]  # two staging buffers: never more than one ahead
    assert eng.counters.streamed_bytes > 0


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8", "int8-delta", "int8-kivi"])
def test_staging_holds_the_stored_bytes_of_the_host_blocks_after_the_step_wrote_them(llama_model, kv_dtype):
    """After each step, every staged layer equals the host tier's stored parts of the step's host blocks, byte for
    byte, the blocks the step itself wrote into included (re-copied after the layer's copy was issued)."""
    eng = _engine(llama_model, 0, kv_dtype=kv_dtype)  # no device tier: every write and read is on the host tier
    runner = eng.runner
    made = []
    begin = runner.stream.begin

    def keep(*a, **k):
        made.append(begin(*a, **k))
        return made[-1]

    runner.stream.begin = keep
    eng.add_request(prompts(40, [27])[0], SamplingParams(max_new_tokens=6, ignore_eos=True))
    host = eng.pool.tiers[Tier.HOST]
    checked = 0
    for _ in range(6):  # the prefill, then 5 decode steps
        made.clear()
        eng.step()
        (st,) = made
        for li in st.layers:
            staged = st.ready(li)
            for side, parts in (("k", host.k), ("v", host.v)):
                for name, layers in parts.items():
                    want = layers[li][st.slots]
                    got = staged[(side, name)]
                    assert got.dtype == want.dtype  # stored, not decoded: int8 stays int8
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (li, side, name)
                    checked += 1
    assert checked > 0
    # Bytes counted: stored bytes of the staged blocks, every layer, K and V (scales included).
    assert eng.counters.streamed_bytes % eng.pool.block_bytes == 0


def test_stored_bytes_cross_not_decoded_ones(llama_model):
    """int8 K/V stream about a quarter of fp32's bytes for the same blocks."""
    got = {}
    for dtype in ("fp32", "int8"):
        eng = _engine(llama_model, 0, kv_dtype=dtype)
        eng.generate(prompts(41, [33]), SamplingParams(max_new_tokens=5, ignore_eos=True))
        got[dtype] = eng.counters.streamed_bytes
    assert 0.25 <= got["int8"] / got["fp32"] <= 0.35  # int8 data + fp16 scales per token: (64 + 2) / 256 ~ 0.26


def test_a_sliding_window_layer_that_skips_host_blocks_leaves_no_copy_behind(tiny_mistral):
    """Blocks wholly outside a window are not read; their layer's copy is still waited for before the step ends."""
    from transformers import AutoModelForCausalLM

    model = load_model(tiny_mistral)
    p = prompts(42, [70])[0]
    eng = _engine(model, 1)
    out = eng.generate([p], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    ref = AutoModelForCausalLM.from_pretrained(tiny_mistral, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = ref.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out == want[0, len(p):].tolist()
    assert eng.counters.streamed_bytes > 0


def test_a_copy_that_fails_fails_its_step(llama_model, monkeypatch):
    """An error in a copy fails the step (no partial output as success), once the stream's first step was checked
    (a copy that fails in that step is caught and the host tier read instead: tests/runtime/test_self_check.py)."""
    eng = _engine(llama_model, 0)
    eng.runner.stream.checked = True
    eng.add_request(prompts(43, [20])[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
    import engine.attention.host_stream as hs

    real = torch.index_select

    def broken(src, dim, idx, out=None):
        raise RuntimeError("copy engine fault")

    monkeypatch.setattr(hs.torch, "index_select", broken)
    with pytest.raises(RuntimeError, match="copy engine fault"):
        eng.step()
    monkeypatch.setattr(hs.torch, "index_select", real)


def test_compute_mode_and_device_resident_steps_stage_nothing(llama_model):
    for mode, dev in (("compute", 0), ("stream", 400)):
        eng = _engine(llama_model, dev, mode=mode)
        eng.runner.stream.log = log = []
        eng.generate(prompts(44, [25]), SamplingParams(max_new_tokens=4, ignore_eos=True))
        assert log == [] and eng.counters.streamed_bytes == 0, mode
        assert eng.runner.stream.nbytes() == 0


def test_staging_memory_is_reported_and_follows_a_format_change(llama_model):
    eng = _engine(llama_model, 0, kv_dtype="int8")
    eng.generate(prompts(45, [30]), SamplingParams(max_new_tokens=3, ignore_eos=True))
    mem = eng.memory()
    assert mem["stream_staging_bytes"] == eng.runner.stream.nbytes() > 0
    names = {k[1] for k in eng.runner.stream._bufs}
    assert names == {"data", "scale"}
    eng.reconfigure(kv_dtype="fp32")
    eng.generate(prompts(46, [30]), SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert {k[1] for k in eng.runner.stream._bufs} == {"data"}  # the int8 scales' buffers are gone
    assert np.isfinite(mem["stream_staging_bytes"])


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("kv_dtype", ["fp32", "int8-kivi"])
def test_staged_copies_are_ordered_against_busy_compute_and_host_writes(device, kv_dtype):
    """2 MiB blocks (fp32) on the host tier streamed layer by layer while the compute stream is kept busy; after
    each layer's copy is issued one of its host blocks is rewritten (as the step's own K/V write does) and
    refreshed. Every staged byte must equal the host tier's: a read before the copy landed, a copy that ran
    before the compute stream's earlier work, or a lost refresh would show."""
    from engine.attention.host_stream import HostStream

    g = (8, 4, 128)
    cfg = CacheConfig(block_size=64, kv_dtype=kv_dtype, device_budget_mb=48, host_budget_mb=48)
    dev = torch.device(device)
    pool = BlockPool(g, cfg, dev)
    n = 10
    lids = np.asarray([pool.allocate(Tier.DEVICE, 0, 0.0) for _ in range(n)])
    pool.set_fill(lids.tolist(), [64] * n)
    pool.write_blocks(lids.tolist(), torch.randn(g[0], n, g[1], 64, g[2], device=dev),
                      torch.randn(g[0], n, g[1], 64, g[2], device=dev))
    pool.move(lids, Tier.HOST, 1.0, reason="test")
    host = pool.tiers[Tier.HOST]
    slots = np.sort(pool.slot[lids])
    hs = HostStream(dev)
    busy = torch.randn(2048 if device == "cuda" else 128, 2048 if device == "cuda" else 128, device=dev)
    gen = torch.Generator().manual_seed(0)
    for round_ in range(3):
        st = hs.begin(host.k, host.v, slots, list(range(g[0])))
        for li in range(g[0]):
            st.at_layer(li)  # issues layer li+1's copy
            for _ in range(3):
                busy = busy @ busy / busy.shape[0]  # compute queued on the compute stream meanwhile
            hit = torch.from_numpy(slots[[round_ % n]].astype(np.int64))
            for parts in (host.k, host.v):  # the step writes one host block of this layer
                d = parts["data"][li]
                d[hit] = (torch.randn(d[hit].shape, generator=gen) * 20).to(d.dtype)
            st.refresh(li, hit)
            staged = st.ready(li)
            for side, parts in (("k", host.k), ("v", host.v)):
                for name, layers in parts.items():
                    want = layers[li][torch.from_numpy(slots.astype(np.int64))]
                    got = staged[(side, name)].cpu()
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (round_, li, side, name)
        st.finish()
    assert st.bytes == n * pool.block_bytes  # every layer of every block, as stored, once
    if device == "cuda":
        assert host.k["data"].is_pinned()
