"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, captured over static buffers.

A decode step whose rows all take one token, none repositioned, on a paged attention backend, runs as:
the step's integer inputs packed on the host into one pinned buffer, one host->device copy into the static
buffer the graph reads, `graph.replay()`, and the first B rows of the logits. Everything the forward pass
touches is static: the weights, the device tier's parts, these buffers. The shapes are the bucket's: B rows
padded to the bucket size b with rows that read the null block (context 1) and write the sink block, both
slots past the tier's capacity (engine/kv/tiers.py); block tables are `width` entries wide (the most blocks a
sequence can hold at the context limit), padded with the null block.

Graphs are captured lazily, on a bucket's first step, and dropped when what they captured changes (the device
tier's tensors after a relayout or a budget change: block size, KV dtype, capacity; the attention backend). A
capture that fails leaves that engine eager for good, with the reason in `fallback`.

`mode="static"` runs the same static-shaped forward eagerly, without capturing: on the CPU that is how the tests
check the padding, the null and sink blocks and the invalidation that a GPU's replay depends on.

Self-check (engine/runtime/self_check.py): a bucket's first run after each capture is its replay and then the same
step run eagerly over the same buffers (the static forward: it writes the step's K/V again, the same values, as
appends are idempotent); their logits are compared. A mismatch or an exception leaves decode eager for good
(`fallback`), that step's logits the eager ones. `capture` (cap, pool) -> bool is the seam: tests wrap it so that
a bucket's replay returns wrong values.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from engine.kv.block_pool import BlockPool, Tier, blocks_for
from engine.kv.codecs import Appends
from engine.model.llama_family import AttnGroup, ForwardBatch, LlamaFamily
from engine.sequence import Sequence

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
FIELDS = ("ids", "pos", "slots", "offsets", "ctx")  # each [b]; then the table [b, width]


class _Captured:
    """One bucket: its static buffers, the batch and KV view built over them, and the graph (None: static mode)."""

    def __init__(self, b: int, width: int, device: torch.device):
        self.b, self.width = b, width
        n = len(FIELDS) * b + b * width
        self.packed = torch.zeros(n, dtype=torch.int64, device=device)
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=device.type == "cuda")
        views = self.packed[: len(FIELDS) * b].view(len(FIELDS), b)
        self.ids, self.pos, self.slots, self.offsets, self.ctx = views
        self.table = self.packed[len(FIELDS) * b:].view(b, width)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.replay = None  # () -> logits [b, vocab]: the graph's replay (static mode: the static forward), set by capture
        self.checked = False  # its first run was compared with the eager step (the module doc)


