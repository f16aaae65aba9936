"""Defects found by driving the engine adversarially: progress under tight tiers, reconfiguration from
other threads, lossy-change reporting, and validation of every request and option value."""

from __future__ import annotations

import math
import random
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiny_models import budget_mb, prompts
from engine.kv.block_pool import Tier
from engine.kv.codecs import fp8_supported
from engine.config import CacheConfig, ConfigError, EngineOptions, KVDtype, change_is_lossy
from engine.runtime.engine import Engine, RequestError
from engine.sequence import SamplingParams


def test_shared_prefix_on_a_full_device_tier_without_host_room_finishes(llama_model, llama_ref):
    # The reported livelock: two 90-token prompts sharing 48 tokens, block size 16, a 9-block device tier,
    # no host tier. Before the fix a waiting sequence held its matched prefix blocks, and the head of the
    # queue was admitted and preempted forever (0/2 finished after 5,000 steps).
    shared = prompts(0, [48])[0]
    ps = [shared + prompts(1, [42])[0], shared + prompts(2, [42])[0]]
    eng = Engine(llama_model, CacheConfig(block_size=16, device_budget_mb=budget_mb(llama_model, 9, 16),
                                          host_budget_mb=0))
    assert eng.pool.tiers[Tier.DEVICE].capacity == 9 and eng.pool.tiers[Tier.HOST].capacity == 0
    sp = SamplingParams(max_new_tokens=32, ignore_eos=True)
    ids = [eng.add_request(p, sp) for p in ps]
    eng.run_until_done(max_steps=2_000)
    assert [eng.seqs[i].finish_reason for i in ids] == ["length", "length"]
    assert [eng.seqs[i].output for i in ids] == [llama_ref.greedy(p, 32) for p in ps]
    assert eng.counters.steps < 200
    eng.check_invariants()


def test_a_paused_sequence_on_a_full_device_tier_does_not_starve_the_others(llama_model, llama_ref):
    # A paused sequence's blocks cannot move to a host tier of 0 blocks: its K/V is dropped (it recomputes
    # when resumed) rather than pinning the device tier forever.
    ps = prompts(3, [60, 60])
    eng = Engine(llama_model, CacheConfig(block_size=8, device_budget_mb=budget_mb(llama_model, 11, 8),
                                          host_budget_mb=0))
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    a = eng.add_request(ps[0], sp)
    eng.step()
    eng.pause(a)
    b = eng.add_request(ps[1], sp)
    eng.run_until_done(max_steps=500)
    assert eng.seqs[b].finish_reason == "length" and eng.seqs[b].output == llama_ref.greedy(ps[1], 20)
    eng.resume(a)
    eng.run_until_done(max_steps=500)
    assert eng.seqs[a].finish_reason == "length" and eng.seqs[a].output == llama_ref.greedy(ps[0], 20)
    eng.check_invariants()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), block_size=st.sampled_from([1, 3, 8, 16]), dev_blocks=st.integers(0, 40),
       host_blocks=st.integers(0, 30), n=st.integers(1, 6), max_batch=st.integers(1, 6),
       host_reads=st.sampled_from(["promote", "stream", "compute"]))
def test_any_small_budget_every_request_finishes_or_is_refused(llama_model, llama_ref, seed, block_size, dev_blocks,
                                                               host_blocks, n, max_batch, host_reads):
    rng = random.Random(seed)
    shared = prompts(seed % 1000, [rng.randint(0, 40)])[0]
    eng = Engine(llama_model, CacheConfig(block_size=block_size,
                                          device_budget_mb=budget_mb(llama_model, dev_blocks, block_size),
                                          host_budget_mb=budget_mb(llama_model, host_blocks, block_size, device=False),
                                          host_reads=host_reads),
                 EngineOptions(max_batch=max_batch, max_batched_tokens=rng.choice([7, 64, 1024])))
    accepted = []
    for i in range(n):
        p = (shared if rng.random() < 0.6 else []) + prompts(seed % 1000 + 1 + i, [rng.randint(1, 30)])[0]
        sp = SamplingParams(max_new_tokens=rng.randint(1, 12), ignore_eos=True)
        try:
            accepted.append((eng.add_request(p, sp), p, sp.max_new_tokens))
        except RequestError as e:
            assert "device and host tiers hold" in str(e)  # refused with the reason, up front
    eng.run_until_done(max_steps=3_000)
    assert not eng.has_work()
    for sid, p, m in accepted:
        seq = eng.seqs[sid]
        assert seq.finish_reason == "length", (seq.finish_reason, seq.error)
        assert seq.output == llama_ref.greedy(p, m)
    eng.check_invariants()


