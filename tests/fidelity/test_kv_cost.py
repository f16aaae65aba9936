"""What a lossy KV dtype costs, measured (issue 11): each block's K/V reconstruction error as it is written, the
key channels with outliers, the shadow reference steps, their snapshot fields, and the knob."""

from __future__ import annotations

import itertools
import json
import re
import math

import numpy as np
import pytest
import torch

from engine.telemetry import snapshot_io
from engine.kv.block_pool import Tier
from engine.config import CacheConfig, ConfigError, EngineOptions
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from tiny_models import prompts

LOSSY = ("fp16", "bf16", "int8", "int8-delta", "int8-kivi", "fp8")


def engine(model, dtype="int8", bs=8, shadow=0.0, clock=None, **cfg) -> Engine:
    config = CacheConfig(block_size=bs, kv_dtype=dtype, shadow_every_s=shadow, demote_after_s=3600, **cfg)
    return Engine(model, config, EngineOptions(), **({"clock": clock} if clock else {}))


def prefilled(model, dtype, prompt, bs=8):
    """An engine that has prefilled `prompt` in one step (the sequence still running), and the sequence."""
    e = engine(model, dtype, bs)
    sid = e.add_request(prompt, SamplingParams(max_new_tokens=50))
    e.step()
    return e, e.seqs[sid]


def block_errors(e: Engine, seq) -> tuple[np.ndarray, np.ndarray]:
    """(K, V) error of each block of seq, in table order, as the snapshot shows them."""
    snap = e.snapshot()
    tiers, slots = e.pool.tier[seq.table()], e.pool.slot[seq.table()]
    k = np.array([snap.tiers[t].kerr[s] for t, s in zip(tiers, slots)])
    v = np.array([snap.tiers[t].verr[s] for t, s in zip(tiers, slots)])
    return k, v


@pytest.mark.parametrize("n", [21, 100])  # a decode-sized step (reduced after the last layer) and a prefill (per layer)
def test_a_blocks_error_is_its_worst_token_and_layer_relative_rms_error(llama_model, monkeypatch, n):
    from engine.runtime.step_kv import StepKV

    written = {}  # layer -> the K and V the model computed (in hand) this step
    write = StepKV.write

    def spy(self, layer, k, v):
        written[layer] = (k.detach().clone(), v.detach().clone())
        write(self, layer, k, v)

    monkeypatch.setattr(StepKV, "write", spy)
    prompt = prompts(3, [n])[0]
    e, seq = prefilled(llama_model, "int8-kivi", prompt)
    ref_k = torch.stack([written[i][0] for i in sorted(written)])  # [L, T, H, D]
    ref_v = torch.stack([written[i][1] for i in sorted(written)])
    k_hat, v_hat = e.pool.read_blocks(list(seq.blocks))  # [L, n, H, bs, D]
    got_k, got_v = block_errors(e, seq)
    bs = 8
    for b in range(len(seq.blocks)):
        tok = slice(b * bs, min((b + 1) * bs, len(prompt)))
        n = tok.stop - tok.start
        for ref, hat, got in ((ref_k, k_hat, got_k), (ref_v, v_hat, got_v)):
            x, xh = ref[:, tok], hat[:, b, :, :n].transpose(1, 2)  # [L, n, H, D]
            e_tok = (x - xh).flatten(2).norm(dim=-1) / x.flatten(2).norm(dim=-1)
            assert got[b] == pytest.approx(float(e_tok.max()), rel=1e-4)
    assert np.all(got_k > 0) and np.all(got_v > 0)


def test_fp32_is_exact_and_every_lossy_format_measures_its_own_error(llama_model):
    prompt = prompts(4, [40])[0]
    errs = {}
    for dtype in ("fp32",) + LOSSY:
        e, seq = prefilled(llama_model, dtype, prompt)
        errs[dtype] = block_errors(e, seq)
    assert all(np.all(a == 0) for a in errs["fp32"])  # stored exactly: 0, not "not measured"
    for dtype in LOSSY:
        k, v = errs[dtype]
        assert np.all(np.isfinite(k) & (k > 0)) and np.all(np.isfinite(v) & (v > 0)), dtype
    worst = {d: (errs[d][0].max(), errs[d][1].max()) for d in LOSSY}
    for i in (0, 1):  # K and V: fp16 < bf16 < int8 < fp8 (3, 8, 8 and 4 mantissa bits: e4m3's 3 bits, per-token scale)
        assert worst["fp16"][i] < worst["bf16"][i] < worst["int8"][i] < worst["fp8"][i]
    assert worst["int8-delta"][0] < worst["fp8"][0] and worst["int8-kivi"][0] < worst["fp8"][0]
    # The values of int8-delta and int8-kivi are stored as int8's (one scale per token): about the same error (not
    # equal: from the second layer on, the values are computed from attention over differently stored keys).
    np.testing.assert_allclose(errs["int8-delta"][1], errs["int8"][1], rtol=0.1)
    np.testing.assert_allclose(errs["int8-kivi"][1], errs["int8"][1], rtol=0.1)


