"""Traces others publish: block-hash request traces, read into the what-if curves and into replays.

Two JSONL shapes, one request a line, told apart by their keys:

- **Mooncake** (FAST '25 traces; also AIPerf's `mooncake_trace`): `timestamp` (ms from the start), `input_length`,
  `output_length`, `hash_ids` (one id per 512-token block of the input; requests with the same leading ids share
  that prefix).
- **Bailian** (Alibaba's Qwen serving traces, the AIPerf multi-turn style): `chat_id`, `parent_chat_id` (-1: a
  first turn), `turn`, `timestamp` (seconds), `input_length`, `output_length`, `hash_ids` (16-token blocks).

Other keys on a line (`type`, `session_id`, ...) are ignored. No tokens are needed for the curves (engine/lab/whatif.py
`block_stream`): a request reads its `hash_ids` blocks, then writes ceil((input + output) / block) - len(hash_ids)
new ones, read once. For a
replay (`bench --trace`, `--replay`) tokens are synthesized: each hash id stands for a fixed run of `block`
token ids drawn from ids 16 .. 2,015 by a generator seeded with the id, so equal ids are equal tokens and the
engine's prefix cache finds what the trace shares (at a block size that divides the trace's).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from engine.user_file import json_lines

MOONCAKE_BLOCK = 512
BAILIAN_BLOCK = 16
FIRST_TOKEN, TOKEN_SPAN = 16, 2000  # synthesized ids: 16 .. 2015 (inside the smallest vocabulary we serve)
MAX_HASH_IDS = 1 << 16  # per line: 33M tokens at 512 a block


@dataclass(frozen=True)
class BlockRequest:
    """One line of a block-hash trace. t_s: seconds from the trace's clock origin."""
    t_s: float
    session: str
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    block_tokens: int
    fmt: str  # "mooncake" or "bailian"
    line: int | None = None


def is_block_trace_line(obj: object) -> bool:
    return isinstance(obj, dict) and "hash_ids" in obj


def _int(obj: dict, key: str, low: int, what: str) -> int:
    v = obj.get(key)
    if v is None:
        raise ValueError(f"missing {key!r} ({what})")
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{key} must be an integer >= {low} ({what}), got {v!r:.40}")
    return v


def parse_block_line(obj: object, line: int | None = None) -> BlockRequest:
    """A Mooncake or Bailian line (by its keys: `chat_id` means Bailian); ValueError names what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    bailian = "chat_id" in obj
    fmt, block = ("bailian", BAILIAN_BLOCK) if bailian else ("mooncake", MOONCAKE_BLOCK)
    ts = obj.get("timestamp")
    if ts is None:
        raise ValueError(f"missing 'timestamp' ({'seconds' if bailian else 'milliseconds'} from the start)")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"timestamp must be a number >= 0, got {ts!r:.40}")
    t_s = float(ts) if bailian else float(ts) / 1000.0
    if t_s > 10_000_000.0:
        raise ValueError(f"timestamp is {t_s:,.0f} s from the start; at most 10,000,000 s")
    n_in = _int(obj, "input_length", 1, "prompt tokens")
    n_out = _int(obj, "output_length", 0, "generated tokens")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0
                                                       for h in ids):
        raise ValueError("hash_ids must be a non-empty list of integers >= 0")
    if len(ids) > MAX_HASH_IDS:
        raise ValueError(f"hash_ids has {len(ids):,} blocks; at most {MAX_HASH_IDS:,}")
    if (len(ids) - 1) * block >= n_in:
        raise ValueError(f"{len(ids)} hash_ids of {block} tokens are more than input_length {n_in} needs "
                         f"({math.ceil(n_in / block)})")
    if bailian:
        chat = _int(obj, "chat_id", 0, "the conversation turn's id")
        session = f"chat-{chat}"
    else:
        session = f"req-{line}" if line is not None else f"req-{ids[0]}-{n_in}"
    return BlockRequest(t_s, session, n_in, n_out, tuple(ids), block, fmt, line)


def read_block_trace(path: str | os.PathLike[str]) -> list[BlockRequest]:
    """Every line of a Mooncake or Bailian trace, sorted by time; the first bad line raises
    ValueError("PATH:LINE: problem"), as does a file that mixes the two formats."""
    out: list[BlockRequest] = []
    fmt = None
    for ln in json_lines(path, "a trace"):
        if ln.problem is not None:
            raise ValueError(f"{os.fspath(path)}:{ln.number}: {ln.problem}")
        try:
            r = parse_block_line(ln.value, ln.number)
        except ValueError as e:
            raise ValueError(f"{os.fspath(path)}:{ln.number}: {e}") from None
        if fmt is not None and r.fmt != fmt:
            raise ValueError(f"{os.fspath(path)}:{ln.number}: a {r.fmt} line in a {fmt} trace")
        fmt = r.fmt
        out.append(r)
    if not out:
        raise ValueError(f"{os.fspath(path)}: no requests in the trace")
    return sorted(out, key=lambda r: r.t_s)


# -- into a replay (bench --trace, --replay) ----------------------------------------------------------------

_BLOCK_CACHE: dict[tuple[int, int], list[int]] = {}


def block_token_ids(hash_id: int, n: int) -> list[int]:
    """The synthesized tokens of one block: n ids in FIRST_TOKEN .. FIRST_TOKEN + TOKEN_SPAN - 1, seeded by the id."""
    key = (hash_id, n)
    got = _BLOCK_CACHE.get(key)
    if got is None:
        got = (np.random.default_rng(hash_id).integers(0, TOKEN_SPAN, n) + FIRST_TOKEN).tolist()
        if len(_BLOCK_CACHE) < 100_000:
            _BLOCK_CACHE[key] = got
    return got


def synthesized_prompt(r: BlockRequest) -> list[int]:
    toks: list[int] = []
    for h in r.hash_ids:
        toks.extend(block_token_ids(h, r.block_tokens))
    return toks[:r.input_length]
