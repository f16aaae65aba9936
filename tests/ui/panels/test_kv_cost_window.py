"""What a lossy KV dtype costs, in the window (issue 11): the block map's "kv error" mode and hover, the shadow
chart beside the hit rate, the Cost panel's rows and key-channel table; "no data", never 0, where nothing was
measured."""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import numpy as np
import pytest
from PySide6 import QtGui

from engine.config import CacheConfig, EngineOptions
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from tiny_models import prompts
from ui import palette as pal


def run(model, dtype: str, shadow: float = 0.5, new: int = 10):
    """A snapshot of an engine (simulated clock, a second per reading) with two sequences still running."""
    t = itertools.count(1000.0, 1.0)
    e = Engine(model, CacheConfig(block_size=8, kv_dtype=dtype, shadow_every_s=shadow, demote_after_s=3600),
               EngineOptions(), clock=lambda: next(t))
    for p in prompts(13, [30, 45]):
        e.add_request(p, SamplingParams(max_new_tokens=100))
    for _ in range(new):
        e.step()
    return e.snapshot()


def test_the_kv_error_mode_colours_by_error_and_marks_what_was_not_measured(bm, qtbot, llama_model):
    snap = run(llama_model, "fp8")
    dev = snap.tiers[0]
    used = np.flatnonzero(dev.state > 0)
    assert len(used) >= 4 and np.all(np.isfinite(dev.kerr[used]))
    kerr = dev.kerr.copy()
    kerr[used[0]] = np.nan  # a block whose tokens were not all measured (as after a re-layout)
    verr = dev.verr.copy()
    verr[used[0]] = np.nan
    snap = dataclasses.replace(snap, tiers=(dataclasses.replace(dev, kerr=kerr, verr=verr),) + snap.tiers[1:])
    bm.set_snapshot(snap)
    bm.set_mode("kv error")
    assert bm.mode_box.currentText() == "kv error"
    codes = bm.tier_codes(0).astype(int)
    assert codes[used[0]] == pal.NO_DATA_CODE
    measured = used[1:]
    worst = np.fmax(kerr, verr)[measured]
    c = codes[measured]
    assert np.all(c <= pal.VALUE_MAX) and np.all(np.diff(c[np.argsort(worst)]) >= 0)  # monotone in the error
    assert np.all(codes[snap.tiers[0].state == 0] == pal.FREE_CODE)
    lut = np.asarray(bm.image.lut)
    assert tuple(lut[pal.NO_DATA_CODE]) == pal.NO_DATA and tuple(lut[pal.FREE_CODE]) == pal.FREE
    assert "not measured" in bm.legend.text() and "%" in bm.legend.text()
    # Hover: the block's K and V error in per cent; "not measured" says why; a free block has none.
    qtbot.mouseMove(bm.view.viewport(), bm.cell_pos(0, int(measured[0])))
    qtbot.waitUntil(lambda: "K error" in bm.hover_text, timeout=2000)
    slot = int(re.search(r"slot ([0-9,]+)", bm.hover_text).group(1).replace(",", ""))  # the cell under the mouse
    assert slot in measured
    k, v = float(kerr[slot]), float(verr[slot])
    assert f"K error: {100 * k:.3g} %" in bm.hover_text and f"V error: {100 * v:.3g} %" in bm.hover_text
    assert "not measured" in bm.tooltip_text(0, int(used[0]))
    free = int(np.flatnonzero(snap.tiers[0].state == 0)[0])
    assert "K/V error: —" in bm.tooltip_text(0, free)


def test_fp32_blocks_read_zero_and_say_why(bm, llama_model):
    snap = run(llama_model, "fp32", new=2)
    bm.set_snapshot(snap)
    bm.set_mode("kv error")
    used = int(np.flatnonzero(snap.tiers[0].state > 0)[0])
    assert bm.tier_codes(0)[used] == 0  # the bottom of the colour bar, not "not measured"
    assert "K/V error: 0 (fp32 stores K/V exactly)" in bm.tooltip_text(0, used)
    assert "fp32 is lossless" in bm.legend.text()


