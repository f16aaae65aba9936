"""A request being generated: its tokens, their positions, and its block table."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import numpy as np

from engine.errors import RequestError

SEED_MAX = 2**63 - 1  # torch.Generator.manual_seed takes any int64


class SeqState(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PAUSED = 2
    PREEMPTED = 3
    FINISHED = 4


def check_token_ids(ids: list, vocab_size: int | None = None) -> None:
    """RequestError naming the first entry that is not an integer token id (bools, floats, strings and lists
    are refused; numpy integers pass) or, given `vocab_size`, lies outside the vocabulary."""
    for i, t in enumerate(ids):
        if isinstance(t, (bool, np.bool_)) or not hasattr(type(t), "__index__"):
            raise RequestError(f"token {i} of the prompt is {t!r}, not an integer token id")
        if vocab_size is not None and not 0 <= t < vocab_size:
            raise RequestError(f"token {i} of the prompt is {t}, outside the vocabulary (0..{vocab_size - 1})")


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    # The tokens to emit, in order, whatever the logits say (a rerun of a recorded run's token stream:
    # engine/lab/kv_replay.py); past its end, sampling as above. Empty: none forced.
    forced: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        """Refuse values the sampler cannot use (RequestError names the field and its range)."""
        def num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or \
                self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens: {self.max_new_tokens!r} must be a positive integer")
        if not num(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature: {self.temperature!r} must be a finite number >= 0 (0: greedy)")
        if not num(self.top_p) or not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p: {self.top_p!r} must be in (0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed <= SEED_MAX):
            raise RequestError(f"seed: {self.seed!r} must be an integer in [0, {SEED_MAX}]")
        if not isinstance(self.forced, tuple) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                                     for t in self.forced):
            raise RequestError("forced: must be a tuple of token ids (integers >= 0)")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def cached_table(t: "Sequence | GroupTable") -> np.ndarray:
    """t.blocks as an int64 array, kept in t until t.table_version changes."""
    if t._np_version != t.table_version or t._np_table is None:
        t._np_table = np.asarray(t.blocks, dtype=np.int64)
        t._np_version = t.table_version
    return t._np_table


@dataclass(slots=True)
class GroupTable:
    """A sequence's block table in a sliding-window KV-cache group (engine/kv/groups.py). The group dropped the first
    `dropped` tokens' keys as they left the window (they never come back, as in transformers' sliding-window cache
    and llama.cpp's iSWA one); the table starts at block `base` = dropped // block_size, whose first tokens up to
    `dropped` are hidden from attention. `base_hash` is the chain hash of block base - 1 (0: none), the parent of
    `hashes[0]`."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    base: int = 0
    dropped: int = 0
    base_hash: int = 0
    table_version: int = 0
    _np_table: np.ndarray | None = None
    _np_version: int = -1


@dataclass(slots=True)
class Sequence:
    id: int
    prompt_len: int
    sampling: SamplingParams
    tokens: list[int]  # every token in cache order: kept prompt, then generated
    pos: list[int]  # position of each token (equals its index until a shift or a seq_add)
    blocks: list[int] = field(default_factory=list)  # lids
    hashes: list[int] = field(default_factory=list)  # chain hash per block, 0 when not hashed
    num_cached: int = 0  # tokens whose K/V are in blocks
    canonical: int = 0  # leading tokens whose K/V equal a fresh prefill at positions 0..n-1
    state: SeqState = SeqState.WAITING
    output: list[int] = field(default_factory=list)  # generated ids (never shifted away)
    prefix_reused: int = 0  # prompt tokens served from cached blocks
    arrival: float = 0.0
    first_token_at: float | None = None
    ttft: float | None = None  # arrival to first generated token, s; a fork carries its parent's
    finished_at: float | None = None
    finish_reason: str = ""
    error: str = ""  # why the engine aborted it (finish_reason "stalled"), for the caller to report
    shifts: int = 0
    preemptions: int = 0
    best: tuple[int, int] = (0, 0)  # furthest (generated, cached) reached: progress is passing it
    label: str = ""
    rng: object = None  # torch.Generator when sampling
    table_version: int = 0  # bumped at every change of `blocks`, so a numpy copy can be cached
    repositioned: bool = False  # some position differs from its index (after a shift, seq_add or seq_div)
    groups: list[GroupTable] = field(default_factory=list)  # tables in the other KV-cache groups (engine/kv/groups.py)
    why_missed: dict = field(default_factory=dict)  # reason -> tokens (engine/kv/misses.py): prompt and key reads
    # Where the model has no full-attention layer, `blocks` is a sliding-window group's table (engine/kv/cache.py)
    # and these say where it starts, as GroupTable's do; with a full-attention group they stay 0.
    base: int = 0  # leading blocks dropped from the table
    dropped: int = 0  # leading tokens whose keys left every window
    base_hash: int = 0  # chain hash of block base - 1 (0: none)
    _np_table: np.ndarray | None = None
    _np_version: int = -1

    def table(self) -> np.ndarray:
        """The block table as an int64 array (cached until the table changes)."""
        return cached_table(self)

    def key_positions(self, n: int) -> np.ndarray:
        """Positions of the first n tokens."""
        if not self.repositioned:
            return np.arange(n, dtype=np.int64)
        return np.asarray(self.pos[:n], dtype=np.int64)

    @property
    def pending(self) -> int:
        """Tokens still to be computed (prompt not yet prefilled, or the last sampled token)."""
        return len(self.tokens) - self.num_cached

    @property
    def done(self) -> bool:
        return self.state == SeqState.FINISHED
