"""The health strip at the top of the window: the MemOS design's three monitoring targets (prefix hit rate, block
utilization, eviction rate) over the last 5 s and since start, each green, amber or red against its target, and the
troubleshooting checklist in a word (leaks, the eviction check, lock wait, bandwidth, throughput drops).

What each figure counts is engine/telemetry/health.py's; the strip reads Snapshot.health only. It is painted in one
widget of a fixed height, so a new value repaints the strip and re-lays out nothing. Clicking a chip asks the window
for the panel that explains it (`linkActivated`: the figure's name, or "checklist").
"""

from __future__ import annotations

import math

from PySide6 import QtCore, QtGui, QtWidgets

from engine.telemetry.health import MEANING, HealthTargets, grades

GRADE_COLOURS = {"green": "#66bb6a", "amber": "#ffb300", "red": "#ef5350", "none": "#78909c"}
TEXT, DIM, BOX, EDGE = "#c8ccd4", "#8a9099", "#1b1e23", "#2f353e"
PAD = 24  # a chip's dot and margins: 18 px before its text, 6 after
CHIPS = ("prefix_hit_rate", "block_utilization", "eviction_rate", "checklist")
TITLES = {"prefix_hit_rate": "prefix hit", "block_utilization": "block util", "eviction_rate": "evictions",
          "checklist": "checks"}
LINKS = {"prefix_hit_rate": "the Hit rate panel (its prefix lines)",
         "block_utilization": "the block map in fill mode (tokens / block size per block)",
         "eviction_rate": "the Diagnostics tab (evictions by tier)", "checklist": "the Diagnostics tab"}


def pct(x, short: bool = False) -> str:
    if x is None or not isinstance(x, (int, float)) or not math.isfinite(x):
        return "no data"
    return f"{100 * x:.0f} %" if short else f"{100 * x:.1f} %"


def ms(x, short: bool = False) -> str:
    if x is None or not math.isfinite(x):
        return "no data"
    if short:
        return f"{1e3 * x:.3g} ms" if x < 1 else f"{x:.3g} s"
    return f"{1e3 * x:.2f} ms" if x < 0.1 else f"{x:.2f} s"


def checklist_grade(h: dict) -> str:
    """Red: a leak; amber: an eviction warning or a throughput drop in the last minute; green: checked, nothing
    found; none: nothing checked yet."""
    leaks = h.get("leaks", {})
    if leaks.get("blocks"):
        return "red"
    drops = h.get("throughput", {}).get("last_drops", [])
    recent = drops and isinstance(drops[-1], dict) and h.get("now") is not None and h["now"] - drops[-1]["t"] < 60
    if h.get("eviction_check", {}).get("warning") or recent:
        return "amber"
    return "green" if leaks.get("checks") else "none"


