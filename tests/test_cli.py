"""The CLI as a user meets it: concurrent requests on a tiny Qwen2 directory, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import Reference, prompts


def kvscope(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=600)
    if ok:
        assert out.returncode == 0, out.stderr
    return out


def test_six_concurrent_requests_on_a_qwen2_directory(tiny_qwen2, tmp_path):
    ps = prompts(20, [3, 17, 40, 66, 9, 120])
    f = tmp_path / "req.jsonl"
    f.write_text("".join(json.dumps({"prompt": p, "max_new_tokens": 10 + i}) + "\n" for i, p in enumerate(ps)))
    out = kvscope("generate", "--model", tiny_qwen2, "--prompt-file", str(f), "--ignore-eos", "--block-size", "4")
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    ref = Reference(tiny_qwen2)
    assert [r["token_ids"] for r in rows] == [ref.greedy(p, 10 + i) for i, p in enumerate(ps)]


def test_bad_input_gets_a_clear_error(tiny_llama, tmp_path):
    cases = [
        (["generate", "hi", "--model", str(tmp_path / "nope")], "model not found"),
        (["generate", "hi", "--model", tiny_llama, "--block-size", "0"], "block_size"),
        (["generate", "hi", "--model", tiny_llama, "--decay", "7"], "decay"),
        (["generate", "hi " * 3000, "--model", tiny_llama, "--device-budget-mb", "0.05"], "device tier"),
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    cases.append((["generate", "--prompt-file", str(bad), "--model", tiny_llama], "bad.jsonl:2"))
    for args, needle in cases:
        out = kvscope(*args, ok=False)
        assert out.returncode == 2, (args, out.stderr)
        assert needle in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)


def test_info_prints_the_sizing_formula(tiny_llama):
    out = kvscope("info", "--model", tiny_llama, "--batch", "4", "--context", "100", "--json")
    info = json.loads(out.stdout)
    # 4 x 100 x 2 layers x 2 kv heads x 16 head dim x 2 x 4 bytes
    assert info["sizing"]["bytes"] == 4 * 100 * 2 * 2 * 16 * 2 * 4
    assert info["bytes_per_token"]["fp32"] == 2 * 2 * 16 * 2 * 4
    assert info["bytes_per_token"]["int8"] <= 0.27 * info["bytes_per_token"]["fp32"]
    assert info["memory"]["gpu"]["available"] is False


def test_plain_kvscope_without_a_display_explains_headless():
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    out = subprocess.run([sys.executable, "-m", "app.cli"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2
    assert "--headless" in out.stderr and "Traceback" not in out.stderr


def test_headless_screenshot_and_open_snapshot_round_trip(tiny_llama, tmp_path):
    import numpy as np

    from engine import snapshot_io

    png = tmp_path / "live.png"
    kvscope("--headless", "--screenshot", str(png), "--run-for", "4", "--model", tiny_llama)
    snap, extra = snapshot_io.load(str(tmp_path / "live.json"))
    assert png.stat().st_size > 10_000 and extra["png"] == "live.png"
    assert sum(int(np.count_nonzero(t.state)) for t in snap.tiers) > 0
    again = tmp_path / "again.png"
    kvscope("--headless", "--open-snapshot", str(tmp_path / "live.json"), "--screenshot", str(again), "--run-for", "1")
    snap2, _ = snapshot_io.load(str(tmp_path / "again.json"))
    for a, b in zip(snap.tiers, snap2.tiers):
        assert np.array_equal(a.state, b.state) and np.array_equal(a.owner, b.owner)
    assert snap2.config == snap.config and snap2.counters == snap.counters
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    out = kvscope("--headless", "--open-snapshot", str(bad), ok=False)
    assert out.returncode == 2 and "not a KV Scope snapshot" in out.stderr


def test_headless_window_replays_a_trace_and_refuses_a_bad_one(tiny_llama, tmp_path):
    from engine import snapshot_io

    trace = tmp_path / "mine.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": 0.2 * i, "session": f"mine-{i}", "prompt_tokens": p,
                                         "max_new_tokens": 400}) + "\n" for i, p in enumerate(prompts(5, [8, 20, 33]))))
    png = tmp_path / "replay.png"
    kvscope("--headless", "--screenshot", str(png), "--run-for", "3", "--model", tiny_llama, "--replay", str(trace))
    snap, _ = snapshot_io.load(str(tmp_path / "replay.json"))
    assert {"mine-0", "mine-1", "mine-2"} <= set(snap.seqs.labels)  # the trace's requests, not the demo's
    assert not any(label.startswith("chat") for label in snap.seqs.labels)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "session": "x", "prompt": "hi", "max_new_tokens": "many"}\n')
    out = kvscope("--headless", "--replay", str(bad), "--run-for", "1", ok=False)
    assert out.returncode == 2 and "bad.jsonl:1: max_new_tokens must be an integer" in out.stderr
    assert "Traceback" not in out.stderr
