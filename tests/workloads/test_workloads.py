"""Workloads: the request generators keep their promises, traces round-trip, and the demo driver exercises
prefix reuse, demotion and promotion, forks and context shifts on the tiny model under a fake clock."""

from __future__ import annotations

import dataclasses
import json

import pytest

from engine.config import CacheConfig, EngineOptions
from engine.runtime.engine import Engine
from engine.sequence import SeqState
from engine.model.tokenizer import Tokenizer
from engine.model.chat_format import ChatFormat
from engine.workloads.corpus import DEFAULT_SYSTEM_PROMPT
from engine.workloads.demo import MAX_LIVE, DemoWorkload
from engine.workloads.requests import (KINDS, Request, forks, load_trace, long_documents, mixed, returning_users, save_trace,
                              shared_system_chat)

@pytest.fixture(scope="module")
def chat_model(llama_model, tokenizer_files):
    """The tiny model with the full tiny tokenizer directory, SmolLM2's chat template included (the tiny
    model's own copy has no template, which exercises the plain-text fallback instead)."""
    return dataclasses.replace(llama_model, tokenizer=Tokenizer(tokenizer_files, llama_model.spec.eos_token_ids))


GENERATORS = {
    "shared_system_chat": lambda seed: shared_system_chat(4, 3, seed),
    "returning_users": lambda seed: returning_users(3, 6.0, seed),
    "long_documents": lambda seed: long_documents(3, 300, seed),
    "forks": lambda seed: forks(3, 3, seed),
    "mixed": lambda seed: mixed(seed, 60.0),
}


@pytest.mark.parametrize("name", GENERATORS)
def test_generators_are_deterministic_under_a_seed(name):
    gen = GENERATORS[name]
    a, b, c = gen(7), gen(7), gen(8)
    assert a == b
    assert a != c
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)
    assert all(r.kind in KINDS for r in a)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_shared_system_chat_prompts_share_the_system_prompt(llama_model):
    tok = llama_model.tokenizer
    reqs = shared_system_chat(5, 3, seed=1)
    firsts = [r for r in reqs if r.kind == "chat"]
    assert len(firsts) == 5 and len(reqs) == 15
    assert {r.session for r in reqs} == {r.session for r in firsts}
    n_system = len(tok.encode(DEFAULT_SYSTEM_PROMPT))
    assert n_system >= 150
    ids = [tok.encode(r.prompt) for r in firsts]
    assert min(common_prefix(ids[0], other) for other in ids[1:]) >= n_system
    assert len({r.prompt for r in firsts}) == 5  # the user messages differ


def test_returning_users_come_back_after_the_idle_gap():
    gap = 6.0
    reqs = returning_users(4, gap, seed=2, turns=3)
    by_session: dict[str, list[Request]] = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    assert len(by_session) == 4
    for turns in by_session.values():
        assert [r.kind for r in turns] == ["chat", "turn", "turn"]
        assert all(b.arrival_s - a.arrival_s >= gap for a, b in zip(turns, turns[1:]))


def test_long_documents_have_the_promised_length(llama_model):
    encode = llama_model.tokenizer.encode
    docs = long_documents(3, 300, seed=3, encode=encode)
    assert [len(r.prompt_tokens) for r in docs] == [300] * 3 and all(r.prompt is None for r in docs)
    assert len({tuple(r.prompt_tokens) for r in docs}) == 3
    # Without a tokenizer the text is sized by an estimate: close, not exact.
    for r in long_documents(3, 300, seed=3):
        assert 0.8 * 300 <= len(encode(r.prompt)) <= 1.3 * 300


def test_forks_carry_their_parent():
    reqs = forks(2, 4, seed=4)
    parents = [r for r in reqs if r.kind == "nbest"]
    assert len(parents) == 2 and all(p.n_forks == 3 for p in parents)
    for p in parents:
        kids = [r for r in reqs if r.fork_of == p.session]
        assert len(kids) == p.n_forks
        assert all(k.kind == "fork" and k.prompt == p.prompt and k.arrival_s == p.arrival_s for k in kids)