class DecodeGraphs:
    def __init__(self, model: LlamaFamily, device: torch.device, max_batch: int, mode: str = "auto", checks=None):
        """mode: "auto" (capture on CUDA with a paged backend, else off), "on" (capture; on the CPU: static),
        "static" (static buffers, no capture), "off". checks: the engine's SelfChecks (verdicts recorded there)."""
        self.model, self.device = model, device
        self.cuda = device.type == "cuda"
        self.mode = ("on" if self.cuda else "off") if mode == "auto" else mode
        if self.mode == "on" and not self.cuda:
            self.mode = "static"
        top = next((b for b in BUCKETS if b >= max_batch), BUCKETS[-1])  # larger batches than the top bucket: eager
        self.buckets = [b for b in BUCKETS if b < top] + [top]
        self.captured: dict[int, _Captured] = {}
        self.key: tuple | None = None
        self.fallback: str | None = None  # why decode runs eager for good (a failed capture)
        self.replays = 0
        self.captures = 0
        self._mempool = None
        self.checks = checks
        self.capture = self._capture  # (cap, pool) -> bool: how a bucket gets its replay (a test seam, module doc)

    # -- which steps -------------------------------------------------------------------------------
    def eligible(self, sched: list[tuple[Sequence, int]]) -> bool:
        return (self.mode != "off" and self.fallback is None and self.model.backend is not None
                and len(sched) <= self.buckets[-1] and all(n == 1 and not s.repositioned for s, n in sched))

    def _key(self, pool: BlockPool, width: int) -> tuple:
        dev = pool.tiers[Tier.DEVICE]
        return (dev.k["data"].layer_ptrs(), dev.v["data"].layer_ptrs(), tuple(dev.k["data"].shape), pool.config.kv_dtype, width,
                self.model.backend.name if self.model.backend is not None else None)

    # -- a step ------------------------------------------------------------------------------------
    def prepare(self, pool: BlockPool, sched: list[tuple[Sequence, int]], context_limit: int):
        """(run() -> logits [B, vocab], writes) for a decode step; inputs packed and sent now."""
        if pool.sizes.dev_layers < pool.geom.layers:
            return None  # per-layer placement: some layers' K/V are read and written in host memory, eagerly
        if any((pool.tier[seq.table()] != Tier.DEVICE).any() for seq, _ in sched):
            return None  # a block read from the host tier: the eager step streams it
        bs = pool.geom.block_size
        width = blocks_for(context_limit, bs) + 1  # +1: a row at the limit before its shift writes one more
        key = self._key(pool, width)
        if key != self.key:  # geometry changed: every graph read the old tensors
            self.captured.clear()
            self.key = key
        B = len(sched)
        b = next(x for x in self.buckets if x >= B)
        cap = self.captured.get(b)
        if cap is None:
            cap = self.captured[b] = _Captured(b, width, self.device)
            if not self.capture(cap, pool):
                self.captured.pop(b)
                return None
        dev = pool.tiers[Tier.DEVICE]
        host = cap.host.numpy()
        fields = host[: len(FIELDS) * b].reshape(len(FIELDS), b)
        table = host[len(FIELDS) * b:].reshape(b, width)
        self._padding(fields, table, dev)
        lids = np.empty(B, dtype=np.int64)
        for r, (seq, _) in enumerate(sched):
            i = seq.num_cached
            tbl = seq.table()
            k = blocks_for(i + 1, bs)
            lids[r] = tbl[i // bs]
            fields[0, r] = seq.tokens[i]
            fields[1, r] = i
            fields[3, r] = i % bs
            fields[4, r] = i + 1
            table[r, :k] = pool.slot[tbl[:k]]
        fields[2, :B] = pool.slot[lids]
        cap.packed.copy_(cap.host, non_blocking=True)
        writes = (lids, fields[3, :B] + 1)
        return (lambda: self._run(cap, pool)[:B]), writes

    def _padding(self, fields: np.ndarray, table: np.ndarray, dev) -> None:
        """Every row a padding row: reads the null block (context 1, position 0), writes the sink block."""
        fields[:] = 0
        fields[2] = dev.sink_slot
        fields[4] = 1
        table[:] = dev.null_slot

    def _batch(self, cap: _Captured, pool: BlockPool):
        from engine.runtime.step_kv import StepKV  # noqa: F811 (kept local: the capture path only)

        b, dev = cap.b, self.device
        rows = torch.arange(b, device=dev)
        group = AttnGroup(rows=rows, q_len=1, table=cap.table, kpos=cap.table, kvalid=cap.table.bool(),
                          qpos=cap.pos.view(b, 1), ctx=cap.ctx, key_pos=None)
        batch = ForwardBatch(input_ids=cap.ids, positions=cap.pos, groups=[group], logit_rows=rows)
        # Decode: each row appends one token to its own last block, so that block had `offset` tokens before.
        store = StepKV(pool, Appends.of(cap.slots, cap.offsets, cap.slots, rows, cap.offsets, 0))
        return batch, store

    def _run(self, cap: _Captured, pool: BlockPool) -> torch.Tensor:
        if not cap.checked:
            return self._first_run(cap, pool)
        return cap.replay()

    def _static(self, cap: _Captured, pool: BlockPool) -> torch.Tensor:
        """The bucket's step run eagerly over its static buffers (static mode's replay, and the graphs' reference)."""
        batch, store = self._batch(cap, pool)
        return self.model.forward(batch, store)

    def _replay(self, cap: _Captured) -> torch.Tensor:
        cap.graph.replay()
        self.replays += 1
        return cap.logits

    def _first_run(self, cap: _Captured, pool: BlockPool) -> torch.Tensor:
        """The bucket's first run: its replay, then the eager step over the same buffers; compared (module doc)."""
        from engine.runtime.self_check import Verdict, max_delta, tolerance, why

        t0 = time.perf_counter()
        try:
            got, bad = cap.replay().clone(), None
        except Exception as e:  # noqa: BLE001 - a replay that raises: the eager step serves
            got, bad = None, why(e)
        want = self._static(cap, pool)
        if bad is None:
            d = max_delta(got, want)
            tol = tolerance(self.model.dtype) * max(1.0, float(want.abs().max()))
            if d > tol:
                bad = f"max |Δ| {d:.3g} in the logits (tolerance {tol:.3g})"
        path = (f"CUDA graph bucket {cap.b}" if cap.graph is not None or self.mode != "static"
                else f"static decode bucket {cap.b} (--cuda-graphs static)")
        cap.checked = True
        if bad is not None:
            self.fallback = f"{path} disagreed with the eager step ({bad}); decode runs eager"
            self.captured.clear()
        if self.checks is not None:
            detail = bad or f"max |Δ| {d:.2g} in the logits (tolerance {tol:.2g}), {cap.b} rows"
            self.checks.record(Verdict("graphs", path, bad is None, detail, "" if bad is None else "eager decode",
                                       time.perf_counter() - t0))
        return want if bad is not None else got

    def _capture(self, cap: _Captured, pool: BlockPool) -> bool:
        """Capture the bucket's graph over padding rows (they write only the sink block). False: run eager."""
        if self.mode == "static":
            cap.replay = lambda: self._static(cap, pool)
            return True
        dev = pool.tiers[Tier.DEVICE]
        host = cap.host.numpy()
        self._padding(host[: len(FIELDS) * cap.b].reshape(len(FIELDS), cap.b),
                      host[len(FIELDS) * cap.b:].reshape(cap.b, cap.width), dev)
        cap.packed.copy_(cap.host)
        batch, store = self._batch(cap, pool)
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up: triton compiles, allocator settles
                for _ in range(2):
                    self.model.forward(batch, store)
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self._mempool is None:
                self._mempool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._mempool):
                cap.logits = self.model.forward(batch, store)
            cap.graph = graph
            cap.replay = lambda: self._replay(cap)
            self.captures += 1
            return True
        except Exception as exc:  # noqa: BLE001 - any capture failure: eager from here on, said in `fallback`
            self.fallback = f"CUDA graph capture failed ({type(exc).__name__}: {exc}); decode runs eager"
            self.captured.clear()
            return False
