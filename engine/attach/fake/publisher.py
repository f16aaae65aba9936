"""A fake vLLM / SGLang KV-event publisher, for tests, the soak bench and the README screenshot.

`python -m engine.attach.fake.publisher --flavor vllm --rate 2000` binds on 127.0.0.1 (this is the one thing in
KV Scope that listens: it plays the server) exactly as those servers do: per data-parallel rank a PUB socket
sending (topic, 8-byte big-endian seq, msgpack KVEventBatch) and a ROUTER replay socket answering "8-byte start
seq" with (topic, seq, payload) frames and ("", -1, ""), as vLLM >= 0.26 and SGLang 0.5 do (`--replay-layout
old`: (seq, payload) and (-1, ""), as older vLLM did). Ranks publish on consecutive ports and replay on
consecutive ports from `--replay-port` (default: right after the publishers', so `--vllm
tcp://127.0.0.1:PORT,dp=N` finds them), as the servers offset both by the rank. The batches are today's
layout by default (`--encoding tagged`: byte for byte what vLLM 0.33 / SGLang 0.5 send, with their hash types
and fields; tests/attach/test_attach_real_bytes.py compares them with the real publishers' captures); `--encoding
array` is the older array-like layout. Optionally /metrics in Prometheus text (prometheus_client), vLLM- or
SGLang-named.

Faults on request: `--gap SEQ:LEN` withholds batches from the live stream but keeps them for replay (a
recoverable gap), `--lost SEQ:LEN` drops them from both (an unrecoverable one), `--malformed-every N` sends a
junk frame after every N batches (undecodable payloads with their own seq, wrong frame counts, short seqs).

It prints one JSON line when bound ({"pub": [...], "replay": [...], "metrics": url}) and one when done
({"summary": {...}}: batches and events sent per rank, those withheld, lost and the junk sent), then keeps
answering replay requests for --linger seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import sys
import threading
import time
from collections import deque

import zmq

from engine.attach.events import encode_batch
from engine.attach.fake.workload import FakeCache

END_SEQ = (-1).to_bytes(8, "big", signed=True)
ENCODINGS = ("tagged", "array", "map")
REPLAY_LAYOUTS = ("topic", "old")  # topic: vLLM >= 0.26 and SGLang 0.5; old: vLLM before 0.26


def default_hash(flavor: str, encoding: str) -> str:
    """The block hash type each server sends: vLLM 0.33 sha256 bytes, SGLang signed int64, older vLLM ints."""
    if encoding == "tagged":
        return "int64" if flavor == "sglang" else "bytes"
    return "int" if flavor == "sglang" or encoding == "array" else "bytes"


def encode(events: list, ts: float, rank: int, flavor: str, encoding: str, extra_field: bool = False) -> bytes:
    """One batch as the fake sends it. Today's servers name the rank in every batch (their publishers fill it
    in); older vLLM did in its map twin only, older SGLang never (the subscriber takes it from the port)."""
    named = encoding == "tagged" or (flavor == "vllm" and encoding == "map")
    return encode_batch(ts, events, rank if named else None, encoding=encoding, flavor=flavor,
                        extra_field=extra_field)


def replay_frames(topic: bytes, buffer, start: int, layout: str = "topic") -> list[tuple[bytes, ...]]:
    """The replay ROUTER's answer to "start" (without the client identity), as the servers send it."""
    out = []
    for seq, buf in buffer:
        if seq >= start:
            out.append((b"", topic, seq.to_bytes(8, "big"), buf) if layout == "topic" else
                       (b"", seq.to_bytes(8, "big"), buf))
    out.append((b"", b"", END_SEQ, b"") if layout == "topic" else (b"", END_SEQ, b""))
    return out


def _ranges(specs: list[str]) -> list[tuple[int, int]]:
    out = []
    for s in specs or []:
        a, _, n = s.partition(":")
        out.append((int(a), int(a) + int(n or 1)))
    return out


