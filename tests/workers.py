"""What a test run hands the processes it starts: the repository's root, the packages kept out of the run
(KVSCOPE_TEST_WITHOUT), the environment of a worker that runs a test file as a script, and the workers started
beside the run.

A test module may map a fixture name to a worker command in BACKGROUND ({fixture: build(out_path) -> (argv, env)
or None when it cannot run here}). When collection ends and a selected test uses that fixture, the worker starts
then (tests/conftest.py), on the other CPU, while the suite goes on; the fixture calls background_result and waits
only for what is left (the Triton interpreter's 1.5 minutes in tests/attention/test_paged_attention.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository

# KVSCOPE_TEST_WITHOUT=numba,llvmlite: those packages cannot be imported in this run, as on a machine without
# them (tests/model/test_other_builds.py runs the kernel tests so). Installed on import, before any engine import
# (tests/conftest.py imports this first; a worker running a test file imports it with the file's helpers).
KEPT_OUT = _WITHOUT = tuple(m for m in os.environ.get("KVSCOPE_TEST_WITHOUT", "").split(",") if m)
if _WITHOUT:
    import sys

    class _Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in _WITHOUT:
                raise ImportError(f"{name} is kept out of this run (KVSCOPE_TEST_WITHOUT)")
            return None

    sys.meta_path.insert(0, _Refuse())

WORKERS: dict[str, tuple[subprocess.Popen, str, str]] = {}
WORKER_DIR: list[str] = []  # made when the first worker starts


def interpreter_env(**extra: str) -> dict[str, str]:
    """The environment of a test worker that runs a test file as a script under the Triton interpreter (one
    thread; the repository and tests/ importable, so the file can import its neighbours)."""
    return dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]),
                **extra)


def start_worker(name: str, build) -> None:
    if not WORKER_DIR:
        WORKER_DIR.append(tempfile.mkdtemp(prefix="kvscope-test-workers-"))
    out = os.path.join(WORKER_DIR[0], name + ".out")
    spec = build(out)
    if spec is None:
        return
    argv, env = spec
    log = open(os.path.join(WORKER_DIR[0], name + ".log"), "w")
    WORKERS[name] = (subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), out, log.name)
    log.close()


def background_result(name: str, build, timeout: float = 1200) -> str:
    """The output file of worker `name` (started now if collection did not start it), once it has exited 0."""
    if name not in WORKERS:
        start_worker(name, build)
    proc, out, log = WORKERS[name]
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"worker {name} ran past {timeout:.0f} s") from None
    if rc != 0:
        with open(log) as f:
            raise AssertionError(f"worker {name} exited {rc}:\n{f.read()[-8000:]}")
    return out


def stop_workers() -> None:
    """Kill the workers still running and remove their files (at the end of the run)."""
    for proc, _, _ in WORKERS.values():
        if proc.poll() is None:
            proc.kill()
    for d in WORKER_DIR:
        shutil.rmtree(d, ignore_errors=True)
