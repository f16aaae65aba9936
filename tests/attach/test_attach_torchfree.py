"""Attach needs no torch: every attach module imports, and `kvscope attach` runs, in a process where importing
torch or transformers fails (an import-linter contract keeps engine.attach that way too)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BLOCK = "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", BLOCK + code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_every_attach_module_imports_without_torch():
    mods = [f"engine.attach.{m[:-3]}" for m in sorted(os.listdir(os.path.join(ROOT, "engine", "attach")))
            if m.endswith(".py") and m != "__init__.py"]
    mods += ["ui.attach.window", "ui.attach.dialog", "app.attach", "app.bench.attach_soak"]
    out = _run("import importlib\n"
               f"for m in {mods!r}:\n"
               "    importlib.import_module(m)\n"
               "assert sys.modules['torch'] is None and sys.modules['transformers'] is None\n"
               "print(len(sys.modules))")
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(mods) >= 18


def test_kvscope_attach_runs_without_torch():
    out = _run("from app.cli import main\n"
               "rc = main(['attach', '--vllm', 'tcp://127.0.0.1:9', '--headless', '--run-for', '0.3', '--json'])\n"
               "assert rc == 0, rc\n")
    assert out.returncode == 0, out.stderr[-2000:]
    assert '"sources"' in out.stdout


def test_bad_endpoints_are_one_line_errors():
    out = _run("from app.cli import main\n"
               "sys.exit(main(['attach', '--vllm', 'tcp://*:5557']))\n")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("kvscope attach: error:")
    assert "bind address" in out.stderr
