"""`kvscope bench --compare hf`: the engine and transformers on the same model, prompts and process.

(a) one request, P-token prompt, N new tokens, greedy: engine vs `generate`;
(b) B requests x (P-token prompt + M new tokens): engine vs `generate_batch` (transformers' paged
continuous batching) and vs `generate` run once per request.
Throughput is generated tokens per wall-clock second, prefill included.

`kvscope bench --long [CONTEXT]` instead: B sequences (--batch) of CONTEXT tokens (2048) prefilled, then decode
steps timed against the memory floor, the bytes a step must read (weights + every sequence's KV) over the rate of a
streaming read measured before and after each step, the faster of the two (a step faster than that is an error: the
floor would be wrong);
`--attention` picks the backend.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from app.bench.prompts import bench_prompts
from app.commands import open_engine
from app.options import cache_config

BATCH1_GOAL = 1.2  # batch-1 decode against transformers' generate, fp32, whatever the CPU (issue 37)


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def cmd_bench(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from engine.model.loader import hf_reference_dir
    from engine.sequence import SamplingParams

    if getattr(args, "shadow_every_s", None) is None:
        args.shadow_every_s = 0.0  # benchmarks time the engine alone unless shadow steps are asked for
    if getattr(args, "long", None):
        return cmd_bench_long(args)
    if getattr(args, "kv_memory", None):
        from app.bench.kv_memory import cmd_bench_kv_memory

        return cmd_bench_kv_memory(args)
    if getattr(args, "compare", "hf") == "llamacpp" or getattr(args, "weights_quality", False):
        from app.bench.llamacpp import cmd_bench_llamacpp, cmd_bench_weights_quality

        return cmd_bench_weights_quality(args) if args.weights_quality else cmd_bench_llamacpp(args)
    if getattr(args, "quality", False):
        from app.bench.quality import cmd_bench_quality

        return cmd_bench_quality(args)
    engine, _ = open_engine(args)
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    P, N, B, M = args.prompt_tokens, args.batch1_new_tokens, args.batch, args.batch_new_tokens
    one = bench_prompts(engine.tokenizer, 1, P)
    many = bench_prompts(engine.tokenizer, B, P)[::-1]  # not the same first prompt as (a): no prefix reuse
    hf = AutoModelForCausalLM.from_pretrained(hf_reference_dir(args.model), dtype=torch.float32).to(args.device).eval()
    dev = torch.device(args.device)

    def hf_generate(p: list[int], n: int) -> list[int]:
        with torch.inference_mode():
            out = hf.generate(torch.tensor([p], device=dev), max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=engine.spec.eos_token_ids[0])
        return out[0, len(p):].tolist()

    def eng_run(ps: list[list[int]], n: int) -> list[list[int]]:
        engine.reset_prefix_cache()
        return engine.generate(ps, SamplingParams(max_new_tokens=n, ignore_eos=True))

    # Warm-up: first calls pay one-off allocation and kernel selection costs on both sides.
    say("[bench] warm-up")
    eng_run([one[0][:32]], 4)
    hf_generate(one[0][:32], 4)

    say(f"[bench] (a) 1 x ({P} prompt + {N} new), greedy")
    e_out, e_s = _timed(lambda: eng_run(one, N))
    seq = engine.seqs[max(engine.seqs)]
    e_ttft = seq.ttft
    h_out, h_s = _timed(lambda: hf_generate(one[0], N))
    # transformers' time to first token: the same call with one new token (best of two).
    h_ttft = min(_timed(lambda: hf_generate(one[0], 1))[1] for _ in range(2))
    res = {"batch1": {"engine_tok_s": N / e_s, "generate_tok_s": N / h_s, "engine_s": e_s, "generate_s": h_s,
                      "engine_ttft_s": e_ttft, "generate_ttft_s": h_ttft,
                      "engine_decode_tok_s": (N - 1) / (e_s - e_ttft), "generate_decode_tok_s": (N - 1) / (h_s - h_ttft),
                      "tokens_equal": e_out[0] == h_out}}

    say(f"[bench] (b) {B} x ({P} prompt + {M} new)")
    eb_out, eb_s = _timed(lambda: eng_run(many, M))
    gcfg = GenerationConfig(max_new_tokens=M, min_new_tokens=M, do_sample=False,
                            eos_token_id=engine.spec.eos_token_ids[0], pad_token_id=engine.spec.eos_token_ids[0])
    try:
        with torch.inference_mode():
            hb, hb_s = _timed(lambda: hf.generate_batch(inputs=many, generation_config=gcfg, progress_bar=False))
        hb_out = [list(v.generated_tokens) for v in hb.values()]
        gb_tok_s = B * M / hb_s
        gb_err = None
    except Exception as e:  # report, don't hide: the peer failed on this machine
        gb_tok_s, hb_s, hb_out, gb_err = None, None, [], f"{type(e).__name__}: {e}"
    hs_out, hs_s = _timed(lambda: [hf_generate(p, M) for p in many])
    res["batch"] = {
        "requests": B, "engine_tok_s": B * M / eb_s, "generate_batch_tok_s": gb_tok_s, "generate_sequential_tok_s":
        B * M / hs_s, "engine_s": eb_s, "generate_batch_s": hb_s, "generate_sequential_s": hs_s,
        "tokens_equal_sequential": eb_out == hs_out, "generate_batch_error": gb_err,
        "generate_batch_tokens_equal": sorted(map(tuple, hb_out)) == sorted(map(tuple, eb_out)) if hb_out else None,
    }
    c = engine.counters
    res["ratios"] = {
        # Decode throughput (tokens after the first, per second after it): the target's "batch-1 decode".
        "batch1_vs_generate": res["batch1"]["engine_decode_tok_s"] / res["batch1"]["generate_decode_tok_s"],
        "batch1_goal": BATCH1_GOAL,
        "batch1_end_to_end_vs_generate": res["batch1"]["engine_tok_s"] / res["batch1"]["generate_tok_s"],
        "batch8_vs_generate_batch": (res["batch"]["engine_tok_s"] / gb_tok_s) if gb_tok_s else None,
        "batch8_vs_generate_sequential": res["batch"]["engine_tok_s"] / res["batch"]["generate_sequential_tok_s"],
    }
    res["step_split"] = {"forward_s": c.forward_s, "bookkeeping_s": c.bookkeeping_s,
                         "bookkeeping_fraction": c.bookkeeping_s / max(c.forward_s + c.bookkeeping_s, 1e-9)}
    cost = engine.cost_signals()
    cost["device_hit_rate"] = c.device_hit_rate
    res["cost"] = {k: (None if isinstance(v, float) and v != v else v) for k, v in cost.items()}  # NaN: no data
    res["config"] = engine.config.as_dict()
    res["model"] = engine.spec.name
    res["device"] = args.device
    res["torch_threads"] = torch.get_num_threads()
    from engine.model import kernel_choice

    res["fp32_kernels"] = {"fused_layers": any(f is not None for f in getattr(engine.model, "fused", [])),
                           "picks": kernel_choice.summary(), "cpu": kernel_choice.cpu_key()}
    if args.json:
        print(json.dumps({"machine": getattr(args, "machine", None), **res}))
        return 0
    b1, bb, r = res["batch1"], res["batch"], res["ratios"]
    print(f"model {res['model']} on {args.device}, {res['torch_threads']} threads, {engine.config.summary()}")
    fk = res["fp32_kernels"]
    if fk["picks"]:
        print(f"fp32 matmuls of 1-8 rows on {fk['cpu']} (engine/model/kernel_choice.py; layers "
              f"{'fused, through the f32 kernel' if fk['fused_layers'] else 'not fused'}):")
        for line in fk["picks"]:
            print(f"  {line}")
    print(f"(a) batch 1      decode: engine {b1['engine_decode_tok_s']:6.1f} tok/s, generate "
          f"{b1['generate_decode_tok_s']:6.1f} tok/s, ratio {r['batch1_vs_generate']:.2f}x (goal >= "
          f"{BATCH1_GOAL:g}x: {'met' if r['batch1_vs_generate'] >= BATCH1_GOAL else 'NOT met'}) | end to end (with "
          f"{P}-token prefill): {b1['engine_tok_s']:.1f} vs {b1['generate_tok_s']:.1f} tok/s, "
          f"{r['batch1_end_to_end_vs_generate']:.2f}x | TTFT {b1['engine_ttft_s'] * 1e3:.0f} vs "
          f"{b1['generate_ttft_s'] * 1e3:.0f} ms | tokens equal: {b1['tokens_equal']}")
    gb = f"{bb['generate_batch_tok_s']:7.1f}" if bb["generate_batch_tok_s"] else "  n/a  "
    print(f"(b) batch {B}      engine {bb['engine_tok_s']:7.1f} tok/s   generate_batch {gb} tok/s   "
          f"generate x{B} {bb['generate_sequential_tok_s']:7.1f} tok/s")
    if r["batch8_vs_generate_batch"]:
        print(f"    ratios       vs generate_batch {r['batch8_vs_generate_batch']:.2f}x   "
              f"vs sequential generate {r['batch8_vs_generate_sequential']:.2f}x   "
              f"tokens equal to generate: {bb['tokens_equal_sequential']}")
    else:
        print(f"    generate_batch failed: {bb['generate_batch_error']}; vs sequential "
              f"{r['batch8_vs_generate_sequential']:.2f}x")
    k = res["cost"]

    def show(x, fmt):
        return "no data" if x is None else fmt.format(x)

    print(f"cost: TTFT p50/p95 {show(k['ttft_p50'], '{:.3f}')} / {show(k['ttft_p95'], '{:.3f}')} s, waiting "
          f"{k['waiting']}, preempted {k['preemptions']}, promotion stall {k['promote_stall_s']:.3f} s, promoted / "
          f"demoted {show(k['promoted_mb_per_token'], '{:.3f}')} / {show(k['demoted_mb_per_token'], '{:.3f}')} MB per "
          f"token, device hit rate (keys read) {show(k['device_hit_rate'], '{:.3f}')}, streamed from host "
          f"{show(k['streamed_share'], '{:.3f}')} of keys, {show(k['streamed_mb_per_token'], '{:.3f}')} MB per token "
          "copied as stored")
    s = res["step_split"]
    print(f"step time: forward {s['forward_s']:.2f} s, cache bookkeeping {s['bookkeeping_s']:.2f} s "
          f"({100 * s['bookkeeping_fraction']:.1f} %)")
    return 0


def _sync(device: str) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def model_weight_bytes(model) -> int:
    """Bytes of the forward pass's weights, each storage once (a tied lm_head is the embedding)."""
    seen: dict[int, int] = {}
    tensors = [model.embed, model.lm_head, model.norm] + [t for layer in model.layers for t in layer if t is not None]
    tensors = [p for t in tensors for p in (t.tensors() if hasattr(t, "tensors") else (t,))]  # packed: its parts
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def step_flops(model, rows: int, attended: list[int]) -> float:
    """Floating-point operations of one decode step of `rows` sequences: 2 per weight of every 2-D matrix the
    step multiplies (each layer's and the LM head; the embedding is a lookup) per row, and 4 per attended key per
    query head per head dimension per layer (q.k and the weighted sum of v). Norms, RoPE and softmax are left out:
    a lower bound."""
    s = model.spec
    weights = [t for layer in model.layers for t in layer if t is not None] + [model.lm_head]
    n = sum(int(t.shape[0]) * int(t.shape[1]) for t in weights if hasattr(t, "shape") and len(t.shape) == 2)
    return 2.0 * rows * n + 4.0 * sum(attended) * s.num_heads * s.head_dim * s.num_layers


