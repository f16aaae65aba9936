"""The What-if tab's prediction for a device-budget change, kept once the change is applied, beside what was measured
since it: the hit-rate chart marks it (ui/charts/strip_chart.py set_prediction), the event log lists it.

Plain data and text (no Qt): the window (ui/main_window.py) makes one from Snapshot.last_change and the tab's
ConfiguredPrediction (ui/panels/what_if_data.py), and measures it at every snapshot from the counters the engine kept
at the change, so "now" counts from the change on, whether or not the chart was on screen. A rate with nothing
counted since the change is NaN, shown as "no data", never 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ui.panels.what_if_data import ConfiguredPrediction

PREFIX_COLOUR = "#ffb74d"  # the hit-rate chart's prefix lines
KEYS_COLOUR = "#4fc3f7"  # its device (keys read) lines
TEXT_COLOUR = "#c8ccd4"
# The only change a What-if prediction holds for: it reruns the trace with the recorded knobs at other device-tier
# capacities, so any other knob (policy, block size, host budget, ...) makes it a prediction for another engine.
PREDICTED_KNOBS = frozenset({"device_budget_mb"})

PREFIX_MEANING = "prefix: prompt tokens served from the prefix cache, as a share of all prompt tokens"
KEYS_MEANING = "keys: keys attention read straight from the device tier, as a share of all keys read"


def pct(v: float) -> str:
    return "no data" if v is None or not math.isfinite(v) else f"{100 * v:.1f} %"


def since(counters: dict, base: dict) -> tuple[float, float, int, int]:
    """(prefix rate, keys rate, prompt tokens, keys read) counted between `base` (the counters at a change) and
    `counters`; a rate with nothing counted is NaN."""
    def d(k: str) -> float:
        return float(counters.get(k, 0) or 0) - float(base.get(k, 0) or 0)

    prompt, reads = d("prompt_tokens"), d("read_tokens")
    prefix = d("prompt_reused") / prompt if prompt > 0 else math.nan
    keys = 1.0 - d("read_tokens_missed") / reads if reads > 0 else math.nan
    return prefix, keys, int(prompt), int(reads)


@dataclass
class Prediction:
    """What the What-if tab predicted for an applied device-budget change, and what was measured since it.

    t: the change's time (engine clock, as Snapshot.last_change and the chart's marks); n: its number; change: what
    changed ("device_budget_mb 0.3 -> 0.5"); capacity: the device tier's blocks after it, where the prediction is
    read; prefix, keys: the predicted rates (ConfiguredPrediction.at); base: the counters at the change."""
    t: float
    n: int
    change: str
    capacity: int
    recorded_capacity: int
    knobs: str
    prefix: float
    keys: float
    base: dict
    now_prefix: float = math.nan
    now_keys: float = math.nan
    prompt_tokens: int = 0
    keys_read: int = 0

    @classmethod
    def of(cls, configured: ConfiguredPrediction, last_change: dict, capacity: int) -> "Prediction":
        before = last_change.get("before", {})
        change = ", ".join(f"{k} {before[k]} -> {v}" if k in before else f"{k} -> {v}"
                           for k, v in last_change.get("changes", {}).items())
        return cls(float(last_change["t"]), int(last_change.get("n", 0)), change, int(capacity),
                   int(configured.recorded_capacity), configured.knobs, configured.at(capacity, "prefix_rate"),
                   configured.at(capacity, "device_rate"), dict(last_change.get("counters", {})))

    def measure(self, counters: dict) -> bool:
        """The rates since the change, from `counters` (a snapshot's); True if the numbers shown changed."""
        before = self.now_text()
        self.now_prefix, self.now_keys, self.prompt_tokens, self.keys_read = since(counters, self.base)
        return self.now_text() != before

    def now_text(self) -> str:
        if not (math.isfinite(self.now_prefix) or math.isfinite(self.now_keys)):
            return "no data"
        return f"{pct(self.now_prefix)} · {pct(self.now_keys)}"

    def parts(self) -> list[tuple[str, str]]:
        """The chart's label as (text, colour) runs: "predicted prefix X % · keys Y % | now X' % · Y' %", each
        rate in its line's colour."""
        out = [("predicted ", TEXT_COLOUR), (f"prefix {pct(self.prefix)}", PREFIX_COLOUR), (" · ", TEXT_COLOUR),
               (f"keys {pct(self.keys)}", KEYS_COLOUR), (" | now ", TEXT_COLOUR)]
        if self.now_text() == "no data":
            return out + [("no data", TEXT_COLOUR)]
        return out + [(pct(self.now_prefix), PREFIX_COLOUR), (" · ", TEXT_COLOUR), (pct(self.now_keys), KEYS_COLOUR)]

    def short_parts(self) -> list[tuple[str, str]]:
        """The label where the long one does not fit: "pred X % · Y % | now X' % · Y' %"."""
        parts = self.parts()
        return [("pred ", TEXT_COLOUR), (pct(self.prefix), PREFIX_COLOUR)] + parts[2:3] + \
               [(pct(self.keys), KEYS_COLOUR)] + parts[4:]

    def label(self) -> str:
        return "".join(text for text, _ in self.parts())

    def levels(self) -> list[tuple[float, str]]:
        """The predicted rates as (level, colour): short dashed lines from the change on."""
        return [(v, c) for v, c in ((self.prefix, PREFIX_COLOUR), (self.keys, KEYS_COLOUR)) if math.isfinite(v)]

    def tip(self) -> str:
        return (f"What-if prediction for the change applied (#{self.n}: {self.change}), from the What if tab's trace "
                f"rerun as configured ({self.knobs}) and read at the new device-tier capacity, {self.capacity:,} "
                f"blocks (calibrated at the recorded {self.recorded_capacity:,}).\n"
                f"{PREFIX_MEANING}: predicted {pct(self.prefix)}, measured since the change {pct(self.now_prefix)} "
                f"(over {self.prompt_tokens:,} prompt tokens).\n"
                f"{KEYS_MEANING}: predicted {pct(self.keys)}, measured since the change {pct(self.now_keys)} "
                f"(over {self.keys_read:,} keys read).\n"
                "Dashed short lines: the predicted levels from the change on, in the colours of the rates' lines. "
                "\"no data\": nothing counted since the change yet.")

    def log_line(self) -> str:
        """The event log's line when the change is applied: the same numbers the chart shows."""
        return f"{self.label()} (What if tab, at {self.capacity:,} device blocks, for #{self.n}: {self.change})"

    def outcome_line(self) -> str:
        """The event log's line when a newer change ends this one: what was measured against what was predicted."""
        return (f"{self.label()} until the next change (What if tab, at {self.capacity:,} device blocks, for "
                f"#{self.n}: {self.change}; measured over {self.prompt_tokens:,} prompt tokens, {self.keys_read:,} "
                "keys read)")
