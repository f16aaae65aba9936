"""Where the labels of a chart's marks go (config changes, workload switches): readable, apart, inside the plot.

Marks a few pixels apart share one label ("a; b"). The newest are placed first. Each label takes the first of up
to three rows at the top of the plot, right of its line or else left of it, where it overlaps no other label:
first where its box also hides no other mark's line, then anywhere free, then the same again shortened. A label
that fits nowhere is left to the chart's hover readout.
"""

from __future__ import annotations

from PySide6 import QtCore, QtGui

GROUP_PX = 4  # marks closer than this share a label
ROWS = 3
LONGEST = (160, 90)  # a label's width in pixels, then shortened to this


def place(marks: list[tuple[float, str, str]], plot: QtCore.QRectF, fm: QtGui.QFontMetrics,
          line_h: float) -> list[tuple[QtCore.QRectF, str, str]]:
    """marks: (x in pixels, kind, label) of the labelled marks on screen; returns (box, text, kind) per label."""
    groups: list[list] = []
    for x, kind, label in sorted(marks):
        if groups and x - groups[-1][0] <= GROUP_PX:
            groups[-1][2].append(label)
        else:
            groups.append([x, kind, [label]])
    lines = [g[0] for g in groups]
    rows = max(0, min(ROWS, int((plot.height() - 8) // line_h)))
    taken: list[list[QtCore.QRectF]] = [[] for _ in range(rows)]
    out = []
    # Newest first (the right-most): with many changes close together the rows fill up, and the change a user
    # just made must be the one that stays readable (placed oldest first, after ~4 it was cut or left out).
    for x, kind, labels in reversed(groups):
        texts = dict.fromkeys(fm.elidedText("; ".join(labels), QtCore.Qt.ElideRight, most) for most in LONGEST)
        spots = [(text, row, side, clear) for text in texts for clear in (True, False)
                 for row in range(rows) for side in (1, -1)]
        for text, row, side, clear in spots:
            w = fm.horizontalAdvance(text) + 4
            box = QtCore.QRectF(x + 2 if side > 0 else x - 2 - w, plot.top() + 1 + row * line_h, w, line_h)
            if box.left() < plot.left() or box.right() > plot.right():
                continue
            if any(box.intersects(o.adjusted(-3, 0, 3, 0)) for o in taken[row]):
                continue
            if clear and any(box.left() - 1 <= lx <= box.right() + 1 for lx in lines if lx != x):
                continue
            taken[row].append(box)
            out.append((box, text, kind))
            break
    return sorted(out, key=lambda o: o[0].left())
