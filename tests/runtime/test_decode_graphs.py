"""Decode steps through the CUDA-graph path (engine/runtime/cuda_graphs.py), checked on the CPU in "static" mode: the
same padded, static-shaped step a graph replays (bucketed batch, null-block table padding, padding rows that
write the sink block), run eagerly. Capture itself needs CUDA: app/stress/gpu_check.py runs these checks there."""

from __future__ import annotations

import pytest
import torch

from tiny_models import prompts
from engine.config import CacheConfig, ConfigError, EngineOptions
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from engine.kv.tiers import Tier

N = 12


def _engine(model, mode="static", **cfg) -> Engine:
    cfg.setdefault("host_budget_mb", 0)
    return Engine(model, CacheConfig(**cfg), EngineOptions(attention="cpu", cuda_graphs=mode, context_limit=96))


@pytest.mark.parametrize("bs", [1, 7, 16])
def test_static_decode_steps_equal_transformers(llama_model, llama_ref, bs):
    """3 sequences run in the 4-row bucket (one padding row); every decode step goes through the static path."""
    eng = _engine(llama_model, block_size=bs)
    ps = prompts(40 + bs, [5, 23, 40])
    out = eng.generate(ps, SamplingParams(max_new_tokens=N, ignore_eos=True))
    assert out == [llama_ref.greedy(p, N) for p in ps]
    graphs = eng.runner.graphs
    assert graphs.mode == "static" and graphs.fallback is None
    assert set(graphs.captured) <= {1, 2, 4} and 4 in graphs.captured
    eng.check_invariants()  # the null block still zero, never handed out


def test_padding_rows_write_only_the_sink(llama_model):
    eng = _engine(llama_model, block_size=8)
    dev = eng.pool.tiers[Tier.DEVICE]
    eng.generate(prompts(3, [9, 17, 30]), SamplingParams(max_new_tokens=4, ignore_eos=True))
    sink = dev.k["data"][:, dev.sink_slot]
    assert sink.abs().sum() > 0  # the padding row's K went somewhere harmless...
    assert dev.k["data"][:, dev.null_slot].abs().sum() == 0  # ...not into the null block tables are padded with
    assert dev.sink_slot == dev.capacity + 1 and dev.null_slot == dev.capacity
    assert dev.k["data"].shape[1] == dev.capacity + 2


def test_graphs_are_dropped_after_a_geometry_change_and_tokens_stay_exact(llama_model, llama_ref):
    eng = _engine(llama_model, block_size=16)
    ps = prompts(8, [20, 33])
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=N, ignore_eos=True)) for p in ps]
    for _ in range(6):
        eng.step()
    before = eng.runner.graphs.key
    eng.reconfigure(block_size=4)
    eng.run_until_done()
    assert eng.runner.graphs.key != before
    assert eng.runner.graphs.key[4] == 96 // 4 + 1  # table width: the context limit's blocks at the new size
    assert [eng.seqs[i].output for i in ids] == [llama_ref.greedy(p, N) for p in ps]


def test_prefill_and_repositioned_rows_run_eager(llama_model):
    eng = _engine(llama_model, block_size=8)
    graphs = eng.runner.graphs
    seq = eng.add_request(prompts(5, [30])[0], SamplingParams(max_new_tokens=6, ignore_eos=True))
    eng.step()  # prefill
    assert not graphs.captured
    eng.step()
    assert 1 in graphs.captured
    s = eng.seqs[seq]
    assert graphs.eligible([(s, 1)])
    s.repositioned = True
    assert not graphs.eligible([(s, 1)])


@pytest.mark.parametrize("kv_dtype", ["int8", "int8-delta", "int8-kivi"])
def test_quantized_formats_through_the_static_path_match_eager_decode(llama_model, kv_dtype):
    """The static path appends K/V as eager decode does (one token per block, the block's fill before it as its
    rank-0 offset): its tokens equal an eager engine's, tables padded far past the rows' blocks."""
    ps = prompts(17, [6, 25, 31])
    outs = []
    for mode in ("static", "off"):
        eng = _engine(llama_model, mode, block_size=8, kv_dtype=kv_dtype)
        outs.append(eng.generate(ps, SamplingParams(max_new_tokens=10, ignore_eos=True)))
        eng.check_invariants()
    assert outs[0] == outs[1]


def test_option_values(llama_model):
    with pytest.raises(ConfigError, match="cuda_graphs: 'always' is not one of auto, on, off, static"):
        EngineOptions(cuda_graphs="always").validate()
    eng = Engine(llama_model, CacheConfig(host_budget_mb=0), EngineOptions(cuda_graphs="auto"))
    assert eng.runner.graphs.mode == "off"  # auto on the CPU
    eng = Engine(llama_model, CacheConfig(host_budget_mb=0), EngineOptions(cuda_graphs="on"))
    assert eng.runner.graphs.mode == "static"  # "on" without CUDA: nothing to capture, the static path
    eng = Engine(llama_model, CacheConfig(host_budget_mb=0), EngineOptions(cuda_graphs="static", attention="reference"))
    s = eng.seqs.get(eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=2)))
    assert not eng.runner.graphs.eligible([(s, 1)])  # the reference path is not static-shaped
    assert torch.device(eng.options.device).type == "cpu"
