"""`kvscope attach`: the inspector on running vLLM / SGLang servers, read-only (KV events over ZMQ, /metrics
over HTTP). Needs no torch: this module and everything it imports are Qt + numpy + pyzmq + msgpack +
prometheus_client. `--soak` is the bench (app/bench/attach_soak.py), `--bench-decode` the decoder's
(app/bench/attach_decode.py); `--demo` attaches to fake publishers started here, for trying the window
without a server."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time

from engine.attach.cluster import MODES


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvscope attach", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Attach to running vLLM / SGLang servers (read-only) and draw their KV caches live.",
        epilog="""on the server (vLLM 0.33 and SGLang 0.5 take the same flag and JSON):
  vllm serve MODEL --kv-events-config \\
    '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",
      "replay_endpoint":"tcp://*:5558","topic":"kv-events"}'
  python -m sglang.launch_server --model-path MODEL --kv-events-config '<the same JSON>' --enable-metrics
then: kvscope attach --vllm tcp://SERVER:5557,topic=kv-events

data-parallel ranks: each rank publishes on endpoint port + rank and replays on replay port + rank
(vLLM --data-parallel-size N; SGLang --dp-size N, by attention-DP rank with --enable-dp-attention), so
with N >= 2 the replay endpoint needs a base of its own, after the N publisher ports, e.g. for N = 4:
  vllm serve MODEL --data-parallel-size 4 --kv-events-config \\
    '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",
      "replay_endpoint":"tcp://*:5600","topic":"kv-events"}'
  kvscope attach --vllm tcp://SERVER:5557,dp=4,replay=5600
