"""The replay socket as the real servers run it, and as a broken one does, with real ZMQ sockets on 127.0.0.1.

The server side here is a few lines that do what vLLM 0.33.0's and SGLang 0.5.23's `ZmqEventPublisher` do
(vllm/distributed/kv_events.py `_publisher_thread` / `_service_replay`; the same code in
sglang/srt/disaggregation/kv_events.py): live frames (topic, seq as 8 big-endian bytes, payload); a replay
request (identity, "", start) answered with (identity, "", topic, seq, payload) for every buffered batch with
seq >= start, then (identity, "", "", -1 as 8 signed big-endian bytes, ""). The layout before vLLM 0.26 (no
topic frame) is read too. Payloads are the real shape: an array batch of tag-keyed maps.

A replay socket that never answers costs one wait, not one per gap; one that trickles is given up on at its
deadline; while a request is open the live frames queue (and say so); past the limits they are shed, counted.
"""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import zmq

from engine.attach.cluster import ClusterState
from engine.attach.source import SourceSpec
from engine.attach.subscriber import StreamLimits, Subscriber

END = (-1).to_bytes(8, "big", signed=True)
TOPIC = b"kv-events"


def payload(seq: int) -> bytes:
    """One batch as vLLM 0.33 encodes it: [ts, [BlockStored map], rank], defaults omitted."""
    ev = {"type": "BlockStored", "block_hashes": [1000 + seq], "parent_block_hash": None,
          "token_ids": list(range(16)), "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}
    return msgpack.packb([time.time(), [ev], 0], use_bin_type=True)


class Server:
    """PUB + ROUTER on 127.0.0.1 (the test plays the server); `mode`: how the ROUTER answers."""

    def __init__(self, mode: str = "vllm"):
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)  # never drop here: what the subscriber does is under test
        self.pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.SNDHWM, 100_000)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.mode, self.buffer, self.requests, self.seq = mode, [], 0, 0
        self.answer = threading.Event()  # mode "late": the ROUTER answers (from the buffer then) once this is set
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def spec(self, replay: bool = True) -> SourceSpec:
        return SourceSpec("vllm", f"tcp://127.0.0.1:{self.pub_port}",
                          f"tcp://127.0.0.1:{self.replay_port}" if replay else None, "", 0, "srv")

    def publish(self, n: int, live: bool = True, withhold=()) -> None:
        for _ in range(n):
            seq, self.seq = self.seq, self.seq + 1
            buf = payload(seq)
            with self._lock:
                self.buffer.append((seq, buf))
            if live and seq not in withhold:
                self.pub.send_multipart((TOPIC, seq.to_bytes(8, "big"), buf))

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            client, _, start_b = self.router.recv_multipart()
            self.requests += 1
            start = int.from_bytes(start_b, "big")
            if self.mode == "late":
                while not self.answer.wait(0.02):
                    if self._stop.is_set():
                        return
            with self._lock:
                todo = [(s, b) for s, b in self.buffer if s >= start]
            if self.mode == "silent":
                continue
            for s, b in todo:
                if self.mode == "trickle":  # one batch at a time, forever (the same ones again)
                    while not self._stop.wait(0.15):
                        self.router.send_multipart((client, b"", TOPIC, s.to_bytes(8, "big"), b))
                    return
                if self.mode == "short":  # the first reply only, then nothing (a ROUTER past its high-water mark)
                    self.router.send_multipart((client, b"", TOPIC, s.to_bytes(8, "big"), b))
                    break
                if self.mode == "old":
                    self.router.send_multipart((client, b"", s.to_bytes(8, "big"), b))
                else:
                    self.router.send_multipart((client, b"", TOPIC, s.to_bytes(8, "big"), b))
            if self.mode != "short":
                self.router.send_multipart((client, b"", END, b"") if self.mode == "old" else
                                           (client, b"", b"", END, b""))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


def _wait(pred, timeout=30.0, what="condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")


