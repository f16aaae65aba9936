"""Any exception inside a reconfiguration is undone and refused (issue 18 item 1).

Faults are injected at every block copy of a budget change, inside the policy's move hook, and at each layer of a
growing tier's allocation; after each refused change the pool must be as it was: config, capacities, block
tables, every live block's K/V bytes and the policy's queues. The only thing a refused change may lose is a cached
block whose slot it had already overwritten (its data is gone), which the undo releases. Sequences then finish
with transformers' tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiny_models import prompts
from engine.kv.block_pool import RESERVED, BlockPool
from engine.config import CacheConfig, ConfigError, EngineOptions
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from engine.kv.tiers import Tier

N = 10


def _mb(model, blocks: int) -> float:
    s = model.spec
    return blocks * BlockPool.bytes_per_block(CacheConfig(block_size=8), s.num_layers, s.num_kv_heads, s.head_dim) / 2**20


def _busy_engine(model, policy: str, dev: int = 20, host: int = 20):
    """Both tiers nearly full: cached prompts and two sequences mid-decode."""
    eng = Engine(model, CacheConfig(block_size=8, device_budget_mb=_mb(model, dev + RESERVED),
                                    host_budget_mb=_mb(model, host), policy=policy), EngineOptions(attention="cpu"))
    ps = prompts(41, [30, 44, 23, 37, 51, 40, 33, 45, 35, 19])
    for p in ps[:8]:
        eng.generate([p], SamplingParams(max_new_tokens=2, ignore_eos=True))
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=N, ignore_eos=True)) for p in ps[8:]]
    for _ in range(3):
        eng.step()
    return eng, ids, ps[8:]


def _state(eng):
    pool = eng.pool
    live = np.flatnonzero(pool.tier >= 0)
    k, v = pool.read_blocks(live.tolist())
    queues = [pool.policy.queues(t).copy() for t in pool.tiers] if hasattr(pool.policy, "queues") else None
    return {"config": eng.config, "caps": [t.capacity for t in pool.tiers],
            "tables": {i: list(s.blocks) for i, s in eng.seqs.items() if not s.done},
            "where": {int(l): (int(pool.tier[l]), int(pool.slot[l])) for l in live},
            "owned": {int(l) for l in live if pool.ref_of(int(l)) > 0},
            "k": {int(l): k[:, j] for j, l in enumerate(live)}, "v": {int(l): v[:, j] for j, l in enumerate(live)},
            "queues": queues, "hashes": dict(pool.by_hash)}


def _same_as_before(eng, before) -> None:
    after = _state(eng)
    assert after["config"] == before["config"] and after["caps"] == before["caps"]
    assert after["tables"] == before["tables"]
    assert before["owned"] <= set(after["where"])  # no owned block lost
    lost = set(before["where"]) - set(after["where"])
    assert not (lost & before["owned"])
    assert set(after["where"]) <= set(before["where"])  # nothing made up
    for lid, where in after["where"].items():
        assert where == before["where"][lid], f"block {lid} moved"
        assert torch.equal(after["k"][lid], before["k"][lid]) and torch.equal(after["v"][lid], before["v"][lid])
    if before["queues"] is not None:
        for qa, qb in zip(after["queues"], before["queues"]):
            live = np.asarray([l >= 0 for l in range(len(qa))])
            assert np.array_equal(qa, qb) or lost  # a lost cached block leaves its queue
    eng.check_invariants()


@pytest.mark.parametrize("policy", ["s3fifo", "heat", "lru"])
@pytest.mark.parametrize("pre, dev, host", [(None, 3, 40), ((2, 30), 40, 3), (None, 2, 6)])
def test_a_fault_at_any_block_copy_of_a_resize_is_undone(llama_model, llama_ref, policy, pre, dev, host):
    """(3, 40): the device tier demotes into a grown host tier; (40, 3) after (2, 30): the host tier hands the owned
    blocks it holds to a grown device tier; (2, 6): both shrink (demotions, evictions, packing of both tiers)."""
    eng, ids, ps = _busy_engine(llama_model, policy)
    pool = eng.pool
    if pre:
        eng.reconfigure(device_budget_mb=_mb(llama_model, pre[0] + RESERVED), host_budget_mb=_mb(llama_model, pre[1]))
        assert (pool.tiers[Tier.HOST].ref > 0).sum() >= 3  # owned blocks on the host tier
    change = dict(device_budget_mb=_mb(llama_model, dev + RESERVED), host_budget_mb=_mb(llama_model, host))
    real = pool._copy
    calls = [0]
    before = _state(eng)
    faults = 0
    for k in range(1, 40):
        def fail_at(*a, k=k):
            calls[0] += 1
            if calls[0] == k:
                raise RuntimeError(f"injected fault at copy {k}")
            return real(*a)

        calls[0] = 0
        pool._copy = fail_at
        try:
            eng.reconfigure(**change)
        except ConfigError as e:
            assert "undone" in str(e) and f"copy {k}" in str(e)
            faults += 1
            _same_as_before(eng, before)
            before = _state(eng)
            continue
        break  # the change made fewer than k copies: it went through
    pool._copy = real
    assert faults >= 2, "the change should make several copies"
    assert eng.pool.tiers[Tier.DEVICE].capacity == dev and eng.pool.tiers[Tier.HOST].capacity == host
    eng.check_invariants()
    eng.run_until_done()
    assert [eng.seqs[i].output for i in ids] == [llama_ref.greedy(p, N) for p in ps]


def test_a_fault_inside_the_policy_is_undone(llama_model, llama_ref):
    eng, ids, ps = _busy_engine(llama_model, "s3fifo")
    pool = eng.pool
    before = _state(eng)
    real = pool.policy.on_move

    def broken(*a):
        real(*a)
        raise IndexError("index 64 is out of bounds for axis 0 with size 64")

    pool.policy.on_move = broken
    with pytest.raises(ConfigError, match="IndexError.*undone"):
        eng.reconfigure(device_budget_mb=0.0, host_budget_mb=_mb(llama_model, 64))
    vars(pool.policy).pop("on_move")  # the checkpoint copied the instance with its injected hook: take it off
    _same_as_before(eng, before)
    events = [e for e in eng.take_events() if e.kind == "config_error"]
    assert events and "undone" in events[-1].fields["message"]
    eng.run_until_done()
    assert [eng.seqs[i].output for i in ids] == [llama_ref.greedy(p, N) for p in ps]


@pytest.mark.parametrize("fail_layer", [0, 1])
def test_running_out_of_memory_while_a_tier_grows_is_undone(llama_model, llama_ref, fail_layer):
    eng, ids, ps = _busy_engine(llama_model, "s3fifo")
    pool = eng.pool
    before = _state(eng)
    real = pool.kcodec.alloc_layer
    seen = []

    def oom(parts, g, n, layer, device, pin):
        seen.append(layer)
        if layer == fail_layer and len(seen) == fail_layer + 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(parts, g, n, layer, device, pin)

    pool.kcodec.alloc_layer = oom
    with pytest.raises(ConfigError, match="undone"):
        eng.reconfigure(device_budget_mb=_mb(llama_model, 60 + RESERVED))
    pool.kcodec.alloc_layer = real
    _same_as_before(eng, before)
    dev = pool.tiers[Tier.DEVICE]
    assert all(x.shape[0] == dev.capacity + RESERVED for x in dev.k["data"])  # storage back to the old size
    assert all(not x[dev.null_slot].any() for x in dev.k["data"])  # the null block is zeros again
    eng.run_until_done()
    assert [eng.seqs[i].output for i in ids] == [llama_ref.greedy(p, N) for p in ps]


def test_a_shrink_that_cannot_allocate_after_committing_keeps_a_view(llama_model, llama_ref):
    """The storage of a shrinking tier is cut after the change committed; should that fail it keeps a view."""
    eng, ids, ps = _busy_engine(llama_model, "heat")
    pool = eng.pool
    real = pool.vcodec.alloc_layer

    def oom(*a):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    pool.vcodec.alloc_layer = oom
    eng.reconfigure(device_budget_mb=_mb(llama_model, 6 + RESERVED))
    pool.vcodec.alloc_layer = real
    dev = pool.tiers[Tier.DEVICE]
    assert dev.capacity == 6 and all(x.shape[0] == 6 + RESERVED for x in dev.v["data"])
    assert all(not x[dev.null_slot:].any() for x in dev.v["data"])
    eng.check_invariants()
    eng.run_until_done()
    assert [eng.seqs[i].output for i in ids] == [llama_ref.greedy(p, N) for p in ps]


@pytest.mark.parametrize("policy", ["s3fifo", "lru"])
def test_the_policy_keeps_its_state_across_a_budget_change(llama_model, policy):
    """Before, every budget change replaced the policy: S3-FIFO's queues (which blocks earned main) restarted."""
    eng, ids, ps = _busy_engine(llama_model, policy, dev=30, host=30)
    pool = eng.pool
    keep = pool.policy
    eng.reconfigure(host_budget_mb=_mb(llama_model, 31))  # grows the host tier: nothing moves
    assert eng.pool.policy is keep
    if policy == "s3fifo":
        eng.reconfigure(decay=0.5)
        assert eng.pool.policy is keep
        eng.reconfigure(policy="lru")
        assert eng.pool.policy is not keep
