"""Cache health: the MemOS design's three monitoring targets and its troubleshooting checklist, counted live.

The targets (`HealthTargets`; the window's Controls edit them and presets save them), each over the last WINDOW_S
seconds and since the engine started:

- prefix hit rate, at least 75 %: prompt tokens whose K/V came from the prefix cache when their sequence was admitted
  ÷ prompt tokens admitted (Counters.prompt_reused / prompt_tokens; a prompt counts once, not again after a
  preemption; the last prompt token is always computed, so a fully cached prompt still misses one);
- block utilization, at least 60 %, per tier: tokens stored in the blocks in use (held by a sequence: ref > 0) ÷
  (those blocks × block size), over every KV-cache group's pool; cached blocks (ref 0) are always full and are not
  counted. Sampled after a step at most once a second; "last 5 s" and "since start" weigh each sample by its blocks;
- eviction rate, at most 5 %: blocks evicted (dropped from the cache, from either tier) ÷ blocks allocated (fresh
  blocks handed out on either tier, a re-lay's copies included), over every pool.

The checklist:

- ref-count leaks: a block whose ref count is above the number of block-table entries that hold it (live sequences'
  tables, every group's; the prefix cache holds no count), found by `check_leaks` (every LEAK_CHECK_S, off the step:
  the holders are copied under the engine lock and counted outside it) in two checks in a row, is a leak: an error
  event names it. A count below its holders (a block freed while still held) is reported the same way;
- eviction effectiveness: the device tier of a pool with no free slot for FULL_WARN_S seconds while blocks are wanted
  (requests wait for admission, or new blocks go to the host tier) and no block was evicted from it: a warning event;
- lock wait: seconds the engine step (summed over a step's acquisitions) and the snapshot reader (per snapshot) waited
  for the engine lock: a histogram by decade and the p99 and max of the last LOCK_SAMPLES;
- bandwidth utilization: a decode step's bytes (weights, each storage once, and the K/V its attention read: keys read ×
  bytes per token of each group's pool) ÷ its time (bookkeeping, forward and commit), against the peak
  (engine/runtime/bandwidth.py: on a CPU a streaming read, the limit of a step that reads its bytes once);
- throughput drop: tokens/s over the last WINDOW_S more than 30 % below the median of the last minute's, while the
  batch is no smaller than 70 % of the minute's median batch (a drop in demand is not one), with at least 30 s of
  history: a "throughput_drop" event and mark, with the checklist's findings at that moment.

Numbers with nothing counted are NaN ("no data"), never 0. Torch-free: the window imports this module.
"""

from __future__ import annotations

import collections
import math
import time
import weakref
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from typing import Callable, NamedTuple

import numpy as np

from engine.sequence import cached_table

WINDOW_S = 5.0  # as engine/telemetry/snapshotter.py's windowed rates
UTIL_PERIOD_S = 1.0  # block utilization is sampled at most this often (a pass over every slot)
LEAK_CHECK_S = 3.0  # how often the window's runner checks for leaks (app/window/runner.py)
LEAKS_NAMED = 20  # blocks named in an event and in a snapshot
FULL_WARN_S = 30.0
DROP = 0.30  # a throughput drop: below (1 - DROP) × the minute's median
DROP_MIN_HISTORY_S = 30.0
DROP_BATCH = 0.70
MINUTE_S = 60.0
LOCK_SAMPLES = 1000
LOCK_EDGES_S = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)  # decades: < 10 µs, 10-100 µs, ... , ≥ 1 s
LOCK_BINS = ("< 10 µs", "10-100 µs", "0.1-1 ms", "1-10 ms", "10-100 ms", "0.1-1 s", "≥ 1 s")
AMBER_POINTS = 0.10  # a value that misses its target by less than this (10 percentage points) is amber, else red
DROPS_KEPT = 20

