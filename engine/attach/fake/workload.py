"""A stand-in for a serving engine's prefix cache: the events and metrics a vLLM or SGLang server would publish
for a chat workload, without a model or a GPU. Used by the fake publisher (tests, the soak bench, the README
screenshot).

Requests are chats: a shared system prompt per family (Zipf popularity), a conversation history that grows
turn by turn, a new turn and a few decoded blocks. Each request looks its prefix up in an LRU cache of
`capacity` full blocks; the first missing block and everything after it are stored (prefill in chunks, then
one block per decode step, each naming its parent), and the least recently used blocks are removed when the
cache is over capacity. With `cpu_capacity` the removed blocks are offloaded to a CPU tier (stored there with
medium CPU) and later removed from it too. Hashes chain like vLLM's: blake2b(parent hash, token ids), as
bytes (newer vLLM), a 63-bit int (older vLLM) or a signed int64 (SGLang's hash_str_to_int64).

`flavor` fills in what that server adds to every event: vLLM 0.33 names the KV-cache group of each store and
removal (0) and the group's kind ("full_attention"); SGLang calls its host tier CPU_PINNED.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import OrderedDict

import numpy as np

from engine.attach.events import BlockRemoved, BlockStored, Event


class FakeCache:
    def __init__(self, capacity: int = 4000, block_size: int = 16, families: int = 12, seed: int = 0,
                 hash_kind: str = "bytes", cpu_capacity: int = 0, prefill_chunk: int = 8, flavor: str | None = None):
        self.rng = random.Random(seed)
        self.capacity, self.block_size, self.hash_kind = capacity, block_size, hash_kind
        self.cpu_capacity, self.prefill_chunk = cpu_capacity, prefill_chunk
        self.flavor = flavor
        self.cpu_medium = "CPU_PINNED" if flavor == "sglang" else "CPU"
        self.gpu: OrderedDict = OrderedDict()  # hash -> [stored_t, last_t]; LRU order, oldest first
        self.cpu: OrderedDict = OrderedDict()
        self._seed = seed
        self._tok = 0
        w = [1.0 / (k + 1) for k in range(families)]
        self.family_weights = [x / sum(w) for x in w]
        self.families = [self._chain(None, self.rng.randint(2, 10)) for _ in range(families)]
        self.convs: list[list] = []  # each a list of (hash, tokens) blocks: system prompt, then the turns
        # what /metrics would count
        self.queries = self.hits = 0  # prompt tokens looked up / found in the cache
        self.preemptions = 0
        self.lifetimes: list[float] = []  # seconds, at eviction (drained by the publisher)
        self.idle: list[float] = []
        self.reuse_gaps: list[float] = []

    # -- blocks ----------------------------------------------------------------------------------------
    def _tokens(self) -> list[int]:
        self._tok += 1
        base = (self._tok * 2654435761 + self._seed * 97) & 0xFFFFFFFF
        return [32 + (base * (k + 1) * 40503 >> 7) % 31968 for k in range(self.block_size)]

    def _hash(self, parent, tokens: list[int]):
        h = hashlib.blake2b(digest_size=32)
        if parent is not None:
            h.update(parent if isinstance(parent, bytes) else parent.to_bytes(8, "little", signed=parent < 0))
        h.update(np.asarray(tokens, np.int32).tobytes())
        d = h.digest()
        if self.hash_kind == "bytes":
            return d
        return int.from_bytes(d[:8], "little", signed=True) if self.hash_kind == "int64" else \
            int.from_bytes(d[:8], "little") >> 1

    def _chain(self, parent, n: int) -> list:
        out = []
        for _ in range(n):
            toks = self._tokens()
            parent = self._hash(parent, toks)
            out.append((parent, toks))
        return out

    # -- one request -----------------------------------------------------------------------------------
    def request(self, t: float) -> list[Event]:
        """The events of one request (its prefill and decode, and the evictions they cause)."""
        rng = self.rng
        if self.convs and rng.random() < 0.55:
            conv = self.convs[rng.randrange(len(self.convs))]
        else:
            fam = rng.choices(range(len(self.families)), self.family_weights)[0]
            conv = list(self.families[fam])
            self.convs.append(conv)
            if len(self.convs) > 400:
                self.convs.pop(0)
        parent = conv[-1][0] if conv else None
        turn = self._chain(parent, rng.randint(1, 4))
        prefix = conv + turn
        events: list[Event] = []
        hit = 0
        while hit < len(conv) and conv[hit][0] in self.gpu:
            h = conv[hit][0]
            st = self.gpu[h]
            self.reuse_gaps.append(t - st[1])
            st[1] = t
            self.gpu.move_to_end(h)
            hit += 1
        self.queries += len(prefix) * self.block_size
        self.hits += hit * self.block_size
        todo = prefix[hit:]
        parent = prefix[hit - 1][0] if hit else None
        for i in range(0, len(todo), self.prefill_chunk):
            chunk = todo[i:i + self.prefill_chunk]
            events += self._evict(t, incoming=chunk)
            events.append(self._store(chunk, parent, t))
            parent = chunk[-1][0]
        decoded = self._chain(parent, rng.randint(0, 3))
        for blk in decoded:
            events += self._evict(t, incoming=[blk])
            events.append(self._store([blk], parent, t))
            parent = blk[0]
        conv[:] = prefix + decoded
        for h, _ in reversed(conv):  # freed tail first, as vLLM does: a chain is evicted from its end
            if h in self.gpu:
                self.gpu.move_to_end(h)
        if len(conv) > 64:  # a finished conversation
            self.convs = [c for c in self.convs if c is not conv]
        if any(isinstance(e, BlockRemoved) and e.medium == "GPU" for e in events) and rng.random() < 0.02:
            self.preemptions += 1  # a full cache
        return events

    def _store(self, blocks: list, parent, t: float, medium: str = "GPU") -> BlockStored:
        tier = self.gpu if medium == "GPU" else self.cpu
        for h, _ in blocks:
            tier[h] = [t, t]
            tier.move_to_end(h)
        toks = [x for _, tk in blocks for x in tk]
        if self.flavor == "vllm":
            return BlockStored([h for h, _ in blocks], parent, toks, self.block_size, None, medium, group_idx=0,
                               kv_cache_spec_kind="full_attention")
        return BlockStored([h for h, _ in blocks], parent, toks, self.block_size, None, medium)

    def _evict(self, t: float, incoming: list = ()) -> list[Event]:
        """Room for the blocks about to be stored, made before their store as vLLM's BlockPool makes it (a
        cached block taken for reuse drops its hash first): the GPU tier never holds more than `capacity` (it
        once stored first and removed after, and an attach frame between the two showed 2,504 blocks of 2,500)."""
        out: list[Event] = []
        new = sum(1 for h, _ in incoming if h not in self.gpu)
        while len(self.gpu) + new > self.capacity and self.gpu:
            gone = []
            while len(self.gpu) + new > self.capacity and self.gpu and len(gone) < 16:
                h, (st, lt) = self.gpu.popitem(last=False)
                gone.append(h)
                self.lifetimes.append(t - st)
                self.idle.append(t - lt)
            out.append(self._removed(gone, "GPU"))
            if self.cpu_capacity:  # offloaded: the CPU tier makes its room first too
                old = []
                while self.cpu and len(self.cpu) + sum(h not in self.cpu for h in gone) > self.cpu_capacity:
                    old.append(self.cpu.popitem(last=False)[0])
                if old:
                    out.append(self._removed(old, self.cpu_medium))
                out.append(self._store([(h, []) for h in gone], None, t, self.cpu_medium))
        return out

    def _removed(self, hashes: list, medium: str) -> BlockRemoved:
        return BlockRemoved(hashes, medium, 0 if self.flavor == "vllm" else None)

    def usage(self, t: float) -> float:
        """What vllm:kv_cache_usage_perc would say: blocks held by running requests (a cached block nobody
        holds is free there), here a load that swings over 40 s."""
        return min(1.0, max(0.0, 0.4 + 0.25 * math.sin(2 * math.pi * t / 40.0) + 0.05 * self.rng.random()))
