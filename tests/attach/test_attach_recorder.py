"""Recording an attached stream: the reads inferred from events (continuations vs new requests reading their
prefix), the file `kvscope policy-lab` replays unchanged, and the CLI end to end against a fake publisher."""

from __future__ import annotations

import json

import numpy as np

from engine.attach.cluster import ClusterState
from engine.attach.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from engine.attach.recorder import Recorder
from engine.lab.policy_lab import run_lab
from engine.kv.access_trace import AccessTrace


def _recorded():
    cl = ClusterState(["a", "b"])
    cl.recorder = Recorder(cl.labels)
    ev = [
        (0, BlockStored([1, 2, 3], None, [], 16)),  # request A: prefill of 3 blocks
        (0, BlockStored([4], 3, [], 16)),  # A decodes a block (continues its own tip)
        (0, BlockStored([5], 4, [], 16)),  # and another
        (0, BlockStored([6], 2, [], 16)),  # request B: hit on 1, 2; computes 6
        (0, BlockStored([7], 5, [], 16)),  # A again (5 is still its tip)
        (0, BlockStored([8], 5, [], 16)),  # C: 5 already has a child: a new request reading 1..5
        (0, BlockStored([1], None, [], 16, medium="CPU")),  # offload: not a read
        (0, BlockRemoved([6])),
        (1, BlockStored([1], None, [], 16)),  # another source: its own request
        (0, AllBlocksCleared()),
    ]
    for i, (src, e) in enumerate(ev):
        cl.apply(src, EventBatch(float(i), [e]))
    return cl


def test_reads_inferred_from_stores():
    tr = _recorded().recorder.access_trace()
    rows = list(zip(tr.seq.tolist(), tr.block.tolist(), tr.hit.tolist()))
    # block ids are hashes numbered in order of appearance: 1->0, 2->1, 3->2, 4->3, 5->4, 6->5, 7->6, 8->7
    a = [(s, b, h) for s, b, h in rows if s == 0]
    assert a == [(0, 0, False), (0, 1, False), (0, 2, False), (0, 3, False), (0, 4, False), (0, 6, False)]
    b = [(s, b, h) for s, b, h in rows if s == 1]
    assert b == [(1, 0, True), (1, 1, True), (1, 5, False)]
    c = [(s, b, h) for s, b, h in rows if s == 2]
    assert c == [(2, 0, True), (2, 1, True), (2, 2, True), (2, 3, True), (2, 4, True), (2, 7, False)]
    d = [(s, b, h) for s, b, h in rows if s == 3]
    assert d == [(3, 0, False)]  # source b's block 1 is the same hash: the same block id
    assert len(rows) == 16 and (tr.tier == 0).all()


def test_saved_file_is_an_access_trace_with_the_raw_events(tmp_path):
    cl = _recorded()
    path = str(tmp_path / "rec.npz")
    meta = cl.recorder.save(path)
    assert meta == {"sources": ["a", "b"], "events": 10, "blocks": 8, "reads": 16, "requests": 4}
    tr = AccessTrace.load(path)
    assert len(tr) == 16
    with np.load(path) as z:
        assert int((z["ev_kind"] == 1).sum()) == 1 and int((z["ev_kind"] == 2).sum()) == 1
        assert int((z["ev_medium"] == 1).sum()) == 1
        assert json.loads(str(z["ev_meta"]))["requests"] == 4
    rows = run_lab(tr, [2, 8], policies=("lru", "opt"))
    opt8 = next(r for r in rows if r["policy"] == "opt" and r["capacity"] == 8)
    assert opt8["hits"] == 16 - 8  # 8 distinct blocks: every read after a block's first hits a big enough cache


def test_cli_records_a_live_stream_and_policy_lab_replays_it(tmp_path, capsys):
    from app.cli import main
    from engine.attach.fake.spawn import FakeProcess

    fake = FakeProcess("--flavor", "vllm", "--encoding", "map", "--rate", "2000", "--duration", "2",
                       "--capacity", "400", "--linger", "10")
    path = str(tmp_path / "live.npz")
    try:
        assert main(["attach", "--vllm", fake.pub, "--headless", "--run-for", "3", "--record", path, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        (src,) = out["sources"]
        assert src["events"] == fake.summary()["events"] and src["malformed"] == 0
    finally:
        fake.stop()
    assert main(["policy-lab", path, "--capacity", "100", "400", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["accesses"] > 1000
    hit = {(r["policy"], r["capacity"]): r["hit_rate"] for r in res["rows"]}
    assert 0 < hit[("lru", 100)] <= hit[("lru", 400)] <= hit[("opt", 400)]