# What each figure counts, for tooltips, the README and `generate --json` (one place).
MEANING = {
    "prefix_hit_rate": "prompt tokens whose K/V came from the prefix cache when their sequence was admitted ÷ prompt "
                       "tokens admitted (each prompt once; its last token is always computed)",
    "block_utilization": "tokens stored in the blocks in use (held by a sequence, ref > 0) ÷ (those blocks × block "
                         "size), per tier, every KV-cache group's pool; cached blocks (ref 0, always full) are not "
                         "counted; sampled after a step, once a second",
    "eviction_rate": "blocks evicted (dropped from the cache, from either tier) ÷ blocks allocated (fresh blocks handed "
                     "out on either tier, a re-lay's copies included), every KV-cache group's pool",
    "leaks": "blocks whose ref count differs from the block-table entries that hold them (live sequences' tables; the "
             "prefix cache holds no count), in two checks in a row, every few seconds",
    "eviction_check": f"a pool's device tier with no free slot for {FULL_WARN_S:g} s while blocks are wanted "
                      "(requests waiting, or new blocks placed on the host tier) and no block evicted from it",
    "lock_wait": "seconds the engine step (per step, all its acquisitions) and the snapshot reader (per snapshot) "
                 f"waited for the engine lock; p99 and max of the last {LOCK_SAMPLES}",
    "bandwidth": "a decode step's bytes (weights, each storage once, + the K/V its attention read) ÷ its time "
                 "(bookkeeping, forward, commit), as a share of the peak",
    "throughput": f"tokens/s over the last {WINDOW_S:g} s more than {DROP:.0%} below the median of the last minute's, "
                  f"the batch at least {DROP_BATCH:.0%} of the minute's median batch",
}


# -- targets ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HealthTargets:
    """The three monitoring targets (shares, 0..1): at least, at least, at most."""

    prefix_hit_rate: float = 0.75
    block_utilization: float = 0.60
    eviction_rate: float = 0.05

    AT_MOST = ("eviction_rate",)

    def replace(self, **changes) -> "HealthTargets":
        return HealthTargets.from_dict({**asdict(self), **changes})

    @staticmethod
    def from_dict(d: dict) -> "HealthTargets":
        """From {name: share}; ValueError naming the bad entry (an unknown name, not a number in 0..1)."""
        names = {f.name for f in fields(HealthTargets)}
        out = {}
        for k, v in d.items():
            if k not in names:
                raise ValueError(f"unknown health target {k!r} (known: {', '.join(sorted(names))})")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= float(v) <= 1.0:
                raise ValueError(f"health target {k}: {v!r} is not a share between 0 and 1")
            out[k] = float(v)
        return HealthTargets(**out)

    def as_dict(self) -> dict:
        return asdict(self)

    def grade(self, name: str, value: float) -> str:
        """"green" (meets the target), "amber" (misses by less than AMBER_POINTS), "red", or "none" (no data)."""
        if value is None or not math.isfinite(value):
            return "none"
        target = getattr(self, name)
        miss = value - target if name in self.AT_MOST else target - value
        return "green" if miss <= 0 else "amber" if miss < AMBER_POINTS else "red"

    def describe(self, name: str) -> str:
        op = "≤" if name in self.AT_MOST else "≥"
        return f"{op} {100 * getattr(self, name):g} %"


def grades(health: dict, targets: HealthTargets) -> dict:
    """The three targets' grades, over the last window ("w") and since start ("all"), of a health summary."""
    out = {}
    for name in ("prefix_hit_rate", "block_utilization", "eviction_rate"):
        h = health.get(name, {})
        out[name] = {k: targets.grade(name, h.get(k, math.nan)) for k in ("w", "all")}
    return out


