"""Self-checks at first use: each accelerated path runs once beside its reference before it is trusted.

| feature     | the accelerated path                         | checked                                                | on a mismatch or an exception, from then on        |
|-------------|----------------------------------------------|--------------------------------------------------------|----------------------------------------------------|
| `attention` | the paged backend (`triton` on CUDA, `cpu`)  | at start-up and after a KV-format or block-size change, | the reference path (gather + SDPA); the `numba`    |
|             |                                              | on a scratch sequence (engine/attention/check.py)      | CPU loop: the `chunked` torch path, if it passes   |
| `graphs`    | a captured CUDA-graph bucket (on the CPU:    | its first replay, against the same step run eagerly    | eager decode (DecodeGraphs.fallback); that step's  |
|             | `--cuda-graphs static`, the same buffers)    | over the same buffers (logits)                         | logits are the eager ones                          |
| `migration` | tier copies (on CUDA on the side stream)     | a pool's first copy: every byte of the destination     | synchronous copies; that copy redone so            |
|             |                                              | against the source (engine/kv/copy_check.py)           |                                                    |
| `stream`    | host blocks streamed a layer ahead           | a stream's first step: every staged layer, as attention | host blocks read from the host tier at each read;  |
|             |                                              | reads it, against the host tier read directly          | that step's staging rewritten from the host tier   |

A check that passes changes nothing a user sees: the attention check has scratch tensors of its own; the others
check the live step or copy and write nothing of their own (no counter counts a check). A check costs one step's
extra work once: a flag per feature (per graph bucket, per pool, per stream) is read per step after that. The
attention check's verdicts are kept per process for each (backend, format, geometry): a kernel checked on this
machine is not checked again by the next engine.

`SelfChecks` holds the verdicts: the latest per feature and the first failure (which sticks), for snapshots
(`Snapshot.self_checks`), `kvscope info`, `generate --json`; the engine says each feature's first failure once as a
`self_check` event (the window's status bar repeats it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

FEATURES = ("attention", "graphs", "migration", "stream")
REFERENCE = "the reference path"


@dataclass(frozen=True)
class Verdict:
    feature: str  # one of FEATURES
    path: str  # what was checked, as a user names it: "triton paged decode", "CUDA graph bucket 4", ...
    ok: bool
    detail: str  # "max |Δ| 2.4e-07 (tolerance 1e-04, 7 cases)", "RuntimeError: ...", "every byte equal (...)"
    fallback: str = ""  # what serves from now on (not ok)
    seconds: float = 0.0  # what the check cost

    def message(self) -> str:
        if self.ok:
            return f"{self.path} agreed with the reference ({self.detail})"
        return f"{self.path} disagreed with the reference ({self.detail}): using {self.fallback}"

    def as_dict(self) -> dict:
        return {"feature": self.feature, "path": self.path, "ok": self.ok, "detail": self.detail,
                "fallback": self.fallback or None, "seconds": self.seconds, "message": self.message()}


class SelfChecks:
    """The verdicts of one engine's self-checks."""

    def __init__(self):
        self.latest: dict[str, Verdict] = {}
        self.failed: dict[str, Verdict] = {}  # each feature's first failure: it sticks
        self.count: dict[str, int] = {}
        self._new: list[Verdict] = []

    def record(self, v: Verdict) -> None:
        self.latest[v.feature] = v
        self.count[v.feature] = self.count.get(v.feature, 0) + 1
        if not v.ok and v.feature not in self.failed:
            self.failed[v.feature] = v
            self._new.append(v)  # said once

    def absorb(self, pool_events: list) -> list:
        """The block pool's events with its copy checks ("self_check", engine/kv/copy_check.py) recorded and taken out."""
        rest = []
        for ev in pool_events:
            if ev.kind == "self_check":
                f = dict(ev.fields)
                group = f.pop("group", None)  # a KV-cache group's pool past the first (engine/kv/cache.py)
                if group:
                    f["path"] += f" (KV-cache group {group})"
                self.record(Verdict(**f))
            else:
                rest.append(ev)
        return rest

    def take_failures(self) -> list[Verdict]:
        """Failures not said yet (each feature's first), oldest first."""
        out, self._new = self._new, []
        return out

    def summary(self) -> dict[str, dict]:
        """Per feature: state (passed / failed / not run), checks (how many ran), and the verdict that decides the
        state (the first failure, else the latest pass): path, detail, fallback, seconds, message."""
        out = {}
        for f in FEATURES:
            v = self.failed.get(f) or self.latest.get(f)
            if v is None:
                out[f] = {"state": "not run", "checks": 0}
                continue
            d = v.as_dict()
            del d["feature"], d["ok"]
            out[f] = {"state": "passed" if v.ok else "failed", "checks": self.count[f], **d}
        return out


