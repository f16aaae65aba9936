"""KV-cache groups: the model's layers grouped by what their attention keeps, each group with its own pool.

A full-attention layer reads every earlier key; a sliding-window layer (Gemma 2/3, GPT-OSS, Mistral) reads only the
last `window` positions. Kept in one pool, every layer holds K/V for every token and the window is only a mask.
Grouped as llama.cpp's iSWA cache and vLLM's hybrid allocator do, the full layers keep one pool and each window
size another, whose tables drop blocks no query can see any more: the window group holds at most
`window - 1 + chunk` tokens per sequence whatever the context.

This module says what the groups are (`kv_groups`), how one budget is split between them (`split_config`: each
group gets the same number of sequences' worth of memory, by the bytes a sequence holds in it at the context
limit), and gives the KV layer a sequence as one group sees it (`SeqView`: a sliding-window group's table starts
at its first visible block, so its blocks, tokens and positions start there too). The pools and the scheduler's
questions over all groups are engine/kv/cache.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.config import CacheConfig
from engine.kv.shape import KVShape
from engine.kv.block_pool import BlockPool, blocks_for
from engine.kv.tiers import device_budget_mb
from engine.sequence import GroupTable, Sequence, cached_table



@dataclass(frozen=True)
class KVGroupSpec:
    """One KV-cache group: the model layers whose K/V one pool holds, and the window they attend over."""

    layers: tuple[int, ...]  # model layer indices, ascending; the pool's layer i is model layer layers[i]
    window: int | None  # None: full attention

    @property
    def title(self) -> str:
        n = len(self.layers)
        kind = "full attention" if self.window is None else f"sliding window {self.window}"
        return f"{kind} · {n} layer{'s' if n != 1 else ''}"

    def live_tokens(self, context: int, chunk: int) -> int:
        """Tokens of one sequence this group holds at most: all `context` (full), else the window's last
        `window - 1` keys beside a step's `chunk` new ones."""
        return context if self.window is None else min(context, self.window - 1 + chunk)

    def live_blocks(self, context: int, chunk: int, block_size: int) -> int:
        """Blocks holding `live_tokens` at most (a window's first visible key can sit anywhere in its block)."""
        if self.window is None:
            return blocks_for(context, block_size)
        return min(blocks_for(context, block_size), blocks_for(self.live_tokens(context, chunk), block_size) + 1)


def kv_groups(spec: KVShape, mode: str = "auto") -> tuple[KVGroupSpec, ...]:
    """The groups of a model: full-attention layers first, then one group per window size (ascending); a model whose
    every layer has one window (Mistral, Phi-3) is one window group. mode "off", or a model whose layers all attend
    without a window: one group of every layer, full attention (a window then only a mask)."""
    windows = spec.sliding_window
    if mode == "off" or all(w is None for w in windows):
        return (KVGroupSpec(tuple(range(spec.num_layers)), None),)
    out = []
    if any(w is None for w in windows):
        out.append(KVGroupSpec(tuple(i for i, w in enumerate(windows) if w is None), None))
    for w in sorted({w for w in windows if w is not None}):
        out.append(KVGroupSpec(tuple(i for i, x in enumerate(windows) if x == w), w))
    return tuple(out)


