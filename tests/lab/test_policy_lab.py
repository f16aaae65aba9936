"""The policy lab: simulators against hand-computed and brute-force answers, the engine's S3-FIFO, the CLI."""

from __future__ import annotations

import functools
import io
import json
import os
import struct
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.whatif.policy_lab import main, plot
from engine.lab.policy_lab import default_capacities, first_reads, format_table, near_half, run_lab, scan_polluted_trace
from engine.kv.eviction_sim import POLICIES, replay
from engine.kv.access_trace import MAX_TRACE_ROWS, AccessTrace
from pools import cached_block, lid_of, make_pool, read


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
    # decay 0.5/s; a miss starts at heat 2 (the engine's insert, heat 1, and the read of the step that wrote it).
    # Key 1 read five times at t=0 (heat 6); 2 at t=1 (heat 2). At t=1.5: 1 has 6*0.5^1.5 = 2.12, 2 has
    # 2*0.5^0.5 = 1.41: 2 goes, though 1 is older. At t=4: 1 has 0.375, 3 has 2*0.5^2.5 = 0.354: 3 goes.
    # At t=6: 1 has 0.094, 4 has 0.5: 1 goes.
    r = replay(np.array([1, 1, 1, 1, 1, 2, 3, 4, 5]), 2, "heat", decay=0.5,
               times=np.array([0, 0, 0, 0, 0, 1, 1.5, 4, 6.0]), evictions=True)
    assert r["evicted"] == [2, 3, 1] and r["hits"] == 4
    # Heat decays between reads too: 1 read at t=0 and t=10 has 2*0.5^10 + 1 = 1.002 then; 2 read at t=9 and 9.5
    # has 2.41. At t=11: 1 has 0.50, 2 has 0.85, so 1 goes (LRU would take 2; undecayed counts would too).
    r = replay(np.array([1, 2, 2, 1, 3]), 2, "heat", decay=0.5, times=np.array([0, 9, 9.5, 10, 11.0]),
               evictions=True)
    assert r["evicted"] == [1]
    # decay 1: heat counts reads. 1 and 2 both have heat 3 at t=4; 1's second-to-last read (t=0) is older.
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


@settings(max_examples=150, deadline=None)
@given(keys=st.lists(st.integers(0, 25), min_size=1, max_size=250), cap=st.integers(1, 12),
       decay=st.sampled_from([0.5, 0.9, 1.0]))
def test_lab_miss_reasons_add_up_to_the_misses(keys, cap, decay):
    """Every replayed miss gets one reason: cold (the key's first access) or evicted; OPT's kept share is a subset."""
    keys = np.array(keys)
    rows = run_lab(keys, [cap], decays=(decay,))
    distinct = len(set(keys.tolist()))
    opt_hit = replay(keys, cap, "opt", per_access=True)["hit"]
    for r in rows:
        w = r["why_missed"]
        assert w["cold"] + w["evicted"] == r["misses"]
        assert w["cold"] == distinct  # a first access misses under every demand-paging policy
        assert 0 <= r["evicted_opt_keeps"] <= w["evicted"]
        if r["policy"] == "opt":
            assert r["evicted_opt_keeps"] == 0
        # brute force: an evicted miss is a miss at an access whose key came before
        p, d = (r["policy"].split("(")[0], r["decay"] or 0.9)
        hit = replay(keys, cap, p, decay=d, per_access=True)["hit"]
        seen, ev, kept = set(), 0, 0
        for i, k in enumerate(keys.tolist()):
            if not hit[i] and k in seen:
                ev += 1
                kept += bool(opt_hit[i])
            seen.add(k)
        assert (ev, kept) == (w["evicted"], r["evicted_opt_keeps"])