def tolerance(dtype: torch.dtype) -> float:
    """Largest |Δ| between two logits of the same step, relative to the logits' largest magnitude (at least 1)."""
    return 1e-3 if dtype == torch.float32 else 5e-2


def max_delta(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| (inf where either is NaN or the shapes differ)."""
    if got.shape != want.shape:
        return float("inf")
    d = float((got.float() - want.float()).abs().max()) if got.numel() else 0.0
    return float("inf") if d != d else d


def why(e: BaseException) -> str:
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first[:200]}" if first else type(e).__name__


# -- the attention backend --------------------------------------------------------------------------------------
_CHECKED: dict[tuple, Verdict] = {}  # per process: (backend class, format, geometry, device, dtype) -> its verdict


def attention_path(name: str) -> str:
    return {"triton": "triton paged decode", "numba": "numba paged decode", "chunked": "cpu paged attention",
            "cpu": "cpu paged attention"}.get(name, f"{name} attention")


# A backend's fallback when its check fails, before the reference path: the compiled CPU loop falls back to the
# chunked torch path (itself checked then).
_FALLBACK = {"numba": "chunked"}


def check_attention(model, block_size: int, kv_dtype) -> Verdict | None:
    """The model's paged backend against the reference on a scratch sequence of this block size and format (None:
    the model runs the reference path, or this variant was checked already in this process). A failure switches
    the model to the backend's fallback when it has one that passes its own check (numba -> chunked), else to the
    reference path."""
    from engine.attention.check import check_backend

    backend = model.backend
    if backend is None:
        return None
    spec = model.spec
    windows = tuple(sorted({w for w in spec.sliding_window if w}))
    sinks = any(s is not None for s in model.sinks)
    name = getattr(backend, "name", type(backend).__name__)
    key = (type(backend), name, kv_dtype, block_size, spec.num_heads, spec.num_kv_heads,
           spec.head_dim, str(model.device), model.dtype, windows, sinks)
    if key in _CHECKED and _CHECKED[key].ok:
        return None
    path = attention_path(name)
    compiled = dict(getattr(backend, "compile_seconds", None) or {})
    t0 = time.perf_counter()
    try:
        r = check_backend(backend, kv_dtype, block_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                          model.device, model.dtype, windows, sinks)
        ok = r.ok
        detail = (f"max |Δ| {r.worst:.2g} (tolerance {r.tolerance:g}, {r.cases} cases; worst: {r.worst_case}; "
                  f"{kv_dtype.label} KV, block size {block_size})")
    except Exception as e:  # noqa: BLE001 - any failure of the backend is a verdict, never a crash
        ok, detail = False, f"{why(e)}; {kv_dtype.label} KV, block size {block_size}"
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    seconds = time.perf_counter() - t0
    new = {k: s for k, s in (getattr(backend, "compile_seconds", None) or {}).items() if k not in compiled}
    if new:  # a compiled backend's first call of a variant: compiled, or loaded from its cache
        detail += "; first call (compile or cache load) " + ", ".join(f"{k} data {s:.1f} s" for k, s in new.items())
    fallback = REFERENCE
    if not ok and name in _FALLBACK:
        try:
            model.use_attention(_FALLBACK[name])
        except Exception:  # noqa: BLE001 - the fallback cannot run this model: the reference path
            model.use_attention("reference")
        else:
            check_attention(model, block_size, kv_dtype)  # the fallback's own check (on a failure: the reference)
            if model.backend is not None:
                fallback = attention_path(model.backend.name)
    elif not ok:
        model.use_attention("reference")
    v = Verdict("attention", path, ok, detail, "" if ok else fallback, seconds)
    _CHECKED[key] = v
    return v
