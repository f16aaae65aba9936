"""The migration self-check (engine/runtime/self_check.py): a pool's first tier copy verified byte for byte.

`BlockPool._copy` runs its first copy through `first_copy`: the copy as the pool makes it (`pool.copier`, on CUDA on
the side copy stream), then every layer of every part of the destination slots compared with the source slots (the
source is still intact: a move frees its slots only after the copy). A byte that differs, or an exception, and the
copy is redone synchronously (`copy_slots` without a stream: the reference), and the pool copies that way from then
on. The verdict goes out as a pool event ("self_check"), drained with the others. `pool.copier` is the seam: tests
put a copy that flips a byte there.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from engine.kv.tiers import TierPool, copy_slots


def differing(src: TierPool, src_slots: np.ndarray, dst: TierPool, dst_slots: np.ndarray) -> str | None:
    """None when the destination slots hold the source slots' bytes in every layer of every part; else the first
    part and layer that differ, and how many bytes."""
    for side, sp, dp in (("k", src.k, dst.k), ("v", src.v, dst.v)):
        for name, layers in sp.items():
            for layer, (s_t, d_t) in enumerate(zip(layers, dp[name])):
                a = s_t[torch.as_tensor(src_slots, device=s_t.device)].cpu()
                b = d_t[torch.as_tensor(dst_slots, device=d_t.device)].cpu()
                a, b = a.reshape(len(a), -1).view(torch.uint8), b.reshape(len(b), -1).view(torch.uint8)
                if not torch.equal(a, b):
                    return f"{side} {name} of layer {layer}: {int((a != b).sum())} of {a.numel()} bytes differ"
    return None


def first_copy(pool, src: TierPool, src_slots: np.ndarray, dst: TierPool, dst_slots: np.ndarray) -> None:
    """The pool's first copy, checked (the module doc); the pool's copier and copy stream left as they will serve."""
    t0 = time.perf_counter()
    side = pool.copy_stream is not None
    try:
        pool.copier(src, src_slots, dst, dst_slots, pool.copy_stream, pool.device)
        bad = differing(src, src_slots, dst, dst_slots)
    except Exception as e:  # noqa: BLE001 - a copy that raises: redone the reference way
        bad = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if bad is not None:
        copy_slots(src, src_slots, dst, dst_slots, None, pool.device)  # the reference: synchronous
        pool.copier, pool.copy_stream = copy_slots, None
    pool.copy_checked = True
    pool._emit("self_check", feature="migration", path="migration on the side copy stream" if side else "tier copy",
               ok=bad is None, detail=bad or f"every byte equal: {len(src_slots)} blocks, every layer and part",
               fallback="" if bad is None else "synchronous copies", seconds=time.perf_counter() - t0)
