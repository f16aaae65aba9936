"""KV event batches encoded byte for byte as the servers encode them: for the fake publisher, the tests and the
decode bench (the decoder is engine/attach/events.py).

The structs below copy the declarations of vLLM 0.33.0 (`vllm/distributed/kv_events.py`) and SGLang 0.5.23
(`sglang/srt/disaggregation/kv_events.py`): the same field order and defaults, events `omit_defaults=True,
tag=True` (a map whose "type" key is the class name, fields left at their default omitted), the batch
array-like (`[ts, events, rank]`; vLLM omits a default rank, SGLang always writes it). Encoded with msgspec, as
the servers do, they give the servers' bytes: tests/attach/test_attach_real_bytes.py checks them against captures of
the real publishers (tests/data/attach/). The older layouts (array-like events: vLLM up to 0.10 and older
SGLang; a map batch, which no server sends but the decoder takes) come from `legacy_batch`.
"""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec

KIND_STORED, KIND_REMOVED = 0, 1
LAYOUTS = ("tagged", "array", "map")  # tagged: today's servers; array / map: older or hand-made ones


# -- vLLM 0.33.0 -----------------------------------------------------------------------------------------
class VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _VllmEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VllmStored(_VllmEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class VllmRemoved(_VllmEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VllmCleared(_VllmEvent, tag="AllBlocksCleared"):
    pass


# -- SGLang 0.5.23 ---------------------------------------------------------------------------------------
class SglangBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class _SglangEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class SglangStored(_SglangEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[Any]  # ints, or (token, next token) pairs on an EAGLE "bigram" page
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class SglangRemoved(_SglangEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class SglangCleared(_SglangEvent, tag="AllBlocksCleared"):
    pass


_ENC = msgspec.msgpack.Encoder()


def _tokens(v) -> list:
    if isinstance(v, msgspec.Raw):
        return msgspec.msgpack.decode(v)
    return list(v) if v is not None else []


def _raw(v):
    return msgspec.msgpack.decode(v) if isinstance(v, msgspec.Raw) else v


def to_wire(ev, flavor: str = "vllm"):
    """One decoded event (engine.attach.events) as the server's struct."""
    def g(name):  # a field older event objects do not have
        return getattr(ev, name, None)

    if ev.KIND == KIND_STORED:
        base = dict(block_hashes=list(ev.block_hashes), parent_block_hash=ev.parent_block_hash,
                    token_ids=_tokens(ev.token_ids), block_size=ev.block_size, lora_id=ev.lora_id,
                    medium=ev.medium, lora_name=g("lora_name"), session_id=g("session_id"))
        if flavor == "sglang":
            return SglangStored(**base, cache_salt=g("cache_salt"))
        return VllmStored(**base, extra_keys=_raw(g("extra_keys")), group_idx=g("group_idx"),
                          kv_cache_spec_kind=g("kv_cache_spec_kind"),
                          kv_cache_spec_sliding_window=g("kv_cache_spec_sliding_window"), locality=g("locality"),
                          ownership=g("ownership"), lookahead_token_ids=_raw(g("lookahead_token_ids")))
    if ev.KIND == KIND_REMOVED:
        if flavor == "sglang":
            return SglangRemoved(list(ev.block_hashes), ev.medium)
        return VllmRemoved(list(ev.block_hashes), ev.medium, g("group_idx"), g("locality"), g("ownership"))
    return SglangCleared() if flavor == "sglang" else VllmCleared()


def tagged_batch(ts: float, events: list, rank: int | None = None, flavor: str = "vllm",
                 extra_field: bool = False) -> bytes:
    """Today's layout, as vLLM 0.33 / SGLang 0.5 encode it. extra_field adds a key no decoder knows to every
    event, as a newer server would."""
    evs: list = [to_wire(ev, flavor) for ev in events]
    if extra_field:
        evs = [{**msgspec.to_builtins(e, builtin_types=(bytes,)), "future_field": 7} for e in evs]
    batch = SglangBatch(ts, evs, rank) if flavor == "sglang" else VllmBatch(ts, evs, rank)
    return _ENC.encode(batch)


# -- the older layouts -----------------------------------------------------------------------------------
def _legacy_fields(ev, flavor: str) -> tuple[str, list[tuple[str, object]]]:
    if ev.KIND == KIND_STORED:
        fs = [("block_hashes", ev.block_hashes), ("parent_block_hash", ev.parent_block_hash),
              ("token_ids", _tokens(ev.token_ids)), ("block_size", ev.block_size), ("lora_id", ev.lora_id)]
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


def legacy_batch(ts: float, events: list, rank: int | None, layout: str, flavor: str, known: dict,
                 extra_field: bool = False) -> bytes:
    """Array-like events (vLLM up to 0.10, older SGLang) or a map batch of map events. `known` maps a tag to
    the decoder's positional field names (the fields extra_field writes a new one after)."""
    evs = []
    for ev in events:
        tag, fs = _legacy_fields(ev, flavor)
        if extra_field:  # after every field the decoder knows, as a newer struct would append it
            have = {k for k, _ in fs}
            fs = fs + [(k, None) for k in known.get(tag, ()) if k not in have] + [("future_field", 7)]
        evs.append([tag] + [v for _, v in fs] if layout == "array" else {"type": tag, **dict(fs)})
    if layout == "array":
        batch: Any = [ts, evs] + ([rank] if rank is not None else [])
    else:
        batch = {"ts": ts, "events": evs}
        if rank is not None:
            batch["data_parallel_rank"] = rank
    return msgpack.packb(batch, use_bin_type=True)
