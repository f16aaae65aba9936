"""Per-layer placement (issue 10 item 1): `device_layers` N keeps the first N layers of the device tier's blocks in
device memory and the rest in host memory, so the device budget holds more blocks; the host memory they take
comes out of the host budget; tokens stay exact; a live change of N moves every block's bytes unchanged."""

from __future__ import annotations

import pytest
import torch

from tiny_models import prompts
from engine.kv.block_pool import RESERVED, BlockPool
from engine.config import CacheConfig, ConfigError, EngineOptions
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from engine.kv.tiers import Tier, tier_sizes

N = 12


def _per_block(model, bs: int = 8) -> int:
    s = model.spec
    return BlockPool.bytes_per_block(CacheConfig(block_size=bs), s.num_layers, s.num_kv_heads, s.head_dim)


def test_the_device_budget_holds_layers_over_n_times_the_blocks(deep_model):
    per = _per_block(deep_model)
    base = CacheConfig(block_size=8, device_budget_mb=20 * per / 2**20, host_budget_mb=100 * per / 2**20)
    all_layers = tier_sizes(base, 12, per)
    assert (all_layers.dev_cap, all_layers.host_cap, all_layers.spilled_bytes) == (18, 100, 0)
    three = tier_sizes(base.replace(device_layers=3), 12, per)
    assert three.dev_block_bytes * 4 == per and three.dev_cap == 80 - RESERVED
    # The device tier's other 9 layers (its reserved slots' too) live in host memory, out of the host budget.
    assert three.spilled_bytes == 80 * per * 3 // 4
    assert three.host_cap == 100 - 60
    with pytest.raises(ConfigError, match="device_layers 13: this model has 12 layers"):
        tier_sizes(base.replace(device_layers=13), 12, per)


def test_a_host_budget_too_small_for_the_spilled_layers_is_refused(deep_model):
    per = _per_block(deep_model)
    cfg = CacheConfig(block_size=8, device_budget_mb=20 * per / 2**20, host_budget_mb=10 * per / 2**20,
                      device_layers=3)
    with pytest.raises(ConfigError, match=r"other 9 layers need .* MB of host memory but host_budget_mb is"):
        Engine(deep_model, cfg, EngineOptions(attention="cpu"))
    with pytest.raises(ConfigError, match="device_layers: -1 is outside"):
        CacheConfig().replace(device_layers=-1)


@pytest.mark.parametrize("attention", ["cpu", "reference"])
def test_tokens_are_exact_with_layers_on_the_host(deep_model, deep_ref, attention):
    per = _per_block(deep_model)
    eng = Engine(deep_model, CacheConfig(block_size=8, device_budget_mb=8 * per / 2**20, host_budget_mb=60 * per / 2**20,
                                         device_layers=4), EngineOptions(attention=attention))
    dev = eng.pool.tiers[Tier.DEVICE]
    assert dev.capacity == 8 * 3 - RESERVED
    places = [eng.pool.layer_place(Tier.DEVICE, layer) for layer in range(12)]
    assert all(p == (eng.device, False) for p in places[:4])
    assert all(p[0] == torch.device("cpu") for p in places[4:])
    mem = eng.memory()["tiers"]["device"]
    assert mem["device_layers"] == 4 and mem["host_layers_bytes"] == (dev.capacity + RESERVED) * per * 8 // 12
    ps = prompts(50, [30, 17, 41])
    outs = eng.generate(ps, SamplingParams(max_new_tokens=N, ignore_eos=True))
    assert outs == [deep_ref.greedy(p, N) for p in ps]
    assert eng.counters.preemptions == 0


def test_a_live_change_of_device_layers_moves_every_byte_unchanged(deep_model, deep_ref):
    per = _per_block(deep_model)
    eng = Engine(deep_model, CacheConfig(block_size=8, kv_dtype="int8-delta", device_budget_mb=30 * per / 2**20,
                                         host_budget_mb=60 * per / 2**20), EngineOptions(attention="cpu"))
    ps = prompts(51, [30, 22])
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=N, ignore_eos=True)) for p in ps]
    for _ in range(3):
        eng.step()
    assert not eng.is_lossy_change({"device_layers": 5})
    before = {i: eng.kv.tokens_kv(eng.seqs[i]) for i in ids}
    eng.reconfigure(device_layers=5)
    assert eng.pool.sizes.dev_layers == 5 and eng.pool.tiers[Tier.DEVICE].capacity > 30 - RESERVED
    for i in ids:  # every stored value bit for bit (int8-delta: codes, steps and anchors copied, not re-encoded)
        k, v = eng.kv.tokens_kv(eng.seqs[i])
        assert torch.equal(k, before[i][0]) and torch.equal(v, before[i][1])
    eng.reconfigure(device_layers=0)
    for i in ids:
        k, v = eng.kv.tokens_kv(eng.seqs[i])
        assert torch.equal(k, before[i][0]) and torch.equal(v, before[i][1])
    eng.run_until_done()
    eng.kv.check(eng.seqs.values())
    assert all(len(eng.seqs[i].output) == N for i in ids)
