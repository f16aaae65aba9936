"""`kvscope generate` and `kvscope info`."""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from typing import Iterator

from app.options import T_START, cache_config


def progress_printer(stage: str, fraction: float) -> None:
    print(f"\r[kvscope] {stage}: {fraction * 100:5.1f}%", end="\n" if fraction >= 1.0 else "", file=sys.stderr,
          flush=True)


def open_engine(args: argparse.Namespace, progress=progress_printer):
    """The engine for the parsed flags, and the seconds its model took to load; progress(stage, fraction)
    hears the load's stages (the first start's conversion)."""
    from engine.config import EngineOptions
    from engine.runtime.engine import Engine
    from engine.model.loader import load_model

    config = cache_config(args)  # validate knobs before the (slow) model load
    options = EngineOptions(device=args.device, context_limit=getattr(args, "context_limit", None),
                            n_keep=getattr(args, "n_keep", 0) or 0,
                            weights_dtype=getattr(args, "weights_dtype", None) or "auto",
                            attention=getattr(args, "attention", None) or "auto",
                            cuda_graphs=getattr(args, "cuda_graphs", None) or "auto",
                            kv_groups=getattr(args, "kv_groups", None) or "auto",
                            quant_activations=getattr(args, "quant_activations", None) or "int8")
    options.validate()  # signs and types now; against the model's positions once it is loaded
    t0 = time.perf_counter()
    # Loaded straight into the engine's dtype and device, so the engine uses these tensors as they are.
    # (the option's name, not its torch dtype: int8 / int4 load packed, engine/model/quant.py)
    model = load_model(args.model, progress=progress, dtype=options.weights_dtype, device=options.device)
    engine = Engine(model, config, options)
    return engine, time.perf_counter() - t0


def _sampling(args: argparse.Namespace, max_new: int):
    from engine.sequence import SamplingParams

    return SamplingParams(max_new_tokens=max_new, temperature=args.temperature or 0.0, top_p=args.top_p,
                          seed=args.seed, ignore_eos=args.ignore_eos)


def _stats(engine, seq) -> dict:
    from engine.kv.misses import seq_summary as seq_why_missed

    ttft = seq.ttft
    decode_s = (seq.finished_at or engine.clock()) - (seq.first_token_at or seq.arrival)
    return {
        "prompt_tokens": seq.prompt_len,
        "generated_tokens": len(seq.output),
        "prefix_reused_tokens": seq.prefix_reused,
        "finish_reason": seq.finish_reason,
        "ttft_s": ttft,
        "decode_tokens_per_s": (len(seq.output) - 1) / decode_s if len(seq.output) > 1 and decode_s > 0 else None,
        "context_shifts": seq.shifts,
        "preemptions": seq.preemptions,
        # engine/kv/misses.py: this sequence's missed tokens by reason (its prompt lookups and its key reads)
        "why_missed": seq_why_missed(seq.why_missed),
    }


