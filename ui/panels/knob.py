"""One knob's control: a slider over round values (or a combo of choices) beside a box for any value in range.

The knob's range, unit and help come from engine.config.KNOBS (torch-free); the slider snaps to `slider_stops`, the box
takes any value in range and says the unit (a budget's: MiB) in the singular for a value of 1. `SPIN_ARROWS` is the
value boxes' step buttons, for every panel that has such a box.
"""

from __future__ import annotations

import os

import numpy as np
from PySide6 import QtCore, QtWidgets

from engine.config import Knob

# The values a slider snaps to (a typed value may lie between two). Knobs not named here take powers of two
# (sizes and counts) or, for budgets in MiB, powers of two from 1 MiB to 128 GiB (a log scale); each list is
# cut to the knob's range (engine.config.KNOBS).
STOPS = {
    "decay": (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99, 1.0),
    "demote_after_s": (0, 0.25, 0.5, 1, 2, 3, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600),
    "prefetch_depth": (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
    "shadow_every_s": (0, 0.5, 1, 2, 3, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600),
    "device_layers": (0, 1, 2, 4, 6, 8, 10, 12, 16, 20, 24, 28, 32, 40, 48, 64, 80, 96, 128),
}
ZERO_TEXT = {"device_layers": "all layers", "shadow_every_s": "off"}  # what a 0 in the value box means
SPIN_TEXT = "131072.00 MiB"  # the widest value a box shows for a slider stop
SETTLE_MS = 350  # a key or wheel step applies once the steps stop for this long (each apply may re-lay the pool)
# The value boxes' step buttons, each drawn here with its arrow an image (ui/icons): under the app's style sheet on the
# boxes (background, border) Qt's own arrows are dark on dark.
ICONS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "icons").replace(os.sep, "/")
SPIN_ARROWS = "".join(
    f" QAbstractSpinBox::{b}-button {{ subcontrol-origin: border; subcontrol-position: {pos} right; width: 14px;"
    f" background: #2a2f37; border-left: 1px solid #3a404a; }}"
    f" QAbstractSpinBox::{b}-button:hover {{ background: #3a404a; }}"
    f" QAbstractSpinBox::{b}-arrow {{ image: url({ICONS}/spin-{b}.svg); width: 8px; height: 7px; }}"
    f" QAbstractSpinBox::{b}-arrow:disabled, QAbstractSpinBox::{b}-arrow:off"
    f" {{ image: url({ICONS}/spin-{b}-off.svg); }}"
    for b, pos in (("up", "top"), ("down", "bottom")))


# A budget counts mebibytes (2**20 bytes: 48 of them are 50.3 million bytes), whether engine.config names its unit
# "MB" or "MiB"; the controls say MiB.
BYTE_UNITS = {"MB": "MiB", "MiB": "MiB"}


def unit_text(knob: Knob, value=None) -> str:
    """The unit a control shows for the knob (a budget's: MiB), in the singular for a value of 1 ("1 token",
    "1 block", "1 layer", never "1 tokens")."""
    unit = BYTE_UNITS.get(knob.unit, knob.unit)
    if value == 1 and unit.isalpha() and len(unit) > 2 and unit.endswith("s"):
        return unit[:-1]
    return unit


def slider_stops(knob: Knob) -> tuple[float, ...]:
    """The values the knob's slider snaps to, in order, within the knob's range."""
    if knob.name in STOPS:
        stops = STOPS[knob.name]
    elif knob.unit in BYTE_UNITS:
        stops = (0.0,) + tuple(2.0**e for e in range(0, 18))
    else:
        stops = (0,) + tuple(2**e for e in range(0, 31))
    return tuple(knob.kind(v) for v in stops if knob.lo <= v <= knob.hi)


def value_label(value) -> str:
    """A knob value as a user reads it (a dtype by its name, not its enum number)."""
    return value.label if hasattr(value, "label") else f"{value:g}" if isinstance(value, float) else str(value)


class StopSlider(QtWidgets.QSlider):
    """A slider over a knob's stops whose wheel moves one stop a notch (Qt's default is three, a factor of 8
    on a power-of-two scale)."""

    def wheelEvent(self, event) -> None:
        notches = event.angleDelta().y() // 120 or (1 if event.angleDelta().y() > 0 else -1)
        self.setValue(self.value() + notches)
        event.accept()


