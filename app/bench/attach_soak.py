"""`kvscope attach --soak`: the attach window under load, measured (offscreen, real sockets, real widgets).

N fake publishers (separate processes on 127.0.0.1, vLLM- and SGLang-shaped, array and map encodings) each
send R events/s for S seconds; one session attaches to all of them and the window redraws every 100 ms as it
does live. Reported: the frame time (refresh + painting the map and every visible dock into images, as Qt paints
dirty widgets into the backing store) p50 / p99 / max, the event loop's longest stall (a 5 ms probe timer),
and per publisher the events it sent against the events the session applied, with how far behind the live
stream it fell at worst (seconds and queued frames) and how many frames it shed. Counts must match: an event that
was sent and not applied is a failure (exit status 1). Timing is reported, never asserted.
"""

from __future__ import annotations

import os
import time

import numpy as np

SHAPES = (("vllm", "map"), ("sglang", "array"), ("vllm", "array"))


def _stats(ms: list[float], cpu: list[float] | None = None) -> dict:
    """cpu: the same frames' CPU time; then also how many frames were over 16 ms on CPU time alone (the work of
    the frame itself), against the ones over only because they waited for a CPU."""
    a = np.asarray(ms, dtype=np.float64)
    if not len(a):
        return {"frames": 0}
    out = {"frames": int(len(a)), "p50_ms": float(np.median(a)), "p99_ms": float(np.percentile(a, 99)),
           "max_ms": float(a.max()), "over_16ms": int((a > 16.0).sum())}
    if cpu is not None and len(cpu) == len(a):
        out["over_16ms_cpu"] = int((np.asarray(cpu) > 16.0).sum())
    return out