def _engine_stats(engine, load_s: float, first_token_s: float | None) -> dict:
    from engine.kv.misses import summary as why_missed
    from engine.telemetry.health import report

    c = engine.counters.as_dict()
    return {
        "config": engine.config.as_dict(),
        "device": str(engine.device),
        "model": engine.spec.name,
        "load_s": load_s,
        "first_token_since_start_s": first_token_s,
        "device_blocks": engine.pool.tiers[0].capacity,
        "host_blocks": engine.pool.tiers[1].capacity,
        "block_bytes": engine.pool.block_bytes,
        # Rates with nothing counted are null ("no data"), not 0 and not NaN (which is not JSON).
        **{k: (None if isinstance(c[k], float) and c[k] != c[k] else c[k])
           for k in ("device_hit_rate", "prefix_hit_rate", "read_tokens", "read_tokens_missed", "read_tokens_streamed",
                     "streamed_bytes", "block_reads", "block_misses", "promotions", "demotions", "promoted_bytes",
                     "demoted_bytes",
                     "evictions", "preemptions", "cow_copies", "context_shifts", "steps")},
        "forward_s": c["forward_s"],
        "bookkeeping_s": c["bookkeeping_s"],
        # engine/kv/misses.py: every sequence's, adding up to the engine's lookups and key reads missed
        "engine_why_missed": why_missed(c),
        # Cache health (engine/telemetry/health.py): the MemOS targets with their grades, and the checklist.
        "health": report(engine.health()),
        # KV-cache groups (engine/kv/groups.py): each one's pool; device_blocks etc. above are the first's. [] with
        # one pool for every layer.
        "kv_groups": [{"title": g.title, "layers": list(g.layers), "window": g.window,
                       "device_blocks": p.tiers[0].capacity, "host_blocks": p.tiers[1].capacity,
                       "block_bytes": p.block_bytes, "read_tokens": reads[0], "read_tokens_missed": reads[1],
                       "why_missed": reads[3]}
                      for g, p, reads in engine.kv.snapshot_groups()],
        # Self-checks at first use (engine/runtime/self_check.py): per feature its state and the deciding verdict.
        "self_checks": engine.runner.checks.summary(),
    }


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.runtime.engine import RequestError

    # Everything that can be checked without the model is checked before its (slow) load.
    _sampling(args, args.max_new_tokens)
    if args.prompt_file:
        if not any(True for _ in _read_prompt_file(args.prompt_file, args.max_new_tokens)):
            raise RequestError(f"{args.prompt_file}: no requests")
    elif args.prompt is None:
        raise RequestError("give a PROMPT or --prompt-file")
    trace_path = check_writable(args.record_trace, ".npz", "--record-trace") if args.record_trace else None
    engine, load_s = open_engine(args)
    if trace_path:
        engine.start_trace()
    try:
        if args.prompt_file:
            return _run_file(engine, args, load_s)
        return _run_one(engine, args, load_s)
    finally:
        if trace_path:
            trace = engine.stop_trace(trace_path)
            print(f"[kvscope] recorded {len(trace):,} block reads to {trace_path}", file=sys.stderr)


def check_writable(path: str, suffix: str, flag: str) -> str:
    """The path a file will be written to (np.savez adds `suffix`), if it can be; else RequestError, now."""
    from engine.errors import RequestError

    target = path if path.endswith(suffix) else path + suffix
    folder = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(folder):
        raise RequestError(f"{flag} {path}: no such folder {folder}")
    if os.path.isdir(target):
        raise RequestError(f"{flag} {path}: is a folder")
    existed = os.path.exists(target)
    if existed and not os.path.isfile(target):  # a FIFO would block the open below, a device take the bytes
        raise RequestError(f"{flag} {path}: not a regular file")
    try:
        with open(target, "ab"):
            pass
    except OSError as e:
        raise RequestError(f"{flag} {path}: cannot write there ({e.strerror})") from None
    if not existed:
        os.remove(target)
    return target


def _run_one(engine, args, load_s: float) -> int:
    from engine.model.tokenizer import StreamDecoder
    from engine.workloads.prompts import encode_text

    ids = encode_text(engine.tokenizer, args.prompt, args.chat)
    sid = engine.add_request(ids, _sampling(args, args.max_new_tokens))
    engine.keep(sid)
    seq = engine.seqs[sid]
    decoder = StreamDecoder(engine.tokenizer)
    first_token_s = None
    while engine.has_work():
        for out in engine.step():
            if first_token_s is None:
                first_token_s = time.perf_counter() - T_START
                if not args.json:
                    print(f"[kvscope] first token {first_token_s:.2f} s after start (model load {load_s:.2f} s)",
                          file=sys.stderr)
            if not args.json:
                print(decoder.push(out.token), end="", flush=True)
    if seq.finish_reason not in ("eos", "length"):  # aborted: what came out is not an answer
        if not args.json:
            print(file=sys.stdout, flush=True)
        print(f"kvscope: error: {seq.error or 'generation ended early: ' + seq.finish_reason}", file=sys.stderr)
        return 2
    text = engine.tokenizer.decode(seq.output)
    if args.json:
        stats = {**_stats(engine, seq), **_engine_stats(engine, load_s, first_token_s)}
        print(json.dumps({"token_ids": seq.output, "text": text, "stats": stats}))
    else:
        print(decoder.flush())
        c = engine.counters
        print(f"[kvscope] {len(seq.output)} tokens, device hit rate {c.device_hit_rate:.3f}, "
              f"{c.promotions} promotions / {c.demotions} demotions, {engine.config.summary()}", file=sys.stderr)
    return 0


