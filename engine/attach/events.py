"""KV cache events as vLLM and SGLang publish them, decoded from msgpack: typed in C where the shape is known,
tolerantly otherwise.

The publishers encode `KVEventBatch{ts, events, data_parallel_rank}` with msgspec. The batch is array-like
(`[ts, events, rank]`). Today's events (vLLM 0.11 on, 0.33 checked; SGLang 0.5) are tag-keyed maps with the
fields left at their defaults omitted (`{"type": "BlockStored", "block_hashes": [...], ...}`); older ones are
array-like (`["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, ...]`, vLLM up to 0.10).
Fields were added over versions (medium, lora_name, extra_keys, group_idx, kv_cache_spec_*, locality,
ownership, session_id, lookahead_token_ids; SGLang's cache_salt), a block hash is an int (SGLang's signed
int64, vLLM's uint64 with int hashes) or bytes (vLLM's sha256), SGLang names media GPU / CPU_PINNED / DISK /
EXTERNAL, and an EAGLE "bigram" page's token_ids are (token, next token) pairs. So: fields by position or by
name, anything extra ignored, anything optional missing defaulted. A frame that is not a batch raises
DecodeError and nothing else (the caller counts the frame as malformed and skips it; DecodeError.reason says
why); one bad event inside a good batch is counted and skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import msgspec

_BATCH_FIELDS = ("ts", "events", "data_parallel_rank")
_RANK_KEYS = ("data_parallel_rank", "attn_dp_rank", "dp_rank")
_TAG_KEYS = ("type", "tag", "kind")
_STR_FIELDS = ("lora_name", "kv_cache_spec_kind", "locality", "ownership", "session_id", "cache_salt")
MEDIUM_GPU = "GPU"
KIND_STORED, KIND_REMOVED, KIND_CLEARED = 0, 1, 2
# A frame is refused (DecodeError, reason "too_large") above this many bytes: a batch of one scheduler step is
# kilobytes to a few megabytes (a 128k-token prefill with its token ids is ~0.5 MB), and msgpack bytes
# decode to several times their size in objects.
MAX_FRAME_BYTES = 32 << 20
# What a DecodeError says about the frame (DecodeError.reason), for a subscriber that counts them apart.
REASONS = ("too_large", "too_deep", "not_msgpack", "not_a_batch")

BlockHash = int | bytes  # the tolerant path also takes a str
_NIL = msgspec.Raw(b"\xc0")  # a field the typed path leaves undecoded (msgpack nil: not sent)
_EMPTY = msgspec.Raw(b"\x90")  # an empty token list


class DecodeError(ValueError):
    """A frame that is not an event batch at all; `reason` is one of REASONS."""

    def __init__(self, message: str, reason: str = "not_a_batch"):
        super().__init__(message)
        self.reason = reason


# The event types are msgspec structs declared like the servers', so a well-formed batch decodes in C (the
# fast path); their array-like and map twins share the fields (the union of vLLM 0.33's and SGLang 0.5's).
# Anything the typed decode refuses goes through the tolerant path below, which builds the same structs.
class _StoredFields(msgspec.Struct, gc=False):
    KIND: ClassVar[int] = KIND_STORED
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: Any = msgspec.field(default_factory=list)  # a list, or msgspec.Raw (decoded only for a tooltip)
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None  # None: GPU (before vLLM named media, every event was about the GPU pool)
    lora_name: str | None = None
    extra_keys: Any = None  # per block: LoRA name, (mm id, offset) pairs, cache salt (vLLM); Raw or a list
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None  # vLLM: "full_attention", "sliding_window", "mamba", ...
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None  # vLLM: LOCAL / REMOTE relative to the publisher
    ownership: str | None = None  # vLLM: the secondary offloading tier that generated it
    session_id: str | None = None
    lookahead_token_ids: Any = None  # vLLM: per block, the tokens after it used in its hash
    cache_salt: str | None = None  # SGLang


class _RemovedFields(msgspec.Struct, gc=False):
    KIND: ClassVar[int] = KIND_REMOVED
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _ClearedFields(msgspec.Struct, gc=False):
    KIND: ClassVar[int] = KIND_CLEARED


class BlockStored(_StoredFields, array_like=True, tag="BlockStored"):
    token_ids: msgspec.Raw = _EMPTY
    extra_keys: msgspec.Raw = _NIL
    lookahead_token_ids: msgspec.Raw = _NIL


class BlockRemoved(_RemovedFields, array_like=True, tag="BlockRemoved"):
    pass


class AllBlocksCleared(_ClearedFields, array_like=True, tag="AllBlocksCleared"):
    pass


class _MapStored(_StoredFields, tag="BlockStored"):
    token_ids: msgspec.Raw = _EMPTY
    extra_keys: msgspec.Raw = _NIL
    lookahead_token_ids: msgspec.Raw = _NIL


class _MapRemoved(_RemovedFields, tag="BlockRemoved"):
    pass


class _MapCleared(_ClearedFields, tag="AllBlocksCleared"):
    pass


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):  # vLLM up to 0.10, older SGLang
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class _TaggedBatch(msgspec.Struct, array_like=True, gc=False):  # today's vLLM and SGLang: [ts, events, rank]
    ts: float
    events: list[_MapStored | _MapRemoved | _MapCleared]
    data_parallel_rank: int | None = None  # SGLang calls it attn_dp_rank: the same position


class _MapBatch(msgspec.Struct, gc=False):
    ts: float
    events: list[_MapStored | _MapRemoved | _MapCleared]
    data_parallel_rank: int | None = None
    attn_dp_rank: int | None = None  # SGLang's name for it
    dp_rank: int | None = None


# Positional fields after the tag (array-like events), in the order the structs declare them (vLLM's order).
_STORED_FIELDS = BlockStored.__struct_fields__
_REMOVED_FIELDS = BlockRemoved.__struct_fields__
_ARRAY = msgspec.msgpack.Decoder(_ArrayBatch)
_TAGGED = msgspec.msgpack.Decoder(_TaggedBatch)
_MAP = msgspec.msgpack.Decoder(_MapBatch)

Event = Any  # BlockStored | BlockRemoved | AllBlocksCleared, array-like or map twins: dispatch on .KIND

# The servers' media, by tier. SGLang 0.5: GPU (L1), CPU_PINNED (L2, HiCache's host memory), DISK (L3),
# EXTERNAL (L4, a shared or remote pool such as Mooncake). vLLM: GPU, and the offloading connector's CPU and
# STORAGE (its tier after CPU).
TIERS = {None: "GPU", "GPU": "GPU", "CPU": "CPU", "CPU_PINNED": "CPU", "DISK": "DISK", "STORAGE": "DISK",
         "EXTERNAL": "EXTERNAL"}


def medium_of(ev) -> str:
    m = ev.medium
    t = TIERS.get(m)
    if t is None:
        u = m.upper()
        t = TIERS.get(u) or u[:24]
    return t


def is_placeholder(ev) -> bool:
    """A store that names only hashes (vLLM's offloading connector for chunks it has no metadata for:
    token_ids [], block_size 0, no parent)."""
    return ev.block_size <= 0 and ev.parent_block_hash is None and token_count(ev.token_ids) == 0


_META_STR = ("lora_name", "session_id", "cache_salt", "locality", "ownership")
_MAX_META_CHARS = 200


def event_meta(ev) -> dict | None:
    """What a stored event says beyond the block map's columns, for the tooltip of its blocks (None when it
    says nothing more, as most do): the LoRA's name, the session, SGLang's cache salt, vLLM's locality and
    ownership, the extra hash keys and lookahead tokens (copied: a view would keep the frame alive), and
    whether it is a hash-only placeholder. Strings are cut to 200 characters."""
    m = None
    for k in _META_STR:
        v = getattr(ev, k)
        if v is not None:
            if m is None:
                m = {}
            m[k] = v[:_MAX_META_CHARS] if isinstance(v, str) else str(v)[:_MAX_META_CHARS]
    for k in ("extra_keys", "lookahead_token_ids"):
        v = getattr(ev, k)
        if v is None or (isinstance(v, msgspec.Raw) and _nil_raw(v)):
            continue
        if m is None:
            m = {}
        m[k] = v.copy() if isinstance(v, msgspec.Raw) else v
    if ev.block_size <= 0 and is_placeholder(ev):
        m = m or {}
        m["placeholder"] = True
    elif is_bigram(ev.token_ids):
        m = m or {}
        m["bigram"] = True
    return m


def is_bigram(tokens) -> bool:
    """An EAGLE "bigram" page (SGLang): token ids sent as (token, next token) pairs. Both decode paths leave
    such a page's token ids as msgpack (msgspec.Raw): an array whose first element is an array."""
    if not isinstance(tokens, msgspec.Raw):
        return False
    mv = memoryview(tokens)
    n, b = len(mv), mv[0] if len(mv) else 0
    i = 1 if 0x91 <= b <= 0x9F else 3 if b == 0xDC else 5 if b == 0xDD else 0
    return 0 < i < n and (0x90 <= mv[i] <= 0x9F or mv[i] in (0xDC, 0xDD))


