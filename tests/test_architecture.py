"""The layering rules of the brief, enforced by import-linter's contracts in pyproject.toml."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_contracts_hold():
    exe = shutil.which("lint-imports") or os.path.join(os.path.dirname(sys.executable), "lint-imports")
    out = subprocess.run([exe, "--config", os.path.join(ROOT, "pyproject.toml")], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "5 kept, 0 broken" in out.stdout
    assert "layers: app above ui above engine KEPT" in out.stdout
