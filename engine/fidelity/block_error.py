"""What the KV storage format costs each block, measured as tokens are written, and the key channels with outliers.

**Reconstruction error.** When a step's K/V are appended (engine/runtime/step_kv.py, `StepKV.write`), a `StepProbe`
reads the tokens just written straight back through the codec's `decode` and compares each with the K/V the
model computed (in hand, cast to fp32). Per token and layer, over its kv_heads × head_dim values:

    e = ‖x − x̂‖₂ / ‖x‖₂        (relative RMS error: 0.01 means the stored value is off by 1 % of its size)

A block's K error (`TierPool.kerr`) and V error (`verr`) is the **max** of e over the block's tokens and the
model's layers: the worst token of the worst layer. It is kept per slot in the tier's metadata, so it follows
the block through migrations. fp32 stores K/V exactly: its blocks read 0 with nothing decoded. NaN means "not
measured": a block any of whose tokens did not come through this path (written by `BlockPool.write_blocks`, a
re-layout or a restore; the copy-on-write copy of another block; a decode step replayed from a CUDA graph,
whose block keeps the max over the tokens that were measured). A slot's value holds only while `err_born`
equals the slot's `born` (a reused slot reads NaN until its new block is measured).

Cost: per layer, reading the new tokens back: a gather per part of just their entries for a TOKEN_LOCAL codec
(int8-delta's keys, a running sum over the block, decode the blocks written whole). A step of at most
DEFER_TOKENS tokens (decode) holds those and decodes and reduces every layer at once after the last one; a longer
one (prefill) reduces layer by layer. fp32 reads nothing back. The errors stay on the compute device; one small
tensor (with the running key-channel absmax) comes to the host per step. Measured on the default model (CPU, one
thread, a batch-8 decode step at block size 16 or 128): 3-4 % of the step's CPU time for fp16, bf16, int8, int8-kivi
and fp8, 5 % (bs 16) to 11 % (bs 128) for int8-delta, 1 % for fp32 (the key absmax alone).

**Key channels.** Per layer and kv head, a running absmax of every channel of the keys written (post-RoPE),
since the engine started. A channel far above its head's median channel is an outlier: a scale per token is set
by it and leaves the other channels few quantization levels (KIVI's observation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.kv.codecs import Appends, ChannelCodec, Codec, Geometry, Parts, TokenCodec
from engine.kv.tiers import Tier, TierPool

TOP_OUTLIERS = 10  # key channels listed in a snapshot
DEFER_TOKENS = 64  # a step writing at most this many tokens (decode) is reduced once after its last layer
# Codecs whose stored token decodes from that token's entries and its block's per-block entries alone: read back
# token by token. Any other (int8-delta's keys: a running sum over the block; a codec added later) decodes the
# blocks written whole, which is always right and costs block_size times more.
TOKEN_LOCAL = (Codec, TokenCodec, ChannelCodec)


@dataclass(eq=False)  # compared by identity
class _Target:
    """The tokens a step writes into one tier: the distinct blocks (slots), each token's block, and how many
    tokens each block held before the step."""

    tier: TierPool
    slots: np.ndarray  # [U]
    tok_block: np.ndarray  # [T'] index into slots
    prev_fill: np.ndarray  # [U]
    device: torch.device  # where its errors are reduced (a layer's parts may sit elsewhere: device_layers)
    err: torch.Tensor | None = None  # [2, T'] K and V errors, max over the layers so far
    held: list = field(default_factory=list)  # per layer (k, _pick of k, v, _pick of v), reduced in `finish`


class KVErrors:
    """One engine's measurements: the running key-channel absmax, and a probe per eager step."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, device: torch.device):
        self.key_absmax_dev = torch.zeros((layers, kv_heads, head_dim), dtype=torch.float32, device=device)
        self.key_absmax = np.zeros((layers, kv_heads, head_dim), np.float32)  # host copy, after each measured step
        self.keys_seen = 0  # tokens whose keys went into key_absmax
        self._axes: tuple | None = None  # (kcodec, vcodec, their token_axes), for the pool in use

    def probe(self, pool, targets: list[tuple[TierPool, np.ndarray, np.ndarray]], count: bool = True) -> "StepProbe":
        """A probe for a step writing, per tier, tokens (lids, offsets) into `TierPool` tier (its appends' order).
        count=False: the step's tokens are counted by another probe (one per KV-cache group writes them)."""
        out = []
        for tier, lids, offs in targets:
            wl, tok_block = np.unique(lids, return_inverse=True)  # as ModelRunner._appends orders them
            prev_fill = np.full(len(wl), pool.geom.block_size, dtype=np.int64)
            np.minimum.at(prev_fill, tok_block, offs)
            dev = self.key_absmax_dev.device if tier.tier == Tier.DEVICE else torch.device("cpu")
            out.append(_Target(tier, pool.slot[wl], tok_block, prev_fill, dev))
        if count:
            self.keys_seen += sum(len(lids) for _, lids, _ in targets)
        if self._axes is None or self._axes[0] is not pool.kcodec or self._axes[1] is not pool.vcodec:
            self._axes = (pool.kcodec, pool.vcodec, token_axes(pool.kcodec, pool.geom), token_axes(pool.vcodec, pool.geom))
        return StepProbe(self, pool.kcodec, pool.vcodec, not pool.config.kv_dtype.lossless, out, self._axes[2:])

    def outliers(self, top: int = TOP_OUTLIERS) -> list[list]:
        """[layer, kv head, channel, absmax, ratio] of the `top` channels whose absmax is the largest multiple of
        their head's median channel absmax (ratio), largest first; [] before any key was written."""
        a = self.key_absmax
        if not a.any():
            return []
        med = np.median(a, axis=-1, keepdims=True)
        ratio = a / np.maximum(med, np.float32(1e-30))
        idx = np.argsort(ratio, axis=None)[::-1][:top]
        return [[int(lyr), int(h), int(d), float(a[lyr, h, d]), float(ratio[lyr, h, d])]
                for lyr, h, d in zip(*np.unravel_index(idx, a.shape))]


