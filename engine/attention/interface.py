"""The attention interface: the storage formats a backend reads (`KVFormat`), one tier's K/V as the pool
holds them (`PagedKV`), a step's block tables and positions (`PagedBatch`), and the `AttentionBackend` protocol.
See the package docstring for the shapes and the visibility rule."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.kv.codecs import Parts
from engine.config import KVDtype


class KVFormat(enum.IntEnum):
    """How one side (K or V) of a storage format turns its parts into fp32 (see engine/kv/codecs.py)."""

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
    """One tier's K/V as the pool holds them: parts with dims [L, N, ...] (engine/kv/codecs.py)."""

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
    # host_table [B, NB] holds their slots in paged.host (any valid slot elsewhere). None: every block on the device.
    on_host: torch.Tensor | None = None
    host_table: torch.Tensor | None = None
    staged_table: torch.Tensor | None = None  # [B, NB] on the device: each host block's row in paged.staged

    def __post_init__(self):
        # The None rules, held (shapes only: no value is read, so no device sync).
        assert (self.on_host is None) == (self.host_table is None), "on_host and host_table come together"
        assert self.staged_table is None or self.on_host is not None, "staged_table needs on_host"
        for name in ("on_host", "host_table", "staged_table"):
            t = getattr(self, name)
            assert t is None or t.shape == self.block_table.shape, f"{name} {tuple(t.shape)} is not [B, NB]"
        assert self.key_pos is None or self.key_pos.shape[0] == self.block_table.shape[0], "key_pos is not [B, ...]"


class AttentionBackend(Protocol):
    name: str

    def decode(self, q: torch.Tensor, layer: int, paged: PagedKV, batch: PagedBatch, *, scale: float,
               window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, H, D] (one query per row) -> [B, H, D] in q's dtype (computed in fp32). sinks [H]: a logit per head
        that joins the softmax's denominator (a key with value 0: GPT-OSS's attention sinks); None: none."""

    def prefill(self, q: torch.Tensor, layer: int, paged: PagedKV, batch: PagedBatch, *, scale: float,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, Q, H, D] -> [B, Q, H, D] in q's dtype; batch.q_pos [B, Q] (causal by position); sinks as decode's."""

    def partial(self, q: torch.Tensor, layer: int, paged: PagedKV, batch: PagedBatch, *, scale: float,
                window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, Q, H, D] -> (out [B, Q, H, D], lse [B, Q, H]) in fp32 over the batch's visible keys (no host blocks:
        on_host None); a query with none gets out 0 and lse -inf. Merged with tier_split.merge_partials; attention
        sinks are never in a partial: they join once, after the merge (tier_split.add_sinks)."""


class DecodeAsPrefill:
    """For backends whose decode is their prefill with one query per row."""

    def decode(self, q: torch.Tensor, layer: int, paged: PagedKV, batch: PagedBatch, *, scale: float,
               window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        return self.prefill(q[:, None], layer, paged, batch, scale=scale, window=window, sinks=sinks)[:, 0]  # [B, H, D]
