"""The policy lab: simulators against hand-computed and brute-force answers, the engine's S3-FIFO, the CLI."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.policy_lab import (POLICIES, default_capacities, first_reads, format_table, main, near_half, plot, replay,
                               run_lab, scan_polluted_trace)
from engine.trace import AccessTrace
from test_eviction import cached_block, lid_of, make_pool, read


def brute_force_max_hits(keys: tuple[int, ...], cap: int) -> int:
    """The most hits any demand-paging policy gets: every eviction choice tried (memoized on the cache set)."""

    @functools.lru_cache(maxsize=None)
    def best(i: int, cache: frozenset) -> int:
        if i == len(keys):
            return 0
        k = keys[i]
        if k in cache:
            return 1 + best(i + 1, cache)
        if len(cache) < cap:
            return best(i + 1, cache | {k})
        return max(best(i + 1, (cache - {x}) | {k}) for x in cache)

    return best(0, frozenset())


small_traces = st.lists(st.integers(0, 4), min_size=1, max_size=12)


@settings(max_examples=400, deadline=None)
@given(keys=small_traces, cap=st.integers(1, 3))
def test_opt_equals_brute_force_optimum(keys, cap):
    assert replay(np.array(keys), cap, "opt")["hits"] == brute_force_max_hits(tuple(keys), cap)


def test_opt_by_hand():
    # cap 2: 3 evicts 2 (next read at 5; 1 at 3); 1 hits; 4 evicts 1 (never read again); 2 evicts 4; 3 hits.
    r = replay(np.array([1, 2, 3, 1, 4, 2, 3]), 2, "opt", evictions=True)
    assert r["evicted"] == [2, 1, 4] and r["hits"] == 2
    assert replay(np.array([1, 2, 3, 1, 4, 3]), 2, "opt", evictions=True)["evicted"] == [2, 1]


def test_lru_by_hand():
    r = replay(np.array([1, 2, 3, 1, 4, 2, 5, 1, 2, 3]), 3, "lru", evictions=True)
    assert r["evicted"] == [2, 3, 1, 4, 5]
    assert (r["hits"], r["misses"], r["hit_rate"]) == (2, 8, 0.2)


def test_heat_by_hand():
    # decay 0.5/s. Key 1 read three times at t=0 (heat 3); 2 at t=1 (heat 1). At t=1.5: 1 has 3*0.5^1.5 = 1.06,
    # 2 has 0.5^0.5 = 0.71: 2 goes, though 1 is older. At t=4: 1 has 0.19, 3 has 0.5^2.5 = 0.18: 3 goes.
    # At t=6: 1 has 0.05, 4 has 0.25: 1 goes.
    r = replay(np.array([1, 1, 1, 2, 3, 4, 5]), 2, "heat", decay=0.5, times=np.array([0, 0, 0, 1, 1.5, 4, 6.0]),
               evictions=True)
    assert r["evicted"] == [2, 3, 1] and r["hits"] == 2
    # Heat decays between reads too: 1 read at t=0 and t=10 has 0.5^10 + 1 = 1.001 then; 2 read at t=9 and 9.5
    # has 1.71. At t=11: 1 has 0.50, 2 has 0.60, so 1 goes (LRU would take 2; undecayed counts would too).
    r = replay(np.array([1, 2, 2, 1, 3]), 2, "heat", decay=0.5, times=np.array([0, 9, 9.5, 10, 11.0]),
               evictions=True)
    assert r["evicted"] == [1]
    # decay 1: heat counts reads. 1 and 2 both have heat 2 at t=4; 1's second-to-last read (t=0) is older.
    r = replay(np.array([1, 2, 2, 1, 3]), 2, "heat", decay=1.0, times=np.arange(5.0), evictions=True)
    assert r["evicted"] == [1]
    # Without times, access i is at i*0.01 s.
    assert replay(np.array([1, 1, 1, 2, 3]), 2, "heat", decay=0.5, evictions=True)["evicted"] == [2]


def test_s3fifo_by_hand():
    # cap 4: small target 1, ghost 3. a is reused in the small queue, so when e arrives it moves to main and
    # b (read once) leaves for the ghost. b, c, d come back from the ghost straight into main. f finds the
    # small queue empty: main's pass decrements a (freq 1 -> 0, to the tail) and evicts b.
    a, b, c, d, e, f, g = range(7)
    r = replay(np.array([a, a, b, c, d, e, b, c, d, f, a, g]), 4, "s3fifo", evictions=True)
    assert r["evicted"] == [b, c, d, e, b, f] and r["hits"] == 2
    # cap 3: ghost of 2. 3 falls out of the ghost (4 and 5 pushed it) before it comes back: small queue.
    r = replay(np.array([1, 1, 2, 3, 4, 2, 5, 1, 3, 6]), 3, "s3fifo", evictions=True)
    assert r["evicted"] == [2, 3, 4, 5, 3] and r["hits"] == 2


def test_s3fifo_resists_a_scan_that_flushes_lru():
    hot = list(range(8)) * 3
    keys = np.array(hot + list(range(100, 160)) + hot)
    assert replay(keys, 16, "s3fifo")["hits"] == 16 + 24
    assert replay(keys, 16, "lru")["hits"] == 16 + 16  # the hot set is read in again after the scan


@settings(max_examples=200, deadline=None)
@given(keys=st.lists(st.integers(0, 30), min_size=1, max_size=300), cap=st.integers(1, 20),
       decay=st.sampled_from([0.5, 0.9, 0.99, 1.0]))
def test_every_policy_is_at_most_opt(keys, cap, decay):
    keys = np.array(keys)
    opt = replay(keys, cap, "opt")["hits"]
    distinct = len(set(keys.tolist()))
    for p in POLICIES:
        r = replay(keys, cap, p, decay=decay)
        assert r["hits"] + r["misses"] == len(keys)
        assert r["hits"] <= opt
        if cap >= distinct:  # everything fits: only the first read of each key misses
            assert r["misses"] == distinct


def engine_evictions(keys: list[int], cap: int) -> list[int]:
    """Drive a BlockPool with the engine's S3FIFO over `keys`: a hit reuses the cached block, a miss makes one."""
    pool = make_pool(cap, "s3fifo")
    out: list[int] = []
    pool.listener = lambda kind, **f: out.append(pool.hash_of(f["lid"]) - 1) if kind == "evict" else None
    for i, k in enumerate(keys):
        if lid_of(pool, k) is not None:
            read(pool, k, 0.01 * i)
        else:
            cached_block(pool, k, 0.01 * i)
    return out


