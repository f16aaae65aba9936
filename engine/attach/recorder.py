"""Record an attached event stream to a trace the policy lab replays (`kvscope policy-lab FILE.npz`).

The file is an ordinary KV Scope access trace (columns t, seq, block, tier, hit: engine/kv/access_trace.py) with the raw
events beside it (columns ev_*), so `policy-lab` reads it unchanged and nothing is lost for later tools.

Events carry no request ids and no cache hits, so the reads are inferred, and only for the GPU medium:
- every stored block is a read that missed (the server computed it);
- a store that names a parent read that parent and its whole visible chain (prefix caching only extends a
  resident prefix), unless the parent is the tip of the chain a previous store ended with and nothing else has
  extended it yet: then it is the same request continuing (its next prefill chunk or decode block) and the
  chain is not read again. So a chat whose next turn starts exactly at the previous turn's last full block
  reads as the same request, and its prefix reuse is undercounted, never overcounted;
- a request is one `seq`; the lab replays each sequence's first read of each block.
Block ids are block hashes numbered in order of appearance, shared across ranks and endpoints: the trace asks
what one pooled cache of N blocks would have hit. Record one endpoint to ask about one rank.

A recording is always consistent: ClusterState hands over only the events it applied (their fields checked by
engine/attach/bounds.py), a row is checked before any column grows, and the columns are checked to be the
same length when taken, saved and loaded (`load_columns`). It stops at MAX_ROWS rows (and says so).
"""

from __future__ import annotations

import json
import math
from array import array

import numpy as np

from engine.attach.events import KIND_REMOVED, KIND_STORED, EventBatch, medium_of
from engine.kv.access_trace import AccessTrace

MEDIA = {"GPU": 0, "CPU": 1, "DISK": 2}
KIND_CLEARED = 2
MAX_CHAIN = 100_000  # blocks of one chain walked at most (a 1.6M-token context at block size 16)
MAX_ROWS = 20_000_000  # event rows (blocks) recorded at most: ~31 bytes each in memory
_DTYPES = {"t": np.float64, "src": np.int16, "rank": np.int32, "medium": np.int8, "kind": np.int8,
           "block": np.int64, "parent": np.int64, "first": np.bool_}
_RANGES = {"src": (0, (1 << 15) - 1), "rank": (0, (1 << 31) - 1), "medium": (0, 3), "kind": (0, 2)}


class RecordingError(ValueError):
    """Columns of a recording that do not fit together."""


class Recorder:
    def __init__(self, source_labels: list[str]):
        self.labels = list(source_labels)
        self.ids: dict = {}  # block hash -> id
        self.c = {name: array(code) for name, code in (("t", "d"), ("src", "h"), ("rank", "i"), ("medium", "b"),
                                                        ("kind", "b"), ("block", "q"), ("parent", "q"),
                                                        ("first", "b"))}
        self.events = 0
        self.refused = 0  # events not recorded: a value out of a column's range, or the recording was full
        self.full_note: str | None = None  # said once by ClusterState when the recording stops
        self.max_rows = MAX_ROWS
        self.full = False

    def _id(self, h) -> int:
        i = self.ids.get(h)
        if i is None:
            i = self.ids[h] = len(self.ids)
        return i

    def _row(self, t, src, rank, medium, kind, block, parent, first) -> None:
        c = self.c
        c["t"].append(t)
        c["src"].append(src)
        c["rank"].append(rank)
        c["medium"].append(medium)
        c["kind"].append(kind)
        c["block"].append(block)
        c["parent"].append(parent)
        c["first"].append(first)

    def add(self, source: int, rank: int, t: float, events) -> None:
        """Called by ClusterState with the events of a batch it applied (a list, or the EventBatch), under its
        lock. An event whose rows would not fit the columns is refused whole, never half-written."""
        if isinstance(events, EventBatch):
            events = events.events
        if not (_RANGES["src"][0] <= source <= _RANGES["src"][1] and _RANGES["rank"][0] <= rank <= _RANGES["rank"][1]
                and math.isfinite(t)):
            self.refused += len(events)
            return
        rows = len(self.c["t"])
        for ev in events:
            n = len(ev.block_hashes) if ev.KIND in (KIND_STORED, KIND_REMOVED) else 1
            if rows + n > self.max_rows:
                self.refused += 1
                if not self.full:
                    self.full = True
                    self.full_note = (f"recording full at {rows:,} rows ({self.events:,} events): later events "
                                      f"are shown but not recorded")
                continue
            rows += n
            self.events += 1
            if ev.KIND == KIND_STORED:
                med = MEDIA.get(medium_of(ev), 3)
                parent = -1 if ev.parent_block_hash is None else self._id(ev.parent_block_hash)
                for i, h in enumerate(ev.block_hashes):
                    b = self._id(h)
                    self._row(t, source, rank, med, KIND_STORED, b, parent, i == 0)
                    parent = b
            elif ev.KIND == KIND_REMOVED:
                med = MEDIA.get(medium_of(ev), 3)
                for i, h in enumerate(ev.block_hashes):
                    self._row(t, source, rank, med, KIND_REMOVED, self._id(h), -1, i == 0)
            else:
                self._row(t, source, rank, 0, KIND_CLEARED, -1, -1, 1)

    def columns(self) -> dict[str, np.ndarray]:
        cols = {k: np.frombuffer(a, dtype=_DTYPES[k]).copy() if len(a) else np.zeros(0, _DTYPES[k])
                for k, a in self.c.items()}
        check_columns(cols)
        return cols

    def access_trace(self) -> AccessTrace:
        return access_trace(self.columns())

    def save(self, path: str, cols: dict[str, np.ndarray] | None = None) -> dict:
        """Write the trace; `cols` from `columns()` (taken under the cluster's lock) or taken now."""
        cols = self.columns() if cols is None else cols
        check_columns(cols)
        tr = access_trace(cols)
        meta = {"sources": self.labels, "events": int(np.count_nonzero(cols["first"])), "blocks": len(self.ids),
                "reads": len(tr), "requests": int(len(np.unique(tr.seq))) if len(tr) else 0}
        with open(path, "wb") as f:
            np.savez_compressed(f, **{c: getattr(tr, c) for c in ("t", "seq", "block", "tier", "hit")},
                                **{"ev_" + k: v for k, v in cols.items()},
                                ev_meta=np.array(json.dumps(meta)))
        return meta


