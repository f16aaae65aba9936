"""The immutable snapshot records the engine publishes: `Snapshot`, with a `TierSnapshot` per tier and a
`SeqTable` of the sequences.

Plain frozen dataclasses of numpy arrays and small dicts; `Telemetry` (engine/telemetry/snapshotter.py) builds them,
engine/telemetry/snapshot_io.py writes and reads them, the window draws them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

@dataclass(frozen=True)
class TierSnapshot:
    """One entry per slot of a tier. state: 0 free, 1 cached (no owner), 2 in use."""

    name: str
    capacity: int
    block_bytes: int
    state: np.ndarray  # uint8
    owner: np.ndarray  # int32, -1 none (the sequence that allocated it)
    ref: np.ndarray  # int32
    fill: np.ndarray  # int32 tokens
    heat: np.ndarray  # float32, decayed to the snapshot time (0 where free)
    age: np.ndarray  # float32 seconds since last access (meaningless where state is free)
    hashed: np.ndarray  # bool: full block in the prefix cache
    # float32 reconstruction error of the block's K and V (engine/fidelity/block_error.py: relative RMS, max over its tokens
    # and layers); NaN where free or not measured. None in snapshots built without them (read as no data).
    kerr: np.ndarray | None = None
    verr: np.ndarray | None = None
    # A block's history (engine/kv/misses.py), None in snapshots built without it: why it went to the host tier
    # (int8 WHY_*: 0 none, 1 idle demotion, 2 room, 3 a re-lay or budget change), how many times its hash was stored
    # before (int32, 0 where free or unhashed), seconds since its previous copy left the cache (float32, NaN: never)
    # and why (int8 GONE_*: 0 never, 1 evicted, 2 reconfigured).
    why: np.ndarray | None = None
    stores: np.ndarray | None = None
    gone_age: np.ndarray | None = None
    gone_by: np.ndarray | None = None

    @property
    def used(self) -> int:
        return int(np.count_nonzero(self.state))


@dataclass(frozen=True)
class SeqTable:
    id: np.ndarray
    state: np.ndarray  # SeqState values
    tokens: np.ndarray  # tokens in cache order (prompt kept + generated)
    generated: np.ndarray
    blocks_device: np.ndarray
    blocks_host: np.ndarray
    tokens_per_s: np.ndarray
    ttft: np.ndarray  # seconds, nan until the first token
    prefix_reused: np.ndarray
    labels: tuple[str, ...]
    block_tier: tuple[np.ndarray, ...]  # per sequence: tier of each of its blocks
    block_slot: tuple[np.ndarray, ...]  # per sequence: slot of each of its blocks
    # per sequence: its missed tokens by reason (engine/kv/misses.py), {} none; () in files from before reasons
    why_missed: tuple[dict, ...] = ()


@dataclass(frozen=True)
class Snapshot:
    t: float
    model: dict
    config: dict
    tiers: tuple[TierSnapshot, ...]
    seqs: SeqTable
    counters: dict
    windowed: dict
    memory: dict
    series: dict[str, np.ndarray]
    residency: dict[str, np.ndarray]
    timing: dict = field(default_factory=dict)
    # Moments worth marking on the time series: (engine-clock time, kind, label), oldest first. Kinds:
    # "config", "workload", "context_shift", "preempt".
    marks: tuple = ()
    # What the KV format costs (Telemetry.quality): kv_dtype, lossless, keys_seen, key_outliers [[layer, head,
    # channel, absmax, ratio to the head's median channel]], shadow_every_s, shadow (the latest shadow step).
    quality: dict = field(default_factory=dict)
    # The last config change (Telemetry.last_change), {} before the first and in files from before it was kept:
    # t (engine clock), n (its number, counters.config_changes), changes {knob: new value} and before {knob: old
    # value} as events label them, lossy, and counters: every Counters field at that moment (what "since the last
    # change" is counted from).
    last_change: dict = field(default_factory=dict)
    # KV-cache groups (engine/kv/groups.py), () with one pool for every layer (and in files from before groups):
    # per group title, layers, window, device/host_budget_mb (its share), read_tokens / _missed / _streamed (its key
    # reads), why_missed ({reason: tokens}: the prompt tokens its missing blocks cost and its key reads' reasons,
    # engine/kv/misses.py group_summary; {} in files from before it), tiers (TierSnapshot device, host; the first
    # group's are `tiers`).
    kv_groups: tuple = ()
    # Cache health (engine/telemetry/health.py Health.summary): the MemOS targets (prefix hit rate, block utilization,
    # eviction rate) and the checklist (leaks, eviction check, lock wait, bandwidth, throughput drops); {} in files from
    # before it.
    health: dict = field(default_factory=dict)
    # Self-checks at first use (engine/runtime/self_check.py), per feature (attention, graphs, migration, stream):
    # state ("passed", "failed", "not run"), checks, and the deciding verdict's path, detail, fallback, seconds,
    # message. {} in files from before them.
    self_checks: dict = field(default_factory=dict)
    # The what-if curves the window computed last (app/whatif/worker.py WhatIfResult.saved; the engine never fills
    # it): source, groups [{group, title, current_blocks, block_mib, accesses, counted, distinct, curves [{policy,
    # exact, capacities (int64 blocks), hit_rate (float64, NaN: no data)}], lines}], one per KV-cache group the
    # trace read. {} where none were computed, and in files from before it.
    what_if: dict = field(default_factory=dict)
