"""Attention over the paged KV cache, behind one interface.

A backend reads one tier's K/V where the pool keeps them (`PagedKV`: the codec parts, see engine/codecs.py)
through a block table, and returns the attention output. Three backends, checked against each other on every
block size and storage format (tests/test_paged_attention.py):

| name        | module          | how                                                                        |
|-------------|-----------------|----------------------------------------------------------------------------|
| `reference` | `reference.py`  | today's model path: codec.decode of the whole table, permute, SDPA + mask  |
| `cpu`       | `cpu_paged.py`  | torch ops in chunks of blocks, gathered head-major (no permute copy),      |
|             |                 | dequantized per chunk, online softmax; runs on any device                  |
| `triton`    | `triton_paged.py` | a paged-decode kernel: one program per (sequence, kv head), K/V          |
|             |                 | dequantized in registers; prefill falls back to the `cpu` path             |

Shapes: B sequences, Q queries each (1 for decode), H query heads, Hkv kv heads (H % Hkv == 0; query
head h reads kv head h // (H // Hkv)), D head dim, NB blocks per table row, bs block size.

Visibility (the model's `_mask`): key i of row b is visible to a query at position p iff
i < context_lens[b], key_pos[b, i] <= p and, with a window, key_pos[b, i] > p - window. Every query must
see at least one key (a row with none is undefined: NaN in the reference).

Blocks on the host tier (PagedBatch.on_host) are read in one of two ways (the host_reads knob): streamed
(copied as stored to a staging buffer on the compute device one layer ahead, host_stream.py, and read there by
`read_blocks`), or
attended where they are (host_reads="compute", host_compute.py): each backend's `partial` returns (output, lse)
over one tier's keys, the host part runs on the CPU, and the two are merged by log-sum-exp. A partial is defined
for every row: one with no visible key gives output 0 and lse -inf.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.codecs import Parts
from engine.config import KVDtype


class KVFormat(enum.IntEnum):
    """How one side (K or V) of a storage format turns its parts into fp32 (see engine/codecs.py)."""

    PLAIN = 0  # data cast: fp32 / fp16 / bf16
    CHANNEL_SCALE = 2  # data * scale[slot, head, channel] * tscale[slot, head, token] (fp16): int8-kivi keys
    TOKEN_SCALE = 3  # data * scale[slot, head, token] (fp16): int8, fp8, int8-kivi and int8-delta values
    DELTA = 4  # anchor[slot, head] + cumsum over tokens of data * scale[slot, head, token] (token 0's step is 0)


_FORMATS = {
    KVDtype.FP32: (KVFormat.PLAIN, KVFormat.PLAIN),
    KVDtype.FP16: (KVFormat.PLAIN, KVFormat.PLAIN),
    KVDtype.BF16: (KVFormat.PLAIN, KVFormat.PLAIN),
    KVDtype.INT8: (KVFormat.TOKEN_SCALE, KVFormat.TOKEN_SCALE),
    KVDtype.FP8: (KVFormat.TOKEN_SCALE, KVFormat.TOKEN_SCALE),
    KVDtype.INT8_DELTA: (KVFormat.DELTA, KVFormat.TOKEN_SCALE),
    KVDtype.INT8_KIVI: (KVFormat.CHANNEL_SCALE, KVFormat.TOKEN_SCALE),
}


def kv_formats(dtype: KVDtype) -> tuple[KVFormat, KVFormat]:
    """(key format, value format) of a storage dtype."""
    return _FORMATS[dtype]


@dataclass(frozen=True)
class PagedKV:
    """One tier's K/V as the pool holds them: parts with dims [L, N, ...] (engine/codecs.py)."""

    k: Parts  # data [L, N, Hkv, bs, D]; scale / anchor as the format has them
    v: Parts
    dtype: KVDtype
    host: "PagedKV | None" = None  # the host tier, for tables with entries there (PagedBatch.on_host)
    # The step's host blocks staged on the compute device a layer ahead (host_stream.py), read through
    # PagedBatch.staged_table; None: host blocks are read from `host` directly.
    staged: "PagedKV | None" = None

    @property
    def block_size(self) -> int:
        return self.k["data"].shape[3]

    @property
    def kv_heads(self) -> int:
        return self.k["data"].shape[2]


@dataclass(frozen=True)
class PagedBatch:
    """Where each sequence's keys are, and where its queries sit."""

    block_table: torch.Tensor  # [B, NB] int32/int64 slots in the tier; entries past a row's context: any slot
    context_lens: torch.Tensor  # [B] int: row b's keys are the first context_lens[b] of its table
    q_pos: torch.Tensor  # [B, Q] int64 positions of the queries ([B] accepted for decode)
    key_pos: torch.Tensor | None = None  # [B, NB*bs] int64 position of each key; None: key i sits at i
    # Blocks read from the host tier where they are (host_reads stream / compute): on_host [B, NB] bool marks them, and
    # host_table [B, NB] holds their slots in kv.host (any valid slot elsewhere). None: every block on the device.
    on_host: torch.Tensor | None = None
    host_table: torch.Tensor | None = None
    staged_table: torch.Tensor | None = None  # [B, NB] on the device: each host block's row in kv.staged


