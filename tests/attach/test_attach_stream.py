"""Real ZMQ sockets on 127.0.0.1: a fake publisher process (vLLM- and SGLang-shaped, both encodings) and an
attach session. Sequence gaps are recovered from the replay socket or reported lost, malformed frames are
counted and skipped, batches published before attaching are fetched as history, and every event the publisher
sent arrives (counts match). Attach only connects: nothing in it binds a port."""

from __future__ import annotations

import time

import pytest
import zmq

from engine.attach.fake.spawn import FakeProcess
from engine.attach.session import AttachSession
from engine.attach.source import parse_source


def _wait(pred, timeout=30.0, what="condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _wait_while_moving(read, expected, still_s: float = 60.0, cap_s: float = 600.0):
    """read() until it equals expected, or until it has not changed for still_s (or cap_s in all): a slow machine
    makes the counts arrive later, not stop."""
    t0 = last_change = time.monotonic()
    got = prev = read()
    while got != expected and time.monotonic() - last_change < still_s and time.monotonic() - t0 < cap_s:
        time.sleep(0.1)
        got = read()
        if got != prev:
            prev, last_change = got, time.monotonic()
    return got


def _run(fake: FakeProcess, session: AttachSession, expected_per_source) -> None:
    _wait(lambda: [a.events for a in session.cluster.activity()] == expected_per_source, 60,
          f"events {expected_per_source} (have {[a.events for a in session.cluster.activity()]})")


@pytest.fixture
def no_bind(monkeypatch):
    """Attach must only connect: any bind in this process fails the test."""
    def refuse(self, addr):
        raise AssertionError(f"attach bound {addr}")
    monkeypatch.setattr(zmq.Socket, "bind", refuse)
    monkeypatch.setattr(zmq.Socket, "bind_to_random_port", refuse)


def test_vllm_map_two_ranks_gap_recovered_gap_lost_malformed_counted(no_bind):
    fake = FakeProcess("--flavor", "vllm", "--encoding", "map", "--dp", "2", "--rate", "3000", "--batch", "20",
                       "--max-batches", "150", "--duration", "60", "--gap", "40:6", "--lost", "90:4",
                       "--malformed-every", "25", "--extra-field", "--start-delay", "0.5", "--linger", "20")
    session = AttachSession(parse_source("vllm", f"{fake.pub},dp=2,name=v"), []).start()
    try:
        s = fake.summary()
        expected = [r["events"] - r["lost_events"] for r in s["ranks"]]
        _run(fake, session, expected)
        time.sleep(0.3)  # junk frames after the last batch
        st = session.statuses()
        for r, status in zip(s["ranks"], st):
            assert status.recovered == r["withheld_batches"] == 6
            assert status.lost == r["lost_batches"] == 4
            assert (90, 93) in status.lost_ranges
            assert status.malformed == r["malformed_sent"] > 0
            assert status.gaps == 2 and status.duplicates == 0
        keys = set(session.cluster.groups)
        assert {(0, 0, "GPU", 0), (1, 1, "GPU", 0)} <= keys  # the rank named in the batches
        kinds = {k for _, k, _ in session.cluster.take_notes()}
        assert {"replay", "gap", "malformed"} <= kinds
    finally:
        session.stop()
        fake.stop()


def test_sglang_array_without_replay_endpoint_reports_the_gap_lost(no_bind):
    fake = FakeProcess("--flavor", "sglang", "--encoding", "array", "--rate", "3000", "--batch", "20",
                       "--max-batches", "80", "--duration", "60", "--gap", "30:5", "--start-delay", "0.5",
                       "--linger", "20")
    session = AttachSession(parse_source("sglang", f"{fake.pub},replay=none"), []).start()
    try:
        s = fake.summary()
        expected = s["events"] - s["ranks"][0]["withheld_events"]
        _run(fake, session, [expected])
        (status,) = session.statuses()
        assert status.gaps == 1 and status.recovered == 0 and status.lost == 5
        assert status.lost_ranges == ((30, 34),)
        assert set(session.cluster.groups) == {(0, 0, "GPU", 0)}  # SGLang names no medium: GPU
    finally:
        session.stop()
        fake.stop()


def test_attaching_late_fetches_the_history_from_the_replay_buffer(no_bind):
    fake = FakeProcess("--flavor", "vllm", "--encoding", "array", "--rate", "2000", "--batch", "20",
                       "--duration", "1.5", "--linger", "20", "--cpu-offload", "500")
    time.sleep(0.8)  # about half the stream is out before we connect
    session = AttachSession(parse_source("vllm", fake.pub), []).start()
    try:
        s = fake.summary()
        _run(fake, session, [s["events"]])
        (status,) = session.statuses()
        assert status.first_seq > 0 and status.history == status.first_seq and status.history_missing == 0
        assert status.batches == s["batches"]
        assert (0, 0, "CPU", 0) in session.cluster.groups
    finally:
        session.stop()
        fake.stop()


def test_short_soak_three_publishers_counts_match_through_the_ingest_process():
    """Every event of three publishers arrives through the ingest process, however slow the machine. A loaded
    machine once failed it with [0, 0, 8950]: the ingest process (spawned, at nice 5) took longer to start than
    the first two publishers' replay buffers lived (--linger 30 after 3.5 s of publishing), so it attached to
    servers that were gone. The publishers now answer replay until the test stops them (as a real server does),
    and the wait ends when the counts stop moving for a minute, not at a fixed time."""
    from engine.attach.worker import AttachClient

    shapes = (("vllm", "map"), ("sglang", "array"), ("vllm", "array"))
    fakes = [FakeProcess("--flavor", f, "--encoding", e, "--rate", "3000", "--batch", "50", "--duration", "3",
                         "--start-delay", "0.5", "--linger", "3600", "--seed", str(i))
             for i, (f, e) in enumerate(shapes)]
    specs = [s for (f, _), fk in zip(shapes, fakes) for s in parse_source(f, fk.pub)]
    client = AttachClient(specs, [], startup_timeout_s=300.0)
    try:
        expected = [fk.summary()["events"] for fk in fakes]
        assert min(expected) > 5000
        got = _wait_while_moving(lambda: [a.events for a in client.frame(wait=True).snap.activity], expected)
        assert got == expected
        fr = client.frame(slow=True, wait=True)
        assert all(s.malformed == 0 and s.lost == 0 for s in fr.statuses)
        key = fr.snap.groups[0].key
        cell = int((fr.snap.groups[0].codes != 253).argmax())
        info = client.block_info(key, cell)
        assert info is not None and info["cell"] == cell
    finally:
        client.stop()
        for fk in fakes:
            fk.stop()


def test_ingest_client_hands_each_note_out_once_however_slow_the_answers():
    """AttachClient shows the latest frame while the next is on its way: the frame shown again must not bring its
    notes again, and two answers read in one call must not lose the older one's notes (a pipe of our own, the
    ingest side answering only when told)."""
    import multiprocessing as mp
    import threading

    from engine.attach.session import Frame
    from engine.attach.worker import AttachClient

    ours, theirs = mp.Pipe()
    go = threading.Semaphore(0)
    frames = [Frame(None, (), ((float(i), "source", f"note {i}"),), {}) for i in range(1, 5)]

    def ingest():
        for fr in frames:
            try:
                _, rid, _ = theirs.recv()
            except (EOFError, OSError):
                return
            go.acquire()
            theirs.send(("frame", rid, fr))

    t = threading.Thread(target=ingest, daemon=True)
    t.start()
    client = AttachClient.__new__(AttachClient)
    client._open(ours)
    got = []
    go.release()
    got += client.frame().notes  # the first frame waits: note 1
    for _ in range(3):  # no newer answer yet: frame 1 again, its note not again
        fr = client.frame()
        assert fr.snap is None and fr.statuses == ()
        got += fr.notes
    go.release()
    assert ours.poll(10)
    got += client.frame().notes  # note 2
    go.release()
    go.release()
    got += client.frame(wait=True).notes  # frames 3 and 4 both read in this call: notes 3 and 4
    t.join(10)
    assert [text for _, _, text in got] == ["note 1", "note 2", "note 3", "note 4"]
    ours.close()
    theirs.close()
