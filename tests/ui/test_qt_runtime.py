"""The Qt binding must not leak references to None (PySide6 6.12.0 does, and the window then crashes)."""

from __future__ import annotations

import sys


def test_void_qt_calls_keep_none_alive(qtbot):
    from PySide6 import QtWidgets

    label = QtWidgets.QLabel()
    qtbot.addWidget(label)
    before = sys.getrefcount(None)
    for i in range(2000):
        label.setText(str(i))
        label.resize(100 + i % 7, 40)
    # Other threads may hold or release a few references meanwhile; a leak shows as thousands.
    assert sys.getrefcount(None) - before > -100
