"""One tier of the KV cache: its K and V parts, allocated once, and the metadata of each slot.

`TierPool` holds a tier's per-slot metadata in numpy arrays, with a free-slot stack and an `IndexedSet`
of cached slots (O(1) each); `copy_slots` copies blocks between tiers (on CUDA, on a side stream).
`BlockPool` (engine/kv/block_pool.py) owns two of these and maps logical block ids onto their slots.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from engine.kv.codecs import Parts

NO_HASH = np.uint64(0)


def chain_hash(parent: int, tokens: np.ndarray) -> int:
    """Hash of a full block: its parent's hash and its token ids. Never 0 (0 means "no hash")."""
    h = hashlib.blake2b(digest_size=8)
    h.update(int(parent).to_bytes(8, "little"))
    h.update(np.ascontiguousarray(tokens, dtype=np.int32).tobytes())
    return int.from_bytes(h.digest(), "little") or 1
HIST_K = 2  # LRU-K depth: the last K access times of each block


class Tier(enum.IntEnum):
    DEVICE = 0
    HOST = 1


class CacheFull(RuntimeError):
    """A tier cannot hold what was asked of it even after eviction."""


RESERVED = 2  # device-tier slots past the blocks: the null block and the sink (block_pool.BlockPool._make_tier)


@dataclass(frozen=True)
class TierSizes:
    """What a config's budgets hold, in blocks. With per-layer placement (`device_layers` N of L layers), a
    device-tier block keeps layers [0, N) in device memory and [N, L) in host memory: `dev_block_bytes` of the
    device budget per block, and `spilled_bytes` of the host budget for the device tier's other layers."""

    dev_cap: int
    host_cap: int
    block_bytes: int  # all layers
    dev_layers: int
    dev_block_bytes: int
    spilled_bytes: int  # host memory holding the device tier's layers [N, L) (its reserved slots included)

    @property
    def device_bytes(self) -> int:
        """Device memory the device tier takes: its blocks and reserved slots, their first `dev_layers` layers."""
        return (self.dev_cap + RESERVED) * self.dev_block_bytes

    @property
    def host_bytes(self) -> int:
        """Host memory the host tier and the device tier's spilled layers take."""
        return self.host_cap * self.block_bytes + self.spilled_bytes


