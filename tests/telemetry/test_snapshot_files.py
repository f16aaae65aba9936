"""Snapshot files from outside: a damaged, foreign or hostile file is refused with one line naming the file and
the field (SnapshotFileError; `kvscope --open-snapshot` prints `kvscope: error: ...` and exits 2), never a
traceback, never a hang; a good file still opens."""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from engine.telemetry import snapshot_io
from engine.config import CacheConfig, EngineOptions
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from tiny_models import prompts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def good(llama_model, tmp_path_factory) -> str:
    """A real snapshot file: two tiers in use (the device tier small enough to demote), several sequences
    with block tables, a config change mark, the extra a screenshot writes."""
    now = [100.0]
    eng = Engine(llama_model, CacheConfig(block_size=4, device_budget_mb=0.05, host_budget_mb=2, demote_after_s=1.0),
                 EngineOptions(context_limit=256), clock=lambda: now[0])
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=20, ignore_eos=True), label=f"s{i}")
           for i, p in enumerate(prompts(7, [9, 17, 30]))]

    def run(steps: int) -> None:
        for _ in range(steps):
            now[0] += 0.05
            eng.step()

    run(2)
    eng.reconfigure(block_size=8)
    run(2)
    eng.pause(ids[0])
    now[0] += 2.0  # its blocks go idle past demote_after_s: the host tier fills
    run(3)
    snap = eng.snapshot()
    assert all(t.used for t in snap.tiers) and len(snap.seqs.id) == 3 and snap.marks
    path = str(tmp_path_factory.mktemp("snap") / "good.json")
    snapshot_io.save(path, snap, extra={"caption": "KV Scope — test", "png": "good.png", "colour_mode": "heat",
                                        "selected": ids[1]})
    return path