def _nil_raw(v: msgspec.Raw) -> bool:
    return len(v) == 1 and memoryview(v)[0] == 0xC0


def token_count(src) -> int:
    if isinstance(src, msgspec.Raw):
        return 0 if len(src) == 1 and memoryview(src)[0] in (0x90, 0xC0) else -1  # -1: some (not counted here)
    return len(src) if src else 0


def plain(v):
    """A field the typed path left as msgspec.Raw, decoded (None where it was not sent or is unreadable)."""
    if not isinstance(v, msgspec.Raw):
        return v
    try:
        return msgspec.msgpack.decode(v)
    except (msgspec.DecodeError, RecursionError):
        return None


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


def _str_or_none(v, name: str) -> str | None:
    if v is not None and not isinstance(v, str):
        raise ValueError(f"{name} must be a string, got {type(v).__name__}")
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


def _token_ids(tokens):
    """Token ids: ints, or an EAGLE "bigram" page's (token, next token) pairs (SGLang), kept as msgpack as the
    typed path leaves them (block_state.token_list takes the first of each: a page of N bigrams spans N
    tokens and the one after; events.is_bigram says it was one)."""
    if not isinstance(tokens, (list, tuple)):
        raise ValueError("token_ids must be a list")
    if tokens and isinstance(tokens[0], (list, tuple)):
        if not all(isinstance(p, (list, tuple)) and len(p) == 2 and all(type(t) is int for t in p)
                   for p in tokens):
            raise ValueError("token_ids must be a list of ints or of (int, int) pairs")
        return msgspec.Raw(msgspec.msgpack.encode([list(p) for p in tokens]))
    if not all(type(t) is int for t in tokens):
        raise ValueError("token_ids must be a list of ints")
    return list(tokens)