class HealthStrip(QtWidgets.QWidget):
    """Four chips: the three targets and the checklist. `segments(name)` is what a chip says, (text, colour) parts."""

    linkActivated = QtCore.Signal(str)

    def __init__(self, targets: HealthTargets | None = None):
        super().__init__()
        self.targets = targets or HealthTargets()
        self.health: dict = {}
        self._segs: dict[str, list[tuple[str, str]]] = {}
        self._rects: dict[str, QtCore.QRectF] = {}
        self.room = 1200
        self._font = QtGui.QFont(self.font())
        self._font.setPointSize(8)
        self._bold = QtGui.QFont(self._font)
        self._bold.setBold(True)
        fm = QtGui.QFontMetrics(self._font)
        self.setFixedHeight(fm.height() + 10)
        self.setSizePolicy(QtWidgets.QSizePolicy.Ignored, QtWidgets.QSizePolicy.Fixed)
        self.setMouseTracking(True)
        self.setCursor(QtCore.Qt.PointingHandCursor)
        self._build()

    def sizeHint(self) -> QtCore.QSize:
        """All the room the menu bar has right of its menus (the chips start there)."""
        return QtCore.QSize(max(self.room, 200), self.height())

    def set_room(self, px: int) -> None:
        """The width the menu bar has right of its menus (the window says so when it is resized)."""
        if px != self.room:
            self.room = px
            self.updateGeometry()

    def minimumSizeHint(self) -> QtCore.QSize:
        return QtCore.QSize(200, self.height())

    # -- data -----------------------------------------------------------------------------------
    def set_targets(self, targets: HealthTargets) -> None:
        self.targets = targets
        self._build()

    def update_snapshot(self, snap) -> None:
        self.health = {**snap.health, "now": snap.t} if snap.health else {}
        self._build()

    def grade(self, name: str, key: str = "w") -> str:
        if name == "checklist":
            return checklist_grade(self.health)
        return grades(self.health, self.targets)[name][key]

    def segments(self, name: str) -> list[tuple[str, str]]:
        return self._segs[name]

    def text(self, name: str) -> str:
        return "".join(t for t, _ in self._segs[name])

    def _target(self, name: str) -> str:
        """The target as the strip writes it, tight: "≥75%" (the tooltip says "≥ 75 %")."""
        return self.targets.describe(name).replace(" ", "")

    def _build(self) -> None:
        h, g = self.health, grades(self.health, self.targets)
        c = lambda name, k: GRADE_COLOURS[g[name][k]]  # noqa: E731
        segs = {}
        def values(name: str, fig: dict) -> list[tuple[str, str]]:
            if g[name]["w"] == g[name]["all"] == "none":  # nothing counted yet: said once
                return [("no data", GRADE_COLOURS["none"])]
            return [(pct(fig.get("w")), c(name, "w")), (" 5 s · ", DIM), (pct(fig.get("all")), c(name, "all")),
                    (" all", DIM)]

        for name in ("prefix_hit_rate", "eviction_rate"):
            segs[name] = [(TITLES[name] + " ", TEXT), (self._target(name) + "  ", DIM),
                          *values(name, h.get(name, {}))]
        u = h.get("block_utilization", {})
        host = u.get("tiers", {}).get("host", {})
        host_grade = GRADE_COLOURS[self.targets.grade("block_utilization", host.get("w", math.nan))]
        segs["block_utilization"] = [
            (TITLES["block_utilization"] + " ", TEXT), (self._target("block_utilization") + "  ", DIM),
            ("dev ", DIM), *values("block_utilization", u), (" · host ", DIM), (pct(host.get("w")), host_grade)]
        leaks = h.get("leaks", {})
        lock = h.get("lock_wait", {}).get("step", {})
        bw = h.get("bandwidth", {})
        tp = h.get("throughput", {})
        drops = tp.get("drops") if tp.get("checks") or tp.get("drops") else None  # None: not checked yet
        stepped = bool(h.get("eviction_check", {}).get("steps"))
        n_leaks = leaks.get("blocks", 0)
        segs["checklist"] = [
            ("leaks " + (str(n_leaks) if leaks.get("checks") else "no data"),
             GRADE_COLOURS["red" if n_leaks else "green" if leaks.get("checks") else "none"]),
            (" · evict " + ("stalled" if h.get("eviction_check", {}).get("warning") else "ok" if stepped else "no data"),
             GRADE_COLOURS["amber" if h.get("eviction_check", {}).get("warning") else "green" if stepped else "none"]),
            (f" · lock {ms(lock.get('p99_s'), short=True)}", TEXT),
            (f" · BW {pct(bw.get('w'), short=True)}", TEXT),
            (f" · drops {drops if drops is not None else 'no data'}",
             GRADE_COLOURS["amber" if drops else "green" if drops is not None else "none"])]
        self._segs = segs
        self.update()

    # -- painting -------------------------------------------------------------------------------
    def _layout(self) -> dict[str, QtCore.QRectF]:
        fm, fb = QtGui.QFontMetrics(self._font), QtGui.QFontMetrics(self._bold)
        x, out = 4.0, {}
        for name in CHIPS:
            w = PAD + sum((fb if i == 0 and name != "checklist" else fm).horizontalAdvance(t)
                          for i, (t, _) in enumerate(self._segs[name]))
            w = min(w, max(self.width() - x - 4, 40))
            out[name] = QtCore.QRectF(x, 3, w, self.height() - 6)
            x += w + 4
        return out

    def natural_width(self, segs: dict | None = None) -> int:
        """The width every chip needs whole."""
        fm, fb = QtGui.QFontMetrics(self._font), QtGui.QFontMetrics(self._bold)
        segs = self._segs if segs is None else segs
        return int(4 + sum(PAD + 4 + sum((fb if i == 0 and name != "checklist" else fm).horizontalAdvance(t)
                                         for i, (t, _) in enumerate(chip)) for name, chip in segs.items()))

    def paintEvent(self, event) -> None:
        p = QtGui.QPainter(self)
        p.fillRect(self.rect(), QtGui.QColor("#15181d"))
        p.setRenderHint(QtGui.QPainter.Antialiasing)
        fm = QtGui.QFontMetrics(self._font)
        self._rects = self._layout()
        for name, r in self._rects.items():
            if r.left() >= self.width() - 8:
                continue
            p.setPen(QtGui.QColor(EDGE))
            p.setBrush(QtGui.QColor(BOX))
            p.drawRoundedRect(r, 4, 4)
            p.setPen(QtCore.Qt.NoPen)
            p.setBrush(QtGui.QColor(GRADE_COLOURS[self.grade(name)]))
            p.drawEllipse(QtCore.QPointF(r.left() + 9, r.center().y()), 4, 4)
            p.save()
            p.setClipRect(r.adjusted(0, 0, -4, 0))
            x = r.left() + 18
            y = r.center().y() + fm.ascent() / 2 - 1
            for i, (text, colour) in enumerate(self._segs[name]):
                font = self._bold if i == 0 and name != "checklist" else self._font
                p.setFont(font)
                p.setPen(QtGui.QColor(colour))
                p.drawText(QtCore.QPointF(x, y), text)
                x += QtGui.QFontMetrics(font).horizontalAdvance(text)
            p.restore()
        p.end()

    def chip_at(self, pos: QtCore.QPointF) -> str:
        for name, r in (self._rects or self._layout()).items():
            if r.contains(pos):
                return name
        return ""

    def mousePressEvent(self, event) -> None:
        name = self.chip_at(event.position())
        if name:
            self.linkActivated.emit(name)

    def event(self, event) -> bool:
        if event.type() == QtCore.QEvent.ToolTip:
            name = self.chip_at(event.position() if hasattr(event, "position") else QtCore.QPointF(event.pos()))
            if name:
                QtWidgets.QToolTip.showText(event.globalPos(), self.tooltip(name), self)
            else:
                QtWidgets.QToolTip.hideText()
            return True
        return super().event(event)

    def tooltip(self, name: str) -> str:
        """What the chip counts, exactly, its target and colours, and where a click goes."""
        t = self.targets
        colours = ("green: meets the target; amber: misses it by less than 10 points; red: by more; grey: no data "
                   "(nothing counted)")
        h = self.health
        if name == "prefix_hit_rate":
            f = h.get("prefix_hit_rate", {})
            body = (f"prefix hit rate = {MEANING['prefix_hit_rate']}.\nSince start: {f.get('reused', 0):,} of "
                    f"{f.get('prompt_tokens', 0):,} prompt tokens reused. Target {t.describe(name)}.")
        elif name == "block_utilization":
            u = h.get("block_utilization", {})
            tiers = u.get("tiers", {})
            lines = [f"{k}: {pct(v.get('w'))} over 5 s, {pct(v.get('all'))} since start ({v.get('tokens', 0):,} "
                     f"tokens in {v.get('capacity_tokens', 0):,} slots now)" for k, v in tiers.items()]
            groups = [f"{gr['title']}: device {pct(gr.get('device'))}, host {pct(gr.get('host'))}"
                      for gr in u.get("groups", []) if gr.get("title")]
            body = (f"block utilization = {MEANING['block_utilization']}: the internal fragmentation the block size "
                    f"({u.get('block_size', '?')} tokens) costs.\n" + "\n".join(lines + groups)
                    + f"\nTarget {t.describe(name)} (the device tier's colours the chip).")
        elif name == "eviction_rate":
            e = h.get("eviction_rate", {})
            d = e.get("device", {})
            body = (f"eviction rate = {MEANING['eviction_rate']}.\nLast 5 s: {e.get('evicted_w', 0):,} evicted ÷ "
                    f"{e.get('allocated_w', 0):,} allocated; since start: {e.get('evicted', 0):,} ÷ "
                    f"{e.get('allocated', 0):,}. Device tier: {d.get('to_host', 0):,} blocks evicted to the host tier "
                    f"(kept, not counted as evicted), {d.get('dropped', 0):,} dropped. Target {t.describe(name)}.")
        else:
            body = ("The MemOS troubleshooting checklist: leaks = " + MEANING["leaks"] + "; evictions stalled = "
                    + MEANING["eviction_check"] + "; lock p99 = "
                    "the engine step's wait for the engine lock, p99 of the last 1000 steps; BW = a decode step's "
                    "bytes ÷ time as a share of the peak, median over 5 s; drops = throughput drops of more than "
                    "30 % against the last minute's median.")
            colours = "red: a leak; amber: an eviction warning or a throughput drop in the last minute; green: checked"
        return f"{body}\n{colours}\nClick: {LINKS[name]}."
