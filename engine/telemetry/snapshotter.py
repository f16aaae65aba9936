"""What the engine tells the outside: counters, an event feed, and immutable numpy snapshots.

A snapshot never copies KV data: per tier it copies the per-slot metadata arrays (contiguous
copies, a few ms at a million blocks), plus small per-sequence and time-series arrays. The snapshot
records themselves are in engine/telemetry/snapshot.py; `Telemetry` here collects and builds them.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import psutil

from engine.kv.misses import WHY_FIELDS
from engine.telemetry.counters import Counters
from engine.telemetry.health import Health
from engine.telemetry.snapshot import SeqTable, Snapshot, TierSnapshot

if TYPE_CHECKING:  # annotations only: this module stays torch-free
    from engine.config import CacheConfig
    from engine.kv.block_pool import BlockPool, PoolEvent
    from engine.model.spec import ModelSpec
    from engine.sequence import Sequence

RESIDENCY_SAMPLES = 4096  # newest samples kept per residency histogram
SERIES_LEN = 1200  # time-series points kept (one per SERIES_PERIOD_S at most)
SERIES_PERIOD_S = 0.1
WINDOW_S = 5.0  # windowed rates look this far back
MARK_KINDS = ("config", "workload", "context_shift", "preempt", "throughput_drop")
MARKS_KEPT = 512
# Per shadow step (engine/fidelity/shadow.py), NaN between them: KL(reference ‖ engine), flip rate, max |logit error|.
SHADOW_SERIES = ("shadow_kld", "shadow_flip_rate", "shadow_logit_err")
AUTO_TABLES_MAX = 200_000  # block-table entries above which snapshots list blocks only for chosen sequences


class _Totals(NamedTuple):
    """The counters the windowed rates are differences of, after one step."""

    t: float
    read_tokens: int
    read_tokens_missed: int
    prompt_tokens: int
    prompt_reused: int
    evictions: int
    promotions: int
    demotions: int
    generated: int
    why: tuple[int, ...]  # the WHY_FIELDS counters (engine/kv/misses.py)


class SeriesPoint(NamedTuple):
    """One point of the snapshot's time series (a snapshot's `series` has one array per field, by name)."""

    t: float
    device_hit_rate_w: float  # over the last WINDOW_S (NaN: nothing read in it)
    prefix_hit_rate_w: float
    device_hit_rate: float  # since start
    prefix_hit_rate: float
    evictions_per_s: float
    promotions_per_s: float
    demotions_per_s: float
    tokens_per_s: float
    device_used_bytes: float
    host_used_bytes: float
    rss_bytes: float
    gpu_used_bytes: float  # NaN without NVML
    torch_allocated_bytes: float
    bandwidth_util: float  # the latest decode step's bytes / time / peak since the last point (engine/telemetry/health.py)
    shadow_kld: float  # per shadow step, NaN between them (SHADOW_SERIES)
    shadow_flip_rate: float
    shadow_logit_err: float


assert SeriesPoint._fields[-len(SHADOW_SERIES):] == SHADOW_SERIES


@dataclass(frozen=True)
class Event:
    t: float
    kind: str
    fields: dict


@dataclass(frozen=True)
class StepSample:
    """What a step hands telemetry when it ends (under the engine's lock)."""

    t: float  # engine time of the step
    device_used_bytes: int  # blocks held on each tier × block bytes
    host_used_bytes: int
    # For the health figures (engine/telemetry/health.py): the step's time (bookkeeping, forward, commit), whether every
    # sequence in it computed one token, how many ran and wait, and per KV-cache group (pool, its keys read so far).
    step_s: float = 0.0
    decode: bool = False
    batch: int = 0
    waiting: int = 0
    pools: tuple = ()


class KeyErrorReadings(Protocol):
    """Per-channel key reconstruction errors, as engine/fidelity/block_error.py's KVErrors keeps them."""

    keys_seen: int

    def outliers(self) -> list: ...


@dataclass(frozen=True)
class EngineState:
    """What a snapshot reads, handed by the engine under its lock (the live objects: read, never kept)."""

    now: float  # engine time
    pool: "BlockPool"
    seqs: "Mapping[int, Sequence]"
    spec: "ModelSpec"
    device: str  # the compute device, as torch names it ("cpu", "cuda:0")
    context_limit: int
    waiting: int  # sequences queued
    running: int  # sequences admitted
    key_errors: KeyErrorReadings  # per-channel key reconstruction errors (engine/fidelity/block_error.py)
    shadow: dict  # the latest shadow step (engine/fidelity/shadow.py), {} before the first
    stream_staging_bytes: int  # buffers host blocks are streamed through, on the compute device
    # KV-cache groups (engine/kv/groups.py), one per pool: (KVGroupSpec, pool, reads) with reads the group's key
    # reads (read_tokens, read_tokens_missed, read_tokens_streamed); () with one pool for every layer. The first
    # group's pool is `pool`.
    groups: tuple = ()
    cache_config: "CacheConfig | None" = None  # the engine's (with groups each pool has its share of the budgets)
    self_checks: dict = field(default_factory=dict)  # SelfChecks.summary() (engine/runtime/self_check.py)
    weights: str = ""  # what the weights are held as (LlamaFamily.weights_format: "fp32", "int4+int8 (Q4_1 x210, ...)")

    @property
    def config(self) -> "CacheConfig":
        return self.cache_config or self.pool.config


class Telemetry:
    """Counters' companions: the event feed, the marks, the windowed history and the time series; and the snapshots
    built from an EngineState. Handed its inputs (events, a StepSample per step, shadow points); it holds no engine.

    cuda_memory: torch's allocator readings (allocated, reserved) bytes, or None without CUDA."""

    def __init__(self, counters: Counters, clock: Callable[[], float], device: str = "cpu",
                 cuda_memory: Callable[[], tuple[int, int]] | None = None):
        self.counters = counters
        self.clock = clock
        self.health = Health(self.emit)  # the MemOS targets and checklist (engine/telemetry/health.py)
        self.device = device
        self.cuda_memory = cuda_memory
        self.events: collections.deque[Event] = collections.deque(maxlen=50_000)
        self.marks: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=MARKS_KEPT)
        self.history: collections.deque[_Totals] = collections.deque()
        self.series: collections.deque[SeriesPoint] = collections.deque(maxlen=SERIES_LEN)
        self.residency = {k: collections.deque(maxlen=RESIDENCY_SAMPLES)
                          for k in ("reuse_gap", "age_at_hit", "age_at_eviction", "lifetime")}
        self.ttfts: collections.deque[float] = collections.deque(maxlen=RESIDENCY_SAMPLES)
        self._last_series = 0.0
        self._proc = psutil.Process(os.getpid())
        self._nvml = None
        self._nvml_error = ""
        self._table_cache: dict[int, tuple[int, np.ndarray]] = {}
        self._table_ids: list[int] = []
        # Device blocks per sequence (sid -> (table_version, count)), valid for one placement epoch
        # (id(pool), pool.moves); the concatenated tables behind a full recount, kept while no table changes.
        self._dev_cache: dict[int, tuple[int, int]] = {}
        self._dev_epoch: tuple[int, int] | None = None
        self._flat: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._shadow_point: tuple[float, float, float] | None = None  # for the next time-series point
        # The last config change, as it was applied (the Cost panel's "since the last change" baseline, taken here
        # whether or not a window was looking): {} before the first. _config_seen: each knob's value as events
        # label it, from the latest snapshot and the changes since, so a change can say what it changed from.
        self.last_change: dict = {}
        self._config_seen: dict[str, str] = {}

    # -- inputs -------------------------------------------------------------------------------
    def emit(self, kind: str, **fields) -> None:
        self.events.append(Event(time.time(), kind, fields))
        if kind in MARK_KINDS:
            self.marks.append((self.clock(), kind, _mark_label(kind, fields)))
        c = self.counters
        if kind == "preempt":  # counted here, where the event is made: the feed and the counter always agree
            c.preemptions += 1
        elif kind == "context_shift":
            c.context_shifts += 1
        elif kind == "cow":
            c.cow_copies += 1
        elif kind == "config":
            c.config_changes += 1
            self._note_change(fields)

    def _note_change(self, fields: dict) -> None:
        """Keep the counters at the config change just applied (Snapshot.last_change), what changed and from what."""
        changes = {str(k): str(v) for k, v in fields.get("changes", {}).items()}
        before = {k: self._config_seen[k] for k in changes if k in self._config_seen}
        self.last_change = {"t": self.clock(), "n": self.counters.config_changes, "changes": changes,
                            "before": before, "lossy": bool(fields.get("lossy")), "counters": asdict(self.counters)}
        self._config_seen.update(changes)

    def pool_events(self, events: "Iterable[PoolEvent]") -> None:
        """The block pool's queued events (engine/kv/block_pool.py), as the engine drains them: counted; promotions
        and demotions also go to the feed (evictions are too frequent for it one by one)."""
        c = self.counters
        for kind, f in events:
            self.health.pool_event(kind, f)
            if kind == "evict":
                c.evictions += 1
                self.residency["age_at_eviction"].append(f["age"])
                self.residency["lifetime"].append(f["age"])
                continue
            if kind == "promote":
                c.promotions += f["n"]
                c.promoted_bytes += f["nbytes"]
            elif kind == "demote":
                c.demotions += f["n"]
                c.demoted_bytes += f["nbytes"]
            self.emit(kind, **f)

    def shadow_point(self, kld: float, flip_rate: float, logit_err: float) -> None:
        """A shadow step's measurement, for the next time-series point (the newest wins)."""
        self._shadow_point = (kld, flip_rate, logit_err)

    def record_prefix_hit(self, gaps: np.ndarray, ages: np.ndarray) -> None:
        self.residency["reuse_gap"].extend(gaps.tolist())
        self.residency["age_at_hit"].extend(ages.tolist())

    def cost_signals(self, waiting: int, running: int) -> dict[str, float]:
        """What a change costs, as the window and `kvscope bench` show it (NaN: nothing counted yet).

        ttft_p50 / ttft_p95: seconds from arrival to first token over the last requests; waiting / running: sequences
        queued and admitted now; preemptions: since start; promote_stall_s: seconds steps spent copying blocks to
        the device tier before they could run (on CUDA: issuing the side-stream copies; the compute stream's wait
        for them is not timed); promoted_mb_per_token / demoted_mb_per_token: MB moved between tiers
        per generated token; streamed_share: keys attention read from the host tier where they are, as a share of
        all keys read; streamed_mb_per_token: MB of host blocks copied as stored to the compute device's staging to
        be read there (host_reads=stream, or promote's overflow), per generated token."""
        c = self.counters
        t = np.asarray(self.ttfts, dtype=np.float64)
        per_tok = (lambda b: b / 2**20 / c.generated) if c.generated else (lambda b: float("nan"))
        return {
            "ttft_p50": float(np.percentile(t, 50)) if len(t) else float("nan"),
            "ttft_p95": float(np.percentile(t, 95)) if len(t) else float("nan"),
            "waiting": waiting, "running": running, "preemptions": c.preemptions,
            "promote_stall_s": c.promote_stall_s,
            "promoted_mb_per_token": per_tok(c.promoted_bytes), "demoted_mb_per_token": per_tok(c.demoted_bytes),
            "streamed_share": c.read_tokens_streamed / c.read_tokens if c.read_tokens else float("nan"),
            "streamed_mb_per_token": per_tok(c.streamed_bytes),
        }

    def ttft(self, seconds: float) -> None:
        self.ttfts.append(seconds)

    def after_step(self, sample: StepSample) -> None:
        c = self.counters
        now = sample.t
        self.history.append(_Totals(now, c.read_tokens, c.read_tokens_missed, c.prompt_tokens, c.prompt_reused,
                                    c.evictions, c.promotions, c.demotions, c.generated,
                                    tuple(getattr(c, k) for k in WHY_FIELDS)))
        while self.history and now - self.history[0].t > WINDOW_S:
            self.history.popleft()
        self.health.after_step(sample)
        if now - self._last_series >= SERIES_PERIOD_S:
            self._last_series = now
            w = self._windowed(now)
            self.health.series_point(now, w["tokens_per_s"], lambda: self.health.findings(w, c))
            gpu = self.gpu()
            kld, flips, logit_err = self._shadow_point or (np.nan, np.nan, np.nan)  # NaN: no shadow step since
            self._shadow_point = None
            self.series.append(SeriesPoint(
                t=now, device_hit_rate_w=w["device_hit_rate"], prefix_hit_rate_w=w["prefix_hit_rate"],
                device_hit_rate=c.device_hit_rate, prefix_hit_rate=c.prefix_hit_rate,
                evictions_per_s=w["evictions_per_s"], promotions_per_s=w["promotions_per_s"],
                demotions_per_s=w["demotions_per_s"], tokens_per_s=w["tokens_per_s"],
                device_used_bytes=sample.device_used_bytes,
                host_used_bytes=sample.host_used_bytes, rss_bytes=self._proc.memory_info().rss,
                gpu_used_bytes=gpu.get("nvml_used_bytes", np.nan),
                torch_allocated_bytes=gpu.get("torch_allocated_bytes", np.nan),
                bandwidth_util=self.health.bandwidth_point(),
                shadow_kld=kld, shadow_flip_rate=flips, shadow_logit_err=logit_err))

    # -- outputs ------------------------------------------------------------------------------
    def take_events(self) -> list[Event]:
        out = []
        while self.events:
            out.append(self.events.popleft())
        return out

    def _windowed(self, now: float) -> dict[str, float]:
        nan = float("nan")  # no data: nothing counted in the window (drawn as a gap, never as 0)
        if len(self.history) < 2:
            return {"device_hit_rate": nan, "prefix_hit_rate": nan, "evictions_per_s": nan, "promotions_per_s": nan,
                    "demotions_per_s": nan, "tokens_per_s": nan, **{k: nan for k in WHY_FIELDS}}
        a, b = self.history[0], self.history[-1]
        dt = max(b.t - a.t, 1e-6)
        reads, misses = b.read_tokens - a.read_tokens, b.read_tokens_missed - a.read_tokens_missed
        prompt, reused = b.prompt_tokens - a.prompt_tokens, b.prompt_reused - a.prompt_reused
        return {
            "device_hit_rate": 1.0 - misses / reads if reads else nan,
            "prefix_hit_rate": reused / prompt if prompt else nan,
            "evictions_per_s": (b.evictions - a.evictions) / dt,
            "promotions_per_s": (b.promotions - a.promotions) / dt,
            "demotions_per_s": (b.demotions - a.demotions) / dt,
            "tokens_per_s": (b.generated - a.generated) / dt,
            # tokens missed in the window, per reason (engine/kv/misses.py); lookup_tokens / read_tokens: their totals
            **{k: y - x for k, x, y in zip(WHY_FIELDS, a.why, b.why)},
        }

    def snapshot(self, e: EngineState, tables: str | set[int] = "auto") -> Snapshot:
        """tables: which sequences' block lists (tier, slot) to include: "all", a set of ids, or "auto"
        (all while the tables hold at most AUTO_TABLES_MAX entries, else none)."""
        now = e.now
        pool = e.pool
        tiers = tuple(self._tier(pool, t, now) for t in pool.tiers)
        seqs = self._seqs(e, tables)
        counters = self.counters.as_dict()
        counters.update(self.cost_signals(e.waiting, e.running))
        windowed = self._windowed(now)
        memory = self.memory(e)
        names = SeriesPoint._fields
        arr = np.asarray(self.series, dtype=np.float64).reshape(-1, len(names))
        series = {n: arr[:, i].copy() for i, n in enumerate(names)}
        residency = {k: np.asarray(v, dtype=np.float32) for k, v in self.residency.items()}
        spec = e.spec
        model = {"name": spec.name, "architecture": spec.architecture, "layers": spec.num_layers,
                 "heads": spec.num_heads, "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
                 "device": e.device, "context_limit": e.context_limit, "weights": e.weights}
        config = e.config.as_dict()
        self._config_seen = {k: str(v) for k, v in config.items()}
        steps = max(self.counters.steps, 1)
        timing = {"forward_ms_per_step": 1e3 * self.counters.forward_s / steps,
                  "bookkeeping_ms_per_step": 1e3 * self.counters.bookkeeping_s / steps}
        return Snapshot(t=now, model=model, config=config, tiers=tiers, seqs=seqs, counters=counters,
                        windowed=windowed, memory=memory, series=series, residency=residency, timing=timing,
                        marks=tuple(self.marks), quality=self.quality(e), last_change=dict(self.last_change),
                        kv_groups=self.kv_groups(e, tiers, now), health=self.health.summary(now, self.counters, windowed),
                        self_checks=dict(e.self_checks))

    def health_summary(self, now: float) -> dict:
        """The health figures (engine/telemetry/health.py) as a snapshot carries them."""
        return self.health.summary(now, self.counters, self._windowed(now))

    def kv_groups(self, e: EngineState, tiers: tuple, now: float) -> tuple[dict, ...]:
        """Each KV-cache group: its title, model layers, window, budgets, key reads, and its tiers (the first
        group's are the snapshot's own `tiers`, given here again; a later group's its own pool's)."""
        out = []
        for i, (g, pool, reads) in enumerate(e.groups):
            gt = tiers if i == 0 else tuple(self._tier(pool, t, now) for t in pool.tiers)
            out.append({"title": g.title, "layers": list(g.layers), "window": g.window,
                        "device_budget_mb": pool.config.device_budget_mb, "host_budget_mb": pool.config.host_budget_mb,
                        "read_tokens": reads[0], "read_tokens_missed": reads[1], "read_tokens_streamed": reads[2],
                        "why_missed": dict(reads[3]) if len(reads) > 3 else {}, "tiers": gt})
        return tuple(out)

    def quality(self, e: EngineState) -> dict:
        """What the KV format costs (engine/fidelity/block_error.py, engine/fidelity/shadow.py): the key channels with outliers, the
        latest shadow step (empty before the first) and the shadow period."""
        errors = e.key_errors
        return {"kv_dtype": e.config.kv_dtype.label, "lossless": e.config.kv_dtype.lossless,
                "keys_seen": errors.keys_seen, "key_outliers": errors.outliers(),
                "shadow_every_s": e.config.shadow_every_s, "shadow": dict(e.shadow)}

    def _tier(self, pool, t, now: float) -> TierSnapshot:
        # float32 throughout (half the bytes to move; exp is the costliest op here), each array written once:
        # at a million blocks this is memory-bound, so temporaries cost as much as the arithmetic.
        n = t.capacity
        age = np.empty(n, np.float32)
        np.subtract(now, t.last, out=age, casting="unsafe")  # in float64 (clocks run to large values), stored f32
        heat = np.maximum(age, 0)
        heat *= np.float32(np.log(pool.config.decay))
        np.exp(heat, out=heat)
        np.multiply(heat, t.heat, out=heat, casting="unsafe", dtype=np.float32)
        ref = t.ref.copy()
        state = np.greater_equal(t.lid, 0).view(np.uint8)  # 0 free, 1 cached, 2 in use
        state += np.greater(ref, 0).view(np.uint8)
        # K/V reconstruction error (engine/fidelity/block_error.py): NaN where free, or the slot's block was not measured.
        bad = np.not_equal(t.err_born, t.born)
        bad |= state == 0
        no_data = np.where(bad, np.float32(np.nan), np.float32(0))  # added to both: branch-free
        gone_age = np.empty(n, np.float32)
        np.subtract(now, t.gone_t, out=gone_age, casting="unsafe")
        free = state == 0
        return TierSnapshot(name=t.tier.name.lower(), capacity=t.capacity, block_bytes=pool.block_bytes, state=state,
                            owner=t.owner.copy(), ref=ref, fill=t.fill.copy(), heat=heat, age=age,
                            hashed=t.hash.view(np.int64) != 0, kerr=t.kerr + no_data, verr=t.verr + no_data,
                            why=np.where(free, 0, t.why).astype(np.int8), stores=np.where(free, 0, t.stores),
                            gone_age=np.where(free, np.float32(np.nan), gone_age),
                            gone_by=np.where(free, 0, t.gone_by).astype(np.int8))

    def _tables(self, seqs: "Mapping[int, Sequence]") -> tuple[list[np.ndarray], bool]:
        """Each sequence's block table as a numpy array, recopied only when the table changed; and whether
        any table (or the set of sequences) changed since the last call."""
        out = []
        changed = False
        if len(self._table_cache) > 2 * len(seqs) + 64:
            self._table_cache = {k: v for k, v in self._table_cache.items() if k in seqs}
        for s in seqs.values():
            hit = self._table_cache.get(s.id)
            if hit is None or hit[0] != s.table_version:
                hit = (s.table_version, np.asarray(s.blocks, dtype=np.int64))
                self._table_cache[s.id] = hit
                changed = True
            out.append(hit[1])
        ids = list(seqs)
        if ids != self._table_ids:
            self._table_ids, changed = ids, True
        return out, changed

    def _device_blocks(self, pool: "BlockPool", rows: list, arrays: list[np.ndarray], lens: np.ndarray,
                       changed: bool) -> np.ndarray:
        """Blocks on the device tier, per sequence.

        Counts hold while blocks stay on their tiers (pool.moves unchanged): then only sequences whose
        table changed are recounted. After a migration every sequence is recounted in one segmented sum
        over the concatenated tables, which are themselves kept while no table changes.
        """
        epoch = (id(pool), pool.moves)
        if changed:
            self._flat = None
        cache = self._dev_cache
        if epoch == self._dev_epoch:
            stale = [i for i, s in enumerate(rows) if cache.get(s.id, (-1,))[0] != s.table_version]
            if len(stale) <= 64:
                for i in stale:
                    s = rows[i]
                    cache[s.id] = (s.table_version, int(np.count_nonzero(pool.tier[arrays[i]] == 0)))
                if len(cache) > 2 * len(rows) + 64:
                    live = {s.id for s in rows}
                    self._dev_cache = cache = {k: v for k, v in cache.items() if k in live}
                return np.fromiter((cache[s.id][1] for s in rows), dtype=np.int64, count=len(rows))
        if self._flat is None:
            flat = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
            nz = lens > 0  # reduceat would give an empty segment the element at its start
            self._flat = (flat, (np.cumsum(lens) - lens)[nz], nz)
        flat, starts, nz = self._flat
        dev = np.zeros(len(rows), np.int64)
        if len(starts):
            dev[nz] = np.add.reduceat((pool.tier[flat] == 0).view(np.uint8), starts, dtype=np.int64)
        self._dev_epoch = epoch
        self._dev_cache = {s.id: (s.table_version, int(d)) for s, d in zip(rows, dev)}
        return dev

    def _seqs(self, e: EngineState, tables: str | set[int]) -> SeqTable:
        now, pool = e.now, e.pool
        rows = list(e.seqs.values())
        arrays, changed = self._tables(e.seqs)
        lens = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
        dev = self._device_blocks(pool, rows, arrays, lens, changed)
        if tables == "auto":
            tables = "all" if int(lens.sum()) <= AUTO_TABLES_MAX else set()
        empty_t, empty_s = np.zeros(0, np.int8), np.zeros(0, np.int64)
        if tables == "all":
            flat = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
            tier, slot = pool.tier[flat], pool.slot[flat]
            ends = np.cumsum(lens)
            block_tier = tuple(tier[a:b] for a, b in zip(ends - lens, ends))
            block_slot = tuple(slot[a:b] for a, b in zip(ends - lens, ends))
        else:
            block_tier = tuple(pool.tier[arrays[i]] if s.id in tables else empty_t for i, s in enumerate(rows))
            block_slot = tuple(pool.slot[arrays[i]] if s.id in tables else empty_s for i, s in enumerate(rows))

        # One pass over the sequences for their scalar columns; the rates are computed on the arrays.
        nan = float("nan")
        cols = np.array([(s.id, int(s.state), len(s.tokens), len(s.output), s.prefix_reused,
                          nan if s.ttft is None else s.ttft,
                          nan if s.first_token_at is None else s.first_token_at,
                          now if s.finished_at is None else s.finished_at) for s in rows],
                        dtype=np.float64).reshape(len(rows), 8)
        generated, first, end = cols[:, 3], cols[:, 6], cols[:, 7]
        with np.errstate(invalid="ignore"):
            tps = np.where((generated >= 2) & ~np.isnan(first),
                           (generated - 1) / np.maximum(end - first, 1e-6), 0.0)
        return SeqTable(
            id=cols[:, 0].astype(np.int32),
            state=cols[:, 1].astype(np.int8),
            tokens=cols[:, 2].astype(np.int32),
            generated=generated.astype(np.int32),
            blocks_device=dev.astype(np.int32),
            blocks_host=(lens - dev).astype(np.int32),
            tokens_per_s=tps.astype(np.float32),
            ttft=cols[:, 5].astype(np.float32),
            prefix_reused=cols[:, 4].astype(np.int32),
            labels=tuple(s.label for s in rows),
            block_tier=block_tier,
            block_slot=block_slot,
            why_missed=tuple(dict(s.why_missed) for s in rows),
        )

    def memory(self, e: EngineState) -> dict:
        """The tiers' memory over every KV-cache group's pool (block counts and bytes summed; block_bytes: the first
        pool's, "groups": each group's own)."""
        pools = [pool for _, pool, _ in e.groups] or [e.pool]
        parts = [self._pool_memory(p) for p in pools]
        tiers = {name: {k: (sum(p[name][k] for p in parts) if isinstance(v, (int, float)) and not isinstance(v, bool)
                            else v) for k, v in t.items()} for name, t in parts[0].items()}
        pool = e.pool
        vm = psutil.virtual_memory()
        out = {"tiers": tiers, "block_bytes": pool.block_bytes, "rss_bytes": self._proc.memory_info().rss,
               # buffers host blocks are streamed through, on the compute device (engine/attention/host_stream.py)
               "stream_staging_bytes": e.stream_staging_bytes,
               "system_total_bytes": vm.total, "system_used_bytes": vm.total - vm.available, "gpu": self.gpu()}
        if e.groups:
            out["groups"] = [{"title": g.title, "block_bytes": p.block_bytes, "tiers": m}
                             for (g, p, _), m in zip(e.groups, parts)]
        return out

    def _pool_memory(self, pool) -> dict:
        tiers = {}
        for t in pool.tiers:
            nb = t.nbytes()
            tiers[t.tier.name.lower()] = {
                "k_bytes": nb.get("k_data", 0),
                "v_bytes": nb.get("v_data", 0),
                "scale_bytes": sum(v for k, v in nb.items() if not k.endswith("_data")),
                "metadata_bytes": t.metadata_bytes(),
                "capacity_bytes": t.capacity * pool.block_bytes,  # the blocks' (k/v/scale bytes add reserved_bytes)
                "reserved_bytes": sum(nb.values()) - t.capacity * pool.block_bytes,  # device: the null and sink blocks
                "used_bytes": t.used * pool.block_bytes,
                "capacity_blocks": t.capacity,
                "used_blocks": t.used,
                "device": str(t.k["data"].device),
                "pinned": bool(t.k["data"].is_pinned()) if t.k["data"].device.type == "cpu" and self.cuda_memory is not None else False,
            }
            if t.null_slot is not None:  # per-layer placement: the device tier's layers [N, L) sit in host memory
                tiers[t.tier.name.lower()].update(device_layers=pool.sizes.dev_layers,
                                                  host_layers_bytes=pool.sizes.spilled_bytes)
        return tiers

    def gpu(self) -> dict:
        """NVML and torch allocator readings, or {'available': False, 'reason': ...}."""
        if self.cuda_memory is None:
            return {"available": False, "reason": "no GPU: the device tier is a budgeted CPU pool"}
        allocated, reserved = self.cuda_memory()
        out: dict[str, Any] = {"available": True, "torch_allocated_bytes": allocated, "torch_reserved_bytes": reserved}
        if self._nvml is None and not self._nvml_error:
            try:
                import pynvml

                pynvml.nvmlInit()
                idx = int(self.device.partition(":")[2] or 0)
                self._nvml = pynvml.nvmlDeviceGetHandleByIndex(idx)
            except Exception as ex:  # NVML missing or the driver refuses: say so, keep the torch numbers
                self._nvml_error = f"NVML unavailable: {ex}"
        if self._nvml is not None:
            import pynvml

            info = pynvml.nvmlDeviceGetMemoryInfo(self._nvml)
            out.update(nvml_used_bytes=int(info.used), nvml_total_bytes=int(info.total),
                       name=str(pynvml.nvmlDeviceGetName(self._nvml)))
        else:
            out["nvml_error"] = self._nvml_error
        return out


def _mark_label(kind: str, fields: dict) -> str:
    if kind == "config":
        changes = ", ".join(f"{k}={v}" for k, v in fields.get("changes", {}).items())
        return changes + (" (lossy)" if fields.get("lossy") else "")
    if kind == "workload":
        return f"workload: {fields.get('name', '?')}"
    if kind == "throughput_drop":
        return f"throughput -{fields.get('drop', '?')}"
    if kind == "context_shift":
        return f"context shift, seq {fields.get('seq', '?')}"
    return f"preempted seq {fields.get('seq', '?')} ({fields.get('mode', '?')})"
