"""The Controls panel: a control for every cache knob, the health strip's targets, presets, and the engine's and the
workload's buttons; each change applies to the running engine.

The knobs and their ranges come from engine.config.KNOBS (torch-free); each knob's control is ui/panels/knob.py, a
preset file ui/presets.py. A change is sent to the controller (ui/controller.py); a refusal shows the engine's message
and the control returns to the live value. Moving the KV dtype down in precision asks first, since it is lossy.
"""

from __future__ import annotations

import threading
import time

from PySide6 import QtCore, QtGui, QtWidgets

from engine.config import KNOBS, CacheConfig, ConfigError
from engine.errors import RequestError
from engine.telemetry.health import HealthTargets
from ui.controller import Controller
from ui.panels.knob import SPIN_ARROWS, KnobControl, value_label
from ui.presets import PresetError, read_preset, write_preset

# Row labels: the knob's name without its unit, which the value box shows.
LABELS = {"device_budget_mb": "device budget", "host_budget_mb": "host budget", "demote_after_s": "demote after",
          "kv_dtype": "KV dtype", "shadow_every_s": "shadow every", "device_layers": "device layers"}
BUSY_AFTER_S = 0.15  # a change that takes longer shows the busy state (see ControlsPanel._off_ui_thread)
# Disabled controls (a saved snapshot's) drawn as disabled: the app's style gives a slider's handle its bright
# colour whatever its state, and the boxes their normal text.
DISABLED_STYLE = ("QSlider::handle:horizontal:disabled { background: #4a5059; }"
                  " QSlider::groove:horizontal:disabled { background: #23272d; }"
                  " QSpinBox:disabled, QDoubleSpinBox:disabled, QComboBox:disabled { color: #5c626b;"
                  " background: #1b1e23; border: 1px solid #2a2f37; }"
                  + SPIN_ARROWS)


