"""A prompt as the token ids the engine is given, and whether the engine would take the request.

`encode_text`: a prompt typed by a user (`generate`, the window's prompt box): the text alone, or one user
message in the tokenizer's chat template. `RequestCheck`: a trace's request (engine/workloads/requests.py)
as token ids and sampling, and why the engine would refuse it, asked of the engine's own rule
(`SequenceOps.check_fits` through `Engine.check_request`, or directly for a bound on a prompt's length).
"""

from __future__ import annotations

import zlib

from engine.errors import RequestError
from engine.model.chat_format import ChatFormat
from engine.sequence import SamplingParams

FORK_TEMPERATURE = 0.8  # nbest requests and their forks sample, so the forks diverge


def encode_text(tokenizer, text: str, chat: bool) -> list[int]:
    """The token ids of a typed prompt: with `chat`, one user message and the assistant cue."""
    if chat:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(text)


class RequestCheck:
    """How a replay turns a trace request into what the engine is asked (token ids, sampling), and whether the
    engine would take it: the checks a trace's reader runs on every line, against the engine that will run it."""

    def __init__(self, engine, cap: int | None = None):
        self.engine, self.cap = engine, cap
        self.fmt = ChatFormat(engine.tokenizer)
        self._overhead: dict[bool, int] = {}

    def sampling(self, r) -> SamplingParams:
        n = min(r.max_new_tokens, self.cap) if self.cap else r.max_new_tokens
        if r.kind in ("nbest", "fork"):
            return SamplingParams(max_new_tokens=n, temperature=FORK_TEMPERATURE, seed=zlib.crc32(r.session.encode()),
                                  ignore_eos=True)
        return SamplingParams(max_new_tokens=n, ignore_eos=True)

    def prompt(self, r, history: list[int] | None) -> list[int]:
        """The token ids of `r` after `history` (a later turn's conversation so far; None for anything else)."""
        if r.prompt_tokens is not None:
            return (history or []) + list(r.prompt_tokens)
        if r.kind == "chat":
            return self.fmt.first(None, self.fmt.encode(r.prompt))
        if r.kind == "turn":
            body = self.fmt.encode(r.prompt)
            if not history:
                return self.fmt.first(None, body)
            ended = history[-1] if history[-1] in self.engine.eos else None
            return history + self.fmt.next_turn(body, ended)
        return self.engine.tokenizer.encode(r.prompt)

    def refusal(self, r) -> str | None:
        """Why the engine would refuse `r` were it to arrive now (as a first turn: a later one also carries its
        conversation so far, checked when it starts); None if it would take it. A text prompt is encoded only
        when a bound on its length (a token holds at least one UTF-8 byte, plus two for a tokenizer's leading
        space and the chat template's own tokens) does not already show that it fits."""
        e, sp = self.engine, self.sampling(r)
        try:
            if r.prompt_tokens is not None:
                e.check_request(r.prompt_tokens, sp)
                return None
            bound = len(r.prompt.encode("utf-8")) + 2 + self._template_tokens(r.kind in ("chat", "turn"))
            if self._fits(bound, sp):
                return None
            e.check_request(self.prompt(r, None), sp)
        except RequestError as ex:
            return str(ex)
        except (TypeError, ValueError) as ex:  # a tokenizer that cannot take the text
            return f"the prompt cannot be encoded ({ex})"
        return None

    def _fits(self, n: int, sp: SamplingParams) -> bool:
        """Whether the engine holds a prompt of n tokens generating sp.max_new_tokens (the length rule of
        Engine.check_request, without a prompt's ids)."""
        try:
            self.engine.check_fits(n, sp.max_new_tokens)
        except RequestError:
            return False
        return True

    def _template_tokens(self, chat: bool) -> int:
        if chat not in self._overhead:
            self._overhead[chat] = len(self.fmt.first(None, []) if chat else self.engine.tokenizer.encode(""))
        return self._overhead[chat]
