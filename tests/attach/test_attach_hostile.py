"""A peer that sends what no server would: fields out of range, thousands of ranks, an endless stream of new
prefixes, sequence numbers at the edge of 64 bits. Every bad event is counted and skipped whole (its batch's
others applied), a recording stays consistent, the session's tables stay bounded, and the sequence arithmetic
is the servers' (signed 64-bit), so a wrap is a restart, never 1.8e19 batches missing."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zmq

from engine.attach import bounds
from engine.attach.cluster import ClusterState
from engine.attach.events import BlockRemoved, BlockStored, EventBatch
from engine.attach.recorder import Recorder, RecordingError, check_columns, load_columns
from engine.attach.source import SourceSpec
from engine.attach.subscriber import Subscriber


def _cluster(record: bool = False) -> ClusterState:
    cl = ClusterState(["s"])
    cl.set_offset(0, 100.0, now=100.0)
    if record:
        cl.recorder = Recorder(cl.labels)
    return cl


def _stored(h, lora=None, parent=None):
    return BlockStored([h], parent, list(range(16)), 16, lora)


# -- item 8: bounds on every field; a recording is always consistent ------------------------------------------

def test_a_lora_id_past_int32_skips_that_event_only_and_counts_it_bad():
    cl = _cluster(record=True)
    events = [_stored(i) for i in range(10)] + [_stored(99, lora=1 << 40)]
    cl.apply(0, EventBatch(100.0, events))
    (a,) = cl.activity()
    assert a.events == 11 and a.bad_events == 1 and a.stored_events == 10 and a.stored_blocks == 10
    assert len(cl.groups[(0, 0, "GPU", 0)]) == 10
    assert any("lora_id" in t for _, k, t in cl.take_notes() if k == "malformed")
    cols = cl.recorder.columns()
    assert check_columns(cols) == 10  # only what was applied is recorded


@pytest.mark.parametrize("ev", [
    BlockStored([1], None, [], 1 << 30),  # block size
    BlockStored([1], None, [], 16, group_idx=100_000),
    BlockStored([1 << 70], None, [], 16),  # not a 64-bit hash
    BlockStored([b"x" * 10_000], None, [], 16),  # a 10 kB hash
    BlockStored([1], None, [], 16, medium="M" * 500),
    BlockStored([1], None, [], 16, lora_id=-5),
    BlockRemoved([1], group_idx=-1),
])
def test_each_out_of_range_field_is_refused(ev):
    assert bounds.event_problem(ev) is not None
    cl = _cluster()
    cl.apply(0, EventBatch(100.0, [ev, _stored(7)]))
    (a,) = cl.activity()
    assert a.bad_events == 1 and a.events == 2
    assert sum(len(g) for g in cl.groups.values()) == 1  # the good one


def test_a_rank_past_int16_is_refused_and_the_recording_stays_consistent(tmp_path):
    cl = _cluster(record=True)
    for i in range(6):
        cl.apply(0, EventBatch(100.0 + i, [_stored(i)], 1))
    cl.apply(0, EventBatch(107.0, [_stored(7)], 40_000))  # rank 40,000
    cl.apply(0, EventBatch(float("nan"), [_stored(8)], 1))  # a time that is not a time
    (a,) = cl.activity()
    assert a.bad_events == 2 and a.stored_events == 6
    cols = cl.recorder.columns()
    assert {len(v) for v in cols.values()} == {6}
    path = str(tmp_path / "rec.npz")
    cl.recorder.save(path)
    back, meta = load_columns(path)
    assert len(back["rank"]) == 6 and meta["events"] == 6


def test_the_recorder_alone_refuses_a_row_it_cannot_hold_and_never_half_writes():
    rec = Recorder(["s"])
    rec.add(0, 1 << 40, 1.0, [_stored(1)])  # no OverflowError, nothing written
    rec.add(0, 3, 1.0, [_stored(2)])
    assert rec.refused == 1 and check_columns(rec.columns()) == 1


def test_columns_of_different_lengths_are_never_saved_nor_loaded(tmp_path):
    rec = Recorder(["s"])
    rec.add(0, 0, 1.0, [_stored(1), _stored(2)])
    cols = rec.columns()
    cols["rank"] = cols["rank"][:1]
    with pytest.raises(RecordingError, match="different lengths"):
        rec.save(str(tmp_path / "bad.npz"), cols)
    assert not (tmp_path / "bad.npz").exists()
    good = rec.columns()
    np.savez(tmp_path / "hand.npz", **{"ev_" + k: (v[:1] if k == "t" else v) for k, v in good.items()})
    with pytest.raises(RecordingError):
        load_columns(str(tmp_path / "hand.npz"))


# -- item 10: bounded tables ----------------------------------------------------------------------------------

def test_family_tables_follow_the_resident_blocks_not_the_blocks_ever_seen():
    cl = _cluster()
    h = 0
    for step in range(20_000):  # every store a new root (a new prefix), 50 resident
        h += 1
        evs = [BlockStored([h], None, list(range(16)), 16)]
        if h > 50:
            evs.append(BlockRemoved([h - 50]))
        cl.apply(0, EventBatch(100.0 + step * 1e-3, evs))
    assert len(cl.groups[(0, 0, "GPU", 0)]) == 50
    assert len(cl.family_tokens) == len(cl.family_of_root) == 50
    # families named after a parent never seen go too, and a chain keeps its family while a block is resident
    cl.apply(0, EventBatch(200.0, [BlockStored([10**9, 10**9 + 1], 777, list(range(32)), 16)]))
    g = cl.groups[(0, 0, "GPU", 0)]
    fam = int(g.a["family"][g.index[10**9]])
    cl.apply(0, EventBatch(201.0, [BlockRemoved([10**9])]))
    assert fam in cl.family_tokens
    cl.apply(0, EventBatch(202.0, [BlockRemoved([10**9 + 1])]))
    assert fam not in cl.family_tokens and 777 not in cl.family_of_root


def test_thousands_of_ranks_make_a_bounded_number_of_maps_and_say_so():
    cl = _cluster()
    for r in range(3000):
        cl.apply(0, EventBatch(100.0, [_stored(r)], r))
    assert len(cl.groups) == bounds.MAX_GROUPS_PER_SOURCE
    (a,) = cl.activity()
    assert a.stored_events == bounds.MAX_GROUPS_PER_SOURCE and a.bad_events == 3000 - bounds.MAX_GROUPS_PER_SOURCE
    assert any("is the limit" in t for _, k, t in cl.take_notes())
    cl.apply(0, EventBatch(100.0, [_stored(1)], bounds.MAX_RANK + 1))
    assert cl.activity()[0].bad_events == 3001 - bounds.MAX_GROUPS_PER_SOURCE


def test_a_clear_and_a_restart_forget_their_families():
    cl = _cluster()
    cl.apply(0, EventBatch(100.0, [_stored(i) for i in range(20)]))
    assert len(cl.family_tokens) == 20
    cl.apply(0, EventBatch(101.0, [BlockStored([5], None, [], 16)]))  # already resident: no new family
    assert len(cl.family_tokens) == 20
    from engine.attach.events import AllBlocksCleared
    cl.apply(0, EventBatch(102.0, [AllBlocksCleared()]))
    assert cl.family_tokens == {} and cl.family_of_root == {}
    cl.apply(0, EventBatch(103.0, [_stored(i) for i in range(5)]))
    cl.reset_source(0)
    assert cl.family_tokens == {}


# -- item 12: sequence numbers as the servers send them ------------------------------------------------------

def _sub() -> tuple[Subscriber, ClusterState, zmq.Context]:
    cl = ClusterState(["s"])
    ctx = zmq.Context()
    return Subscriber(SourceSpec("vllm", "tcp://127.0.0.1:1", None, "", 0, "s"), 0, cl, ctx), cl, ctx


def _frame(seq: int, h: int) -> list[bytes]:
    ev = {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None, "token_ids": [], "block_size": 16,
          "lora_id": None, "medium": "GPU", "lora_name": None}
    return [b"kv", (seq % (1 << 64)).to_bytes(8, "big"), msgpack.packb([100.0, [ev], 0])]


def test_a_sequence_number_of_2_64_minus_1_then_0_is_not_1_8e19_batches_missing():
    sub, cl, ctx = _sub()
    try:
        sub._on_frame(_frame((1 << 64) - 1, 1))  # -1 as the servers' signed 64 bits: not a sequence number
        sub._on_frame(_frame(0, 2))
        sub._on_frame(_frame(1, 3))
        st = sub.status()
        assert st.history_missing == 0 and st.lost == 0 and st.malformed == 1
        assert st.first_seq == 0 and st.last_seq == 1 and st.batches == 2
        sub._on_frame(_frame(1 << 63, 4))  # past int64: negative, malformed, never a jump
        assert sub.status().malformed == 2 and sub.status().gaps == 0
    finally:
        ctx.term()


def test_a_big_step_back_is_a_restart_not_a_duplicate_forever():
    sub, cl, ctx = _sub()
    try:
        for s in range(1000, 1010):
            sub._on_frame(_frame(s, s))
        sub._on_frame(_frame(3, 99))  # the restarted publisher's first frames were missed
        sub._on_frame(_frame(4, 100))
        st = sub.status()
        assert st.restarts == 1 and st.duplicates == 0 and st.last_seq == 4
        assert st.history_missing == 1000 + 3  # no replay endpoint: what came before each first frame is gone
        assert set(cl.groups[(0, 0, "GPU", 0)].index) == {99, 100}
        sub._on_frame(_frame(4, 100))
        assert sub.status().duplicates == 1
    finally:
        ctx.term()


# -- a batch time stepping back; an exception applying one event ----------------------------------------------

@pytest.mark.parametrize("back_s", [5_000.0, 1.7e9])  # 500 half-lives (past float32 heat), to a batch time of 0
def test_a_batch_time_stepping_back_is_not_heat_and_every_event_applies(back_s):
    """Guards against: 2**(gap / half-life) grew the parent's heat, OverflowError (math.exp2 past ~1,024 half-lives, the
    float32 column before that) left apply and the rest of the batch was dropped, noted only as an error."""
    import time
    import warnings

    cl = ClusterState(["s"])
    cl.set_offset(0, 1.7e9)  # the first batch's time is now
    cl.apply(0, EventBatch(1.7e9, [_stored(1)]))
    cl.apply(0, EventBatch(1.7e9 - back_s, [_stored(2, parent=1), _stored(3, parent=2)]))
    (a,) = cl.activity()
    assert a.events == 3 and a.bad_events == 0 and a.stored_events == 3
    g = cl.groups[(0, 0, "GPU", 0)]
    assert len(g) == 3
    info = cl.block_info((0, 0, "GPU", 0), g.index[1])
    assert info["named"] == 1 and 1.0 <= info["heat"] <= 2.0  # touched once: +1, no growth from the step back
    assert not [t for _, k, t in cl.take_notes() if k in ("error", "malformed")]
    # The other way round: batch times ahead of this machine's clock (an offset fixed at ts 0, then 1.7e9).
    cl = ClusterState(["s"])
    cl.set_offset(0, 0.0)
    cl.apply(0, EventBatch(0.0, [_stored(1)]))
    cl.apply(0, EventBatch(1.7e9, [_stored(2, parent=1)]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow to inf either
        now = time.time()
        heat = cl.groups[(0, 0, "GPU", 0)].values("heat", now)
        info = cl.block_info((0, 0, "GPU", 0), cl.groups[(0, 0, "GPU", 0)].index[2])
        cl.snapshot("heat", now=now)
    occ = cl.groups[(0, 0, "GPU", 0)].a["occ"].astype(bool)
    assert np.isfinite(heat[occ]).all() and heat[occ].max() <= 2.0 and 0 < info["heat"] <= 1.0
    assert cl.activity()[0].bad_events == 0


def test_an_exception_applying_one_event_counts_it_bad_with_the_reason_and_the_rest_apply(monkeypatch):
    cl = _cluster(record=True)
    store, problem = ClusterState._store, bounds.event_problem

    def store_or_fail(self, g, ev, t):
        if ev.block_hashes[0] == 5:
            raise ZeroDivisionError("a bug no check foresaw")
        return store(self, g, ev, t)

    def problem_or_fail(ev):
        if ev.block_hashes[0] == 8:
            raise KeyError("a check that fails")
        return problem(ev)

    monkeypatch.setattr(ClusterState, "_store", store_or_fail)
    monkeypatch.setattr(bounds, "event_problem", problem_or_fail)
    cl.apply(0, EventBatch(100.0, [_stored(i) for i in range(10)]))
    (a,) = cl.activity()
    assert a.events == 10 and a.bad_events == 2 and a.stored_events == 8
    assert len(cl.groups[(0, 0, "GPU", 0)]) == 8
    notes = [t for _, k, t in cl.take_notes() if k == "malformed"]
    assert any("ZeroDivisionError" in t and "a bug no check foresaw" in t for t in notes), notes
    assert any("KeyError" in t and "a check that fails" in t for t in notes), notes
    assert check_columns(cl.recorder.columns()) == 8  # the recording has what the maps have
