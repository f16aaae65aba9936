"""One step's view of the cache for the model (`StepKV`): where the step's new K/V go, and the tiers to read.

The model runner builds one per step; the model's attention layers call `write` for each layer's new K/V and
read the tiers through it; CUDA-graph capture builds one over its static buffers (engine/runtime/cuda_graphs.py).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.attention import PagedKV, read_blocks
from engine.attention.host_stream import StepStream
from engine.fidelity.block_error import StepProbe
from engine.kv.block_pool import BlockPool, Tier
from engine.kv.codecs import Appends, Codec

PLAIN = (torch.float32, torch.float16, torch.bfloat16)  # what plain_writes takes


class StepKV:
    """The model's view of the cache for one step: where new K/V go, and the tiers to read."""

    def __init__(self, pool: BlockPool, appends: Appends, host: tuple[torch.Tensor, Appends] | None = None,
                 probe: StepProbe | None = None, layer_ids: tuple[int, ...] | None = None):
        self.pool = pool
        # The model layer of each of the pool's layers (a KV-cache group's, engine/kv/groups.py); None: the same.
        self.layer_ids = layer_ids
        self.stream: StepStream | None = None  # host blocks read through staging (set by ModelRunner.build)
        self.probe = probe  # measures what the step writes (engine/fidelity/block_error.py); None: nothing measured
        self.dev = pool.tiers[Tier.DEVICE]
        self.appends = appends  # slot_mapping (slot, offset) of every new token, and the blocks they extend
        # Tokens whose blocks are on the host tier (a device tier too small for the step's writes): their rows of
        # the step's K/V and their appends into the host tier's parts. None: every write goes to the device tier.
        self.host = host
        self._moved: dict[torch.device, Appends] = {}  # self.appends on another device, made once per step

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, kv_heads, head_dim]: appended in place, one scatter per part; no block is re-encoded."""
        kc, vc, probe = self.pool.kcodec, self.pool.vcodec, self.probe
        if self.stream is not None:
            self.stream.at_layer(layer)  # the next layer's host blocks start copying while this one computes
        if probe is not None:
            probe.keys(layer if self.layer_ids is None else self.layer_ids[layer], k)
        if self.host is None:
            app, k, v = self._placed(layer, self.appends, k, v)
            kc.append(self.dev.k, layer, app, k)
            vc.append(self.dev.v, layer, app, v)
            if probe is not None:
                probe.measure(layer, 0, self.dev.k, self.dev.v, app, k, v)
            return
        rows, happ = self.host
        ht = self.pool.tiers[Tier.HOST]
        hk, hv = k[rows].to(ht.k["data"].device), v[rows].to(ht.v["data"].device)
        kc.append(ht.k, layer, happ, hk)
        vc.append(ht.v, layer, happ, hv)
        if self.stream is not None:  # written after this layer's copy was issued: staged again
            self.stream.refresh(layer, happ.wslots)
        if probe is not None:
            probe.measure(layer, 1, ht.k, ht.v, happ, hk, hv)
        if self.appends is not None:
            app, dk, dv = self._placed(layer, self.appends, k[self.appends.rows], v[self.appends.rows])
            kc.append(self.dev.k, layer, app, dk)
            vc.append(self.dev.v, layer, app, dv)
            if probe is not None:
                probe.measure(layer, 0, self.dev.k, self.dev.v, app, dk, dv)

    def plain_writes(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(slots, offsets) of the step's tokens, in row order, where a compiled decode layer may write them itself
        (quant_layer.decode_layer, numba_kernel.write_plain): every token to the device tier, nothing streamed,
        plain codecs (fp32 / fp16 / bf16, Codec itself) on both sides, every layer's blocks in CPU memory. None
        otherwise: write() does it."""
        if self.host is not None or self.stream is not None or self.appends is None or self.appends.rows is not None:
            return None
        kc, vc = self.pool.kcodec, self.pool.vcodec
        if type(kc) is not Codec or type(vc) is not Codec or kc.storage != vc.storage or kc.storage not in PLAIN:
            return None
        data = self.dev.k["data"]
        if any(data[i].device.type != "cpu" for i in (0, len(data) - 1)) or self.appends.slots.device.type != "cpu":
            return None
        return (self.appends.slots.to(torch.int64).contiguous().numpy(),
                self.appends.offsets.to(torch.int64).contiguous().numpy())

    def _placed(self, layer: int, app: Appends, k: torch.Tensor, v: torch.Tensor):
        """Appends and K/V on the device the device tier keeps `layer` on (host memory past device_layers)."""
        where = self.dev.k["data"][layer].device
        if where == k.device:
            return app, k, v
        if where not in self._moved:
            self._moved[where] = app.to(where)
        return self._moved[where], k.to(where), v.to(where)

    def gather(self, layer: int, group) -> tuple[torch.Tensor, torch.Tensor]:
        batch, paged, every = group.paged(), self.paged(), slice(None)
        kc, vc = self.pool.kcodec, self.pool.vcodec
        return (read_blocks(paged, "k", batch, every, lambda p, sl: kc.decode(p, layer, sl), False),
                read_blocks(paged, "v", batch, every, lambda p, sl: vc.decode(p, layer, sl), False))

    def paged(self) -> PagedKV:
        host = self.pool.tiers[Tier.HOST]
        dtype = self.pool.config.kv_dtype
        staged = None
        if self.stream is not None:
            sk, sv = self.stream.sides
            staged = PagedKV(k=sk, v=sv, dtype=dtype)
        return PagedKV(k=self.dev.k, v=self.dev.v, dtype=dtype, host=PagedKV(k=host.k, v=host.v, dtype=dtype),
                       staged=staged)
