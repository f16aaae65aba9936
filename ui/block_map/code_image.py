"""The block maps' image item: a uint8 code per cell, coloured through a 256-entry LUT.

pyqtgraph turns a uint8 image with a 256-entry LUT into an Indexed8 QImage (cheap to build), but the raster
painter draws an Indexed8 image scaled to the view through a per-pixel colour-table lookup: 3.1 ms for a
632 × 356 map on a 962 × 563 view here, against 0.37 ms for the same image as RGB32. So each new image is
converted to RGB32 once (≈ 0.2 ms, in C) and every paint draws that. Paints are counted: the benches and the
tests check that a frame was really drawn.
"""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtGui import QImage


class CodeImage(pg.ImageItem):
    paints = 0

    def render(self) -> None:
        super().render()
        q = self.qimage
        if q is not None and q.format() == QImage.Format.Format_Indexed8:
            self.qimage = q.convertToFormat(QImage.Format.Format_RGB32)

    def paint(self, painter, *args):
        self.paints += 1
        super().paint(painter, *args)
