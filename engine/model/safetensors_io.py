"""Reading safetensors files one tensor at a time straight into their final memory.

Every header is read and checked against its file's size first; then each tensor is read into its final tensor
in the requested dtype and device, q/k/v and gate/up into one fused buffer each, so the weights exist once and
loading needs at most one source tensor beyond them. Pickles are never opened.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

import torch

from engine.model.quant import can_quantize, quantize
from engine.model.spec import ModelLoadError, read_json
from engine import hugepages


# The weights `--weights-dtype int8|int4` packs as they are read (the forward's linear weights and embeddings).
PACKED_SUFFIXES = tuple(f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj", "embed_tokens", "lm_head"))
_PACKED = {s.split(".")[0] for s in PACKED_SUFFIXES}  # whole names: Phi-3's fused qkv_proj is not a v_proj


def read_safetensors(directory: str, dtype: torch.dtype = torch.float32,
                      device: torch.device = torch.device("cpu"), quant: str | None = None) -> dict:
    """Every tensor of the directory's safetensors, in `dtype` on `device`. quant ("int8" / "int4"): the 2-D
    PACKED_SUFFIXES weights are each read into a buffer of their own size and packed at once
    (engine/model/quant.py), so the model never exists in float whole."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        weight_map = read_json(index_path).get("weight_map") or {}
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        pickled = [f for f in os.listdir(directory) if f.endswith((".bin", ".pt", ".pth"))]
        if pickled:
            raise ModelLoadError(
                f"{directory} holds only {pickled[0]}: only safetensors are loaded (pickles are never opened); "
                "convert with: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir)"
            )
        raise ModelLoadError(f"no *.safetensors in {directory}")
    entries: dict[str, _Entry] = {}
    for file in files:  # every header first: fusing plans across shards; a name in two shards is the later shard's
        path = os.path.join(directory, file)
        entries |= {e.name: e for e in _safetensors_entries(path)}
    packed = {n for n, e in entries.items()
              if quant and n.endswith(PACKED_SUFFIXES) and n.split(".")[-2] in _PACKED and len(e.shape) == 2}
    # (with quant, a float tensor the model packs later must be freed then: no shared mapping for those)
    weights = _allocate({n: e for n, e in entries.items() if n not in packed}, dtype, device, shared=quant is None)
    by_file: dict[str, list[_Entry]] = {}
    for e in entries.values():
        by_file.setdefault(e.path, []).append(e)
    for path, file_entries in by_file.items():
        try:
            with open(path, "rb", buffering=0) as f:
                for e in sorted(file_entries, key=lambda e: e.start):  # in file order: sequential reads
                    if e.name in packed:
                        buf = torch.empty(e.shape, dtype=torch.float32)
                        _read_into(f, e, buf)
                        weights[e.name] = quantize(buf, quant if can_quantize(buf, quant) else "int8").to(device)
                        del buf
                        continue
                    _read_into(f, e, weights[e.name])
        except OSError as e:
            raise ModelLoadError(f"corrupt or unreadable safetensors file {path}: {e}") from None
    return weights


# safetensors dtype names; float8 only where this torch has it.
_ST_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr) for name, attr in (
        ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("I64", "int64"),
        ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"), ("BOOL", "bool"),
        ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
    ) if hasattr(torch, attr)
}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the json header


@dataclass(frozen=True)
class _Entry:
    name: str
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def _safetensors_entries(path: str) -> list[_Entry]:
    """The tensors a safetensors file declares, checked against its size (truncation, bad offsets)."""
    def bad(reason: str) -> ModelLoadError:
        return ModelLoadError(f"corrupt or unreadable safetensors file {path}: {reason}")

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) != 8:
                raise bad("shorter than its 8-byte header length")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(_MAX_HEADER, size - 8):
                raise bad(f"header length {header_len} exceeds the file")
            header = json.loads(f.read(header_len))
    except OSError as e:
        raise bad(str(e)) from None
    except ValueError as e:  # json, utf-8
        raise bad(f"header is not valid json: {e}") from None
    if not isinstance(header, dict):
        raise bad("header is not a json object")
    base = 8 + header_len
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            start, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name}: bad or unsupported dtype, shape or data_offsets") from None
        numel = 1
        for d in shape:
            numel *= d
        if min(shape, default=0) < 0 or not 0 <= start <= end or end - start != numel * _itemsize(dtype):
            raise bad(f"tensor {name}: data_offsets {start}..{end} do not fit shape {list(shape)} {info['dtype']}")
        if base + end > size:
            raise bad(f"tensor {name} ends at byte {base + end} but the file has {size} (truncated?)")
        entries.append(_Entry(name, path, dtype, shape, base + start, base + end))
    return entries


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# Tensors of one layer stored as consecutive rows of one buffer, in this order (the forward pass's layout).
_FUSED_GROUPS = (
    ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
)


def _allocate(entries: dict[str, _Entry], dtype: torch.dtype, device: torch.device,
              shared: bool = True) -> dict[str, torch.Tensor]:
    """Uninitialized final tensors for every entry, in `dtype` on `device`; fused groups share one buffer. On the CPU
    and `shared`, all of them carved out of one mapping on 2 MiB pages where the system allows (engine/hugepages.py:
    a decode step streams every weight; one mapping, so small tensors and each one's last part are on those pages
    too), each its own storage; the mapping lives while any of them does, so not `shared` where some are replaced
    after loading (packed by the model: their memory must go with them)."""
    # (buffer shape, [(entry name, its rows of the buffer; None: the whole buffer)])
    plans: list[tuple[tuple[int, ...], list[tuple[str, int | None]]]] = []
    grouped: set[str] = set()
    for name in entries:
        for group in _FUSED_GROUPS:
            if not name.endswith("." + group[0]):
                continue
            prefix = name[: -len(group[0])]
            parts = [entries.get(prefix + g) for g in group]
            if any(p is None for p in parts) or len({p.shape[1:] for p in parts}) != 1 or not parts[0].shape:
                continue  # not fusable: each part gets its own tensor below (shapes are checked later)
            plans.append(((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), [(p.name, p.shape[0]) for p in parts]))
            grouped |= {p.name for p in parts}
    plans += [(tuple(e.shape), [(name, None)]) for name, e in entries.items() if name not in grouped]
    if torch.device(device).type == "cpu" and shared:
        buffers = hugepages.carve([shape for shape, _ in plans], dtype)
    else:
        buffers = [torch.empty(shape, dtype=dtype, device=device) for shape, _ in plans]
    weights: dict[str, torch.Tensor] = {}
    for buf, (_, names) in zip(buffers, plans):
        row = 0
        for n, rows in names:
            weights[n] = buf if rows is None else buf[row: row + rows]
            row += rows or 0
    return weights


def _read_into(f: BinaryIO, e: _Entry, dst: torch.Tensor) -> None:
    """Read entry `e` from the open file into `dst` (contiguous), casting and moving it as needed."""
    nbytes = e.end - e.start
    if nbytes == 0:
        return
    direct = dst.dtype == e.dtype and dst.device.type == "cpu"
    # Straight into the final memory when no cast or copy is needed; else through one buffer of this tensor.
    buf = dst if direct else torch.empty(e.shape, dtype=e.dtype)
    view = buf.reshape(-1).view(torch.uint8).numpy()
    f.seek(e.start)
    done = 0
    while done < nbytes:
        n = f.readinto(view[done:])
        if not n:
            raise ModelLoadError(f"corrupt or unreadable safetensors file {e.path}: tensor {e.name} is cut short")
        done += n
    if not direct:
        dst.copy_(buf)

