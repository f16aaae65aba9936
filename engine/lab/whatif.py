"""What a change would buy: the access stream a recorded trace implies, and the curves the window draws.

`stream_of` turns an AccessTrace into the stream the curves replay: which key each read names, when, and
whether it counts. A block is named by its contents where the trace recorded its sequence's tokens (`prefix_keys`:
a hash of its tokens and every token before it, one key where the prefix cache's chained hash has one block): a block evicted and recomputed
later is then the same block, so a larger cache is credited with the hit it would have had. Where the tokens are
not known (an old trace, a block not yet full) a block is named by its serial.

Which reads count, as in the policy lab: the first read of each block by each sequence (a sequence's later reads
of its own blocks hit under any policy; the engine pins them). `recency="every"` lets every read move its block
to the front of the LRU stack (as the engine's LRU orders blocks by their last read), counting only first reads;
`recency="first"` replays first reads alone (the policy lab's stream).

`rebin` re-cuts the recorded token stream at another block size (8, 16, 32, 64): each recorded read of a
sequence's table at the recorded size becomes a read of the blocks covering the same tokens at the new one.
`threshold_curve` is the hit rate at one capacity against the demotion threshold (a block idle longer than
`demote_after_s` is on the host tier when read: a device miss). `block_stream` is the stream of a published
block-hash trace (engine/workloads/public_traces.py reads them; the two packages may not import each other, so
this takes its requests by their fields). `real_hit_rate` measures on a run what the curves predict.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from engine.kv.access_trace import AccessTrace
from engine.kv.tiers import chain_hash
from engine.lab.mrc import MIN_CURVE_POINTS, Curve, curve_capacities, lru_curve, sampled_curve, stack_distances

BLOCK_SIZES = (8, 16, 32, 64)
_MASK63 = (1 << 63) - 1


@dataclass(frozen=True)
class Stream:
    """The accesses a curve replays. keys: int64 (content hash >= 0, or -1 - serial); counted: the reads the hit
    rate is over; block_size: tokens per block (None: unknown)."""
    keys: np.ndarray
    times: np.ndarray
    counted: np.ndarray
    block_size: int | None
    content: bool  # keys are contents (tokens were recorded), not serials
    fresh: np.ndarray | None = None  # reads that miss at every capacity (a block its reader computes); None: none

    def misses_anyway(self) -> np.ndarray:
        return np.zeros(len(self.keys), dtype=bool) if self.fresh is None else self.fresh

    @functools.cached_property
    def distinct(self) -> int:
        return int(len(np.unique(self.keys)))


def block_hashes(tokens: np.ndarray, block_size: int) -> np.ndarray:
    """The chained hash of every full block of a token list (as the prefix cache computes them), as int64 >= 0."""
    out = np.empty(len(tokens) // block_size, dtype=np.int64)
    h = 0
    for j in range(len(out)):
        h = chain_hash(h, tokens[j * block_size:(j + 1) * block_size])
        out[j] = h & _MASK63
    return out


_P = 0x9E3779B97F4A7C15  # odd: invertible modulo 2^64
_P_INV = pow(_P, -1, 1 << 64)


def prefix_keys(tokens: np.ndarray, block_size: int) -> np.ndarray:
    """A content key for every full block of a token list, as int64 >= 0: a hash of the block's tokens and every
    token before it, so two sequences' blocks get one key exactly where block_hashes (the prefix cache's chained
    hash) gives them one (up to a 2^-63 chance of a collision). See `_prefix_keys_of`."""
    flat, _, _ = _prefix_keys_of([np.asarray(tokens)], block_size)
    return flat


def _prefix_keys_of(lists: list, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`prefix_keys` of many token lists at once: (keys end to end, each list's first key's index, its count).
    The polynomial hash of each prefix, H = sum_k (token_k + 1) · P^(e-k) mod 2^64 over a list's tokens before
    block end e; over the lists laid end to end (global index g, a list starting at a) it is
    P^e_g · (S(e_g - 1) - S(a - 1)) with S the running sum of (token + 1) · P^-g: one pass for every list. Then
    splitmix64's finaliser, so every token bit reaches every key bit."""
    lens = np.array([len(x) // block_size for x in lists], dtype=np.int64)
    offs = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)
    if not lens.sum():
        return np.zeros(0, dtype=np.int64), offs, lens
    toks = np.concatenate([np.asarray(x, dtype=np.int64).ravel() for x in lists])
    starts = np.concatenate(([0], np.cumsum([len(x) for x in lists])[:-1])).astype(np.int64)
    n = len(toks)
    with np.errstate(over="ignore"):
        inv = np.full(n, _P_INV, dtype=np.uint64)
        inv[0] = 1
        run = np.concatenate(([np.uint64(0)], np.cumsum((toks.view(np.uint64) + np.uint64(1)) *
                                                        np.cumprod(inv, dtype=np.uint64), dtype=np.uint64)))
        pw = np.full(n + 1, _P, dtype=np.uint64)
        pw[0] = 1
        pw = np.cumprod(pw, dtype=np.uint64)
        owner = np.repeat(np.arange(len(lists)), lens)
        local = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(offs, lens)
        ends = starts[owner] + (local + 1) * block_size  # global index just past each block
        h = pw[ends] * (run[ends] - run[starts[owner]])
        h ^= h >> np.uint64(31)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(27)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(31)
    return (h >> np.uint64(1)).astype(np.int64), offs, lens


def _first_of_pairs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """True at the first occurrence of each (a, b) pair, in order."""
    n = len(a)
    order = np.lexsort((np.arange(n), b, a))
    first = np.ones(n, dtype=bool)
    first[1:] = (a[order][1:] != a[order][:-1]) | (b[order][1:] != b[order][:-1])
    out = np.zeros(n, dtype=bool)
    out[order[first]] = True
    return out


def _positions(trace: AccessTrace) -> np.ndarray:
    """Each row's block index in its sequence: recorded (a window group's rows start at its table's base), or,
    in a trace from before positions, rebuilt as the index in its chunk (one sequence's table read at one time)."""
    if trace.pos is not None:
        return trace.pos.astype(np.int64)
    n = len(trace)
    start = np.ones(n, dtype=bool)
    start[1:] = (trace.seq[1:] != trace.seq[:-1]) | (trace.t[1:] != trace.t[:-1])
    idx = np.arange(n)
    return idx - np.maximum.accumulate(np.where(start, idx, 0))


def _chunk_starts(seq: np.ndarray, t: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Where each chunk (one read of a sequence's table: the same sequence and time, consecutive blocks) starts."""
    start = np.ones(len(seq), dtype=bool)
    start[1:] = (seq[1:] != seq[:-1]) | (t[1:] != t[:-1]) | (pos[1:] != pos[:-1] + 1)
    return np.flatnonzero(start)


def groups_of(trace: AccessTrace) -> list[int]:
    """The KV-cache groups with rows in `trace` ([0] for a trace from before groups)."""
    if trace.group is None or not len(trace):
        return [0]
    return [int(g) for g in np.unique(trace.group)]


def _rows(trace: AccessTrace, group: int | None) -> np.ndarray:
    if group is None or trace.group is None:
        return np.arange(len(trace))
    return np.flatnonzero(trace.group == group)


def _content_keys(seq: np.ndarray, pos: np.ndarray, fallback: np.ndarray, tokens: dict[int, np.ndarray],
                  block_size: int) -> np.ndarray:
    """Content key of each (seq, pos) where the sequence's tokens fill that block, else `fallback`. One pass over
    the rows: each sequence's block hashes laid end to end, a row's found at its sequence's offset + pos."""
    keys = fallback.copy()
    if not len(seq):
        return keys
    useq, inv = np.unique(seq, return_inverse=True)
    inv = inv.ravel()
    empty = np.zeros(0, np.int64)
    flat, offs, lens = _prefix_keys_of([tokens.get(int(s), empty) for s in useq], block_size)
    ok = (pos >= 0) & (pos < lens[inv])
    keys[ok] = flat[offs[inv[ok]] + pos[ok]]
    return keys


def _one_key_per_block(serial: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Every read of a block under one key: its contents' where any read of it has one (a block being filled is
    read while partial, under its serial, and later full), else its serial's. Two keys for one block would hold
    two places in a simulated cache that the engine's block holds once."""
    has = np.flatnonzero(keys >= 0)[::-1]  # newest first: np.unique's first index is then the newest
    if not len(has):
        return keys
    u, first = np.unique(serial[has], return_index=True)
    content = keys[has][first]
    at = np.minimum(np.searchsorted(u, serial), len(u) - 1)
    found = u[at] == serial
    out = keys.copy()
    out[found] = content[at[found]]
    return out


def _written_here(seq: np.ndarray, serial: np.ndarray | None, pos: np.ndarray, counted: np.ndarray,
                  trace: AccessTrace, block_size: int) -> np.ndarray:
    """The counted reads that miss at every capacity: a block past its sequence's prompt (some of its tokens
    generated) is computed by that sequence, so no cache of any size has it at the sequence's first read, even where
    an earlier sequence generated the same tokens (the engine looks up prompts, whole blocks of them). The read
    still moves the block in the cache's order (it is written there); its later reads keep their outcome."""
    here = counted & _past_prompt(trace, seq, pos, block_size)
    if serial is not None:  # and it is the block's first read (a fork's read of a block it shares is not)
        here &= _first_of_pairs(np.zeros(len(serial), dtype=np.int64), serial)
    return here


def _past_prompt(trace: AccessTrace, seq: np.ndarray, pos: np.ndarray, block_size: int) -> np.ndarray:
    """True where block `pos` of the sequence holds a token past its prompt (False where the prompt is unknown)."""
    if not len(seq):
        return np.zeros(0, dtype=bool)
    prompt = dict(zip(trace.tok_seq.tolist(), trace.tok_prompt.tolist()))
    useq, inv = np.unique(seq, return_inverse=True)
    plen = np.array([prompt.get(int(s), 1 << 40) for s in useq], dtype=np.int64)[inv.ravel()]
    return (pos + 1) * block_size > plen


def stream_of(trace: AccessTrace, recency: str = "every", group: int | None = 0) -> Stream:
    """The stream of `trace` (one KV-cache group's rows; None: every row) at its recorded block size."""
    if recency not in ("every", "first"):
        raise ValueError(f"recency must be 'every' or 'first', got {recency!r}")
    rows = _rows(trace, group)
    seq, serial, t = trace.seq[rows].astype(np.int64), trace.block[rows], trace.t[rows]
    pos = _positions(trace)[rows]
    keys = -1 - serial
    tokens = trace.token_lists()
    content = bool(tokens) and trace.block_size is not None
    counted = _first_of_pairs(seq, serial)
    if content:
        keys = _one_key_per_block(serial, _content_keys(seq, pos, keys, tokens, trace.block_size))
    fresh = _written_here(seq, serial, pos, counted, trace, trace.block_size) if content and \
        trace.tok_prompt is not None else None
    if recency == "first":
        return Stream(keys[counted], t[counted], np.ones(int(counted.sum()), dtype=bool), trace.block_size, content,
                      None if fresh is None else fresh[counted])
    return Stream(keys, t, counted, trace.block_size, content, fresh)


def rebin(trace: AccessTrace, block_size: int, recency: str = "every", group: int = 0) -> Stream:
    """The stream `trace`'s recorded tokens would make at another block size: each chunk (a sequence's table
    read at once, blocks a .. b at the recorded size) covers tokens a x size .. (b + 1) x size (at most the
    sequence's length), read as the blocks of `block_size` that hold them (a window group's table starts where
    its first visible block does). Needs a trace with tokens (`generate --record-trace`)."""
    tokens = trace.token_lists()
    if not tokens or trace.block_size is None:
        raise ValueError("this trace has no recorded tokens (record it again with this version): "
                         "a block size can only be re-cut from the tokens")
    if not 1 <= block_size <= 65536:
        raise ValueError(f"block size must be 1 .. 65,536, got {block_size}")
    sel = _rows(trace, group)
    seq, t, pos = trace.seq[sel].astype(np.int64), trace.t[sel], _positions(trace)[sel]
    start = _chunk_starts(seq, t, pos)
    ends = np.append(start[1:], len(seq))
    bs0 = trace.block_size
    cseq, ct = seq[start], t[start]
    lo_tok = pos[start] * bs0
    hi_tok = np.array([min(int(p + 1) * bs0, len(tokens.get(int(s), ()))) or int(p + 1) * bs0
                       for s, p in zip(cseq, pos[ends - 1])], dtype=np.int64)
    first = lo_tok // block_size
    newm = np.maximum(-(-hi_tok // block_size) - first, 1)
    rseq = np.repeat(cseq, newm)
    rt = np.repeat(ct, newm)
    rpos = np.concatenate([np.arange(f, f + m, dtype=np.int64) for f, m in zip(first, newm)]) if len(newm) else \
        np.zeros(0, np.int64)
    # A block no full-block hash names (the tail, or an unrecorded sequence): its own key per (sequence, position).
    fallback = -1 - (rseq * (1 << 24) + rpos)
    keys = _content_keys(rseq, rpos, fallback, tokens, block_size)
    counted = _first_of_pairs(rseq, rpos)
    fresh = _written_here(rseq, None, rpos, counted, trace, block_size) if trace.tok_prompt is not None else None
    if recency == "first":
        return Stream(keys[counted], rt[counted], np.ones(int(counted.sum()), dtype=bool), block_size, True,
                      None if fresh is None else fresh[counted])
    return Stream(keys, rt, counted, block_size, True, fresh)


def block_stream(requests: list, merge: int = 1, outputs: bool = True) -> Stream:
    """The access stream of a block-hash trace (engine/workloads/public_traces.py BlockRequest: t_s, hash_ids,
    input_length, output_length, block_tokens): each request reads its hash_ids'
    blocks at its time, then (outputs) the blocks its generated tokens fill, new and read once. merge=k cuts at
    k times the trace's block size: a block is k consecutive ids (a prefix of ids names its block, so the
    k-tuple is hashed); a request's last, partial group is its own. Every access counts (each is one
    request's first read of a block)."""
    if merge < 1:
        raise ValueError(f"merge must be >= 1, got {merge}")
    keys: list[int] = []
    times: list[float] = []
    fresh = 0
    for r in requests:
        ids = r.hash_ids
        full = len(ids) // merge
        for j in range(full):
            group = ids[j * merge:(j + 1) * merge]
            keys.append(group[0] if merge == 1 else hash(group) & _MASK63)
        n_read = full
        if len(ids) % merge:
            fresh += 1
            keys.append(-fresh)
            n_read += 1
        if outputs:
            total = math.ceil((r.input_length + r.output_length) / (r.block_tokens * merge))
            for _ in range(max(total - n_read, 0)):
                fresh += 1
                keys.append(-fresh)
                n_read += 1
        times.extend([r.t_s] * n_read)
    k = np.asarray(keys, dtype=np.int64)
    return Stream(k, np.asarray(times, dtype=np.float64), np.ones(len(k), dtype=bool),
                  requests[0].block_tokens * merge if requests else None, True)


# -- the curves -------------------------------------------------------------------------------------------

def policy_curves(stream: Stream, capacities=None, policies=("lru", "heat", "s3fifo"), decay: float = 0.9,
                  seed: int = 0) -> list[Curve]:
    """LRU exact (Mattson), heat and S3-FIFO by SHARDS-sampled simulation, at >= 32 capacities.

    Heat and S3-FIFO are fed the counted reads only (the policy lab's stream: S3-FIFO counts a hit per
    request's read, as the engine's does); LRU moves a block on every read of the stream."""
    caps = curve_capacities(stream.distinct) if capacities is None else np.asarray(capacities, dtype=np.int64)
    # The simulated policies cost a simulation per capacity: MIN_CURVE_POINTS of them, spread over the same range.
    few = caps if len(caps) <= MIN_CURVE_POINTS else \
        caps[np.unique(np.linspace(0, len(caps) - 1, MIN_CURVE_POINTS).round().astype(int))]
    out = []
    for p in policies:
        if p == "lru":
            out.append(lru_curve(stream.keys, caps, stream.counted, fresh=stream.fresh))
        else:
            c = stream.counted
            out.append(sampled_curve(stream.keys[c], stream.times[c], few, p, decay=decay, seed=seed,
                                     fresh=None if stream.fresh is None else stream.fresh[c]))
    return out


def block_size_curves(trace: AccessTrace, mib_per_token: float, sizes=BLOCK_SIZES, recency: str = "every",
                      points: int = 40, group: int = 0) -> list[tuple[int, np.ndarray, Curve]]:
    """LRU curve per block size, each with its capacities in MiB (blocks x size x mib_per_token): the same
    bytes hold half as many blocks at twice the size. [(block size, MiB per point, curve)]."""
    out = []
    for b in sizes:
        s = rebin(trace, b, recency, group)
        caps = curve_capacities(s.distinct, points)
        c = lru_curve(s.keys, caps, s.counted, fresh=s.fresh)
        out.append((b, caps * b * mib_per_token, c))
    return out


def threshold_curve(stream: Stream, capacity: int, thresholds) -> np.ndarray:
    """LRU hit rate at `capacity` if a block idle longer than each threshold (seconds) were demoted first: a
    counted read hits iff its stack distance < capacity and its block was read within the threshold."""
    d = stack_distances(stream.keys)
    order = np.argsort(stream.keys, kind="stable")
    ks = stream.keys[order]
    gap = np.full(len(d), np.inf)
    same = ks[1:] == ks[:-1]
    gap[order[1:][same]] = stream.times[order[1:][same]] - stream.times[order[:-1][same]]
    c = stream.counted
    hit = (d >= 0) & (d < capacity) & ~stream.misses_anyway()
    total = int(c.sum())
    if not total:
        return np.full(len(thresholds), np.nan)
    return np.array([np.count_nonzero(c & hit & (gap <= th)) / total for th in thresholds])


def real_hit_rate(trace: AccessTrace, group: int | None = 0) -> tuple[float, int]:
    """What the curves predict, measured on a run: over the first read of each block by each sequence, the share
    that found the block already computed (an earlier read of the same serial) and on the device tier. One
    KV-cache group's rows (serials are per pool); None: every row. Returns (rate, counted reads)."""
    rows = _rows(trace, group)
    seq, serial = trace.seq[rows].astype(np.int64), trace.block[rows]
    counted = _first_of_pairs(seq, serial)
    seen_before = ~_first_of_pairs(np.zeros(len(serial), dtype=np.int64), serial)
    hit = counted & seen_before & (trace.tier[rows] == 0)
    n = int(counted.sum())
    return (float(hit.sum() / n) if n else float("nan")), n
