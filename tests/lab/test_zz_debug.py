import numpy as np
from engine.config import CacheConfig, EngineOptions
from engine.lab.whatif import real_hit_rate
from engine.lab.kv_replay import KVReplay, step_cost

def test_dbg(llama_model):
    from app.whatif_check import budget_for_blocks, run_traced, in_flight
    from engine.workloads.requests import reference_desk
    reqs = reference_desk(64, 0, rate_per_s=40.0, max_new_tokens=24)
    run_traced(llama_model, CacheConfig(), EngineOptions(attention="cpu"), reqs[:8], 16, None, 0.0)
    for pol in ("lru", "heat"):
        base = CacheConfig(block_size=16, host_budget_mb=8.0, policy=pol)
        config = base.replace(device_budget_mb=budget_for_blocks(llama_model, base, 48))
        t, c, res = run_traced(llama_model, config, EngineOptions(attention="cpu"), reqs, 16, None, 1.0)
        kr = KVReplay(t)
        print(pol, "real48", round(100*real_hit_rate(t)[0],1), in_flight(t), "steps", len(t.step_t), "cost", kr.cost, "span", t.step_t[-1]-t.step_t[0])
        for cap in (24, 48, 96):
            r = kr.run(cap, keep_trace=True)
            print("  replay", cap, round(100*r.hit_rate,1), in_flight(r.trace), "steps", r.steps, "span", r.seconds - kr.requests[0].arrival)
    assert False
