"""Every `kvscope bench` names the machine its figures were measured on (engine/runtime/machine.py)."""

from __future__ import annotations

import json
import os

import torch

from kvscope_cli import run_cli
from engine.runtime import machine


def _cpuinfo_fields() -> tuple[str | None, set[str]]:
    name, flags = None, set()
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name is None:
                name = value.strip()
            if key.strip() == "flags" and not flags:
                flags = set(value.split())
    return name, flags


def test_the_machine_is_this_one():
    m = machine.describe("cpu")
    name, flags = _cpuinfo_fields() if os.path.exists("/proc/cpuinfo") else (None, set())
    if name is not None:
        assert m["cpu"] == name
        assert m["isa"] == [f for f in machine.ISA_FLAGS if f in flags]  # in the module's order, none invented
    assert m["cpus"] == len(os.sched_getaffinity(0)) and m["threads"] == torch.get_num_threads()
    assert m["read_gbps"] > 0.1 and m["gpu"] is None  # no GPU asked for: the line says "no GPU"
    text = machine.line(m)
    assert text.startswith("machine: ") and m["cpu"] in text and "no GPU" in text
    assert f"streaming read {m['read_gbps']:.1f} GB/s" in text and m["date"] in text
    assert "streaming read" not in machine.line(machine.describe("cpu", read_rate=False))


def test_a_bench_prints_its_machine_first_and_in_its_json(capsys):
    rc, out, err = run_cli(capsys, "bench", "--snapshot-blocks", "256", "--json")
    assert rc == 0, err
    res = json.loads(out)
    assert res["machine"]["cpu"] == machine.describe("cpu", read_rate=False)["cpu"] and res["machine"]["read_gbps"] > 0
    assert err.splitlines()[0] == machine.line(res["machine"])  # the same machine, as one line, before the figures
    rc, out, _ = run_cli(capsys, "bench", "--snapshot-blocks", "256")
    assert rc == 0 and out.splitlines()[0].startswith("machine: ") and out.splitlines()[1].startswith("snapshot of ")
