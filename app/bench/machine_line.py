"""Every figure names its machine: the line `kvscope bench` prints before its figures."""

from __future__ import annotations

import sys


def announce_machine(args) -> None:
    """Print the machine's line (engine/runtime/machine.py) before a bench's figures (stderr with --json) and keep
    it in args.machine for the JSON."""
    from engine.runtime import machine

    args.machine = machine.describe(getattr(args, "device", None) or "cpu")
    print(machine.line(args.machine), file=sys.stderr if getattr(args, "json", False) else sys.stdout, flush=True)
