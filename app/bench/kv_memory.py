"""`kvscope bench --kv-memory [CONTEXT]`: the KV bytes one request of CONTEXT prompt tokens holds with KV-cache groups
(engine/kv/groups.py) against one pool for every layer, and whether the tokens are the same.

Both runs get the same budgets (raised to hold the one-pool run on the device tier) and the same greedy request. Held
bytes are the blocks the sequence owns (ref > 0) times their size, per group, at the end of the prefill and at their
peak; blocks a window group let go of but keeps cached for prefix reuse are reclaimable and counted apart.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from app.bench.prompts import bench_prompts
from app.options import cache_config


def owned_and_cached(pools) -> tuple[list[int], list[int]]:
    """Per pool: bytes of blocks sequences own, and of cached (unowned, hashed) ones, over both tiers."""
    owned, cached = [], []
    for p in pools:
        o = c = 0
        for t in p.tiers:
            live = t.lid >= 0
            o += int(np.count_nonzero(live & (t.ref > 0)))
            c += int(np.count_nonzero(live & (t.ref == 0)))
        owned.append(o * p.block_bytes)
        cached.append(c * p.block_bytes)
    return owned, cached


def cmd_bench_kv_memory(args: argparse.Namespace) -> int:
    from engine.config import EngineOptions
    from engine.kv.block_pool import BlockPool, blocks_for
    from engine.model.loader import load_model, resolve_weights_dtype
    from engine.runtime.engine import Engine
    from engine.sequence import SamplingParams

    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    ctx, n_new = args.kv_memory, min(args.batch1_new_tokens, 16)
    config = cache_config(args)
    dtype = resolve_weights_dtype(getattr(args, "weights_dtype", None) or "auto", args.device)
    model = load_model(args.model, dtype=dtype, device=args.device)
    s = model.spec
    per_block = BlockPool.bytes_per_block(config, s.num_layers, s.num_kv_heads, s.head_dim)
    need_mb = (blocks_for(ctx + n_new, config.block_size) + 4) * per_block / 2**20
    if config.device_budget_mb < need_mb:
        config = config.replace(device_budget_mb=float(np.ceil(need_mb)))
    config = config.replace(shadow_every_s=0.0)  # the engine alone
    prompt = bench_prompts(model.tokenizer, 1, ctx)[0]
    say(f"[bench] kv memory: {s.name}, one request of {ctx} prompt tokens + {n_new} new, {config.summary()}")
    runs = {}
    for mode in ("off", "auto"):
        eng = Engine(model, config, EngineOptions(device=args.device, kv_groups=mode,
                                                  weights_dtype=getattr(args, "weights_dtype", None) or "auto"))
        pools = eng.kv.pools
        titles = [g.title for g in eng.kv_groups]
        sid = eng.add_request(prompt, SamplingParams(max_new_tokens=n_new, ignore_eos=True))
        seq = eng.seqs[sid]
        peak = [0] * len(pools)
        prefill = None
        t0 = time.perf_counter()
        while not seq.done:
            eng.step()
            owned, cached = owned_and_cached(pools)
            peak = [max(a, b) for a, b in zip(peak, owned)]
            if prefill is None and seq.output:
                prefill = (owned, cached)
        runs[mode] = {"groups": titles, "owned_after_prefill": prefill[0], "cached_after_prefill": prefill[1],
                      "peak_owned": peak, "tokens": list(seq.output), "seconds": time.perf_counter() - t0}
        say(f"  kv_groups {mode:4s}: " + "; ".join(
            f"{t}: {o / 2**20:.1f} MiB held after the prefill (peak {p / 2**20:.1f}, {c / 2**20:.1f} cached)"
            for t, o, p, c in zip(titles, prefill[0], peak, prefill[1])) + f"  [{runs[mode]['seconds']:.0f} s]")
    one, grouped = sum(runs["off"]["owned_after_prefill"]), sum(runs["auto"]["owned_after_prefill"])
    same = runs["off"]["tokens"] == runs["auto"]["tokens"]
    ratio = grouped / one if one else float("nan")
    say(f"  held at {ctx} tokens: {grouped / 2**20:.1f} MiB with groups, {one / 2**20:.1f} MiB in one pool: "
        f"{ratio:.3f}x; peak {sum(runs['auto']['peak_owned']) / 2**20:.1f} vs {sum(runs['off']['peak_owned']) / 2**20:.1f} "
        f"MiB; same {n_new} tokens: {same}")
    if args.json:
        print(json.dumps({"machine": getattr(args, "machine", None), "model": s.name, "context": ctx, "new_tokens": n_new, "ratio": ratio, "same_tokens": same,
                          "runs": runs}))
    return 0 if same else 1
