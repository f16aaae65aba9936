"""The window's "What if" tab, its app side: record or open a trace, compute its curves on a worker thread, hand the
tab plain numpy arrays (ui/panels/what_if.py draws them; ui never sees torch or the engine).

`WhatIfService` wraps the live engine's runner: `record()` starts a trace (refused while one is recorded from
Controls), `take()` stops it and returns it unsaved, `compute(source, done)` runs `what_if_results` (one result
per KV-cache group the trace read) on a daemon thread and calls done(results or an error message) from that
thread: the tab passes a Qt signal's emit, so the result crosses to the GUI thread queued.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from engine.lab.mrc import curve_capacities, what_if_short
from engine.lab.whatif import (BLOCK_SIZES, block_size_curves, block_stream, groups_of, policy_curves, stream_of,
                               threshold_curve)
from ui.panels.what_if_data import ConfiguredPrediction, SavedResult

TARGET = 0.75
THRESHOLDS_S = np.array([0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0])


@dataclass(frozen=True)
class WhatIfResult(SavedResult):
    """Everything the tab draws for one KV-cache group (ui/panels/what_if_data.py SavedResult's fields, computed here):
    curves: (label, capacities in blocks, hit rate, exact); block_sizes: (block size, MiB, hit rate); thresholds:
    (seconds, hit rate) at the current capacity; lines: the what-if sentences; group, group_title: which group's reads
    (0 and "" for a trace of one group). `saved()` is what a snapshot carries of it."""
    seconds: float = 0.0
    saved_only: bool = False


def _load(source):
    """(trace or None, block-hash stream or None, the source's name)."""
    from engine.kv.access_trace import AccessTrace

    if isinstance(source, str) and source.endswith(".jsonl"):
        from engine.workloads.public_traces import read_block_trace

        reqs = read_block_trace(source)
        return None, block_stream(reqs), f"{source} ({reqs[0].fmt})"
    trace = AccessTrace.load(source) if isinstance(source, str) else source
    if len(trace) == 0:
        raise ValueError("the trace is empty: nothing was read while it recorded")
    return trace, None, source if isinstance(source, str) else "recorded from this engine"


def what_if_result(source, current_blocks: int, block_mib: float | None, demote_after_s: float | None = None,
                   decay: float = 0.9, group: int = 0, group_title: str = "", _loaded=None) -> WhatIfResult:
    """source: an AccessTrace, a path to one (.npz), or a path to a Mooncake / Bailian trace (.jsonl); one KV-cache
    group's curves (a block-hash trace has one group)."""
    t0 = time.perf_counter()
    trace, stream, name = _loaded or _load(source)
    if trace is not None:
        stream = stream_of(trace, group=group)
        if len(stream.keys) == 0:
            raise ValueError(f"the trace has no reads of KV-cache group {group}")
    caps = curve_capacities(stream.distinct)
    caps = np.unique(np.append(caps, [max(1, current_blocks // 2), current_blocks, current_blocks * 2,
                                       current_blocks * 4]))
    curves = policy_curves(stream, caps, decay=decay)
    lines = [what_if_short(c, current_blocks, block_mib, TARGET) for c in curves]
    sizes = []
    if trace is not None and trace.tokens is not None and trace.block_size and block_mib:
        per_token = block_mib / trace.block_size
        sizes = [(b, mib, c.hit_rate) for b, mib, c in block_size_curves(trace, per_token, BLOCK_SIZES, group=group)]
    th = (THRESHOLDS_S, threshold_curve(stream, current_blocks, THRESHOLDS_S)) if trace is not None else None
    configured, note = (configured_prediction(trace, current_blocks) if trace is not None and group == 0
                        else (None, None))
    if configured is not None:
        lines = configured_lines_of(configured, current_blocks, block_mib) + lines
    elif note:
        lines = [note] + lines
    return WhatIfResult(name, int(len(stream.keys)), int(stream.counted.sum()), stream.distinct, current_blocks,
                        block_mib, demote_after_s,
                        [(c.policy, c.capacities, c.hit_rate, c.exact) for c in curves], sizes, th, lines,
                        time.perf_counter() - t0, group, group_title, configured=configured)


def configured_prediction(trace, current_blocks: int) -> tuple[ConfiguredPrediction | None, str | None]:
    """The engine as recorded, rerun on `trace` (engine/lab/kv_replay.py); (None, why) for a trace it cannot be
    rerun on (no tokens or knobs recorded, KV-cache groups)."""
    from engine.lab.kv_replay import KVReplay, KVReplayError, default_capacities, knobs_text

    try:
        replay = KVReplay(trace)
        if replay.recorded_capacity is None:
            raise KVReplayError("the trace does not say the device tier's capacity (recorded by an older version)")
        cal = replay.calibrated(default_capacities(int(replay.recorded_capacity), current_blocks))
    except KVReplayError as e:
        return None, f"engine as configured: not predicted ({e})"
    return ConfiguredPrediction(replay.config.policy, knobs_text(replay.config), cal.recorded_capacity,
                                cal.capacities(), cal.predicted("hit_rate"), cal.predicted("prefix_rate"),
                                cal.predicted("device_rate"), dict(cal.measured)), None


def configured_lines_of(p: ConfiguredPrediction, current: int, block_mib: float | None) -> list[str]:
    """The prediction's sentences (engine/lab/kv_replay.configured_lines) from the tab's plain arrays."""
    from engine.lab.kv_replay import Calibrated, Rerun, configured_lines

    runs = [Rerun(int(c), float(h), 0, float(q), float(d), 0, 0.0)
            for c, h, q, d in zip(p.capacities, p.hit_rate, p.prefix_rate, p.device_rate)]
    cal = Calibrated(p.recorded_capacity, p.measured, {k: 0.0 for k in Calibrated.RATES}, runs)
    return configured_lines(cal, p.knobs, current, block_mib)


def what_if_results(source, groups: list[tuple[int, float | None, str]], demote_after_s: float | None = None,
                    decay: float = 0.9) -> list[WhatIfResult]:
    """One WhatIfResult per KV-cache group the trace read. groups: per live group (device-tier blocks, MiB a
    block, title); a trace's group the live engine does not have is read at group 0's capacity."""
    loaded = _load(source)
    trace = loaded[0]
    present = groups_of(trace) if trace is not None else [0]
    out = []
    for g in present:
        blocks, mib, title = groups[g] if g < len(groups) else (groups[0][0], groups[0][1], f"group {g}")
        out.append(what_if_result(source, blocks, mib, demote_after_s, decay, g,
                                  title if len(present) > 1 or g else "", _loaded=loaded))
    return out


class WhatIfService:
    def __init__(self, runner):
        self.runner = runner
        self._mine = False  # the recording running is the tab's

    def current(self) -> tuple[int, float, float, float]:
        """(device-tier blocks, MiB a block, demote_after_s, decay) of the live config (the first KV-cache group)."""
        eng = self.runner.engine
        pool, cfg = eng.pool, eng.config
        return int(pool.sizes.dev_cap), pool.block_bytes / 2**20, float(cfg.demote_after_s), float(cfg.decay)

    def groups(self) -> list[tuple[int, float, str]]:
        """Per KV-cache group of the live engine: (device-tier blocks, MiB a block, title)."""
        eng = self.runner.engine
        titles = eng.kv.titles or [""]  # one pool of every layer: no group to name
        return [(int(p.sizes.dev_cap), p.block_bytes / 2**20, t) for p, t in zip(eng.kv.pools, titles)]

    def record(self) -> str | None:
        """Start recording; an error message instead if a trace is being recorded already (from Controls)."""
        if self.runner.recording:
            return "a trace is being recorded already (Controls: Record trace); stop it first"
        self.runner.engine.start_trace()
        self._mine = True
        return None

    def take(self):
        """Stop the tab's recording and return the trace (not saved); None if the tab was not recording."""
        if not self._mine:
            return None
        self._mine = False
        return self.runner.engine.stop_trace(None)

    def compute(self, source, done) -> None:
        """done(a list of WhatIfResult, one per KV-cache group the trace read; or an error message), called on
        the worker thread."""
        _, _, demote, decay = self.current()
        groups = self.groups()

        def work():
            try:
                done(what_if_results(source, groups, demote, decay))
            except (ValueError, OSError) as e:  # a bad file: TraceFileError, a bad JSONL line; refused in one line
                done(str(e))

        threading.Thread(target=work, name="kvscope-what-if", daemon=True).start()
