"""The attach window: the caches of running vLLM / SGLang servers, drawn from their KV events and /metrics.

Centre: what events cannot tell (said plainly), then the block map, one framed grid per endpoint × rank ×
medium. Docks: metrics (hit rate, usage, preemptions, residency histograms), sources (stream health: gaps,
replays, malformed frames) and events. Network threads never touch a widget: they write to the session's
Qt-free state, and a QTimer on this thread pulls a snapshot each frame (100 ms), the slower panels every
fifth frame.
"""

from __future__ import annotations

import gc

import html
import time
from collections import deque

from PySide6 import QtCore, QtGui, QtWidgets

from engine.attach.session import LIMITS, Frame
from ui import dock_layout
from ui.attach.block_map import AttachMap, meta_lines
from ui.attach.panels import AttachEventsPanel, MetricsPanel, SourcesPanel, behind_text, traffic_lines
from ui.attach.restores import RestoresPanel

REFRESH_MS = 100
WANT_SIZE = QtCore.QSize(1400, 900)  # on a screen with room for it; a smaller one gets all of its free area
SLOW_EVERY = 5
# Each panel other than the map has its own frame of every SLOW_EVERY, so no frame pays for two: 0 the slow
# frame (the session's costlier per-group numbers), 1 the metrics charts, 2 the sources table and the status
# line (one frame's numbers, so their counts agree), 3 the metrics table. A scrape's metrics (once a second)
# wait for their slot: at most 0.4 s.


def _short_hash(h) -> str:
    if isinstance(h, bytes):
        return h[:8].hex() + "…"
    if isinstance(h, int):
        return f"{h & ((1 << 64) - 1):016x}"
    return str(h)[:16]


