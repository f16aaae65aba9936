"""The attach window, offscreen, on a fake publisher: one map per endpoint / rank / medium, what events cannot
tell said plainly, "no data" where a metric is absent, malformed frames counted and never fatal, tooltips (with
decoded text given a tokenizer), File → Attach…, and a screenshot."""

from __future__ import annotations

import os
import re
import time

import pytest

pytest.importorskip("pytestqt")

from PySide6 import QtGui  # noqa: E402

from engine.attach import codes  # noqa: E402
from engine.attach.fake.spawn import FakeProcess  # noqa: E402
from engine.attach.session import AttachSession  # noqa: E402
from engine.attach.source import parse_source  # noqa: E402
from ui.attach.window import AttachWindow  # noqa: E402
from workers import ROOT  # noqa: E402


@pytest.fixture
def fake():
    f = FakeProcess("--flavor", "vllm", "--encoding", "map", "--dp", "2", "--cpu-offload", "200", "--rate", "1500",
                    "--batch", "20", "--duration", "4", "--capacity", "400", "--malformed-every", "5",
                    "--metrics-port", "0", "--kv-cache-metrics", "--linger", "5")
    yield f
    f.stop()


def _tokenizer(tmp_path) -> str:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(32000)} | {"[UNK]": 32000}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    return path


def _until(qtbot, pred, timeout_ms=20000):
    qtbot.waitUntil(pred, timeout=timeout_ms)


def test_window_on_a_live_fake_publisher(qtbot, fake, tmp_path):
    from engine.attach.tokens import TokenText

    specs = parse_source("vllm", f"{fake.pub},dp=2,name=fake,metrics={fake.metrics}")
    session = AttachSession(specs, []).start()
    win = AttachWindow(session, TokenText(_tokenizer(tmp_path)), owns_session=True, refresh_ms=50)
    qtbot.addWidget(win)
    win.show()
    try:
        _until(qtbot, lambda: len(win.map.label_texts()) == 4 and win.frames > 30
               and sum(s.malformed for s in win.last_frame.statuses) >= 4)
        win.refresh_all()
        labels = win.map.label_texts()
        assert [lab.split("   ")[0] for lab in labels] == ["fake/dp0  rank 0  GPU", "fake/dp0  rank 0  CPU",
                                                          "fake/dp1  rank 1  GPU", "fake/dp1  rank 1  CPU"]
        assert "of 400 (num_gpu_blocks, /metrics)" in labels[0] and "capacity: not in the events" in labels[1]
        banner = win.banner.text()
        for phrase in ("not by physical slot", "in flight", "per-request block tables", "Cache hits are not published"):
            assert phrase in banner
        # malformed frames are counted in the sources table and said in the events panel; frames keep coming
        assert int(win.sources.item(0, 4).text().replace(",", "")) >= 2
        assert any(" malformed " in line for line in win.events.lines())
        frames = win.frames
        _until(qtbot, lambda: win.frames > frames + 5)
        # tooltips: a resident block (decoded tokens) and an empty cell, once the stream has stopped
        _until(qtbot, fake.done)
        time.sleep(0.3)
        win.refresh_all()
        g = win.last_frame.snap.groups[0]
        cell = int((g.codes != codes.EMPTY_CODE).argmax())
        tip = win.map.tooltip_for(0, cell)
        assert "stored" in tip and re.search(r"w\d+ w\d+ w\d+", tip) and "not in the events" in tip
        empty = int((g.codes == codes.EMPTY_CODE).argmax())
        assert "not a free slot" in win.map.tooltip_for(0, empty)
        # every colour mode draws
        for mode in ("idle", "heat", "reuse", "family", "depth", "age"):
            win.map.set_mode(mode)
            win.refresh_all()
            assert win.last_frame.snap.mode == mode
            assert (win.map.group_codes(0) != codes.EMPTY_CODE).sum() == g.resident or mode != "age"
        win.map.set_mode("family")
        win.refresh_all()
        legend = win.map.legend.text()
        assert re.search(r"w\d+ w\d+", legend) and "families (colour: id mod 32)" in legend  # roots' text
        _until(qtbot, lambda: win.metrics.text_of(1, 0) not in ("", "no data"))
        assert "/" in win.metrics.text_of(1, 0)  # vLLM's lifetime histogram: p50 / p90
        png = str(tmp_path / "shot.png")
        win.save_screenshot(png)
        img = QtGui.QImage(png)
        assert img.width() >= 1000 and img.height() >= 600 and os.path.getsize(png) > 20_000
    finally:
        win.close()
    assert session._stopped


