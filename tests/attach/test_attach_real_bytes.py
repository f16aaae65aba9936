"""The real servers' bytes: frames captured from vLLM 0.33.0's and SGLang 0.5.23's own ZmqEventPublisher
(tests/data/attach/real_frames.json, written by tests/data/attach/capture_real.py against the real packages in a
scratch venv). The decoder takes every live frame on its typed path with every field; the replay replies are
today's layout; the fake publisher sends the same bytes for the same events; the subscriber, fed the real
frames and replies over 127.0.0.1, applies every batch and its history."""

from __future__ import annotations

import base64
import json
import os
import time

import msgspec
import pytest
import zmq

from engine.attach.block_state import token_list
from engine.attach.cluster import ClusterState
from engine.attach.events import (AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, event_meta,
                                  is_placeholder, medium_of, plain)
from engine.attach.fake.publisher import encode, replay_frames

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "attach", "real_frames.json")
REAL = json.load(open(DATA))
SERVERS = ("vllm", "sglang")
TIER = {"GPU": "GPU", "CPU": "CPU", "CPU_PINNED": "CPU", "DISK": "DISK", "STORAGE": "DISK", "EXTERNAL": "EXTERNAL"}


def _b(x: str) -> bytes:
    return base64.b64decode(x)


def _value(v):
    if isinstance(v, dict) and set(v) == {"hex"}:
        return bytes.fromhex(v["hex"])
    if isinstance(v, list):
        return [_value(x) for x in v]
    return v


def _ranks(server: str):
    for r in REAL[server]["ranks"]:
        yield r["rank"], [[_b(x) for x in f] for f in r["live"]], REAL["scenario"][server][str(r["rank"])], r


def _cases():
    for server in SERVERS:
        for rank, live, batches, _ in _ranks(server):
            for i, (frame, batch) in enumerate(zip(live, batches)):
                yield pytest.param(server, rank, i, frame, batch, id=f"{server}-dp{rank}-batch{i}")


def test_the_capture_names_the_real_versions_and_has_every_case():
    assert REAL["versions"]["vllm"] == "0.33.0" and REAL["versions"]["sglang"] == "0.5.23"
    kinds = {(s, kind) for s in SERVERS for b in REAL["scenario"][s].values() for batch in b for kind, _ in batch}
    assert kinds == {(s, k) for s in SERVERS for k in ("BlockStored", "BlockRemoved", "AllBlocksCleared")}
    for s in SERVERS:
        assert [r["rank"] for r in REAL[s]["ranks"]] == [0, 1]
        assert all(len(r["live"]) == len(REAL["scenario"][s][str(r["rank"])]) for r in REAL[s]["ranks"])


@pytest.mark.parametrize("server,rank,i,frame,batch", list(_cases()))
def test_a_real_live_frame_decodes_on_the_typed_path_with_every_field(server, rank, i, frame, batch):
    topic, seq, payload = frame
    assert topic == REAL["topic"].encode() and int.from_bytes(seq, "big") == i
    b = decode_batch(payload)
    assert b.bad_events == b.unknown_events == 0
    assert b.data_parallel_rank == rank and b.ts == REAL["ts"] + 0.5 * i + rank
    assert len(b.events) == len(batch)
    for ev, (kind, f) in zip(b.events, batch):
        assert ev.KIND == {"BlockStored": 0, "BlockRemoved": 1, "AllBlocksCleared": 2}[kind]
        f = {k: _value(v) for k, v in f.items()}
        if kind == "AllBlocksCleared":
            continue
        assert ev.block_hashes == f["block_hashes"]
        assert medium_of(ev) == TIER[f["medium"]]
        for k in ("group_idx", "locality", "ownership"):
            assert getattr(ev, k) == f.get(k)
        if kind == "BlockRemoved":
            continue
        assert isinstance(ev.token_ids, msgspec.Raw)  # the typed path: token ids left for the tooltip
        toks = f["token_ids"]
        assert token_list(ev.token_ids) == [t[0] if isinstance(t, list) else t for t in toks]  # bigram pairs
        assert ev.parent_block_hash == f["parent_block_hash"] and ev.block_size == f["block_size"]
        for k in ("lora_id", "lora_name", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "session_id",
                  "cache_salt"):
            assert getattr(ev, k) == f.get(k), k
        for k in ("extra_keys", "lookahead_token_ids"):
            assert plain(getattr(ev, k)) == f.get(k), k
        assert is_placeholder(ev) == (f["block_size"] == 0 and not toks)


