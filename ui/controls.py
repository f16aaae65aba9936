"""Sliders and combos for every cache knob; each applies to the running engine.

The knobs and their ranges come from engine.config.KNOBS (torch-free). A change is sent to the controller;
a refusal shows the engine's message and the control returns to the live value. Moving the KV dtype down in
precision asks first, since it is lossy.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib

from PySide6 import QtCore, QtWidgets

from engine.config import KNOBS, CacheConfig, ConfigError, Knob
from engine.errors import RequestError

# Slider resolution for float knobs: sliders are int, these map position <-> value.
LOG_KNOBS = {"device_budget_mb", "host_budget_mb", "demote_after_s"}
STEPS = 1000


class KnobControl(QtWidgets.QWidget):
    """One knob: a slider (or combo) plus an exact-value editor; emits `changed(name, value)` when settled."""

    changed = QtCore.Signal(str, object)

    def __init__(self, knob: Knob):
        super().__init__()
        self.knob = knob
        lay = QtWidgets.QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        self.slider = None
        self.combo = None
        self.spin = None
        if knob.choices:
            self.combo = QtWidgets.QComboBox()
            self.combo.addItems(knob.choices)
            self.combo.activated.connect(lambda _i: self.changed.emit(knob.name, self.combo.currentText()))
            lay.addWidget(self.combo, 1)
        else:
            self.slider = QtWidgets.QSlider(QtCore.Qt.Horizontal)
            self.slider.setRange(0, STEPS)
            self.spin = QtWidgets.QDoubleSpinBox() if knob.kind is float else QtWidgets.QSpinBox()
            if knob.kind is float:
                self.spin.setDecimals(2)
            self.spin.setRange(knob.lo, knob.hi)
            self.spin.setKeyboardTracking(False)
            self.spin.setMinimumWidth(84)
            self.spin.setSuffix(f" {knob.unit}" if knob.unit else "")
            self.slider.sliderMoved.connect(lambda pos: self.spin.blockSignals(True) or self.spin.setValue(
                self._from_pos(pos)) or self.spin.blockSignals(False))
            self.slider.sliderReleased.connect(lambda: self.changed.emit(knob.name, self.spin.value()))
            self.spin.valueChanged.connect(lambda v: self.changed.emit(knob.name, v))
            lay.addWidget(self.slider, 1)
            lay.addWidget(self.spin)
        self.setToolTip(knob.help)

    def _to_pos(self, v: float) -> int:
        lo, hi = self.knob.lo, self.knob.hi
        if self.knob.name in LOG_KNOBS:
            lo = max(lo, 0.01)
            return round(STEPS * (math.log(max(v, lo)) - math.log(lo)) / (math.log(hi) - math.log(lo)))
        if self.knob.name == "block_size":  # most useful sizes are small
            return round(STEPS * math.sqrt((v - lo) / (hi - lo)))
        return round(STEPS * (v - lo) / (hi - lo))

    def _from_pos(self, pos: int):
        lo, hi = self.knob.lo, self.knob.hi
        f = pos / STEPS
        if self.knob.name in LOG_KNOBS:
            lo2 = max(lo, 0.01)
            v = math.exp(math.log(lo2) + f * (math.log(hi) - math.log(lo2)))
        elif self.knob.name == "block_size":
            v = lo + f * f * (hi - lo)
        else:
            v = lo + f * (hi - lo)
        return round(v) if self.knob.kind is int else round(v, 2)

    def show_value(self, value) -> None:
        """Reflect the live value without emitting."""
        for w in (self.slider, self.combo, self.spin):
            if w is not None:
                w.blockSignals(True)
        if self.combo is not None:
            self.combo.setCurrentText(value.label if hasattr(value, "label") else str(value))
        else:
            self.spin.setValue(value)
            self.slider.setValue(self._to_pos(value))
        for w in (self.slider, self.combo, self.spin):
            if w is not None:
                w.blockSignals(False)


class ControlsPanel(QtWidgets.QWidget):
    def __init__(self, controller, confirm_lossy=None):
        super().__init__()
        self.controller = controller
        self.confirm_lossy = confirm_lossy or self._ask_lossy
        lay = QtWidgets.QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        form = QtWidgets.QFormLayout()
        form.setLabelAlignment(QtCore.Qt.AlignRight)
        self.controls: dict[str, KnobControl] = {}
        for name, knob in KNOBS.items():
            c = KnobControl(knob)
            c.changed.connect(self.apply)
            self.controls[name] = c
            form.addRow(name.replace("_", " "), c)
        lay.addLayout(form)
        self.message = QtWidgets.QLabel(" ")
        self.message.setWordWrap(True)
        self.message.setMinimumHeight(34)
        lay.addWidget(self.message)
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
        eng = QtWidgets.QGroupBox("engine and workload")
        g = QtWidgets.QGridLayout(eng)
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
        g.addWidget(self.workload_label, 2, 0, 1, 2)
        g.addWidget(self.replay, 3, 0)
        g.addWidget(self.demo, 3, 1)
        g.addWidget(self.record, 4, 0, 1, 2)
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
        if controller.read_only:
            for w in [*self.controls.values(), self.reset, self.load, self.pause, self.step, self.wl_pause,
                      self.intensity, self.record, self.replay, self.demo]:
                w.setEnabled(False)
            self.message.setText("read-only: a saved snapshot")
        self.sync()

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
        lossy = self.controller.is_lossy(changes)
        if lossy:
            if not self.confirm_lossy(", ".join(f"{k}={v}" for k, v in changes.items())):
                self.sync()
                return False
        try:
            new = self.controller.reconfigure(**changes)
        except ConfigError as e:
            self.show_error(str(e))
            self.sync()
            return False
        lossy = " (lossy: K/V are re-encoded with less precision)" if lossy else ""
        self.show_ok(f"applied {', '.join(f'{k}={v}' for k, v in changes.items())}{lossy}")
        for name in changes:
            self.controls[name].show_value(getattr(new, name))
        return True

    def show_error(self, text: str) -> None:
        self.message.setStyleSheet("color: #ff8a80;")
        self.message.setText(f"refused: {text}")

    def show_ok(self, text: str) -> None:
        self.message.setStyleSheet("color: #a5d6a7;")
        self.message.setText(text)

    def reset_defaults(self) -> None:
        d = CacheConfig()
        self.apply_many({f.name: getattr(d, f.name) for f in dataclasses.fields(d)})

    def save_preset(self, path: str) -> None:
        cfg = self.live().as_dict()
        lines = ["# KV Scope cache preset"]
        for k, v in cfg.items():
            lines.append(f"{k} = \"{v}\"" if isinstance(v, str) else f"{k} = {v}")
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        self.show_ok(f"preset saved to {path}")

    def load_preset(self, path: str) -> bool:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            self.show_error(f"{path}: {e}")
            return False
        return self.apply_many(data)

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
        self.workload_label.setText(f"workload: {self.controller.workload_name()}")

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
