"""Per-group what-if curves (issue 23 item 2): a grouped engine's trace records every KV-cache group's reads, a
sliding-window group's rows at their blocks' positions in the sequence (its table starts at its base), so each
group's stream names its blocks by their contents, as the group's pool does. Ground truth: what the group's pool
actually hit on the run (real_hit_rate over the group's own rows)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import CacheConfig, EngineOptions
from engine.lab.mrc import lru_curve
from engine.lab.whatif import block_hashes, groups_of, prefix_keys, real_hit_rate, rebin, stream_of
from engine.model.loader import load_model
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from tiny_models import prompts

PLAIN_LRU = dict(policy="lru", demote_after_s=3600.0, prefetch_depth=0)


@pytest.fixture(scope="module")
def qwen3_sliding(tiny_qwen3_sliding):
    return load_model(tiny_qwen3_sliding)  # layer 0 full attention, layers 1-2 a window of 24


def _run(model, requests, block_size=4, device_mb=64.0):
    eng = Engine(model, CacheConfig(block_size=block_size, device_budget_mb=device_mb, host_budget_mb=16.0,
                                    **PLAIN_LRU), EngineOptions(attention="cpu"))
    eng.start_trace()
    for batch in requests:
        eng.generate(batch, SamplingParams(max_new_tokens=6, ignore_eos=True))
    return eng, eng.stop_trace()


def _workload():
    """Conversations that return with a longer history (the window group reuses the blocks of the history's last
    window), and a repeated prompt."""
    (shared,) = prompts(7, [40])
    tails = prompts(8, [9, 13, 5])
    return [[shared + tails[0]], [shared + tails[0] + tails[1]], [shared + tails[2]], [shared + tails[0]],
            [shared + tails[0] + tails[1] + tails[2]]]


@pytest.mark.parametrize("name, groups", [("qwen3_sliding", [0, 1]), ("tiny_gemma3", [0, 1]),
                                          ("tiny_mistral", [0])])
def test_each_groups_lru_curve_at_its_capacity_is_what_its_pool_hit(name, groups, request):
    """Qwen3 (full layer 0, window layers 1-2), Gemma 3 (S S F S S), Mistral (every layer slides: group 0 is a
    window group, its table the sequence's own, starting at Sequence.base)."""
    model = request.getfixturevalue(name)
    eng, trace = _run(model if name == "qwen3_sliding" else load_model(model), _workload())
    assert groups_of(trace) == groups
    if name == "tiny_mistral":
        g0 = np.flatnonzero(trace.group == 0)
        assert trace.pos[g0].min() > 0  # its window slid past the first blocks too
        return _each_group(eng, trace)
    g1 = np.flatnonzero(trace.group == 1)
    # the window slid past the first blocks: group 1's table reads start at its base, and the rows say where
    assert trace.pos[g1].min() > 0 and len(np.unique(trace.pos[g1])) > 4
    _each_group(eng, trace)


def _each_group(eng, trace):
    for g, pool in enumerate(eng.kv.pools):
        s = stream_of(trace, group=g)
        real, n = real_hit_rate(trace, g)
        cap = int(pool.sizes.dev_cap)
        assert s.distinct <= cap  # nothing was evicted: the pool is the cache the curve models at this size
        got = lru_curve(s.keys, [cap, 1], s.counted, fresh=s.fresh).hit_rate
        assert n == int(s.counted.sum()) and 0.2 < real < 1.0, (g, real, n)
        assert got[0] == pytest.approx(real, abs=1e-12), g
        assert got[1] < got[0]
        # a block is one key (its contents'), and the blocks the prompts covered are one block per key (the
        # engine computed a generated block twice where two sequences generated the same tokens: one key, as a
        # larger cache would still compute it at the second sequence's first read)
        rows = np.flatnonzero(trace.group == g)
        full = s.keys >= 0
        pairs = set(zip(trace.block[rows][full].tolist(), s.keys[full].tolist()))
        assert len(pairs) == len({b for b, _ in pairs}), g


def test_a_window_groups_rows_name_the_blocks_it_reads(qwen3_sliding):
    """Each content key of group 1 is the chained hash of the sequence's tokens up to the end of the block the row
    is at: the hash the group's pool stores (checked here against the pool's own hashes of live blocks)."""
    eng = Engine(qwen3_sliding, CacheConfig(block_size=4, device_budget_mb=64.0, **PLAIN_LRU),
                 EngineOptions(attention="cpu"))
    eng.start_trace()
    (p,) = prompts(9, [50])
    eng.add_request(p, SamplingParams(max_new_tokens=20, ignore_eos=True))
    for _ in range(12):
        eng.step()
    trace = eng.stop_trace()
    seq = next(iter(eng.scheduler.seqs.values()))
    table = eng.kv.table(seq, 1)
    assert table.base > 0
    rows = np.flatnonzero((trace.group == 1) & (trace.t == trace.t.max()))
    assert trace.pos[rows].tolist() == list(range(table.base, table.base + len(rows)))
    keys = prefix_keys(np.asarray(seq.tokens), 4)
    s = stream_of(trace, group=1)
    at = np.flatnonzero(trace.group == 1)
    last = np.isin(at, rows)
    full = trace.pos[at][last] < len(keys)
    assert s.keys[last][full].tolist() == keys[trace.pos[at][last][full]].tolist()
    # the pool's own names of those blocks (chained hashes) are the same blocks: block_hashes at the rows' places
    pool = block_hashes(np.asarray(seq.tokens), 4)[trace.pos[at][last][full]]
    assert [h & ((1 << 63) - 1) for h in table.hashes[:int(full.sum())]] == pool.tolist()


def _canonical(keys: np.ndarray) -> list[int]:
    """Each key as the index of its first occurrence: streams equal up to the names of their keys."""
    _, first, inv = np.unique(keys, return_index=True, return_inverse=True)
    return first[inv].tolist()


def test_rebin_of_a_window_group_starts_at_its_table(qwen3_sliding):
    _, trace = _run(qwen3_sliding, _workload()[:2])
    s4, s8 = rebin(trace, 4, group=1), rebin(trace, 8, group=1)
    # at the recorded size, the same stream (the same keys where a block is named by its contents; the rest named
    # per block either way)
    same = stream_of(trace, group=1)
    assert _canonical(s4.keys) == _canonical(same.keys) and s4.counted.tolist() == same.counted.tolist()
    assert s4.fresh.tolist() == same.fresh.tolist() and 0 < s4.fresh.sum() < s4.counted.sum()
    assert (s4.keys >= 0).sum() > len(s4.keys) // 2 and s4.keys[s4.keys >= 0].tolist() == same.keys[same.keys >= 0].tolist()
    assert 0 < s8.distinct < s4.distinct


def test_policy_lab_prints_every_groups_curves(qwen3_sliding, tmp_path, capsys):
    import json

    from app.whatif.policy_lab import main

    _, trace = _run(qwen3_sliding, _workload()[:3])
    p = str(tmp_path / "grouped.npz")
    trace.save(p)
    assert main([p, "--curve", "--current", "8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [g["group"] for g in doc["groups"]] == [0, 1] and doc["group"] == 0
    for g in doc["groups"]:
        s = stream_of(trace, group=g["group"])
        assert g["distinct_blocks"] == s.distinct and len(g["curves"][0]["capacities"]) >= min(32, s.distinct)
    assert doc["groups"][1]["distinct_blocks"] < doc["groups"][0]["distinct_blocks"]
    assert main([p, "--curve", "--group", "1", "--block-sizes", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["group"] == 1 and "groups" not in one and one["curves"] == doc["groups"][1]["curves"]
    assert [r["block_size"] for r in one["block_sizes"]] == [8, 16, 32, 64]
    assert main([p, "--curve"]) == 0
    out = capsys.readouterr().out
    assert "— KV-cache group 0 —" in out and "— KV-cache group 1 —" in out
    assert main([p, "--curve", "--group", "5"]) == 2
    assert "--group 5: the trace has groups 0, 1" in capsys.readouterr().err
