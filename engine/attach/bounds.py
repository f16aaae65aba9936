"""The ranges every field must be in before an event is applied to the block tables or recorded.

The decoder says what a field is (an int, a string ...); this says whether the value can be used: a LoRA id
goes into an int32 column, a rank into the recording's int32 column and a group key, a block size into slice
arithmetic, a medium and a KV-cache group name a map of their own. An event with a field out of range is
skipped and counted as bad (with the reason in a note), never half-applied; the others of its batch are applied.
The counts of groups are bounded too, so a peer cannot make thousands of maps (each at least 1,024 cells).
"""

from __future__ import annotations

import math

from engine.attach.events import KIND_REMOVED, KIND_STORED

MAX_RANK = 4095  # data-parallel ranks (vLLM and SGLang number them from 0; thousands is already absurd)
MAX_GROUP_IDX = 255  # KV-cache groups of one model (hybrid models have a handful)
MAX_LORA_ID = (1 << 31) - 1  # an int32 column; -1 there means "no LoRA"
MAX_BLOCK_SIZE = 1 << 20  # tokens per block
MAX_HASH_BYTES = 256  # a bytes / str block hash (vLLM's sha256 hashes are 32 bytes)
MAX_MEDIUM_CHARS = 32
MAX_BLOCKS_PER_EVENT = 1 << 20
MAX_GROUPS = 1024  # block tables in one session, all sources together
MAX_GROUPS_PER_SOURCE = 128  # ranks x media x KV-cache groups of one endpoint
MAX_SOURCES = 4096
_I64 = (-(1 << 63), (1 << 64) - 1)  # an int hash: signed (SGLang) or unsigned (older vLLM) 64-bit
MAX_TS = 1e11  # seconds since the epoch (the year 5138): a batch time past it is not a time


def batch_problem(ts, rank) -> str | None:
    """Why a whole batch cannot be applied (its time or rank is unusable), or None."""
    if not isinstance(ts, (int, float)) or not math.isfinite(ts) or not -MAX_TS < ts < MAX_TS:
        return f"batch time {ts!r} is not a finite time in seconds"
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= MAX_RANK:
        return f"data_parallel_rank {rank!r} is not in 0..{MAX_RANK}"
    return None


def _hash_problem(h) -> str | None:
    if isinstance(h, int) and not isinstance(h, bool):
        return None if _I64[0] <= h <= _I64[1] else f"block hash {h} is not a 64-bit integer"
    if isinstance(h, (bytes, str)):
        return None if len(h) <= MAX_HASH_BYTES else f"a {len(h):,}-byte block hash (at most {MAX_HASH_BYTES})"
    return f"a block hash of type {type(h).__name__}"


def _int_in(v, name: str, lo: int, hi: int) -> str | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        return f"{name} {v!r} is not in {lo}..{hi:,}"
    return None


def _bad_hashes(hashes) -> str | None:
    lo, hi = _I64
    for h in hashes:  # the hot loop of the check: plain type tests, no calls
        c = h.__class__
        if c is int:
            if lo <= h <= hi:
                continue
        elif (c is bytes or c is str) and len(h) <= MAX_HASH_BYTES:
            continue
        return _hash_problem(h) or f"block hash {h!r:.40}"
    return None


def event_problem(ev) -> str | None:
    """Why one decoded event cannot be applied, or None. AllBlocksCleared has no fields to check. Called for
    every event, so the common case is a handful of comparisons and one call."""
    kind = ev.KIND
    if kind != KIND_STORED and kind != KIND_REMOVED:
        return None
    hashes = ev.block_hashes
    if hashes.__class__ is not list or len(hashes) > MAX_BLOCKS_PER_EVENT:
        return "block_hashes is not a list of at most 1M hashes"
    if kind == KIND_STORED and not hashes:
        return "BlockStored without block hashes"
    p = _bad_hashes(hashes)
    if p:
        return p
    m, g = ev.medium, ev.group_idx
    if m is not None and (m.__class__ is not str or not 0 < len(m) <= MAX_MEDIUM_CHARS):
        return f"medium {str(m)[:40]!r} is not a name of at most {MAX_MEDIUM_CHARS} characters"
    if g is not None and (g.__class__ is not int or not 0 <= g <= MAX_GROUP_IDX):
        return _int_in(g, "group_idx", 0, MAX_GROUP_IDX)
    if kind == KIND_REMOVED:
        return None
    parent, lora, bs = ev.parent_block_hash, ev.lora_id, ev.block_size
    if parent is not None:
        p = _bad_hashes((parent,))
        if p:
            return "parent: " + p
    if lora is not None and (lora.__class__ is not int or not 0 <= lora <= MAX_LORA_ID):
        return _int_in(lora, "lora_id", 0, MAX_LORA_ID)
    if bs is not None and (bs.__class__ is not int or not 0 <= bs <= MAX_BLOCK_SIZE):
        return _int_in(bs, "block_size", 0, MAX_BLOCK_SIZE)
    return None