def test_a_snapshot_without_errors_draws_no_data(bm, llama_model):
    snap = run(llama_model, "int8", new=2)
    snap = dataclasses.replace(snap, tiers=tuple(dataclasses.replace(t, kerr=None, verr=None) for t in snap.tiers))
    bm.set_snapshot(snap)
    bm.set_mode("kv error")
    used = snap.tiers[0].state > 0
    assert np.all(bm.tier_codes(0)[used] == pal.NO_DATA_CODE)
    assert "not measured" in bm.tooltip_text(0, int(np.flatnonzero(used)[0]))


def test_the_shadow_chart_beside_the_hit_rate(qtbot, llama_model):
    from ui.panels.charts import HitRatePanel

    panel = HitRatePanel()
    qtbot.addWidget(panel)
    panel.resize(420, 420)
    panel.show()
    snap = run(llama_model, "fp8", new=12)
    panel.update_snapshot(snap)
    chart = panel.shadow
    kld = snap.series["shadow_kld"]
    i = int(np.flatnonzero(np.isfinite(kld))[-1])
    ago = float(snap.series["t"][i] - snap.t)
    assert chart.value_at("shadow_kld", ago) == pytest.approx(math.log10(max(kld[i], 1e-6)))
    assert chart.value_format(chart.value_at("shadow_kld", ago)) == f"{max(kld[i], 1e-6):.3g}"
    flips = panel.rates.series["shadow_flip_rate"]
    assert flips.dots and np.isfinite(flips.y).sum() == np.isfinite(kld).sum()
    assert panel.rates.value_at("shadow_flip_rate", ago) == snap.series["shadow_flip_rate"][i]
    # Between shadow steps there is no data, never 0.
    empty = np.flatnonzero(~np.isfinite(kld))
    far = [j for j in empty if np.all(np.abs(snap.series["t"][np.isfinite(kld)] - snap.series["t"][j]) > chart.span / 30)]
    if far:
        assert math.isnan(chart.value_at("shadow_kld", float(snap.series["t"][far[0]] - snap.t)))
    for key in ("shadow_kld", "shadow_logit_err"):
        assert "no dots where there was none" in chart.series[key].tip
    assert "nats" in chart.series["shadow_kld"].tip and "60 s" in flips.tip
    every = snap.quality["shadow_every_s"]
    from ui.panels import kv_cost

    got = kv_cost.measured_interval(snap)
    assert chart.note == ("" if got <= 1.5 * every else f"one every {got:.0f} s (asked {every:g} s)")
    panel.update_snapshot(run(llama_model, "fp8", shadow=0.0, new=2))
    assert chart.note.startswith("off") and np.all(np.isnan(chart.series["shadow_kld"].y))
    panel.grab()  # paints (dots, log ticks) without error


def test_the_cost_panel_shows_the_shadow_and_the_key_channels(qtbot, llama_model):
    from ui.panels.cost import ROWS, CostPanel

    panel = CostPanel()
    qtbot.addWidget(panel)
    off = run(llama_model, "int8", shadow=0.0, new=2)
    panel.update_snapshot(off)
    rows = {name: i for i, (name, _) in enumerate(ROWS)}
    assert panel.values[rows["shadow KLD (mean)"]][0].text() == "—"  # no data, not 0
    assert panel.values[rows["top-1 flips"]][0].text() == "—"
    snap = run(llama_model, "int8", new=12)
    panel.update_snapshot(snap)
    c = snap.counters
    assert panel.values[rows["shadow KLD (mean)"]][0].text() == f"{c['shadow_kld_sum'] / c['shadow_steps']:.2e}"
    assert f"({c['shadow_flips']} / {c['shadow_steps']})" in panel.values[rows["top-1 flips"]][0].text()
    text = panel.outliers.text()
    layer, head, ch, _, ratio = snap.quality["key_outliers"][0]
    assert "Key channels with outliers" in text and f"L{layer} h{head} ch{ch} <b>{ratio:.1f}×</b>" in text
    tip = panel.outliers.toolTip()  # every channel listed, in a table
    assert tip.count("<tr>") == len(snap.quality["key_outliers"]) + 1 and f"<td>{layer}</td><td>{head}</td>" in tip
    panel.update_snapshot(dataclasses.replace(snap, quality={}))  # a file from before: says so
    assert "no data" in panel.outliers.text()