def test_lab_miss_reasons_by_hand(capsys):
    # cap 2, LRU: 1 2 3 1 2 3 -> all six miss; 1, 2, 3 cold, then 1, 2, 3 evicted (each last used 3 accesses
    # before). OPT evicts 2 for 3 (hits 1), then 1 for 2 (hits 3): both are LRU's evicted misses that OPT kept.
    keys = np.array([1, 2, 3, 1, 2, 3])
    lru = next(r for r in run_lab(keys, [2], policies=("lru",)))
    assert lru["why_missed"] == {"cold": 3, "evicted": 3}
    assert lru["evicted_gap_p50_accesses"] == 3.0 and lru["evicted_gap_p50_s"] is None
    opt = replay(keys, 2, "opt", per_access=True)
    assert lru["evicted_opt_keeps"] == int(opt["hit"].sum()) == 2
    assert main(["--synthetic", "scan", "--capacity", "500", "--policy", "lru", "opt"]) == 0
    out = capsys.readouterr().out
    assert "why missed at 500 blocks" in out and "cold" in out and "OPT would have kept" in out


def engine_evictions(keys: list[int], cap: int, policy: str, decay: float = 0.9) -> list[int]:
    """Drive a BlockPool with the engine's `policy` over `keys` (one access per 0.01 s, the lab's clock for a trace
    without times): a hit reuses the cached block, a miss makes one; the keys of the evicted blocks, in order."""
    pool = make_pool(cap, policy, decay=decay)
    out: list[int] = []
    for i, k in enumerate(keys):
        if lid_of(pool, k) is not None:
            read(pool, k, 0.01 * i)
        else:
            cached_block(pool, k, 0.01 * i)
        out += [e.fields["hash"] - 1 for e in pool.take_events() if e.kind == "evict"]
    return out


def test_lab_and_engine_s3fifo_agree_on_a_small_trace():
    keys = [0, 0, 1, 2, 3, 4, 1, 2, 3, 5, 0, 6, 7, 0, 8, 9, 10, 11, 1, 12]
    assert engine_evictions(keys, 4, "s3fifo") == replay(np.array(keys), 4, "s3fifo", evictions=True)["evicted"]


# The lab's simulators (engine/kv/eviction_sim.py) are plain Python for speed; the engine's rules
# (engine/kv/eviction.py) are numpy over a tier. One rule each, written twice: these hold them to the same victims.
@pytest.mark.parametrize("policy", ["lru", "heat", "s3fifo"])
@settings(max_examples=150, deadline=None)
@given(keys=st.lists(st.integers(0, 40), min_size=1, max_size=200), cap=st.integers(1, 25),
       decay=st.sampled_from([0.5, 0.9, 0.99, 1.0]))
def test_lab_and_engine_make_the_same_evictions(policy, keys, cap, decay):
    lab = replay(np.array(keys), cap, policy, decay=decay, evictions=True)["evicted"]
    assert engine_evictions(keys, cap, policy, decay) == lab



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
    for r in doc["rows"]:  # the trace's own times: the gap is in seconds
        assert sum(r["why_missed"].values()) == r["misses"]
        assert r["evicted_gap_p50_s"] is None or r["evicted_gap_p50_s"] > 0


def test_main_reports_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros(3))
    assert main([str(bad)]) == 2
    assert "not a KV Scope access trace" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])
    capsys.readouterr()
    assert main(["--synthetic", "scan", "--capacity", "0"]) == 2
    assert capsys.readouterr().err.startswith("kvscope policy-lab: error: --capacity")


# -- hostile and broken trace files -------------------------------------------------------------------

def good_columns(n: int = 100) -> dict[str, np.ndarray]:
    return dict(t=np.arange(n) * 0.5, seq=np.arange(n, dtype=np.int32) // 10, block=np.arange(n, dtype=np.int64),
                tier=np.zeros(n, np.int8), hit=np.ones(n, bool))


def npy(a: np.ndarray) -> bytes:
    b = io.BytesIO()
    np.save(b, a, allow_pickle=True)
    return b.getvalue()


def npy_header(descr: str, shape: tuple) -> bytes:
    b = io.BytesIO()
    np.lib.format.write_array_header_1_0(b, {"descr": descr, "fortran_order": False, "shape": shape})
    return b.getvalue()


