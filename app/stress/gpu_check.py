"""One prepared CUDA check, for a lent GPU machine (`python3 -m app.stress.gpu_check --out DIR`).

The device tool carries at most 64 MiB, so the 98 MB default GGUF cannot travel: the check builds
random-weight models with transformers there instead — a tiny one for exactness and a full-size one
with SmolLM2-135M's geometry for the throughput comparison (throughput does not depend on weight values).
It checks: greedy tokens equal transformers `generate` on CUDA (the triton paged-decode backend, fp32 weights);
with a device tier smaller than the requests' KV, blocks migrate between CUDA memory and pinned host memory on a
side stream and tokens stay equal; every lossy format runs; decode through CUDA graphs (replayed, re-captured
after a block-size change, tokens equal; kernel launches per decode step with and without); bf16 weights + bf16
KV against transformers in bf16; tests/runtime/test_cuda.py (2 MiB blocks migrated under a busy stream, every byte) and
tests/attention/test_host_stream.py (host blocks streamed a layer ahead on the side stream, every staged byte); the wall
time of host_reads=stream with the copies a layer ahead vs at the read (`stream_overlap`);
NVML and torch allocator readings; and `bench --compare hf` on CUDA. Prints one JSON object.

Issue 24: the self-checks at first use (engine/runtime/self_check.py) on real hardware — each feature's verdict
(triton paged decode, CUDA-graph buckets, side-stream migrations, streamed steps), the start-up cost of the attention
check (cold, and in a second process with triton's kernel cache warm), and each injected fault (a backend off by
0.01, a bucket replaying logits + 0.5, a copy or a staging copy with one byte flipped) caught there with tokens still
equal — and every target of item 2 in `targets` (value, target, met): batch 8 x (275 + 64) vs `generate_batch`, batch
1 decode vs `generate`, CPU-side launches per decode step with graphs, the paged-decode kernel's share of HBM
bandwidth at 8 x 8k (`bench --long`), the self-checks passing.

One run within `--budget-s` (450 s: the lent machine's 8 minutes with room to spare): the parts run in order of
importance, each timed (`timings`); a part whose estimate no longer fits is skipped and named in `skipped`, one that
raises is named in `errors` and the rest still run. `--dry-run` runs every part on the CPU at toy sizes (the code
paths, not the numbers: `dry_run` is true and no target counts as met).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


def tiny_model_dir(root: str, tokenizer_dir: str | None, seed: int = 0, **cfg) -> str:
    """A random-weight Llama of `cfg` saved under `root` as an HF directory (weights spread x4 so that greedy argmaxes
    are decisive), with `tokenizer_dir`'s tokenizer files (None: a word-level tokenizer made here)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    path = os.path.join(root, f"llama-{cfg['num_hidden_layers']}x{cfg['hidden_size']}")
    model.save_pretrained(path)
    if tokenizer_dir is None:
        tokenizer_dir = _word_tokenizer(root, cfg["vocab_size"])
    for f in os.listdir(tokenizer_dir):
        if f.startswith("tokenizer") or f in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(os.path.join(tokenizer_dir, f), path)
    return path


