"""End to end on the real default model (SmolLM2-135M), through the CLI where the user would go."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.config import CacheConfig, EngineOptions
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from tiny_models import Reference

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_model():
    from engine.model.loader import load_model

    return load_model(None)


@pytest.fixture(scope="module")
def default_ref() -> Reference:
    from engine.model.loader import hf_reference_dir

    return Reference(hf_reference_dir())


def kvscope(*args: str) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("block_size", ["1", "16", "64"])
def test_cli_json_tokens_equal_generate(default_ref, default_model, block_size):
    prompt = "The three most useful things to know about caches are"
    (res,) = kvscope("generate", prompt, "--json", "--max-new-tokens", "64", "--ignore-eos", "--block-size", block_size)
    ids = default_model.tokenizer.encode(prompt)
    assert res["token_ids"] == default_ref.greedy(ids, 64)


def test_concurrent_requests_migrate_and_stay_exact(default_model, default_ref, tmp_path):
    texts = ["Write a haiku about memory.", "List five prime numbers and explain why they are prime.",
             "Tell me about the history of Paris in two sentences.", "What does a compiler do?",
             "Describe a cat to someone who has never seen one, in detail, with examples.", "Hi"]
    lines = [json.dumps({"prompt": t, "max_new_tokens": 24 + 4 * i, "chat": True}) for i, t in enumerate(texts)]
    f = tmp_path / "requests.jsonl"
    f.write_text("\n".join(lines) + "\n")
    # 6 MB of device tier holds ~130 tokens of this model's fp32 KV: far less than the six requests need.
    results = kvscope("generate", "--prompt-file", str(f), "--ignore-eos", "--device-budget-mb", "6",
                      "--block-size", "8")
    assert len(results) == 6
    for i, (t, res) in enumerate(zip(texts, results)):
        ids = default_model.tokenizer.apply_chat_template([{"role": "user", "content": t}])
        assert res["token_ids"] == default_ref.greedy(ids, 24 + 4 * i), t
    # Each line carries the engine's counters as of that request's end: the last to finish saw them all.
    stats = max((r["stats"] for r in results), key=lambda st: st["steps"])
    assert stats["promotions"] > 0 and stats["demotions"] > 0


def test_shared_prefix_is_reused_and_output_unchanged(default_model, default_ref, tmp_path):
    base = " ".join(f"Rule {i}: keep the cache warm." for i in range(40))
    p1, p2 = base + " Summarise rule 3.", base + " Which rule is the last?"
    f = tmp_path / "shared.jsonl"
    f.write_text(json.dumps({"prompt": p1, "max_new_tokens": 16}) + "\n" + json.dumps({"prompt": p2, "max_new_tokens": 16}) + "\n")
    r1, r2 = kvscope("generate", "--prompt-file", str(f), "--ignore-eos")
    tok = default_model.tokenizer
    shared = sum(1 for a, b in zip(tok.encode(p1), tok.encode(p2)) if a == b)
    assert shared >= 256
    assert r2["stats"]["prefix_reused_tokens"] >= 240
    assert r1["token_ids"] == default_ref.greedy(tok.encode(p1), 16)
    assert r2["token_ids"] == default_ref.greedy(tok.encode(p2), 16)


def test_block_size_change_mid_generation_is_exact(default_model, default_ref):
    ids = default_model.tokenizer.encode("Once upon a time, in a city of caches,")
    eng = Engine(default_model, CacheConfig(block_size=16))
    sid = eng.add_request(ids, SamplingParams(max_new_tokens=40, ignore_eos=True))
    for i in range(40):
        if i == 5:
            eng.reconfigure(block_size=48)
        if i == 15:
            eng.reconfigure(block_size=5, policy="lru", demote_after_s=0.5, prefetch_depth=0)
        eng.step()
    eng.run_until_done()
    eng.check_invariants()
    assert eng.seqs[sid].output == default_ref.greedy(ids, 40)


def test_ui_bench_runs_every_part_and_reports_frames(tmp_path):
    """`kvscope bench --ui`, scaled down: each part runs on real widgets and a real engine and reports
    frame times; the panels it times are the ones on screen (the tabbed-away Residency panel is not)."""
    code = ("import json; from app.bench.ui_frames import run_ui_bench; "
            "print(json.dumps(run_ui_bench(big=20_000, medium=5_000, stall_s=3.0, say=lambda *a: None)))")
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for part in ("blockmap_1m", "blockmap_1m_after_migration", "full_refresh_100k"):
        r = res[part]
        assert 0 < r["median_ms"] <= r["p99_ms"] <= r["max_ms"] < 5_000
    assert res["blockmap_1m"]["blocks"] == 20_000 and res["full_refresh_100k"]["blocks"] == 5_000
    panels = res["full_refresh_100k"]["panels"]
    assert {"BlockMap", "HitRatePanel", "MemoryPanel", "HeatPanel", "SequencesPanel", "EventsPanel"} <= set(panels)
    assert "ResidencyPanel" not in panels
    ev = res["event_loop"]
    assert ev["engine_steps"] > 0 and ev["ticks"] > 100  # the engine decoded while the 5 ms probe ran
    assert 0 <= ev["p99_stall_ms"] <= ev["max_stall_ms"]