class StepProbe:
    """Measures one step's writes (see the module docstring); `finish()` after the forward pass stores them.

    A step of at most DEFER_TOKENS tokens (decode) only picks, per layer, what reading its tokens back needs (for
    a TOKEN_LOCAL codec the parts' entries of each token, else the decoded tokens) and holds it with the K/V in
    hand; `finish` then decodes and reduces every layer at once. A longer step (prefill) reduces layer by layer.
    """

    def __init__(self, owner: KVErrors, kc: Codec, vc: Codec, lossy: bool, targets: list[_Target], axes: tuple):
        self.owner, self.kc, self.vc, self.lossy, self.targets = owner, kc, vc, lossy, targets
        self.k_axes, self.v_axes = axes
        self.held_keys: list[tuple[int, torch.Tensor]] = []

    def keys(self, layer: int, k: torch.Tensor) -> None:
        """k [T, Hkv, D]: the layer's keys this step, into the running per-channel absmax."""
        if len(k) <= DEFER_TOKENS:
            self.held_keys.append((layer, k.detach()))
            return
        a = self.owner.key_absmax_dev[layer]
        torch.maximum(a, k.detach().abs().amax(dim=0).float(), out=a)

    def measure(self, layer: int, target: int, parts_k: Parts, parts_v: Parts, a: Appends, k: torch.Tensor,
                v: torch.Tensor) -> None:
        """After k, v [T', Hkv, D] were appended through `a` into a tier's parts: their error, max over layers."""
        if not self.lossy:
            return
        t = self.targets[target]
        dev = t.device
        if len(k) <= DEFER_TOKENS:
            t.held.append((k.float().to(dev), _to(_pick(self.kc, self.k_axes, parts_k, layer, a), dev),
                           v.float().to(dev), _to(_pick(self.vc, self.v_axes, parts_v, layer, a), dev)))
            return
        if type(self.kc) is Codec and type(self.vc) is Codec:  # plain storage: what the tier holds is x rounded to it
            x_hat = (k.to(self.kc.storage).float(), v.to(self.vc.storage).float())  # (read back: the same values)
        else:
            x_hat = (stored(self.kc, self.k_axes, parts_k, layer, a), stored(self.vc, self.v_axes, parts_v, layer, a))
        _reduce(t, torch.stack((k.float(), v.float()))[:, None].to(dev), torch.stack(x_hat)[:, None].to(dev))

    def direct(self, tokens: int) -> tuple[np.ndarray, np.ndarray, bool] | None:
        """For a step whose tokens all go to the device tier, written and measured by compiled code
        (numba_kernel.write_plain): (the running key absmax [layers, Hkv, D] to update in place, this step's K and V
        errors [2, tokens] to max into over the layers, whether the format is lossy), both views of what finish()
        reads; None where the probe's tensors are not plain CPU memory (then keys() / measure() are called)."""
        absmax = self.owner.key_absmax_dev
        if absmax.device.type != "cpu" or len(self.targets) != 1 or self.targets[0].device.type != "cpu" \
                or len(self.targets[0].tok_block) != tokens or self.held_keys or self.targets[0].held:
            return None
        t = self.targets[0]
        if self.lossy and t.err is None:
            t.err = torch.full((2, tokens), -np.inf, dtype=torch.float32)
        err = t.err.numpy() if self.lossy else np.empty((2, 0), dtype=np.float32)
        return absmax.numpy(), err, self.lossy

    def finish(self) -> None:
        """One transfer to the host (the compute device's errors and key absmax), then each written block's
        K and V error in its tier's metadata."""
        absmax = self.owner.key_absmax_dev
        if self.held_keys:
            layers = [layer for layer, _ in self.held_keys]
            m = torch.stack([k for _, k in self.held_keys]).abs().amax(dim=1).float()  # [n, Hkv, D]
            if layers == list(range(len(absmax))):
                torch.maximum(absmax, m, out=absmax)
            else:
                idx = torch.tensor(layers, device=absmax.device)
                absmax[idx] = torch.maximum(absmax[idx], m)
            self.held_keys = []
        for t in self.targets:
            if t.held:
                x = torch.stack([torch.stack([h[0] for h in t.held]), torch.stack([h[2] for h in t.held])])
                x_hat = torch.stack([_unpick(self.kc, [h[1] for h in t.held]), _unpick(self.vc, [h[3] for h in t.held])])
                _reduce(t, x, x_hat)  # [2, layers, T', Hkv, D]
                t.held = []
        on_dev = [t for t in self.targets if t.err is not None and t.err.device == absmax.device]
        flat = torch.cat([absmax.reshape(-1)] + [t.err.reshape(-1) for t in on_dev]).cpu().numpy()
        n = absmax.numel()
        self.owner.key_absmax = flat[:n].reshape(absmax.shape)
        at = n
        for t in self.targets:
            if not self.lossy:
                err = np.zeros((2, len(t.tok_block)), np.float32)  # fp32: stored exactly
            elif t.err is None:
                continue  # nothing written there through a probe
            elif t in on_dev:
                err = flat[at:at + t.err.numel()].reshape(2, -1)
                at += t.err.numel()
            else:
                err = t.err.cpu().numpy()
            _store(t, err)