def _word_tokenizer(root: str, vocab: int) -> str:
    """A word-level tokenizer.json (no hub, no gguf needed) with the ids a Llama config expects."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, vocab):
        words[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    d = os.path.join(root, "tok")
    os.makedirs(d, exist_ok=True)
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, f)
    return d


def _graph_checks(model, prompts, refs, sp, device: str, checks: dict, report: dict) -> None:
    """CUDA graphs for decode (issue 9 item 3): captured per bucket, replayed, re-captured after a geometry change,
    tokens equal transformers; kernel launches per decode step with and without graphs (torch.profiler)."""
    from engine.config import CacheConfig, EngineOptions
    from engine.runtime.engine import Engine

    opts = dict(device=device, weights_dtype="fp32", attention="auto")
    eng = Engine(model, CacheConfig(block_size=16), EngineOptions(cuda_graphs="on", **opts))
    checks["graphs_greedy_equal"] = eng.generate(prompts, sp) == refs
    g = eng.runner.graphs
    report["graphs"] = {"attention": eng.model.attention, "captures": g.captures, "replays": g.replays,
                        "buckets": sorted(g.captured), "fallback": g.fallback}
    if device == "cuda":
        checks["graphs_replayed"] = g.fallback is None and g.replays > 0
    else:  # "on" without CUDA is the static path: the same buffers, run eagerly, nothing to replay
        checks["graphs_static_ran"] = g.fallback is None and bool(g.captured)
    # A block-size change mid-run: the graphs read the old tier, so they are dropped and captured again.
    eng = Engine(model, CacheConfig(block_size=16), EngineOptions(cuda_graphs="on", **opts))
    from engine.sequence import SamplingParams

    ids = [eng.add_request(p, SamplingParams(max_new_tokens=sp.max_new_tokens, ignore_eos=True)) for p in prompts]
    for _ in range(min(12, sp.max_new_tokens // 2)):
        eng.step()
    before = eng.runner.graphs.captures
    eng.reconfigure(block_size=32)
    eng.run_until_done()
    checks["graphs_recaptured_equal"] = [eng.seqs[i].output for i in ids] == refs
    report["graphs"]["captures_after_change"] = eng.runner.graphs.captures - before
    if device == "cuda":
        report["launches_per_decode_step"] = {mode: _launches(model, prompts, device, mode) for mode in ("on", "off")}


def _launches(model, prompts, device: str, mode: str) -> dict:
    """CUDA launches (kernels + graph launches + memcpys) per decode step, counted by torch.profiler over 8 steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine.config import CacheConfig, EngineOptions
    from engine.runtime.engine import Engine
    from engine.sequence import SamplingParams

    eng = Engine(model, CacheConfig(block_size=16), EngineOptions(device=device, weights_dtype="fp32", cuda_graphs=mode))
    for p in prompts[:4]:
        eng.add_request(p, SamplingParams(max_new_tokens=40, ignore_eos=True))
    for _ in range(6):  # prefill, and the bucket's capture
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            eng.step()
        torch.cuda.synchronize()
    names: dict[str, int] = {}
    for e in prof.events():
        if e.name in ("cudaLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync", "cuLaunchKernel", "cuLaunchKernelEx",
                      "cudaLaunchKernelExC"):
            names[e.name] = names.get(e.name, 0) + 1
    return {"per_step": sum(names.values()) / 8, "by_call": names}


