"""`kvscope` with no subcommand: the inspector window on a live engine, or on a saved snapshot."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading

from app.window.platform_check import window_problem


def add_window_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--headless", action="store_true", help="render offscreen (no display needed)")
    p.add_argument("--screenshot", metavar="OUT.png", help="with --headless: write the window and its snapshot JSON")
    p.add_argument("--run-for", type=float, default=20.0, metavar="SECONDS", help="with --headless: run this long first")
    p.add_argument("--open-snapshot", metavar="FILE.json", help="show a saved snapshot, read-only")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                   help="two saved snapshots side by side (block maps, why missed) with every counter's A, B and "
                        "delta")
    p.add_argument("--no-workload", action="store_true", help="start without the built-in demo workload")
    p.add_argument("--replay", metavar="TRACE.jsonl",
                   help="replay your own requests (a JSONL trace, the bench --trace format) instead of the demo, "
                        "at their arrival times, looping")
    p.add_argument("--seed", type=int, default=0, help="demo workload seed")


def run_window(args: argparse.Namespace) -> int:
    if args.headless:
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
    else:
        # Before Qt starts: a plugin that cannot load or a display that does not answer would abort the
        # process with Qt's misleading advice.
        problem = window_problem()
        if problem:
            print(problem, file=sys.stderr)
            return 2
    if args.screenshot and not args.headless:
        print("kvscope: error: --screenshot needs --headless (in the window, use File > Save screenshot)",
              file=sys.stderr)
        return 2
    if getattr(args, "replay", None):  # read the trace before the model loads: refused if no line can run
        from engine.workloads.trace_workload import check_trace_file
        from engine.errors import RequestError

        try:
            check_trace_file(args.replay)
        except RequestError as e:
            print(f"kvscope: error: {e}", file=sys.stderr)
            return 2
    # A signal inside PySide6's first import aborts the process (shiboken's bootstrap: exit 134, no cleanup, as
    # kvscope attach found): held until the import is done, then acted on as it would have been.
    with held_signals() as held:
        from PySide6 import QtCore, QtWidgets
    for signum, handler in held:
        _deliver(signum, handler)

    from engine.telemetry import snapshot_io
    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication(["kvscope"])
    app.setApplicationName("KV Scope")
    app.setOrganizationName("kvscope")
    _style(app)
    from ui.main_window import MainWindow, open_snapshot_window, snapshot_path

    if getattr(args, "compare", None):
        try:
            win = compare_window(*args.compare)
            win.refresh_all()
        except snapshot_io.SnapshotFileError as e:
            print(f"kvscope: error: {e}", file=sys.stderr)
            return 2
        args.open_snapshot = " and ".join(args.compare)  # what a drawing error names
        return _show(app, win, args, runner=None)

    if args.open_snapshot:
        try:
            path = snapshot_path(args.open_snapshot)  # a screenshot's PNG: the JSON saved beside it
            if path != args.open_snapshot:
                print(f"[kvscope] {args.open_snapshot} is a screenshot: opening {path}, the snapshot saved beside it",
                      file=sys.stderr)
            win = open_snapshot_window(path)
            # Every panel drawn once now, so a snapshot that passes the file checks and still cannot be
            # drawn is refused here, in one line, before any window shows.
            win.refresh_all()
        except snapshot_io.SnapshotFileError as e:
            print(f"kvscope: error: {e}", file=sys.stderr)
            return 2
        except Exception as e:
            print(f"kvscope: error: {args.open_snapshot}: cannot draw the snapshot ({_one_line(e)})", file=sys.stderr)
            return 2
        return _show(app, win, args, runner=None)

    runner = start_runner(args) if args.headless else load_with_progress(args)
    rc = 1
    try:
        settings = None if args.headless else QtCore.QSettings("kvscope", "kvscope")
        win = MainWindow(runner, settings=settings, confirm_lossy=(lambda dtype: True) if args.headless else None)
        rc = _show(app, win, args, runner)
        return rc
    finally:
        stop_engine_thread(runner, rc)


def compare_window(path_a: str, path_b: str):
    """The compare window on two snapshot files (or the JSONs beside two screenshots' PNGs); SnapshotFileError
    naming the file that is not one."""
    from engine.telemetry import snapshot_io
    from ui.compare import CompareWindow
    from ui.main_window import snapshot_path

    loaded = [snapshot_io.load(snapshot_path(p)) for p in (path_a, path_b)]
    names = tuple(os.path.basename(p) for p in (path_a, path_b))
    if names[0] == names[1]:
        names = ("A: " + names[0], "B: " + names[1])
    return CompareWindow(loaded[0][0], loaded[1][0], names,
                         tuple(str(extra.get("caption", "")) for _, extra in loaded))


def stop_engine_thread(runner, rc: int, timeout_s: float = 60.0) -> None:
    """Stop the engine thread and wait for it: the process must not exit while it runs. A daemon thread still
    inside torch when the interpreter shuts down ends the process with "terminate called without an active
    exception" (exit 134): seen when an error in the window's start skipped runner.stop(), and possible when a
    step outlasts stop's own timeout on a loaded machine. A step that never ends (a hung device) exits the
    process without running the C++ destructors, with the status it had."""
    runner.stop()
    thread = getattr(runner, "_thread", None)
    if thread is None or not thread.is_alive():
        return
    thread.join(timeout_s)
    if thread.is_alive():
        print(f"kvscope: the engine thread did not stop within {timeout_s:g} s; exiting without it",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(rc if rc else 1)


@contextlib.contextmanager
def held_signals():
    """SIGINT and SIGTERM received inside are kept (with the handler they would have gone to) rather than acted
    on; the caller delivers them after. The main thread only (elsewhere signals cannot be set)."""
    held: list[tuple[int, object]] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in old:
        signal.signal(s, lambda signum, _frame: held.append((signum, old[signum])))
    try:
        yield held
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _deliver(signum: int, handler) -> None:
    """Act on a held signal as its handler would have."""
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def load_with_progress(args: argparse.Namespace):
    """start_runner on a worker thread while a small window shows the load's progress (the first start
    converts the model, half a minute with nothing else on screen); raises what the load raised."""
    import shiboken6
    from PySide6 import QtCore

    from app.commands import progress_printer
    from ui.loading_window import LoadingWindow

    class Bridge(QtCore.QObject):  # carries the worker's reports to the window's thread
        progress = QtCore.Signal(str, float)
        done = QtCore.Signal()

    win = LoadingWindow()
    win.show()
    bridge = Bridge()
    bridge.progress.connect(win.set_progress)
    loop = QtCore.QEventLoop()
    bridge.done.connect(loop.quit)
    out: dict = {}

    def report(stage: str, fraction: float) -> None:
        progress_printer(stage, fraction)
        bridge.progress.emit(stage, fraction)

    def work() -> None:
        try:
            out["runner"] = start_runner(args, progress=report)
        except BaseException as e:  # handed to the main thread, raised there
            out["error"] = e
        finally:
            bridge.done.emit()

    def interrupt(*_) -> None:  # Ctrl+C in the terminal still stops a start (the window's timer lets it run)
        out.setdefault("error", KeyboardInterrupt())
        loop.quit()

    worker = threading.Thread(target=work, name="kvscope-load", daemon=True)
    worker.start()
    old = signal.signal(signal.SIGINT, interrupt)
    try:
        loop.exec()  # the signal is queued, so a load that ends first still ends this loop
    finally:
        signal.signal(signal.SIGINT, old)
    if not isinstance(out.get("error"), KeyboardInterrupt):
        worker.join()  # it has emitted its last signal
    QtCore.QCoreApplication.sendPostedEvents()  # the worker's last progress reports, to the window still there
    win.close()
    # Delete both Qt objects here, on the GUI thread. Left to Python, a raised error's traceback holds this
    # frame in a reference cycle, and the cyclic GC may then run on any thread (an attach session's, say):
    # a widget destroyed there crashed the next processEvents.
    shiboken6.delete(win)
    if not worker.is_alive():  # interrupted (Ctrl+C) while loading, the worker may still emit: keep its bridge
        shiboken6.delete(bridge)
    if "error" in out:
        raise out["error"]
    return out["runner"]


def start_runner(args: argparse.Namespace, progress=None):
    import torch

    from app.commands import open_engine
    from app.window.runner import EngineRunner, open_trace_workload
    from engine.workloads.demo import DemoWorkload

    # Leave a core to the window: the model's matmuls get the rest.
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    if getattr(args, "context_limit", None) is None:
        args.context_limit = 512  # so the demo's long chat reaches the limit and shifts within seconds
    if not getattr(args, "n_keep", 0):
        args.n_keep = 128  # the demo system prompt is ~context_limit/4 tokens: keep it across shifts
    # Demo budgets small enough that the tiers visibly fill, evict and migrate (flags override them).
    if args.device_budget_mb is None:
        args.device_budget_mb = 48.0
    if args.host_budget_mb is None:
        args.host_budget_mb = 192.0
    print("[kvscope] loading the model…", file=sys.stderr, flush=True)
    engine, load_s = open_engine(args) if progress is None else open_engine(args, progress=progress)
    print(f"[kvscope] model ready in {load_s:.1f} s", file=sys.stderr, flush=True)
    if getattr(args, "replay", None):
        workload = open_trace_workload(engine, args.replay)
    else:
        workload = None if args.no_workload else DemoWorkload(engine, seed=args.seed)
    return EngineRunner(engine, workload).start()


def _show(app, win, args, runner) -> int:
    """Show the window; headless, take the screenshot after --run-for seconds and quit. Whatever goes wrong
    there ends the event loop (never a hang) with one error line and exit status 2 (never a traceback)."""
    from PySide6 import QtCore

    if not args.headless:
        win.show_fitted()
        return app.exec()
    win.show()
    done = {"rc": 0}
    what = f"{args.open_snapshot}: cannot draw the snapshot" if runner is None else "the window failed"

    def fail(msg: str) -> None:
        if done["rc"] == 0:  # the first error only: one line
            print(f"kvscope: error: {msg}", file=sys.stderr, flush=True)
        done["rc"] = 2

    def finish() -> None:
        try:
            if args.screenshot:
                json_path = win.save_screenshot(args.screenshot)
                print(f"[kvscope] wrote {args.screenshot} and {json_path}", file=sys.stderr)
        except OSError as e:
            fail(str(e))
        except Exception as e:
            fail(f"{what} ({_one_line(e)})")
        finally:
            try:
                if runner is not None and runner.error:
                    print(f"kvscope: engine error during the run: {runner.error}", file=sys.stderr)
                win.close()
            except Exception as e:
                fail(f"{what} ({_one_line(e)})")
            finally:
                app.quit()

    # A read-only snapshot: an exception in a timer's repaint (Qt reports it through sys.excepthook and
    # carries on) ends the run too, in one line, rather than a traceback on every frame.
    old_hook = sys.excepthook

    def hook(kind, e, tb) -> None:
        if not issubclass(kind, Exception):
            return old_hook(kind, e, tb)
        fail(f"{what} ({_one_line(e)})")
        app.quit()

    if runner is None:
        sys.excepthook = hook
    try:
        QtCore.QTimer.singleShot(int(max(args.run_for, 0.1) * 1000), finish)
        app.exec()
    finally:
        sys.excepthook = old_hook
    return done["rc"]


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "assets")


def _style(app) -> None:
    from PySide6 import QtGui

    pal = QtGui.QPalette()
    for role, colour in ((QtGui.QPalette.Window, "#1b1e23"), (QtGui.QPalette.WindowText, "#d0d4da"),
                         (QtGui.QPalette.Base, "#15181d"), (QtGui.QPalette.AlternateBase, "#1c2026"),
                         (QtGui.QPalette.Text, "#d0d4da"), (QtGui.QPalette.Button, "#2a2f37"),
                         (QtGui.QPalette.ButtonText, "#d0d4da"), (QtGui.QPalette.Highlight, "#2f5d7c"),
                         (QtGui.QPalette.HighlightedText, "#ffffff"), (QtGui.QPalette.ToolTipBase, "#252930"),
                         (QtGui.QPalette.ToolTipText, "#e6e8eb"), (QtGui.QPalette.PlaceholderText, "#737a84")):
        pal.setColor(role, QtGui.QColor(colour))
    app.setPalette(pal)
    font = app.font()
    font.setPointSize(9)
    app.setFont(font)
    with open(os.path.join(ASSETS, "style.qss"), encoding="utf-8") as f:
        app.setStyleSheet(f.read())
    app.setWindowIcon(QtGui.QIcon(os.path.join(ASSETS, "icons", "kvscope.svg")))