def test_decode_tokens_raise_a_blocks_error_to_their_max(llama_model):
    e, seq = prefilled(llama_model, "fp8", prompts(5, [12])[0])
    k0, v0 = block_errors(e, seq)
    for _ in range(3):  # appended to the second block (12 -> 15 tokens)
        e.step()
    k1, v1 = block_errors(e, seq)
    assert k1[0] == k0[0] and v1[0] == v0[0]  # untouched
    assert k1[1] >= k0[1] and v1[1] >= v0[1]


def test_errors_follow_a_block_through_demotion_and_promotion(llama_model):
    e, seq = prefilled(llama_model, "int8", prompts(6, [30])[0])
    before = block_errors(e, seq)
    lids = seq.table().copy()
    old_slots = e.pool.slot[lids].copy()
    with e.lock:
        assert e.pool.move(lids, Tier.HOST, e.clock(), "test") == len(lids)
    assert np.all(e.pool.tier[lids] == Tier.HOST)
    on_host = block_errors(e, seq)
    np.testing.assert_array_equal(on_host[0], before[0])
    np.testing.assert_array_equal(on_host[1], before[1])
    snap = e.snapshot()
    assert np.all(np.isnan(snap.tiers[0].kerr[old_slots]))  # the slots left behind are free: no value
    with e.lock:
        e.pool.move(lids, Tier.DEVICE, e.clock(), "test")
    back = block_errors(e, seq)
    np.testing.assert_array_equal(back[0], before[0])
    e.step()  # the engine goes on writing into the promoted blocks
    assert np.all(np.isfinite(block_errors(e, seq)[0]))


def test_blocks_re_encoded_by_a_relayout_read_not_measured_until_rewritten(llama_model):
    e, seq = prefilled(llama_model, "int8", prompts(7, [20])[0])
    e.reconfigure(block_size=4)  # write_blocks re-encodes every block: nothing of it measured
    k, v = block_errors(e, seq)
    assert np.all(np.isnan(k)) and np.all(np.isnan(v))
    for _ in range(6):  # 20 -> 26 tokens: block 5 (tokens 20..23) is written whole by decode steps
        e.step()
    k, v = block_errors(e, seq)
    assert np.isfinite(k[5]) and np.isfinite(v[5]) and k[5] > 0
    assert np.all(np.isnan(k[:5]))


def test_a_reused_slot_reads_not_measured_until_its_new_block_is(llama_model):
    t = itertools.count(1000.0, 1.0)
    e = engine(llama_model, "int8", clock=lambda: next(t))
    sid = e.add_request(prompts(8, [5])[0], SamplingParams(max_new_tokens=1))
    e.run_until_done()  # a partial block: freed when the sequence finishes
    slot = 0
    with e.lock:
        assert e.pool.tiers[0].lid[slot] < 0 and np.isfinite(e.pool.tiers[0].kerr[slot])  # the old value stays behind
        lid = e.pool.allocate(Tier.DEVICE, owner=sid, now=e.clock())
    assert e.pool.slot[lid] == slot
    assert math.isnan(e.snapshot().tiers[0].kerr[slot])  # a fresh block: its value is not the old one


def test_key_channel_outliers(llama_model, llama_ref):
    prompt = prompts(9, [30])[0]
    e, _ = prefilled(llama_model, "fp32", prompt)
    q = e.snapshot().quality
    assert q["keys_seen"] == 30 and q["kv_dtype"] == "fp32" and q["lossless"]
    rows = q["key_outliers"]
    assert len(rows) == 10 and [r[4] for r in rows] == sorted((r[4] for r in rows), reverse=True)
    with torch.inference_mode():
        cache = llama_ref.model(torch.tensor([prompt]), use_cache=True).past_key_values
    absmax = torch.stack([layer.keys[0] for layer in cache.layers]).abs().amax(dim=2)  # [L, H, D]
    absmax = absmax.numpy()
    ratio = absmax / np.median(absmax, axis=-1, keepdims=True)  # the median of an even count: the middle two's mean
    layer, head, ch, amax, r = rows[0]
    assert amax == pytest.approx(float(absmax[layer, head, ch]), rel=1e-4)
    assert r == pytest.approx(float(ratio.max()), rel=1e-3) and r > 1


