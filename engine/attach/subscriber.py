"""One publisher, read on its own thread: a ZMQ SUB for the live stream and a DEALER for the replay socket,
both on one poller, so the replay socket never holds up reading the live stream.

Frames are (topic, 8-byte big-endian sequence number, msgpack batch). The servers count from 0 and send the
number as a signed 64-bit value's bytes (their end marker is -1), so it is read signed: a negative one is a
malformed frame, never a jump of 1.8e19. Sequence numbers say what was missed:
- right after connecting, where a replay endpoint is known, the batches published before we attached are asked
  for from seq 0 (history), without waiting for a live frame: a warm server may be idle. The request ends at the
  server's end marker, or at the first live frame's seq (the live stream has the rest), within the replay
  deadlines; where it got nothing, the first frame (seq S > 0) asks for [0, S);
- a frame whose seq jumps past last+1 is a gap: the missing range is asked for (engine/attach/replay.py);
- seq == last is a duplicate and is skipped; a seq 0 after a higher one, or one more than a few below the
  last, is a publisher restart (its cache is empty again; its history is asked for afresh).
What the replay buffer no longer holds is counted as lost (a gap) or as unavailable history, never made up.
A frame that cannot be decoded is counted as malformed and skipped.

Live frames are read off the socket as they come into a queue of our own, and applied from it. While a replay
request is open the queue is held (a replayed batch must be applied before the live ones after it), for at
most the replay client's deadline. How far behind a source is, is the age of the oldest frame still queued
and how many are queued; past `StreamLimits` (frames, bytes, seconds behind) the oldest queued frames are shed:
dropped unread, counted and said, as a gap that is not asked for.

Nothing here listens: both sockets connect. The thread never touches the window; it applies batches to the
ClusterState (its own lock) and appends notes there.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections import deque

import zmq

from engine.attach.cluster import ClusterState
from engine.attach.events import DecodeError, EventBatch, decode_batch
from engine.attach.replay import END_SEQ, ReplayClient  # noqa: F401  (END_SEQ: the protocol's, re-exported)
from engine.attach.source import SourceSpec
from engine.attach.stream_health import SourceStatus, StreamLimits  # noqa: F401  (imported from here too)

RESTART_BELOW = 16  # a seq this far or more below the last one is a restarted publisher, not a duplicate
TRIM_AFTER_BYTES = 32 << 20  # a queue that held this much, once drained, hands the memory back to the OS


def _trim_heap() -> None:
    """glibc keeps the heap a drained queue of many ~10 kB frames used (RSS stays at the backlog's peak);
    malloc_trim returns it. Elsewhere (no glibc) nothing to do."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Subscriber(threading.Thread):
    def __init__(self, spec: SourceSpec, index: int, cluster: ClusterState, ctx: zmq.Context,
                 replay_timeout_s: float | None = None, hwm: int = 500_000, limits: StreamLimits | None = None):
        super().__init__(name=f"kvscope-attach-{spec.label}", daemon=True)
        self.spec, self.index, self.cluster, self.ctx = spec, index, cluster, ctx
        lim = limits or StreamLimits()
        if replay_timeout_s is not None:
            lim = StreamLimits(**{**lim.__dict__, "replay_timeout_s": replay_timeout_s})
        self.limits = lim
        self.hwm = hwm
        self._stop_ev = threading.Event()
        self.c = dict(frames=0, malformed=0, batches=0, duplicates=0, gaps=0, recovered=0, lost=0, history=0,
                      history_missing=0, restarts=0, shed=0)
        self.first_seq: int | None = None
        self.last_seq: int | None = None
        self.last_frame_t: float | None = None
        self.shed_t: float | None = None
        self._offset_due = False  # frames were shed before any was applied: fix the clock at the next one
        self._behind_note_t: float | None = None  # when we last said we were behind (None: not behind)
        self.lost_ranges: deque[tuple[int, int]] = deque(maxlen=8)
        self.queue: deque[tuple[float, list[bytes]]] = deque()  # (monotonic receive time, frames)
        self.queued_bytes = 0
        self._peak_bytes = 0  # the most queued since the queue was last empty
        self._held: tuple[int, EventBatch | None] | None = None  # the live frame a replay request waits under
        self._history_end: int | None = None  # the last seq of the history got at connect, until a live frame passes it
        self.replay = ReplayClient(ctx, spec.replay, timeout_s=lim.replay_timeout_s, deadline_s=lim.replay_deadline_s,
                                   max_batches=lim.replay_max_batches, backoff_s=lim.replay_backoff_s)
        self.error: str | None = None

    @property
    def replay_timeout_s(self) -> float:
        return self.limits.replay_timeout_s

    # -- control ---------------------------------------------------------------------------------------
    def stop(self, timeout: float = 3.0) -> None:
        self._stop_ev.set()
        if self.is_alive():
            self.join(timeout)

    def status(self) -> SourceStatus:
        now = time.monotonic()
        q = self.queue
        try:
            behind = now - q[0][0] if q else 0.0
        except IndexError:  # emptied meanwhile by the thread
            behind = 0.0
        return SourceStatus(self.spec.label, self.spec.endpoint, self.spec.replay, first_seq=self.first_seq,
                            last_seq=self.last_seq, lost_ranges=tuple(self.lost_ranges),
                            last_frame_age_s=None if self.last_frame_t is None else now - self.last_frame_t,
                            queued=len(q), queued_bytes=self.queued_bytes, behind_s=max(0.0, behind),
                            shed_age_s=None if self.shed_t is None else now - self.shed_t,
                            replay_state=self.replay.state, replay_timeouts=self.replay.timeouts,
                            malformed=self.c["malformed"] + self.replay.malformed,
                            **{k: v for k, v in self.c.items() if k != "malformed"})

    # -- the thread ------------------------------------------------------------------------------------
    def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        lim = self.limits
        try:
            sub.setsockopt(zmq.RCVHWM, self.hwm)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt_string(zmq.SUBSCRIBE, self.spec.topic)
            sub.connect(self.spec.endpoint)
            self.cluster.note("source", f"{self.spec.label}: subscribed to {self.spec.endpoint}"
                              + (f", replay {self.spec.replay}" if self.spec.replay else ", no replay endpoint"))
            if self.replay.can_ask(time.monotonic()):  # the history now: a warm server may publish nothing more
                self.replay.ask(0, None, True, time.monotonic())
            poller = zmq.Poller()
            poller.register(sub, zmq.POLLIN)
            dealer = None
            while not self._stop_ev.is_set():
                if self.replay.sock is not dealer:  # a new replay socket (or none)
                    if dealer is not None:
                        poller.unregister(dealer)
                    dealer = self.replay.sock
                    if dealer is not None:
                        poller.register(dealer, zmq.POLLIN)
                busy = bool(self.queue) and self.replay.req is None
                ready = dict(poller.poll(0 if busy else 50))
                if sub in ready:
                    self._read_live(sub, lim.read_budget_s)
                    req = self.replay.req
                    if req is not None and req.open_end and req.end is None:
                        req.end = self._first_queued_seq()  # the history asked for at connect ends there
                if dealer is not None and dealer in ready:
                    self._read_replay(dealer, lim.apply_budget_s)
                now = time.monotonic()
                why = self.replay.check(now)
                if why is not None:
                    self._replay_done(complete=False, now=now, why=why)
                self._shed_if_behind(now)
                self._say_if_behind(now)
                self._apply_queued(lim.apply_budget_s)
        except zmq.ZMQError as e:
            self.error = str(e)
            self.cluster.note("error", f"{self.spec.label}: {e}")
        finally:
            sub.close(0)
            self.replay.close()

    def _read_live(self, sub, budget_s: float) -> None:
        end = time.monotonic() + budget_s
        q = self.queue
        for i in range(1 << 30):
            try:
                parts = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            now = time.monotonic()
            q.append((now, parts))
            self.queued_bytes += sum(map(len, parts))
            if self.queued_bytes > self._peak_bytes:
                self._peak_bytes = self.queued_bytes
            self.c["frames"] += 1
            self.last_frame_t = now
            if not i & 63 and now > end:
                break

    def _first_queued_seq(self) -> int | None:
        for _, parts in itertools.islice(self.queue, 16):  # (junk frames first: asked again at the next turn)
            seq = _seq_of(parts)
            if seq is not None:
                return seq
        return None

    def _read_replay(self, dealer, budget_s: float) -> None:
        end = time.monotonic() + budget_s
        while self.replay.sock is dealer and time.monotonic() < end:
            try:
                parts = dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            now = time.monotonic()
            r = self.replay.on_reply(parts, now)
            if r is None:
                continue
            kind, _, payload = r
            if kind == "done":
                self._replay_done(complete=True, now=now)
                return
            batch = self._decode(payload)
            if batch is not None:
                self._apply(batch)
            req = self.replay.req
            if req is not None:
                t = time.monotonic()
                req.busy_s += t - now
                req.last_t = t  # applying a big batch is not the server being slow

    def _apply_queued(self, budget_s: float) -> None:
        end = time.monotonic() + budget_s
        q = self.queue
        n = 0
        while q and self.replay.req is None:
            recv_t, parts = q.popleft()
            self.queued_bytes -= sum(map(len, parts))
            self._on_frame(parts, recv_t)
            n += 1
            if not n & 15 and time.monotonic() > end:
                return
        if not q and self._peak_bytes > TRIM_AFTER_BYTES:
            self._peak_bytes = 0
            _trim_heap()

    def _shed_if_behind(self, now: float) -> None:
        lim, q = self.limits, self.queue
        if not q or (len(q) <= lim.max_queued_frames and self.queued_bytes <= lim.max_queued_bytes
                     and now - q[0][0] <= lim.max_behind_s):
            return
        if self.replay.req is not None:  # nothing may wait for a replay while frames are being dropped
            self._replay_done(complete=False, now=now, why="too slow: the source is too far behind")
        n, first, last = 0, None, None
        while q and (len(q) > lim.max_queued_frames * 3 // 4 or self.queued_bytes > lim.max_queued_bytes * 3 // 4
                     or now - q[0][0] > lim.max_behind_s / 2):
            _, parts = q.popleft()
            self.queued_bytes -= sum(map(len, parts))
            n += 1
            seq = _seq_of(parts)
            if seq is not None:
                first = seq if first is None else min(first, seq)
                last = seq if last is None else max(last, seq)
        self.c["shed"] += n
        self.shed_t = now
        if last is not None and self.last_seq is None:  # shed before the first frame was applied
            self.first_seq, self.c["history_missing"] = first, self.c["history_missing"] + first
            self.last_seq, self._offset_due = first - 1, True  # the clock offset from the next frame applied
        if last is not None and last > self.last_seq:
            # The shed frames are a gap that is not asked for (asking would put us further behind).
            lost = last - self.last_seq
            self.c["lost"] += lost
            self.lost_ranges.append((self.last_seq + 1, last))
            self.last_seq = last
        self.cluster.note("shed", f"{self.spec.label}: falling behind: {n:,} queued frames dropped unread"
                                  + (f" (seq {first:,}..{last:,}); their events are lost" if first is not None else "")
                                  + f"; {len(q):,} still queued")

    def _say_if_behind(self, now: float) -> None:
        q = self.queue
        behind = now - q[0][0] if q else 0.0
        if behind > self.limits.behind_note_s:
            if self._behind_note_t is None or now - self._behind_note_t > 10.0:
                self._behind_note_t = now
                self.cluster.note("behind", f"{self.spec.label}: {behind:.1f} s behind the live stream, "
                                            f"{len(q):,} frames ({self.queued_bytes / 1e6:.1f} MB) queued"
                                  + (" while a replay request is open" if self.replay.req is not None else ""))
        elif self._behind_note_t is not None and not q:
            self._behind_note_t = None
            self.cluster.note("behind", f"{self.spec.label}: caught up with the live stream")

    def _malformed(self, why: str) -> None:
        self.c["malformed"] += 1
        if self.c["malformed"] <= 20 or self.c["malformed"] % 1000 == 0:
            self.cluster.note("malformed", f"{self.spec.label}: frame skipped ({why}); "
                                           f"{self.c['malformed']:,} so far")

    def _on_frame(self, parts: list[bytes], recv_t: float | None = None) -> None:
        """One live frame, in order (tests call it directly, frames and all)."""
        if recv_t is None:
            self.c["frames"] += 1
            self.last_frame_t = recv_t = time.monotonic()
        if len(parts) == 3:
            _, seq_b, payload = parts
        elif len(parts) == 2:  # a publisher with no topic frame
            seq_b, payload = parts
        else:
            return self._malformed(f"{len(parts)} frames, expected topic, sequence, payload")
        if len(seq_b) != 8:
            return self._malformed(f"a {len(seq_b)}-byte sequence number")
        seq = int.from_bytes(seq_b, "big", signed=True)
        if seq < 0:
            return self._malformed(f"sequence number {seq} (the servers count from 0)")
        last = self.last_seq
        # The first live frame after history got at connect (last_seq is the history's last): the replay buffer
        # may have held this frame and some after it too (duplicates then, not history, and no restart).
        after_history = self.first_seq is None and last is not None
        in_history = self._history_end is not None and 0 < seq <= self._history_end
        if self._history_end is not None and not in_history:
            self._history_end = None
        if last is not None and (seq == 0 < last or (seq <= last - RESTART_BELOW and not in_history)):
            self.c["restarts"] += 1
            self.cluster.note("source", f"{self.spec.label}: the publisher restarted (sequence {last:,} -> {seq:,})")
            self.cluster.reset_source(self.index)
            last = self.last_seq = self._history_end = None
            after_history = False
        if after_history:
            self.first_seq = seq
            if seq <= last:
                self.c["history"] = max(0, self.c["history"] - (last - seq + 1))
        if last is not None and seq <= last:
            self.c["duplicates"] += 1
            return
        batch = self._decode(payload)
        now = time.monotonic()
        if self._offset_due and batch is not None:
            self._offset_due = False
            self.cluster.set_offset(self.index, batch.ts, now=time.time() - (now - recv_t))
        if last is None:
            if batch is not None:  # the clock offset from when the frame arrived, not when it was applied
                self.cluster.set_offset(self.index, batch.ts, now=time.time() - (now - recv_t))
            self.first_seq = seq
            if seq > 0 and self._ask(0, seq, True, batch, now):
                return
            if seq > 0:
                self.c["history_missing"] += seq
        elif after_history and seq > last + 1:  # published between the history's answer and this frame: history
            if self._ask(last + 1, seq, True, batch, now):
                return
            self.c["history_missing"] += seq - last - 1
        elif seq > last + 1:
            self.c["gaps"] += 1
            if self._ask(last + 1, seq, False, batch, now):
                return
            self._count_lost(last + 1, seq, 0, why="no replay endpoint" if not self.replay.available else
                             "the replay socket is not answering; not asked")
        self.last_seq = seq
        if batch is not None:
            self._apply(batch)

    def _decode(self, payload: bytes) -> EventBatch | None:
        try:
            return decode_batch(payload)
        except DecodeError as e:
            self._malformed(str(e))
            return None
        except (RecursionError, MemoryError, ValueError, TypeError) as e:  # a decoder bug must not end the thread
            self._malformed(f"{type(e).__name__} decoding the batch")
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
    def _ask(self, start: int, end: int, history: bool, batch: EventBatch | None, now: float) -> bool:
        """Ask the replay socket for [start, end) and hold the live frame `end` until it answers; False when
        it cannot be asked (none, or resting after it failed)."""
        if not self.replay.can_ask(now):
            return False
        req = self.replay.ask(start, end, history, now)
        self._held = (end, batch)
        if req.start > start:  # longer than one request may ask for: the oldest part is not asked for
            self._count_lost(start, req.start, 0, history, why="more than one replay request asks for")
        return True

    def _count_lost(self, start: int, end: int, got: int, history: bool = False, why: str = "") -> None:
        missing = end - start - got
        if history:
            self.c["history_missing"] += missing
            return
        if missing > 0:
            self.c["lost"] += missing
            self.lost_ranges.append((start + got, end - 1) if got == 0 else (start, end - 1))
            self.cluster.note("gap", f"{self.spec.label}: {missing:,} batches lost (seq {start:,}..{end - 1:,}; "
                                     f"{got:,} recovered from the replay socket{'; ' + why if why else ''})")

    def _replay_done(self, complete: bool, now: float, why: str = "") -> None:
        req = self.replay.finish(complete, now, why)
        if req is None:
            return
        if req.open_end:
            # The history asked for at connect: up to what the server held, or to the first live frame where a
            # reply reached it (the server holds nothing between); the first live frame goes on from there.
            upto = req.end if req.reached_end else req.expected
        else:
            upto = req.end
        if not complete:
            rests = self.replay.state == "backoff"
            what = (f"seq {req.start:,}..{upto - 1:,}" if not req.open_end else
                    f"the history (from seq {req.start:,}, asked at connect)")
            self.cluster.note("replay", f"{self.spec.label}: replay request for {what} "
                                        f"given up after {now - req.t0:.1f} s with {req.got:,} batches ({why})"
                              + (f"; gaps in the next {self.limits.replay_backoff_s:g} s are counted lost unasked"
                                 if rests else ""))
        if req.open_end:
            self.c["history"] += req.got
            self.c["history_missing"] += max(0, upto - req.start - req.got)
            if upto > req.start and self.last_seq is None:
                self.last_seq = self._history_end = upto - 1
                self._offset_due = True  # the clock offset from the first live frame
            if req.got:
                self.cluster.note("replay", f"{self.spec.label}: {req.got:,} batches of history from the replay "
                                            f"buffer (up to seq {req.expected - 1:,})")
            return
        if req.history:
            self.c["history"] += req.got
            self.c["history_missing"] += req.end - req.start - req.got
        else:
            self.c["recovered"] += req.got
            missing = req.end - req.start - req.got
            if missing:
                for r in req.holes:
                    self.lost_ranges.append(r)
                if req.expected < req.end:
                    self.lost_ranges.append((req.expected, req.end - 1))
                self.c["lost"] += missing
                self.cluster.note("gap", f"{self.spec.label}: {missing:,} batches lost (seq {req.start:,}.."
                                         f"{req.end - 1:,}; {req.got:,} recovered from the replay socket)")
            else:
                self.cluster.note("replay", f"{self.spec.label}: gap of {req.got:,} batches (seq {req.start:,}.."
                                            f"{req.end - 1:,}) recovered from the replay socket")
        held, self._held = self._held, None
        if held is not None:
            seq, batch = held
            self.last_seq = seq
            if batch is not None:
                self._apply(batch)


def _seq_of(parts: list[bytes]) -> int | None:
    seq_b = parts[-2] if len(parts) in (2, 3) else b""
    if len(seq_b) != 8:
        return None
    seq = int.from_bytes(seq_b, "big", signed=True)
    return seq if seq >= 0 else None
