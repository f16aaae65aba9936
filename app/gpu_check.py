"""One prepared CUDA check, for a lent GPU machine (`python3 -m app.gpu_check --out DIR`).

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
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


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
    checks["graphs_replayed"] = g.fallback is None and g.replays > 0
    # A block-size change mid-run: the graphs read the old tier, so they are dropped and captured again.
    eng = Engine(model, CacheConfig(block_size=16), EngineOptions(cuda_graphs="on", **opts))
    from engine.sequence import SamplingParams

    ids = [eng.add_request(p, SamplingParams(max_new_tokens=32, ignore_eos=True)) for p in prompts]
    for _ in range(12):
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


def _stream_overlap(path: str, device: str, checks: dict, report: dict) -> None:
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
    prompts = [torch.randint(3, 4096, (n,), generator=g).tolist() for n in (900, 1000, 1100, 1200)]
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-bench", action="store_true", help="skip the throughput comparison (a CPU dry run)")
    args = ap.parse_args(argv)
    import torch

    from engine.config import CacheConfig, EngineOptions
    from engine.runtime.engine import Engine
    from engine.model.loader import load_model
    from engine.sequence import SamplingParams

    report: dict = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({**report, "error": "no CUDA device"}))
        return 1
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name(0)
    dev = torch.device(args.device)
    root = tempfile.mkdtemp(prefix="kvscope-gpu-")
    tiny = tiny_model_dir(root, None, vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1,
                     eos_token_id=2, tie_word_embeddings=True)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).to(dev).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 4096, (n,), generator=g).tolist() for n in (9, 70, 130, 33, 201, 64)]

    def ref(p: list[int], n: int) -> list[int]:
        with torch.inference_mode():
            out = hf.generate(torch.tensor([p], device=dev), max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        return out[0, len(p):].tolist()

    refs = [ref(p, 32) for p in prompts]
    model = load_model(tiny)
    sp = SamplingParams(max_new_tokens=32, ignore_eos=True)
    checks = {}
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
    report["host_tier_pinned"] = snap.memory["tiers"]["host"]["pinned"]
    report["device_tier_on"] = snap.memory["tiers"]["device"]["device"]
    report["copy_stream"] = eng.pool.copy_stream is not None
    report["gpu_memory"] = snap.memory["gpu"]
    _tier_checks(model, prompts, refs, sp, args.device, checks, report)
    # Every lossy format on CUDA, through migrations: runs, keeps its invariants, stays close to fp32.
    report["lossy"] = {}
    for dtype in ("fp16", "bf16", "int8", "int8-delta", "int8-kivi", "fp8"):
        try:
            eng = Engine(model, CacheConfig(block_size=8, kv_dtype=dtype, device_budget_mb=0.25, host_budget_mb=8,
                                            demote_after_s=0.0), EngineOptions(device=args.device, weights_dtype="fp32", max_batched_tokens=128))
            got = eng.generate(prompts, sp)
            eng.check_invariants()
            same = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(o)) for o, r in zip(got, refs)]
            report["lossy"][dtype] = {"identical_prefix": same, "promotions": eng.counters.promotions}
        except Exception as e:  # a format this GPU or torch build cannot store: say so, do not stop
            report["lossy"][dtype] = {"error": f"{type(e).__name__}: {e}"}
    checks["lossy_formats_run"] = all("error" not in v for k, v in report["lossy"].items() if k != "fp8")
    _graph_checks(model, prompts, refs, sp, args.device, checks, report)
    _bf16_check(tiny, model.spec, prompts[:3], args.device, checks, report)
    # 2 MiB blocks demoted and promoted while the compute stream is busy: every byte must come back.
    checks["migration_bytes_equal"] = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/runtime/test_cuda.py",
         "tests/attention/test_host_stream.py", "-k", "cuda"],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), capture_output=True, text=True,
        timeout=300).returncode == 0
    report["checks"] = checks
    # Throughput: SmolLM2-135M geometry with random weights, engine vs transformers on the same GPU.
    big = tiny_model_dir(root, tiny, vocab_size=4096, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, bos_token_id=1,
                    eos_token_id=2, tie_word_embeddings=True)

    try:
        _stream_overlap(big, args.device, checks, report)
    except Exception as e:  # report it, run the rest
        report["stream_overlap"] = {"error": f"{type(e).__name__}: {e}"}
    if args.no_bench:
        report["bench"] = "skipped (--no-bench)"
    else:
        bench = subprocess.run([sys.executable, "-m", "app.cli", "bench", "--compare", "hf", "--model", big, "--device",
                                args.device, "--json"], capture_output=True, text=True, timeout=500)
        try:
            report["bench"] = json.loads(bench.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            report["bench_error"] = bench.stderr[-3000:]
    report["ok"] = all(checks.values()) and report["migrations"]["promotions"] > 0
    text = json.dumps(report, indent=1, default=str)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        f.write(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
