"""`ChatFormat`: token ids of chat turns built from a tokenizer's chat template (or a plain-text fallback)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jinja2 import TemplateError

if TYPE_CHECKING:
    from engine.model.tokenizer import Tokenizer

class ChatFormat:
    """Token ids of chat turns, from the tokenizer's chat template, built around pre-tokenized bodies so a
    message can be cut to fit a token budget. Falls back to a plain "User:/Assistant:" text format when the
    tokenizer has no usable template."""

    _S, _U, _A, _V = "\x1eSYS\x1e", "\x1eUSER\x1e", "\x1eREPLY\x1e", "\x1eNEXT\x1e"

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.templated = False
        try:
            self._with_system = tokenizer.render_chat_template(
                [{"role": "system", "content": self._S}, {"role": "user", "content": self._U}]).split(self._U)
            self._without_system = tokenizer.render_chat_template(
                [{"role": "user", "content": self._U}]).split(self._U)
            probe = [{"role": "user", "content": self._U}, {"role": "assistant", "content": self._A}]
            closed = tokenizer.render_chat_template(probe, add_generation_prompt=False)
            nxt = tokenizer.render_chat_template(probe + [{"role": "user", "content": self._V}])
            opening = nxt[len(closed):].split(self._V)
            self._close = closed.split(self._A)[-1]
            self._open = opening
            self.templated = (nxt.startswith(closed) and len(opening) == 2 and len(self._with_system) == 2
                              and self._S in self._with_system[0] and len(self._without_system) == 2)
        except (ValueError, TemplateError):
            pass

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def first(self, system: str | None, body: list[int]) -> list[int]:
        """A conversation's first prompt: optional system prompt, one user message, the assistant cue."""
        if not self.templated:
            head = f"{system}\n\nUser: " if system else "User: "
            return self.tokenizer.encode(head) + body + self.encode("\nAssistant:")
        if system is None:
            pre, post = self._without_system
        else:
            pre, post = self._with_system[0].replace(self._S, system), self._with_system[1]
        return self.encode(pre) + body + self.encode(post)

    def next_turn(self, body: list[int], ended_with: int | None = None) -> list[int]:
        """A later user turn appended to a conversation whose reply just stopped: cut short, or ended with the
        end-of-turn token `ended_with` (then the template's closing text does not repeat it)."""
        if not self.templated:
            return self.encode("\nUser: ") + body + self.encode("\nAssistant:")
        close = self._close
        if ended_with is not None:
            text = self.tokenizer.decode([ended_with], skip_special_tokens=False)
            if text and close.startswith(text):
                close = close[len(text):]
        return self.encode(close + self._open[0]) + body + self.encode(self._open[1])
