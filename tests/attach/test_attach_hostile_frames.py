"""A hostile or broken peer's frames through a real subscription (127.0.0.1; this test plays the server): a frame
nested 100k deep (in the batch, in extra_keys, in token_ids) and one over the size limit are each counted as
malformed, and the batches after them still arrive: the subscriber thread lives on."""

from __future__ import annotations

import time

import zmq

from engine.attach.events import MAX_FRAME_BYTES, BlockStored
from engine.attach.fake.publisher import encode
from engine.attach.session import AttachSession
from engine.attach.source import parse_source

_DEEP = b"\x91" * 100_000 + b"\xc0"
_TS = b"\xcb" + bytes(8)
_STORED = b"\x93" + _TS + b"\x91\x83\xa4type\xabBlockStored\xacblock_hashes\x91\x01"
_BIG = MAX_FRAME_BYTES + 16
HOSTILE = [_DEEP, _STORED + b"\xaaextra_keys" + _DEEP + b"\x00", _STORED + b"\xa9token_ids" + _DEEP + b"\x00",
           b"\x93" + _TS + b"\x91\x99\xabBlockStored\x91\x01\xc0\x90\x10\xc0\xc0\xc0" + _DEEP,  # array-like extra_keys
           b"\x82\xa2ts" + _TS + b"\xa6events\x91\x82\xa4type\xabBlockStored\xa9token_ids" + _DEEP,  # a map batch
           b"\x93" + _TS + b"\x91\x81\xa3pad\xc6" + _BIG.to_bytes(4, "big") + b"x" * _BIG + b"\x00"]


def test_nested_and_oversized_frames_are_counted_and_the_stream_goes_on():
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    session = AttachSession(parse_source("vllm", f"tcp://127.0.0.1:{port},replay=none"), []).start()
    try:
        good = [encode([BlockStored([i], None, list(range(16)), 16)], 1.0 + i, 0, "vllm", "tagged") for i in range(3)]
        frames = [good[0]] + HOSTILE + good[1:]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not session.statuses()[0].frames:
            pub.send_multipart([b"kv-events", (0).to_bytes(8, "big"), good[0]])  # until the SUB is connected
            time.sleep(0.2)
        for seq, payload in enumerate(frames[1:], start=1):
            pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), payload])
        while time.monotonic() < deadline and session.cluster.activity()[0].events < 3:
            time.sleep(0.05)
        st = session.statuses()[0]
        assert session.cluster.activity()[0].events == 3, st
        assert st.malformed == len(HOSTILE) and st.lost == 0
        assert all(s.is_alive() for s in session.subscribers)
    finally:
        session.stop()
        pub.close(0)
        ctx.term()
