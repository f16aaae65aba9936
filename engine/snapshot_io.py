"""Snapshots to and from JSON, so a screenshot can travel with the data behind it.

Arrays are stored exactly (dtype, shape, base64 of the raw little-endian bytes); everything else is plain
JSON. Torch-free: the window imports this.

Reading checks a file against the schema the writer produces before anything is drawn: its size (capped,
checked before reading), JSON nesting depth, the format and version, every field's JSON type, each
array's dtype (the writer's only), shape (capped before any base64 is decoded) and length (per tier: its
capacity; per sequence table: one row per sequence), and the values the window draws or divides by (tier
ids, states, fills within the block size, non-negative counts, finite floats, knobs within their ranges).
Any problem is a SnapshotFileError naming the file and the field. Memory stays within about twice the
file's size: the text is decoded once, and each array's base64 is dropped as soon as it is decoded (the
arrays are read-only views of the decoded bytes, not copies).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
import os
import stat
from typing import Any

import numpy as np

from engine.config import KNOBS, KVDtype
from engine.sequence import SeqState
from engine.telemetry import MARK_KINDS, Counters, SeqTable, Snapshot, TierSnapshot

FORMAT = "kvscope-snapshot"
VERSION = 1

MAX_FILE_BYTES = 256 * 2**20  # larger files are refused before they are read
MAX_ARRAY_BYTES = MAX_FILE_BYTES  # one array's decoded bytes (base64 makes 4 characters of 3 bytes)
MAX_DEPTH = 32  # nesting of free-form JSON (extra, unknown keys); the parser's own limit is the stack's
MAX_BLOCKS = 1 << 26  # slots per tier
MAX_SEQS = 100_000  # rows of the sequence table
MAX_POINTS = 1 << 20  # points of one time series or residency histogram
MAX_MARKS = 100_000
MAX_TEXT = 64 * 1024  # characters of a label, a name, a caption
MAX_DIM = 32  # dimensions of an array
TIER_NAMES = ("device", "host")
# The block map's colour modes (ui.block_map.MODES; engine/ may not import ui/, a test keeps them equal).
COLOUR_MODES = ("state", "owner", "heat", "ref", "fill", "age")

# The dtypes the writer produces, per field (dtype.str: byte order, kind, item size).
TIER_DTYPES = {"state": "|u1", "owner": "<i4", "ref": "<i4", "fill": "<i4", "heat": "<f4", "age": "<f4",
               "hashed": "|b1"}
SEQ_DTYPES = {"id": "<i4", "state": "|i1", "tokens": "<i4", "generated": "<i4", "blocks_device": "<i4",
              "blocks_host": "<i4", "tokens_per_s": "<f4", "ttft": "<f4", "prefix_reused": "<i4"}
TABLE_DTYPES = {"block_tier": "|i1", "block_slot": "<i8"}
SERIES_DTYPE = "<f8"
RESIDENCY_DTYPE = "<f4"
ANY_DTYPES = ("|u1", "|i1", "<i4", "<i8", "<f4", "<f8", "|b1")  # arrays in free-form places
SPECIAL_FLOATS = ("nan", "inf", "-inf")  # how the writer stores a non-finite float: {"__float__": repr(f)}


class SnapshotFileError(ValueError):
    """A snapshot file that cannot be read; the message names the file and the problem."""


class _Bad(Exception):
    """A field that breaks the schema: where (a path like tiers[0].heat) and what is wrong."""

    def __init__(self, where: str, what: str):
        super().__init__(f"{where}: {what}" if where else what)


def _enc(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        a = np.ascontiguousarray(x)
        return {"__nd__": a.dtype.str, "shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode("ascii")}
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        f = float(x)
        return f if math.isfinite(f) else {"__float__": repr(f)}
    if isinstance(x, (np.bool_,)):
        return bool(x)
    if isinstance(x, dict):
        return {str(k): _enc(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_enc(v) for v in x]
    return x


def to_json(snap: Snapshot, extra: dict | None = None) -> str:
    body = {f.name: getattr(snap, f.name) for f in dataclasses.fields(snap)}
    body["tiers"] = [{f.name: getattr(t, f.name) for f in dataclasses.fields(t)} for t in snap.tiers]
    body["seqs"] = {f.name: getattr(snap.seqs, f.name) for f in dataclasses.fields(snap.seqs)}
    doc = {"format": FORMAT, "version": VERSION, "snapshot": _enc(body), "extra": _enc(extra or {})}
    return json.dumps(doc)


# -- reading ------------------------------------------------------------------------------------------
def save(path: str, snap: Snapshot, extra: dict | None = None) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(to_json(snap, extra))


def load(path: str) -> tuple[Snapshot, dict]:
    """Read and check a snapshot file; SnapshotFileError (one line: the file and what is wrong) if it is not
    one this version wrote intact."""
    return _from_doc(_parse(_read_text(path), path), path)


def from_json(text: str, source: str = "<snapshot>") -> tuple[Snapshot, dict]:
    return _from_doc(_parse(text, source), source)


def _mb(n: int) -> str:
    return f"{n / 2**20:,.0f} MB" if n >= 2**20 else f"{n:,} bytes"


def _read_text(path: str) -> str:
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block in open, a device never end
            raise SnapshotFileError(f"{path}: not a regular file")
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise SnapshotFileError(f"{path}: not a regular file")
            if st.st_size > MAX_FILE_BYTES:
                raise SnapshotFileError(f"{path}: the file is {_mb(st.st_size)}, more than the "
                                        f"{_mb(MAX_FILE_BYTES)} a snapshot file may be")
            data = f.read(MAX_FILE_BYTES + 1)  # bounded even if the file grows meanwhile
    except OSError as e:
        raise SnapshotFileError(f"{path}: {e.strerror or e}") from None
    if len(data) > MAX_FILE_BYTES:
        raise SnapshotFileError(f"{path}: the file grew past the {_mb(MAX_FILE_BYTES)} a snapshot file may be")
    if not data or data.isspace():  # (strip() would copy the whole text)
        raise SnapshotFileError(f"{path}: the file is empty")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SnapshotFileError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def _parse(text: str, source: str) -> dict:
    if len(text) > MAX_FILE_BYTES:
        raise SnapshotFileError(f"{source}: {_mb(len(text))} of text, more than the {_mb(MAX_FILE_BYTES)} a "
                                f"snapshot file may be")
    if not text or text.isspace():
        raise SnapshotFileError(f"{source}: the file is empty")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        # An unterminated string or an error at the very end: the text stops mid-document.
        if e.msg.startswith("Unterminated string") or (len(text) - e.pos < 4096 and not text[e.pos:].strip()):
            raise SnapshotFileError(f"{source}: not JSON: the text ends early, in the middle of the document "
                                    f"(a truncated file?)") from None
        raise SnapshotFileError(f"{source}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise SnapshotFileError(f"{source}: not a KV Scope snapshot (JSON nested too deeply)") from None
    except ValueError as e:  # e.g. an integer literal with more digits than Python converts
        raise SnapshotFileError(f"{source}: not JSON ({_clip(str(e))})") from None
    if not isinstance(doc, dict) or "format" not in doc:
        raise SnapshotFileError(f"{source}: not a KV Scope snapshot (no \"format\": \"{FORMAT}\")")
    if doc["format"] != FORMAT:
        raise SnapshotFileError(f"{source}: not a KV Scope snapshot (its \"format\" is {_clip(repr(doc['format']))}, "
                                f"not \"{FORMAT}\")")
    version = doc.get("version")
    if type(version) is not int or version != VERSION:
        raise SnapshotFileError(f"{source}: snapshot version {_clip(repr(version))} is not {VERSION} (a file "
                                f"from another version of KV Scope, or damaged)")
    return doc


def _from_doc(doc: dict, source: str) -> tuple[Snapshot, dict]:
    try:
        unknown = sorted(set(doc) - {"format", "version", "snapshot", "extra"})
        if unknown:
            raise _Bad("", f"unknown top-level field(s) {_names(unknown)}")
        if "snapshot" not in doc:
            raise _Bad("snapshot", "missing")
        snap = _snapshot(doc["snapshot"])
        extra = _extra(doc.get("extra", {}))
    except _Bad as e:
        raise SnapshotFileError(f"{source}: damaged snapshot: {e}") from None
    except (MemoryError, RecursionError) as e:  # guarded above; a last line so it never ends in a traceback
        raise SnapshotFileError(f"{source}: damaged snapshot: cannot be read ({type(e).__name__})") from None
    return snap, extra


# -- the schema -----------------------------------------------------------------------------------------
def _clip(s: str, n: int = 60) -> str:
    return s if len(s) <= n else s[:n] + "…"


def _names(keys) -> str:
    return ", ".join(_clip(repr(k), 40) for k in list(keys)[:5]) + (", …" if len(keys) > 5 else "")


def _kind(x: Any) -> str:
    if isinstance(x, dict):
        return "an array" if "__nd__" in x else "an object"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            type(None): "null"}.get(type(x), type(x).__name__)


def _obj(x: Any, where: str, keys: tuple[str, ...] = (), optional: tuple[str, ...] = (),
         closed: bool = False) -> dict:
    if not isinstance(x, dict) or "__nd__" in x or "__float__" in x:
        raise _Bad(where, f"expected an object, got {_kind(x)}")
    missing = [k for k in keys if k not in x]
    if missing:
        raise _Bad(f"{where}.{missing[0]}" if where else missing[0], "missing")
    if closed:
        unknown = sorted(set(x) - set(keys) - set(optional))
        if unknown:
            raise _Bad(where or "snapshot", f"unknown field(s) {_names(unknown)}")
    return x


def _list(x: Any, where: str, n: int | None = None, max_n: int | None = None) -> list:
    if not isinstance(x, list):
        raise _Bad(where, f"expected a list, got {_kind(x)}")
    if n is not None and len(x) != n:
        raise _Bad(where, f"{len(x):,} entries, expected {n:,}")
    if max_n is not None and len(x) > max_n:
        raise _Bad(where, f"{len(x):,} entries, more than the {max_n:,} a snapshot may hold")
    return x


def _int(x: Any, where: str, lo: int | None = None, hi: int | None = None) -> int:
    if type(x) is not int:
        raise _Bad(where, f"expected an integer, got {_kind(x)}")
    if (lo is not None and x < lo) or (hi is not None and x > hi):
        raise _Bad(where, f"{_clip(str(x))} is out of range ({_range(lo, hi)})")
    return x


def _range(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"{lo:g} to {hi:g}" if isinstance(lo, float) or isinstance(hi, float) else f"{lo:,} to {hi:,}"
    return f"at least {lo:g}" if lo is not None else f"at most {hi:g}"


def _num(x: Any, where: str, lo: float | None = None, hi: float | None = None, nan_ok: bool = False) -> float | int:
    """A JSON number (or the writer's {"__float__": "nan"} form): finite unless nan_ok allows NaN."""
    if isinstance(x, dict) and set(x) == {"__float__"}:
        if x["__float__"] not in SPECIAL_FLOATS:
            raise _Bad(where, f"{_clip(repr(x['__float__']))} is not one of {', '.join(SPECIAL_FLOATS)}")
        x = float(x["__float__"])
    elif type(x) is not int and type(x) is not float:
        raise _Bad(where, f"expected a number, got {_kind(x)}")
    if isinstance(x, float) and math.isnan(x):
        if nan_ok:
            return x
        raise _Bad(where, "NaN, expected a finite number")
    if isinstance(x, float) and math.isinf(x):
        raise _Bad(where, f"{x}, expected a finite number")
    if (lo is not None and x < lo) or (hi is not None and x > hi):
        raise _Bad(where, f"{_clip(repr(x))} is out of range ({_range(lo, hi)})")
    return x


def _str(x: Any, where: str, choices: tuple[str, ...] = ()) -> str:
    if type(x) is not str:
        raise _Bad(where, f"expected a string, got {_kind(x)}")
    if len(x) > MAX_TEXT:
        raise _Bad(where, f"{len(x):,} characters, more than the {MAX_TEXT:,} a snapshot text may have")
    if choices and x not in choices:
        raise _Bad(where, f"{_clip(repr(x))} is not one of {', '.join(choices)}")
    return x


def _bool(x: Any, where: str) -> bool:
    if type(x) is not bool:
        raise _Bad(where, f"expected true or false, got {_kind(x)}")
    return x


def _array(x: Any, where: str, dtypes: tuple[str, ...] | str, ndim: int | None = 1,
           max_len: int | None = None) -> np.ndarray:
    """Decode one stored array, checked before anything is allocated: its dtype is one the writer uses, its
    shape a list of non-negative integers whose byte size is capped and matches the base64 length. The
    base64 text is dropped from the document once decoded; the array is a read-only view of the bytes."""
    if isinstance(dtypes, str):
        dtypes = (dtypes,)
    if not isinstance(x, dict) or "__nd__" not in x:
        raise _Bad(where, f"expected an array, got {_kind(x)}")
    for k in ("shape", "b64"):
        if k not in x:
            raise _Bad(f"{where}.{k}", "missing")
    if len(x) != 3:
        raise _Bad(where, f"unknown field(s) {_names(sorted(set(x) - {'__nd__', 'shape', 'b64'}))}")
    dt = x["__nd__"]
    if type(dt) is not str or dt not in dtypes:
        raise _Bad(where, f"dtype {_clip(repr(dt))}, expected {' or '.join(dtypes)}")
    shape = x["shape"]
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape[:MAX_DIM + 1]):
        raise _Bad(f"{where}.shape", f"{_clip(repr(shape))} is not a list of non-negative integers")
    if len(shape) > MAX_DIM or (ndim is not None and len(shape) != ndim):
        raise _Bad(f"{where}.shape", f"{len(shape)} dimensions, expected {ndim if ndim is not None else MAX_DIM}")
    dtype = np.dtype(dt)
    n = math.prod(shape)
    nbytes = n * dtype.itemsize
    if nbytes > MAX_ARRAY_BYTES:
        raise _Bad(f"{where}.shape", f"{_clip(repr(shape))} declares {_mb(nbytes)}, more than the "
                                      f"{_mb(MAX_ARRAY_BYTES)} a snapshot array may hold")
    if max_len is not None and shape and shape[0] > max_len:
        raise _Bad(f"{where}.shape", f"{shape[0]:,} entries, more than the {max_len:,} a snapshot may hold")
    b64 = x["b64"]
    if type(b64) is not str:
        raise _Bad(f"{where}.b64", f"expected a string, got {_kind(b64)}")
    want = 4 * -(-nbytes // 3)
    if len(b64) != want:
        raise _Bad(f"{where}.b64", f"{len(b64):,} base64 characters, expected {want:,} for shape {shape} of "
                                   f"{dt} ({nbytes:,} bytes)")
    try:
        raw = binascii.a2b_base64(b64, strict_mode=True)
    except (binascii.Error, ValueError) as e:
        raise _Bad(f"{where}.b64", f"not valid base64 ({_clip(str(e))})") from None
    if len(raw) != nbytes:
        raise _Bad(f"{where}.b64", f"{len(raw):,} bytes decoded, expected {nbytes:,} for shape {shape}")
    del x["b64"], b64  # the text is no longer needed: free it before the next array is decoded
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def _ints(a: np.ndarray, where: str, lo: int | None = None, hi: int | None = None, what: str = "") -> None:
    if a.size == 0:
        return
    mn, mx = int(a.min()), int(a.max())
    if lo is not None and mn < lo:
        raise _Bad(where, f"holds {mn:,}, below the least allowed {lo:,}{what}")
    if hi is not None and mx > hi:
        raise _Bad(where, f"holds {mx:,}, above the most allowed {hi:,}{what}")


def _floats(a: np.ndarray, where: str, lo: float | None = None, nan_ok: bool = False) -> None:
    """Finite (NaN too where nan_ok), and at least lo. min/max reductions: no temporaries at any size."""
    if a.size == 0:
        return
    if nan_ok:
        mn, mx = float(np.fmin.reduce(a, axis=None)), float(np.fmax.reduce(a, axis=None))  # NaN-ignoring
    else:
        mn, mx = float(a.min()), float(a.max())  # NaN-propagating
        if math.isnan(mn) or math.isnan(mx):
            raise _Bad(where, "holds NaN, expected finite numbers")
    for v in (mn, mx):
        if math.isinf(v):
            raise _Bad(where, f"holds {v}, expected finite numbers")
    if lo is not None and not math.isnan(mn) and mn < lo:
        raise _Bad(where, f"holds {mn:g}, below the least allowed {lo:g}")


def _plain(x: Any, where: str, depth: int = 0) -> Any:
    """Free-form JSON (extra, fields the window does not read): bounded depth, the writer's encoded floats and
    arrays decoded with the same checks."""
    if depth > MAX_DEPTH:
        raise _Bad(where, f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(x, dict):
        if "__nd__" in x:
            return _array(x, where, ANY_DTYPES, ndim=None)
        if "__float__" in x:
            if set(x) != {"__float__"} or x["__float__"] not in SPECIAL_FLOATS:
                raise _Bad(where, f"{_clip(repr(x))} is not one of the stored forms of nan, inf, -inf")
            return float(x["__float__"])
        return {k: _plain(v, f"{where}.{_clip(k, 40)}", depth + 1) for k, v in x.items()}
    if isinstance(x, list):
        return [_plain(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(x)]
    if isinstance(x, str):
        return _str(x, where)
    return x


def _rest(d: dict, where: str, known: tuple[str, ...]) -> dict:
    """The fields of d the window does not read (besides `known`), as free-form JSON."""
    return {k: _plain(v, f"{where}.{_clip(k, 40)}", 1) for k, v in d.items() if k not in known}


SNAPSHOT_KEYS = ("t", "model", "config", "tiers", "seqs", "counters", "windowed", "memory", "series", "residency")
SNAPSHOT_OPTIONAL = ("timing", "marks")  # files from before marks existed have none


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
    windowed = {k: _num(v, f"windowed.{_clip(k, 40)}") for k, v in windowed.items()}
    memory = _memory(body["memory"])
    series = _series(body["series"])
    residency = _residency(body["residency"])
    timing = _obj(body.get("timing", {}), "timing")
    timing = {k: _num(v, f"timing.{_clip(k, 40)}", nan_ok=True) for k, v in timing.items()}
    marks = _marks(body.get("marks", []))
    return Snapshot(t=t, model=model, config=config, tiers=tiers, seqs=seqs, counters=counters, windowed=windowed,
                    memory=memory, series=series, residency=residency, timing=timing, marks=marks)


def _model(x: Any) -> dict:
    m = _obj(x, "model", ("name", "device", "layers", "kv_heads", "head_dim"))
    out = _rest(m, "model", ("name", "device", "architecture", "layers", "heads", "kv_heads", "head_dim",
                             "context_limit"))
    for k in ("name", "device", "architecture"):
        if k in m:
            out[k] = _str(m[k], f"model.{k}")
    for k in ("layers", "heads", "kv_heads", "head_dim", "context_limit"):
        if k in m:
            out[k] = _int(m[k], f"model.{k}", 1, 1 << 24)
    return out


def _config(x: Any) -> dict:
    c = _obj(x, "config", tuple(KNOBS), closed=True)
    out = {}
    for name, knob in KNOBS.items():
        v, where = c[name], f"config.{name}"
        if knob.kind is KVDtype or knob.kind is str:
            out[name] = _str(v, where, knob.choices)
        elif knob.kind is int:
            out[name] = _int(v, where, int(knob.lo), int(knob.hi))
        else:
            out[name] = _num(v, where, knob.lo, knob.hi)
    return out


def _tiers(x: Any, block_size: int) -> tuple[TierSnapshot, ...]:
    out = []
    for i, t in enumerate(_list(x, "tiers", len(TIER_NAMES))):
        where = f"tiers[{i}]"
        t = _obj(t, where, ("name", "capacity", "block_bytes", *TIER_DTYPES), closed=True)
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
        out.append(TierSnapshot(name=name, capacity=cap, block_bytes=block_bytes, **arrays))
    return tuple(out)


def _seqs(x: Any, capacities: tuple[int, ...]) -> SeqTable:
    names = tuple(f.name for f in dataclasses.fields(SeqTable))
    s = _obj(x, "seqs", names, closed=True)
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
    return SeqTable(**cols, labels=labels, **tables)


def _counters(x: Any) -> dict:
    c = _obj(x, "counters", ("device_hit_rate", "prefix_hit_rate"))
    ints = {f.name for f in dataclasses.fields(Counters) if f.type in ("int", int)}
    out = {}
    for k, v in c.items():
        where = f"counters.{_clip(k, 40)}"
        if k in ints:
            out[k] = _int(v, where, 0)
        elif k in ("device_hit_rate", "prefix_hit_rate"):
            out[k] = _num(v, where, 0.0, 1.0)
        else:
            out[k] = _num(v, where, nan_ok=True)  # ttft_p50 is NaN before any first token
    return out


def _memory(x: Any) -> dict:
    m = _obj(x, "memory", ("tiers", "block_bytes", "rss_bytes", "system_total_bytes", "system_used_bytes", "gpu"))
    out = _rest(m, "memory", ("tiers", "block_bytes", "rss_bytes", "system_total_bytes", "system_used_bytes", "gpu"))
    for k in ("block_bytes", "rss_bytes", "system_total_bytes", "system_used_bytes"):
        out[k] = _num(m[k], f"memory.{k}", lo=0)
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


def _extra(x: Any) -> dict:
    e = _plain(_obj(x, "extra"), "extra")
    for k in ("caption", "png"):
        if k in e:
            _str(e[k], f"extra.{k}")
    if "colour_mode" in e:
        _str(e["colour_mode"], "extra.colour_mode", COLOUR_MODES)
    if "selected" in e:
        _int(e["selected"], "extra.selected", -1)
    return e