def doc_of(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def arr(node: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(node["b64"]), dtype=node["__nd__"]).reshape(node["shape"]).copy()


def put(node: dict, a: np.ndarray) -> None:
    node.update(snapshot_io._enc(np.asarray(a)))


def _set_value(node: dict, i: int, v) -> None:
    a = arr(node)
    a[i] = v
    put(node, a)


def _edit(fn):
    """A case that edits the good document: fn(doc) changes it in place (or returns text/bytes to write)."""
    def make(good_path: str) -> bytes:
        doc = doc_of(good_path)
        out = fn(doc)
        if out is None:
            out = json.dumps(doc)
        return out.encode("utf-8") if isinstance(out, str) else out
    return make


def _raw(data: bytes):
    return lambda good_path: data


def _truncated(good_path: str) -> bytes:
    data = open(good_path, "rb").read()
    return data[: len(data) // 2]


def _del(d: dict, key: str) -> None:
    del d[key]


def _del_last(lst: list) -> None:
    del lst[-1]


def _snap(doc: dict) -> dict:
    return doc["snapshot"]


def _nested(depth: int):
    def fn(doc):
        junk: list = []
        for _ in range(depth):
            junk = [junk]
        doc["extra"]["notes"] = junk
    return fn


# (case id, how to make the file from the good one, what the message must say)
CASES = [
    ("empty", _raw(b""), r"the file is empty"),
    ("not-json", _raw(b"kvscope notes: not a snapshot\n"), r"not JSON \(Expecting value at line 1 column 1\)"),
    ("truncated", _truncated, r"not JSON: the text ends early"),
    ("not-utf8", _raw(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe"), r"not UTF-8 text \(byte 0x89 at offset 0\)"),
    ("wrong-format", _edit(lambda d: d.update(format="kvscope-trace")), r"its \"format\" is 'kvscope-trace'"),
    ("wrong-version", _edit(lambda d: d.update(version=True)), r"snapshot version True is not 1"),
    ("missing-key", _edit(lambda d: _del(_snap(d)["tiers"][0], "heat")), r": tiers\[0\]\.heat: missing$"),
    ("missing-knob", _edit(lambda d: _del(_snap(d)["config"], "prefetch_depth")), r"config\.prefetch_depth: missing"),
    ("wrong-type", _edit(lambda d: _snap(d)["config"].update(block_size="8")),
     r"config\.block_size: expected an integer, got a string"),
    ("wrong-type-rate", _edit(lambda d: _snap(d)["counters"].update(device_hit_rate="high")),
     r"counters\.device_hit_rate: expected a number, got a string"),
    ("bad-dtype", _edit(lambda d: put(_snap(d)["tiers"][0]["state"], arr(_snap(d)["tiers"][0]["state"]).astype("<f8"))),
     r"tiers\[0\]\.state: dtype '<f8', expected \|u1"),
    ("object-dtype", _edit(lambda d: _snap(d)["tiers"][0]["owner"].update(__nd__="|O")),
     r"tiers\[0\]\.owner: dtype '\|O', expected <i4"),
    ("length-vs-capacity", _edit(lambda d: put(_snap(d)["tiers"][0]["heat"], arr(_snap(d)["tiers"][0]["heat"])[:5])),
     r"tiers\[0\]\.heat: 5 values, expected [\d,]+ \(the tier's capacity\)"),
    ("shape-vs-bytes", _edit(lambda d: _snap(d)["tiers"][1]["fill"].update(shape=[3])),
     r"tiers\[1\]\.fill\.b64: [\d,]+ base64 characters, expected 16 for shape \[3\]"),
    ("huge-shape", _edit(lambda d: _snap(d)["tiers"][0]["age"].update(shape=[10**12])),
     r"tiers\[0\]\.age\.shape: \[1000000000000\] declares .* more than the 256 MB"),
    ("negative-shape", _edit(lambda d: _snap(d)["tiers"][0]["ref"].update(shape=[-1])),
     r"tiers\[0\]\.ref\.shape: \[-1\] is not a list of non-negative integers"),
    ("nan-heat", _edit(lambda d: _set_value(_snap(d)["tiers"][0]["heat"], 0, np.nan)),
     r"tiers\[0\]\.heat: holds NaN, expected finite numbers"),
    ("nan-time", _edit(lambda d: _snap(d).update(t={"__float__": "nan"})), r": t: NaN, expected a finite number"),
    ("inf-literal", _edit(lambda d: _snap(d)["config"].update(decay=float("inf"))),  # json writes Infinity
     r"config\.decay: inf, expected a finite number"),
    ("tier-id", _edit(lambda d: _set_value(_snap(d)["seqs"]["block_tier"][0], 0, 5)),
     r"seqs\.block_tier\[0\]: holds 5, above the most allowed 1 \(tier ids"),
    ("slot-range", _edit(lambda d: _set_value(_snap(d)["seqs"]["block_slot"][0], 0, 10**6)),
     r"seqs\.block_slot\[0\]: holds 1,000,000, above the most allowed"),
    ("fill-over-block-size", _edit(lambda d: _set_value(_snap(d)["tiers"][1]["fill"], 0, 99)),
     r"tiers\[1\]\.fill: holds 99, above the most allowed 8 \(the block size\)"),
    ("state-range", _edit(lambda d: _set_value(_snap(d)["tiers"][0]["state"], 0, 7)), r"tiers\[0\]\.state: holds 7"),
    ("negative-count", _edit(lambda d: _set_value(_snap(d)["seqs"]["tokens"], 0, -5)),
     r"seqs\.tokens: holds -5, below the least allowed 0"),
    ("block-size-range", _edit(lambda d: _snap(d)["config"].update(block_size=4096)),
     r"config\.block_size: 4096 is out of range \(1 to 1,024\)"),
    ("zero-layers", _edit(lambda d: _snap(d)["model"].update(layers=0)), r"model\.layers: 0 is out of range"),
    ("seq-columns", _edit(lambda d: put(_snap(d)["seqs"]["ttft"], arr(_snap(d)["seqs"]["ttft"])[:1])),
     r"seqs\.ttft: 1 values, expected 3 \(one per sequence"),
    ("labels", _edit(lambda d: _del_last(_snap(d)["seqs"]["labels"])), r"seqs\.labels: 2 entries, expected 3"),
    ("mark", _edit(lambda d: _del_last(_snap(d)["marks"][0])), r"marks\[0\]: 2 entries, expected 3"),
    ("colour-mode", _edit(lambda d: d["extra"].update(colour_mode="rainbow")),
     r"extra\.colour_mode: 'rainbow' is not one of state, owner"),
    ("nested-junk", _edit(_nested(200)), r"extra\.notes(\[0\])+: nested deeper than 32 levels"),
    ("nested-deep", _raw(b'{"format": "kvscope-snapshot", "version": 1, "extra": ' + b"[" * 200_000),
     r"nested too deeply"),
    ("bad-base64", _edit(lambda d: _snap(d)["tiers"][0]["hashed"].update(
        b64="!" * len(_snap(d)["tiers"][0]["hashed"]["b64"]))), r"tiers\[0\]\.hashed\.b64: not valid base64"),
    ("unknown-field", _edit(lambda d: _snap(d).update(bogus=1)), r"snapshot: unknown field\(s\) 'bogus'"),
    ("staging-bytes", _edit(lambda d: _snap(d)["memory"].update(stream_staging_bytes="3 MiB")),
     r"memory\.stream_staging_bytes: expected a number, got a string"),
]
assert len({c[0] for c in CASES}) == len(CASES) >= 13


def write_case(tmp_path, name: str, make, good_path: str) -> str:
    path = tmp_path / f"{name}.json"
    path.write_bytes(make(good_path))
    return str(path)


def test_a_good_file_round_trips(good):
    snap, extra = snapshot_io.load(good)
    doc = doc_of(good)
    again, extra2 = snapshot_io.from_json(snapshot_io.to_json(snap, extra), "again.json")
    assert extra == extra2 == doc["extra"]
    for a, b in zip(snap.tiers, again.tiers):
        for f in snapshot_io.TIER_DTYPES:
            assert np.array_equal(getattr(a, f), getattr(b, f)) and getattr(a, f).dtype == getattr(b, f).dtype
    assert again.config == snap.config and again.counters.keys() == snap.counters.keys()
    assert [np.array_equal(x, y) for x, y in zip(snap.seqs.block_slot, again.seqs.block_slot)] == [True] * 3
    assert again.marks == snap.marks and snap.marks[-1][1] == "config"


@pytest.mark.parametrize("name,make,message", CASES, ids=[c[0] for c in CASES])
def test_a_malformed_file_is_refused_naming_the_problem(tmp_path, good, name, make, message):
    path = write_case(tmp_path, name, make, good)
    with pytest.raises(snapshot_io.SnapshotFileError, match=message) as e:
        snapshot_io.load(path)
    text = str(e.value)
    assert text.startswith(f"{path}: ") and "\n" not in text and len(text) < 400


def test_a_file_over_the_size_cap_is_refused_before_it_is_read(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(snapshot_io.MAX_FILE_BYTES + 1)  # sparse: costs no disk
    t0 = time.perf_counter()
    with pytest.raises(snapshot_io.SnapshotFileError, match=r"big\.json: the file is 256 MB, more than the 256 MB"):
        snapshot_io.load(str(big))
    assert time.perf_counter() - t0 < 0.5


def test_colour_modes_match_the_block_map():
    pytest.importorskip("PySide6")
    from ui.block_map.widget import MODES

    assert set(snapshot_io.COLOUR_MODES) == set(MODES)


# -- the command line -------------------------------------------------------------------------------------
def kvscope(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)


def assert_refused(out: subprocess.CompletedProcess, path: str, message: str) -> None:
    errors = [line for line in out.stderr.splitlines() if line.startswith("kvscope: error:")]
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert len(errors) == 1 and errors[0].startswith(f"kvscope: error: {path}: "), out.stderr
    assert message in errors[0]


CLI_CASES = {  # each ended in a traceback or, the first, a hang before files were checked
    "missing-knob": "config.prefetch_depth: missing",
    "colour-mode": "extra.colour_mode",
    "nested-deep": "nested too deeply",
    "not-utf8": "not UTF-8",
    "wrong-type-rate": "counters.device_hit_rate",
}


@pytest.mark.parametrize("name", list(CLI_CASES))
def test_open_snapshot_refuses_a_bad_file_in_one_line(tmp_path, good, name):
    make = {c[0]: c[1] for c in CASES}[name]
    path = write_case(tmp_path, name, make, good)
    out = kvscope("--headless", "--open-snapshot", path, "--screenshot", str(tmp_path / "out.png"), "--run-for", "1")
    assert_refused(out, path, CLI_CASES[name])
    assert not (tmp_path / "out.png").exists()


def test_open_snapshot_refuses_a_fifo_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    out = kvscope("--headless", "--open-snapshot", str(fifo), "--screenshot", str(tmp_path / "out.png"),
                  "--run-for", "1")
    assert_refused(out, str(fifo), "not a regular file")


def test_open_snapshot_still_opens_a_good_file(tmp_path, good):
    png = tmp_path / "again.png"
    out = kvscope("--headless", "--open-snapshot", good, "--screenshot", str(png), "--run-for", "1")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and png.stat().st_size > 10_000
    snap, extra = snapshot_io.load(str(tmp_path / "again.json"))
    orig, orig_extra = snapshot_io.load(good)
    assert extra["colour_mode"] == "heat" and extra["selected"] == orig_extra["selected"]
    for a, b in zip(orig.tiers, snap.tiers):
        assert np.array_equal(a.state, b.state) and np.array_equal(a.heat, b.heat)


# -- the headless run's end: whatever fails there still quits, with one line and status 2 ----------------
class _Window:
    """Stands in for the main window: its screenshot, its close or a repaint on a timer raises."""

    def __init__(self, fail: str):
        from PySide6 import QtCore

        self.fail = fail
        self.closed = False
        self.timer = QtCore.QTimer()
        self.timer.timeout.connect(self.repaint)
        if fail == "repaint":
            self.timer.start(20)

    def show(self) -> None: ...

    def repaint(self) -> None:
        raise ValueError("cannot paint this")

    def save_screenshot(self, png: str) -> str:
        if self.fail == "screenshot":
            raise KeyError("prefetch_depth")
        return png[:-4] + ".json"

    def close(self) -> None:
        self.timer.stop()
        self.closed = True
        if self.fail == "close":
            raise RuntimeError("window already deleted")


@pytest.mark.parametrize("fail", ["screenshot", "close", "repaint"])
def test_headless_end_quits_with_one_line_whatever_raises(qapp, capsys, fail):
    from PySide6 import QtCore

    from app.window.launch import _show

    win = _Window(fail)
    args = argparse.Namespace(headless=True, screenshot="out.png", run_for=0.2, open_snapshot="snap.json")
    watchdog = QtCore.QTimer()
    watchdog.setSingleShot(True)
    watchdog.timeout.connect(qapp.quit)  # before the fix a failure here skipped app.quit(): the run hung
    watchdog.start(10_000)
    hook = sys.excepthook
    t0 = time.perf_counter()
    try:
        rc = _show(qapp, win, args, runner=None)
    finally:
        watchdog.stop()
        win.timer.stop()
    assert time.perf_counter() - t0 < 5 and sys.excepthook is hook
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("kvscope: error:")]
    assert len(lines) == 1 and lines[0].startswith("kvscope: error: snap.json: cannot draw the snapshot"), err


def test_the_last_change_travels_in_the_file_and_older_files_open_without_it(tmp_path, good):
    """Issue 22 item 1: the counters at the last config change are saved and read back; a file from before they were
    kept (no last_change) still opens, with none; a damaged one is refused naming the field."""
    snap, _ = snapshot_io.load(good)
    last = snap.last_change
    assert last["changes"] == {"block_size": "8"} and last["n"] == 1
    assert 0 < last["counters"]["generated"] < snap.counters["generated"]
    doc = doc_of(good)
    del doc["snapshot"]["last_change"]
    older = tmp_path / "older.json"
    older.write_text(json.dumps(doc))
    assert snapshot_io.load(str(older))[0].last_change == {}
    doc = doc_of(good)
    doc["snapshot"]["last_change"]["counters"]["generated"] = -3
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(snapshot_io.SnapshotFileError, match=r"last_change\.counters\.generated: -3 is out of range"):
        snapshot_io.load(str(bad))


def test_the_windows_rates_travel_in_extra_checked(tmp_path, good):
    """Issue 22 item 3: a screenshot's JSON keeps the rates' lines the window drew (extra.rates), so the file redraws
    them; they are checked like the snapshot's own series."""
    snap, extra = snapshot_io.load(good)
    t = np.array([1.0, 2.0, 3.0])
    rates = {"t": t, "device_hit_rate_w": np.array([0.5, np.nan, 0.75])}
    again, got = snapshot_io.from_json(snapshot_io.to_json(snap, {**extra, "rates": rates, "workload": "demo"}))
    np.testing.assert_array_equal(got["rates"]["device_hit_rate_w"], rates["device_hit_rate_w"])
    assert got["workload"] == "demo"
    for bad, message in (({"t": t, "x": np.zeros(2)}, r"extra\.rates\.x: 2 points, expected 3"),
                         ({"t": t, "x": np.zeros(3, np.float32)}, r"extra\.rates\.x: expected a 1-D array of float64"),
                         ({"x": t}, r"extra\.rates: expected an object of time series"),
                         ({"t": np.array([1.0, np.nan, 2.0])}, r"extra\.rates\.t: holds NaN")):
        with pytest.raises(snapshot_io.SnapshotFileError, match=message):
            snapshot_io.from_json(snapshot_io.to_json(snap, {**extra, "rates": bad}))


@pytest.mark.subprocess
@pytest.mark.slow
def test_open_snapshot_of_a_screenshot_png_opens_the_json_beside_it_or_says_so(tmp_path, good):
    """Issue 22 item 3: `--open-snapshot shot.png` opens shot.json (saved beside it by the screenshot), or says to."""
    png = tmp_path / "shot.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n")
    out = kvscope("--headless", "--open-snapshot", str(png), "--screenshot", str(tmp_path / "out.png"), "--run-for", "1")
    assert_refused(out, str(png), "a screenshot, not a snapshot: open the .json saved beside it (shot.json is not in")
    with open(good, encoding="utf-8") as f:
        (tmp_path / "shot.json").write_text(f.read())
    out = kvscope("--headless", "--open-snapshot", str(png), "--screenshot", str(tmp_path / "out.png"), "--run-for", "1")
    assert out.returncode == 0, out.stderr
    assert f"{png} is a screenshot: opening {tmp_path / 'shot.json'}, the snapshot saved beside it" in out.stderr
    assert (tmp_path / "out.png").stat().st_size > 10_000