def lying(a: np.ndarray, shape: tuple) -> bytes:
    """The .npy of `a` with a header that declares `shape` instead (the data stays `a`'s)."""
    return npy_header(np.lib.format.dtype_to_descr(a.dtype), shape) + a.tobytes()


def write_npz(path, members: dict, compression=zipfile.ZIP_DEFLATED) -> str:
    with zipfile.ZipFile(path, "w", compression) as z:
        for name, v in members.items():
            z.writestr(name + ".npy", v if isinstance(v, bytes) else npy(v))
    return str(path)


def with_column(**cols) -> dict:
    return {**good_columns(), **cols}


def entry_claims(path, member: str, size: int) -> None:
    """Rewrite the zip central directory so `member` claims `size` uncompressed bytes."""
    data = bytearray(open(path, "rb").read())
    pos = data.find(b"PK\x01\x02")
    while pos >= 0:
        n = struct.unpack_from("<H", data, pos + 28)[0]
        if data[pos + 46:pos + 46 + n] == member.encode():
            struct.pack_into("<I", data, pos + 24, size)
        pos = data.find(b"PK\x01\x02", pos + 4)
    open(path, "wb").write(bytes(data))


def _bad_t(value: float) -> np.ndarray:
    t = good_columns()["t"]
    t[3] = value
    return t


def _negative_block() -> np.ndarray:
    b = good_columns()["block"]
    b[5] = -7
    return b


def _tier_three() -> np.ndarray:
    tr = good_columns()["tier"]
    tr[5] = 3
    return tr