def test_signed_and_unsigned_64_bit_int_hashes_and_bytes_hashes_all_arrive():
    hashes = set()
    for server in SERVERS:
        for _, live, _, _ in _ranks(server):
            for _, _, payload in live:
                for ev in decode_batch(payload).events:
                    hashes.update(getattr(ev, "block_hashes", ()))
    assert -(1 << 63) + 9 in hashes and (1 << 64) - 5 in hashes and bytes.fromhex("00" * 31 + "a1") in hashes


@pytest.mark.parametrize("server", SERVERS)
def test_the_replay_replies_are_the_live_frames_in_todays_layout_and_end_with_the_marker(server):
    end = (-1).to_bytes(8, "big", signed=True)
    for _, live, _, r in _ranks(server):
        for rep in r["replay"]:
            replies = [[_b(x) for x in parts] for parts in rep["replies"]]
            assert replies[-1] == [b"", b"", end, b""]
            assert [p[1:] for p in replies[:-1]] == live[rep["start"]:]
            assert all(p[0] == b"" and len(p) == 4 for p in replies)


def _events(server: str, batch: list) -> list:
    out = []
    for kind, f in batch:
        f = {k: _value(v) for k, v in f.items()}
        if kind == "BlockStored":
            out.append(BlockStored(**f))
        elif kind == "BlockRemoved":
            out.append(BlockRemoved(**f))
        else:
            out.append(AllBlocksCleared())
    return out


@pytest.mark.parametrize("server,rank,i,frame,batch", list(_cases()))
def test_the_fake_publisher_sends_the_real_bytes_for_the_same_events(server, rank, i, frame, batch):
    payload = encode(_events(server, batch), REAL["ts"] + 0.5 * i + rank, rank, server, "tagged")
    assert payload == frame[2]


@pytest.mark.parametrize("server", SERVERS)
def test_the_fake_publishers_replay_answer_is_the_real_one(server):
    for _, live, _, r in _ranks(server):
        buffer = [(int.from_bytes(seq, "big"), payload) for _, seq, payload in live]
        for rep in r["replay"]:
            real = [tuple(_b(x) for x in parts) for parts in rep["replies"]]
            assert replay_frames(REAL["topic"].encode(), buffer, rep["start"]) == real
            old = replay_frames(REAL["topic"].encode(), buffer, rep["start"], "old")
            assert [f[1:] for f in old] == [f[2:] for f in real]  # the older layout: no topic frame


def test_the_real_frames_applied_make_one_map_per_rank_tier_and_group_with_its_fields():
    c = ClusterState(["vllm", "sglang"])
    for src, server in enumerate(SERVERS):
        for rank, live, _, _ in _ranks(server):
            for _, _, payload in live[:-1]:  # the last batch removes and clears
                c.apply(src, decode_batch(payload), rank)
    keys = set(c.groups)
    assert {(0, 0, "GPU", 0), (0, 0, "GPU", 1), (0, 0, "CPU", 0), (0, 0, "DISK", 0), (0, 1, "GPU", 0)} <= keys
    assert {(1, 0, "GPU", 0), (1, 0, "CPU", 0), (1, 0, "DISK", 0), (1, 0, "EXTERNAL", 0), (1, 1, "GPU", 0)} <= keys
    assert "sliding window 4,096 tokens" in c.group_label((0, 0, "GPU", 1))
    assert "full attention" in c.group_label((0, 0, "GPU", 0))
    g = c.groups[(0, 0, "GPU", 0)]
    info = g.info(g.index[bytes.fromhex("00" * 31 + "a3")], time.time())
    assert info["meta"]["lora_name"] == "sql-adapter" and info["meta"]["session_id"] == "chat-42"
    assert info["lora"] == 3 and plain(info["meta"]["extra_keys"]) == [["sql-adapter", "salt-1"]]
    # the offloading connector's placeholder: on the CPU map, hash only, depth unknown, block size untouched
    cpu = c.groups[(0, 0, "CPU", 0)]
    assert len(cpu) == 0 and cpu.removed == 1  # stored then removed in the same batch
    disk = c.groups[(0, 0, "DISK", 0)]
    assert disk.block_size == 16 and len(disk) == 1
    sg = c.groups[(1, 0, "GPU", 0)]
    bigram = sg.info(sg.index[-17], time.time())
    assert bigram["tokens"] == list(range(42, 50)) and bigram["depth"] == 2
    root = sg.info(sg.index[-(1 << 63) + 9], time.time())
    assert root["meta"] == {"lora_name": "math-lora", "session_id": "s-1", "cache_salt": "tenant-7"}


