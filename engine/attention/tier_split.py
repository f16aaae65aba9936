"""Attention split by tier (host_reads="compute"): host-resident blocks are attended where they are, llama.cpp-style.

A group whose table has blocks on the host tier (PagedBatch.on_host) is attended in two parts, each a *partial*
(output, log-sum-exp) per query and head:

- the device part: the backend over the device tier's blocks, the host ones hidden;
- the host part: the CPU path over only the table's host columns, read from the host tier's parts, on the host.

`merge_partials` combines them as flash-decoding's split-K does; a model's attention sinks (GPT-OSS) join after
that, as one more term of the log-sum-exp (`add_sinks`). On CUDA nothing of a host block crosses PCIe:
q goes to the host (its copy queued before the device part, so the GPU computes while the CPU does), and the
host part's output and lse come back, [B, Q, H, D + 1] floats. Streaming (host_reads="stream") is the other way:
`read_blocks` copies every host block of every layer to the device.

Hiding keys from a side: a key's position is set to HIDDEN, past every query, so the visibility rule
(engine/attention/__init__.py) never shows it; each side's explicit key positions carry that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.interface import PagedBatch, PagedKV
from engine.attention.reading import key_positions

HIDDEN = 1 << 62  # a key position after every query: never visible


@dataclass(frozen=True)
class TierSplit:
    """A group's batch as two partials read it (built once per step, used by every layer)."""

    device: PagedBatch | None  # the device tier's blocks, host keys hidden; None: no row has a device block
    host: PagedBatch  # the host columns only (CPU tensors): table = slots in paged.host, other rows' keys hidden


def split_by_tier(batch: PagedBatch, block_size: int) -> TierSplit | None:
    """The split of a batch with blocks on the host tier (None when it has none)."""
    if batch.on_host is None:
        return None
    bs = block_size
    B, NB = batch.block_table.shape
    dev = batch.block_table.device
    on_host = batch.on_host.cpu()  # [B, NB] bool; one small copy per step on CUDA
    cols = torch.nonzero(on_host.any(0)).reshape(-1)  # [C] columns with a host block in some row
    if not len(cols):
        return None
    ctx = batch.context_lens.cpu().long()  # [B]
    kpos = key_positions(batch, NB * bs).cpu()  # [B, S]
    used = torch.arange(NB)[None, :] * bs < ctx[:, None]  # [B, NB] blocks inside each row's context
    device = None
    if bool((used & ~on_host).any()):
        host_keys = on_host.repeat_interleave(bs, dim=1).to(dev, non_blocking=True)  # [B, S]
        device = PagedBatch(block_table=batch.block_table, context_lens=batch.context_lens, q_pos=batch.q_pos,
                            key_pos=torch.where(host_keys, HIDDEN, key_positions(batch, NB * bs)))
    keys = (cols[:, None] * bs + torch.arange(bs)[None, :]).reshape(-1)  # [C*bs] key indices of those columns
    shown = on_host[:, cols].repeat_interleave(bs, dim=1) & (keys[None, :] < ctx[:, None])  # [B, C*bs]
    host = PagedBatch(block_table=batch.host_table[:, cols].long(), context_lens=torch.full((B,), len(keys)),
                      q_pos=batch.q_pos.cpu().long(), key_pos=torch.where(shown, kpos[:, keys], HIDDEN))
    return TierSplit(device=device, host=host)


def merge_partials(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partials over disjoint keys -> the partial over their union: o [..., D], lse [...] (fp32).

    A side with no visible key has lse -inf and o 0 and weighs 0; when neither has one, the result is (0, -inf).
    """
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # both -inf: exp(-inf - 0) = 0, never NaN
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    o = (o_a * w_a[..., None] + o_b * w_b[..., None]) / torch.where(total > 0, total, 1.0)[..., None]
    return o, m + torch.log(total)


def add_sinks(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A partial (o [..., H, D], lse [..., H]) with each head's attention sink (sinks [H], a logit) joined: the sink
    is one more term of the log-sum-exp, a key whose value is 0, so o scales by exp(lse) / (exp(lse) + exp(sink))."""
    sink_lse = sinks.to(device=lse.device, dtype=torch.float32).expand_as(lse)
    return merge_partials(o, lse, torch.zeros_like(o), sink_lse)


def attend_split(device_side, host_side, q: torch.Tensor, layer: int, paged: PagedKV, split: TierSplit, *,
                 scale: float, window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Q, H, D] -> [B, Q, H, D] in q's dtype: device_side.partial over split.device, host_side.partial over
    split.host on the CPU (paged.host's parts), merged; then the attention sinks [H], if any (add_sinks)."""
    cuda = q.is_cuda
    if cuda:  # q to the host first (queued), then the device part: the GPU computes while the CPU does
        q_host = torch.empty(q.shape, dtype=q.dtype, pin_memory=True)
        q_host.copy_(q, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
    else:
        q_host = q
    dev = None
    if split.device is not None:
        dev = device_side.partial(q, layer, paged, split.device, scale=scale, window=window)
    if cuda:
        copied.synchronize()
    o, lse = host_side.partial(q_host, layer, paged.host, split.host, scale=scale, window=window)  # on the CPU
    if cuda:
        o, lse = o.to(q.device, non_blocking=True), lse.to(q.device, non_blocking=True)
    if dev is not None:
        o, lse = merge_partials(dev[0], dev[1], o, lse)
    if sinks is not None:
        o, lse = add_sinks(o, lse, sinks)
    return o.to(q.dtype)


def attend_on_host(host_side, q: torch.Tensor, layer: int, paged: PagedKV, batch: PagedBatch, q_len: int, *,
                   scale: float, window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A layer the device tier keeps in host memory (per-layer placement, `device_layers`): the whole layer
    attended on the host CPU, where its K/V are (both tiers' blocks), and the output sent back, as llama.cpp does
    for layers whose KV is not offloaded. q [B*Q, H, D] -> the same shape on q's device."""
    cpu = torch.device("cpu")
    pb = PagedBatch(**{f: (getattr(batch, f).to(cpu) if getattr(batch, f) is not None else None)
                       for f in ("block_table", "context_lens", "q_pos", "key_pos", "on_host", "host_table")})
    qh = q.to(cpu)
    sinks = None if sinks is None else sinks.to(cpu)
    if q_len == 1:
        o = host_side.decode(qh, layer, paged, pb, scale=scale, window=window, sinks=sinks)
    else:
        B = pb.block_table.shape[0]
        o = host_side.prefill(qh.view(B, q_len, *qh.shape[1:]), layer, paged, pb, scale=scale, window=window,
                              sinks=sinks)
    return o.reshape(q.shape).to(q.device, non_blocking=True)


def lse_of(m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """Log-sum-exp of a running max m and sum l (online softmax); -inf where nothing was visible (l = 0)."""
    return torch.where(l > 0, m + torch.log(l), float("-inf"))
