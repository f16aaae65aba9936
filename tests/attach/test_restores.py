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


def test_the_sorted_parts_refresh_at_most_twice_a_second_while_counts_stay_current():
    t = BlockTable()
    for h in range(1, 5):
        store(t, h, float(h))
    t.remove(1, 5.0)
    store(t, 1, 6.0)
    rs = t.restores
    first = rs.summary(now=100.0)
    assert first["curve"] == [(1, 1)] and first["kept"] == 1
    t.remove(2, 7.0)
    t.remove(3, 8.0)
    store(t, 2, 9.0)  # need 2 (removals 2 and 3)
    stale = rs.summary(now=100.2)
    assert (stale["re_stores"], stale["stores"]) == (2, 6)  # counts: current
    assert stale["curve"] == [(1, 1)] and stale["kept"] == 1  # the sort: not yet
    fresh = rs.summary(now=100.6)
    assert fresh["curve"] == [(1, 1), (2, 2)] and fresh["kept"] == 2


def test_the_re_stores_panel_draws_each_caches_curve_and_says_no_data_without_one(qtbot):
    from engine.attach.cluster import ClusterState
    from engine.attach.events import BlockRemoved, BlockStored, decode_batch
    from engine.attach.fake.publisher import encode
    from ui.attach.restores import RestoresPanel

    c = ClusterState(["v", "w"])
    panel = RestoresPanel()
    qtbot.addWidget(panel)
    panel.update_groups(c.snapshot().groups)
    assert panel.note.isVisible() and panel.lines() == []
    frames = ([BlockStored(list(range(1, 9)), None, list(range(128)), 16)], [BlockRemoved([1, 2, 3, 4])],
              [BlockStored([4], None, list(range(16)), 16)], [BlockStored([1], None, list(range(16)), 16)])
    for i, events in enumerate(frames):
        c.apply(0, decode_batch(encode(events, float(i), 0, "vllm", "tagged")))
    c.apply(1, decode_batch(encode([BlockStored([7], None, list(range(16)), 16)], 0.0, 0, "vllm", "tagged")))
    groups = c.snapshot().groups
    panel.update_groups(groups)
    v, w = groups
    assert v.restores["re_stores"] == 2
    assert panel.lines()[0].startswith(f"{v.label}: re-stored 2 of 10 stores (20.0 %)")
    assert "+4 blocks: ≥ 2 of 2 re-stores would have hit (lower bound)" in panel.lines()[0]
    assert panel.lines()[1] == f"{w.label}: re-stored 0 of 1 stores (0.0 %), gap p50 no data; no re-stores: " \
                               "nothing more blocks would buy that events can show"
    x, y = panel.curve_points(v.label)
    assert list(y) == [50.0, 50.0, 100.0]  # needs 1 and 4: +1 and +2 keep one of two, +4 both
    assert panel.curve_points(w.label) is None and not panel.note.isVisible()