def test_metrics_absent_say_no_data_not_zero(qtbot):
    from engine.attach.metrics import parse_metrics
    from ui.attach.panels import MetricsPanel

    p = MetricsPanel(["sglang-a"])
    qtbot.addWidget(p)
    from engine.attach.metrics import rates

    s = parse_metrics('sglang:token_usage{tp_rank="0"} 0.5\nsglang:cache_hit_rate{tp_rank="0"} 0.25\n', t=time.time())
    p.update_metrics(time.time(), [[rates(None, s)]], [s], [None], {}, 1.0)
    assert p.preempt.note.startswith("no data")  # SGLang exposes no preemption counter
    assert p.hit.note == "" and p.usage.note == ""
    assert [p.text_of(r, c) for r in (0, 1) for c in range(3)] == ["no data"] * 6


def test_file_attach_dialog_parses_lines_and_opens_a_window(qtbot, fake):
    from engine.attach.source import SourceError
    from ui.attach.dialog import AttachDialog, open_attach_window, parse_lines

    assert [s.label for s in parse_lines(f"# comment\nvllm {fake.pub},dp=2,name=x\n\nsglang tcp://h:1")] == \
        ["x/dp0", "x/dp1", "h:1"]
    with pytest.raises(SourceError, match="line 1"):
        parse_lines("vllm tcp://*:5557")
    dlg = AttachDialog()
    qtbot.addWidget(dlg)
    dlg.sources.setPlainText("vllm nonsense")
    dlg.accept()
    assert "line 1" in dlg.error.text() and dlg.result_value is None
    dlg.sources.setPlainText(f"vllm {fake.pub},dp=2,name=dialog")
    win = open_attach_window(None, in_process=True, dialog=dlg)
    qtbot.addWidget(win)
    try:
        _until(qtbot, lambda: win.frames > 3 and len(win.map.label_texts()) >= 2)
        assert win.map.label_texts()[0].startswith("dialog/dp0")
    finally:
        win.close()


def test_main_window_file_menu_opens_the_attach_dialog():
    import inspect

    from ui import main_window

    src = inspect.getsource(main_window.MainWindow._menus)
    assert "Attach" in src and "open_attach_window(self)" in src


@pytest.mark.parametrize("avail", [(0, 0, 1280, 720), (0, 0, 1366, 728), (0, 24, 1440, 876), (0, 0, 1920, 1040),
                                   (1920, 0, 2560, 1400)])
def test_the_window_opens_fitted_to_the_free_area_of_the_screen(qtbot, monkeypatch, avail):
    """show_fitted, as the main window's (ui/dock_layout.fitted_geometry): 1400 x 900 centred where it fits with
    room for a title bar, else all of the free area, maximized (guards against: 1400 x 900 at +0+0 whatever the screen,
    the Metrics dock's right side, the Sources / Events docks and the status bar off a 1280 x 720 screen)."""
    from PySide6 import QtCore

    from ui.attach.window import WANT_SIZE

    free = QtCore.QRect(*avail)
    monkeypatch.setattr(QtGui.QScreen, "availableGeometry", lambda self: QtCore.QRect(free))
    session = AttachSession(parse_source("vllm", "tcp://127.0.0.1:47971,dp=2"),
                            ["http://127.0.0.1:47975/metrics"]).start()  # nothing there: it only connects
    win = AttachWindow(session, None, owns_session=True)
    qtbot.addWidget(win)
    try:
        assert win.minimumSizeHint().width() <= free.width() and win.minimumSizeHint().height() <= free.height()
        win.show_fitted()
        qtbot.waitExposed(win)
        small = WANT_SIZE.width() > free.width() or WANT_SIZE.height() + 40 > free.height()
        assert bool(win.windowState() & QtCore.Qt.WindowMaximized) == small
        # (maximized, the offscreen platform takes a screen of its own: the geometry asked for is the normal one)
        placed = win.normalGeometry() if small else win.geometry()
        assert free.contains(placed), placed
        if small:
            assert placed == free
        else:
            assert placed.size() == WANT_SIZE and placed.center() == free.center()
        # At that size the map, every dock and the status bar show whole, none over another.
        win.setWindowState(QtCore.Qt.WindowNoState)
        win.resize(placed.size())
        win.refresh_all()
        qtbot.wait(50)
        assert win.size() == placed.size()
        behind = {n for n, d in win.docks.items() if d.visibleRegion().isEmpty()}  # tabs not raised
        assert behind == {"Re-stores"} and win.tabifiedDockWidgets(win.docks["Re-stores"]) == [win.docks["Events"]]
        rects = {n: d.geometry() for n, d in win.docks.items() if n not in behind}
        rects["map"] = win.centralWidget().geometry()
        rects["status bar"] = win.statusBar().geometry()
        for n, r in rects.items():
            assert r.width() > 0 and r.height() > 0 and win.rect().contains(r), (n, r, win.rect())
            for m, other in rects.items():
                assert m == n or not r.intersects(other), (n, m)
        for n, d in win.docks.items():
            assert d.width() >= d.minimumSizeHint().width() and d.height() >= d.minimumSizeHint().height(), n
    finally:
        win.close()


