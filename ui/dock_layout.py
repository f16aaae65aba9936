"""The inspector window's default dock arrangement, and how it shares a window of any size from 1280 x 720 up.

The right column (Controls over Prompt) runs the full height; the left (Sequences over Events) and the block
map sit above the charts, three places each with its tabs (Hit rate, Why missed | Memory, Diagnostics | Heat,
Residency, Cost, What if: at 1280 x 720 a place is ~300-370 px wide, which six tabs in one place could only show
elided), which share the width left of the right column. Sizes follow the window: side columns as wide as
their contents want, the charts a good third of the
height, the prompt what the controls leave.
"""

from __future__ import annotations

from PySide6 import QtCore, QtWidgets

DEFAULT_SIZE = QtCore.QSize(1600, 1000)  # on a screen with room for it; a smaller one gets all of its space
TITLE_ROOM = 40  # a window manager's title bar and frame, which a screen's available geometry does not include
MAP_WIDTH = 430  # the block map keeps this much width before the sequences table's labels give way
Qt = QtCore.Qt

DOCK_AREAS = (("Controls", Qt.RightDockWidgetArea), ("Prompt", Qt.RightDockWidgetArea),
              ("Sequences", Qt.LeftDockWidgetArea), ("Events", Qt.LeftDockWidgetArea),
              ("Hit rate", Qt.BottomDockWidgetArea), ("Memory", Qt.BottomDockWidgetArea),
              ("Heat", Qt.BottomDockWidgetArea), ("Residency", Qt.BottomDockWidgetArea),
              ("Cost", Qt.BottomDockWidgetArea), ("Why missed", Qt.BottomDockWidgetArea),
              ("Diagnostics", Qt.BottomDockWidgetArea), ("What if", Qt.BottomDockWidgetArea))


# Docks that share a place, the first of each in front by default: why tokens missed beside the hit rate, the
# checklist (leaks, lock wait, bandwidth) beside memory, what a change would buy in the widest place with the cache's
# detail panels.
TAB_PLACES = (("Hit rate", "Why missed"), ("Memory", "Diagnostics"), ("Heat", "Residency", "Cost", "What if"))
TABBED = tuple(n for place in TAB_PLACES for n in place)


def fitted_geometry(avail: QtCore.QRect, want: QtCore.QSize = DEFAULT_SIZE) -> tuple[QtCore.QRect, bool]:
    """Where the window opens on a screen whose free area is `avail`: the wanted size, centred, where it
    fits with room for a title bar; else all of `avail`, maximized (True)."""
    if want.width() <= avail.width() and want.height() + TITLE_ROOM <= avail.height():
        r = QtCore.QRect(QtCore.QPoint(0, 0), want)
        r.moveCenter(avail.center())
        return r, False
    return QtCore.QRect(avail), True


def arrange(win: QtWidgets.QMainWindow) -> None:
    """Every dock of win.docks back in its default place, shown and docked, then sized (share)."""
    win.setCorner(Qt.TopRightCorner, Qt.RightDockWidgetArea)
    win.setCorner(Qt.BottomRightCorner, Qt.RightDockWidgetArea)
    win.setCorner(Qt.TopLeftCorner, Qt.LeftDockWidgetArea)
    win.setCorner(Qt.BottomLeftCorner, Qt.BottomDockWidgetArea)
    docks = win.docks
    for name, area in DOCK_AREAS:
        d = docks[name]
        d.setFloating(False)
        win.removeDockWidget(d)
        win.addDockWidget(area, d, Qt.Vertical)
        d.setFloating(False)
        d.show()
    win.splitDockWidget(docks["Hit rate"], docks["Memory"], Qt.Horizontal)
    win.splitDockWidget(docks["Memory"], docks["Heat"], Qt.Horizontal)
    for place in TAB_PLACES:
        for a, b in zip(place, place[1:]):
            win.tabifyDockWidget(docks[a], docks[b])
    for place in TAB_PLACES:
        docks[place[0]].raise_()
        # The tabs of a place share one least width: the widest tab's. Each tab's own, the place widened when a
        # wider one came to the front and narrowed the charts beside it (and back on the next tab).
        panels = [docks[n].widget() for n in place]
        least = max(p.minimumSizeHint().width() for p in panels)
        for p in panels:
            p.setMinimumWidth(least)
    share(win)


def share(win: QtWidgets.QMainWindow) -> None:
    """Share the window's present size among its docks."""
    w, h = win.width(), win.height()
    d = win.docks
    right = _clamp(w * 0.22, d["Controls"].minimumSizeHint().width(), 420)
    left = _clamp(w * 0.28, min(win.seqs.natural_width(), w - right - MAP_WIDTH), 560)
    win.resizeDocks([d["Sequences"], d["Controls"]], [left, right], Qt.Horizontal)
    win.resizeDocks([d["Hit rate"]], [_clamp(h * 0.42, 300, 440)], Qt.Vertical)
    win.resizeDocks([d["Sequences"], d["Events"]], [1, 1], Qt.Vertical)
    third = (w - right) // 3
    win.resizeDocks([d["Hit rate"], d["Memory"], d["Heat"]], [third, third, third], Qt.Horizontal)
    controls = win.controls.sizeHint().height() + 28  # and the dock's title bar
    prompt = max(h - 60 - controls, d["Prompt"].minimumSizeHint().height())
    win.resizeDocks([d["Controls"], d["Prompt"]], [controls, prompt], Qt.Vertical)


def _clamp(v: float, lo: int, hi: int) -> int:
    return int(max(lo, min(hi, v)))