REQUEST_KEYS = {"prompt", "max_new_tokens", "chat"}


def _read_prompt_file(path: str, default_max: int) -> Iterator[tuple[int, dict]]:
    """(line number, request) for each request line, checked for shape; read lazily (memory stays bounded).
    The file must be a regular file of at most MAX_JSONL_BYTES (engine/user_file.py)."""
    from engine.runtime.engine import RequestError
    from engine.sequence import check_token_ids
    from engine.user_file import json_lines
    from engine.workloads.requests import MAX_NEW_TOKENS

    lines = json_lines(path, "a prompt file")
    while True:
        try:
            ln = next(lines, None)
        except ValueError as e:  # the file itself: not a regular file, too large, grown past the cap
            raise RequestError(str(e)) from None
        if ln is None:
            return
        n, obj = ln.number, ln.value
        if ln.problem is not None:
            raise RequestError(f"{path}:{n}: {ln.problem}")
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), (str, list)):
            raise RequestError(f'{path}:{n}: expected {{"prompt": "..." or [token ids], "max_new_tokens": N}}')
        if unknown := sorted(set(obj) - REQUEST_KEYS):
            raise RequestError(f"{path}:{n}: unknown key(s) {', '.join(k[:40] for k in unknown[:5])}; keys are "
                               f"{', '.join(sorted(REQUEST_KEYS))}")
        mnt = obj.get("max_new_tokens", default_max)
        if not isinstance(mnt, int) or isinstance(mnt, bool) or mnt < 1:
            raise RequestError(f"{path}:{n}: max_new_tokens must be a positive integer, not {_clip(mnt)}")
        if "max_new_tokens" in obj and mnt > MAX_NEW_TOKENS:
            raise RequestError(f"{path}:{n}: max_new_tokens must be at most {MAX_NEW_TOKENS:,}, not {_clip(mnt)}")
        chat = obj.get("chat", False)
        if not isinstance(chat, bool):
            raise RequestError(f"{path}:{n}: chat must be true or false, not {_clip(chat)}")
        prompt = obj["prompt"]
        if isinstance(prompt, list):
            try:
                check_token_ids(prompt)
            except RequestError as e:
                raise RequestError(f"{path}:{n}: {_clip(str(e), 200)}") from None
        if not prompt or (isinstance(prompt, str) and not prompt.strip()):
            raise RequestError(f"{path}:{n}: empty prompt")
        yield n, {"prompt": prompt, "max_new_tokens": mnt, "chat": chat}


def _clip(v: object, n: int = 60) -> str:
    """A JSON value for a one-line message, whatever its size."""
    if isinstance(v, (list, dict)):
        text = f"an array of {len(v):,} items" if isinstance(v, list) else f"an object of {len(v):,} keys"
    elif isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**20:
        text = f"an integer of {len(str(abs(v))):,} digits"
    else:
        text = v if isinstance(v, str) else repr(v)
    return text if len(text) <= n else text[:n] + "…"