# -- lock wait -----------------------------------------------------------------------------------------
class LockWaits:
    """Time spent waiting for the engine lock, by who waited: "step" (every acquisition of a step, summed; recorded
    at the step's end) and "snapshot" (one per snapshot). Recorded under the lock itself, so no lock of its own.

    `waiting[who]` holds the perf_counter time a waiter began waiting while it waits (a test waits for it)."""

    WHO = ("step", "snapshot")

    def __init__(self):
        self.hist = {w: np.zeros(len(LOCK_BINS), np.int64) for w in self.WHO}
        self.recent = {w: collections.deque(maxlen=LOCK_SAMPLES) for w in self.WHO}  # (t, seconds)
        self.waiting: dict[str, float] = {}
        self.last = {w: math.nan for w in self.WHO}
        self.gave_up = 0  # snapshots that timed out waiting (the window kept its last one)
        self._step = 0.0

    @contextmanager
    def held(self, lock):
        """`with waits.held(engine.lock):` for the step: the wait adds to the step's."""
        t = time.perf_counter()
        self.waiting["step"] = t
        lock.acquire()
        self._step += time.perf_counter() - t
        self.waiting.pop("step", None)
        try:
            yield
        finally:
            lock.release()

    def acquire(self, lock, timeout: float = -1, who: str = "snapshot") -> bool:
        """lock.acquire(timeout=...), its wait recorded as one of `who`'s (a timeout too, as what it waited)."""
        t = time.perf_counter()
        self.waiting[who] = t
        ok = lock.acquire(timeout=timeout)
        waited = time.perf_counter() - t
        self.waiting.pop(who, None)
        if ok:
            self.record(who, waited)
        else:
            self.gave_up += 1
        return ok

    def end_step(self) -> float:
        """The step's wait so far, recorded; the next step starts from 0."""
        w, self._step = self._step, 0.0
        self.record("step", w)
        return w

    def record(self, who: str, seconds: float) -> None:
        self.hist[who][int(np.searchsorted(LOCK_EDGES_S, seconds, side="right"))] += 1
        self.recent[who].append((time.monotonic(), seconds))
        self.last[who] = seconds

    def p99(self, who: str, since: float | None = None) -> float:
        """p99 of the recent waits (those after monotonic time `since`), NaN if none."""
        w = [s for t, s in self.recent[who] if since is None or t >= since]
        return float(np.percentile(w, 99)) if w else math.nan

    def summary(self) -> dict:
        out: dict = {"edges_s": list(LOCK_EDGES_S), "bins": list(LOCK_BINS), "gave_up": self.gave_up}
        for w in self.WHO:
            r = [s for _, s in self.recent[w]]
            out[w] = {"n": int(self.hist[w].sum()), "hist": self.hist[w].tolist(), "recent": len(r),
                      "p99_s": float(np.percentile(r, 99)) if r else math.nan,
                      "max_s": float(max(r)) if r else math.nan, "last_s": self.last[w]}
        return out


# -- the health figures -----------------------------------------------------------------------------------
class _Totals(NamedTuple):
    t: float
    allocated: int
    evicted: int


class _Util(NamedTuple):
    t: float
    tokens: tuple  # per tier (device, host): tokens stored in blocks in use, over every pool
    capacity: tuple  # per tier: blocks in use × block size


