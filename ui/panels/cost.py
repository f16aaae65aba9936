"""What the present config costs, beside what it cost before the last change: the numbers a tuner compares.

Two columns from the snapshot's counters: since the engine started, and since the last config change: the
difference from the counters the engine kept when it applied that change (Snapshot.last_change), so the column
is right whether or not the panel was on screen then, and in a reopened snapshot file. "—" where nothing was
counted: a rate with nothing to divide by is no data, not 0.
"""

from __future__ import annotations

import math

from PySide6 import QtCore, QtWidgets

from engine.telemetry.snapshot import Snapshot
from ui.panels import kv_cost
BASE = ("read_tokens", "read_tokens_missed", "read_tokens_streamed", "streamed_bytes", "promoted_bytes", "demoted_bytes", "generated",
        "preemptions", "promote_stall_s", "steps", "shadow_steps", "shadow_flips", "shadow_kld_sum")

# (label, tooltip): what each row counts.
ROWS = (
    ("device hit (keys)", "keys attention read straight from the device tier (in blocks that were there when their "
                          "step began, or written there), as a share of all keys read; a block promoted for the "
                          "step, or read or written on the host tier, is a miss for each of its keys"),
    ("streamed from host", "keys attention read from the host tier where they are (not promoted first), as a share "
                           "of all keys read"),
    ("streamed MiB / token", "MiB (2**20 bytes) of host blocks copied, as stored, to the compute device's staging a "
                             "layer ahead to be read there, per generated token (— with host_reads = compute: those "
                             "keys are attended on the host)"),
    ("promoted MiB / token", "MiB (2**20 bytes) copied host -> device per generated token"),
    ("demoted MiB / token", "MiB (2**20 bytes) copied device -> host per generated token"),
    ("promotion stall", "seconds steps spent copying their blocks to the device tier before running (on CUDA: "
                        "issuing the copies), per step"),
    ("preempted", "preempt events (each one line in Events): a running sequence stopped to make room (its blocks "
                  "swapped to the host tier or dropped), or a paused or waiting sequence's K/V dropped because "
                  "neither tier had room for it (it recomputes when it runs again)"),
    ("TTFT p50 / p95", "seconds from a request's arrival to its first token, over the engine's newest requests "
                       "(not split at config changes)"),
    ("waiting / running", "sequences queued for admission / admitted, now"),
    ("shadow KLD (mean)", "KL(reference ‖ engine) in nats of the next-token distribution, averaged over the shadow "
                          "steps (one running sequence's step recomputed with lossless fp32 K/V every shadow_every_s "
                          "seconds); — where there was none (shadow_every_s = 0: off)"),
    ("top-1 flips", "shadow steps whose top-1 token differed from the lossless reference's, as a share of the "
                    "shadow steps (and how many of how many); — where there was none"),
)


def _pct(x: float) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{100 * x:.1f} %"


def _f(x: float, fmt: str) -> str:
    return "—" if x is None or not math.isfinite(x) else format(x, fmt)


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def cells(c: dict) -> list[str]:
    """One column: the rows' values from counters (or counter differences) c."""
    return [
        _pct(1 - _ratio(c["read_tokens_missed"], c["read_tokens"])) if c["read_tokens"] else "—",
        _pct(_ratio(c["read_tokens_streamed"], c["read_tokens"])),
        _f(_ratio(c["streamed_bytes"] / 2**20, c["generated"]), ".3f") if c.get("streamed_bytes") else "—",
        _f(_ratio(c["promoted_bytes"] / 2**20, c["generated"]), ".3f"),
        _f(_ratio(c["demoted_bytes"] / 2**20, c["generated"]), ".3f"),
        _f(_ratio(c["promote_stall_s"] * 1e3, c["steps"]), ".2f") + (" ms/step" if c["steps"] else ""),
        str(int(c["preemptions"])),
        "", "",  # TTFT and waiting / running: not split at changes, filled in by the panel
        _f(_ratio(c["shadow_kld_sum"], c["shadow_steps"]), ".2e"),
        f"{_pct(_ratio(c['shadow_flips'], c['shadow_steps']))} ({int(c['shadow_flips'])} / {int(c['shadow_steps'])})"
        if c["shadow_steps"] else "—",
    ]


def _value(text: str) -> str:
    """A knob value as events label it, numbers short ("48.0" -> "48")."""
    try:
        return format(float(text), "g")
    except ValueError:
        return text