def gemm_rate(device: str, n: int = 2048, repeats: int = 3) -> float:
    """FLOP per second of an n x n x n fp32 matrix product (MKL / cuBLAS on every thread), best of `repeats`: the
    most this machine's fp32 arithmetic did here, which a step of a few rows cannot beat."""
    import torch

    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    torch.mm(a, b)
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best


class FloorError(RuntimeError):
    """A decode step ran faster than the memory floor measured beside it: the floor is wrong, not the step fast."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


def long_context_bench(args: argparse.Namespace, say=print, read_mb: int = 512, steps: int = 10) -> dict:
    """B sequences x `args.long` tokens of context: prefill, then `steps` decode steps timed against the memory
    floor (the bytes a step reads over the rate of a streaming read of a `read_mb` MiB buffer, the faster of the
    reads just before and just after each step), and the top ops of 3 more steps under the torch profiler. Raises
    FloorError where a step beats its floor."""
    import numpy as np
    import torch

    from engine.kv.block_pool import blocks_for
    from engine.config import EngineOptions
    from engine.runtime.engine import Engine
    from engine.model.loader import load_model, resolve_weights_dtype
    from engine.sequence import SamplingParams

    B, ctx = args.batch, args.long
    config = cache_config(args)
    options = EngineOptions(device=args.device, weights_dtype=getattr(args, "weights_dtype", None) or "auto",
                            attention=getattr(args, "attention", None) or "auto",
                            quant_activations=getattr(args, "quant_activations", None) or "int8",
                            cuda_graphs=getattr(args, "cuda_graphs", None) or "auto", max_batch=max(16, B))
    options.validate()
    model = load_model(args.model, dtype=resolve_weights_dtype(options.weights_dtype, options.device),
                       device=options.device)
    s = model.spec
    # The device tier must hold every sequence's whole context (plus the steps): a budget that is too small is
    # raised to fit, so the bench measures attention, not eviction.
    from engine.kv.codecs import Geometry, codecs_for

    kc, vc = codecs_for(config.kv_dtype)
    geom = Geometry(layers=s.num_layers, kv_heads=s.num_kv_heads, block_size=config.block_size, head_dim=s.head_dim)
    block_bytes = sum(kc.block_bytes(geom).values()) + sum(vc.block_bytes(geom).values())
    need_mb = B * (blocks_for(ctx + 3 * steps, config.block_size) + 2) * block_bytes / 2**20
    if config.device_budget_mb < need_mb:
        config = config.replace(device_budget_mb=float(np.ceil(need_mb)))
    engine = Engine(model, config, options)
    ps = bench_prompts(engine.tokenizer, B, ctx)
    backend = engine.model.backend.name if engine.model.backend is not None else "reference"
    check = engine.runner.checks.summary()["attention"]
    say(f"[bench] long context: {B} x {ctx} tokens, {engine.model.attention} attention ({backend} backend; self-check "
        f"{check['state']}{': ' + check['message'] if 'message' in check else ''}), {engine.config.summary()}")
    t0 = time.perf_counter()
    # First token, a warm-up step, the timed steps and 3 profiled ones; no sequence finishes before the end.
    # Sequences prefilled first decode while the others prefill (a chunk of max_batched_tokens a step): room for
    # those tokens too.
    room = steps + 8 + 2 * B * -(-ctx // options.max_batched_tokens)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=room, ignore_eos=True)) for p in ps]
    while any(engine.seqs[i].first_token_at is None for i in ids):
        engine.step()
    prefill_s = time.perf_counter() - t0
    say(f"[bench] prefilled in {prefill_s:.1f} s; decoding")
    engine.step()  # warm-up: first decode step's allocations
    # The memory's read rate is measured by a streaming read of a `read_mb` MiB buffer (engine/runtime/bandwidth.py
    # StreamRead: a sum on every thread, larger than the last-level cache) just before and just after each timed
    # step, and each step is held against the floor at the faster of the two: on a shared machine the rate drifts
    # within a run, and on some it flips between two levels within seconds (EPYC-z4: ~33 and ~57 GB/s), so a step
    # that ran after a flip up must not be held against the slow read before it. A step reads its bytes once, so a
    # step faster than its floor means the floor is wrong: FloorError, not a result.
    from engine.runtime.bandwidth import StreamRead, last_level_cache_bytes

    llc = last_level_cache_bytes()
    probe = StreamRead(args.device, read_mb)
    times, fwd, reads = [], [], [probe.rate()]  # reads[i] before step i, reads[i + 1] after it
    for _ in range(steps):
        f0 = engine.counters.forward_s
        t = time.perf_counter()
        outs = engine.step()
        _sync(args.device)
        times.append(time.perf_counter() - t)
        fwd.append(engine.counters.forward_s - f0)
        reads.append(probe.rate())
        assert len(outs) == B, "every sequence decodes each step"
    # What this machine can reach for such a step: the buffer read once with the step's arithmetic beside the read
    # (its FLOPs as FMAs of 16 fp32 lanes, spread evenly: k per 64 bytes, rounded up), each such pass timed against
    # the faster of the same kernel's passes with no FMA (a plain read, on the same threads) just before and just
    # after it, as the steps are. Their ratio is the step at its floor plus the arithmetic a core could not hide
    # under the stream: the yardstick for where a step over its floor loses (the machine or the engine's kernels).
    ctx_now = [engine.seqs[i].num_cached for i in ids]
    flops = step_flops(engine.model, B, [c + 1 for c in ctx_now])
    bs = engine.config.block_size
    kv_read = sum(blocks_for(c + 1, bs) for c in ctx_now) * engine.pool.block_bytes  # blocks each row attends over
    weights = model_weight_bytes(engine.model)
    fma_k = int(np.ceil(flops / 32 / ((weights + kv_read) / 64)))
    attainable, plain = [], probe.rate_with_fma(0)
    for _ in range(5 if plain is not None else 0):
        with_fma, after = probe.rate_with_fma(fma_k), probe.rate_with_fma(0)
        attainable.append(max(plain, after) / with_fma)
        plain = after
    del probe
    rates = [max(a, b) for a, b in zip(reads, reads[1:])]  # each step's: the faster read beside it
    gemm = gemm_rate(args.device)
    bw = float(np.median(rates))
    floor = (weights + kv_read) / bw
    ratios = [t * r / (weights + kv_read) for t, r in zip(times, rates)]  # each step / the floor at its rate
    step_s = float(np.median(times))
    res = {"sequences": B, "context_tokens": ctx, "attention": engine.model.attention, "device": args.device,
           "attention_backend": engine.model.backend.name if engine.model.backend is not None else "reference",
           "model": s.name, "weights_dtype": str(engine.model.dtype).replace("torch.", ""),
           "config": engine.config.as_dict(), "torch_threads": torch.get_num_threads(), "prefill_s": prefill_s,
           "decode_steps": steps, "step_ms_median": 1e3 * step_s, "step_ms_min": 1e3 * min(times),
           "forward_ms_median": 1e3 * float(np.median(fwd)), "weights_bytes": weights, "kv_bytes_read": kv_read,
           "read_mib": read_mb, "last_level_cache_bytes": llc,
           "read_gbps": bw / 1e9, "read_gbps_min": min(rates) / 1e9, "read_gbps_max": max(rates) / 1e9,
           "reads_gbps": [r / 1e9 for r in reads],
           "floor_ms": 1e3 * floor, "step_over_floor": float(np.median(ratios)),
           "step_over_floor_each": ratios,
           "target_over_floor": 1.3,
           "step_gflop": flops / 1e9, "gemm_gflops": gemm / 1e9, "compute_floor_ms": 1e3 * flops / gemm,
           "step_over_compute_floor": step_s * gemm / flops}
    # Where the step sits between its floors: the memory floor alone is the step whose arithmetic all ran while its
    # bytes streamed in; the two floors' sum the step that did one, then the other. The share of the compute floor
    # the step hid under the memory floor, and the share the 1.3x target needs hidden (with every kernel at its
    # floor's rate: a share below 0 is a step slower than the sum, its kernels short of the read rate or the gemm's).
    mem_s, comp_s = floor, flops / gemm
    res["serial_floor_ms"] = 1e3 * (mem_s + comp_s)
    res["compute_hidden_share"] = (mem_s + comp_s - step_s) / comp_s
    res["compute_hidden_share_needed"] = min(1.0, max(0.0, (comp_s - (res["target_over_floor"] - 1) * mem_s) / comp_s))
    res["attainable_fma_per_64_bytes"] = fma_k
    res["attainable_over_floor_each"] = attainable
    res["attainable_over_floor"] = float(np.median(attainable)) if attainable else None
    say("[bench] profiling 3 decode steps")
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if str(args.device).startswith("cuda") else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        for _ in range(3):
            engine.step()
        _sync(args.device)
        profiled_s = time.perf_counter() - t
    cuda = str(args.device).startswith("cuda")
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)
    total = sum(getattr(e, key, 0) for e in events) or 1
    if not cuda:  # numba's kernels (attention, packed and fp32 matmuls) are no torch op: their time is in here
        res["outside_torch_ops_ms_per_step"] = max(0.0, profiled_s * 1e3 - total / 1e3) / 3
        total = max(total, profiled_s * 1e6)  # shares of the steps' wall time, not of the torch ops' alone
    res["profile_top_ops"] = [{"op": e.key, "calls_per_step": e.count / 3, "ms_per_step": getattr(e, key) / 3e3,
                               "share": getattr(e, key) / total} for e in events[:12]]
    # The paged-decode kernel's own bandwidth (CUDA, triton): the KV bytes a step attends over / the kernel's device
    # time per step, against the read rate measured beside the steps.
    kernel_us = sum(getattr(e, key, 0) for e in events if "paged_decode" in e.key) / 3
    if cuda and kernel_us > 0:
        res["paged_decode_ms_per_step"] = kernel_us / 1e3
        res["paged_decode_gbps"] = kv_read / (kernel_us / 1e6) / 1e9
        res["hbm_gbps"] = bw / 1e9
        res["paged_decode_hbm_share"] = res["paged_decode_gbps"] / res["hbm_gbps"]
    if min(ratios) < 1.0:
        i = int(np.argmin(ratios))
        raise FloorError(f"decode step {i} took {1e3 * times[i]:.1f} ms for {(weights + kv_read) / 1e6:.0f} MB, "
                         f"{(weights + kv_read) / times[i] / 1e9:.1f} GB/s, faster than the streaming reads just "
                         f"before and after it ({reads[i] / 1e9:.1f} and {reads[i + 1] / 1e9:.1f} GB/s of a "
                         f"{read_mb} MiB buffer): the floor is not a floor here "
                         f"(a buffer inside the last-level cache, {llc and llc >> 20} MiB? a step that reads less than "
                         "counted?)", res)
    return res


def cmd_bench_long(args: argparse.Namespace) -> int:
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    try:
        res = long_context_bench(args, say)
    except FloorError as e:
        print(f"kvscope bench --long: {e}", file=sys.stderr)
        if args.json:
            print(json.dumps({"machine": getattr(args, "machine", None), **e.result, "error": str(e)}))
        return 1
    if args.json:
        print(json.dumps({"machine": getattr(args, "machine", None), **res}))
        return 0
    llc = res["last_level_cache_bytes"]
    print(f"model {res['model']} ({res['weights_dtype']}) on {res['device']}, {res['torch_threads']} threads, "
          f"{res['attention']} attention ({res['attention_backend']} backend), {res['sequences']} x "
          f"{res['context_tokens']} tokens of context")
    print(f"decode step: median {res['step_ms_median']:.1f} ms (forward {res['forward_ms_median']:.1f} ms, min "
          f"{res['step_ms_min']:.1f} ms) | memory floor {res['floor_ms']:.1f} ms = ({res['weights_bytes'] / 1e6:.0f} MB "
          f"weights + {res['kv_bytes_read'] / 1e6:.0f} MB KV) / {res['read_gbps']:.1f} GB/s read (a streaming read of "
          f"{res['read_mib']} MiB, last-level cache {f'{llc >> 20} MiB' if llc else 'not known'}, on every thread, "
          f"the faster of those before and after each step: {res['read_gbps_min']:.1f}-{res['read_gbps_max']:.1f}) | "
          f"step / floor {res['step_over_floor']:.2f}x (median of each step against the floor at that rate, "
          f"{min(res['step_over_floor_each']):.2f}-{max(res['step_over_floor_each']):.2f}; target <= "
          f"{res['target_over_floor']}x: {'met' if res['step_over_floor'] <= res['target_over_floor'] else 'NOT met'})")
    print(f"compute floor {res['compute_floor_ms']:.1f} ms = {res['step_gflop']:.2f} GFLOP a step (weights x rows "
          f"and attention's q.k and v sums, x 2) / {res['gemm_gflops']:.0f} GFLOP/s (an fp32 2048^3 gemm here, every "
          f"thread) | step / compute floor {res['step_over_compute_floor']:.2f}x | the "
          f"{'memory' if res['floor_ms'] >= res['compute_floor_ms'] else 'compute'} floor is the higher")
    print(f"overlap: the two floors' sum {res['serial_floor_ms']:.1f} ms (the bytes read, then the arithmetic); the "
          f"step hid {100 * res['compute_hidden_share']:.0f} % of the compute floor under the memory floor, where "
          f"{res['target_over_floor']}x the memory floor needs {100 * res['compute_hidden_share_needed']:.0f} % hidden")
    if res["attainable_over_floor"] is not None:
        a = res["attainable_over_floor_each"]
        print(f"attainable: {res['attainable_over_floor']:.2f}x the floor ({min(a):.2f}-{max(a):.2f}, {len(a)} "
              f"passes) = the {res['read_mib']} MiB buffer read once with the step's arithmetic beside the read "
              f"({res['attainable_fma_per_64_bytes']} FMAs of 16 fp32 lanes per 64 bytes, on every thread) against the "
              f"faster of the same read without them just before and after it: what a step that streams its bytes "
              f"once can reach here; the step's {res['step_over_floor']:.2f}x past it is its kernels'")
    else:
        print("attainable: not measured (no llvmlite, or not a CPU)")
    if "paged_decode_gbps" in res:
        print(f"paged decode kernel: {res['paged_decode_ms_per_step']:.2f} ms per step for {res['kv_bytes_read'] / 1e6:.0f} MB "
              f"of KV = {res['paged_decode_gbps']:.0f} GB/s, {100 * res['paged_decode_hbm_share']:.0f} % of the "
              f"device's streaming read ({res['hbm_gbps']:.0f} GB/s; target >= 50 %)")
    print("top ops per decode step (self time):")
    if "outside_torch_ops_ms_per_step" in res:
        print(f"  {res['outside_torch_ops_ms_per_step']:8.2f} ms  in no torch op (numba's compiled attention and "
              f"matmuls, Python; the profiled steps' wall time less every op's self time; shares below are of that "
              f"wall time)")
    for op in res["profile_top_ops"]:
        print(f"  {op['ms_per_step']:8.2f} ms  {100 * op['share']:5.1f} %  {op['calls_per_step']:7.1f} calls  {op['op']}")
    return 0


def tiny_random_model(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 4096):
    """An in-memory random Llama with the default model's tokenizer: for measuring the cache, not the model."""
    import dataclasses

    import torch

    from engine.model.loader import LoadedModel, load_model

    base = load_model(None)
    spec = dataclasses.replace(base.spec, num_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                               num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads, vocab_size=vocab,
                               sliding_window=(None,) * layers, name="tiny-random")
    g = torch.Generator().manual_seed(0)
    w = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g), "model.norm.weight": torch.ones(hidden)}
    hd = hidden // heads
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (heads * hd, hidden)), ("self_attn.k_proj", (kv_heads * hd, hidden)),
                            ("self_attn.v_proj", (kv_heads * hd, hidden)), ("self_attn.o_proj", (hidden, heads * hd)),
                            ("mlp.gate_proj", (2 * hidden, hidden)), ("mlp.up_proj", (2 * hidden, hidden)),
                            ("mlp.down_proj", (hidden, 2 * hidden))):
            w[p + name + ".weight"] = torch.randn(*shape, generator=g) * 0.1
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    return LoadedModel(spec=spec, weights=w, tokenizer=base.tokenizer, source="tiny-random", cache_dir=None)