@pytest.mark.parametrize("seed, duration", [(0, 20.0), (1, 20.0), (2, 60.0), (3, 300.0)])
def test_mixed_holds_every_kind(seed, duration):
    reqs = mixed(seed, duration)
    assert {r.kind for r in reqs} == set(KINDS)
    assert all(0 <= r.arrival_s < duration for r in reqs)


def test_trace_round_trips(tmp_path, llama_model):
    reqs = mixed(5, 60.0) + long_documents(2, 64, seed=5, encode=llama_model.tokenizer.encode)
    reqs.sort(key=lambda r: r.arrival_s)
    path = tmp_path / "trace.jsonl"
    save_trace(reqs, path)
    assert load_trace(path) == reqs
    first = json.loads(path.read_text().splitlines()[0])
    assert {"arrival_s", "session", "max_new_tokens"} <= set(first)
    assert ("prompt" in first) != ("prompt_tokens" in first)


GOOD = '{"arrival_s": 0.5, "session": "a", "prompt": "hi", "max_new_tokens": 8}'


@pytest.mark.parametrize("line, problem", [
    ('{"arrival_s": 1, "session": "a", "prompt": "hi"', "not valid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"session": "b", "prompt": "hi", "max_new_tokens": 8}', "missing 'arrival_s'"),
    ('{"arrival_s": 1, "session": "b", "max_new_tokens": 8}', "missing 'prompt' or 'prompt_tokens'"),
    ('{"arrival_s": 1, "session": "b", "promt": "hi", "max_new_tokens": 8}', "unknown key(s) 'promt'"),
    ('{"arrival_s": "soon", "session": "b", "prompt": "hi", "max_new_tokens": 8}', "arrival_s must be a number"),
    ('{"arrival_s": -1, "session": "b", "prompt": "hi", "max_new_tokens": 8}', "arrival_s must be a finite number"),
    ('{"arrival_s": 1, "session": "b", "prompt": "hi", "prompt_tokens": [1], "max_new_tokens": 8}',
     "exactly one of prompt and prompt_tokens"),
    ('{"arrival_s": 1, "session": "b", "prompt_tokens": [1, "x"], "max_new_tokens": 8}', "list of integer token ids"),
    ('{"arrival_s": 1, "session": "b", "prompt": "hi", "max_new_tokens": 0}', "max_new_tokens must be from 1 to 1,048,576, got 0"),
    ('{"arrival_s": 1, "session": "b", "prompt": "hi", "max_new_tokens": true}', "max_new_tokens must be an integer"),
    ('{"arrival_s": 1, "session": "b", "prompt": "hi", "max_new_tokens": 8, "kind": "poem"}', "kind 'poem'"),
    ('{"arrival_s": 1, "session": "b", "prompt": "hi", "max_new_tokens": 8, "fork_of": "zz"}', "fork_of 'zz'"),
])
def test_a_malformed_trace_line_is_named(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(GOOD + "\n\n" + line + "\n")
    with pytest.raises(ValueError) as err:
        load_trace(path)
    assert str(err.value).startswith(f"{path}:3: ")
    assert problem in str(err.value)


def test_chat_format_matches_the_chat_template(chat_model):
    tok = chat_model.tokenizer
    fmt = ChatFormat(tok)
    assert fmt.templated
    system, q1, reply, q2 = "Be brief.", "What is a cache?", "A place to keep things.", "Why use one?"
    ids = fmt.first(system, fmt.encode(q1))
    assert ids == tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q1}])
    whole = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q1},
                                     {"role": "assistant", "content": reply}, {"role": "user", "content": q2}])
    eos = tok.eos_token_ids[0]
    assert ids + fmt.encode(reply) + [eos] + fmt.next_turn(fmt.encode(q2), ended_with=eos) == whole
    assert ids + fmt.encode(reply) + fmt.next_turn(fmt.encode(q2)) == whole  # a reply cut short gets closed