def test_a_run_that_cannot_progress_aborts_with_a_reason_instead_of_spinning(llama_model, monkeypatch):
    eng = Engine(llama_model, CacheConfig(block_size=4), EngineOptions(stall_steps=50))
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    a, b = (eng.add_request(p, sp) for p in prompts(5, [10, 12]))
    for _ in range(3):
        eng.step()
    monkeypatch.setattr(eng.scheduler, "_place", lambda *a: None)  # tiers that never have room for a step
    steps = 0
    while eng.has_work() and steps < 1_000:
        eng.step()
        steps += 1
    assert steps < 200
    reasons = {eng.seqs[s].finish_reason for s in (a, b)}
    assert reasons == {"stalled"}
    assert all("no sequence made progress in 50 steps" in eng.seqs[s].error for s in (a, b))
    assert [e for e in eng.take_events() if e.kind == "error" and "aborted" in e.fields["message"]]
    eng.check_invariants()


def test_reconfigure_storm_from_another_thread_drops_nothing(llama_model, llama_ref):
    # A change every few ms from another thread while the engine steps and a third thread adds requests:
    # each call returns the config it applied or raises; every accepted one is applied (one config event
    # each), and tokens stay exact (fp32, greedy).
    eng = Engine(llama_model, CacheConfig(block_size=4, device_budget_mb=4, host_budget_mb=8))
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ps = prompts(6, [30, 17, 44, 25, 9, 38])
    sids = [eng.add_request(p, sp) for p in ps[:3]]
    accepted, refused, errors = [], [], []
    stop = threading.Event()

    def storm() -> None:
        rng = random.Random(1)
        while not stop.is_set():
            change = rng.choice([{"block_size": rng.choice([1, 2, 4, 5, 8, 16])},
                                 {"device_budget_mb": rng.choice([0.01, 0.5, 2.0, 4.0])},
                                 {"host_budget_mb": rng.choice([0.0, 4.0, 8.0])},
                                 {"policy": rng.choice(["lru", "heat", "s3fifo"])},
                                 {"prefetch_depth": rng.randint(0, 4)}])
            try:
                new = eng.reconfigure(**change)
                k, v = next(iter(change.items()))
                assert getattr(new, k) == v
                accepted.append(change)
            except ConfigError:
                refused.append(change)
            except Exception as e:  # noqa: BLE001 - any other exception is the bug this test is for
                errors.append(repr(e))
            stop.wait(0.003)

    def feeder() -> None:
        for p in ps[3:]:
            stop.wait(0.05)
            sids.append(eng.add_request(p, sp))

    threads = [threading.Thread(target=storm), threading.Thread(target=feeder)]
    for t in threads:
        t.start()
    try:
        for _ in range(3_000):
            if len(sids) == len(ps) and not eng.has_work():
                break
            eng.step()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors
    assert len(accepted) >= 20
    events = eng.take_events()
    assert sum(e.kind == "config" for e in events) == len(accepted)
    assert sum(e.kind == "config_error" for e in events) == len(refused)
    assert [eng.seqs[s].output for s in sids] == [llama_ref.greedy(p, 24) for p in ps]
    eng.check_invariants()


DTYPES = [d for d in KVDtype if d is not KVDtype.FP8 or fp8_supported()]


@pytest.mark.parametrize("old", DTYPES, ids=lambda d: d.label)
@pytest.mark.parametrize("new", DTYPES, ids=lambda d: d.label)
def test_a_change_reported_lossless_keeps_every_stored_value(llama_model, old, new):
    for new_bs in (8, 4):
        eng = Engine(llama_model, CacheConfig(block_size=8, kv_dtype=old, device_budget_mb=2, host_budget_mb=0))
        sids = [eng.add_request(p, SamplingParams(max_new_tokens=20, ignore_eos=True)) for p in prompts(7, [37, 21])]
        for _ in range(6):
            eng.step()
        before = [eng.kv.tokens_kv(eng.seqs[s]) for s in sids]
        changes = {"kv_dtype": new.label, "block_size": new_bs}
        lossy = eng.is_lossy_change(changes)
        eng.reconfigure(**changes)
        after = [eng.kv.tokens_kv(eng.seqs[s]) for s in sids]
        same = all(torch.equal(x, y) for b, a in zip(before, after) for x, y in zip(b, a))
        if not lossy:
            assert same, f"{old.label} -> {new.label} at block size {new_bs} reported lossless but changed K/V"
        event = [e for e in eng.take_events() if e.kind == "config"][-1]
        assert event.fields["lossy"] == lossy