class Health:
    """The health figures, fed by Telemetry (engine/telemetry/snapshotter.py): each StepSample, the pool events, the
    series points; `check_leaks` from whoever checks (app/window/runner.py's thread, `Engine.check_health`). `emit` is
    Telemetry.emit (errors, warnings, throughput drops go to the feed and the marks)."""

    def __init__(self, emit: Callable[..., None]):
        self.emit = emit
        self.locks = LockWaits()
        self.titles: list[str] = []  # KV-cache groups' titles, by index ([] with one pool)
        # allocations, per pool (a re-laid pool is a new one) and per tier, as last read
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.allocated = [0, 0]  # per tier, since start
        self.dropped = [0, 0]  # blocks evicted from the cache, per tier they were dropped from
        self.to_host = 0  # device blocks an eviction moved to the host tier (not dropped)
        self.history: collections.deque[_Totals] = collections.deque()
        self.util: collections.deque[_Util] = collections.deque()
        self.util_sum = ([0, 0], [0, 0])  # since start: tokens, capacity per tier
        self.util_groups: list[dict] = []
        self._util_t = -math.inf
        self.block_size = 0
        # eviction effectiveness, per group index: since when its device tier has had no free slot, and what happened
        self._full: dict[int, dict] = {}
        self._device_evicted = collections.Counter()  # per group, since start (dropped + moved to host)
        self.warnings = 0
        self.warning = ""
        # bandwidth
        self.peak_bps = math.nan
        self.peak_how = "not measured"
        self.weights_bytes = 0
        self._reads: dict[int, int] = {}
        self.bw: collections.deque = collections.deque(maxlen=4096)  # (t, utilization, bytes, step_s)
        self._bw_point = math.nan
        # throughput
        self.tps: collections.deque = collections.deque()  # (t, tokens/s over WINDOW_S, median batch of the period)
        self._batches: list[int] = []
        self.batches: collections.deque = collections.deque()  # (t, batch) per step, the last minute
        self.drops: collections.deque = collections.deque(maxlen=DROPS_KEPT)
        self.n_drops = 0
        self.drop_checks = 0  # checks made (each needs DROP_MIN_HISTORY_S of history)
        self.steps = 0
        self._in_drop = False
        self._drop_check_t = -math.inf
        # leaks
        self.leaks: dict = {"checks": 0, "checked_at": math.nan, "blocks": 0, "under": 0, "named": []}
        self._suspects: dict = {}

    # -- inputs ---------------------------------------------------------------------------------
    def set_bandwidth(self, weights_bytes: int, peak_bps: float, how: str) -> None:
        self.weights_bytes, self.peak_bps, self.peak_how = int(weights_bytes), float(peak_bps), how

    def pool_event(self, kind: str, f: dict) -> None:
        """One of the pool's queued events (engine/kv/block_pool.py): evictions counted by tier and group."""
        g = f.get("group", 0)
        if kind == "evict":
            tier = int(f.get("tier", 0))
            self.dropped[tier] += 1
            if tier == 0:
                self._device_evicted[g] += 1
        elif kind == "demote" and f.get("reason") == "evict":
            self.to_host += f["n"]
            self._device_evicted[g] += f["n"]

    def after_step(self, s) -> None:
        """A StepSample (engine/telemetry/snapshotter.py), under the engine lock."""
        now = s.t
        self.steps += 1
        self.locks.end_step()
        self._batches.append(s.batch)
        self.batches.append((now, s.batch))
        while self.batches and now - self.batches[0][0] > MINUTE_S:
            self.batches.popleft()
        host_allocs = 0
        for g, (pool, reads) in enumerate(s.pools):
            counts = pool.allocated
            last = self._seen.get(pool, (0, 0))
            for tier in (0, 1):
                self.allocated[tier] += counts[tier] - last[tier]
            host_allocs += counts[1] - last[1]
            self._seen[pool] = (counts[0], counts[1])
            self._watch_full(g, pool, now, s.waiting, counts[1] - last[1])
        self.history.append(_Totals(now, sum(self.allocated), sum(self.dropped)))
        while self.history and now - self.history[0].t > WINDOW_S:
            self.history.popleft()
        if now - self._util_t >= UTIL_PERIOD_S:
            self._util_t = now
            self._sample_util(now, s.pools)
        self._bandwidth(s)

    def _watch_full(self, g: int, pool, now: float, waiting: int, host_allocs: int) -> None:
        dev = pool.tiers[0]
        if dev.free_slots or not dev.capacity:
            self._full.pop(g, None)
            return
        st = self._full.get(g)
        if st is None:
            st = self._full[g] = {"since": now, "evicted_at_start": self._device_evicted[g], "pressure": False,
                                  "warned": False}
        st["pressure"] = st["pressure"] or waiting > 0 or host_allocs > 0
        evicted = self._device_evicted[g] - st["evicted_at_start"]
        if evicted:  # eviction runs: start counting again from here
            st.update(since=now, evicted_at_start=self._device_evicted[g], pressure=False)
            return
        if now - st["since"] >= FULL_WARN_S and st["pressure"] and not st["warned"]:
            st["warned"] = True
            self.warnings += 1
            where = f" ({self.titles[g]})" if g < len(self.titles) and len(self.titles) > 1 else ""
            owned = int(np.count_nonzero(dev.ref[: dev.capacity] > 0))
            self.warning = (f"the device tier{where} has been full for {now - st['since']:.0f} s with blocks wanted "
                            f"and nothing was evicted from it ({owned} of {dev.capacity} blocks owned by sequences, "
                            f"{len(dev.cached)} cached)")
            self.emit("warning", message=self.warning, group=g)

    def _sample_util(self, now: float, pools) -> None:
        tokens, cap = [0, 0], [0, 0]
        groups = []
        for g, (pool, _) in enumerate(pools):
            bs = pool.config.block_size
            self.block_size = bs
            per = {}
            for tier, t in enumerate(pool.tiers):
                used = t.ref[: t.capacity] > 0
                n = int(np.count_nonzero(used))
                k = int(t.fill[: t.capacity][used].sum()) if n else 0
                tokens[tier] += k
                cap[tier] += n * bs
                per[("device", "host")[tier]] = k / (n * bs) if n else math.nan
            if len(self.titles) > 1:  # KV-cache groups: each pool's own
                groups.append({"title": self.titles[g], **per})
        self.util.append(_Util(now, tuple(tokens), tuple(cap)))
        while self.util and now - self.util[0].t > WINDOW_S:
            self.util.popleft()
        for tier in (0, 1):
            self.util_sum[0][tier] += tokens[tier]
            self.util_sum[1][tier] += cap[tier]
        self.util_groups = groups

    def _bandwidth(self, s) -> None:
        kv = 0.0
        for g, (pool, reads) in enumerate(s.pools):
            kv += (reads - self._reads.get(g, 0)) * pool.block_bytes / pool.config.block_size
            self._reads[g] = reads
        if not s.decode or s.step_s <= 0 or not math.isfinite(self.peak_bps):
            return
        nbytes = self.weights_bytes + kv
        u = nbytes / s.step_s / self.peak_bps
        self.bw.append((s.t, u, nbytes, s.step_s))
        self._bw_point = u

    def bandwidth_point(self) -> float:
        """The latest decode step's utilization since the last series point (NaN: none), for the time series."""
        u, self._bw_point = self._bw_point, math.nan
        return u

    def series_point(self, now: float, tokens_per_s: float, findings: Callable[[], dict]) -> None:
        """A time-series point's tokens/s (over WINDOW_S); once a second, the throughput-drop check."""
        batch = float(np.median(self._batches)) if self._batches else math.nan
        self._batches = []
        self.tps.append((now, tokens_per_s, batch))
        while self.tps and now - self.tps[0][0] > MINUTE_S:
            self.tps.popleft()
        if now - self._drop_check_t < 1.0:
            return
        self._drop_check_t = now
        self.check_drop(now, findings)

    def check_drop(self, now: float, findings: Callable[[], dict]) -> None:
        pts = [(t, v, b) for t, v, b in self.tps if math.isfinite(v)]
        if not pts or now - pts[0][0] < DROP_MIN_HISTORY_S:
            return
        median = float(np.median([v for _, v, _ in pts]))
        cur = pts[-1][1]
        batches = [b for _, _, b in pts if math.isfinite(b)]
        recent = [b for t, _, b in pts if now - t <= WINDOW_S and math.isfinite(b)]
        if median <= 0 or not batches or not recent:
            return
        self.drop_checks += 1
        dropped = cur < (1 - DROP) * median and float(np.median(recent)) >= DROP_BATCH * float(np.median(batches))
        if dropped and not self._in_drop:
            self.n_drops += 1
            f = findings()
            drop = {"t": now, "tokens_per_s": cur, "median_tokens_per_s": median, "drop": 1 - cur / median,
                    "findings": f}
            self.drops.append(drop)
            self.emit("throughput_drop", tokens_per_s=round(cur, 2), median=round(median, 2),
                      drop=f"{100 * (1 - cur / median):.0f} %", findings="; ".join(f"{k}: {v}" for k, v in f.items()))
        self._in_drop = cur < (1 - DROP) * median

    # -- leaks ----------------------------------------------------------------------------------
    def check_leaks(self, held: list) -> dict:
        """held: per pool, from `leak_input` (copied under the engine lock); counted here, outside it. A block
        found in two checks in a row with the same allocation serial and count is reported (an error event for the
        new ones). Returns the leaks summary."""
        found = {}
        under = 0
        for g, (lid_by_slot, ref, serial, tables, n_lids) in enumerate(held):
            holders = np.bincount(tables, minlength=n_lids) if len(tables) else np.zeros(n_lids, np.int64)
            for tier, (lids, refs) in enumerate(zip(lid_by_slot, ref)):
                used = np.flatnonzero(lids >= 0)
                h = holders[lids[used]]
                r = refs[used].astype(np.int64)
                bad = np.flatnonzero(r != h)
                for i in bad.tolist():
                    slot = int(used[i])
                    lid = int(lids[slot])
                    found[(g, lid, int(serial[lid]), int(r[i]))] = (g, lid, tier, slot, int(r[i]), int(h[i]))
        confirmed = [v for k, v in found.items() if k in self._suspects]
        new = [v for k, v in found.items() if k in self._suspects and not self._suspects[k]]
        self._suspects = {k: (k in self._suspects) for k in found}
        under = sum(1 for v in confirmed if v[4] < v[5])
        if new:
            named = ", ".join(self._block_name(v) for v in new[:LEAKS_NAMED])
            more = f" and {len(new) - LEAKS_NAMED} more" if len(new) > LEAKS_NAMED else ""
            self.emit("error", message=f"ref-count leak: {len(new)} block(s) whose count is not their holders' "
                                       f"(count/holders): {named}{more}",
                      blocks=[[v[0], v[1]] for v in new[:LEAKS_NAMED]])
        self.leaks = {"checks": self.leaks["checks"] + 1, "checked_at": time.time(), "blocks": len(confirmed),
                      "under": under, "named": [list(v) for v in confirmed[:LEAKS_NAMED]]}
        return self.leaks

    def _block_name(self, v) -> str:
        g, lid, tier, slot, r, h = v
        where = f"group {self.titles[g]} " if len(self.titles) > 1 and g < len(self.titles) else ""
        return f"{where}block {lid} ({('device', 'host')[tier]} slot {slot}, {r}/{h})"

    # -- outputs --------------------------------------------------------------------------------
    def findings(self, windowed: dict, counters) -> dict:
        """The checklist in a few words each, at this moment (a throughput drop's event carries them)."""
        ms = lambda s: "no data" if not math.isfinite(s) else f"{1e3 * s:.2f} ms"  # noqa: E731
        pct = lambda x: "no data" if not math.isfinite(x) else f"{100 * x:.1f} %"  # noqa: E731
        minute = time.monotonic() - MINUTE_S
        recent = time.monotonic() - WINDOW_S
        bw = self._bw_recent(WINDOW_S)
        return {
            "leaks": f"{self.leaks['blocks']} block(s)" if self.leaks["checks"] else "not checked yet",
            "eviction": self.warning or "no warning",
            "lock wait p99 (step, 5 s / minute)": f"{ms(self.locks.p99('step', recent))} / "
                                                   f"{ms(self.locks.p99('step', minute))}",
            "lock wait p99 (snapshot, 5 s / minute)": f"{ms(self.locks.p99('snapshot', recent))} / "
                                                       f"{ms(self.locks.p99('snapshot', minute))}",
            "prefix hit (5 s / all)": f"{pct(windowed.get('prefix_hit_rate', math.nan))} / "
                                      f"{pct(counters.prefix_hit_rate)}",
            "device hit (5 s / all)": f"{pct(windowed.get('device_hit_rate', math.nan))} / "
                                      f"{pct(counters.device_hit_rate)}",
            "bandwidth (5 s / minute)": f"{pct(bw)} / {pct(self._bw_recent(MINUTE_S))}",
        }

    def _bw_recent(self, span: float) -> float:
        if not self.bw:
            return math.nan
        end = self.bw[-1][0]
        u = [x[1] for x in self.bw if end - x[0] <= span]
        return float(np.median(u)) if u else math.nan

    def summary(self, now: float, counters, windowed: dict) -> dict:
        """The health figures as a snapshot carries them (JSON-able; NaN: no data)."""
        nan = math.nan
        w_alloc = self.history[-1].allocated - self.history[0].allocated if len(self.history) > 1 else 0
        w_evict = self.history[-1].evicted - self.history[0].evicted if len(self.history) > 1 else 0
        alloc, evicted = sum(self.allocated), sum(self.dropped)
        tiers = {}
        for tier, name in enumerate(("device", "host")):
            wt = sum(u.tokens[tier] for u in self.util)
            wc = sum(u.capacity[tier] for u in self.util)
            last = self.util[-1] if self.util else None
            tiers[name] = {"w": wt / wc if wc else nan,
                           "all": self.util_sum[0][tier] / self.util_sum[1][tier] if self.util_sum[1][tier] else nan,
                           "tokens": last.tokens[tier] if last else 0, "capacity_tokens": last.capacity[tier] if last else 0}
        full = [{"group": g, "title": self.titles[g] if g < len(self.titles) else "", "full_s": now - st["since"],
                 "pressure": st["pressure"], "warned": st["warned"]} for g, st in sorted(self._full.items())]
        bw_last = self.bw[-1] if self.bw else None
        tps = [v for _, v, _ in self.tps if math.isfinite(v)]
        return {
            "window_s": WINDOW_S,
            "prefix_hit_rate": {"w": windowed.get("prefix_hit_rate", nan), "all": counters.prefix_hit_rate,
                                "reused": counters.prompt_reused, "prompt_tokens": counters.prompt_tokens},
            "block_utilization": {"w": tiers["device"]["w"], "all": tiers["device"]["all"], "tiers": tiers,
                                  "groups": list(self.util_groups), "block_size": self.block_size},
            "eviction_rate": {"w": w_evict / w_alloc if w_alloc else nan, "all": evicted / alloc if alloc else nan,
                              "evicted": evicted, "allocated": alloc, "evicted_w": w_evict, "allocated_w": w_alloc,
                              "device": {"allocated": self.allocated[0], "dropped": self.dropped[0],
                                         "to_host": self.to_host},
                              "host": {"allocated": self.allocated[1], "dropped": self.dropped[1]}},
            "leaks": dict(self.leaks),
            "eviction_check": {"full": full, "warnings": self.warnings, "warning": self.warning, "steps": self.steps},
            "lock_wait": self.locks.summary(),
            "bandwidth": {"peak_bytes_per_s": self.peak_bps, "peak": self.peak_how, "weights_bytes": self.weights_bytes,
                          "steps": len(self.bw), "w": self._bw_recent(WINDOW_S), "minute": self._bw_recent(MINUTE_S),
                          "last_bytes": bw_last[2] if bw_last else nan, "last_step_s": bw_last[3] if bw_last else nan,
                          "last": bw_last[1] if bw_last else nan},
            "throughput": {"tokens_per_s": tps[-1] if tps else nan,
                           "median_minute": float(np.median(tps)) if tps else nan,
                           "drops": self.n_drops, "checks": self.drop_checks, "last_drops": list(self.drops)},
        }


