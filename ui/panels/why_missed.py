"""Why tokens missed (engine/kv/misses.py): stacked bars of the reasons, over the last 5 s and since the engine
started, for the prompt tokens a prefix-cache lookup did not serve and for the keys attention did not read straight
from the device tier. Each bar is its misses split by reason (the segments add up to the bar's count exactly); "no
data" where nothing was looked up or read, "no misses" where nothing missed. Painted, from the snapshot's counters
(since start) and windowed figures (last 5 s): no engine object is read.

With KV-cache groups, one more bar per group (since start): the prompt tokens whose miss that group's missing block
caused and that group's own key reads, by reason (partial and preempted belong to a sequence, not to a group). The
group bars share one scale, so the group that costs the most misses has the longest bar.
"""

from __future__ import annotations

import math

from PySide6 import QtCore, QtGui, QtWidgets

from engine.kv.misses import LEDGER_CAP, PROMPT_REASONS, READ_REASONS, counter_name
from engine.telemetry.snapshot import Snapshot

COLOURS = {"cold": "#7986cb", "evicted": "#e57373", "partial": "#ffb74d", "diverged": "#ba68c8",
           "reconfigured": "#4db6ac", "preempted": "#f06292",
           "demoted-idle": "#64b5f6", "capacity": "#ef5350", "promoted": "#aed581", "streamed": "#ffd54f"}

MEANING = {
    "cold": "no block with this chained hash was ever stored (or the ledger forgot it: it keeps the newest "
            f"{LEDGER_CAP:,} hashes per pool)",
    "evicted": "its block was stored, then evicted (by the eviction policy, to make room)",
    "partial": "in the block holding the prompt's last token: a tail never filled, or a full last block, which the "
               "cache never serves because the last token is always computed (what the block size costs)",
    "diverged": "never stored, but a block after the same prefix was: the prompt diverges from a cached one here",
    "reconfigured": "its block was stored, then dropped by a config change (a re-lay, a budget change, a reset)",
    "preempted": "the sequence computed it before and lost its K/V to a preemption; it recomputes it",
    "demoted-idle": "its block went to the host tier after idling past demote_after_s",
    "capacity": "its block went to the host tier for want of device room (written there, demoted for room, "
                "evicted to the host tier or swapped out)",
    "promoted": "promoted for the step from the host tier, where a re-lay or a budget change had put its block",
    "streamed": "read where it sits on the host tier (host_reads stream or compute)",
}

BARS = (  # (title, reasons, total counter, served counter or None, missed counter)
    ("prompt", PROMPT_REASONS, "lookup_tokens", "lookup_served", None),
    ("keys", READ_REASONS, "read_tokens", None, "read_tokens_missed"),
)
SCOPES = (("last 5 s", "windowed"), ("since start", "counters"))

GROUP_SCOPE = "since start"

TIP = ("Why tokens missed. Prompt tokens: every admission of a sequence holding no blocks looks its tokens up in "
       "the prefix cache; each token not served has one reason. Key reads: each key attention read not straight "
       "from the device tier (its block was on the host tier when the step began, or is there now) has one reason. "
       "Each bar is the misses, split by reason (the segments add up to them); its text, the misses as a share of "
       "the tokens looked up (keys read). With KV-cache groups, one bar per group (since start): the prompt tokens "
       "whose miss the group's missing block caused (the first group lacking a needed block), and the group's own "
       "key reads not from the device tier; partial and preempted misses belong to a whole sequence and are in no "
       "group's bar. Group bars share one scale. Hover a segment for what it counts.")


def _num(d: dict, k: str) -> float:
    v = d.get(k)
    return float(v) if isinstance(v, (int, float)) else math.nan


def bars(snap: Snapshot) -> list[dict]:
    """One bar per (scope, kind): its title, total counted, missed, and (reason, tokens) segments; missed is NaN
    where nothing was counted (no data)."""
    out = []
    for scope, field in SCOPES:
        src = getattr(snap, field) or {}
        for title, reasons, total_k, served_k, missed_k in BARS:
            total = _num(src, total_k)
            missed = total - _num(src, served_k) if served_k else _num(src, missed_k)
            segs = [(r, _num(src, counter_name(r))) for r in reasons]
            if not (total > 0) or any(math.isnan(n) for _, n in segs):
                missed = math.nan
            out.append({"scope": scope, "title": title, "total": total, "missed": missed,
                        "segments": [(r, int(n)) for r, n in segs if n == n and n > 0]})
    for g in snap.kv_groups:
        why = g.get("why_missed") or {}
        segs = [(r, int(why[r])) for r in PROMPT_REASONS + READ_REASONS if why.get(r)]
        out.append({"scope": GROUP_SCOPE, "title": g["title"], "total": math.nan, "group": True,
                    "missed": float(sum(n for _, n in segs)) if "why_missed" in g else math.nan, "segments": segs})
    return out


