"""Eviction order of each policy on small hand-made pools (one-token blocks, no host tier: victims are dropped)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv.block_pool import BlockPool
from engine.config import CacheConfig
from engine.kv.eviction import LRU, S3FIFO, Heat, make_policy, s3fifo_sizes
from engine.kv.tiers import Tier
from pools import cached_block, lid_of, make_pool, new_block, read

def resident(pool: BlockPool, keys) -> list[bool]:
    return [lid_of(pool, k) is not None and bool(pool.tier[lid_of(pool, k)] == Tier.DEVICE) for k in keys]


def evicted_by(pool: BlockPool, n: int, now: float) -> list[int]:
    """The keys of the blocks one eviction of n drops, in the policy's order."""
    pool.take_events()
    assert pool.evict(Tier.DEVICE, n, now) == n
    out = [e.fields["hash"] - 1 for e in pool.take_events() if e.kind == "evict"]
    assert not any(resident(pool, out))
    return out


def test_make_policy_names():
    assert isinstance(make_policy("lru", 0.9), LRU)
    assert isinstance(make_policy("heat", 0.9), Heat)
    assert isinstance(make_policy("s3fifo", 0.9), S3FIFO)
    with pytest.raises(ValueError):
        make_policy("arc", 0.9)


# -- LRU and heat -------------------------------------------------------------------------------------

def test_lru_evicts_least_recently_used():
    pool = make_pool(4, "lru")
    a, b, c, d = (cached_block(pool, k, float(k)) for k in range(4))
    read(pool, a, 5.0)  # a is now the most recent; b the least
    read(pool, c, 6.0)
    assert evicted_by(pool, 1, 7.0) == [b]
    assert evicted_by(pool, 2, 7.0) == [d, a]


def heat_vs_recency_pool(policy: str) -> tuple[BlockPool, int, int]:
    """`old` was read 20 times around t=0-1 s; `new` once at t=9.5 s. At t=10 s, with decay 0.9/s:
    old's heat is about 20*0.9^9 = 7.7, new's about 2*0.9^0.5 = 1.9. Recency says evict old, heat says new."""
    pool = make_pool(2, policy, decay=0.9)
    lid = new_block(pool, 0, 0.0)
    for i in range(1, 20):
        pool.touch(np.array([lid]), i * 0.05)
    pool.decref(lid)
    cached_block(pool, 1, 9.5)
    return pool, 0, 1


def test_heat_evicts_lowest_decayed_heat_not_least_recent():
    pool, old, new = heat_vs_recency_pool("heat")
    heat = pool.current_heat(pool.tiers[0], pool.slot[[lid_of(pool, old), lid_of(pool, new)]], 10.0)
    assert heat[0] > 5.0 > 2.0 > heat[1]
    assert evicted_by(pool, 1, 10.0) == [new]
    pool, old, new = heat_vs_recency_pool("lru")  # the same state under LRU: the other block goes
    assert evicted_by(pool, 1, 10.0) == [old]


def test_heat_decays_so_a_long_idle_hot_block_goes_eventually():
    pool, old, new = heat_vs_recency_pool("heat")
    read(pool, new, 40.0)  # at t=45: old 20*0.9^44 ~ 0.2; new 2.6*0.9^5 ~ 1.6
    assert evicted_by(pool, 1, 45.0) == [old]


def test_heat_ties_go_to_the_older_second_to_last_access():
    # decay 1: heat counts reads. a: t0, t3; b: t1, t2. Equal heat; a's second-to-last read (t0) is older.
    pool = make_pool(2, "heat", decay=1.0)
    a = cached_block(pool, 0, 0.0)
    b = cached_block(pool, 1, 1.0)
    read(pool, b, 2.0)
    read(pool, a, 3.0)
    h = pool.current_heat(pool.tiers[0], pool.slot[[lid_of(pool, a), lid_of(pool, b)]], 4.0)
    assert h[0] == h[1]
    assert evicted_by(pool, 1, 4.0) == [a]  # LRU would take b (last read at t2)


# -- S3-FIFO ------------------------------------------------------------------------------------------

