"""Miss-ratio curves (engine/lab/mrc.py): Mattson's LRU curve against brute-force LRU, SHARDS against the full
simulators, the demotion-threshold curve against a by-hand simulation, the what-if sentence."""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.kv.eviction_sim import replay
from engine.lab import mrc
from engine.lab.mrc import (MIN_CURVE_POINTS, Curve, curve_capacities, lru_curve, replay_hits, sampled_curve,
                            stack_distances, what_if_line, what_if_short)
from engine.lab.whatif import Stream, threshold_curve

# Every curve test runs on both paths: the numba-compiled loops (engine/lab/mrc_jit.py) and the numpy / Python
# fallback. numba is a dependency, so a machine without it fails here rather than skipping the compiled path.
BACKENDS = ("numba", "numpy")


@contextmanager
def on(backend: str):
    old = mrc.set_backend(backend)
    try:
        yield
    finally:
        mrc.set_backend(old)


def brute_lru(keys, cap, counted=None, times=None, max_gap=np.inf):
    """A literal LRU cache of `cap` entries; hits over the counted accesses (a hit also needs the key's last
    access within max_gap seconds)."""
    cache: OrderedDict = OrderedDict()
    hits = total = 0
    for i, k in enumerate(keys):
        c = True if counted is None else bool(counted[i])
        t = i if times is None else times[i]
        hit = k in cache and t - cache[k] <= max_gap
        if k in cache:
            cache.move_to_end(k)
        elif len(cache) >= cap:
            cache.popitem(last=False)
        cache[k] = t
        if c:
            total += 1
            hits += hit
    return hits, total


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=80), st.data())
def test_lru_curve_equals_brute_force_at_every_capacity(backend, keys, data):
    with on(backend):
        _lru_curve_equals_brute_force(keys, data)


def _lru_curve_equals_brute_force(keys, data):
    keys = np.array(keys, dtype=np.int64)
    counted = np.array(data.draw(st.lists(st.booleans(), min_size=len(keys), max_size=len(keys))))
    if not counted.any():
        counted[0] = True
    caps = np.arange(1, 16)
    curve = lru_curve(keys, caps, counted)
    for cap, rate in zip(caps, curve.hit_rate):
        hits, total = brute_lru(keys.tolist(), int(cap), counted)
        assert rate == pytest.approx(hits / total), cap
    # and every access counted: the simulator the policy lab uses
    full = lru_curve(keys, caps)
    for cap, rate in zip(caps, full.hit_rate):
        assert rate * len(keys) == pytest.approx(replay(keys, int(cap), "lru")["hits"])


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-2**62, 2**62), min_size=0, max_size=60))
def test_stack_distance_is_the_distinct_keys_since_the_last_access(backend, keys):
    with on(backend):
        d = stack_distances(np.array(keys, dtype=np.int64))
    for i, k in enumerate(keys):
        before = [j for j in range(i) if keys[j] == k]
        expected = -1 if not before else len(set(keys[before[-1] + 1:i]))
        assert d[i] == expected


def test_capacities_are_at_least_32_and_reach_every_distinct_block():
    caps = curve_capacities(10_000)
    assert len(caps) >= MIN_CURVE_POINTS and caps[0] == 1 and caps[-1] == 10_000
    assert (np.diff(caps) > 0).all()
    assert curve_capacities(7).tolist() == list(range(1, 8))


