"""Decoding vLLM / SGLang KV event batches: both encodings, fields added over versions, unknown kinds and fields,
and frames that are not batches at all (DecodeError, never anything else)."""

from __future__ import annotations

import msgpack
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.attach.block_state import token_list
from engine.attach.events import (KIND_CLEARED, KIND_REMOVED, KIND_STORED, AllBlocksCleared, BlockRemoved,
                                  MAX_FRAME_BYTES, REASONS, BlockStored, DecodeError, decode_batch, encode_batch,
                                  event_meta, is_placeholder, medium_of, plain)


# vLLM's own declarations (vllm/distributed/kv_events.py): array-like up to 0.10, maps with more fields since.
class _VOldBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list


class _VOldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _VOldStored(_VOldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _VOldRemoved(_VOldEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class _VNewBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class _VNewEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _VNewStored(_VNewEvent, tag="BlockStored"):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _VNewCleared(_VNewEvent, tag="AllBlocksCleared"):
    pass


def test_vllm_array_like_batch_as_vllm_encodes_it():
    payload = msgspec.msgpack.encode(_VOldBatch(12.5, [
        _VOldStored([11, 12], None, list(range(32)), 16, None, "GPU"),
        _VOldRemoved([11], None)]))
    b = decode_batch(payload)
    assert b.ts == 12.5 and b.data_parallel_rank is None and b.bad_events == b.unknown_events == 0
    s, r = b.events
    assert s.KIND == KIND_STORED and s.block_hashes == [11, 12] and s.parent_block_hash is None
    assert token_list(s.token_ids) == list(range(32)) and s.block_size == 16 and medium_of(s) == "GPU"
    assert r.KIND == KIND_REMOVED and r.block_hashes == [11] and medium_of(r) == "GPU"  # None means GPU


def test_vllm_map_batch_with_newer_fields_as_vllm_encodes_it():
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    payload = msgspec.msgpack.encode(_VNewBatch(3.0, [
        _VNewStored([h2], h1, [5] * 16, 16, None, "CPU", None, [None], 1, "full_attention", None),
        _VNewCleared()], data_parallel_rank=3))
    b = decode_batch(payload)
    assert b.data_parallel_rank == 3 and len(b.events) == 2
    s, c = b.events
    assert s.block_hashes == [h2] and s.parent_block_hash == h1 and medium_of(s) == "CPU" and s.group_idx == 1
    assert c.KIND == KIND_CLEARED


@pytest.mark.parametrize("encoding", ["array", "map"])
@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_round_trip_with_a_field_no_decoder_knows(encoding, flavor):
    events = [BlockStored([1, 2, 3], 99, list(range(48)), 16, 4, "GPU"), BlockRemoved([7, 8], "GPU"),
              AllBlocksCleared()]
    b = decode_batch(encode_batch(1.0, events, 2, encoding=encoding, flavor=flavor, extra_field=True))
    assert [e.KIND for e in b.events] == [KIND_STORED, KIND_REMOVED, KIND_CLEARED]
    assert b.events[0].block_hashes == [1, 2, 3] and b.events[0].parent_block_hash == 99
    assert b.events[0].lora_id == 4 and token_list(b.events[0].token_ids) == list(range(48))
    assert b.data_parallel_rank == 2 and b.bad_events == 0 and b.unknown_events == 0


def test_unknown_kind_and_bad_event_are_counted_and_the_rest_kept():
    payload = msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2], 2, None, "GPU"],
                                   ["BlockEvictedToMars", [1]],
                                   ["BlockStored", "not a list", None, [], 2, None, None],
                                   {"type": "BlockRemoved", "block_hashes": ["a-str-hash"], "medium": "gpu"}]])
    b = decode_batch(payload)
    assert b.unknown_events == 1 and b.bad_events == 1 and len(b.notes) == 1
    assert [e.KIND for e in b.events] == [KIND_STORED, KIND_REMOVED]
    assert b.events[1].block_hashes == ["a-str-hash"] and medium_of(b.events[1]) == "GPU"


def test_missing_optional_fields_are_defaulted():
    b = decode_batch(msgpack.packb({"ts": 2, "events": [{"type": "BlockStored", "block_hashes": [5]}],
                                    "attn_dp_rank": 1}))
    (s,) = b.events
    assert s.parent_block_hash is None and s.block_size == 0 and s.lora_id is None and medium_of(s) == "GPU"
    assert b.data_parallel_rank == 1 and b.ts == 2.0


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"\x00" * 8, msgpack.packb(7), msgpack.packb([1.0]),
                                     msgpack.packb({"ts": "x", "events": []}), msgpack.packb([1.0, 5]),
                                     msgpack.packb([True, []]), b"\x92\xcb"])
