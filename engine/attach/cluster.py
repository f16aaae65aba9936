"""Every cache the attached publishers describe: one BlockTable per (source, data-parallel rank, medium,
KV-cache group), fed by decoded batches from the subscriber threads, read by the window through snapshots.

The subscriber threads call `apply` (under the lock); the window calls `snapshot` on its timer (under the
lock, copies only: a few numpy passes). Nothing here knows about Qt.

Times are the publisher's batch timestamps moved onto this machine's clock by an offset fixed at the first
live batch of each source, so replayed history gets its true age and clock skew between nodes cancels.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import numpy as np

from engine.attach import bounds, codes
from engine.attach.block_state import BlockTable, token_list
from engine.attach.events import (KIND_REMOVED, KIND_STORED, MEDIUM_GPU, EventBatch, event_meta, is_placeholder,
                                  medium_of)

MODES = ("age", "idle", "heat", "reuse", "family", "depth")
_MEDIUM_ORDER = {"GPU": 0, "CPU": 1, "DISK": 2}

GroupKey = tuple[int, int, str, int]  # (source index, data-parallel rank, medium, KV-cache group)


@dataclass(frozen=True)
class SourceActivity:
    """Cumulative counts of what one source's events did (the window diffs them per frame)."""

    batches: int = 0
    events: int = 0  # BlockStored + BlockRemoved + AllBlocksCleared events applied
    stored_events: int = 0
    stored_blocks: int = 0
    removed_events: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    bad_events: int = 0
    unknown_events: int = 0


@dataclass(frozen=True)
class GroupView:
    key: GroupKey
    label: str
    resident: int
    block_size: int
    codes: np.ndarray  # uint8 per cell for the snapshot's mode (engine/attach/codes.py); EMPTY_CODE: no block
    stored: int
    removed: int
    removed_unknown: int
    restores: dict | None = None  # engine/attach/restores.py ReStores.summary(): re-stores and their curve


@dataclass(frozen=True)
class ClusterSnapshot:
    t: float
    mode: str
    groups: tuple[GroupView, ...]
    activity: tuple[SourceActivity, ...]
    families: int
    range: tuple[float, float]  # the colour bar's (low, high) for age / idle / heat / depth
    top_families: tuple[tuple[int, int, tuple[int, ...]], ...] = ()  # family mode: (id, blocks, root tokens)


def spec_text(kind: str, window: int | None) -> str:
    """A KV-cache group's kind as vLLM names it, for a map's title: "sliding window 4,096 tokens"."""
    text = kind.replace("_", " ")
    return text + (f" {window:,} tokens" if isinstance(window, int) and window > 0 else "")


class _Ring:
    SIZE = 8192

    def __init__(self) -> None:
        self.a = np.zeros(self.SIZE, np.float64)
        self._mv = memoryview(self.a)
        self.n = 0

    def add(self, v: float) -> None:
        self._mv[self.n % self.SIZE] = v
        self.n += 1

    def values(self) -> np.ndarray:
        return self.a[: min(self.n, self.SIZE)].copy()


def _failed(what: str, e: BaseException) -> str:
    """A reason for the events panel: what failed, the exception (one line, at most 200 characters)."""
    return f"{type(e).__name__} {what}: {e}"[:200].replace("\n", " ")