def test_the_dense_reference_equals_transformers(llama_model, llama_ref):
    from engine.fidelity.shadow import dense_logits

    e = engine(llama_model, "fp32")
    tokens = prompts(10, [37])[0]
    with torch.inference_mode():
        ref = llama_ref.model(torch.tensor([tokens])).logits[0, -1]
    got = dense_logits(e.model, tokens)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dense_logits(e.model, tokens, chunk=5), got, rtol=1e-4, atol=1e-4)  # chunked the same


def shadowed(model, dtype: str, every: float = 0.5, steps: int = 12) -> Engine:
    t = itertools.count(1000.0, 1.0)  # each reading of the clock one second later: a shadow step every few steps
    e = engine(model, dtype, shadow=every, clock=lambda: next(t))
    for p in prompts(11, [25, 40]):
        e.add_request(p, SamplingParams(max_new_tokens=steps, ignore_eos=True))
    e.run_until_done()
    return e


def test_shadow_steps_agree_with_fp32_kv_and_measure_what_fp8_costs(llama_model):
    exact, lossy = shadowed(llama_model, "fp32"), shadowed(llama_model, "fp8")
    a, b = exact.counters, lossy.counters
    assert a.shadow_steps >= 3 and b.shadow_steps >= 3
    assert a.shadow_flips == 0 and a.shadow_kld_max < 1e-8 and a.shadow_logit_err_max < 1e-3
    assert b.shadow_kld_max > 1e-6 and b.shadow_kld_max > 100 * max(a.shadow_kld_max, 1e-12)
    assert b.shadow_logit_err_max > 10 * a.shadow_logit_err_max
    for e in (exact, lossy):
        snap = e.snapshot()
        kld = snap.series["shadow_kld"]
        n = int(np.isfinite(kld).sum())
        assert 1 <= n <= e.counters.shadow_steps and np.isnan(kld).sum() > 0  # a point per shadow step, NaN between
        assert np.array_equal(np.isfinite(kld), np.isfinite(snap.series["shadow_flip_rate"]))
        last = snap.quality["shadow"]
        assert last["kv_dtype"] == snap.config["kv_dtype"] and last["tokens"] > 25
        # The budget: the next shadow step waits at least 19 times the last one's cost.
        assert e.shadow.next_at >= last["t"] + 19 * last["cost_s"] - 1e-9


def test_shadowing_off_leaves_no_data(llama_model):
    e = shadowed(llama_model, "int8", every=0.0, steps=4)
    snap = e.snapshot()
    assert e.counters.shadow_steps == 0 and snap.quality["shadow"] == {}
    for key in ("shadow_kld", "shadow_flip_rate", "shadow_logit_err"):
        assert len(snap.series[key]) and np.all(np.isnan(snap.series[key]))  # no data, never 0


def test_the_shadow_knob_rejects_bad_values(llama_model):
    for bad, needle in ((-1, "outside [0, 3600] s"), ("nan", "outside"), ("soon", "is not a valid float"),
                        (1e6, "outside")):
        with pytest.raises(ConfigError, match="shadow_every_s"):
            CacheConfig().replace(shadow_every_s=bad)
        with pytest.raises(ConfigError, match=re.escape(needle)):
            CacheConfig().replace(shadow_every_s=bad)
    e = engine(llama_model, "int8", shadow=2.0)
    with pytest.raises(ConfigError, match="shadow_every_s"):
        e.reconfigure(shadow_every_s=-0.5)
    assert e.config.shadow_every_s == 2.0
    assert e.reconfigure(shadow_every_s="0").shadow_every_s == 0.0
    assert [ev.fields["message"] for ev in e.take_events() if ev.kind == "config_error"]


def test_the_cli_flag(tiny_llama, capsys):
    from kvscope_cli import run_cli

    rc, _, err = run_cli(capsys, "generate", "hi", "--model", tiny_llama, "--shadow-every", "-1")
    assert rc == 2 and "shadow_every_s" in err and "Traceback" not in err
    rc, out, _ = run_cli(capsys, "generate", "hi", "--model", tiny_llama, "--shadow-every", "0.5", "--max-new-tokens",
                         "3", "--json")
    assert rc == 0 and json.loads(out)["stats"]["config"]["shadow_every_s"] == 0.5


