"""Checked reading of one field of a snapshot file: the limits, and the checkers of JSON types, ranges,
stored arrays and free-form JSON.

Every checker raises `_Bad` (where, what) for a field that breaks the schema; engine/telemetry/snapshot_io.py turns it
into a SnapshotFileError naming the file. An array's dtype (the writer's only) and shape (capped) are checked
before any base64 is decoded, and its base64 text is dropped as soon as it is decoded.
"""

from __future__ import annotations

import binascii
import math
from typing import Any

import numpy as np

MAX_FILE_BYTES = 256 * 2**20  # larger files are refused before they are read
MAX_ARRAY_BYTES = MAX_FILE_BYTES  # one array's decoded bytes (base64 makes 4 characters of 3 bytes)
MAX_DEPTH = 32  # nesting of free-form JSON (extra, unknown keys); the parser's own limit is the stack's
MAX_TEXT = 64 * 1024  # characters of a label, a name, a caption
MAX_DIM = 32  # dimensions of an array
ANY_DTYPES = ("|u1", "|i1", "<i4", "<i8", "<f4", "<f8", "|b1")  # arrays in free-form places
SPECIAL_FLOATS = ("nan", "inf", "-inf")  # how the writer stores a non-finite float: {"__float__": repr(f)}


class _Bad(Exception):
    """A field that breaks the schema: where (a path like tiers[0].heat) and what is wrong."""

    def __init__(self, where: str, what: str):
        super().__init__(f"{where}: {what}" if where else what)


def _mb(n: int) -> str:
    return f"{n / 2**20:,.0f} MB" if n >= 2**20 else f"{n:,} bytes"


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
