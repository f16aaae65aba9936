"""The What if tab's prediction kept when the user applies a device-budget change: a mark on the hit-rate chart
(predicted prefix / keys, and what was measured since the change), in the event log with the same numbers; a
change of another knob gets none. A real engine (tiny model) behind the window, offscreen."""

from __future__ import annotations

import math

import numpy as np
import pytest

from app.window.runner import EngineRunner
from engine.config import CacheConfig, EngineOptions
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from tiny_models import prompts

pytest.importorskip("PySide6")

from ui.charts.prediction import pct  # noqa: E402
from ui.panels.what_if_data import ConfiguredPrediction, SavedResult  # noqa: E402


@pytest.fixture
def window(qtbot, runner):
    from ui.main_window import MainWindow

    win = MainWindow(runner, confirm_lossy=lambda dtype: True)
    qtbot.addWidget(win)
    win.resize(1280, 720)
    win.show()
    return win


def configured(recorded: int) -> ConfiguredPrediction:
    """A prediction whose rates differ at every capacity (so reading it at the wrong one shows)."""
    caps = np.array(sorted({max(1, recorded // 4), max(2, recorded // 2), recorded, 2 * recorded, 4 * recorded,
                            8 * recorded}), dtype=np.int64)
    frac = np.linspace(0.0, 1.0, len(caps))
    return ConfiguredPrediction("heat", "heat (decay 0.9/s), evict batch 8, ...", recorded, caps,
                                hit_rate=0.2 + 0.7 * frac, prefix_rate=0.1 + 0.6 * frac ** 0.5,
                                device_rate=0.5 + 0.45 * frac, measured={})


def hold_prediction(window, runner) -> ConfiguredPrediction:
    cap = runner.engine.pool.sizes.dev_cap
    conf = configured(cap)
    window.what_if.show_result([SavedResult("recorded from this engine", 100, 80, 40, cap, None,
                                            lines=["engine as configured ..."], configured=conf)])
    return conf


def prediction_logs(window) -> list[str]:
    return [text for _, kind, text in window.events.events if kind == "config_whatif"]


def test_a_budget_change_keeps_the_prediction_beside_what_was_measured_since(qtbot, window, runner):
    window.refresh_all()
    conf = hold_prediction(window, runner)
    chart = window.hit.rates
    assert chart.prediction is None
    assert window.controls.apply("device_budget_mb", 0.5)
    window.refresh_all()
    cap = runner.engine.pool.sizes.dev_cap
    pred = window.prediction
    assert pred is not None and pred.capacity == cap and cap != conf.recorded_capacity
    prefix, keys = conf.at(cap, "prefix_rate"), conf.at(cap, "device_rate")
    assert (pred.prefix, pred.keys) == (prefix, keys)
    # The mark: at the change (the engine's config mark's time), levels at the predicted rates, the label.
    snap = window.snapshot
    assert chart.prediction.ago == pytest.approx(snap.last_change["t"] - snap.t)
    assert [v for v, _ in chart.prediction.levels] == [prefix, keys]
    head = f"predicted prefix {100 * prefix:.1f} % · keys {100 * keys:.1f} % | now"
    short = f"pred {100 * prefix:.1f} % · {100 * keys:.1f} % | now"
    assert "".join(t for t, _ in chart.prediction.parts) == head + " no data"  # nothing counted since the change
    assert chart.prediction_text() in (head + " no data", short + " no data")  # the short one where it is narrow
    tip = chart.prediction.tip
    assert "prompt tokens served from the prefix cache, as a share of all prompt tokens" in tip
    assert "keys attention read straight from the device tier, as a share of all keys read" in tip
    assert "What if tab's trace" in tip and f"{cap:,} blocks" in tip
    assert any(line.startswith(head) and f"at {cap:,} device blocks" in line for line in prediction_logs(window))
    # Its label inside the plot, clear of the config mark's label.
    box, _ = chart.prediction_label()
    assert chart._rect.contains(box)
    assert not any(box.intersects(b) for b, _, _ in chart.mark_labels())
    assert chart.legend_tip(box.center()) == tip  # the label's tooltip says what is counted

    for p in prompts(30, [40, 25]):
        runner.engine.add_request(p, SamplingParams(max_new_tokens=8, ignore_eos=True))

    def measured() -> bool:
        window.refresh_all()
        return math.isfinite(pred.now_prefix) and math.isfinite(pred.now_keys)

    qtbot.waitUntil(measured, timeout=20_000)
    now = f" {pct(pred.now_prefix)} · {pct(pred.now_keys)}"
    assert chart.prediction_text() in (head + now, short + now) and "no data" not in chart.prediction_text()
    # Kept across frames: the same prediction, its line moving left as time passes.
    window.refresh_all()
    assert window.prediction is pred and chart.prediction.ago < 0


def test_another_knob_gets_no_prediction_and_ends_the_one_shown(qtbot, window, runner):
    window.refresh_all()
    hold_prediction(window, runner)
    assert window.controls.apply("device_budget_mb", 0.5)
    window.refresh_all()
    assert window.hit.rates.prediction is not None
    first = window.prediction
    assert window.controls.apply("evict_batch", 16)
    window.refresh_all()
    assert window.prediction is None and window.hit.rates.prediction is None
    assert window.hit.rates.prediction_text() == ""
    logs = prediction_logs(window)
    assert any("until the next change" in line and f"#{first.n}:" in line for line in logs)
    # The tab's trace was rerun with the old evict batch: a later budget change gets no prediction either.
    assert window.controls.apply("device_budget_mb", 0.4)
    window.refresh_all()
    assert window.prediction is None and window.hit.rates.prediction is None
    assert "no What-if prediction" in prediction_logs(window)[-1]


def test_a_budget_change_without_a_what_if_result_gets_no_mark(qtbot, window, runner):
    window.refresh_all()
    assert window.controls.apply("device_budget_mb", 0.5)
    window.refresh_all()
    assert window.prediction is None and window.hit.rates.prediction is None and not prediction_logs(window)
