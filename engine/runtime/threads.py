"""The compiled kernels' threads follow torch's.

numba's kernels (attention over the blocks, the fp32 and packed matmuls) run on numba's own thread pool, which
takes every core unless told otherwise, and numba keeps that number per calling thread. A thread that runs the
model calls follow_torch() once, so its kernels use the cores torch was given: the window gives the engine all
but one (app/window/launch.py) and the UI keeps that one whatever the step runs in.
"""

from __future__ import annotations

import torch


def follow_torch() -> int | None:
    """Set numba's thread count for the calling thread to torch's (at most numba's pool size); the count set, or
    None where numba does not import."""
    try:
        import numba
    except Exception:  # no numba: the torch paths run, on torch's threads
        return None
    n = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(n)
    return n
