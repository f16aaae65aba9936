"""`kvscope policy-lab`: the command line and the figure of the policy lab (engine/lab/policy_lab.py holds its logic)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from engine.kv.access_trace import AccessTrace
from engine.kv.eviction_sim import POLICIES
from engine.lab.policy_lab import (DEFAULT_DECAYS, MAX_CAPACITY, policy_order, default_capacities, format_reasons,
                                   format_table, lab_input, near_half, run_lab, scan_polluted_trace)


def _tick_labels(caps: list[int]) -> list[str]:
    """Short labels (1.5k), blank where a tick sits too close to the last labelled one on a log axis."""
    out, last = [], None
    for c in caps:
        if last is not None and c < last * 1.3:
            out.append("")
            continue
        out.append(f"{c / 1000:.2g}k" if c >= 1000 else str(c))
        last = c
    return out


def plot(rows: list[dict], path: str, title: str = "Eviction policies against OPT") -> None:
    """Hit rate and fraction of OPT against capacity, one line per policy (OPT dashed). Writes a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # no pyplot: no global backend, no display
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullFormatter

    fig = Figure(figsize=(12, 5.2), dpi=120)
    FigureCanvasAgg(fig)
    ax_hit, ax_frac = fig.subplots(1, 2)
    # Policies often coincide (heat with a short memory is LRU): big hollow markers under small solid ones.
    fixed = {"lru": dict(color="tab:blue", marker="s", markersize=9, markerfacecolor="none", linewidth=2.4),
             "s3fifo": dict(color="tab:green", marker="^", markersize=7, linewidth=2.0)}
    heat_colors = iter(["tab:orange", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive"])
    caps = sorted({r["capacity"] for r in rows})
    top = max([r["hit_rate"] for r in rows] + [0.01])
    for p in policy_order(rows):
        mine = sorted((r for r in rows if r["policy"] == p), key=lambda r: r["capacity"])
        x = [r["capacity"] for r in mine]
        if p == "opt":
            style = dict(color="black", linestyle="--", linewidth=2.0, label="OPT (Belady)")
        else:
            style = fixed.get(p) or dict(color=next(heat_colors, "tab:gray"), marker="o", markersize=4, linewidth=1.4)
            style = dict(style, label=p)
        ax_hit.plot(x, [100 * r["hit_rate"] for r in mine], **style)
        ax_frac.plot(x, [r["fraction_of_opt"] for r in mine], **style)
    for ax in (ax_hit, ax_frac):
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator(caps))
        ax.xaxis.set_major_formatter(FixedFormatter(_tick_labels(caps)))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("cache capacity (blocks, log scale)", fontsize=11)
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=9)
    ax_hit.set_ylabel("hit rate (%)", fontsize=11)
    ax_hit.set_ylim(0, min(100.0, 100 * top * 1.15 + 1))
    ax_hit.set_title("Hit rate (OPT is the ceiling)", fontsize=12)
    ax_frac.set_ylabel("hit rate / OPT's hit rate", fontsize=11)
    ax_frac.set_ylim(0, 1.05)
    ax_frac.set_title("Fraction of OPT", fontsize=12)
    ax_hit.legend(fontsize=10, loc="lower right")
    fig.suptitle(title, fontsize=13)
    fig.tight_layout()
    fig.savefig(path)


