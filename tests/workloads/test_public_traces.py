"""Mooncake and Bailian block-hash traces (engine/workloads/public_traces.py): files of our own making in each
format, read into the curves and, with synthesized tokens, into replays."""

from __future__ import annotations

import json

import numpy as np
import pytest

from app.whatif.policy_lab import main
from engine.lab.mrc import lru_curve
from engine.lab.whatif import block_stream
from engine.workloads.public_traces import BAILIAN_BLOCK, MOONCAKE_BLOCK, read_block_trace, synthesized_prompt
from engine.workloads.requests import load_trace, read_trace

MOONCAKE = [  # two requests share a 2-block prefix; the third is new; the fourth repeats the first's prefix
    {"timestamp": 0, "input_length": 1100, "output_length": 30, "hash_ids": [0, 1, 2]},
    {"timestamp": 250, "input_length": 1030, "output_length": 10, "hash_ids": [0, 1, 3]},
    {"timestamp": 700, "input_length": 600, "output_length": 500, "hash_ids": [4, 5]},
    {"timestamp": 900, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1]},
]
BAILIAN = [  # a two-turn chat (turn 2 carries turn 1's blocks) and a one-turn chat with the same system prompt
    {"chat_id": 11, "parent_chat_id": -1, "turn": 1, "timestamp": 0.0, "input_length": 40, "output_length": 8,
     "hash_ids": [100, 101, 102], "type": "text"},
    {"chat_id": 12, "parent_chat_id": -1, "turn": 1, "timestamp": 0.5, "input_length": 20, "output_length": 4,
     "hash_ids": [100, 200]},
    {"chat_id": 13, "parent_chat_id": 11, "turn": 2, "timestamp": 3.0, "input_length": 70, "output_length": 8,
     "hash_ids": [100, 101, 102, 103, 104]},
]


def _write(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return str(path)


def test_mooncake_stream_reads_hash_ids_then_new_output_blocks(tmp_path):
    reqs = read_block_trace(_write(tmp_path / "m.jsonl", MOONCAKE))
    assert [r.fmt for r in reqs] == ["mooncake"] * 4 and reqs[0].block_tokens == MOONCAKE_BLOCK
    assert [r.t_s for r in reqs] == [0.0, 0.25, 0.7, 0.9]
    s = block_stream(reqs)
    # request 3 writes ceil((600 + 500) / 512) - 2 = 1 output block, request 4 ceil(1025 / 512) - 2 = 1
    assert s.keys.tolist() == [0, 1, 2, 0, 1, 3, 4, 5, -1, 0, 1, -2]
    c = lru_curve(s.keys, [2, 3, 100], s.counted)
    # unbounded: hits are the re-reads of 0 and 1 (twice each)
    assert c.hit_rate[-1] == pytest.approx(4 / 12)
    merged = block_stream(reqs, merge=2)  # 1024-token blocks: (0,1) is one block, shared by three requests
    assert merged.keys[0] == merged.keys[2] == merged.keys[6] and merged.block_size == 1024


def test_bailian_turns_share_their_conversation_blocks(tmp_path):
    reqs = read_block_trace(_write(tmp_path / "b.jsonl", BAILIAN))
    assert {r.fmt for r in reqs} == {"bailian"} and reqs[0].block_tokens == BAILIAN_BLOCK
    s = block_stream(reqs, outputs=False)
    assert s.keys.tolist() == [100, 101, 102, 100, 200, 100, 101, 102, 103, 104]
    assert lru_curve(s.keys, [100]).hit_rate[0] == pytest.approx(4 / 10)


@pytest.mark.parametrize("line, problem", [
    ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": []}, "non-empty list"),
    ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]}, "more than input_length"),
    ({"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}, "timestamp"),
    ({"input_length": 10, "output_length": 1, "hash_ids": [1]}, "missing 'timestamp'"),
    ({"timestamp": 0, "input_length": 10, "hash_ids": [1]}, "missing 'output_length'"),
    ({"chat_id": "x", "timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}, "chat_id"),
])
def test_a_bad_line_is_named(tmp_path, line, problem):
    path = _write(tmp_path / "bad.jsonl", [MOONCAKE[0], line])
    with pytest.raises(ValueError, match=problem) as e:
        read_block_trace(path)
    assert f"{path}:2:" in str(e.value)
    assert [isinstance(r, str) for _, r in read_trace(path)] == [False, True]  # bench --trace / --replay name it too


def test_a_file_mixing_the_formats_is_refused(tmp_path):
    with pytest.raises(ValueError, match="bailian line in a mooncake trace"):
        read_block_trace(_write(tmp_path / "mix.jsonl", [MOONCAKE[0], BAILIAN[0]]))


def test_replay_requests_share_tokens_where_the_trace_shares_hash_ids(tmp_path):
    reqs = load_trace(_write(tmp_path / "m.jsonl", MOONCAKE))
    p = [r.prompt_tokens for r in reqs]
    assert [len(x) for x in p] == [1100, 1030, 600, 1024]
    assert p[0][:1024] == p[1][:1024] == p[3] and p[0][1024:] != p[1][1024:]
    assert all(16 <= t < 2016 for x in p for t in x)
    assert [r.max_new_tokens for r in reqs] == [30, 10, 500, 1]


def test_the_engine_reuses_the_prefix_a_bailian_trace_shares(tmp_path, llama_model):
    """Synthesized tokens through the real engine: the second turn finds its conversation's blocks cached."""
    from engine.config import CacheConfig, EngineOptions
    from engine.runtime.engine import Engine
    from engine.sequence import SamplingParams

    reqs = load_trace(_write(tmp_path / "b.jsonl", BAILIAN))
    engine = Engine(llama_model, CacheConfig(block_size=16), EngineOptions(attention="cpu"))
    for r in reqs:
        engine.generate([r.prompt_tokens], SamplingParams(max_new_tokens=1))
    # turn 2 (70 tokens) reuses turn 1's 2 full 16-token blocks at least (32 tokens); chat 12 shares none in full
    assert engine.counters.prompt_reused >= 32


def test_policy_lab_reads_a_block_hash_trace(tmp_path, capsys):
    path = _write(tmp_path / "m.jsonl", MOONCAKE)
    assert main([path, "--block-sizes", "--current", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["distinct_blocks"] == 8 and [r["block_size"] for r in out["block_sizes"]] == [512, 1024, 2048]
    lru = next(c for c in out["curves"] if c["policy"] == "lru")
    assert lru["hit_rate"][-1] == pytest.approx(4 / 12)
    bad = _write(tmp_path / "bad.jsonl", [{"timestamp": 0}])
    assert main([bad, "--curve"]) == 2
    assert f"{bad}:1:" in capsys.readouterr().err


def test_synthesized_prompt_is_deterministic():
    from engine.workloads.public_traces import BlockRequest

    r = BlockRequest(0.0, "s", 20, 1, (7, 8), 16, "bailian")
    assert synthesized_prompt(r) == synthesized_prompt(r) and len(synthesized_prompt(r)) == 20
    assert np.array_equal(synthesized_prompt(r)[:16], synthesized_prompt(BlockRequest(0.0, "t", 16, 1, (7,), 16,
                                                                                       "bailian")))
