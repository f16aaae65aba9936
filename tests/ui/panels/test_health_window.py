"""The health strip and the Diagnostics tab on a real engine (tiny model), offscreen: "no data" where nothing was
counted, colours against the targets the Controls set, the links, presets and screenshots."""

from __future__ import annotations

import dataclasses
import math

import pytest
from PySide6 import QtCore

from app.window.runner import EngineRunner
from engine.config import CacheConfig, EngineOptions
from engine.runtime.engine import Engine
from engine.sequence import SamplingParams
from engine.telemetry.health import HealthTargets
from tiny_models import prompts
from ui.panels.diagnostics import DiagnosticsPanel
from ui.panels.health import GRADE_COLOURS, HealthStrip


@pytest.fixture
def engine(llama_model):
    now = [100.0]
    eng = Engine(llama_model, CacheConfig(block_size=4, device_budget_mb=0.3, host_budget_mb=1),
                 EngineOptions(context_limit=256), clock=lambda: now[0])
    eng.fake_now = now
    return eng


@pytest.fixture
def window(qtbot, llama_model):
    from ui.main_window import MainWindow

    eng = Engine(llama_model, CacheConfig(block_size=4, device_budget_mb=0.3, host_budget_mb=1),
                 EngineOptions(context_limit=256))
    runner = EngineRunner(eng).start()
    win = MainWindow(runner, confirm_lossy=lambda dtype: True)
    qtbot.addWidget(win)
    win.show()
    yield win
    runner.stop()


def _steps(eng, n: int, dt: float = 1.0) -> None:
    for _ in range(n):
        eng.fake_now[0] += dt
        eng.step()


def test_nothing_counted_reads_no_data_never_0(qtbot, engine):
    strip, diag = HealthStrip(), DiagnosticsPanel()
    qtbot.addWidget(strip)
    qtbot.addWidget(diag)
    snap = engine.snapshot()
    strip.update_snapshot(snap)
    diag.update_snapshot(snap)
    for name in ("prefix_hit_rate", "block_utilization", "eviction_rate"):
        assert "no data" in strip.text(name) and "0.0 %" not in strip.text(name), strip.text(name)
        assert strip.grade(name) == "none"
    assert "leaks no data" in strip.text("checklist") and "lock no data" in strip.text("checklist")
    assert all(grade == "none" for _, grade, _, _ in diag.rows)
    assert "drops no data" in strip.text("checklist") and "evict no data" in strip.text("checklist")
    assert "no data (not checked yet)" in diag.text.text()
    old = dataclasses.replace(snap, health={})  # a file from before health was counted
    strip.update_snapshot(old)
    diag.update_snapshot(old)
    assert "no data" in strip.text("prefix_hit_rate") and {g for _, g, _, _ in diag.rows} == {"none"}


def test_the_strip_grades_against_the_targets(qtbot, engine):
    strip = HealthStrip()
    qtbot.addWidget(strip)
    sid = engine.add_request(prompts(1, [10])[0], SamplingParams(max_new_tokens=30, ignore_eos=True))
    _steps(engine, 2)  # 10, then 11 tokens in 3 blocks of 4: (10 + 11) / 24; one prompt, nothing reused: 0 %
    strip.update_snapshot(engine.snapshot())
    assert engine.seqs[sid].num_cached == 11
    assert "dev 87.5 % 5 s · 87.5 % all · host no data" in strip.text("block_utilization")
    assert strip.grade("block_utilization") == "green"
    # The prompt came before the 5 s window's first sample: no data there; since start, 0 of 10 reused.
    assert strip.text("prefix_hit_rate").endswith("no data 5 s · 0.0 % all")
    assert strip.grade("prefix_hit_rate", "all") == "red" and strip.grade("prefix_hit_rate") == "none"
    seg = dict(strip.segments("prefix_hit_rate"))
    assert seg["0.0 %"] == GRADE_COLOURS["red"] and seg["no data"] == GRADE_COLOURS["none"]
    strip.set_targets(HealthTargets(block_utilization=0.95, prefix_hit_rate=0.0))
    assert strip.grade("block_utilization") == "amber" and strip.grade("prefix_hit_rate", "all") == "green"
    assert "≥95%" in strip.text("block_utilization")
    assert "blocks evicted (dropped from the cache" in strip.tooltip("eviction_rate")