@pytest.mark.parametrize("width", [900, 480, 430])
def test_the_legend_line_fits_a_narrow_block_map(qtbot, width):
    """At 1280 x 720 the map is ~430 px wide: the kv error legend (colour bar, swatches, the selection swatch) once ran
    past its right edge. Colour bars shrink, then swatch labels drop their "(...)" hints; the line always fits."""
    from ui.block_map.legend import _Legend
    from ui.panels.kv_cost import error_legend

    lg = _Legend()
    qtbot.addWidget(lg)
    lg.resize(width, 30)
    lg.set_items(error_legend("int8") + [("swatch", pal.SELECTED, "selected (click a block)")])
    lg.show()
    qtbot.waitExposed(lg)
    lg.grab()  # paints
    assert 0 < lg.drawn_width <= width + 14  # the last swatch's trailing gap may pass the edge, its text may not


@pytest.mark.parametrize("width", [380, 345, 300])
def test_the_kv_error_legend_of_fp32_fits_the_map_at_1280x720(qtbot, width):
    """Seen under Xvfb at 1280x720: in kv error mode on fp32 the legend's line ended in 'not r', cut at the edge
    (free and the selection not shown). A short line leaves the colour bar's title to the mode box, narrows the
    bar, and ends in '…' where an item still does not fit, the whole legend in its tooltip."""
    from ui.block_map.legend import _Legend
    from ui.panels.kv_cost import error_legend

    lg = _Legend()
    qtbot.addWidget(lg)
    lg.resize(width, 30)
    items = error_legend("fp32") + [("swatch", pal.SELECTED, "selected: seq 13 (chat-5)")]
    lg.set_items(items)
    lg.show()
    qtbot.waitExposed(lg)
    lg.grab()
    assert 0 < lg.drawn_width <= width + 14  # the last swatch's trailing gap may pass the edge, its text may not
    assert "not measured" in lg.toolTip() and "free" in lg.toolTip() and "selected: seq 13" in lg.toolTip()


def test_the_shadow_chart_says_how_often_shadow_steps_really_come(qtbot):
    """'shadow every 2.00 s' gave 5-8 shadow steps in 8 minutes and nothing said so: the chart's note gives the
    measured interval when it is well past the asked one; at a narrow width the title and note are cut with
    '…' (at 1280x720 'KV format vs lossless (shadow steps)' ran past the chart's edge)."""
    from types import SimpleNamespace

    from ui.panels.kv_cost import measured_interval, note, shadow_chart

    t = np.arange(0, 120, 0.5)
    kld = np.full(len(t), np.nan)
    kld[[10, 90, 170]] = 1e-9  # a step every 40 s
    snap = SimpleNamespace(quality={"shadow_every_s": 2.0, "shadow": {"steps": 3}}, config={"shadow_every_s": 2.0},
                           series={"t": t, "shadow_kld": kld})
    assert measured_interval(snap) == pytest.approx(40.0)
    assert note(snap) == "one every 40 s (asked 2 s)"
    kld[:] = 1e-9  # every half second: as asked or better, no note
    assert note(snap) == ""
    chart = shadow_chart(60)
    qtbot.addWidget(chart)
    chart.resize(230, 120)
    chart.set_note("one every 40 s (asked 2 s)")
    title, shown = chart.heading()
    fm = QtGui.QFontMetrics(chart._title_font)
    assert fm.horizontalAdvance(title + ("  " + shown if shown else "")) <= 230 - 12 and title.endswith("…")
    chart.resize(600, 120)
    assert chart.heading() == ("KV format vs lossless (shadow steps)", "one every 40 s (asked 2 s)")
