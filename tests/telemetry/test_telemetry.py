"""Snapshots say what the engine holds: every per-block and per-sequence field checked against the engine."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.config import CacheConfig, EngineOptions
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from tiny_models import prompts


@pytest.fixture
def engine(llama_model):
    now = [100.0]
    eng = Engine(llama_model, CacheConfig(block_size=4, device_budget_mb=0.05, host_budget_mb=2, demote_after_s=1.0,
                                          decay=0.8),
                 EngineOptions(context_limit=256), clock=lambda: now[0])
    eng.fake_now = now
    return eng


def _run(eng, steps: int, dt: float = 0.05) -> None:
    for _ in range(steps):
        eng.fake_now[0] += dt
        eng.step()


def test_snapshot_fields_match_the_engine(engine):
    eng = engine
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=30, ignore_eos=True), label=f"s{i}")
           for i, p in enumerate(prompts(3, [9, 17, 30, 5]))]
    _run(eng, 6)
    eng.pause(ids[0])
    fork = eng.seq_cp(ids[1], SamplingParams(max_new_tokens=40, ignore_eos=True), label="fork")
    eng.fake_now[0] += 2.0  # the paused sequence's blocks go idle past demote_after_s
    _run(eng, 5)
    assert eng.counters.demotions > 0  # blocks really sit on both tiers
    now = eng.clock()
    snap = eng.snapshot("all")
    pool = eng.pool

    # Per block, per tier: state, owner, ref, fill, age, decayed heat, hashed.
    for t, ts in zip(pool.tiers, snap.tiers):
        assert ts.capacity == t.capacity
        want_state = np.where(t.lid < 0, 0, np.where(t.ref > 0, 2, 1))
        assert np.array_equal(ts.state, want_state)
        assert np.array_equal(ts.owner, t.owner) and np.array_equal(ts.ref, t.ref)
        assert np.array_equal(ts.fill, t.fill)
        np.testing.assert_allclose(ts.age, now - t.last, rtol=1e-6, atol=1e-4)
        np.testing.assert_allclose(ts.heat, t.heat * 0.8 ** np.maximum(now - t.last, 0), rtol=1e-5, atol=1e-6)
        assert np.array_equal(ts.hashed, t.hash != 0)
        live = ts.state > 0
        assert live.any()
    assert (snap.tiers[1].state > 0).any()

    # Per sequence: every column against the Sequence object and the pool's placement of its blocks.
    assert set(snap.seqs.id.tolist()) == set(eng.seqs)
    assert fork in snap.seqs.id
    for i, sid in enumerate(snap.seqs.id.tolist()):
        s = eng.seqs[sid]
        assert snap.seqs.state[i] == int(s.state)
        assert snap.seqs.tokens[i] == len(s.tokens)
        assert snap.seqs.generated[i] == len(s.output)
        assert snap.seqs.prefix_reused[i] == s.prefix_reused
        assert snap.seqs.labels[i] == s.label
        lids = np.asarray(s.blocks, dtype=np.int64)
        tiers = pool.tier[lids]
        assert snap.seqs.blocks_device[i] == int((tiers == 0).sum())
        assert snap.seqs.blocks_host[i] == int((tiers == 1).sum())
        assert np.array_equal(snap.seqs.block_tier[i], tiers)
        assert np.array_equal(snap.seqs.block_slot[i], pool.slot[lids])
        if s.first_token_at is None:
            assert math.isnan(snap.seqs.ttft[i])
        elif sid == fork:  # a fork's first tokens are its parent's: so is its TTFT, never negative
            assert snap.seqs.ttft[i] == pytest.approx(snap.seqs.ttft[list(snap.seqs.id).index(ids[1])])
            assert snap.seqs.ttft[i] > 0
        else:
            assert snap.seqs.ttft[i] == pytest.approx(s.first_token_at - s.arrival, rel=1e-5)
        if s.first_token_at is not None and len(s.output) >= 2:
            end = s.finished_at if s.finished_at is not None else now
            assert snap.seqs.tokens_per_s[i] == pytest.approx((len(s.output) - 1) / (end - s.first_token_at), rel=1e-4)
        else:
            assert snap.seqs.tokens_per_s[i] == 0
    assert snap.seqs.state[list(snap.seqs.id).index(ids[0])] == 2  # paused
    assert snap.seqs.blocks_host[list(snap.seqs.id).index(ids[0])] > 0

    # Block lists only for the sequences asked for; the counts are there for all.
    some = eng.snapshot({fork})
    for i, sid in enumerate(some.seqs.id.tolist()):
        assert (len(some.seqs.block_tier[i]) > 0) == (sid == fork)
        assert some.seqs.blocks_device[i] + some.seqs.blocks_host[i] == len(eng.seqs[sid].blocks)


def test_marks_record_changes_and_engine_actions_and_survive_a_snapshot_file(llama_model, tmp_path):
    import json

    from engine.telemetry import snapshot_io
    now = [50.0]
    eng = Engine(llama_model, CacheConfig(block_size=4), EngineOptions(context_limit=32, n_keep=4),
                 clock=lambda: now[0])
    eng.fake_now = now
    sid = eng.add_request(prompts(4, [20])[0], SamplingParams(max_new_tokens=30, ignore_eos=True))
    _run(eng, 3)
    eng.reconfigure(block_size=8)
    _run(eng, 1)
    t_config = eng.clock()
    eng.reconfigure(kv_dtype="int8")
    _run(eng, 2)
    snap = eng.snapshot()
    configs = [m for m in snap.marks if m[1] == "config"]
    assert [label for _, _, label in configs] == ["block_size=8", "kv_dtype=int8 (lossy)"]
    _run(eng, 20)  # past the 32-token context limit: a shift
    snap = eng.snapshot()
    assert f"context shift, seq {sid}" in [label for _, kind, label in snap.marks if kind == "context_shift"]
    # Engine-clock time (the clock the series use) of the change: reconfigure applies it at the call.
    assert configs[1][0] == pytest.approx(t_config)
    assert all(a[0] <= b[0] for a, b in zip(snap.marks, snap.marks[1:]))
    path = tmp_path / "s.json"
    snapshot_io.save(str(path), snap)
    back, _ = snapshot_io.load(str(path))
    assert back.marks == snap.marks
    doc = json.loads(path.read_text())  # a file from before marks existed still opens, with none
    del doc["snapshot"]["marks"]
    path.write_text(json.dumps(doc))
    assert snapshot_io.load(str(path))[0].marks == ()
    assert sid in eng.seqs


def test_a_config_change_keeps_the_counters_at_that_moment(engine):
    """Issue 22 item 1: the Cost panel's "since the last change" counts from the counters the engine kept when it
    applied the change (Snapshot.last_change), not from whatever snapshot a panel saw first."""
    eng = engine
    assert eng.snapshot().last_change == {}
    for p in prompts(5, [20, 30]):
        eng.add_request(p, SamplingParams(max_new_tokens=30, ignore_eos=True))
    _run(eng, 5)
    eng.snapshot()  # the telemetry learns the config as it is (so a change can say what it changed from)
    at = dict(vars(eng.counters))
    eng.reconfigure(block_size=8, policy="lru")
    t_change = eng.clock()
    _run(eng, 6)
    last = eng.snapshot().last_change
    assert last["t"] == t_change and last["n"] == 1 == eng.counters.config_changes
    assert last["changes"] == {"block_size": "8", "policy": "lru"} and last["before"] == {"block_size": "4",
                                                                                          "policy": "heat"}
    assert not last["lossy"]
    kept = last["counters"]
    for k in ("generated", "steps", "read_tokens", "read_tokens_missed", "preemptions"):
        assert kept[k] == at[k], k  # nothing counted between the change and its record
    assert eng.counters.generated > kept["generated"] and kept["config_changes"] == 1
    eng.reconfigure(kv_dtype="int8")
    last = eng.snapshot().last_change
    assert last["n"] == 2 and last["before"] == {"kv_dtype": "fp32"} and last["lossy"]
    assert last["counters"]["generated"] == eng.counters.generated
