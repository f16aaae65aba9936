"""Re-stores from an attached server's events (issue 23 item 4): a store of a hash the cache removed before is a
re-store, with the removals since as the blocks the cache lacked; the curve is a lower bound on what more blocks buy."""

from __future__ import annotations

import math

from engine.attach.block_state import BlockTable
from engine.attach.restores import curve_text


def store(t: BlockTable, h: int, now: float) -> None:
    t.store(h, -1, None, 0, 0, [], 0, now, None)


def test_a_store_after_a_removal_is_a_re_store_with_its_need_and_gap():
    t = BlockTable()
    for h in range(1, 9):  # 8 compulsory stores
        store(t, h, float(h))
    for h in (1, 2, 3, 4):  # evicted in order
        t.remove(h, 10.0 + h)
    store(t, 4, 20.0)  # removed last: one more block would have kept it
    store(t, 1, 21.0)  # removed first: four more blocks (the 4 removals from its own on)
    store(t, 9, 22.0)  # never seen: compulsory
    s = t.restores.summary()
    assert (s["stores"], s["compulsory"], s["re_stores"]) == (11, 9, 2)
    assert s["re_store_share"] == 2 / 11
    assert sorted(t.restores.needs().tolist()) == [1, 4]
    assert s["gap_p50_s"] == ((20.0 - 14.0) + (21.0 - 11.0)) / 2
    assert s["curve"] == [(1, 1), (2, 1), (4, 2)]
    assert curve_text(s) == "+1 blocks: ≥ 1 of 2 re-stores would have hit; +4 blocks: ≥ 2 of 2 re-stores would have hit"
    # A duplicate store of a resident hash is neither.
    store(t, 4, 23.0)
    assert t.restores.summary()["stores"] == 11 and t.restored == 1


def test_no_store_is_no_data():
    s = BlockTable().restores.summary()
    assert s["stores"] == 0 and math.isnan(s["re_store_share"]) and math.isnan(s["gap_p50_s"]) and s["curve"] == []
    assert curve_text(s) == "no re-stores seen"


def test_the_real_servers_bytes_stored_removed_and_stored_again_count_one_re_store():
    """vLLM 0.33.0's and SGLang 0.5.23's own frames (tests/data/attach/real_frames.json), rank 1: a BlockStored, then
    the BlockRemoved of that block; the stored frame again is one re-store, one removal after its own."""
    import base64
    import json
    import os

    from engine.attach.cluster import ClusterState
    from engine.attach.events import decode_batch

    real = json.load(open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                                       "attach", "real_frames.json")))
    for server in ("vllm", "sglang"):
        (rank,) = [r for r in real[server]["ranks"] if r["rank"] == 1]
        stored, removed = ([base64.b64decode(x) for x in f][-1] for f in rank["live"][:2])
        c = ClusterState([server])
        for payload in (stored, removed, stored):
            c.apply(0, decode_batch(payload), 1)
        (view,) = [g for g in c.snapshot().groups if g.key[1] == 1]
        rs = view.restores
        assert rs["re_stores"] == 1 and rs["stores"] == rs["compulsory"] + 1 == view.stored, server
        assert rs["curve"] == [(1, 1)] and rs["re_store_share"] == 1 / rs["stores"] and rs["gap_p50_s"] >= 0


def test_a_map_title_says_how_many_blocks_were_re_stored(qtbot):
    import numpy as np

    from engine.attach.cluster import ClusterState
    from engine.attach.events import BlockRemoved, BlockStored, decode_batch
    from engine.attach.fake.publisher import encode
    from ui.attach.block_map import AttachMap

    c = ClusterState(["v"])
    frames = ([BlockStored([1, 2, 3], None, list(range(48)), 16)], [BlockRemoved([1])],
              [BlockStored([1], None, list(range(16)), 16)])
    for i, events in enumerate(frames):
        c.apply(0, decode_batch(encode(events, float(i), 0, "vllm", "tagged")))
    m = AttachMap()
    qtbot.addWidget(m)
    m.set_snapshot(c.snapshot())
    assert "4 stores" not in m.label_texts()[0] and "1 re-stored (25.0 % of stores)" in m.label_texts()[0]
    assert np.isfinite(c.snapshot().groups[0].restores["gap_p50_s"])
