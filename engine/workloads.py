"""Workloads that keep the cache busy: seedable request generators, JSONL traces, and the live demo driver.

The generators return plain `Request` lists (no engine, no tokenizer needed) whose prompts come from a
small built-in corpus, so a seed fully decides the text. `DemoWorkload` drives a live `Engine` from the
engine thread: chat users sharing a system prompt, users who go idle past `demote_after_s` and come back,
long documents, a forked request and one long chat that reaches the context limit.

This module does not import torch at load time (the engine classes it drives arrive as objects), so
trace tools can use the generators cheaply.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

from jinja2 import TemplateError

from engine.sequence import SamplingParams, SeqState, Sequence

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.tokenizer import Tokenizer

# -- corpus -----------------------------------------------------------------------------------

SYSTEM_SENTENCES: tuple[str, ...] = (
    "You are Quill, the assistant of a small public library in a harbour town.",
    "You answer questions from visitors about books, local history, science and everyday practical matters.",
    "Keep every answer short, friendly and concrete, and prefer plain words over jargon.",
    "When a question is ambiguous, say which reading you chose before you answer it.",
    "If you do not know something, say so plainly and suggest where in the library the visitor could look.",
    "Never invent titles, authors, dates or quotations; it is better to admit a gap than to guess.",
    "The library opens at nine in the morning and closes at six in the evening, except on Sundays.",
    "Its reading room faces the harbour, its archive keeps ship logs from the last two centuries, "
    "and its workshop lends tools as well as books.",
    "Visitors range from school children doing homework to retired sailors tracing old voyages.",
    "Adapt the depth of an answer to the visitor: one example is often worth more than three definitions.",
    "Use metric units, and give both the metric and the imperial value when a visitor uses imperial units.",
    "When you list steps, number them, and keep each step to a single sentence.",
    "Do not give medical, legal or financial advice beyond pointing to the right kind of professional.",
    "End an answer with a question only when you really need more information to help.",
)
DEFAULT_SYSTEM_PROMPT = " ".join(SYSTEM_SENTENCES)

SENTENCES: tuple[str, ...] = (
    "The tide in the harbour rises twice a day, and the fishing boats leave an hour before high water.",
    "Sourdough bread rises slowly because wild yeast works more gently than the yeast sold in packets.",
    "A glacier moves only a few centimetres a day, yet over centuries it can carve a whole valley.",
    "Honey bees tell each other where flowers are by dancing in a figure of eight inside the hive.",
    "The old lighthouse keeper wrote the weather into his log every four hours for thirty-one years.",
    "A violin's top plate is usually spruce, chosen because it is light and stiff along the grain.",
    "Compilers turn source code into machine instructions, and good ones reorder work to keep the processor busy.",
    "Cast iron pans hold heat well, which is why they sear meat better than thin aluminium ones.",
    "Night trains were popular again after travellers noticed how much time a sleeping berth saves.",
    "Chess openings have names like the Sicilian Defence and the Queen's Gambit that go back centuries.",
    "A suspension bridge hangs its deck from cables that pass over tall towers and anchor in the ground.",
    "Moss grows on the shady side of trees and walls, where the surface stays damp for longest.",
    "The first public libraries lent books for free so that workers could study in the evenings.",
    "Salt marshes protect the coast by slowing waves down before they reach the dunes.",
    "A cache keeps recently used data close at hand so the next request does not have to fetch it again.",
    "Paper made from cotton rags lasts far longer than paper made from wood pulp.",
    "Swallows fly thousands of kilometres south each autumn and often return to the same barn in spring.",
    "The town's clock tower was rebuilt after a storm in the winter of the great flood.",
    "Fermenting cabbage with salt produces sauerkraut, which keeps for months in a cool cellar.",
    "Old maps often show sea monsters in the empty corners where the mapmakers had no information.",
    "Tomatoes ripen faster next to bananas because bananas release a gas called ethylene.",
    "A well-tuned bicycle chain needs a drop of oil on each link and a wipe to remove the excess.",
    "Telescopes gather light with a large lens or mirror, so a wider one shows fainter stars.",
    "The market square fills with stalls on Saturdays, selling cheese, apples, rope and second-hand books.",
    "Knots used by sailors, like the bowline, are chosen because they hold well and untie easily.",
    "Rain gauges are simple cylinders, but they must stand away from walls and trees to read correctly.",
    "A sonnet has fourteen lines, and its turn of thought usually comes after the eighth line.",
    "Beeswax candles burn longer and cleaner than paraffin ones, though they cost more.",
    "The ferry to the island runs every two hours in summer and twice a day in winter.",
    "Learning a language is easier with short daily practice than with one long session a week.",
    "A compass needle points to magnetic north, which drifts slowly away from the geographic pole.",
    "Clay pots keep water cool because a little of it seeps through and evaporates from the surface.",
    "The museum's oldest exhibit is a carved wooden anchor pulled from the mud during dredging.",
    "Wind turbines turn their blades to face the wind and stop themselves when gusts become too strong.",
    "A good index at the back of a book saves the reader more time than any table of contents.",
    "Seaweed was once burned to make soda ash, which glassmakers needed to melt sand.",
    "In a relay race the baton must be passed inside a marked zone, or the team is disqualified.",
    "Owls can turn their heads much further than people because their necks have twice as many bones.",
    "Printing presses spread quickly because one press could do in a day what a scribe did in a year.",
    "Frost forms on clear nights because heat escapes into the open sky without clouds to hold it in.",
)

TOPICS: tuple[str, ...] = (
    "the tides", "sourdough starters", "glaciers", "bee dances", "lighthouses", "violin making", "compilers",
    "cast iron cooking", "night trains", "chess openings", "suspension bridges", "salt marshes",
    "paper making", "bird migration", "fermentation", "old sea charts", "ripening fruit", "bicycle repair",
    "telescopes", "sailors' knots", "rain gauges", "sonnets", "candle making", "magnetic compasses",
    "wind turbines", "book indexes", "glass making", "owls", "printing presses", "frost",
)

QUESTIONS: tuple[str, ...] = (
    "Can you explain how {topic} work, in simple words?",
    "What is the most surprising fact you know about {topic}?",
    "I am writing a school report on {topic}. Where should I start?",
    "Could you give me three quick tips about {topic}?",
    "What did people get wrong about {topic} a hundred years ago?",
    "Which books in the library would help me understand {topic}?",
    "Why do so many visitors ask about {topic}?",
    "How would you describe {topic} to a seven year old?",
    "What is one small experiment I can do at home about {topic}?",
    "Is there a connection between {topic} and the harbour town?",
)

FOLLOW_UPS: tuple[str, ...] = (
    "Thanks. Can you say a bit more about the second point?",
    "That helps. Is there a simpler example?",
    "I see. What would you read first, if you had only one evening?",
    "Interesting. How does that compare with {topic}?",
    "Could you sum that up in one sentence?",
    "And what is a common mistake people make with {topic}?",
    "Good. Can you suggest a question I could ask the librarian about {topic}?",
)

STORIES: tuple[str, ...] = (
    "A retired sailor finds a ship's log in the library archive that ends in the middle of a sentence.",
    "Two children borrow a telescope from the workshop and see a light on the island where nobody lives.",
    "The lighthouse keeper's cat goes missing on the night of the first winter storm.",
    "A baker discovers that her grandmother's sourdough starter is older than the town's clock tower.",
    "A visitor returns a book forty years late, with a pressed flower and a map tucked inside.",
    "The ferry is cancelled, and six strangers spend the evening in the library reading room.",
)

NAMES: tuple[str, ...] = ("Ada", "Bram", "Cleo", "Dev", "Esme", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kiri",
                          "Lev", "Mina", "Nils", "Oona", "Pavel")

KINDS: tuple[str, ...] = ("chat", "turn", "document", "nbest", "fork")
_WORDS_TO_TOKENS = 1.2  # corpus tokens per whitespace word (measured on the default model's tokenizer)
_SECONDS_PER_TOKEN = 0.05  # a trace's guess of decode time, so a next turn arrives after the reply


def _question(rng: random.Random) -> str:
    return rng.choice(QUESTIONS).format(topic=rng.choice(TOPICS))


def _message(rng: random.Random, context_sentences: int) -> str:
    """A user message: a few corpus sentences of context, then a question."""
    context = rng.sample(SENTENCES, context_sentences)
    return " ".join([*context, _question(rng)])


def _follow_up(rng: random.Random) -> str:
    return rng.choice(FOLLOW_UPS).format(topic=rng.choice(TOPICS))


def _passage(rng: random.Random, n_words: int) -> str:
    """Paragraphs of corpus sentences (each used once before any repeats) with at least n_words words."""
    sentences: list[str] = []
    order: list[str] = []
    words = 0
    while words < n_words:
        if not order:
            order = rng.sample(SENTENCES, len(SENTENCES))
        sentences.append(order.pop())
        words += len(sentences[-1].split())
    paragraphs = []
    while sentences:
        k = rng.randint(3, 6)
        paragraphs.append(" ".join(sentences[:k]))
        sentences = sentences[k:]
    return "\n\n".join(paragraphs)


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

    def __post_init__(self) -> None:
        if not (isinstance(self.arrival_s, (int, float)) and math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise ValueError(f"arrival_s must be a finite number >= 0, got {self.arrival_s!r}")
        if not self.session:
            raise ValueError("session must be a non-empty string")
        if (self.prompt is None) == (self.prompt_tokens is None):
            raise ValueError("give exactly one of prompt and prompt_tokens")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt is empty")
        if self.prompt_tokens is not None and (not self.prompt_tokens or any(t < 0 for t in self.prompt_tokens)):
            raise ValueError("prompt_tokens must be a non-empty list of token ids >= 0")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.kind not in KINDS:
            raise ValueError(f"kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.n_forks < 0:
            raise ValueError(f"n_forks must be >= 0, got {self.n_forks}")


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


def load_trace(path: str | os.PathLike[str]) -> list[Request]:
    """Requests of a JSONL trace, sorted by arrival; a bad line raises ValueError("PATH:LINE: problem")."""
    out: list[Request] = []
    sessions: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                req = _parse_line(json.loads(line), sessions)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
            sessions.add(req.session)
            out.append(req)
    return _sorted(out)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_line(obj: object, sessions: set[str]) -> Request:
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
        raise ValueError(f"arrival_s must be a number, got {arrival!r}")
    for key in ("session", "prompt", "kind", "fork_of"):
        if key in obj and not isinstance(obj[key], str):
            raise ValueError(f"{key} must be a string, got {obj[key]!r}")
    tokens = obj.get("prompt_tokens")
    if tokens is not None and not (isinstance(tokens, list) and all(_is_int(t) for t in tokens)):
        raise ValueError("prompt_tokens must be a list of integer token ids")
    for key in ("max_new_tokens", "n_forks"):
        if key in obj and not _is_int(obj[key]):
            raise ValueError(f"{key} must be an integer, got {obj[key]!r}")
    fork_of = obj.get("fork_of")
    if fork_of is not None and fork_of not in sessions:
        raise ValueError(f"fork_of {fork_of!r} names no session on an earlier line")
    return Request(float(arrival), obj["session"], obj.get("prompt"), tokens, obj["max_new_tokens"],
                   obj.get("kind", "chat"), fork_of, obj.get("n_forks", 0))


# -- chat formatting ----------------------------------------------------------------------------

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


# -- the live demo ------------------------------------------------------------------------------

MAX_LIVE = 8  # live sequences (paused ones included) the demo keeps at most
INTENSITY_RANGE = (0.1, 3.0)


def check_intensity(value: object) -> float:
    """A workload intensity as float, or ValueError naming the range."""
    lo, hi = INTENSITY_RANGE
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (lo <= value <= hi):
        raise ValueError(f"intensity: {value!r} is outside [{lo:g}, {hi:g}]")
    return float(value)
_RATES = {"chat": 1 / 6, "document": 1 / 30, "nbest": 1 / 20, "long_chat": 1 / 15}  # arrivals per second at 1.0
# The opening minute is scripted so that every phenomenon shows within ~20 s: (seconds from start, kind).
_OPENING = ((0.0, "chat"), (0.0, "long_chat"), (0.6, "chat"), (1.2, "nbest"), (1.8, "chat"), (3.0, "document"))
_STEADY_AFTER_S = 10.0  # intensity-seconds before the random arrival streams start
_HEADROOM = 8  # extra max_new_tokens beyond a turn, so the engine never finishes a session on its own
_DOC_TOKENS = 320
_FORK_AFTER = 4  # tokens an nbest request generates before it is forked
_LONG_CHAT_SHIFTS = 2  # the long chat ends after this many context shifts
_STAT_OF = {"chat": "chats", "long_chat": "long_chats", "document": "documents", "nbest": "nbest"}
_REFUSED = object()  # what _call returns when the engine refuses a request


@dataclass
class _Session:
    kind: str  # "chat" | "long_chat" | "document" | "nbest" | "fork"
    sid: int
    turn_start: int = 0  # len(output) when the current turn began
    turn_len: int = 0  # tokens this turn generates before the user speaks again
    turns_left: int = 0  # user turns still to come
    return_at: float | None = None  # while paused: when the user comes back
    long_idle: bool = False  # the current idle is longer than demote_after_s
    idles: int = 0
    forked: bool = False
    shifts: int = 0  # seq.shifts already counted


class DemoWorkload:
    """A live, deterministic mix of requests that keeps the cache busy; call `tick(now)` on the engine thread
    before each step. `intensity`, `paused` and `stats()` may be used from other threads."""

    def __init__(self, engine: Engine, seed: int = 0, intensity: float = 1.0) -> None:
        self.engine = engine
        self.paused = False
        self._intensity = 1.0
        self.set_intensity(intensity)
        self._rng = random.Random(f"demo:{seed}")
        self._fmt = ChatFormat(engine.tokenizer)
        self._sessions: dict[int, _Session] = {}
        self._t0: float | None = None
        self._last = 0.0
        self._opening = list(_OPENING)
        self._countdown = {k: _STEADY_AFTER_S + self._rng.expovariate(r) for k, r in _RATES.items()}
        self._serial = {k: 0 for k in ("chat", "long_chat", "document", "nbest")}
        # Every key exists from the start, so stats() can copy the dict from another thread safely.
        self._stats = {k: 0 for k in ("requests", "chats", "long_chats", "documents", "nbest", "forks", "turns",
                                      "returns", "shifts", "ended", "refused")}
        self._system = self._fit_system(max(16, min(160, engine.context_limit // 4)))

    # -- knobs ----------------------------------------------------------------------------------
    @property
    def intensity(self) -> float:
        return self._intensity

    @intensity.setter
    def intensity(self, value: float) -> None:
        self.set_intensity(value)

    def set_intensity(self, value: float) -> None:
        self._intensity = check_intensity(value)

    def stats(self) -> dict[str, int]:
        out = dict(self._stats)
        out["live"] = len(self._sessions)
        return out

    name = "demo"

    def observe(self, outs) -> None:
        """Called with each step's tokens; the demo tends its sessions from the engine's state in tick()."""

    def close(self) -> None:
        """End every session (cancel its sequence): the workload is being replaced."""
        for s in list(self._sessions.values()):
            self._end(s)

    # -- the tick -------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        if self._t0 is None:
            self._t0 = self._last = now
        dt = max(0.0, now - self._last)
        self._last = now
        for session in list(self._sessions.values()):
            self._tend(session, now)
        if not self.paused:
            self._arrivals(now - self._t0, dt)

    def _live(self) -> int:
        return sum(1 for s in self.engine.seqs.values() if not s.done)

    def _arrivals(self, elapsed: float, dt: float) -> None:
        while self._opening and self._opening[0][0] <= elapsed and self._start(self._opening[0][1]):
            self._opening.pop(0)
        for kind, rate in _RATES.items():
            if kind == "long_chat" and any(s.kind == "long_chat" for s in self._sessions.values()):
                continue  # one long chat at a time; its clock waits meanwhile
            self._countdown[kind] -= dt * self._intensity
            if self._countdown[kind] <= 0 and self._start(kind):
                self._countdown[kind] = self._rng.expovariate(rate)

    def _start(self, kind: str) -> bool:
        """Start a session of this kind; False when there is no room now (the arrival waits)."""
        if self._live() + (2 if kind == "nbest" else 1) > MAX_LIVE:
            return False
        self._serial[kind] += 1
        ids, sampling, turn_len, turns_left = self._first_prompt(kind)
        label = f"{kind.replace('_', '-')}-{self._serial[kind]}"
        sid = self._call(lambda: self.engine.add_request(ids, sampling, label=label))
        if sid is _REFUSED:
            return True  # counted; the arrival is spent
        self._sessions[sid] = _Session(kind, sid, turn_len=turn_len, turns_left=turns_left)
        self._stats["requests"] += 1
        self._stats[_STAT_OF[kind]] += 1
        return True

    def _first_prompt(self, kind: str) -> tuple[list[int], SamplingParams, int, int]:
        """Prompt ids, sampling, first turn length and follow-up turns of a new session."""
        rng, fmt, limit = self._rng, self._fmt, self.engine.context_limit
        if kind == "document":
            n_body = max(8, min(_DOC_TOKENS, limit - 24 - len(fmt.first(None, []))))
            body = fmt.encode("Summarize this document in three sentences.\n\n" + _passage(rng, n_body))[:n_body]
            return fmt.first(None, body), SamplingParams(max_new_tokens=16), 0, 0
        if kind == "nbest":
            body = fmt.encode(f"{rng.choice(STORIES)}\n\nWrite an ending for this story.")
            # Plain temperature sampling: a top-p cut sorts the whole vocabulary at every step, which costs
            # more than the model's forward on CPU.
            sampling = SamplingParams(max_new_tokens=rng.randint(24, 32), temperature=0.8, seed=rng.randrange(2**31))
            return fmt.first(self._system, body), sampling, 0, 0
        if kind == "chat":
            ids = fmt.first(self._system, fmt.encode(_message(rng, rng.randint(0, 2) if limit >= 384 else 0)))
            turns_left = rng.randint(1, 3)
        else:  # long_chat: a first turn of about a third of the context, so that the next turns reach the limit
            question = fmt.encode(" " + _question(rng))
            room = limit - 1 - len(fmt.first(self._system, question))
            ids = fmt.first(self._system, fmt.encode(_passage(rng, limit // 2))[:max(0, min(room, limit // 3))]
                            + question)
            turns_left = 12
        turn_len = self._turn_len(kind)
        # Sessions ignore EOS and are paused by _tend at the end of each turn (at EOS or turn_len), so the
        # engine never finishes them and their blocks stay for the next turn.
        return ids, SamplingParams(max_new_tokens=turn_len + _HEADROOM, ignore_eos=True), turn_len, turns_left

    def _call(self, fn: Callable[[], Any]) -> Any:
        """fn(), or _REFUSED when the engine refuses it (counted)."""
        from engine.engine import RequestError  # lazy: keeps torch out of this module's import

        try:
            return fn()
        except RequestError:
            self._stats["refused"] += 1
            return _REFUSED

    def _turn_len(self, kind: str) -> int:
        if kind == "long_chat":
            return self._rng.randint(16, 24)
        return min(self._rng.randint(16, 32), max(8, self.engine.context_limit // 8))

    def _tend(self, s: _Session, now: float) -> None:
        seq = self.engine.seqs.get(s.sid)
        if seq is not None and seq.shifts > s.shifts:
            self._stats["shifts"] += seq.shifts - s.shifts
            s.shifts = seq.shifts
        if seq is None or seq.done:
            del self._sessions[s.sid]
            return
        if seq.state == SeqState.PAUSED:
            if s.return_at is not None and now >= s.return_at and not self.paused:
                self._next_turn(s, seq)
            return
        produced = len(seq.output) - s.turn_start
        if s.kind == "nbest" and not s.forked and produced >= _FORK_AFTER and not self.paused:
            self._fork(s, seq)
        if s.kind in ("chat", "long_chat") and produced > 0 and (
                produced >= s.turn_len or seq.output[-1] in self.engine.eos):
            self._end_turn(s, seq, now)

    def _fork(self, s: _Session, seq: Sequence) -> None:
        if seq.state != SeqState.RUNNING or self._live() >= MAX_LIVE:
            return
        s.forked = True
        sampling = SamplingParams(max_new_tokens=seq.sampling.max_new_tokens, temperature=0.8,
                                  seed=self._rng.randrange(2**31))
        sid = self._call(lambda: self.engine.seq_cp(s.sid, sampling, label=f"{seq.label}/fork"))
        if sid is not _REFUSED:
            self._sessions[sid] = _Session("fork", sid)
            self._stats["forks"] += 1

    def _end_turn(self, s: _Session, seq: Sequence, now: float) -> None:
        if s.turns_left <= 0 or (s.kind == "long_chat" and seq.shifts >= _LONG_CHAT_SHIFTS):
            self._end(s)
            return
        self.engine.pause(s.sid)
        demote = self.engine.config.demote_after_s
        s.long_idle = s.kind == "chat" and (s.idles == 0 or self._rng.random() < 0.5)
        if s.long_idle:
            gap = min(demote * self._rng.uniform(1.2, 1.6) + 0.5, 120.0)
        elif s.kind == "chat":
            gap = self._rng.uniform(0.5, 2.5)
        else:
            gap = self._rng.uniform(0.2, 1.0)
        s.idles += 1
        s.return_at = now + gap

    def _next_turn(self, s: _Session, seq: Sequence) -> None:
        fmt, limit = self._fmt, self.engine.context_limit
        ended_with = seq.output[-1] if seq.output and seq.output[-1] in self.engine.eos else None
        turn_len = self._turn_len(s.kind)
        if s.kind == "chat":
            ext = fmt.next_turn(fmt.encode(_follow_up(self._rng)), ended_with)
            if len(seq.tokens) + len(ext) + turn_len + _HEADROOM > limit:
                self._end(s)  # a short chat never shifts; the long chat is there for that
                return
        else:
            # Long user turns push the long chat past the context limit; the engine then shifts it.
            room = limit - len(seq.tokens) - len(fmt.next_turn([], ended_with))
            if room >= 4:
                ext = fmt.next_turn(fmt.encode(_passage(self._rng, limit // 2))[:min(room, limit // 3)], ended_with)
            elif len(seq.tokens) <= limit:
                ext = []  # no room for a user turn: the assistant goes on, past the limit
            else:  # it stopped just past the limit, before the engine could shift it; extend would refuse
                self._end(s)
                return
        if self._call(lambda: self.engine.extend(s.sid, ext, turn_len + _HEADROOM)) is _REFUSED:
            self._end(s)
            return
        s.turn_start, s.turn_len = len(seq.output), turn_len
        s.turns_left -= 1
        s.return_at = None
        self._stats["turns"] += 1
        if s.long_idle:
            self._stats["returns"] += 1

    def _end(self, s: _Session) -> None:
        self._sessions.pop(s.sid, None)
        seq = self.engine.seqs.get(s.sid)
        if seq is not None and not seq.done:
            self.engine.cancel(s.sid)
        self._stats["ended"] += 1

    def _fit_system(self, n_tokens: int) -> str:
        """The longest whole-sentence prefix of the system prompt within n_tokens (at least one sentence)."""
        text = SYSTEM_SENTENCES[0]
        for k in range(2, len(SYSTEM_SENTENCES) + 1):
            cand = " ".join(SYSTEM_SENTENCES[:k])
            if len(self._fmt.encode(cand)) > n_tokens:
                break
            text = cand
        return text