@pytest.fixture
def attach():
    made = []

    def make(server: Server, replay: bool = True, limits: StreamLimits | None = None):
        cl = ClusterState(["srv"])
        ctx = zmq.Context()
        sub = Subscriber(server.spec(replay), 0, cl, ctx, limits=limits)
        sub.start()
        made.append((sub, ctx))
        time.sleep(0.3)  # the SUB connects (frames before that are history, asked for too)
        return sub, cl

    yield make
    for sub, ctx in made:
        sub.stop()
        ctx.term()


@pytest.mark.parametrize("mode", ["vllm", "old"])
def test_a_warm_idle_server_gives_its_history_at_connect_without_a_live_frame(attach, mode):
    """Guards against: history was asked for only at the first live frame, so a server that published nothing more
    showed nothing (0 batches, history 0) while its replay buffer held all of it."""
    srv = Server(mode)
    try:
        srv.publish(40, live=False)  # all before we attached; nothing live after
        sub, cl = attach(srv)
        _wait(lambda: sub.status().batches == 40, 10, lambda: f"40 batches of history (have {sub.status()})")
        st = sub.status()
        assert st.history == 40 and st.history_missing == 0 and st.frames == 0 and st.first_seq is None
        assert srv.requests == 1 and len(cl.groups[(0, 0, "GPU", 0)]) == 40
        srv.publish(5)  # it wakes up: seq 40 on, live, as today
        _wait(lambda: sub.status().batches == 45, 10, lambda: f"45 batches (have {sub.status()})")
        st = sub.status()
        assert st.first_seq == 40 and st.history == 40 and st.gaps == 0 and st.duplicates == 0
        assert srv.requests == 1 and len(cl.groups[(0, 0, "GPU", 0)]) == 45
    finally:
        srv.close()


def test_history_asked_at_connect_ends_at_the_first_live_frame_and_nothing_is_applied_twice(attach):
    """The server answers late, after live frames it also holds in its buffer: the history stops at the first
    live frame's seq (the live stream has the rest), each batch is applied once and counted once."""
    srv = Server("late")
    try:
        srv.publish(40, live=False)
        sub, cl = attach(srv, limits=StreamLimits(replay_timeout_s=10.0))
        _wait(lambda: srv.requests == 1, 10, "the request at connect")
        srv.publish(10)  # seqs 40-49: live, and in the buffer the late answer is made from
        _wait(lambda: sub.status().frames == 10, 10, lambda: f"10 live frames queued (have {sub.status()})")
        assert sub.status().batches == 0 and sub.status().queued == 10  # held while the request is open
        srv.answer.set()
        _wait(lambda: sub.status().batches == 50, 10, lambda: f"50 batches (have {sub.status()})")
        _wait(lambda: not sub.status().queued, 10, "the queue applied")
        st = sub.status()
        assert st.history == 40 and st.first_seq == 40 and st.history_missing == 0 and st.batches == 50
        assert st.gaps == 0 and st.lost == 0 and st.duplicates == 0 and srv.requests == 1
        (a,) = cl.activity()
        assert a.events == 50 and a.stored_blocks == 50 and len(cl.groups[(0, 0, "GPU", 0)]) == 50
    finally:
        srv.close()


def test_a_first_live_frame_the_history_already_had_is_a_duplicate_not_history_nor_a_restart(attach):
    srv = Server()
    try:
        srv.publish(40, live=False)
        sub, cl = attach(srv)
        _wait(lambda: sub.status().batches == 40, 10, lambda: f"the history (have {sub.status()})")
        for seq in range(20, 40):  # the live stream's copies of the replay buffer's newest 20 (seq 20-39)
            srv.pub.send_multipart((TOPIC, seq.to_bytes(8, "big"), srv.buffer[seq][1]))
        srv.publish(3)  # seq 40-42
        _wait(lambda: sub.status().batches == 43, 10, lambda: f"43 batches (have {sub.status()})")
        st = sub.status()
        assert st.first_seq == 20 and st.history == 20  # the batches before the first live one
        assert st.duplicates == 20 and st.restarts == 0 and st.gaps == 0 and cl.activity()[0].events == 43
    finally:
        srv.close()


