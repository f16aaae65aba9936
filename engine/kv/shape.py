"""What the KV layer knows of a model: the shape of its K/V, and which layers attend over a sliding window."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_window: tuple[int | None, ...]  # per layer: its attention window, None for full attention

    @classmethod
    def of(cls, spec) -> "KVShape":
        """The shape of a model spec (engine/model/spec.py ModelSpec, or anything with these four fields)."""
        return cls(int(spec.num_layers), int(spec.num_kv_heads), int(spec.head_dim),
                   tuple(getattr(spec, "sliding_window", None) or (None,) * int(spec.num_layers)))
