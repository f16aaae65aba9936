"""The benches' prompts: the same English text (assets/bench_text.txt) cut into token prompts of a given length,
so every bench and every run measures the same work."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASSET = os.path.join(ROOT, "assets", "bench_text.txt")


def bench_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """n distinct prompts of exactly `length` tokens, cut from the bench text at different offsets."""
    with open(ASSET, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read())
    while len(ids) < length + n * 17:
        ids = ids + ids
    return [ids[i * 17:i * 17 + length] for i in range(n)]