def test_lab_and_engine_s3fifo_agree_on_a_small_trace():
    keys = [0, 0, 1, 2, 3, 4, 1, 2, 3, 5, 0, 6, 7, 0, 8, 9, 10, 11, 1, 12]
    assert engine_evictions(keys, 4) == replay(np.array(keys), 4, "s3fifo", evictions=True)["evicted"]


@settings(max_examples=150, deadline=None)
@given(keys=st.lists(st.integers(0, 40), min_size=1, max_size=200), cap=st.integers(1, 25))
def test_lab_and_engine_s3fifo_make_the_same_evictions(keys, cap):
    assert engine_evictions(keys, cap) == replay(np.array(keys), cap, "s3fifo", evictions=True)["evicted"]


def test_replay_rejects_bad_arguments():
    with pytest.raises(ValueError):
        replay(np.array([1]), 2, "arc")
    with pytest.raises(ValueError):
        replay(np.array([1]), 0, "lru")
    with pytest.raises(ValueError):
        replay(np.array([1, 2]), 2, "heat", times=np.array([0.0]))


# -- the lab ------------------------------------------------------------------------------------------

def test_run_lab_rows_are_consistent():
    keys = scan_polluted_trace(1, n_hot=128, n_scan=256, n_requests=300, scan_every=50, n_prefixes=16)
    caps = [32, 128, 512]
    rows = run_lab(keys, caps, decays=(0.5, 0.99))
    labels = ["lru", "heat(0.5)", "heat(0.99)", "s3fifo", "opt"]
    assert [(r["policy"], r["capacity"]) for r in rows] == [(p, c) for c in caps for p in labels]
    for c in caps:
        at = {r["policy"]: r for r in rows if r["capacity"] == c}
        opt = at["opt"]
        assert opt["fraction_of_opt"] == 1.0
        for r in at.values():
            assert r["hits"] + r["misses"] == len(keys)
            assert r["hit_rate"] == r["hits"] / len(keys)
            assert r["fraction_of_opt"] == pytest.approx(r["hit_rate"] / opt["hit_rate"])
            assert r["fraction_of_opt"] <= 1.0
        assert at["lru"]["hit_rate"] == replay(keys, c, "lru")["hit_rate"]
        assert at["heat(0.99)"]["hits"] == replay(keys, c, "heat", decay=0.99)["hits"]
    opt_rates = [r["hit_rate"] for r in rows if r["policy"] == "opt"]
    assert opt_rates == sorted(opt_rates)  # more room never hurts OPT
    table = format_table(rows)
    assert all(label in table for label in labels) and "512" in table
    assert near_half(rows) in caps


