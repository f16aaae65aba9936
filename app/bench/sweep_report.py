"""The report of a sweep: one row of scalars per config, shown as a table, JSON, CSV and a figure."""

from __future__ import annotations

import csv
import math

import numpy as np

from engine.workloads.replay import RESIDENCY, RunResult
from engine.kv.misses import PROMPT_REASONS, READ_REASONS, counter_name, top
from engine.telemetry.health import one_line
from engine.telemetry.health import report as report_health

# 1-2-5 bin edges from 1 ms to 1000 s (values above the last edge land in the last bin).
BIN_EDGES_S = (0.0,) + tuple(m * 10.0**e for e in range(-3, 3) for m in (1, 2, 5)) + (1000.0,)


def _pct(values, q: float, scale: float = 1.0) -> float:
    return float(np.percentile(values, q)) * scale if len(values) else float("nan")


def histogram(values: np.ndarray) -> dict:
    edges = np.asarray(BIN_EDGES_S)
    counts, _ = np.histogram(np.clip(values, 0.0, edges[-1]), bins=edges)
    return {"n": int(len(values)), "p50_s": _pct(values, 50), "p90_s": _pct(values, 90),
            "edges_s": edges.tolist(), "counts": counts.tolist()}


def row_of(r: RunResult) -> dict:
    """One flat row of scalars: the table, the CSV and the JSON all show these."""
    c = r.counters
    row = {
        "config": r.label, "requests": r.requests, "finished": r.finished, "refused": len(r.refused),
        "forked": r.forked, "generated_tokens": r.generated, "wall_s": r.wall_s,
        "idle_skipped_s": r.idle_skipped_s,
        "tokens_per_s": r.generated / r.wall_s if r.wall_s > 0 else 0.0,
        "ttft_p50_ms": _pct(r.ttft_s, 50, 1e3), "ttft_p95_ms": _pct(r.ttft_s, 95, 1e3),
        "itl_p50_ms": _pct(r.itl_s, 50, 1e3), "itl_p95_ms": _pct(r.itl_s, 95, 1e3),
        "device_hit_rate": c["device_hit_rate"], "prefix_hit_rate": c["prefix_hit_rate"],
        "evictions": c["evictions"], "promotions": c["promotions"], "promoted_bytes": c["promoted_bytes"],
        "demotions": c["demotions"], "demoted_bytes": c["demoted_bytes"],
        "peak_device_bytes": r.peak_device_bytes, "peak_host_bytes": r.peak_host_bytes,
        "preemptions": c["preemptions"], "promote_stall_s": c.get("promote_stall_s", 0.0),
        "promoted_mb_per_token": c["promoted_bytes"] / 2**20 / r.generated if r.generated else float("nan"),
        "demoted_mb_per_token": c["demoted_bytes"] / 2**20 / r.generated if r.generated else float("nan"),
        "streamed_share": c.get("read_tokens_streamed", 0) / c["read_tokens"] if c.get("read_tokens") else float("nan"),
        "streamed_mb_per_token": c.get("streamed_bytes", 0) / 2**20 / r.generated if r.generated else float("nan"),
        # Why tokens missed (engine/kv/misses.py): prompt tokens a lookup did not serve, keys not read from the device
        **{counter_name(k): c.get(counter_name(k), 0) for k in PROMPT_REASONS + READ_REASONS},
        "lookup_tokens": c.get("lookup_tokens", 0), "lookup_served": c.get("lookup_served", 0),
    }
    for k in RESIDENCY:
        row[f"{k}_p50_s"] = _pct(r.residency[k], 50)
        row[f"{k}_p90_s"] = _pct(r.residency[k], 90)
    return row


def _finite(x):
    return None if isinstance(x, float) and not math.isfinite(x) else x


def report(meta: dict, results: list[RunResult]) -> dict:
    """The --json object: what ran, one row per config, and residency histograms per config."""
    rows = [{k: _finite(v) for k, v in row_of(r).items()} for r in results]
    residency = {r.label: {k: {kk: _finite(vv) for kk, vv in histogram(r.residency[k]).items()} for k in RESIDENCY}
                 for r in results}
    return {**meta, "configs": [{"label": r.label, **r.config.as_dict()} for r in results], "rows": rows,
            "residency": residency, "health": {r.label: report_health(r.health) for r in results}}


def format_health(results: list[RunResult]) -> str:
    """One line per config: the health targets since start, graded, and the checklist (engine/telemetry/health.py)."""
    return "\n".join(f"health {r.label}: {one_line(r.health)}" for r in results if r.health)


