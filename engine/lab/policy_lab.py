"""The policy lab: replay a block-access trace through eviction policies and compare them with OPT.

The simulators and `replay` are in engine/kv/eviction_sim.py. Here `run_lab` sweeps capacities, `format_table`
and `plot` show the result, `main` is `kvscope policy-lab`.
An engine trace has a row for every read, and a running sequence reads all its blocks at every step;
those re-reads hit under any policy (the engine pins a sequence's blocks), so by default the lab
replays only the first read of each block by each sequence: the reads a cache can win or lose.
`scan_polluted_trace` makes a synthetic workload (hot chat prefixes plus long one-time document scans)
for checking scan resistance without a recorded trace.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from engine.kv.eviction_sim import POLICIES, replay
from engine.kv.access_trace import MAX_TRACE_ROWS, AccessTrace

DEFAULT_DECAYS = (0.5, 0.9, 0.99)
MAX_CAPACITY = MAX_TRACE_ROWS  # more blocks than a trace can have accesses changes nothing


# -- the lab ------------------------------------------------------------------------------------------

def _label(policy: str, decay: float) -> str:
    return f"heat({decay:g})" if policy == "heat" else policy


def first_reads(trace: AccessTrace) -> tuple[np.ndarray, np.ndarray]:
    """Block ids and times of the first read of each block by each sequence, in trace order."""
    n = len(trace)
    order = np.lexsort((np.arange(n), trace.block, trace.seq))  # by sequence, block, then time
    s, b = trace.seq[order], trace.block[order]
    first = np.ones(n, dtype=bool)
    first[1:] = (s[1:] != s[:-1]) | (b[1:] != b[:-1])
    idx = np.sort(order[first])
    return np.asarray(trace.block[idx], dtype=np.int64), np.asarray(trace.t[idx], dtype=np.float64)


def lab_input(trace: AccessTrace | np.ndarray, every_read: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """(keys, times) the lab replays: an array as it is; a trace's first reads, or every read if asked."""
    if not isinstance(trace, AccessTrace):
        return np.asarray(trace), None
    if every_read:
        return np.asarray(trace.block, dtype=np.int64), np.asarray(trace.t, dtype=np.float64)
    return first_reads(trace)


def run_lab(trace: AccessTrace | np.ndarray, capacities: list[int], decays=DEFAULT_DECAYS,
            policies=POLICIES, *, every_read: bool = False) -> list[dict]:
    """One row per (policy, capacity): hit rate and its fraction of OPT's hit rate at that capacity.

    A trace is replayed as its first reads (see `first_reads`) unless every_read; an array of block
    ids as it is. Heat gets one row per decay, labelled like "heat(0.9)". OPT is always simulated (it is
    the denominator) but only listed if asked for. fraction_of_opt is 1.0 where OPT hits nothing.
    """
    keys, times = lab_input(trace, every_read)
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"unknown policy {p!r}; choose one of {', '.join(POLICIES)}")
    rows = []
    for cap in capacities:
        opt = replay(keys, cap, "opt")
        runs = []
        for p in policies:
            for d in (decays if p == "heat" else (None,)):
                r = opt if p == "opt" else replay(keys, cap, p, decay=d if d is not None else 0.9, times=times)
                runs.append((_label(p, d), d, r))
        for label, d, r in runs:
            rows.append({"policy": label, "decay": d, "capacity": int(cap), "hits": r["hits"],
                         "misses": r["misses"], "hit_rate": r["hit_rate"],
                         "fraction_of_opt": r["hits"] / opt["hits"] if opt["hits"] else 1.0})
    return rows


def default_capacities(keys: np.ndarray, points: int = 8) -> list[int]:
    """`points` capacities spaced geometrically from 5 % to 100 % of the trace's distinct blocks."""
    distinct = len(np.unique(keys))
    caps = np.geomspace(0.05, 1.0, points) * distinct
    return sorted({max(1, int(round(c))) for c in caps})


