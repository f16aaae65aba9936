"""Cache health in `generate --json` and `bench` (engine/telemetry/health.py): hand counts on the tiny model."""

from __future__ import annotations

import json

from kvscope_cli import run_cli
from test_sweep import TRACE, bench_args

from app.bench.sweep import run_sweep


def test_generate_json_carries_the_health_targets_graded(tiny_llama, tmp_path, capsys):
    f = tmp_path / "one.jsonl"
    f.write_text('{"prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13], "max_new_tokens": 4}\n')
    rc, out, _ = run_cli(capsys, "generate", "--model", tiny_llama, "--prompt-file", str(f), "--block-size", "4",
                         "--ignore-eos")
    assert rc == 0
    h = json.loads(out)["stats"]["health"]
    # 9 prompt tokens + 3 generated ones cached = 12 tokens: 3 blocks allocated, none evicted; nothing reused.
    assert (h["eviction_rate"]["allocated"], h["eviction_rate"]["evicted"], h["eviction_rate"]["all"]) == (3, 0, 0.0)
    assert h["prefix_hit_rate"]["all"] == 0.0 and h["prefix_hit_rate"]["prompt_tokens"] == 9
    assert h["grades"]["prefix_hit_rate"]["all"] == "red" and h["grades"]["eviction_rate"]["all"] == "green"
    assert h["targets"] == {"prefix_hit_rate": 0.75, "block_utilization": 0.6, "eviction_rate": 0.05}
    assert h["leaks"]["checks"] == 2 and h["leaks"]["blocks"] == 0
    assert h["lock_wait"]["step"]["n"] == h["bandwidth"]["steps"] + 1  # every step; every one but the prefill decodes
    assert 0 < h["block_utilization"]["all"] <= 1.0
    assert h["throughput"]["drops"] == 0 and h["eviction_check"]["warnings"] == 0


def test_bench_prints_and_reports_health_per_config(tiny_llama, capsys):
    argv = ["--model", tiny_llama, "--trace", TRACE, "--time-scale", "0", "--max-new-tokens-cap", "4",
            "--sweep", "block_size=8,16"]
    assert run_sweep(bench_args(*argv, "--json")) == 0
    res = json.loads(capsys.readouterr().out)
    for label in ("block_size=8", "block_size=16"):
        h = res["health"][label]
        assert h["leaks"]["blocks"] == 0 and set(h["grades"]) == {"prefix_hit_rate", "block_utilization",
                                                                  "eviction_rate"}
        row = next(r for r in res["rows"] if r["config"] == label)
        assert h["prefix_hit_rate"]["all"] == row["prefix_hit_rate"]
    assert run_sweep(bench_args(*argv)) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("health ")]
    assert [line.split(":")[0] for line in lines] == ["health block_size=8", "health block_size=16"]
    assert all("prefix hit" in line and "(≥ 75 %:" in line and "leaks 0" in line for line in lines)
