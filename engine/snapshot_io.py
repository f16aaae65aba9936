"""Snapshots to and from JSON, so a screenshot can travel with the data behind it.

Arrays are stored exactly (dtype, shape, base64 of the raw little-endian bytes); everything else is plain
JSON. Torch-free: the window imports this.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from typing import Any

import numpy as np

from engine.telemetry import SeqTable, Snapshot, TierSnapshot

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


def _dec(x: Any) -> Any:
    if isinstance(x, dict):
        if "__nd__" in x:
            a = np.frombuffer(base64.b64decode(x["b64"]), dtype=np.dtype(x["__nd__"]))
            return a.reshape(x["shape"]).copy()
        if "__float__" in x:
            return float(x["__float__"])
        return {k: _dec(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_dec(v) for v in x]
    return x


def to_json(snap: Snapshot, extra: dict | None = None) -> str:
    body = {f.name: getattr(snap, f.name) for f in dataclasses.fields(snap)}
    body["tiers"] = [{f.name: getattr(t, f.name) for f in dataclasses.fields(t)} for t in snap.tiers]
    body["seqs"] = {f.name: getattr(snap.seqs, f.name) for f in dataclasses.fields(snap.seqs)}
    doc = {"format": FORMAT, "version": VERSION, "snapshot": _enc(body), "extra": _enc(extra or {})}
    return json.dumps(doc)


def from_json(text: str, source: str = "<snapshot>") -> tuple[Snapshot, dict]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise SnapshotFileError(f"{source}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SnapshotFileError(f"{source}: not a KV Scope snapshot (no \"format\": \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise SnapshotFileError(f"{source}: snapshot version {doc.get('version')} is not {VERSION}")
    try:
        body = _dec(doc["snapshot"])
        tiers = tuple(TierSnapshot(**t) for t in body.pop("tiers"))
        s = body.pop("seqs")
        s["labels"] = tuple(s["labels"])
        s["block_tier"] = tuple(s["block_tier"])
        s["block_slot"] = tuple(s["block_slot"])
        seqs = SeqTable(**s)
        body["marks"] = tuple((float(t), str(k), str(label)) for t, k, label in body.get("marks", ()))
        snap = Snapshot(tiers=tiers, seqs=seqs, **body)
        for t in tiers:
            for name in ("state", "owner", "ref", "fill", "heat", "age", "hashed"):
                if len(getattr(t, name)) != t.capacity:
                    raise ValueError(f"tier {t.name}: {name} has {len(getattr(t, name))} entries for {t.capacity} slots")
    except (KeyError, TypeError, ValueError, base64.binascii.Error) as e:
        raise SnapshotFileError(f"{source}: damaged snapshot ({e})") from None
    return snap, _dec(doc.get("extra", {}))


def save(path: str, snap: Snapshot, extra: dict | None = None) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(to_json(snap, extra))


def load(path: str) -> tuple[Snapshot, dict]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise SnapshotFileError(f"{path}: {e.strerror}") from None
    return from_json(text, path)
