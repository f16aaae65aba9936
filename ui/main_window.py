"""The inspector window: dockable panels around the block map, refreshed from snapshots on a timer."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import math
import os
import time

import numpy as np
from PySide6 import QtCore, QtGui, QtWidgets

from engine.telemetry import snapshot_io
from engine.errors import ConfigError, RequestError
from engine.telemetry.health import HealthTargets
from engine.telemetry.snapshot import Snapshot
from engine.telemetry.snapshotter import SERIES_LEN
from ui import dock_layout
from ui.block_map.groups import GroupMaps
from ui.controller import Controller, SnapshotController
from ui.panels.controls import ControlsPanel
from ui.panels.lists import EventsPanel, SequencesPanel
from ui.panels.cost import CostPanel
from ui.panels.why_missed import WhyMissedPanel
from ui.panels.diagnostics import DiagnosticsPanel
from ui.panels.health import HealthStrip
from ui.panels.charts import HeatPanel, HitRatePanel, MemoryPanel, ResidencyPanel
from ui.panels.prompt import PromptPanel
from ui.panels.what_if import WhatIfPanel
from ui.charts.prediction import PREDICTED_KNOBS, Prediction
from ui.charts.rates import RateHistory

REFRESH_MS = 66  # ~15 Hz: the engine steps at 10-50 Hz on a CPU, plots need no more
SLOW_EVERY = 5  # plots refresh at 6 Hz, tables and histograms at 3 Hz
STATE_VERSION = 5  # dock layouts saved by older versions (another arrangement) are not restored


class MainWindow(QtWidgets.QMainWindow):
    def __init__(self, controller: Controller, settings: QtCore.QSettings | None = None, confirm_lossy=None):
        super().__init__()
        self.controller = controller
        self.settings = settings
        self.setWindowTitle("KV Scope" + (" — saved snapshot (read-only)" if controller.read_only else ""))
        self.setDockOptions(QtWidgets.QMainWindow.AllowNestedDocks | QtWidgets.QMainWindow.AllowTabbedDocks)
        self.selected = -1
        self.frames = 0
        self.fps = 0.0
        self._fps_t = time.perf_counter()
        self._fps_n = 0
        self.snapshot: Snapshot | None = None
        self._last_evictions = None
        # The What if tab's prediction for the device-budget change applied last (ui/charts/prediction.py), kept
        # until a newer change; _change_n: the number of the last change seen (Snapshot.last_change["n"]);
        # _stale: the tab's prediction once another knob changed (it reran the trace with the knobs recorded).
        self.prediction: Prediction | None = None
        self._change_n: int | None = None
        self._stale = None

        central = QtWidgets.QWidget()
        cl = QtWidgets.QVBoxLayout(central)
        cl.setContentsMargins(2, 2, 2, 2)
        bar = QtWidgets.QHBoxLayout()
        self.reset_view = QtWidgets.QPushButton("Reset view")
        bar.addWidget(self.reset_view)
        bar.addStretch(1)
        self.selection = QtWidgets.QLabel("click a block or a row to select a sequence")
        bar.addWidget(self.selection)
        cl.addLayout(bar)
        # One map per KV-cache group (ui/block_map/groups.py); block_map: the first group's (or the one pool's).
        self.maps = GroupMaps()
        self.block_map = self.maps.primary
        cl.addWidget(self.maps, 1)
        self.setCentralWidget(central)

        # The charts' and the status bar's rates, from every snapshot; a saved snapshot's, as its window drew them.
        self.rates = getattr(controller, "rates", None) or EngineClockRates(RateHistory())
        self.controls = ControlsPanel(controller, confirm_lossy)
        self.hit = HitRatePanel(self.rates)
        self.memory = MemoryPanel()
        self.heat = HeatPanel()
        self.residency = ResidencyPanel()
        self.cost = CostPanel()
        self.why = WhyMissedPanel()
        self.diagnostics = DiagnosticsPanel()
        self.seqs = SequencesPanel()
        self.events = EventsPanel()
        self.prompt = PromptPanel()
        # The what-if curves (app/whatif/worker.py computes them from the live engine's trace; none for a snapshot)
        self.what_if = WhatIfPanel(controller.what_if() if hasattr(controller, "what_if") else None)
        # The controls scroll when the window is too short for all of them, instead of painting over the
        # prompt below.
        scroll = QtWidgets.QScrollArea()
        scroll.setWidget(self.controls)
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QtWidgets.QFrame.NoFrame)
        scroll.setHorizontalScrollBarPolicy(QtCore.Qt.ScrollBarAlwaysOff)
        scroll.setMinimumWidth(self.controls.minimumSizeHint().width() + 12)  # room for the scroll bar
        widgets = {"Controls": scroll, "Prompt": self.prompt, "Sequences": self.seqs, "Events": self.events,
                   "Hit rate": self.hit, "Memory": self.memory, "Heat": self.heat, "Residency": self.residency,
                   "Cost": self.cost, "Why missed": self.why, "Diagnostics": self.diagnostics,
                   "What if": self.what_if}
        self.docks = {}
        for name, _ in dock_layout.DOCK_AREAS:
            d = QtWidgets.QDockWidget(name, self)
            d.setObjectName(f"dock-{name}")
            d.setWidget(widgets[name])
            self.docks[name] = d
        # The health strip (ui/panels/health.py) at the top, in the menu bar's row right of the menus: it takes no
        # height from the docks (a toolbar of its own pushed the controls into scrolling at 1280 x 720).
        self.health = HealthStrip(self.controls.targets)
        self.menuBar().setCornerWidget(self.health, QtCore.Qt.TopRightCorner)
        self.health.linkActivated.connect(self.show_health_link)
        self.controls.targetsChanged.connect(self._targets)
        self.resize(dock_layout.DEFAULT_SIZE)
        self.reset_layout()
        # Hidden tabs are not refreshed; one brought to the front is filled at once.
        for name, panel in (("Heat", self.heat), ("Residency", self.residency), ("Cost", self.cost),
                            ("Why missed", self.why), ("Diagnostics", self.diagnostics)):
            self.docks[name].visibilityChanged.connect(
                lambda shown, panel=panel: shown and self.snapshot is not None and panel.update_snapshot(self.snapshot))

        self._menus()
        self.status = QtWidgets.QLabel()
        self.status.setSizePolicy(QtWidgets.QSizePolicy.Ignored, QtWidgets.QSizePolicy.Fixed)
        self.status.setToolTip(
            "tok/s: tokens generated per second over the last 5 s, all sequences; device hit: keys attention "
            "read from blocks already on the device tier / all keys read; prefix hit: prompt tokens reused from the prefix "
            "cache / all prompt tokens (both since the engine started; — before there are any); last, if any, each "
            "self-check that failed (an accelerated path that disagreed with its reference and is no longer used)")
        self.statusBar().addWidget(self.status, 1)
        self.reset_view.clicked.connect(self.block_map.reset_view)
        self.block_map.sequenceSelected.connect(self.select_sequence)
        self.maps.sequenceSelected.connect(self.select_sequence)
        self.seqs.sequenceSelected.connect(self.select_sequence)
        self.prompt.submitted.connect(self.submit_prompt)
        if controller.read_only:
            self.prompt.setEnabled(False)
        self._restored = False  # a saved geometry and dock layout were restored
        if settings is not None:
            geo, state = settings.value("geometry"), settings.value("state")
            if geo is not None and state is not None:
                self._restored = self.restoreGeometry(geo) and self.restoreState(state, STATE_VERSION)
        self.controls.refused.connect(self.events.add_local)
        self.timer = QtCore.QTimer(self)
        self.timer.timeout.connect(self.refresh)
        self.timer.start(REFRESH_MS)
        self.refresh()

    def _menus(self) -> None:
        file = self.menuBar().addMenu("&File")
        act = QtGui.QAction("Save &screenshot…", self)
        act.setShortcut(QtGui.QKeySequence("Ctrl+Shift+S"))
        act.triggered.connect(self._save_dialog)
        file.addAction(act)
        file.addAction("Open snapshot…", self._open_dialog)
        file.addAction("Compare…", self._compare_dialog)
        from ui.attach.dialog import open_attach_window  # File > Attach…: vLLM / SGLang servers, read-only

        file.addAction("&Attach to vLLM / SGLang…", lambda: open_attach_window(self))
        file.addSeparator()
        quit_ = QtGui.QAction("&Quit", self)
        quit_.setShortcut(QtGui.QKeySequence("Ctrl+Q"))
        quit_.triggered.connect(self.close)
        file.addAction(quit_)
        view = self.menuBar().addMenu("&View")
        for d in self.docks.values():
            view.addAction(d.toggleViewAction())
        view.addSeparator()
        view.addAction("&Reset layout", self.reset_layout)
        from ui.help_dialog import add_help_menu  # Help: the topics `kvscope help TOPIC` prints

        add_help_menu(self)

    # -- layout ---------------------------------------------------------------------------------
    def reset_layout(self) -> None:
        """Every dock back in its place, shown and docked, sized for the window's present size."""
        dock_layout.arrange(self)

    def size_docks(self) -> None:
        dock_layout.share(self)

    def show_fitted(self) -> None:
        """Show the window on its screen: where it was last time if that still fits the screen, else fitted
        to the screen's free area (maximized when the default size does not fit)."""
        screen = self.screen() or QtGui.QGuiApplication.primaryScreen()
        avail = screen.availableGeometry()
        if self._restored and avail.contains(self.geometry()):
            self.show()
            return
        rect, maximize = dock_layout.fitted_geometry(avail)
        self.setGeometry(rect)
        self.size_docks()  # sizes saved for another screen (or none) are shared out afresh
        if maximize:
            self.showMaximized()
            # With no window manager to hold a maximized window to the screen (Xvfb, some kiosk set-ups), Qt may
            # grow it to its docks' preferred heights: put it back on the screen once the show has settled.
            QtCore.QTimer.singleShot(0, lambda: self._hold_to(avail))
        else:
            self.show()

    def _hold_to(self, avail: QtCore.QRect) -> None:
        if not avail.contains(self.geometry()):
            self.setGeometry(avail)
            self.size_docks()

    # -- refresh ------------------------------------------------------------------------------
    def refresh_all(self) -> None:
        """Refresh every panel now (screenshots, selection, tests)."""
        self.refresh(every_panel=True)

    def refresh(self, every_panel: bool = False, snap: Snapshot | None = None) -> None:
        """snap: draw this one (a screenshot draws and saves the same snapshot); by default the controller's now."""
        if snap is None:
            tables = {self.selected} if self.selected >= 0 else set()
            snap = self.controller.snapshot(tables, wait=every_panel or self.snapshot is None)
        self.snapshot = snap
        if not self.controller.read_only:
            # Wall time, not the snapshot's (the engine's clock stands still while it is paused, and a rate
            # must fall to 0 then).
            self.rates.observe(time.monotonic(), snap.counters, snap.t)
        self.maps.set_snapshot(snap)
        # The other panels take turns, so a frame repaints the map and one or two panels, not all.
        slot = self.frames % SLOW_EVERY
        if every_panel:
            self.hit.update_snapshot(snap)
            self.memory.update_snapshot(snap)
        elif slot in (0, 2):
            self.hit.update_snapshot(snap, "rates" if slot == 0 else "flow")
        elif slot in (1, 3):
            self.memory.update_snapshot(snap, "tiers" if slot == 1 else "process")
        if not every_panel and slot not in (1, 3) and self._on_screen(self.memory):
            self.memory.update_text(snap)  # its tier rows in step with the map (nothing done where they are unchanged)
        if every_panel or slot == 4:
            # Tabbed docks share a place; only the one on top is drawn, so only it is updated.
            for panel in (self.heat, self.residency, self.cost, self.why, self.diagnostics):
                if self._on_screen(panel):
                    panel.update_snapshot(snap)
        if every_panel or slot == 0:
            self.health.update_snapshot(snap)
            paused = not self.controller.read_only and self.controller.engine_paused
            self.seqs.update_snapshot(snap, engine_paused=paused)
            self.prompt.update_snapshot(snap.seqs, engine_paused=paused)
        if not self.controller.read_only:
            self.events.add(self.controller.take_events())
            ev = snap.counters["evictions"]
            if self._last_evictions is not None:
                self.events.add_evictions(ev - self._last_evictions)
            self._last_evictions = ev
            self.prompt.stream(self.controller.take_tokens())
            self._follow_prediction(snap)  # after the engine's events: its config line comes first in the log
        self.frames += 1
        self._fps_n += 1
        now = time.perf_counter()
        if now - self._fps_t >= 1.0:
            self.fps = self._fps_n / (now - self._fps_t)
            self._fps_t, self._fps_n = now, 0
        self._status(snap)

    # -- the What if tab's prediction, against what the applied change gave -------------------------------
    def configured_prediction(self):
        """The What if tab's prediction of the engine as configured (ConfiguredPrediction), or None."""
        return next((r.configured for r in self.what_if.results if getattr(r, "configured", None) is not None),
                    None)

    def _follow_prediction(self, snap: Snapshot) -> None:
        """A change applied since the last snapshot (Snapshot.last_change, whichever way it was made: a control, a
        preset, Reset): a device-budget change alone, with the What if tab holding a prediction, gets it read at the
        new device-tier capacity and marked on the hit-rate chart; any other change ends the mark shown. Each
        snapshot measures the mark's rates since the change."""
        last = snap.last_change or {}
        n = int(last.get("n", 0) or 0)
        if self._change_n is None or n == self._change_n:  # (the first snapshot: a change from before the window)
            self._change_n = n
            if self.prediction is not None and self.prediction.measure(snap.counters):
                self.hit.show_prediction(snap.t)
            return
        self._change_n = n
        old = self.prediction
        if old is not None:  # ended by this change: measured up to it, from the counters the engine kept then
            old.measure(last.get("counters", snap.counters))
            self.events.add_local("config_whatif", old.outcome_line())
        self.prediction = None
        configured = self.configured_prediction()
        changes = set(last.get("changes", {}))
        budget_only = bool(changes) and changes <= PREDICTED_KNOBS
        capacity = next((int(t.capacity) for t in snap.tiers if t.name == "device"), None)
        if configured is not None and not budget_only:
            self._stale = configured  # rerun with knobs the engine no longer has
        elif configured is not None and (configured is self._stale or capacity is None):
            self.events.add_local("config_whatif", f"no What-if prediction for #{n}: a knob other than the device "
                                  "budget changed since the What if tab's trace was recorded (record it again)")
        elif configured is not None:
            self.prediction = Prediction.of(configured, last, capacity)
            self.prediction.measure(snap.counters)
            self.events.add_local("config_whatif", self.prediction.log_line())
        self.hit.set_prediction(self.prediction, snap.t)

    def front_tabs(self) -> list[str]:
        """The tabbed docks whose tab is in front (a screenshot's JSON reopens with the same ones)."""
        return [name for name in TABBED if not self.docks[name].widget().visibleRegion().isEmpty()]

    def _on_screen(self, panel: QtWidgets.QWidget) -> bool:
        """Whether any of the panel shows (a dock tabbed behind another does not); before the window is
        shown every panel counts, so tests and screenshots see them filled."""
        return not self.isVisible() or not panel.visibleRegion().isEmpty()

    def _status(self, snap: Snapshot) -> None:
        c = snap.counters
        cfg = snap.config
        state = "read-only snapshot" if self.controller.read_only else (
            "engine paused" if self.controller.engine_paused else "running")
        # Live: the window's own 5 s rate, which falls to 0 while nothing is generated (the engine's is only
        # updated when it steps). A saved snapshot: the saved window's, or the engine's in a file without them.
        tps = snap.windowed.get("tokens_per_s", math.nan) if isinstance(self.rates, EngineClockRates) and \
            self.controller.read_only else self.rates.latest()["tokens_per_s"]
        dev = 1 - c["read_tokens_missed"] / c["read_tokens"] if c.get("read_tokens") else math.nan
        pre = c["prompt_reused"] / c["prompt_tokens"] if c.get("prompt_tokens") else math.nan
        self.status.setText(
            f"{snap.model['name']} on {snap.model['device']} | bs={cfg['block_size']} {cfg['kv_dtype']} "
            f"dev {cfg['device_budget_mb']:g} MiB host {cfg['host_budget_mb']:g} MiB {cfg['policy']} "
            f"decay {cfg['decay']:g} demote>{cfg['demote_after_s']:g}s | {_num(tps, '.1f')} tok/s | "
            f"device hit {_num(dev, '.3f')} prefix hit {_num(pre, '.3f')} | UI {self.fps:.0f} fps | {state}" +
            "".join(f" | ⚠ {c['message']}" for c in snap.self_checks.values() if c.get("state") == "failed"))

    def caption(self, when: datetime.datetime | None = None) -> str:
        """The screenshot's caption: model, config, and when it was captured (now, or `when`); a saved snapshot's
        is the one it was saved with (its capture time, not the time it was reopened)."""
        saved = getattr(self.controller, "extra", {}).get("caption") if self.controller.read_only else None
        if saved:
            return saved
        snap = self.snapshot
        cfg = snap.config
        when = "capture time not saved" if self.controller.read_only else \
            (when or datetime.datetime.now()).strftime("%Y-%m-%d %H:%M:%S")
        return (f"KV Scope — {snap.model['name']} on {snap.model['device']} — bs={cfg['block_size']} "
                f"{cfg['kv_dtype']} device {cfg['device_budget_mb']:g} MiB host {cfg['host_budget_mb']:g} MiB "
                f"policy {cfg['policy']} decay {cfg['decay']:g} demote>{cfg['demote_after_s']:g}s prefetch "
                f"{cfg['prefetch_depth']} batch {cfg['evict_batch']} — {when}")

    # -- health ---------------------------------------------------------------------------------
    def show_health_link(self, name: str) -> None:
        """A health chip was clicked: the panel that explains its figure (utilization: the block map in fill mode)."""
        if name == "block_utilization":
            self.maps.set_mode("fill")
            return
        dock = self.docks["Hit rate" if name == "prefix_hit_rate" else "Diagnostics"]
        dock.show()
        dock.raise_()

    def _targets(self, targets) -> None:
        self.health.set_targets(targets)

    # -- selection and prompts ----------------------------------------------------------------
    def select_sequence(self, sid: int) -> None:
        self.selected = sid
        self.maps.set_selected(sid)
        self.seqs.select_id(sid)
        self.selection.setText(f"selected sequence {sid}" if sid >= 0 else "no sequence selected")
        self.refresh_all()

    def submit_prompt(self, text: str, chat: bool, max_new: int) -> None:
        try:
            sid = self.controller.submit_prompt(text, chat, max_new)
        except (RequestError, ConfigError) as e:
            self.prompt.error(str(e))
            return
        self.prompt.started(sid, text)
        self.select_sequence(sid)

    # -- screenshots ----------------------------------------------------------------------------
    def save_screenshot(self, png_path: str) -> str:
        """Write the window as PNG with a caption strip, and beside it as JSON the snapshot drawn in it (every
        block table), with what the window drew that a snapshot does not hold: the rates' lines, the events, the
        caption, the workload. `--open-snapshot` draws the same picture from it."""
        snap = self.with_what_if(self.controller.snapshot("all"))
        self.refresh(every_panel=True, snap=snap)
        caption = self.caption(datetime.datetime.now())
        shot = self.grab().toImage()
        cap_h = 26
        img = QtGui.QImage(shot.width(), shot.height() + cap_h, QtGui.QImage.Format_ARGB32)
        img.fill(QtGui.QColor("#0d0f12"))
        p = QtGui.QPainter(img)
        p.drawImage(0, 0, shot)
        p.setPen(QtGui.QColor("#e0e0e0"))
        f = p.font()
        f.setPointSize(10)
        p.setFont(f)
        p.drawText(QtCore.QRect(8, shot.height(), shot.width() - 16, cap_h), QtCore.Qt.AlignVCenter, caption)
        p.end()
        if not img.save(png_path, "PNG"):
            raise OSError(f"cannot write {png_path}")
        json_path = os.path.splitext(png_path)[0] + ".json"
        # The events shown (the newest EVENTS_SAVED), so the file opens with its Events panel as it was.
        lines = [[float(t), str(k), str(f)] for t, k, f in self.events.events[-EVENTS_SAVED:]]
        rates = {k: np.asarray(v, dtype=np.float64) for k, v in self.hit.drawn.items()}
        snapshot_io.save(json_path, snap, extra={"caption": caption, "png": os.path.basename(png_path),
                                                 "colour_mode": self.block_map.mode(), "selected": self.selected,
                                                 "events": lines, "rates": rates,
                                                 "workload": self.controller.workload_name(),
                                                 "tabs": self.front_tabs(),
                                                 "health_targets": self.controls.targets.as_dict()})
        return json_path

    def with_what_if(self, snap: Snapshot) -> Snapshot:
        """`snap` with the What if tab's curves (Snapshot.what_if), so they travel in the file and compare."""
        saved = self.what_if.saved()
        return dataclasses.replace(snap, what_if=saved) if saved else snap

    def _save_dialog(self) -> None:
        path, _ = QtWidgets.QFileDialog.getSaveFileName(self, "Save screenshot", "kvscope.png", "PNG (*.png)")
        if path:
            try:
                self.statusBar().showMessage(f"saved {path} and {self.save_screenshot(path)}", 5000)
            except OSError as e:
                QtWidgets.QMessageBox.warning(self, "Screenshot", str(e))

    def _open_dialog(self) -> None:
        path, _ = QtWidgets.QFileDialog.getOpenFileName(self, "Open snapshot", "", "KV Scope snapshot (*.json)")
        if path:
            try:
                win = open_snapshot_window(path)
            except snapshot_io.SnapshotFileError as e:
                QtWidgets.QMessageBox.warning(self, "Open snapshot", str(e))
                return
            win.show()
            self._children = getattr(self, "_children", []) + [win]

    def _compare_dialog(self) -> None:
        """Two snapshot files side by side; one file: it (A) beside what this window shows now (B)."""
        paths, _ = QtWidgets.QFileDialog.getOpenFileNames(self, "Compare snapshots (one: with this window's)", "",
                                                          "KV Scope snapshot (*.json)")
        if not paths:
            return
        if len(paths) > 2:
            QtWidgets.QMessageBox.warning(self, "Compare", f"{len(paths)} files chosen: choose one or two")
            return
        try:
            win = self.compare_with(paths)
        except snapshot_io.SnapshotFileError as e:
            QtWidgets.QMessageBox.warning(self, "Compare", str(e))
            return
        win.show()
        self._children = getattr(self, "_children", []) + [win]

    def compare_with(self, paths: list[str]):
        """The compare window (ui/compare.py) on two files, or on one file and this window's snapshot (B: now)."""
        import os

        from ui.compare import CompareWindow

        loaded = [snapshot_io.load(snapshot_path(p)) for p in paths]
        if len(loaded) == 1:
            if self.snapshot is None:
                raise snapshot_io.SnapshotFileError("this window has drawn no snapshot yet: choose two files")
            loaded.append((self.with_what_if(self.snapshot), {"caption": self.caption()}))
            names = (os.path.basename(paths[0]), "this window")
        else:
            names = tuple(os.path.basename(p) for p in paths)
        return CompareWindow(loaded[0][0], loaded[1][0], names, tuple(str(x.get("caption", "")) for _, x in loaded))
    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        bar = self.menuBar()
        menus = max((bar.actionGeometry(a).right() for a in bar.actions()), default=0)
        self.health.set_room(self.width() - menus - 16)

    def closeEvent(self, event) -> None:
        if self.settings is not None:
            self.settings.setValue("geometry", self.saveGeometry())
            self.settings.setValue("state", self.saveState(STATE_VERSION))
        self.timer.stop()
        super().closeEvent(event)


