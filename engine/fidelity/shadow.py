"""The shadow reference: on sampled steps, one sequence's step computed again with lossless KV, to show what the
KV storage format costs in the model's output.

Every `shadow_every_s` seconds of engine time (engine/config.py; 0: off) the engine hands the step it just ran to
`Shadow.pick`, which takes one running sequence whose row is its next-token step (a decode, or a prompt's last
chunk): round robin by id among those whose positions are their indices (no context shift or seq_add, whose cached
keys a fresh forward pass would not reproduce). After the step, outside the engine's lock, `measure` runs the model
densely over that sequence's tokens, K/V kept in fp32 in a plain per-layer list (no paged cache, no codec; the
weights and their dtype as the engine's), and compares its last-token logits with the engine's for that step:

- KL divergence KL(ref ‖ engine) of the softmax distributions, in nats;
- top-1 flip: 1 when the argmax differs, else 0 (charted as the share of flipped shadow steps over the last
  FLIP_WINDOW_S seconds);
- max |logit error|: the largest absolute difference between the two logit vectors.

The first shadow step comes `shadow_every_s` after the engine's first step (a short run goes unshadowed), and one
that took c seconds puts the next at least 19 c later, so shadowing takes at most 5 % of the engine's time,
whatever the sequence lengths. With fp32 KV the difference is only the order of floating-point
operations (KLD ~1e-9 or less, no flips): the floor every lossy format is read against.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass

import torch

from engine.model.llama_family import AttnGroup, ForwardBatch, LlamaFamily

FLIP_WINDOW_S = 60.0  # the flip rate counts the shadow steps of this many engine seconds
CHUNK = 256  # query rows per dense forward pass (bounds the attention matrix at CHUNK × tokens)
BUDGET = 19.0  # the next shadow step waits at least BUDGET × the last one's cost
BACKOFF_S = 60.0  # after a failed shadow step (out of memory ...)


@dataclass(frozen=True)
class Measured:
    """A shadow step's outcome: the comparison, or why it failed (error set, numbers NaN)."""

    pick: "_Pick"
    kld: float = math.nan
    flip: int = 0
    logit_err: float = math.nan
    cost_s: float = 0.0
    error: str = ""


@dataclass
class _Pick:
    seq_id: int
    tokens: list[int]  # the sequence's tokens up to and including the one whose next token the step predicted
    logits: torch.Tensor  # [vocab] the engine's logits for that step (a copy)
    t: float  # engine time of the step


class Shadow:
    """Picks and measures shadow steps. Handed what it reads: the model (for the dense reference), the step's batch
    and logits, the period; the engine records a measurement under its lock (`record`)."""

    def __init__(self, model: LlamaFamily):
        self.model = model
        self.next_at: float | None = None  # engine time from which the next step may be shadowed
        self.last_id = -1
        self.flips: collections.deque[tuple[float, int]] = collections.deque()
        self.last: dict = {}  # the latest measurement (the snapshot's quality.shadow)

    def pick(self, sched, logits: torch.Tensor, now: float, every: float) -> _Pick | None:
        """The row of this step (a Scheduled batch; its logits [rows, vocab]) to shadow, or None (most steps: one
        comparison). every: the config's shadow_every_s (0: off)."""
        if self.next_at is None:  # the first one `every` seconds after the first step: short runs go unshadowed
            self.next_at = now + every
        if every <= 0 or now < self.next_at:
            return None
        rows = [(s.id, i) for i, (s, n) in enumerate(sched)
                if s.pending == n and not s.repositioned and s.canonical == s.num_cached]
        if not rows:
            return None
        sid, i = min(rows, key=lambda r: (r[0] <= self.last_id, r[0]))  # the next id after the last one shadowed
        self.last_id = sid
        self.next_at = now + every
        seq = sched[i][0]
        return _Pick(sid, seq.tokens[: seq.num_cached + sched[i][1]], logits[i].detach().float().clone(), now)

    def measure(self, p: _Pick | None) -> Measured | None:
        """The dense reference for a picked step, compared (None for None). Runs outside the engine's lock; a failure
        (out of memory, most likely) backs the next shadow step off and comes back as Measured.error."""
        if p is None:
            return None
        t0 = time.perf_counter()
        try:
            ref = dense_logits(self.model, p.tokens)
        except RuntimeError as ex:
            self.next_at = p.t + BACKOFF_S
            return Measured(p, error=f"shadow reference step failed: {ex}")
        kld, flip, err = compare(ref, p.logits)
        cost = time.perf_counter() - t0
        self.next_at = max(self.next_at, p.t + BUDGET * cost)
        return Measured(p, kld, flip, err, cost)

    def record(self, m: Measured, kv_dtype: str) -> tuple[float, float, float]:
        """Under the engine's lock: keep a measurement as `last`; its (KLD, flip rate, max logit error) for the time
        series (the counters count it: Counters.count_shadow). kv_dtype: the label of the format measured."""
        p = m.pick
        self.flips.append((p.t, m.flip))
        while self.flips and p.t - self.flips[0][0] > FLIP_WINDOW_S:
            self.flips.popleft()
        rate = sum(f for _, f in self.flips) / len(self.flips)
        self.last = {"t": p.t, "seq": p.seq_id, "tokens": len(p.tokens), "kld": m.kld, "flip": m.flip,
                     "flip_rate": rate, "logit_err": m.logit_err, "cost_s": m.cost_s, "kv_dtype": kv_dtype}
        return m.kld, rate, m.logit_err


