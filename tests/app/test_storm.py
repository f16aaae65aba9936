"""The reconfiguration storm (app/stress/storm.py), short: a change every 20 ms under every knob while requests decode.

Counts, not times: the storm must finish with no unexpected exception, no engine error event, no dropped change,
no lost request, no invariant failure, and requests that lived on fp32 equal to transformers' tokens."""

from __future__ import annotations

import argparse

import pytest

from app.stress.storm import random_change, run


def test_a_short_storm_breaks_nothing():
    out = run(argparse.Namespace(model=None, seed=5, every_ms=20.0, in_flight=6, minutes=10.0, steps=400))
    assert out["steps"] >= 400
    for k in ("unexpected (reconfigure)", "unexpected (step)", "engine errors", "dropped", "lost", "mismatched",
              "invariant failures"):
        assert out[k] == 0, (k, out["failures"][:2])
    assert out["applied"] >= 20 and out["refused"] >= 1  # changes went through, and some were refused
    assert out["checked equal"] >= 10  # requests that lived on fp32 were compared with transformers
    assert out["finished"] >= 20 and out["ok"] is True


def test_a_short_storm_on_packed_weights_breaks_nothing(monkeypatch):
    """int4 weights: decode steps take the whole-layer compiled call (FusedLayer.decode_into) whenever the step allows
    it, and the other path when not (host blocks, lossy codecs); changes every 20 ms break neither. No transformers
    reference here: finished requests are counted as unchecked, none compared."""
    from engine.model.quant_layer import FusedLayer

    calls = [0]
    real = FusedLayer.decode_into

    def counted(layer, *a, **k):
        calls[0] += 1
        return real(layer, *a, **k)

    monkeypatch.setattr(FusedLayer, "decode_into", counted)
    out = run(argparse.Namespace(model=None, seed=7, every_ms=20.0, in_flight=6, minutes=10.0, steps=300,
                                 weights_dtype="int4"))
    for k in ("unexpected (reconfigure)", "unexpected (step)", "engine errors", "dropped", "lost", "mismatched",
              "invariant failures", "reasons unaccounted"):
        assert out[k] == 0, (k, out["failures"][:2])
    assert out["weights_dtype"] == "int4" and out["checked equal"] == 0 and out["finished unchecked"] >= 10
    assert out["applied"] >= 20 and out["ok"] is True
    assert calls[0] > 0  # some steps ran whole layers


def test_the_storm_counts_what_it_claims(monkeypatch):
    """A storm that hid failures would pass anything: an engine whose step raises is counted, not swallowed."""
    from engine.runtime import engine as engine_mod
    real = engine_mod.Engine._step
    calls = [0]

    def sometimes(self):
        calls[0] += 1
        if calls[0] % 50 == 0:
            raise IndexError("index out of range in self")
        return real(self)

    monkeypatch.setattr(engine_mod.Engine, "_step", sometimes)
    out = run(argparse.Namespace(model=None, seed=6, every_ms=50.0, in_flight=4, minutes=10.0, steps=150))
    assert out["unexpected (step)"] >= 2 and out["ok"] is False
    assert any("IndexError" in f for f in out["failures"])


@pytest.mark.parametrize("seed", range(3))
def test_random_changes_name_real_knobs(seed):
    import random

    from engine.config import KNOBS

    rng = random.Random(seed)
    for _ in range(200):
        ch = random_change(rng, 0.01, 4, lossy=False)
        assert set(ch) <= set(KNOBS) and ch.get("kv_dtype", "fp32") == "fp32"
