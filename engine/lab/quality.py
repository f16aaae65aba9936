"""What a lossy KV format costs: the same tokens run through a lossless and a lossy cache, logits compared.

Teacher forcing: the lossless (fp32) engine generates greedily and its tokens are the reference; each lossy
engine is then fed those same tokens (its own sampling is ignored), so every step's logits answer "given
this history, what does the cache's loss change?" and one early flip cannot derail the rest of the count.
Per step and sequence: KL(p_ref || p_lossy) in nats, top-1 agreement (argmax equal), max |logit error|.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.runtime.model_runner import ModelRunner
from engine.sequence import SamplingParams


@dataclass(frozen=True)
class QualityResult:
    kv_dtype: str
    tokens: int  # compared steps (sequences x new tokens)
    kld: float  # mean KL(p_ref || p) in nats
    kld_p99: float
    top1: float  # fraction of steps whose argmax equals the reference's
    max_logit_err: float  # max |logit - logit_ref| over every step and vocabulary entry
    identical_prefix: list[int]  # per prompt: greedy tokens (free-running) equal to the reference's before the first flip


class TeacherRunner(ModelRunner):
    """A model runner that records each step's logits and returns forced tokens instead of sampling."""

    def __init__(self, base: ModelRunner, forced: dict[int, list[int]]):
        super().__init__(base.model, base.device, counters=base.counters)
        self.inputs, self.stream = base.inputs, base.stream
        self.forced = forced  # sequence id -> the tokens to append, in order
        self.logits: dict[int, list[torch.Tensor]] = {sid: [] for sid in forced}

    def sample(self, sched, logits: torch.Tensor) -> list[int]:
        out = []
        for i, (seq, n) in enumerate(sched):
            if seq.pending > n:  # a prompt chunk with more to come: no token is appended
                out.append(0)
                continue
            got = self.logits[seq.id]
            got.append(logits[i].float().cpu())
            out.append(self.forced[seq.id][len(got) - 1])
        return out


def run_forced(engine, prompts: list[list[int]], continuations: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt: logits [n, vocab] of each step, with the continuation's tokens appended as if sampled."""
    sp = SamplingParams(max_new_tokens=max(len(c) for c in continuations), ignore_eos=True)
    ids = []
    for p, c in zip(prompts, continuations):
        ids.append(engine.add_request(p, SamplingParams(max_new_tokens=len(c), ignore_eos=True) if c else sp))
    base = engine.runner
    teacher = TeacherRunner(base, dict(zip(ids, continuations)))
    engine.runner = teacher
    try:
        engine.run_until_done()
    finally:
        engine.runner = base  # its CUDA graphs, context limit and counters as they were
    return [torch.stack(teacher.logits[i]) for i in ids]


def compare(kv_dtype: str, ref: list[torch.Tensor], got: list[torch.Tensor], free: list[list[int]],
            reference_tokens: list[list[int]]) -> QualityResult:
    lp_ref = torch.cat([torch.log_softmax(r, -1) for r in ref])
    lp = torch.cat([torch.log_softmax(g, -1) for g in got])
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).clamp_min(0)  # [steps]
    top1 = (lp_ref.argmax(-1) == lp.argmax(-1)).float().mean().item()
    err = max((g - r).abs().max().item() for g, r in zip(got, ref))
    prefix = [next((i for i, (a, b) in enumerate(zip(f, r)) if a != b), len(r)) for f, r in zip(free, reference_tokens)]
    k = kl.sort().values
    return QualityResult(kv_dtype=kv_dtype, tokens=int(kl.numel()), kld=kl.mean().item(),
                         kld_p99=k[min(len(k) - 1, math.ceil(0.99 * len(k)) - 1)].item(), top1=top1,
                         max_logit_err=err, identical_prefix=prefix)