def compare(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, int, float]:
    """(KL(ref ‖ got) in nats, 1 if the argmaxes differ, max |got − ref|), in float64."""
    ref, got = ref.double().cpu(), got.double().cpu()
    lr, lg = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kld = float((lr.exp() * (lr - lg)).sum())
    return max(kld, 0.0), int(int(ref.argmax()) != int(got.argmax())), float((got - ref).abs().max())


class DenseKV:
    """K/V of one sequence, fp32, one growing tensor per layer: the model's KVStore for a lossless forward pass
    through its reference attention (one "block" holding every token)."""

    def __init__(self, layers: int):
        self.k: list[torch.Tensor | None] = [None] * layers
        self.v: list[torch.Tensor | None] = [None] * layers

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k, v = k.float(), v.float()  # [T, Hkv, D]
        old_k, old_v = self.k[layer], self.v[layer]
        self.k[layer] = k if old_k is None else torch.cat((old_k, k))
        self.v[layer] = v if old_v is None else torch.cat((old_v, v))

    def gather(self, layer: int, group: AttnGroup) -> tuple[torch.Tensor, torch.Tensor]:
        # [1, 1, Hkv, S, D]: one sequence, one block of all S tokens
        return self.k[layer].transpose(0, 1)[None, None], self.v[layer].transpose(0, 1)[None, None]

    def paged(self):
        """Nothing is paged: the reference attention asks only for the block size (0: no blocks to split by tier)."""
        return _NotPaged()


class _NotPaged:
    block_size = 0


@torch.inference_mode()
def dense_logits(model: LlamaFamily, tokens: list[int], chunk: int = CHUNK, every_row: bool = False) -> torch.Tensor:
    """[vocab] fp32 logits after `tokens` (positions 0..n-1), K/V never stored lossily: prefilled in chunks of
    `chunk` queries through the model's reference attention over a DenseKV. every_row: [n, vocab], the logits
    after each prefix (tokens[:1], tokens[:2], ...)."""
    dev = model.embed.device
    ids = torch.tensor(tokens, dtype=torch.long, device=dev)
    store = DenseKV(model.spec.num_layers)
    out = []
    backend, model.backend = model.backend, None  # the reference path reads store.gather (on the engine thread)
    try:
        for lo in range(0, len(tokens), chunk):
            hi = min(len(tokens), lo + chunk)
            q = hi - lo
            pos = torch.arange(lo, hi, device=dev)
            group = AttnGroup(rows=torch.arange(q, device=dev), q_len=q,
                              table=torch.zeros((1, 1), dtype=torch.long, device=dev),
                              kpos=torch.arange(hi, device=dev)[None], kvalid=torch.ones((1, hi), dtype=torch.bool, device=dev),
                              qpos=pos[None])
            rows = torch.arange(q, device=dev) if every_row else torch.tensor([q - 1], device=dev)
            logits = model.forward(ForwardBatch(input_ids=ids[lo:hi], positions=pos, groups=[group], logit_rows=rows),
                                   store)
            out = [*out, logits] if every_row else [logits]  # (the last chunk's alone where only it is read)
    finally:
        model.backend = backend
    return torch.cat(out) if every_row else out[-1][0]