class ClusterState:
    def __init__(self, source_labels: list[str], half_life_s: float = 10.0):
        self.labels = list(source_labels)
        self.half_life_s = half_life_s
        self.lock = threading.Lock()
        self.groups: dict[GroupKey, BlockTable] = {}
        self._offset: dict[int, float] = {}
        self._act = [dict.fromkeys(SourceActivity.__dataclass_fields__, 0) for _ in self.labels]
        # Families with a resident block, and only those (a family whose last block went is forgotten, so a
        # stream of new prefixes does not grow these): root hash (or the hash of a parent never seen) -> id,
        # id -> (root hash, token ids of its root's event, block index, size), id -> resident blocks.
        self.family_of_root: dict = {}
        self.family_tokens: dict[int, tuple] = {}
        self._family_blocks: dict[int, int] = {}
        self._next_family = 0
        self._refused_groups = 0  # events not applied because they would have made one map too many
        self.notes: deque[tuple[float, str, str]] = deque(maxlen=2000)  # (t, kind, text) for the events panel
        self.recorder = None  # an engine.attach.recorder.Recorder, given every applied batch
        # The latest lifetimes / idle times of removed blocks and gaps between touches, from events alone
        # (the window puts them beside vLLM's sampled histograms).
        self.rings = {k: _Ring() for k in ("lifetime", "idle_before_evict", "reuse_gap")}
        self._ranges = codes.Ranges()

    # -- writing (subscriber threads) -------------------------------------------------------------------
    def note(self, kind: str, text: str) -> None:
        self.notes.append((time.time(), kind, text))

    def set_offset(self, source: int, batch_ts: float, now: float | None = None) -> None:
        """Fix the source's clock offset from a live batch (the first one counts)."""
        with self.lock:
            self._offset.setdefault(source, (time.time() if now is None else now) - batch_ts)

    def reset_source(self, source: int) -> None:
        """The source restarted: its caches are empty and its clock offset is taken afresh."""
        with self.lock:
            for k in [k for k in self.groups if k[0] == source]:
                self._forget(self.groups.pop(k).resident_families())
            self._offset.pop(source, None)

    def _group(self, source: int, rank: int, medium: str, gidx: int) -> BlockTable | None:
        """The block table of a cache, made on first use; None when that would be one map too many."""
        key = (source, rank, medium, gidx)
        g = self.groups.get(key)
        if g is None:
            mine = sum(1 for k in self.groups if k[0] == source)
            if len(self.groups) >= bounds.MAX_GROUPS or mine >= bounds.MAX_GROUPS_PER_SOURCE:
                self._refused_groups += 1
                if self._refused_groups in (1, 10, 100) or not self._refused_groups % 10_000:
                    self.note("malformed", f"{self.labels[source]}: rank {rank} {medium} group {gidx} not shown: "
                                           f"{len(self.groups):,} caches ({mine:,} of this endpoint) is the limit "
                                           f"({bounds.MAX_GROUPS:,}, {bounds.MAX_GROUPS_PER_SOURCE} per endpoint); "
                                           f"{self._refused_groups:,} events skipped so far")
                return None
            g = self.groups[key] = BlockTable(half_life_s=self.half_life_s)
            if medium == MEDIUM_GPU:
                g.on_evict, g.on_reuse = self._evicted, self.rings["reuse_gap"].add
        return g

    def _family(self, root_hash, tokens, i: int, bs: int) -> int:
        fid = self.family_of_root.get(root_hash)
        if fid is None:
            fid = self._next_family
            while fid in self.family_tokens:  # ids wrap at 2^31 (an int32 column); skip the ones still alive
                fid = (fid + 1) & 0x7FFFFFFF
            self._next_family = (fid + 1) & 0x7FFFFFFF
            self.family_of_root[root_hash] = fid
            self.family_tokens[fid] = (root_hash, tokens, i, bs)
            self._family_blocks[fid] = 0
        return fid

    def _forget(self, families) -> None:
        """Blocks of these families (one entry per block) are no longer resident."""
        counts = self._family_blocks
        for fid in families:
            n = counts.get(fid)
            if n is None:
                continue
            if n > 1:
                counts[fid] = n - 1
            else:
                self._drop_family(fid)

    def _drop_family(self, fid: int) -> None:
        self._family_blocks.pop(fid, None)
        f = self.family_tokens.pop(fid, None)
        if f is not None and self.family_of_root.get(f[0]) == fid:
            del self.family_of_root[f[0]]

    def family_text_ids(self, fid: int) -> list[int]:
        """The first token ids of a family's root block (decoded now); [] for a family no longer resident."""
        f = self.family_tokens.get(fid)
        if f is None:
            return []
        _, tokens, i, bs = f
        return list(token_list(tokens)[i * bs: i * bs + min(bs, 8)])

    def apply(self, source: int, batch: EventBatch, default_rank: int = 0) -> None:
        with self.lock:
            self._apply(source, batch, default_rank)

    def _checked(self, source: int, batch: EventBatch, rank) -> list:
        """The batch's events that can be applied (engine/attach/bounds.py); the others are counted bad, and
        their reason noted. Every event counts in `events` either way, so sent and received still compare."""
        try:
            why = bounds.batch_problem(batch.ts, rank)
        except Exception as e:  # a check that cannot be made is a problem too, said as such
            why = _failed("checking the batch", e)
        if why is not None:
            bad, events = list(batch.events), []
        else:
            bad, events = [], batch.events
            problem, i = bounds.event_problem, len(events)
            try:
                for i, ev in enumerate(events):
                    if problem(ev) is not None:
                        break
                else:
                    i = len(events)
            except Exception:
                pass  # that event again, below, with the reason
            if i < len(events):  # rare: only then is the list copied
                keep = events[:i]
                for e in events[i:]:
                    try:
                        p = problem(e)
                    except Exception as x:
                        p = _failed("checking an event", x)
                    if p is None:
                        keep.append(e)
                    else:
                        bad.append(e)
                        why = why or p
                events = keep
        if bad:
            self._act[source]["bad_events"] += len(bad)
            self.note("malformed", f"{self.labels[source]}: {len(bad):,} of {len(batch.events):,} event(s) of a "
                                   f"batch skipped ({why})")
        return events

    def _apply(self, source: int, batch: EventBatch, default_rank: int) -> None:
        act = self._act[source]
        act["batches"] += 1
        act["events"] += len(batch.events)
        act["bad_events"] += batch.bad_events
        act["unknown_events"] += batch.unknown_events
        rank = default_rank if batch.data_parallel_rank is None else batch.data_parallel_rank
        events = self._checked(source, batch, rank)
        if not events:
            return
        t = batch.ts + self._offset.get(source, 0.0)
        applied = [] if self.recorder is not None else None
        counts = self._family_blocks
        failed, why = 0, ""
        for ev in events:
            # An exception applying one event (a bug, or a value no check foresaw) counts that event bad with
            # the reason, and the batch's others are still applied: nothing leaves here to drop the rest.
            try:
                kind = ev.KIND
                if kind == KIND_STORED:
                    g = self._group(source, rank, medium_of(ev), ev.group_idx or 0)
                    if g is None:
                        act["bad_events"] += 1
                        continue
                    self._store(g, ev, t)
                    act["stored_events"] += 1
                    act["stored_blocks"] += len(ev.block_hashes)
                elif kind == KIND_REMOVED:
                    g = self._group(source, rank, medium_of(ev), ev.group_idx or 0)
                    if g is None:
                        act["bad_events"] += 1
                        continue
                    remove = g.remove
                    for h in ev.block_hashes:
                        f = remove(h, t)
                        if f is not None:  # the block's family has one block fewer (inline _forget: hot)
                            n = counts.get(f)
                            if n is not None:
                                if n > 1:
                                    counts[f] = n - 1
                                else:
                                    self._drop_family(f)
                    act["removed_events"] += 1
                    act["removed_blocks"] += len(ev.block_hashes)
                else:
                    # It carries no medium: vLLM sends it when the GPU prefix cache is reset.
                    n = 0
                    for k, g in self.groups.items():
                        if k[0] == source and k[1] == rank and k[2] == MEDIUM_GPU:
                            self._forget(g.resident_families())
                            n += g.clear()
                    act["cleared"] += 1
                    self.note("cleared", f"{self.labels[source]} rank {rank}: all blocks cleared ({n:,} resident)")
            except Exception as e:
                act["bad_events"] += 1
                failed += 1
                why = why or _failed(f"applying a {type(ev).__name__}", e)
                continue
            if applied is not None:
                applied.append(ev)
        if failed:
            self.note("malformed", f"{self.labels[source]}: {failed:,} of {len(batch.events):,} event(s) of a batch "
                                   f"not applied ({why})")
        if applied is not None:  # what was applied, and only that: the recording and the maps agree
            try:
                self.recorder.add(source, rank, t, applied)
            except Exception as e:  # the maps have the batch: say the recording lacks it, never "not applied"
                self.note("error", f"{self.labels[source]}: a batch applied but not recorded "
                                   f"({_failed('recording it', e)})")
            if self.recorder.full_note:
                self.note("error", self.recorder.full_note)
                self.recorder.full_note = None

    def _evicted(self, lifetime: float, idle: float) -> None:
        self.rings["lifetime"].add(lifetime)
        self.rings["idle_before_evict"].add(idle)

    def _store(self, g: BlockTable, ev, t: float) -> None:
        hashes = ev.block_hashes
        toks = ev.token_ids
        if isinstance(toks, msgspec.Raw):
            toks = toks.copy()  # just the token bytes: a view would keep the whole frame alive
        bs = ev.block_size
        placeholder = bs <= 0 and is_placeholder(ev)  # vLLM's offloading connector: hashes only (still shown)
        if bs <= 0:  # not given: what the token ids say (nothing, for a placeholder: the size stays as known)
            bs = len(token_list(toks)) // len(hashes)
        if bs > 0:
            g.block_size = bs
        if ev.kv_cache_spec_kind is not None:
            g.spec = (ev.kv_cache_spec_kind[:32], ev.kv_cache_spec_sliding_window)
        parent = ev.parent_block_hash
        pcell = -1 if parent is None else g.index.get(parent, -1)
        if pcell >= 0:
            g.touch(pcell, t)
            depth = int(g.a["depth"][pcell])
            depth = depth + 1 if depth >= 0 else -1
            family = int(g.a["family"][pcell])
        elif parent is None:  # a root: its family is named after its own hash below (a placeholder: depth unknown)
            depth, family = -1 if placeholder else 0, None
        else:  # the parent was never seen (stored before we attached) or is gone: name the family after it
            depth, family = -1, self._family(parent, toks, 0, bs)
        lora = ev.lora_id
        meta = event_meta(ev)
        counts = self._family_blocks
        for i, h in enumerate(hashes):
            if family is None:
                family = self._family(h, toks, i, bs)
            before = g.stored
            pcell = g.store(h, pcell, parent, depth, family, toks, i, t, lora, meta)
            if g.stored != before:  # placed (not a hash already resident, which keeps its own family)
                counts[family] = counts.get(family, 0) + 1
            parent = h
            if depth >= 0:
                depth += 1
        if family is not None and not counts.get(family):  # made for blocks that were all resident already
            self._drop_family(family)

    # -- reading (the window) --------------------------------------------------------------------------
    def sorted_keys(self) -> list[GroupKey]:
        return sorted(self.groups, key=lambda k: (k[0], k[1], _MEDIUM_ORDER.get(k[2], 9), k[2], k[3]))

    def group_label(self, key: GroupKey) -> str:
        src, rank, medium, gidx = key
        g = self.groups.get(key)
        spec = "" if g is None or g.spec is None else "  " + spec_text(*g.spec)
        return f"{self.labels[src]}  rank {rank}  {medium}" + (f"  group {gidx}" if gidx else "") + spec

    def snapshot(self, mode: str = "age", now: float | None = None) -> ClusterSnapshot:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; one of {MODES}")
        now = time.time() if now is None else now
        with self.lock:  # copies only; the codes are worked out after, unlocked
            raw = []
            for key in self.sorted_keys():
                g = self.groups[key]
                raw.append((key, self.group_label(key), len(g), g.block_size, g.a["occ"].astype(bool),
                            g.values(mode, now), g.stored, g.removed, g.removed_unknown, g.restores.summary()))
            act = tuple(SourceActivity(**a) for a in self._act)
            families = len(self.family_tokens)
        top_fams = self._top_families(raw) if mode == "family" else ()
        top = max((codes.peak(r[5], r[4]) for r in raw if r[2]), default=0.0)
        rng = self._ranges.update(mode, top) if mode in codes.LOG_MODES or mode == "depth" else (0.0, 0.0)
        views = tuple(GroupView(key, label, n, bs, codes.to_codes(mode, values, occ, *rng), st, rm, ru, rs)
                      for key, label, n, bs, occ, values, st, rm, ru, rs in raw)
        return ClusterSnapshot(now, mode, views, act, families, rng, top_fams)

    def _top_families(self, raw, k: int = 6) -> tuple:
        """The k families with the most resident blocks (all groups), with their root's first tokens."""
        ids = [r[5][r[4]].astype(np.int64) for r in raw if r[2]]
        if not ids:
            return ()
        fams, counts = np.unique(np.concatenate(ids), return_counts=True)
        order = np.argsort(-counts, kind="stable")[:k]
        with self.lock:
            return tuple((int(fams[i]), int(counts[i]), tuple(self.family_text_ids(int(fams[i])))) for i in order)

    def block_info(self, key: GroupKey, cell: int, now: float | None = None) -> dict | None:
        now = time.time() if now is None else now
        with self.lock:
            g = self.groups.get(key)
            info = None if g is None else g.info(cell, now)
            if info is not None and info["family"] in self.family_tokens:
                info["family_tokens"] = self.family_text_ids(info["family"])
            if info is not None:
                info["block_size"] = g.block_size
            return info

    def event_times(self) -> dict[str, np.ndarray]:
        """The latest (up to _Ring.SIZE) GPU block lifetimes, idle-before-evict and reuse gaps, in seconds."""
        with self.lock:
            return {k: r.values() for k, r in self.rings.items()}

    def activity(self) -> tuple[SourceActivity, ...]:
        with self.lock:
            return tuple(SourceActivity(**a) for a in self._act)

    def take_notes(self) -> list[tuple[float, str, str]]:
        out = []
        while True:
            try:
                out.append(self.notes.popleft())
            except IndexError:
                return out
