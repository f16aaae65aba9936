"""A model whose every layer slides (Mistral, Phi-3): one KV-cache group, a window group, held in the sequence's own
table from its first visible block (Sequence.base), so its layers keep only the last window of keys as transformers'
sliding-window cache and llama.cpp's SWA cache do; with --kv-groups off the window is only a mask over every key.
Ground truth: transformers' fp32 greedy `generate`, and the one-pool engine where both keep the same keys."""

from __future__ import annotations

import numpy as np
import pytest

from tiny_models import Reference, prompts
from grouped_runs import a_repeated_prefix, follow_a_window_table, held_at_the_first_token
from engine.config import CacheConfig, ConfigError, EngineOptions
from engine.kv.block_pool import blocks_for
from engine.kv.groups import KVGroupSpec, kv_groups
from engine.kv.tiers import Tier
from engine.model.loader import load_model
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams

W = 24  # tiny_mistral's window
SP = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral(tiny_mistral):
    return load_model(tiny_mistral), Reference(tiny_mistral)


def test_every_layer_sliding_is_one_window_group(mistral):
    model, _ = mistral
    n = model.spec.num_layers
    assert kv_groups(model.spec) == (KVGroupSpec(tuple(range(n)), W),)
    assert kv_groups(model.spec)[0].title == f"sliding window 24 · {n} layers"
    eng = Engine(model, CacheConfig(block_size=8))
    assert eng.grouped and not eng.kv.full and len(eng.kv.pools) == 1
    off = Engine(model, CacheConfig(block_size=8), EngineOptions(kv_groups="off"))
    assert not off.grouped and off.kv_groups == (KVGroupSpec(tuple(range(n)), None),)


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_the_table_starts_at_the_window_and_tokens_equal_transformers(mistral, bs):
    model, ref = mistral
    p = prompts(61, [150])[0]

    def base_is_the_first_visible_block(seq):
        assert seq.base == seq.dropped // bs or len(seq.blocks) == 1

    _, seq = follow_a_window_table(model, p, bs, W, lambda seq: seq, also=base_is_the_first_visible_block)
    assert seq.output == ref.greedy(p, 20)
    assert not seq.blocks and seq.base == 0  # released whole


def test_kv_bytes_held_are_the_window_whatever_the_prompt(mistral):
    """At the end of a 400-token prompt one pool holds every layer x 400 tokens; the window group every layer x
    (the window and a block)."""
    model, ref = mistral
    p = prompts(62, [400])[0]
    out, held = held_at_the_first_token(model, p)
    assert out["auto"] == out["off"] == ref.greedy(p, 4)
    per_block = held["off"] / blocks_for(401, 8)
    assert held["auto"] <= per_block * (blocks_for(W, 8) + 1)
    assert held["auto"] / held["off"] < 0.1


def test_a_prefix_hit_needs_only_the_last_window(mistral):
    model, ref = mistral
    bs = 4
    p = prompts(63, [90])[0]
    eng, seq, match, hashes, first = a_repeated_prefix(model, p, bs, W, group=0)
    n = len(match)
    pool = eng.kv.pool
    pool._release(match.window[0][-1])  # the prefix's last block gone: the hit is one block shorter
    match, _ = eng.kv.find_prefix(seq)
    n -= 1
    assert len(match) == n and match.first[0] == max(0, n * bs - W + 1) // bs
    keep = set(match.window[0])
    for t in pool.tiers:  # blocks before its last window are not needed: dropping them keeps the hit
        for s in t.cached.view().copy().tolist():
            if int(t.lid[s]) not in keep:
                pool._release(int(t.lid[s]))
    assert len(eng.kv.find_prefix(seq)[0]) == n
    pool._release(match.window[0][0])  # the window's first block gone: no shorter prefix has its window either
    assert len(eng.kv.find_prefix(seq)[0]) == 0
    reused_before = eng.counters.prompt_reused
    for _ in range(40):
        eng.step()
    assert seq.done and seq.output == ref.greedy(p, SP.max_new_tokens)
    assert seq.prefix_reused == 0 and eng.counters.prompt_reused == reused_before
    eng.check_invariants()


