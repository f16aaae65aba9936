"""The model runner: a scheduled batch in, one sampled token per sequence out.

It turns (sequence, n tokens) pairs into the step's tensors (token ids, positions, the slot and offset
of every new token's K/V, block tables per attention group), runs the model, and samples. It decides
nothing about which sequences run or where blocks live.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from engine.attention.host_stream import HostStream, StepStream
from engine.kv.block_pool import BlockPool, Tier, blocks_for
from engine.kv.codecs import Appends
from engine.telemetry.counters import Counters
from engine.runtime.cuda_graphs import DecodeGraphs
from engine.runtime.self_check import SelfChecks, Verdict, check_attention
from engine.fidelity.block_error import KVErrors
from engine.model.llama_family import AttnGroup, ForwardBatch, KVPart, LlamaFamily
from engine.runtime.step_kv import StepKV
from engine.sequence import Sequence


class StepInputs:
    """Persistent buffers for a step's index tensors, reused every step (grown by doubling, never shrunk).

    Each named input is written into a host buffer (pinned when the model is on CUDA) and, on CUDA, copied
    to its device buffer with non_blocking=True: no allocation and no synchronous pageable copy per step.
    Reusing the host buffer next step is safe: sampling reads the logits back (`.tolist()`), which waits
    for this step's stream, copies included, before the next step writes its inputs.

    On the CPU there is no copy to stage: each input is a tensor over a fresh copy of the array (torch's slice,
    copy_ and view of a buffer took ~12 us an input, 14 inputs a decode step: ~2 % of a batch-1 step).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.host: dict[str, torch.Tensor] = {}
        self.dev: dict[str, torch.Tensor] = {}

    def put(self, name: str, a: np.ndarray) -> torch.Tensor:
        """The array as a tensor on the model's device (on CUDA through `name`'s buffers): shape and dtype kept."""
        if not self.cuda:  # a copy: the caller's array may change after the step
            return torch.from_numpy(np.array(a, dtype=np.bool_ if a.dtype == np.bool_ else np.int64, order="C"))
        a = np.ascontiguousarray(a)
        dtype = torch.bool if a.dtype == np.bool_ else torch.int64
        n = a.size
        buf = self.host.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            size = max(64, 1 << max(n - 1, 1).bit_length())
            self.host[name] = buf = torch.empty(size, dtype=dtype, pin_memory=True)
            self.dev[name] = torch.empty(size, dtype=dtype, device=self.device)
        host = buf[:n]
        host.copy_(torch.from_numpy(a.reshape(-1).astype(np.bool_ if dtype is torch.bool else np.int64, copy=False)))
        out = self.dev[name][:n]
        out.copy_(host, non_blocking=True)
        return out.view(a.shape)


