"""The engine as configured, rerun on a recorded trace's requests at another capacity: what-if by the engine itself.

The curves of engine/lab/mrc.py replay a policy in the abstract (a demand-paged cache of C blocks). The engine
does more: it evicts in batches (`evict_batch`), decays heat with the clock's real seconds, demotes blocks idle
longer than `demote_after_s` to the host tier and promotes them back (so a host-tier block is found, not
recomputed), admits and preempts by room, and reuses prompt blocks through its prefix cache. `KVReplay` answers
"what hit rate at C blocks" by running the engine's own scheduler and KV layer again (engine/runtime/engine.py,
unchanged) on the recorded requests, with:

- a one-layer model of one 16-wide head standing in for the real one (its K/V bytes are irrelevant: budgets are
  set so the device tier holds exactly C blocks and the host tier as many as it held when recorded), and every
  generated token forced to the one the run produced (SamplingParams.forced), so each request reads and writes
  the blocks it did;
- a virtual clock: each request arrives when it arrived (AccessTrace.tok_arrival; a driver that adds requests between
  steps says how long each had waited, Engine.add_request's waited_s), and each step takes what a step of that many
  tokens and sequences took in the recorded run (`StepCost`: a least-squares fit over the recorded steps), so heat
  decay and idle demotion see the run's seconds;
- the knobs and scheduling options recorded with the trace (AccessTrace.meta), or given.

The hit rate of a rerun is measured on its own trace by the function a real rerun is measured with
(`engine.lab.whatif.real_hit_rate`), and its prefix hit rate by prompt tokens by the engine's counters, so the
prediction counts what the measurement counts. `calibrate` compares the rerun at the recorded capacity with the
recorded run's own rate: the difference (the part of the run the rerun does not reproduce: wall-clock jitter,
a recording started mid-run) is added to every capacity's prediction, so the curve passes through the measured point.

Not modelled: forks (a forked sequence reruns as a request whose prompt is its parent's tokens at the fork; its
shared blocks come from the prefix cache instead of seq_cp), context shifts, and models with sliding-window
KV-cache groups (refused: KVReplayError).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from engine.kv.access_trace import AccessTrace
from engine.lab.whatif import real_hit_rate

REPLAY_HEAD_DIM = 16  # the stand-in model's one head: small enough that a step costs ~1 ms
REPLAY_MAX_STEPS = 1_000_000


class KVReplayError(ValueError):
    """A trace the engine cannot be rerun on (no tokens recorded, a grouped model), or a capacity it cannot take."""


@dataclass(frozen=True)
class Request:
    seq: int
    arrival: float  # on the recorded engine's clock (the rerun's clock keeps its origin: the same sums of seconds)
    prompt: tuple[int, ...]
    output: tuple[int, ...]  # the tokens the run generated (forced in the rerun)


@dataclass(frozen=True)
class StepCost:
    """A step's duration as the recorded run's steps took: fixed_s + per_token_s x tokens computed + per_seq_s x
    sequences run."""
    fixed_s: float
    per_token_s: float
    steps: int  # recorded steps the fit is over (0: no step records, a default)
    per_seq_s: float = 0.0

    def __call__(self, tokens: int, seqs: int = 0) -> float:
        return self.fixed_s + self.per_token_s * tokens + self.per_seq_s * seqs


@dataclass
class Rerun:
    """One rerun at `capacity` device-tier blocks."""
    capacity: int
    hit_rate: float  # real_hit_rate of the rerun's trace: counted first reads found on the device tier
    counted: int  # the first reads that rate is over
    prefix_rate: float  # prompt tokens served from the prefix cache / prompt tokens (the health strip's number)
    device_rate: float  # keys attention read straight from the device tier / keys read (the hit-rate chart's blue)
    steps: int
    seconds: float  # the rerun's virtual time
    preempted: int = 0
    trace: AccessTrace | None = None  # the rerun's own trace (run(keep_trace=True))


@dataclass
class Calibrated:
    """Reruns at several capacities, each rate shifted so the recorded capacity's equals the recorded run's own:
    the counted first reads on the device tier (real_hit_rate), the prefix hit rate by prompt tokens, and the device
    hit rate by keys read (the last two where the trace says what the run counted, AccessTrace.meta "counts")."""
    recorded_capacity: int
    measured: dict  # rate name -> the recorded run's value (nan: not known)
    offset: dict  # rate name -> measured - the rerun's value at the recorded capacity (0 where not known)
    runs: list[Rerun] = field(default_factory=list)

    RATES = ("hit_rate", "prefix_rate", "device_rate")

    def capacities(self) -> np.ndarray:
        return np.array([r.capacity for r in self.runs], dtype=np.int64)

    def predicted(self, rate: str = "hit_rate") -> np.ndarray:
        """A rate predicted at each capacity (clipped to [0, 1]; nan where the rerun had nothing to count)."""
        return np.clip(np.array([getattr(r, rate) for r in self.runs]) + self.offset[rate], 0.0, 1.0)

    def at(self, capacity: int, rate: str = "hit_rate") -> float:
        """The prediction at `capacity`, linear between the reruns (the nearest end's outside them)."""
        c = self.capacities()
        order = np.argsort(c)
        return float(np.interp(capacity, c[order], self.predicted(rate)[order]))


def measured_rates(trace: AccessTrace) -> dict:
    """The recorded run's own rates: real_hit_rate of its trace, and from AccessTrace.meta's counts the prefix hit
    rate by prompt tokens and the device hit rate by keys read (nan where the trace does not say)."""
    counts = (trace.meta or {}).get("counts", {})

    def share(num: str, den: str, complement: bool = False) -> float:
        d = counts.get(den)
        if not isinstance(d, (int, float)) or d <= 0 or not isinstance(counts.get(num), (int, float)):
            return float("nan")
        v = counts[num] / d
        return 1.0 - v if complement else v

    return {"hit_rate": real_hit_rate(trace)[0], "prefix_rate": share("prompt_reused", "prompt_tokens"),
            "device_rate": share("read_tokens_missed", "read_tokens", complement=True)}


def requests_of(trace: AccessTrace) -> list[Request]:
    """The recorded sequences as requests, in arrival order: prompt = the first tok_prompt tokens, output = the rest.
    A trace without arrivals (recorded before them) takes each sequence's first read as its arrival."""
    lists = trace.token_lists()
    if not lists or trace.tok_prompt is None or trace.block_size is None:
        raise KVReplayError("this trace has no recorded tokens and prompt lengths (record it again with this version: "
                            "`generate --record-trace`, or the window's trace button): the engine can only be rerun "
                            "on the requests' tokens")
    prompt = dict(zip(trace.tok_seq.tolist(), trace.tok_prompt.tolist()))
    if trace.tok_arrival is not None:
        arrival = dict(zip(trace.tok_seq.tolist(), trace.tok_arrival.tolist()))
    else:
        arrival = {}
        for s, t in zip(trace.seq.tolist(), trace.t.tolist()):
            arrival.setdefault(s, t)
    t0 = min(arrival.get(s, math.inf) for s in lists)
    out = []
    for s, toks in lists.items():
        p = int(prompt[s])
        if p < 1 or len(toks) <= p:  # a sequence cut before its first token (or a prompt-less one): nothing to rerun
            continue
        out.append(Request(s, float(arrival.get(s, t0)), tuple(int(x) for x in toks[:p]),
                           tuple(int(x) for x in toks[p:])))
    if not out:
        raise KVReplayError("the trace holds no request that generated a token")
    return sorted(out, key=lambda r: (r.arrival, r.seq))


def step_cost(trace: AccessTrace) -> StepCost:
    """Fit a step's duration against the tokens it computed and the sequences it ran, over the recorded steps (a
    step's duration: the next step's start minus its own), by least squares with no coefficient below zero. A gap
    that held idle time (nothing to run until the next arrival, a paused engine) is longer than its step: the fit
    starts from the gaps up to 3x the median, then keeps those up to twice its prediction, four times over.
    Without step records: 10 ms a step (SECONDS_PER_ACCESS's clock)."""
    if trace.step_t is None or len(trace.step_t) < 3:
        return StepCost(0.01, 0.0, 0)
    dt = np.diff(trace.step_t)
    n = trace.step_tokens[:-1].astype(np.float64)
    q = (trace.step_seqs[:-1] if trace.step_seqs is not None else np.zeros(len(n))).astype(np.float64)
    ok = dt > 0
    dt, n, q = dt[ok], n[ok], q[ok]
    if len(dt) < 2:
        return StepCost(0.01, 0.0, 0)
    keep = dt <= 3.0 * np.median(dt)
    coef = np.array([float(np.median(dt)), 0.0, 0.0])
    for _ in range(4):
        if keep.sum() < 3:
            break
        coef = _nonnegative_fit(np.stack([np.ones(int(keep.sum())), n[keep], q[keep]], axis=1), dt[keep])
        keep = dt <= 2.0 * np.maximum(coef[0] + coef[1] * n + coef[2] * q, 1e-9)
    return StepCost(float(coef[0]), float(coef[1]), int(keep.sum()), float(coef[2]))


def _nonnegative_fit(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares of y on the columns of a with every coefficient >= 0: the best over the subsets of columns
    whose own fit has none below zero (three columns: eight subsets)."""
    best, best_err = np.zeros(a.shape[1]), float(np.sum(y * y))
    for mask in range(1, 1 << a.shape[1]):
        cols = [j for j in range(a.shape[1]) if mask >> j & 1]
        sub = a[:, cols]
        if np.linalg.matrix_rank(sub) < len(cols):
            continue
        c, *_ = np.linalg.lstsq(sub, y, rcond=None)
        if (c < 0).any():
            continue
        err = float(np.sum((sub @ c - y) ** 2))
        if err < best_err:
            best, best_err = np.zeros(a.shape[1]), err
            best[cols] = c
    return best


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stand_in_model(spec, layers: int = 1):
    """A LoadedModel with `spec`'s vocabulary and positions and one small head per layer, random weights: the
    engine runs it as it runs any Llama; its outputs are forced, so its numbers never matter."""
    import dataclasses

    import torch

    from engine.model.loader import LoadedModel
    from engine.model.spec import ModelSpec, check_weights, expected_shapes

    d = REPLAY_HEAD_DIM
    tiny = ModelSpec(architecture="LlamaForCausalLM", model_type="llama", vocab_size=spec.vocab_size, hidden_size=d,
                     intermediate_size=d, num_layers=layers, num_heads=1, num_kv_heads=1, head_dim=d,
                     rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                     max_position_embeddings=spec.max_position_embeddings, attention_bias=False,
                     tie_word_embeddings=True, sliding_window=(None,) * layers, bos_token_id=spec.bos_token_id,
                     eos_token_ids=tuple(spec.eos_token_ids), name=f"{spec.name} (KV replay stand-in)")
    g = torch.Generator().manual_seed(0)
    weights = {k: torch.randn(v, generator=g) * 0.02 for k, v in expected_shapes(tiny).items()}
    check_weights(tiny, weights, "kv-replay")
    return LoadedModel(spec=dataclasses.replace(tiny), weights=weights, tokenizer=None, source="kv-replay",
                       cache_dir=None)


class KVReplay:
    """Reruns of `trace`'s requests through the engine's scheduler and KV layer, with the knobs and options it
    was recorded with (AccessTrace.meta) unless `config` / `options` are given (config: a CacheConfig or a dict
    of knobs; options: max_batch, max_batched_tokens, context_limit), each step taking `cost` (default: fitted to
    the recorded steps, `step_cost`)."""

    def __init__(self, trace: AccessTrace, config=None, options: dict | None = None, vocab_size: int | None = None,
                 max_positions: int | None = None, cost: StepCost | None = None):
        from engine.config import CacheConfig, ConfigError

        meta = trace.meta or {}
        if meta.get("grouped"):
            raise KVReplayError("the model has sliding-window KV-cache groups: rerunning it as configured is not "
                                "modelled (the LRU / heat / S3-FIFO curves still are)")
        self.requests = requests_of(trace)
        self.trace = trace
        if config is None:
            try:
                config = CacheConfig().replace(**meta.get("config", {}))
            except (ConfigError, TypeError) as e:
                raise KVReplayError(f"the trace's recorded knobs are not usable ({e})") from None
        elif isinstance(config, dict):
            config = CacheConfig().replace(**config)
        if config.block_size != trace.block_size:
            config = config.replace(block_size=trace.block_size)
        self.config = config
        opts = dict(meta.get("options", {}))
        opts.update(options or {})
        self.options = opts
        cap = meta.get("capacity", {})
        self.recorded_capacity = cap.get("device")
        self.host_capacity = cap.get("host")
        self.cost = cost or step_cost(trace)
        longest = max(len(r.prompt) + len(r.output) for r in self.requests)
        self.vocab = vocab_size or int(max(max(r.prompt + r.output) for r in self.requests) + 1)
        self.positions = max(max_positions or 0, int(opts.get("context_limit") or 0), longest + 1)
        self._model = None

    def _stand_in(self):
        if self._model is None:
            from types import SimpleNamespace

            spec = SimpleNamespace(vocab_size=self.vocab, max_position_embeddings=self.positions, bos_token_id=None,
                                   eos_token_ids=(), name="trace")
            self._model = stand_in_model(spec)
        return self._model

    def _budgets(self, capacity: int, host: int | None) -> dict:
        """device_budget_mb / host_budget_mb that give the stand-in's tiers exactly these many blocks."""
        from engine.kv.codecs import Geometry, codecs_for
        from engine.kv.tiers import device_budget_mb
        from engine.config import KVDtype

        kc, vc = codecs_for(KVDtype.FP32)
        geom = Geometry(layers=1, kv_heads=1, block_size=self.config.block_size, head_dim=REPLAY_HEAD_DIM)
        block = sum(kc.block_bytes(geom).values()) + sum(vc.block_bytes(geom).values())
        h = self.config.host_budget_mb if host is None else host * block / 2**20
        return {"device_budget_mb": device_budget_mb(capacity, block), "host_budget_mb": h}

    def run(self, capacity: int, host_capacity: int | None = None, keep_trace: bool = False) -> Rerun:
        """The requests rerun with a device tier of `capacity` blocks (and the recorded host tier's blocks, or
        `host_capacity`)."""
        from engine.config import EngineOptions, KVDtype
        from engine.errors import RequestError
        from engine.runtime.engine import Engine
        from engine.sequence import SamplingParams

        if not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise KVReplayError(f"capacity must be a whole number of blocks >= 1, got {capacity!r}")
        host = self.host_capacity if host_capacity is None else host_capacity
        config = self.config.replace(kv_dtype=KVDtype.FP32, device_layers=0, shadow_every_s=0.0,
                                     **self._budgets(int(capacity), host))
        o = self.options
        options = EngineOptions(device="cpu", weights_dtype="fp32", attention="cpu", cuda_graphs="off",
                                max_batch=int(o.get("max_batch", 16)),
                                max_batched_tokens=int(o.get("max_batched_tokens", 1024)),
                                context_limit=self.positions, kv_groups="off")
        clock = _Clock()
        clock.now = self.requests[0].arrival
        engine = Engine(self._stand_in(), config, options, clock=clock)
        if engine.pool.sizes.dev_cap != capacity:
            raise KVReplayError(f"the stand-in's device tier took {engine.pool.sizes.dev_cap} blocks, not {capacity}")
        engine.start_trace()
        pending = list(self.requests)
        i = steps = 0
        while i < len(pending) or engine.has_work():
            while i < len(pending) and pending[i].arrival <= clock.now:
                r = pending[i]
                sp = SamplingParams(max_new_tokens=len(r.output), ignore_eos=True, forced=r.output)
                try:
                    engine.add_request(list(r.prompt), sp, waited_s=clock.now - r.arrival)
                except RequestError:
                    pass  # a request this capacity cannot hold: refused here as the engine would refuse it
                i += 1
            if not engine.has_work():
                clock.now = pending[i].arrival
                continue
            rec = engine.kv.trace
            before = rec.steps
            engine.step()
            steps += 1
            clock.now += self.cost(rec.step_tokens(before), rec.step_seqs(before))
            if steps > REPLAY_MAX_STEPS:
                raise KVReplayError(f"the rerun at {capacity} blocks made no progress in {REPLAY_MAX_STEPS:,} steps")
        trace = engine.stop_trace()
        rate, counted = real_hit_rate(trace)
        c = engine.counters
        return Rerun(int(capacity), rate, counted, c.prefix_hit_rate, c.device_hit_rate, steps, clock.now,
                     c.preemptions, trace if keep_trace else None)

    def calibrated(self, capacities, measured: dict | None = None) -> Calibrated:
        """Reruns at `capacities` (the recorded capacity added), each rate shifted by the recorded point's
        residual: `measured` (default: measured_rates of the recorded trace) minus the rerun's rate there."""
        if self.recorded_capacity is None:
            raise KVReplayError("the trace does not say the device tier's capacity when recorded (record it again "
                                "with this version)")
        c0 = int(self.recorded_capacity)
        caps = sorted({int(c) for c in capacities if int(c) >= 1} | {c0})
        runs = [self.run(c) for c in caps]
        base = next(r for r in runs if r.capacity == c0)
        have = measured_rates(self.trace)
        have.update(measured or {})
        offset = {k: (have[k] - getattr(base, k) if math.isfinite(have.get(k, math.nan))
                      and math.isfinite(getattr(base, k)) else 0.0) for k in Calibrated.RATES}
        return Calibrated(c0, have, offset, runs)


def default_capacities(recorded: int, current: int | None = None) -> list[int]:
    """Where the window and `policy-lab --curve` rerun the engine: 1/4 to 8x the recorded capacity, and 1/2, 2x
    and 4x the current one where the live budget has moved since."""
    caps = {max(1, round(recorded * f)) for f in (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 8.0)}
    if current and current != recorded:
        caps |= {max(1, round(current * f)) for f in (0.5, 1.0, 2.0, 4.0)}
    return sorted(caps)


def knobs_text(config) -> str:
    """The knobs a rerun used, without the budgets (they are what varies)."""
    host = "no host tier" if config.host_budget_mb <= 0 else "a host tier"
    return (f"{config.policy}" + (f" (decay {config.decay:g}/s)" if config.policy == "heat" else "")
            + f", evict batch {config.evict_batch}, prefetch {config.prefetch_depth}, demote after "
              f"{config.demote_after_s:g} s, {host} (host reads: {config.host_reads}), block {config.block_size}")


def configured_lines(cal: Calibrated, knobs: str, current: int, block_mib: float | None = None,
                     factor: float = 2.0) -> list[str]:
    """What the calibrated reruns say at `current` blocks and at `factor` times it, each rate named by what it
    counts."""
    unit = (lambda c: f"{c:,} blocks ({c * block_mib:,.2f} MiB)") if block_mib else (lambda c: f"{c:,} blocks")
    then = max(1, round(current * factor))

    def pct(rate: str, c: int) -> str:
        v = cal.at(c, rate)
        return "no data" if not math.isfinite(v) else f"{100 * v:.1f} %"

    def delta(rate: str) -> str:
        a, b = cal.at(current, rate), cal.at(then, rate)
        return "" if not (math.isfinite(a) and math.isfinite(b)) else f" ({100 * (b - a):+.1f} points)"

    m = cal.measured
    seen = ", ".join(f"{name} {100 * m[k]:.1f} %" for k, name in (("hit_rate", "first reads"),
                                                                   ("prefix_rate", "prefix"),
                                                                   ("device_rate", "keys read"))
                     if math.isfinite(m.get(k, math.nan)))
    return [f"engine as configured ({knobs}), rerun on the trace at {len(cal.runs)} capacities and calibrated at the "
            f"recorded {unit(cal.recorded_capacity)} (measured there: {seen or 'no data'})",
            f"  at {unit(current)}: first reads on the device tier {pct('hit_rate', current)}, prompt tokens from the "
            f"prefix cache {pct('prefix_rate', current)}, keys read from the device tier {pct('device_rate', current)}",
            f"  at {factor:g}x, {unit(then)}: first reads {pct('hit_rate', then)}{delta('hit_rate')}, prefix "
            f"{pct('prefix_rate', then)}{delta('prefix_rate')}, keys read {pct('device_rate', then)}"
            f"{delta('device_rate')}"]
