"""Runs the KV-cache group tests share (tests/kv/test_kv_groups.py: Gemma 3, a full group and window groups;
tests/kv/test_window_only_groups.py: Mistral, one window group): a window table followed through a whole request, and
the K/V bytes held at the first token with groups and with one pool."""

from __future__ import annotations

from typing import Callable

from engine.config import CacheConfig, EngineOptions
from engine.kv.block_pool import blocks_for
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams, Sequence


def held_bytes(eng: Engine) -> int:
    return eng.kv.device_bytes() + eng.kv.host_bytes()


def follow_a_window_table(model, p: list[int], bs: int, window: int, table: Callable[[Sequence], object],
                          new_tokens: int = 20, also: Callable[[Sequence], None] | None = None
                          ) -> tuple[Engine, Sequence]:
    """Generate `new_tokens` after `p` on 1 MiB tiers, checking after every step that the window table `table(seq)`
    (its blocks, base and dropped count) holds no key out of the next query's window, and no more than the window
    and the block it starts in while decoding; `also(seq)` checks more after each step. Returns the engine and the
    finished sequence."""
    eng = Engine(model, CacheConfig(block_size=bs, device_budget_mb=1.0, host_budget_mb=1.0),
                 EngineOptions(max_batched_tokens=64))
    seq = eng.seqs[eng.add_request(p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))]
    longest = 0
    while not seq.done:
        eng.step()
        eng.check_invariants()
        if seq.done:
            break
        t = table(seq)
        assert t.dropped >= seq.num_cached - window  # every key out of the next query's window is dropped
        assert len(t.blocks) == blocks_for(seq.num_cached, bs) - t.base
        longest = max(longest, len(t.blocks)) if seq.pending == 1 else longest
        if also is not None:
            also(seq)
    assert longest <= blocks_for(window, bs) + 1  # decoding: the window, and the block it starts in
    return eng, seq


def held_at_the_first_token(model, p: list[int]) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Prefill `p` with groups ("auto") and with one pool ("off"): the K/V bytes each holds when the first token is
    out (cached blocks that left the window dropped first: they are not held for this sequence), and 4 tokens each."""
    out, held = {}, {}
    for mode in ("auto", "off"):
        eng = Engine(model, CacheConfig(block_size=8, device_budget_mb=64, host_budget_mb=64),
                     EngineOptions(kv_groups=mode, max_batched_tokens=128))
        sid = eng.add_request(p, SamplingParams(max_new_tokens=4, ignore_eos=True))
        while eng.seqs[sid].pending > 1:
            eng.step()
        eng.step()  # the last chunk: the first token
        eng.kv.reset_prefix_cache()
        held[mode] = held_bytes(eng)
        while not eng.seqs[sid].done:
            eng.step()
        out[mode] = eng.seqs[sid].output
    return out, held


def a_repeated_prefix(model, p: list[int], bs: int, window: int, group: int):
    """`p` run once, then added again: the engine, the new sequence, and its prefix match and hashes, after checking
    that the match is every full block of `p` but the one holding its last token, and that window group `group`
    needs only the blocks of its last window (match.first / match.window). Returns (eng, seq, match, hashes, first)."""
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    eng = Engine(model, CacheConfig(block_size=bs))
    eng.generate([p], sp)
    seq = eng.seqs[eng.add_request(p, sp)]
    match, hashes = eng.kv.find_prefix(seq)
    n = len(match)
    assert n == (len(p) - 1) // bs and len(hashes) == n
    first = max(0, n * bs - window + 1) // bs
    assert match.first[group] == first and len(match.window[group]) == n - first
    return eng, seq, match, hashes, first