def change_text(snap: Snapshot) -> str:
    """What the second column counts from: the last change, named (knob old -> new), and how long ago."""
    last = snap.last_change
    if not last:
        n = int(snap.counters.get("config_changes", 0) or 0)
        if n:  # a file from before the counters at a change were kept
            return (f"{n} config change(s), not recorded with their counters (an older snapshot file): the second "
                    "column counts from the start")
        return "no config change yet: both columns count from the engine's start"
    before = last.get("before", {})
    diff = ", ".join(f"{k} {_value(before[k])} -> {_value(v)}" if k in before else f"{k} -> {_value(v)}"
                     for k, v in last["changes"].items())
    ago = snap.t - last["t"]
    return (f"last change (#{last['n']}, {ago:.0f} s ago): {diff or 'none'}" + (" (lossy)" if last.get("lossy") else ""))


VALUE_SAMPLE = "9.999 / 99.99 s"  # the widest a value cell gets in practice (TTFT; a wider one may widen the tab)
ROW_TTFT = [name for name, _ in ROWS].index("TTFT p50 / p95")
ROW_WAIT = [name for name, _ in ROWS].index("waiting / running")


class CostPanel(QtWidgets.QWidget):
    def __init__(self):
        super().__init__()
        self.grid = QtWidgets.QGridLayout(self)
        self.grid.setContentsMargins(6, 4, 6, 4)
        self.grid.setVerticalSpacing(1)  # every row, the key channels' included, shows at 1280 x 720
        heads = ("", "since start", "since last change")
        for j, h in enumerate(heads):
            lab = QtWidgets.QLabel(f"<b>{h}</b>")
            self.grid.addWidget(lab, 0, j)
        self.values: list[list[QtWidgets.QLabel]] = []
        for i, (name, tip) in enumerate(ROWS, start=1):
            lab = QtWidgets.QLabel(name)
            lab.setToolTip(tip)
            self.grid.addWidget(lab, i, 0)
            row = []
            for j in (1, 2):
                v = QtWidgets.QLabel("—")
                v.setToolTip(tip)
                v.setAlignment(QtCore.Qt.AlignRight | QtCore.Qt.AlignVCenter)
                # As wide as the widest value it shows, from the start: a value that grew the panel widened
                # its tab's place and narrowed the charts beside it when the tab came to the front.
                v.setMinimumWidth(v.fontMetrics().horizontalAdvance(VALUE_SAMPLE) + 4)
                self.grid.addWidget(v, i, j)
                row.append(v)
            self.values.append(row)
        self.changed = QtWidgets.QLabel("")
        self.changed.setWordWrap(True)
        self.grid.addWidget(self.changed, len(ROWS) + 1, 0, 1, 3)
        self.outliers = QtWidgets.QLabel("")
        self.outliers.setTextFormat(QtCore.Qt.RichText)
        self.outliers.setWordWrap(True)
        self.outliers.setToolTip(kv_cost.OUTLIER_TIP)
        self.outliers.setStyleSheet("font-size: 8pt;")
        self.grid.addWidget(self.outliers, len(ROWS) + 2, 0, 1, 3)
        self.grid.setRowStretch(len(ROWS) + 3, 1)

    def update_snapshot(self, snap: Snapshot) -> None:
        c = {k: float(snap.counters.get(k, 0) or 0) for k in BASE}
        last = snap.last_change
        base = {k: float(last["counters"].get(k, 0) or 0) for k in BASE} if last else {k: 0.0 for k in BASE}
        self.changed.setText(change_text(snap))
        since = {k: c[k] - base[k] for k in BASE}
        for row, a, b in zip(self.values, cells(c), cells(since)):
            row[0].setText(a)
            row[1].setText(b)
        k = snap.counters
        ttft = f"{_f(k.get('ttft_p50', math.nan), '.3f')} / {_f(k.get('ttft_p95', math.nan), '.3f')} s"
        self.values[ROW_TTFT][0].setText(ttft)
        self.values[ROW_TTFT][1].setText("")
        self.values[ROW_WAIT][0].setText(f"{int(k.get('waiting', 0))} / {int(k.get('running', 0))}")
        self.values[ROW_WAIT][1].setText("")
        text, tip = kv_cost.outliers_text(snap)
        self.outliers.setText(text)
        self.outliers.setToolTip(tip)