class KnobControl(QtWidgets.QWidget):
    """One knob: a slider (or combo) plus an exact-value editor; emits `changed(name, value)` when settled.

    The slider snaps to `slider_stops` (arrow keys and the wheel step one stop, Page Up/Down two); the editor
    takes any value in the knob's range. A drag applies on release, a key or wheel step once the steps settle.
    """

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
            self.stops = slider_stops(knob)
            self.slider = StopSlider(QtCore.Qt.Horizontal)
            self.slider.setRange(0, len(self.stops) - 1)
            self.slider.setSingleStep(1)
            self.slider.setPageStep(2)
            self.slider.setFocusPolicy(QtCore.Qt.StrongFocus)
            lo, hi = value_label(self.stops[0]), value_label(self.stops[-1])
            self.slider.setToolTip(f"{knob.help}; snaps to {lo} … {hi} {unit_text(knob)} (arrow keys: one step); "
                                   "type any value in the box")
            self.spin = QtWidgets.QDoubleSpinBox() if knob.kind is float else QtWidgets.QSpinBox()
            if knob.kind is float:
                self.spin.setDecimals(2)
                self.spin.setStepType(QtWidgets.QAbstractSpinBox.AdaptiveDecimalStepType)
            self.spin.setRange(knob.lo, knob.hi)
            self.spin.setKeyboardTracking(False)
            # One width for every knob, room for the largest slider stop of any (sized by the largest value in
            # its range, the box would leave the slider a few pixels per stop); a larger typed value scrolls.
            self.spin.setFixedWidth(self.spin.fontMetrics().horizontalAdvance(SPIN_TEXT) + 26)
            self.spin.setSuffix(f" {unit_text(knob)}" if knob.unit else "")
            if knob.name in ZERO_TEXT:  # 0 means something other than "none of the unit"
                self.spin.setSpecialValueText(ZERO_TEXT[knob.name])
            self._settle = QtCore.QTimer(self, singleShot=True, interval=SETTLE_MS)
            self._settle.timeout.connect(self._emit_slider)
            self.slider.sliderMoved.connect(self._preview)
            self.slider.sliderReleased.connect(self._emit_slider)
            self.slider.valueChanged.connect(self._stepped)
            self.spin.valueChanged.connect(self._unit_for)
            self.spin.valueChanged.connect(lambda v: self.changed.emit(knob.name, v))
            lay.addWidget(self.slider, 1)
            lay.addWidget(self.spin)
        self._live = None
        self.setToolTip(knob.help)

    def _unit_for(self, value) -> None:
        if self.knob.unit:
            suffix = f" {unit_text(self.knob, value)}"
            if suffix != self.spin.suffix():
                self.spin.setSuffix(suffix)

    def pos_of(self, value: float) -> int:
        """The slider position nearest to value (between two stops, the nearer one)."""
        x = float(np.interp(float(value), self.stops, np.arange(len(self.stops))))
        return int(x + 0.5)

    def _preview(self, pos: int) -> None:
        self.spin.blockSignals(True)
        self.spin.setValue(self.stops[pos])
        self.spin.blockSignals(False)
        self._unit_for(self.stops[pos])

    def _stepped(self, pos: int) -> None:
        """A key, wheel or page step (a drag applies on release instead)."""
        self._preview(pos)
        if not self.slider.isSliderDown():
            self._settle.start()

    def _emit_slider(self) -> None:
        self._settle.stop()
        value = self.stops[self.slider.value()]
        if value != self._live:
            self.changed.emit(self.knob.name, value)

    def show_value(self, value) -> None:
        """Reflect the live value without emitting."""
        self._live = value
        for w in (self.slider, self.combo, self.spin):
            if w is not None:
                w.blockSignals(True)
        if self.combo is not None:
            self.combo.setCurrentText(value_label(value))
        else:
            self._settle.stop()
            self.spin.setValue(value)
            self._unit_for(value)
            self.slider.setValue(self.pos_of(value))
        for w in (self.slider, self.combo, self.spin):
            if w is not None:
                w.blockSignals(False)
