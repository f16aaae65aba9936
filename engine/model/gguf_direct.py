"""A Llama GGUF's weights loaded packed, tensor by tensor, straight from the memory-mapped file (`--weights-dtype
int8|int4`): no float copy of the model is ever made. config and tokenizer still come from the converted cache
directory (engine/model/gguf_cache.py); only the weights are read here.

Each GGUF type goes to the packed layout (engine/model/quant.py) that holds its values:
  Q4_1  -> int4, group 32: scale d, zero m                       (exact: d q + m)
  Q4_0  -> int4, group 32: scale d, zero -8 d                    (d (q - 8), up to one rounding)
  Q4_K  -> int4, group 32: scale d sc, zero -dmin m              (exact: its 6-bit sub-block scales and mins)
  Q8_0  -> int8, group 32: scale d                               (exact)
  Q5_0  -> int8, group 32: q - 16, scale d                       (exact)
  Q6_K  -> int8, group 16: q - 32, scale d sc                    (exact)
  F32 / F16 / BF16 linear weights -> quantized to the requested kind here; norms stay fp32 tensors.
So a GGUF's quantization is kept as it is whatever int8/int4 asks; the kind picks how its float tensors are packed.
Llama's q/k rows are stored permuted for GGML's RoPE (convert_hf_to_gguf's permute); they are put back in HF order
by a row permutation of the packed rows, as transformers' GGUF loader does to its dequantized copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.model.quant import QuantWeight, can_quantize, quantize
from engine.model.spec import ModelLoadError

_ARCHITECTURES = ("LlamaForCausalLM",)

_NAMES = {  # GGUF name (blk.N. stripped) -> HF name (model.layers.N. stripped)
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
        "output_norm.weight": "model.norm.weight"}


def supported(config: dict) -> bool:
    """Whether read_gguf maps this model's GGUF (the Llama family's names and q/k permutation)."""
    return (config.get("architectures") or [""])[0] in _ARCHITECTURES


def hf_name(name: str) -> str | None:
    if name in _TOP:
        return _TOP[name]
    if name.startswith("blk."):
        _, n, rest = name.split(".", 2)
        if rest in _NAMES:
            return f"model.layers.{n}.{_NAMES[rest]}"
    return None


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF's table: what unpack_tensor needs (GGUFReader's ReaderTensor names)."""

    name: str
    tensor_type: "object"  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGML order: inputs first
    data_offset: int  # absolute, in the file
    n_bytes: int