def test_not_a_batch_raises_decode_error(payload):
    with pytest.raises(DecodeError):
        decode_batch(payload)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_decode_error(data):
    try:
        b = decode_batch(data)
    except DecodeError:
        return
    for e in b.events:
        assert e.KIND in (KIND_STORED, KIND_REMOVED, KIND_CLEARED)


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=5)
                    | st.binary(max_size=5),
                    lambda ch: st.lists(ch, max_size=5) | st.dictionaries(st.text(max_size=5), ch, max_size=4),
                    max_leaves=20))
def test_any_msgpack_value_decodes_or_raises_decode_error(obj):
    try:
        decode_batch(msgpack.packb(obj, use_bin_type=True))
    except DecodeError:
        pass


# -- a hostile or broken peer: only DecodeError leaves the decoder ---------------------------------------------
_DEEP = b"\x91" * 100_000 + b"\xc0"  # an array in an array ... 100k deep
_DEEP_MAP = b"\x81\xa1k" * 100_000 + b"\xc0"
_TS = b"\xcb" + bytes(8)
_TAGGED_STORED = b"\x93" + _TS + b"\x91\x83\xa4type\xabBlockStored\xacblock_hashes\x91\x01"


@pytest.mark.parametrize("payload", [
    _DEEP,
    _TAGGED_STORED + b"\xaaextra_keys" + _DEEP + b"\x00",  # today's layout, nested extra_keys
    _TAGGED_STORED + b"\xaaextra_keys" + _DEEP_MAP + b"\x00",
    _TAGGED_STORED + b"\xa9token_ids" + _DEEP + b"\x00",  # nested token_ids
    b"\x82\xa2ts" + _TS + b"\xa6events\x91\x83\xa4type\xabBlockStored\xacblock_hashes\x91\x01\xa9token_ids" + _DEEP,
    b"\x93" + _TS + b"\x91\x99\xabBlockStored\x91\x01\xc0\x90\x10\xc0\xc0\xc0" + _DEEP,  # array-like extra_keys
    b"\x83\xa2ts" + _TS + b"\xa6events\x90\xa1x" + _DEEP,  # a field nobody knows
], ids=["top", "tagged-extra-keys", "tagged-extra-keys-maps", "tagged-token-ids", "map-batch-token-ids",
        "array-extra-keys", "unknown-field"])
def test_a_frame_nested_100k_deep_is_a_decode_error_not_a_recursion_error(payload):
    with pytest.raises(DecodeError) as e:
        decode_batch(payload)
    assert e.value.reason in REASONS


def test_a_nested_frame_on_a_thread_leaves_the_thread_running():
    """The subscriber decodes on its own thread: what it can catch there is what counts."""
    import threading

    out = []

    def work():
        for p in (_TAGGED_STORED + b"\xaaextra_keys" + _DEEP + b"\x00", encode_batch(1.0, [AllBlocksCleared()])):
            try:
                out.append(len(decode_batch(p).events))
            except DecodeError as e:
                out.append(e.reason)

    t = threading.Thread(target=work)
    t.start()
    t.join(60)
    assert out == ["too_deep", 1]


def test_a_frame_over_the_size_limit_is_refused_with_its_reason():
    big = msgpack.packb([1.0, [{"type": "AllBlocksCleared", "pad": b"x" * MAX_FRAME_BYTES}], 0])
    assert len(big) > MAX_FRAME_BYTES
    with pytest.raises(DecodeError) as e:
        decode_batch(big)
    assert e.value.reason == "too_large"
    ok = msgpack.packb([1.0, [{"type": "AllBlocksCleared", "pad": b"x" * 1000}], 0])
    assert len(decode_batch(ok).events) == 1


def _real_shaped(flavor: str, layout: str) -> bytes:
    from app.bench.attach_decode import payloads

    return payloads(flavor, layout, "int64" if flavor == "sglang" else "bytes", batches=1, per_batch=6)[0][0]


_SEEDS = [_real_shaped("vllm", "tagged"), _real_shaped("sglang", "tagged"), _real_shaped("vllm", "array")]


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(_SEEDS), st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=8),
       st.integers(0, 3), st.integers(0, 3000), st.integers(0, 10_000))
