"""A paged backend checked against the reference on a scratch sequence (the attention self-check, run before the
backend serves: engine/runtime/self_check.py).

The scratch K/V are random, encoded in the live storage format and block size into a small tier of their own (one
layer, on the compute device; the pool is not touched), laid out in shuffled slots so no table is contiguous. The
cases are the variants the model will call: decode over short rows (one with a single key, one ending inside a
block), decode with explicit key positions (a repositioned row, some keys after the query), each sliding window the
model has, attention sinks if it has them, a prefill chunk, the partial (output and log-sum-exp) that
host_reads="compute" merges, and on CUDA a long row, which the triton kernel splits across programs. Each output is
compared with `ReferenceBackend` (codec.decode of the whole table, SDPA in fp32) on the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.interface import PagedBatch, PagedKV
from engine.attention.reference import ReferenceBackend
from engine.config import KVDtype
from engine.kv.codecs import Geometry, codecs_for

# Largest |Δ| between a backend's output and the reference's, per q dtype: both compute in fp32 and round to q's
# dtype at the end, so fp32 differs by summation order only, a half type by one rounding of outputs of size ~1.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


@dataclass(frozen=True)
class CheckResult:
    worst: float  # the largest |Δ| over every case (NaN counts as infinite)
    tolerance: float
    cases: int
    worst_case: str  # the case it came from

    @property
    def ok(self) -> bool:
        return self.worst <= self.tolerance


def check_backend(backend, kv_dtype: KVDtype, block_size: int, heads: int, kv_heads: int, head_dim: int,
                  device: torch.device, q_dtype: torch.dtype = torch.float32, windows: tuple[int, ...] = (),
                  sinks: bool = False, seed: int = 0) -> CheckResult:
    """`backend`'s decode, prefill and partial against ReferenceBackend on scratch K/V of this geometry and format.
    Raises what the backend raises."""
    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    bs, D, H = block_size, head_dim, heads
    # Blocks of a short row: on CUDA up to 512 keys (one program per row), elsewhere 16 (the chunk loop is the same
    # at any length, and the triton interpreter runs a program per block in Python), at least one block.
    short = max(1, (512 if device.type == "cuda" else 16) // bs)
    rows: dict[str, list[int]] = {"short": [1, min(short * bs, bs + 1), max(1, short * bs - bs // 2)]}
    rows["prefill"] = [bs + 4, 2 * bs + 5]
    if device.type == "cuda":
        rows["long"] = [4 * 512 + 3]  # the kernel splits it (flash-decoding's split-K)
    kc, vc = codecs_for(kv_dtype)
    tables: dict[str, torch.Tensor] = {}
    need = sum(-(-c // bs) for ctx in rows.values() for c in ctx)
    order = torch.randperm(need, generator=g)  # shuffled slots: no table is contiguous
    used = 0
    for name, ctx in rows.items():
        nb = max(-(-c // bs) for c in ctx)
        t = torch.full((len(ctx), nb), need, dtype=torch.int64)  # padded with the last slot (zeros: never visible)
        for b, c in enumerate(ctx):
            k = -(-c // bs)
            t[b, :k] = order[used:used + k]
            used += k
        tables[name] = t.to(device)
    geom = Geometry(1, kv_heads, bs, D)
    n = need + 1
    k_parts, v_parts = kc.alloc(geom, n, device, False), vc.alloc(geom, n, device, False)
    slots = torch.arange(need, device=device)
    kc.encode(k_parts, 0, slots, torch.randn(need, kv_heads, bs, D, generator=g).to(device))
    vc.encode(v_parts, 0, slots, torch.randn(need, kv_heads, bs, D, generator=g).to(device))
    paged = PagedKV(k=k_parts, v=v_parts, dtype=kv_dtype)
    ref = ReferenceBackend()
    scale = D ** -0.5
    sink = torch.randn(H, generator=g).to(device) if sinks else None

    def batch(name: str, q_len: int = 1, shift: int = 0) -> PagedBatch:
        ctx = torch.tensor(rows[name], dtype=torch.int64)
        table = tables[name]
        qpos = (ctx - 1)[:, None] - torch.arange(q_len - 1, -1, -1)[None, :]  # [B, Q]: the last q_len keys
        key_pos = None
        if shift:  # repositioned: key i at i + shift, the query before the last two keys (they are not visible)
            key_pos = torch.arange(table.shape[1] * bs)[None, :].expand(len(ctx), -1) + shift
            qpos = qpos + shift - torch.clamp(ctx - 1, max=2)[:, None]
            key_pos = key_pos.to(device)
        return PagedBatch(block_table=table, context_lens=ctx.to(device), q_pos=qpos.to(device), key_pos=key_pos)

    def q(b: int, q_len: int = 0) -> torch.Tensor:
        shape = (b, H, D) if not q_len else (b, q_len, H, D)
        return torch.randn(*shape, generator=g).to(device=device, dtype=q_dtype)

    worst, where, cases = 0.0, "", 0

    def compare(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        nonlocal worst, where, cases
        cases += 1
        d = (got.float() - want.float()).abs()
        finite = torch.isfinite(want.float())  # lse of a row with no visible key: -inf on both sides
        d = torch.where(finite, d, torch.where(got.float() == want.float(), 0.0, float("inf")))
        m = float(d.max()) if d.numel() else 0.0
        m = float("inf") if m != m else m
        if m > worst or not where:
            worst, where = m, name

    decode_cases = [("decode", "short", None, 0, None)]
    decode_cases.append(("decode, repositioned keys", "short", None, 5, None))
    for w in sorted(set(windows)):
        decode_cases.append((f"decode, window {w}", "short", max(2, min(w, bs + 3)), 0, None))
    if sinks:
        decode_cases.append(("decode, attention sinks", "short", None, 0, sink))
    if "long" in rows:
        decode_cases.append(("decode, long row (split)", "long", None, 0, None))
        for w in sorted(set(windows)):
            decode_cases.append((f"decode, long row, window {w}", "long", min(w, 1000), 0, None))
    for label, name, window, shift, sk in decode_cases:
        pb, qd = batch(name, shift=shift), q(len(rows[name]))
        compare(label, backend.decode(qd, 0, paged, pb, scale=scale, window=window, sinks=sk),
                ref.decode(qd, 0, paged, pb, scale=scale, window=window, sinks=sk))
    pb, qp = batch("prefill", q_len=4), q(len(rows["prefill"]), 4)
    compare("prefill", backend.prefill(qp, 0, paged, pb, scale=scale), ref.prefill(qp, 0, paged, pb, scale=scale))
    pb, qd = batch("short"), q(len(rows["short"]), 1)
    (o, lse), (ro, rlse) = backend.partial(qd, 0, paged, pb, scale=scale), ref.partial(qd, 0, paged, pb, scale=scale)
    compare("partial (host_reads=compute)", o, ro)
    compare("partial's log-sum-exp", lse, rlse)
    return CheckResult(worst, TOLERANCE.get(q_dtype, 4e-2), cases, where)