class ModelRunner:
    def __init__(self, model: LlamaFamily, device: torch.device, max_batch: int = 16, graphs: str = "off",
                 context_limit: int = 1 << 30, counters: Counters | None = None):
        self.model = model
        self.device = device
        self.inputs = StepInputs(device)
        self.context_limit = context_limit
        # Self-checks at first use (engine/runtime/self_check.py): their verdicts, and what the attention backend was
        # last checked for (the backend and the pool's config, compared by identity: nothing per step after that).
        self.checks = SelfChecks()
        self._attn_checked: tuple = (None, None)
        self.graphs = DecodeGraphs(model, device, max_batch, graphs, checks=self.checks)
        self.stream = HostStream(device)  # staging for host blocks streamed a layer ahead
        self.counters = counters or Counters()
        spec = model.spec
        self.errors = KVErrors(spec.num_layers, spec.num_kv_heads, spec.head_dim, device)  # eager steps measure
        self.group_streams: dict[int, HostStream] = {}  # KV-cache groups past the first: their own staging
        self._ns = ""  # input-buffer names' prefix while a KV-cache group past the first is built

    def check_attention(self, pool: BlockPool) -> Verdict | None:
        """The attention self-check for the pool's block size and format (at start-up, and at the first step after the
        backend or the config changed); a failure puts the model on the reference path."""
        cfg = pool.config
        v = check_attention(self.model, cfg.block_size, cfg.kv_dtype)
        if v is not None:
            self.checks.record(v)
        self._attn_checked = (self.model.backend, cfg)
        return v

    def prepare(self, kv, sched: list[tuple[Sequence, int]]):
        """(run() -> logits [len(sched), vocab], writes: one (lids, fills) per KV-cache group) for the step over
        `kv` (engine/kv/cache.py). One pool of every layer: a decode step through its CUDA graph when it can, else
        the eager forward pass over `build`'s tensors; KV-cache groups: `_prepare_groups`. Host-side work happens
        here; `run` does the device work."""
        if kv.grouped:
            return self._prepare_groups(kv, sched)
        pool = kv.pool
        if self.model.backend is not self._attn_checked[0] or pool.config is not self._attn_checked[1]:
            self.check_attention(pool)
        if self.graphs.eligible(sched):
            got = self.graphs.prepare(pool, sched, self.context_limit)
            if got is not None:
                run, writes = got
                return run, (writes,)
        batch, store, writes = self.build(pool, sched)
        return self._eager(batch, [store]), (writes,)

    def _eager(self, batch: ForwardBatch, stores: list[StepKV]):
        """run() -> logits of the eager forward pass over `stores` (one, or one per KV-cache group: the first is the
        forward pass's `store`, the others come in batch.parts)."""
        def run() -> torch.Tensor:
            try:
                logits = self.model.forward(batch, stores[0])
            finally:
                for store in stores:
                    if store.stream is not None:
                        store.stream.finish()  # no copy outlives its step (the next one reuses the buffers)
                        self.counters.streamed_bytes += store.stream.bytes
                        if store.stream.verdict is not None:  # the stream's first step was checked
                            self.checks.record(Verdict("stream", *store.stream.verdict))
            for store in stores:
                store.probe.finish()  # what the step wrote, measured (engine/fidelity/block_error.py)
            return logits

        return run

    def _prepare_groups(self, kv, sched: list[tuple[Sequence, int]]):
        """prepare() for a model with KV-cache groups (engine/kv/cache.py): one part per group, each built
        from the group's pool and its view of the sequences (its own tables, tiers, stores), the forward pass
        reading each layer's K/V from its group's part; eager (no CUDA graph). writes: one (lids, fills) per group."""
        if self.model.backend is not self._attn_checked[0] or kv.pool.config is not self._attn_checked[1]:
            self.check_attention(kv.pool)
        parts, writes = [], []
        batch = None
        try:
            for g, (grp, m) in enumerate(zip(kv.groups, kv.mgrs)):
                self._ns = f"g{g}." if g else ""
                views = [(kv.view(seq, g), n) for seq, n in sched]
                b, store, w = self.build(m.pool, views, layer_ids=grp.layers, group=g)
                batch = batch or b
                parts.append(KVPart(grp.layers, b.groups, store))
                writes.append(w)
        finally:
            self._ns = ""
        batch = dataclasses.replace(batch, parts=parts)
        return self._eager(batch, [part.store for part in parts]), tuple(writes)

    def build(self, pool: BlockPool, sched: list[tuple[Sequence, int]], layer_ids: tuple[int, ...] | None = None,
              group: int = 0):
        """The step's flat token batch, where each token's K/V goes, and the attention groups. `layer_ids`, `group`:
        the model layers of the pool's layers and the KV-cache group they are (_prepare_groups)."""
        bs = pool.geom.block_size
        ids, pos, lids, offs = [], [], [], []
        decode_rows, decode = [], []
        groups: list[AttnGroup] = []
        logit_rows = []
        hosts: list[tuple[AttnGroup, str, np.ndarray, np.ndarray]] = []  # groups with host blocks (see _group)
        row = 0
        for seq, n in sched:
            lo, hi = seq.num_cached, seq.num_cached + n
            idx = np.arange(lo, hi)
            ids.extend(seq.tokens[lo:hi])
            pos.append(idx if not seq.repositioned else np.asarray(seq.pos[lo:hi], dtype=np.int64))
            lids.append(seq.table()[idx // bs])
            offs.append(idx % bs)
            if n == 1:
                decode.append(seq)
                decode_rows.append(row)
            else:
                groups.append(self._group(pool, [seq], [row], q_len=n, ctx=[hi], qpos=[pos[-1]], name=f"p{len(groups)}",
                                          hosts=hosts))
            row += n
            logit_rows.append(row - 1)
        if decode:
            groups.insert(0, self._group(pool, decode, decode_rows, name="decode", hosts=hosts))
        lids_np, offs_np = np.concatenate(lids), np.concatenate(offs)
        on_host = pool.tier[lids_np] == Tier.HOST
        wl = np.unique(lids_np)
        new_fill = np.zeros(len(wl), dtype=np.int64)
        np.maximum.at(new_fill, np.searchsorted(wl, lids_np), offs_np + 1)
        dev_tier, host_tier = pool.tiers[Tier.DEVICE], pool.tiers[Tier.HOST]
        count = group == 0  # each group writes the step's tokens: counted once
        if not on_host.any():
            store = StepKV(pool, self._appends(pool, lids_np, offs_np, "", device=True),
                           probe=self.errors.probe(pool, [(dev_tier, lids_np, offs_np)], count), layer_ids=layer_ids)
        else:  # some blocks written are on the host tier: their tokens' K/V go there
            rows = np.flatnonzero(on_host)
            dev_rows = np.flatnonzero(~on_host)
            host = (torch.as_tensor(rows, device=self.device), self._appends(pool, lids_np[rows], offs_np[rows], "h", device=False))
            dev = self._appends(pool, lids_np[dev_rows], offs_np[dev_rows], "", device=True, rows=dev_rows) if len(dev_rows) else None
            store = StepKV(pool, dev, host, probe=self.errors.probe(
                pool, [(dev_tier, lids_np[dev_rows], offs_np[dev_rows]), (host_tier, lids_np[rows], offs_np[rows])], count),
                layer_ids=layer_ids)
        if hosts and pool.config.host_reads != "compute":
            store.stream = self._stream(pool, hosts, group)  # None after a failed stream check: read where they are
        put = self._put
        batch = ForwardBatch(input_ids=put("ids", np.asarray(ids, dtype=np.int64)), positions=put("pos", np.concatenate(pos)),
                             groups=groups, logit_rows=put("logit_rows", np.asarray(logit_rows, dtype=np.int64)))
        return batch, store, (wl, new_fill)

    def _put(self, name: str, a: np.ndarray) -> torch.Tensor:
        return self.inputs.put(self._ns + name, a)

    def _stream(self, pool: BlockPool, hosts: list[tuple[AttnGroup, str, np.ndarray, np.ndarray]],
                group: int = 0) -> StepStream:
        """The step's host blocks streamed through staging: their distinct slots, copied a layer ahead for the
        layers the device tier keeps on the compute device, and each group's table of staging rows."""
        slots = np.unique(np.concatenate([table[mask] for _, _, mask, table in hosts]))
        dev, host = pool.tiers[Tier.DEVICE], pool.tiers[Tier.HOST]
        layers = [li for li, t in enumerate(dev.k["data"]) if t.device.type == self.device.type]
        stream = self.stream if group == 0 else self.group_streams.setdefault(group, HostStream(self.device))
        if stream.failed:  # its self-check failed: host blocks are read from the host tier at each read
            return None
        step = stream.begin(host.k, host.v, slots, layers)
        for g, name, mask, table in hosts:
            g.staged_table = self._put(name + ".staged", np.where(mask, step.staged_rows(table), 0))
        return step

    def _appends(self, pool: BlockPool, lids: np.ndarray, offs: np.ndarray, prefix: str, device: bool,
                 rows: np.ndarray | None = None) -> Appends:
        """Appends of tokens (block lids, offsets) into their tier's parts. Writes are appends: the first offset
        written into a block is how many of its slots were already valid."""
        wl, tok_block = np.unique(lids, return_inverse=True)
        prev_fill = np.full(len(wl), pool.geom.block_size, dtype=np.int64)
        np.minimum.at(prev_fill, tok_block, offs)
        max_rank = int((offs - prev_fill[tok_block]).max())
        if device:
            put = self._put
            a = Appends.of(put(prefix + "slots", pool.slot[lids]), put(prefix + "offsets", offs),
                           put(prefix + "wslots", pool.slot[wl]), put(prefix + "tok_block", tok_block),
                           put(prefix + "prev_fill", prev_fill), max_rank)
            return a if rows is None else a.with_rows(put("dev_rows", rows))
        t = torch.from_numpy  # the host tier's parts are CPU tensors
        return Appends.of(t(pool.slot[lids]), t(offs.astype(np.int64)), t(pool.slot[wl]), t(tok_block.astype(np.int64)),
                          t(prev_fill), max_rank)

    def _group(self, pool: BlockPool, seqs: list[Sequence], first_rows: list[int], q_len: int = 1,
               ctx: list[int] | None = None, qpos: list[np.ndarray] | None = None, name: str = "g",
               hosts: list | None = None) -> AttnGroup:
        """Sequences attended together, their block tables padded to the longest with the null block (masked).
        A group with blocks on the host tier is added to `hosts` as (group, name, mask [B, NB], host slots)."""
        bs = pool.geom.block_size
        ctx = ctx or [s.num_cached + 1 for s in seqs]
        nb = max(blocks_for(c, bs) for c in ctx)
        B = len(seqs)
        null = pool.tiers[Tier.DEVICE].null_slot
        table = np.full((B, nb), null, dtype=np.int64)
        host = np.zeros((B, nb), dtype=bool)
        kpos = np.zeros((B, nb * bs), dtype=np.int64)
        kvalid = np.zeros((B, nb * bs), dtype=bool)
        qp = np.zeros((B, q_len), dtype=np.int64)
        ctx_np = np.asarray(ctx, dtype=np.int64)
        for b, (seq, c) in enumerate(zip(seqs, ctx)):
            k = blocks_for(c, bs)
            lids = seq.table()[:k]
            table[b, :k] = pool.slot[lids]
            host[b, :k] = pool.tier[lids] == Tier.HOST
            kp = seq.key_positions(c)
            kpos[b, :c] = kp
            kvalid[b, :c] = True
            qp[b] = qpos[b] if qpos is not None else kp[c - 1]
        rows = (np.asarray(first_rows, dtype=np.int64)[:, None] + np.arange(q_len)[None, :]).reshape(-1)
        put = self._put
        kpos_t = put(name + ".kpos", kpos)
        # Key positions for the backends only when some row's differ from their indices (after a context shift,
        # seq_add, seq_div): else None, and a backend may skip blocks wholly after the queries or before a window.
        key_pos = kpos_t if any(seq.repositioned for seq in seqs) else None
        on_host = host_table = host_np = None
        if host.any():  # blocks read where they are on the host tier: the device table points at the null block
            host_np = np.where(host, table, 0)
            host_table = torch.from_numpy(host_np)
            table = np.where(host, null, table)
            on_host = put(name + ".on_host", host)
        g = AttnGroup(rows=put(name + ".rows", rows), q_len=q_len, table=put(name + ".table", table),
                      kpos=kpos_t, kvalid=put(name + ".kvalid", kvalid), qpos=put(name + ".qpos", qp),
                      ctx=put(name + ".ctx", ctx_np), key_pos=key_pos, on_host=on_host, host_table=host_table,
                      host_compute=pool.config.host_reads == "compute")
        if host_np is not None and hosts is not None:
            hosts.append((g, name, host, host_np))
        return g

    @staticmethod
    def sample(sched: list[tuple[Sequence, int]], logits: torch.Tensor) -> list[int]:
        out = []
        # numpy's argmax on the CPU (the first of equal maxima, NaN the largest, as torch's): torch's takes 44 us
        # over a 49,152-token row, numpy's 4 (a decode step of 7 ms on the default model)
        greedy = (logits.numpy().argmax(-1) if logits.device.type == "cpu" else logits.argmax(dim=-1)).tolist()
        for i, (seq, _) in enumerate(sched):
            sp = seq.sampling
            if len(seq.output) < len(sp.forced):
                out.append(sp.forced[len(seq.output)])
                continue
            if sp.greedy:
                out.append(greedy[i])
                continue
            probs = torch.softmax(logits[i].float() / sp.temperature, dim=-1).cpu()
            if sp.top_p < 1.0:
                sorted_p, idx = probs.sort(descending=True)
                cut = torch.cumsum(sorted_p, 0) - sorted_p > sp.top_p
                sorted_p[cut] = 0
                probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
            out.append(int(torch.multinomial(probs / probs.sum(), 1, generator=seq.rng)))
        return out
