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
