"""KV-cache groups (issue 21 item 3): a pool per attention type, sliding-window groups that let go of blocks leaving
every window, prefix reuse across groups as vLLM's hybrid manager has it, and the engine's operations per group.
Ground truth: transformers' fp32 greedy `generate` (its Gemma 3 cache is a sliding-window one too), and the same
engine with one pool for every layer (--kv-groups off) where both keep the same keys."""

from __future__ import annotations

import numpy as np
import pytest

from tiny_models import Reference, prompts
from grouped_runs import a_repeated_prefix, follow_a_window_table, held_at_the_first_token
from engine.config import CacheConfig, ConfigError, EngineOptions
from engine.kv.block_pool import blocks_for
from engine.kv.groups import KVGroupSpec, kv_groups, split_config
from engine.kv.tiers import Tier
from engine.model.loader import load_model
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams

SP = SamplingParams(max_new_tokens=12, ignore_eos=True)
W = 24  # tiny_gemma3's window


@pytest.fixture(scope="module")
def gemma3(tiny_gemma3):
    return load_model(tiny_gemma3), Reference(tiny_gemma3)


# -- the groups ---------------------------------------------------------------------------------------------------


def test_groups_follow_the_layers_attention(gemma3, tiny_qwen3_sliding, tiny_llama):
    model, _ = gemma3
    g = kv_groups(model.spec)
    assert g == (KVGroupSpec((2,), None), KVGroupSpec((0, 1, 3, 4), W))
    assert [x.title for x in g] == ["full attention · 1 layer", "sliding window 24 · 4 layers"]
    assert kv_groups(model.spec, "off") == (KVGroupSpec((0, 1, 2, 3, 4), None),)
    assert kv_groups(load_model(tiny_qwen3_sliding).spec) == (KVGroupSpec((0,), None), KVGroupSpec((1, 2), 24))
    assert len(kv_groups(load_model(tiny_llama).spec)) == 1
    eng = Engine(model, CacheConfig(block_size=8))
    assert eng.grouped and [p.geom.layers for p in eng.kv.pools] == [1, 4]
    assert not Engine(model, CacheConfig(block_size=8), EngineOptions(kv_groups="off")).grouped
    with pytest.raises(ConfigError, match="kv_groups"):
        EngineOptions(kv_groups="on").validate()


def test_budgets_split_by_what_a_sequence_holds_in_each_group(gemma3):
    """By bytes per sequence at the context limit; a window group's device share at least one sequence's window and
    chunk (as far as its layers' share allows); the full group at least its layers' share."""
    model, _ = gemma3
    s = model.spec
    groups = kv_groups(s)
    split = lambda cfg, context, chunk: split_config(cfg, groups, context, chunk, s.num_kv_heads, s.head_dim)  # noqa
    cfg = CacheConfig(device_budget_mb=100.0, host_budget_mb=50.0)
    for context, chunk in ((200, 1024), (10_000, 64)):
        parts = split(cfg, context, chunk)
        weights = np.array([1 * min(context, context), 4 * min(context, W - 1 + chunk)], dtype=float)
        assert sum(p.device_budget_mb for p in parts) == pytest.approx(100.0)
        assert sum(p.host_budget_mb for p in parts) == pytest.approx(50.0)
        assert [p.device_budget_mb / 100.0 for p in parts] == pytest.approx(list(weights / weights.sum()))
        assert [p.host_budget_mb / 50.0 for p in parts] == pytest.approx(list(weights / weights.sum()))
    # A long context limit and a small budget: the window group still gets one sequence's window and chunk.
    small = CacheConfig(block_size=16, device_budget_mb=0.5, host_budget_mb=0.0)
    parts = split(small, 100_000, 64)
    window_blocks = blocks_for(W - 1 + 64, 16) + 1
    from engine.kv.block_pool import BlockPool, RESERVED

    block_mb = BlockPool.bytes_per_block(small, 4, s.num_kv_heads, s.head_dim) / 2**20
    assert parts[1].device_budget_mb == pytest.approx((window_blocks + RESERVED) * block_mb)
    assert parts[0].device_budget_mb >= 0.5 * 1 / 5 and sum(p.device_budget_mb for p in parts) == pytest.approx(0.5)
    # ...never more than its layers' share.
    tiny = small.replace(device_budget_mb=0.05)
    assert split(tiny, 100_000, 64)[1].device_budget_mb == pytest.approx(0.05 * 4 / 5)
    eng = Engine(model, cfg, EngineOptions(context_limit=400, max_batched_tokens=64))
    want = split(cfg, 400, 64)
    assert [p.config.device_budget_mb for p in eng.kv.pools] == pytest.approx([w.device_budget_mb for w in want])


