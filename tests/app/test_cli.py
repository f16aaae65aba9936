"""The CLI as a user meets it: concurrent requests on a tiny Qwen2 directory, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvscope_cli import run_cli
from tiny_models import Reference, prompts


def kvscope(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=600)
    if ok:
        assert out.returncode == 0, out.stderr
    return out


def test_six_concurrent_requests_on_a_qwen2_directory(tiny_qwen2, tmp_path, capsys):
    ps = prompts(20, [3, 17, 40, 66, 9, 120])
    f = tmp_path / "req.jsonl"
    f.write_text("".join(json.dumps({"prompt": p, "max_new_tokens": 10 + i}) + "\n" for i, p in enumerate(ps)))
    rc, out, err = run_cli(capsys, "generate", "--model", tiny_qwen2, "--prompt-file", str(f), "--ignore-eos",
                           "--block-size", "4")
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    ref = Reference(tiny_qwen2)
    assert [r["token_ids"] for r in rows] == [ref.greedy(p, 10 + i) for i, p in enumerate(ps)]


def test_bad_input_gets_a_clear_error(tiny_llama, tmp_path, capsys):
    cases = [
        (["generate", "hi", "--model", str(tmp_path / "nope")], "model not found"),
        (["generate", "hi", "--model", tiny_llama, "--block-size", "0"], "block_size"),
        (["generate", "hi", "--model", tiny_llama, "--decay", "7"], "decay"),
        (["generate", "hi " * 3000, "--model", tiny_llama, "--device-budget-mb", "0.05"], "context limit of 512"),
        (["generate", "hi " * 300, "--model", tiny_llama, "--device-budget-mb", "0.05", "--host-budget-mb", "0.05"],
         "device and host tiers hold"),
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    cases.append((["generate", "--prompt-file", str(bad), "--model", tiny_llama], "bad.jsonl:2"))
    for args, needle in cases:
        rc, _, err = run_cli(capsys, *args)  # in this process: an exception would fail the test, not print a traceback
        assert rc == 2, (args, err)
        assert needle in err, (args, err)


def test_info_prints_the_sizing_formula(tiny_llama, capsys):
    rc, out, err = run_cli(capsys, "info", "--model", tiny_llama, "--batch", "4", "--context", "100", "--json")
    assert rc == 0, err
    info = json.loads(out)
    # 4 x 100 x 2 layers x 2 kv heads x 16 head dim x 2 x 4 bytes
    assert info["sizing"]["bytes"] == 4 * 100 * 2 * 2 * 16 * 2 * 4
    assert info["bytes_per_token"]["fp32"] == 2 * 2 * 16 * 2 * 4
    # int8: a code per element and an fp16 scale per token and head: (16 + 2) / (16 x 4) of fp32
    assert info["bytes_per_token"]["int8"] == info["bytes_per_token"]["fp32"] * 18 / 64
    assert info["memory"]["gpu"]["available"] is False
    # the kernels this CPU runs: tiny Llama's 4 heads on 2 kv heads, head dim 16
    from engine.attention import attn_ir

    assert info["kernels"]["attention_blocks"] == attn_ir.describe(2, 16)
    assert info["kernels"]["attention_blocks"].startswith(
        "LLVM IR kernels" if attn_ir.llvm is not None else "numba's loops (")
    # the pages the weights and the pool are on: every byte counted once, those advised and those on 2 MiB pages
    # (with THP "always", unadvised too) within it
    from engine import hugepages

    pages = info["pages"]
    assert pages["mode"] == hugepages.describe()
    for kind in ("weights", "kv_pool"):
        if pages[kind] is not None:
            m = pages[kind]
            assert 0 <= m["huge"] <= m["bytes"] and 0 <= m["advised"] <= m["bytes"]
    assert pages["weights"] is None or pages["weights"]["bytes"] == info["model"]["weights_bytes"]


def test_info_on_a_model_whose_every_layer_slides_sizes_its_window(tiny_mistral, capsys):
    """One window group (Mistral, window 24): each sequence holds min(context, 23 + chunk) tokens, not the context."""
    args = ("info", "--model", tiny_mistral, "--batch", "4", "--context", "2000")
    rc, out, err = run_cli(capsys, *args, "--json")
    assert rc == 0, err
    (group,) = json.loads(out)["kv_groups"]
    assert group["window"] == 24 and group["tokens_per_sequence"] == 23 + 1024  # the default prompt chunk
    assert group["bytes"] == 4 * (23 + 1024) * 2 * 2 * 16 * 2 * 4
    rc, out, err = run_cli(capsys, *args)
    assert rc == 0 and "every layer slides" in out and "sliding window 24 · 2 layers" in out
    rc, out, err = run_cli(capsys, *args, "--kv-groups", "off", "--json")
    (group,) = json.loads(out)["kv_groups"]
    assert group["window"] is None and group["tokens_per_sequence"] == 2000


def test_plain_kvscope_without_a_display_explains_headless():
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    out = subprocess.run([sys.executable, "-m", "app.cli"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2
    assert "--headless" in out.stderr and "Traceback" not in out.stderr


def test_headless_screenshot_and_open_snapshot_round_trip(tiny_llama, tmp_path):
    import numpy as np

    from engine.telemetry import snapshot_io
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
    from engine.telemetry import snapshot_io
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


def test_three_thousand_requests_stream_in_input_order_with_bounded_memory(tiny_llama, tmp_path, capsys, monkeypatch):
    # Guards against: finished sequences past keep_finished=1024 were forgotten before their output was read
    # (KeyError: 0, exit 1, nothing printed). Now results stream out in input order as they finish. 3,000 requests:
    # nearly three times keep_finished (10,000 showed nothing more, in 3x the time).
    import app.commands as commands

    f = tmp_path / "many.jsonl"
    f.write_text("".join(json.dumps({"prompt": [3 + i % 50, 7, 9 + i % 13], "max_new_tokens": 1 + i % 3}) + "\n"
                         for i in range(3_000)))
    seen = {"max_seqs": 0, "in_flight_at_first_line": None}
    printed: list[str] = []
    real_open = commands.open_engine

    def open_engine(args):
        engine, load_s = real_open(args)
        step = engine.step

        def watched_step():
            seen["max_seqs"] = max(seen["max_seqs"], len(engine.seqs))
            printed.append(capsys.readouterr().out)
            if "".join(printed) and seen["in_flight_at_first_line"] is None:
                seen["in_flight_at_first_line"] = len(engine.seqs)
            return step()

        engine.step = watched_step
        return engine, load_s

    monkeypatch.setattr(commands, "open_engine", open_engine)
    rc, out, err = run_cli(capsys, "generate", "--model", tiny_llama, "--prompt-file", str(f), "--ignore-eos",
                           "--block-size", "4")
    assert rc == 0, err
    rows = [json.loads(line) for line in ("".join(printed) + out).splitlines()]
    assert [r["line"] for r in rows] == list(range(1, 3_001))
    assert [len(r["token_ids"]) for r in rows] == [1 + i % 3 for i in range(3_000)]
    assert seen["in_flight_at_first_line"]  # the first line came out while requests were still running
    assert seen["max_seqs"] <= 4 * 16  # the in-flight window: finished ones are dropped once printed


def bad_value_cases(tmp_path) -> list[tuple[list[str], str]]:
    def lines(name: str, *rows: str | bytes) -> str:
        p = tmp_path / name
        p.write_bytes(b"".join((r if isinstance(r, bytes) else r.encode()) + b"\n" for r in rows))
        return str(p)

    ok = '{"prompt": [5, 6, 7]}'
    return [
        (["hi", "--n-keep", "-5"], "n_keep: -5"),
        (["hi", "--n-keep", "600"], "n_keep: 600"),
        (["hi", "--context-limit", "1"], "context_limit: 1"),
        (["hi", "--context-limit", "100000"], "context_limit: 100000"),
        (["hi", "--temperature", "-1"], "temperature: -1.0"),
        (["hi", "--temperature", "nan"], "temperature: nan"),
        (["hi", "--top-p", "0"], "top_p: 0.0"),
        (["hi", "--top-p", "2"], "top_p: 2.0"),
        (["hi", "--top-p", "nan"], "top_p: nan"),
        (["hi", "--max-new-tokens", "0"], "max_new_tokens: 0"),
        (["hi", "--max-new-tokens", "-1"], "max_new_tokens: -1"),
        (["hi", "--seed", str(2**70)], "seed:"),
        (["hi", "--device-budget-mb", "1000000"], "GiB of CPU memory but"),
        (["hi", "--record-trace", "/nonexistent/x.npz"], "--record-trace /nonexistent/x.npz: no such folder"),
        (["--prompt-file", lines("f.jsonl", ok, '{"prompt": [1, 2.0]}')], "f.jsonl:2: token 1 of the prompt is 2.0"),
        (["--prompt-file", lines("b.jsonl", '{"prompt": [true]}')], "b.jsonl:1: token 0 of the prompt is True"),
        (["--prompt-file", lines("s.jsonl", ok, ok, '{"prompt": ["7"]}')], "s.jsonl:3: token 0 of the prompt is '7'"),
        (["--prompt-file", lines("n.jsonl", '{"prompt": [[1, 2]]}')], "n.jsonl:1: token 0 of the prompt is [1, 2]"),
        (["--prompt-file", lines("v.jsonl", ok, '{"prompt": [99999999]}')], "v.jsonl:2: token 0 of the prompt is "
                                                                          "99999999, outside the vocabulary"),
        (["--prompt-file", lines("u.jsonl", ok, b'{"prompt": "caf\xe9"}')], "u.jsonl:2: not UTF-8 text"),
        (["--prompt-file", lines("m.jsonl", '{"prompt": "x", "max_new_tokens": true}')], "m.jsonl:1: max_new_tokens"),
        (["--prompt-file", lines("c.jsonl", '{"prompt": "x", "chat": "yes"}')], "c.jsonl:1: chat must be"),
        (["--prompt-file", lines("k.jsonl", '{"prompt": "x", "max_tokens": 5}')], "k.jsonl:1: unknown key(s) max_tokens"),
        (["--prompt-file", lines("e.jsonl", '{"prompt": []}')], "e.jsonl:1: empty prompt"),
        (["--prompt-file", lines("d.jsonl", "[" * 100_000)], "d.jsonl:1: not readable JSON (nested too deeply)"),
        (["--prompt-file", str(tmp_path / "missing.jsonl")], "missing.jsonl: No such file"),
        (["--prompt-file", str(tmp_path)], "is a directory, not a regular file"),
    ]


def test_bad_values_get_one_clear_line_and_exit_2(tiny_llama, tmp_path, capsys):
    for args, needle in bad_value_cases(tmp_path):
        rc, out, err = run_cli(capsys, "generate", *args, "--model", tiny_llama)
        assert rc == 2, (args, err)
        assert needle in err and "Traceback" not in err, (args, err)
        assert err.count("error:") == 1 and not out, (args, err, out)


def test_record_trace_to_a_bad_path_fails_before_the_model_loads(tmp_path, capsys):
    # No --model can even load here: the path is refused first.
    rc, _, err = run_cli(capsys, "generate", "hi", "--model", str(tmp_path / "no-model"), "--record-trace",
                         str(tmp_path / "no" / "x.npz"))
    assert rc == 2 and "no such folder" in err and "model not found" not in err


def test_a_run_that_cannot_progress_says_so_and_prints_no_answer(tiny_llama, tmp_path, capsys, monkeypatch):
    from engine.runtime.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "_place", lambda self, *a: None)  # tiers with no room for a step, ever
    rc, out, err = run_cli(capsys, "generate", "--model", tiny_llama, "--json", "hello there", "--block-size", "1",
                           "--max-new-tokens", "8")
    assert rc == 2 and out == "" and "no sequence made progress" in err
    f = tmp_path / "two.jsonl"
    f.write_text('{"prompt": [5, 6, 7]}\n{"prompt": [8, 9]}\n')
    rc, out, err = run_cli(capsys, "generate", "--model", tiny_llama, "--prompt-file", str(f), "--block-size", "1")
    rows = [json.loads(line) for line in out.splitlines()]
    assert rc == 2 and [r["line"] for r in rows] == [1, 2]
    assert all("error" in r and "text" not in r and "token_ids" not in r for r in rows)
    assert "two.jsonl:1:" in err and "two.jsonl:2:" in err


def test_generate_json_says_why_its_tokens_missed(tiny_llama, capsys):
    rc, out, err = run_cli(capsys, "generate", "--model", tiny_llama, "--json", "hello there, how are you today?",
                           "--block-size", "4", "--max-new-tokens", "4")
    assert rc == 0, err
    stats = json.loads(out)["stats"]
    engine = stats["engine_why_missed"]
    assert engine["lookup_tokens"] == stats["prompt_tokens"] == engine["lookup_missed"]  # nothing cached before
    assert sum(engine["prompt"].values()) == engine["lookup_missed"] and engine["prompt"]["partial"] > 0
    assert sum(engine["reads"].values()) == engine["read_tokens_missed"] == stats["read_tokens_missed"]
    assert stats["why_missed"] == {"prompt": engine["prompt"], "reads": engine["reads"]}  # the one request's


def test_help_lists_every_subcommand_and_every_sampling_flag_says_what_it_does(capsys):
    from app.cli import SUBCOMMANDS

    rc, top, _ = run_cli(capsys, "--help")
    assert rc == 0
    for sub in SUBCOMMANDS:
        assert sub in top, sub  # every subcommand is listed in the top-level help
    gen = " ".join(run_cli(capsys, "generate", "-h")[1].split("options:", 1)[1].split())
    for flag, words in (("--max-new-tokens N", "generated tokens"), ("--temperature T", "logits divided by T"),
                        ("--top-p P", "nucleus"), ("--seed SEED", "repeatable")):
        assert f"{flag} " in gen and words in gen.split(flag, 1)[1][:200], flag


def test_every_subcommand_prints_its_help(capsys):
    """Each subcommand's --help renders (a knob's help text with a bare '%' once made `bench --help` a traceback)."""
    from app.cli import SUBCOMMANDS

    for sub in SUBCOMMANDS:
        rc, out, err = run_cli(capsys, sub, "--help")
        assert rc == 0 and "usage:" in out, (sub, err[-500:])


def test_counts_out_of_range_are_usage_errors(capsys):
    # Guards against: `info --batch -3` printed a sizing of "-270.0 MiB" and exited 0.
    for args, flag in ((["info", "--batch", "-3"], "--batch"), (["info", "--context", "0"], "--context"),
                       (["bench", "--batch", "0"], "--batch"), (["bench", "--quality-prompts", "x"], "--quality-prompts"),
                       (["bench", "--long", "-1"], "--long")):
        rc, _, err = run_cli(capsys, *args)
        assert rc == 2 and flag in err and "expected an integer from" in err, (args, err)


def test_replay_flags_without_a_workload_are_refused_before_anything_runs(capsys, monkeypatch):
    # Guards against: `bench --sweep block_size=8` ignored the sweep and started the multi-minute --compare hf run.
    import app.bench.throughput as throughput

    monkeypatch.setattr(throughput, "cmd_bench", lambda args: pytest.fail("the --compare run started"))
    for args in (["--sweep", "block_size=8"], ["--live-change", "kv_dtype=int8"], ["--csv", "x.csv"]):
        rc, _, err = run_cli(capsys, "bench", *args)
        assert rc == 2 and "give --workload NAME or --trace FILE.jsonl" in err and args[0] in err, (args, err)


def test_every_flag_says_what_it_does():
    """Every option of every subcommand has help text (guards against options without it, as bench's --batch,
    --prompt-tokens, --json ... were)."""
    import argparse

    from app.cli import build_parser

    from app.attach import build_parser as attach_parser
    from app.cli import window_parser
    from app.whatif.policy_lab import build_parser as lab_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parsers = dict(sub.choices, window=window_parser(), attach=attach_parser(), **{"policy-lab": lab_parser()})
    bare = {name: [a.option_strings[0] for a in p._actions if a.option_strings and not a.help]
            for name, p in parsers.items()}
    assert bare == {name: [] for name in parsers}
