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


def event_problem(ev) -> str | None:
    """Why one decoded event cannot be applied, or None. AllBlocksCleared has no fields to check."""
    kind = ev.KIND
    if kind not in (KIND_STORED, KIND_REMOVED):
        return None
    hashes = ev.block_hashes
    if not isinstance(hashes, list) or len(hashes) > MAX_BLOCKS_PER_EVENT:
        return "block_hashes is not a list of at most 1M hashes"
    if kind == KIND_STORED and not hashes:
        return "BlockStored without block hashes"
    for h in hashes:
        p = _hash_problem(h)
        if p:
            return p
    m = ev.medium
    if m is not None and (not isinstance(m, str) or not 0 < len(m) <= MAX_MEDIUM_CHARS):
        return f"medium {str(m)[:40]!r} is not a name of at most {MAX_MEDIUM_CHARS} characters"
    p = _int_in(ev.group_idx, "group_idx", 0, MAX_GROUP_IDX)
    if p or kind == KIND_REMOVED:
        return p
    if ev.parent_block_hash is not None:
        p = _hash_problem(ev.parent_block_hash)
        if p:
            return "parent: " + p
    return (_int_in(ev.lora_id, "lora_id", 0, MAX_LORA_ID)
            or _int_in(ev.block_size, "block_size", 0, MAX_BLOCK_SIZE))