def _file_requests(engine, args, load_check: bool = False) -> Iterator[tuple[int, list[int], object]]:
    """(line, token ids, sampling) per request; RequestError names the line of one the engine cannot serve."""
    from engine.runtime.engine import RequestError
    from engine.workloads.prompts import encode_text

    for n, r in _read_prompt_file(args.prompt_file, args.max_new_tokens):
        ids = (r["prompt"] if isinstance(r["prompt"], list)
               else encode_text(engine.tokenizer, r["prompt"], r["chat"] or args.chat))
        sp = _sampling(args, r["max_new_tokens"])
        try:
            engine.check_request(ids, sp)
        except RequestError as e:
            raise RequestError(f"{args.prompt_file}:{n}: {e}") from None
        yield n, ids, sp


def _run_file(engine, args, load_s: float) -> int:
    """Run every request of the file concurrently and print one JSON line per request, in input order,
    each as soon as it and all before it are done. At most `window` requests are in the engine at once
    and finished ones are dropped once printed, so memory does not grow with the file."""
    for _ in _file_requests(engine, args):  # every line is checked before the first token is computed
        pass
    window = max(4 * engine.options.max_batch, 64)
    todo = _file_requests(engine, args)
    order: collections.deque[tuple[int, int]] = collections.deque()  # (line, sid) in input order
    done: dict[int, dict] = {}
    failed = 0
    exhausted = False
    while True:
        while not exhausted and len(order) < window:
            nxt = next(todo, None)
            if nxt is None:
                exhausted = True
                break
            n, ids, sp = nxt
            sid = engine.add_request(ids, sp)
            engine.keep(sid)
            order.append((n, sid))
        if not order:
            break
        if not engine.has_work() and order[0][1] not in done:
            raise RuntimeError(f"request on line {order[0][0]} neither finished nor is being worked on")
        engine.step()
        for _, sid in order:  # finished by a token, or aborted by the engine
            if sid not in done and engine.seqs[sid].done:
                done[sid] = _result(engine, engine.seqs[sid], load_s)
                engine.forget(sid)
        while order and order[0][1] in done:
            n, sid = order.popleft()
            res = done.pop(sid)
            if "error" in res:
                failed += 1
                print(f"kvscope: error: {args.prompt_file}:{n}: {res['error']}", file=sys.stderr)
            print(json.dumps({"line": n, **res}), flush=True)
    return 2 if failed else 0


def _result(engine, seq, load_s: float) -> dict:
    stats = {**_stats(engine, seq), **_engine_stats(engine, load_s, None)}
    if seq.finish_reason not in ("eos", "length"):  # aborted: its tokens are not an answer
        return {"error": seq.error or f"generation ended early: {seq.finish_reason}", "stats": stats}
    return {"token_ids": seq.output, "text": engine.tokenizer.decode(seq.output), "stats": stats}


def _print_tiers(tiers: dict, block_bytes: int) -> None:
    for name, t in tiers.items():
        print(f"{name:<10} {t['capacity_blocks']:,} blocks x {block_bytes:,} B on {t['device']}: "
              f"K {t['k_bytes'] / 2**20:.1f} MiB, V {t['v_bytes'] / 2**20:.1f} MiB, scales "
              f"{t['scale_bytes'] / 2**20:.2f} MiB, metadata {t['metadata_bytes'] / 2**20:.2f} MiB")
        if t.get("host_layers_bytes"):
            print(f"{'':<10} all but the first {t['device_layers']} layers of these blocks in host memory (device_layers): "
                  f"{t['host_layers_bytes'] / 2**20:.1f} MiB of the above, out of the host budget")