class ControlsPanel(QtWidgets.QWidget):
    # (kind, text) of a refusal the engine never saw (a preset file that cannot be read), for the event feed;
    # the engine reports its own refusals there itself.
    refused = QtCore.Signal(str, str)
    targetsChanged = QtCore.Signal(object)  # HealthTargets: the health strip's thresholds (ui/panels/health.py)
    _work_done = QtCore.Signal()  # a reconfigure's worker thread has finished (see _off_ui_thread)

    def __init__(self, controller: Controller, confirm_lossy=None):
        super().__init__()
        self.controller = controller
        self.confirm_lossy = confirm_lossy or self._ask_lossy
        lay = QtWidgets.QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.setSpacing(3)  # tight spacing throughout: every knob shows at 1280 x 720 without scrolling
        form = QtWidgets.QFormLayout()
        form.setLabelAlignment(QtCore.Qt.AlignRight)
        form.setVerticalSpacing(0)
        self.controls: dict[str, KnobControl] = {}
        for name, knob in KNOBS.items():
            c = KnobControl(knob)
            c.changed.connect(self.apply)
            self.controls[name] = c
            form.addRow(LABELS.get(name, name.replace("_", " ")), c)
        self.targets = HealthTargets()
        self.target_boxes = self._target_row(form)
        for name, box in self.target_boxes.items():
            box.setText(f"{100 * getattr(self.targets, name):g}")
        lay.addLayout(form)
        self.message = QtWidgets.QLabel(" ")
        self.message.setWordWrap(True)
        # Two lines at most, at a fixed height (a longer message ends in "…", whole in its tooltip and in
        # Events): a message that grew the panel would push the buttons below out of sight.
        self.message.setFixedHeight(2 * self.message.fontMetrics().lineSpacing() + 4)
        self.message.setAlignment(QtCore.Qt.AlignTop | QtCore.Qt.AlignLeft)
        lay.addWidget(self.message)
        # A change the engine takes seconds to apply (a re-layout of the pool): a busy bar on the message's second
        # line (the busy message takes one), so showing it moves nothing and the panel is no taller.
        self.progress = QtWidgets.QProgressBar(self.message)
        self.progress.setRange(0, 0)
        self.progress.setTextVisible(False)
        self.progress.setToolTip("the engine is applying the change between two of its steps")
        self.progress.hide()
        self.busy = False
        row = QtWidgets.QHBoxLayout()
        self.reset = QtWidgets.QPushButton("Reset defaults")
        self.save = QtWidgets.QPushButton("Save preset…")
        self.load = QtWidgets.QPushButton("Load preset…")
        for b in (self.reset, self.save, self.load):
            row.addWidget(b)
        lay.addLayout(row)
        self.reset.clicked.connect(self.reset_defaults)
        self.save.clicked.connect(lambda: self._pick_and(self.save_preset, save=True))
        self.load.clicked.connect(lambda: self._pick_and(self.load_preset, save=False))
        eng = QtWidgets.QGroupBox()  # untitled: its buttons say what they do, and the title's line went to the targets
        eng.setStyleSheet("QGroupBox { margin-top: 2px; padding-top: 0px; }")
        g = QtWidgets.QGridLayout(eng)
        g.setContentsMargins(6, 1, 6, 1)
        g.setVerticalSpacing(2)
        self.pause = QtWidgets.QPushButton("Pause engine")
        self.pause.setCheckable(True)
        self.step = QtWidgets.QPushButton("Single step")
        self.wl_pause = QtWidgets.QPushButton("Pause workload")
        self.wl_pause.setCheckable(True)
        self.intensity = QtWidgets.QSlider(QtCore.Qt.Horizontal)
        self.intensity.setRange(1, 30)
        self.intensity.setValue(10)
        self.intensity.setToolTip("workload intensity: arrival rate of the demo, or speed of a replayed trace "
                                  "(0.1x to 3x)")
        self.workload_label = QtWidgets.QLabel()
        self.replay = QtWidgets.QPushButton("Replay trace…")
        self.replay.setToolTip("replace the demo with your own requests: a JSONL trace (the kvscope bench --trace "
                               "format), replayed at its arrival times, looping")
        self.demo = QtWidgets.QPushButton("Demo")
        self.demo.setToolTip("go back to the built-in demo workload")
        self.record = QtWidgets.QPushButton("Record trace")
        self.record.setCheckable(True)
        self.record.setToolTip("record every block read (time, sequence, tier, hit/miss) for kvscope policy-lab")
        g.addWidget(self.pause, 0, 0)
        g.addWidget(self.step, 0, 1)
        g.addWidget(self.wl_pause, 1, 0)
        g.addWidget(self.intensity, 1, 1)
        g.addWidget(self.workload_label, 2, 0)
        g.addWidget(self.record, 2, 1)
        g.addWidget(self.replay, 3, 0)
        g.addWidget(self.demo, 3, 1)
        lay.addWidget(eng)
        lay.addStretch(1)
        self.pause.toggled.connect(lambda on: (controller.pause_engine(on),
                                               self.pause.setText("Resume engine" if on else "Pause engine")))
        self.step.clicked.connect(controller.step_once)
        self.wl_pause.toggled.connect(lambda on: (controller.set_workload_paused(on),
                                                  self.wl_pause.setText("Resume workload" if on else "Pause workload")))
        self.intensity.sliderReleased.connect(lambda: controller.set_intensity(self.intensity.value() / 10))
        self.record.toggled.connect(self._record)
        self.replay.clicked.connect(lambda: (lambda p: p and self.replay_trace(p))(self.workload_path()))
        self.demo.clicked.connect(self.use_demo)
        self._show_workload()
        self.setStyleSheet(DISABLED_STYLE)
        if controller.read_only:
            for w in [*self.controls.values(), self.reset, self.load, self.pause, self.step, self.wl_pause,
                      self.intensity, self.record, self.replay, self.demo]:
                w.setEnabled(False)
            self.message.setText("read-only: a saved snapshot")
        self.sync()

    def _target_row(self, form: QtWidgets.QFormLayout) -> dict[str, QtWidgets.QLineEdit]:
        """The health strip's targets, in percent: one row of three small boxes across the form (saved in presets as
        [health]); a value outside 0-100 is not taken (the box goes back to the target)."""
        row = QtWidgets.QHBoxLayout()
        row.setSpacing(2)
        title = QtWidgets.QLabel("targets:")
        title.setToolTip("the health strip's targets: green where a figure meets its target, amber within 10 points "
                         "of it, red beyond; saved in presets as [health]")
        row.addWidget(title)
        boxes = {}
        for name, text, tip in (
                ("prefix_hit_rate", "hit ≥", "prefix hit rate target: at least this share of prompt tokens reused"),
                ("block_utilization", "util ≥", "block utilization target: at least this share of the in-use blocks' "
                                                "token slots filled"),
                ("eviction_rate", "evict ≤", "eviction rate target: at most this many blocks evicted per block "
                                             "allocated")):
            box = QtWidgets.QLineEdit()
            box.setValidator(QtGui.QDoubleValidator(0.0, 100.0, 1, box))
            box.setFixedWidth(box.fontMetrics().horizontalAdvance("100") + 10)
            box.setAlignment(QtCore.Qt.AlignRight)
            box.setToolTip(tip + " (percent)")
            box.editingFinished.connect(lambda name=name, box=box: self._target_typed(name, box))
            label = QtWidgets.QLabel(text)
            label.setToolTip(tip)
            row.addWidget(label)
            row.addWidget(box)
            row.addWidget(QtWidgets.QLabel("%"))
            boxes[name] = box
        row.addStretch(1)
        form.addRow(row)  # across both columns: no wider than a knob's row
        return boxes

    def _target_typed(self, name: str, box: QtWidgets.QLineEdit) -> None:
        try:
            value = float(box.text()) / 100
            targets = self.targets.replace(**{name: value})
        except ValueError:
            self.set_targets(self.targets)  # the box shows the target again
            return
        if targets != self.targets:
            self.set_targets(targets)

    def set_targets(self, targets: HealthTargets) -> None:
        """New health targets: the boxes show them, and targetsChanged says so."""
        self.targets = targets
        for name, box in self.target_boxes.items():
            box.setText(f"{100 * getattr(targets, name):g}")
        self.targetsChanged.emit(targets)

    def live(self) -> CacheConfig:
        return self.controller.config()

    def sync(self) -> None:
        cfg = self.live()
        for name, c in self.controls.items():
            c.show_value(getattr(cfg, name))

    def apply(self, name: str, value) -> bool:
        """Send one change; True if the engine took it."""
        return self.apply_many({name: value})

    def apply_many(self, changes: dict) -> bool:
        text = ", ".join(f"{k}={value_label(v)}" for k, v in changes.items())
        if self.busy:  # a change still being applied (its controls are disabled; a timer may still fire)
            self.show_note(f"not applied: {text} (the previous change is still being applied)")
            return False
        lossy = self.controller.is_lossy(changes)
        if lossy:
            if not self.confirm_lossy(text):
                self.show_note(f"not applied: {text} (declined: it would re-encode K/V with less precision)")
                self.sync()
                return False
        try:
            new = self._off_ui_thread(lambda: self.controller.reconfigure(**changes), f"applying {text}")
        except ConfigError as e:
            self.show_error(f"{text}: {e}")  # what was refused, then the engine's reason
            self.sync()
            return False
        lossy = " (lossy: K/V are re-encoded with less precision)" if lossy else ""
        self.show_ok(f"applied {text}{lossy}")
        for name in changes:
            if name in self.controls:
                self.controls[name].show_value(getattr(new, name))
        return True

    def _off_ui_thread(self, fn, what: str):
        """fn() on a worker thread, the window's events running meanwhile, and its result (or its exception).
        A change that takes seconds (a re-layout to block size 1 on a full pool) leaves the window repainting: the
        controls are disabled, and a busy bar and the seconds so far show until the engine has applied the change
        between two of its steps."""
        out: dict = {}

        def work() -> None:
            try:
                out["value"] = fn()
            except BaseException as e:  # raised on the window's thread
                out["error"] = e
            finally:
                self._work_done.emit()

        loop = QtCore.QEventLoop()
        self._work_done.connect(loop.quit)
        worker = threading.Thread(target=work, name="kvscope-reconfigure", daemon=True)
        worker.start()
        worker.join(BUSY_AFTER_S)  # a quick change shows no busy state
        if worker.is_alive():
            self._set_busy(what, True)
            t0 = time.monotonic()
            tick = QtCore.QTimer(self, interval=250)
            tick.timeout.connect(lambda: self._say(f"{what}… {time.monotonic() - t0:.1f} s", "#ffcc80"))
            tick.start()
            try:
                while worker.is_alive():
                    loop.exec()  # quits at the worker's signal (queued: sent before exec, it still ends it)
                    worker.join(0.01)
            finally:
                tick.stop()
                tick.deleteLater()
                self._set_busy(what, False)
        worker.join()
        self._work_done.disconnect(loop.quit)
        if "error" in out:
            raise out["error"]
        return out["value"]

    def _set_busy(self, what: str, busy: bool) -> None:
        self.busy = busy
        for w in [*self.controls.values(), self.reset, self.load]:
            w.setEnabled(not busy)
        line = self.message.fontMetrics().lineSpacing()
        self.progress.setGeometry(0, line + 4, max(self.message.width() - 4, 40), min(8, line - 4))
        self.progress.setVisible(busy)
        if busy:
            self._say(f"{what}…", "#ffcc80")
            QtWidgets.QApplication.setOverrideCursor(QtCore.Qt.BusyCursor)
        else:
            QtWidgets.QApplication.restoreOverrideCursor()

    def show_error(self, text: str) -> None:
        self._say(f"refused: {text}", "#ff8a80")

    def show_ok(self, text: str) -> None:
        self._say(text, "#a5d6a7")

    def show_note(self, text: str) -> None:
        self._say(text, "#ffcc80")

    def _say(self, text: str, colour: str) -> None:
        self.message.setStyleSheet(f"color: {colour};")
        self.message.setToolTip(text)
        # What fits in two lines of the label (a little less, for the words' wrapping).
        room = max(2 * self.message.width() - 3 * self.message.fontMetrics().averageCharWidth() * 4, 120)
        self.message.setText(self.message.fontMetrics().elidedText(text, QtCore.Qt.ElideRight, room))

    def reset_defaults(self) -> bool:
        """Every knob back to its default; the message names the ones that changed."""
        live = self.live().as_dict()
        # Values as a user (or a preset file) writes them: the dtype by name, not its enum number.
        changes = {k: v for k, v in CacheConfig().as_dict().items() if live.get(k) != v}
        if not changes:
            self.show_ok("every knob is at its default")
            return True
        return self.apply_many(changes)

    def save_preset(self, path: str) -> None:
        write_preset(path, self.live().as_dict(), self.targets)
        self.show_ok(f"preset saved to {path}")

    def load_preset(self, path: str) -> bool:
        """Apply the preset's knobs, then its targets; a file that cannot be read, or a change the engine refuses,
        applies nothing of it and says why."""
        try:
            preset = read_preset(path)
        except PresetError as e:
            self.show_error(f"{path}: {e}")
            self.refused.emit("config_error", f"preset {path} not loaded: {e}")
            return False
        if preset.knobs and not self.apply_many(preset.knobs):
            return False
        if preset.targets is not None:
            self.set_targets(preset.targets)
            if not preset.knobs:
                self.show_ok(f"health targets loaded from {path}")
        return True

    def _pick_and(self, fn, save: bool) -> None:
        dlg = QtWidgets.QFileDialog.getSaveFileName if save else QtWidgets.QFileDialog.getOpenFileName
        path, _ = dlg(self, "Preset", "kvscope-preset.toml", "TOML (*.toml)")
        if path:
            fn(path)

    def _record(self, on: bool) -> None:
        if on:
            self.controller.start_trace()
            self.record.setText("Stop and save trace…")
            self.show_ok("recording block reads")
            return
        path = self.trace_path()
        self.record.setText("Record trace")
        if not path:
            self.controller.stop_trace("")
            self.show_ok("trace discarded")
            return
        try:
            n = self.controller.stop_trace(path)
        except OSError as e:
            self.show_error(f"{path}: {e}")
            return
        self.show_ok(f"saved {n:,} block reads to {path} (kvscope policy-lab {path})")

    def replay_trace(self, path: str) -> bool:
        """Replace the workload with a replay of the JSONL trace at path; a bad file is refused, visibly."""
        before = self.controller.workload_name()
        try:
            name = self.controller.replay_trace(path)
        except RequestError as e:
            self.show_error(str(e))
            return False
        self.show_ok(f"replaying {name}" + (f" (the {before} workload's sequences are cancelled)"
                                              if before != "none" else ""))
        self._show_workload()
        return True

    def use_demo(self) -> None:
        self.controller.use_demo_workload()
        self.show_ok("demo workload")
        self._show_workload()

    def _show_workload(self) -> None:
        text = f"workload: {self.controller.workload_name()}"
        self.workload_label.setToolTip(text)
        # A long trace name is shortened ("…"), not allowed to widen the panel.
        self.workload_label.setText(self.workload_label.fontMetrics().elidedText(text, QtCore.Qt.ElideMiddle, 170))

    def workload_path(self) -> str:
        """Which trace to replay (a file dialog; tests replace this)."""
        path, _ = QtWidgets.QFileDialog.getOpenFileName(self, "Replay a request trace", "",
                                                        "Request trace (*.jsonl);;All files (*)")
        return path

    def trace_path(self) -> str:
        """Where to save a recorded trace (a file dialog; tests replace this)."""
        path, _ = QtWidgets.QFileDialog.getSaveFileName(self, "Save access trace", "kvscope-trace.npz",
                                                        "Access trace (*.npz)")
        return path

    def _ask_lossy(self, change: str) -> bool:
        r = QtWidgets.QMessageBox.question(
            self, "Lossy change", f"Applying {change} re-encodes the cached K/V and loses precision: running "
            "sequences continue, but their tokens may differ from an fp32 run. Apply?")
        return r == QtWidgets.QMessageBox.Yes
