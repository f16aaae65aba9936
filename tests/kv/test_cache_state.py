"""Random operations on a live engine; the cache's invariants must hold after every one."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from engine.config import CacheConfig, ConfigError, EngineOptions
from engine.runtime.engine import Engine, RequestError
from engine.sequence import SamplingParams, SeqState
from engine.kv.tiers import Tier


def make_machine(model):
    class CacheMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.now = 0.0
            self.engine = Engine(model, CacheConfig(block_size=4, device_budget_mb=0.03, host_budget_mb=0.06),
                                 EngineOptions(max_batched_tokens=48, context_limit=96, n_keep=2),
                                 clock=lambda: self.now)

        def live(self) -> list[int]:
            return [s.id for s in self.engine.seqs.values() if not s.done]

        @rule(n=st.integers(1, 40), new=st.integers(1, 12), seed=st.integers(0, 3))
        def add(self, n, new, seed):
            rng = np.random.default_rng(seed)  # few seeds: prompts often share prefixes
            ids = rng.integers(3, 1000, size=n).tolist()
            try:
                self.engine.add_request(ids, SamplingParams(max_new_tokens=new, ignore_eos=True))
            except RequestError:
                pass
            self.engine.step()  # keep the engine moving: most interesting states need running sequences

        @rule(steps=st.integers(1, 4), dt=st.floats(0.0, 3.0))
        def append(self, steps, dt):
            for _ in range(steps):
                self.now += dt
                self.engine.step()

        @precondition(lambda self: self.live())
        @rule(data=st.data())
        def fork(self, data):
            sid = data.draw(st.sampled_from(self.live()))
            self.engine.seq_cp(sid)

        @precondition(lambda self: self.live())
        @rule(data=st.data(), frac=st.floats(0.1, 0.9))
        def remove(self, data, frac):
            sid = data.draw(st.sampled_from(self.live()))
            seq = self.engine.seqs[sid]
            if seq.num_cached < 2 or seq.pending:
                return
            cut = max(1, int(seq.num_cached * frac))
            try:
                self.engine.seq_rm(sid, seq.pos[cut], None)
            except RequestError:  # both tiers full: refused, and the invariant check shows nothing changed
                return
            self.engine.extend(sid, [seq.output[-1] if seq.output else 5], 2)

        @precondition(lambda self: self.live())
        @rule(data=st.data(), delta=st.integers(-5, 5))
        def shift(self, data, delta):
            sid = data.draw(st.sampled_from(self.live()))
            seq = self.engine.seqs[sid]
            if len(seq.pos) > 4 and min(seq.pos[2:]) + delta >= 2:
                try:
                    self.engine.seq_add(sid, seq.pos[2], None, delta)
                except RequestError:  # both tiers full: refused, and the invariant check shows nothing changed
                    pass

        @rule(n=st.integers(1, 8))
        def evict(self, n):
            self.engine.pool.evict(Tier.DEVICE, n, self.now)

        @precondition(lambda self: self.live())
        @rule(data=st.data(), to_host=st.booleans())
        def migrate(self, data, to_host):
            sid = data.draw(st.sampled_from(self.live()))
            lids = np.asarray(self.engine.seqs[sid].blocks, dtype=np.int64)
            if len(lids):
                self.engine.pool.move(lids, Tier.HOST if to_host else Tier.DEVICE, self.now, reason="test")

        @precondition(lambda self: self.live())
        @rule(data=st.data())
        def pause_resume(self, data):
            sid = data.draw(st.sampled_from(self.live()))
            if self.engine.seqs[sid].state == SeqState.PAUSED:
                self.engine.resume(sid)
            else:
                self.engine.pause(sid)

        @precondition(lambda self: self.live())
        @rule(data=st.data())
        def cancel(self, data):
            self.engine.cancel(data.draw(st.sampled_from(self.live())))

        @rule(bs=st.sampled_from([1, 3, 4, 8]), dtype=st.sampled_from(["fp32", "fp16", "int8", "int8-delta", "int8-kivi"]),
              dev=st.sampled_from([0.0, 0.005, 0.02, 0.03, 0.05]), policy=st.sampled_from(["lru", "heat"]),
              host_reads=st.sampled_from(["promote", "stream", "compute"]), layers=st.sampled_from([0, 1, 2]))
        def reconfigure(self, bs, dtype, dev, policy, host_reads, layers):
            # Device tiers down to none: sequences then run from the host tier (issue 10); per-layer placement.
            try:
                self.engine.reconfigure(block_size=bs, kv_dtype=dtype, device_budget_mb=dev, policy=policy,
                                        host_reads=host_reads, device_layers=layers)
            except ConfigError:
                return
            self.engine.step()

        @rule(dev=st.sampled_from([0.0, 0.004, 0.01, 0.03, 0.08]), host=st.sampled_from([0.0, 0.01, 0.06, 0.2]))
        def resize(self, dev, host):
            # Budgets alone change in place (engine/kv/resize.py): same pool, block ids kept, or refused unchanged.
            pool, tables = self.engine.pool, {s.id: list(s.blocks) for s in self.engine.seqs.values()}
            try:
                self.engine.reconfigure(device_budget_mb=dev, host_budget_mb=host)
            except ConfigError:
                assert self.engine.pool is pool and {s.id: s.blocks for s in self.engine.seqs.values()} == tables
                return
            assert self.engine.pool is pool and {s.id: s.blocks for s in self.engine.seqs.values()} == tables
            self.engine.step()

        @invariant()
        def consistent(self):
            e = self.engine
            e.check_invariants()
            p = e.pool
            for t in p.tiers:  # bytes accounted equal the pool (the device tier's null and sink blocks besides)
                reserved = 2 if t.null_slot is not None else 0
                assert sum(t.nbytes().values()) == (t.capacity + reserved) * p.block_bytes
            dev, n = p.tiers[0], p.sizes.dev_layers  # per-layer placement: device memory holds layers [0, n) only
            assert sum(x.numel() * x.element_size() for parts in (dev.k, dev.v) for layers in parts.values()
                       for x in layers[:n]) == (dev.capacity + 2) * p.sizes.dev_block_bytes
            for s in e.seqs.values():
                if not s.done and s.state != SeqState.RUNNING:
                    assert len(s.blocks) * e.config.block_size >= s.num_cached
            # What the window shows: the snapshot's per-sequence placement (cached between snapshots while
            # tables and tiers hold still) equals a recount.
            snap = e.snapshot(set())
            for i, sid in enumerate(snap.seqs.id.tolist()):
                tiers = p.tier[np.asarray(e.seqs[sid].blocks, dtype=np.int64)]
                assert (snap.seqs.blocks_device[i], snap.seqs.blocks_host[i]) == ((tiers == 0).sum(), (tiers == 1).sum())

        def teardown(self):
            e = self.engine
            for sid in self.live():
                e.cancel(sid)
            e.check_invariants()
            # Every block left is an unowned cached one; dropping the cache leaves the pool empty.
            for t in e.pool.tiers:
                assert np.all(t.ref[t.lid >= 0] == 0)
            e.pool.drop_cached()
            assert all(t.used == 0 for t in e.pool.tiers)
            assert len(e.pool.free_lids) == e.pool.n_lids

    return CacheMachine


def test_random_operations_keep_the_cache_consistent(llama_model):
    run_state_machine_as_test(
        make_machine(llama_model),
        settings=settings(max_examples=40, stateful_step_count=40, deadline=None,
                          suppress_health_check=list(HealthCheck)),
    )
