"""`kvscope bench --ui`: the window's responsiveness, measured (offscreen, real widgets, real engine).

1. snapshot + block-map redraw per frame at 1,000,000 blocks (engine snapshot, set_snapshot, paint);
2. a full refresh of every panel at 100,000 blocks (MainWindow.refresh, paint), with two minutes of
   time-series history behind the charts;
3. event-loop stalls while the engine decodes the demo workload on the default model: a 5 ms timer
   records the gaps between its ticks; anything above 5 ms is time the loop could not run.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np


def _paint(widget) -> None:
    # Render the whole widget tree now. (repaint() is a no-op on the offscreen platform, where
    # windows are never exposed; grab() paints every child into a pixmap, which is the same work.)
    widget.grab()


def _ms(r: dict) -> str:
    return f"median {r['median_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, max {r['max_ms']:.1f} ms"


def _frames(fn, n: int, before=None) -> dict:
    """fn timed n times; before(i), if given, runs untimed ahead of each."""
    times = []
    for i in range(n):
        if before is not None:
            before(i)
        t = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t))
    a = np.asarray(times)
    return {"median_ms": float(np.median(a)), "p99_ms": float(np.percentile(a, 99)), "max_ms": float(a.max())}


def _two_minutes_of_history(eng, seed: int = 0) -> None:
    """Give the engine's time series the full length a window shows after two minutes of running (every
    chart then draws its full polyline), with rates that move from point to point as a live cache's do."""
    from engine.telemetry.snapshotter import SERIES_LEN, SERIES_PERIOD_S, StepSample

    rng = np.random.default_rng(seed)
    c = eng.counters
    saved = dataclasses.replace(c)
    end = eng.clock()
    for i in range(SERIES_LEN):
        c.read_tokens += int(rng.integers(800, 6400))
        c.read_tokens_missed += int(rng.integers(0, 640))
        c.prompt_tokens += int(rng.integers(0, 300))
        c.prompt_reused += int(rng.integers(0, 150))
        c.evictions += int(rng.integers(0, 30))
        c.promotions += int(rng.integers(0, 20))
        c.demotions += int(rng.integers(0, 20))
        c.generated += int(rng.integers(1, 60))
        t = end - (SERIES_LEN - 1 - i) * SERIES_PERIOD_S * 1.001
        used = [tier.used * eng.pool.block_bytes for tier in eng.pool.tiers]
        eng.telemetry.after_step(StepSample(t, *used))
    for f in dataclasses.fields(c):  # the counters as they were; only the history is synthetic
        setattr(c, f.name, getattr(saved, f.name))


