"""An attach session in an ingest process of its own, behind the same frame API as AttachSession.

At tens of thousands of events a second, decoding and applying them is most of a core of Python; on threads of
the window's process they would hold the GIL the window needs for its frames. So `kvscope attach` runs the
session here: the child process owns the sockets, the block tables and the recorder; the window's process sends
small requests over a pipe and gets immutable Frames back (numpy arrays, pickled). Frames are pipelined: the
window shows the latest frame it has and asks for the next, so it never waits for the ingest process to get the
GIL; only the very first frame, a hover lookup and saving a recording wait for an answer.
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing as mp
import os
import time
import traceback
from collections import deque

from engine.attach.session import AttachSession, Frame


def _serve(conn, specs, urls, kwargs) -> None:
    if hasattr(os, "nice"):
        # When the CPU is short the window's frames come first: the sockets buffer what this process has not
        # read yet (a high-water mark of 500,000 frames per publisher) and it catches up after.
        try:
            os.nice(5)
        except OSError:
            pass
    try:
        session = AttachSession(specs, urls, **kwargs).start()
    except Exception as e:  # the parent reports it
        conn.send(("error", 0, f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", 0, (session.labels, session.metrics_labels, session.recording)))
    try:
        while True:
            try:
                cmd, rid, args = conn.recv()
            except (EOFError, OSError):  # the window's process is gone
                break
            try:
                if cmd == "frame":
                    conn.send(("frame", rid, session.frame(*args)))
                elif cmd == "info":
                    conn.send(("info", rid, session.block_info(*args)))
                elif cmd == "save":
                    conn.send(("save", rid, session.save_recording(*args)))
                elif cmd == "stop":
                    break
            except Exception as e:
                conn.send(("error", rid, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"))
    finally:
        session.stop()
        try:
            conn.send(("stopped", -1, None))
        except OSError:
            pass


class WorkerError(RuntimeError):
    """The ingest process refused a request or died."""


class AttachClient:
    """The window's side: same frame API as AttachSession, the session in a child process."""

    def __init__(self, specs, metrics_urls=(), startup_timeout_s: float = 60.0, **kwargs):
        ctx = mp.get_context("spawn")  # a clean interpreter: nothing of Qt is inherited
        conn, child = ctx.Pipe()
        self.specs = list(specs)
        self._open(conn)
        self._proc = ctx.Process(target=_serve, args=(child, self.specs, list(metrics_urls), kwargs),
                                 name="kvscope-attach-ingest", daemon=True)
        self._proc.start()
        child.close()
        kind, _, payload = self._recv(startup_timeout_s)
        if kind != "ready":
            self._proc.join(5)
            raise WorkerError(f"the attach ingest process did not start: {payload}")
        self.labels, self.metrics_labels, self.recording = payload

    def start(self) -> "AttachClient":
        return self  # running since construction

    # -- the pipe -----------------------------------------------------------------------------------------
    def _open(self, conn) -> None:
        """The client's state over one end of a pipe (the constructor's; a test's own pipe)."""
        self._conn = conn
        self._ids = itertools.count(1)
        self._pending: int | None = None
        self._last: Frame | None = None
        # A Frame's notes are the ones since the ingest process's previous frame: each is handed out once. The
        # latest frame may be shown again (no newer answer yet: without its notes), and two answers may arrive
        # between calls (the older one's notes ride on the newer frame).
        self._notes: deque[tuple[float, str, str]] = deque(maxlen=2000)
        self._replies: dict[int, tuple] = {}
        self._stopped = False

    def _recv(self, timeout: float) -> tuple:
        if not self._conn.poll(timeout):
            raise WorkerError(f"no answer from the attach ingest process within {timeout:g} s")
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            raise WorkerError("the attach ingest process ended") from None

    def _take(self, msg: tuple) -> None:
        kind, rid, payload = msg
        if kind == "frame":
            self._last = payload
            self._notes.extend(payload.notes)
            if rid == self._pending:
                self._pending = None
        else:
            self._replies[rid] = msg
            if rid == self._pending:  # an error answering a frame request
                self._pending = None

    def _drain(self) -> None:
        while self._conn.poll(0):
            self._take(self._recv(0))

    def _call(self, cmd: str, args: tuple, timeout: float):
        rid = next(self._ids)
        self._conn.send((cmd, rid, args))
        end = time.monotonic() + timeout
        while rid not in self._replies:
            left = end - time.monotonic()
            if left <= 0:
                raise WorkerError(f"no answer to {cmd!r} within {timeout:g} s")
            self._take(self._recv(left))
        kind, _, payload = self._replies.pop(rid)
        if kind == "error":
            raise WorkerError(payload)
        return payload

    # -- the frame API ------------------------------------------------------------------------------------
    def frame(self, mode: str = "age", slow: bool = False, wait: bool = False) -> Frame:
        """The latest frame there is (and a request for the next); wait: a frame asked for now."""
        self._drain()
        if wait and self._pending is not None:  # the answer to an older request first
            self._await(lambda: self._pending is None)
        if self._pending is None:
            self._pending = next(self._ids)
            self._conn.send(("frame", self._pending, (mode, slow)))
        if wait or self._last is None:
            rid = self._pending
            self._await(lambda: self._pending != rid)
        notes = tuple(self._notes)
        self._notes.clear()
        return self._last if notes == self._last.notes else dataclasses.replace(self._last, notes=notes)

    def _await(self, done, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while not done():
            self._take(self._recv(max(0.0, end - time.monotonic())))

    def block_info(self, key, cell: int, timeout: float = 1.0) -> dict | None:
        try:
            return self._call("info", (key, cell), timeout)
        except WorkerError:
            return None  # a busy ingest process: no tooltip this time

    def save_recording(self, path: str) -> dict:
        try:
            return self._call("save", (path,), 600.0)
        except WorkerError as e:
            raise ValueError(str(e)) from None

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            self._conn.send(("stop", 0, ()))
        except OSError:
            pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
        self._conn.close()