def queue_of(pool: BlockPool, key: int) -> int:
    """1: small queue, 2: main queue (of the block's current tier)."""
    lid = lid_of(pool, key)
    return int(pool.policy.queues(pool.tiers[pool.tier[lid]])[pool.slot[lid]])


def test_s3fifo_evicts_a_one_hit_block_before_an_older_reused_one():
    pool = make_pool(10, "s3fifo")
    a = cached_block(pool, 0, 0.0)
    read(pool, a, 1.0)  # a is reused while in the small queue
    b = cached_block(pool, 1, 2.0)
    c = cached_block(pool, 2, 3.0)
    assert queue_of(pool, a) == queue_of(pool, b) == 1
    # FIFO and LRU would both take a (the oldest, last read before b and c arrived).
    assert evicted_by(pool, 1, 4.0) == [b]
    assert queue_of(pool, a) == 2  # a moved to the main queue on its way out of the small one
    assert evicted_by(pool, 1, 4.0) == [c]


def test_s3fifo_counts_reads_by_other_sequences_not_the_writers_own():
    # A system-prompt block shared by a second sequence while its writer runs; then a long document's block
    # that its own sequence reads at every one of 30 decode steps. The document's block is the one-hit block.
    pool = make_pool(10, "s3fifo")
    shared = new_block(pool, 0, 0.0)
    pool.incref(shared)  # a second request finds it by hash
    pool.touch(np.array([shared]), 0.5)
    pool.decref(shared)
    pool.decref(shared)
    doc = new_block(pool, 1, 1.0)
    for step in range(30):
        pool.touch(np.array([doc]), 1.0 + 0.1 * step)
    pool.decref(doc)
    cached_block(pool, 2, 5.0)
    assert evicted_by(pool, 1, 6.0) == [1]  # LRU would take 0 (last read at 0.5), heat too (doc's heat ~9)
    assert queue_of(pool, 0) == 2


def hot_then_scan(policy: str, n_hot: int = 5, n_scan: int = 50) -> tuple[BlockPool, list[int]]:
    pool = make_pool(10, policy)
    hot = [cached_block(pool, k, 0.1 * k) for k in range(n_hot)]
    for k in hot:
        read(pool, k, 1.0)
    for i in range(n_scan):  # a long document: one-hit blocks, each released after its step
        cached_block(pool, 1000 + i, 2.0 + 0.1 * i)
    return pool, hot


@pytest.mark.parametrize("n_scan", [10, 50, 500])
def test_s3fifo_scan_of_one_hit_blocks_does_not_evict_main_queue_blocks(n_scan):
    pool, hot = hot_then_scan("s3fifo", n_scan=n_scan)
    assert all(resident(pool, hot))
    assert [queue_of(pool, k) for k in hot] == [2] * len(hot)
    pool, hot = hot_then_scan("lru", n_scan=n_scan)  # the same workload flushes LRU
    assert not any(resident(pool, hot))


def test_s3fifo_ghost_sends_a_recently_evicted_block_to_main():
    pool = make_pool(10, "s3fifo")
    x = cached_block(pool, 7, 0.0)
    for i in range(10):
        cached_block(pool, 100 + i, 1.0 + i)
    assert resident(pool, [x]) == [False]  # read once: left through the small queue, its hash is in the ghost
    cached_block(pool, x, 20.0)  # the same tokens again (recomputed): a new block with x's hash
    y = cached_block(pool, 8, 20.5)  # a block never seen before
    assert queue_of(pool, x) == 2 and queue_of(pool, y) == 1
    for i in range(10):
        cached_block(pool, 200 + i, 21.0 + i)
    assert resident(pool, [x, y]) == [True, False]


def test_s3fifo_main_queue_gives_a_second_chance():
    # All ten blocks reused: the small queue hands them all to main, where each has freq 1. A pass
    # over main decrements them all and the head (block 0) goes.
    pool = make_pool(10, "s3fifo")
    blocks = [cached_block(pool, k, float(k)) for k in range(10)]
    for k in blocks:
        read(pool, k, 10.0)
    assert evicted_by(pool, 1, 11.0) == [0]
    assert [queue_of(pool, k) for k in blocks[1:]] == [2] * 9
    read(pool, 2, 12.0)  # block 2 gets a second chance; 1 is next in line, then 3
    assert evicted_by(pool, 2, 13.0) == [1, 3]
    assert evicted_by(pool, 1, 13.0) == [4]