def _stored(f: dict) -> BlockStored:
    hashes = f.get("block_hashes")
    if not isinstance(hashes, (list, tuple)) or not hashes:
        raise ValueError("BlockStored without block_hashes")
    tokens = _token_ids(f.get("token_ids") or [])
    parent = f.get("parent_block_hash")
    bs = _int_or_none(f.get("block_size"), "block_size")
    strs = {k: _str_or_none(f.get(k), k) for k in _STR_FIELDS}
    return BlockStored([_hash(h) for h in hashes], None if parent is None else _hash(parent), tokens, bs or 0,
                       _int_or_none(f.get("lora_id"), "lora_id"), _str_or_none(f.get("medium"), "medium"),
                       extra_keys=f.get("extra_keys"), group_idx=_int_or_none(f.get("group_idx"), "group_idx"),
                       kv_cache_spec_sliding_window=_int_or_none(f.get("kv_cache_spec_sliding_window"),
                                                                 "kv_cache_spec_sliding_window"),
                       lookahead_token_ids=f.get("lookahead_token_ids"), **strs)


def _removed(f: dict) -> BlockRemoved:
    hashes = f.get("block_hashes")
    if not isinstance(hashes, (list, tuple)):
        raise ValueError("BlockRemoved without block_hashes")
    return BlockRemoved([_hash(h) for h in hashes], _str_or_none(f.get("medium"), "medium"),
                        _int_or_none(f.get("group_idx"), "group_idx"), _str_or_none(f.get("locality"), "locality"),
                        _str_or_none(f.get("ownership"), "ownership"))


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
        deep = isinstance(e, (msgpack.StackError, RecursionError))
        raise DecodeError(f"not msgpack ({type(e).__name__})", "too_deep" if deep else "not_msgpack") from None
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


