"""The block tables events build: prefix-tree facts (depth, family, parents named), placement by hash, growth,
clears, groups per rank / medium / KV-cache group, and the code snapshots the window draws."""

from __future__ import annotations

import msgspec
import pytest
import numpy as np

from engine.attach import codes
from engine.attach.block_state import BlockTable
from engine.attach.cluster import ClusterState
from engine.attach.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch


def _batch(*events, ts=100.0, rank=None):
    return EventBatch(ts, list(events), rank)


def _cluster(n=1):
    cl = ClusterState([f"s{i}" for i in range(n)])
    for i in range(n):
        cl.set_offset(i, 100.0, now=100.0)  # publisher time = local time
    return cl


def test_chain_depth_family_and_parent_named():
    cl = _cluster()
    cl.apply(0, _batch(BlockStored([1, 2, 3], None, list(range(48)), 16)))
    cl.apply(0, _batch(BlockStored([4], 3, list(range(100, 116)), 16), ts=101.0))  # decode block
    cl.apply(0, _batch(BlockStored([5, 6], 2, list(range(200, 232)), 16), ts=102.0))  # a branch off block 2
    g = cl.groups[(0, 0, "GPU", 0)]
    depth = {h: int(g.a["depth"][g.index[h]]) for h in (1, 2, 3, 4, 5, 6)}
    assert depth == {1: 0, 2: 1, 3: 2, 4: 3, 5: 2, 6: 3}
    fam = {int(g.a["family"][g.index[h]]) for h in (1, 2, 3, 4, 5, 6)}
    assert len(fam) == 1
    named = {h: int(g.a["named"][g.index[h]]) for h in (1, 2, 3)}
    assert named == {1: 0, 2: 1, 3: 1}  # named as the parent of a later store
    info = cl.block_info((0, 0, "GPU", 0), g.index[6], now=103.0)
    assert info["tokens"] == list(range(216, 224)) and info["parent"] == 5 and info["depth"] == 3
    assert info["family_tokens"] == list(range(8))
    assert [t[0] for t in info["path_tokens"]] == [0, 16, 200]  # blocks 1, 2, 5 above it, root first
    assert abs(info["age_s"] - 1.0) < 1e-9 and abs(info["idle_s"] - 1.0) < 1e-9


def test_unseen_parent_gives_unknown_depth_and_a_family_named_after_it():
    cl = _cluster()
    cl.apply(0, _batch(BlockStored([10, 11], 999, [], 16), BlockStored([12], 999, [], 16)))
    g = cl.groups[(0, 0, "GPU", 0)]
    assert int(g.a["depth"][g.index[10]]) == -1 and int(g.a["depth"][g.index[11]]) == -1
    assert g.a["family"][g.index[10]] == g.a["family"][g.index[12]]  # siblings under the same unseen parent
    snap = cl.snapshot("depth")
    assert (snap.groups[0].codes == codes.UNKNOWN_CODE).sum() == 3


def test_removal_empties_the_cell_and_a_removed_parent_is_not_followed():
    cl = _cluster()
    cl.apply(0, _batch(BlockStored([1, 2], None, [], 16)))
    g = cl.groups[(0, 0, "GPU", 0)]
    c2 = g.index[2]
    cl.apply(0, _batch(BlockRemoved([1, 77])))
    assert 1 not in g.index and g.removed == 1 and g.removed_unknown == 1
    assert g.parent_of(c2) == -1
    cl.apply(0, _batch(BlockStored([1], None, [], 16)))  # stored again: maybe in another cell
    assert g.parent_of(c2) == (g.index[1] if g.hash_at[g.index[1]] == 1 else -1)


def test_placement_is_by_hash_stable_and_the_same_in_every_group():
    a, b = BlockTable(), BlockTable()
    hashes = [bytes([i]) * 32 for i in range(200)]
    for h in hashes:
        a.store(h, -1, None, 0, 0, [], 0, 1.0, None)
    for h in reversed(hashes[:50]):  # another order, fewer blocks: collisions differ, home cells do not
        b.store(h, -1, None, 0, 0, [], 0, 1.0, None)
    before = {h: a.index[h] for h in hashes}
    for h in hashes[::2]:
        a.remove(h)
    assert all(a.index[h] == before[h] for h in hashes[1::2])  # the rest keep their cells
    same = sum(a.index.get(h) == b.index[h] for h in hashes[1:50:2])
    assert same >= 20  # with few collisions, a hash has the same place on both maps


def test_growth_keeps_every_block_and_its_chain():
    t = BlockTable(cells=1024)
    prev = None
    pcell = -1
    for i in range(3000):
        pcell = t.store(i, pcell, prev, i, 0, [], 0, float(i), None)
        prev = i
    assert t.cells == 8192 and len(t) == 3000
    assert all(t.hash_at[c] == h for h, c in t.index.items())
    assert int(t.a["occ"].sum()) == 3000
    c = t.index[2999]
    for expect in range(2998, 2990, -1):
        c = t.parent_of(c)
        assert t.hash_at[c] == expect
    assert t.a["stored_t"][t.index[1234]] == 1234.0