EVENTS_SAVED = 2000  # events written into a screenshot's JSON
TABBED = dock_layout.TABBED  # docks that share a place, one in front (ui/dock_layout.py arrange)


class EngineClockRates:
    """The window's rates (ui/charts/rates.py), sampled on the wall clock so that a paused engine's rates fall to 0,
    handed to the charts on the engine's clock, which their marks and the engine's series are on: each sample at
    its snapshot's time (a pause's samples at the moment it began). Drawn against the wall clock, after a pause of P
    seconds every line ended P seconds to the right of "now", shifted from the marks by as much."""

    def __init__(self, history: RateHistory):
        self.history = history
        keep = SERIES_LEN + 64  # as many as the history's rows (RateHistory's default), and its gap rows
        self._wall: collections.deque[float] = collections.deque(maxlen=keep)
        self._engine: collections.deque[float] = collections.deque(maxlen=keep)

    def observe(self, wall_t: float, counters: dict, engine_t: float) -> bool:
        if not self.history.observe(wall_t, counters):
            return False
        self._wall.append(wall_t)
        self._engine.append(engine_t)
        return True

    def latest(self) -> dict[str, float]:
        return self.history.latest()

    def series(self, engine_series: dict | None = None) -> dict[str, np.ndarray]:
        out = self.history.series(engine_series)
        if not self._wall:
            return out
        t = out["t"].copy()
        own = t >= self.history.first_t  # (before it: the engine's own samples, on its clock already)
        t[own] = np.interp(t[own], np.asarray(self._wall), np.asarray(self._engine))
        return out | {"t": t}


