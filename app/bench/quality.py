"""`kvscope bench --quality`: what each lossy KV format costs on the model, against the lossless cache.

Per KV dtype: bytes per token, tokens/s of its (teacher-forced) run, mean and p99 KL divergence from fp32 KV,
top-1 agreement and max logit error over N new tokens x P prompts (engine/lab/quality.py), and the free-running
identical prefix per prompt. For scale: llama.cpp's q8_0 KV cache is quoted at KLD ~0.001.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from app.bench.prompts import bench_prompts
from app.commands import open_engine

DTYPES = ("fp16", "bf16", "fp8", "int8", "int8-delta", "int8-kivi")


def cmd_bench_quality(args: argparse.Namespace) -> int:
    from engine.config import CacheConfig, EngineOptions
    from engine.runtime.engine import Engine
    from engine.lab.quality import compare, run_forced
    from engine.sequence import SamplingParams

    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    base, _ = open_engine(args)
    n, count = args.quality_tokens, args.quality_prompts
    ps = bench_prompts(base.tokenizer, count, args.prompt_tokens)
    big = dict(device_budget_mb=max(base.config.device_budget_mb, 512.0), host_budget_mb=0.0)

    def engine(dtype: str) -> Engine:
        return Engine(base.loaded, CacheConfig(block_size=base.config.block_size, kv_dtype=dtype, **big),
                      EngineOptions(device=base.options.device, weights_dtype=base.options.weights_dtype,
                                    attention=base.options.attention))

    say(f"[bench] quality: {count} prompts x ({args.prompt_tokens} + {n} new tokens), fp32 KV as the reference")
    ref_engine = engine("fp32")
    reference_tokens = ref_engine.generate(ps, SamplingParams(max_new_tokens=n, ignore_eos=True))
    ref = run_forced(engine("fp32"), ps, reference_tokens)
    rows = []
    for dtype in args.quality_dtypes.split(","):
        eng = engine(dtype)
        t = time.perf_counter()
        got = run_forced(eng, ps, reference_tokens)
        tok_s = count * n / (time.perf_counter() - t)
        free = engine(dtype).generate(ps, SamplingParams(max_new_tokens=n, ignore_eos=True))
        r = compare(dtype, ref, got, free, reference_tokens)
        per_token = eng.pool.block_bytes / eng.config.block_size
        rows.append({"kv_dtype": dtype, "bytes_per_token": per_token, "vs_fp32": per_token / (ref_engine.pool.block_bytes / ref_engine.config.block_size),
                     "tok_s": tok_s, "kld": r.kld, "kld_p99": r.kld_p99, "top1": r.top1,
                     "max_logit_err": r.max_logit_err, "identical_prefix": r.identical_prefix, "tokens": r.tokens})
        say(f"  {dtype:10s} {per_token:8.0f} B/token ({rows[-1]['vs_fp32']:.3f}x)  {tok_s:6.1f} tok/s  KLD {r.kld:.5f} "
            f"(p99 {r.kld_p99:.4f})  top-1 {100 * r.top1:6.2f} %  max logit err {r.max_logit_err:.3f}  "
            f"identical prefix {r.identical_prefix}")
    if args.json:
        print(json.dumps({"machine": getattr(args, "machine", None), "model": base.spec.name, "prompts": count, "new_tokens": n, "rows": rows}))
    return 0
