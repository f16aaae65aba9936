"""One publisher's replay socket: a DEALER that asks the server's ROUTER for missed batches, one request at a time.

The protocol is vLLM's and SGLang's (vllm/distributed/kv_events.py and sglang/srt/disaggregation/kv_events.py,
`ZmqEventPublisher._service_replay`, the same in vLLM 0.33.0 and SGLang 0.5.23): the request is the start seq as
8 big-endian bytes (a DEALER sends an empty delimiter first, as REQ would); the server answers every buffered
batch with seq >= start, each as `(identity, "", topic, seq, payload)` — a DEALER sees `("", topic, seq,
payload)` — and then the end marker `("", "", seq -1 as 8 signed big-endian bytes, "")`. Servers before vLLM
0.26 answered `("", seq, payload)` and ended with `("", seq -1, "")`: both layouts are read.

A request is bounded: at most `max_batches` batches are asked for (the newest of a longer gap), a reply must
come within `timeout_s` of the request or of the previous reply, and the whole request within `deadline_s` of
waiting (the time spent applying the batches that came is not counted: a big history that flows is fine).
A server that never answers, or trickles, is rested for `backoff_s` (gaps are counted lost meanwhile); one
whose answer stopped short (SGLang's ROUTER drops what passes its high-water mark, the end marker too) is
asked again at the next gap.
Nothing here blocks: the subscriber's poll loop calls `on_reply` for each message and `check` on every turn.
Once a request has what it asked for, the rest of the server's answer (batches the live stream has too) is
read and dropped until the end marker, without holding up the live stream; a request needed before that gets
a fresh socket, so an old answer is never taken for a new one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import zmq

END_SEQ = -1


def parse_reply(parts: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of a replay reply in either layout (seq END_SEQ: the end marker); None if malformed."""
    if parts and parts[0] == b"":
        parts = parts[1:]
    if len(parts) == 3:  # vLLM >= 0.26, SGLang 0.5: topic, seq, payload (the end marker's topic is empty)
        _, seq_b, payload = parts
    elif len(parts) == 2:  # older: seq, payload
        seq_b, payload = parts
    else:
        return None
    if len(seq_b) != 8:
        return None
    return int.from_bytes(seq_b, "big", signed=True), payload


@dataclass
class Request:
    start: int
    end: int | None  # exclusive: the seq of the live frame that revealed the gap (None: not known yet)
    history: bool  # batches from before we attached (else: a gap in the live stream)
    t0: float
    last_t: float
    expected: int = 0
    got: int = 0
    replies: int = 0
    holes: list = None  # [first, last] seqs inside the range the server no longer held (the first few)
    busy_s: float = 0.0  # time spent applying what came (not counted against the deadline: only waiting is)
    open_end: bool = False  # asked with no end (at connect: all the server holds; `end` set at the first live frame)
    reached_end: bool = False  # a reply at or past `end` came: the server holds nothing more below it


class ReplayClient:
    def __init__(self, ctx: zmq.Context, endpoint: str | None, *, timeout_s: float = 2.0, deadline_s: float = 10.0,
                 max_batches: int = 20_000, backoff_s: float = 30.0, drain_s: float = 5.0):
        self.ctx, self.endpoint = ctx, endpoint
        self.timeout_s, self.deadline_s, self.max_batches = timeout_s, deadline_s, max_batches
        self.backoff_s, self.drain_s = backoff_s, drain_s
        self.sock: zmq.Socket | None = None
        self.req: Request | None = None
        self._drain_until: float | None = None  # reading the tail of an answer we no longer need
        self.dead_until = 0.0  # no requests before this (monotonic): the socket did not answer
        self.malformed = 0
        self.timeouts = 0  # requests given up on (no answer, or too slow)
        self.requests = 0

    @property
    def available(self) -> bool:
        return self.endpoint is not None

    def can_ask(self, now: float) -> bool:
        return self.endpoint is not None and self.req is None and now >= self.dead_until

    @property
    def state(self) -> str:
        if self.endpoint is None:
            return "none"
        if self.req is not None:
            return "waiting"
        return "backoff" if time.monotonic() < self.dead_until else "idle"

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
        self.sock, self._drain_until = None, None

    def ask(self, start: int, end: int | None, history: bool, now: float) -> Request:
        """Send a request for [start, end) (clipped to the newest max_batches); the caller has checked can_ask.
        end None: everything the server holds from start (at most max_batches of it), until the caller sets
        `req.end` (the seq of the first live frame: the live stream has the rest)."""
        if end is not None:
            start = max(start, end - self.max_batches)
        if self.sock is not None and self._drain_until is not None:
            self.close()  # still reading an old answer: a fresh socket, so its tail is never taken for this one
        if self.sock is None:
            self.sock = self.ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.connect(self.endpoint)
        self.sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        self.requests += 1
        self.req = Request(start, end, history, now, now, expected=start, holes=[], open_end=end is None)
        return self.req

    def on_reply(self, parts: list[bytes], now: float) -> tuple[str, int, bytes] | None:
        """One message from the socket. Returns ("batch", seq, payload) for a batch the request wants (in seq
        order; the caller applies it), ("done", 0, b"") when the request has all it can get (the caller calls
        finish), or None."""
        r = parse_reply(parts)
        if r is None:
            self.malformed += 1
            return None
        seq, payload = r
        if seq == END_SEQ and not payload:
            self._drain_until = None  # the answer is complete: the socket can take the next request
            return ("done", 0, b"") if self.req is not None else None
        req = self.req
        if req is None:  # the tail of an answer already used
            return None
        req.replies += 1
        req.last_t = now
        if seq < req.expected:
            return None
        if (req.end is not None and seq >= req.end) or (req.open_end and req.got >= self.max_batches):
            # the live stream has these: what we asked for is all here (or an open request has all it may take)
            req.reached_end = req.end is not None and seq >= req.end
            self._drain_until = now + self.drain_s
            return "done", 0, b""
        if seq > req.expected and len(req.holes) < 8:
            req.holes.append((req.expected, seq - 1))
        req.expected, req.got = seq + 1, req.got + 1
        return "batch", seq, payload

    def check(self, now: float) -> str | None:
        """Why the request must be given up on now (then the caller calls finish): "no answer", "stopped"
        (replies came, then none for timeout_s) or "too slow" (past the deadline); None while it may go on."""
        if self._drain_until is not None and now > self._drain_until and self.req is None:
            self.close()
        req = self.req
        if req is None:
            return None
        if now - req.t0 - req.busy_s > self.deadline_s:
            return "too slow"
        if now - req.last_t > self.timeout_s:
            return "stopped" if req.replies else "no answer"
        return None

    def finish(self, complete: bool, now: float, why: str = "") -> Request:
        """The request is over; `complete` False: given up on `why` (the socket is replaced; after "no answer"
        or "too slow" the server is rested, unless the request was the history asked for at connect: a server
        just starting, or one that answers an empty buffer with nothing, is asked again at the first gap)."""
        req, self.req = self.req, None
        if not complete:
            self.timeouts += 1
            self.close()
            if why != "stopped" and not (req is not None and req.open_end):
                self.dead_until = now + self.backoff_s
        return req
