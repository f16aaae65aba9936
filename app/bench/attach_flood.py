"""`python -m app.bench.attach_flood`: the attach session's memory under a flood of new prefixes.

A publisher process on 127.0.0.1 sends RATE events/s for SECONDS, every store a new root (2 blocks, 32 token
ids), removals keeping about 50 blocks resident, in today's wire shape (an array batch of tag-keyed maps); an
AttachSession in this process reads it. Every `--every` seconds one JSON line: this process's RSS, the events
applied, the blocks resident, the prefix families held, and how far behind the stream is. With a steady
resident set the RSS should stay flat: the session keeps what is resident, not what it has seen.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import time


def _publish(port: int, rate: float, seconds: float) -> None:
    import msgpack
    import zmq

    if hasattr(os, "nice"):
        os.nice(10)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")  # the test plays the server; attach itself only connects
    time.sleep(1.0)
    h, seq, sent, resident, t0 = 1, 0, 0, [], time.monotonic()
    while time.monotonic() - t0 < seconds:
        evs = []
        while len(evs) < 100:
            evs.append({"type": "BlockStored", "block_hashes": [h, h + 1], "parent_block_hash": None,
                        "token_ids": list(range(h, h + 32)), "block_size": 16, "lora_id": None, "medium": "GPU",
                        "lora_name": None})
            resident += [h, h + 1]
            h += 2
            if len(resident) > 50:
                evs.append({"type": "BlockRemoved", "block_hashes": resident[:2], "medium": "GPU"})
                del resident[:2]
        pub.send_multipart((b"kv-events", seq.to_bytes(8, "big"), msgpack.packb([time.time(), evs, 0])))
        seq, sent = seq + 1, sent + len(evs)
        ahead = sent / rate - (time.monotonic() - t0)
        if ahead > 0:
            time.sleep(ahead)
    time.sleep(2.0)
    pub.close(0)
    ctx.term()


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.bench.attach_flood", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=20_000.0, help="events per second (20000)")
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--every", type=float, default=10.0, help="seconds between lines")
    args = ap.parse_args(argv)
    from engine.attach.session import AttachSession
    from engine.attach.source import parse_source

    s0 = socket.socket()
    s0.bind(("127.0.0.1", 0))
    port = s0.getsockname()[1]
    s0.close()
    proc = mp.get_context("spawn").Process(target=_publish, args=(port, args.rate, args.seconds), daemon=True)
    proc.start()
    session = AttachSession(parse_source("vllm", f"tcp://127.0.0.1:{port},replay=none"), []).start()
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < args.seconds + 3:
            time.sleep(args.every)
            st, a = session.statuses()[0], session.cluster.activity()[0]
            print(json.dumps({"t_s": round(time.monotonic() - t0), "rss_mb": round(_rss_mb(), 1), "events": a.events,
                              "resident": sum(len(g) for g in session.cluster.groups.values()),
                              "families": len(session.cluster.family_tokens), "behind_s": round(st.behind_s, 1),
                              "queued": st.queued, "shed": st.shed}), flush=True)
    finally:
        session.stop()
        proc.terminate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