def test_chat_format_without_a_template_falls_back_to_plain_text(llama_model):
    tok = llama_model.tokenizer
    assert tok.chat_template is None
    fmt = ChatFormat(tok)
    assert not fmt.templated
    assert tok.decode(fmt.first("Be brief.", fmt.encode("Hi?"))) == "Be brief.\n\nUser: Hi?\nAssistant:"
    assert tok.decode(fmt.next_turn(fmt.encode("Why?"))) == "\nUser: Why?\nAssistant:"


def demo_engine(model) -> tuple[Engine, list[float]]:
    now = [0.0]
    eng = Engine(model, CacheConfig(demote_after_s=5.0, device_budget_mb=8, host_budget_mb=16),
                 EngineOptions(context_limit=128, n_keep=8), clock=lambda: now[0])
    return eng, now


def drive(eng: Engine, now: list[float], wl: DemoWorkload, ticks: int) -> int:
    """tick + step with the clock advancing 0.1 s a step; returns the most live sequences seen."""
    most = 0
    for _ in range(ticks):
        wl.tick(now[0])
        eng.step()
        now[0] += 0.1
        most = max(most, sum(not s.done for s in eng.seqs.values()))
    return most


@pytest.mark.parametrize("model", ["chat_model", "llama_model"])
def test_demo_workload_exercises_the_cache(model, request):
    eng, now = demo_engine(request.getfixturevalue(model))
    wl = DemoWorkload(eng, seed=0)
    assert drive(eng, now, wl, 200) <= MAX_LIVE
    c, st = eng.counters, wl.stats()
    assert c.prompt_reused > 0  # chat users share the system prompt's blocks
    assert c.demotions > 0 and c.promotions > 0 and st["returns"] > 0  # idle users went to the host and came back
    assert c.cow_copies > 0 and st["forks"] > 0 and any(s.label.endswith("/fork") for s in eng.seqs.values())
    assert c.context_shifts > 0 and st["shifts"] > 0
    assert st["documents"] > 0 and st["turns"] > 0 and st["requests"] >= 6
    eng.check_invariants()


def test_demo_workload_is_deterministic(chat_model):
    runs = []
    for _ in range(2):
        eng, now = demo_engine(chat_model)
        wl = DemoWorkload(eng, seed=3)
        drive(eng, now, wl, 80)
        runs.append(([(s.label, s.tokens, s.state) for s in eng.seqs.values()], wl.stats()))
    assert runs[0] == runs[1]
    assert runs[0][1]["forks"] > 0  # the sampled fork branches are covered by the comparison


def test_demo_workload_knobs(chat_model):
    eng, now = demo_engine(chat_model)
    wl = DemoWorkload(eng, seed=0, intensity=0.5)
    for bad in (0.0, 3.5, float("nan"), "2"):
        with pytest.raises(ValueError, match="intensity"):
            wl.set_intensity(bad)
    with pytest.raises(ValueError, match="intensity"):
        DemoWorkload(eng, intensity=5)
    wl.intensity = 3.0
    assert wl.intensity == 3.0
    wl.paused = True
    drive(eng, now, wl, 5)
    assert wl.stats()["requests"] == 0 and not eng.seqs
    wl.paused = False
    drive(eng, now, wl, 2)
    assert wl.stats()["requests"] >= 2
    assert all(s.state in (SeqState.WAITING, SeqState.RUNNING) for s in eng.seqs.values())


def test_the_demo_and_a_trace_are_workloads(chat_model, tmp_path):
    from engine.workloads.trace_workload import TraceWorkload
    from engine.workloads.workload import Workload

    eng, _ = demo_engine(chat_model)
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"arrival_s": 0, "session": "a", "prompt": "hi", "max_new_tokens": 3}) + "\n")
    for w in (DemoWorkload(eng, seed=0), TraceWorkload(eng, str(trace))):
        assert isinstance(w, Workload), type(w).__name__
    assert not isinstance(object(), Workload)