@pytest.mark.parametrize("mode", ["vllm", "old"])
def test_history_and_a_gap_are_recovered_in_the_servers_reply_layout(attach, mode):
    srv = Server(mode)
    try:
        srv.publish(40, live=False)  # before we attached: only in the replay buffer
        sub, cl = attach(srv)
        srv.publish(60, withhold=range(70, 75))
        _wait(lambda: sub.status().batches == 100, 20, lambda: f"100 batches (have {sub.status()})")
        st = sub.status()
        assert st.first_seq >= 40 and st.history == st.first_seq and st.history_missing == 0
        assert st.gaps == 1 and st.recovered == 5 and st.lost == 0 and st.malformed == 0
        assert len(cl.groups[(0, 0, "GPU", 0)]) == 100 and srv.requests == 2
    finally:
        srv.close()


def test_a_replay_socket_that_never_answers_is_asked_once_not_at_every_gap(attach):
    srv = Server("silent")
    try:
        sub, cl = attach(srv, limits=StreamLimits(replay_timeout_s=0.3))
        srv.publish(1)  # seq 0: no history to ask for
        _wait(lambda: sub.status().batches == 1, 10, "the first batch")
        gaps = [50 * k + 10 for k in range(1, 11)]  # a batch withheld every 50
        srv.publish(550, withhold=gaps)
        _wait(lambda: sub.status().batches == 551 - len(gaps), 20, lambda: f"the live batches (have {sub.status()})")
        st = sub.status()
        assert st.gaps == 10 and st.lost == 10 and st.recovered == 0
        # Asked twice in all: the history at connect (no answer: not rested, a server may be starting) and the
        # first gap (no answer: rested, the nine gaps after it counted lost unasked).
        assert srv.requests == 2 and st.replay_timeouts == 2 and st.replay_state == "backoff"
        notes = [t for _, k, t in cl.take_notes() if k == "replay"]
        assert any("no answer" in t and "counted lost" in t for t in notes)
    finally:
        srv.close()


def test_an_answer_that_stops_short_is_not_a_dead_replay_socket(attach):
    srv = Server("short")
    try:
        sub, cl = attach(srv, limits=StreamLimits(replay_timeout_s=0.3))
        srv.publish(1)
        _wait(lambda: sub.status().batches == 1, 10, "the first batch")
        srv.publish(100, withhold=(10, 11, 50, 51))
        _wait(lambda: sub.status().last_seq == 100 and not sub.status().queued, 20, lambda: f"all (have {sub.status()})")
        st = sub.status()
        # Asked at connect (nothing buffered: this server answers nothing at all) and at both gaps.
        assert srv.requests == 3 and st.replay_state != "backoff"
        assert st.recovered == 2 and st.lost == 2 and st.replay_timeouts == 3
        assert (11, 11) in st.lost_ranges and (51, 51) in st.lost_ranges
    finally:
        srv.close()


def test_a_trickling_replay_is_given_up_at_its_deadline_and_the_wait_is_visible(attach):
    srv = Server("trickle")
    try:
        sub, cl = attach(srv, limits=StreamLimits(replay_timeout_s=1.0, replay_deadline_s=1.5, behind_note_s=0.3))
        srv.publish(1)
        _wait(lambda: sub.status().batches == 1, 10, "the first batch")
        srv.publish(200, withhold=(5,))  # a gap: the request trickles one batch every 0.15 s
        _wait(lambda: sub.status().queued > 0 and sub.status().replay_state == "waiting", 10, "frames queued")
        assert sub.status().behind_s > 0
        _wait(lambda: sub.status().batches + sub.status().lost == 201, 20, lambda: f"the live batches (have {sub.status()})")
        st = sub.status()
        assert st.replay_timeouts == 1 and st.recovered + st.lost == 1 and st.queued == 0
        notes = []
        _wait(lambda: notes.extend(cl.take_notes()) or any("caught up" in t for _, _, t in notes), 10, "caught up")
        assert any("too slow" in t for _, k, t in notes if k == "replay")
        behind = [t for _, k, t in notes if k == "behind"]
        assert "behind the live stream" in behind[0] and "replay request is open" in behind[0]
        assert "caught up" in behind[-1]
    finally:
        srv.close()


