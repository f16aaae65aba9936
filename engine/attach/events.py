"""KV cache events as vLLM and SGLang publish them, decoded tolerantly from msgpack.

The publishers encode `KVEventBatch{ts, events, data_parallel_rank}` with msgspec: tagged structs, either
array-like (`["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, ...]`, SGLang and vLLM up to
0.10) or maps (`{"type": "BlockStored", "block_hashes": ...}`, newer vLLM). Fields were added over versions
(medium, lora_name, extra_keys, group_idx, kv_cache_spec_*), trailing defaults are omitted, and a block hash is
an int (SGLang, older vLLM) or bytes (vLLM's sha256 hashes). So: fields by position or by name, anything
extra ignored, anything optional missing defaulted. A batch whose outer shape is wrong raises DecodeError (the
caller counts the frame as malformed and skips it); one bad event inside a good batch is counted and skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import msgspec

# Positional fields after the tag, in the order vLLM's msgspec structs declare them.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_BATCH_FIELDS = ("ts", "events", "data_parallel_rank")
_RANK_KEYS = ("data_parallel_rank", "attn_dp_rank", "dp_rank")
_TAG_KEYS = ("type", "tag", "kind")
MEDIUM_GPU = "GPU"
KIND_STORED, KIND_REMOVED, KIND_CLEARED = 0, 1, 2

BlockHash = int | bytes  # the tolerant path also takes a str


class DecodeError(ValueError):
    """A frame that is not an event batch at all."""


# The event types are msgspec structs declared like vLLM's, so a well-formed batch decodes in C (the fast
# path); their array-like and map twins share the fields. Anything the typed decode refuses goes through the
# tolerant path below, which builds the same structs.
class _StoredFields(msgspec.Struct, gc=False):
    KIND: ClassVar[int] = KIND_STORED
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: Any = msgspec.field(default_factory=list)  # a list, or msgspec.Raw (decoded only for a tooltip)
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None  # None: GPU (before vLLM named media, every event was about the GPU pool)
    lora_name: str | None = None
    extra_keys: Any = None
    group_idx: int | None = None


class _RemovedFields(msgspec.Struct, gc=False):
    KIND: ClassVar[int] = KIND_REMOVED
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class _ClearedFields(msgspec.Struct, gc=False):
    KIND: ClassVar[int] = KIND_CLEARED


class BlockStored(_StoredFields, array_like=True, tag="BlockStored"):
    token_ids: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"\x90"))


class BlockRemoved(_RemovedFields, array_like=True, tag="BlockRemoved"):
    pass


class AllBlocksCleared(_ClearedFields, array_like=True, tag="AllBlocksCleared"):
    pass


class _MapStored(_StoredFields, tag="BlockStored"):
    token_ids: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"\x90"))


class _MapRemoved(_RemovedFields, tag="BlockRemoved"):
    pass


class _MapCleared(_ClearedFields, tag="AllBlocksCleared"):
    pass


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class _MapBatch(msgspec.Struct, gc=False):
    ts: float
    events: list[_MapStored | _MapRemoved | _MapCleared]
    data_parallel_rank: int | None = None
    attn_dp_rank: int | None = None  # SGLang's name for it
    dp_rank: int | None = None


_ARRAY = msgspec.msgpack.Decoder(_ArrayBatch)
_MAP = msgspec.msgpack.Decoder(_MapBatch)

Event = Any  # BlockStored | BlockRemoved | AllBlocksCleared, array-like or map twins: dispatch on .KIND


def medium_of(ev) -> str:
    m = ev.medium
    return MEDIUM_GPU if m is None else m if m in ("GPU", "CPU", "DISK") else m.upper()


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list
    data_parallel_rank: int | None = None
    bad_events: int = 0  # events of a known kind whose fields made no sense: skipped
    unknown_events: int = 0  # events of a kind this version does not know: skipped
    notes: list[str] = field(default_factory=list)  # why events were skipped (the first few)


def _hash(v) -> BlockHash:
    if isinstance(v, bool) or not isinstance(v, (int, bytes, str)):
        raise ValueError(f"a block hash must be an int or bytes, got {type(v).__name__}")
    return v


def _medium(v) -> str | None:
    if v is not None and not isinstance(v, str):
        raise ValueError(f"medium must be a string, got {type(v).__name__}")
    return v


def _int_or_none(v, name: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an int, got {type(v).__name__}")
    return v


def _fields(raw, names: tuple[str, ...]) -> dict:
    if isinstance(raw, (list, tuple)):
        return dict(zip(names, raw[1:]))
    return raw


def _stored(f: dict) -> BlockStored:
    hashes = f.get("block_hashes")
    if not isinstance(hashes, (list, tuple)) or not hashes:
        raise ValueError("BlockStored without block_hashes")
    tokens = f.get("token_ids") or []
    if not isinstance(tokens, (list, tuple)) or not all(isinstance(t, int) for t in tokens):
        raise ValueError("token_ids must be a list of ints")
    parent = f.get("parent_block_hash")
    bs = _int_or_none(f.get("block_size"), "block_size")
    return BlockStored([_hash(h) for h in hashes], None if parent is None else _hash(parent), list(tokens), bs or 0,
                       _int_or_none(f.get("lora_id"), "lora_id"), _medium(f.get("medium")),
                       group_idx=_int_or_none(f.get("group_idx"), "group_idx"))


def _removed(f: dict) -> BlockRemoved:
    hashes = f.get("block_hashes")
    if not isinstance(hashes, (list, tuple)):
        raise ValueError("BlockRemoved without block_hashes")
    return BlockRemoved([_hash(h) for h in hashes], _medium(f.get("medium")),
                        _int_or_none(f.get("group_idx"), "group_idx"))


def decode_event(raw):
    """One event, or None for a kind this decoder does not know. Raises ValueError for a known kind whose
    fields are unusable."""
    if isinstance(raw, (list, tuple)):
        tag = raw[0] if raw else None
    elif isinstance(raw, dict):
        tag = next((raw[k] for k in _TAG_KEYS if k in raw), None)
    else:
        raise ValueError(f"an event must be an array or a map, got {type(raw).__name__}")
    if isinstance(tag, bytes):
        tag = tag.decode("utf-8", "replace")
    if tag == "BlockStored":
        return _stored(_fields(raw, _STORED_FIELDS))
    if tag == "BlockRemoved":
        return _removed(_fields(raw, _REMOVED_FIELDS))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _tolerant(payload: bytes) -> EventBatch:
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several kinds (ExtraData, FormatError, StackError, ValueError ...)
        raise DecodeError(f"not msgpack ({type(e).__name__})") from None
    if isinstance(obj, (list, tuple)):
        f = dict(zip(_BATCH_FIELDS, obj))
    elif isinstance(obj, dict):
        f = obj
    else:
        raise DecodeError(f"a batch must be an array or a map, got {type(obj).__name__}")
    ts, events = f.get("ts"), f.get("events")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not isinstance(events, (list, tuple)):
        raise DecodeError("a batch needs a numeric ts and a list of events")
    rank = next((f[k] for k in _RANK_KEYS if k in f), None)
    if isinstance(rank, bool) or not isinstance(rank, (int, type(None))):
        rank = None
    out = EventBatch(float(ts), [], rank)
    for raw in events:
        try:
            ev = decode_event(raw)
        except (ValueError, TypeError, UnicodeDecodeError) as e:
            out.bad_events += 1
            if len(out.notes) < 3:
                out.notes.append(str(e))
            continue
        if ev is None:
            out.unknown_events += 1
        else:
            out.events.append(ev)
    return out


def decode_batch(payload: bytes) -> EventBatch:
    """A KVEventBatch from its msgpack bytes. DecodeError when the bytes are not msgpack or not a batch."""
    first = payload[0] if payload else 0
    dec = _ARRAY if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD) else \
        _MAP if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF) else None
    if dec is not None:
        try:
            b = dec.decode(payload)
            rank = b.data_parallel_rank
            if rank is None and dec is _MAP:
                rank = b.attn_dp_rank if b.attn_dp_rank is not None else b.dp_rank
            return EventBatch(b.ts, b.events, rank)
        except (msgspec.ValidationError, msgspec.DecodeError):
            pass  # an unknown event kind, a field of another type, a field name we do not know: go slowly
    return _tolerant(payload)


# -- encoding, for the fake publisher and the tests -----------------------------------------------------------

def _event_fields(ev: Event, flavor: str) -> tuple[str, list[tuple[str, object]]]:
    if ev.KIND == KIND_STORED:
        fs = [("block_hashes", ev.block_hashes), ("parent_block_hash", ev.parent_block_hash),
              ("token_ids", ev.token_ids), ("block_size", ev.block_size), ("lora_id", ev.lora_id)]
        if flavor != "sglang":
            fs += [("medium", ev.medium), ("lora_name", None)]
            if ev.group_idx:
                fs += [("extra_keys", None), ("group_idx", ev.group_idx)]
        return "BlockStored", fs
    if ev.KIND == KIND_REMOVED:
        fs = [("block_hashes", ev.block_hashes)]
        if flavor != "sglang":
            fs.append(("medium", ev.medium))
            if ev.group_idx:
                fs.append(("group_idx", ev.group_idx))
        return "BlockRemoved", fs
    return "AllBlocksCleared", []


def encode_batch(ts: float, events: list[Event], rank: int | None = None, *, encoding: str = "array",
                 flavor: str = "vllm", extra_field: bool = False) -> bytes:
    """msgpack bytes as vLLM (array-like up to 0.10, maps after) or SGLang (array-like) would send them.
    extra_field adds a field no decoder knows, as a newer publisher would."""
    evs = []
    for ev in events:
        tag, fs = _event_fields(ev, flavor)
        if extra_field:  # after every field this decoder knows, as a newer struct would append it
            known = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS if tag == "BlockRemoved" else ()
            have = {k for k, _ in fs}
            fs = fs + [(k, None) for k in known if k not in have] + [("future_field", 7)]
        evs.append([tag] + [v for _, v in fs] if encoding == "array" else {"type": tag, **dict(fs)})
    if encoding == "array":
        batch = [ts, evs] + ([rank] if rank is not None else [])
    else:
        batch = {"ts": ts, "events": evs}
        if rank is not None:
            batch["data_parallel_rank"] = rank
    return msgpack.packb(batch, use_bin_type=True)