def _bf16_check(tiny: str, spec, prompts, device: str, checks: dict, report: dict) -> None:
    """bf16 weights and bf16 KV against transformers in bf16 (item 6): agreement over 128 tokens on 3 prompts."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.config import CacheConfig, EngineOptions
    from engine.runtime.engine import Engine
    from engine.model.loader import load_model
    from engine.sequence import SamplingParams

    dev = torch.device(device)
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16).to(dev).eval()
    refs = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p], device=dev), max_new_tokens=128, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
    model = load_model(tiny, dtype=torch.bfloat16, device=device)
    eng = Engine(model, CacheConfig(block_size=16, kv_dtype="bf16"), EngineOptions(device=device, weights_dtype="bf16"))
    # Each prompt alone, as transformers' generate ran it: batching changes how bf16 matmuls round (on either side).
    got = [eng.generate([p], SamplingParams(max_new_tokens=128, ignore_eos=True))[0] for p in prompts]
    equal = sum(a == b for g, r in zip(got, refs) for a, b in zip(g, r)) / sum(map(len, refs))
    report["bf16_agreement"] = equal
    checks["bf16_agreement_95"] = equal >= 0.95


def _tier_checks(model, prompts, refs, sp, device: str, checks: dict, report: dict) -> None:
    """Issue 10 on CUDA: the host tier serves (streamed, or attended on the host), per-layer placement, and a
    live block-size change re-laid a layer at a time; tokens equal transformers in each."""
    import torch

    from engine.config import CacheConfig, EngineOptions
    from engine.runtime.engine import Engine

    opts = EngineOptions(device=device, weights_dtype="fp32", max_batched_tokens=128)
    report["tiers"] = {}
    for mode in ("stream", "compute"):
        eng = Engine(model, CacheConfig(block_size=8, device_budget_mb=0.05, host_budget_mb=16, host_reads=mode), opts)
        checks[f"host_reads_{mode}_equal"] = eng.generate(prompts, sp) == refs
        eng.check_invariants()
        report["tiers"][mode] = {k: eng.counters.as_dict()[k] for k in ("read_tokens", "read_tokens_streamed",
                                                                        "promotions", "preemptions")}
    eng = Engine(model, CacheConfig(block_size=8, device_budget_mb=0.25, host_budget_mb=16, device_layers=2,
                                    demote_after_s=0.0), opts)
    checks["device_layers_equal"] = eng.generate(prompts, sp) == refs
    eng.check_invariants()
    report["tiers"]["device_layers"] = eng.memory()["tiers"]["device"]
    eng = Engine(model, CacheConfig(block_size=8), opts)
    ids = [eng.add_request(p, sp) for p in prompts]
    for _ in range(8):
        eng.step()
    cuda = device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    eng.reconfigure(block_size=16)
    ev = next(e.fields for e in reversed(eng.telemetry.events) if e.kind == "config")
    report["tiers"]["relayout"] = {**{k: ev.get(k) for k in ("peak_extra_bytes", "old_tier_bytes", "new_tier_bytes")},
                                   "cuda_peak_over_start_bytes": torch.cuda.max_memory_allocated() - before if cuda
                                   else None}
    eng.run_until_done()
    checks["relayout_live_equal"] = [eng.seqs[i].output for i in ids] == refs


def _stream_overlap(path: str, device: str, checks: dict, report: dict, lengths=(900, 1000, 1100, 1200),
                    new: int = 24) -> None:
    """host_reads=stream on the full-size geometry with a device tier of a few blocks: wall time of the same
    generation with each layer's host blocks copied a layer ahead (side stream, overlapping compute) and copied
    when the layer reads them (no overlap); tokens equal either way."""
    import torch

    from engine.config import CacheConfig, EngineOptions
    from engine.runtime.engine import Engine
    from engine.model.loader import load_model
    from engine.sequence import SamplingParams

    model = load_model(path)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 4096, (n,), generator=g).tolist() for n in lengths]
    sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out, rep = {}, {}
    for ahead in (False, True):
        for dtype in ("fp16", "int8"):
            eng = Engine(model, CacheConfig(block_size=16, kv_dtype=dtype, device_budget_mb=4, host_budget_mb=2048,
                                            host_reads="stream"), EngineOptions(device=device))
            eng.runner.stream.ahead = ahead
            eng.generate([prompts[0][:64]], SamplingParams(max_new_tokens=2, ignore_eos=True))  # warm up
            sync()
            t0 = time.perf_counter()
            got = eng.generate(prompts, sp)
            sync()
            key = f"{dtype}_{'ahead' if ahead else 'at_read'}"
            rep[key] = {"wall_s": time.perf_counter() - t0, "steps": eng.counters.steps,
                        "streamed_mb": eng.counters.streamed_bytes / 2**20,
                        "staging_mb": eng.runner.stream.nbytes() / 2**20}
            out.setdefault(dtype, got)
            checks[f"stream_{key}_same_tokens"] = got == out[dtype]
    report["stream_overlap"] = rep


# -- issue 24: the self-checks on real hardware --------------------------------------------------------------------


def _flip_stage(copy):
    def bad(src, slots, out):
        copy(src, slots, out)
        out.reshape(-1)[:1].view(__import__("torch").uint8)[0] ^= 0x10
    return bad


def _self_checks(model, tiny: str, prompts, refs, sp, device: str, checks: dict, report: dict) -> None:
    """Each self-check on this hardware: the verdicts of engines that exercise every feature (tokens equal), the
    start-up cost, and each injected fault caught."""
    from app.stress.faults import WrongBackend, flip_one_byte
    from engine.config import CacheConfig, EngineOptions
    from engine.runtime.engine import Engine

    def opts(**kw):
        return EngineOptions(device=device, weights_dtype="fp32", **kw)

    out: dict = {"features": {}, "faults": {}}
    engines = {
        "graphs": Engine(model, CacheConfig(block_size=16), opts(cuda_graphs="on" if device == "cuda" else "static")),
        "migration": Engine(model, CacheConfig(block_size=8, device_budget_mb=0.25, host_budget_mb=8,
                                               demote_after_s=0.0), opts(max_batched_tokens=128)),
        "stream": Engine(model, CacheConfig(block_size=8, device_budget_mb=0.05, host_budget_mb=16, host_reads="stream"),
                         opts(max_batched_tokens=128)),
    }
    out["startup_attention_check_s"] = engines["graphs"].runner.checks.summary()["attention"].get("seconds")
    for name, eng in engines.items():
        checks[f"self_check_{name}_engine_equal"] = eng.generate(prompts, sp) == refs
        for f, v in eng.runner.checks.summary().items():
            if v["state"] != "not run" and (f not in out["features"] or v["state"] == "failed"):
                out["features"][f] = v
    for f in ("attention", "graphs", "migration", "stream"):
        out["features"].setdefault(f, {"state": "not run", "checks": 0})
    checks["self_checks_all_passed"] = all(v["state"] == "passed" for v in out["features"].values())
    # The start-up check in a fresh process: triton's kernel cache on disk is warm now (what a second start pays).
    code = ("import sys, time, torch; from engine.model.loader import load_model; from engine.config import CacheConfig, "
            "EngineOptions; from engine.runtime.engine import Engine; m = load_model(sys.argv[1]); t = time.perf_counter(); "
            f"e = Engine(m, CacheConfig(block_size=16), EngineOptions(device={device!r}, weights_dtype='fp32')); "
            "print(time.perf_counter() - t, e.runner.checks.summary()['attention'].get('seconds'))")
    r = subprocess.run([sys.executable, "-c", code, tiny], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    try:
        engine_s, check_s = r.stdout.split()[-2:]
        out["second_process"] = {"engine_start_s": float(engine_s), "attention_check_s": float(check_s)}
    except ValueError:
        out["second_process"] = {"error": r.stderr[-1500:]}
    # Injected faults, each through its seam: caught, a checked path serving (the attention backend's fallback: the
    # reference path, or on the CPU the chunked torch path behind the numba loop), tokens still equal.
    faults = {}
    eng = Engine(model, CacheConfig(block_size=16), opts())
    eng.model.backend = WrongBackend(eng.model.backend)
    faults["attention"] = (eng, lambda e: not isinstance(e.model.backend, WrongBackend))
    eng = Engine(model, CacheConfig(block_size=16), opts(cuda_graphs="on" if device == "cuda" else "static"))
    real = eng.runner.graphs.capture

    def wrong(cap, pool, real=real):
        ok = real(cap, pool)
        right = cap.replay
        cap.replay = lambda: right() + 0.5
        return ok

    eng.runner.graphs.capture = wrong
    faults["graphs"] = (eng, lambda e: e.runner.graphs.fallback is not None)
    eng = Engine(model, CacheConfig(block_size=8, device_budget_mb=0.25, host_budget_mb=8, demote_after_s=0.0),
                 opts(max_batched_tokens=128))
    eng.pool.copier = flip_one_byte(eng.pool.copier)
    faults["migration"] = (eng, lambda e: e.pool.copy_stream is None)
    eng = Engine(model, CacheConfig(block_size=8, device_budget_mb=0.05, host_budget_mb=16, host_reads="stream"),
                 opts(max_batched_tokens=128))
    eng.runner.stream.copy = _flip_stage(eng.runner.stream.copy)
    faults["stream"] = (eng, lambda e: e.runner.stream.failed)
    for f, (eng, fell_back) in faults.items():
        equal = eng.generate(prompts, sp) == refs
        v = eng.runner.checks.summary()[f]
        said = [e.fields["message"] for e in eng.take_events() if e.kind == "self_check"]
        out["faults"][f] = {"caught": v["state"] == "failed", "fell_back": fell_back(eng), "tokens_equal": equal,
                            "said": said}
        checks[f"fault_{f}_caught"] = v["state"] == "failed" and fell_back(eng) and equal and len(said) == 1
    report["self_checks"] = out


def _bench_long(big: str, device: str, context: int, batch: int, timeout: float, report: dict) -> None:
    """`kvscope bench --long` (graphs off, so the profiler sees each kernel): the paged-decode kernel's bandwidth."""
    r = subprocess.run([sys.executable, "-m", "app.cli", "bench", "--long", str(context), "--batch", str(batch),
                        "--model", big, "--device", device, "--cuda-graphs", "off", "--json"],
                       capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT)
    try:
        res = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        report["bench_long"] = {"error": r.stderr[-3000:]}
        return
    res.pop("profile_top_ops", None)
    report["bench_long"] = res