# -- the command line ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvscope policy-lab",
                                 description="Replay a block-access trace through eviction policies and OPT.")
    ap.add_argument("trace", nargs="?", metavar="TRACE", help="an .npz access trace (generate --record-trace)")
    ap.add_argument("--synthetic", choices=("scan",), help="instead of TRACE: a generated scan-polluted chat trace")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic trace")
    ap.add_argument("--capacity", type=int, nargs="+", action="extend", metavar="N",
                    help="cache capacities in blocks (default: 8 from 5%% to 100%% of the distinct blocks)")
    ap.add_argument("--decay", type=float, nargs="+", action="extend", metavar="D",
                    help=f"heat decays per second (default: {' '.join(map(str, DEFAULT_DECAYS))})")
    ap.add_argument("--policy", nargs="+", action="extend", choices=POLICIES, help="policies (default: all)")
    ap.add_argument("--plot", metavar="OUT.png", help="write a figure of hit rate against capacity")
    ap.add_argument("--every-read", action="store_true",
                    help="replay every read of the trace, not just each sequence's first read of a block")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    from app.whatif.cli import add_flags

    add_flags(ap)
    return ap


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag, its valid range and the value given, for a number out of range."""
    for c in args.capacity or []:
        if not 1 <= c <= MAX_CAPACITY:
            raise ValueError(f"--capacity must be a number of blocks from 1 to {MAX_CAPACITY:,}, got {c}")
    for d in args.decay or []:
        if not 0.0 < d <= 1.0:  # also refuses nan
            raise ValueError(f"--decay must be in (0, 1] (heat kept per second), got {d}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if args.current is not None and not 1 <= args.current <= MAX_CAPACITY:
        raise ValueError(f"--current must be a number of blocks from 1 to {MAX_CAPACITY:,}, got {args.current}")
    if args.block_mib is not None and not 0 < args.block_mib < 1 << 20:  # also refuses nan
        raise ValueError(f"--block-mib must be a positive number of MiB, got {args.block_mib}")
    if args.time is not None and not 1 <= args.time <= 50_000_000:
        raise ValueError(f"--time must be a number of accesses from 1 to 50,000,000, got {args.time}")
    for flag, v, top in (("--requests", args.requests, 10_000), ("--window", args.window, 64),
                         ("--max-new-tokens-cap", args.max_new_tokens_cap, 1 << 20)):
        if not 1 <= v <= top:
            raise ValueError(f"{flag} must be from 1 to {top:,}, got {v}")
    if not 0.0 < args.rate <= 1000.0:  # also refuses nan
        raise ValueError(f"--rate must be a number of requests a second in (0, 1000], got {args.rate}")
    if args.plot:
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):
            raise ValueError(f"--plot {args.plot}: no such folder {folder}")


def main(argv: list[str] | None = None) -> int:
    """`kvscope policy-lab`. Bad input (a number out of range, a file that is not a trace, an empty trace)
    prints one line, "kvscope policy-lab: error: ...", and returns 2."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if (args.trace is None) == (args.synthetic is None) and not (args.validate or args.time is not None):
        ap.error("give a TRACE file or --synthetic scan (one of them)")
    try:
        check_args(args)
        from app.whatif.cli import main as what_if, wants_what_if

        if wants_what_if(args):
            return what_if(args)
        if args.synthetic:
            trace: AccessTrace | np.ndarray = scan_polluted_trace(args.seed)
            source = f"synthetic scan-polluted chat trace (seed {args.seed})"
        else:
            trace = AccessTrace.load(args.trace)
            source = args.trace
        if len(trace) == 0:
            raise ValueError(f"{source}: the trace is empty")
    except ValueError as e:
        print(f"kvscope policy-lab: error: {e}", file=sys.stderr)
        return 2
    keys, _ = lab_input(trace, args.every_read)
    caps = sorted(set(args.capacity)) if args.capacity else default_capacities(keys)
    decays = tuple(args.decay) if args.decay else DEFAULT_DECAYS
    policies = tuple(dict.fromkeys(args.policy)) if args.policy else POLICIES
    rows = run_lab(trace, caps, decays=decays, policies=policies, every_read=args.every_read)
    distinct = len(np.unique(keys))
    if args.plot:
        try:
            plot(rows, args.plot, title=f"Eviction policies against OPT: {len(keys):,} accesses, {distinct:,} blocks")
        except OSError as e:
            print(f"kvscope policy-lab: error: --plot {args.plot}: cannot write the figure ({e.strerror or e})",
                  file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps({"trace": source, "accesses": len(keys), "distinct_blocks": distinct,
                          "reads": "every" if args.every_read or args.synthetic else "first", "rows": rows}))
        return 0
    if isinstance(trace, AccessTrace) and not args.every_read:
        print(f"{source}: {len(trace):,} reads; replaying the {len(keys):,} first reads of a block by a sequence "
              f"({distinct:,} distinct blocks; --every-read for all)")
    else:
        print(f"{source}: {len(keys):,} accesses, {distinct:,} distinct blocks")
    print(format_table(rows))
    cap = near_half(rows)
    if cap is not None:
        at = [r for r in rows if r["capacity"] == cap]
        desc = ", ".join(f"{r['policy']} {100 * r['hit_rate']:.1f}% ({r['fraction_of_opt']:.2f} of OPT)" for r in at)
        print(f"at {cap:,} blocks (LRU nearest 50%): {desc}")
        for line in format_reasons(rows, cap):
            print(line)
    if args.plot:
        print(f"figure: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