def tier_sizes(config, layers: int, block_bytes: int) -> TierSizes:
    """Capacities of both tiers under `config`'s budgets: the one rule of what a budget holds (the device tier keeps
    RESERVED slots past its blocks).

    Raises ConfigError when `device_layers` exceeds the model's layers or the host budget cannot hold the device
    tier's spilled layers."""
    from engine.config import ConfigError

    n = config.device_layers or layers
    if n > layers:
        raise ConfigError(f"device_layers {config.device_layers}: this model has {layers} layers")
    dev_block = block_bytes // layers * n
    dev_cap = max(0, int(config.device_budget_mb * 2**20) // dev_block - RESERVED)
    spilled = (block_bytes - dev_block) * (dev_cap + RESERVED)
    host_bytes = int(config.host_budget_mb * 2**20) - spilled
    if host_bytes < 0:
        raise ConfigError(
            f"device_layers {n}: the device tier's other {layers - n} layers need {spilled / 2**20:.1f} MB of host "
            f"memory but host_budget_mb is {config.host_budget_mb:g}; raise the host budget, lower the device "
            "budget or keep more layers on the device")
    return TierSizes(dev_cap, host_bytes // block_bytes, block_bytes, n, dev_block, spilled)


def device_budget_mb(blocks: int, dev_block_bytes: int) -> float:
    """The device budget (MiB) whose tier holds exactly `blocks` blocks of `dev_block_bytes` each (tier_sizes'
    inverse: the reserved slots counted)."""
    return (blocks + RESERVED) * dev_block_bytes / 2**20


def budget_for_blocks(config, layers: int, block_bytes: int, blocks: int) -> float:
    """device_budget_mb for `config`'s placement: a device-tier block keeps its first `device_layers` layers."""
    n = min(config.device_layers or layers, layers)
    return device_budget_mb(blocks, block_bytes // layers * n)


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

    META = ("lid", "ref", "fill", "owner", "last", "heat", "born", "hash", "parent", "kerr", "verr", "err_born", "why",
            "stores", "gone_t", "gone_by")

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
        # Reconstruction error of the block's K and V as written (engine/fidelity/block_error.py): NaN = not measured. Valid
        # only while err_born equals born (a slot reused by a block whose tokens were not measured reads NaN).
        self.kerr = np.full(n, np.nan, dtype=np.float32)
        self.verr = np.full(n, np.nan, dtype=np.float32)
        self.err_born = np.full(n, np.nan, dtype=np.float64)
        self.tokens = np.zeros((n, block_size), dtype=np.int32)
        # Why the block went to the host tier (engine/kv/misses.py WHY_*), and its hash's earlier lives: times stored
        # before this store, when and why (GONE_*) its last copy left the pool (NaN / 0: never).
        self.why = np.zeros(n, dtype=np.int8)
        self.stores = np.zeros(n, dtype=np.int32)
        self.gone_t = np.full(n, np.nan, dtype=np.float64)
        self.gone_by = np.zeros(n, dtype=np.int8)
        self.free_slots = list(range(n - 1, -1, -1))  # stack: lowest slot first
        self.cached = IndexedSet(max(n, 1))  # slots holding ref-0 hashed blocks

    @property
    def used(self) -> int:
        return self.capacity - len(self.free_slots)

    def nbytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for prefix, parts in (("k", self.k), ("v", self.v)):
            for name, layers in parts.items():
                out[f"{prefix}_{name}"] = layers.nbytes()
        return out

    def metadata_bytes(self) -> int:
        arrays = [getattr(self, m) for m in self.META] + [self.hist, self.tokens, self.cached.items, self.cached.where]
        return sum(a.nbytes for a in arrays) + 8 * self.capacity  # + the free-slot stack

    def copy_meta(self, dst: "TierPool", src_slots: np.ndarray, dst_slots: np.ndarray) -> None:
        for m in self.META + ("hist", "tokens"):
            getattr(dst, m)[dst_slots] = getattr(self, m)[src_slots]


def copy_slots(src: TierPool, src_slots: np.ndarray, dst: TierPool, dst_slots: np.ndarray,
               stream: torch.cuda.Stream | None, device: torch.device) -> None:
    """Copy slots between tiers (or pools), every layer of every part, each layer where it sits. With a CUDA side
    `stream` the copies run on it, ordered against `device`'s current (compute) stream: K/V the model wrote on
    the compute stream land before the copy reads them; a device->host copy is staged in pinned memory and has
    landed before the host reads the staging buffer; attention on the compute stream reads a promoted block only
    after its copy."""
    index: dict[tuple[int, torch.device], torch.Tensor] = {}

    def idx(which: int, slots: np.ndarray, dev: torch.device) -> torch.Tensor:
        key = (which, dev)
        if key not in index:
            index[key] = torch.as_tensor(slots, device=dev)
        return index[key]

    pairs = [(s_t, d_t) for sp, dp in ((src.k, dst.k), (src.v, dst.v)) for name, s_l in sp.items()
             for s_t, d_t in zip(s_l, dp[name])]  # every layer of every part
    if stream is None:
        for s_t, d_t in pairs:
            d_t[idx(1, dst_slots, d_t.device)] = s_t[idx(0, src_slots, s_t.device)].to(d_t.device)
        return
    compute = torch.cuda.current_stream(device)
    stream.wait_stream(compute)  # source written -> copy
    landed: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]] = []
    with torch.cuda.stream(stream):
        for s_t, d_t in pairs:
            si, di = idx(0, src_slots, s_t.device), idx(1, dst_slots, d_t.device)
            gathered = s_t.index_select(0, si)  # [n, ...] on the source's device
            if d_t.device.type == "cpu" and s_t.device.type == "cpu":
                d_t[di] = gathered  # host to host (a layer kept in host memory): no stream involved
            elif d_t.device.type == "cpu":
                staged = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                staged.copy_(gathered, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
                landed.append((d_t, staged, done))
            else:
                if s_t.device.type == "cpu":  # pinned staging, so the host->device copy is truly async
                    gathered = gathered.pin_memory()
                d_t[di] = gathered.to(d_t.device, non_blocking=True)
    for d_t, staged, done in landed:
        done.synchronize()  # the device->host copy has landed: only now may the host read it
        d_t[idx(1, dst_slots, d_t.device)] = staged
    compute.wait_stream(stream)  # copy -> destination readable by attention
