"""What the KV storage format costs, as the window shows it: the block map's "kv error" mode (legend and hover
lines), the shadow reference chart beside the hit rate, and the key channels with outliers (Cost panel).

The numbers come from the snapshot (engine/fidelity/block_error.py, engine/fidelity/shadow.py); "no data" wherever nothing was
measured, never 0.
"""

from __future__ import annotations

import html
import math

import numpy as np

from engine.telemetry.snapshot import Snapshot, TierSnapshot
from ui import palette as pal
from ui.charts.strip_chart import StripChart

ERROR_MEANING = ("relative RMS error ‖x − x̂‖ / ‖x‖ of a token's stored K (or V) against what the model computed, "
                 "over its kv heads × head dim; a block shows the max over its tokens and the model's layers (its "
                 "worst token in its worst layer), measured as the tokens are written")
NOT_MEASURED = ("not measured: some of its tokens were not written through the measured path (re-encoded by a "
                "re-layout or a restore, copied on write, or a decode step replayed from a CUDA graph)")
LOG_LO, LOG_HI = -6.0, 1.0  # the shadow chart's y axis: log10 of the values, 1e-6 to 10
FLIP_TIP = ("shadow steps (one running sequence's step recomputed with lossless fp32 K/V, see the KV-cost chart) whose "
            "top-1 token differs from the engine's, as a share of the shadow steps in the last 60 s; one dot per "
            "shadow step; no dots where there was none (shadow_every_s = 0: off)")


def pct(v: float) -> str:
    return "no data" if v is None or not math.isfinite(v) else "0" if v == 0 else f"{100 * v:.3g} %"


def error_lines(t: TierSnapshot, slot: int, kv_dtype: str) -> list[str]:
    """The hover lines of a block's K/V error."""
    if int(t.state[slot]) == 0:
        return ["K/V error: —"]
    k = float(t.kerr[slot]) if t.kerr is not None else math.nan
    v = float(t.verr[slot]) if t.verr is not None else math.nan
    if math.isnan(k) and math.isnan(v):
        return [f"K/V error: {NOT_MEASURED}"]
    if k == 0 and v == 0:
        return [f"K/V error: 0 ({kv_dtype} stores K/V exactly)"]
    return [f"K error: {pct(k)} &nbsp; V error: {pct(v)}",
            "<small>(relative RMS error of the stored values, worst token × layer)</small>"]


def error_legend(kv_dtype: str) -> list[tuple]:
    """The "kv error" mode's legend items (block_legend._Legend)."""
    lo, hi = pal.ERROR_RANGE
    ticks = [(0.0, f"{100 * lo:g} %"), (0.5, f"{100 * (lo * hi) ** 0.5:g} %"), (1.0, f"{100 * hi:g} %")]
    items = [("ramp", pal.ramp("kv error"), ticks, "K/V error")]
    if kv_dtype == "fp32":
        items.append(("swatch", tuple(int(c) for c in pal.ramp("kv error")[0]), "0 (fp32 is lossless)"))
    return items + [("swatch", pal.NO_DATA, "not measured"), ("swatch", pal.FREE, "free")]


def _log_tick(y: float) -> str:
    return f"1e{int(round(y))}" if round(y) != 0 else "1"


def _log_value(y: float) -> str:
    return f"≤ 1e{int(LOG_LO)}" if y <= LOG_LO else f"{10 ** y:.3g}"


def shadow_chart(span_s: float) -> StripChart:
    """KL divergence and max logit error of the shadow steps, on a log axis (1e-6 .. 10), a dot per step."""
    chart = StripChart("KV format vs lossless (shadow steps)", "log", span_s=span_s, y_range=(LOG_LO, LOG_HI),
                       y_ticks=(-6.0, -3.0, 0.0), tick_format=_log_tick, value_format=_log_value)
    chart.add_series("shadow_kld", "KLD (nats)", "#f06292", dots=True,
                     tip="KL(reference ‖ engine) of the next-token distribution on a shadow step, in nats: one running "
                         "sequence's step recomputed by a dense forward pass with lossless fp32 K/V (no paged cache), "
                         "against the engine's logits for that step; one dot per shadow step (every shadow_every_s "
                         "seconds at most); values ≤ 1e-6 sit on the bottom line; no dots where there was none "
                         "(shadow_every_s = 0: off)")
    chart.add_series("shadow_logit_err", "max |Δlogit|", "#ffd54f", dots=True,
                     tip="the largest |engine logit − reference logit| over the vocabulary on a shadow step; one dot "
                         "per shadow step; no dots where there was none")
    return chart


