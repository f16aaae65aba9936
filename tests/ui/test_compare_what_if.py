"""The what-if curves travel in snapshots (Snapshot.what_if, issue 23 items 2 and 5): saved as the window saves them,
read back exactly, checked when read, drawn on each side of the compare window with a row per group and policy, and in
a reopened snapshot's What if tab; a file from before them still opens ("no data")."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from engine.config import CacheConfig, EngineOptions
from engine.model.loader import load_model
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from tiny_models import prompts

pytest.importorskip("PySide6")


@pytest.fixture(scope="module")
def files(tiny_llama, tmp_path_factory):
    """The same requests at two device budgets, each snapshot with the curves of its own recorded trace (as the
    window saves them: MainWindow.with_what_if), and one without curves (a file from before them)."""
    from app.whatif.worker import what_if_results
    from engine.telemetry import snapshot_io

    d = tmp_path_factory.mktemp("compare-what-if")
    model = load_model(tiny_llama)
    (shared,) = prompts(81, [48])
    ps = [shared + t for t in prompts(82, [5, 9, 3, 7])]
    out = []
    for name, mb in (("small", 0.02), ("large", 1.0)):  # 8 and 510 device blocks; 22 distinct
        eng = Engine(model, CacheConfig(block_size=4, device_budget_mb=mb, host_budget_mb=8.0),
                     EngineOptions(attention="cpu"))
        eng.start_trace()
        for p in ps:
            eng.generate([p], SamplingParams(max_new_tokens=4, ignore_eos=True))
        trace = eng.stop_trace()
        results = what_if_results(trace, [(int(eng.pool.sizes.dev_cap), eng.pool.block_bytes / 2**20, "")])
        snap = dataclasses.replace(eng.snapshot(), what_if={"source": "recorded from this engine",
                                                            "groups": [r.saved() for r in results]})
        path = d / f"{name}.json"
        snapshot_io.save(str(path), snap, {"caption": f"{name}: {mb} MiB"})
        out.append((str(path), results))
    old = d / "old.json"
    snapshot_io.save(str(old), eng.snapshot(), {"caption": "no curves"})
    return out, str(old)


def test_the_curves_round_trip_exactly(files):
    from engine.telemetry import snapshot_io

    (path, results), _ = files[0][0], files[1]
    snap, _ = snapshot_io.load(path)
    (g,) = snap.what_if["groups"]
    r = results[0]
    assert g["group"] == 0 and g["current_blocks"] == r.current_blocks and g["distinct"] == r.distinct
    assert [c["policy"] for c in g["curves"]] == ["lru", "heat(0.9)", "s3fifo"]
    for c, (label, caps, hit, exact) in zip(g["curves"], r.curves):
        assert c["capacities"].dtype == np.int64 and c["capacities"].tolist() == np.asarray(caps).tolist()
        assert np.array_equal(c["hit_rate"], np.asarray(hit, dtype=np.float64), equal_nan=True)
        assert c["exact"] == exact
    assert g["lines"] == r.lines


def test_compare_draws_both_sides_curves_and_a_row_per_policy(qtbot, files, tmp_path):
    from app.window.launch import compare_window

    ((pa, ra), (pb, rb)), _ = files
    win = compare_window(pa, pb)
    qtbot.addWidget(win)
    for side, r in zip(win.sides, (ra, rb)):
        drawn = side.what_if.result
        assert drawn is not None and drawn.current_blocks == r[0].current_blocks
        assert drawn.curves[0][2].tolist() == np.asarray(r[0].curves[0][2]).tolist()
        assert "saved in the snapshot" in side.what_if.text.text() and "2× budget:" in side.what_if.text.text()
    rows = {(x[0], x[1]): x[2:] for x in win.rows}
    lru_a, lru_b = ra[0].curves[0], rb[0].curves[0]
    want_a = float(np.asarray(lru_a[2])[list(lru_a[1]).index(ra[0].current_blocks)])
    want_b = float(np.asarray(lru_b[2])[list(lru_b[1]).index(rb[0].current_blocks)])
    assert want_a < want_b  # the larger device tier keeps more of the shared prefix
    assert rows[("what if", "group 0 lru at its capacity")] == (
        f"{100 * want_a:.1f} %", f"{100 * want_b:.1f} %", f"{100 * want_b - 100 * want_a:+.1f}",
        f"{100 * want_b - 100 * want_a:+.1f} points")
    js = win.save_screenshot(str(tmp_path / "c.png"))
    assert any(r[0] == "what if" for r in json.load(open(js))["rows"])


def test_a_file_without_curves_still_opens_and_says_no_data(qtbot, files):
    from app.window.launch import compare_window

    ((pa, _), _), old = files
    win = compare_window(pa, old)
    qtbot.addWidget(win)
    assert win.sides[1].what_if.result is None
    assert "no data: this snapshot holds no what-if curves" in win.sides[1].what_if.text.text()
    rows = {(x[0], x[1]): x[2:] for x in win.rows}
    assert rows[("what if", "group 0 lru at its capacity")][1:] == ("—", "—", "—")


def test_a_reopened_snapshot_draws_its_curves_in_the_what_if_tab(qtbot, files):
    from ui.main_window import open_snapshot_window

    ((pa, ra), _), _ = files
    win = open_snapshot_window(pa)
    qtbot.addWidget(win)
    assert win.what_if.result is not None and win.what_if.result.distinct == ra[0].distinct
    assert win.with_what_if(win.snapshot).what_if["groups"][0]["current_blocks"] == ra[0].current_blocks


@pytest.mark.parametrize("change, where", [
    (lambda c: c.update(hit_rate=c["hit_rate"] * 3), "hit_rate"),
    (lambda c: c.update(hit_rate=c["hit_rate"][:-1]), "expected"),
    (lambda c: c.update(capacities=c["capacities"][::-1].copy()), "not ascending"),
    (lambda c: c.update(capacities=c["capacities"].astype(np.float32)), "capacities"),
])
def test_a_damaged_what_if_field_is_named(files, tmp_path, change, where):
    from engine.telemetry import snapshot_io

    ((pa, _), _), _ = files
    snap, extra = snapshot_io.load(pa)
    wi = json.loads(json.dumps(snap.what_if, default=lambda a: a.tolist()))  # a deep copy
    groups = [dict(g, curves=[dict(c, capacities=np.asarray(c["capacities"], dtype=np.int64),
                                   hit_rate=np.asarray(c["hit_rate"], dtype=np.float64)) for c in g["curves"]])
              for g in wi["groups"]]
    change(groups[0]["curves"][0])
    bad = tmp_path / "bad.json"
    snapshot_io.save(str(bad), dataclasses.replace(snap, what_if={**wi, "groups": groups}), extra)
    with pytest.raises(snapshot_io.SnapshotFileError, match=r"what_if\.groups\[0\]\.curves\[0\]") as e:
        snapshot_io.load(str(bad))
    assert where in str(e.value)
