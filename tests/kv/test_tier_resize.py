"""Budget changes in place (issue 10 item 2): a tier grows or shrinks without being rebuilt, block ids are kept,
shrinking demotes or evicts the coldest blocks first, the prefix cache survives, and tokens stay exact."""

from __future__ import annotations

import numpy as np
import pytest

from tiny_models import prompts
from engine.kv.block_pool import RESERVED, BlockPool
from engine.config import CacheConfig, ConfigError, EngineOptions
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from engine.kv.tiers import Tier

N = 14


def _mb(model, blocks: int, bs: int = 8) -> float:
    s = model.spec
    return blocks * BlockPool.bytes_per_block(CacheConfig(block_size=bs), s.num_layers, s.num_kv_heads, s.head_dim) / 2**20


def _engine(model, dev: int, host: int, **kw) -> Engine:
    return Engine(model, CacheConfig(block_size=8, device_budget_mb=_mb(model, dev + RESERVED),
                                     host_budget_mb=_mb(model, host), **kw), EngineOptions(attention="cpu"))


def test_resizing_mid_run_keeps_block_ids_and_tokens(llama_model, llama_ref):
    eng = _engine(llama_model, 40, 40)
    ps = prompts(30, [29, 41, 17])
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=N, ignore_eos=True)) for p in ps]
    for _ in range(4):
        eng.step()
    tables = {i: list(eng.seqs[i].blocks) for i in ids}
    pool = eng.pool
    for dev, host in ((80, 40), (3, 60), (0, 60), (25, 10)):  # grow, shrink below one sequence, none, back
        eng.reconfigure(device_budget_mb=_mb(llama_model, dev + RESERVED), host_budget_mb=_mb(llama_model, host))
        assert eng.pool is pool  # the same pool, resized
        assert pool.tiers[Tier.DEVICE].capacity == dev and pool.tiers[Tier.HOST].capacity == host
        assert {i: eng.seqs[i].blocks for i in ids} == tables  # no block was renumbered
        eng.check_invariants()
        eng.step()
        tables = {i: list(eng.seqs[i].blocks) for i in ids}
    eng.run_until_done()
    assert [eng.seqs[i].output for i in ids] == [llama_ref.greedy(p, N) for p in ps]
    eng.check_invariants()


