"""The host tier serves (issue 10 item 1): a sequence whose blocks do not all fit the device tier still runs;
attention reads host-resident blocks where they are (streamed per layer), writes that the device tier cannot
take go to the host tier, and a request is refused only when both tiers together cannot hold it. Ground truth:
transformers' greedy tokens (fp32), at every device budget down to none at all."""

from __future__ import annotations

import pytest

from tiny_models import _engine, _mb, prompts
from engine.kv.block_pool import RESERVED
from engine.config import CacheConfig, EngineOptions
from engine.runtime.engine import Engine
from engine.errors import RequestError
from engine.sequence import SamplingParams
from engine.kv.tiers import Tier

N = 16


@pytest.mark.parametrize("mode", ["promote", "stream"])
@pytest.mark.parametrize("attention", ["cpu", "reference"])
@pytest.mark.parametrize("bs,dev_blocks", [(1, 0), (1, 3), (8, 0), (8, 1), (8, 2), (16, 1)])
def test_device_tier_smaller_than_one_sequence_keeps_tokens_exact(llama_model, llama_ref, mode, attention, bs,
                                                                   dev_blocks):
    ps = prompts(3, [37, 50, 21])
    eng = _engine(llama_model, bs, dev_blocks, mode, attention)
    assert eng.pool.tiers[Tier.DEVICE].capacity == dev_blocks
    out = eng.generate(ps, SamplingParams(max_new_tokens=N, ignore_eos=True))
    assert out == [llama_ref.greedy(p, N) for p in ps]
    eng.check_invariants()
    c = eng.counters
    assert c.read_tokens_streamed > 0 and c.preemptions == 0  # served from the host tier, nothing preempted
    assert c.read_tokens_missed <= c.read_tokens
    if dev_blocks == 0:  # nothing is ever read straight from a device tier with no blocks
        assert c.read_tokens_missed == c.read_tokens_streamed == c.read_tokens and c.device_hit_rate == 0


def test_streaming_reads_the_host_tier_in_place_and_promote_mode_promotes(llama_model, llama_ref):
    """A prefix cached on the host tier (demoted after its request): stream mode reads it there; promote mode
    copies it back to the device tier first. Same tokens either way."""
    p = prompts(9, [60])[0]
    out = {}
    for mode in ("stream", "promote"):
        eng = _engine(llama_model, 8, 40, mode)
        eng.generate([p], SamplingParams(max_new_tokens=4, ignore_eos=True))  # the prompt's blocks, cached
        eng.kv.residency.demote_idle(eng.clock() + 3600)  # an hour later: every idle block has moved to the host tier
        assert eng.pool.tiers[Tier.DEVICE].used == 0
        before = (eng.counters.promotions, eng.counters.read_tokens_streamed)
        out[mode] = eng.generate([p + [7, 8]], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
        promoted = eng.counters.promotions - before[0]
        streamed = eng.counters.read_tokens_streamed - before[1]
        if mode == "stream":
            assert streamed >= 56 and promoted == 0
        else:
            assert promoted > 0
    assert out["stream"] == out["promote"] == llama_ref.greedy(p + [7, 8], 6)


def test_refused_only_when_both_tiers_cannot_hold_it(llama_model):
    eng = _engine(llama_model, 8, 2, "stream", host_blocks=5)  # 2 + 5 blocks of 8 tokens: 56 tokens
    ok = prompts(4, [40])[0]
    eng.check_request(ok, SamplingParams(max_new_tokens=16))  # 56 tokens: fits both tiers together
    with pytest.raises(RequestError, match=r"device and host tiers hold 2 \+ 5"):
        eng.check_request(ok, SamplingParams(max_new_tokens=17))


@pytest.mark.parametrize("kv_dtype", ["int8-kivi", "int8-delta"])
def test_quantized_blocks_read_and_written_on_the_host_equal_device_ones(llama_model, kv_dtype):
    """Same appends, same bytes, same reads: a tiny device tier gives the tokens a roomy one gives."""
    ps = prompts(12, [30, 45])
    outs = []
    for dev in (0, 400):
        eng = Engine(llama_model, CacheConfig(block_size=8, kv_dtype=kv_dtype, device_budget_mb=_mb(llama_model, dev + RESERVED, 8, kv_dtype),
                                              host_budget_mb=_mb(llama_model, 400, 8, kv_dtype), host_reads="stream"),
                     EngineOptions(attention="cpu"))
        outs.append(eng.generate(ps, SamplingParams(max_new_tokens=12, ignore_eos=True)))
        eng.check_invariants()
    assert outs[0] == outs[1]


def test_many_short_requests_share_a_tiny_device_tier(llama_model, llama_ref):
    """Five concurrent requests, a device tier of 3 blocks: none refused, all exact."""
    ps = prompts(21, [12, 19, 25, 8, 33])
    eng = _engine(llama_model, 8, 3, "promote")
    out = eng.generate(ps, SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert out == [llama_ref.greedy(p, 10) for p in ps]
    eng.check_invariants()