def test_s3fifo_owned_blocks_are_never_victims_and_keep_their_place():
    pool = make_pool(6, "s3fifo")
    new_block(pool, 0, 0.0)  # the oldest block, never released
    rest = [cached_block(pool, k, float(k)) for k in range(1, 6)]
    for i in range(20):
        cached_block(pool, 100 + i, 10.0 + i)
    assert resident(pool, [0]) == [True] and queue_of(pool, 0) == 1
    assert not any(resident(pool, rest))


def test_s3fifo_state_follows_blocks_across_tiers():
    pool = make_pool(4, "s3fifo", host=4)
    a = cached_block(pool, 0, 0.0)
    read(pool, a, 0.5)
    b = cached_block(pool, 1, 1.0)
    c = cached_block(pool, 2, 2.0)
    pool.evict(Tier.DEVICE, 1, 3.0)  # a moves to main; b (read once) is demoted to the host tier
    assert pool.tier[lid_of(pool, b)] == Tier.HOST and resident(pool, [a]) == [True] and queue_of(pool, a) == 2
    assert queue_of(pool, b) == 1
    pool.move(np.array([lid_of(pool, a)]), Tier.HOST, 4.0, reason="test")
    assert queue_of(pool, a) == 2  # still main, now on the host
    pool.move(np.array([lid_of(pool, b)]), Tier.DEVICE, 5.0, reason="test")
    assert queue_of(pool, b) == 2  # its hash is in the device's ghost: it comes back to main
    assert queue_of(pool, c) == 1


def test_s3fifo_a_main_pass_sends_blocks_behind_owned_ones_and_leaves_the_rest_in_place():
    # Main holds, head first: x (freq 1), a (0), c (0), o (owned), all placed by hand. One eviction: x gets
    # its second chance (to the tail, behind o), a goes, c was not reached and stays ahead of o.
    pool = make_pool(8, "s3fifo")
    x, a, c = (cached_block(pool, k, float(k)) for k in range(3))
    o = new_block(pool, 3, 3.0)
    tier = pool.tiers[Tier.DEVICE]
    state = pool.policy._state(tier)
    slots = pool.slot[[lid_of(pool, k) for k in (x, a, c, 3)]]
    state.in_main[slots] = True
    state.freq[slots] = [1, 0, 0, 0]
    state.pos[slots] = [-4, -3, -2, -1]  # ahead of anything the policy numbers itself
    assert evicted_by(pool, 1, 5.0) == [a]
    main = sorted(np.flatnonzero(pool.policy.queues(tier) == 2), key=lambda s: state.pos[s])
    assert [int(pool.hash_of(tier.lid[s])) - 1 for s in main] == [c, 3, x]
    assert state.freq[pool.slot[lid_of(pool, x)]] == 0
    pool.decref(o)
    assert evicted_by(pool, 2, 6.0) == [c, 3]


def test_s3fifo_switched_on_at_run_time_takes_over_existing_blocks():
    pool = make_pool(8, "lru")
    keys = [cached_block(pool, k, float(k)) for k in range(8)]
    pool.policy = make_policy("s3fifo", 0.9)
    assert evicted_by(pool, 3, 9.0) == keys[:3]  # everything starts in the small queue, oldest first


# Random pools, some blocks held by a sequence: a batch of n victims is exactly n single evictions.

def build(policy: str, cap: int, keys: list[int], pinned: set[int], host: int = 0,
          batch: int = 1) -> tuple[BlockPool, dict[int, int]]:
    """A pool after reading `keys` in turn (a miss makes the block); `pinned` keys stay owned.
    Returns the pool and the lid -> owner count map that BlockPool.check expects."""
    pool = make_pool(cap, policy, host=host, evict_batch=batch)
    owners: dict[int, int] = {}
    for i, k in enumerate(keys):
        now = 0.01 * i
        lid = lid_of(pool, k)
        if lid is not None and k in pinned:
            pool.touch(np.array([lid]), now)
        elif lid is not None:
            read(pool, k, now)
        elif k in pinned:
            owners[new_block(pool, k, now)] = 1
        else:
            cached_block(pool, k, now)
    return pool, owners


