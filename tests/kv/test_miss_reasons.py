"""Why each token missed (issue 23 item 1, engine/kv/misses.py): every prompt token a lookup did not serve and every
key read not straight from the device tier has exactly one reason, and the reasons add up to the misses."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiny_models import budget_mb, prompts
from engine.config import CacheConfig, EngineOptions
from engine.kv.misses import PROMPT_REASONS, READ_REASONS, counter_name
from engine.model.loader import load_model
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams

SP = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tiny_llama):
    return load_model(tiny_llama)


@pytest.fixture(scope="module")
def gemma3(tiny_gemma3):
    return load_model(tiny_gemma3)


def reasons(eng: Engine, which=PROMPT_REASONS) -> dict[str, int]:
    return {r: getattr(eng.counters, counter_name(r)) for r in which if getattr(eng.counters, counter_name(r))}


def run_one(eng: Engine, p: list[int], sp: SamplingParams = SP) -> int:
    sid = eng.add_request(p, sp)
    while not eng.seqs[sid].done:
        eng.step()
    return sid


def add_up(eng: Engine) -> None:
    """The reasons add up to the misses, in the engine's counters and over the sequences."""
    c = eng.counters
    assert sum(reasons(eng).values()) == c.lookup_tokens - c.lookup_served
    assert sum(reasons(eng, READ_REASONS).values()) == c.read_tokens_missed
    per_seq = {}
    for s in eng.seqs.values():
        for r, n in s.why_missed.items():
            per_seq[r] = per_seq.get(r, 0) + n
    assert per_seq == {**reasons(eng), **reasons(eng, READ_REASONS)}


def test_a_new_prompt_is_cold_and_its_last_block_partial(llama):
    eng = Engine(llama, CacheConfig(block_size=16))
    run_one(eng, prompts(1, [37])[0])  # blocks 0, 1 full and looked up; 5 tokens in the last block
    assert reasons(eng) == {"cold": 32, "partial": 5}
    run_one(eng, prompts(2, [32])[0])  # a full last block is never served: the last token is always computed
    assert reasons(eng) == {"cold": 32 + 16, "partial": 5 + 16}
    add_up(eng)


def test_a_repeat_hits_a_sibling_diverged_and_after_it_cold(llama):
    eng = Engine(llama, CacheConfig(block_size=8))
    a = prompts(3, [60])[0]
    run_one(eng, a)
    before = reasons(eng)
    sid = run_one(eng, a)  # 7 full blocks served, the last 4 tokens computed
    assert eng.seqs[sid].prefix_reused == 56 and reasons(eng) == {**before, "partial": before["partial"] + 4}
    b = a[:24] + prompts(4, [30])[0]  # shares 3 blocks, then diverges inside block 3
    sid = run_one(eng, b)
    assert eng.seqs[sid].why_missed == {"diverged": 8, "cold": 16, "partial": 6}
    add_up(eng)


def test_evicted_and_reconfigured_blocks_are_named(llama):
    bs = 4
    a = prompts(5, [40])[0]
    # A tiny cache: other prompts evict a's cached blocks.
    eng = Engine(llama, CacheConfig(block_size=bs, device_budget_mb=budget_mb(llama, 14, bs), host_budget_mb=0.0,
                                    policy="lru"))
    run_one(eng, a)
    for p in prompts(6, [40, 40]):
        run_one(eng, p)
    sid = run_one(eng, a)
    why = eng.seqs[sid].why_missed
    assert why.get("evicted", 0) > 0 and set(why) <= {"evicted", "partial", "cold"}
    h = eng.kv.chain(eng.seqs[sid], 1)[0]
    assert eng.pool.ledger.history(h)["stores"] >= 1
    # The lookup's record: what it served, and why its first missed block missed (policy, occupancy, how long ago).
    (look,) = [e.fields for e in eng.take_events() if e.kind == "lookup" and e.fields["seq"] == sid]
    assert look["tokens"] == 40 and look["served"] == eng.seqs[sid].prefix_reused
    assert look["first_miss"] == "evicted" and look["policy"] == "lru" and look["tier"] == 0
    assert 0 < look["occupancy"] <= 1 and look["gone_s_ago"] >= 0 and look["evicted"] == why["evicted"]
    # A prefix-cache reset is a config change: the next lookup says so.
    eng2 = Engine(llama, CacheConfig(block_size=bs))
    run_one(eng2, a)
    eng2.kv.reset_prefix_cache()
    sid = run_one(eng2, a)
    assert eng2.seqs[sid].why_missed == {"reconfigured": 36, "partial": 4}
    # A block-size change re-lays what fits; a budget too small for the cached blocks drops the rest.
    eng3 = Engine(llama, CacheConfig(block_size=bs, device_budget_mb=1.0, host_budget_mb=0.0))
    run_one(eng3, a)
    eng3.reconfigure(device_budget_mb=budget_mb(llama, 3, bs))
    eng3.reconfigure(device_budget_mb=1.0)
    sid = run_one(eng3, a)
    assert eng3.seqs[sid].why_missed.get("reconfigured", 0) > 0 and "evicted" not in eng3.seqs[sid].why_missed
    for e in (eng, eng2, eng3):
        add_up(e)


