"""Drive vLLM's or SGLang's own ZmqEventPublisher on 127.0.0.1 with a steady synthetic workload, for trying
`kvscope attach` against the real publishers (not part of the suite; run it in the scratch venv of
capture_real.py, then attach from KV Scope's venv):

    /tmp/realpub/bin/python tests/data/attach/run_real_publishers.py --server sglang --dp 2 --port 47100 \\
        --replay-port 47200 --seconds 20 --rate 2000
    kvscope attach --sglang tcp://127.0.0.1:47100,dp=2,replay=47200,topic=kv-events --headless --run-for 10

Each rank publishes batches of chained BlockStored events (16-token blocks, the server's hash type: vLLM
sha256 bytes, SGLang signed int64) and BlockRemoved events that keep a steady resident set, through the
package's own structs and publisher (ports offset by the rank by the publisher itself). It prints one JSON
line when bound and one with the events published per rank when done, then keeps answering replay requests
for --linger seconds. vLLM binds its PUB only on a wildcard host; here it is told to bind 127.0.0.1 (its
`_is_bind_endpoint` answers True: the one patch, so nothing listens beyond loopback).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections import deque

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from capture_real import TOPIC, load_sglang, load_vllm  # noqa: E402


def _hash(server: str, parent, tokens: list[int]):
    d = hashlib.sha256(repr((parent, tokens)).encode()).digest()
    return d if server == "vllm" else int.from_bytes(d[:8], "big", signed=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", choices=("vllm", "sglang"), required=True)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--replay-port", type=int, required=True)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=1000.0, help="events per second per rank")
    ap.add_argument("--batch", type=int, default=20)
    ap.add_argument("--resident", type=int, default=2000, help="blocks kept per rank before removing")
    ap.add_argument("--linger", type=float, default=30.0)
    args = ap.parse_args(argv)
    mod = load_vllm() if args.server == "vllm" else load_sglang()
    pubs = []
    for r in range(args.dp):
        if args.server == "vllm":
            mod.ZmqEventPublisher._is_bind_endpoint = staticmethod(lambda endpoint: True)
            pubs.append(mod.ZmqEventPublisher(r, endpoint=f"tcp://127.0.0.1:{args.port}",
                                              replay_endpoint=f"tcp://127.0.0.1:{args.replay_port}", topic=TOPIC))
        else:
            pubs.append(mod.ZmqEventPublisher(r, endpoint=f"tcp://127.0.0.1:{args.port}",
                                              replay_endpoint=f"tcp://127.0.0.1:{args.replay_port}", topic=TOPIC,
                                              bind=True))
    print(json.dumps({"pub": [p._endpoint for p in pubs], "replay": [p._replay_endpoint for p in pubs]}), flush=True)
    kw = dict(group_idx=0, kv_cache_spec_kind="full_attention", lora_name=None) if args.server == "vllm" else {}
    resident = [deque() for _ in pubs]
    parents = [None] * len(pubs)
    sent = [dict(batches=0, events=0, stored=0, removed=0) for _ in pubs]
    tok = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < args.seconds:
        for r, pub in enumerate(pubs):
            events = []
            for _ in range(args.batch):
                if len(resident[r]) > args.resident:
                    gone = [resident[r].popleft() for _ in range(8)]
                    events.append(mod.BlockRemoved(block_hashes=gone, medium="GPU", **({"group_idx": 0} if
                                                                                         args.server == "vllm" else {})))
                    sent[r]["removed"] += len(gone)
                    continue
                if tok % 640 == 0:
                    parents[r] = None  # a new conversation
                toks = list(range(tok, tok + 16))
                tok += 16
                h = _hash(args.server, parents[r], toks)
                events.append(mod.BlockStored(block_hashes=[h], parent_block_hash=parents[r], token_ids=toks,
                                              block_size=16, lora_id=None, medium="GPU", **kw))
                parents[r] = h
                resident[r].append(h)
                sent[r]["stored"] += 1
            pub.publish(mod.KVEventBatch(ts=time.time(), events=events))
            sent[r]["batches"] += 1
            sent[r]["events"] += len(events)
        time.sleep(max(0.0, args.batch / args.rate - 0.0002))
    time.sleep(0.5)
    print(json.dumps({"summary": sent, "events": sum(s["events"] for s in sent)}), flush=True)
    time.sleep(args.linger)
    for pub in pubs:
        pub.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