def leak_input(pools, seqs) -> list:
    """Under the engine lock: per pool (KV-cache group order), copies of each tier's lid and ref by slot, the serials,
    the lids every live table holds (group 0: the sequences' own tables; group g: their g-th group table)."""
    out = []
    for g, pool in enumerate(pools):
        tables = []
        for s in seqs.values():
            t = s if g == 0 else (s.groups[g - 1] if len(s.groups) >= g else None)
            if t is not None and t.blocks:
                tables.append(cached_table(t))  # kept as an array until the table changes
        flat = np.concatenate(tables) if tables else np.zeros(0, np.int64)
        out.append(([t.lid[: t.capacity].copy() for t in pool.tiers], [t.ref[: t.capacity].copy() for t in pool.tiers],
                    pool.serial.copy(), flat, pool.n_lids))
    return out


def report(summary: dict, targets: HealthTargets | None = None) -> dict:
    """A health summary for `generate --json` and `bench --json`: the figures, the targets and each target's grade
    over the last window and since start, NaN as null (no data)."""
    targets = targets or HealthTargets()
    return json_safe({**summary, "targets": targets.as_dict(), "grades": grades(summary, targets)})


def one_line(summary: dict, targets: HealthTargets | None = None) -> str:
    """The targets since start and the checklist in one line (`bench` prints one per config)."""
    targets = targets or HealthTargets()
    g = grades(summary, targets)
    pct = lambda x: "no data" if x is None or not math.isfinite(x) else f"{100 * x:.1f} %"  # noqa: E731
    parts = [f"{label} {pct(summary.get(name, {}).get('all', math.nan))} ({targets.describe(name)}: "
             f"{g[name]['all']})" for name, label in (("prefix_hit_rate", "prefix hit"),
                                                      ("block_utilization", "block util (device)"),
                                                      ("eviction_rate", "eviction rate"))]
    lk = summary.get("leaks", {})
    lw = summary.get("lock_wait", {}).get("step", {})
    p99 = lw.get("p99_s", math.nan)
    parts.append(f"leaks {lk.get('blocks', 0) if lk.get('checks') else 'not checked'}")
    parts.append(f"step lock wait p99 {'no data' if not math.isfinite(p99) else f'{1e3 * p99:.2f} ms'}")
    parts.append(f"bandwidth {pct(summary.get('bandwidth', {}).get('minute', math.nan))} of peak")
    parts.append(f"throughput drops {summary.get('throughput', {}).get('drops', 0)}")
    return ", ".join(parts)


def json_safe(x):
    """NaN and infinities as None (JSON has no NaN): `generate --json`, `bench --json`."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, np.generic):
        return json_safe(x.item())
    return x