class RankPublisher:
    def __init__(self, pub: zmq.Socket, router: zmq.Socket, args, rank: int):
        self.pub, self.router = pub, router
        self.args, self.rank = args, rank
        self.topic = args.topic.encode()
        hash_kind = args.hash or default_hash(args.flavor, args.encoding)
        self.cache = FakeCache(capacity=args.capacity, block_size=args.block_size, seed=args.seed + rank,
                               hash_kind=hash_kind, cpu_capacity=args.cpu_offload,
                               flavor=args.flavor if args.encoding == "tagged" else None)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=args.buffer_steps)
        self.seq = 0
        self.pending: list = []
        self.gaps, self.lost = _ranges(args.gap), _ranges(args.lost)
        self.s = dict(batches=0, events=0, withheld_batches=0, withheld_events=0, lost_batches=0, lost_events=0,
                      malformed_sent=0, replay_requests=0, blocks_stored=0, blocks_removed=0)
        self._junk = random.Random(args.seed + 99 + rank)
        self.pre: deque = deque()

    def _in(self, ranges, seq: int) -> bool:
        return any(a <= seq < b for a, b in ranges)

    def pregenerate(self, batches: int, per_batch: int) -> None:
        """Encode `batches` batches now (timestamps patched in at sending), so publishing costs a send only."""
        self.pre = deque()
        for _ in range(batches):
            self.fill(per_batch, time.time())
            events, self.pending = self.pending[:per_batch], self.pending[per_batch:]
            self.pre.append((self._encode(events, 0.0), self._counts(events)))

    @staticmethod
    def _counts(events: list) -> tuple[int, int, int]:
        stored = sum(len(ev.block_hashes) for ev in events if ev.KIND == 0)
        removed = sum(len(ev.block_hashes) for ev in events if ev.KIND == 1)
        return len(events), stored, removed

    def _encode(self, events: list, ts: float) -> bytes:
        return encode(events, ts, self.rank, self.args.flavor, self.args.encoding, self.args.extra_field)

    def fill(self, n: int, t: float) -> None:
        while len(self.pending) < n:
            self.pending.extend(self.cache.request(t))

    def publish(self, n_events: int, t: float) -> None:
        if self.pre:
            payload, counts = self.pre.popleft()
            i = payload.index(b"\xcb", 0, 16)  # the batch's ts is its first float64 (array or map)
            payload = payload[:i + 1] + struct.pack(">d", time.time()) + payload[i + 9:]
        else:
            self.fill(n_events, t)
            events, self.pending = self.pending[:n_events], self.pending[n_events:]
            payload = self._encode(events, time.time())
            counts = self._counts(events)
        n_ev, n_stored, n_removed = counts
        seq = self.seq
        self.seq += 1
        self.s["batches"] += 1
        self.s["events"] += n_ev
        self.s["blocks_stored"] += n_stored
        self.s["blocks_removed"] += n_removed
        if self._in(self.lost, seq):
            self.s["lost_batches"] += 1
            self.s["lost_events"] += n_ev
        else:
            self.buffer.append((seq, payload))
            if self._in(self.gaps, seq):
                self.s["withheld_batches"] += 1
                self.s["withheld_events"] += n_ev
            else:
                self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        every = self.args.malformed_every
        if every and self.s["batches"] % every == 0:
            self._send_junk()

    def _send_junk(self) -> None:
        kind = self.s["malformed_sent"] % 3
        if kind == 0:  # a payload that is not a batch, with a sequence number of its own
            junk = b"\xc1" + bytes(self._junk.randrange(256) for _ in range(self._junk.randrange(1, 40)))
            seq, self.seq = self.seq, self.seq + 1
            self.buffer.append((seq, junk))  # 0xc1 is never valid msgpack
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), junk))
        elif kind == 1:  # four frames
            self.pub.send_multipart((self.topic, b"\0" * 8, b"x", b"y"))
        else:  # a 5-byte sequence number
            self.pub.send_multipart((self.topic, b"\0" * 5, b"\x90"))
        self.s["malformed_sent"] += 1

    def serve_replay(self) -> None:
        while self.router.poll(0):
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            self.s["replay_requests"] += 1
            for frames in replay_frames(self.topic, list(self.buffer), start, self.args.replay_layout):
                self.router.send_multipart((client,) + frames)


def _bind(ctx: zmq.Context, n: int, port: int, hwm: int, tries: int = 50,
          replay_port: int = 0) -> tuple[int, int, list, list]:
    """n PUB sockets on consecutive ports of 127.0.0.1 and n ROUTER sockets on consecutive ports from
    `replay_port` (0: the n ports after the publishers'), from `port`, or from a random base when port is 0
    (retried where one is taken). Returns both bases."""
    rng = random.Random()
    for _ in range(1 if port else tries):
        base = port or rng.randrange(20000, 60000 - 2 * n)
        rbase = replay_port or base + n
        pubs, routers = [], []
        try:
            for i in range(n):
                s = ctx.socket(zmq.PUB)
                s.setsockopt(zmq.SNDHWM, hwm)
                s.setsockopt(zmq.LINGER, 2000)
                pubs.append(s)
                s.bind(f"tcp://127.0.0.1:{base + i}")
            for i in range(n):
                s = ctx.socket(zmq.ROUTER)
                s.setsockopt(zmq.LINGER, 0)
                routers.append(s)
                s.bind(f"tcp://127.0.0.1:{rbase + i}")
            return base, rbase, pubs, routers
        except zmq.ZMQError:
            for s in pubs + routers:
                s.close(0)
            if port:
                raise
    raise RuntimeError(f"no {2 * n} consecutive free ports found on 127.0.0.1")


