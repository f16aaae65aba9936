"""Admission counted in blocks over both tiers (issue 18 item 5): a request that fits the two tiers alone is
queued until what it still needs fits beside what the running sequences were promised, and then finishes; nothing
is admitted only to be preempted and recomputed in a loop. Ground truth: transformers' greedy tokens (fp32)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiny_models import budget_mb, prompts
from engine.kv.block_pool import Tier, blocks_for
from engine.config import CacheConfig, EngineOptions
from engine.runtime.engine import Engine, RequestError
from engine.sequence import SamplingParams, SeqState


def tiers(model, dev: int, host: int, bs: int, mode: str = "promote") -> CacheConfig:
    return CacheConfig(block_size=bs, device_budget_mb=budget_mb(model, dev, bs),
                       host_budget_mb=budget_mb(model, host, bs, device=False), host_reads=mode)


def preempt_events(eng: Engine) -> list:
    return [e for e in eng.take_events() if e.kind == "preempt"]


def issue_mix(seed: int = 5) -> list[list[int]]:
    """24 prompts of 10-85 tokens, every other one opening with the same 24-token system prompt."""
    rng = random.Random(seed)
    system = prompts(seed, [24])[0]
    out = []
    for i in range(24):
        n = rng.randint(10, 85)
        own = prompts(seed * 100 + i + 1, [n - 24 if i % 2 == 0 and n > 24 else n])[0]
        out.append(system + own if i % 2 == 0 and n > 24 else own)
    return out


@pytest.mark.parametrize("mode", ["promote", "stream", "compute"])
def test_the_reported_mix_finishes_without_a_preemption(llama_model, llama_ref, mode):
    # Block size 8, 6 device + 17 host blocks: every request fits the two tiers alone (the largest needs 12).
    # Before the fix, 9-10 of the 24 finished and the rest were aborted as "stalled" after ~3,600 preemptions.
    ps = issue_mix()
    eng = Engine(llama_model, tiers(llama_model, 6, 17, 8, mode))
    assert (eng.kv.capacity(Tier.DEVICE), eng.kv.capacity(Tier.HOST)) == (6, 17)
    assert max(blocks_for(len(p) + 6, 8) for p in ps) <= 12
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ids = [eng.add_request(p, sp) for p in ps]
    eng.run_until_done(max_steps=2_000)
    assert not eng.has_work()
    assert [eng.seqs[i].finish_reason for i in ids] == ["length"] * 24, [eng.seqs[i].error for i in ids][:3]
    assert [eng.seqs[i].output for i in ids] == [llama_ref.greedy(p, 6) for p in ps]
    assert eng.counters.preemptions == 0 and not preempt_events(eng)
    assert eng.counters.prompt_reused > 0  # the shared system prompt's blocks were reused, counted once
    eng.check_invariants()


def test_a_request_that_does_not_fit_beside_the_running_ones_waits_holding_nothing(llama_model, llama_ref):
    # 10 device blocks of 8, no host tier. a (20 + 30 tokens) is promised 7 blocks; b (30 + 4) needs 5: its first
    # chunk has device room now (4 of 7 free blocks), but a will need 4 more, so b waits until a is done. Before
    # the fix b was admitted, the two outgrew the tier and one was preempted.
    ps = prompts(7, [20, 30])
    eng = Engine(llama_model, tiers(llama_model, 10, 0, 8))
    a = eng.add_request(ps[0], SamplingParams(max_new_tokens=30, ignore_eos=True))
    b = eng.add_request(ps[1], SamplingParams(max_new_tokens=4, ignore_eos=True))
    eng.step()
    assert eng.seqs[a].state == SeqState.RUNNING
    while not eng.seqs[a].done:
        assert eng.seqs[b].state == SeqState.WAITING and not eng.seqs[b].blocks
        eng.step()
    eng.run_until_done(max_steps=100)
    assert [eng.seqs[a].output, eng.seqs[b].output] == [llama_ref.greedy(ps[0], 30), llama_ref.greedy(ps[1], 4)]
    assert eng.counters.preemptions == 0 and not preempt_events(eng)


def test_a_request_larger_than_both_tiers_is_refused_when_added(llama_model):
    eng = Engine(llama_model, tiers(llama_model, 2, 3, 8))
    with pytest.raises(RequestError, match="device and host tiers hold 2 \\+ 3"):
        eng.add_request(prompts(8, [40])[0], SamplingParams(max_new_tokens=1))  # 41 tokens: 6 blocks
    eng.add_request(prompts(8, [39])[0], SamplingParams(max_new_tokens=1))  # 40 tokens: 5 blocks, fits alone
    eng.run_until_done(max_steps=50)
    assert not eng.has_work()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), block_size=st.sampled_from([1, 3, 8, 16]), dev_blocks=st.integers(0, 20),
       host_blocks=st.integers(0, 30), n=st.integers(1, 10), max_batch=st.integers(1, 16),
       chunk=st.sampled_from([5, 64, 1024]), host_reads=st.sampled_from(["promote", "stream", "compute"]))
def test_any_mix_every_request_that_fits_alone_finishes_without_preemption(
        llama_model, llama_ref, seed, block_size, dev_blocks, host_blocks, n, max_batch, chunk, host_reads):
    # The bound: 0. An admitted sequence was promised every block it needs to reach its peak, so nothing a plain
    # mix of requests does can take them back: no running sequence is ever preempted, and none is recomputed.
    rng = random.Random(seed)
    shared = prompts(seed % 1000, [rng.randint(0, 40)])[0]
    eng = Engine(llama_model, tiers(llama_model, dev_blocks, host_blocks, block_size, host_reads),
                 EngineOptions(max_batch=max_batch, max_batched_tokens=chunk))
    accepted = []
    for i in range(n):
        p = (shared if rng.random() < 0.5 else []) + prompts(seed % 1000 + 1 + i, [rng.randint(1, 40)])[0]
        m = rng.randint(1, 8)
        try:
            accepted.append((eng.add_request(p, SamplingParams(max_new_tokens=m, ignore_eos=True)), p, m))
        except RequestError:  # refused only when both tiers together cannot hold it
            assert blocks_for(len(p) + m, block_size) > dev_blocks + host_blocks
            continue
        assert blocks_for(len(p) + m, block_size) <= dev_blocks + host_blocks
    eng.run_until_done(max_steps=3_000)
    assert not eng.has_work()
    for sid, p, m in accepted:
        seq = eng.seqs[sid]
        assert seq.finish_reason == "length", (seq.finish_reason, seq.error)
        assert seq.output == llama_ref.greedy(p, m)
    assert eng.counters.preemptions == 0 and not preempt_events(eng)
    eng.check_invariants()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), block_size=st.sampled_from([1, 4, 8]), dev_blocks=st.integers(0, 12),
       host_blocks=st.integers(4, 30), host_reads=st.sampled_from(["promote", "stream", "compute"]))
def test_forks_and_pauses_preempt_a_bounded_number_of_times(llama_model, llama_ref, seed, block_size, dev_blocks,
                                                             host_blocks, host_reads):
    # Forks (seq_cp of a running sequence) and resumed pauses are what admission does not weigh: a fork can break
    # the running sequences' promise. Each restores it by preempting at most the newer running sequences once
    # (they recompute and come back when they fit), so preemptions <= events x max_batch, and every one finishes.
    rng = random.Random(seed)
    max_batch = 4
    eng = Engine(llama_model, tiers(llama_model, dev_blocks, host_blocks, block_size, host_reads),
                 EngineOptions(max_batch=max_batch))
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    cap = dev_blocks + host_blocks
    accepted = []
    for i in range(6):
        p = prompts(seed % 1000 + i, [rng.randint(1, 30)])[0]
        if blocks_for(len(p) + 8, block_size) <= cap:
            accepted.append((eng.add_request(p, sp), p))
    events = 0
    paused: list[int] = []
    for _ in range(3_000):
        if not (eng.has_work() or paused):
            break
        running = [s for s in eng.scheduler.active()]
        if running and rng.random() < 0.15 and events < 6:
            sid = rng.choice(running)
            events += 1
            if rng.random() < 0.5:
                accepted.append((eng.seq_cp(sid), next(p for s, p in accepted if s == sid)))
            else:
                eng.pause(sid)
                paused.append(sid)
        if paused and (rng.random() < 0.3 or not eng.has_work()):
            eng.resume(paused.pop(0))
        eng.step()
    assert not eng.has_work() and not paused
    for sid, p in accepted:
        seq = eng.seqs[sid]
        assert seq.finish_reason == "length", (seq.finish_reason, seq.error)
        assert seq.output == llama_ref.greedy(p, 8)  # a fork of a greedy sequence continues it exactly
    assert eng.counters.preemptions + len(preempt_events(eng)) <= 2 * events * max_batch
    eng.check_invariants()


def test_a_fork_that_breaks_the_promise_preempts_the_newest_once(llama_model, llama_ref):
    # 12 blocks of 4; a (20 + 8 tokens: 7 blocks) and b (10 + 8: 5 blocks) fill the promise. A fork of b needs
    # its own tail: b's fork is the newest and is preempted (recomputed), then admitted when a finishes.
    ps = prompts(9, [20, 10])
    eng = Engine(llama_model, tiers(llama_model, 6, 6, 4))
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    a, b = (eng.add_request(p, sp) for p in ps)
    eng.step()
    eng.step()
    assert {eng.seqs[a].state, eng.seqs[b].state} == {SeqState.RUNNING}
    f = eng.seq_cp(b)
    eng.run_until_done(max_steps=200)
    assert [eng.seqs[i].output for i in (a, b, f)] == [llama_ref.greedy(p, 8) for p in (ps[0], ps[1], ps[1])]
    assert eng.counters.preemptions == 1 and eng.seqs[f].preemptions == 1
    eng.check_invariants()


def test_the_watchdog_names_what_the_stuck_request_needs(llama_model, monkeypatch):
    eng = Engine(llama_model, CacheConfig(block_size=4), EngineOptions(stall_steps=20))
    sid = eng.add_request(prompts(5, [10])[0], SamplingParams(max_new_tokens=8, ignore_eos=True))
    eng.step()
    monkeypatch.setattr(eng.scheduler, "_place", lambda *a: None)  # tiers that never have room for a step
    eng.run_until_done(max_steps=100)
    seq = eng.seqs[sid]
    assert seq.finish_reason == "stalled"
    assert f"sequence {sid} aborted: no sequence made progress in 20 steps" in seq.error
    assert "it needs 5 blocks of 4 tokens at its peak (18 tokens)" in seq.error  # 10 prompt + 8 new tokens
