"""The "What if" tab: hit rate against device capacity, block size and demotion threshold, from a recorded trace.

Fed plain numpy arrays by app/whatif/worker.py (computed on a worker thread; the result comes back through a
queued signal): this module imports neither torch nor the engine's computation. `service` is None in a saved
snapshot's window (the tab then says it needs the live engine).
"""

from __future__ import annotations

import html
import math

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtWidgets

from ui.panels.what_if_data import saved_results

RECORD_S = 30
TARGET = 0.75
COLOURS = {"lru": "#4e9be6", "s3fifo": "#5cc96b", "heat": "#f0a040"}
SIZE_COLOURS = ("#c678dd", "#4e9be6", "#5cc96b", "#f0a040", "#e06c75")
VIEWS = ("vs capacity", "vs block size", "vs demote after")

CONFIGURED_COLOUR = "#ffffff"
CONFIGURED = ("Engine as configured (white, thick; dots: its reruns): the engine's own scheduler and KV layer rerun on "
              "the trace's requests at each capacity, with the knobs it was recorded with (eviction batches, heat "
              "decay on the run's seconds, prefetch, idle demotion, the host tier), calibrated so the recorded "
              "capacity gives the run's own rates. Drawn: FIRST READS, as the policy curves count. Its sentences "
              "also give PREFIX, the prompt tokens served from the prefix cache (a block found on the host tier "
              "counts: the health strip's number and its 75 % target, the Hit rate chart's orange line), and KEYS "
              "READ, the keys attention read straight from the device tier (the Hit rate chart's blue line). Apply "
              "a device budget and the Hit rate chart keeps the prediction for it beside what is measured.\n\n")
COUNTED = CONFIGURED + (
           "Hit rate here = the share of counted reads that find their block already cached on the device tier. "
           "Counted: each sequence's first read of each block (the reads a cache can win or lose: a running "
           "sequence's later reads of its own blocks hit under any policy, the engine pins them). A block is "
           "named by its tokens, so one evicted and recomputed is the same block. LRU is exact at every capacity "
           "(Mattson stack distances over every read); heat and S3-FIFO (~) are SHARDS-sampled simulations of "
           "the counted reads. Capacity: device-tier blocks, in MiB at the current block size and KV dtype. "
           "Not the Hit rate panel's device hit rate, which counts every key of every read.")


def _log(x: float) -> float:
    return math.log10(max(x, 1e-9))