def _reduce(t: _Target, x: torch.Tensor, x_hat: torch.Tensor) -> None:
    """x, x_hat [2 (K, V), layers, T', Hkv, D]: each token's error, max over the layers, into t.err [2, T']."""
    e = torch.linalg.vector_norm(x - x_hat, dim=(-2, -1)) / torch.linalg.vector_norm(x, dim=(-2, -1)).clamp_min(1e-30)
    e = e.amax(dim=1)
    if t.err is None:
        t.err = e
    else:
        torch.maximum(t.err, e, out=t.err)


def _store(t: _Target, err: np.ndarray) -> None:
    """A block's error: this step's max over its new tokens, and over its earlier ones where they were measured
    (NaN where they were not: the block's max is unknown)."""
    tier, slots = t.tier, t.slots
    step = np.full((2, len(slots)), -np.inf, np.float32)
    np.maximum.at(step[0], t.tok_block, err[0])
    np.maximum.at(step[1], t.tok_block, err[1])
    born = tier.born[slots]
    fresh = t.prev_fill == 0
    valid = tier.err_born[slots] == born
    for arr, new in ((tier.kerr, step[0]), (tier.verr, step[1])):
        old = np.where(valid, arr[slots], np.float32(np.nan))
        arr[slots] = np.where(fresh, new, np.maximum(old, new))
    tier.err_born[slots] = born