def run_ui_bench(big: int = 1_000_000, medium: int = 100_000, stall_s: float = 20.0, say=print) -> dict:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6 import QtCore, QtWidgets

    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication(["kvscope-bench"])
    from app.window.launch import _style

    _style(app)  # the app's own style sheet: painting cost depends on it
    from app.bench.throughput import filled_engine
    from app.window.runner import EngineRunner
    from ui.block_map.widget import BlockMap
    from ui.main_window import MainWindow

    out: dict = {}
    say(f"[ui-bench] filling an engine with {big:,} blocks…")
    eng, n_seqs, _ = filled_engine(big)
    bm = BlockMap()
    bm.resize(1100, 620)
    bm.show()
    app.processEvents()

    def frame_big() -> None:
        bm.set_snapshot(eng.snapshot(set()))
        _paint(bm)

    frame_big()
    out["blockmap_1m"] = {"blocks": big, "sequences": n_seqs, **_frames(frame_big, 30)}
    say(f"[ui-bench] snapshot + block map at {big:,} blocks ({n_seqs} sequences): {_ms(out['blockmap_1m'])} "
        f"(goal ≤ 16 ms)")
    # The same after the engine moved a block between tiers before each frame, as a busy engine does: the
    # snapshot's cached per-sequence placement is then recounted for every sequence.
    from engine.kv.tiers import Tier

    pool = eng.pool
    lids = np.flatnonzero(pool.tier >= 0)

    def migrate(i: int) -> None:
        lid = lids[i * 997 % len(lids)]
        to = Tier.HOST if pool.tier[lid] == Tier.DEVICE else Tier.DEVICE
        pool.move(np.asarray([lid]), to, eng.clock(), "bench")

    out["blockmap_1m_after_migration"] = _frames(frame_big, 30, before=migrate)
    say(f"[ui-bench] the same, a migration before each frame: {_ms(out['blockmap_1m_after_migration'])}")
    bm.close()
    del eng

    say(f"[ui-bench] full refresh of every panel at {medium:,} blocks…")
    eng, n_seqs, _ = filled_engine(medium)
    _two_minutes_of_history(eng)
    runner = EngineRunner(eng)  # not started: the engine holds still while panels are timed
    win = MainWindow(runner, confirm_lossy=lambda d: True)
    win.timer.stop()
    win.show()
    app.processEvents()
    first = max(eng.seqs)
    win.select_sequence(first)

    # A refresh repaints what it changed: every data panel (the map, plots, tables, status bar), not the
    # static controls. Each is rendered into its own reused image, as Qt paints dirty widgets into the
    # window's backing store.
    # (The residency dock is a tab behind Heat: nothing of it is on screen, so Qt would not paint it.)
    panels = [w for w in (win.block_map, win.hit, win.memory, win.heat, win.residency, win.seqs, win.events,
                          win.statusBar()) if not w.visibleRegion().isEmpty()]
    say(f"[ui-bench] panels on screen: {', '.join(type(w).__name__ for w in panels)}")
    from PySide6 import QtGui

    images = [QtGui.QImage(w.size(), QtGui.QImage.Format_ARGB32_Premultiplied) for w in panels]

    def frame_full() -> None:
        win.refresh(every_panel=True)
        for w, img in zip(panels, images):
            w.render(img)

    frame_full()
    out["full_refresh_100k"] = {"blocks": medium, "sequences": n_seqs,
                                "panels": [type(w).__name__ for w in panels], **_frames(frame_full, 20)}
    say(f"[ui-bench] full refresh of every panel at {medium:,} blocks ({n_seqs} sequences): "
        f"{_ms(out['full_refresh_100k'])} (goal ≤ 16 ms)")
    win.close()
    del eng, runner

    say(f"[ui-bench] event-loop stalls over {stall_s:g} s of demo workload on the default model…")
    import argparse

    from app.window.launch import start_runner

    args = argparse.Namespace(model=None, device="cpu", no_workload=False, seed=0, context_limit=None, n_keep=0,
                              **{k: None for k in ("block_size", "kv_dtype", "device_budget_mb", "host_budget_mb",
                                                   "policy", "decay", "demote_after_s", "prefetch_depth",
                                                   "evict_batch")})
    runner = start_runner(args)
    win = MainWindow(runner, confirm_lossy=lambda d: True)
    win.show()
    gaps: list[float] = []
    last = [time.perf_counter()]

    def tick() -> None:
        now = time.perf_counter()
        gaps.append(1e3 * (now - last[0]))
        last[0] = now

    probe = QtCore.QTimer()
    probe.setTimerType(QtCore.Qt.PreciseTimer)
    probe.timeout.connect(tick)
    probe.start(5)
    steps0 = runner.steps
    QtCore.QTimer.singleShot(int(stall_s * 1000), app.quit)
    app.exec()
    probe.stop()
    win.close()
    runner.stop()
    g = np.asarray(gaps[5:])  # the first ticks include window start-up
    stall = g - 5.0
    out["event_loop"] = {"seconds": stall_s, "ticks": int(len(g)), "engine_steps": runner.steps - steps0,
                         "tokens_per_s": runner.engine.counters.generated / stall_s,
                         "ui_fps": win.fps, "max_stall_ms": float(stall.max()),
                         "p99_stall_ms": float(np.percentile(stall, 99)), "median_gap_ms": float(np.median(g))}
    ev = out["event_loop"]
    say(f"[ui-bench] event loop over {stall_s:g} s ({ev['engine_steps']} engine steps, {ev['tokens_per_s']:.1f} tok/s, "
        f"UI {ev['ui_fps']:.0f} fps): max stall {ev['max_stall_ms']:.1f} ms, p99 {ev['p99_stall_ms']:.1f} ms "
        f"(goal < 50 ms)")
    return out