def test_sources_table_columns_fit_their_text_without_resize_to_contents(qtbot):
    """The table sizes its own columns (ResizeToContents measured every cell on each setText: a frame's worth
    in the soak): a text longer than its column widens it, the rows changing fits them afresh."""
    from PySide6 import QtWidgets

    from engine.attach.subscriber import SourceStatus
    from ui.attach.panels import SourcesPanel

    def st(label, frames=0):
        return SourceStatus(label=label, endpoint="tcp://h:1", replay=None, frames=frames, malformed=0, batches=0,
                            duplicates=0, gaps=0, recovered=0, lost=0, history=0, history_missing=0, first_seq=None,
                            last_seq=None, restarts=0, last_frame_age_s=None, lost_ranges=())

    p = SourcesPanel()
    qtbot.addWidget(p)
    p.resize(900, 200)
    p.show()
    assert p.horizontalHeader().sectionResizeMode(0) == QtWidgets.QHeaderView.Interactive
    p.update_status([st("a")], [0], [0])
    narrow = p.columnWidth(0)
    long = "a-very-long-endpoint-label.example.internal:5557/dp12"
    p.update_status([st(long)], [0], [0])  # same rows, a longer text: the column grows to hold it
    assert p.columnWidth(0) >= p.fontMetrics().horizontalAdvance(long) > narrow
    p.update_status([st("a"), st("b")], [0, 0], [0, 0])  # the rows changed: fitted to what they hold now
    assert p.columnWidth(0) < p.fontMetrics().horizontalAdvance(long)
    p.update_status([st("a", 10 ** 12), st("b")], [0, 0], [0, 0])
    assert p.columnWidth(1) >= p.fontMetrics().horizontalAdvance(f"{10 ** 12:,}")


def test_metrics_charts_and_table_take_their_own_frames(qtbot, fake):
    """A scrape's metrics reach the charts at the charts' slot and the table at the table's, never both in one
    frame; refresh_all shows both at once."""
    from ui.attach import window as aw
    specs = parse_source("vllm", f"{fake.pub},dp=2,name=fake,metrics={fake.metrics}")
    session = AttachSession(specs, []).start()
    win = AttachWindow(session, owns_session=True, refresh_ms=10_000)  # the test drives the frames
    qtbot.addWidget(win)
    calls = []
    win.metrics.update_charts = lambda *a: calls.append(("charts", win.frames % aw.SLOW_EVERY))
    win.metrics.update_table = lambda *a: calls.append(("table", win.frames % aw.SLOW_EVERY))
    try:
        deadline = time.monotonic() + 20
        while len(calls) < 4 and time.monotonic() < deadline:
            win.refresh()
            time.sleep(0.05)
        assert {c for c in calls if c[0] == "charts"} == {("charts", 1)}
        assert {c for c in calls if c[0] == "table"} == {("table", 3)}
        calls.clear()
        win.refresh_all()
        assert sorted(k for k, _ in calls) == ["charts", "table"] or calls == []  # nothing new since: nothing due
    finally:
        win.close()