class _Metrics:
    def __init__(self, flavor: str, port: int, ranks: list[RankPublisher], histograms: bool):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

        self.flavor, self.ranks, self.histograms = flavor, ranks, histograms
        r = self.registry = CollectorRegistry()
        lab = ["model_name", "engine"]
        if flavor == "vllm":
            self.usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lab,
                               registry=r)
            self.queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", lab, registry=r)
            self.hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", lab, registry=r)
            self.preempt = Counter("vllm:num_preemptions", "Cumulative number of preemptions.", lab, registry=r)
            info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                         ["block_size", "num_gpu_blocks", "enable_prefix_caching"], registry=r)
            info.labels(str(ranks[0].cache.block_size), str(ranks[0].cache.capacity), "True").set(1)
            if histograms:
                b = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 300)
                self.life = Histogram("vllm:kv_block_lifetime_seconds", "KV block lifetime.", lab, buckets=b,
                                      registry=r)
                self.idle = Histogram("vllm:kv_block_idle_before_evict_seconds", "Idle before eviction.", lab,
                                      buckets=b, registry=r)
                self.gap = Histogram("vllm:kv_block_reuse_gap_seconds", "Gap between reuses.", lab, buckets=b,
                                     registry=r)
        else:
            self.usage = Gauge("sglang:token_usage", "The token usage.", ["model_name", "dp_rank"], registry=r)
            self.hit_rate = Gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", ["model_name", "dp_rank"],
                                  registry=r)
        self.done = [dict(queries=0, hits=0, preempt=0) for _ in ranks]
        self.server, _ = start_http_server(port, addr="127.0.0.1", registry=r)
        self.port = self.server.server_port

    def update(self) -> None:
        for i, rp in enumerate(self.ranks):
            c, d, labels = rp.cache, self.done[i], ("fake-model", str(rp.rank))
            self.usage.labels(*labels).set(c.usage(time.time()))
            if self.flavor == "sglang":
                self.hit_rate.labels(*labels).set(c.hits / c.queries if c.queries else 0.0)
                continue
            self.queries.labels(*labels).inc(c.queries - d["queries"])
            self.hits.labels(*labels).inc(c.hits - d["hits"])
            self.preempt.labels(*labels).inc(c.preemptions - d["preempt"])
            d.update(queries=c.queries, hits=c.hits, preempt=c.preemptions)
            for name, xs in (("life", c.lifetimes), ("idle", c.idle), ("gap", c.reuse_gaps)):
                if self.histograms:
                    h = getattr(self, name).labels(*labels)
                    for x in xs[-200:]:  # sampled, as vLLM samples (--kv-cache-metrics-sample)
                        h.observe(x)
                xs.clear()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m engine.attach.fake.publisher", description=__doc__.split("\n")[0])
    ap.add_argument("--flavor", choices=("vllm", "sglang"), default="vllm")
    ap.add_argument("--encoding", choices=ENCODINGS, default="tagged",
                    help="tagged: today's servers (default); array: array-like events (vLLM <= 0.10); map: a map "
                         "batch (no server)")
    ap.add_argument("--replay-layout", choices=REPLAY_LAYOUTS, default="topic",
                    help="replay replies with a topic frame (vLLM >= 0.26, SGLang 0.5; default) or without (old)")
    ap.add_argument("--hash", choices=("int", "int64", "bytes"),
                    help="block hash type (default: the server's: vLLM 0.33 bytes, SGLang int64, older vLLM int)")
    ap.add_argument("--port", type=int, default=0, help="first PUB port (0: pick free ones)")
    ap.add_argument("--replay-port", type=int, default=0,
                    help="first replay port (0: right after the publishers')")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel ranks")
    ap.add_argument("--topic", default="kv-events")
    ap.add_argument("--rate", type=float, default=2000.0, help="events per second (all ranks together)")
    ap.add_argument("--batch", type=int, default=50, help="events per batch")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds to publish")
    ap.add_argument("--max-batches", type=int, default=0, help="stop after this many batches per rank")
    ap.add_argument("--start-delay", type=float, default=0.0, help="seconds to wait before publishing")
    ap.add_argument("--capacity", type=int, default=3000, help="GPU blocks per rank")
    ap.add_argument("--cpu-offload", type=int, default=0, help="CPU blocks per rank (0: no CPU tier)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--buffer-steps", type=int, default=10_000, help="batches kept for replay")
    ap.add_argument("--hwm", type=int, default=0, help="PUB high-water mark (0: unlimited)")
    ap.add_argument("--gap", action="append", metavar="SEQ:LEN", help="withhold batches live, keep them for replay")
    ap.add_argument("--lost", action="append", metavar="SEQ:LEN", help="drop batches from the stream and replay")
    ap.add_argument("--malformed-every", type=int, default=0, metavar="N")
    ap.add_argument("--extra-field", action="store_true", help="add a field no decoder knows to every event")
    ap.add_argument("--metrics-port", type=int, default=-1, help="serve /metrics (0: any free port; -1: none)")
    ap.add_argument("--kv-cache-metrics", action="store_true", help="also the block lifetime / idle / reuse histograms")
    ap.add_argument("--linger", type=float, default=2.0, help="seconds to keep answering replay after publishing")
    ap.add_argument("--pregenerate", action="store_true",
                    help="encode every batch before publishing (a bench: then publishing costs a send per batch)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--exit-with-stdin", action="store_true",
                    help="exit when stdin ends: started by a parent that holds the other end of a pipe (spawn.py), "
                         "so the publisher dies with its parent, whatever ends it (a SIGKILL included)")
    return ap


