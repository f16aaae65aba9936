"""`kvscope attach --bench-decode`: how many events per second the decoder takes, for payloads shaped as the
servers send them (engine/attach/wire.py: vLLM 0.33 and SGLang 0.5 byte for byte, and the older layouts).

The payloads are the fake workload's (engine/attach/fake/workload.py: chat requests storing and evicting
blocks of 16 tokens, 50 events per batch), encoded once; the timed loop is `decode_batch` alone, on this
thread, over and over for a fixed time per shape, then the same with each batch applied to a ClusterState as
the ingest process does. Reported per shape: events/s both ways, MB/s, and which path the batches took
(typed: msgspec in C; tolerant: the Python fallback).
"""

from __future__ import annotations

import time

import msgspec

from engine.attach.events import decode_batch
from engine.attach.fake.workload import FakeCache

# (label, flavor, layout, hash kind): the current servers first
SHAPES = (("vllm 0.33 (tagged maps, bytes hashes)", "vllm", "tagged", "bytes"),
          ("sglang 0.5 (tagged maps, int64 hashes)", "sglang", "tagged", "int64"),
          ("vllm <= 0.10 (array-like events)", "vllm", "array", "int"),
          ("map batch (no server; tolerated)", "vllm", "map", "bytes"))


def payloads(flavor: str, layout: str, hash_kind: str, batches: int = 200, per_batch: int = 50,
             seed: int = 0) -> tuple[list[bytes], int]:
    from engine.attach.events import encode_batch

    cache = FakeCache(capacity=3000, seed=seed, hash_kind=hash_kind, flavor=flavor)
    pending: list = []
    out, n = [], 0
    for _ in range(batches):
        while len(pending) < per_batch:
            pending.extend(cache.request(0.0))
        evs, pending = pending[:per_batch], pending[per_batch:]
        out.append(encode_batch(1.7e9, evs, 0, encoding=layout, flavor=flavor))
        n += len(evs)
    return out, n


def _path(b) -> str:
    """The typed path leaves token ids undecoded (msgspec.Raw); the tolerant one has decoded them."""
    stored = [e for e in b.events if e.KIND == 0]
    return "typed" if stored and isinstance(stored[0].token_ids, msgspec.Raw) else "tolerant"


def _timed(ps: list[bytes], n: int, seconds: float, step) -> tuple[float, int]:
    done = 0
    t0 = time.perf_counter()
    while True:
        for p in ps:
            step(p)
        done += n
        el = time.perf_counter() - t0
        if el >= seconds:
            return done / el, done


def run(seconds: float = 2.0, decode=decode_batch, shapes=SHAPES, say=print, batches: int = 400,
        apply: bool = True) -> dict:
    """Per shape: decode alone, then decode + apply to a ClusterState (what the ingest process does per
    batch, the block map's bookkeeping included), each for `seconds`."""
    from engine.attach.cluster import ClusterState

    res = {}
    for label, flavor, layout, hk in shapes:
        ps, n = payloads(flavor, layout, hk, batches=batches)
        size = sum(len(p) for p in ps)
        probe = decode(ps[0])
        decode_s, done = _timed(ps, n, seconds, decode)
        cluster = ClusterState(["bench"])
        apply_s = _timed(ps, n, seconds, lambda p: cluster.apply(0, decode(p)))[0] if apply else float("nan")
        res[label] = {"events_per_s": decode_s, "with_apply_events_per_s": apply_s,
                      "mb_per_s": decode_s * size / n / 1e6, "bytes_per_event": size / n, "path": _path(probe),
                      "events_decoded": done}
        say(f"[bench-decode] {label}: decode {decode_s:,.0f} events/s ({res[label]['mb_per_s']:.0f} MB/s, "
            f"{size / n:.0f} B/event, {res[label]['path']} path); decode + apply {apply_s:,.0f} events/s")
    return res
