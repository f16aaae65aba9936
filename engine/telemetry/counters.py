"""The engine's running counters (engine/telemetry/snapshotter.py publishes them in snapshots and events)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Counters:
    steps: int = 0
    forward_s: float = 0.0
    bookkeeping_s: float = 0.0
    generated: int = 0
    prompt_tokens: int = 0
    prompt_reused: int = 0
    block_reads: int = 0  # blocks in the tables of scheduled sequences, per step
    block_misses: int = 0  # of those, blocks on the host tier when the step began
    read_tokens: int = 0  # keys attention read: each scheduled sequence's context, per step
    read_tokens_missed: int = 0  # of those, keys not read from the device tier without a copy: in blocks on the host
    # tier when the step began (promoted since, or read there) or written to the host tier
    read_tokens_streamed: int = 0  # of those, keys read from the host tier where they are (host_reads=stream, or no
    # room), or attended there with host_reads=compute
    # Why tokens missed (engine/kv/misses.py). Every admission of a sequence holding no blocks looks its tokens up in
    # the prefix cache (a first admission's are the prompt; after a preemption, what it had computed):
    lookup_tokens: int = 0  # tokens looked up
    lookup_served: int = 0  # of those, served from cached blocks; the rest have one reason each:
    miss_cold: int = 0  # no block with this chained hash was ever stored (or it was forgotten: the ledger's bound)
    miss_evicted: int = 0  # stored, then evicted
    miss_partial: int = 0  # in the block holding the last token: a block-size cost
    miss_diverged: int = 0  # never stored, but a block with the same parent was
    miss_reconfigured: int = 0  # stored, then dropped by a config change
    miss_preempted: int = 0  # computed before, dropped by a preemption
    # read_tokens_missed, by reason:
    read_miss_demoted_idle: int = 0  # promoted for the step; its block had been demoted for idling
    read_miss_capacity: int = 0  # promoted for the step; its block had gone to the host tier for room
    read_miss_promoted: int = 0  # promoted for the step; a re-lay or budget change had put its block there
    read_miss_streamed: int = 0  # read where it sits on the host tier
    streamed_bytes: int = 0  # bytes of host blocks copied as stored to the compute device's staging, a layer ahead
    promote_stall_s: float = 0.0  # seconds steps waited on copies of their blocks to the device tier
    evictions: int = 0
    promotions: int = 0
    demotions: int = 0
    promoted_bytes: int = 0
    demoted_bytes: int = 0
    preemptions: int = 0
    cow_copies: int = 0
    context_shifts: int = 0
    config_changes: int = 0
    # Shadow reference steps (engine/fidelity/shadow.py): one sequence's step recomputed with lossless KV.
    shadow_steps: int = 0
    shadow_flips: int = 0  # of those, steps whose top-1 token differed from the engine's
    shadow_kld_sum: float = 0.0  # KL(reference ‖ engine) summed over them, nats
    shadow_kld_max: float = 0.0
    shadow_logit_err_max: float = 0.0  # the largest |engine logit - reference logit| seen
    shadow_s: float = 0.0  # seconds spent computing them

    @property
    def device_hit_rate(self) -> float:
        """Share of the keys attention read straight from the device tier: in blocks that were there when their step
        began or were written there (nan: none read)."""
        return 1.0 - self.read_tokens_missed / self.read_tokens if self.read_tokens else float("nan")

    @property
    def prefix_hit_rate(self) -> float:
        """Share of prompt tokens served from the prefix cache (nan: no prompt yet)."""
        return self.prompt_reused / self.prompt_tokens if self.prompt_tokens else float("nan")

    def count_shadow(self, kld: float, flip: int, logit_err: float, cost_s: float) -> None:
        """One shadow step measured."""
        self.shadow_steps += 1
        self.shadow_flips += flip
        self.shadow_kld_sum += kld
        self.shadow_kld_max = max(self.shadow_kld_max, kld)
        self.shadow_logit_err_max = max(self.shadow_logit_err_max, logit_err)
        self.shadow_s += cost_s

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["device_hit_rate"] = self.device_hit_rate
        d["prefix_hit_rate"] = self.prefix_hit_rate
        return d