def _zipf_trace(n=60_000, blocks=6_000, seed=3):
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, blocks + 1) ** 0.8
    return rng.choice(blocks, size=n, p=w / w.sum()).astype(np.int64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy", ["lru", "s3fifo", "heat"])
def test_shards_estimate_is_near_the_full_simulation(policy, backend):
    """SHARDS keeps ~4,096 of the 6,000 blocks here at the mid capacities, and one rate 0.68 the tail; the error
    of a hit rate estimated from a spatial sample of B blocks with heavy-tailed access counts is O(1/sqrt(B))
    (Waldspurger et al. report < 1 point mean absolute error at 8K samples); 5 points is about 3 standard errors
    at B ~ 4K. Fixed seed: the sample, and so the outcome, is the same every run."""
    keys = _zipf_trace()
    times = np.arange(len(keys)) * 0.01
    caps = [200, 800, 2_400]
    with on(backend):
        est = sampled_curve(keys, times, caps, policy, seed=0)
    assert not est.exact
    for cap, rate in zip(caps, est.hit_rate):
        full = replay(keys, cap, policy, times=times)["hit_rate"]
        assert abs(rate - full) <= 0.05, (cap, rate, full)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampled_curve_is_exact_when_nothing_is_sampled_away(backend):
    keys = _zipf_trace(n=3_000, blocks=300)
    caps = [10, 50, 150]
    with on(backend):
        est = sampled_curve(keys, None, caps, "s3fifo")
    assert est.exact
    assert est.hit_rate.tolist() == [replay(keys, c, "s3fifo")["hit_rate"] for c in caps]


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 8), min_size=1, max_size=50), st.integers(1, 8), st.floats(0.0, 0.3))
@example(keys=[0, 0, 0, 0, 0], cap=1, threshold=0.02)  # gaps on both sides of 0.02 by one rounding
def test_threshold_curve_equals_lru_with_idle_demotion(backend, keys, cap, threshold):
    times = np.arange(len(keys)) * 0.02
    s = Stream(np.array(keys, dtype=np.int64), times, np.ones(len(keys), dtype=bool), None, False)
    with on(backend):
        got = threshold_curve(s, cap, [threshold, np.inf])
    # The same float gaps compared the same way (t_i - t_j <= threshold): a gap one rounding past the threshold
    # (0.08 - 0.06 = 0.020000000000000004) is a miss on both sides, so no tolerance is needed, and none is given.
    hits, total = brute_lru(keys, cap, times=times.tolist(), max_gap=threshold)
    assert got[0] == pytest.approx(hits / total)
    assert got[1] == pytest.approx(brute_lru(keys, cap)[0] / len(keys))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-3, 12), min_size=1, max_size=300), st.integers(1, 12),
       st.sampled_from(["lru", "heat", "s3fifo"]), st.sampled_from([0.3, 0.9, 1.0]), st.data())
def test_compiled_simulators_equal_the_python_ones_access_for_access(keys, cap, policy, decay, data):
    """The numba simulators (mrc_jit.lru, heat, s3fifo) against eviction_sim's: the same hit or miss at every
    access, with times that tie (heat's tie-breaks: older second-to-last access, then insertion order)."""
    keys = np.array(keys, dtype=np.int64) * 1_000_003
    gaps = data.draw(st.lists(st.sampled_from([0.0, 0.01, 0.5, 3.0]), min_size=len(keys), max_size=len(keys)))
    times = np.cumsum(gaps)
    want = replay(keys, cap, policy, decay=decay, times=times, per_access=True)["hit"]
    with on("numba"):
        got = replay_hits(keys, cap, policy, decay, times)
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("policy", ["lru", "heat", "s3fifo"])
def test_compiled_simulators_equal_the_python_ones_on_random_traces(policy):
    """200 fixed random traces, each over fewer or more keys than the cache holds."""
    rng = np.random.default_rng(11)
    for _ in range(200):
        n, m, cap = int(rng.integers(1, 400)), int(rng.integers(1, 50)), int(rng.integers(1, 45))
        keys = rng.integers(0, m, n).astype(np.int64) * 7919 - 50
        times = np.cumsum(rng.choice([0.0, 0.01, 0.5], n))
        want = replay(keys, cap, policy, decay=0.9, times=times, per_access=True)["hit"]
        with on("numba"):
            got = replay_hits(keys, cap, policy, 0.9, times)
        assert got.tolist() == want.tolist(), (n, m, cap)


def test_compiled_heat_compacts_its_heap_without_changing_an_answer():
    """A long trace over a small cache: the heap outgrows 2 x capacity + 1024 entries many times over."""
    rng = np.random.default_rng(5)
    keys = rng.integers(0, 60, 20_000).astype(np.int64)
    times = np.cumsum(rng.choice([0.0, 0.02, 0.3], len(keys)))
    want = replay(keys, 7, "heat", decay=0.8, times=times, per_access=True)["hit"]
    with on("numba"):
        got = replay_hits(keys, 7, "heat", 0.8, times)
    assert (got == want).all() and 0 < want.sum() < len(keys)


def test_backend_is_named_or_refused():
    with pytest.raises(ValueError, match="numba"):
        mrc.set_backend("fortran")
    with on("numpy"):
        assert mrc.backend() == "numpy"


def test_what_if_line_reads_the_curve():
    c = Curve("lru", np.array([10, 20, 40, 80]), np.array([0.2, 0.5, 0.76, 0.9]), True)
    line = what_if_line(c, 20, block_mib=0.5)
    assert "at 2× the device budget: +26.0 points" in line
    assert "75 % needs ≈ 20.0 MiB" in line  # 40 blocks of 0.5 MiB
    assert "not reached" in what_if_line(Curve("lru", np.array([1, 2]), np.array([0.1, 0.2]), True), 1)
    assert what_if_short(c, 20, block_mib=0.5) == "lru: 50.0 % now · 2× budget: +26.0 pts · 75 % needs ≈ 20.0 MiB"
