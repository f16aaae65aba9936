"""Can Qt open a window here? Asked before a QApplication exists.

When Qt's X11 platform plugin (xcb) cannot load, or DISPLAY names no running server, Qt aborts the process
(exit 134) and blames xcb-cursor0 whatever is really missing. Here the same conditions are found first, by
asking the dynamic linker which of the plugin's libraries do not resolve and by connecting to the display,
so the app can say what to install (or to run --headless) and exit 2.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys

HEADLESS = ("  Or run it without a window: kvscope --headless --screenshot kvscope.png --run-for 20\n"
            "  (the demo workload runs offscreen for 20 s, then the PNG and its snapshot JSON are written).")

NO_DISPLAY = (
    "kvscope: no display found (DISPLAY / WAYLAND_DISPLAY are unset), so the window cannot open.\n"
    "  Run it headless instead, e.g.:\n"
    "    kvscope --headless --screenshot kvscope.png --run-for 20\n"
    "  (runs the demo workload offscreen for 20 s, then writes the PNG and its snapshot JSON), or give it a\n"
    "  display (a desktop session, ssh -X, or xvfb-run kvscope)."
)


def window_problem(env: dict | None = None) -> str | None:
    """Why no window can open with this environment, as a message for the user; None if nothing is wrong
    that can be seen before Qt starts. Only Linux's X11 plugin is checked (other platforms, Wayland and
    QT_QPA_PLATFORM=offscreen and the like are left to Qt)."""
    env = os.environ if env is None else env
    if sys.platform != "linux":
        return None
    platform = env.get("QT_QPA_PLATFORM", "").split(":")[0].split(";")[0]
    if platform and platform != "xcb":
        return None
    display = env.get("DISPLAY", "")
    if not platform and env.get("WAYLAND_DISPLAY") and (not display or env.get("XDG_SESSION_TYPE") == "wayland"):
        return None  # Qt picks its Wayland plugin
    if not display:
        return NO_DISPLAY
    plugin = xcb_plugin()
    missing = missing_libraries(plugin) if plugin else []
    if missing:
        return missing_message(missing)
    error = display_error(display)
    if error:
        return (f"kvscope: error: cannot connect to the X display DISPLAY={display} ({error}), so the window "
                f"cannot open.\n  Start an X server there or point DISPLAY at one (for a virtual one: xvfb-run "
                f"kvscope).\n{HEADLESS}")
    return None


def missing_message(missing: list[str]) -> str:
    packages = " ".join(debian_package(s) for s in missing)
    return (f"kvscope: error: Qt's X11 platform plugin (xcb) cannot load: the system lacks "
            f"{', '.join(missing)}.\n  On Debian or Ubuntu install them with: sudo apt-get install {packages}\n"
            f"  (other systems: the packages that provide those files).\n{HEADLESS}")


def xcb_plugin() -> str | None:
    """The path of Qt's xcb platform plugin in the installed PySide6, or None."""
    from PySide6 import QtCore

    path = os.path.join(QtCore.QLibraryInfo.path(QtCore.QLibraryInfo.LibraryPath.PluginsPath), "platforms",
                        "libqxcb.so")
    return path if os.path.isfile(path) else None


def missing_libraries(path: str) -> list[str]:
    """The shared libraries `path` needs that the dynamic linker cannot find (sonames, in ldd's order)."""
    ldd = shutil.which("ldd")
    if ldd:
        try:
            out = subprocess.run([ldd, path], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            out = None
        if out is not None:
            return parse_ldd(out)
    try:  # no ldd: load it; the linker names the first library it cannot find
        ctypes.CDLL(path, mode=os.RTLD_LAZY)
    except OSError as e:
        m = re.search(r"([\w.+-]+\.so[\w.]*): cannot open shared object file", str(e))
        return [m.group(1)] if m else []
    return []


def parse_ldd(text: str) -> list[str]:
    """Sonames that ldd reports as "not found", each once."""
    found = re.findall(r"^\s*(\S+)\s*=>\s*not found", text, flags=re.M)
    return list(dict.fromkeys(found))


def debian_package(soname: str) -> str:
    """The Debian/Ubuntu package that ships a library, by the distribution's naming rule:
    libxcb-icccm.so.4 -> libxcb-icccm4, libxkbcommon-x11.so.0 -> libxkbcommon-x11-0."""
    base, _, version = soname.partition(".so")
    version = version.lstrip(".").split(".")[0]
    base = base.lower()
    if not version:
        return base
    return f"{base}-{version}" if base[-1].isdigit() else f"{base}{version}"


def display_error(display: str) -> str | None:
    """None if an X server answers on `display`, else why not (libxcb's connection error, in words)."""
    try:
        xcb = ctypes.CDLL("libxcb.so.1")
    except OSError:
        return None  # then the plugin check above has said what is missing
    xcb.xcb_connect.restype = ctypes.c_void_p
    xcb.xcb_connect.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]
    xcb.xcb_connection_has_error.argtypes = [ctypes.c_void_p]
    xcb.xcb_disconnect.argtypes = [ctypes.c_void_p]
    conn = xcb.xcb_connect(display.encode(), None)
    try:
        code = xcb.xcb_connection_has_error(conn) if conn else 1
    finally:
        if conn:
            xcb.xcb_disconnect(conn)
    if not code:
        return None
    reasons = {1: "no X server answers there", 2: "the server lacks an extension", 3: "out of memory",
               4: "a request was too long", 5: "the display name cannot be parsed",
               6: "no such screen on that server", 7: "file descriptor passing failed"}
    return reasons.get(code, f"connection error {code}")
