"""Compare two snapshots (issue 23 item 5): every counter's A, B and delta, the knobs that differ, each side's maps
and why-missed bars; `kvscope --compare A.json B.json` headless, a bad file refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.config import CacheConfig
from engine.model.loader import load_model
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from tiny_models import prompts

pytest.importorskip("PySide6")


@pytest.fixture(scope="module")
def two_files(tiny_llama, tmp_path_factory):
    """Before and after a block-size change, the same requests: saved as the window saves them."""
    from engine.telemetry import snapshot_io

    d = tmp_path_factory.mktemp("compare")
    model = load_model(tiny_llama)
    ps = prompts(80, [40, 40, 24])
    out = []
    for name, bs in (("before", 16), ("after", 4)):
        eng = Engine(model, CacheConfig(block_size=bs))
        eng.generate(ps, SamplingParams(max_new_tokens=6, ignore_eos=True))
        path = d / f"{name}.json"
        snapshot_io.save(str(path), eng.snapshot(), {"caption": f"{name}: block size {bs}"})
        out.append((str(path), eng))
    return out


def test_rows_are_every_counter_with_its_delta_and_the_knobs_that_differ(two_files):
    from engine.telemetry import snapshot_io
    from ui.compare import compare_rows

    (pa, ea), (pb, eb) = two_files
    a, b = snapshot_io.load(pa)[0], snapshot_io.load(pb)[0]
    rows = {(r[0], r[1]): r[2:] for r in compare_rows(a, b)}
    assert rows[("config", "block_size")] == ("16", "4", "", "changed")
    assert ("config", "policy") not in rows  # the same on both sides
    la, lb = ea.counters.lookup_served, eb.counters.lookup_served
    assert rows[("why missed", "lookup_served")][:3] == (f"{la:,}", f"{lb:,}", f"{lb - la:,}")
    pa_, pb_ = ea.counters.prefix_hit_rate, eb.counters.prefix_hit_rate
    assert rows[("rates", "prefix_hit_rate")][3] == f"{100 * (pb_ - pa_):+.1f} points"
    assert rows[("why missed", "miss_partial")][0] == f"{ea.counters.miss_partial:,}"
    assert len([k for k in rows if k[0] in ("counters", "why missed")]) >= len(a.counters) - 2


def test_the_window_shows_both_sides(qtbot, two_files, tmp_path):
    from app.window.launch import compare_window

    (pa, _), (pb, _) = two_files
    win = compare_window(pa, pb)
    qtbot.addWidget(win)
    assert [s.title.text() for s in win.sides] == ["<b>before.json</b>  before: block size 16",
                                                  "<b>after.json</b>  after: block size 4"]
    assert win.sides[0].why.texts() != win.sides[1].why.texts()
    assert win.table.rowCount() == len(win.rows) and win.table.item(0, 1).text() == "block_size"
    js = win.save_screenshot(str(tmp_path / "c.png"))
    assert json.load(open(js))["rows"][0] == ["config", "block_size", "16", "4", "", "changed"]


@pytest.mark.subprocess
def test_kvscope_compare_headless_and_a_bad_file(two_files, tmp_path):
    (pa, _), (pb, _) = two_files
    out = tmp_path / "cmp.png"
    r = subprocess.run([sys.executable, "-m", "app.cli", "--compare", pa, pb, "--headless", "--screenshot", str(out),
                        "--run-for", "0.5"], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert out.exists() and json.load(open(tmp_path / "cmp.json"))["compare"] == ["before.json", "after.json"]
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    r = subprocess.run([sys.executable, "-m", "app.cli", "--compare", pa, str(bad), "--headless"], capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 2 and "bad.json" in r.stderr and "Traceback" not in r.stderr