def test_a_placeholder_store_keeps_the_maps_block_size_and_has_an_unknown_depth():
    c = ClusterState(["v"])
    c.apply(0, decode_batch(encode([BlockStored([1], None, list(range(16)), 16, medium="CPU")], 1.0, 0, "vllm",
                                   "tagged")))
    c.apply(0, decode_batch(encode([BlockStored([2], None, [], 0, medium="CPU", group_idx=0)], 2.0, 0, "vllm",
                                   "tagged")))
    g = c.groups[(0, 0, "CPU", 0)]
    assert g.block_size == 16
    info = g.info(g.index[2], 3.0)
    assert info["depth"] == -1 and info["meta"] == {"placeholder": True}
    assert event_meta(BlockStored([3], None, list(range(16)), 16)) is None


def test_the_subscriber_applies_real_frames_and_fetches_history_from_a_real_replay_answer():
    """The real bytes over 127.0.0.1: this test plays the server (PUB + ROUTER answering with the captured
    replies), the attach session only connects. History is asked for at connect (seq 0 on), before any live
    frame; the first live frame is seq 2: seqs 0-1 count as history, whatever came first, and nothing is applied
    twice (the replay buffer's seqs 2-3 and the live ones are one batch each)."""
    from engine.attach.session import AttachSession
    from engine.attach.source import parse_source

    rank, live, _, r = next(_ranks("vllm"))
    replies = {rep["start"]: [[_b(x) for x in parts] for parts in rep["replies"]] for rep in r["replay"]}
    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    rport = router.bind_to_random_port("tcp://127.0.0.1")
    session = AttachSession(parse_source("vllm", f"tcp://127.0.0.1:{port},replay=tcp://127.0.0.1:{rport}"), [])
    session.start()
    try:
        expected = sum(len(decode_batch(p).events) for _, _, p in live)
        deadline = time.monotonic() + 30
        asked, next_send = [], 0.0
        while time.monotonic() < deadline and (session.cluster.activity()[0].events != expected
                                               or session.statuses()[0].first_seq is None):
            if time.monotonic() > next_send:
                # until the SUB is connected a PUB drops what it sends; frames seen twice count as duplicates
                for f in live[2:]:
                    pub.send_multipart(f)
                next_send = time.monotonic() + 0.3
            if router.poll(50):
                ident, _, start_b = router.recv_multipart()
                start = int.from_bytes(start_b, "big")
                asked.append(start)
                for parts in replies[start]:
                    router.send_multipart([ident] + parts)
        st = session.statuses()[0]
        assert session.cluster.activity()[0].events == expected, (st, asked)
        assert asked[0] == 0 and st.history == 2 and st.malformed == 0 and st.first_seq == 2
        assert st.batches == len(live) and st.history_missing == 0 and st.gaps == 0
        assert {(0, rank, "GPU", 0), (0, rank, "GPU", 1)} <= set(session.cluster.groups)
    finally:
        session.stop()
        pub.close(0)
        router.close(0)
        ctx.term()
