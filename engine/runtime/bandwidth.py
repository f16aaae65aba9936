"""What a decode step could read per second: the bandwidth the health checklist holds a step's bytes against.

On a CPU it is measured once per process, when the first engine starts: a 128 MiB tensor copied with `copy_`, best of
3 (bytes copied per second, as `kvscope bench --long` measures its memory floor, which copies 512 MiB). On CUDA it is
the device's peak from NVML (the memory clock's maximum × the bus width × 2 transfers a clock), or a measured copy on
the device where NVML cannot say. A step's bytes are the weights (each storage once) and the K/V its attention read.
"""

from __future__ import annotations

import threading
import time

import torch

COPY_MIB = 128  # larger than this machine's 32 MiB L3: the copy runs from memory
REPEATS = 3

_measured: dict[str, float] = {}
_lock = threading.Lock()


def memcpy_bandwidth(device: str = "cpu", mib: int = COPY_MIB, repeats: int = REPEATS) -> float:
    """Bytes copied per second by dst.copy_(src) of an `mib` MiB buffer (best of `repeats`; pages touched first)."""
    src = torch.ones(mib << 18, dtype=torch.float32, device=device)
    dst = torch.zeros_like(src)
    cuda = str(device).startswith("cuda")
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        dst.copy_(src)
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return src.numel() * src.element_size() / best


def nvml_peak(index: int) -> float | None:
    """The device's peak memory bandwidth in bytes/s from NVML, or None where NVML cannot say."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        clock_mhz = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)
        bus_bits = pynvml.nvmlDeviceGetMemoryBusWidth(h)
    except Exception:  # no NVML, an old driver, a device that does not report: the caller measures instead
        return None
    if not clock_mhz or not bus_bits:
        return None
    return clock_mhz * 1e6 * 2 * bus_bits / 8


def peak_bandwidth(device: torch.device) -> tuple[float, str]:
    """(bytes per second, how it was found) for the engine's compute device; measured once per process."""
    key = str(device)
    with _lock:
        if key not in _measured:
            if device.type == "cuda":
                peak = nvml_peak(device.index if device.index is not None else torch.cuda.current_device())
                _measured[key + ":how"] = 0.0 if peak is None else 1.0
                _measured[key] = peak if peak is not None else memcpy_bandwidth(key)
            else:
                _measured[key] = memcpy_bandwidth(key)
        bps = _measured[key]
    if device.type == "cuda":
        how = ("the device's peak (NVML: max memory clock × bus width × 2)" if _measured.get(key + ":how")
               else f"a {COPY_MIB} MiB copy on the device, measured at start (NVML could not say)")
    else:
        how = f"memcpy bandwidth measured at start ({COPY_MIB} MiB copy_, best of {REPEATS})"
    return bps, how


def weight_bytes(model) -> int:
    """Bytes of the forward pass's weights, each storage once (a tied lm_head is the embedding)."""
    seen: dict[int, int] = {}
    tensors = [model.embed, model.lm_head, model.norm] + [t for layer in model.layers for t in layer]
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())