def _age(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


class AttachWindow(QtWidgets.QMainWindow):
    def __init__(self, session, tokens=None, owns_session: bool = False, mode: str = "age",
                 refresh_ms: int = REFRESH_MS):
        """session: an AttachSession or an AttachClient (the same frame API; see engine/attach/session.py)."""
        super().__init__()
        self.session, self.tokens, self.owns_session = session, tokens, owns_session
        self.setWindowTitle("KV Scope — attached: " + ", ".join(s.label for s in session.specs) if session.specs
                            else "KV Scope — attached (metrics only)")
        self.frames = 0
        self._metrics_charts = self._metrics_table = None  # the latest frame with metrics not shown yet
        self.frame_ms: deque[float] = deque(maxlen=100_000)  # wall time of each refresh (bench, status bar)
        self._last_traffic = time.monotonic()
        self._activity: tuple = ()
        self._capacities: dict[int, int] = {}
        self.last_frame: Frame | None = None
        self._fps_t, self._fps_n, self.fps = time.monotonic(), 0, 0.0

        self.banner = QtWidgets.QLabel("<b>What the events cannot tell</b> — " + " ".join(LIMITS))
        self.banner.setWordWrap(True)
        self.banner.setObjectName("attachLimits")
        self.banner.setStyleSheet("QLabel#attachLimits { color: #e6c07b; padding: 4px 6px; }")
        self.map = AttachMap(mode=mode)
        self.map.info_fn = session.block_info
        self.map.describe_fn = self.describe_block
        self.map.capacity_fn = self._capacity
        if tokens is not None:
            self.map.decode_fn = tokens.decode
        central = QtWidgets.QWidget()
        lay = QtWidgets.QVBoxLayout(central)
        lay.setContentsMargins(2, 2, 2, 2)
        lay.addWidget(self.banner)
        lay.addWidget(self.map, 1)
        self.setCentralWidget(central)

        self.metrics = MetricsPanel(list(session.metrics_labels))
        self.sources = SourcesPanel()
        self.events = AttachEventsPanel()
        self.restores = RestoresPanel()
        self.docks = {}
        for name, w, area in (("Metrics", self.metrics, QtCore.Qt.RightDockWidgetArea),
                              ("Sources", self.sources, QtCore.Qt.BottomDockWidgetArea),
                              ("Events", self.events, QtCore.Qt.BottomDockWidgetArea),
                              ("Re-stores", self.restores, QtCore.Qt.BottomDockWidgetArea)):
            d = QtWidgets.QDockWidget(name, self)
            d.setObjectName(f"attach-{name}")
            d.setWidget(w)
            self.addDockWidget(area, d)
            self.docks[name] = d
        self.tabifyDockWidget(self.docks["Events"], self.docks["Re-stores"])
        self.docks["Events"].raise_()
        self.status = QtWidgets.QLabel()
        # Its text changes every half second: with a size hint that followed the text, each change re-laid out
        # the main window and repainted much of it (5 ms a frame in the soak); the bar's height stays as it is.
        self.status.setSizePolicy(QtWidgets.QSizePolicy.Ignored, QtWidgets.QSizePolicy.Fixed)
        self.status.setToolTip("Counted at the Sources table's last update (2 a second), from the same frame: "
                               "events applied is the sum of its events column; blocks resident the sum over the "
                               "maps (whose titles update every frame, so while events flow they may be ahead)")
        self.statusBar().addWidget(self.status, 1)
        file = self.menuBar().addMenu("&File")
        file.addAction("Save &screenshot…", self._save_dialog)
        if session.recording:
            file.addAction("Save &recording…", self._record_dialog)
        file.addSeparator()
        close = QtGui.QAction("&Close", self)
        close.setShortcut(QtGui.QKeySequence.Close)  # Ctrl+W
        close.triggered.connect(self.close)
        file.addAction(close)
        # Ctrl+Q as in the main window: `kvscope attach` ends with its window; opened by File > Attach, only
        # this window closes.
        quit_ = QtGui.QAction("&Quit", self)
        quit_.setShortcut(QtGui.QKeySequence("Ctrl+Q"))
        quit_.triggered.connect(self.close)
        file.addAction(quit_)
        view = self.menuBar().addMenu("&View")
        for d in self.docks.values():
            view.addAction(d.toggleViewAction())
        view.addAction("Reset map view", self.map.reset_view)
        self.resize(WANT_SIZE)  # headless (offscreen): this size; on a screen show_fitted fits it
        self.resizeDocks([self.docks["Metrics"]], [430], QtCore.Qt.Horizontal)
        self.resizeDocks([self.docks["Sources"]], [170], QtCore.Qt.Vertical)
        self.resizeDocks([self.docks["Sources"]], [370], QtCore.Qt.Horizontal)  # its columns; Events gets the rest
        self.timer = QtCore.QTimer(self)
        self.timer.timeout.connect(self.refresh)
        self.timer.start(refresh_ms)
        # Everything built so far lives as long as the window: out of the collector's sight, so a full collection
        # (which otherwise walks Qt wrappers, numpy buffers and the session) cannot stall a frame.
        gc.collect()
        gc.freeze()

    def show_fitted(self) -> None:
        """Show the window as the main window shows itself (ui/dock_layout.fitted_geometry): WANT_SIZE centred on
        the free area of its screen where that fits with room for a title bar, else all of that area, maximized."""
        screen = self.screen() or QtGui.QGuiApplication.primaryScreen()
        rect, maximize = dock_layout.fitted_geometry(screen.availableGeometry(), WANT_SIZE)
        self.setGeometry(rect)
        self.resizeDocks([self.docks["Metrics"]], [min(430, rect.width() // 3)], QtCore.Qt.Horizontal)
        self.resizeDocks([self.docks["Sources"]], [min(170, rect.height() // 4)], QtCore.Qt.Vertical)
        self.resizeDocks([self.docks["Sources"]], [min(370, rect.width() // 3)], QtCore.Qt.Horizontal)
        if maximize:
            self.showMaximized()
        else:
            self.show()

    # -- frames -----------------------------------------------------------------------------------------
    def refresh(self, every_panel: bool = False) -> None:
        t0 = time.perf_counter()
        slot = self.frames % SLOW_EVERY
        fr = self.session.frame(self.map.mode(), slow=every_panel or slot == 0)
        self.last_frame = fr
        snap = fr.snap
        self._capacities = fr.capacities
        if snap.mode == self.map.mode():  # a pipelined frame asked before a mode change waits a frame
            self.map.set_snapshot(snap)
        self.events.add_lines(list(fr.notes))
        now = time.monotonic()
        if len(self._activity) != len(snap.activity):
            self._activity = snap.activity
        if now - self._last_traffic >= 1.0 or every_panel:
            self.events.add_lines(traffic_lines(self.session.labels, self._activity, snap.activity))
            self._activity, self._last_traffic = snap.activity, now
        if fr.metrics is not None:  # a scrape's worth (once a second): shown at the next charts / table slot
            self._metrics_charts = self._metrics_table = fr
        m = self._metrics_charts
        if m is not None and (every_panel or slot == 1):
            self.metrics.update_charts(time.time(), [x.history for x in m.metrics],
                                       m.metrics[0].interval_s if m.metrics else 1.0)
            self._metrics_charts = None
        m = self._metrics_table
        if m is not None and (every_panel or slot == 3):
            self.metrics.update_table([x.latest for x in m.metrics], [x.error for x in m.metrics],
                                      m.event_times or {})
            self._metrics_table = None
        if every_panel or slot == 0:  # the slow frame carries the per-cache re-store summaries
            self.restores.update_groups(snap.groups)
        if every_panel or slot == 2:  # from the same frame: the status line's totals are the table's sums
            self.sources.update_status(list(fr.statuses), [a.events for a in snap.activity],
                                       [a.bad_events for a in snap.activity])
            self._update_status(snap)
        self.frames += 1
        self._fps_n += 1
        if now - self._fps_t >= 1.0:
            self.fps, self._fps_t, self._fps_n = self._fps_n / (now - self._fps_t), now, 0
        self.frame_ms.append(1e3 * (time.perf_counter() - t0))

    def _update_status(self, snap) -> None:
        ev = sum(a.events for a in snap.activity)
        resident = sum(g.resident for g in snap.groups)
        last = self.frame_ms[-1] if self.frame_ms else 0.0
        statuses = self.last_frame.statuses if self.last_frame is not None else ()
        late = [f"{s.label} {behind_text(s)}" for s in statuses
                if s.behind_s >= 2.0 or (s.shed_age_s is not None and s.shed_age_s < 10.0)]
        self.status.setText(f"{len(self.session.specs)} endpoint(s), {len(snap.groups)} cache(s), "
                            f"{resident:,} blocks resident, {ev:,} events applied   |   "
                            f"UI {self.fps:.0f} fps, frame {last:.1f} ms"
                            + ("   |   BEHIND: " + "; ".join(late[:3]) if late else ""))

    def refresh_all(self) -> None:
        self.refresh(every_panel=True)

    # -- tooltips -----------------------------------------------------------------------------------------
    def _text(self, ids: list[int]) -> str:
        if self.tokens is None:
            return " ".join(map(str, ids))
        return repr(self.tokens.decode(ids))

    def describe_block(self, info: dict) -> str:
        depth = info["depth"]
        lines = [f"hash {_short_hash(info['hash'])}" + (f" (parent {_short_hash(info['parent'])})"
                                                         if info["parent"] is not None else ""),
                 f"stored {_age(info['age_s'])} ago, last touched {_age(info['idle_s'])} ago",
                 f"heat {info['heat']:.3g}; named as a parent {info['named']}×",
                 f"depth {depth}" if depth >= 0 else "depth unknown (the chain above was never seen)",
                 f"family {info['family']}" + (f": {html.escape(self._text(info['family_tokens']))}"
                                               if info.get("family_tokens") else ""),
                 f"tokens (block size {info['block_size']}; the first {len(info['tokens'])}): "
                 + (html.escape(self._text(info["tokens"])) if info["tokens"] else "none in the event")]
        if info["path_tokens"]:
            path = [t for blk in info["path_tokens"] for t in blk]
            lines.append(f"the {len(info['path_tokens'])} block(s) above (first tokens of each): "
                         + html.escape(self._text(path)))
        lines += meta_lines(info)
        lines.append("<i>slot, owner request and ref count: not in the events</i>")
        return "<br>".join(lines)

    def _capacity(self, key) -> int | None:
        """num_gpu_blocks from the source's /metrics (given with it, or the only one on its host)."""
        return self._capacities.get(key[0]) if key[2] == "GPU" else None

    # -- files ------------------------------------------------------------------------------------------
    def save_screenshot(self, path: str) -> None:
        self.refresh_all()
        if not self.grab().save(path):
            raise OSError(f"{path}: cannot write the PNG")

    def _save_dialog(self) -> None:
        path, _ = QtWidgets.QFileDialog.getSaveFileName(self, "Save screenshot", "kvscope-attach.png", "PNG (*.png)")
        if path:
            self._try(lambda: self.save_screenshot(path), f"saved {path}")

    def _record_dialog(self) -> None:
        path, _ = QtWidgets.QFileDialog.getSaveFileName(self, "Save recording", "attach-trace.npz", "Trace (*.npz)")
        if path:
            self._try(lambda: self.session.save_recording(path), f"saved {path} (kvscope policy-lab {path})")

    def _try(self, fn, ok: str) -> None:
        try:
            fn()
            self.statusBar().showMessage(ok, 8000)
        except (OSError, ValueError) as e:
            QtWidgets.QMessageBox.warning(self, "KV Scope", str(e))

    def closeEvent(self, ev) -> None:
        self.timer.stop()
        if self.owns_session:
            self.session.stop()
        super().closeEvent(ev)