class WhyMissedPanel(QtWidgets.QWidget):
    """Four stacked bars (prompt tokens and key reads, last 5 s and since start) and the reasons' legend."""

    ROW_H = 22

    def __init__(self):
        super().__init__()
        self.setToolTip(TIP)
        self.setMouseTracking(True)
        self._bars: list[dict] = []
        self._hits: list[tuple[QtCore.QRectF, str]] = []  # painted segments and what each says on hover
        self.setMinimumSize(200, 4 * self.ROW_H + 3 * 18 + 16)  # the bars and a legend of up to three lines

    def update_snapshot(self, snap: Snapshot) -> None:
        self._bars = bars(snap)
        self.update()

    def texts(self) -> list[str]:
        """Each bar as one line (what the panel shows; tests read it)."""
        out = []
        for b in self._bars:
            head = f"{b['title']} · {b['scope']}: "
            if math.isnan(b["missed"]):
                out.append(head + "no data")
            elif b.get("group"):
                parts = ", ".join(f"{r} {n:,}" for r, n in b["segments"])
                out.append(head + (f"{int(b['missed']):,} missed ({parts})" if b["missed"] else "no misses"))
            elif b["missed"] == 0:
                out.append(head + f"no misses of {int(b['total']):,}")
            else:
                parts = ", ".join(f"{r} {n:,}" for r, n in b["segments"])
                out.append(head + f"{int(b['missed']):,} missed of {int(b['total']):,} ({parts})")
        return out

    def paintEvent(self, event) -> None:
        p = QtGui.QPainter(self)
        p.setRenderHint(QtGui.QPainter.Antialiasing, False)
        pal = self.palette()
        text, dim = pal.color(QtGui.QPalette.WindowText), QtGui.QColor("#8a919c")
        fm = p.fontMetrics()
        w = self.width()
        label_w = min(max(fm.horizontalAdvance(f"{b['title']} · {b['scope']}") for b in self._bars) + 10
                      if self._bars else 60, w // 2)
        x0, bar_w = label_w, max(40, w - label_w - 6)
        group_top = max([b["missed"] for b in self._bars if b.get("group") and b["missed"] > 0] + [1.0])
        y = 6
        # Rows shrink (to 14 px) rather than push the legend out when group bars join the four.
        row_h = max(14.0, min(float(self.ROW_H), (self.height() - 3 * (fm.height() + 2) - 18) / max(1, len(self._bars))))
        self._hits = []
        for b in self._bars:
            p.setPen(text)
            label = fm.elidedText(f"{b['title']} · {b['scope']}", QtCore.Qt.ElideRight, label_w - 8)
            p.drawText(QtCore.QRectF(4, y, label_w - 8, row_h), QtCore.Qt.AlignVCenter, label)
            frame = QtCore.QRectF(x0, y + 3, bar_w, row_h - 6)
            p.setPen(dim)
            p.drawRect(frame)
            if math.isnan(b["missed"]) or b["missed"] == 0:
                p.drawText(frame, QtCore.Qt.AlignCenter, "no data" if math.isnan(b["missed"]) else
                           "no misses" if b.get("group") else f"no misses of {int(b['total']):,}")
            else:
                # The bar is the misses; its segments split them by reason. A group's bar: its length is its misses
                # on the scale of the largest group's.
                span = bar_w * (b["missed"] / group_top if b.get("group") else 1.0)
                x = x0
                for reason, n in b["segments"]:
                    seg = span * n / b["missed"]
                    r = QtCore.QRectF(x, y + 3, max(seg, 1.0), row_h - 6)
                    p.fillRect(r, QtGui.QColor(COLOURS[reason]))
                    what = "keys" if b["title"] == "keys" or reason in READ_REASONS else "prompt tokens"
                    whose = f" because of group {b['title']}'s blocks" if b.get("group") else ""
                    self._hits.append((r, f"<b>{reason}</b>: {n:,} {what} missed{whose}, {b['scope']} "
                                          f"({100 * n / b['missed']:.1f} % of the bar's {int(b['missed']):,})"
                                          f"<br>{MEANING[reason]}"))
                    x += seg
                text_x = frame.adjusted(0, 0, -4, 0)
                if b.get("group"):
                    keys = sum(n for r, n in b["segments"] if r in READ_REASONS)
                    label = f"{int(b['missed']) - keys:,} prompt · {keys:,} keys"
                    p.setPen(text if span < bar_w - fm.horizontalAdvance(label) - 8 else QtGui.QColor("#101216"))
                else:
                    label = f"{int(b['missed']):,} missed ({100 * b['missed'] / b['total']:.1f} %)"
                    p.setPen(QtGui.QColor("#101216"))  # dark on the segments' light colours
                p.drawText(text_x, QtCore.Qt.AlignRight | QtCore.Qt.AlignVCenter, label)
            y += row_h
        # Legend: every reason, in its colour.
        y += 6
        x = 4.0
        for reason in PROMPT_REASONS + READ_REASONS:
            tw = fm.horizontalAdvance(reason) + 18
            if x + tw > w:
                x, y = 4.0, y + fm.height() + 2
            p.fillRect(QtCore.QRectF(x, y + 3, 10, 10), QtGui.QColor(COLOURS[reason]))
            p.setPen(text)
            p.drawText(QtCore.QPointF(x + 13, y + fm.ascent()), reason)
            self._hits.append((QtCore.QRectF(x, y, tw, fm.height()), f"<b>{reason}</b>: {MEANING[reason]}"))
            x += tw
        p.end()

    def event(self, e: QtCore.QEvent) -> bool:
        if e.type() == QtCore.QEvent.ToolTip:
            for rect, tip in self._hits:
                if rect.contains(QtCore.QPointF(e.pos())):
                    QtWidgets.QToolTip.showText(e.globalPos(), tip, self)
                    return True
            QtWidgets.QToolTip.showText(e.globalPos(), TIP, self)
            return True
        return super().event(e)
