"""Self-checks at first use (engine/runtime/self_check.py), run here through the CPU forms of the accelerated paths:
the `chunked` paged backend (the `numba` one's fallback: tests/attention/test_numba_paged.py), `--cuda-graphs static`, tier copies and host blocks streamed a layer ahead. Each fault is
injected through a seam (a backend put on the model, a bucket whose replay returns wrong values, a copier or a
staging copy that flips one byte) and must be (a) caught, (b) answered by the reference path from then on, (c)
said once as an event, (d) recorded in the snapshot, and (e) leave greedy tokens equal to transformers' `generate`.
A passing check must change nothing a user sees."""

from __future__ import annotations

import json

import pytest
import torch

from tiny_models import budget_mb, prompts
from app.stress.faults import RaisingBackend, WrongBackend, flip_one_byte
from engine.config import CacheConfig, EngineOptions
from engine.kv.block_pool import RESERVED
from engine.kv.tiers import copy_slots
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from engine.telemetry import snapshot_io

N = 10


def _failures(eng) -> list:
    return [e for e in eng.take_events() if e.kind == "self_check"]


def test_a_passing_engine_says_its_checks_passed_and_changes_nothing(llama_model, llama_ref):
    eng = Engine(llama_model, CacheConfig(block_size=8, host_budget_mb=0), EngineOptions(attention="cpu"))
    summary = eng.runner.checks.summary()
    # The attention check ran at start-up, or earlier in this process for the same variant (kept per process).
    assert summary["graphs"]["state"] == "not run" and summary["migration"]["state"] == "not run"
    assert summary["attention"]["state"] in ("passed", "not run")
    assert eng.counters.steps == 0 and eng.pool.tiers[0].used == 0 and not _failures(eng)
    ps = prompts(3, [11, 30])
    assert eng.generate(ps, SamplingParams(max_new_tokens=N, ignore_eos=True)) == [llama_ref.greedy(p, N) for p in ps]
    assert not _failures(eng)


def test_the_attention_check_compares_every_format_and_block_size_with_the_reference():
    from engine.attention import make_backend
    from engine.attention.check import check_backend
    from engine.config import KVDtype

    for dt in KVDtype:
        for bs in (1, 7, 16):
            for name in ("cpu", "chunked"):  # the numba loop and the torch path
                r = check_backend(make_backend(name), dt, bs, 6, 2, 16, torch.device("cpu"), windows=(5,), sinks=True)
                assert r.ok and r.cases == 7, (name, dt, bs, r)  # 4 decodes, a prefill, a partial and its lse
    r = check_backend(WrongBackend(make_backend("cpu"), 1e-3), KVDtype.FP32, 16, 6, 2, 16, torch.device("cpu"))
    assert not r.ok and 9e-4 < r.worst < 2e-3 and r.worst_case.startswith("decode")


