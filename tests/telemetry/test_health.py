"""Cache health (engine/telemetry/health.py): each figure against a hand count on a small engine."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

from engine.config import CacheConfig, EngineOptions
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from engine.telemetry import snapshot_io
from engine.telemetry.health import HealthTargets, grades
from tiny_models import budget_mb, prompts


def _engine(model, **cfg) -> Engine:
    now = [100.0]
    base = dict(block_size=4, device_budget_mb=0.5, host_budget_mb=1.0)
    eng = Engine(model, CacheConfig(**{**base, **cfg}), EngineOptions(context_limit=256), clock=lambda: now[0])
    eng.fake_now = now
    return eng


def _step(eng, dt: float = 1.0) -> None:
    eng.fake_now[0] += dt
    eng.step()


def test_nothing_counted_is_no_data(llama_model):
    h = _engine(llama_model).snapshot().health
    for name in ("prefix_hit_rate", "block_utilization", "eviction_rate"):
        assert math.isnan(h[name]["w"]) and math.isnan(h[name]["all"]), name
    assert math.isnan(h["lock_wait"]["step"]["p99_s"]) and h["lock_wait"]["step"]["n"] == 0
    assert math.isnan(h["bandwidth"]["last"]) and math.isnan(h["throughput"]["tokens_per_s"])
    assert h["throughput"]["checks"] == 0 and h["eviction_check"]["steps"] == 0 and h["leaks"]["checks"] == 0
    assert grades(h, HealthTargets()) == {k: {"w": "none", "all": "none"} for k in
                                          ("prefix_hit_rate", "block_utilization", "eviction_rate")}


def test_block_utilization_is_tokens_over_blocks_in_use(llama_model):
    eng = _engine(llama_model)
    sid = eng.add_request(prompts(1, [10])[0], SamplingParams(max_new_tokens=8, ignore_eos=True))
    _step(eng)  # the prompt: 10 tokens in 3 blocks of 4 (4, 4, 2)
    h = eng.snapshot().health["block_utilization"]
    assert eng.seqs[sid].num_cached == 10
    assert h["tiers"]["device"]["tokens"] == 10 and h["tiers"]["device"]["capacity_tokens"] == 12
    assert h["w"] == pytest.approx(10 / 12) and h["all"] == pytest.approx(10 / 12)
    assert math.isnan(h["tiers"]["host"]["w"])  # nothing in use on the host tier: no data, not 0
    _step(eng)  # one decode step: 11 tokens in the same 3 blocks
    h = eng.snapshot().health["block_utilization"]
    assert h["w"] == pytest.approx((10 + 11) / (12 + 12))
    for _ in range(6):  # the 10-token sample leaves the 5 s window; since start keeps it
        _step(eng)
    h = eng.snapshot().health["block_utilization"]
    cached = eng.seqs[sid].num_cached if not eng.seqs[sid].done else None
    assert cached is None or h["tiers"]["device"]["tokens"] == cached
    assert h["all"] < 1.0 and h["w"] != pytest.approx(h["all"])


def test_shared_blocks_count_once(llama_model):
    eng = _engine(llama_model)
    sid = eng.add_request(prompts(2, [8])[0], SamplingParams(max_new_tokens=8, ignore_eos=True))
    _step(eng)  # 8 tokens: 2 full blocks
    eng.seq_cp(sid, SamplingParams(max_new_tokens=8, ignore_eos=True))  # shares both (ref 2)
    _step(eng)  # each writes its 9th token into a block of its own: 2 shared blocks + 2 tails of 1 token
    h = eng.snapshot().health["block_utilization"]["tiers"]["device"]
    assert (h["tokens"], h["capacity_tokens"]) == (8 + 1 + 1, 4 * 4)


def test_eviction_rate_is_evicted_over_allocated(llama_model):
    # A device tier of 2 blocks and no host tier: each 7-token prompt allocates 2 blocks (4 + 3 tokens) and finishes
    # with its full block cached and the other freed; the next prompt's second block evicts that cached one (dropped:
    # the host tier takes none).
    eng = _engine(llama_model, device_budget_mb=budget_mb(llama_model, 2, 4), host_budget_mb=0)
    for p in prompts(3, [7, 7, 7]):
        eng.add_request(p, SamplingParams(max_new_tokens=1))
        _step(eng)
        assert not eng.has_work()
    h = eng.health()["eviction_rate"]
    assert (h["allocated"], h["evicted"]) == (6, 2)  # three prompts × 2 blocks; the first two prompts' full ones
    assert h["all"] == pytest.approx(2 / 6)
    assert h["device"] == {"allocated": 6, "dropped": 2, "to_host": 0}
    assert eng.counters.evictions == 2


def test_eviction_to_the_host_tier_is_not_a_drop(llama_model):
    eng = _engine(llama_model, device_budget_mb=budget_mb(llama_model, 2, 4), host_budget_mb=1.0)
    for p in prompts(4, [7, 7]):
        eng.add_request(p, SamplingParams(max_new_tokens=1))
        _step(eng)
    h = eng.health()["eviction_rate"]
    assert h["device"]["to_host"] == 1 and h["evicted"] == 0 and h["all"] == 0.0


def test_an_injected_leak_is_reported_by_block(llama_model):
    eng = _engine(llama_model)
    sid = eng.add_request(prompts(5, [10])[0], SamplingParams(max_new_tokens=20, ignore_eos=True))
    _step(eng)
    assert eng.check_health()["blocks"] == 0
    leaked = eng.seqs[sid].blocks[1]
    eng.pool.incref(leaked)  # a count no table holds
    eng.take_events()
    assert eng.check_health()["blocks"] == 0  # seen once: not yet a leak
    leaks = eng.check_health()  # seen twice: reported
    assert leaks["blocks"] == 1 and leaks["named"][0][1] == leaked and leaks["named"][0][4:] == [2, 1]
    errors = [e for e in eng.take_events() if e.kind == "error"]
    assert len(errors) == 1 and f"block {leaked} " in errors[0].fields["message"]
    assert errors[0].fields["blocks"] == [[0, leaked]]
    eng.check_health()
    assert not [e for e in eng.take_events() if e.kind == "error"]  # said once
    eng.pool.decref(leaked)
    assert eng.check_health()["blocks"] == 0
    assert eng.snapshot().health["leaks"]["blocks"] == 0


def test_a_leak_after_every_sequence_finished(llama_model):
    eng = _engine(llama_model)
    eng.add_request(prompts(6, [12])[0], SamplingParams(max_new_tokens=2, ignore_eos=True))
    while eng.has_work():
        _step(eng)
    assert eng.health()["leaks"]["blocks"] == 0
    t = eng.pool.tiers[0]
    slot = next(iter(t.cached.view().tolist()))  # a cached block (ref 0) taken and never given back
    eng.pool.incref(int(t.lid[slot]))
    h = eng.health()["leaks"]
    assert h["blocks"] == 1 and h["named"][0][1:] == [int(t.lid[slot]), 0, slot, 1, 0]


def _wait_for(cond, what: str) -> None:
    for _ in range(2000):
        if cond():
            return
        time.sleep(0.005)
    raise AssertionError(f"never {what}")


def test_lock_wait_grows_while_a_test_holds_the_lock(llama_model):
    eng = _engine(llama_model)
    eng.add_request(prompts(7, [6])[0], SamplingParams(max_new_tokens=20, ignore_eos=True))
    _step(eng)
    waits = eng.lock_waits
    free = waits.last["step"]
    assert waits.hist["step"].sum() == 1 and free < 0.2
    held_for = 0.2
    for who, call in (("step", eng.step), ("snapshot", eng.snapshot)):
        eng.lock.acquire()
        th = threading.Thread(target=call)
        th.start()
        _wait_for(lambda: who in waits.waiting, f"{who} waited")
        time.sleep(held_for)  # the waiter is blocked on the lock all this time
        eng.lock.release()
        th.join()
        assert waits.last[who] >= held_for, who
        assert waits.hist[who][5] >= 1  # the 0.1-1 s bin
    s = eng.snapshot().health["lock_wait"]
    assert s["step"]["max_s"] >= held_for and s["snapshot"]["max_s"] >= held_for
    assert s["step"]["n"] == 2


def test_bandwidth_counts_weights_and_the_kv_read(llama_model):
    eng = _engine(llama_model)
    sid = eng.add_request(prompts(8, [9])[0], SamplingParams(max_new_tokens=20, ignore_eos=True))
    _step(eng)
    assert not eng.telemetry.health.bw  # a prefill step is not a decode step
    _step(eng)
    t, util, nbytes, step_s = eng.telemetry.health.bw[-1]
    m = eng.model
    storages = {}
    for x in [m.embed, m.lm_head, m.norm] + [w for layer in m.layers for w in layer if w is not None]:
        storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
    weights = sum(storages.values())
    keys = eng.seqs[sid].num_cached  # one sequence's decode step reads its whole context
    assert nbytes == pytest.approx(weights + keys * eng.pool.block_bytes / 4)
    h = eng.snapshot().health["bandwidth"]
    assert h["weights_bytes"] == weights and "streaming read" in h["peak"] and h["peak_bytes_per_s"] > 0
    assert util == pytest.approx(nbytes / step_s / h["peak_bytes_per_s"])
    assert not np.isnan(eng.snapshot().series["bandwidth_util"]).all()


def test_a_throughput_drop_is_marked_with_the_findings(llama_model):
    eng = _engine(llama_model, device_budget_mb=2.0)
    for p in prompts(9, [5, 6, 7, 8]):
        eng.add_request(p, SamplingParams(max_new_tokens=240, ignore_eos=True))
    for _ in range(180):  # 36 s at 5 steps a second: 20 tokens/s from 4 sequences
        _step(eng, 0.2)
    assert eng.telemetry.health.n_drops == 0 and eng.telemetry.health.drop_checks > 0
    for _ in range(12):  # the same batch, a step every 0.6 s: a third of the throughput
        _step(eng, 0.6)
    snap = eng.snapshot()
    assert snap.health["throughput"]["drops"] == 1
    drop = snap.health["throughput"]["last_drops"][0]
    assert drop["median_tokens_per_s"] == pytest.approx(20, rel=0.05) and drop["drop"] > 0.3
    assert set(drop["findings"]) >= {"leaks", "eviction", "lock wait p99 (step, 5 s / minute)",
                                     "bandwidth (5 s / minute)", "prefix hit (5 s / all)"}
    assert [m for m in snap.marks if m[1] == "throughput_drop"]
    assert [e for e in eng.take_events() if e.kind == "throughput_drop"]


def test_a_smaller_batch_is_not_a_drop(llama_model):
    eng = _engine(llama_model, device_budget_mb=2.0)
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=240, ignore_eos=True)) for p in prompts(10, [5, 6, 7, 8])]
    for _ in range(180):
        _step(eng, 0.2)
    for sid in ids[1:]:
        eng.cancel(sid)  # demand falls to a quarter: throughput with it
    for _ in range(40):
        _step(eng, 0.2)
    assert eng.telemetry.health.n_drops == 0


def test_a_full_device_tier_that_evicts_nothing_is_a_warning(llama_model):
    # 2 device blocks of 64 tokens, each owned by a running sequence that decodes inside it; a third request waits
    # for room the whole time.
    eng = _engine(llama_model, block_size=64, device_budget_mb=budget_mb(llama_model, 2, 64), host_budget_mb=0)
    for p in prompts(11, [11, 11]):
        eng.add_request(p, SamplingParams(max_new_tokens=45, ignore_eos=True))
    _step(eng)
    eng.add_request(prompts(12, [11])[0], SamplingParams(max_new_tokens=4))
    eng.take_events()
    for _ in range(40):
        _step(eng, 1.0)
        if eng.telemetry.health.warnings:
            break
    h = eng.snapshot().health["eviction_check"]
    assert h["warnings"] == 1 and "full for 30 s" in h["warning"] and "nothing was evicted" in h["warning"]
    assert [e for e in eng.take_events() if e.kind == "warning"]


def test_health_travels_in_snapshot_files(llama_model, tmp_path):
    eng = _engine(llama_model)
    eng.add_request(prompts(13, [10])[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
    _step(eng)
    snap = eng.snapshot("all")
    path = str(tmp_path / "s.json")
    snapshot_io.save(path, snap)
    back, _ = snapshot_io.load(path)
    assert back.health["block_utilization"]["w"] == pytest.approx(snap.health["block_utilization"]["w"])
    assert back.health["lock_wait"]["step"]["hist"] == snap.health["lock_wait"]["step"]["hist"]
    assert math.isnan(back.health["eviction_rate"]["w"])
    import json

    doc = json.loads(open(path).read())
    del doc["snapshot"]["health"]  # a file from before health existed still opens, with no data
    old, _ = snapshot_io.from_json(json.dumps(doc))
    assert old.health == {}
    doc["snapshot"]["health"] = {"block_utilization": {"w": 1.5}}
    with pytest.raises(snapshot_io.SnapshotFileError, match=r"health.block_utilization.w"):
        snapshot_io.from_json(json.dumps(doc))


def test_targets_grade_and_refuse_bad_values():
    t = HealthTargets()
    assert t.grade("prefix_hit_rate", 0.80) == "green" and t.grade("prefix_hit_rate", 0.70) == "amber"
    assert t.grade("prefix_hit_rate", 0.60) == "red" and t.grade("eviction_rate", 0.05) == "green"
    assert t.grade("eviction_rate", 0.12) == "amber" and t.grade("eviction_rate", 0.2) == "red"
    assert t.grade("block_utilization", float("nan")) == "none"
    assert t.replace(block_utilization=0.9).grade("block_utilization", 0.85) == "amber"
    for bad in ({"prefix_hit_rate": 1.5}, {"eviction_rate": "x"}, {"nope": 0.1}, {"block_utilization": True}):
        with pytest.raises(ValueError):
            HealthTargets.from_dict(bad)
    assert np.isclose(HealthTargets.from_dict({"eviction_rate": 0.1}).eviction_rate, 0.1)


def test_kv_cache_groups_count_every_pool(tiny_gemma3):
    """Gemma 3's sliding-window layers keep a pool of their own (engine/kv/cache.py): utilization counts both pools'
    blocks, and a leak in the window group's pool is found and named with its group."""
    from engine.model.loader import load_model

    eng = _engine(load_model(tiny_gemma3), device_budget_mb=1.0)
    assert eng.grouped
    sid = eng.add_request(prompts(14, [41])[0], SamplingParams(max_new_tokens=20, ignore_eos=True))
    while eng.seqs[sid].first_token_at is None:
        _step(eng)
    _step(eng)
    seq = eng.seqs[sid]
    win = seq.groups[0]
    assert win.base > 0  # the window group let go of blocks that left the window
    h = eng.snapshot().health["block_utilization"]
    tokens = seq.num_cached + (seq.num_cached - win.base * 4)
    blocks = len(seq.blocks) + len(win.blocks)
    assert (h["tiers"]["device"]["tokens"], h["tiers"]["device"]["capacity_tokens"]) == (tokens, blocks * 4)
    assert [g["title"] for g in h["groups"]] == [g.title for g in eng.kv_groups]
    eng.kv.pools[1].incref(win.blocks[-1])
    eng.check_health()
    leaks = eng.check_health()
    assert leaks["blocks"] == 1 and leaks["named"][0][:2] == [1, win.blocks[-1]]
    msg = next(e for e in eng.take_events() if e.kind == "error").fields["message"]
    assert f"group {eng.kv_groups[1].title} block {win.blocks[-1]} " in msg