def _targets(report: dict, dry: bool) -> dict:
    """Item 2's targets: each value (None: not measured), its target, and whether it was met (never on a dry run)."""
    bench = report.get("bench") if isinstance(report.get("bench"), dict) else {}
    ratios = bench.get("ratios", {})
    launches = report.get("launches_per_decode_step", {}).get("on", {}).get("per_step")
    long = report.get("bench_long", {})
    feats = report.get("self_checks", {}).get("features", {})
    rows = {
        "batch8_vs_generate_batch": (ratios.get("batch8_vs_generate_batch"), ">=", 1.5),
        "batch1_decode_vs_generate": (ratios.get("batch1_vs_generate"), ">=", 2.0),
        "launches_per_decode_step_with_graphs": (launches, "<=", 10),
        "paged_decode_hbm_share_8x8k": (long.get("paged_decode_hbm_share"), ">=", 0.5),
        "self_checks_passed": (sum(v.get("state") == "passed" for v in feats.values()) if feats else None, ">=", 4),
    }
    out = {}
    for k, (v, op, t) in rows.items():
        met = None if v is None else (v >= t if op == ">=" else v <= t)
        out[k] = {"value": v, "target": f"{op} {t}", "met": (False if dry else met)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-bench", action="store_true", help="skip the throughput comparisons")
    ap.add_argument("--dry-run", action="store_true",
                    help="every part on the CPU at toy sizes: the code paths, not the numbers")
    ap.add_argument("--budget-s", type=float, default=450.0, help="the whole run's time budget (default 450 s)")
    ap.add_argument("--only", default="", metavar="PARTS",
                    help="run only these parts (comma-separated: self_checks, exactness, graphs, bench, bench_long, "
                         "bf16, cuda_tests, stream_overlap); the rest are named in `skipped`")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device = "cpu"
    dry = args.dry_run
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    import torch

    from engine.config import CacheConfig, EngineOptions
    from engine.runtime.engine import Engine
    from engine.model.loader import load_model
    from engine.sequence import SamplingParams

    report: dict = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "dry_run": dry,
                    "budget_s": args.budget_s}
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({**report, "error": "no CUDA device"}))
        return 1
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name(0)
    timings, skipped, errors = {}, {}, {}
    report.update(timings=timings, skipped=skipped, errors=errors)
    checks: dict = {}

    only = {p.strip() for p in args.only.split(",") if p.strip()}

    def part(name: str, estimate_s: float, fn) -> None:
        """Run one part if its estimate fits what is left of the budget; time it; an exception is reported."""
        if only and name not in only:
            skipped[name] = "not in --only"
            return
        left = deadline - time.perf_counter()
        if left < estimate_s:
            skipped[name] = f"needs ~{estimate_s:.0f} s, {max(left, 0):.0f} s left of the budget"
            return
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - report it, run the rest
            errors[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
            checks[f"{name}_ran"] = False
        timings[name] = round(time.perf_counter() - t0, 1)

    dev = torch.device(args.device)
    root = tempfile.mkdtemp(prefix="kvscope-gpu-")
    t0 = time.perf_counter()
    tiny = tiny_model_dir(root, None, vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1,
                          eos_token_id=2, tie_word_embeddings=True)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).to(dev).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 4096, (n,), generator=g).tolist() for n in (9, 70, 130, 33, 201, 64)]
    n_new = 12 if dry else 32

    def ref(p: list[int], n: int) -> list[int]:
        with torch.inference_mode():
            out = hf.generate(torch.tensor([p], device=dev), max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        return out[0, len(p):].tolist()

    refs = [ref(p, n_new) for p in prompts]
    model = load_model(tiny)
    sp = SamplingParams(max_new_tokens=n_new, ignore_eos=True)
    timings["setup"] = round(time.perf_counter() - t0, 1)
    big_cfg = dict(vocab_size=4096, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                   num_key_value_heads=3, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
                   tie_word_embeddings=True)
    if dry:  # toy sizes: the same code paths
        big_cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=1024)
    big: list[str] = []

    def big_model() -> str:
        if not big:
            big.append(tiny_model_dir(root, tiny, **big_cfg))
        return big[0]

    part("self_checks", 60, lambda: _self_checks(model, tiny, prompts, refs, sp, args.device, checks, report))

    def exactness() -> None:
        for bs in (1, 16, 64):
            eng = Engine(model, CacheConfig(block_size=bs), EngineOptions(device=args.device, weights_dtype="fp32"))
            checks[f"greedy_equal_bs{bs}"] = eng.generate(prompts, sp) == refs
        # Device tier far smaller than the six requests' KV: blocks must move CUDA <-> pinned host.
        eng = Engine(model, CacheConfig(block_size=8, device_budget_mb=0.25, host_budget_mb=8, demote_after_s=0.0),
                     EngineOptions(device=args.device, weights_dtype="fp32", max_batched_tokens=128))
        t0 = time.perf_counter()
        out = eng.generate(prompts, sp)
        checks["migrating_equal"] = out == refs
        eng.check_invariants()
        c = eng.counters.as_dict()
        snap = eng.snapshot()
        report["migrations"] = {k: c[k] for k in ("promotions", "demotions", "promoted_bytes", "demoted_bytes",
                                                  "preemptions", "device_hit_rate")}
        report["migrations"]["seconds"] = time.perf_counter() - t0
        checks["migrations_happened"] = c["promotions"] > 0
        report["host_tier_pinned"] = snap.memory["tiers"]["host"]["pinned"]
        report["device_tier_on"] = snap.memory["tiers"]["device"]["device"]
        report["copy_stream"] = eng.pool.copy_stream is not None
        report["gpu_memory"] = snap.memory["gpu"]
        _tier_checks(model, prompts, refs, sp, args.device, checks, report)
        # Every lossy format through migrations: runs, keeps its invariants, stays close to fp32.
        report["lossy"] = {}
        for dtype in ("fp16", "bf16", "int8", "int8-delta", "int8-kivi", "fp8"):
            try:
                eng = Engine(model, CacheConfig(block_size=8, kv_dtype=dtype, device_budget_mb=0.25, host_budget_mb=8,
                                                demote_after_s=0.0),
                             EngineOptions(device=args.device, weights_dtype="fp32", max_batched_tokens=128))
                got = eng.generate(prompts, sp)
                eng.check_invariants()
                same = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(o)) for o, r in zip(got, refs)]
                report["lossy"][dtype] = {"identical_prefix": same, "promotions": eng.counters.promotions,
                                          "attention_check": eng.runner.checks.summary()["attention"]["state"]}
            except Exception as e:  # a format this GPU or torch build cannot store: say so, do not stop
                report["lossy"][dtype] = {"error": f"{type(e).__name__}: {e}"}
        checks["lossy_formats_run"] = all("error" not in v for k, v in report["lossy"].items() if k != "fp8")

    part("exactness", 90, exactness)
    part("graphs", 30, lambda: _graph_checks(model, prompts, refs, sp, args.device, checks, report))
    if args.no_bench:
        skipped["bench"] = skipped["bench_long"] = "--no-bench"
        only.discard("bench"), only.discard("bench_long")
    else:
        def bench() -> None:
            cmd = [sys.executable, "-m", "app.cli", "bench", "--compare", "hf", "--model", big_model(), "--device",
                   args.device, "--json"]
            if dry:
                cmd += ["--prompt-tokens", "32", "--batch1-new-tokens", "8", "--batch-new-tokens", "8", "--batch", "2"]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30.0, deadline - time.perf_counter() - 120),
                               cwd=ROOT)
            try:
                report["bench"] = json.loads(r.stdout.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError):
                report["bench"] = {"error": r.stderr[-3000:]}

        part("bench", 150, bench)
        part("bench_long", 60, lambda: _bench_long(big_model(), args.device, 256 if dry else 8192, 2 if dry else 8,
                                                   max(30.0, deadline - time.perf_counter() - 60), report))
    part("bf16", 20, lambda: _bf16_check(tiny, model.spec, prompts[:3], args.device, checks, report))
    if dry and (not only or "cuda_tests" in only):
        skipped["cuda_tests"] = "a dry run (tests/runtime/test_cuda.py needs CUDA)"
    elif not dry:
        def cuda_tests() -> None:
            # 2 MiB blocks demoted and promoted while the compute stream is busy: every byte must come back.
            checks["migration_bytes_equal"] = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/runtime/test_cuda.py",
                 "tests/attention/test_host_stream.py", "-k", "cuda"],
                cwd=ROOT, capture_output=True, text=True,
                timeout=max(30.0, deadline - time.perf_counter() - 30)).returncode == 0

        part("cuda_tests", 60, cuda_tests)
    part("stream_overlap", 45, lambda: _stream_overlap(big_model(), args.device, checks, report,
                                                       *(((90, 100, 110, 120), 6) if dry else ())))
    report["checks"] = checks
    report["targets"] = _targets(report, dry)
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    report["ok"] = all(checks.values()) and not errors
    text = json.dumps(report, indent=1, default=str)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        f.write(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
