"""Why a token missed: each prompt token the prefix cache did not serve, and each key attention read not straight
from the device tier, gets exactly one reason.

A pool keeps a `HashLedger`: what became of every chained hash it stored (stored when, removed when and why: evicted
by which policy at what occupancy, or dropped by a config change; re-stored). At each admission of a sequence holding
no blocks (a lookup of its tokens in the prefix cache), `explain_prompt` gives every token past the served prefix one
of PROMPT_REASONS:

- `partial`: in the block holding the last token (a tail never filled, or a full last block, which the cache never
  serves because the last token is always computed): what the block size costs;
- `preempted`: the sequence was admitted before and lost its K/V to preemption; it recomputes what the cache no
  longer gives;
- otherwise by the first block the lookup missed, from its hash's history: `evicted` (stored, then evicted),
  `reconfigured` (stored, then dropped by a config change: a re-lay, a budget change, a prefix-cache reset),
  `diverged` (never stored, but a block with the same parent was: a sibling shares the prefix up to here), `cold`
  (never stored). A later block whose own hash is still cached misses because of that first block and takes its
  reason; one that is not cached has its own.

Key reads (READ_REASONS) are explained by `Residency.make_resident` where it counts them: a key read where it sits on
the host tier by choice (host_reads stream or compute) is `streamed`; any other (promoted to the device for the
step, or read on the host for want of device room) is `demoted-idle` or `capacity` by why its block went to the
host (the per-slot `why` code: an idle demotion; or room: a device tier full at allocation, a demotion for room, an
eviction or a swap-out to the host), else `promoted` (put there by a re-lay or a budget change).
The counts add up exactly: prompt reasons to lookup tokens - lookup tokens served, read reasons to read_tokens_missed.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Callable, Iterator

PROMPT_REASONS = ("cold", "evicted", "partial", "diverged", "reconfigured", "preempted")
READ_REASONS = ("demoted-idle", "capacity", "promoted", "streamed")

# Per-slot host-placement cause (TierPool.why): why the block sits on the host tier.
WHY_NONE, WHY_IDLE, WHY_ROOM, WHY_OTHER = 0, 1, 2, 3
WHY_OF_MOVE = {"idle": WHY_IDLE, "room": WHY_ROOM, "evict": WHY_ROOM, "preempt": WHY_ROOM}
READ_REASON_OF_WHY = {WHY_IDLE: "demoted-idle", WHY_ROOM: "capacity", WHY_OTHER: "promoted", WHY_NONE: "promoted"}

# Per-slot removal cause of the hash's previous life (TierPool.gone_by), for the block map's hover.
GONE_NONE, GONE_EVICTED, GONE_RECONFIGURED = 0, 1, 2
GONE_NAMES = {GONE_NONE: "", GONE_EVICTED: "evicted", GONE_RECONFIGURED: "reconfigured"}

# The counters a window of time is counted over for the "why missed" chart (Telemetry's windowed figures).
WHY_FIELDS = ("lookup_tokens", "lookup_served", "read_tokens", "read_tokens_missed",
              *(f"{'read_miss' if r in READ_REASONS else 'miss'}_{r.replace('-', '_')}"
                for r in PROMPT_REASONS + READ_REASONS))

LEDGER_CAP = 1 << 16  # hashes remembered per pool (oldest forgotten first: a forgotten hash reads as never stored)


def counter_name(reason: str) -> str:
    """The Counters field of a reason: miss_cold, ..., read_miss_demoted_idle, ..."""
    base = reason.replace("-", "_")
    return f"read_miss_{base}" if reason in READ_REASONS else f"miss_{base}"


class HashLedger:
    """What became of each chained hash a pool stored. `removed[h]` = (t, cause, detail) of its last removal while it
    is not stored; `stores[h]` = how many times it was stored; `parents` = hashes some stored block had as parent.
    Bounded by LEDGER_CAP entries each (dicts keep insertion order: the oldest go first)."""

    def __init__(self, cap: int = LEDGER_CAP):
        self.cap = cap
        self.removed: dict[int, tuple[float, str, dict]] = {}
        self.stores: dict[int, int] = {}
        self.parents: dict[int, None] = {}
        self._cause: str | None = None

    @contextmanager
    def cause(self, name: str) -> Iterator[None]:
        """Within: removals (evictions included) are recorded as `name` (a config change's, "reconfigured")."""
        old, self._cause = self._cause, name
        try:
            yield
        finally:
            self._cause = old

    def _bound(self, d: dict) -> None:
        while len(d) > self.cap:
            del d[next(iter(d))]

    def stored(self, h: int, parent: int) -> tuple[int, float, int]:
        """A block with hash h was stored: (times stored before, when it was last removed (nan), why (GONE_*))."""
        before = self.stores.pop(h, 0)
        self.stores[h] = before + 1
        self._bound(self.stores)
        self.parents.pop(parent, None)
        self.parents[parent] = None
        self._bound(self.parents)
        gone = self.removed.pop(h, None)
        if gone is None:
            return before, float("nan"), GONE_NONE
        return before, gone[0], GONE_EVICTED if gone[1] == "evicted" else GONE_RECONFIGURED

    def gone(self, h: int, now: float, cause: str, **detail) -> None:
        """The block with hash h left the pool (cause "evicted" or "reconfigured"; a config change in progress
        overrides it)."""
        cause = self._cause or cause
        self.removed.pop(h, None)
        self.removed[h] = (now, cause, detail)
        self._bound(self.removed)

    def classify(self, h: int, parent: int, cached: Callable[[int], bool]) -> str:
        """"cached" if a block with hash h is in the pool now; else its removal's cause; else "diverged" (a sibling
        after the same non-empty prefix was stored) or "cold"."""
        if cached(h):
            return "cached"
        gone = self.removed.get(h)
        if gone is not None:
            return gone[1]
        return "diverged" if parent and parent in self.parents else "cold"  # no sibling shares an empty prefix

    def detail(self, h: int, now: float) -> dict:
        """What a lookup event says of a missed block's hash: how long ago it left and, evicted, by which policy at
        what occupancy of which tier; {} if it is not recorded as removed."""
        gone = self.removed.get(h)
        if gone is None:
            return {}
        out = {"gone_s_ago": round(now - gone[0], 3)}
        for k, v in gone[2].items():
            out[k] = round(v, 3) if isinstance(v, float) else v
        return out

    def history(self, h: int) -> dict:
        """For a block's hover: times stored, and the last removal (t, cause, detail) while not stored."""
        gone = self.removed.get(h)
        return {"stores": self.stores.get(h, 0), "removed": None if gone is None else
                {"t": gone[0], "cause": gone[1], **gone[2]}}

    def carry(self, other: "HashLedger") -> None:
        """Take another ledger's memory (a re-laid pool keeps its old pool's ledger)."""
        self.removed, self.stores, self.parents = other.removed, other.stores, other.parents


def explain_prompt(n_tokens: int, served: int, bs: int, reusable: int, readmitted: bool,
                   block_reason: Callable[[int], str], blocks_cached: Callable[[int], bool],
                   group_of: Callable[[int], int] | None = None, split: dict | None = None) -> Counter:
    """Reasons (token counts) for the n_tokens - served tokens a lookup did not serve (see the module docstring).

    `reusable`: blocks a cached prefix may give (full blocks before the last token, positions canonical);
    `readmitted`: the sequence was admitted before (what it misses it had computed: preempted); `block_reason(b)`:
    the reason of block b from its hash's history; `blocks_cached(b)`: whether block b's hash is cached now. (Only a
    readmitted sequence can be past the context limit, where fewer blocks are looked up: a prompt is not.)
    KV-cache groups: `group_of(b)` is the group whose missing block gave block b's reason; `split` then gets each
    group's share ({group: Counter}); partial and preempted belong to the sequence, not to a group, and are not split."""
    out: Counter = Counter()
    missed = n_tokens - served
    if missed <= 0:
        return out
    if readmitted:
        out["preempted"] = missed
        return out
    m = served // bs
    first = None
    for b in range(m, max(reusable, m)):
        if first is None:
            first = block_reason(b)
            reason, src = first, b
        elif blocks_cached(b):
            reason, src = first, m
        else:
            reason, src = block_reason(b), b
        out[reason] += bs
        if split is not None and group_of is not None:
            split.setdefault(group_of(src), Counter())[reason] += bs
    out["partial"] += missed - sum(out.values())
    return out


def summary(counters) -> dict:
    """The reasons from a Counters (or its as_dict()): lookups, prompt reasons, key-read reasons (JSON-ready)."""
    get = counters.get if isinstance(counters, dict) else (lambda k, d=0: getattr(counters, k, d))
    looked, served = get("lookup_tokens", 0), get("lookup_served", 0)
    return {"lookup_tokens": looked, "lookup_missed": looked - served,
            "prompt": {r: get(counter_name(r), 0) for r in PROMPT_REASONS},
            "read_tokens_missed": get("read_tokens_missed", 0),
            "reads": {r: get(counter_name(r), 0) for r in READ_REASONS}}


def group_summary(prompt: dict[str, int], counters) -> dict[str, int]:
    """A KV-cache group's reasons (JSON-ready, zeros left out): the prompt tokens whose miss this group's missing
    block caused (`prompt`, {reason: tokens}), and its own key reads' reasons (from its GroupCounters)."""
    out = {r: int(prompt.get(r, 0)) for r in PROMPT_REASONS if prompt.get(r, 0)}
    for r in READ_REASONS:
        n = int(getattr(counters, counter_name(r), 0))
        if n:
            out[r] = n
    return out


def unaccounted(counters, groups: list[dict[str, int]] | None = None) -> list[str]:
    """Where the reasons do not add up to the misses (empty: they do): prompt reasons to lookup tokens - served, key
    read reasons to read_tokens_missed, and with KV-cache groups (each group's group_summary) the groups' reasons
    plus the sequence-wide ones (partial, preempted) to the engine's. For checks that run while the engine does
    (the reconfiguration storm)."""
    s = summary(counters)
    out = []
    if sum(s["prompt"].values()) != s["lookup_missed"]:
        out.append(f"prompt reasons {sum(s['prompt'].values()):,} != {s['lookup_missed']:,} prompt tokens missed")
    if sum(s["reads"].values()) != s["read_tokens_missed"]:
        out.append(f"key read reasons {sum(s['reads'].values()):,} != {s['read_tokens_missed']:,} keys missed")
    if groups:
        whole = {**s["prompt"], **s["reads"]}
        summed = {r: whole[r] for r in ("partial", "preempted")}
        for g in groups:
            for r, n in g.items():
                summed[r] = summed.get(r, 0) + n
        wrong = {r: (summed.get(r, 0), n) for r, n in whole.items() if summed.get(r, 0) != n}
        if wrong:
            out.append("groups' reasons differ from the engine's: " +
                       ", ".join(f"{r} {a:,} vs {b:,}" for r, (a, b) in wrong.items()))
    return out


def seq_summary(why: dict[str, int]) -> dict:
    """A sequence's why_missed as summary() lays reasons out: {"prompt": {...}, "reads": {...}}, every reason."""
    return {"prompt": {r: why.get(r, 0) for r in PROMPT_REASONS}, "reads": {r: why.get(r, 0) for r in READ_REASONS}}


def top(reasons: dict[str, int], n: int = 2) -> str:
    """The n largest reasons as shares of their sum ("evicted 62%, cold 30%"); "-" when nothing missed."""
    total = sum(reasons.values())
    if not total:
        return "-"
    best = sorted(((v, k) for k, v in reasons.items() if v), reverse=True)[:n]
    return ", ".join(f"{k} {100 * v / total:.0f}%" for v, k in best)