def format_live_change(results: list[RunResult]) -> str:
    """The A/B of --live-change: prefix hit rate before/after the change's step in each run, and what it held."""
    lines = []
    for r in results:
        lc = r.live_change
        if lc is None:
            lines.append(f"{r.label}: the run ended before the change's step (fewer steps than --change-at-step)")
            continue
        pct = (lambda x: "no data" if not math.isfinite(x) else f"{100 * x:.1f} %")
        line = (f"{r.label}: prefix hit rate before step {lc['at_step']} {pct(lc['prefix_before'])}, "
                f"after {pct(lc['prefix_after'])}")
        if lc.get("error"):
            line += f"; the change was refused: {lc['error']}"
        elif "peak_extra_bytes" in lc:
            tiers = max(lc["old_tier_bytes"], lc["new_tier_bytes"])
            line += (f"; the re-lay held {_mb(lc['peak_extra_bytes'])} MiB beside {_mb(tiers)} MiB of tiers "
                     f"({100 * lc['peak_extra_bytes'] / max(tiers, 1):.1f} %)")
        lines.append(line)
    if len(results) == 2 and all(r.live_change for r in results):
        a, b = (r.live_change["prefix_after"] for r in results)
        if math.isfinite(a) and math.isfinite(b):
            lines.append(f"after the change, {results[1].label} vs control: {100 * (b - a):+.1f} points of prefix hits")
    return "\n".join(lines)


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _ms(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.0f}" if x >= 10 else f"{x:.1f}"


def _secs(x: float) -> str:
    if not math.isfinite(x):
        return "-"
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s" if x < 100 else f"{x:.0f} s"


TABLE = (  # header (units in it), cell
    ("config", lambda r: r["config"]),
    ("done", lambda r: f"{r['finished']}/{r['requests']}"),
    ("wall s", lambda r: f"{r['wall_s']:.1f}"),
    ("tok/s", lambda r: f"{r['tokens_per_s']:.1f}"),
    ("TTFT p50/p95 ms", lambda r: f"{_ms(r['ttft_p50_ms'])} / {_ms(r['ttft_p95_ms'])}"),
    ("ITL p50/p95 ms", lambda r: f"{_ms(r['itl_p50_ms'])} / {_ms(r['itl_p95_ms'])}"),
    ("dev hit %", lambda r: _pc(r["device_hit_rate"])),
    ("streamed %, MiB/tok", lambda r: f"{_pc(r['streamed_share'])}, {_f3(r['streamed_mb_per_token'])}"),
    ("prefix hit %", lambda r: _pc(r["prefix_hit_rate"])),
    ("prompt missed: why", lambda r: top({k: r[counter_name(k)] for k in PROMPT_REASONS})),
    ("dev miss: why", lambda r: top({k: r[counter_name(k)] for k in READ_REASONS})),
    ("evict", lambda r: str(r["evictions"])),
    ("promote n/MiB", lambda r: f"{r['promotions']} / {_mb(r['promoted_bytes'])}"),
    ("demote n/MiB", lambda r: f"{r['demotions']} / {_mb(r['demoted_bytes'])}"),
    ("peak dev/host MiB", lambda r: f"{_mb(r['peak_device_bytes'])} / {_mb(r['peak_host_bytes'])}"),
    ("preempt", lambda r: str(r["preemptions"])),
    ("stall s", lambda r: f"{r['promote_stall_s']:.2f}"),
    ("MiB/tok in/out", lambda r: f"{_f3(r['promoted_mb_per_token'])} / {_f3(r['demoted_mb_per_token'])}"),
)


def _pc(x) -> str:
    """A share as a percentage; "-" for no data (nothing counted)."""
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:.1f}"


def _f3(x) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.3f}"


def format_table(rows: list[dict]) -> str:
    cells = [[h for h, _ in TABLE]] + [[cell(r) for _, cell in TABLE] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(TABLE))]
    lines = []
    for n, line in enumerate(cells):
        parts = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        out = csv.DictWriter(f, fieldnames=list(rows[0]))
        out.writeheader()
        out.writerows({k: "" if isinstance(v, float) and not math.isfinite(v) else v for k, v in r.items()}
                      for r in rows)


def best_of(results: list[RunResult]) -> RunResult:
    return max(results, key=lambda r: row_of(r)["tokens_per_s"])