def queue_snapshot(pool: BlockPool, tier) -> tuple:
    """Each queue's slots in order, freqs, and the ghost: what future decisions depend on."""
    st = pool.policy._state(tier)
    q = pool.policy.queues(tier)
    order = lambda which: [int(s) for s in sorted(np.flatnonzero(q == which), key=lambda s: st.pos[s])]  # noqa: E731
    return order(1), order(2), st.freq.tolist(), list(st.ghost)


@settings(max_examples=150, deadline=None)
@given(cap=st.integers(2, 24), keys=st.lists(st.integers(0, 40), min_size=1, max_size=120),
       pinned=st.sets(st.integers(0, 40), max_size=3), n=st.integers(1, 24), host=st.sampled_from([0, 5]))
def test_s3fifo_batch_equals_single_evictions(cap, keys, pinned, n, host):
    pinned = {k for k in pinned if k in keys[: cap // 2]}
    a, _ = build("s3fifo", cap, keys, pinned, host)
    b, _ = build("s3fifo", cap, keys, pinned, host)
    ta, tb = a.tiers[Tier.DEVICE], b.tiers[Tier.DEVICE]
    cand = ta.cached.view().copy()
    assert np.array_equal(cand, tb.cached.view())
    n = min(n, len(cand))
    if n == 0:
        return
    batch = a.policy.victims(ta, cand.copy(), n, 9.0, a.config.decay)
    assert len(batch) == n and len(set(batch.tolist())) == n and set(batch.tolist()) <= set(cand.tolist())
    singles, left = [], cand.copy()
    for _ in range(n):
        v = b.policy.victims(tb, left.copy(), 1, 9.0, b.config.decay)
        singles.append(int(v[0]))
        left = left[left != v[0]]
    assert batch.tolist() == singles
    assert queue_snapshot(a, ta) == queue_snapshot(b, tb)


@settings(max_examples=60, deadline=None)
@given(cap=st.integers(2, 16), keys=st.lists(st.integers(0, 30), min_size=1, max_size=150),
       pinned=st.sets(st.integers(0, 30), max_size=3), host=st.sampled_from([0, 6]),
       batch=st.integers(1, 4), policy=st.sampled_from(["lru", "heat", "s3fifo"]))
def test_pool_invariants_hold_under_every_policy(cap, keys, pinned, host, batch, policy):
    pinned = {k for k in pinned if k in keys[: cap // 2]}
    pool, owners = build(policy, cap, keys, pinned, host, batch)
    pool.check(owners)
    if policy == "s3fifo":
        for t in pool.tiers:
            q = pool.policy.queues(t)
            assert np.array_equal(q > 0, t.lid >= 0)  # every block is in exactly one queue


def test_s3fifo_sizes():
    assert s3fifo_sizes(1) == (1, 1)
    assert s3fifo_sizes(100) == (10, 90)


# -- in the engine ------------------------------------------------------------------------------------

def test_engine_on_s3fifo_stays_exact_under_pressure(llama_model, llama_ref):
    """Prefix reuse, eviction, demotion and promotion with S3-FIFO choosing: tokens equal transformers'."""
    from tiny_models import prompts
    from engine.config import EngineOptions
    from engine.runtime.engine import Engine
    from engine.sequence import SamplingParams

    shared = prompts(7, [48])[0]
    waves = [[shared + p for p in prompts(8, [20, 9])] + prompts(9, [40, 25]),
             prompts(10, [50, 30]) + [shared + p for p in prompts(11, [14])]]
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    # 0.1 MB: 51 blocks of 4 tokens for the tiny model (0.04 MB host: 20); a wave needs ~90 at its peak.
    eng = Engine(llama_model, CacheConfig(block_size=4, device_budget_mb=0.1, host_budget_mb=0.04, policy="s3fifo"),
                 EngineOptions(max_batched_tokens=64))
    for ps in waves:
        assert eng.generate(ps, sp) == [llama_ref.greedy(p, 12) for p in ps]
        eng.check_invariants()
    c = eng.counters
    assert c.evictions > 0 and c.demotions > 0
    assert eng.seqs[max(eng.seqs)].prefix_reused >= 48  # the shared prefix survived the second wave's pressure