def test_a_leak_turns_the_checklist_red_and_names_the_block(qtbot, engine):
    strip, diag = HealthStrip(), DiagnosticsPanel()
    qtbot.addWidget(strip)
    qtbot.addWidget(diag)
    sid = engine.add_request(prompts(2, [10])[0], SamplingParams(max_new_tokens=30, ignore_eos=True))
    _steps(engine, 1)
    engine.check_health()
    strip.update_snapshot(engine.snapshot())
    assert strip.grade("checklist") == "green" and "leaks 0" in strip.text("checklist")
    lid = engine.seqs[sid].blocks[0]
    engine.pool.incref(lid)
    engine.check_health()
    engine.check_health()
    snap = engine.snapshot()
    strip.update_snapshot(snap)
    diag.update_snapshot(snap)
    assert strip.grade("checklist") == "red" and "leaks 1" in strip.text("checklist")
    leak_row = diag.rows[0]
    assert leak_row[1] == "red" and f"block {lid} (device slot" in leak_row[2]


def test_chips_link_to_their_panels(qtbot, window):
    strip = window.health
    window.refresh_all()
    qtbot.wait(50)
    assert window.block_map.mode() == "state"
    rects = strip._layout()
    qtbot.mouseClick(strip, QtCore.Qt.LeftButton, pos=rects["block_utilization"].center().toPoint())
    assert window.block_map.mode() == "fill"  # utilization reads the block map in fill mode
    qtbot.mouseClick(strip, QtCore.Qt.LeftButton, pos=rects["checklist"].center().toPoint())
    qtbot.wait(50)
    assert "Diagnostics" in window.front_tabs()
    window.docks["Heat"].raise_()
    qtbot.mouseClick(strip, QtCore.Qt.LeftButton, pos=rects["eviction_rate"].center().toPoint())
    qtbot.wait(50)
    assert "Diagnostics" in window.front_tabs()


def test_targets_from_the_controls_and_presets(qtbot, window, tmp_path):
    c = window.controls
    box = c.target_boxes["block_utilization"]
    box.setText("80")
    box.editingFinished.emit()
    assert window.health.targets.block_utilization == pytest.approx(0.80)
    box.setText("250")  # out of range: the validator keeps it from being taken; the box shows the target again
    c._target_typed("block_utilization", box)
    assert window.health.targets.block_utilization == pytest.approx(0.80) and box.text() == "80"
    path = str(tmp_path / "p.toml")
    c.save_preset(path)
    assert "[health]" in open(path).read()
    c.set_targets(HealthTargets())
    assert c.load_preset(path) and window.health.targets.block_utilization == pytest.approx(0.80)
    bad = tmp_path / "bad.toml"
    bad.write_text("block_size = 8\n[health]\neviction_rate = 3\n")
    before = window.controller.config().block_size
    assert not c.load_preset(str(bad))  # refused whole: the knob is not applied either
    assert window.controller.config().block_size == before and "eviction_rate" in c.message.toolTip()
    assert window.health.targets.block_utilization == pytest.approx(0.80)


def test_screenshots_carry_the_strip_and_reopen_with_it(qtbot, window, tmp_path):
    from ui.main_window import open_snapshot_window

    eng = window.controller.engine
    for p in prompts(3, [30, 20]):
        eng.add_request(p, SamplingParams(max_new_tokens=40, ignore_eos=True))
    qtbot.waitUntil(lambda: eng.counters.generated > 20, timeout=20_000)
    window.controls.set_targets(HealthTargets(eviction_rate=0.2))
    json_path = window.save_screenshot(str(tmp_path / "shot.png"))
    shot = window.grab()
    strip_rect = window.health.geometry()
    assert shot.rect().contains(strip_rect) and strip_rect.width() >= 600  # in the picture, at the top
    texts = {n: window.health.text(n) for n in ("prefix_hit_rate", "block_utilization", "eviction_rate")}
    ro = open_snapshot_window(json_path)
    qtbot.addWidget(ro)
    ro.refresh_all()
    assert ro.controls.targets.eviction_rate == pytest.approx(0.2)
    assert ro.snapshot.health["block_utilization"]["w"] == pytest.approx(
        window.snapshot.health["block_utilization"]["w"])
    assert {n: ro.health.text(n) for n in texts} == texts
    assert not math.isnan(ro.snapshot.health["lock_wait"]["step"]["p99_s"])
