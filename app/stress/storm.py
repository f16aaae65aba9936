"""A reconfiguration storm: the engine decodes a stream of requests while another thread changes a random knob
every `--every-ms` milliseconds, under every policy, through every KV format, budgets down to 0.

    python -m app.stress.storm --minutes 30                # a tiny random-weight model (fast steps, many changes)
    python -m app.stress.storm --minutes 5 --model PATH    # a real checkpoint

What it counts, and what must be 0 for exit 0:
- unexpected: an exception other than a refusal (ConfigError) out of reconfigure, or any exception out of a step;
- engine errors: "error" events the engine emitted (a failed shadow step, a sequence aborted as stalled);
- dropped: a change reconfigure accepted whose values the engine's config does not show afterwards;
- mismatched: a finished request whose whole life ran on lossless KV (fp32) and whose tokens differ from
  transformers' greedy `generate` on the same model and prompt (not checked with --weights-dtype int8 / int4,
  which transformers has no reference for: those count as "finished unchecked");
- lost: a request admitted that did not finish with its tokens (aborted, or still unfinished when the storm ends
  and its queue is drained);
- invariant failures: the pool's own checks (engine/kv/invariants.py) run every few steps under the engine's locks;
- reasons unaccounted: at those checks, why tokens missed (engine/kv/misses.py) does not add up to the misses,
  engine-wide or over the KV-cache groups;
- RSS growth: the process's resident memory after warm-up (the first fifth of the run) may not exceed its
  warm-up level by more than 10 %.
Refusals (a change that cannot apply now: budgets below what live sequences hold, a value out of range) are
expected, and counted by reason.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter

import psutil

# Lossy formats are named in the last third of every 15 s: the first two thirds run on fp32 (after the prefix cache
# that went through a lossy format is dropped), so that requests there can be checked against transformers.
PHASE_S, LOSSY_SHARE = 15.0, 1 / 3
DTYPES = ("fp32", "fp16", "bf16", "int8", "int8-delta", "int8-kivi", "fp8")
POLICIES = ("lru", "heat", "s3fifo")


def tiny_model_dir(layers: int = 4, seed: int = 0) -> str:
    """A random-weight Llama (64 wide, `layers` deep) saved as an HF directory with the default model's tokenizer."""
    from app.stress.gpu_check import tiny_model_dir as save_tiny
    from engine.model.loader import hf_reference_dir

    return save_tiny(tempfile.mkdtemp(prefix="kvscope-storm-"), hf_reference_dir(), seed, vocab_size=49152, hidden_size=64,
                     intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


class Reference:
    """transformers' greedy generate on the same directory, cached by prompt."""

    def __init__(self, path: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.cache: dict[tuple, list[int]] = {}

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in self.cache:
            torch = self.torch
            with torch.no_grad():
                out = self.model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                          pad_token_id=0, eos_token_id=None)
            self.cache[key] = out[0, len(prompt):].tolist()
            if len(self.cache) > 4096:
                self.cache.pop(next(iter(self.cache)))
        return self.cache[key]


def random_change(rng: random.Random, block_mb: float, layers: int, lossy: bool = True) -> dict:
    """One or two knobs at random, values across and past each knob's range (those are refused). lossy=False:
    kv_dtype changes name fp32 only."""
    def budget():
        r = rng.random()
        if r < 0.1:
            return 0.0
        if r < 0.13:
            return rng.choice([-1.0, float("nan"), 1e12])  # refused: out of range
        return round(block_mb * rng.randint(1, 60), 6)

    makers = {
        "block_size": lambda: rng.choice([4, 8, 8, 16, 32, 0, 2000]),
        "kv_dtype": lambda: "fp32" if not lossy or rng.random() < 0.3 else rng.choice(DTYPES[1:]),
        "device_budget_mb": budget,
        "host_budget_mb": budget,
        "policy": lambda: rng.choice(POLICIES),
        "decay": lambda: rng.choice([0.5, 0.9, 0.99, 1.0, 0.0]),
        "demote_after_s": lambda: rng.choice([0.0, 0.02, 0.2, 1.0, 5.0]),
        "prefetch_depth": lambda: rng.choice([0, 1, 2, 8]),
        "evict_batch": lambda: rng.choice([1, 4, 8, 64]),
        "host_reads": lambda: rng.choice(["promote", "stream", "compute"]),
        "device_layers": lambda: rng.choice([0, 0, 1, layers - 1]),
        "shadow_every_s": lambda: rng.choice([0.0, 0.3, 2.0]),
    }
    names = rng.sample(sorted(makers), rng.choice([1, 1, 2]))
    return {n: makers[n]() for n in names}


class Storm:
    def __init__(self, engine, ref: Reference, seed: int, every_ms: float, in_flight: int):
        self.eng, self.ref = engine, ref
        self.rng = random.Random(seed)
        self.every = every_ms / 1000.0
        self.in_flight = in_flight
        self.stop = threading.Event()
        self.mu = threading.Lock()  # live and tainted: the changer's and the engine thread's
        self.lossy_finished = False  # a tainted sequence finished this step
        self.seen: dict[int, set[str]] = {}  # sid -> config summaries at its steps (for a mismatch's report)
        self.t0 = time.monotonic()
        self.kinds: Counter = Counter()  # distinct failures
        self.steps_under: Counter = Counter()  # steps run under each policy, format, host_reads, placement
        self.last_change: dict = {}
        self.c: Counter = Counter()
        self.refusals: Counter = Counter()
        self.failures: list[str] = []  # the first few unexpected exceptions, mismatches, drops, with details
        self.tainted: set[int] = set()  # sequences that lived through a lossy config
        self.live: dict[int, tuple[list[int], int]] = {}  # sid -> (prompt, max_new)
        s = engine.spec
        from engine.kv.block_pool import BlockPool

        self.block_mb = BlockPool.bytes_per_block(engine.config, s.num_layers, s.num_kv_heads, s.head_dim) / 2**20
        self.layers = s.num_layers
        self.prefixes = [[self.rng.randrange(3, 40000) for _ in range(self.rng.randint(8, 40))] for _ in range(3)]

    def _fail(self, what: str) -> None:
        """Count a failure; keep the first traceback of each distinct one (its last line), with the config and the
        last change applied."""
        self.c[what] += 1
        tb = traceback.format_exc(limit=12) if sys.exc_info()[0] else ""
        key = f"{what}: {tb.strip().splitlines()[-1] if tb else ''}"
        self.kinds[key] += 1
        if self.kinds[key] == 1 and len(self.failures) < 20:
            self.failures.append(f"{key}\nconfig: {self.eng.config.summary()}\nlast change: {self.last_change}\n{tb}")

    # -- the changing thread ------------------------------------------------------------------
    def changer(self) -> None:
        """Lossy KV taints the sequences it touches: every live one when a lossy format applies, and every one added
        while a tainted one with the same first tokens still runs (a prefix match can share its blocks). Cached blocks
        that went through a lossy format are dropped (the prefix cache reset) when the format comes back to fp32 and
        when a tainted sequence finishes on fp32."""
        from engine.config import ConfigError, KVDtype, coerce

        while not self.stop.wait(self.every):
            phase = (time.monotonic() - self.t0) % PHASE_S
            change = random_change(self.rng, self.block_mb, self.layers, lossy=phase >= PHASE_S * (1 - LOSSY_SHARE))
            with self.mu:
                was_lossless = self.eng.config.kv_dtype is KVDtype.FP32
                try:
                    new = self.eng.reconfigure(**change)
                except ConfigError as e:
                    self.c["refused"] += 1
                    self.refusals[str(e).split(":")[0][:60]] += 1
                    continue
                except Exception:
                    self._fail("unexpected (reconfigure)")
                    continue
                self.c["applied"] += 1
                self.last_change = change
                shown = self.eng.config
                for k, v in change.items():
                    if getattr(shown, k) != coerce(k, v) or getattr(new, k) != coerce(k, v):
                        self.c["dropped"] += 1
                        self.failures.append(f"dropped: {k}={v!r} accepted, config shows {getattr(shown, k)!r}")
                if new.kv_dtype is not KVDtype.FP32:
                    self.tainted.update(self.live)
                elif not was_lossless:
                    self.eng.reset_prefix_cache()  # cached blocks went through the lossy format

    # -- the engine thread --------------------------------------------------------------------
    def feed(self) -> None:
        from engine.config import KVDtype
        from engine.errors import RequestError
        from engine.sequence import SamplingParams

        while len(self.live) < self.in_flight:
            n = self.rng.randint(4, 90)
            body = [self.rng.randrange(3, 40000) for _ in range(n)]
            prompt = (self.rng.choice(self.prefixes) + body) if self.rng.random() < 0.5 else body
            new = self.rng.randint(3, 16)
            with self.mu:
                try:
                    sid = self.eng.add_request(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))
                except RequestError as e:
                    self.c["request refused"] += 1
                    self.refusals["request: " + str(e)[:50]] += 1
                    return
                self.c["requests"] += 1
                if self.eng.config.kv_dtype is not KVDtype.FP32 or self._shares_lossy(prompt):
                    self.tainted.add(sid)
                self.live[sid] = (prompt, new)

    def _shares_lossy(self, prompt: list[int]) -> bool:
        """Whether a prefix match could hand this prompt a block of a tainted live sequence (a first block in common:
        the smallest block size is 4 tokens)."""
        head = prompt[:4]
        return any(self.live[s][0][:4] == head for s in self.tainted if s in self.live)

    def step(self) -> None:
        from engine.config import KVDtype

        try:
            outs = self.eng.step()
        except Exception:
            self._fail("unexpected (step)")
            time.sleep(0.01)
            return
        self.c["steps"] += 1
        cfg = self.eng.config
        for k in (cfg.policy, cfg.kv_dtype.label, "host_reads=" + cfg.host_reads, f"device_layers={cfg.device_layers}",
                  "device 0 MB" if cfg.device_budget_mb == 0 else "device > 0"):
            self.steps_under[k] += 1
        with self.mu:
            summary = self.eng.config.summary()
            for sid in self.live:
                self.seen.setdefault(sid, set()).add(summary)
            for o in outs:
                if o.finished:
                    self._finished(o.seq_id)
            for sid in [s for s in self.live if s not in self.eng.seqs or self.eng.seqs[s].done]:
                self._finished(sid)  # ended without a last token: aborted or cancelled
            # A tainted sequence's blocks stay hashed when it finishes (cached, lossy): on fp32 the prefix cache is
            # dropped before any new request can match them (on a lossy format new requests are tainted anyway).
            if self.lossy_finished and self.eng.config.kv_dtype is KVDtype.FP32:
                self.eng.reset_prefix_cache()
            self.lossy_finished = False

    def _finished(self, sid: int) -> None:
        prompt, n = self.live.pop(sid)
        seen = self.seen.pop(sid, set())
        seq = self.eng.seqs.get(sid)
        if seq is None or seq.finish_reason not in ("length", "eos"):
            self.c["lost"] += 1
            self.failures.append(f"lost: sequence {sid} finished as {getattr(seq, 'finish_reason', None)!r}")
            return
        self.c["finished"] += 1
        if sid in self.tainted:
            self.tainted.discard(sid)
            self.lossy_finished = True  # its blocks stay in the prefix cache
            self.c["finished lossy"] += 1
            return
        if self.ref is None:  # packed weights: no transformers reference (counted as finished, not as checked)
            self.c["finished unchecked"] += 1
            return
        if list(seq.output) != self.ref.greedy(prompt, n):
            self.c["mismatched"] += 1
            if len(self.failures) < 20:
                self.failures.append(f"mismatched: sequence {sid} (prompt {len(prompt)} tokens, {n} new, "
                                     f"{seq.prefix_reused} reused, {seq.preemptions} preemptions); configs at its "
                                     f"steps: {sorted(seen)[:6]}")
        else:
            self.c["checked equal"] += 1

    def check(self) -> None:
        from engine.kv.misses import unaccounted

        with self.eng.step_lock, self.eng.lock:
            try:
                self.eng.check_invariants()
            except Exception:
                self._fail("invariant failures")
            wrong = unaccounted(self.eng.counters, [r[3] for _, _, r in self.eng.kv.snapshot_groups()])
            if wrong:
                self.c["reasons unaccounted"] += 1
                if len(self.failures) < 20:
                    self.failures.append("reasons unaccounted: " + "; ".join(wrong))

    def events(self) -> None:
        for e in self.eng.take_events():
            if e.kind == "error":
                self.c["engine errors"] += 1
                if len(self.failures) < 20:
                    self.failures.append(f"engine error event: {e.fields.get('message')}")
            elif e.kind == "config_error":
                self.c["refusal events"] += 1


