"""The machine a figure was measured on, as every `kvscope bench` prints it first: a figure without its machine
cannot be compared with another.

One line (and a dict under "machine" in `--json`): the CPU's model name and LLVM's name for its core, the vector
extensions the kernels choose between (AVX2, AVX-512 and its VNNI / BF16 / FP16 parts, AVX-VNNI, AMX), the CPUs
this process may run on and torch's intra-op threads, the system's memory, the rate of a streaming read measured
now (engine/runtime/bandwidth.py: a sum of 512 MiB on every thread, best of 3; the rate a decode step's bytes are
read at, not a copy's), the GPU where there is one, and the date in UTC.
"""

from __future__ import annotations

import datetime
import os
import platform

import torch

from engine.runtime import bandwidth

# The flags /proc/cpuinfo names that decide which kernel runs (engine/model/quant_ir.py, MKL, oneDNN), in order.
ISA_FLAGS = ("avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_int8", "amx_bf16")


def _cpuinfo() -> tuple[str, list[str]]:
    """(model name, the ISA_FLAGS present) from /proc/cpuinfo; the platform's names where there is none."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f.read(1 << 17).splitlines():
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and name in (platform.processor(), platform.machine()):
                    name = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return name, [f for f in ISA_FLAGS if f in flags]


def _llvm_cpu() -> str | None:
    try:
        import llvmlite.binding as llvm

        return llvm.get_host_cpu_name()
    except Exception:  # llvmlite absent or unusable: the line says nothing of the core's name
        return None


def describe(device: str | torch.device = "cpu", read_rate: bool = True) -> dict:
    """The machine as a dict: cpu, core (LLVM's name), isa, cpus (this process's affinity), threads (torch's),
    memory_gib, read_gbps (a streaming read of host memory now, None when read_rate is False), gpu, date."""
    import psutil

    name, isa = _cpuinfo()
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    dev = torch.device(device)
    gpu = None
    if dev.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(dev)
        peak = bandwidth.nvml_peak(dev.index if dev.index is not None else torch.cuda.current_device())
        gpu = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
               "peak_gbps": None if peak is None else round(peak / 1e9, 1)}
    return {
        "cpu": name, "core": _llvm_cpu(), "isa": isa, "cpus": cpus, "threads": torch.get_num_threads(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "read_gbps": round(bandwidth.stream_read("cpu") / 1e9, 1) if read_rate else None,
        "gpu": gpu, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def line(m: dict) -> str:
    """The dict of describe() as one line."""
    core = f"{m['core']}; " if m.get("core") else ""
    isa = " ".join(m["isa"]) or "no AVX2"
    read = f", streaming read {m['read_gbps']:.1f} GB/s" if m.get("read_gbps") else ""
    g = m.get("gpu")
    gpu = "no GPU" if not g else (f"{g['name']} ({g['memory_gib']} GiB"
                                  + (f", {g['peak_gbps']:.0f} GB/s peak)" if g.get("peak_gbps") else ")"))
    return (f"machine: {m['cpu']} ({core}{isa}), {m['cpus']} CPUs, torch {m['threads']} threads, "
            f"{m['memory_gib']} GiB{read}, {gpu}; {m['date']}")