def _group_sizing(engine, batch: int, context: int, dsize: float) -> list[dict]:
    """Each KV-cache group's share of the sizing formula: a sliding-window group holds at most window - 1 keys beside
    a step's prompt chunk per sequence, whatever the context."""
    s = engine.spec
    chunk = engine.options.max_batched_tokens
    configs = engine.kv.configs(engine.config)
    out = []
    for g, c in zip(engine.kv_groups, configs):
        tokens = g.live_tokens(context, chunk)
        n = len(g.layers)
        per_token = n * s.num_kv_heads * s.head_dim * 2 * dsize
        cap = "" if g.window is None else f" (min(context, window {g.window} - 1 + chunk {chunk}))"
        out.append({"title": g.title, "layers": list(g.layers), "window": g.window, "tokens_per_sequence": tokens,
                    "bytes_per_token": per_token, "bytes": batch * tokens * per_token,
                    "device_budget_mb": c.device_budget_mb, "host_budget_mb": c.host_budget_mb,
                    "formula": f"{batch} x {tokens}{cap} x {n} x {s.num_kv_heads} x {s.head_dim} x 2 x {dsize:.4g} = "
                               f"{batch * tokens * per_token:,.0f} bytes ({batch * tokens * per_token / 2**20:.1f} MiB)"})
    return out


