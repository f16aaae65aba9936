"""engine/lab/quality.py: teacher-forced comparison of a lossy KV cache against the lossless one."""

from __future__ import annotations

import torch

from engine.config import CacheConfig
from engine.runtime.engine import Engine
from engine.lab.quality import compare, run_forced
from engine.sequence import SamplingParams
from tiny_models import prompts


def test_forced_runs_follow_the_reference_tokens_and_measure_the_loss(llama_model):
    ps = prompts(50, [12, 30])
    eng = lambda dtype: Engine(llama_model, CacheConfig(block_size=8, kv_dtype=dtype, host_budget_mb=0))  # noqa: E731
    ref_tokens = eng("fp32").generate(ps, SamplingParams(max_new_tokens=10, ignore_eos=True))
    ref = run_forced(eng("fp32"), ps, ref_tokens)
    assert [r.shape[0] for r in ref] == [10, 10]
    assert [r.argmax(-1).tolist() for r in ref] == ref_tokens  # fp32 forced by its own greedy tokens: the same run
    same = compare("fp32", ref, run_forced(eng("fp32"), ps, ref_tokens), ref_tokens, ref_tokens)
    assert same.kld == 0 and same.top1 == 1 and same.max_logit_err == 0 and same.identical_prefix == [10, 10]
    # Forced tokens that are not the engine's own choice: it follows them (the logits change with the history).
    other = [[t + 1 for t in r] for r in ref_tokens]
    moved = run_forced(eng("fp32"), ps, other)
    assert not torch.equal(moved[0][1:], ref[0][1:]) and torch.equal(moved[0][0], ref[0][0])
    lossy = compare("int8", ref, run_forced(eng("int8"), ps, ref_tokens), ref_tokens, ref_tokens)
    assert 0 < lossy.kld < 0.05 and 0 < lossy.max_logit_err and lossy.tokens == 20
