"""`kvscope --headless` must exit 0, never 134 ("terminate called without an active exception"): the process
must not end while the engine thread runs (a daemon thread inside torch at interpreter shutdown aborts it), and
a signal inside PySide6's first import must not reach shiboken's bootstrap (issue 22 item 4)."""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time

import pytest

pytest.importorskip("PySide6")


class _Runner:
    """An engine thread that takes `lag_s` to finish the step it is in after stop() (a loaded machine), and a
    stop() that, like EngineRunner's, waits for it only `timeout` seconds."""

    def __init__(self, lag_s: float = 0.0):
        self._stop = threading.Event()
        self.lag_s = lag_s
        self.stops = 0
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        self._stop.wait()
        time.sleep(self.lag_s)

    def stop(self, timeout: float = 0.05) -> None:
        self.stops += 1
        self._stop.set()
        self._thread.join(timeout)


def _args(**kw) -> argparse.Namespace:
    base = dict(headless=True, screenshot=None, run_for=0.1, open_snapshot=None, replay=None, no_workload=True)
    return argparse.Namespace(**{**base, **kw})


def test_an_error_while_the_window_starts_still_stops_the_engine_thread(qapp, monkeypatch):
    """MainWindow raising in its constructor skipped runner.stop(): the engine thread ran on into the
    interpreter's shutdown (seen: exit 134 after a TypeError in the window's first refresh)."""
    import app.window.launch as w
    import ui.main_window

    runner = _Runner()
    monkeypatch.setattr(w, "start_runner", lambda args: runner)

    def broken(*a, **k):
        raise TypeError("the window could not start")

    monkeypatch.setattr(ui.main_window, "MainWindow", broken)
    with pytest.raises(TypeError):
        w.run_window(_args())
    assert runner.stops == 1 and not runner._thread.is_alive()


def test_the_process_waits_for_a_step_that_outlasts_stops_timeout():
    from app.window.launch import stop_engine_thread

    runner = _Runner(lag_s=0.5)
    stop_engine_thread(runner, 0)
    assert not runner._thread.is_alive()


@pytest.fixture
def default_sigint():
    """SIGINT with Python's default handler (KeyboardInterrupt) for the test, whatever this process inherited: one
    started in the background by a non-interactive shell has it ignored (SIG_IGN), and Python keeps that."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_a_signal_inside_the_held_section_waits_until_it_ends(default_sigint):
    from app.window.launch import _deliver, held_signals

    with held_signals() as held:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # Python runs the handler between bytecodes: here, held
    assert [s for s, _ in held] == [signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    with pytest.raises(KeyboardInterrupt):
        for signum, handler in held:
            _deliver(signum, handler)


def test_a_signal_the_process_ignores_stays_ignored_after_the_held_section():
    """A process started with SIGINT ignored (SIG_IGN, as a background job of a non-interactive shell is): a
    SIGINT inside the held section is kept with that handler, and delivering it does nothing."""
    from app.window.launch import _deliver, held_signals

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with held_signals() as held:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert held == [(signal.SIGINT, signal.SIG_IGN)]
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        for signum, handler in held:
            _deliver(signum, handler)  # ignored: no KeyboardInterrupt, the process lives on
    finally:
        signal.signal(signal.SIGINT, before)