def run(args) -> dict:
    from engine.config import CacheConfig, EngineOptions
    from engine.runtime.engine import Engine
    from engine.model.loader import load_model

    path = args.model or tiny_model_dir(seed=args.seed)
    weights = getattr(args, "weights_dtype", None) or "fp32"
    model = load_model(path, dtype=weights)
    ref = Reference(path) if weights == "fp32" else None
    eng = Engine(model, CacheConfig(block_size=8, device_budget_mb=0.2, host_budget_mb=0.4, shadow_every_s=0.5),
                 EngineOptions(weights_dtype=weights))
    storm = Storm(eng, ref, args.seed, args.every_ms, args.in_flight)
    proc = psutil.Process()
    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    warm_until = t0 + args.minutes * 60 / 5
    rss_warm, rss_max, samples = None, 0, []
    th = threading.Thread(target=storm.changer, daemon=True)
    th.start()
    last_sample = 0.0
    try:
        while time.monotonic() < end and (args.steps is None or storm.c["steps"] < args.steps):
            storm.feed()
            storm.step()
            if storm.c["steps"] % 25 == 0:
                storm.check()
                storm.events()
            now = time.monotonic()
            if now - last_sample >= 5:
                last_sample = now
                rss = proc.memory_info().rss
                samples.append((round(now - t0), rss >> 20))
                if now >= warm_until:
                    rss_warm = rss if rss_warm is None else rss_warm
                    rss_max = max(rss_max, rss)
    finally:
        storm.stop.set()
        th.join(10)
    drain_start = time.monotonic()
    while storm.live and time.monotonic() - drain_start < 120:  # the last requests finish on the last config
        storm.step()
    storm.check()
    storm.events()
    storm.c["lost"] += len(storm.live)
    growth = (rss_max / rss_warm - 1) if rss_warm else None
    out = {"minutes": round((time.monotonic() - t0) / 60, 2), "every_ms": args.every_ms, "seed": args.seed,
           "weights_dtype": weights,
           **{k: storm.c[k] for k in ("steps", "applied", "refused", "requests", "finished", "checked equal",
                                      "finished unchecked",
                                      "finished lossy", "request refused", "refusal events")},
           **{k: storm.c[k] for k in ("unexpected (reconfigure)", "unexpected (step)", "engine errors", "dropped",
                                      "mismatched", "lost", "invariant failures", "reasons unaccounted")},
           "rss_warm_mib": None if rss_warm is None else rss_warm >> 20, "rss_max_mib": rss_max >> 20,
           "rss_growth": None if growth is None else round(growth, 3), "rss_samples_mib": samples[:: max(1, len(samples) // 40)],
           "refusals": dict(storm.refusals.most_common(12)), "steps_under": dict(storm.steps_under), "failure_kinds": dict(storm.kinds),
           "failures": storm.failures}
    bad = sum(out[k] for k in ("unexpected (reconfigure)", "unexpected (step)", "engine errors", "dropped",
                               "mismatched", "lost", "invariant failures", "reasons unaccounted"))
    out["ok"] = bad == 0 and (growth is None or growth <= 0.10)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.stress.storm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--steps", type=int, help="stop after this many engine steps (the tests' bound)")
    ap.add_argument("--every-ms", type=float, default=100.0, help="milliseconds between two changes (default 100)")
    ap.add_argument("--in-flight", type=int, default=8, help="requests kept in flight (default 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", help="a model directory or .gguf (default: a tiny random-weight Llama)")
    ap.add_argument("--weights-dtype", choices=("fp32", "int8", "int4"), default="fp32",
                    help="int8 / int4: packed weights (their decode steps run whole layers in compiled calls); no "
                         "transformers reference for them, so finished requests are counted, not compared")
    args = ap.parse_args(argv)
    out = run(args)
    print(json.dumps(out, indent=1))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
