"""Before Qt starts: a platform plugin that cannot load, or a display nobody answers, is an exit 2 with what to
do, not Qt's abort (exit 134) blaming xcb-cursor0."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from app.window import platform_check as pc


def _free_display() -> str:
    n = next(n for n in range(173, 400) if not os.path.exists(f"/tmp/.X11-unix/X{n}"))
    return f":{n}"


@pytest.mark.skipif(sys.platform != "linux", reason="the X11 check is Linux's")
def test_a_display_with_no_server_exits_2_with_advice():
    env = {k: v for k, v in os.environ.items() if k not in ("QT_QPA_PLATFORM", "WAYLAND_DISPLAY")}
    env["DISPLAY"] = _free_display()
    out = subprocess.run([sys.executable, "-m", "app.cli"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, (out.returncode, out.stderr[-500:])  # guards against: 134, Qt's abort
    assert out.stderr.startswith("kvscope: error:") and "--headless" in out.stderr
    assert "xcb-cursor0" not in out.stderr and "Traceback" not in out.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="the X11 check is Linux's")
def test_attach_checks_the_display_the_same_way():
    env = {k: v for k, v in os.environ.items() if k not in ("QT_QPA_PLATFORM", "WAYLAND_DISPLAY")}
    env["DISPLAY"] = _free_display()
    out = subprocess.run([sys.executable, "-m", "app.cli", "attach", "--vllm", "tcp://127.0.0.1:1"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 2, (out.returncode, out.stderr[-500:])
    assert out.stderr.startswith("kvscope: error:") and "kvscope attach ... --headless" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.skipif(not shutil.which("cc") and not shutil.which("gcc"), reason="needs a C compiler")
def test_a_plugin_whose_libraries_are_missing_is_named_with_the_packages(tmp_path, monkeypatch):
    """A stand-in plugin linked against a library that is then removed, as libqxcb.so is against
    libxcb-icccm.so.4 on a system without libxcb-icccm4."""
    cc = shutil.which("cc") or shutil.which("gcc")
    (tmp_path / "dep.c").write_text("int dep(void) { return 1; }\n")
    (tmp_path / "plugin.c").write_text("int dep(void);\nint plugin(void) { return dep(); }\n")
    dep = tmp_path / "libkvscope-test-icccm.so.4"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(dep), "-Wl,-soname,libkvscope-test-icccm.so.4",
                    str(tmp_path / "dep.c")], check=True)
    plugin = tmp_path / "libqfake.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(plugin), str(tmp_path / "plugin.c"), str(dep)], check=True)
    dep.unlink()
    assert pc.missing_libraries(str(plugin)) == ["libkvscope-test-icccm.so.4"]
    monkeypatch.setattr(pc, "xcb_plugin", lambda: str(plugin))
    msg = pc.window_problem({"DISPLAY": ":0"})
    assert msg.startswith("kvscope: error:")
    assert "libkvscope-test-icccm.so.4" in msg and "apt-get install libkvscope-test-icccm4" in msg
    assert "--headless" in msg


def test_ldd_output_and_package_names():
    ldd = ("\tlinux-vdso.so.1 (0x00007ffd)\n\tlibxcb-icccm.so.4 => not found\n"
           "\tlibQt6Core.so.6 => /x/libQt6Core.so.6 (0x7f)\n\tlibxcb-keysyms.so.1 => not found\n"
           "\tlibxcb-icccm.so.4 => not found\n")
    assert pc.parse_ldd(ldd) == ["libxcb-icccm.so.4", "libxcb-keysyms.so.1"]
    assert [pc.debian_package(s) for s in ("libxcb-icccm.so.4", "libxcb-keysyms.so.1", "libxcb-cursor.so.0",
                                           "libxkbcommon-x11.so.0", "libX11-xcb.so.1", "libEGL.so.1")] == [
        "libxcb-icccm4", "libxcb-keysyms1", "libxcb-cursor0", "libxkbcommon-x11-0", "libx11-xcb1", "libegl1"]


def test_other_platforms_are_left_to_qt():
    assert pc.window_problem({"QT_QPA_PLATFORM": "offscreen"}) is None
    assert pc.window_problem({"WAYLAND_DISPLAY": "wayland-0"}) is None
    if sys.platform == "linux":
        assert pc.window_problem({}) == pc.NO_DISPLAY