(publishers 5557..5560, replay 5600..5603; with 5557 / 5558, rank 1's publisher and rank 0's replay socket
would both bind 5558 on one node)""")
    ap.add_argument("--vllm", action="append", default=[], metavar="tcp://HOST:PORT[,opts]",
                    help="a vLLM KV-event publisher (its endpoint's port; rank 0's with dp=N); options after "
                         "commas: replay=PORT or replay=tcp://HOST:PORT (the server's replay_endpoint, rank 0's "
                         "port; default: PORT+N, right after the N publishers) or replay=none, topic=NAME, dp=N "
                         "(ranks publish on PORT..PORT+N-1 and replay on REPLAY..REPLAY+N-1, as the servers offset "
                         "both), name=LABEL, metrics=http://HOST:PORT/metrics (this server's /metrics)")
    ap.add_argument("--sglang", action="append", default=[], metavar="tcp://HOST:PORT[,opts]",
                    help="an SGLang KV-event publisher (same options)")
    ap.add_argument("--metrics", action="append", default=[], metavar="http://HOST:PORT[/metrics]",
                    help="a server's Prometheus endpoint (vLLM: the API port; SGLang: with --enable-metrics)")
    ap.add_argument("--tokenizer", metavar="PATH", help="the served model's tokenizer.json (or its directory): "
                                                        "tooltips show block text")
    ap.add_argument("--mode", choices=MODES, default="age", help="initial colour mode of the block map")
    ap.add_argument("--half-life", type=float, default=10.0, metavar="SECONDS", help="heat half-life (10)")
    ap.add_argument("--scrape-interval", type=float, default=1.0, metavar="SECONDS",
                    help="seconds between two reads of each server's /metrics (default 1)")
    ap.add_argument("--record", metavar="FILE.npz", help="record the event stream; at exit write a trace for "
                                                         "`kvscope policy-lab FILE.npz`")
    ap.add_argument("--headless", action="store_true", help="no window: run offscreen")
    ap.add_argument("--screenshot", metavar="OUT.png", help="with --headless: write the window after --run-for")
    ap.add_argument("--run-for", type=float, default=20.0, metavar="SECONDS", help="with --headless (20)")
    ap.add_argument("--demo", action="store_true",
                    help="start fake publishers on 127.0.0.1 (a vLLM with 2 ranks and a CPU tier, an SGLang) and "
                         "attach to them")
    ap.add_argument("--soak", action="store_true", help="the bench: fake publishers at a high rate, frame times "
                                                        "and events sent vs received")
    ap.add_argument("--soak-publishers", type=int, default=3, help="with --soak: fake publishers started (3)")
    ap.add_argument("--soak-rate", type=float, default=20_000.0, help="events/s per publisher (20000)")
    ap.add_argument("--soak-seconds", type=float, default=60.0, help="with --soak: seconds the soak runs (60)")
    ap.add_argument("--soak-paint", choices=("qt", "all"), default="qt",
                    help="qt: a frame is the refresh plus what Qt repaints (the widgets marked dirty), as in a "
                         "user's window; all: plus a forced paint of every visible panel, each timed (worst case)")
    ap.add_argument("--bench-decode", action="store_true",
                    help="the decoder's bench: events/s decoding payloads shaped as vLLM 0.33 and SGLang 0.5 send "
                         "them (and the older layouts), alone and applied to the block maps; no sockets")
    ap.add_argument("--bench-seconds", type=float, default=2.0, metavar="SECONDS",
                    help="with --bench-decode: seconds per shape and measure (2)")
    ap.add_argument("--in-process", action="store_true",
                    help="decode events on threads of the window's process instead of an ingest process (debugging)")
    ap.add_argument("--json", action="store_true", help="print one JSON object (headless summary, soak)")
    return ap


def _specs(args) -> tuple[list, list[str]]:
    from engine.attach.source import parse_metrics_url, parse_source

    from engine.attach.source import check_distinct

    specs = [s for kind in ("vllm", "sglang") for text in getattr(args, kind) for s in parse_source(kind, text)]
    check_distinct(specs)
    return specs, [parse_metrics_url(u) for u in args.metrics]


# (option, its dest, least value, whether the least is allowed): every number a user types, checked before
# anything starts (nan and inf pass a plain `<= 0` test; nan seconds raised out of time.sleep or never ended
# the decode bench).
_NUMBERS = (("--half-life", "half_life", 0.0, False), ("--scrape-interval", "scrape_interval", 0.0, False),
            ("--run-for", "run_for", 0.0, True), ("--bench-seconds", "bench_seconds", 0.0, False),
            ("--soak-publishers", "soak_publishers", 1, True), ("--soak-rate", "soak_rate", 0.0, False),
            ("--soak-seconds", "soak_seconds", 0.0, False))


def check_numbers(args) -> None:
    """Raises SourceError naming the first option whose value cannot be used."""
    import math

    from engine.attach.source import SourceError

    for flag, dest, least, inclusive in _NUMBERS:
        v = getattr(args, dest)
        if not math.isfinite(v) or v < least or (v == least and not inclusive):
            raise SourceError(f"{flag} {v:g}: must be a finite number {'>=' if inclusive else '>'} {least:g}")


def _start_demo(fakes: list) -> tuple[list, list, list[str]]:
    """Start the demo's publishers, each appended to fakes as it starts (so an interrupted start stops those
    already running). Each dies with this process however it ends (engine/attach/fake/spawn.py)."""
    from engine.attach.fake.spawn import FakeProcess

    # The vLLM one also withholds a few batches from its live stream (recovered from its replay socket) and
    # sends a junk frame now and then, so the Sources panel has something to show.
    for argv in (("--flavor", "vllm", "--dp", "2", "--cpu-offload", "1500",
                  "--rate", "1500", "--duration", "1e9", "--metrics-port", "0", "--kv-cache-metrics",
                  "--capacity", "2500", "--seed", "1", "--gap", "150:5", "--malformed-every", "200"),
                 ("--flavor", "sglang", "--rate", "800", "--duration", "1e9",
                  "--metrics-port", "0", "--capacity", "1800", "--seed", "2")):
        fakes.append(FakeProcess(*argv))
    return fakes, [f"{fakes[0].pub},dp=2,name=fake-vllm,metrics={fakes[0].metrics}",
                   f"{fakes[1].pub},name=fake-sglang,metrics={fakes[1].metrics}"], []


def _summary(session) -> dict:
    act = session.cluster.activity()
    return {"sources": [{**st.__dict__, "events": a.events, "stored_blocks": a.stored_blocks,
                         "removed_blocks": a.removed_blocks, "bad_events": a.bad_events}
                        for st, a in zip(session.statuses(), act)],
            "caches": {session.cluster.group_label(k): len(g) for k, g in session.cluster.groups.items()},
            # engine/attach/restores.py: stores of hashes each cache removed before, and what more blocks would buy
            "re_stores": {session.cluster.group_label(k): g.restores.summary()
                          for k, g in session.cluster.groups.items()}}


class Stopped(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl+C raises KeyboardInterrupt: the same clean stop (the session, the demo's
    publishers), exit status 128 + 15."""


_SIGNALLED: list[int] = []  # the stop signals received: an error raised after one is the interruption's


def _interrupt(signum, frame) -> None:
    """Outside the window: SIGTERM raises Stopped, Ctrl+C KeyboardInterrupt, where the main thread is."""
    _SIGNALLED.append(signum)
    if signum == signal.SIGTERM:
        raise Stopped()
    signal.default_int_handler(signum, frame)