@pytest.mark.parametrize("fault", [WrongBackend, RaisingBackend])
def test_a_faulty_attention_backend_is_caught_and_the_reference_path_serves(llama_model, llama_ref, fault):
    eng = Engine(llama_model, CacheConfig(block_size=8, host_budget_mb=0), EngineOptions(attention="chunked"))
    eng.model.backend = fault(eng.model.backend)  # swapped in before the first step: checked at that step
    ps = prompts(4, [9, 27, 40])
    out = eng.generate(ps, SamplingParams(max_new_tokens=N, ignore_eos=True))
    assert out == [llama_ref.greedy(p, N) for p in ps]  # (e)
    assert eng.model.attention == "reference" and eng.model.backend is None  # (a), (b)
    said = _failures(eng)
    assert len(said) == 1  # (c) once
    msg = said[0].fields["message"]
    assert msg.startswith("cpu paged attention disagreed with the reference (") and msg.endswith(
        "): using the reference path")
    assert ("max |Δ| 0.01" in msg) if fault is WrongBackend else ("RuntimeError: no kernel image" in msg)
    snap = eng.snapshot()
    assert snap.self_checks["attention"]["state"] == "failed"  # (d)
    assert snap.self_checks["attention"]["fallback"] == "the reference path"
    back, _ = snapshot_io.from_json(snapshot_io.to_json(snap))
    assert back.self_checks == snap.self_checks
    eng.generate(prompts(5, [12]), SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert not _failures(eng)  # said once, not at every step


def test_a_graph_bucket_that_replays_wrong_values_is_caught(llama_model, llama_ref):
    eng = Engine(llama_model, CacheConfig(block_size=8, host_budget_mb=0),
                 EngineOptions(attention="cpu", cuda_graphs="static", context_limit=96))
    graphs = eng.runner.graphs
    real = graphs.capture

    def wrong(cap, pool):  # the bucket's replay returns the right logits plus 0.5
        ok = real(cap, pool)
        right = cap.replay
        cap.replay = lambda: right() + 0.5
        return ok

    graphs.capture = wrong
    ps = prompts(6, [10, 25, 33])
    out = eng.generate(ps, SamplingParams(max_new_tokens=N, ignore_eos=True))
    assert out == [llama_ref.greedy(p, N) for p in ps]
    assert graphs.fallback is not None and "disagreed with the eager step (max |Δ| 0.5" in graphs.fallback
    assert not graphs.captured and not graphs.eligible([(eng.seqs[0], 1)])  # eager from then on
    said = _failures(eng)
    assert [e.fields["feature"] for e in said] == ["graphs"]
    assert said[0].fields["message"].endswith("): using eager decode")
    assert eng.snapshot().self_checks["graphs"]["state"] == "failed"


def test_a_passing_graph_check_keeps_the_buckets_and_the_tokens(llama_model, llama_ref):
    eng = Engine(llama_model, CacheConfig(block_size=8, host_budget_mb=0),
                 EngineOptions(attention="cpu", cuda_graphs="static", context_limit=96))
    ps = prompts(6, [10, 25, 33])
    assert eng.generate(ps, SamplingParams(max_new_tokens=N, ignore_eos=True)) == [llama_ref.greedy(p, N) for p in ps]
    g = eng.runner.graphs
    assert g.fallback is None and 4 in g.captured and all(c.checked for c in g.captured.values())
    s = eng.runner.checks.summary()["graphs"]
    assert s["state"] == "passed" and s["checks"] == len(g.captured) and "static decode bucket" in s["path"]


def _migrating(model, bs: int = 8, **cfg) -> Engine:
    config = CacheConfig(block_size=bs, device_budget_mb=budget_mb(model, 6 + RESERVED, bs),
                         host_budget_mb=budget_mb(model, 200, bs, device=False), demote_after_s=0.0, **cfg)
    return Engine(model, config, EngineOptions(attention="cpu", max_batched_tokens=32))


def test_a_copy_that_flips_one_byte_is_caught_and_copies_turn_synchronous(llama_model, llama_ref):
    eng = _migrating(llama_model)
    eng.pool.copier = flip_one_byte(eng.pool.copier)
    ps = prompts(7, [30, 41, 22])
    out = eng.generate(ps, SamplingParams(max_new_tokens=N, ignore_eos=True))
    assert eng.counters.promotions + eng.counters.demotions > 0  # blocks did migrate
    assert out == [llama_ref.greedy(p, N) for p in ps]
    assert eng.pool.copier is copy_slots and eng.pool.copy_stream is None
    said = _failures(eng)
    assert [e.fields["feature"] for e in said] == ["migration"]
    assert "k data of layer 0: 1 of" in said[0].fields["detail"]
    assert said[0].fields["message"].endswith(": using synchronous copies")
    snap = eng.snapshot()
    assert snap.self_checks["migration"]["state"] == "failed"
    assert eng.counters.promotions + eng.counters.demotions == snap.counters["promotions"] + snap.counters["demotions"]
    eng.check_invariants()


def test_a_passing_copy_check_counts_nothing_of_its_own(llama_model, llama_ref):
    ps = prompts(7, [30, 41, 22])
    eng = _migrating(llama_model)
    assert eng.generate(ps, SamplingParams(max_new_tokens=N, ignore_eos=True)) == [llama_ref.greedy(p, N) for p in ps]
    s = eng.runner.checks.summary()["migration"]
    assert s["state"] == "passed" and s["checks"] == 1 and eng.pool.copy_checked
    kinds = [e.kind for e in eng.telemetry.events]
    assert "self_check" not in kinds
    # The events feed's promotions and demotions add up to the counters: the check added none.
    moved = sum(e.fields["n"] for e in eng.telemetry.events if e.kind in ("promote", "demote"))
    assert moved == eng.counters.promotions + eng.counters.demotions


def _streaming(model, bs: int = 8) -> Engine:
    config = CacheConfig(block_size=bs, device_budget_mb=budget_mb(model, 1 + RESERVED, bs),
                         host_budget_mb=budget_mb(model, 400, bs, device=False), host_reads="stream")
    return Engine(model, config, EngineOptions(attention="cpu"))


@pytest.mark.parametrize("fault", ["flip", "raise"])
def test_a_staging_copy_that_flips_one_byte_is_caught_and_host_blocks_are_read_directly(deep_model, deep_ref, fault):
    eng = _streaming(deep_model)
    real = eng.runner.stream.copy

    def flip(src, slots, out):  # gathers the rows, then flips one bit of one byte
        real(src, slots, out)
        out.reshape(-1)[:1].view(torch.uint8)[0] ^= 0x10

    def raising(src, slots, out):
        raise RuntimeError("copy engine fault")

    eng.runner.stream.copy = flip if fault == "flip" else raising
    ps = prompts(31, [29, 41])
    out = eng.generate(ps, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert out == [deep_ref.greedy(p, 8) for p in ps]
    assert eng.runner.stream.failed
    said = _failures(eng)
    assert [e.fields["feature"] for e in said] == ["stream"]
    assert ("bytes differ" if fault == "flip" else "RuntimeError: copy engine fault") in said[0].fields["detail"]
    assert said[0].fields["message"].endswith(": using the host tier read at each read (no staging)")
    streamed = eng.counters.streamed_bytes
    eng.generate(prompts(32, [20]), SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert eng.counters.streamed_bytes == streamed  # nothing staged after the failure
    assert eng.counters.read_tokens_streamed > 0
    assert eng.snapshot().self_checks["stream"]["state"] == "failed"


def test_a_passing_stream_check_keeps_staging(deep_model, deep_ref):
    eng = _streaming(deep_model)
    ps = prompts(31, [29, 41])
    assert eng.generate(ps, SamplingParams(max_new_tokens=8, ignore_eos=True)) == [deep_ref.greedy(p, 8) for p in ps]
    s = eng.runner.checks.summary()["stream"]
    assert s["state"] == "passed" and s["checks"] == 1 and not eng.runner.stream.failed
    assert eng.counters.streamed_bytes > 0


def test_kv_cache_groups_are_checked_per_pool_and_per_stream(tiny_gemma3):
    """A grouped model (engine/kv/cache.py: a pool per attention type, eager steps): a copy that flips a byte in the
    sliding group's pool is caught there, and tokens equal transformers'."""
    from tiny_models import Reference
    from engine.model.loader import load_model

    model = load_model(tiny_gemma3)
    ref = Reference(tiny_gemma3)
    config = CacheConfig(block_size=8, device_budget_mb=0.05, host_budget_mb=8, demote_after_s=0.0)
    eng = Engine(model, config, EngineOptions(attention="cpu", kv_groups="auto", max_batched_tokens=32))
    assert eng.grouped
    pool = eng.kv.mgrs[1].pool
    pool.copier = flip_one_byte(pool.copier)
    ps = prompts(8, [40, 23])
    out = eng.generate(ps, SamplingParams(max_new_tokens=N, ignore_eos=True))
    assert out == [ref.greedy(p, N) for p in ps]
    assert pool.copier is copy_slots and pool.copy_checked
    said = _failures(eng)
    assert [e.fields["feature"] for e in said] == ["migration"]
    assert eng.snapshot().self_checks["migration"]["state"] == "failed"


def test_generate_json_and_info_record_the_self_checks(capsys, tiny_llama):
    from kvscope_cli import run_cli

    rc, out, _ = run_cli(capsys, "generate", "hello world", "--model", tiny_llama, "--json", "--max-new-tokens", "3",
                         "--cuda-graphs", "static")
    assert rc == 0
    checks = json.loads(out)["stats"]["self_checks"]
    assert set(checks) == {"attention", "graphs", "migration", "stream"}
    assert checks["graphs"]["state"] == "passed" and checks["graphs"]["checks"] >= 1
    assert checks["attention"]["state"] in ("passed", "not run")  # kept per process: maybe checked before
    rc, out, _ = run_cli(capsys, "info", "--model", tiny_llama, "--json")
    assert rc == 0 and json.loads(out)["self_checks"]["migration"] == {"state": "not run", "checks": 0}
    rc, out, _ = run_cli(capsys, "info", "--model", tiny_llama)
    assert rc == 0 and "self-check migration  not run yet (checked at first use)" in out
