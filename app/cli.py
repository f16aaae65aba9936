"""The `kvscope` console script: generate, info, bench."""

from __future__ import annotations

import argparse
import json
import sys

# Shared with app.commands and app.bench.sweep, which import app.options rather than this module (no import cycle).
# The underscored names stay for callers that used them from here.
from app.options import T_START, cache_config  # noqa: F401
from app.options import add_cache_flags as _add_cache_flags
from app.options import add_model_flags as _add_model_flags


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvscope", description="See and tune a tiered, paged KV cache while a real model runs.")
    sub = ap.add_subparsers(dest="cmd")

    g = sub.add_parser("generate", help="generate text, streaming; or run a JSONL file of requests concurrently")
    g.add_argument("prompt", nargs="?", help="the prompt text")
    g.add_argument("--prompt-file", help='JSONL: {"prompt": ..., "max_new_tokens": ...} per line, run concurrently')
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                   help="stop each sequence after N generated tokens (default 64; sooner at EOS)")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--greedy", action="store_true", help="argmax decoding (the default)")
    mode.add_argument("--temperature", type=float, metavar="T",
                      help="sample instead of argmax: logits divided by T (> 0; higher is more random)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="with --temperature: sample from the smallest set of tokens whose probabilities sum to P "
                        "(nucleus sampling; 1.0, the default, keeps all)")
    g.add_argument("--seed", type=int, help="with --temperature: a seed for the sampler, for repeatable output")
    g.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    g.add_argument("--json", action="store_true", help="print one JSON object: token_ids, text, stats")
    g.add_argument("--record-trace", metavar="FILE.npz", help="record every block read (for kvscope policy-lab)")
    _add_model_flags(g)
    _add_cache_flags(g)

    i = sub.add_parser("info", help="model geometry, bytes per token per dtype, sizing formula, memory breakdown")
    i.add_argument("--batch", type=int, default=8)
    i.add_argument("--context", type=int, default=2048)
    i.add_argument("--json", action="store_true")
    _add_model_flags(i)
    _add_cache_flags(i)

    b = sub.add_parser("bench", help="throughput against transformers on the same model, in one run")
    b.add_argument("--compare", choices=("hf",), default="hf")
    b.add_argument("--prompt-tokens", type=int, default=275)
    b.add_argument("--batch1-new-tokens", type=int, default=128)
    b.add_argument("--batch", type=int, default=8)
    b.add_argument("--batch-new-tokens", type=int, default=64)
    b.add_argument("--ui", action="store_true",
                   help="instead: the window's frame costs at 1M / 100k blocks and event-loop stalls while decoding")
    b.add_argument("--snapshot-blocks", type=int, metavar="N",
                   help="instead: time engine snapshots of a pool of N blocks filled by live sequences")
    b.add_argument("--long", type=int, nargs="?", const=2048, metavar="CONTEXT", help="instead: --batch sequences of CONTEXT tokens (2048), decode step time against the memory floor (weights + KV read per step / memcpy bandwidth), top ops")
    b.add_argument("--quality", action="store_true",
                   help="instead: per KV dtype, bytes/token, tok/s, KL divergence, top-1 agreement and max logit error "
                        "against fp32 KV (teacher-forced: the fp32 run's tokens fed to each)")
    b.add_argument("--quality-tokens", type=int, default=128, metavar="N", help="with --quality: new tokens per prompt")
    b.add_argument("--quality-prompts", type=int, default=5, metavar="P", help="with --quality: prompts")
    b.add_argument("--quality-dtypes", default="fp16,bf16,fp8,int8,int8-delta,int8-kivi", metavar="LIST",
                   help="with --quality: the KV dtypes to measure, comma-separated")
    b.add_argument("--json", action="store_true")
    _add_model_flags(b)
    _add_cache_flags(b)
    from app.bench.sweep import add_sweep_flags

    add_sweep_flags(b)
    sub.add_parser("policy-lab", add_help=False,
                   help="replay a recorded block-access trace through eviction policies, against Belady's OPT")
    sub.add_parser("attach", add_help=False,
                   help="draw the KV caches of running vLLM / SGLang servers live (KV events + /metrics), read-only")
    return ap


SUBCOMMANDS = ("generate", "info", "bench", "policy-lab", "attach")


def window_parser() -> argparse.ArgumentParser:
    from app.window import add_window_flags

    ap = argparse.ArgumentParser(prog="kvscope", description="KV Scope: watch and tune a tiered, paged KV cache "
                                 f"while a real model runs. Subcommands: {', '.join(SUBCOMMANDS)} (kvscope SUB -h).")
    add_window_flags(ap)
    _add_model_flags(ap)
    _add_cache_flags(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "attach":  # before the engine imports below: attach needs no torch
        from app.attach import main as attach_main

        return attach_main(argv[1:])
    from engine.config import ConfigError
    from engine.errors import RequestError
    from engine.model.loader import ModelLoadError

    if not argv or (argv[0] not in SUBCOMMANDS and argv[0].startswith("-")):
        args = window_parser().parse_args(argv)
        try:
            from app.window import run_window

            return run_window(args)
        except (ModelLoadError, ConfigError, RequestError, OSError) as e:
            print(f"kvscope: error: {e}", file=sys.stderr)
            return 2
    if argv[0] == "policy-lab":
        from app.policy_lab import main as lab_main

        try:
            return lab_main(argv[1:])
        except (ValueError, OSError) as e:
            print(f"kvscope policy-lab: error: {e}", file=sys.stderr)
            return 2
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        if args.cmd == "generate":
            from app.commands import cmd_generate

            return cmd_generate(args)
        if args.cmd == "info":
            from app.commands import cmd_info

            return cmd_info(args)
        if args.cmd == "bench" and (args.workload or args.trace):
            from app.bench.sweep import run_sweep

            return run_sweep(args)
        if args.cmd == "bench" and args.ui:
            from app.bench.ui_frames import run_ui_bench

            res = run_ui_bench(say=(lambda *a: print(*a, file=sys.stderr)) if args.json else print)
            if args.json:
                print(json.dumps(res))
            return 0
        if args.cmd == "bench" and args.snapshot_blocks:
            from app.bench.throughput import snapshot_bench

            res = snapshot_bench(args.snapshot_blocks)
            print(json.dumps(res) if args.json else
                  f"snapshot of {res['blocks']:,} blocks ({res['used_device']:,} used on device, {res['used_host']:,} "
                  f"on host, {res['sequences']} sequences): median {res['snapshot_ms_median']:.2f} ms, "
                  f"max {res['snapshot_ms_max']:.2f} ms")
            return 0
        if args.cmd == "bench":
            from app.bench.throughput import cmd_bench

            return cmd_bench(args)
    except (ModelLoadError, ConfigError, RequestError, OSError) as e:
        print(f"kvscope: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    ap.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