def test_snapshot_files_carry_the_new_fields_and_older_files_still_open(llama_model, tmp_path):
    e = shadowed(llama_model, "int8", steps=6)
    e.add_request(prompts(12, [20])[0], SamplingParams(max_new_tokens=20))
    e.step()
    snap = e.snapshot()
    text = snapshot_io.to_json(snap, extra={"colour_mode": "kv error"})
    back, extra = snapshot_io.from_json(text)
    assert extra["colour_mode"] == "kv error"
    for a, b in zip(snap.tiers, back.tiers):
        np.testing.assert_array_equal(a.kerr, b.kerr)  # NaN where NaN
        np.testing.assert_array_equal(a.verr, b.verr)
    assert np.isfinite(back.tiers[0].kerr).any()
    assert back.quality["key_outliers"] == snap.quality["key_outliers"]
    assert back.quality["shadow"] == snap.quality["shadow"] and back.quality["shadow"]
    assert back.config["shadow_every_s"] == snap.config["shadow_every_s"]
    for k in ("shadow_kld", "shadow_flip_rate", "shadow_logit_err"):
        np.testing.assert_array_equal(back.series[k], snap.series[k])
    assert back.counters["shadow_steps"] == snap.counters["shadow_steps"] > 0
    # A file written before these fields existed.
    doc = json.loads(text)
    body = doc["snapshot"]
    for t in body["tiers"]:
        del t["kerr"], t["verr"]
    del body["quality"], body["config"]["shadow_every_s"]
    for k in ("shadow_kld", "shadow_flip_rate", "shadow_logit_err"):
        del body["series"][k]
    old, _ = snapshot_io.from_json(json.dumps(doc))
    assert all(np.all(np.isnan(t.kerr)) and len(t.kerr) == t.capacity for t in old.tiers)
    assert old.quality["key_outliers"] == [] and old.config["shadow_every_s"] == CacheConfig().shadow_every_s
    # Damaged values are named.
    for edit, needle in ((lambda d: d["snapshot"]["tiers"][0].update(kerr={"__nd__": "<f4", "shape": [1], "b64": "AACAvw=="}),
                          "tiers[0].kerr"),
                         (lambda d: d["snapshot"]["quality"]["key_outliers"].append([99, 0, 0, 1.0, 1.0]),
                          "quality.key_outliers"),
                         (lambda d: d["snapshot"]["config"].update(shadow_every_s=-3), "config.shadow_every_s")):
        d = json.loads(text)
        edit(d)
        with pytest.raises(snapshot_io.SnapshotFileError, match=re.escape(needle)):
            snapshot_io.from_json(json.dumps(d))


@pytest.mark.parametrize("dtype", LOSSY + ("fp32",))
def test_reading_back_token_by_token_equals_decoding_whole_blocks(dtype):
    from engine.kv.codecs import Appends, Geometry, codecs_for
    from engine.config import KVDtype
    from engine.fidelity.block_error import stored, token_axes

    g = Geometry(2, 3, 8, 16)
    torch.manual_seed(0)
    for codec in codecs_for(KVDtype.parse(dtype)):
        parts = codec.alloc(g, 4, torch.device("cpu"), False)
        x = torch.randn(4, 8, 3, 16) * torch.linspace(0.2, 5, 8)[None, :, None, None]  # louder tokens later
        for j in range(8):  # token by token into blocks 3, 0, 2, 1
            slots = torch.tensor([3, 0, 2, 1])
            off = torch.full((4,), j)
            a = Appends.of(slots, off, slots, torch.arange(4), off, 0)
            for layer in range(2):
                codec.append(parts, layer, a, x[:, j] * (layer + 1))
            whole = stored(codec, None, parts, 1, a)
            assert torch.equal(whole, codec.decode(parts, 1, slots)[:, :, j])
            axes = token_axes(codec, g)
            if axes is not None:  # every codec but int8-delta's keys
                assert torch.equal(stored(codec, axes, parts, 1, a), whole), (dtype, type(codec).__name__, j)
    assert (token_axes(codecs_for(KVDtype.INT8_DELTA)[0], g) is None) and token_axes(codecs_for(KVDtype.INT8_KIVI)[0], g)