def filled_engine(n_blocks: int, seq_tokens: int = 1000):
    """An engine whose pool of n_blocks one-token blocks is ~95% held by live sequences, half of them
    paused and demoted to the host tier. Returns (engine, sequence count, seconds to fill)."""
    import numpy as np

    from engine.config import CacheConfig, EngineOptions
    from engine.runtime.engine import Engine
    from engine.sequence import SamplingParams

    model = tiny_random_model()
    s = model.spec
    per_block = s.num_layers * s.num_kv_heads * s.head_dim * 2 * 4  # fp32, block_size 1
    half_mb = n_blocks / 2 * per_block / 2**20
    now = [1000.0]  # a clock well past zero, so a bench can lay history before the fill
    eng = Engine(model, CacheConfig(block_size=1, device_budget_mb=half_mb, host_budget_mb=half_mb,
                                    demote_after_s=1.0),
                 EngineOptions(max_batch=4096, max_batched_tokens=1 << 16), clock=lambda: now[0])
    rng = np.random.default_rng(0)
    seq_tokens = max(1, min(seq_tokens, n_blocks // 8))  # small pools (tests) still hold several sequences
    per_phase = max(1, int(0.95 * n_blocks / 2) // seq_tokens)
    # Admission reserves each request's peak (prompt + max_new_tokens) over both tiers (engine/runtime/scheduler.py), and
    # the second half is admitted beside the first half's blocks: what the fill leaves free is what they may
    # still generate.
    max_new = max(1, (n_blocks - 4 - 2 * per_phase * seq_tokens) // per_phase - 1)
    n_seqs = 2 * per_phase
    t0 = time.perf_counter()
    ids: list[int] = []
    for phase in range(2):
        batch = [eng.add_request(rng.integers(3, s.vocab_size, seq_tokens).tolist(),
                                 SamplingParams(max_new_tokens=max_new, ignore_eos=True)) for _ in range(per_phase)]
        while any(eng.seqs[i].first_token_at is None for i in batch):
            eng.step()
        ids += batch
        if phase == 0:  # park the first half: paused, idle past demote_after_s, so on the host tier
            for i in batch:
                eng.pause(i)
            now[0] += 2.0
            eng.step()
    return eng, n_seqs, time.perf_counter() - t0


def snapshot_bench(n_blocks: int, repeats: int = 20) -> dict:
    """Time `snapshot()` (per-tier metadata arrays plus the sequence table) on a filled pool."""
    import numpy as np

    eng, n_seqs, fill_s = filled_engine(n_blocks)
    eng.snapshot()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        snap = eng.snapshot()
        times.append(time.perf_counter() - t)
    used = [int(np.count_nonzero(t.state)) for t in snap.tiers]
    return {"blocks": sum(t.capacity for t in snap.tiers), "used_device": used[0], "used_host": used[1],
            "sequences": n_seqs, "fill_s": fill_s, "snapshot_ms_median": 1e3 * float(np.median(times)),
            "snapshot_ms_max": 1e3 * float(np.max(times))}