def _policy_order(rows: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for r in rows:
        seen.setdefault(r["policy"], None)
    return list(seen)


def format_table(rows: list[dict]) -> str:
    """Hit rate and fraction of OPT, one line per policy, one column per capacity."""
    caps = sorted({r["capacity"] for r in rows})
    cell = {(r["policy"], r["capacity"]): r for r in rows}
    names = _policy_order(rows)
    w0 = max([len("policy")] + [len(p) for p in names]) + 2
    w = max(14, max(len(f"{c:,}") for c in caps) + 2)
    lines = ["hit rate (fraction of OPT) by cache capacity in blocks",
             "policy".ljust(w0) + "".join(f"{c:,}".rjust(w) for c in caps)]
    for p in names:
        parts = []
        for c in caps:
            r = cell.get((p, c))
            parts.append((f"{100 * r['hit_rate']:.1f}% ({r['fraction_of_opt']:.2f})" if r else "-").rjust(w))
        lines.append(p.ljust(w0) + "".join(parts))
    return "\n".join(lines)


def near_half(rows: list[dict], policy: str = "lru", target: float = 0.5) -> int | None:
    """The capacity at which `policy`'s hit rate is nearest `target`."""
    mine = [r for r in rows if r["policy"] == policy]
    if not mine:
        return None
    return min(mine, key=lambda r: (abs(r["hit_rate"] - target), r["capacity"]))["capacity"]


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
    for p in _policy_order(rows):
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


# -- a synthetic workload -----------------------------------------------------------------------------

def scan_polluted_trace(seed: int = 0, n_hot: int = 2048, n_scan: int = 2048, n_requests: int = 3000,
                        scan_every: int = 100, n_prefixes: int = 64, zipf_a: float = 1.0, system_blocks: int = 4,
                        tail_blocks: tuple[int, int] = (1, 8), scan_chunk: int = 64) -> np.ndarray:
    """Block ids of a chat service whose prefix cache is swept by long documents.

    Chat: `n_prefixes` conversation prefixes (system prompt + few-shot / history; lengths log-normal,
    `n_hot` blocks in all) with Zipf(`zipf_a`) popularity. Every request reads a shared system prompt
    of `system_blocks` blocks, its prefix's blocks, and a tail of new blocks (the new turn, read once).
    Scans: every `scan_every` requests a document of `n_scan` new blocks is read once, in chunks of
    `scan_chunk` blocks (chunked prefill), each chunk interleaved with a chat request, as an engine
    serving both would read them. One access per block per request: the prefix-cache lookups, not
    every decode step's re-read of a running sequence's own blocks (those hit under any policy).
    """
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean=0.0, sigma=0.6, size=n_prefixes)
    lengths = np.maximum(1, np.round(lengths / lengths.sum() * n_hot)).astype(np.int64)
    starts = system_blocks + np.concatenate(([0], np.cumsum(lengths)[:-1]))
    weights = 1.0 / np.arange(1, n_prefixes + 1) ** zipf_a
    choice = rng.choice(n_prefixes, size=n_requests, p=weights / weights.sum())
    tails = rng.integers(tail_blocks[0], tail_blocks[1] + 1, size=n_requests)
    next_id = int(starts[-1] + lengths[-1])
    system = np.arange(system_blocks, dtype=np.int64)
    out: list[np.ndarray] = []
    scan_left = 0
    for i in range(n_requests):
        if scan_every and i % scan_every == scan_every - 1:
            scan_left += n_scan
        if scan_left:
            chunk = min(scan_chunk, scan_left)
            out.append(np.arange(next_id, next_id + chunk, dtype=np.int64))
            next_id += chunk
            scan_left -= chunk
        p = choice[i]
        out.append(system)
        out.append(np.arange(starts[p], starts[p] + lengths[p], dtype=np.int64))
        out.append(np.arange(next_id, next_id + tails[i], dtype=np.int64))
        next_id += int(tails[i])
    return np.concatenate(out)


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
    if args.plot:
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):
            raise ValueError(f"--plot {args.plot}: no such folder {folder}")


def main(argv: list[str] | None = None) -> int:
    """`kvscope policy-lab`. Bad input (a number out of range, a file that is not a trace, an empty trace)
    prints one line, "kvscope policy-lab: error: ...", and returns 2."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if (args.trace is None) == (args.synthetic is None):
        ap.error("give a TRACE file or --synthetic scan (one of them)")
    try:
        check_args(args)
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
    if args.plot:
        print(f"figure: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
