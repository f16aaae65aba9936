"""`python3 -m app.stress.gpu_check --dry-run`: the prepared CUDA check's parts run on the CPU at toy sizes. It checks the
code paths a lent GPU will take (the numbers are the CPU's, and no target counts as met): every target of issue 24
item 2 is in `targets`; each self-check passed and each injected fault was caught on this machine, tokens equal; and
`bench --long` ran. The other parts (exactness, graphs, bench --compare, bf16, the stream A/B) are older and each
ran in a full dry run (`--dry-run` alone; ~20 minutes on this 2-CPU machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_dry_run_reports_every_target_and_self_check(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "app.stress.gpu_check", "--dry-run", "--only", "self_checks,bench_long",
                           "--budget-s", "3000", "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=3000)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and not report["errors"], (report["errors"], proc.stderr[-3000:])
    assert set(report["targets"]) == {"batch8_vs_generate_batch", "batch1_decode_vs_generate",
                                      "launches_per_decode_step_with_graphs", "paged_decode_hbm_share_8x8k",
                                      "self_checks_passed"}
    assert all(t["met"] is False for t in report["targets"].values())  # a dry run meets nothing
    assert report["targets"]["self_checks_passed"]["value"] == 4
    sc = report["self_checks"]
    assert {f: v["state"] for f, v in sc["features"].items()} == dict.fromkeys(
        ("attention", "graphs", "migration", "stream"), "passed")
    assert len(sc["faults"]) == 4 and all(
        f["caught"] and f["fell_back"] and f["tokens_equal"] and len(f["said"]) == 1 for f in sc["faults"].values())
    assert "engine_start_s" in sc["second_process"]
    assert report["bench_long"]["decode_steps"] > 0 and "paged_decode_gbps" not in report["bench_long"]  # CUDA only
    assert all(report["checks"].values()) and proc.returncode == 0, report["checks"]
    assert set(report["skipped"]) == {"exactness", "graphs", "bench", "bf16", "stream_overlap"}