def test_the_status_line_and_the_sources_table_count_the_same_events(qtbot, fake):
    """Both come from one frame: the status line's 'events applied' is the Sources table's events column summed,
    at every frame while the stream runs (they came from frames 0.2 s apart and disagreed by hundreds)."""
    import re

    specs = parse_source("vllm", f"{fake.pub},dp=2,name=fake")
    session = AttachSession(specs, []).start()
    win = AttachWindow(session, owns_session=True, refresh_ms=10_000)  # the test drives the frames
    qtbot.addWidget(win)
    try:
        col = [win.sources.horizontalHeaderItem(c).text() for c in range(win.sources.columnCount())].index("events")
        checked = 0
        deadline = time.monotonic() + 20
        while checked < 12 and time.monotonic() < deadline:
            win.refresh()
            time.sleep(0.03)
            m = re.search(r"([\d,]+) events applied", win.status.text())
            if m is None or win.sources.rowCount() == 0:
                continue
            table = sum(int(win.sources.item(r, col).text().replace(",", "")) for r in range(win.sources.rowCount()))
            status = int(m.group(1).replace(",", ""))
            if status:
                assert status == table, (status, table, win.status.text())
                checked += 1
        assert checked >= 12
    finally:
        win.close()


def test_ctrl_q_closes_the_attach_window(qtbot):
    """Issue 22 item 5: Ctrl+Q quits there too (`kvscope attach` ends with its window), as in the main window."""
    from PySide6 import QtCore

    session = AttachSession(parse_source("vllm", "tcp://127.0.0.1:47981"), []).start()  # nothing there
    win = AttachWindow(session, None, owns_session=True)
    qtbot.addWidget(win)
    win.show()
    win.activateWindow()
    qtbot.waitActive(win)
    assert win.isVisible()
    # To the window's QWindow: through the window system's key path, where shortcuts are matched (a key event sent to
    # the widget skips them on the offscreen platform).
    qtbot.keyClick(win.windowHandle(), QtCore.Qt.Key_Q, QtCore.Qt.ControlModifier)
    qtbot.waitUntil(lambda: not win.isVisible(), timeout=2000)
    assert not win.timer.isActive()


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_the_demos_publishers_die_with_kvscope_attach_whatever_ends_it(tmp_path, how):
    """Issue 22 item 5: `kvscope attach --demo` stopped by SIGTERM or Ctrl+C (SIGINT) left its fake publishers
    running (duration 1e9, ~12 % CPU each). Now SIGTERM and SIGINT close the window and stop them (exit 143 / 130),
    and even a SIGKILL, which runs nothing, ends them: each watches a pipe from its parent that the kernel closes."""
    import contextlib
    import signal
    import subprocess
    import sys

    import psutil

    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    parent = subprocess.Popen([sys.executable, "-m", "app.cli", "attach", "--demo", "--headless", "--screenshot",
                               str(tmp_path / "never.png"), "--run-for", "120"], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    children = []
    try:
        def publishers() -> list:
            return [p for p in _descendants(parent.pid) if "engine.attach.fake.publisher" in " ".join(p.cmdline())]

        for line in parent.stderr:  # the publishers and the ingest process are up, then the window
            if line.startswith("[kvscope] attached (offscreen)"):
                break
        else:
            raise AssertionError(f"kvscope attach ended: {parent.wait()}")
        time.sleep(1.0)  # its frames flowing
        children = _descendants(parent.pid)  # the publishers and the ingest process (and what it started)
        assert len(publishers()) == 2 and len(children) >= 3, [p.cmdline() for p in children]
        parent.send_signal(getattr(signal, how))
        rc = parent.wait(timeout=20)
        if how != "SIGKILL":
            assert rc == 128 + getattr(signal, how), parent.stderr.read()
            assert "Traceback" not in parent.stderr.read()
        gone, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, [(p.pid, p.cmdline()) for p in alive]
    finally:  # (on a failure: none left behind)
        for p in children + _descendants(parent.pid):
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        if parent.poll() is None:
            parent.kill()
        parent.wait()
