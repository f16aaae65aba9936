"""The engine thread, the controller the window talks to, and the window's trace workload (its skipped lines
said on stderr).

The window never touches the engine: it calls this controller, which (a) reads immutable snapshots and
drains events (both thread-safe in the engine), and (b) queues commands that the engine thread runs
between two steps. Config changes are validated at once on the caller's thread, so a refusal comes back
as an exception with the engine's message while the engine keeps running on its old config.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from engine.config import KNOBS, CacheConfig, ConfigError
from engine.errors import RequestError
from engine.runtime.threads import follow_torch
from ui.controller import Controller

if TYPE_CHECKING:
    from engine.workloads.trace_workload import TraceWorkload
    from engine.workloads.workload import Workload


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def open_trace_workload(engine, path: str, say=_say) -> TraceWorkload:
    """The window's live replay of the JSONL trace at `path` (engine/workloads/trace_workload.py); the lines it
    skips are said (on stderr), the first SHOWN by name, then how many. RequestError if no line can run."""
    from engine.workloads.trace_workload import TraceWorkload

    w = TraceWorkload(engine, path)
    if w.n_skipped:
        for line in w.skipped:
            say(f"kvscope: {line} (skipped)")
        more = f" ({w.n_skipped - len(w.skipped):,} not shown)" if w.n_skipped > len(w.skipped) else ""
        say(f"kvscope: {path}: {w.n_skipped:,} of {w.n_skipped + w.n_requests:,} lines skipped{more}; "
            f"replaying the other {w.n_requests:,}")
    return w


class EngineRunner(Controller):
    def __init__(self, engine, workload: Workload | None = None):
        self.engine = engine
        self.workload = workload
        self.read_only = False
        self._stop = threading.Event()
        self._paused = False
        self._single_steps = 0
        self._lock = threading.Lock()
        self._tokens: collections.deque[tuple[int, str]] = collections.deque(maxlen=100_000)
        self._decoders: dict[int, Any] = {}
        self.numba_threads: int | None = None  # what the engine thread set numba's thread count to (None: no numba)
        self._thread = threading.Thread(target=self._loop, name="kvscope-engine", daemon=True)
        # The ref-count leak check (engine/telemetry/health.py), every few seconds, off the engine's thread.
        self._health = threading.Thread(target=self._check_health, name="kvscope-health", daemon=True)
        self.error: str | None = None
        self._next_workload = None  # a replacement, applied by the engine thread between steps
        self.steps = 0
        self._last = None

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> "EngineRunner":
        self._thread.start()
        self._health.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._health.is_alive():
            self._health.join(timeout)

    def _check_health(self) -> None:
        from engine.telemetry.health import LEAK_CHECK_S

        while not self._stop.wait(LEAK_CHECK_S):
            try:
                self.engine.check_health()
            except Exception as e:  # say what broke; the engine runs on
                self.engine.telemetry.emit("error", message=f"health check failed: {type(e).__name__}: {e}")

    def _loop(self) -> None:
        eng = self.engine
        self.numba_threads = follow_torch()  # the compiled kernels on this thread use the cores torch has
        while not self._stop.is_set():
            with self._lock:
                paused = self._paused and self._single_steps == 0
                if self._single_steps:
                    self._single_steps -= 1
            if paused:
                time.sleep(0.02)
                continue
            try:
                with self._lock:
                    nxt, self._next_workload = self._next_workload, None
                if nxt is not None:
                    if self.workload is not None:
                        self.workload.close()
                    self.workload = nxt
                    eng.telemetry.emit("workload", name=nxt.name)
                if self.workload is not None and not self.workload.paused:
                    self.workload.tick(eng.clock())
                if not eng.has_work():
                    time.sleep(0.02)
                    continue
                outs = eng.step()
                self.steps += 1
                if self.workload is not None:
                    self.workload.observe(outs)
                self._stream(outs)
            except Exception as e:  # keep the window alive and say what broke
                import traceback

                self.error = f"{type(e).__name__}: {e}"
                eng.telemetry.emit("error", message=self.error, trace=traceback.format_exc(limit=6))
                time.sleep(0.5)

    def _stream(self, outs) -> None:
        """Detokenize the tokens of prompts typed in the window (label "prompt") for the transcript."""
        from engine.model.tokenizer import StreamDecoder

        for o in outs:
            dec = self._decoders.get(o.seq_id)
            if dec is None:
                seq = self.engine.seqs.get(o.seq_id)
                if seq is None or seq.label != "prompt":
                    continue
                dec = self._decoders[o.seq_id] = StreamDecoder(self.engine.tokenizer)
            piece = dec.push(o.token)
            if o.finished:
                piece += dec.flush()
                del self._decoders[o.seq_id]
            if piece:
                self._tokens.append((o.seq_id, piece))

    # -- reads (any thread) -----------------------------------------------------------------
    def snapshot(self, tables="auto", wait: bool = True):
        """The engine's state now; with wait=False, the last one if the engine is busy for more than 5 ms
        (a context shift or a re-layout holds its lock), so the window never waits on the engine."""
        snap = self.engine.snapshot(tables, timeout=None if wait else 0.005)
        if snap is None:
            return self._last
        self._last = snap
        return snap

    def take_events(self):
        return self.engine.take_events()

    def take_tokens(self) -> list[tuple[int, str]]:
        out = []
        while self._tokens:
            out.append(self._tokens.popleft())
        return out

    def config(self) -> CacheConfig:
        return self.engine.config

    def knobs(self):
        return KNOBS

    def is_lossy(self, changes: dict) -> bool:
        """Whether applying these knob changes can alter stored K/V (see engine.config.change_is_lossy)."""
        try:
            return self.engine.is_lossy_change(changes)
        except ConfigError:
            return False  # an invalid value: reconfigure refuses it with its reason

    @property
    def engine_paused(self) -> bool:
        return self._paused

    # -- commands -----------------------------------------------------------------------------
    def reconfigure(self, **changes) -> CacheConfig:
        """Applied between two engine steps before this returns; a refusal raises ConfigError with the reason
        (and is an event), and the engine keeps its config."""
        return self.engine.reconfigure(**changes)

    def pause_engine(self, paused: bool) -> None:
        with self._lock:
            self._paused = paused
            # The engine's clock stops with it: the demotion rule and heat decay see no idle time for the pause.
            (self.engine.clock.pause if paused else self.engine.clock.resume)()

    def step_once(self) -> None:
        with self._lock:
            self._single_steps += 1

    def workload_name(self) -> str:
        with self._lock:
            w = self._next_workload or self.workload
        return w.name if w is not None else "none"

    def replay_trace(self, path: str) -> str:
        """Replace the workload with a live, looping replay of a JSONL request trace. The file is read and
        checked now (RequestError names the problem, and the running workload stays); the swap happens
        between two steps, and the old workload's sequences are cancelled."""
        w = open_trace_workload(self.engine, path)
        self._replace_workload(w)
        return w.name

    def use_demo_workload(self, seed: int = 0) -> None:
        from engine.workloads.demo import DemoWorkload

        self._replace_workload(DemoWorkload(self.engine, seed=seed))

    def _replace_workload(self, w: Workload) -> None:
        old = self.workload
        if old is not None:
            w.paused = old.paused
            w.set_intensity(old.intensity)
        with self._lock:
            self._next_workload = w

    def set_workload_paused(self, paused: bool) -> None:
        if self.workload is not None:
            self.workload.paused = paused

    def set_intensity(self, x: float) -> None:
        if self.workload is not None:
            self.workload.set_intensity(x)

    @property
    def recording(self) -> bool:
        return self.engine.trace is not None

    def start_trace(self) -> None:
        self.engine.start_trace()

    def what_if(self):
        """The "What if" tab's service: record, open and compute curves on a worker thread (app/whatif/worker.py)."""
        from app.whatif.worker import WhatIfService

        return WhatIfService(self)

    def stop_trace(self, path: str) -> int:
        """Stop recording and save the block-access trace (.npz); returns its number of reads."""
        trace = self.engine.stop_trace(path)
        return 0 if trace is None else len(trace)

    def submit_prompt(self, text: str, chat: bool, max_new_tokens: int) -> int:
        """Queue a user prompt; its text streams through take_tokens(). Raises RequestError if it cannot fit."""
        from engine.sequence import SamplingParams
        from engine.workloads.prompts import encode_text

        if not text.strip():
            raise RequestError("empty prompt")
        ids = encode_text(self.engine.tokenizer, text, chat)
        return self.engine.add_request(ids, SamplingParams(max_new_tokens=max_new_tokens), label="prompt")

    def info(self) -> dict:
        e = self.engine
        return {"model": e.spec.name, "device": str(e.device), "layers": e.spec.num_layers,
                "kv_heads": e.spec.num_kv_heads, "head_dim": e.spec.head_dim}