class AttentionBackend(Protocol):
    name: str

    def decode(self, q: torch.Tensor, layer: int, kv: PagedKV, batch: PagedBatch, *, scale: float,
               window: int | None = None) -> torch.Tensor:
        """q [B, H, D] (one query per row) -> [B, H, D] in q's dtype (computed in fp32)."""

    def prefill(self, q: torch.Tensor, layer: int, kv: PagedKV, batch: PagedBatch, *, scale: float,
                window: int | None = None) -> torch.Tensor:
        """q [B, Q, H, D] -> [B, Q, H, D] in q's dtype; batch.q_pos [B, Q] (causal by position)."""

    def partial(self, q: torch.Tensor, layer: int, kv: PagedKV, batch: PagedBatch, *, scale: float,
                window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, Q, H, D] -> (out [B, Q, H, D], lse [B, Q, H]) in fp32 over the batch's visible keys (no host blocks:
        on_host None); a query with none gets out 0 and lse -inf. Merged with host_compute.merge_partials."""


class DecodeAsPrefill:
    """For backends whose decode is their prefill with one query per row."""

    def decode(self, q: torch.Tensor, layer: int, kv: PagedKV, batch: PagedBatch, *, scale: float,
               window: int | None = None) -> torch.Tensor:
        return self.prefill(q[:, None], layer, kv, batch, scale=scale, window=window)[:, 0]  # [B, H, D]


def make_backend(name: str, **options) -> AttentionBackend:
    """'reference', 'cpu' or 'triton' (imports triton only when asked for)."""
    if name == "reference":
        from engine.attention.reference import ReferenceBackend

        return ReferenceBackend(**options)
    if name == "cpu":
        from engine.attention.cpu_paged import ChunkedPagedBackend

        return ChunkedPagedBackend(**options)
    if name == "triton":
        from engine.attention.triton_paged import TritonPagedBackend

        return TritonPagedBackend(**options)
    raise ValueError(f"attention backend {name!r}: choose reference, cpu or triton")


def read_blocks(kv: PagedKV, side: str, batch: PagedBatch, cols: slice, fetch, head_major: bool) -> torch.Tensor:
    """fetch(parts, slots [B, c]) of block columns `cols` of the table, from the tier each block is in; the
    result is [B, Hkv, c, ...] when `head_major`, else [B, c, ...].

    Host blocks are read from the step's staging buffer on the compute device (kv.staged: copied there as
    stored, one layer ahead, by host_stream.py), or, without one (a layer kept in host memory, attended there),
    fetched from the host tier's parts and copied to the compute device.
    """
    dev_parts = kv.k if side == "k" else kv.v
    out = fetch(dev_parts, batch.block_table[:, cols].long())
    if batch.on_host is None:
        return out
    mask = batch.on_host[:, cols]
    if not bool(mask.any()):
        return out
    if kv.staged is not None and batch.staged_table is not None and kv.staged.k["data"].device.type == out.device.type:
        from_host = fetch(kv.staged.k if side == "k" else kv.staged.v, batch.staged_table[:, cols].long())
    else:
        host_parts = kv.host.k if side == "k" else kv.host.v
        from_host = fetch(host_parts, batch.host_table[:, cols].long().cpu()).to(out.device, non_blocking=True)
    mask = mask[:, None] if head_major else mask  # [B, 1, c] or [B, c]
    mask = mask.reshape(mask.shape + (1,) * (out.dim() - mask.dim()))
    return torch.where(mask.to(out.device), from_host, out)


def query_positions(batch: PagedBatch, B: int, Q: int) -> torch.Tensor:
    """batch.q_pos as [B, Q] int64."""
    return batch.q_pos.reshape(B, Q).long()


def key_positions(batch: PagedBatch, S: int) -> torch.Tensor:
    """[B, S] int64 key positions (index when batch.key_pos is None)."""
    B = batch.block_table.shape[0]
    if batch.key_pos is None:
        return torch.arange(S, device=batch.block_table.device).expand(B, S)
    return batch.key_pos[:, :S].long()


def visibility(batch: PagedBatch, Q: int, S: int, window: int | None) -> torch.Tensor:
    """[B, Q, S] bool: key s of row b visible to query q (the model's `_mask`, keys counted by context_lens)."""
    B = batch.block_table.shape[0]
    kpos = key_positions(batch, S)[:, None, :]  # [B, 1, S]
    qpos = query_positions(batch, B, Q)[:, :, None]  # [B, Q, 1]
    idx = torch.arange(S, device=kpos.device)
    m = (idx[None, None, :] < batch.context_lens.to(kpos.device).long()[:, None, None]) & (kpos <= qpos)
    if window is not None:
        m = m & (kpos > qpos - window)
    return m