def test_a_source_too_far_behind_sheds_its_oldest_frames_and_says_so(attach, monkeypatch):
    srv = Server("vllm")
    try:
        sub, cl = attach(srv, replay=False, limits=StreamLimits(max_queued_frames=100))
        slow = cl.apply

        def apply(*a, **kw):  # an ingest process that cannot keep up
            time.sleep(0.002)
            slow(*a, **kw)
        monkeypatch.setattr(cl, "apply", apply)
        srv.publish(3000)
        _wait(lambda: sub.status().last_seq == 2999 and not sub.status().queued, 30,
              lambda: f"every frame (have {sub.status()})")
        st = sub.status()
        assert st.shed > 0 and st.lost >= st.shed and st.shed_age_s is not None
        assert st.batches + st.lost == 3000 and st.malformed == 0
        assert any("falling behind" in t for _, k, t in cl.take_notes() if k == "shed")
        from types import SimpleNamespace

        from app.attach import _summary, _summary_text
        from ui.attach.panels import behind_text

        assert "SHEDDING" in behind_text(st) and f"{st.shed:,} shed" in behind_text(st)
        (js,) = _summary(SimpleNamespace(cluster=cl, statuses=lambda: [st]))["sources"]
        assert js["shed"] == st.shed and {"behind_s", "queued", "queued_bytes", "replay_state"} <= set(js)
        assert f"{st.shed:,} shed" in _summary_text({"sources": [js], "caches": {}})
    finally:
        srv.close()


REAL = __import__("pathlib").Path(__file__).resolve().parents[1] / "data" / "attach" / "real_frames.json"


@pytest.mark.parametrize("server", ["vllm", "sglang"])
def test_the_real_servers_replay_replies_byte_for_byte_give_the_history(attach, server):
    """The frames vLLM 0.33.0's and SGLang 0.5.23's own replay ROUTER sent (tests/data/attach/real_frames.json,
    captured with the real packages), answered verbatim to our request; the live frame is the last one they
    published, so everything before it is history."""
    import base64
    import json

    if not REAL.exists():
        pytest.skip("tests/data/attach/real_frames.json not captured here")
    rank = json.loads(REAL.read_text())[server]["ranks"][0]
    live = [[base64.b64decode(f) for f in fr] for fr in rank["live"]]
    (answer,) = [[[base64.b64decode(f) for f in fr] for fr in r["replies"]] for r in rank["replay"] if r["start"] == 0]
    assert answer[-1][1:] == [b"", END, b""]  # the layout this reads: ("", topic, seq, payload) ... end marker
    srv = Server("silent")
    try:
        srv._stop.set()  # answer here instead, with the real bytes
        srv._thread.join(2)
        sub, cl = attach(srv)
        srv.pub.send_multipart(live[-1])
        assert srv.router.poll(10_000)
        client, _, start = srv.router.recv_multipart()
        assert int.from_bytes(start, "big") == 0
        for fr in answer:
            srv.router.send_multipart([client] + fr)
        n = int.from_bytes(live[-1][1], "big")
        _wait(lambda: sub.status().batches == n + 1, 20, lambda: f"{n + 1} batches (have {sub.status()})")
        st = sub.status()
        assert st.history == n and st.history_missing == 0 and st.malformed == 0
        assert cl.activity()[0].bad_events == 0 and cl.activity()[0].stored_events > 0
    finally:
        srv.close()