def test_a_request_one_pool_holds_is_held_with_groups(gemma3):
    """The context limit far past the request and the window (the model's 512; chunks of 32), a device tier that
    holds the request in one pool with little room to spare: admitted and exact with groups too (split by bytes at
    the context limit alone, the window group got 2 of the 5 blocks one sequence's window and chunk take)."""
    model, ref = gemma3
    p = prompts(47, [150])[0]
    from tiny_models import _mb

    cfg = CacheConfig(block_size=16, device_budget_mb=_mb(model, blocks_for(150 + 8, 16) + 3, 16), host_budget_mb=0.0)
    for mode in ("off", "auto"):
        eng = Engine(model, cfg, EngineOptions(kv_groups=mode, max_batched_tokens=32))
        assert eng.generate([p], SamplingParams(max_new_tokens=8, ignore_eos=True)) == [ref.greedy(p, 8)]


# -- a window group lets go of what left the window ---------------------------------------------------------------


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_window_tables_hold_only_the_window_and_tokens_equal_transformers(gemma3, bs):
    model, ref = gemma3
    p = prompts(41, [150])[0]
    eng, seq = follow_a_window_table(model, p, bs, W, lambda seq: seq.groups[0])
    assert seq.output == ref.greedy(p, 20)
    assert eng.kv.pools[1].tiers[Tier.DEVICE].used + eng.kv.pools[1].tiers[Tier.HOST].used > 0  # cached for reuse


def test_kv_bytes_held_fall_with_groups_and_the_tokens_stay(gemma3):
    """At the end of a 400-token prompt: one pool holds 5 layers x 400 tokens; the groups 1 x 400 and 4 x (the
    window and a block)."""
    model, ref = gemma3
    p = prompts(42, [400])[0]
    out, held = held_at_the_first_token(model, p)
    assert out["auto"] == out["off"] == ref.greedy(p, 4)
    per_layer_token = held["off"] / (5 * blocks_for(401, 8) * 8)
    assert held["auto"] <= per_layer_token * (1 * blocks_for(401, 8) * 8 + 4 * (blocks_for(W, 8) + 1) * 8)
    assert held["auto"] / held["off"] < 0.4


# -- prefix reuse across groups -----------------------------------------------------------------------------------


def test_a_prefix_hit_needs_the_full_prefix_and_only_the_last_window(gemma3):
    model, ref = gemma3
    bs = 4
    p = prompts(43, [90])[0]
    eng, seq, match, hashes, first = a_repeated_prefix(model, p, bs, W, group=1)
    n = len(match)
    # Window blocks before the last window are not needed: dropping them keeps the hit.
    wpool = eng.kv.pools[1]
    keep = set(match.window[1])
    for t in wpool.tiers:
        for s in t.cached.view().copy().tolist():
            if int(t.lid[s]) not in keep:
                wpool._release(int(t.lid[s]))
    assert len(eng.kv.find_prefix(seq)[0]) == n
    # One block of the last window gone: the hit shortens to where the window group still holds a window.
    wpool._release(match.window[1][-1])
    shorter = eng.kv.find_prefix(seq)[0]
    assert len(shorter) < n
    for _ in range(40):
        eng.step()
    assert seq.done and seq.output == ref.greedy(p, SP.max_new_tokens)
    assert seq.prefix_reused == len(shorter) * bs
    eng.check_invariants()


# -- operations per group -----------------------------------------------------------------------------------------


def test_forks_and_tail_removal_on_groups_equal_one_pool(gemma3):
    """seq_cp (copy-on-write in both groups) and seq_rm of the last tokens keep every key either layout keeps: the
    grouped engine gives one pool's tokens."""
    model, _ = gemma3
    p = prompts(44, [70])[0]

    def play(mode: str) -> list[list[int]]:
        eng = Engine(model, CacheConfig(block_size=4, device_budget_mb=1.0, host_budget_mb=1.0),
                     EngineOptions(kv_groups=mode))
        sid = eng.add_request(p, SamplingParams(max_new_tokens=30, ignore_eos=True))
        for _ in range(6):
            eng.step()
        fork = eng.seq_cp(sid)
        for _ in range(4):
            eng.step()
        n = len(eng.seqs[sid].tokens)
        eng.seq_rm(sid, n - 3)
        while not all(eng.seqs[s].done for s in (sid, fork)):
            eng.step()
            eng.check_invariants()
        return [eng.seqs[sid].output, eng.seqs[fork].output]

    assert play("auto") == play("off")


