"""Where to attach: the publisher endpoints of a vLLM or SGLang server, parsed from the command line.

`--vllm tcp://HOST:5557` is a server started with
`--kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",
"replay_endpoint":"tcp://*:5558","topic":"kv-events"}'` (SGLang takes the same flag and JSON). Options follow
commas: `replay=PORT` or `replay=tcp://HOST:PORT` (the server's replay_endpoint; default: the port after the
last rank's publisher, i.e. 5558 for one rank; `replay=none` for none), `topic=kv-events` (default: every
topic), `dp=N` (data-parallel ranks), `name=LABEL`, `metrics=http://HOST:PORT/metrics` (this server's Prometheus
endpoint: scraped, and its num_gpu_blocks frames the GPU maps).

Ports per rank, as the servers assign them: each data-parallel rank r runs its own publisher and offsets
*both* its endpoint's and its replay endpoint's port by r (vLLM 0.33 `ZmqEventPublisher.offset_endpoint_port`
with the rank `parallel_config.data_parallel_index`; SGLang 0.5 the same with the attention-DP rank under
`--enable-dp-attention`, else the DP rank). So with N ranks the publishers take PORT..PORT+N-1 and the replay
sockets REPLAY..REPLAY+N-1, and the two ranges must not overlap: the usual 5557 / 5558 serves one rank only
(rank 1's publisher would take rank 0's replay port, 5558). For N >= 2 the server needs a replay base of its
own, e.g. `"replay_endpoint":"tcp://*:5600"`, given here as `replay=5600`; without it, attach assumes the
replay base PORT+N (the ranges packed end to end). tests/attach/test_attach_ports.py checks the derivation against
the servers' own offsets (tests/data/attach/real_frames.json).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("vllm", "sglang")
# A host name, an IPv4 address, an IPv6 one in brackets, or the bind wildcard (refused with the reason);
# ASCII only (\d would take any script's digits).
_TCP = re.compile(r"^tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|\[::\]|[A-Za-z0-9._-]+|\*):(?P<port>[0-9]+)$", re.ASCII)


class SourceError(ValueError):
    """A source the attach command cannot use; the message says which and why."""


@dataclass(frozen=True)
class SourceSpec:
    kind: str  # "vllm" | "sglang"
    endpoint: str  # the PUB socket to connect a SUB to
    replay: str | None  # the ROUTER socket to ask for missed batches, if any
    topic: str  # SUB prefix ("" receives every topic)
    rank: int  # data-parallel rank this endpoint publishes (batches that carry their own rank win)
    label: str
    name: str = ""  # the server's label (label without the /dpN suffix)
    metrics: str | None = None  # the server's /metrics URL, when given with the endpoint


def _split(endpoint: str) -> tuple[str, int]:
    m = _TCP.match(endpoint)
    if not m:
        raise SourceError(f"{endpoint!r}: expected tcp://HOST:PORT")
    host, port = m.group("host"), int(m.group("port"))
    if host in ("*", "0.0.0.0", "[::]"):
        raise SourceError(f"{endpoint!r}: that is the server's bind address; attach connects, so give the "
                          f"server's host name or IP, e.g. tcp://10.0.0.5:{port}")
    if not 0 < port < 65536:
        raise SourceError(f"{endpoint!r}: port {port} is not in 1..65535")
    return host, port


def rank_port(base: int, rank: int) -> int:
    """The port data-parallel rank `rank` uses for a base port, as vLLM and SGLang offset it."""
    return base + rank


def parse_source(kind: str, text: str) -> list[SourceSpec]:
    """One `--vllm` / `--sglang` value: a list of endpoints (one per data-parallel rank)."""
    if kind not in KINDS:
        raise SourceError(f"unknown server kind {kind!r}; one of {', '.join(KINDS)}")
    head, *opts = [p.strip() for p in text.split(",")]
    host, port = _split(head)
    o: dict[str, str] = {}
    for opt in opts:
        k, eq, v = opt.partition("=")
        if not eq or k not in ("replay", "topic", "dp", "name", "metrics"):
            raise SourceError(f"--{kind} {text!r}: unknown option {opt!r} (replay=, topic=, dp=, name=, metrics=)")
        o[k] = v
    dp_text = o.get("dp", "1")
    if not re.fullmatch(r"[0-9]+", dp_text, re.ASCII):
        raise SourceError(f"--{kind} {text!r}: dp must be a whole number, got {dp_text!r}")
    dp = int(dp_text)
    if not 1 <= dp <= 256:
        raise SourceError(f"--{kind} {text!r}: dp must be 1..256, got {dp}")
    replay = o.get("replay")
    try:
        if replay is None:
            rhost, rport = host, port + dp
        elif replay.lower() == "none":
            rhost = rport = None
        elif re.fullmatch(r"[0-9]+", replay, re.ASCII):  # a port of the publisher's host
            rhost, rport = _split(f"tcp://{host}:{replay}")
        else:
            rhost, rport = _split(replay)
    except SourceError as e:
        why = e if replay.startswith("tcp://") or replay.isdigit() else "expected a port, tcp://HOST:PORT or none"
        raise SourceError(f"--{kind} {text!r}: replay={replay}: {why}") from None
    if rank_port(port, dp - 1) > 65535 or (rport is not None and rank_port(rport, dp - 1) > 65535):
        raise SourceError(f"--{kind} {text!r}: with dp={dp} the ranks' ports would run past 65535")
    if rport is not None and rhost == host and rport < port + dp and port < rport + dp:
        raise SourceError(
            f"--{kind} {text!r}: the replay ports {rport}..{rank_port(rport, dp - 1)} overlap the publishers' "
            f"{port}..{rank_port(port, dp - 1)}: the server offsets both by the data-parallel rank, so with dp={dp} "
            f"its replay_endpoint needs a base of its own (e.g. \"replay_endpoint\":\"tcp://*:{port + dp}\" in "
            f"--kv-events-config, then replay={port + dp} here)")
    name = o.get("name") or f"{host}:{port}"
    metrics = parse_metrics_url(o["metrics"]) if o.get("metrics") else None
    out = []
    for r in range(dp):
        out.append(SourceSpec(kind, f"tcp://{host}:{rank_port(port, r)}",
                              None if rport is None else f"tcp://{rhost}:{rank_port(rport, r)}",
                              o.get("topic", ""), r, name if dp == 1 else f"{name}/dp{r}", name, metrics))
    return out


def check_distinct(specs: list[SourceSpec]) -> None:
    """Every publisher and replay endpoint once: the same publisher twice would count each of its events
    twice, and one server's replay socket taken for another's would hand it a stranger's history (hosts are
    compared as written: tcp://localhost:5557 and tcp://127.0.0.1:5557 are not known to be the same)."""
    seen: dict[str, str] = {}
    for s in specs:
        for what, ep in (("publisher", s.endpoint), ("replay socket", s.replay)):
            if ep is None:
                continue
            owner = f"{s.kind} {s.label}'s {what}"
            if ep in seen:
                both = f"as {seen[ep]} and as {owner}" if seen[ep] != owner else f"as {owner}"
                raise SourceError(f"{ep} is given twice, {both} (data-parallel rank r takes PORT+r and REPLAY+r)")
            seen[ep] = owner


def parse_metrics_url(text: str) -> str:
    """`--metrics` value: http(s)://HOST:PORT[/path] (path defaults to /metrics)."""
    m = re.match(r"^(https?)://([^/\s]+)(/\S*)?$", text.strip())
    if not m:
        raise SourceError(f"--metrics {text!r}: expected http://HOST:PORT[/metrics]")
    return f"{m.group(1)}://{m.group(2)}{m.group(3) or '/metrics'}"