def test_groups_per_rank_medium_and_kv_group_and_clear_only_gpu_of_that_rank():
    cl = _cluster()
    cl.apply(0, _batch(BlockStored([1], None, [], 16, medium="GPU"), BlockStored([1], None, [], 16, medium="CPU"),
                       BlockStored([2], None, [], 16, group_idx=1), rank=0))
    cl.apply(0, _batch(BlockStored([3], None, [], 16), rank=1))
    assert set(cl.groups) == {(0, 0, "GPU", 0), (0, 0, "CPU", 0), (0, 0, "GPU", 1), (0, 1, "GPU", 0)}
    cl.apply(0, _batch(AllBlocksCleared(), rank=0))
    sizes = {k: len(g) for k, g in cl.groups.items()}
    assert sizes == {(0, 0, "GPU", 0): 0, (0, 0, "CPU", 0): 1, (0, 0, "GPU", 1): 0, (0, 1, "GPU", 0): 1}
    assert any(kind == "cleared" for _, kind, _ in cl.take_notes())


def test_snapshot_codes_mark_empty_cells_and_reuse_counts():
    cl = _cluster()
    cl.apply(0, _batch(BlockStored([1, 2], None, [], 16)))
    for i in range(6):
        cl.apply(0, _batch(BlockStored([100 + i], 2, [], 16)))  # six requests read block 2
    snap = cl.snapshot("reuse")
    (g,) = snap.groups
    tab = cl.groups[g.key]
    assert g.resident == 8 and len(g.codes) == tab.cells
    assert (g.codes == codes.EMPTY_CODE).sum() == tab.cells - 8
    # block 1 is block 2's parent within one event: named only by the event's parent_block_hash, never
    assert g.codes[tab.index[2]] == 4 and g.codes[tab.index[1]] == 0 and g.codes[tab.index[100]] == 0
    assert snap.activity[0].stored_blocks == 8 and snap.activity[0].events == 7


def test_age_codes_grow_with_age_on_a_log_scale():
    cl = _cluster()
    cl.apply(0, _batch(BlockStored([1], None, [], 16), ts=100.0))
    cl.apply(0, _batch(BlockStored([2], None, [], 16), ts=190.0))
    snap = cl.snapshot("age", now=200.0)
    tab = cl.groups[(0, 0, "GPU", 0)]
    c_old, c_new = snap.groups[0].codes[tab.index[1]], snap.groups[0].codes[tab.index[2]]
    lo, hi = snap.range
    assert c_old > c_new > 0 and hi >= 100.0
    assert abs(int(c_new) - codes.VALUE_MAX * np.log(10.0 / lo) / np.log(hi / lo)) <= 1


def test_tokens_stay_raw_until_a_tooltip_asks():
    cl = _cluster()
    b = decode_batch(encode_batch(100.0, [BlockStored([1, 2], None, list(range(32)), 16)], encoding="map"))
    assert isinstance(b.events[0].token_ids, msgspec.Raw)
    cl.apply(0, b)
    g = cl.groups[(0, 0, "GPU", 0)]
    assert g.tokens(g.index[2]) == list(range(16, 24))
    assert not isinstance(g.tok_at[g.index[2]][0], list)  # kept as bytes, copied out of the frame


def test_family_snapshot_names_the_biggest_families_with_their_root_tokens():
    cl = _cluster()
    cl.apply(0, _batch(BlockStored([1, 2, 3], None, list(range(48)), 16), BlockStored([9], None, [7] * 16, 16)))
    cl.apply(0, _batch(BlockStored([4, 5], 3, [], 16)))
    snap = cl.snapshot("family")
    (big, blocks, toks), (small, n2, toks2) = snap.top_families
    assert blocks == 5 and n2 == 1 and toks == tuple(range(8)) and toks2 == (7,) * 8
    tab = cl.groups[(0, 0, "GPU", 0)]
    assert snap.groups[0].codes[tab.index[5]] == big % codes.N_CATEGORICAL


def test_a_block_lands_in_the_same_cell_in_every_process():
    """Placement does not depend on Python's per-process hash salt (bytes and str hashes): two processes with
    different PYTHONHASHSEED put the same blocks in the same cells, so maps of two runs can be compared."""
    import json
    import os
    import subprocess
    import sys

    code = ("from engine.attach.block_state import BlockTable\n"
            "t = BlockTable()\n"
            "keys = [bytes([i % 256, i // 256]) * 16 if i % 3 else f'h{i}' for i in range(300)]\n"
            "for h in keys:\n"
            "    t.store(h, -1, None, 0, 0, [], 0, 1.0, None)\n"
            "print([t.index[h] for h in keys])\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    cells = [json.loads(out) for out in outs]
    assert cells[0] == cells[1] and len(set(cells[0])) == 300


@pytest.mark.parametrize("cpu", [0, 500])
def test_the_fake_server_never_holds_more_than_its_capacity_event_by_event(cpu):
    """The fake cache (the demo's publishers) stored a request's blocks, then removed the ones over capacity:
    an attach frame between the two showed '2,504 blocks of 2,500'. vLLM's BlockPool drops a reused block's hash
    before the new store, so after every event the resident blocks are at most the capacity, each tier."""
    from engine.attach.fake.workload import FakeCache

    c = FakeCache(capacity=300, cpu_capacity=cpu, seed=1, flavor="vllm")
    res = {"GPU": set(), "CPU": set()}
    peak = dict.fromkeys(res, 0)
    removed = 0
    for i in range(3000):
        for e in c.request(0.01 * i):
            tier = res["GPU" if e.medium == "GPU" else "CPU"]
            if isinstance(e, BlockStored):
                tier.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                tier.difference_update(e.block_hashes)
                removed += 1
            peak["GPU"], peak["CPU"] = max(peak["GPU"], len(res["GPU"])), max(peak["CPU"], len(res["CPU"]))
    assert removed and peak["GPU"] == 300 and peak["CPU"] == cpu
    assert res["GPU"] == set(c.gpu) and res["CPU"] == set(c.cpu)
