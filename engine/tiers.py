"""One tier of the KV cache: its K and V parts, allocated once, and the metadata of each slot.

`TierPool` holds a tier's per-slot metadata in numpy arrays, with a free-slot stack and an `IndexedSet`
of cached slots (O(1) each); `copy_slots` copies blocks between tiers (on CUDA, on a side stream).
`BlockPool` (engine/block_pool.py) owns two of these and maps logical block ids onto their slots.
"""

from __future__ import annotations

import enum

import numpy as np
import torch

from engine.codecs import Parts

NO_HASH = np.uint64(0)
HIST_K = 2  # LRU-K depth: the last K access times of each block


class Tier(enum.IntEnum):
    DEVICE = 0
    HOST = 1


class BlockState(enum.IntEnum):
    FREE = 0
    CACHED = 1  # no owner, kept for prefix reuse
    IN_USE = 2


class CacheFull(RuntimeError):
    """A tier cannot hold what was asked of it even after eviction."""


class IndexedSet:
    """A set of small ints with O(1) add/remove/contains and a dense numpy view of its members."""

    def __init__(self, universe: int):
        self.items = np.empty(universe, dtype=np.int64)
        self.where = np.full(universe, -1, dtype=np.int64)
        self.n = 0

    def add(self, x: int) -> None:
        if self.where[x] >= 0:
            return
        self.items[self.n] = x
        self.where[x] = self.n
        self.n += 1

    def discard(self, x: int) -> None:
        i = self.where[x]
        if i < 0:
            return
        last = self.items[self.n - 1]
        self.items[i] = last
        self.where[last] = i
        self.where[x] = -1
        self.n -= 1

    def __contains__(self, x: int) -> bool:
        return self.where[x] >= 0

    def __len__(self) -> int:
        return self.n

    def view(self) -> np.ndarray:
        return self.items[: self.n]


class TierPool:
    """One tier: K and V parts allocated once, and the metadata of each slot in numpy arrays.

    Metadata is kept per slot, not per logical block, so a snapshot of a tier is a few contiguous
    array copies (a random gather of a million entries would cost ten times more).
    """

    META = ("lid", "ref", "fill", "owner", "last", "heat", "born", "hash", "parent")

    def __init__(self, tier: Tier, capacity: int, k: Parts, v: Parts, block_size: int, universe: int,
                 null_slot: int | None = None):
        self.tier = tier
        self.capacity = capacity
        self.null_slot = null_slot  # device tier: a zero block past the capacity that pads block tables,
        self.sink_slot = None if null_slot is None else null_slot + 1  # and one that padding rows write to
        self.k, self.v = k, v
        n = capacity
        self.lid = np.full(n, -1, dtype=np.int64)  # -1: free slot
        self.ref = np.zeros(n, dtype=np.int32)
        self.fill = np.zeros(n, dtype=np.int32)
        self.owner = np.full(n, -1, dtype=np.int32)
        self.last = np.zeros(n, dtype=np.float64)
        self.hist = np.zeros((n, HIST_K), dtype=np.float64)
        self.heat = np.zeros(n, dtype=np.float64)
        self.born = np.zeros(n, dtype=np.float64)
        self.hash = np.zeros(n, dtype=np.uint64)
        self.parent = np.zeros(n, dtype=np.uint64)  # the hash of the block before it in its prefix (0: the first)
        self.tokens = np.zeros((n, block_size), dtype=np.int32)
        self.free_slots = list(range(n - 1, -1, -1))  # stack: lowest slot first
        self.cached = IndexedSet(max(n, 1))  # slots holding ref-0 hashed blocks

    @property
    def used(self) -> int:
        return self.capacity - len(self.free_slots)

    def nbytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for prefix, parts in (("k", self.k), ("v", self.v)):
            for name, t in parts.items():
                out[f"{prefix}_{name}"] = t.numel() * t.element_size()
        return out

    def metadata_bytes(self) -> int:
        arrays = [getattr(self, m) for m in self.META] + [self.hist, self.tokens, self.cached.items, self.cached.where]
        return sum(a.nbytes for a in arrays) + 8 * self.capacity  # + the free-slot stack

    def copy_meta(self, dst: "TierPool", src_slots: np.ndarray, dst_slots: np.ndarray) -> None:
        for m in self.META + ("hist", "tokens"):
            getattr(dst, m)[dst_slots] = getattr(self, m)[src_slots]


def _dev_of(t: TierPool) -> torch.device:
    return t.k["data"].device


def copy_slots(src: TierPool, src_slots: np.ndarray, dst: TierPool, dst_slots: np.ndarray,
               stream: torch.cuda.Stream | None, device: torch.device) -> None:
    """Copy slots between tiers (or pools), every part. With a CUDA side `stream` the copies run on it, ordered
    against `device`'s current (compute) stream: K/V the model wrote on the compute stream land before the copy
    reads them; a device->host copy is staged in pinned memory and has landed before the host reads the staging
    buffer; attention on the compute stream reads a promoted block only after its copy."""
    src_dev, dst_dev = _dev_of(src), _dev_of(dst)
    si = torch.as_tensor(src_slots, device=src_dev)
    di = torch.as_tensor(dst_slots, device=dst_dev)
    pairs = [(s_t, dp[name]) for sp, dp in ((src.k, dst.k), (src.v, dst.v)) for name, s_t in sp.items()]
    if stream is None:
        for s_t, d_t in pairs:
            d_t[:, di] = s_t[:, si].to(dst_dev)
        return
    compute = torch.cuda.current_stream(device)
    stream.wait_stream(compute)  # source written -> copy
    landed: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]] = []
    with torch.cuda.stream(stream):
        for s_t, d_t in pairs:
            gathered = s_t.index_select(1, si)  # [L, n, ...] on the source's device
            if dst_dev.type == "cpu":
                staged = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                staged.copy_(gathered, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
                landed.append((d_t, staged, done))
            else:
                if src_dev.type == "cpu":  # pinned staging, so the host->device copy is truly async
                    gathered = gathered.pin_memory()
                d_t[:, di] = gathered.to(dst_dev, non_blocking=True)
    for d_t, staged, done in landed:
        done.synchronize()  # the device->host copy has landed: only now may the host read it
        d_t[:, di] = staged
    compute.wait_stream(stream)  # copy -> destination readable by attention
