"""Faults injected to prove the self-checks (engine/runtime/self_check.py) catch them, each through a seam of the
engine: a backend put on the model, a copier put on a pool. The tests (tests/runtime/test_self_check.py) and the
GPU check script (app/stress/gpu_check.py) inject the same ones."""

from __future__ import annotations

import torch


class WrongBackend:
    """A paged backend that computes right and then adds a small error to every decode output."""

    def __init__(self, inner, error: float = 1e-2):
        self.inner, self.error, self.name = inner, error, inner.name

    def decode(self, q, layer, paged, batch, **kw):
        return self.inner.decode(q, layer, paged, batch, **kw) + self.error

    def prefill(self, *a, **kw):
        return self.inner.prefill(*a, **kw)

    def partial(self, *a, **kw):
        return self.inner.partial(*a, **kw)


class RaisingBackend(WrongBackend):
    def decode(self, q, layer, paged, batch, **kw):
        raise RuntimeError("no kernel image is available for execution on the device")


def flip_one_byte(copy):
    """A copier (tiers.copy_slots' signature) that copies, then flips one byte of the first destination slot."""

    def bad(src, src_slots, dst, dst_slots, stream, device):
        copy(src, src_slots, dst, dst_slots, stream, device)
        t = dst.k["data"][0]
        t[int(dst_slots[0])].view(-1).view(torch.uint8)[3] ^= 0x40
    return bad