def plot_sweep(results: list[RunResult], title: str, path: str) -> None:
    """A 2x2 figure: throughput, TTFT, hit rates per config; residency histograms of the fastest config."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    rows = [row_of(r) for r in results]
    best = best_of(results)
    n = len(rows)
    parts = [r["config"].split(" ") for r in rows]
    knobs = [p.partition("=")[0] for p in parts[0]] if "=" in rows[0]["config"] else []
    compact = n > 4 and knobs  # many configs: values only, the knob names once in the axis label
    names = ["\n".join(p.partition("=")[2] if compact else p for p in ps) for ps in parts]
    xlabel = " / ".join(knobs) + " (top to bottom)" if compact else ""
    x = np.arange(n)
    fig = Figure(figsize=(max(12.0, 1.3 * n + 5), 9.5), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title, fontsize=14)
    (a_tp, a_ttft), (a_hit, a_res) = fig.subplots(2, 2)
    blue, orange, grey = "#3b75af", "#ef8636", "#9aa5b1"

    def config_axis(ax) -> None:
        ax.set_xticks(x, names, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=9)
        ax.set_xlim(-0.5 - 0.5 * max(0, 3 - n), n - 0.5 + 0.5 * max(0, 3 - n))  # no bar wider than a third
        ax.spines[["top", "right"]].set_visible(False)

    tps = [r["tokens_per_s"] for r in rows]
    bars = a_tp.bar(x, tps, color=[blue if r is best else grey for r in results])
    a_tp.bar_label(bars, fmt="%.1f", fontsize=9, padding=2)
    a_tp.set_title("Throughput (generated tokens per wall second; blue: fastest)")
    a_tp.set_ylabel("tokens / s")
    a_tp.set_ylim(0, max(tps + [1e-9]) * 1.15)
    config_axis(a_tp)

    wd = 0.38
    for dx, key, color, lab in ((-wd / 2, "ttft_p50_ms", blue, "p50"), (wd / 2, "ttft_p95_ms", orange, "p95")):
        vals = [r[key] if math.isfinite(r[key]) else 0.0 for r in rows]
        bars = a_ttft.bar(x + dx, vals, wd, color=color, label=lab)
        a_ttft.bar_label(bars, fmt=_ms, fontsize=8, padding=2)
    a_ttft.set_title("Time to first token")
    a_ttft.set_ylabel("ms")
    a_ttft.set_ylim(0, 1.35 * max([r["ttft_p95_ms"] for r in rows if math.isfinite(r["ttft_p95_ms"])] + [1.0]))
    a_ttft.legend(frameon=False, loc="upper center", ncols=2)
    config_axis(a_ttft)

    for dx, key, color, lab in ((-wd / 2, "device_hit_rate", blue, "device tier (keys read)"),
                                (wd / 2, "prefix_hit_rate", orange, "prefix cache (prompt tokens)")):
        # No data (nothing read / no prompt) is a missing bar, not a 0 one.
        vals = [100 * r[key] if r[key] is not None and math.isfinite(r[key]) else np.nan for r in rows]
        bars = a_hit.bar(x + dx, vals, wd, color=color, label=lab)
        a_hit.bar_label(bars, fmt="%.0f", fontsize=8, padding=2)
    a_hit.set_title("Hit rates")
    a_hit.set_ylabel("%")
    a_hit.set_ylim(0, 118)
    a_hit.legend(frameon=False, loc="upper left", ncols=2)
    config_axis(a_hit)

    edges = np.asarray(BIN_EDGES_S)
    plot_edges = edges.copy()
    plot_edges[0] = edges[1] / 2  # the [0, 1 ms) bin, drawn on a log axis
    shown, top = [], 0
    for key, color, lab in (("reuse_gap", blue, "reuse gap (idle before a prefix hit)"),
                            ("age_at_eviction", orange, "age at eviction")):
        h = histogram(best.residency[key])
        if h["n"]:
            a_res.stairs(h["counts"], plot_edges, color=color, fill=True, alpha=0.3)
            a_res.stairs(h["counts"], plot_edges, color=color, linewidth=2,
                         label=f"{lab}\nn={h['n']}, p50 {_secs(h['p50_s'])}, p90 {_secs(h['p90_s'])}")
            shown.append(np.flatnonzero(h["counts"]))
            top = max(top, max(h["counts"]))
    a_res.set_xscale("log")
    a_res.set_title(f"Block residency in the fastest config\n{best.label}")
    a_res.set_xlabel("seconds (log scale; 1-2-5 bins)")
    a_res.set_ylabel("blocks")
    a_res.spines[["top", "right"]].set_visible(False)
    if shown:
        nz = np.concatenate(shown)
        lo, hi = max(nz.min() - 1, 0), min(nz.max() + 2, len(plot_edges) - 1)
        a_res.set_xlim(plot_edges[lo], plot_edges[hi])
        a_res.set_ylim(0, top * 1.6)
        a_res.legend(frameon=False, fontsize=9, loc="upper left")
    else:
        lo, hi = 1, len(plot_edges) - 1
        a_res.set_xlim(plot_edges[lo], plot_edges[hi])
        a_res.text(0.5, 0.5, "no prefix hits and no evictions in this run", ha="center", va="center",
                   transform=a_res.transAxes, color="#555555")
        a_res.set_yticks([])
    ticks = plot_edges[lo + (lo == 0):hi + 1]
    if len(ticks) > 10:
        ticks = ticks[np.isclose(np.log10(ticks) % 1, 0) | np.isclose(np.log10(ticks) % 1, 1)]  # decades only
    a_res.xaxis.set_major_locator(FixedLocator(ticks))
    a_res.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _secs(v)))
    a_res.xaxis.set_minor_locator(NullLocator())
    fig.savefig(path, dpi=150)
