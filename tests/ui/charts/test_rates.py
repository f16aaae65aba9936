"""The window's own windowed rates (ui/charts/rates.py): a rate means what its tooltip says, and "no data" is NaN,
never a 0 or a stale value."""

from __future__ import annotations

import math

import numpy as np

from ui.charts.rates import GAP_S, RATES, RateHistory, mask_engine_series


def _counters(reads=0, misses=0, prompt=0, reused=0, evictions=0, generated=0) -> dict:
    return {"read_tokens": reads, "read_tokens_missed": misses, "prompt_tokens": prompt, "prompt_reused": reused,
            "evictions": evictions, "promotions": 0, "demotions": 0, "generated": generated}


def test_rates_are_counts_over_the_last_five_seconds():
    h = RateHistory()
    for i in range(101):  # 10 s at 10 Hz: 100 reads/s with 10 misses, 20 tokens/s, 4 evictions/s
        t = i * 0.1
        h.observe(t, _counters(reads=10 * i, misses=i, generated=2 * i, evictions=round(0.4 * i)))
    r = h.latest()
    assert math.isclose(r["device_hit_rate_w"], 0.9)
    assert math.isclose(r["tokens_per_s"], 20.0, rel_tol=1e-6)
    assert math.isclose(r["evictions_per_s"], 4.0, rel_tol=1e-6)
    assert math.isnan(r["prefix_hit_rate_w"]) and math.isnan(r["prefix_hit_rate"])  # no prompt yet: no data


def test_a_paused_engine_reads_zero_tokens_per_second_and_no_hit_rate():
    h = RateHistory()
    t = 0.0
    for i in range(60):
        t = i * 0.1
        h.observe(t, _counters(reads=10 * i, generated=2 * i))
    frozen = _counters(reads=590, generated=118)
    assert h.latest()["tokens_per_s"] > 15
    for k in range(1, 80):  # paused for 8 s: the counters stop, the clock does not
        h.observe(t + 0.1 * k, frozen)
    r = h.latest()
    assert r["tokens_per_s"] == 0.0  # was stale at its last value before (the engine's history stops)
    assert math.isnan(r["device_hit_rate_w"])  # no reads in the window: no data, not 1.0 and not 0.0
    assert r["device_hit_rate"] == 1.0  # the cumulative rate still stands


def test_no_prompt_in_the_window_is_no_data_not_zero():
    h = RateHistory()
    prompt = reused = 0
    for i in range(200):
        if i in (10, 120):  # two prompts, 20 s apart, each with 40 of 100 tokens reused
            prompt, reused = prompt + 100, reused + 40
        h.observe(i * 0.1, _counters(reads=i, prompt=prompt, reused=reused))
    s = h.series()
    y = s["prefix_hit_rate_w"]
    seen = y[np.isfinite(y)]
    assert len(seen) and np.allclose(seen, 0.4)  # never 0: the square wave is gone
    # 9 s after the first prompt, before the second: no prompt in the window, no data.
    assert np.isnan(y[np.argmin(abs(s["t"] - 10.0))])


def test_a_sampling_stall_breaks_the_lines():
    h = RateHistory()
    for i in range(30):
        h.observe(i * 0.1, _counters(reads=10 * i, generated=i))
    h.observe(2.9 + 3 * GAP_S, _counters(reads=400, generated=40))
    s = h.series()
    inside = np.flatnonzero((s["t"] > 2.95) & (s["t"] < 2.85 + 3 * GAP_S))  # a row within the stall
    assert len(inside) == 1 and all(np.isnan(s[k][inside[0]]) for k in RATES)  # where every line breaks


def test_the_engine_series_loses_its_post_gap_zeros_and_ramps():
    t = np.concatenate((np.arange(0, 3, 0.1), np.arange(20, 23, 0.1)))
    zero_after_gap = np.ones(len(t))
    zero_after_gap[30] = 0.0
    out = mask_engine_series({"t": t, "device_hit_rate_w": zero_after_gap, "device_hit_rate": np.ones(len(t)),
                              "device_used_bytes": np.ones(len(t))})
    assert np.isnan(out["device_hit_rate_w"][30]) and np.isfinite(out["device_hit_rate_w"]).sum() == len(t) - 1
    assert np.isfinite(out["device_hit_rate"]).all() and np.isfinite(out["device_used_bytes"]).all()
    # The window's history takes over from the engine's at its first sample.
    h = RateHistory()
    h.observe(21.0, _counters())
    merged = h.series({"t": t, "device_hit_rate_w": zero_after_gap})
    assert merged["t"][-1] == 21.0 and (merged["t"][:-1] < 21.0).all()
