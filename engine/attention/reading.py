"""Helpers every backend shares: reading a table's blocks from the tier each is in, and the visibility rule
(which keys a query sees: the one definition, the model's mask included)."""

from __future__ import annotations

import torch

from engine.attention.interface import PagedBatch, PagedKV


def read_blocks(paged: PagedKV, side: str, batch: PagedBatch, cols: slice, fetch, head_major: bool) -> torch.Tensor:
    """fetch(parts, slots [B, c]) of block columns `cols` of the table, from the tier each block is in; the
    result is [B, Hkv, c, ...] when `head_major`, else [B, c, ...].

    Host blocks are read from the step's staging buffer on the compute device (paged.staged: copied there as
    stored, one layer ahead, by host_stream.py), or, without one (a layer kept in host memory, attended there),
    fetched from the host tier's parts and copied to the compute device.
    """
    dev_parts = paged.k if side == "k" else paged.v
    out = fetch(dev_parts, batch.block_table[:, cols].long())
    if batch.on_host is None:
        return out
    mask = batch.on_host[:, cols]
    if not bool(mask.any()):
        return out
    if paged.staged is not None and batch.staged_table is not None and paged.staged.k["data"].device.type == out.device.type:
        from_host = fetch(paged.staged.k if side == "k" else paged.staged.v, batch.staged_table[:, cols].long())
    else:
        host_parts = paged.host.k if side == "k" else paged.host.v
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
