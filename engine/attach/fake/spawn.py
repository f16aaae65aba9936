"""Start fake publishers as child processes (tests, the soak bench, `kvscope attach --demo`) and read what they
report: the endpoints they bound, and at the end how many batches and events they sent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class FakeProcess:
    def __init__(self, *args: str, startup_timeout_s: float = 30.0, nice: int = 0):
        """nice > 0: the publisher runs at that lower priority (the soak's: it stands in for a server on another
        machine, so on a shared 2-CPU box it must not take CPU from the window whose frames are measured)."""
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        lower = (lambda: os.nice(nice)) if nice > 0 and hasattr(os, "nice") else None
        # Its stdin is a pipe only this process holds (never inherited: non-inheritable, and the ingest process
        # is spawned): when this process ends, however it ends, the publisher sees the end of its input and exits.
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.attach.fake.publisher", *args, "--exit-with-stdin"],
                                     cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env, preexec_fn=lower)
        self._lines: list[dict] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.info = self._wait(lambda: self._lines[0] if self._lines else None, startup_timeout_s, "start")

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            with self._cv:
                self._lines.append(obj)
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def _wait(self, pick, timeout: float, what: str):
        with self._cv:
            ok = self._cv.wait_for(lambda: pick() is not None or self.proc.poll() is not None, timeout)
            got = pick()
        if got is None:
            err = self.proc.stderr.read() if self.proc.poll() is not None else ""
            raise RuntimeError(f"fake publisher did not report its {what}" + ("" if ok else f" within {timeout:g} s")
                               + (f": {err.strip()[-800:]}" if err else ""))
        return got

    @property
    def pub(self) -> str:
        return self.info["pub"][0]

    @property
    def metrics(self) -> str | None:
        return self.info.get("metrics")

    def started(self) -> bool:
        """Publishing has begun (after any pre-generation)."""
        with self._cv:
            return any("started" in x for x in self._lines)

    def done(self) -> bool:
        """Publishing has ended (the summary is in)."""
        with self._cv:
            return any("summary" in x for x in self._lines)

    def summary(self, timeout_s: float = 120.0) -> dict:
        """The publisher's totals, once it has finished publishing."""
        return self._wait(lambda: next((x["summary"] for x in self._lines if "summary" in x), None), timeout_s,
                          "summary")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except OSError:
                pass
