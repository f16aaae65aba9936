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

REAL = json.load(open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "attach", "real_frames.json")))


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


@pytest.mark.parametrize("text", ["tcp://a b:5557", "tcp://[:5557", "tcp://h:٥٥٥٧", "tcp://h:5557,dp=٣",
                                  "tcp://h:5557,replay=٥٥٥٨", "tcp://h;rm:5557", "tcp://h:5557,replay=",
                                  "tcp://h:5557,replay=bogus"])
def test_hosts_ports_and_counts_are_ascii_names_and_digits(text):
    with pytest.raises(SourceError) as e:  # a host "a b" or "[" or non-ASCII digits: refused, never subscribed to
        parse_source("vllm", text)
    assert text in str(e.value) or text.split(",")[0] in str(e.value)


def test_an_endpoint_given_twice_is_refused_whoever_takes_it():
    from engine.attach.source import check_distinct

    def specs(*args):
        return [s for kind, text in args for s in parse_source(kind, text)]

    check_distinct(specs(("vllm", "tcp://h:5557,dp=2,replay=5600"), ("sglang", "tcp://h:5559")))
    for clash in ([("vllm", "tcp://h:5557"), ("vllm", "tcp://h:5557")],  # the same server twice: events counted twice
                  [("vllm", "tcp://h:5557,dp=2,replay=5600"), ("sglang", "tcp://h:5558")],  # rank 1's publisher
                  [("vllm", "tcp://h:5557,dp=2"), ("sglang", "tcp://h:5559")],  # rank 0's replay socket
                  [("vllm", "tcp://h:5557,replay=6000"), ("sglang", "tcp://h:5558,replay=6000")]):
        with pytest.raises(SourceError, match="given twice"):
            check_distinct(specs(*clash))


def test_file_attach_refuses_an_endpoint_twice_as_the_command_line_does():
    pytest.importorskip("PySide6")
    from ui.attach.dialog import parse_lines

    with pytest.raises(SourceError, match="tcp://h:5558 is given twice"):
        parse_lines("vllm tcp://h:5557,dp=2,replay=5600\nsglang tcp://h:5558")


@pytest.mark.parametrize("argv", [
    ["--vllm", "tcp://127.0.0.1:0"], ["--vllm", "tcp://127.0.0.1:70000"], ["--vllm", "garbage"],
    ["--vllm", "tcp://127.0.0.1:5557,dp=2,replay=5558"], ["--vllm", "tcp://127.0.0.1:5557,replay=0"],
    ["--vllm", "tcp://127.0.0.1:5557", "--vllm", "tcp://127.0.0.1:5557"],
    ["--vllm", "tcp://127.0.0.1:5557", "--half-life", "nan"],
    ["--vllm", "tcp://127.0.0.1:5557", "--scrape-interval", "inf"],
    ["--vllm", "tcp://127.0.0.1:5557", "--headless", "--run-for", "nan"],
    ["--vllm", "tcp://127.0.0.1:5557", "--headless", "--run-for", "-1"],
    ["--bench-decode", "--bench-seconds", "nan"], ["--soak", "--soak-seconds", "-1"],
    ["--soak", "--soak-publishers", "0"], ["--soak", "--soak-rate", "0"]])
def test_the_cli_refuses_in_one_line_with_exit_2_before_starting_anything(argv, capsys):
    from app.attach import main

    assert main(argv) == 2  # refused before anything starts: no time.sleep(nan), no endless bench, no publishers
    err = capsys.readouterr().err  # started and then a KeyError or WorkerError traceback
    assert err.startswith("kvscope attach: error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_no_window_advice_is_said_of_attach():
    from app.window import platform_check
    from app.attach import attach_advice

    for text in (platform_check.NO_DISPLAY, platform_check.missing_message(["libxcb-icccm.so.4"])):
        said = attach_advice(text)
        assert "kvscope attach ... --headless" in said and "demo workload" not in said and "snapshot JSON" not in said