class WhatIfPanel(QtWidgets.QWidget):
    resultReady = QtCore.Signal(object)

    def __init__(self, service=None, parent=None):
        super().__init__(parent)
        self.service = service
        self.result = None  # the result drawn: the selected KV-cache group's
        self.results: list = []  # one per KV-cache group the trace read
        self._left = 0
        lay = QtWidgets.QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        row = QtWidgets.QHBoxLayout()
        self.record = QtWidgets.QPushButton(f"Record {RECORD_S} s")
        self.record.setToolTip(f"record the engine's block reads for {RECORD_S} s (click again to stop early), then "
                               "compute the curves on a worker thread")
        self.open = QtWidgets.QPushButton("Open…")
        self.open.setToolTip("an access trace (.npz: generate --record-trace, or Controls' Record trace) or a "
                             "Mooncake / Bailian block-hash trace (.jsonl)")
        self.view = QtWidgets.QComboBox()
        self.view.addItems(VIEWS)
        self.group = QtWidgets.QComboBox()
        self.group.setToolTip("which KV-cache group's reads the curves replay: each group has its own pool, capacity "
                              "and blocks (a sliding-window group holds only its window's blocks)")
        self.group.setVisible(False)
        row.addWidget(self.record)
        row.addWidget(self.open)
        row.addWidget(self.view)
        row.addWidget(self.group)
        row.addStretch(1)
        lay.addLayout(row)
        self.plot = pg.PlotWidget()
        self.plot.setMouseEnabled(x=False, y=False)
        self.plot.setMenuEnabled(False)
        self.plot.setLabel("left", "hit %")
        self.plot.setYRange(0, 100)
        self.plot.setToolTip(COUNTED)
        self.plot.setMinimumHeight(120)
        lay.addWidget(self.plot, 1)
        self.text = QtWidgets.QLabel()
        self.text.setTextFormat(QtCore.Qt.RichText)
        self.text.setWordWrap(True)
        self.text.setToolTip(COUNTED)
        lay.addWidget(self.text)
        self.timer = QtCore.QTimer(self)
        self.timer.setInterval(1000)
        self.timer.timeout.connect(self._tick)
        self.record.clicked.connect(self._record_clicked)
        self.open.clicked.connect(self._open_clicked)
        self.view.currentIndexChanged.connect(lambda _: self.draw())
        self.group.currentIndexChanged.connect(self._group_changed)
        self.resultReady.connect(self.show_result)
        if service is None:
            self.record.setEnabled(False)
            self.open.setEnabled(False)
        self.draw()

    # -- inputs ---------------------------------------------------------------------------------------
    def _record_clicked(self) -> None:
        if self.timer.isActive():
            self._finish_recording()
            return
        err = self.service.record()
        if err:
            self._say(err)
            return
        self._left = RECORD_S
        self.timer.start()
        self._tick(first=True)

    def _tick(self, first: bool = False) -> None:
        if not first:
            self._left -= 1
        if self._left <= 0:
            self._finish_recording()
            return
        self.record.setText(f"Recording… {self._left} s (stop)")

    def _finish_recording(self) -> None:
        self.timer.stop()
        self.record.setText(f"Record {RECORD_S} s")
        trace = self.service.take()
        if trace is None:
            return
        self.start(trace)

    def _open_clicked(self) -> None:
        path = self.trace_path()
        if path:
            self.start(path)

    def trace_path(self) -> str:
        """Which trace to open (a file dialog; tests replace this)."""
        path, _ = QtWidgets.QFileDialog.getOpenFileName(
            self, "Open a trace", "", "Traces (*.npz *.jsonl);;Access trace (*.npz);;Block-hash trace (*.jsonl)")
        return path

    def start(self, source) -> None:
        """Compute the curves of `source` (an AccessTrace or a path) on the service's worker thread."""
        self._say("computing the curves…")
        self.record.setEnabled(False)
        self.open.setEnabled(False)
        self.service.compute(source, self.resultReady.emit)

    # -- output ---------------------------------------------------------------------------------------
    @QtCore.Slot(object)
    def show_result(self, result) -> None:
        if self.service is not None:
            self.record.setEnabled(True)
            self.open.setEnabled(True)
        if isinstance(result, str):
            self._say(f"<span style='color:#e06c75'>{html.escape(result)}</span>")
            return
        self.results = list(result) if isinstance(result, (list, tuple)) else [result]
        self.result = self.results[0] if self.results else None
        self.group.blockSignals(True)
        self.group.clear()
        for r in self.results:
            title = getattr(r, "group_title", "")
            self.group.addItem(f"group {getattr(r, 'group', 0)}" + (f": {title}" if title else ""))
        self.group.blockSignals(False)
        self.group.setVisible(len(self.results) > 1)
        self.draw()

    def show_saved(self, what_if: dict) -> None:
        """Draw the curves a snapshot carries (Snapshot.what_if): a saved window's or a compare window's side."""
        results = saved_results(what_if)
        if results:
            self.show_result(results)
        else:
            self.results, self.result = [], None
            self.group.setVisible(False)
            self._no_data = "no data: this snapshot holds no what-if curves (compute them in the What if tab " \
                "before saving)"
            self.draw()

    def _group_changed(self, i: int) -> None:
        if 0 <= i < len(self.results):
            self.result = self.results[i]
            self.draw()

    def saved(self) -> dict:
        """The curves computed last, as a snapshot carries them (Snapshot.what_if): {} when none were."""
        if not self.results:
            return {}
        return {"source": str(self.results[0].source), "groups": [r.saved() for r in self.results]}

    def _say(self, text: str) -> None:
        self.text.setText(text)

    def draw(self) -> None:
        self._draw()
        self.plot.enableAutoRange(axis="y", enable=False)
        self.plot.setYRange(0, 100, padding=0.02)

    def _draw(self) -> None:
        p = self.plot
        p.clear()
        r = self.result
        if r is None:
            p.setLogMode(x=False, y=False)
            msg = "no data: record the engine for a while, or open a trace" if self.service is not None else \
                getattr(self, "_no_data", "no data: the what-if curves need the live engine (a saved snapshot "
                        "holds no trace)")
            self._say(msg)
            p.addItem(pg.TextItem("no data", color="#8a8f98", anchor=(0.5, 0.5)))
            return
        view = self.view.currentIndex()
        unit = "MiB" if r.block_mib else "blocks"
        scale = r.block_mib or 1.0
        target = pg.InfiniteLine(pos=100 * TARGET, angle=0, pen=pg.mkPen("#e06c75", width=1, style=QtCore.Qt.DashLine))
        p.addItem(target)
        title = getattr(r, "group_title", "")
        which = f" · KV-cache group {r.group} ({html.escape(title)})" if title else ""
        took = "saved in the snapshot" if getattr(r, "saved_only", False) else f"computed in {r.seconds:.1f} s"
        head = (f"{html.escape(str(r.source))}{which}: {r.accesses:,} reads, {r.counted:,} counted, {r.distinct:,} "
                f"distinct blocks; {took}. Dashed red: the 75 % target.")
        if view == 0:
            p.setLogMode(x=True, y=False)
            p.setLabel("bottom", f"device capacity ({unit}, log scale)")
            for label, caps, hit, exact in r.curves:
                colour = COLOURS.get(label.split("(")[0], "#c8ccd4")
                p.plot(caps * scale, 100 * np.asarray(hit), pen=pg.mkPen(colour, width=2 if exact else 1.5),
                       name=label)
            conf = getattr(r, "configured", None)
            if conf is not None:
                ok = np.isfinite(np.asarray(conf.hit_rate, dtype=float))
                p.plot(np.asarray(conf.capacities)[ok] * scale, 100 * np.asarray(conf.hit_rate)[ok],
                       pen=pg.mkPen(CONFIGURED_COLOUR, width=3), symbol="o", symbolSize=5,
                       symbolBrush=CONFIGURED_COLOUR, name="engine as configured")
            p.addItem(pg.InfiniteLine(pos=_log(r.current_blocks * scale), angle=90,
                                      pen=pg.mkPen("#e0e0e0", width=1, style=QtCore.Qt.DotLine)))
            key = " ".join(f"<span style='color:{COLOURS.get(lab.split('(')[0], '#c8ccd4')}'>&#9632;</span> "
                           f"{html.escape(lab)}{'' if ex else ' ~'}" for lab, _, _, ex in r.curves)
            if conf is not None:
                key = (f"<span style='color:{CONFIGURED_COLOUR}'>&#9632;</span> engine as configured "
                       f"({html.escape(conf.policy)}; first reads) &nbsp; " + key + " (each policy alone, first reads)")
            lines = "<br>".join(html.escape(x) for x in r.lines)
            self._say(f"{key} &nbsp; dotted: now ({r.current_blocks:,} blocks)<br>{lines}<br>"
                      f"<small>{head}</small>")
        elif view == 1:
            p.setLogMode(x=True, y=False)
            p.setLabel("bottom", "device capacity (MiB, log scale)")
            if not r.block_sizes and getattr(r, "saved_only", False):
                self._say(f"no data: a snapshot carries the capacity curves only<br><small>{head}</small>")
                return
            if not r.block_sizes:
                self._say("no data: re-cutting block sizes needs a trace recorded by this version (it records the "
                          f"tokens) from the live engine<br><small>{head}</small>")
                return
            parts = []
            for (bs, mib, hit), colour in zip(r.block_sizes, SIZE_COLOURS):
                p.plot(np.asarray(mib), 100 * np.asarray(hit), pen=pg.mkPen(colour, width=2))
                parts.append(f"<span style='color:{colour}'>&#9632;</span> block {bs}")
            if r.block_mib:
                p.addItem(pg.InfiniteLine(pos=_log(r.current_blocks * r.block_mib), angle=90,
                                          pen=pg.mkPen("#e0e0e0", width=1, style=QtCore.Qt.DotLine)))
            self._say(" ".join(parts) + " &nbsp; (LRU, the same MiB hold fewer, larger blocks; dotted: the current "
                      f"budget)<br><small>{head}</small>")
        else:
            p.setLogMode(x=True, y=False)
            p.setLabel("bottom", "demote_after_s (s, log scale)")
            if r.thresholds is None and getattr(r, "saved_only", False):
                self._say(f"no data: a snapshot carries the capacity curves only<br><small>{head}</small>")
                return
            if r.thresholds is None:
                self._say(f"no data: a block-hash trace has no read times to idle on<br><small>{head}</small>")
                return
            secs, hit = r.thresholds
            p.plot(np.asarray(secs), 100 * np.asarray(hit), pen=pg.mkPen(COLOURS["lru"], width=2), symbol="o",
                   symbolSize=5)
            if r.demote_after_s:
                p.addItem(pg.InfiniteLine(pos=_log(r.demote_after_s), angle=90,
                                          pen=pg.mkPen("#e0e0e0", width=1, style=QtCore.Qt.DotLine)))
            self._say(f"LRU at the current capacity ({r.current_blocks:,} blocks) if a block idle longer than the "
                      f"threshold were demoted (a device miss when read again); dotted: the current "
                      f"demote_after_s<br><small>{head}</small>")