def snapshot_path(path: str) -> str:
    """The snapshot file to open for path: a screenshot's PNG stands for the JSON saved beside it."""
    if not path.lower().endswith(".png"):
        return path
    beside = os.path.splitext(path)[0] + ".json"
    if os.path.isfile(beside):
        return beside
    raise snapshot_io.SnapshotFileError(
        f"{path}: a screenshot, not a snapshot: open the .json saved beside it ({os.path.basename(beside)} is not "
        f"in {os.path.dirname(os.path.abspath(path))})")


def open_snapshot_window(path: str) -> MainWindow:
    """A read-only window on a snapshot file (or on the JSON beside a screenshot's PNG)."""
    snap, extra = snapshot_io.load(snapshot_path(path))
    win = MainWindow(SnapshotController(snap, extra))
    mode = extra.get("colour_mode")
    if mode:
        win.maps.set_mode(mode)
    if isinstance(extra.get("selected"), int) and extra["selected"] >= 0:
        win.select_sequence(extra["selected"])
    win.events.add_lines([tuple(e) for e in extra.get("events", [])])
    if extra.get("health_targets"):  # the strip's targets as it was saved (checked by the snapshot's schema)
        win.controls.set_targets(HealthTargets.from_dict(extra["health_targets"]))
    if snap.what_if:  # the what-if curves computed before it was saved
        win.what_if.show_saved(snap.what_if)
    for name in extra.get("tabs", []):  # the tab that was in front when it was saved
        if name in TABBED:
            win.docks[name].raise_()
    return win


def _num(v: float, fmt: str) -> str:
    """A number, or "—" where there is none (NaN)."""
    return "—" if v is None or math.isnan(v) else format(v, fmt)


def selected_cells(snap: Snapshot, sid: int) -> list[np.ndarray]:
    """Per tier, the slots that hold blocks of sequence sid (for tests and highlights)."""
    idx = np.flatnonzero(snap.seqs.id == sid)
    out = [np.zeros(0, np.int64), np.zeros(0, np.int64)]
    if len(idx):
        i = idx[0]
        tiers, slots = snap.seqs.block_tier[i], snap.seqs.block_slot[i]
        for t in (0, 1):
            out[t] = np.sort(slots[tiers == t])
    return out