def run_soak(publishers: int = 3, rate: float = 20_000.0, seconds: float = 60.0, batch: int = 100,
             say=print, drain_timeout_s: float = 60.0, profile: str | None = None, paint: str = "qt") -> dict:
    """paint "qt": a frame is the refresh and the paint Qt then does of the widgets it marked dirty (what a
    user's window does); "all": the refresh and a forced paint of every visible panel, changed or not (the
    worst case: each panel is timed). profile: a path; the timed frames (and only they) run under cProfile,
    its stats written there."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6 import QtCore, QtGui, QtWidgets

    from app.window.launch import _style
    from engine.attach.fake.spawn import FakeProcess
    from engine.attach.worker import AttachClient
    from engine.attach.source import parse_source
    from ui.attach.window import AttachWindow

    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication(["kvscope-soak"])
    _style(app)
    say(f"[attach-soak] starting {publishers} fake publishers, {rate:,.0f} events/s each for {seconds:g} s…")
    fakes = []
    for i in range(publishers):
        flavor, enc = SHAPES[i % len(SHAPES)]
        fakes.append(FakeProcess("--flavor", flavor, "--encoding", enc, "--rate", str(rate), "--batch", str(batch),
                                 "--duration", str(seconds), "--start-delay", "1.0", "--capacity", "20000",
                                 "--pregenerate",
                                 "--metrics-port", "0", "--buffer-steps", "100000", "--linger",
                                 str(drain_timeout_s + 10), "--seed", str(i), nice=10))
    specs = [s for i, f in enumerate(fakes) for s in parse_source(SHAPES[i % len(SHAPES)][0],
                                                                    f"{f.pub},name=pub{i},metrics={f.metrics}")]
    session = AttachClient(specs, [])
    win = AttachWindow(session)
    win.timer.stop()  # the soak drives the frames itself, to time the painting too
    win.show()
    app.processEvents()
    panels = [win.map, win.metrics, win.sources, win.events, win.statusBar()]
    images = {}
    frames: list[float] = []
    cpu: list[float] = []  # the same frames' CPU time in this thread: the rest of a frame's time it waited for a CPU
    gaps: list[float] = []
    last = [time.perf_counter()]

    if paint not in ("qt", "all"):
        raise ValueError(f"paint: 'qt' or 'all', not {paint!r}")
    parts: dict[str, list[float]] = {"refresh": [], **({"paint": []} if paint == "qt" else
                                                       {type(w).__name__: [] for w in panels})}
    worst: dict[int, list[float]] = {}  # source -> [seconds behind, frames queued], the most seen

    def behind() -> None:
        fr = win.last_frame
        for i, st in enumerate(fr.statuses if fr is not None else ()):
            w = worst.setdefault(i, [0.0, 0])
            w[0], w[1] = max(w[0], st.behind_s), max(w[1], st.queued)

    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()

    class _PaintCount(QtCore.QObject):
        """How many frames repainted each panel (a Paint event on the panel or any widget inside it)."""

        def __init__(self):
            super().__init__()
            self.now: set[str] = set()

        def eventFilter(self, obj, ev):
            if ev.type() == QtCore.QEvent.Paint:
                for w in panels:
                    if w is obj or w.isAncestorOf(obj):
                        self.now.add(type(w).__name__)
            return False

    painted = _PaintCount()
    repaints = {type(w).__name__: 0 for w in panels}
    for w in panels:
        for x in [w, *w.findChildren(QtWidgets.QWidget)]:
            x.installEventFilter(painted)

    def frame() -> None:
        if prof is not None:
            prof.enable()
        painted.now.clear()
        t0, c0 = time.perf_counter(), time.thread_time()
        win.refresh()
        t1 = time.perf_counter()
        parts["refresh"].append(1e3 * (t1 - t0))
        if paint == "qt":
            # What Qt does after a refresh: the posted update requests paint the widgets marked dirty (and only
            # those) into the window's backing store, synchronously, here.
            app.sendPostedEvents()
            parts["paint"].append(1e3 * (time.perf_counter() - t1))
        else:
            for w in panels:
                if w.visibleRegion().isEmpty():
                    continue
                img = images.get(id(w))
                if img is None or img.size() != w.size():
                    img = images[id(w)] = QtGui.QImage(w.size(), QtGui.QImage.Format_ARGB32_Premultiplied)
                t2 = time.perf_counter()
                w.render(img)
                parts[type(w).__name__].append(1e3 * (time.perf_counter() - t2))
        frames.append(1e3 * (time.perf_counter() - t0))
        cpu.append(1e3 * (time.thread_time() - c0))
        if prof is not None:
            prof.disable()
        for k in painted.now:
            repaints[k] += 1
        behind()  # not timed: the soak's own bookkeeping

    def probe() -> None:
        now = time.perf_counter()
        gaps.append(1e3 * (now - last[0]))
        last[0] = now

    t_frame, t_probe = QtCore.QTimer(), QtCore.QTimer()
    t_frame.timeout.connect(frame)
    t_probe.setTimerType(QtCore.Qt.PreciseTimer)
    t_probe.timeout.connect(probe)
    t_frame.start(100)
    t_probe.start(5)
    def pump(at_least_s: float = 0.0) -> None:
        # Block in the event loop until something happens (the 5 ms probe wakes it), as app.exec() would:
        # a loop that returned at once and polled the publishers again would spend a core of this process on
        # the polling, and the frames would be timed against the soak's own busy-wait.
        end = time.perf_counter() + at_least_s
        while True:
            app.processEvents(QtCore.QEventLoop.AllEvents | QtCore.QEventLoop.WaitForMoreEvents)
            if time.perf_counter() >= end:
                return

    summaries: list[dict] = []
    repaints_during: dict[str, int] = {}
    drain_s = float("nan")
    try:
        say("[attach-soak] publishers pre-generating their streams (not timed)…")
        while not all(f.started() for f in fakes):
            pump()
            if any(f.proc.poll() is not None for f in fakes):
                raise RuntimeError("a fake publisher ended before publishing")
        frames.clear()  # time the frames while the events flow
        cpu.clear()
        gaps.clear()
        for v in parts.values():
            v.clear()
        for k in repaints:
            repaints[k] = 0
        if prof is not None:
            prof.clear()
        say(f"[attach-soak] publishing for {seconds:g} s…")
        while not all(f.done() for f in fakes):
            pump()
        summaries = [f.summary() for f in fakes]
        expected = [s["events"] - s["lost_events"] for s in summaries]
        n_during, n_gaps = len(frames), len(gaps)
        repaints_during = dict(repaints)
        t_drain = time.monotonic()
        say(f"[attach-soak] publishers done: {sum(s['events'] for s in summaries):,} events sent; draining…")
        while True:
            pump(0.1)
            got = [a.events for a in session.frame(wait=True).snap.activity]
            if got == expected or time.monotonic() - t_drain > drain_timeout_s:
                break
        drain_s = time.monotonic() - t_drain
        del frames[n_during:], cpu[n_during:], gaps[n_gaps:]
        if prof is not None:
            prof.dump_stats(profile)
    finally:
        t_frame.stop()
        t_probe.stop()
        final = session.frame(slow=True, wait=True)
        statuses, act = final.statuses, final.snap.activity
        win.close()
        session.stop()
        for f in fakes:
            f.stop()
    per = []
    for i, (s, st, a) in enumerate(zip(summaries, statuses, act)):
        per.append({"publisher": f"pub{i} ({SHAPES[i % len(SHAPES)][0]}, {SHAPES[i % len(SHAPES)][1]})",
                    "events_sent": s["events"], "events_per_s_sent": s["events_per_s"],
                    "events_received": a.events, "batches_sent": s["batches"], "batches_received": st.batches,
                    "malformed": st.malformed, "gaps": st.gaps, "recovered": st.recovered, "lost": st.lost,
                    "history": st.history, "history_missing": st.history_missing, "shed": st.shed,
                    "behind_max_s": worst.get(i, [0.0, 0])[0], "queued_max": worst.get(i, [0.0, 0])[1]})
    g = np.asarray(gaps[20:]) - 5.0 if len(gaps) > 20 else np.zeros(1)
    res = {"publishers": publishers, "rate_per_publisher": rate, "seconds": seconds, "batch": batch,
           "frame": _stats(frames, cpu), "frame_cpu": _stats(cpu), "paint": paint,
           "frame_parts_p50_ms": {k: float(np.median(v)) for k, v in parts.items() if v},
           "frames_repainting": repaints_during,
           "frame_ms_each": [round(x, 2) for x in frames], "frame_cpu_ms_each": [round(x, 2) for x in cpu], "max_stall_ms": float(g.max()), "p99_stall_ms": float(np.percentile(g, 99)),
           "drain_s": drain_s, "per_publisher": per,
           "events_sent": sum(p["events_sent"] for p in per), "events_received": sum(p["events_received"] for p in per)}
    res["counts_match"] = all(p["events_sent"] == p["events_received"] for p in per)
    f = res["frame"]
    say(f"[attach-soak] frames: {f['frames']:,}, p50 {f['p50_ms']:.1f} ms, p99 {f['p99_ms']:.1f} ms, max "
        f"{f['max_ms']:.1f} ms, {f['over_16ms']:,} over 16 ms (goal ≤ 16 ms); event loop: max stall "
        f"{res['max_stall_ms']:.1f} ms, p99 "
        f"{res['p99_stall_ms']:.1f} ms")
    c = res["frame_cpu"]
    if c["frames"]:
        say(f"[attach-soak] the same frames' CPU time in the window's thread: p50 {c['p50_ms']:.1f} ms, p99 "
            f"{c['p99_ms']:.1f} ms, max {c['max_ms']:.1f} ms (the rest of a frame it waited for a CPU); "
            f"{f.get('over_16ms_cpu', 0):,} frames over 16 ms of CPU time")
    say("[attach-soak] frame p50 by part: " + ", ".join(f"{k} {v:.1f} ms" for k, v in res["frame_parts_p50_ms"].items())
        + ("  (paint: what Qt repainted, the widgets marked dirty)" if paint == "qt" else
           "  (every visible panel forced to paint each frame)"))
    say(f"[attach-soak] frames that repainted each panel (of {f['frames']:,}): "
        + ", ".join(f"{k} {v:,}" for k, v in repaints_during.items()))
    for p in per:
        say(f"[attach-soak] {p['publisher']}: sent {p['events_sent']:,} events ({p['events_per_s_sent']:,.0f}/s), "
            f"received {p['events_received']:,}; gaps {p['gaps']} ({p['recovered']} batches recovered, "
            f"{p['lost']} lost); malformed {p['malformed']}; at worst {p['behind_max_s']:.1f} s behind "
            f"({p['queued_max']:,} frames queued), {p['shed']:,} shed")
    say(f"[attach-soak] total: sent {res['events_sent']:,}, received {res['events_received']:,} -> "
        f"{'counts match' if res['counts_match'] else 'COUNTS DIFFER'} (drained in {drain_s:.1f} s after the "
        f"publishers stopped); load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return res