def test_the_prefix_cache_survives_a_budget_change(llama_model):
    eng = _engine(llama_model, 60, 60)
    shared = prompts(31, [40])[0]
    eng.generate([shared + [5]], SamplingParams(max_new_tokens=2, ignore_eos=True))
    cached = len(eng.pool.tiers[Tier.DEVICE].cached) + len(eng.pool.tiers[Tier.HOST].cached)
    assert cached >= 5
    eng.reconfigure(device_budget_mb=_mb(llama_model, 30 + RESERVED))  # still room for every cached block
    assert len(eng.pool.tiers[Tier.DEVICE].cached) + len(eng.pool.tiers[Tier.HOST].cached) == cached
    before = eng.counters.prompt_reused
    eng.generate([shared + [9]], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert eng.counters.prompt_reused - before == 40  # all five blocks of the shared prompt reused


def test_shrinking_demotes_the_coldest_first(llama_model):
    now = [0.0]
    eng = Engine(llama_model, CacheConfig(block_size=8, device_budget_mb=_mb(llama_model, 20 + RESERVED),
                                          host_budget_mb=_mb(llama_model, 20)), EngineOptions(attention="cpu"),
                 clock=lambda: now[0])
    ps = prompts(32, [30, 30])
    for p in ps:  # two cached prompts, the second read later (hotter)
        eng.generate([p], SamplingParams(max_new_tokens=1, ignore_eos=True))
        now[0] += 1.0
    dev = eng.pool.tiers[Tier.DEVICE]
    by_age = sorted(np.flatnonzero(dev.lid >= 0), key=lambda s: dev.last[s])
    coldest = set(dev.lid[by_age[:4]].tolist())
    eng.reconfigure(device_budget_mb=_mb(llama_model, dev.used - 4 + RESERVED))
    assert all(eng.pool.tier[lid] == Tier.HOST for lid in coldest)


def test_a_shrink_that_cannot_hold_owned_blocks_is_refused_and_changes_nothing(llama_model):
    eng = _engine(llama_model, 10, 0)
    sid = eng.add_request(prompts(33, [50])[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
    eng.step()
    blocks, cfg = list(eng.seqs[sid].blocks), eng.config
    with pytest.raises(ConfigError, match="nothing was changed"):
        eng.reconfigure(device_budget_mb=_mb(llama_model, 2 + RESERVED))
    assert eng.config == cfg and eng.seqs[sid].blocks == blocks and eng.pool.tiers[Tier.DEVICE].capacity == 10
    eng.run_until_done()
    eng.check_invariants()


def test_a_dtype_change_keeps_the_prefix_cache(llama_model):
    """Cached blocks are re-encoded with their hashes: the next request with the same prompt still hits."""
    eng = _engine(llama_model, 60, 60)
    shared = prompts(34, [40])[0]
    eng.generate([shared + [5]], SamplingParams(max_new_tokens=2, ignore_eos=True))
    eng.reconfigure(kv_dtype="int8-kivi")
    assert len(eng.pool.tiers[Tier.DEVICE].cached) + len(eng.pool.tiers[Tier.HOST].cached) >= 5
    before = eng.counters.prompt_reused
    eng.generate([shared + [9]], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert eng.counters.prompt_reused - before == 40
    eng.check_invariants()


@pytest.mark.parametrize("bs", [4, 16])
def test_a_block_size_change_rebuilds_the_prefix_cache(llama_model, llama_ref, bs):
    """Cached prefixes are cut into blocks of the new size and chained anew: a request sharing a cached prompt
    still reuses it after the change (issue 10: every block-size change emptied the prefix cache), exactly."""
    eng = _engine(llama_model, 60, 60)
    shared = prompts(35, [48])[0]
    eng.generate([shared + [5]], SamplingParams(max_new_tokens=2, ignore_eos=True))
    eng.reconfigure(block_size=bs)
    cached = len(eng.pool.tiers[Tier.DEVICE].cached) + len(eng.pool.tiers[Tier.HOST].cached)
    assert cached >= 48 // bs
    before = eng.counters.prompt_reused
    out = eng.generate([shared + [9]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert eng.counters.prompt_reused - before == 48  # the whole shared prompt, in blocks of the new size
    assert out[0] == llama_ref.greedy(shared + [9], 6)
    eng.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "heat", "s3fifo"])
def test_a_budget_change_with_the_host_tier_full_keeps_the_engine_working(llama_model, llama_ref, policy):
    """Issue 18 item 1: under s3fifo, shrinking the device tier to 0 with the host tier full raised IndexError
    out of reconfigure (the policy's per-tier state was still sized for the old capacity), left the new config
    applied and broke every later step."""
    eng = _engine(llama_model, 20, 20, policy=policy)
    ps = prompts(36, [30, 44, 23, 37, 51, 40, 33, 45, 51, 19])
    for p in ps[:8]:  # cached prompts fill both tiers
        eng.generate([p], SamplingParams(max_new_tokens=2, ignore_eos=True))
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=N, ignore_eos=True)) for p in ps[8:]]
    eng.step()
    assert eng.pool.tiers[Tier.HOST].used >= 16 and eng.pool.tiers[Tier.DEVICE].used >= 12  # both (nearly) full
    for dev, host in ((0, 64), (6, 30), (0, 12), (30, 8), (2, 40), (20, 20)):
        eng.reconfigure(device_budget_mb=_mb(llama_model, dev + RESERVED), host_budget_mb=_mb(llama_model, host))
        assert eng.pool.tiers[Tier.DEVICE].capacity == dev and eng.pool.tiers[Tier.HOST].capacity == host
        eng.check_invariants()
        eng.step()
    eng.run_until_done()
    assert [eng.seqs[i].output for i in ids] == [llama_ref.greedy(p, N) for p in ps[8:]]
    eng.check_invariants()


def test_a_device_shrink_hands_owned_blocks_to_the_host_before_cached_ones(llama_model, llama_ref):
    """Found by `python -m app.stress.storm`: the shrink demoted its victims cached-first into a host tier with room for
    only some of them and released the rest, owned blocks included: a running sequence's table then held a freed
    block and every step raised IndexError (slot -1)."""
    now = [0.0]
    eng = Engine(llama_model, CacheConfig(block_size=8, device_budget_mb=_mb(llama_model, 30 + RESERVED),
                                          host_budget_mb=_mb(llama_model, 8)), EngineOptions(attention="cpu"),
                 clock=lambda: now[0])
    for p in prompts(37, [30, 30, 30]):  # cached blocks, colder than the running sequence's
        eng.generate([p], SamplingParams(max_new_tokens=1, ignore_eos=True))
        now[0] += 1.0
    p = prompts(38, [90])[0]
    sid = eng.add_request(p, SamplingParams(max_new_tokens=N, ignore_eos=True))
    eng.step()
    dev = eng.pool.tiers[Tier.DEVICE]
    assert (dev.ref > 0).sum() == 12 and len(dev.cached) == 9
    eng.reconfigure(device_budget_mb=_mb(llama_model, 6 + RESERVED))  # 6 owned + the cached must leave the device
    assert (eng.pool.tier[eng.seqs[sid].table()] >= 0).all()
    eng.check_invariants()
    eng.run_until_done()
    assert eng.seqs[sid].output == llama_ref.greedy(p, N)