def _first_event_byte(payload: bytes) -> int:
    """In an array batch, the first byte of its first event (0 where the shape is not the expected one): a
    map event is today's layout, an array one the older."""
    try:
        first = payload[0]
        i = 1 if first <= 0x9F else 3 if first == 0xDC else 5
        b = payload[i]  # ts: a float64 as the servers write it, any number otherwise
        i += 9 if b == 0xCB else 5 if b in (0xCA, 0xCE, 0xD2) else 1 if b <= 0x7F or b >= 0xE0 else \
            2 if b in (0xCC, 0xD0) else 3 if b in (0xCD, 0xD1) else 9 if b in (0xCF, 0xD3) else 0
        b = payload[i]  # the events array
        i += 1 if 0x90 <= b <= 0x9F else 3 if b == 0xDC else 5 if b == 0xDD else 0
        return payload[i]
    except IndexError:
        return 0


def _is_map(b: int) -> bool:
    return 0x80 <= b <= 0x8F or b in (0xDE, 0xDF)


def decode_batch(payload: bytes) -> EventBatch:
    """A KVEventBatch from its msgpack bytes. Raises DecodeError (and nothing else) when the frame is not a
    batch: not msgpack, not a batch's shape, larger than MAX_FRAME_BYTES, or nested deeper than the decoders
    go. A batch with a bad or unknown event is decoded without it (counted in the batch)."""
    try:
        n = len(payload)
        if n > MAX_FRAME_BYTES:
            raise DecodeError(f"a {n:,}-byte frame (the limit is {MAX_FRAME_BYTES:,})", "too_large")
        first = payload[0] if n else 0
        if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):
            dec = _TAGGED if _is_map(_first_event_byte(payload)) else _ARRAY
        else:
            dec = _MAP if _is_map(first) else None
        if dec is not None:
            try:
                b = dec.decode(payload)
                rank = b.data_parallel_rank
                if rank is None and dec is _MAP:
                    rank = b.attn_dp_rank if b.attn_dp_rank is not None else b.dp_rank
                return EventBatch(b.ts, b.events, rank)
            except (msgspec.ValidationError, msgspec.DecodeError):
                pass  # an unknown event kind, a field of another type, a bad event: go slowly
        return _tolerant(payload)
    except DecodeError:
        raise
    except RecursionError:
        raise DecodeError("nested deeper than a batch can be", "too_deep") from None
    except Exception as e:  # whatever a hostile frame finds: never out of the decoder (the subscriber would die)
        raise DecodeError(f"not a batch ({type(e).__name__})") from None


# -- encoding, for the fake publisher and the tests (engine/attach/wire.py) -----------------------------------

def encode_batch(ts: float, events: list[Event], rank: int | None = None, *, encoding: str = "tagged",
                 flavor: str = "vllm", extra_field: bool = False) -> bytes:
    """msgpack bytes as a server would send them: "tagged" (today's vLLM and SGLang: an array batch of
    tag-keyed maps, byte for byte as their msgspec structs encode), "array" (array-like events: vLLM up to
    0.10, older SGLang) or "map" (a map batch: no server sends one; the decoder takes it). extra_field adds a
    field no decoder knows, as a newer publisher would."""
    from engine.attach import wire

    if encoding == "tagged":
        return wire.tagged_batch(ts, events, rank, flavor, extra_field)
    if encoding not in wire.LAYOUTS:
        raise ValueError(f"unknown encoding {encoding!r}; one of {wire.LAYOUTS}")
    return wire.legacy_batch(ts, events, rank, encoding, flavor,
                             {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}, extra_field)
