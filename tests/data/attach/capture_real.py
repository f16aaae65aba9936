"""Capture what vLLM's and SGLang's own KV-event publishers put on the wire, for tests/attach/test_attach_real_bytes.py.

Not part of the test suite, and not run with KV Scope's venv: it needs the real packages, which are never
KV Scope dependencies. In a scratch venv outside the repo:

    python3 -m venv /tmp/realpub
    /tmp/realpub/bin/pip install --no-deps vllm==0.33.0 sglang==0.5.23   # or the wheels in /tmp/pkgs
    /tmp/realpub/bin/pip install msgspec pyzmq pydantic psutil urllib3    # what their kv_events modules import
    /tmp/realpub/bin/python tests/data/attach/capture_real.py tests/data/attach/real_frames.json

It loads `vllm/distributed/kv_events.py` and `sglang/srt/disaggregation/kv_events.py` from the installed
packages without running the packages' `__init__` (which import torch and the model code). Stubbed, because
they import torch and are not about the wire: `vllm.config.utils.config` (vLLM's config decorator, replaced by
`dataclasses.dataclass`: it only shapes `KVEventsConfig`, which the publisher keeps and never sends) and
`vllm.v1.core.kv_cache_utils` (only `ExternalBlockHash = bytes | int`, copied from vLLM 0.33.0's line 57). Every
other module they import is the real one. Nothing else is patched: the events are the packages' structs, the
encoding their publisher thread's `msgspec.msgpack.Encoder`, the ports their `offset_endpoint_port`.

On 127.0.0.1 only. For each server, two data-parallel ranks publish through `ZmqEventPublisher` (rank r
publishes on PUB+r and answers replay on REPLAY+r, as the servers compute it); a plain SUB receives the live
frames, then a DEALER asks each rank's replay ROUTER for everything from seq 0 (and from seq 1) and records
the replies frame by frame, end marker included. vLLM binds its PUB only on a wildcard host (`tcp://*:PORT`,
every interface) or ipc/inproc, and connects it otherwise; a PUB connecting to a bound SUB delivered nothing
on this machine (not even between two plain pyzmq sockets), so vLLM's PUB publishes on inproc (the same bytes:
the frames do not depend on the transport; the capture's SUB shares pyzmq's global context with it) and its
replay ROUTER on tcp://127.0.0.1. SGLang's PUB binds 127.0.0.1 (`bind=True`). The ports both servers derive
per rank are recorded from their own `offset_endpoint_port` ("ports" in the JSON). The events published are
in SCENARIO (hashes as {"hex": ...} for bytes); the JSON written holds them, the package versions, and every
frame in base64.
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import importlib.metadata
import json
import os
import socket
import sys
import time
import types

import zmq

TOPIC = "kv-events"
INPROC = "inproc://kvscope-capture"  # vLLM's PUB endpoint here (rank r: INPROC + "_dp{r}", vLLM's own offset)
TS = 1767225600.25  # fixed batch times, so the bytes are the same on every run


def _h(n: int, width: int = 32) -> dict:
    return {"hex": n.to_bytes(width, "big").hex()}


# What each rank publishes, batch by batch: (event kind, fields). Field names are the servers' own.
SCENARIO = {
    "vllm": {
        0: [
            [("BlockStored", dict(block_hashes=[_h(0xA1), _h(0xA2)], parent_block_hash=None,
                                  token_ids=list(range(100, 132)), block_size=16, lora_id=None, medium="GPU",
                                  lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention",
                                  session_id="chat-42")),
             ("BlockStored", dict(block_hashes=[_h(0xA3)], parent_block_hash=_h(0xA2), token_ids=list(range(132, 148)),
                                  block_size=16, lora_id=3, medium="GPU", lora_name="sql-adapter",
                                  extra_keys=[["sql-adapter", "salt-1"]], group_idx=0,
                                  kv_cache_spec_kind="full_attention", session_id="chat-42",
                                  lookahead_token_ids=[[148, 149]]))],
            # a second KV-cache group (a sliding-window layer group of a hybrid model)
            [("BlockStored", dict(block_hashes=[_h(0xB1)], parent_block_hash=None, token_ids=list(range(200, 216)),
                                  block_size=16, lora_id=None, medium="GPU", lora_name=None, group_idx=1,
                                  kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=4096))],
            # the offloading connector: a placeholder store (hash only) to CPU, a full one to STORAGE, a removal
            [("BlockStored", dict(block_hashes=[_h(0xC1)], parent_block_hash=None, token_ids=[], block_size=0,
                                  lora_id=None, medium="CPU", lora_name=None, group_idx=0, locality="LOCAL")),
             ("BlockStored", dict(block_hashes=[_h(0xA1)], parent_block_hash=None, token_ids=list(range(100, 116)),
                                  block_size=16, lora_id=None, medium="STORAGE", lora_name=None, group_idx=0,
                                  kv_cache_spec_kind="full_attention", locality="REMOTE", ownership="tier-2")),
             ("BlockRemoved", dict(block_hashes=[_h(0xC1)], medium="CPU", group_idx=0, locality="LOCAL"))],
            [("BlockRemoved", dict(block_hashes=[_h(0xA3), _h(0xA2)], medium="GPU", group_idx=0)),
             ("AllBlocksCleared", {})],
        ],
        1: [
            # int hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1: the sha256's top 64 bits, unsigned)
            [("BlockStored", dict(block_hashes=[(1 << 64) - 5, 77], parent_block_hash=None,
                                  token_ids=list(range(300, 332)), block_size=16, lora_id=None, medium="GPU",
                                  lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention"))],
            [("BlockRemoved", dict(block_hashes=[77], medium="GPU", group_idx=0))],
        ],
    },
    "sglang": {
        0: [
            [("BlockStored", dict(block_hashes=[-(1 << 63) + 9], parent_block_hash=None, token_ids=list(range(10, 26)),
                                  block_size=16, lora_id=None, medium="GPU", cache_salt="tenant-7",
                                  session_id="s-1", lora_name="math-lora")),
             ("BlockStored", dict(block_hashes=[4242], parent_block_hash=-(1 << 63) + 9,
                                  token_ids=list(range(26, 42)), block_size=16, lora_id=None, medium="GPU"))],
            # an EAGLE "bigram" page: (token, next token) pairs
            [("BlockStored", dict(block_hashes=[-17], parent_block_hash=4242,
                                  token_ids=[[t, t + 1] for t in range(42, 58)], block_size=16, lora_id=None,
                                  medium="GPU"))],
            # HiCache: the host tier (CPU_PINNED), disk, a shared pool (EXTERNAL)
            [("BlockStored", dict(block_hashes=[4242], parent_block_hash=None, token_ids=list(range(26, 42)),
                                  block_size=16, lora_id=None, medium="CPU_PINNED")),
             ("BlockStored", dict(block_hashes=[5151], parent_block_hash=None, token_ids=list(range(60, 76)),
                                  block_size=16, lora_id=None, medium="DISK")),
             ("BlockStored", dict(block_hashes=[6161], parent_block_hash=None, token_ids=list(range(80, 96)),
                                  block_size=16, lora_id=None, medium="EXTERNAL")),
             ("BlockRemoved", dict(block_hashes=[4242], medium="CPU_PINNED"))],
            [("BlockRemoved", dict(block_hashes=[-17, 4242], medium="GPU")), ("AllBlocksCleared", {})],
        ],
        1: [
            [("BlockStored", dict(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(32)),
                                  block_size=16, lora_id=None, medium="GPU"))],
            [("BlockRemoved", dict(block_hashes=[2], medium="GPU"))],
        ],
    },
}


def _site() -> str:
    import msgspec

    return os.path.dirname(os.path.dirname(msgspec.__file__))


def _package_stub(name: str, site: str) -> None:
    """A package whose __init__ is not run (its submodules still import normally)."""
    if name not in sys.modules:
        m = types.ModuleType(name)
        m.__path__ = [os.path.join(site, *name.split("."))]
        sys.modules[name] = m


def load_vllm():
    site = _site()
    for name in ("vllm", "vllm.config", "vllm.distributed", "vllm.utils", "vllm.v1", "vllm.v1.core"):
        _package_stub(name, site)
    utils = types.ModuleType("vllm.config.utils")
    utils.config = dataclasses.dataclass
    sys.modules[utils.__name__] = utils
    kcu = types.ModuleType("vllm.v1.core.kv_cache_utils")
    kcu.ExternalBlockHash = bytes | int
    sys.modules[kcu.__name__] = kcu
    return importlib.import_module("vllm.distributed.kv_events")


def load_sglang():
    site = _site()
    for name in ("sglang", "sglang.srt", "sglang.srt.disaggregation", "sglang.srt.utils"):
        _package_stub(name, site)
    return importlib.import_module("sglang.srt.disaggregation.kv_events")


def _value(v):
    if isinstance(v, dict) and set(v) == {"hex"}:
        return bytes.fromhex(v["hex"])
    if isinstance(v, list):
        return [_value(x) for x in v]
    return v


def _events(mod, flavor: str, batch: list) -> list:
    out = []
    for kind, fields in batch:
        f = {k: _value(v) for k, v in fields.items()}
        if flavor == "vllm" and "extra_keys" in f:
            f["extra_keys"] = [tuple(k) for k in f["extra_keys"]]
        if flavor == "sglang" and isinstance(f.get("token_ids"), list) and f["token_ids"] and \
                isinstance(f["token_ids"][0], list):
            f["token_ids"] = [tuple(p) for p in f["token_ids"]]  # as SGLang builds a bigram page
        if flavor == "sglang" and "medium" in f:
            f["medium"] = mod.StorageMedium(f["medium"])  # SGLang passes its enum
        out.append(getattr(mod, kind)(**f))
    return out


def _free_ports(n: int) -> int:
    """A base port with n free ports after it on 127.0.0.1."""
    for base in range(41000, 60000, 97):
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def _b64(frames) -> list[str]:
    return [base64.b64encode(bytes(f)).decode() for f in frames]


def capture(flavor: str, mod, ctx: zmq.Context) -> dict:
    ranks = sorted(SCENARIO[flavor])
    base = _free_ports(8)
    pub_base, replay_base = base, base + 4  # replay apart from the publishers, as DP >= 2 needs
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    pubs = []
    for r in ranks:
        if flavor == "vllm":  # see the module's docstring: vLLM's PUB on inproc, its replay ROUTER on tcp
            pubs.append(mod.ZmqEventPublisher(r, endpoint=INPROC, replay_endpoint=f"tcp://127.0.0.1:{replay_base}",
                                              topic=TOPIC))
            sub.connect(pubs[-1]._endpoint)
        else:
            pubs.append(mod.ZmqEventPublisher(r, endpoint=f"tcp://127.0.0.1:{pub_base}",
                                              replay_endpoint=f"tcp://127.0.0.1:{replay_base}", topic=TOPIC,
                                              bind=True))
            sub.connect(f"tcp://127.0.0.1:{pub_base + r}")
    time.sleep(2.0)  # connections and subscriptions are up before anything is published (PUB drops until then)
    for r, pub in zip(ranks, pubs):
        for i, batch in enumerate(SCENARIO[flavor][r]):
            pub.publish(mod.KVEventBatch(ts=TS + 0.5 * i + r, events=_events(mod, flavor, batch)))
    want = sum(len(SCENARIO[flavor][r]) for r in ranks)
    live = []
    end = time.monotonic() + 10
    while len(live) < want and time.monotonic() < end:
        if sub.poll(200):
            live.append(sub.recv_multipart())
    assert len(live) == want, f"{flavor}: {len(live)} of {want} live frames ({[len(p._buffer) for p in pubs]} " \
        f"in the publishers' buffers; {[p._endpoint for p in pubs]})"
    off = mod.ZmqEventPublisher.offset_endpoint_port
    out = {"ports": {"pub_base": pub_base, "replay_base": replay_base,
                     "offset_examples": {ep: [off(ep, r) for r in range(4)]
                                         for ep in ("tcp://*:5557", "tcp://*:5558", "tcp://10.0.0.5:5600",
                                                    "tcp://*:0")}},
           "ranks": []}
    for r, pub in zip(ranks, pubs):
        rank_live = []
        for topic, seq, payload in live:
            if payload in [p for _, p in pub._buffer]:
                rank_live.append([topic, seq, payload])
        replays = []
        for start in (0, 1):
            d = ctx.socket(zmq.DEALER)
            d.connect(f"tcp://127.0.0.1:{replay_base + r}")
            d.send_multipart([b"", start.to_bytes(8, "big")])
            replies = []
            while True:
                assert d.poll(5000), f"{flavor} rank {r}: the replay socket did not answer"
                parts = d.recv_multipart()
                replies.append(_b64(parts))
                if len(parts) >= 2 and parts[-2] == (-1).to_bytes(8, "big", signed=True):
                    break
            d.close(0)
            replays.append({"start": start, "replies": replies})
        out["ranks"].append({"rank": r, "endpoint": pub._endpoint, "replay_endpoint": pub._replay_endpoint,
                             "live": [_b64(f) for f in rank_live], "replay": replays})
    for pub in pubs:
        pub.shutdown()
    sub.close(0)
    return out


def _retry(flavor: str, mod, ctx: zmq.Context, tries: int = 3) -> dict:
    for i in range(tries):
        try:
            return capture(flavor, mod, ctx)
        except AssertionError as e:  # a slow connection dropped a live frame: again, on fresh ports
            print(f"{flavor}: {e}; again", file=sys.stderr)
            if i == tries - 1:
                raise
    raise AssertionError("unreachable")


def main(path: str) -> int:
    vllm, sglang = load_vllm(), load_sglang()
    ctx = zmq.Context.instance()
    data = {"about": "frames from vLLM's and SGLang's own ZmqEventPublisher on 127.0.0.1; "
                     "written by tests/data/attach/capture_real.py",
            "versions": {p: importlib.metadata.version(p) for p in ("vllm", "sglang", "msgspec", "pyzmq")},
            "topic": TOPIC, "ts": TS, "scenario": {k: {str(r): b for r, b in v.items()} for k, v in SCENARIO.items()},
            "vllm": _retry("vllm", vllm, ctx), "sglang": _retry("sglang", sglang, ctx)}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    n = sum(len(r["live"]) for k in ("vllm", "sglang") for r in data[k]["ranks"])
    print(f"wrote {path}: {n} live frames, versions {data['versions']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "real_frames.json")))