def exit_when_stdin_ends() -> None:
    """A thread that ends the process when stdin reaches its end: the parent holding the pipe's other end has
    closed it or is gone (the kernel closes a dead process's files). At once: nobody is left to read a summary."""

    def watch() -> None:
        try:
            while sys.stdin.buffer.read(4096):  # the parent never writes: this waits for the end
                pass
        except (OSError, ValueError):
            pass
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.exit_with_stdin:
        exit_when_stdin_ends()
    ctx = zmq.Context()
    n = args.dp
    base, rbase, pubs, routers = _bind(ctx, n, args.port, args.hwm, replay_port=args.replay_port)
    ranks = [RankPublisher(pubs[r], routers[r], args, r) for r in range(n)]
    metrics = _Metrics(args.flavor, args.metrics_port, ranks, args.kv_cache_metrics) if args.metrics_port >= 0 else None
    print(json.dumps({"pub": [f"tcp://127.0.0.1:{base + r}" for r in range(n)],
                      "replay": [f"tcp://127.0.0.1:{rbase + r}" for r in range(n)],
                      "metrics": f"http://127.0.0.1:{metrics.port}/metrics" if metrics else None}), flush=True)
    per_batch = max(1, args.batch)
    if args.pregenerate:
        total = int(args.rate * args.duration / per_batch) + 1
        for r, rp in enumerate(ranks):
            rp.pregenerate(total // n + (r < total % n), per_batch)
    time.sleep(args.start_delay)
    print(json.dumps({"started": time.time()}), flush=True)
    t0 = time.monotonic()
    sent = 0
    last_metrics = 0.0
    try:
        while True:
            now = time.monotonic()
            if now - t0 >= args.duration or (args.max_batches and ranks[-1].s["batches"] >= args.max_batches):
                break
            due = int((now - t0) * args.rate) - sent
            if due < per_batch:
                for rp in ranks:
                    rp.serve_replay()
                time.sleep(0.0005)
                continue
            for _ in range(min(due // per_batch, 64)):
                rp = ranks[(sent // per_batch) % n]
                rp.publish(per_batch, time.time())
                sent += per_batch
                if args.max_batches and ranks[-1].s["batches"] >= args.max_batches:
                    break
            for rp in ranks:
                rp.serve_replay()
            if metrics and now - last_metrics > 0.25:
                metrics.update()
                last_metrics = now
        elapsed = time.monotonic() - t0
        if metrics:
            metrics.update()
        summary = {"elapsed_s": elapsed, "ranks": [rp.s | {"last_seq": rp.seq - 1} for rp in ranks]}
        for k in ("batches", "events", "lost_events", "malformed_sent"):
            summary[k] = sum(rp.s[k] for rp in ranks)
        summary["events_per_s"] = summary["events"] / elapsed if elapsed else 0.0
        print(json.dumps({"summary": summary}), flush=True)
        end = time.monotonic() + args.linger
        while time.monotonic() < end:
            for rp in ranks:
                rp.serve_replay()
            time.sleep(0.005)
    except KeyboardInterrupt:
        pass
    finally:
        if metrics:
            metrics.server.shutdown()
        for rp in ranks:
            rp.pub.close()
            rp.router.close(0)
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
