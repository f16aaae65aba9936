"""Workload replay and config sweeps (`kvscope bench --trace/--workload --sweep ...`) on the tiny Llama."""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import struct

import pytest

from app.cli import _add_cache_flags, _add_model_flags
from app.bench.sweep import add_sweep_flags, run_sweep
from app.bench.sweep_report import BIN_EDGES_S
from engine.workloads.requests import load_trace

TRACE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "assets", "example_trace.jsonl")


def bench_args(*argv: str) -> argparse.Namespace:
    """The `kvscope bench` flags the sweep reads, parsed as the CLI would."""
    p = argparse.ArgumentParser(prog="kvscope bench")
    p.add_argument("--json", action="store_true")
    _add_model_flags(p)
    _add_cache_flags(p)
    add_sweep_flags(p)
    return p.parse_args(list(argv))


def sweep_json(capsys, *argv: str) -> tuple[dict, str]:
    """The --json object and what went to stderr."""
    assert run_sweep(bench_args(*argv, "--json")) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err


def test_example_trace_has_every_kind_of_request():
    reqs = load_trace(TRACE)
    assert 12 <= len(reqs) <= 20
    assert max(r.arrival_s for r in reqs) <= 10.5
    assert {"chat", "turn", "document", "nbest", "fork"} <= {r.kind for r in reqs}
    sessions = [r.session for r in reqs]
    assert sum(1 for s in set(sessions) if sessions.count(s) >= 3) >= 2  # two sessions with 3 turns
    firsts = [r.prompt for r in reqs if r.kind == "chat" and r.prompt.startswith("You are Quill")]
    assert len(firsts) >= 2 and len({p.split("\n\n")[0] for p in firsts}) == 1  # a shared system prompt
    fork = next(r for r in reqs if r.kind == "fork")
    assert fork.fork_of in sessions[:sessions.index(fork.session)]
    # A returning user: a turn more than 6 s after the session's previous request.
    by = {}
    gaps = []
    for r in reqs:
        if r.session in by:
            gaps.append(r.arrival_s - by[r.session])
        by[r.session] = r.arrival_s
    assert max(gaps) >= 6.0


def test_example_trace_replays_in_real_time_with_forks_and_demotion(tiny_llama, capsys):
    # Time slowed 10x: the returning user's ~6 s idle gap becomes ~60 s, far longer than this run computes
    # however loaded the machine, so it can only have been skipped, not waited out or filled with work.
    res, err = sweep_json(capsys, "--model", tiny_llama, "--trace", TRACE, "--max-new-tokens-cap", "8",
                          "--time-scale", "0.1")
    (row,) = res["rows"]
    assert row["config"] == "base" and res["configs"][0]["label"] == "base"
    assert row["requests"] == 15 and row["finished"] == 15 and row["refused"] == 0
    assert row["generated_tokens"] > 0 and row["tokens_per_s"] > 0
    assert row["forked"] == 1  # the fork shared its live parent's blocks (seq_cp)
    assert row["prefix_hit_rate"] > 0  # later turns and users reuse the cached prefixes
    # The returning user was idle ~6 s > demote_after_s (5 s): the clock skipped the gap, blocks were demoted.
    assert row["demotions"] > 0
    assert row["idle_skipped_s"] >= 30.0 and row["wall_s"] < row["idle_skipped_s"]
    assert 0 < row["ttft_p50_ms"] <= row["ttft_p95_ms"] and 0 < row["itl_p50_ms"] <= row["itl_p95_ms"]
    assert "\r[sweep] config 1/1 base" in err and "requests 15/15" in err


