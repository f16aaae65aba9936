"""`python3 -m app.gpu_check --dry-run`: the prepared CUDA check's every part run on the CPU at toy sizes. It checks
the code paths a lent GPU will take (the numbers are the CPU's, and no target counts as met): every target of issue 24
item 2 is in `targets`, each self-check passed and each injected fault was caught on this machine, tokens equal."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_dry_run_reports_every_target_and_self_check(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "app.gpu_check", "--dry-run", "--budget-s", "3000", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and not report["errors"], (report["errors"], proc.stderr[-3000:])
    assert set(report["targets"]) == {"batch8_vs_generate_batch", "batch1_decode_vs_generate",
                                      "launches_per_decode_step_with_graphs", "paged_decode_hbm_share_8x8k",
                                      "self_checks_passed"}
    assert all(t["met"] is False for t in report["targets"].values())  # a dry run meets nothing
    assert report["targets"]["batch8_vs_generate_batch"]["value"] is not None
    sc = report["self_checks"]
    assert {f: v["state"] for f, v in sc["features"].items()} == dict.fromkeys(
        ("attention", "graphs", "migration", "stream"), "passed")
    assert all(f["caught"] and f["fell_back"] and f["tokens_equal"] and len(f["said"]) == 1
               for f in sc["faults"].values()) and len(sc["faults"]) == 4
    assert "engine_start_s" in sc["second_process"]
    failed = [k for k, v in report["checks"].items() if not v]
    assert not failed and proc.returncode == 0, failed
    assert set(report["timings"]) >= {"setup", "self_checks", "exactness", "graphs", "bench", "bench_long", "bf16",
                                      "stream_overlap"}
    assert report["skipped"] == {"cuda_tests": "a dry run (tests/runtime/test_cuda.py needs CUDA)"}
