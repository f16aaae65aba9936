"""Drive vLLM's or SGLang's own ZmqEventPublisher on 127.0.0.1 with a steady synthetic workload, for trying
`kvscope attach` against the real publishers (not part of the suite; run it in the scratch venv of
capture_real.py, then attach from KV Scope's venv):

    /tmp/realpub/bin/python tests/data/attach/run_real_publishers.py --server sglang --dp 2 --port 47100 \\
        --replay-port 47200 --seconds 20 --rate 2000
    kvscope attach --sglang tcp://127.0.0.1:47100,dp=2,replay=47200,topic=kv-events --headless --run-for 10

Today's fields, to look at in the window: `--groups 2 --window 1024` (vLLM: a second KV-cache group, sliding
window, as a hybrid model has), `--lora NAME` (every other conversation; vLLM adds its extra_keys),
`--session`, `--salt` (SGLang's cache_salt), `--bigram K` (SGLang: every K-th page an EAGLE bigram page),
`--host-tier N` (evicted GPU blocks offloaded to vLLM's CPU / SGLang's CPU_PINNED tier, N kept), e.g.

    /tmp/realpub/bin/python tests/data/attach/run_real_publishers.py --server vllm --dp 2 --port 47300 \
        --replay-port 47400 --seconds 20 --groups 2 --window 1024 --lora sql-adapter --session --host-tier 500
    kvscope attach --vllm tcp://127.0.0.1:47300,dp=2,replay=47400,topic=kv-events

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
    ap.add_argument("--groups", type=int, choices=(1, 2), default=1,
                    help="vLLM: 2 adds a second KV-cache group (sliding window, the same blocks) as a hybrid model has")
    ap.add_argument("--window", type=int, default=256, help="with --groups 2: the sliding window in tokens (256)")
    ap.add_argument("--lora", metavar="NAME", help="every other conversation under this LoRA (lora_name, lora_id 1; "
                                                   "vLLM: extra_keys)")
    ap.add_argument("--session", action="store_true", help="session_id per conversation")
    ap.add_argument("--salt", action="store_true", help="SGLang: cache_salt per tenant")
    ap.add_argument("--bigram", type=int, default=0, metavar="K", help="SGLang: every K-th page an EAGLE bigram page")
    ap.add_argument("--host-tier", type=int, default=0, metavar="N",
                    help="evicted GPU blocks offloaded to the host tier (vLLM CPU, SGLang CPU_PINNED), N kept")
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
    vllm = args.server == "vllm"
    host = "CPU" if vllm else "CPU_PINNED"  # vLLM's offloading CPU tier / SGLang HiCache's host tier
    gpu = [deque() for _ in pubs]  # resident GPU blocks (group 0), oldest first
    win = [deque() for _ in pubs]  # group 1 (sliding window): the current conversation's last blocks
    cpu = [deque() for _ in pubs]
    parents = [None] * len(pubs)
    sent = [dict(batches=0, events=0, stored=0, removed=0) for _ in pubs]
    tok = [r * 10**8 for r in range(len(pubs))]  # each rank's own conversations (token ids, so hashes, apart)

    def removed(hashes, medium, group):
        return mod.BlockRemoved(block_hashes=hashes, medium=medium, **({"group_idx": group} if vllm else {}))

    def stored(r, h, toks, conv, medium="GPU", group=0):
        lora = args.lora if args.lora and conv % 2 else None
        f = dict(block_hashes=[h], parent_block_hash=parents[r] if medium == "GPU" else None, token_ids=toks,
                 block_size=16, lora_id=(1 if lora else None), medium=medium, lora_name=lora)
        if args.session:
            f["session_id"] = f"chat-{r}-{conv}"
        if vllm:
            f.update(group_idx=group, kv_cache_spec_kind="sliding_window" if group else "full_attention")
            if group:
                f["kv_cache_spec_sliding_window"] = args.window
            if lora:
                f["extra_keys"] = [(lora,)]
        else:
            if args.salt:
                f["cache_salt"] = f"tenant-{conv % 3}"
            if args.bigram and medium == "GPU" and (toks[0] // 16) % args.bigram == 0:
                f["token_ids"] = [[t, t + 1] for t in toks]  # an EAGLE bigram page
        return mod.BlockStored(**f)

    t0 = time.monotonic()
    while time.monotonic() - t0 < args.seconds:
        for r, pub in enumerate(pubs):
            events = []
            while len(events) < args.batch:
                if len(gpu[r]) > args.resident:
                    gone = [gpu[r].popleft() for _ in range(8)]
                    events.append(removed([h for h, _ in gone], "GPU", 0))
                    sent[r]["removed"] += len(gone)
                    if args.host_tier:  # offloaded to the host tier, which keeps its newest --host-tier
                        for h, toks in gone:
                            events.append(stored(r, h, toks, toks[0] // 640, medium=host))
                            cpu[r].append(h)
                            sent[r]["stored"] += 1
                        if len(cpu[r]) > args.host_tier:
                            old = [cpu[r].popleft() for _ in range(len(cpu[r]) - args.host_tier)]
                            events.append(removed(old, host, 0))
                            sent[r]["removed"] += len(old)
                    continue
                conv = tok[r] // 640
                if tok[r] % 640 == 0:
                    parents[r] = None  # a new conversation
                    if win[r]:  # the sliding-window group drops the previous conversation's blocks
                        events.append(removed(list(win[r]), "GPU", 1))
                        sent[r]["removed"] += len(win[r])
                        win[r].clear()
                toks = list(range(tok[r], tok[r] + 16))
                tok[r] += 16
                h = _hash(args.server, parents[r], toks)
                events.append(stored(r, h, toks, conv))
                sent[r]["stored"] += 1
                if vllm and args.groups == 2:
                    events.append(stored(r, h, toks, conv, group=1))
                    sent[r]["stored"] += 1
                    win[r].append(h)
                    if len(win[r]) > args.window // 16:
                        events.append(removed([win[r].popleft()], "GPU", 1))
                        sent[r]["removed"] += 1
                parents[r] = h
                gpu[r].append((h, toks))
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