def test_two_by_two_sweep_table_csv_json_and_plot_agree(tiny_llama, tmp_path, capsys):
    out_csv, out_png = tmp_path / "sweep.csv", tmp_path / "sweep.png"
    argv = ["--model", tiny_llama, "--trace", TRACE, "--time-scale", "0", "--max-new-tokens-cap", "6",
            "--sweep", "block_size=8,16", "--sweep", "kv_dtype=fp32,int8", "--csv", str(out_csv),
            "--plot", str(out_png)]
    assert run_sweep(bench_args(*argv, "--json")) == 0
    out = capsys.readouterr()
    res = json.loads(out.out)
    labels = ["block_size=8 kv_dtype=fp32", "block_size=8 kv_dtype=int8", "block_size=16 kv_dtype=fp32",
              "block_size=16 kv_dtype=int8"]
    assert [r["config"] for r in res["rows"]] == labels
    assert [(c["block_size"], c["kv_dtype"]) for c in res["configs"]] == [(8, "fp32"), (8, "int8"), (16, "fp32"),
                                                                          (16, "int8")]
    assert all(r["finished"] == r["requests"] == 15 and r["tokens_per_s"] > 0 for r in res["rows"])
    # int8 blocks are smaller, so the same work peaks at fewer device bytes.
    peak = {r["config"]: r["peak_device_bytes"] for r in res["rows"]}
    assert peak[labels[1]] < peak[labels[0]] and peak[labels[3]] < peak[labels[2]]
    assert "[sweep] config 4/4" in out.err and "\r" in out.err

    with open(out_csv, newline="") as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == 4
    for c, j in zip(csv_rows, res["rows"]):
        assert list(c) == list(j)
        for k, v in j.items():
            if v is None:
                assert c[k] == ""
            elif isinstance(v, str):
                assert c[k] == v
            else:
                assert math.isclose(float(c[k]), v, rel_tol=1e-9), k

    data = out_png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 1500 and height >= 1200 and 30_000 < len(data) < 3_000_000

    # The same run as a table: one aligned line per config under a header with units.
    assert run_sweep(bench_args(*argv[:-4])) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("config"))
    assert "tok/s" in lines[header] and "TTFT p50/p95 ms" in lines[header] and "peak dev/host MiB" in lines[header]
    body = lines[header + 2:header + 6]
    assert [line.split("  ")[0].strip() for line in body] == labels
    assert len({len(line) for line in lines[header:header + 6]}) <= 2  # aligned columns


@pytest.mark.parametrize("sweep, needle", [
    ("block_sizee=8,16", "unknown knob"),
    ("block_size=0,16", "block_size: 0 is outside"),
    ("kv_dtype=fp32,fp33", "kv_dtype: unknown dtype 'fp33'"),
    ("policy=lru,nope", "policy: 'nope' is not one of"),
    ("block_size", "expected KNOB=V1,V2"),
])
def test_a_bad_sweep_is_a_clear_error_before_the_model_loads(sweep, needle, tmp_path, capsys):
    # --model names nothing: the sweep must be refused before any model is looked for.
    args = bench_args("--model", str(tmp_path / "no-model"), "--trace", TRACE, "--sweep", sweep)
    assert run_sweep(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvscope: error: --sweep") and needle in err and "Traceback" not in err


def test_a_bad_trace_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "session": "a", "prompt": "hi", "max_new_tokens": 4}\n{"arrival_s": 1}\n')
    assert run_sweep(bench_args("--trace", str(bad))) == 2
    assert "bad.jsonl:2: missing 'session'" in capsys.readouterr().err


def test_residency_histograms_fill_when_a_small_cache_evicts(tiny_llama, capsys):
    # fp32 blocks of 16 tokens are 8 KiB on the tiny model: 32 device blocks, 8 host blocks, for 4 users
    # whose prompts are ~16 blocks each.
    res, _ = sweep_json(capsys, "--model", tiny_llama, "--workload", "chat", "--requests", "12", "--time-scale", "0",
                        "--max-new-tokens-cap", "8", "--device-budget-mb", "0.25", "--host-budget-mb", "0.0625")
    (row,) = res["rows"]
    assert row["finished"] == row["requests"] == 12
    assert row["evictions"] > 0 and row["prefix_hit_rate"] > 0
    hists = res["residency"]["base"]
    for key in ("reuse_gap", "age_at_hit", "age_at_eviction", "lifetime"):
        h = hists[key]
        assert h["n"] > 0 and sum(h["counts"]) == h["n"], key
        assert h["edges_s"] == list(BIN_EDGES_S) and len(h["counts"]) == len(BIN_EDGES_S) - 1
        assert 0 <= h["p50_s"] <= h["p90_s"]
        assert row[f"{key}_p50_s"] == pytest.approx(h["p50_s"])


