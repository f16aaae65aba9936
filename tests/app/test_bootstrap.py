"""The set-up script checks what the window needs before it installs anything (issue 22 item 7): a machine without
Qt's X11 libraries was told so after 5 minutes of installing."""

from __future__ import annotations

import pytest

import app.bootstrap as bootstrap

MISSING = ["libxcb-icccm.so.4", "libxcb-keysyms.so.1"]


def failing_for(names):
    def load(name):
        if name in names:
            raise OSError(f"{name}: cannot open shared object file")
    return load


def test_the_missing_libraries_are_named():
    assert bootstrap.missing_window_libraries(load=failing_for(MISSING)) == MISSING
    assert bootstrap.missing_window_libraries(load=failing_for([])) == []
    assert set(MISSING) <= set(bootstrap.QT_XCB_LIBRARIES)


@pytest.fixture
def no_install(monkeypatch):
    """ensure_env fails the test if called: the check must come first."""
    def ensure_env():
        raise AssertionError("installed before the window check")
    monkeypatch.setattr(bootstrap, "ensure_env", ensure_env)
    monkeypatch.setattr(bootstrap, "missing_window_libraries", lambda load=None: list(MISSING))
    monkeypatch.delenv("QT_QPA_PLATFORM", raising=False)


def test_launch_says_what_to_install_before_installing(no_install, capsys, monkeypatch):
    monkeypatch.setattr(bootstrap.sys, "platform", "linux")
    assert bootstrap.main(["launch"]) == 2
    err = capsys.readouterr().err
    assert "libxcb-icccm.so.4, libxcb-keysyms.so.1" in err
    assert "sudo apt-get install libxcb-icccm4 libxcb-keysyms1" in err and "--headless" in err


def test_no_window_no_check(no_install, monkeypatch):
    """--headless, another Qt platform, or the test command: nothing to check (ensure_env is reached)."""
    monkeypatch.setattr(bootstrap.sys, "platform", "linux")
    for argv, env in ((["launch", "--headless", "--run-for", "1"], {}), (["launch"], {"QT_QPA_PLATFORM": "offscreen"}),
                      (["test", "-x"], {})):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(AssertionError, match="installed before"):
            bootstrap.main(argv)
        for k in env:
            monkeypatch.delenv(k)