def trace_of(seq, block, t=None) -> AccessTrace:
    n = len(block)
    t = np.arange(n, dtype=np.float64) if t is None else np.asarray(t, dtype=np.float64)
    return AccessTrace(t=t, seq=np.asarray(seq, np.int32), block=np.asarray(block, np.int64),
                       tier=np.zeros(n, np.int8), hit=np.zeros(n, bool))


def test_run_lab_uses_trace_times_and_keeps_opt_as_denominator():
    keys = np.array([1, 1, 1, 2, 3, 4, 5])
    t = np.array([0, 0, 0, 1, 1.5, 4, 6.0])
    trace = trace_of(np.arange(len(keys)), keys, t)  # one request per read: all are first reads
    rows = run_lab(trace, [2], decays=(0.5,), policies=("heat", "lru"))
    assert [r["policy"] for r in rows] == ["heat(0.5)", "lru"]
    heat = rows[0]
    assert heat["hits"] == replay(keys, 2, "heat", decay=0.5, times=t)["hits"]
    assert heat["fraction_of_opt"] == heat["hits"] / replay(keys, 2, "opt")["hits"]


def test_first_reads_keep_each_sequences_first_read_of_a_block():
    # Two steps of sequence 1 (blocks 5, 6, then 5, 6, 7), sequence 2 sharing block 5, sequence 1 again.
    tr = trace_of([1, 1, 1, 1, 1, 2, 2, 1], [5, 6, 5, 6, 7, 5, 8, 7], t=[0, 0, 1, 1, 1, 2, 2, 3])
    keys, times = first_reads(tr)
    assert keys.tolist() == [5, 6, 7, 5, 8] and times.tolist() == [0, 0, 1, 2, 2]
    rows = run_lab(tr, [2], policies=("lru",))
    assert rows[0]["hits"] + rows[0]["misses"] == 5 and rows[0]["hits"] == replay(keys, 2, "lru")["hits"]
    rows = run_lab(tr, [2], policies=("lru",), every_read=True)
    assert rows[0]["hits"] + rows[0]["misses"] == 8


def test_scan_polluted_trace_shape():
    a = scan_polluted_trace(3, n_hot=256, n_scan=500, n_requests=400, scan_every=100)
    assert np.array_equal(a, scan_polluted_trace(3, n_hot=256, n_scan=500, n_requests=400, scan_every=100))
    assert not np.array_equal(a, scan_polluted_trace(4, n_hot=256, n_scan=500, n_requests=400, scan_every=100))
    ids, counts = np.unique(a, return_counts=True)
    assert (counts[ids < 4] == 400).all()  # the system prompt is read by every request
    assert (ids[counts > 1] < 4 + 256 + 64).all()  # only the prefixes are reused (rounding may add a few)
    assert (counts == 1).sum() >= 4 * 500  # four documents went by, read once, besides every new turn
    caps = default_capacities(a)
    assert len(caps) == 8 and caps[-1] == len(ids) and caps[0] == round(0.05 * len(ids))


def test_plot_writes_a_png(tmp_path):
    keys = scan_polluted_trace(0, n_hot=64, n_scan=128, n_requests=100, scan_every=25, n_prefixes=8)
    out = tmp_path / "lab.png"
    plot(run_lab(keys, [16, 64, 256]), str(out))
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_main_on_a_saved_trace_prints_a_table(tmp_path, capsys):
    rng = np.random.default_rng(0)
    blocks = rng.zipf(1.3, 3000) % 400
    n = len(blocks)
    path = tmp_path / "trace.npz"
    trace_of(np.arange(n) // 3, blocks, np.arange(n) * 0.02).save(str(path))  # a sequence reads 3 blocks
    assert main([str(path), "--plot", str(tmp_path / "f.png")]) == 0
    out = capsys.readouterr().out
    m = len(first_reads(AccessTrace.load(str(path)))[0])
    assert m < n and f"3,000 reads; replaying the {m:,} first reads" in out and "hit rate (fraction of OPT)" in out
    for label in ("lru", "heat(0.5)", "heat(0.9)", "heat(0.99)", "s3fifo", "opt"):
        assert any(line.startswith(label + " ") for line in out.splitlines())
    assert "LRU nearest 50%" in out and (tmp_path / "f.png").exists()

    assert main([str(path), "--capacity", "10", "50", "--decay", "0.8", "--every-read", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["accesses"] == n and {r["capacity"] for r in doc["rows"]} == {10, 50}
    assert {r["policy"] for r in doc["rows"]} == {"lru", "heat(0.8)", "s3fifo", "opt"}


def test_main_reports_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros(3))
    assert main([str(bad)]) == 2
    assert "not a KV Scope access trace" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])
    with pytest.raises(SystemExit):
        main(["--synthetic", "scan", "--capacity", "0"])
