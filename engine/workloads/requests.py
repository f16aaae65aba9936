"""Requests of a workload: the `Request` record, seedable request generators, and JSONL traces.

The generators return plain `Request` lists (no engine, no tokenizer needed) whose prompts come from the
built-in corpus (engine/workloads/corpus.py), so a seed fully decides the text. The live demo driver that feeds a
running engine is in engine/workloads/demo.py.

This module does not import torch, so trace tools can use the generators cheaply.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from engine.workloads.corpus import DEFAULT_SYSTEM_PROMPT, NAMES, SENTENCES, STORIES, _follow_up, _message, _passage
from engine.user_file import json_lines, surrogate_problem

KINDS: tuple[str, ...] = ("chat", "turn", "document", "nbest", "fork")
_WORDS_TO_TOKENS = 1.2  # corpus tokens per whitespace word (measured on the default model's tokenizer)
_SECONDS_PER_TOKEN = 0.05  # a trace's guess of decode time, so a next turn arrives after the reply
# Bounds of a request, so that one a trace can hold is one a replay can run and finish.
MAX_ARRIVAL_S = 10_000_000.0  # ~116 days; an engine clock far beyond would lose its sub-millisecond steps
MAX_NEW_TOKENS = 1 << 20
MAX_FORKS = 1024
MAX_SESSION_CHARS = 256  # a session is a sequence's label: in the window, the events and the snapshot JSON


# -- requests ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Request:
    """One request of a workload.

    kind: "chat" opens a session (its prompt holds the whole first prompt), "turn" is a later user turn
    of the same session (its prompt holds only the new text, to append), "document" is a long one-shot
    prompt, "nbest" is a one-shot prompt to be forked `n_forks` times once it runs, and "fork" is one of
    those forks (`fork_of` names the nbest session; it repeats the prompt, so a replayer without forks
    can run it as a plain request and still share the cached prefix).
    """

    arrival_s: float
    session: str
    prompt: str | None
    prompt_tokens: list[int] | None
    max_new_tokens: int
    kind: str
    fork_of: str | None = None
    n_forks: int = 0
    line: int | None = field(default=None, compare=False)  # the trace line it was read from, to name it

    def __post_init__(self) -> None:
        if not (isinstance(self.arrival_s, (int, float)) and math.isfinite(self.arrival_s)
                and 0 <= self.arrival_s <= MAX_ARRIVAL_S):
            raise ValueError(f"arrival_s must be a finite number from 0 to {MAX_ARRIVAL_S:,.0f} (seconds), "
                             f"got {self.arrival_s!r}")
        if not self.session:
            raise ValueError("session must be a non-empty string")
        if len(self.session) > MAX_SESSION_CHARS:
            raise ValueError(f"session is {len(self.session):,} characters; at most {MAX_SESSION_CHARS}")
        if (self.prompt is None) == (self.prompt_tokens is None):
            raise ValueError("give exactly one of prompt and prompt_tokens")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt is empty")
        if self.prompt_tokens is not None and (not self.prompt_tokens or any(t < 0 for t in self.prompt_tokens)):
            raise ValueError("prompt_tokens must be a non-empty list of token ids >= 0")
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(f"max_new_tokens must be from 1 to {MAX_NEW_TOKENS:,}, got {_short(self.max_new_tokens)}")
        if self.kind not in KINDS:
            raise ValueError(f"kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not 0 <= self.n_forks <= MAX_FORKS:
            raise ValueError(f"n_forks must be from 0 to {MAX_FORKS:,}, got {_short(self.n_forks)}")
        for name in ("session", "prompt", "fork_of"):
            text = getattr(self, name)
            problem = surrogate_problem(text) if text is not None else None
            if problem is not None:
                raise ValueError(f"{name} holds {problem}")


def _short(n: int) -> str:
    """An integer for a message: a huge one by its size, not its 4,000 digits."""
    return str(n) if abs(n) < 10**20 else f"an integer of about {int(abs(n).bit_length() * 0.30103) + 1:,} digits"


def _show(v: object) -> str:
    """A JSON value for a one-line message, whatever its size (and without repr's recursion)."""
    if isinstance(v, list):
        return f"an array of {len(v):,} items"
    if isinstance(v, dict):
        return f"an object of {len(v):,} keys"
    if _is_int(v):
        return _short(v)
    text = repr(v)
    return text if len(text) <= 60 else text[:60] + "…"


def _sorted(requests: list[Request]) -> list[Request]:
    return sorted(requests, key=lambda r: r.arrival_s)  # stable: a session's turns keep their order on ties


def _chat_text(system_prompt: str, message: str) -> str:
    return f"{system_prompt}\n\nUser: {message}\nAssistant:"


def _turn_text(message: str) -> str:
    return f"\nUser: {message}\nAssistant:"


def shared_system_chat(n_users: int, turns: int, seed: int, system_prompt: str = DEFAULT_SYSTEM_PROMPT,
                       max_new_tokens: int = 32) -> list[Request]:
    """Chat users whose first prompts all start with `system_prompt` (prefix reuse), `turns` turns each."""
    if n_users < 1 or turns < 1:
        raise ValueError("n_users and turns must be >= 1")
    rng = random.Random(f"shared_system_chat:{seed}")
    out: list[Request] = []
    t = rng.uniform(0.0, 1.0)
    for u in range(n_users):
        session = f"chat-{u}"
        out.append(Request(round(t, 3), session, _chat_text(system_prompt, _message(rng, rng.randint(0, 2))), None,
                           max_new_tokens, "chat"))
        at = t
        for _ in range(turns - 1):
            at += max_new_tokens * _SECONDS_PER_TOKEN + rng.uniform(1.0, 4.0)
            out.append(Request(round(at, 3), session, _turn_text(_follow_up(rng)), None, max_new_tokens, "turn"))
        t += rng.uniform(0.5, 3.0)
    return _sorted(out)


def returning_users(n_users: int, idle_gap_s: float, seed: int, turns: int = 3,
                    max_new_tokens: int = 32) -> list[Request]:
    """Multi-turn sessions whose consecutive turns arrive at least `idle_gap_s` apart (plus the reply time):
    with idle_gap_s > demote_after_s, their blocks go to the host tier between turns and come back."""
    if n_users < 1 or turns < 2:
        raise ValueError("n_users must be >= 1 and turns >= 2 (a user must return)")
    if idle_gap_s <= 0:
        raise ValueError(f"idle_gap_s must be > 0, got {idle_gap_s}")
    rng = random.Random(f"returning_users:{seed}")
    out: list[Request] = []
    t = rng.uniform(0.0, 1.0)
    for u in range(n_users):
        session = f"user-{u}"
        intro = f"My name is {rng.choice(NAMES)} and I come to the library every week."
        out.append(Request(round(t, 3), session, f"User: {intro} {_message(rng, rng.randint(0, 1))}\nAssistant:",
                           None, max_new_tokens, "chat"))
        at = t
        for _ in range(turns - 1):
            # Round up so the promised gap survives the rounding to milliseconds.
            at = math.ceil((at + idle_gap_s + max_new_tokens * _SECONDS_PER_TOKEN
                            + rng.uniform(0.0, idle_gap_s / 2)) * 1000) / 1000
            out.append(Request(at, session, _turn_text(_follow_up(rng)), None, max_new_tokens, "turn"))
        t += rng.uniform(0.5, 3.0)
    return _sorted(out)


def long_documents(n_docs: int, doc_tokens: int, seed: int, encode: Callable[[str], list[int]] | None = None,
                   max_new_tokens: int = 32) -> list[Request]:
    """Long one-shot documents that sweep the cache (each is new text, so none of its blocks is reused).

    With `encode` (a tokenizer's encode) each request carries exactly `doc_tokens` prompt_tokens;
    without, it carries text of about `doc_tokens` tokens.
    """
    if n_docs < 1 or doc_tokens < 1:
        raise ValueError("n_docs and doc_tokens must be >= 1")
    rng = random.Random(f"long_documents:{seed}")
    out: list[Request] = []
    t = rng.uniform(0.0, 1.0)
    for d in range(n_docs):
        head = "Summarize the following document in three sentences.\n\n"
        words = math.ceil(doc_tokens / _WORDS_TO_TOKENS)
        if encode is None:
            req = Request(round(t, 3), f"doc-{d}", head + _passage(rng, words - len(head.split())), None,
                          max_new_tokens, "document")
        else:
            ids = encode(head + _passage(rng, words))
            while len(ids) < doc_tokens:
                ids += encode("\n\n" + _passage(rng, words // 4 + 1))
            req = Request(round(t, 3), f"doc-{d}", None, ids[:doc_tokens], max_new_tokens, "document")
        out.append(req)
        t += rng.uniform(2.0, 8.0)
    return _sorted(out)


def forks(n_prompts: int, n_best: int, seed: int, max_new_tokens: int = 32) -> list[Request]:
    """n-best generation: per prompt one "nbest" request with n_forks = n_best - 1 and that many "fork"s."""
    if n_prompts < 1 or n_best < 1:
        raise ValueError("n_prompts and n_best must be >= 1")
    rng = random.Random(f"forks:{seed}")
    out: list[Request] = []
    t = rng.uniform(0.0, 1.0)
    for i in range(n_prompts):
        session = f"nbest-{i}"
        prompt = f"{rng.choice(STORIES)} {rng.choice(SENTENCES)}\n\nWrite an ending for this story:"
        at = round(t, 3)
        out.append(Request(at, session, prompt, None, max_new_tokens, "nbest", n_forks=n_best - 1))
        out += [Request(at, f"{session}.{j}", prompt, None, max_new_tokens, "fork", fork_of=session)
                for j in range(1, n_best)]
        t += rng.uniform(1.0, 5.0)
    return _sorted(out)


def mixed(seed: int, duration_s: float) -> list[Request]:
    """All of the above within [0, duration_s); every kind appears when duration_s >= 20."""
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    rng = random.Random(f"mixed:{seed}")
    parts = (
        shared_system_chat(max(2, int(duration_s // 10)), 3, rng.randrange(2**31)),
        returning_users(max(1, int(duration_s // 30)), min(10.0, max(1.0, duration_s / 4)), rng.randrange(2**31)),
        long_documents(max(1, int(duration_s // 30)), 384, rng.randrange(2**31)),
        forks(max(1, int(duration_s // 40)), 2, rng.randrange(2**31)),
    )
    return _sorted([r for part in parts for r in part if r.arrival_s < duration_s])


def reference_desk(n_requests: int, seed: int, rate_per_s: float = 4.0, max_new_tokens: int = 16,
                   n_docs: int = 3) -> list[Request]:
    """A help desk's mix, many requests in flight at once (Poisson arrivals at `rate_per_s`): a third open with one
    of two shared system prompts, a third ask about one of `n_docs` documents that come back (the same text, another
    question after it), a third are unique one-shot questions. Reuse at three distances: the system prompts' blocks
    are read by every third request, a document's by its next question some seconds later, the unique ones never."""
    if n_requests < 1:
        raise ValueError("n_requests must be >= 1")
    if not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
    if n_docs < 1:
        raise ValueError(f"n_docs must be >= 1, got {n_docs}")
    rng = random.Random(f"reference_desk:{seed}")
    systems = (DEFAULT_SYSTEM_PROMPT, "You are the reference librarian. Quote the catalogue when you can, and say "
               "which shelf a book is on. " + " ".join(rng.sample(SENTENCES, 2)))
    docs = [_passage(rng, 60 + 20 * (i % 3)) for i in range(n_docs)]
    out: list[Request] = []
    t = 0.0
    for i in range(n_requests):
        t += rng.expovariate(rate_per_s)
        kind = i % 3
        if kind == 0:
            text = _chat_text(systems[rng.randrange(2)], _message(rng, rng.randint(0, 2)))
        elif kind == 1:
            text = f"Read this.\n\n{docs[rng.randrange(len(docs))]}\n\nQuestion: {_follow_up(rng)}\nAnswer:"
        else:
            text = f"{rng.choice(STORIES)} {_message(rng, rng.randint(0, 2))}"
        out.append(Request(round(t, 3), f"desk-{i}", text, None, max_new_tokens, "document" if kind else "chat"))
    return _sorted(out)


# -- traces -----------------------------------------------------------------------------------

_TRACE_KEYS = ("arrival_s", "session", "prompt", "prompt_tokens", "max_new_tokens", "kind", "fork_of", "n_forks")


def save_trace(requests: Iterable[Request], path: str | os.PathLike[str]) -> None:
    """JSONL, one request a line; optional keys are written only when they differ from their defaults."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            d: dict[str, Any] = {"arrival_s": r.arrival_s, "session": r.session}
            if r.prompt is not None:
                d["prompt"] = r.prompt
            else:
                d["prompt_tokens"] = list(r.prompt_tokens or [])
            d["max_new_tokens"] = r.max_new_tokens
            d["kind"] = r.kind
            if r.fork_of is not None:
                d["fork_of"] = r.fork_of
            if r.n_forks:
                d["n_forks"] = r.n_forks
            f.write(json.dumps(d, ensure_ascii=False) + "\n")


def read_trace(path: str | os.PathLike[str]) -> Iterator[tuple[int, Request | str]]:
    """(line number, request) for each request line of a JSONL trace, or (line number, what is wrong with
    it): read lazily, in file order, so memory does not grow with the file. The file's own problems (not a
    regular file, over MAX_JSONL_BYTES) raise UserFileError (a ValueError) naming it. A `fork_of` must name
    the session of an earlier good line."""
    from engine.workloads import public_traces as pub  # a line with hash_ids: Mooncake or Bailian, tokens synthesized

    sessions: set[str] = set()
    for ln in json_lines(path, "a trace"):
        if ln.problem is not None:
            yield ln.number, ln.problem
            continue
        try:
            if pub.is_block_trace_line(ln.value):
                req = _block_request(pub.parse_block_line(ln.value, ln.number), pub.synthesized_prompt)
            else:
                req = _parse_line(ln.value, sessions, ln.number)
        except ValueError as e:
            yield ln.number, str(e)
            continue
        sessions.add(req.session)
        yield ln.number, req


def _block_request(r, synthesize) -> Request:
    """A Mooncake / Bailian line (engine/workloads/public_traces.py) as a replayable request: synthesized prompt
    tokens, output_length new tokens (at least 1), its own session (the trace's prompts carry their history)."""
    session = r.session if r.fmt == "mooncake" else f"{r.session}-{r.line}"
    return Request(r.t_s, session, None, synthesize(r), max(1, r.output_length), "chat", line=r.line)


def load_trace(path: str | os.PathLike[str]) -> list[Request]:
    """Requests of a JSONL trace, sorted by arrival; the first bad line raises ValueError("PATH:LINE: problem")."""
    out: list[Request] = []
    for number, req in read_trace(path):
        if isinstance(req, str):
            raise ValueError(f"{os.fspath(path)}:{number}: {req}")
        out.append(req)
    return _sorted(out)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_line(obj: object, sessions: set[str], line: int | None = None) -> Request:
    """Type checks of one JSON line; value checks are Request's own."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(_TRACE_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))}; keys are {', '.join(_TRACE_KEYS)}")
    for key in ("arrival_s", "session", "max_new_tokens"):
        if key not in obj:
            raise ValueError(f"missing {key!r}")
    if "prompt" not in obj and "prompt_tokens" not in obj:
        raise ValueError("missing 'prompt' or 'prompt_tokens'")
    arrival = obj["arrival_s"]
    if not (_is_int(arrival) or isinstance(arrival, float)):
        raise ValueError(f"arrival_s must be a number, got {_show(arrival)}")
    if _is_int(arrival) and arrival > MAX_ARRIVAL_S:  # (float() of a 400-digit integer overflows)
        raise ValueError(f"arrival_s must be a finite number from 0 to {MAX_ARRIVAL_S:,.0f} (seconds), "
                         f"got {_short(arrival)}")
    for key in ("session", "prompt", "kind", "fork_of"):
        if key in obj and not isinstance(obj[key], str):
            raise ValueError(f"{key} must be a string, got {_show(obj[key])}")
    tokens = obj.get("prompt_tokens")
    if tokens is not None and not (isinstance(tokens, list) and all(_is_int(t) for t in tokens)):
        raise ValueError("prompt_tokens must be a list of integer token ids")
    for key in ("max_new_tokens", "n_forks"):
        if key in obj and not _is_int(obj[key]):
            raise ValueError(f"{key} must be an integer, got {_show(obj[key])}")
    fork_of = obj.get("fork_of")
    if fork_of is not None and fork_of not in sessions:
        raise ValueError(f"fork_of {_show(fork_of)} names no session on an earlier line")
    return Request(float(arrival), obj["session"], obj.get("prompt"), tokens, obj["max_new_tokens"],
                   obj.get("kind", "chat"), fork_of, obj.get("n_forks", 0), line)