@pytest.mark.parametrize("bs", [1, 16])
def test_a_repeated_prompt_reuses_its_prefix_and_stays_exact(mistral, bs):
    model, ref = mistral
    p = prompts(68, [90])[0]
    eng = Engine(model, CacheConfig(block_size=bs))
    assert eng.generate([p], SP) == [ref.greedy(p, SP.max_new_tokens)]
    q = p[:70] + prompts(69, [15])[0]  # the first 70 tokens shared, the rest new
    sid = eng.add_request(q, SP)
    while not eng.seqs[sid].done:
        eng.step()
        eng.check_invariants()
    seq = eng.seqs[sid]
    assert seq.prefix_reused == (70 // bs) * bs and eng.counters.prompt_reused == seq.prefix_reused
    assert seq.output == ref.greedy(q, SP.max_new_tokens)


def test_forks_tail_removal_and_a_small_device_tier_equal_one_pool(mistral):
    """seq_cp (copy-on-write), seq_rm of the last tokens, and a device tier of a few blocks (the rest on the host
    tier, migrating) keep every key either layout keeps: the window group gives one pool's tokens."""
    model, ref = mistral
    p = prompts(64, [70])[0]

    def play(mode: str, dev_mb: float) -> list[list[int]]:
        eng = Engine(model, CacheConfig(block_size=4, device_budget_mb=dev_mb, host_budget_mb=1.0),
                     EngineOptions(kv_groups=mode))
        sid = eng.add_request(p, SamplingParams(max_new_tokens=30, ignore_eos=True))
        for _ in range(6):
            eng.step()
        fork = eng.seq_cp(sid)
        for _ in range(4):
            eng.step()
        eng.seq_rm(sid, len(eng.seqs[sid].tokens) - 3)
        while not all(eng.seqs[s].done for s in (sid, fork)):
            eng.step()
            eng.check_invariants()
        return [eng.seqs[sid].output, eng.seqs[fork].output]

    from tiny_models import budget_mb

    want = play("off", 1.0)
    assert play("auto", 1.0) == want
    assert play("auto", budget_mb(model, 12, 4)) == want
    small = Engine(model, CacheConfig(block_size=4, device_budget_mb=budget_mb(model, 3, 4), host_budget_mb=1.0))
    out = small.generate(prompts(65, [60, 45]), SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert out == [ref.greedy(x, 10) for x in prompts(65, [60, 45])]
    assert small.counters.promotions > 0 or small.counters.read_tokens_missed > 0  # the host tier was used


def test_live_block_size_dtype_and_budget_changes(mistral):
    model, ref = mistral
    p = prompts(66, [100, 37])
    eng = Engine(model, CacheConfig(block_size=16), EngineOptions(max_batched_tokens=32))
    ids = [eng.add_request(x, SamplingParams(max_new_tokens=16, ignore_eos=True)) for x in p]
    for bs in (5, 1, 3, 16):
        for _ in range(4):
            eng.step()
        eng.reconfigure(block_size=bs)
        eng.check_invariants()
        assert eng.pool.config.block_size == bs
        assert all(eng.seqs[i].base == eng.seqs[i].dropped // bs for i in ids if not eng.seqs[i].done)
    eng.reconfigure(kv_dtype="fp32", device_budget_mb=2.0)
    with pytest.raises(ConfigError):
        eng.reconfigure(device_budget_mb=0.0, host_budget_mb=0.01)
    assert eng.pool.config.device_budget_mb == 2.0
    while not all(eng.seqs[i].done for i in ids):
        eng.step()
    assert [eng.seqs[i].output for i in ids] == [ref.greedy(x, 16) for x in p]


def test_the_snapshot_names_the_window_group(mistral, tmp_path):
    from engine.telemetry import snapshot_io

    model, _ = mistral
    eng = Engine(model, CacheConfig(block_size=4, device_budget_mb=1.0, host_budget_mb=1.0))
    eng.generate(prompts(67, [60, 30]), SamplingParams(max_new_tokens=6, ignore_eos=True))
    snap = eng.snapshot()
    (group,) = snap.kv_groups
    assert group["title"] == f"sliding window 24 · {model.spec.num_layers} layers" and group["window"] == W
    assert group["read_tokens"] == eng.counters.read_tokens > 0
    assert snap.memory["tiers"]["device"]["used_blocks"] == eng.pool.tiers[Tier.DEVICE].used
    path = tmp_path / "w.json"
    snapshot_io.save(str(path), snap)
    back, _ = snapshot_io.load(str(path))
    assert [g["title"] for g in back.kv_groups] == [group["title"]]
    assert np.array_equal(back.tiers[0].state, snap.tiers[0].state)