def test_live_trace_replay_loops_and_matches_greedy(llama_model, llama_ref, tmp_path):
    """The window's trace workload: requests start at their arrival times (scaled by intensity), a later
    turn waits for its session's reply, a fork shares its parent's blocks, every plain request's tokens equal
    transformers' greedy ones, and a finished trace starts its next round."""
    from engine.workloads.trace_workload import TraceWorkload
    from tiny_models import prompts
    from engine.config import CacheConfig, EngineOptions
    from engine.runtime.engine import Engine

    ps = prompts(7, [12, 30, 9])
    lines = [{"arrival_s": 0.0, "session": "a", "prompt_tokens": ps[0], "max_new_tokens": 6},
             {"arrival_s": 0.5, "session": "b", "prompt_tokens": ps[1], "max_new_tokens": 8},
             {"arrival_s": 0.5, "session": "n", "prompt_tokens": ps[2], "max_new_tokens": 6, "kind": "nbest",
              "n_forks": 1},
             {"arrival_s": 0.6, "session": "n/1", "prompt_tokens": ps[2], "max_new_tokens": 6, "kind": "fork",
              "fork_of": "n"},
             {"arrival_s": 2.0, "session": "a", "prompt_tokens": ps[1][:5], "max_new_tokens": 4, "kind": "turn"}]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    now = [0.0]
    eng = Engine(llama_model, CacheConfig(block_size=4), EngineOptions(context_limit=256), clock=lambda: now[0])
    w = TraceWorkload(eng, str(path))
    w.set_intensity(2.0)  # the trace's 2.0 s arrive after 1.0 s
    started_at: dict[str, float] = {}
    for _ in range(400):
        w.tick(eng.clock())
        for s in eng.seqs.values():
            started_at.setdefault(f"{s.label}#{s.id}", now[0])
        if eng.has_work():
            w.observe(eng.step())
        now[0] += 0.01
        if w.rounds == 2:
            break
    assert w.rounds == 2, w.stats()
    first_round = sorted(eng.seqs.values(), key=lambda s: s.id)[:5]
    by_label = {}
    for s in first_round:
        by_label.setdefault(s.label, []).append(s)
    assert [s.output for s in by_label["b"]] == [llama_ref.greedy(ps[1], 8)]
    assert by_label["a"][0].output == llama_ref.greedy(ps[0], 6)
    turn = by_label["a"][1]  # the second turn: the first turn's prompt and reply, then its own tokens
    assert turn.tokens[: len(ps[0]) + 6] == ps[0] + by_label["a"][0].output
    assert started_at[f"a#{turn.id}"] >= 1.0 - 1e-9  # arrival 2.0 s at intensity 2
    assert started_at[f"b#{by_label['b'][0].id}"] >= 0.25 - 1e-9
    st = w.stats()
    assert st["forked"] >= 1 and st["refused"] == 0
    assert st["finished"] >= 5 and st["requests"] == 10