def test_mutated_real_frames_decode_or_raise_decode_error(seed, flips, cut, depth, at):
    """Real-shaped frames with bytes changed, cut short, or deep nesting spliced in: DecodeError or a batch."""
    b = bytearray(seed)
    for i, v in flips:
        b[i % len(b)] = v
    if cut:
        b = b[: len(b) * cut // 4]
    if depth:
        i = at % (len(b) + 1)
        b[i:i] = (b"\x91" if depth % 2 else b"\x81\xa1k") * depth + b"\xc0"
    try:
        out = decode_batch(bytes(b))
    except DecodeError as e:
        assert e.reason in REASONS
        return
    assert all(e.KIND in (KIND_STORED, KIND_REMOVED, KIND_CLEARED) for e in out.events)


# -- today's servers' fields (vLLM 0.33, SGLang 0.5) -------------------------------------------------------
def _tagged(*events, rank=0):
    return msgpack.packb([5.0, list(events), rank], use_bin_type=True)


_BIGRAM = {"type": "BlockStored", "block_hashes": [-(1 << 63)], "parent_block_hash": None,
           "token_ids": [[t, t + 1] for t in range(40, 44)], "block_size": 4, "lora_id": None, "medium": "CPU_PINNED",
           "cache_salt": "tenant-7", "session_id": "s-9"}


@pytest.mark.parametrize("path", ["typed", "tolerant"])
def test_an_eagle_bigram_page_and_sglangs_fields_decode_on_both_paths(path):
    extra = [{"type": "BlockEvictedToMars"}] if path == "tolerant" else []  # an unknown kind: the slow path
    b = decode_batch(_tagged(_BIGRAM, *extra))
    (s,) = b.events
    # both paths keep a bigram page's pairs as msgpack, so the tooltip can say what the page was
    assert isinstance(s.token_ids, msgspec.Raw) and b.unknown_events == len(extra)
    assert token_list(s.token_ids) == [40, 41, 42, 43] and b.bad_events == 0
    assert s.block_hashes == [-(1 << 63)] and medium_of(s) == "CPU"
    assert (s.cache_salt, s.session_id) == ("tenant-7", "s-9")
    assert event_meta(s) == {"session_id": "s-9", "cache_salt": "tenant-7", "bigram": True}


@pytest.mark.parametrize("path", ["typed", "tolerant"])
def test_a_plain_page_is_no_bigram_on_either_path(path):
    extra = [{"type": "BlockEvictedToMars"}] if path == "tolerant" else []
    plain_page = dict(_BIGRAM, token_ids=[40, 41, 42, 43], cache_salt=None, session_id=None)
    (s,) = decode_batch(_tagged(plain_page, *extra)).events
    assert token_list(s.token_ids) == [40, 41, 42, 43] and event_meta(s) is None


@pytest.mark.parametrize("medium,tier", [(None, "GPU"), ("GPU", "GPU"), ("gpu", "GPU"), ("CPU", "CPU"),
                                         ("CPU_PINNED", "CPU"), ("DISK", "DISK"), ("STORAGE", "DISK"),
                                         ("EXTERNAL", "EXTERNAL"), ("nvme-pool", "NVME-POOL")])
def test_media_map_to_tiers(medium, tier):
    b = decode_batch(_tagged({"type": "BlockRemoved", "block_hashes": [1], "medium": medium}))
    assert medium_of(b.events[0]) == tier


@pytest.mark.parametrize("path", ["typed", "tolerant"])
def test_vllm_0_33_fields_and_an_offloading_placeholder_decode_on_both_paths(path):
    full = {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": None,
            "token_ids": list(range(16)), "block_size": 16, "lora_id": 2, "medium": "GPU", "lora_name": "sql",
            "extra_keys": [["sql", "salt"]], "group_idx": 1, "kv_cache_spec_kind": "sliding_window",
            "kv_cache_spec_sliding_window": 4096, "locality": "LOCAL", "ownership": "tier-2",
            "session_id": "chat-1", "lookahead_token_ids": [[16, 17]]}
    hole = {"type": "BlockStored", "block_hashes": [b"\x02" * 32], "parent_block_hash": None, "token_ids": [],
            "block_size": 0, "lora_id": None, "medium": "STORAGE", "lora_name": None, "group_idx": 0}
    gone = {"type": "BlockRemoved", "block_hashes": [b"\x02" * 32], "medium": "STORAGE", "group_idx": 0,
            "locality": "REMOTE", "ownership": "tier-2"}
    extra = [{"type": "BlockEvictedToMars"}] if path == "tolerant" else []
    b = decode_batch(_tagged(full, hole, gone, *extra, rank=3))
    s, p, r = b.events
    assert b.bad_events == 0 and b.data_parallel_rank == 3
    assert (s.group_idx, s.kv_cache_spec_kind, s.kv_cache_spec_sliding_window) == (1, "sliding_window", 4096)
    assert (s.lora_id, s.lora_name, s.locality, s.ownership, s.session_id) == (2, "sql", "LOCAL", "tier-2", "chat-1")
    assert plain(s.extra_keys) == [["sql", "salt"]] and plain(s.lookahead_token_ids) == [[16, 17]]
    assert not is_placeholder(s) and is_placeholder(p) and medium_of(p) == "DISK"
    m = event_meta(s)
    assert m["lora_name"] == "sql" and plain(m["extra_keys"]) == [["sql", "salt"]]
    assert event_meta(p) == {"placeholder": True}
    assert (r.locality, r.ownership, r.group_idx, medium_of(r)) == ("REMOTE", "tier-2", 0, "DISK")
