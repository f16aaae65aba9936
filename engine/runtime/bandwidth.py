"""What a decode step could read per second: the bandwidth the health checklist holds a step's bytes against.

On a CPU it is measured once per process, when the first engine starts: the model's own weights read through a 4 MiB
scratch buffer (bytes read per second, best of 3; what a decode step does with them, and no memory taken beside them:
a 128 MiB copy added 256 MiB to `generate`'s peak RSS, tests/model/test_weights.py); where the weights are smaller
than 64 MiB (they would be read from the cache), a 128 MiB tensor copied with `copy_` instead (bytes copied per
second, as `kvscope bench --long` measures its memory floor). On CUDA it is
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


READ_MIN_MIB = 64  # twice this machine's L3: weights at least this large are read from memory
SCRATCH_MIB = 4


def read_bandwidth(tensors: list[torch.Tensor], repeats: int = REPEATS) -> float:
    """Bytes read per second streaming through `tensors` (resident CPU memory) into a SCRATCH_MIB buffer, best of
    `repeats`: nothing allocated beside them but the scratch."""
    flat = [t.detach().reshape(-1) for t in tensors]
    total = sum(t.numel() * t.element_size() for t in flat)
    scratch: dict[torch.dtype, torch.Tensor] = {}
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for t in flat:
            n = max(1, (SCRATCH_MIB << 20) // t.element_size())
            s = scratch.setdefault(t.dtype, torch.empty(n, dtype=t.dtype))
            for i in range(0, t.numel(), n):
                part = t[i:i + n]
                s[:part.numel()].copy_(part)
        best = min(best, time.perf_counter() - t0)
    return total / best


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


def peak_bandwidth(device: torch.device, model=None) -> tuple[float, str]:
    """(bytes per second, how it was found) for the engine's compute device; measured once per process (on a CPU
    over `model`'s weights where they are large enough, see the module docstring)."""
    key = str(device)
    with _lock:
        if key not in _measured:
            if device.type == "cuda":
                peak = nvml_peak(device.index if device.index is not None else torch.cuda.current_device())
                _measured[key + ":how"] = 0.0 if peak is None else 1.0
                _measured[key] = peak if peak is not None else memcpy_bandwidth(key)
            else:
                weights = _weight_tensors(model) if model is not None else []
                if sum(t.numel() * t.element_size() for t in weights) >= READ_MIN_MIB << 20:
                    _measured[key] = read_bandwidth(weights)
                    _measured[key + ":how"] = 1.0
                else:
                    _measured[key] = memcpy_bandwidth(key)
        bps = _measured[key]
    if device.type == "cuda":
        how = ("the device's peak (NVML: max memory clock × bus width × 2)" if _measured.get(key + ":how")
               else f"a {COPY_MIB} MiB copy on the device, measured at start (NVML could not say)")
    elif _measured.get(key + ":how"):
        how = f"the weights read through a {SCRATCH_MIB} MiB buffer at start (best of {REPEATS})"
    else:
        how = f"memcpy bandwidth measured at start ({COPY_MIB} MiB copy_, best of {REPEATS})"
    return bps, how


def _flat(items: list) -> list:
    """Packed weights (engine/model/quant.py) as their tensors (packed values, scales, zeros)."""
    return [t for item in items for t in (item.tensors() if hasattr(item, "tensors") else (item,))]


def _weight_tensors(model) -> list[torch.Tensor]:
    """The forward pass's weight tensors on the CPU, each storage once (a tied lm_head is the embedding)."""
    seen: dict[int, torch.Tensor] = {}
    tensors = _flat([model.embed, model.lm_head, model.norm] + [t for layer in model.layers for t in layer])
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            seen.setdefault(t.untyped_storage().data_ptr(), t)
    return list(seen.values())


def weight_bytes(model) -> int:
    """Bytes of the forward pass's weights, each storage once (a tied lm_head is the embedding)."""
    seen: dict[int, int] = {}
    tensors = _flat([model.embed, model.lm_head, model.norm] + [t for layer in model.layers for t in layer])
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())