def test_live_trace_replay_refuses_a_bad_file_by_name(llama_model, tmp_path):
    from app.window.runner import open_trace_workload
    from engine.workloads.trace_workload import TraceWorkload
    from engine.config import CacheConfig
    from engine.runtime.engine import Engine
    from engine.errors import RequestError

    eng = Engine(llama_model, CacheConfig(block_size=4))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 1}\n{"arrival_s": 0, "session": "a", "prompt": "hi", "max_new_tokens": "3"}\n')
    with pytest.raises(RequestError, match=r"bad.jsonl:1: missing 'session' \(and 1 more lines that cannot run\); nothing to replay"):
        TraceWorkload(eng, str(bad))
    # A bad line beside good ones is named and skipped; the rest is replayed (tests/app/test_user_files.py).
    bad.write_text('{"arrival_s": 0, "session": "a", "prompt": "hi", "max_new_tokens": 3}\n{"arrival_s": 1}\n')
    said: list[str] = []
    w = open_trace_workload(eng, str(bad), say=said.append)
    assert w.n_requests == 1 and w.skipped == [f"{bad}:2: missing 'session'"]
    assert said[-1] == f"kvscope: {bad}: 1 of 2 lines skipped; replaying the other 1"
    with pytest.raises(RequestError, match="nope.jsonl"):
        TraceWorkload(eng, str(tmp_path / "nope.jsonl"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(RequestError, match="no requests"):
        TraceWorkload(eng, str(empty))


def test_live_trace_clock_stands_still_while_paused(llama_model, tmp_path):
    from engine.workloads.trace_workload import TraceWorkload
    from engine.config import CacheConfig
    from engine.runtime.engine import Engine

    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"arrival_s": a, "session": f"s{i}", "prompt_tokens": [5, 6, 7],
                                        "max_new_tokens": 2}) + "\n" for i, a in enumerate((0.0, 3.0, 6.0))))
    now = [0.0]
    eng = Engine(llama_model, CacheConfig(block_size=4), clock=lambda: now[0])
    w = TraceWorkload(eng, str(path))
    w.tick(0.0)
    assert len(eng.seqs) == 1
    w.paused = True  # the runner stops ticking a paused workload; 60 s pass
    now[0] = 60.0
    w.paused = False
    w.tick(60.0)
    assert len(eng.seqs) == 1  # nothing that was due during the pause arrives in a burst
    for t in (60.5, 61.0, 61.5, 62.0, 62.5, 63.1):
        w.tick(t)
    assert len(eng.seqs) == 2  # 3.0 s of trace time later, the second request


def test_live_change_ab_reports_the_split_and_the_memory_held(tiny_llama, capsys):
    """--live-change: a control run and a run reconfigured mid-workload, the prefix hit rate counted apart before and
    after the change's step in both, and what the change held (a block-size change re-lays a layer at a time)."""
    res, _ = sweep_json(capsys, "--model", tiny_llama, "--trace", TRACE, "--time-scale", "0", "--max-new-tokens-cap",
                        "6", "--live-change", "block_size=4", "--change-at-step", "12")
    assert [r["config"] for r in res["rows"]] == ["control", "live block_size=4"]
    control, live = res["live_change"]["control"], res["live_change"]["live block_size=4"]
    for lc in (control, live):
        assert lc["at_step"] == 12 and lc["error"] is None
        assert 0 <= lc["prefix_before"] <= 1 and 0 <= lc["prefix_after"] <= 1
    assert control["changes"] == {} and "peak_extra_bytes" not in control
    assert live["changes"] == {"block_size": "4"}
    assert 0 < live["peak_extra_bytes"] < max(live["old_tier_bytes"], live["new_tier_bytes"])
    assert all(row["finished"] == row["requests"] for row in res["rows"])


@pytest.mark.parametrize("change, needle", [
    ("block_size=0", "block_size: 0 is outside"),
    ("block_size=8,16", "expected KNOB=V"),
    ("block_size=16", "that is the base config already"),
])
def test_a_bad_live_change_is_a_clear_error_before_the_model_loads(change, needle, tmp_path, capsys):
    args = bench_args("--model", str(tmp_path / "no-model"), "--trace", TRACE, "--live-change", change)
    assert run_sweep(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvscope: error: --live-change") and needle in err and "Traceback" not in err
