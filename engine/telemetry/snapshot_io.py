"""Snapshots to and from JSON, so a screenshot can travel with the data behind it.

Arrays are stored exactly (dtype, shape, base64 of the raw little-endian bytes); everything else is plain
JSON. Torch-free: the window imports this.

This module holds the writer and the reader's front door: the file's size (capped, checked before reading),
its text, JSON, format and version. The checks of the document itself are in engine/telemetry/snapshot_schema.py
(the snapshot's fields) and engine/telemetry/snapshot_fields.py (one JSON field: types, ranges, arrays, depth). Any
problem is a SnapshotFileError naming the file and the field. Memory stays within about twice the file's
size: the text is decoded once, and each array's base64 is dropped as soon as it is decoded (the arrays are
read-only views of the decoded bytes, not copies).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import os
import stat
from typing import Any

import numpy as np

from engine.telemetry.snapshot import Snapshot
from engine.telemetry.snapshot_fields import MAX_FILE_BYTES, _Bad, _clip, _mb, _names
from engine.telemetry.snapshot_schema import COLOUR_MODES, TIER_DTYPES, _extra, _snapshot  # noqa: F401 (tests read both here)

FORMAT = "kvscope-snapshot"
VERSION = 1


class SnapshotFileError(ValueError):
    """A snapshot file that cannot be read; the message names the file and the problem."""


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
    body["kv_groups"] = [{**g, "tiers": None if i == 0 else [{f.name: getattr(t, f.name) for f in dataclasses.fields(t)}
                                                             for t in g["tiers"]]}
                         for i, g in enumerate(snap.kv_groups)]
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