def tensor_table(path: str) -> list[TensorInfo]:
    """The GGUF's tensor table, read by a small parser of its header (metadata values skipped, not built):
    GGUFReader builds a numpy view per vocabulary string (~100k for the default model's tokenizer), 100+ MB of
    Python objects that would be the peak of a packed load."""
    import mmap
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # fixed-size value types
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (magic {bytes(m[:4])!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
        if version < 2:
            raise ModelLoadError(f"{path}: GGUF version {version} is not read (2 and up are)")
        pos = 24
        alignment = 32

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", m, at)
            return bytes(m[at + 8: at + 8 + n]).decode("utf-8", "replace"), at + 8 + n

        def skip(kind: int, at: int) -> int:
            if kind in sizes:
                return at + sizes[kind]
            if kind == 8:
                return at + 8 + struct.unpack_from("<Q", m, at)[0]
            if kind == 9:
                item, n = struct.unpack_from("<IQ", m, at)
                at += 12
                if item in sizes:
                    return at + n * sizes[item]
                for _ in range(n):
                    at = skip(item, at)
                return at
            raise ModelLoadError(f"{path}: unknown GGUF metadata type {kind}")

        for _ in range(n_kv):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", m, pos)
            pos += 4
            if key == "general.alignment" and kind == 4:
                (alignment,) = struct.unpack_from("<I", m, pos)
            pos = skip(kind, pos)
        infos = []
        for _ in range(n_tensors):
            name, pos = string(pos)
            (n_dims,) = struct.unpack_from("<I", m, pos)
            shape = struct.unpack_from(f"<{n_dims}Q", m, pos + 4)
            kind, offset = struct.unpack_from("<IQ", m, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, kind, shape, offset))
        start = (pos + alignment - 1) // alignment * alignment
        size = len(m)
    out = []
    for name, kind, shape, offset in infos:
        qtype = GGMLQuantizationType(kind)
        block, nbytes = GGML_QUANT_SIZES[qtype]
        n = 1
        for d in shape:
            n *= d
        info = TensorInfo(name, qtype, tuple(int(d) for d in shape), start + offset, n // block * nbytes)
        if info.data_offset + info.n_bytes > size:
            raise ModelLoadError(f"{path}: tensor {name} ends past the end of the file (truncated?)")
        out.append(info)
    return out


def read_gguf(path: str, config: dict, quant: str, device: torch.device = torch.device("cpu")) -> dict:
    """HF-named weights of a Llama GGUF: QuantWeight for the linear weights and embeddings, fp32 tensors else."""
    try:
        table = tensor_table(path)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read GGUF {path}: {e}") from None
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    weights: dict = {}
    with open(path, "rb", buffering=0) as f:
        for t in table:
            name = hf_name(t.name)
            if name is None:
                if t.name.startswith("rope_freqs"):
                    continue
                raise ModelLoadError(f"GGUF {path}: tensor {t.name} has no HF name in the Llama family's map")
            # Read into a buffer of this tensor's size (no map: mapped pages once touched count in the RSS).
            raw = np.empty(t.n_bytes, dtype=np.uint8)
            f.seek(t.data_offset)
            if f.readinto(memoryview(raw)) != raw.nbytes:
                raise ModelLoadError(f"GGUF {path}: tensor {t.name} is cut short")
            w = unpack_tensor(t, quant, raw)
            del raw
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                w = _unpermute(w, heads if "q_proj" in name else kv_heads)
            weights[name] = w.to(device)
    return weights


def unpack_tensor(t, quant: str, data: np.ndarray | None = None) -> "QuantWeight | torch.Tensor":
    """One GGUF tensor (a GGUFReader tensor; `data`: its bytes read already, else t.data): packed when
    quantized, or a 2-D float one quantized to `quant`; a 1-D float one (a norm) as fp32."""
    data = t.data if data is None else data
    kind = t.tensor_type.name
    N = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
    K = int(t.shape[0])
    if kind in ("F32", "F16", "BF16"):
        if kind == "BF16":
            f = torch.from_numpy((np.ascontiguousarray(data).view(np.int16).astype(np.int32) << 16).view(np.float32))
        else:
            f = torch.from_numpy(np.ascontiguousarray(data).view(np.float16 if kind == "F16" else np.float32)
                                 .astype(np.float32))
        f = f.reshape(N, K) if len(t.shape) > 1 else f.reshape(K)
        return quantize(f, quant) if f.dim() == 2 and can_quantize(f, quant) else f
    unpack = _UNPACK.get(kind)
    if unpack is None:
        raise ModelLoadError(f"GGUF tensor {t.name}: type {kind} is not loaded packed (Q4_0, Q4_1, Q4_K, Q5_0, "
                             "Q6_K, Q8_0, F16, F32 are); use --weights-dtype fp32")
    blocks = np.asarray(data).reshape(N, -1)  # [N, bytes per row]
    w = unpack(blocks, N, K)
    w.source = kind
    return w


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _int4(vals: np.ndarray, scale: np.ndarray, zero: np.ndarray, N: int, K: int) -> QuantWeight:
    """vals uint8 [N, K/2] already in the int4 layout (groups of 16 bytes: low nibble j, high 16 + j)."""
    return QuantWeight("int4", torch.from_numpy(np.ascontiguousarray(vals).reshape(N, K // 2)),
                       torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(N, -1)),
                       torch.from_numpy(np.ascontiguousarray(zero, dtype=np.float32).reshape(N, -1)), 32)


def _int8(q: np.ndarray, scale: np.ndarray, group: int, N: int, K: int) -> QuantWeight:
    s = torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(N, -1))
    return QuantWeight("int8", torch.from_numpy(np.ascontiguousarray(q).view(np.int8).reshape(N, K)), s,
                       torch.zeros_like(s), group)


def _q4_1(blocks, N, K):
    b = blocks.reshape(N, K // 32, 20)
    return _int4(b[..., 4:], _f16(b[..., 0:2]), _f16(b[..., 2:4]), N, K)


def _q4_0(blocks, N, K):
    b = blocks.reshape(N, K // 32, 18)
    d = _f16(b[..., 0:2])
    return _int4(b[..., 2:], d, -8 * d, N, K)


def _q8_0(blocks, N, K):
    b = blocks.reshape(N, K // 32, 34)
    return _int8(b[..., 2:], _f16(b[..., 0:2]), 32, N, K)


def _q5_0(blocks, N, K):
    b = blocks.reshape(N, K // 32, 22)
    d = _f16(b[..., 0:2])
    qh = np.ascontiguousarray(b[..., 2:6]).view("<u4")  # [N, G, 1]: bit i is input i's fifth bit
    hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [N, G, 32]
    qs = b[..., 6:]
    lo = np.concatenate((qs & 15, qs >> 4), axis=-1)  # [N, G, 32]
    q = (lo | (hi << 4)).astype(np.int8) - np.int8(16)
    return _int8(q, d, 32, N, K)


def _q4_k(blocks, N, K):
    from gguf.quants import Q4_K

    nb = N * K // 256
    b = blocks.reshape(nb, 144)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])  # [nb]
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))  # [nb, 8] each: sub-block scale and min
    scale = d[:, None] * sc.reshape(nb, 8).astype(np.float32)
    zero = -(dmin[:, None] * m.reshape(nb, 8).astype(np.float32))
    qs = b[:, 16:].reshape(nb, 4, 32)  # 4 chunks of 32 bytes: low nibbles sub-block 2i, high 2i + 1
    vals = np.stack((qs & 15, qs >> 4), axis=2).reshape(nb, 8, 32)  # [nb, sub-block, input]
    packed = vals[..., :16] | (vals[..., 16:] << 4)  # our layout per group of 32
    return _int4(packed.reshape(N, K // 2), scale.reshape(N, -1), zero.reshape(N, -1), N, K)


def _q6_k(blocks, N, K):
    nb = N * K // 256
    b = blocks.reshape(nb, 210)
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    scale = d[:, None] * np.ascontiguousarray(sc).view(np.int8).astype(np.float32)  # [nb, 16]
    lo = ((ql.reshape(nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(nb, 8, 32)
    hi = ((qh.reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(nb, 8, 32)
    q = (lo | (hi << 4)).astype(np.int8) - np.int8(32)
    return _int8(q.reshape(N, K), scale.reshape(N, -1), 16, N, K)


_UNPACK = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q8_0": _q8_0, "Q5_0": _q5_0, "Q6_K": _q6_k}


def _unpermute(w, heads: int):
    """Undo convert_hf_to_gguf's q/k row permutation (transformers' reverse_permute), on rows."""
    N = w.shape[0]
    idx = torch.arange(N).reshape(heads, N // heads // 2, 2).transpose(1, 2).reshape(-1)
    return w.take_rows(idx) if isinstance(w, QuantWeight) else w[idx].contiguous()
