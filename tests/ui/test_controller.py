"""Both controllers behind the window (ui/controller.py): the live engine's runner and a saved snapshot answer every
call of the `Controller` protocol with the parameters the window passes; a saved snapshot refuses or ignores
commands."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from app.window.runner import EngineRunner
from engine.config import CacheConfig, ConfigError
from engine.errors import RequestError
from ui.controller import Controller, SnapshotController

METHODS = sorted(n for n, v in vars(Controller).items() if callable(v) and not n.startswith("_"))
FIELDS = sorted(n for n in Controller.__annotations__)


def test_the_protocol_names_what_the_window_calls():
    assert "is_lossy" in METHODS and "reconfigure" in METHODS and FIELDS == ["engine_paused", "read_only"]


@pytest.mark.parametrize("cls", [EngineRunner, SnapshotController])
@pytest.mark.parametrize("name", METHODS)
def test_each_controller_takes_the_protocols_parameters(cls, name):
    """Every parameter of the protocol's method, by the same name and kind; any more must have defaults."""
    want = inspect.signature(getattr(Controller, name)).parameters
    impl = getattr(cls, name)
    assert getattr(impl, "__qualname__", "").startswith(cls.__name__ + "."), f"{cls.__name__}.{name} is not its own"
    have = inspect.signature(impl).parameters
    for p in want.values():
        assert p.name in have and have[p.name].kind == p.kind, (cls.__name__, name, p.name)
    extra = [p for n, p in have.items() if n not in want]
    assert all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in extra), extra


def test_each_controller_has_the_protocols_fields():
    runner = EngineRunner(SimpleNamespace())
    saved = SnapshotController(SimpleNamespace(config={}), {})
    for c in (runner, saved):
        assert all(isinstance(getattr(c, f), bool) for f in FIELDS)
    assert saved.read_only and not runner.read_only


def test_a_saved_snapshot_refuses_or_ignores_every_command(tmp_path):
    saved = SnapshotController(SimpleNamespace(config={"block_size": 8}), {"workload": "demo"})
    assert saved.config() == CacheConfig(block_size=8) and not saved.is_lossy({"kv_dtype": "int8"})
    with pytest.raises(ConfigError, match="read-only"):
        saved.reconfigure(block_size=4)
    for call in (lambda: saved.submit_prompt("hi", False, 4), lambda: saved.replay_trace(str(tmp_path / "t.jsonl"))):
        with pytest.raises(RequestError, match="read-only"):
            call()
    assert saved.take_events() == [] and saved.take_tokens() == [] and saved.stop_trace("x.npz") == 0
    assert saved.workload_name() == "demo (saved)" and saved.rates is None