def test_live_block_size_and_dtype_changes_re_lay_every_group(gemma3):
    model, ref = gemma3
    p = prompts(45, [100, 37])
    eng = Engine(model, CacheConfig(block_size=16), EngineOptions(max_batched_tokens=32))
    ids = [eng.add_request(x, SamplingParams(max_new_tokens=16, ignore_eos=True)) for x in p]
    plan = [{"block_size": 5}, {"kv_dtype": "fp16"}, {"kv_dtype": "fp32"}, {"block_size": 1}, {"block_size": 16}]
    for change in plan:
        for _ in range(3):
            eng.step()
        eng.reconfigure(**change)
        eng.check_invariants()
        assert [pl.config.block_size for pl in eng.kv.pools] == [eng.config.block_size] * 2
        assert eng.kv.pools[1].config.kv_dtype == eng.config.kv_dtype
    while not all(eng.seqs[i].done for i in ids):
        eng.step()
    # fp16 storage rounds the keys once: compare with transformers only the run that stays fp32.
    eng2 = Engine(model, CacheConfig(block_size=16), EngineOptions(max_batched_tokens=32))
    ids2 = [eng2.add_request(x, SamplingParams(max_new_tokens=16, ignore_eos=True)) for x in p]
    for bs in (5, 1, 3, 16):
        for _ in range(4):
            eng2.step()
        eng2.reconfigure(block_size=bs)
        eng2.check_invariants()
    while not all(eng2.seqs[i].done for i in ids2):
        eng2.step()
    assert [eng2.seqs[i].output for i in ids2] == [ref.greedy(x, 16) for x in p]


def test_a_refused_budget_leaves_every_group_as_it_was(gemma3):
    model, _ = gemma3
    eng = Engine(model, CacheConfig(block_size=4, device_budget_mb=8, host_budget_mb=8))
    sid = eng.add_request(prompts(46, [120])[0], SamplingParams(max_new_tokens=40, ignore_eos=True))
    for _ in range(8):
        eng.step()
    before = [(pl.config.device_budget_mb, pl.tiers[0].capacity, pl.tiers[1].capacity) for pl in eng.kv.pools]
    with pytest.raises(ConfigError):
        eng.reconfigure(device_budget_mb=0.0, host_budget_mb=0.01)
    assert [(pl.config.device_budget_mb, pl.tiers[0].capacity, pl.tiers[1].capacity) for pl in eng.kv.pools] == before
    eng.reconfigure(device_budget_mb=4.0)
    assert [pl.config.device_budget_mb for pl in eng.kv.pools] == pytest.approx(
        [c.device_budget_mb for c in eng.kv.configs(eng.config)])
    while not eng.seqs[sid].done:
        eng.step()
    eng.check_invariants()


# -- what a snapshot says about the groups ------------------------------------------------------------------------


def test_snapshots_carry_each_group_and_reopen_as_saved(gemma3, tmp_path):
    from engine.telemetry import snapshot_io

    model, _ = gemma3
    eng = Engine(model, CacheConfig(block_size=4, device_budget_mb=1.0, host_budget_mb=1.0))
    eng.generate(prompts(48, [60, 30]), SamplingParams(max_new_tokens=6, ignore_eos=True))
    snap = eng.snapshot()
    full, window = snap.kv_groups
    assert (full["title"], window["title"]) == ("full attention · 1 layer", "sliding window 24 · 4 layers")
    assert full["tiers"] is snap.tiers and window["layers"] == [0, 1, 3, 4] and window["window"] == W
    wpool = eng.kv.pools[1]
    assert [t.capacity for t in window["tiers"]] == [t.capacity for t in wpool.tiers]
    assert [t.used for t in window["tiers"]] == [t.used for t in wpool.tiers]
    assert [g["device_budget_mb"] for g in snap.kv_groups] == pytest.approx([p.config.device_budget_mb
                                                                             for p in eng.kv.pools])
    assert snap.config["device_budget_mb"] == 1.0  # the engine's budgets (each pool has its share)
    # Key reads per group add up to the engine's; the window group reads fewer keys than the full one.
    c = eng.counters
    assert sum(g["read_tokens"] for g in snap.kv_groups) == c.read_tokens
    assert sum(g["read_tokens_missed"] for g in snap.kv_groups) == c.read_tokens_missed
    assert 0 < window["read_tokens"] < 4 * full["read_tokens"]
    # Memory: every pool's blocks, summed; each group's apart.
    used = sum(p.tiers[0].used for p in eng.kv.pools)
    assert snap.memory["tiers"]["device"]["used_blocks"] == used
    assert [g["tiers"]["device"]["used_blocks"] for g in snap.memory["groups"]] == [p.tiers[0].used
                                                                                   for p in eng.kv.pools]
    path = tmp_path / "g.json"
    snapshot_io.save(str(path), snap)
    back, _ = snapshot_io.load(str(path))
    assert [g["title"] for g in back.kv_groups] == [g["title"] for g in snap.kv_groups]
    for a, b in zip(back.kv_groups[1]["tiers"], window["tiers"]):
        assert np.array_equal(a.state, b.state) and np.array_equal(a.ref, b.ref) and a.capacity == b.capacity
    # One pool: no groups, and a file without them opens with none.
    one = Engine(model, CacheConfig(block_size=4), EngineOptions(kv_groups="off")).snapshot()
    assert one.kv_groups == ()
    snapshot_io.save(str(path), one)
    assert snapshot_io.load(str(path))[0].kv_groups == ()
