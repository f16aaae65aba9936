"""A small window shown while the model loads (and, on the first start, is converted), so a start that takes
half a minute shows what it is doing instead of nothing."""

from __future__ import annotations

import time

from PySide6 import QtCore, QtWidgets


class LoadingWindow(QtWidgets.QWidget):
    def __init__(self, what: str = "the model"):
        super().__init__()
        self.setWindowTitle("KV Scope — starting")
        lay = QtWidgets.QVBoxLayout(self)
        lay.setContentsMargins(18, 16, 18, 16)
        title = QtWidgets.QLabel(f"<b>KV Scope</b> is loading {what}")
        self.stage = QtWidgets.QLabel("loading the model")
        self.stage.setWordWrap(True)
        self.bar = QtWidgets.QProgressBar()
        self.bar.setRange(0, 0)  # busy until a stage reports a fraction
        self.elapsed = QtWidgets.QLabel()
        note = QtWidgets.QLabel("The first start converts the model into a local cache (about half a minute); "
                                "later starts only load it.")
        note.setWordWrap(True)
        note.setStyleSheet("color: #aab0b8;")
        for w in (title, self.stage, self.bar, self.elapsed, note):
            lay.addWidget(w)
        self.setFixedWidth(440)
        self._t0 = time.monotonic()
        self._timer = QtCore.QTimer(self, interval=250)
        self._timer.timeout.connect(self._tick)
        self._timer.start()
        self._tick()

    def showEvent(self, event) -> None:
        super().showEvent(event)
        screen = self.screen()
        if screen is not None:  # centred on its screen, where a window manager would put a dialog
            r = self.frameGeometry()
            r.moveCenter(screen.availableGeometry().center())
            self.move(r.topLeft())

    @QtCore.Slot(str, float)
    def set_progress(self, stage: str, fraction: float) -> None:
        """A stage of the load and how far it is (0..1)."""
        self.stage.setText(f"{stage}: {fraction * 100:.0f}%")
        self.bar.setRange(0, 100)
        self.bar.setValue(round(fraction * 100))
        if fraction >= 1.0:  # that stage is done; what follows (reading the weights) reports nothing
            self.stage.setText(f"{stage}: done; loading the weights")
            self.bar.setRange(0, 0)

    def _tick(self) -> None:
        self.elapsed.setText(f"{time.monotonic() - self._t0:.0f} s")

    def closeEvent(self, event) -> None:
        self._timer.stop()
        super().closeEvent(event)
