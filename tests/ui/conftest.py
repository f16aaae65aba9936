"""Fixtures the window and widget tests share: a started engine runner behind a window, the app's own style, and a
shown block map. tests/ui/ mirrors ui/: tests/ui/attach/, block_map/, charts/, panels/, and here the windows."""

from __future__ import annotations

import pytest


@pytest.fixture
def runner(llama_model):
    """A started EngineRunner on the tiny Llama, for the window tests: small pools (block size 4, 0.3 MiB device,
    1 MiB host) so that a test's few prompts fill, evict and migrate; stopped after the test."""
    from app.window.runner import EngineRunner
    from engine.config import CacheConfig, EngineOptions
    from engine.runtime.engine import Engine

    eng = Engine(llama_model, CacheConfig(block_size=4, device_budget_mb=0.3, host_budget_mb=1),
                 EngineOptions(context_limit=256))
    r = EngineRunner(eng).start()
    yield r
    r.stop()


@pytest.fixture
def app_style(qapp):
    """The app's own palette, font and style sheet (widths and heights depend on them), restored after."""
    from app.window.launch import _style

    saved = (qapp.styleSheet(), qapp.palette(), qapp.font())
    _style(qapp)
    yield qapp
    qapp.setStyleSheet(saved[0])
    qapp.setPalette(saved[1])
    qapp.setFont(saved[2])


@pytest.fixture
def bm(qtbot):
    """A block map widget at 800 x 420, shown."""
    from ui.block_map.widget import BlockMap

    w = BlockMap()
    qtbot.addWidget(w)
    w.resize(800, 420)
    w.show()
    qtbot.waitExposed(w)
    return w
