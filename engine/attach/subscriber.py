"""One publisher, read on its own thread: a ZMQ SUB for the live stream and a DEALER for the replay socket.

Frames are (topic, 8-byte big-endian sequence number, msgpack batch). Sequence numbers say what was missed:
- at the first frame (seq S > 0) the batches published before we attached are asked for (history);
- a frame whose seq jumps past last+1 is a gap: the missing range is asked for;
- seq <= last is a duplicate (a replayed batch arriving live too) and is skipped; seq 0 after a higher one is
  a publisher restart (its cache is empty again).
The replay protocol is vLLM's and SGLang's: send the start seq as 8 big-endian bytes to the ROUTER (a DEALER
sends an empty delimiter first, as REQ would); receive (seq, payload) frames for every buffered batch from
start on, then (seq -1, empty). What the replay buffer no longer holds is counted as lost (a gap) or as
unavailable history, never made up. A frame that cannot be decoded is counted as malformed and skipped.

Nothing here listens: both sockets connect. The thread never touches the window; it applies batches to the
ClusterState (its own lock) and appends notes there.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import zmq

from engine.attach.cluster import ClusterState
from engine.attach.events import DecodeError, EventBatch, decode_batch
from engine.attach.source import SourceSpec

END_SEQ = -1


@dataclass(frozen=True)
class SourceStatus:
    label: str
    endpoint: str
    replay: str | None
    frames: int  # multipart messages received live
    malformed: int  # frames skipped: wrong frame count, a sequence number that is not 8 bytes, not a batch
    batches: int  # batches applied (live + replayed)
    duplicates: int
    gaps: int  # jumps in the sequence
    recovered: int  # batches of gaps recovered from the replay socket
    lost: int  # batches of gaps the replay socket could not give: their events are missing
    history: int  # batches before the first live one, got from the replay socket
    history_missing: int  # batches before the first live one that the replay buffer no longer held
    first_seq: int | None
    last_seq: int | None
    restarts: int
    last_frame_age_s: float | None  # seconds since the last live frame
    lost_ranges: tuple[tuple[int, int], ...]  # the latest few [first, last] seqs lost


class Subscriber(threading.Thread):
    def __init__(self, spec: SourceSpec, index: int, cluster: ClusterState, ctx: zmq.Context,
                 replay_timeout_s: float = 2.0, hwm: int = 500_000):
        super().__init__(name=f"kvscope-attach-{spec.label}", daemon=True)
        self.spec, self.index, self.cluster, self.ctx = spec, index, cluster, ctx
        self.replay_timeout_s = replay_timeout_s
        self.hwm = hwm
        self._stop_ev = threading.Event()
        self.c = dict(frames=0, malformed=0, batches=0, duplicates=0, gaps=0, recovered=0, lost=0, history=0,
                      history_missing=0, restarts=0)
        self.first_seq: int | None = None
        self.last_seq: int | None = None
        self.last_frame_t: float | None = None
        self.lost_ranges: deque[tuple[int, int]] = deque(maxlen=8)
        self._dealer = None
        self.error: str | None = None

    # -- control ---------------------------------------------------------------------------------------
    def stop(self, timeout: float = 3.0) -> None:
        self._stop_ev.set()
        if self.is_alive():
            self.join(timeout)

    def status(self) -> SourceStatus:
        now = time.monotonic()
        return SourceStatus(self.spec.label, self.spec.endpoint, self.spec.replay, first_seq=self.first_seq,
                            last_seq=self.last_seq, lost_ranges=tuple(self.lost_ranges),
                            last_frame_age_s=None if self.last_frame_t is None else now - self.last_frame_t,
                            **self.c)

    # -- the thread ------------------------------------------------------------------------------------
    def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.RCVHWM, self.hwm)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt_string(zmq.SUBSCRIBE, self.spec.topic)
            sub.connect(self.spec.endpoint)
            self.cluster.note("source", f"{self.spec.label}: subscribed to {self.spec.endpoint}"
                              + (f", replay {self.spec.replay}" if self.spec.replay else ", no replay endpoint"))
            while not self._stop_ev.is_set():
                if not sub.poll(100):
                    continue
                for _ in range(256):  # drain what is queued, then look at the stop flag again
                    try:
                        parts = sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_frame(parts)
        except zmq.ZMQError as e:
            self.error = str(e)
            self.cluster.note("error", f"{self.spec.label}: {e}")
        finally:
            sub.close(0)
            if self._dealer is not None:
                self._dealer.close(0)

    def _malformed(self, why: str) -> None:
        self.c["malformed"] += 1
        if self.c["malformed"] <= 20 or self.c["malformed"] % 1000 == 0:
            self.cluster.note("malformed", f"{self.spec.label}: frame skipped ({why}); "
                                           f"{self.c['malformed']:,} so far")

    def _on_frame(self, parts: list[bytes]) -> None:
        self.c["frames"] += 1
        self.last_frame_t = time.monotonic()
        if len(parts) == 3:
            _, seq_b, payload = parts
        elif len(parts) == 2:  # a publisher with no topic frame
            seq_b, payload = parts
        else:
            return self._malformed(f"{len(parts)} frames, expected topic, sequence, payload")
        if len(seq_b) != 8:
            return self._malformed(f"a {len(seq_b)}-byte sequence number")
        seq = int.from_bytes(seq_b, "big")
        last = self.last_seq
        if last is not None and seq == 0 and last > 0:
            self.c["restarts"] += 1
            self.cluster.note("source", f"{self.spec.label}: the publisher restarted (sequence back to 0)")
            self.cluster.reset_source(self.index)
            last = self.last_seq = None
        if last is not None and seq <= last:
            self.c["duplicates"] += 1
            return
        batch = self._decode(payload)
        if last is None:
            if batch is not None:
                self.cluster.set_offset(self.index, batch.ts)
            self.first_seq = seq
            if seq > 0:
                got = self._replay(0, seq, history=True)
                self.c["history"] += got
                self.c["history_missing"] += seq - got
        elif seq > last + 1:
            self.c["gaps"] += 1
            got = self._replay(last + 1, seq, history=False)
            self.c["recovered"] += got
            missing = seq - (last + 1) - got
            if missing:
                self.c["lost"] += missing
                self.cluster.note("gap", f"{self.spec.label}: {missing:,} batches lost (seq {last + 1:,}.."
                                         f"{seq - 1:,}; {got:,} recovered from the replay socket)")
            else:
                self.cluster.note("replay", f"{self.spec.label}: gap of {got:,} batches (seq {last + 1:,}.."
                                            f"{seq - 1:,}) recovered from the replay socket")
        self.last_seq = seq
        if batch is not None:
            self._apply(batch)

    def _decode(self, payload: bytes) -> EventBatch | None:
        try:
            return decode_batch(payload)
        except DecodeError as e:
            self._malformed(str(e))
            return None

    def _apply(self, batch: EventBatch) -> None:
        self.c["batches"] += 1
        try:
            self.cluster.apply(self.index, batch, self.spec.rank)
        except Exception as e:  # a bug must not end the subscription: say it and carry on
            self.cluster.note("error", f"{self.spec.label}: batch not applied ({type(e).__name__}: {e})")
        if batch.bad_events and batch.notes:
            self.cluster.note("malformed", f"{self.spec.label}: {batch.bad_events} event(s) skipped "
                                           f"({'; '.join(batch.notes)})")

    # -- replay ----------------------------------------------------------------------------------------
    def _dealer_socket(self):
        if self._dealer is None:
            d = self.ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(self.spec.replay)
            self._dealer = d
        return self._dealer

    def _replay(self, start: int, end: int, history: bool) -> int:
        """Ask for batches [start, end) and apply the ones that come, in order; returns how many did."""
        if self.spec.replay is None or end <= start:
            if not history and end > start:
                self.lost_ranges.append((start, end - 1))
            return 0
        d = self._dealer_socket()
        d.send_multipart([b"", start.to_bytes(8, "big")])
        got, expected = 0, start
        deadline = time.monotonic() + self.replay_timeout_s
        finished = False
        while not self._stop_ev.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or not d.poll(int(left * 1000) + 1):
                break
            parts = d.recv_multipart()
            if parts and parts[0] == b"":
                parts = parts[1:]
            if len(parts) != 2 or len(parts[0]) != 8:
                self._malformed("a replay reply that is not (sequence, payload)")
                continue
            rseq = int.from_bytes(parts[0], "big", signed=True)
            if rseq == END_SEQ or not parts[1]:
                finished = True
                break
            if rseq < expected or rseq >= end:
                continue  # already applied, or at/after the live frame that will follow
            if rseq > expected and not history:
                self.lost_ranges.append((expected, rseq - 1))
            expected = rseq + 1
            batch = self._decode(parts[1])
            got += 1
            if batch is not None:
                self._apply(batch)
            deadline = time.monotonic() + self.replay_timeout_s  # a long replay is fine while it flows
        if not finished:
            # Replies to this request may still arrive; a fresh socket makes sure they are never taken for
            # the answer to a later one.
            self._dealer.close(0)
            self._dealer = None
            self.cluster.note("replay", f"{self.spec.label}: the replay socket did not finish answering within "
                                        f"{self.replay_timeout_s:g} s")
        if expected < end and not history:
            self.lost_ranges.append((expected, end - 1))
        return got