def check_columns(cols: dict[str, np.ndarray], where: str = "recording") -> int:
    """Rows of a recording's event columns; RecordingError when one is missing, of another length, or holds
    a value no row can have (a recording that fails this is never written, and never read back)."""
    missing = [k for k in _DTYPES if k not in cols]
    if missing:
        raise RecordingError(f"{where}: event column(s) {', '.join(missing)} missing")
    lengths = {k: len(cols[k]) for k in _DTYPES}
    if len(set(lengths.values())) != 1:
        raise RecordingError(f"{where}: event columns of different lengths ({lengths})")
    n = lengths["t"]
    for k, (lo, hi) in _RANGES.items():
        v = cols[k]
        if n and (int(v.min()) < lo or int(v.max()) > hi):
            raise RecordingError(f"{where}: column {k} out of {lo}..{hi}")
    if n and not np.isfinite(cols["t"]).all():
        raise RecordingError(f"{where}: a time that is not finite")
    if n and not cols["first"][0]:
        raise RecordingError(f"{where}: the first row does not start an event")
    return n


def load_columns(path: str) -> tuple[dict[str, np.ndarray], dict]:
    """The event columns and meta of a recording written by `Recorder.save`, checked (`check_columns`)."""
    with np.load(path, allow_pickle=False) as z:
        cols = {k: z["ev_" + k] for k in _DTYPES if "ev_" + k in z.files}
        meta = json.loads(str(z["ev_meta"])) if "ev_meta" in z.files else {}
    check_columns(cols, path)
    return cols, meta


def access_trace(cols: dict[str, np.ndarray]) -> AccessTrace:
    """The reads implied by the GPU stores of recorded events (see the module docstring)."""
    t_out: list[float] = []
    seq_out: list[int] = []
    blk_out: list[int] = []
    hit_out: list[bool] = []
    parent_of: dict[int, int] = {}
    tip_owner: dict[tuple[int, int, int], int] = {}  # (src, rank, tip block) -> request
    next_seq = 0
    kind, medium, first = cols["kind"], cols["medium"], cols["first"]
    t, src, rank, block, parent = cols["t"], cols["src"], cols["rank"], cols["block"], cols["parent"]
    event_starts = np.flatnonzero(first)  # each event's rows are contiguous and the first is marked
    event_ends = np.append(event_starts[1:], len(kind))
    gpu_store = (kind[event_starts] == KIND_STORED) & (medium[event_starts] == 0)
    for s, e in zip(event_starts[gpu_store].tolist(), event_ends[gpu_store].tolist()):
        ts, sr, rk, p = float(t[s]), int(src[s]), int(rank[s]), int(parent[s])
        seq = tip_owner.pop((sr, rk, p), None) if p >= 0 else None
        if seq is None:  # a new request: it read the parent's whole visible chain from the cache
            seq, next_seq = next_seq, next_seq + 1
            chain, seen, c = [], set(), p
            while c >= 0 and c not in seen and len(chain) < MAX_CHAIN:
                chain.append(c)
                seen.add(c)
                c = parent_of.get(c, -1)
            for b in reversed(chain):
                t_out.append(ts), seq_out.append(seq), blk_out.append(b), hit_out.append(True)
        rows = range(s, e)
        prev = p
        for r in rows:
            b = int(block[r])
            if prev >= 0 and b != prev:
                parent_of.setdefault(b, prev)
            t_out.append(ts), seq_out.append(seq), blk_out.append(b), hit_out.append(False)
            prev = b
        tip_owner[(sr, rk, prev)] = seq
    n = len(t_out)
    return AccessTrace(np.asarray(t_out, np.float64), np.asarray(seq_out, np.int32), np.asarray(blk_out, np.int64),
                       np.zeros(n, np.int8), np.asarray(hit_out, bool))
