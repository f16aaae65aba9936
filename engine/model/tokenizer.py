"""Tokenizer for KV Scope: the `tokenizers` backend plus the HF tokenizer_config, without transformers.

Encodings and chat prompts must match transformers' AutoTokenizer token for token, because the
reference runs (tests, bench) use transformers and our engine must see the same ids.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _BackendTokenizer

# The named special tokens transformers passes to every chat template (its SPECIAL_TOKENS_ATTRIBUTES).
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_content(value: Any) -> str | None:
    # tokenizer_config stores special tokens either as plain strings or as serialized AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_chat_template(directory: str, config: dict[str, Any]) -> str | None:
    # transformers 5 saves the template as chat_template.jinja; older repos keep it in tokenizer_config.json,
    # sometimes as a list of named templates. The separate file wins, as in transformers.
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template if isinstance(template, str) else None


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (used by some templates to mark assistant text)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _compile_template(source: str) -> jinja2.Template:
    # Same environment options and globals as transformers' chat template renderer.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson HTML-escapes, which would change the prompt.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """tokenizer.json + tokenizer_config.json (+ chat_template.jinja) from a HF model directory."""

    def __init__(self, directory: str, extra_eos_token_ids: tuple[int, ...] = ()) -> None:
        """Raises OSError/ValueError on missing or malformed files; the loader turns them into ModelLoadError."""
        self._backend = _BackendTokenizer.from_file(os.path.join(directory, "tokenizer.json"))
        config_path = os.path.join(directory, "tokenizer_config.json")
        config: dict[str, Any] = {}
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        self.special_tokens: dict[str, str] = {
            name: content for name in _SPECIAL_TOKEN_NAMES if (content := _token_content(config.get(name)))
        }
        self.chat_template: str | None = _read_chat_template(directory, config)
        self._compiled: jinja2.Template | None = None
        self.bos_token_id: int | None = self._special_id("bos_token")
        eos = self._special_id("eos_token")
        # Generation stops on the model's eos ids (config/generation_config) as well as the tokenizer's.
        ids = [*extra_eos_token_ids, *([eos] if eos is not None else [])]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self._backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # transformers 5 ignores add_bos_token when tokenizer.json exists: its post_processor decides, as here.
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # No clean_up_tokenization: transformers 5 skips it for BPE models, which all supported families are.
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text exactly as transformers' apply_chat_template(tokenize=False) renders it."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template")
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template)
        # transformers drops None-valued keys (e.g. content=None) before rendering.
        cleaned = [{k: v for k, v in m.items() if v is not None} for m in messages]
        return self._compiled.render(
            messages=cleaned, tools=None, documents=None,
            add_generation_prompt=add_generation_prompt, **self.special_tokens,
        )

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        # The template already writes bos etc.; adding special tokens again would double them.
        return self.encode(self.render_chat_template(messages, add_generation_prompt), add_special_tokens=False)


class StreamDecoder:
    """Turns a stream of token ids into text chunks without splitting multi-byte characters."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._emitted = ""

    def push(self, token_id: int) -> str:
        """Returns the newly printable text; empty while a character is still incomplete."""
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip_special)
        if text.endswith("\ufffd"):
            return ""  # byte-fallback / byte-level pieces of a character still to come
        return self._take(text)

    def flush(self) -> str:
        """Whatever is still held back (e.g. a character cut off at end of generation)."""
        return self._take(self._tokenizer.decode(self._ids, skip_special_tokens=self._skip_special))

    def _take(self, text: str) -> str:
        # Decoding the full list keeps context-dependent pieces (leading-space rules) right.
        new = text[len(self._emitted):]
        self._emitted = text
        return new