def test_a_restored_block_carries_its_history_in_the_map(llama):
    bs = 4
    a = prompts(7, [20])[0]
    eng = Engine(llama, CacheConfig(block_size=bs))
    run_one(eng, a)
    eng.kv.reset_prefix_cache()
    run_one(eng, a)
    dev = eng.pool.tiers[0]
    h = eng.kv.chain(eng.seqs[max(eng.seqs)], 1)[0]
    (slot,) = np.flatnonzero(dev.hash == np.uint64(h))
    assert dev.stores[slot] == 1 and dev.gone_by[slot] == 2 and np.isfinite(dev.gone_t[slot])


def test_preempted_tokens(llama):
    """A fork that breaks the promise is preempted (recomputed): admitted again, what it misses is `preempted`."""
    bs = 4
    eng = Engine(llama, CacheConfig(block_size=bs, device_budget_mb=budget_mb(llama, 6, bs),
                                    host_budget_mb=budget_mb(llama, 6, bs, device=False)))
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    a, b = (eng.add_request(p, sp) for p in prompts(9, [20, 10]))
    eng.step()
    eng.step()
    f = eng.seq_cp(b)
    eng.run_until_done(max_steps=200)
    assert eng.seqs[f].preemptions == 1
    assert eng.seqs[f].why_missed.get("preempted", 0) > 0
    assert set(eng.seqs[f].why_missed) <= {"preempted"} | set(READ_REASONS)
    add_up(eng)


def test_key_reads_missed_for_idleness_capacity_and_streaming(llama):
    bs = 4
    now = [0.0]
    eng = Engine(llama, CacheConfig(block_size=bs, demote_after_s=5.0, prefetch_depth=0), clock=lambda: now[0])
    a, b = prompts(10, [30, 30])
    sa = eng.add_request(a, SamplingParams(max_new_tokens=30, ignore_eos=True))
    eng.step()
    eng.pause(sa)
    now[0] += 10.0
    sb = run_one(eng, b)
    assert eng.seqs[sb].done
    eng.resume(sa)
    eng.step()  # a's blocks were demoted for idling: promoted back for this step
    assert eng.counters.read_miss_demoted_idle > 0 and eng.seqs[sa].why_missed["demoted-idle"] > 0
    add_up(eng)
    # A device tier smaller than the request: its blocks go to the host tier for room.
    for mode, reason in (("promote", "capacity"), ("stream", "streamed")):
        small = Engine(llama, CacheConfig(block_size=bs, device_budget_mb=budget_mb(llama, 4, bs), host_budget_mb=1.0,
                                          host_reads=mode))
        run_one(small, prompts(11, [60])[0], SamplingParams(max_new_tokens=8, ignore_eos=True))
        assert reasons(small, READ_REASONS).get(reason, 0) > 0, (mode, reasons(small, READ_REASONS))
        add_up(small)


def test_groups_name_the_window_block_that_left(gemma3):
    """Gemma 3: the full group holds a prefix whose last window the window group lost to eviction: the lookup's
    first missed block is the window group's, evicted."""
    bs = 4
    eng = Engine(gemma3, CacheConfig(block_size=bs))
    a = prompts(12, [60])[0]
    run_one(eng, a)
    seq = eng.seqs[eng.add_request(a, SP)]
    match, _ = eng.kv.find_prefix(seq)
    wpool = eng.kv.pools[1]
    lid = match.window[1][-1]
    wpool._release(lid, "evicted", policy="heat")
    while not seq.done:
        eng.step()
    assert seq.why_missed.get("evicted", 0) > 0
    add_up(eng)
    groups = add_up_groups(eng)
    assert groups[1].get("evicted", 0) > 0 and "evicted" not in groups[0]  # the window group's block left


def add_up_groups(eng: Engine) -> list[dict]:
    """Per KV-cache group (snapshot kv_groups[g]["why_missed"]): the groups' prompt reasons plus the sequence-wide
    ones (partial, preempted) add up to the engine's, and their key-read reasons too."""
    snap = eng.snapshot()
    groups = [g["why_missed"] for g in snap.kv_groups]
    assert len(groups) == len(eng.kv.groups) >= 2
    whole = {**reasons(eng), **reasons(eng, READ_REASONS)}
    summed = {}
    for g in groups:
        assert "partial" not in g and "preempted" not in g
        for r, n in g.items():
            summed[r] = summed.get(r, 0) + n
    for r in ("partial", "preempted"):
        if whole.get(r):
            summed[r] = whole[r]
    assert summed == whole
    from engine.kv.misses import unaccounted

    assert unaccounted(eng.counters, groups) == []  # the storm's check (app/stress/storm.py) agrees
    return groups