def split_config(config: CacheConfig, groups: tuple[KVGroupSpec, ...], context: int, chunk: int,
                 kv_heads: int, head_dim: int) -> list[CacheConfig]:
    """Each group's config: `config` with both budgets split in proportion to the bytes one sequence holds in the
    group at the context limit (layers x live tokens), so that every group holds the same number of sequences at
    their peak; but a window group's device budget is at least what one sequence's window and prompt chunk take
    (live_blocks, and the two reserved slots) as far as its layers' share of the budget allows: a request that one
    pool for every layer holds is never refused for its window. The full-attention group keeps at least its layers'
    share. One group: `config` itself."""
    if len(groups) == 1:
        return [config]

    weights = np.asarray([len(g.layers) * g.live_tokens(context, chunk) for g in groups], dtype=np.float64)
    layers = np.asarray([len(g.layers) for g in groups], dtype=np.float64)
    dev = config.device_budget_mb * weights / weights.sum()
    host = config.host_budget_mb * weights / weights.sum()
    full = [i for i, g in enumerate(groups) if g.window is None]
    if not full:  # window groups alone (every layer slides): none has a heavier neighbour to be kept from
        return [config.replace(device_budget_mb=float(d), host_budget_mb=float(h)) for d, h in zip(dev, host)]
    for i, g in enumerate(groups):
        if g.window is None:
            continue
        block = BlockPool.bytes_per_block(config, len(g.layers), kv_heads, head_dim)
        one = device_budget_mb(g.live_blocks(context, chunk, config.block_size), block)
        dev[i] = max(dev[i], min(one, config.device_budget_mb * layers[i] / layers.sum()))
    dev[full] = (config.device_budget_mb - sum(d for i, d in enumerate(dev) if i not in full)) * weights[full] / \
        weights[full].sum()
    return [config.replace(device_budget_mb=float(d), host_budget_mb=float(h)) for d, h in zip(dev, host)]


def bytes_per_token(config: CacheConfig, group: KVGroupSpec, kv_heads: int, head_dim: int) -> float:
    """Bytes a token's K/V takes in the group's blocks (scales included), in `config`'s format."""
    return BlockPool.bytes_per_block(config, len(group.layers), kv_heads, head_dim) / config.block_size


HIDDEN = -(1 << 30)  # the key position of a dropped token still in a table's first block (int32-safe)


class SeqView:
    """A sequence as one sliding-window group's pool sees it: its table (`GroupTable`) starts at block `base`, so
    its tokens, positions and cached counts start at token `base * block_size` too. The KV manager and residency
    (engine/kv/manager.py, residency.py) run unchanged over a view; what changes the sequence itself (its cached
    count, its canonical prefix) is done over all groups by engine/kv/cache.py, so a view refuses it."""

    __slots__ = ("seq", "t", "off")

    def __init__(self, seq: Sequence, table: GroupTable, block_size: int):
        object.__setattr__(self, "seq", seq)
        object.__setattr__(self, "t", table)
        object.__setattr__(self, "off", table.base * block_size)

    # the group's table
    @property
    def blocks(self) -> list[int]:
        return self.t.blocks

    @property
    def hashes(self) -> list[int]:
        return self.t.hashes

    @property
    def table_version(self) -> int:
        return self.t.table_version

    @property
    def base(self) -> int:
        return self.t.base

    @property
    def base_hash(self) -> int:
        return self.t.base_hash

    @property
    def dropped(self) -> int:
        return self.t.dropped

    def table(self) -> np.ndarray:
        return cached_table(self.t)

    def __setattr__(self, name: str, value) -> None:
        if name in ("blocks", "hashes", "table_version"):
            setattr(self.t, name, value)
        elif name == "preemptions":
            self.seq.preemptions = value
        else:
            raise AttributeError(f"a group's view of sequence {self.seq.id} cannot set {name}")

    # the sequence from the table's first token on
    @property
    def num_cached(self) -> int:
        return self.seq.num_cached - self.off

    @property
    def canonical(self) -> int:
        return max(self.seq.canonical - self.off, 0)

    @property
    def tokens(self) -> list[int]:
        return self.seq.tokens[self.off:] if self.off else self.seq.tokens

    @property
    def pos(self) -> list[int]:
        return self.seq.pos[self.off:] if self.off else self.seq.pos

    @property
    def repositioned(self) -> bool:
        return self.seq.repositioned or self.t.dropped > 0

    def key_positions(self, n: int) -> np.ndarray:
        """Positions of the table's first n keys; those of dropped tokens the first block still holds read HIDDEN
        (before any window: never visible, whatever a shift does to the positions)."""
        if not self.seq.repositioned:
            out = np.arange(self.off, self.off + n, dtype=np.int64)
        else:
            out = np.asarray(self.seq.pos[self.off:self.off + n], dtype=np.int64)
        out[:max(self.t.dropped - self.off, 0)] = HIDDEN
        return out

    @property
    def pending(self) -> int:
        return self.seq.pending

    def __getattr__(self, name: str):  # id, state, sampling, arrival, preemptions, ...: the sequence's own
        return getattr(self.seq, name)
