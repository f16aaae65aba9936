"""Paged attention compiled with numba, for the CPU: each K/V byte read once, where the pool keeps it.

The chunked torch path (cpu_paged.py) gathers a chunk of blocks into a dense fp32 copy and then runs two matmuls
over it: the KV crosses memory about three times (the gather reads and writes it, the matmuls read it again).
Here one compiled loop (numba_kernel.attend) per (sequence, kv head) walks the row's block table and for each
block reads its K and V parts in place (the pool's tensors, seen as numpy arrays without a copy): plain formats
straight into the scores and the output, the scaled ones dequantized first into a block-sized buffer that stays in
L1 (the codec's arithmetic, engine/kv/codecs.py, element for element). It folds them into an online softmax for
the G*Q query rows that share the kv head (GQA: the queries of a kv head share the read), with a vectorized exp
(libm's, one call per score, cost as much as the rest of a key). The loop returns (acc, m, l) per row: the
output, the log-sum-exp and the attention sinks are a few small torch ops on [B, H, D] after it. The (sequence,
kv head) items are split across torch's thread count, in one launch of numba's thread pool (numba_kernel.
attend_threads; the pool the packed weights' matmuls use too). What a step's layers share (block tables, positions,
context lengths as numpy arrays) is built at its first layer only (_rows).

Visibility is reading.visibility's rule, key by key (context length, key positions, windows); blocks wholly
outside every query's range are skipped before any byte of them is read (without explicit key positions, by
index; with them, by the block's positions). Blocks on the host tier (PagedBatch.on_host) are read from the
staging buffer or the host tier, as read_blocks chooses, in the same walk.

Storage types numba has no dtype for are read as their bits: fp16 and bf16 data as uint16, converted by an
instruction (fpext of the half bits, vcvtph2ps where the CPU has F16C; bf16 a 16-bit shift: both exact), fp8 as
uint8 through a table of its 256 values (built by torch's own conversion, so exact); fp16 scales through a table
too (one per block row: not the inner loop). One compiled variant per data type (fp32, fp16, bf16, int8, uint8),
compiled at first use and cached on disk
(numba's cache=True: __pycache__ beside this file, or numba's per-user cache dir where that is not writable;
NUMBA_CACHE_DIR overrides); `compile_seconds` records what compiling (or loading from the cache) cost.

Decode over plain storage (fp32 / fp16 / bf16 blocks, keys at their index) runs numba_kernel.decode_plain, whose
per-block inner loops (a block's scores, and its values weighted into the output) are attn_ir.py's LLVM IR kernels
where the head's shape has them, with the sums kept in registers across the block: 51 against 92 us a layer at 8 x
279 keys on the default model (EPYC znver4); KVSCOPE_ATTN_IR=off runs numba's own loops.

What it does not take: tensors on CUDA and a CPU prefill without attention sinks (Q > 1: SDPA's flash kernel over
one gather is faster there, and the copy is amortized over the queries) go to the chunked backend.
`available()` says whether numba imports; engine/attention/__init__.py picks this backend for `cpu` when it does.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from engine.attention.cpu_paged import ChunkedPagedBackend
from engine.attention.interface import KVFormat, PagedBatch, PagedKV, kv_formats
from engine.attention.tier_split import lse_of

try:  # the seam tests use: numba missing (or broken for this build) -> the chunked backend serves
    import numba

    from engine.attention import attn_ir, numba_kernel
except Exception as e:  # noqa: BLE001
    numba = None
    IMPORT_ERROR = f"{type(e).__name__}: {e}"
else:
    IMPORT_ERROR = ""


# The storage dtypes attn_ir's block loops read (their index in attn_ir.FORMATS); fp8 is read through its table.
_IR_FORMAT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def available() -> bool:
    return numba is not None


# Seconds the first call of each compiled variant took (compiling, or loading it from numba's cache), by data type.
compile_seconds: dict[str, float] = {}
_compile_lock = threading.Lock()


# -- torch <-> numpy, without copies ------------------------------------------------------------------------------

_DUMMY16 = np.zeros((1, 1, 1), dtype=np.uint16)
_luts: dict[str, np.ndarray] = {}


def _lut(name: str) -> np.ndarray:
    """fp32 values of every bit pattern of a storage type numba cannot hold (torch's own conversion: exact)."""
    if name not in _luts:
        if name == "none":
            _luts[name] = np.zeros(1, dtype=np.float32)
        elif name in ("float16", "bfloat16"):
            bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
            _luts[name] = bits.view(getattr(torch, name)).float().numpy()
        else:  # float8_e4m3fn
            _luts[name] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(getattr(torch, name)).float().numpy()
    return _luts[name]


class _Strided(Exception):
    """A part that is not one contiguous tensor: the kernel's variants are compiled for C-contiguous arrays."""


def _np(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as numpy (no copy): fp16 / bf16 as uint16, fp8 as uint8."""
    if not t.is_contiguous():
        raise _Strided
    if t.dtype in (torch.float32, torch.int8, torch.int64, torch.bool):
        return t.numpy()
    if t.dtype == torch.float16:  # numpy has float16: its bits without a torch view (a layer's blocks each step)
        return t.numpy().view(np.uint16)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.element_size() == 1:
        return t.view(torch.uint8).numpy()
    raise TypeError(f"no numpy view for {t.dtype}")


def _data_lut(t: torch.Tensor) -> np.ndarray:
    """What numba_kernel.to_f32 reads a data tensor's elements through: nothing (fp32, int8), a marker of the
    16-bit format (fp16, bf16: converted by an instruction), or the table of the 256 fp8 values."""
    if t.dtype in (torch.float32, torch.int8):
        return _lut("none")
    if t.dtype == torch.float16:
        return numba_kernel.F16_BITS
    if t.dtype == torch.bfloat16:
        return numba_kernel.BF16_BITS
    return _lut(str(t.dtype).replace("torch.", ""))


_variants: dict[tuple, str] = {}


def _variant(data: np.ndarray, lut: np.ndarray, what: str) -> str:
    """The compiled variant a data array and its to_f32 argument select, by name (compile_seconds' key); looked up
    per call, so built once per pair of dtypes."""
    key = (data.dtype, lut.dtype, what)
    name = _variants.get(key)
    if name is None:
        mark = {np.dtype(np.int16): " (fp16)", np.dtype(np.int32): " (bf16)"}.get(lut.dtype, "")
        name = _variants[key] = f"{data.dtype}{mark}{what}"
    return name


def _side(parts, fmt: KVFormat, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(data, s1, s2) of one side's parts at `layer`, as numba_kernel.dequant takes them."""
    data = _np(parts["data"][layer])
    if fmt is KVFormat.PLAIN:
        return data, _DUMMY16, _DUMMY16
    if fmt is KVFormat.TOKEN_SCALE:
        return data, _np(parts["scale"][layer]), _DUMMY16
    if fmt is KVFormat.CHANNEL_SCALE:
        return data, _np(parts["scale"][layer]), _np(parts["tscale"][layer])
    return data, _np(parts["scale"][layer]), _np(parts["anchor"][layer])  # DELTA


class NumbaPagedBackend(ChunkedPagedBackend):
    """The compiled in-place loop for decode (and partial, and prefill with attention sinks) on the CPU; the
    chunked torch path (its base class) for the rest: CUDA tensors, CPU prefill without sinks (SDPA)."""

    name = "numba"
    compile_seconds = compile_seconds  # the module's record, read by the self-check (engine/runtime/self_check.py)

    def __init__(self, chunk_elems: int = 1 << 20, dense_prefill: bool = True):
        if numba is None:
            raise RuntimeError(f"numba does not import ({IMPORT_ERROR})")
        super().__init__(chunk_elems=chunk_elems, dense_prefill=dense_prefill)
        self._held = None  # (the batch and tier a step's layers share, the kernel's arrays of it): _rows
        self._any_host = None  # (a batch, whether it has host blocks): _alt

    def decode(self, q: torch.Tensor, layer: int, paged: PagedKV, batch: PagedBatch, *, scale: float,
               window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, H, D] -> [B, H, D] in q's dtype."""
        if sinks is None:
            out = self._decode_plain(q, layer, paged, batch, scale, window)
            if out is not None:
                return out.to(q.dtype)
        got = self._run(q[:, None], layer, paged, batch, scale, window)
        if got is None:
            return super().decode(q, layer, paged, batch, scale=scale, window=window, sinks=sinks)
        return self._finish(q[:, None], got, sinks)[:, 0].to(q.dtype)

    def prefill(self, q: torch.Tensor, layer: int, paged: PagedKV, batch: PagedBatch, *, scale: float,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, Q, H, D] -> [B, Q, H, D] in q's dtype: SDPA over one gather (the chunked backend's CPU prefill)
        unless there are attention sinks (SDPA has no term for them) or a single query."""
        if q.shape[1] == 1 or sinks is not None or not self.dense_prefill:
            got = self._run(q, layer, paged, batch, scale, window)
            if got is not None:
                return self._finish(q, got, sinks).to(q.dtype)
        return super().prefill(q, layer, paged, batch, scale=scale, window=window, sinks=sinks)

    def partial(self, q: torch.Tensor, layer: int, paged: PagedKV, batch: PagedBatch, *, scale: float,
                window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [B, Q, H, D], lse [B, Q, H]) fp32; out 0 and lse -inf for a query with no visible key."""
        got = self._run(q, layer, paged, batch, scale, window)
        if got is None:
            return super().partial(q, layer, paged, batch, scale=scale, window=window)
        acc, m, l = got
        B, Q, H, D = q.shape
        out = acc / torch.where(l > 0, l, 1.0)[..., None]  # [B, Hkv, G*Q, D]
        Hkv = acc.shape[1]
        G = H // Hkv
        out = out.view(B, Hkv, G, Q, D).permute(0, 3, 1, 2, 4).reshape(B, Q, H, D)
        lse = lse_of(m, l).view(B, Hkv, G, Q).permute(0, 3, 1, 2).reshape(B, Q, H)
        return out, lse

    @staticmethod
    def _finish(q: torch.Tensor, got, sinks: torch.Tensor | None) -> torch.Tensor:
        """(acc, m, l) [B, Hkv, G*Q, ...] -> out [B, Q, H, D] fp32; each head's sink joins the sum (scaled by m)."""
        acc, m, l = got
        B, Q, H, D = q.shape
        Hkv = acc.shape[1]
        G = H // Hkv
        if sinks is not None:  # rows (g, i) of each kv head: [Hkv, G*Q]
            sink = sinks.float().view(Hkv, G, 1).expand(Hkv, G, Q).reshape(Hkv, G * Q)
            l = l + torch.exp(sink - m)
        out = acc / l[..., None]
        return out.view(B, Hkv, G, Q, D).permute(0, 3, 1, 2, 4).reshape(B, Q, H, D)

    def _run(self, q: torch.Tensor, layer: int, paged: PagedKV, batch: PagedBatch, scale: float,
             window: int | None):
        """The kernel over q [B, Q, H, D]: (acc [B, Hkv, G*Q, D], m, l [B, Hkv, G*Q]) fp32, or None where it does
        not run (CUDA tensors, parts that are not contiguous): the caller's chunked path then serves."""
        if q.is_cuda or paged.k["data"][layer].device.type != "cpu":
            return None
        alt_kv, alt_table = self._alt(layer, paged, batch)
        B, Q, H, D = q.shape
        Hkv = paged.kv_heads
        G = H // Hkv
        kfmt, vfmt = kv_formats(paged.dtype)
        qg = (q.float() * scale).view(B, Q, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * Q, D).contiguous()
        rows = self._rows(batch, paged, alt_table if alt_kv is not None else None, B, Q)
        try:
            k = _side(paged.k, kfmt, layer)
            v = _side(paged.v, vfmt, layer)
            ak, av = (_side(alt_kv.k, kfmt, layer), _side(alt_kv.v, vfmt, layer)) if alt_kv is not None else (k, v)
        except _Strided:
            return None
        acc = torch.empty((B, Hkv, G * Q, D), dtype=torch.float32)
        m = torch.empty((B, Hkv, G * Q), dtype=torch.float32)
        l = torch.empty((B, Hkv, G * Q), dtype=torch.float32)
        dlut = _data_lut(paged.k["data"][layer])
        args = (qg.numpy(), *rows, int(window or 0),
                k[0], k[1], k[2], int(kfmt), v[0], v[1], v[2], int(vfmt), ak[0], ak[1], ak[2], av[0], av[1], av[2],
                dlut, _lut("float16"), acc.numpy(), m.numpy(), l.numpy())
        kind = _variant(k[0], dlut, "")
        one, many = numba_kernel.attend, numba_kernel.attend_threads
        if kind not in compile_seconds:  # the first call of this variant compiles it (or loads it from the cache)
            with _compile_lock:
                t0 = time.perf_counter()
                one(*args, 0, 1)
                compile_seconds.setdefault(kind, time.perf_counter() - t0)
            return acc, m, l
        n = max(1, min(torch.get_num_threads(), B * Hkv))  # as many threads as torch's ops use
        if n == 1:
            one(*args, 0, 1)
            return acc, m, l
        many(*args, n)
        return acc, m, l

    def _plain_step(self, layer: int, paged: PagedKV, batch: PagedBatch, B: int, H: int):
        """What decode_plain takes for a step over plain storage (fp32 / fp16 / bf16 / fp8 blocks on the CPU, keys at
        their index) besides q, scale, window and the blocks: ((qpos, table, alt, ctx, the data's to_f32 argument,
        key segments per sequence, the block loops' addresses: attn_ir.kernels for the format, or zeros), the tier
        host blocks are read from or None); None where it does not apply. H: query heads. The one place
        _decode_plain and decode_plan decide it."""
        kt = paged.k["data"][layer]
        if batch.key_pos is not None or kt.device.type != "cpu" or kv_formats(paged.dtype) != (0, 0):
            return None
        alt_kv, alt_table = self._alt(layer, paged, batch)
        rows = self._rows(batch, paged, alt_table, B, 1)
        n = max(1, torch.get_num_threads())
        code = _IR_FORMAT.get(kt.dtype)
        fns = attn_ir.NONE[0] if code is None else attn_ir.kernels(H // paged.kv_heads, kt.shape[-1])[code]
        # >= 2 (sequence, segment) units a thread
        return (*rows[:4], _data_lut(kt), max(1, -(-2 * n // B)), fns), alt_kv

    @staticmethod
    def _plain_blocks(paged: PagedKV, alt_kv: PagedKV | None, layer: int) -> tuple:
        """(kd, vd, akd, avd): a layer's device-tier K/V blocks and those host blocks are read from, as arrays
        (_Strided where they cannot be)."""
        kd, vd = _np(paged.k["data"][layer]), _np(paged.v["data"][layer])
        if alt_kv is None:
            return kd, vd, kd, vd
        return kd, vd, _np(alt_kv.k["data"][layer]), _np(alt_kv.v["data"][layer])

    def _decode_plain(self, q: torch.Tensor, layer: int, paged: PagedKV, batch: PagedBatch, scale: float,
                      window: int | None) -> torch.Tensor | None:
        """Decode over plain storage (_plain_step) in one call that takes q as the model gives it and returns the
        normalized output (numba_kernel.decode_plain, split-K over the threads); None where it does not apply."""
        B, H, D = q.shape
        plan = None if q.is_cuda else self._plain_step(layer, paged, batch, B, H)
        if plan is None:
            return None
        step, alt_kv = plan
        try:
            blocks = self._plain_blocks(paged, alt_kv, layer)
        except _Strided:
            return None
        out = torch.empty((B, H, D), dtype=torch.float32)
        args = (q.float().contiguous().numpy(), float(scale), *step[:4], int(window or 0), *blocks, step[4],
                out.numpy(), step[5], step[6])
        kind = _variant(blocks[0], args[11], " decode")
        if kind not in compile_seconds:
            with _compile_lock:
                t0 = time.perf_counter()
                numba_kernel.decode_plain(*args)
                compile_seconds.setdefault(kind, time.perf_counter() - t0)
            return out
        numba_kernel.decode_plain(*args)
        return out

    def decode_plan(self, paged: PagedKV, batch: PagedBatch, B: int, H: int):
        """For a whole decode step over plain fp32 / fp16 / bf16 blocks, every layer's on the CPU: (the step's
        arrays decode_plain takes, as _plain_step gives them; layer(li) -> that layer's (kd, vd, akd, avd)), for a
        caller that runs decode_plain itself (quant_layer.decode_layer); None where _decode_plain would not run
        (or the storage is fp8, which the caller's KV write does not take)."""
        if paged.k["data"][-1].device.type != "cpu" or \
                paged.k["data"][0].dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return None
        plan = self._plain_step(0, paged, batch, B, H)
        if plan is None:
            return None
        step, alt_kv = plan
        if alt_kv is not None and alt_kv.k["data"][0].device.type != "cpu":
            return None

        def layer(li: int) -> tuple:
            return self._plain_blocks(paged, alt_kv, li)

        try:
            layer(0)
        except _Strided:
            return None
        return step, layer

    def _alt(self, layer: int, paged: PagedKV, batch: PagedBatch):
        """(the tier, its block table) a step's host blocks are read from (read_blocks' choice: the staging
        buffer when there is one on this device, else the host tier), or (None, None) with no host block.
        Whether the batch has host blocks at all is asked once a batch (a tensor reduction)."""
        if batch.on_host is None:
            return None, None
        if self._any_host is None or self._any_host[0] is not batch:
            self._any_host = (batch, bool(batch.on_host.any()))
        if self._any_host[1]:
            if paged.staged is not None and batch.staged_table is not None and \
                    paged.staged.k["data"][layer].device.type == "cpu":
                return paged.staged, batch.staged_table
            return paged.host, batch.host_table
        return None, None

    def _rows(self, batch: PagedBatch, paged: PagedKV, alt_table, B: int, Q: int) -> tuple:
        """(qpos, table, alt, ctx, key_pos, has_kpos) as the kernel takes them: the same for every layer of a step
        (one PagedBatch), so built at its first layer and kept until the next batch."""
        key = (batch, paged, alt_table, B, Q)
        held = self._held
        if held is not None and all(a is b for a, b in zip(held[0], key)):
            return held[1]
        table = batch.block_table.long().contiguous()
        if alt_table is not None:
            alt = torch.where(batch.on_host.cpu(), alt_table.long().cpu(), -1).contiguous()
        else:
            alt = torch.full(table.shape, -1, dtype=torch.long)
        qpos = batch.q_pos.reshape(B, Q).long().contiguous()
        has_kpos = batch.key_pos is not None
        kpos = batch.key_pos.long().contiguous() if has_kpos else torch.zeros((1, 1), dtype=torch.long)
        ctx = batch.context_lens.long().contiguous()
        rows = (_np(qpos), _np(table), _np(alt), _np(ctx), _np(kpos), has_kpos)
        self._held = (key, rows)
        return rows
