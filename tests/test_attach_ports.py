"""Ports as the servers assign them: rank r publishes on PORT+r and replays on REPLAY+r (vLLM 0.33 and SGLang
0.5 offset both by the data-parallel rank; their own offsets are in tests/data/attach/real_frames.json), the
replay base is given apart from the publisher's, and a layout the servers cannot run is refused with the fix."""

from __future__ import annotations

import json
import os
import re

import pytest

from app.attach import build_parser
from engine.attach.source import SourceError, parse_source, rank_port

REAL = json.load(open(os.path.join(os.path.dirname(__file__), "data", "attach", "real_frames.json")))


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


@pytest.mark.parametrize("server", ["vllm", "sglang"])
def test_rank_ports_are_the_servers_own_offsets(server):
    ex = REAL[server]["ports"]["offset_examples"]
    for base in ("tcp://*:5557", "tcp://*:5558", "tcp://10.0.0.5:5600"):
        assert [rank_port(_port(base), r) for r in range(4)] == [_port(e) for e in ex[base]]
    # and the capture's own publishers and replay sockets, rank by rank
    p = REAL[server]["ports"]
    for r in REAL[server]["ranks"]:
        assert _port(r["replay_endpoint"]) == rank_port(p["replay_base"], r["rank"])
        if r["endpoint"].startswith("tcp://"):
            assert _port(r["endpoint"]) == rank_port(p["pub_base"], r["rank"])


def test_four_ranks_with_a_replay_base_of_their_own():
    specs = parse_source("vllm", "tcp://10.0.0.7:5557,dp=4,replay=5600,topic=kv-events")
    assert [s.endpoint for s in specs] == [f"tcp://10.0.0.7:{5557 + r}" for r in range(4)]
    assert [s.replay for s in specs] == [f"tcp://10.0.0.7:{5600 + r}" for r in range(4)]
    assert [s.rank for s in specs] == [0, 1, 2, 3] and {s.topic for s in specs} == {"kv-events"}
    other = parse_source("sglang", "tcp://10.0.0.7:5557,dp=2,replay=tcp://10.0.0.8:5558")
    assert [s.replay for s in other] == ["tcp://10.0.0.8:5558", "tcp://10.0.0.8:5559"]  # another host: no clash


def test_one_rank_defaults_to_the_usual_5558_and_n_ranks_to_the_ports_after_the_publishers():
    assert [s.replay for s in parse_source("vllm", "tcp://h:5557")] == ["tcp://h:5558"]
    assert [s.replay for s in parse_source("vllm", "tcp://h:5557,dp=3")] == [f"tcp://h:{5560 + r}" for r in range(3)]
    assert [s.replay for s in parse_source("vllm", "tcp://h:5557,dp=2,replay=none")] == [None, None]


@pytest.mark.parametrize("text", ["tcp://h:5557,dp=2,replay=5558", "tcp://h:5557,dp=4,replay=tcp://h:5559",
                                  "tcp://h:5600,dp=2,replay=5599"])
def test_a_replay_range_overlapping_the_publishers_is_refused_with_the_fix(text):
    with pytest.raises(SourceError) as e:
        parse_source("vllm", text)
    msg = str(e.value)
    assert "overlap" in msg and "replay_endpoint" in msg
    fix = int(re.search(r"replay=(\d+) here", msg).group(1))
    parse_source("vllm", re.sub(r"replay=[^,]+", f"replay={fix}", text))  # the suggested base works


def test_ports_past_65535_are_refused():
    with pytest.raises(SourceError):
        parse_source("vllm", "tcp://h:65535,dp=2")
    with pytest.raises(SourceError):
        parse_source("vllm", "tcp://h:5557,dp=2,replay=65535")


def test_help_says_how_to_set_the_server_up_for_data_parallel_ranks():
    text = build_parser().format_help()
    assert "--kv-events-config" in text and '"replay_endpoint":"tcp://*:5600"' in text
    assert "--data-parallel-size" in text and "--dp-size" in text and "replay=5600" in text
