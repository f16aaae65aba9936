"""The schema of a snapshot file's document: which fields a snapshot has, their dtypes, and the values the
window draws or divides by.

Checks every field's JSON type, each array's dtype and length (per tier: its capacity; per sequence table:
one row per sequence), and the values (tier ids, states, fills within the block size, non-negative counts,
finite floats, knobs within their ranges), using the field checkers of engine/telemetry/snapshot_fields.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from engine.config import KNOBS, CacheConfig, KVDtype
from engine.sequence import SeqState
from engine.telemetry.snapshot import SeqTable, Snapshot, TierSnapshot
from engine.telemetry.snapshot_fields import (_array, _Bad, _bool, _clip, _floats, _int, _ints, _list, _num, _obj, _plain,
                                    _rest, _str)
from engine.telemetry.counters import Counters
from engine.telemetry.health import HealthTargets
from engine.telemetry.snapshotter import MARK_KINDS

MAX_BLOCKS = 1 << 26  # slots per tier
MAX_SEQS = 100_000  # rows of the sequence table
MAX_POINTS = 1 << 20  # points of one time series or residency histogram
MAX_MARKS = 100_000
TIER_NAMES = ("device", "host")
# The block map's colour modes (ui.block_map.widget.MODES; engine/ may not import ui/, a test keeps them equal).
COLOUR_MODES = ("state", "owner", "heat", "ref", "fill", "age", "kv error")

# The dtypes the writer produces, per field (dtype.str: byte order, kind, item size).
TIER_DTYPES = {"state": "|u1", "owner": "<i4", "ref": "<i4", "fill": "<i4", "heat": "<f4", "age": "<f4",
               "hashed": "|b1"}
TIER_OPTIONAL = {"kerr": "<f4", "verr": "<f4"}  # files from before the K/V error existed have none: no data
# A block's history (engine/kv/misses.py): files from before reasons have none (None: no data). (dtype, lo, hi)
TIER_HISTORY = {"why": ("|i1", 0, 3), "stores": ("<i4", 0, None), "gone_age": ("<f4", None, None),
                "gone_by": ("|i1", 0, 2)}
WHY_REASONS_MAX = 16  # reasons a sequence's why_missed may name (engine/kv/misses.py has 10)
SEQ_DTYPES = {"id": "<i4", "state": "|i1", "tokens": "<i4", "generated": "<i4", "blocks_device": "<i4",
              "blocks_host": "<i4", "tokens_per_s": "<f4", "ttft": "<f4", "prefix_reused": "<i4"}
TABLE_DTYPES = {"block_tier": "|i1", "block_slot": "<i8"}
SERIES_DTYPE = "<f8"
RESIDENCY_DTYPE = "<f4"

SNAPSHOT_KEYS = ("t", "model", "config", "tiers", "seqs", "counters", "windowed", "memory", "series", "residency")
SNAPSHOT_OPTIONAL = ("timing", "marks", "quality", "last_change", "kv_groups", "health", "self_checks", "what_if")  # files from before marks (quality, the last
# change's counters) existed have none
# Knobs added after snapshot files were first written: a file without one shows the default.
LATER_KNOBS = ("shadow_every_s",)
MAX_OUTLIERS = 1000


def _snapshot(body: Any) -> Snapshot:
    _obj(body, "snapshot")
    body = _obj(body, "", SNAPSHOT_KEYS, SNAPSHOT_OPTIONAL, closed=True)  # fields named bare: t, tiers[0].heat
    t = _num(body["t"], "t")
    model = _model(body["model"])
    config = _config(body["config"])
    tiers = _tiers(body["tiers"], config["block_size"])
    seqs = _seqs(body["seqs"], tuple(tier.capacity for tier in tiers))
    counters = _counters(body["counters"])
    windowed = _obj(body["windowed"], "windowed", ("tokens_per_s",))
    windowed = {k: _num(v, f"windowed.{_clip(k, 40)}", nan_ok=True) for k, v in windowed.items()}  # NaN: no data
    memory = _memory(body["memory"])
    series = _series(body["series"])
    residency = _residency(body["residency"])
    timing = _obj(body.get("timing", {}), "timing")
    timing = {k: _num(v, f"timing.{_clip(k, 40)}", nan_ok=True) for k, v in timing.items()}
    marks = _marks(body.get("marks", []))
    quality = _quality(body.get("quality", {}), model)
    last_change = _last_change(body.get("last_change", {}))
    kv_groups = _kv_groups(body.get("kv_groups", []), tiers, config["block_size"], model)
    health = _health(body.get("health", {}))
    self_checks = _self_checks(body.get("self_checks", {}))
    what_if = _what_if(body.get("what_if", {}))
    return Snapshot(t=t, model=model, config=config, tiers=tiers, seqs=seqs, counters=counters, windowed=windowed,
                    memory=memory, series=series, residency=residency, timing=timing, marks=marks, quality=quality,
                    last_change=last_change, kv_groups=kv_groups, health=health, self_checks=self_checks,
                    what_if=what_if)


MAX_WHAT_IF_GROUPS = 128  # KV-cache groups (a trace's group column is 0 .. 127)
MAX_WHAT_IF_CURVES = 16
MAX_WHAT_IF_LINES = 64


def _what_if(x: Any) -> dict:
    """Snapshot.what_if (the window's what-if curves, app/whatif/worker.py WhatIfResult.saved), {} in files from
    before it: per group its curves, each capacities (int64, >= 1 block, ascending) and hit rates (float64 in
    [0, 1], NaN: no data) of one length. Fields the compare window does not read are kept as free-form JSON."""
    w = _obj(x, "what_if")
    if not w:
        return {}
    _obj(w, "what_if", ("source", "groups"))
    out = _rest(w, "what_if", ("source", "groups"))
    out["source"] = _str(w["source"], "what_if.source")
    groups = []
    for i, g in enumerate(_list(w["groups"], "what_if.groups", max_n=MAX_WHAT_IF_GROUPS)):
        where = f"what_if.groups[{i}]"
        known = ("group", "title", "current_blocks", "block_mib", "accesses", "counted", "distinct", "curves", "lines")
        _obj(g, where, ("group", "current_blocks", "curves"))
        one = _rest(g, where, known)
        one["group"] = _int(g["group"], f"{where}.group", 0, MAX_WHAT_IF_GROUPS - 1)
        one["title"] = _str(g.get("title", ""), f"{where}.title")
        one["current_blocks"] = _int(g["current_blocks"], f"{where}.current_blocks", 0)
        mib = g.get("block_mib")
        one["block_mib"] = None if mib is None else _num(mib, f"{where}.block_mib", 0.0)
        for k in ("accesses", "counted", "distinct"):
            one[k] = _int(g.get(k, 0), f"{where}.{k}", 0)
        curves = []
        for j, c in enumerate(_list(g["curves"], f"{where}.curves", max_n=MAX_WHAT_IF_CURVES)):
            cw = f"{where}.curves[{j}]"
            _obj(c, cw, ("policy", "capacities", "hit_rate"))
            caps = _array(c["capacities"], f"{cw}.capacities", "<i8", max_len=MAX_POINTS)
            _ints(caps, f"{cw}.capacities", 1)
            if caps.size > 1 and (np.diff(caps) <= 0).any():
                raise _Bad(f"{cw}.capacities", "not ascending")
            hit = _array(c["hit_rate"], f"{cw}.hit_rate", "<f8", max_len=MAX_POINTS)
            if len(hit) != len(caps):
                raise _Bad(f"{cw}.hit_rate", f"{len(hit):,} points, expected {len(caps):,} (as capacities)")
            _floats(hit, f"{cw}.hit_rate", 0.0, nan_ok=True)
            if hit.size and float(np.fmax.reduce(hit)) > 1.0:
                raise _Bad(f"{cw}.hit_rate", f"holds {float(np.fmax.reduce(hit)):g}, above 1 (a rate)")
            curves.append({"policy": _str(c["policy"], f"{cw}.policy"), "exact": _bool(c.get("exact", False),
                                                                                     f"{cw}.exact"),
                           "capacities": caps, "hit_rate": hit})
        one["curves"] = curves
        one["lines"] = [_str(v, f"{where}.lines[{k}]")
                        for k, v in enumerate(_list(g.get("lines", []), f"{where}.lines", max_n=MAX_WHAT_IF_LINES))]
        groups.append(one)
    out["groups"] = groups
    return out


def _health(x: Any) -> dict:
    """Snapshot.health (engine/telemetry/health.py Health.summary), {} in files from before it: free-form JSON whose
    figures the window draws are checked: the three targets' values (shares; NaN: no data) and the lock-wait
    histograms."""
    h = _plain(_obj(x, "health"), "health")
    for name, hi in (("prefix_hit_rate", 1.0), ("block_utilization", 1.0), ("eviction_rate", None)):
        if name not in h:
            continue
        fig = _obj(h[name], f"health.{name}")
        for k in ("w", "all"):
            if k in fig:
                _num(fig[k], f"health.{name}.{k}", 0.0, hi, nan_ok=True)
    lw = h.get("lock_wait")
    if lw is not None:
        for who in ("step", "snapshot"):
            if who in _obj(lw, "health.lock_wait"):
                hist = _obj(lw[who], f"health.lock_wait.{who}").get("hist", [])
                for i, v in enumerate(_list(hist, f"health.lock_wait.{who}.hist", max_n=64)):
                    _int(v, f"health.lock_wait.{who}.hist[{i}]", 0)
    return h


MAX_GROUPS = 64
GROUP_KEYS = ("title", "layers", "window", "device_budget_mb", "host_budget_mb", "read_tokens", "read_tokens_missed",
              "read_tokens_streamed", "tiers")  # and, optional, why_missed


def _kv_groups(x: Any, tiers: tuple[TierSnapshot, ...], block_size: int, model: dict) -> tuple[dict, ...]:
    """Snapshot.kv_groups: [] in files with one pool or from before groups; the first group's tiers are written
    null (they are the snapshot's own `tiers`)."""
    out = []
    layers = model.get("layers", 1 << 20)
    for i, g in enumerate(_list(x, "kv_groups", max_n=MAX_GROUPS)):
        where = f"kv_groups[{i}]"
        g = _obj(g, where, GROUP_KEYS, ("why_missed",), closed=True)
        entry = {"title": _str(g["title"], f"{where}.title"),
                 "layers": [_int(v, f"{where}.layers[{j}]", 0, layers - 1)
                            for j, v in enumerate(_list(g["layers"], f"{where}.layers", max_n=layers))],
                 "window": None if g["window"] is None else _int(g["window"], f"{where}.window", 1, 1 << 40)}
        for k in ("device_budget_mb", "host_budget_mb"):
            entry[k] = _num(g[k], f"{where}.{k}", 0.0)
        for k in ("read_tokens", "read_tokens_missed", "read_tokens_streamed"):
            entry[k] = _int(g[k], f"{where}.{k}", 0)
        entry["why_missed"] = _reasons(g.get("why_missed", {}), f"{where}.why_missed")  # {} in files from before it
        if i == 0:
            if g["tiers"] is not None:
                raise _Bad(f"{where}.tiers", "expected null: the first group's tiers are the snapshot's tiers")
            entry["tiers"] = tiers
        else:
            entry["tiers"] = _tiers(g["tiers"], block_size, f"{where}.tiers")
        out.append(entry)
    return tuple(out)


def _model(x: Any) -> dict:
    m = _obj(x, "model", ("name", "device", "layers", "kv_heads", "head_dim"))
    out = _rest(m, "model", ("name", "device", "architecture", "layers", "heads", "kv_heads", "head_dim",
                             "context_limit", "weights"))
    for k in ("name", "device", "architecture", "weights"):
        if k in m:
            out[k] = _str(m[k], f"model.{k}")
    for k in ("layers", "heads", "kv_heads", "head_dim", "context_limit"):
        if k in m:
            out[k] = _int(m[k], f"model.{k}", 1, 1 << 24)
    return out


def _config(x: Any) -> dict:
    c = _obj(x, "config", tuple(k for k in KNOBS if k not in LATER_KNOBS), LATER_KNOBS, closed=True)
    out = {}
    for name, knob in KNOBS.items():
        if name not in c:
            out[name] = getattr(CacheConfig(), name)
            continue
        v, where = c[name], f"config.{name}"
        if knob.kind is KVDtype or knob.kind is str:
            out[name] = _str(v, where, knob.choices)
        elif knob.kind is int:
            out[name] = _int(v, where, int(knob.lo), int(knob.hi))
        else:
            out[name] = _num(v, where, knob.lo, knob.hi)
    return out


def _tiers(x: Any, block_size: int, at: str = "tiers") -> tuple[TierSnapshot, ...]:
    out = []
    for i, t in enumerate(_list(x, at, len(TIER_NAMES))):
        where = f"{at}[{i}]"
        t = _obj(t, where, ("name", "capacity", "block_bytes", *TIER_DTYPES), (*TIER_OPTIONAL, *TIER_HISTORY),
                 closed=True)
        name = _str(t["name"], f"{where}.name", (TIER_NAMES[i],))
        cap = _int(t["capacity"], f"{where}.capacity", 0, MAX_BLOCKS)
        block_bytes = _int(t["block_bytes"], f"{where}.block_bytes", 0, 1 << 40)
        arrays = {}
        for field, dt in TIER_DTYPES.items():
            a = _array(t[field], f"{where}.{field}", dt, max_len=MAX_BLOCKS)
            if len(a) != cap:
                raise _Bad(f"{where}.{field}", f"{len(a):,} values, expected {cap:,} (the tier's capacity)")
            arrays[field] = a
        _ints(arrays["state"], f"{where}.state", 0, 2, " (0 free, 1 cached, 2 in use)")
        _ints(arrays["owner"], f"{where}.owner", -1, None, " (-1: no owner)")
        _ints(arrays["ref"], f"{where}.ref", 0)
        _ints(arrays["fill"], f"{where}.fill", 0, block_size, " (the block size)")
        _floats(arrays["heat"], f"{where}.heat", lo=0.0)
        _floats(arrays["age"], f"{where}.age")
        for field, dt in TIER_OPTIONAL.items():
            if t.get(field) is None:  # absent (an older file) or null: not measured
                arrays[field] = np.full(cap, np.nan, np.float32)
                continue
            a = _array(t[field], f"{where}.{field}", dt, max_len=MAX_BLOCKS)
            if len(a) != cap:
                raise _Bad(f"{where}.{field}", f"{len(a):,} values, expected {cap:,} (the tier's capacity)")
            _floats(a, f"{where}.{field}", lo=0.0, nan_ok=True)  # NaN: not measured
            arrays[field] = a
        for field, (dt, lo, hi) in TIER_HISTORY.items():
            if t.get(field) is None:
                continue
            a = _array(t[field], f"{where}.{field}", dt, max_len=MAX_BLOCKS)
            if len(a) != cap:
                raise _Bad(f"{where}.{field}", f"{len(a):,} values, expected {cap:,} (the tier's capacity)")
            if a.dtype.kind == "f":
                _floats(a, f"{where}.{field}", nan_ok=True)
            else:
                _ints(a, f"{where}.{field}", lo, hi)
            arrays[field] = a
        out.append(TierSnapshot(name=name, capacity=cap, block_bytes=block_bytes, **arrays))
    return tuple(out)


def _seqs(x: Any, capacities: tuple[int, ...]) -> SeqTable:
    names = tuple(f.name for f in dataclasses.fields(SeqTable) if f.name != "why_missed")
    s = _obj(x, "seqs", names, ("why_missed",), closed=True)
    cols = {}
    n = None
    for field, dt in SEQ_DTYPES.items():
        a = _array(s[field], f"seqs.{field}", dt, max_len=MAX_SEQS)
        if n is None:
            n = len(a)
        elif len(a) != n:
            raise _Bad(f"seqs.{field}", f"{len(a):,} values, expected {n:,} (one per sequence, as seqs.id)")
        cols[field] = a
    _ints(cols["id"], "seqs.id", 0)
    _ints(cols["state"], "seqs.state", min(SeqState), max(SeqState), " (a sequence state)")
    for field in ("tokens", "generated", "blocks_device", "blocks_host", "prefix_reused"):
        _ints(cols[field], f"seqs.{field}", 0)
    _floats(cols["tokens_per_s"], "seqs.tokens_per_s", lo=0.0)
    _floats(cols["ttft"], "seqs.ttft", nan_ok=True)  # NaN until the first token
    labels = tuple(_str(v, f"seqs.labels[{i}]") for i, v in enumerate(_list(s["labels"], "seqs.labels", n)))
    tables = {}
    for field, dt in TABLE_DTYPES.items():
        lst = _list(s[field], f"seqs.{field}", n)
        tables[field] = tuple(_array(v, f"seqs.{field}[{i}]", dt, max_len=MAX_BLOCKS) for i, v in enumerate(lst))
    for i, (tier, slot) in enumerate(zip(tables["block_tier"], tables["block_slot"])):
        if len(tier) != len(slot):
            raise _Bad(f"seqs.block_slot[{i}]", f"{len(slot):,} values, expected {len(tier):,} (as block_tier[{i}])")
        _ints(tier, f"seqs.block_tier[{i}]", 0, len(capacities) - 1, " (tier ids: 0 device, 1 host)")
        for k, cap in enumerate(capacities):
            _ints(slot[tier == k], f"seqs.block_slot[{i}]", 0, cap - 1, f" (slots of tier {k}: its capacity - 1)")
    why = ()
    if s.get("why_missed") is not None:
        why = tuple(_reasons(v, f"seqs.why_missed[{i}]") for i, v in enumerate(_list(s["why_missed"], "seqs.why_missed",
                                                                                     n)))
    return SeqTable(**cols, labels=labels, **tables, why_missed=why)


def _reasons(x: Any, where: str) -> dict:
    """A sequence's why_missed: reason -> tokens, at most WHY_REASONS_MAX reasons."""
    d = _obj(x, where)
    if len(d) > WHY_REASONS_MAX:
        raise _Bad(where, f"{len(d):,} reasons, more than {WHY_REASONS_MAX}")
    return {_clip(k, 40): _int(v, f"{where}.{_clip(k, 40)}", 0) for k, v in d.items()}


def _counters(x: Any) -> dict:
    c = _obj(x, "counters", ("device_hit_rate", "prefix_hit_rate"))
    ints = {f.name for f in dataclasses.fields(Counters) if f.type in ("int", int)}
    out = {}
    for k, v in c.items():
        where = f"counters.{_clip(k, 40)}"
        if k in ints:
            out[k] = _int(v, where, 0)
        elif k in ("device_hit_rate", "prefix_hit_rate"):
            out[k] = _num(v, where, 0.0, 1.0, nan_ok=True)  # NaN: nothing counted yet
        else:
            out[k] = _num(v, where, nan_ok=True)  # ttft_p50 is NaN before any first token
    return out


def _memory(x: Any) -> dict:
    m = _obj(x, "memory", ("tiers", "block_bytes", "rss_bytes", "system_total_bytes", "system_used_bytes", "gpu"))
    out = _rest(m, "memory", ("tiers", "block_bytes", "rss_bytes", "system_total_bytes", "system_used_bytes", "gpu"))
    for k in ("block_bytes", "rss_bytes", "system_total_bytes", "system_used_bytes"):
        out[k] = _num(m[k], f"memory.{k}", lo=0)
    if "stream_staging_bytes" in m:  # read by the memory panel; older snapshots have none
        out["stream_staging_bytes"] = _num(m["stream_staging_bytes"], "memory.stream_staging_bytes", lo=0)
    tiers = _obj(m["tiers"], "memory.tiers", TIER_NAMES)
    out["tiers"] = _rest(tiers, "memory.tiers", TIER_NAMES)
    nums = ("k_bytes", "v_bytes", "scale_bytes", "metadata_bytes", "capacity_bytes", "capacity_blocks", "used_blocks")
    for name in TIER_NAMES:
        where = f"memory.tiers.{name}"
        t = _obj(tiers[name], where, (*nums, "device"))  # what the memory panel reads
        d = _rest(t, where, (*nums, "used_bytes", "device", "pinned"))
        for k in (*nums, "used_bytes"):
            if k in t:
                d[k] = _num(t[k], f"{where}.{k}", lo=0)
        d["device"] = _str(t["device"], f"{where}.device")
        if "pinned" in t:
            d["pinned"] = _bool(t["pinned"], f"{where}.pinned")
        out["tiers"][name] = d
    gpu = _obj(m["gpu"], "memory.gpu", ("available",))
    g = _rest(gpu, "memory.gpu", ("available", "reason", "name", "nvml_error", "torch_allocated_bytes",
                                  "torch_reserved_bytes", "nvml_used_bytes", "nvml_total_bytes"))
    g["available"] = _bool(gpu["available"], "memory.gpu.available")
    if g["available"]:
        _obj(gpu, "memory.gpu", ("torch_allocated_bytes", "torch_reserved_bytes"))
    for k in ("reason", "name", "nvml_error"):
        if k in gpu:
            g[k] = _str(gpu[k], f"memory.gpu.{k}")
    for k in ("torch_allocated_bytes", "torch_reserved_bytes", "nvml_used_bytes", "nvml_total_bytes"):
        if k in gpu:
            g[k] = _num(gpu[k], f"memory.gpu.{k}", lo=0)
    out["gpu"] = g
    return out


def _series(x: Any) -> dict:
    s = _obj(x, "series", ("t",) if x else ())
    out = {}
    for k, v in s.items():
        where = f"series.{_clip(k, 40)}"
        _str(k, where)
        a = _array(v, where, SERIES_DTYPE, max_len=MAX_POINTS)
        if out and len(a) != len(next(iter(out.values()))):
            first = next(iter(out))
            raise _Bad(where, f"{len(a):,} points, expected {len(out[first]):,} (as series.{_clip(first, 40)})")
        _floats(a, where, nan_ok=(k != "t"))  # NaN where a reading was unavailable (NVML on a CPU run)
        out[k] = a
    return out


def _residency(x: Any) -> dict:
    r = _obj(x, "residency")
    out = {}
    for k, v in r.items():
        where = f"residency.{_clip(k, 40)}"
        _str(k, where)
        a = _array(v, where, RESIDENCY_DTYPE, max_len=MAX_POINTS)
        _floats(a, where, nan_ok=True)  # the histograms skip NaN; infinities they cannot place
        out[k] = a
    return out


def _marks(x: Any) -> tuple:
    out = []
    for i, m in enumerate(_list(x, "marks", max_n=MAX_MARKS)):
        where = f"marks[{i}]"
        t, kind, label = _list(m, where, 3)
        out.append((float(_num(t, f"{where}[0]")), _str(kind, f"{where}[1]", MARK_KINDS), _str(label, f"{where}[2]")))
    return tuple(out)


SELF_CHECK_FEATURES = ("attention", "graphs", "migration", "stream")
SELF_CHECK_STATES = ("passed", "failed", "not run")


def _self_checks(x: Any) -> dict:
    """Snapshot.self_checks (engine/runtime/self_check.py): per feature its state and the deciding verdict."""
    out = {}
    for f, v in _obj(x, "self_checks").items():
        where = f"self_checks.{_clip(str(f), 40)}"
        _str(f, "self_checks", SELF_CHECK_FEATURES)
        v = _obj(v, where, ("state", "checks"), ("path", "detail", "fallback", "seconds", "message"), closed=True)
        d = {"state": _str(v["state"], f"{where}.state", SELF_CHECK_STATES), "checks": _int(v["checks"], f"{where}.checks", 0)}
        for k in ("path", "detail", "message"):
            if k in v:
                d[k] = _str(v[k], f"{where}.{k}")
        if "fallback" in v:
            d["fallback"] = None if v["fallback"] is None else _str(v["fallback"], f"{where}.fallback")
        if "seconds" in v:
            d["seconds"] = float(_num(v["seconds"], f"{where}.seconds", 0))
        out[f] = d
    return out


def _last_change(x: Any) -> dict:
    """The last config change and the counters at it (Snapshot.last_change); {} where there was none."""
    lc = _obj(x, "last_change")
    if not lc:
        return {}
    lc = _obj(lc, "last_change", ("t", "n", "changes", "counters"), ("before", "lossy"), closed=True)
    out = {"t": float(_num(lc["t"], "last_change.t")), "n": _int(lc["n"], "last_change.n", 1),
           "lossy": _bool(lc.get("lossy", False), "last_change.lossy")}
    for k in ("changes", "before"):
        d = _obj(lc.get(k, {}), f"last_change.{k}")
        out[k] = {_str(name, f"last_change.{k}"): _str(v, f"last_change.{k}.{_clip(name, 40)}") for name, v in d.items()}
    ints = {f.name for f in dataclasses.fields(Counters) if f.type in ("int", int)}
    counters = {}
    for k, v in _obj(lc["counters"], "last_change.counters").items():
        where = f"last_change.counters.{_clip(k, 40)}"
        counters[k] = _int(v, where, 0) if k in ints else _num(v, where)
    out["counters"] = counters
    return out


MAX_EVENTS = 100_000


def _extra(x: Any) -> dict:
    e = _plain(_obj(x, "extra"), "extra")
    for k in ("caption", "png"):
        if k in e:
            _str(e[k], f"extra.{k}")
    if "workload" in e:
        _str(e["workload"], "extra.workload")
    if "tabs" in e:  # the window's tabbed docks in front, by name
        for i, name in enumerate(_list(e["tabs"], "extra.tabs", max_n=16)):
            _str(name, f"extra.tabs[{i}]")
    if "rates" in e:  # the rates' lines the window drew (ui/charts/rates.py SavedRates): float64 series, one length
        r = e["rates"]
        if not isinstance(r, dict) or not isinstance(r.get("t"), np.ndarray):
            raise _Bad("extra.rates", "expected an object of time series (arrays), t among them")
        for k, a in r.items():
            if not isinstance(a, np.ndarray) or a.dtype != np.float64 or a.ndim != 1:
                raise _Bad(f"extra.rates.{_clip(k, 40)}", "expected a 1-D array of float64")
            if len(a) != len(r["t"]):
                raise _Bad(f"extra.rates.{_clip(k, 40)}", f"{len(a):,} points, expected {len(r['t']):,} (as extra.rates.t)")
            _floats(a, f"extra.rates.{_clip(k, 40)}", nan_ok=(k != "t"))  # NaN: no data (a gap in the line)
    if "health_targets" in e:  # the health strip's targets when it was saved (engine/telemetry/health.py)
        try:
            HealthTargets.from_dict(_obj(e["health_targets"], "extra.health_targets"))
        except ValueError as why:
            raise _Bad("extra.health_targets", str(why)) from None
    if "colour_mode" in e:
        _str(e["colour_mode"], "extra.colour_mode", COLOUR_MODES)
    if "selected" in e:
        _int(e["selected"], "extra.selected", -1)
    if "events" in e:  # the window's Events panel: [time, kind, text] lines
        ev = e["events"]
        if not isinstance(ev, list) or len(ev) > MAX_EVENTS:
            raise _Bad("extra.events", f"expected a list of at most {MAX_EVENTS} [time, kind, text] lines")
        for i, line in enumerate(ev):
            if not isinstance(line, list) or len(line) != 3:
                raise _Bad(f"extra.events[{i}]", "expected [time, kind, text]")
            _num(line[0], f"extra.events[{i}][0]")
            _str(line[1], f"extra.events[{i}][1]")
            _str(line[2], f"extra.events[{i}][2]")
    return e


def _quality(x: Any, model: dict) -> dict:
    """What the KV format costs (engine/telemetry/snapshot.py Snapshot.quality); unknown keys kept as free-form JSON."""
    q = _obj(x, "quality")
    known = ("kv_dtype", "lossless", "keys_seen", "key_outliers", "shadow_every_s", "shadow")
    out = _rest(q, "quality", known)
    if "kv_dtype" in q:
        out["kv_dtype"] = _str(q["kv_dtype"], "quality.kv_dtype", KNOBS["kv_dtype"].choices)
    if "lossless" in q:
        out["lossless"] = _bool(q["lossless"], "quality.lossless")
    if "keys_seen" in q:
        out["keys_seen"] = _int(q["keys_seen"], "quality.keys_seen", 0)
    if "shadow_every_s" in q:
        out["shadow_every_s"] = _num(q["shadow_every_s"], "quality.shadow_every_s", 0.0)
    dims = [model.get(k, 1 << 24) - 1 for k in ("layers", "kv_heads", "head_dim")]
    rows = []
    for i, row in enumerate(_list(q.get("key_outliers", []), "quality.key_outliers", max_n=MAX_OUTLIERS)):
        where = f"quality.key_outliers[{i}]"
        lyr, head, ch, amax, ratio = _list(row, where, 5)
        rows.append([_int(lyr, f"{where}[0]", 0, dims[0]), _int(head, f"{where}[1]", 0, dims[1]),
                     _int(ch, f"{where}[2]", 0, dims[2]), _num(amax, f"{where}[3]", 0.0), _num(ratio, f"{where}[4]", 0.0)])
    out["key_outliers"] = rows
    sh = _obj(q.get("shadow", {}), "quality.shadow")
    out["shadow"] = {k: (_str(v, f"quality.shadow.{_clip(k, 40)}") if isinstance(v, str)
                         else _num(v, f"quality.shadow.{_clip(k, 40)}", nan_ok=True)) for k, v in sh.items()}
    return out