def test_group_reasons_add_up_under_pressure_and_travel_in_files(gemma3, tmp_path):
    """Gemma 3 with small budgets, demotion and re-lays: each group's reasons, summed, are the engine's, in the
    snapshot and after a save/load."""
    from engine.telemetry import snapshot_io

    now = [0.0]
    bs = 4
    eng = Engine(gemma3, CacheConfig(block_size=bs, device_budget_mb=budget_mb(gemma3, 40, bs),
                                     host_budget_mb=budget_mb(gemma3, 80, bs, device=False), demote_after_s=1.0),
                 clock=lambda: now[0])
    base = prompts(15, [48])[0]
    for i in range(6):
        run_one(eng, base[:8 * i] + prompts(200 + i, [24])[0])
        now[0] += 3.0
        if i == 3:
            eng.reconfigure(block_size=8)
    add_up(eng)
    groups = add_up_groups(eng)
    assert sum(groups[0].values()) > 0 and sum(groups[1].values()) > 0
    from engine.kv.misses import unaccounted

    eng.counters.miss_evicted += 1  # a reason counted twice: the storm's check names it
    assert unaccounted(eng.counters, groups)[0].startswith("prompt reasons ")
    assert "evicted" in unaccounted(eng.counters, groups)[-1]
    eng.counters.miss_evicted -= 1
    path = tmp_path / "g.json"
    snapshot_io.save(str(path), eng.snapshot())
    back, _ = snapshot_io.load(str(path))
    assert [g["why_missed"] for g in back.kv_groups] == groups


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(st.data())
def test_reasons_add_up_to_the_misses_on_random_workloads(llama, data):
    bs = data.draw(st.sampled_from([1, 4, 16]))
    policy = data.draw(st.sampled_from(["lru", "heat", "s3fifo"]))
    mode = data.draw(st.sampled_from(["promote", "stream"]))
    now = [0.0]
    eng = Engine(llama, CacheConfig(block_size=bs, device_budget_mb=budget_mb(llama, data.draw(
        st.integers(30, 200)) // bs + 8, bs), host_budget_mb=budget_mb(llama, 200 // bs + 8, bs, device=False),
        policy=policy, host_reads=mode, demote_after_s=2.0), EngineOptions(context_limit=150, n_keep=8),
        clock=lambda: now[0])
    base = prompts(13, [64])[0]
    for i in range(data.draw(st.integers(3, 7))):
        share = data.draw(st.integers(0, 64))
        p = base[:share] + prompts(100 + i, [data.draw(st.integers(1, 80))])[0]
        eng.add_request(p, SamplingParams(max_new_tokens=data.draw(st.integers(1, 20)), ignore_eos=True))
        for _ in range(data.draw(st.integers(0, 6))):
            eng.step()
            now[0] += data.draw(st.sampled_from([0.1, 3.0]))
        if data.draw(st.booleans()):
            eng.reconfigure(block_size=data.draw(st.sampled_from([1, 4, 16])))
    for _ in range(400):
        if all(s.done for s in eng.seqs.values()):
            break
        eng.step()
        now[0] += 0.5
    assert all(s.done for s in eng.seqs.values())
    add_up(eng)


def test_snapshots_and_files_carry_the_reasons(llama, tmp_path):
    from engine.telemetry import snapshot_io

    bs = 4
    eng = Engine(llama, CacheConfig(block_size=bs))
    a = prompts(14, [20])[0]
    run_one(eng, a)
    eng.kv.reset_prefix_cache()
    sid = run_one(eng, a)
    snap = eng.snapshot()
    row = list(snap.seqs.id).index(sid)
    assert snap.seqs.why_missed[row] == eng.seqs[sid].why_missed == {"reconfigured": 16, "partial": 4}
    dev = snap.tiers[0]
    restored = dev.stores > 0
    assert restored.any() and (dev.gone_by[restored] == 2).all() and np.isfinite(dev.gone_age[restored]).all()
    assert (dev.gone_by[dev.state == 0] == 0).all()
    from engine.kv.misses import WHY_FIELDS

    assert set(WHY_FIELDS) <= set(snap.windowed)  # the last 5 s, for the "why missed" chart
    path = tmp_path / "s.json"
    snapshot_io.save(str(path), snap)
    back, _ = snapshot_io.load(str(path))
    assert back.seqs.why_missed == snap.seqs.why_missed
    for f in ("why", "stores", "gone_age", "gone_by"):
        np.testing.assert_array_equal(getattr(back.tiers[0], f), getattr(dev, f))