def token_axes(codec: Codec, g: Geometry) -> dict[str, int | None] | None:
    """Per part, the axis of its per-layer [N, ...] tensor that runs over a block's tokens (None: one entry per
    block), read off the codec's part shapes at a block size no other dimension has; None for a codec that is not
    TOKEN_LOCAL."""
    if type(codec) not in TOKEN_LOCAL:
        return None
    bs = max(g.kv_heads, g.head_dim) + 7
    shapes = codec.parts_shapes(Geometry(1, g.kv_heads, bs, g.head_dim), 1)
    return {name: (shape[1:].index(bs) if bs in shape[1:] else None) for name, (shape, _) in shapes.items()}


def _pick(codec: Codec, axes: dict[str, int | None] | None, parts: Parts, layer: int,
          a: Appends) -> dict[str, torch.Tensor] | torch.Tensor:
    """What reading back the tokens appended through `a` needs: for a TOKEN_LOCAL codec (axes given) each part's
    entries of each token, as T blocks of one token ({part: [T, ..., 1, ...]}); else the tokens decoded from the
    blocks written, whole ([T, Hkv, D])."""
    if axes is None:
        return codec.decode(parts, layer, a.wslots)[a.tok_block, :, a.offsets]
    one = {}
    for name, ax in axes.items():
        t = parts[name][layer]
        if ax is None:
            one[name] = t[a.slots]  # [T, ...] the entry of the token's block
        else:
            idx = [slice(None)] * t.dim()
            idx[0], idx[ax] = a.slots, a.offsets
            one[name] = t[tuple(idx)].unsqueeze(ax)  # [T, ..., 1, ...]
    return one


def _to(picked, device: torch.device):
    """_pick's result on `device` (a no-op where it is there already)."""
    if isinstance(picked, torch.Tensor):
        return picked.to(device)
    return {name: t.to(device) for name, t in picked.items()}


def _unpick(codec: Codec, picked: list) -> torch.Tensor:
    """[layers, T, Hkv, D] fp32 from _pick's results of each layer: one decode for every layer's one-token blocks."""
    if isinstance(picked[0], torch.Tensor):
        return torch.stack(picked)
    blocks = {name: [torch.cat([p[name] for p in picked])] for name in picked[0]}  # every layer's, one after another
    n_blocks = len(blocks["data"][0])
    x = codec.decode(blocks, 0, torch.arange(n_blocks, device=blocks["data"][0].device))[:, :, 0]  # [layers * T, Hkv, D]
    return x.view(len(picked), n_blocks // len(picked), *x.shape[1:])


def stored(codec: Codec, axes: dict[str, int | None] | None, parts: Parts, layer: int, a: Appends) -> torch.Tensor:
    """[T, Hkv, D] fp32: the tokens appended through `a` as the tier now holds them, decoded by the codec (for a
    TOKEN_LOCAL codec from just their entries, else from the blocks written, whole)."""
    return _unpick(codec, [_pick(codec, axes, parts, layer, a)])[0]