def shadow_points(snap: Snapshot, chart: StripChart) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(x seconds ago, {key: log10 values}) of the chart's series from the snapshot (NaN: no shadow step there)."""
    s = snap.series
    x = s.get("t", np.zeros(0)) - snap.t
    ys = {}
    for key in chart.series:
        v = s.get(key, np.full(len(x), np.nan))
        with np.errstate(divide="ignore", invalid="ignore"):
            ys[key] = np.log10(np.clip(v, 10 ** LOG_LO, 10 ** LOG_HI))  # NaN stays NaN
    return x, ys


def note(snap: Snapshot) -> str:
    """The chart's remark: shadowing off, or none yet."""
    q = getattr(snap, "quality", None) or {}
    every = q.get("shadow_every_s", getattr(snap, "config", {}).get("shadow_every_s"))
    if every is not None and every <= 0:
        return "off (shadow_every_s = 0)"
    if not q.get("shadow"):
        return "no shadow step yet"
    # The effective interval: a step is shadowed only when one is due and a sequence runs, so it can be far
    # longer than asked ("every 2.00 s" gave 5-8 in 8 minutes, and nothing said so).
    got = measured_interval(snap)
    if got is not None and every and got > 1.5 * every:
        return f"one every {got:.0f} s (asked {every:g} s)"
    return ""


def measured_interval(snap: Snapshot) -> float | None:
    """Seconds between shadow steps over the snapshot's series (with one or none there: the series' span, a
    lower bound); None without a series."""
    s = snap.series
    t, kld = s.get("t"), s.get("shadow_kld")
    if t is None or kld is None or len(t) != len(kld):
        return None
    t = np.asarray(t)
    ts = t[np.isfinite(kld)]
    if len(ts) >= 2:
        return float((ts[-1] - ts[0]) / (len(ts) - 1))
    span = float(t[-1] - t[0]) if len(t) >= 2 else 0.0
    return span / max(len(ts), 1) if span > 0 else None  # at most one in the series: at least its span apart


def outliers_text(snap: Snapshot, n: int = 3) -> tuple[str, str]:
    """The key channels with outliers: (a line naming the top n, a table of all listed for its tooltip), or
    why there is none."""
    q = getattr(snap, "quality", None) or {}
    rows = q.get("key_outliers") or []
    if not rows:
        return "<b>Key channels with outliers</b>: no data (no key written yet, or a snapshot without them)", OUTLIER_TIP
    top = ", ".join(f"L{lyr} h{h} ch{ch} <b>{ratio:.1f}×</b>" for lyr, h, ch, _, ratio in rows[:n])
    table = "".join(f"<tr><td>{lyr}</td><td>{h}</td><td>{ch}</td><td align=right>{ratio:.1f}×</td>"
                    f"<td align=right>{amax:.3g}</td></tr>" for lyr, h, ch, amax, ratio in rows)
    tip = (f"{html.escape(OUTLIER_TIP)}<br>{html.escape(str(q.get('keys_seen', '?')))} tokens' keys seen"
           "<table cellspacing=4><tr><th>layer</th><th>kv head</th><th>channel</th><th>× median</th><th>max |k|</th>"
           f"</tr>{table}</table>")
    return f"<b>Key channels with outliers</b> (× their head's median max |k|): {top}", tip


OUTLIER_TIP = ("per layer and kv head, the running max |key| of every channel (post-RoPE) over all keys written since "
               "the engine started; a channel far above its head's median channel sets a scale per token and leaves "
               "the others few quantization levels (what int8-kivi's per-channel key scales answer)")