@contextlib.contextmanager
def _stop_signals(handler):
    """SIGINT and SIGTERM go to handler while inside (the main thread only: elsewhere signals cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    with _stop_signals(_interrupt):
        try:
            return _main(args)
        except Stopped:  # before the session's try (while the demo's publishers start): they were stopped there
            return 128 + signal.SIGTERM
        except KeyboardInterrupt:
            return 128 + signal.SIGINT
        except Exception:
            # Interrupted inside an import, the interruption comes out as another error (PySide6: "could not
            # import module"): after a stop signal it is the signal's exit, not a traceback.
            if _SIGNALLED:
                return 128 + _SIGNALLED[-1]
            raise


def _main(args) -> int:
    from engine.attach.source import SourceError

    try:
        check_numbers(args)
    except SourceError as e:
        print(f"kvscope attach: error: {e}", file=sys.stderr)
        return 2
    if args.bench_decode:
        from app.bench.attach_decode import run

        res = run(max(args.bench_seconds, 0.1), say=(lambda *a: print(*a, file=sys.stderr)) if args.json else print)
        if args.json:
            print(json.dumps(res))
        return 0
    if args.soak:
        from app.bench.attach_soak import run_soak

        res = run_soak(args.soak_publishers, args.soak_rate, args.soak_seconds, paint=args.soak_paint,
                       say=(lambda *a: print(*a, file=sys.stderr)) if args.json else print)
        if args.json:
            print(json.dumps(res))
        return 0 if res["counts_match"] else 1
    from engine.attach.session import AttachSession
    from engine.attach.source import SourceError
    from engine.attach.worker import AttachClient, WorkerError

    fakes = []
    try:
        if args.headless and args.screenshot and not os.path.isdir(os.path.dirname(os.path.abspath(args.screenshot))):
            raise SourceError(f"--screenshot {args.screenshot}: no such folder")
        if args.record and not os.path.isdir(os.path.dirname(os.path.abspath(args.record))):
            raise SourceError(f"--record {args.record}: no such folder")
        if args.screenshot and not args.headless:
            raise SourceError("--screenshot needs --headless (in the window: File > Save screenshot)")
        tokens = None
        if args.tokenizer:
            from engine.attach.tokens import TokenText

            tokens = TokenText(args.tokenizer)
        if args.demo:
            fakes, (vllm_src, sglang_src), demo_urls = _start_demo(fakes)
            args.vllm.append(vllm_src)
            args.sglang.append(sglang_src)
            args.metrics.extend(demo_urls)
        specs, urls = _specs(args)
        if not specs and not urls:
            raise SourceError("nothing to attach to: give --vllm / --sglang endpoints (and --metrics URLs), or --demo")
        kw = dict(half_life_s=args.half_life, scrape_interval_s=args.scrape_interval, record=bool(args.record))
        in_process = args.in_process or (args.headless and not args.screenshot)
        session = AttachSession(specs, urls, **kw) if in_process else AttachClient(specs, urls, **kw)
    except (SourceError, ValueError, OSError, RuntimeError, WorkerError) as e:
        print(f"kvscope attach: error: {e}", file=sys.stderr)
        for f in fakes:
            f.stop()
        return 2
    except KeyboardInterrupt:  # Ctrl+C or SIGTERM while starting
        for f in fakes:
            f.stop()
        raise
    rc = 0
    try:
        session.start()
        if args.headless and not args.screenshot:  # no window at all: attach, wait, report
            time.sleep(max(args.run_for, 0.0))
            res = _summary(session)
            print(json.dumps(res, default=str) if args.json else _summary_text(res))
        else:
            rc = _window(args, session, tokens)
    except Stopped:
        rc = 128 + signal.SIGTERM
    except KeyboardInterrupt:
        rc = 130
    finally:
        try:
            if args.record:
                meta = session.save_recording(args.record)
                print(f"[kvscope] recorded {meta['events']:,} events ({meta['blocks']:,} blocks) -> {args.record}: "
                      f"{meta['reads']:,} inferred reads in {meta['requests']:,} requests; replay it with "
                      f"`kvscope policy-lab {args.record}`", file=sys.stderr)
        except (OSError, ValueError) as e:
            print(f"kvscope attach: error: --record {args.record}: {e}", file=sys.stderr)
            rc = rc or 2
        finally:
            session.stop()
            for f in fakes:
                f.stop()
    return rc


def _summary_text(res: dict) -> str:
    lines = []
    for s in res["sources"]:
        lines.append(f"{s['label']}: {s['events']:,} events in {s['batches']:,} batches "
                     f"(stored {s['stored_blocks']:,} blocks, removed {s['removed_blocks']:,}); malformed "
                     f"{s['malformed'] + s['bad_events']:,}; gaps {s['gaps']:,} ({s['recovered']:,} batches "
                     f"recovered, {s['lost']:,} lost); history {s['history']:,} got, {s['history_missing']:,} gone; "
                     f"behind {s['behind_s']:.1f} s ({s['queued']:,} frames queued, {s['shed']:,} shed)")
    from engine.attach.restores import curve_text

    for label, n in res["caches"].items():
        lines.append(f"  {label}: {n:,} blocks resident")
        rs = res.get("re_stores", {}).get(label)
        if rs and rs["stores"]:
            lines.append(f"    re-stored {rs['re_stores']:,} of {rs['stores']:,} stores "
                         f"({100 * rs['re_store_share']:.1f} %), gap p50 {_secs(rs['gap_p50_s'])}; {curve_text(rs)} "
                         "(a lower bound: events show no lookup that hit)")
    return "\n".join(lines) if lines else "no events received"


def _secs(x: float) -> str:
    return "—" if x != x else f"{x:.1f} s"


def attach_advice(problem: str) -> str:
    """The main window's "no window can open" message (app/window/platform_check.py), said of attach: its headless
    run attaches and writes the PNG (no demo workload, no snapshot JSON)."""
    for main, here in (("kvscope --headless", "kvscope attach ... --headless"),
                       ("xvfb-run kvscope", "xvfb-run kvscope attach ..."),
                       ("the demo workload runs offscreen for 20 s, then the PNG and its snapshot JSON are written",
                        "it attaches offscreen for 20 s, then writes the PNG; or --headless --run-for 20 --json "
                        "for a summary"),
                       ("runs the demo workload offscreen for 20 s, then writes the PNG and its snapshot JSON",
                        "attaches offscreen for 20 s, then writes the PNG")):
        problem = problem.replace(main, here)
    return problem


def _window(args, session, tokens) -> int:
    from app.window.platform_check import window_problem
    from app.window.launch import _style

    if args.headless:
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
    else:
        # As for the main window: a platform plugin that cannot load, or a display nobody answers, is a clear
        # exit 2 before Qt starts (not Qt's abort with its misleading advice).
        problem = window_problem()
        if problem:
            print(attach_advice(problem), file=sys.stderr)
            return 2
    # A signal inside PySide6's first import aborts the process (shiboken's bootstrap: exit 134, no cleanup):
    # held until the import is done, then acted on.
    held: list[int] = []
    with _stop_signals(lambda signum, _frame: held.append(signum)):
        from PySide6 import QtCore, QtWidgets

        from ui.attach.window import AttachWindow
    if held:
        _interrupt(held[-1], None)

    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication(["kvscope"])
    _style(app)
    win = AttachWindow(session, tokens, mode=args.mode)
    if args.demo:
        win.setWindowTitle(win.windowTitle() + "  [demo: fake publishers on 127.0.0.1]")
        note = QtWidgets.QLabel("demo: fake vLLM / SGLang publishers on 127.0.0.1 (engine/attach/fake/publisher.py)")
        note.setStyleSheet("color: #e6c07b; padding-right: 6px")
        win.statusBar().addPermanentWidget(note)
    rc = {"rc": 0}

    def stop(signum, _frame) -> None:  # Ctrl+C, SIGTERM: close the window; main's finally stops the rest
        _SIGNALLED.append(signum)
        rc["rc"] = 128 + signum
        win.close()
        app.quit()

    # Python runs a signal's handler only between bytecodes, and Qt's event loop runs none of its own: a timer
    # lets it in within 0.2 s.
    wake = QtCore.QTimer(win)
    wake.timeout.connect(lambda: None)
    wake.start(200)
    with _stop_signals(stop):
        if not args.headless:
            win.show_fitted()  # fitted to the screen's free area, as the main window (headless: the default size)
            app.exec()
            return rc["rc"]
        return _headless_window(app, win, args, rc)


def _headless_window(app, win, args, rc: dict) -> int:
    from PySide6 import QtCore

    win.show()
    print(f"[kvscope] attached (offscreen): the screenshot in {args.run_for:g} s", file=sys.stderr, flush=True)

    def finish() -> None:
        try:
            win.save_screenshot(args.screenshot)
            print(f"[kvscope] wrote {args.screenshot}", file=sys.stderr)
        except OSError as e:
            print(f"kvscope attach: error: {e}", file=sys.stderr)
            rc["rc"] = 2
        finally:
            win.close()
            app.quit()

    QtCore.QTimer.singleShot(int(max(args.run_for, 0.1) * 1000), finish)
    app.exec()
    return rc["rc"]