def cmd_info(args: argparse.Namespace) -> int:
    from engine.kv.block_pool import BlockPool
    from engine.config import CacheConfig, KVDtype
    from engine.runtime.engine import Engine
    from engine.model.loader import load_model

    config = cache_config(args)
    weights_dtype = getattr(args, "weights_dtype", None) or "auto"
    model = load_model(args.model, progress=progress_printer, dtype=weights_dtype)
    s = model.spec
    per_dtype = {}
    for dt in KVDtype:
        cfg = CacheConfig(block_size=config.block_size, kv_dtype=dt)
        per_block = BlockPool.bytes_per_block(cfg, s.num_layers, s.num_kv_heads, s.head_dim)
        per_dtype[dt.label] = per_block / config.block_size
    fp32_token = s.num_layers * s.num_kv_heads * s.head_dim * 2 * 4
    dsize = per_dtype[config.kv_dtype.label] / (s.num_layers * s.num_kv_heads * s.head_dim * 2)
    total = args.batch * args.context * s.num_layers * s.num_kv_heads * s.head_dim * 2 * dsize
    formula = (f"batch x context x layers x kv_heads x head_dim x 2 x dtype_size = {args.batch} x {args.context} x "
               f"{s.num_layers} x {s.num_kv_heads} x {s.head_dim} x 2 x {dsize:.4g} = {total:,.0f} bytes "
               f"({total / 2**20:.1f} MiB)")
    from engine.config import EngineOptions

    engine = Engine(model, config, EngineOptions(kv_groups=getattr(args, "kv_groups", None) or "auto",
                                                 context_limit=getattr(args, "context_limit", None),
                                                 weights_dtype=weights_dtype))
    from engine.runtime.bandwidth import weight_bytes
    mem = engine.memory()
    groups = _group_sizing(engine, args.batch, args.context, dsize)
    info = {
        "model": {"name": s.name, "architecture": s.architecture, "layers": s.num_layers, "heads": s.num_heads,
                  "kv_heads": s.num_kv_heads, "head_dim": s.head_dim, "hidden": s.hidden_size, "vocab": s.vocab_size,
                  "max_position_embeddings": s.max_position_embeddings,
                  "sliding_window": [w for w in s.sliding_window],
                  "weights": engine.model.weights_format, "weights_bytes": weight_bytes(engine.model)},
        "bytes_per_token": per_dtype,
        "fp32_bytes_per_token_check": fp32_token,
        "sizing": {"batch": args.batch, "context": args.context, "dtype": config.kv_dtype.label, "bytes": total,
                   "formula": formula},
        "kv_groups": groups,
        "config": config.as_dict(),
        "memory": mem,
        "self_checks": engine.runner.checks.summary(),
        "kernels": _kernels(s),
        "pages": _pages(engine),
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    m = info["model"]
    print(f"model      {m['name']} ({m['architecture']}): {m['layers']} layers, {m['heads']} heads, "
          f"{m['kv_heads']} KV heads, head dim {m['head_dim']}, vocab {m['vocab']}")
    print(f"weights    {m['weights']}: {m['weights_bytes'] / 2**20:.1f} MiB (--weights-dtype {weights_dtype})")
    print("bytes/token " + ", ".join(f"{k} {v:,.0f}" for k, v in per_dtype.items()) +
          f"  (block size {config.block_size}; scales included)")
    print(f"sizing     {formula}")
    if engine.grouped:
        held = sum(g["bytes"] for g in groups)
        split = ("the budgets split by the bytes a sequence holds in each at the context limit" if len(groups) > 1
                 else "every layer slides: each sequence keeps only its window")
        print(f"kv groups  {len(groups)} pool{'s' if len(groups) > 1 else ''} (--kv-groups auto); {split}: "
              f"{held:,.0f} bytes ({held / 2**20:.1f} MiB) for the above, {held / total:.2f}x one pool's")
        for g in groups:
            print(f"  {g['title']:<28} {g['formula']}; budgets {g['device_budget_mb']:.1f} + "
                  f"{g['host_budget_mb']:.1f} MiB")
    print(f"config     {config.summary()}")
    for title, block_bytes, tiers in ([(g["title"], g["block_bytes"], g["tiers"]) for g in mem["groups"]]
                                      if mem.get("groups") else [(None, mem["block_bytes"], mem["tiers"])]):
        if title:
            print(f"group      {title}")
        _print_tiers(tiers, block_bytes)
    gpu = mem["gpu"]
    print("gpu        " + (gpu.get("reason", "") if not gpu["available"] else
                           f"{gpu.get('name', '')} NVML used {gpu.get('nvml_used_bytes', 0) / 2**30:.2f} GiB"))
    print(f"process    RSS {mem['rss_bytes'] / 2**20:.0f} MiB; system {mem['system_used_bytes'] / 2**30:.1f} / "
          f"{mem['system_total_bytes'] / 2**30:.1f} GiB used")
    for name, c in info["self_checks"].items():
        print(f"self-check {name:<10} " + (c["message"] if "message" in c else "not run yet (checked at first use)"))
    k = info["kernels"]
    print(f"kernels    packed weights: {k['packed_weights']}; decode attention's block loops: {k['attention_blocks']}")
    pg = info["pages"]
    held = "".join(f"; {name} {m['bytes'] / 2**20:.0f} MiB: {m['advised'] / 2**20:.0f} advised, "
                   f"{m['huge'] / 2**20:.0f} on 2 MiB pages now"
                   for name, m in (("weights", pg["weights"]), ("KV pool", pg["kv_pool"])) if m)
    print(f"pages      {pg['mode']}{held}")
    return 0


def _kernels(spec) -> dict:
    """What the CPU kernels are here: the packed weights' (quant_ir) and decode attention's block loops (attn_ir,
    for this model's query rows per kv head and head dim)."""
    from engine.attention import attn_ir
    from engine.model import quant_ir

    G = spec.num_heads // max(1, spec.num_kv_heads)
    return {"packed_weights": quant_ir.status(), "attention_blocks": attn_ir.describe(G, spec.head_dim)}


def _pages(engine) -> dict:
    """The pages the CPU weights and KV pool are on (engine/hugepages.py): the mode, and per kind the bytes,
    those advised onto 2 MiB pages and those on them now (the pool's are committed as blocks are first written);
    a kind's entry None where the system does not say or nothing of it is in CPU memory."""
    from engine import hugepages
    from engine.runtime.bandwidth import _weight_tensors

    pool = [t for p in engine.kv.pools for tier in p.tiers for parts in (tier.k, tier.v) for layers in parts.values()
            for t in layers if t is not None and t.device.type == "cpu"]
    return {"mode": hugepages.describe(), "weights": hugepages.mappings(_weight_tensors(engine.model)) or None,
            "kv_pool": hugepages.mappings(pool) if pool else None}