def make_bad(kind: str, path) -> str:
    """A file of one class of bad input, at `path` (returned)."""
    p = str(path)
    if kind == "0-d columns":
        return write_npz(p, {c: np.asarray(v[0]) for c, v in good_columns().items()})
    if kind == "2-d column":
        return write_npz(p, with_column(block=np.arange(100).reshape(10, 10)))
    if kind == "huge declared shape":
        return write_npz(p, with_column(t=lying(good_columns()["t"], (10 ** 10,))))
    if kind == "header lies about rows":
        return write_npz(p, with_column(t=lying(good_columns()["t"], (1_000_000,))))
    if kind == "zip entry lies about its size":
        write_npz(p, good_columns(), zipfile.ZIP_STORED)
        entry_claims(p, "t.npy", 400_000_000)
        return p
    if kind == "object column":
        return write_npz(p, with_column(seq=np.array([1, "a", None] * 33 + [1], dtype=object)))
    if kind == "complex times":
        return write_npz(p, with_column(t=good_columns()["t"].astype(complex)))
    if kind == "string blocks":
        return write_npz(p, with_column(block=good_columns()["block"].astype(str)))
    if kind == "float blocks":
        return write_npz(p, with_column(block=good_columns()["block"].astype(float)))
    if kind == "integer hits":
        return write_npz(p, with_column(hit=np.ones(100, np.int64)))
    if kind == "columns of different lengths":
        return write_npz(p, with_column(block=np.arange(50)))
    if kind == "nan time":
        return write_npz(p, with_column(t=_bad_t(np.nan)))
    if kind == "inf time":
        return write_npz(p, with_column(t=_bad_t(np.inf)))
    if kind == "negative block serial":
        return write_npz(p, with_column(block=_negative_block()))
    if kind == "tier not 0 or 1":
        return write_npz(p, with_column(tier=_tier_three()))
    if kind == "missing column":
        return write_npz(p, {c: v for c, v in good_columns().items() if c != "hit"})
    if kind == "member is not .npy":
        return write_npz(p, with_column(seq=b"garbage"))
    if kind == "bzip2 member":
        return write_npz(p, good_columns(), zipfile.ZIP_BZIP2)
    if kind == "not a zip":
        open(p, "w").write("hello, not a zip\n")
        return p
    if kind == "empty file":
        open(p, "w").close()
        return p
    if kind == "truncated zip":
        write_npz(p, good_columns())
        data = open(p, "rb").read()
        open(p, "wb").write(data[:len(data) // 2])
        return p
    if kind == "a directory":
        os.mkdir(p)
        return p
    if kind == "missing file":
        return p
    raise AssertionError(kind)


BAD_FILES = {  # kind -> what the message must say besides the file's name
    "0-d columns": "column 't' is 0-d",
    "2-d column": "column 'block' is 2-d",
    "huge declared shape": f"declares 10,000,000,000 rows; the limit is {MAX_TRACE_ROWS:,}",
    "header lies about rows": "declares 1,000,000 rows of float64",
    "zip entry lies about its size": "more than the compression can give",
    "object column": "column 'seq' has dtype object",
    "complex times": "column 't' has dtype complex128",
    "string blocks": "column 'block' has dtype <U",
    "float blocks": "column 'block' has dtype float64; expected integers",
    "integer hits": "column 'hit' has dtype int64; expected booleans",
    "columns of different lengths": "different lengths (t 100, seq 100, block 50",
    "nan time": "not a finite number (nan at row 3)",
    "inf time": "not a finite number (inf at row 3)",
    "negative block serial": "block serial -7 at row 5",
    "tier not 0 or 1": "column 'tier' has 3 at row 5",
    "missing column": "no column 'hit'",
    "member is not .npy": "column 'seq' is not a readable .npy array",
    "bzip2 member": "compression method 12",
    "not a zip": "not an .npz (zip) file",
    "empty file": "the file is empty",
    "truncated zip": "not an .npz (zip) file",
    "a directory": "is a directory, not a regular file",
    "missing file": "No such file",
}


def assert_one_error_line(err: str, needle: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("kvscope policy-lab: error: ") and needle in lines[0], err


@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_a_bad_trace_file_gets_one_clear_error(kind, tmp_path, capsys):
    from app.cli import main as cli_main

    path = make_bad(kind, tmp_path / "bad.npz")
    with pytest.raises(ValueError) as e:
        AccessTrace.load(path)
    assert str(e.value).startswith(f"{path}: ") and BAD_FILES[kind] in str(e.value)
    capsys.readouterr()
    assert cli_main(["policy-lab", path]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert_one_error_line(err, f"{path}: ")
    assert BAD_FILES[kind] in err


def test_a_huge_declared_shape_is_refused_from_its_header_alone(tmp_path, monkeypatch):
    path = make_bad("huge declared shape", tmp_path / "huge.npz")

    def no(*a, **k):
        raise AssertionError("read array data")

    for name in ("empty", "zeros", "load", "frombuffer", "fromfile"):
        monkeypatch.setattr(np, name, no)
    monkeypatch.setattr(np.lib.format, "read_array", no)
    start = time.perf_counter()
    with pytest.raises(ValueError, match="the limit is"):
        AccessTrace.load(path)
    assert time.perf_counter() - start < 1.0


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")
def test_a_small_zip_bomb_keeps_memory_small(tmp_path):
    """2 MB of deflated zeros that a .npy header honestly calls 60 million float64 times (480 MB): refused
    by the row limit before any data is read; a subprocess's peak RSS stays near the interpreter's own."""
    rows = 60_000_000
    assert rows > MAX_TRACE_ROWS
    path = str(tmp_path / "bomb.npz")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        with z.open("t.npy", "w", force_zip64=True) as m:
            m.write(npy_header("<f8", (rows,)))
            zeros, left = bytes(1 << 24), rows * 8
            while left:
                m.write(zeros[:min(left, len(zeros))])
                left -= min(left, len(zeros))
        for c, v in good_columns().items():
            if c != "t":
                z.writestr(c + ".npy", npy(v))
    assert os.path.getsize(path) < 3_000_000
    # VmHWM, the peak RSS of this process image: ru_maxrss would carry over the forking pytest's peak.
    code = ("import sys\nfrom app.whatif.policy_lab import main\nrc = main([sys.argv[1]])\n"
            "hwm = [ln for ln in open('/proc/self/status') if ln.startswith('VmHWM:')][0].split()[1]\n"
            "print(rc, hwm)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=120, cwd=root)
    rc, rss_kb = map(int, out.stdout.split())
    assert rss_kb < 300_000, f"peak RSS {rss_kb / 1024:.0f} MB"
    assert rc == 2 and "the limit is" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_load_accepts_other_int_and_float_widths_and_returns_the_labs_dtypes(tmp_path):
    n = 50
    cols = dict(t=np.arange(n, dtype=">f4"), seq=np.arange(n, dtype=">i8"), block=np.arange(n, dtype=np.uint32),
                tier=np.ones(n, np.int64), hit=np.zeros(n, bool))
    path = write_npz(tmp_path / "w.npz", {**cols, "notes": np.zeros(3)}, zipfile.ZIP_STORED)  # extras are ignored
    tr = AccessTrace.load(path)
    assert (tr.t.dtype, tr.block.dtype, tr.tier.dtype, tr.hit.dtype) == (np.float64, np.int64, np.int8, np.bool_)
    assert tr.seq.dtype.isnative and tr.seq.dtype.kind == "i"
    for c in cols:
        assert np.array_equal(getattr(tr, c), cols[c])
    saved = tmp_path / "s.npz"
    trace_of([1, 1, 2], [4, 5, 4]).save(str(saved))
    back = AccessTrace.load(str(saved))
    assert back.block.tolist() == [4, 5, 4] and back.seq.dtype == np.int32


BAD_ARGS = [  # arguments after the trace -> what the one error line must say
    (["--capacity", "0"], "--capacity must be a number of blocks from 1 to 50,000,000, got 0"),
    (["--capacity", "4", "-1"], "--capacity must be a number of blocks from 1 to 50,000,000, got -1"),
    (["--capacity", str(10 ** 30)], f"--capacity must be a number of blocks from 1 to 50,000,000, got {10 ** 30}"),
    (["--decay", "0"], "--decay must be in (0, 1] (heat kept per second), got 0.0"),
    (["--decay", "2"], "--decay must be in (0, 1] (heat kept per second), got 2.0"),
    (["--decay", "nan"], "--decay must be in (0, 1] (heat kept per second), got nan"),
    (["--decay", "0.9", "inf"], "--decay must be in (0, 1] (heat kept per second), got inf"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--plot", "/nonexistent-kvscope-dir/f.png"], "--plot /nonexistent-kvscope-dir/f.png: no such folder"),
]


@pytest.mark.parametrize("extra,needle", BAD_ARGS, ids=[" ".join(a)[:24] for a, _ in BAD_ARGS])
def test_bad_numbers_get_one_line_naming_the_flag_and_its_range(extra, needle, capsys):
    from app.cli import main as cli_main

    assert cli_main(["policy-lab", "--synthetic", "scan", *extra]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert_one_error_line(err, needle)


def test_a_trace_with_no_rows_gets_one_error_line(tmp_path, capsys):
    from app.cli import main as cli_main

    path = write_npz(tmp_path / "empty.npz", {c: v[:0] for c, v in good_columns().items()})
    assert len(AccessTrace.load(path)) == 0
    assert cli_main(["policy-lab", path]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert_one_error_line(err, f"{path}: the trace is empty")


@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_time_prints_seconds_per_policy_and_the_load(backend, capsys):
    """`policy-lab --time N`: the three curves of a synthetic N-access trace, timed (the seconds are printed, not
    judged), on the backend asked for; the JSON says which ran and how many capacities each curve has."""
    assert main(["--time", "4000", "--backend", backend, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["backend"] == backend and doc["accesses"] == 4000 and 0 < doc["distinct"] <= 2000
    assert set(doc["seconds"]) == {"lru", "heat", "s3fifo"} and all(s >= 0 for s in doc["seconds"].values())
    assert doc["points"]["lru"] >= 32 and doc["points"]["heat"] == doc["points"]["s3fifo"] == 32
    assert len(doc["load_before"]) == 3
    assert main(["--time", "3000"]) == 0
    out = capsys.readouterr().out
    assert "3,000 accesses" in out and "load average" in out and " s  " in out
    assert main(["--time", "0"]) == 2
    assert "--time must be" in capsys.readouterr().err
