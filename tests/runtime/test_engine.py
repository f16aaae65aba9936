"""The engine against recomputation: transformers' greedy tokens are the reference for fp32 KV."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiny_models import Reference, prompts
from engine.kv.block_pool import RESERVED, Tier
from engine.config import CacheConfig, ConfigError, EngineOptions, KVDtype
from engine.runtime.engine import Engine, RequestError
from engine.sequence import SamplingParams

N = 16
SP = SamplingParams(max_new_tokens=N, ignore_eos=True)


def run(engine: Engine, ps, sp=SP) -> list[list[int]]:
    out = engine.generate(ps, sp)
    engine.check_invariants()
    return out


@pytest.mark.parametrize("block_size", [1, 5, 16, 64])
def test_greedy_equals_transformers_at_any_block_size(llama_model, llama_ref, block_size):
    ps = prompts(0, [7, 30, 75])
    eng = Engine(llama_model, CacheConfig(block_size=block_size))
    assert run(eng, ps) == [llama_ref.greedy(p, N) for p in ps]


@pytest.mark.parametrize("host_mb, mode", [(2.0, "swap"), (0.01, "recompute")])
def test_tight_device_budget_migrates_and_stays_exact(llama_model, llama_ref, host_mb, mode):
    ps = prompts(1, [60, 33, 71, 12, 50, 64])
    # 0.05 MB holds 204 one-token blocks; the six requests need ~480 at their peak. With a 0.01 MB
    # host tier, preempted sequences cannot be swapped out: their KV is dropped and recomputed.
    eng = Engine(llama_model, CacheConfig(block_size=1, device_budget_mb=0.05, host_budget_mb=host_mb),
                 EngineOptions(max_batched_tokens=64))
    assert run(eng, ps) == [llama_ref.greedy(p, N) for p in ps]
    c = eng.counters
    # Blocks leave the device tier (demoted to make room, or dropped with a preempted sequence's KV); a sequence
    # runs with blocks left on the host tier (read there) rather than preempting another (issue 10).
    assert c.demotions > 0 or c.preemptions > 0
    modes = {e.fields["mode"] for e in eng.take_events() if e.kind == "preempt"}
    assert not modes or mode in modes
    if mode == "swap":
        assert c.read_tokens_missed > 0 and 0 < c.device_hit_rate < 1


def test_idle_demotion_and_promotion_with_prefetch(llama_model, llama_ref):
    ps = prompts(2, [40, 20])
    now = [0.0]
    eng = Engine(llama_model, CacheConfig(block_size=4, demote_after_s=5.0, prefetch_depth=3), clock=lambda: now[0])
    a = eng.add_request(ps[0], SP)
    b = eng.add_request(ps[1], SP)
    for _ in range(4):
        eng.step()
        now[0] += 0.1
    eng.pause(a)
    now[0] += 6.0  # a's blocks sit idle past demote_after_s
    eng.step()
    seq_a = eng.seqs[a]
    assert all(eng.pool.tier[lid] == Tier.HOST for lid in seq_a.blocks)
    assert seq_a.num_cached == 43
    eng.resume(a)
    misses_before = eng.counters.block_misses
    read_missed = eng.counters.read_tokens_missed
    eng.take_events()
    eng.step()
    assert all(eng.pool.tier[lid] == Tier.DEVICE for lid in seq_a.blocks)
    # Its 11 host blocks (43 tokens) read: 11 block misses, every key it reads (43 + the new one) was in a block
    # on the host tier; promoted in groups of 1 + prefetch_depth: 3 moves, not 11.
    assert len(seq_a.blocks) == 11
    assert eng.counters.block_misses - misses_before == 11
    assert eng.counters.read_tokens_missed - read_missed == 44
    moves = [e for e in eng.take_events() if e.kind == "promote"]
    assert len(moves) == 3 and [e.fields["n"] for e in moves] == [4, 4, 3], [e.fields for e in moves]
    eng.run_until_done()
    eng.check_invariants()
    assert eng.seqs[a].output == llama_ref.greedy(ps[0], N)
    assert eng.seqs[b].output == llama_ref.greedy(ps[1], N)


def test_prefix_reuse_reports_tokens_and_keeps_output(llama_model, llama_ref):
    shared = prompts(3, [260])[0]
    p1, p2 = shared + prompts(4, [9])[0], shared + prompts(5, [13])[0]
    eng = Engine(llama_model, CacheConfig(block_size=16))
    out1 = run(eng, [p1])[0]
    s2 = eng.add_request(p2, SP)
    eng.run_until_done()
    assert eng.seqs[s2].prefix_reused >= 256
    assert out1 == llama_ref.greedy(p1, N)
    assert eng.seqs[s2].output == llama_ref.greedy(p2, N)


def test_seq_rm_tail_then_continue_equals_truncated_prompt(llama_model, llama_ref):
    p = prompts(6, [50])[0]
    eng = Engine(llama_model, CacheConfig(block_size=8))
    sid = eng.add_request(p, SamplingParams(max_new_tokens=40, ignore_eos=True))
    for _ in range(6):
        eng.step()
    seq = eng.seqs[sid]
    # Drop positions 29.. (the prompt's tail and all that was generated), then feed token 29 again
    # as llama.cpp would: what follows must be the greedy continuation of the 30-token prompt.
    eng.seq_rm(sid, 29, None)
    assert seq.tokens == p[:29] and seq.num_cached == 29
    eng.check_invariants()
    before = len(seq.output)
    eng.extend(sid, [p[29]], N)
    eng.run_until_done()
    eng.check_invariants()
    assert seq.output[before:] == llama_ref.greedy(p[:30], N)


def test_fork_shares_blocks_then_diverges_like_two_runs(llama_model, llama_ref):
    p = prompts(7, [37])[0]
    eng = Engine(llama_model, CacheConfig(block_size=8))
    a = eng.add_request(p, SamplingParams(max_new_tokens=30, ignore_eos=True))
    eng.step()  # prefill and the first token
    b = eng.seq_cp(a)
    sa, sb = eng.seqs[a], eng.seqs[b]
    assert sa.blocks == sb.blocks and all(eng.pool.ref_of(lid) == 2 for lid in sa.blocks)
    eng.check_invariants()
    # b continues another way: its pending token differs, so its first write diverges.
    x = (sa.output[-1] + 1) % 49152
    sb.tokens[-1] = sb.output[-1] = x
    eng.step()
    assert len(set(sa.blocks) & set(sb.blocks)) == 37 // 8  # full blocks still shared; the tail was copied
    assert eng.counters.cow_copies >= 1
    eng.run_until_done()
    eng.check_invariants()
    assert sa.output == llama_ref.greedy(p, 30)
    assert sb.output[1:] == llama_ref.greedy(p + [x], 29)


def test_kshift_keys_equal_fresh_keys_and_generation_passes_context(llama_model, llama_ref):
    p = prompts(8, [40])[0]
    eng = Engine(llama_model, CacheConfig(block_size=8))
    sid = eng.add_request(p, SamplingParams(max_new_tokens=5, ignore_eos=True))
    eng.step()
    seq = eng.seqs[sid]
    k_before, _ = eng.kv.tokens_kv(seq)
    keep_idx = torch.tensor(list(range(4)) + list(range(14, seq.num_cached)))
    # Remove positions [4, 14) and shift the rest back by 10: a context shift by hand.
    eng.seq_rm(sid, 4, 14)
    eng.seq_add(sid, 14, None, -10)
    assert seq.pos[: len(seq.tokens)] == list(range(len(seq.tokens)))
    k_engine, _ = eng.kv.tokens_kv(seq)  # [L, n, Hkv, D]
    # Layer 0's keys depend on the token and its position only: they must equal a fresh prefill.
    k_ref = llama_ref.keys(seq.tokens[: seq.num_cached])[0]
    rel = (k_engine[0].transpose(0, 1) - k_ref).norm() / k_ref.norm()
    assert rel <= 1e-4, f"layer 0: relative error {rel:.2e}"
    # Deeper keys also carry the (now removed) context, so for them the check is the rotation itself:
    # the shifted keys equal the unshifted keys rotated afresh from their old to their new positions.
    old_pos = torch.tensor(list(range(4)) + list(range(14, 14 + seq.num_cached - 4)))
    new_pos = torch.arange(seq.num_cached)
    for layer in range(1, k_engine.shape[0]):
        unrot = eng.model.shift_keys(k_before[layer][keep_idx], -old_pos, layer)
        fresh = eng.model.shift_keys(unrot, new_pos, layer)
        rel = (k_engine[layer] - fresh).norm() / fresh.norm()
        assert rel <= 1e-4, f"layer {layer}: relative error {rel:.2e}"

    eng2 = Engine(llama_model, CacheConfig(block_size=8), EngineOptions(context_limit=64, n_keep=4))
    s2 = eng2.add_request(p, SamplingParams(max_new_tokens=100, ignore_eos=True))
    eng2.run_until_done()
    eng2.check_invariants()
    assert len(eng2.seqs[s2].output) == 100 and eng2.seqs[s2].shifts >= 2
    assert eng2.counters.context_shifts == eng2.seqs[s2].shifts


def test_live_reconfiguration_keeps_tokens(llama_model, llama_ref):
    ps = prompts(9, [60, 33, 71, 12])
    eng = Engine(llama_model, CacheConfig(block_size=16))
    ids = [eng.add_request(p, SP) for p in ps]
    for i in range(200):
        if not eng.has_work():
            break
        if i == 3:
            eng.reconfigure(block_size=48)
        if i == 6:
            eng.reconfigure(block_size=5, policy="lru", decay=0.5, demote_after_s=0.0, prefetch_depth=0, evict_batch=3)
        if i == 9:
            eng.reconfigure(device_budget_mb=0.2, host_budget_mb=3)
        eng.step()
        eng.check_invariants()
    assert eng.config.block_size == 5 and eng.config.policy == "lru"
    assert [eng.seqs[i].output for i in ids] == [llama_ref.greedy(p, N) for p in ps]


def test_invalid_config_is_refused_and_nothing_changes(llama_model):
    eng = Engine(llama_model, CacheConfig(block_size=16))
    sid = eng.add_request(prompts(10, [20])[0], SP)
    eng.step()
    before = eng.config
    for bad in (dict(block_size=0), dict(block_size="x"), dict(kv_dtype="int3"), dict(policy="mru"),
                dict(decay=1.5), dict(device_budget_mb=-1), dict(evict_batch=0), dict(nonsense=1),
                dict(device_budget_mb=0.05, host_budget_mb=0, block_size=1024)):
        with pytest.raises(ConfigError):
            eng.reconfigure(**bad)
    assert eng.config == before
    eng.run_until_done()
    assert len(eng.seqs[sid].output) == N


def test_prompt_that_cannot_fit_is_refused(llama_model):
    eng = Engine(llama_model, CacheConfig(block_size=16, device_budget_mb=0.05, host_budget_mb=0.05))
    with pytest.raises(RequestError, match="device and host tiers hold 4 \\+ 6"):
        eng.add_request(prompts(11, [200])[0], SP)
    with pytest.raises(RequestError):
        eng.add_request([], SP)
    with pytest.raises(RequestError):
        eng.add_request([10**9], SP)
    assert not eng.seqs


def test_int8_bytes_and_bounded_logit_error(llama_model):
    # No shadow steps: their dense forward passes go through model.forward too, and on a loaded machine (a run slower
    # than shadow_every_s) one was recorded among the step logits, so rows were compared out of step (0.06 "error").
    fp32 = CacheConfig(block_size=16, shadow_every_s=0)
    int8 = CacheConfig(block_size=16, kv_dtype=KVDtype.INT8, shadow_every_s=0)
    e32, e8 = Engine(llama_model, fp32), Engine(llama_model, int8)
    D = e8.spec.head_dim  # int8 codes + one fp16 scale per token and head: (D + 2) / 4D of fp32
    assert e8.pool.block_bytes * 4 * D == e32.pool.block_bytes * (D + 2)
    p = prompts(12, [90])[0]
    logits, tokens = {}, {}
    for name, eng in (("fp32", e32), ("int8", e8),
                      ("delta", Engine(llama_model, CacheConfig(kv_dtype="int8-delta", shadow_every_s=0))),
                      ("kivi", Engine(llama_model, CacheConfig(kv_dtype="int8-kivi", shadow_every_s=0)))):
        captured: list[torch.Tensor] = []
        eng.model.forward = _recording(eng.model.forward, captured)
        tokens[name] = eng.generate([p], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
        logits[name] = torch.cat(captured)
    ref = logits["fp32"]
    for name in ("int8", "delta", "kivi"):
        # Compare steps up to the first differing token: after it the inputs differ, not just the cache.
        same = next((i for i, (a, b) in enumerate(zip(tokens[name], tokens["fp32"])) if a != b), len(tokens[name]))
        n = max(same, 1)
        err = ((logits[name][:n] - ref[:n]).abs().amax(-1) / ref[:n].abs().amax(-1)).max()
        assert err < 0.02, f"{name}: max logit error {err:.4f} of the logit range"


def _recording(forward, out: list):
    def wrapped(batch, store):
        logits = forward(batch, store)
        out.append(logits)
        return logits

    return wrapped


def test_dtype_change_mid_run_is_lossy_and_continues(llama_model):
    eng = Engine(llama_model, CacheConfig(block_size=16))
    sid = eng.add_request(prompts(13, [40])[0], SP)
    eng.step()
    assert eng.is_lossy_change(KVDtype.INT8)
    eng.reconfigure(kv_dtype="int8")
    eng.run_until_done()
    eng.check_invariants()
    ev = [e for e in eng.take_events() if e.kind == "config"]
    assert ev and ev[-1].fields["lossy"] is True
    assert eng.config.kv_dtype is KVDtype.INT8 and len(eng.seqs[sid].output) == N


def test_qwen2_and_mistral_sliding_window_match_transformers(tiny_qwen2, tiny_mistral):
    from engine.model.loader import load_model

    for path, lengths in ((tiny_qwen2, [5, 40]), (tiny_mistral, [10, 50])):
        model, ref = load_model(path), Reference(path)
        ps = prompts(14, lengths)
        eng = Engine(model, CacheConfig(block_size=4))
        assert run(eng, ps) == [ref.greedy(p, N) for p in ps], path


def test_snapshot_arrays_match_the_pool(llama_model):
    eng = Engine(llama_model, CacheConfig(block_size=4, device_budget_mb=0.05, host_budget_mb=1))
    eng.add_request(prompts(15, [30])[0], SP)
    eng.step()
    snap = eng.snapshot()
    dev = snap.tiers[0]
    assert dev.capacity == eng.pool.tiers[0].capacity == len(dev.state)
    seq_slots = snap.seqs.block_slot[0]
    assert np.all(dev.state[seq_slots] == 2) and np.all(dev.ref[seq_slots] == 1)
    assert int(dev.fill[seq_slots].sum()) == eng.seqs[0].num_cached
    mem = snap.memory["tiers"]["device"]
    assert mem["capacity_bytes"] == dev.capacity * eng.pool.block_bytes
    assert snap.memory["gpu"]["available"] is False and "no GPU" in snap.memory["gpu"]["reason"]


def test_access_trace_records_every_read_with_hits_and_misses(llama_model, tmp_path):
    from engine.kv.access_trace import AccessTrace

    ps = prompts(16, [60, 33, 71, 12])
    eng = Engine(llama_model, CacheConfig(block_size=4, device_budget_mb=0.05, host_budget_mb=1, prefetch_depth=1),
                 EngineOptions(max_batched_tokens=64))
    eng.start_trace()
    run(eng, ps)
    trace = eng.stop_trace(str(tmp_path / "t.npz"))
    c = eng.counters
    assert len(trace) == c.block_reads and int((~trace.hit).sum()) == c.block_misses > 0
    assert np.all(trace.tier[~trace.hit] == 1)  # a miss is a read of a host block
    back = AccessTrace.load(str(tmp_path / "t.npz"))
    assert np.array_equal(back.block, trace.block) and np.array_equal(back.hit, trace.hit)
    # A block keeps its serial across migrations: some serials are read as misses and later as hits.
    missed = set(trace.block[~trace.hit].tolist())
    assert missed & set(trace.block[trace.hit].tolist())


def test_seq_add_with_both_tiers_full_is_refused_and_changes_nothing(llama_model):
    # 0.02 MB device + 0 host = 10 blocks of 4 tokens; a 36-token prompt and its fork share 9 of them.
    eng = Engine(llama_model, CacheConfig(block_size=4, device_budget_mb=(10 + RESERVED) * 2048 / 2**20, host_budget_mb=0.0))
    a = eng.add_request(prompts(17, [36])[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
    eng.step()
    eng.seq_cp(a)
    seq = eng.seqs[a]
    before = (list(seq.tokens), list(seq.pos), list(seq.blocks), seq.num_cached)
    free = eng.pool.reclaimable(Tier.DEVICE) + eng.pool.reclaimable(Tier.HOST)
    assert free < 9 and all(eng.pool.ref_of(lid) == 2 for lid in seq.blocks)
    with pytest.raises(RequestError, match="nothing was changed"):
        eng.seq_add(a, 2, None, 1)  # would re-lay 9 shared blocks into new ones
    assert (seq.tokens, seq.pos, seq.blocks, seq.num_cached) == before
    eng.check_invariants()


def test_a_paused_engine_s_clock_stands_still_so_nothing_demotes_on_resume(llama_model):
    """The demotion rule counts running time only: blocks idle 0.1 s before a 10 s pause are not demoted by the
    first step after it (issue 11: the demote clock ran while the engine was paused)."""
    from app.window.runner import EngineRunner

    now = [0.0]
    eng = Engine(llama_model, CacheConfig(block_size=4, demote_after_s=5.0), clock=lambda: now[0])
    runner = EngineRunner(eng)  # not started: its pause switch is what the window's Pause button calls
    eng.generate([prompts(40, [20])[0]], SamplingParams(max_new_tokens=2, ignore_eos=True))
    on_device = eng.pool.tiers[Tier.DEVICE].used
    assert on_device > 0
    now[0] += 0.1
    runner.pause_engine(True)
    assert eng.clock.paused and eng.clock() == 0.1
    now[0] += 10.0
    assert eng.clock() == 0.1
    runner.pause_engine(False)
    eng.kv.residency.demote_idle(eng.clock())
    assert eng.pool.tiers[Tier.DEVICE].used == on_device and eng.counters.demotions == 0
    now[0] += 6.0  # running time past demote_after_s: now they go
    eng.kv.residency.demote_idle(eng.clock())
    assert eng.pool.tiers[Tier.DEVICE].used == 0


def test_engine_thread_kernels_use_torchs_threads(llama_model):
    """The window gives torch all cores but one (the UI's); numba's kernels (attention, the fp32 and packed matmuls)
    take their thread count per calling thread, every core by default: the engine thread sets it to torch's, so a
    step leaves the UI its core. Here torch is given 1 thread: numba's, on the engine thread, is 1 too, while the
    test's own thread keeps numba's default."""
    import time

    numba = pytest.importorskip("numba")
    from app.window.runner import EngineRunner

    before = torch.get_num_threads()
    default = numba.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner = EngineRunner(Engine(llama_model, CacheConfig(block_size=4))).start()
        try:
            deadline = time.monotonic() + 10
            while runner.numba_threads is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert runner.numba_threads == 1
        finally:
            runner.stop()
    finally:
        torch.set_num_threads(before)
    assert numba.get_num_threads() == default