def test_lossy_changes_named_in_the_report_are_lossy():
    def cfg(dtype, bs=16):
        return CacheConfig(block_size=bs, kv_dtype=dtype)

    d = KVDtype
    for a, b in [(d.INT8, d.INT8_KIVI), (d.INT8_KIVI, d.INT8), (d.INT8, d.INT8_DELTA), (d.INT8_DELTA, d.INT8),
                 (d.FP8, d.INT8_KIVI), (d.INT8, d.FP16), (d.FP16, d.BF16), (d.BF16, d.FP16), (d.FP32, d.FP16)]:
        assert change_is_lossy(cfg(a), cfg(b)), (a.label, b.label)
    assert change_is_lossy(cfg(d.INT8, 16), cfg(d.INT8, 32))  # new per-block scales: re-quantized
    assert not change_is_lossy(cfg(d.INT8_KIVI), CacheConfig(kv_dtype=d.INT8_KIVI, device_budget_mb=64))
    assert not change_is_lossy(cfg(d.INT8), cfg(d.FP32)) and not change_is_lossy(cfg(d.FP16, 16), cfg(d.FP16, 5))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.label)
def test_a_budget_change_copies_blocks_byte_for_byte(llama_model, dtype):
    # int8-delta and int8-kivi do not re-encode to themselves: a budget change must not decode/encode.
    eng = Engine(llama_model, CacheConfig(block_size=8, kv_dtype=dtype, device_budget_mb=2, host_budget_mb=0))
    sids = [eng.add_request(p, SamplingParams(max_new_tokens=20, ignore_eos=True)) for p in prompts(8, [37, 50])]
    for _ in range(6):
        eng.step()
    before = [eng.kv.tokens_kv(eng.seqs[s]) for s in sids]
    eng.reconfigure(device_budget_mb=max(0.01, budget_mb(llama_model, 10, 8, dtype)), host_budget_mb=4)
    assert eng.pool.tiers[Tier.HOST].used > 0  # 13 live blocks, 10 device slots: the rest went to the host tier
    after = [eng.kv.tokens_kv(eng.seqs[s]) for s in sids]
    assert all(torch.equal(x, y) for b, a in zip(before, after) for x, y in zip(b, a))
    eng.run_until_done()
    eng.check_invariants()


@pytest.mark.parametrize("kwargs, problem", [
    ({"temperature": -1.0}, "temperature"), ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 2.0}, "top_p"),
    ({"top_p": math.nan}, "top_p"), ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": -1}, "max_new_tokens"), ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"), ({"seed": 2**64}, "seed"), ({"seed": -1}, "seed"),
    ({"seed": 1.5}, "seed"),
])
def test_bad_sampling_values_are_refused_by_name(kwargs, problem):
    with pytest.raises(RequestError, match=problem):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, problem", [
    ([1, 2.0, 3], "token 1 of the prompt is 2.0"), ([1, True], "token 1 of the prompt is True"),
    ([1, "7"], "not an integer"), ([1, [2, 3]], "not an integer"), ([-5], "outside the vocabulary"),
    ([10**9], "outside the vocabulary"), ([], "non-empty"), ("12 13", "non-empty list"),
])
def test_bad_token_ids_are_refused_and_nothing_changes(llama_model, prompt, problem):
    eng = Engine(llama_model, CacheConfig(block_size=4))
    with pytest.raises(RequestError, match=problem):
        eng.add_request(prompt, SamplingParams())
    assert not eng.seqs and not eng.has_work()


@pytest.mark.parametrize("options, problem", [
    ({"n_keep": -5}, "n_keep"), ({"n_keep": 600}, "n_keep"), ({"context_limit": 32, "n_keep": 31}, "n_keep"),
    ({"context_limit": 1}, "context_limit"), ({"context_limit": 10**6}, "context_limit"),
    ({"context_limit": 2.5}, "context_limit"), ({"max_batch": 0}, "max_batch"), ({"n_discard": 0}, "n_discard"),
])
def test_bad_engine_options_are_refused_by_name(llama_model, options, problem):
    with pytest.raises(ConfigError, match=problem):
        Engine(llama_model, CacheConfig(), EngineOptions(**options))


def test_a_budget_larger_than_memory_is_refused_before_allocating(llama_model):
    with pytest.raises(ConfigError, match="GiB of CPU memory but"):
        Engine(llama_model, CacheConfig(device_budget_mb=1_000_000))
    eng = Engine(llama_model, CacheConfig(block_size=4))
    sid = eng.add_request(prompts(9, [10])[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
    eng.step()
    before = eng.config
    with pytest.raises(ConfigError, match="GiB of CPU memory but"):
        eng.reconfigure(host_budget_mb=4_000_000)
    assert eng.config == before and sid in eng.seqs and not eng.seqs[sid].done
    eng.run_until_done()
    assert eng.seqs[sid].finish_reason == "length"
