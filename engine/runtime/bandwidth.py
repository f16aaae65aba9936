"""What a decode step could read per second: the bandwidth the health checklist and `kvscope bench --long` hold a
step's bytes against.

A decode step reads its bytes (the weights, each storage once, and the K/V its attention attends over) and writes
almost nothing, so its limit is the memory's read rate: measured by a streaming read, a sum of a buffer larger than
the last-level cache on every intra-op thread (`stream_read`), never by a copy, which moves each byte twice (on an
Intel Xeon a 512 MiB copy ran at 13.8 GB/s of buffer where a read of it ran at 30.9). On a CPU the checklist's rate is measured
once per process, when the first engine starts: the model's own weights summed where they are larger than twice the
last-level cache (a read of what a step reads, and no memory taken beside them), else a buffer four times that
cache (128 MiB at least) read.
`StreamRead.rate_with_fma(k)` reads the same buffer with k fused multiply-adds of 16 fp32 lanes per 64 bytes beside
the read (an LLVM IR kernel on every numba thread): `bench --long`'s attainable line, what a step that streams its
bytes once with its arithmetic can reach on this machine.
On CUDA it is the device's peak from NVML (the memory clock's maximum × the bus width × 2 transfers a clock), or a
streaming read on the device where NVML cannot say.
"""

from __future__ import annotations

import os
import threading
import time

import torch

from engine import hugepages

READ_MIB = 512  # the buffer of a streaming read: larger than any last-level cache it is meant to miss
REPEATS = 3

_measured: dict[str, float] = {}
_lock = threading.Lock()


def last_level_cache_bytes() -> int | None:
    """The CPU's largest cache in bytes (Linux sysfs), or None where the system does not say."""
    best = None
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        names = os.listdir(base)
    except OSError:
        return None
    for name in names:
        try:
            with open(os.path.join(base, name, "size"), encoding="ascii") as f:
                text = f.read(32).strip()
        except (OSError, UnicodeDecodeError):
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text[:-1] if unit > 1 else text
        if digits.isdigit():
            best = max(best or 0, int(digits) * unit)
    return best


class StreamRead:
    """A buffer of `mib` MiB (touched once here) whose read rate `rate()` measures: bytes summed per second by
    torch's reduction, which runs on every intra-op thread and reads each byte once."""

    def __init__(self, device: str | torch.device = "cpu", mib: int = READ_MIB):
        self.device = torch.device(device)
        if self.device.type == "cpu":  # on 2 MiB pages where the system allows: the faster read, as the weights get
            self.buf = hugepages.zeros((mib << 18,), torch.float32).fill_(1.0)
        else:
            self.buf = torch.ones(mib << 18, dtype=torch.float32, device=self.device)
        self.bytes = self.buf.numel() * self.buf.element_size()
        self.rate()  # the first read maps nothing new but warms the reduction's code paths

    def rate(self) -> float:
        """Bytes read per second by one pass over the buffer."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        total = self.buf.sum()
        if cuda:
            torch.cuda.synchronize(self.device)
        else:
            total.item()
        return self.bytes / (time.perf_counter() - t)

    def rate_with_fma(self, k: int) -> float | None:
        """Bytes read per second by one pass over the buffer that does k fused multiply-adds of 16 fp32 lanes per 64
        bytes read beside the read (_stream_fma_ir, every numba thread, a piece each): what a kernel that streams
        its bytes once with that much arithmetic can reach here. None on CUDA or without llvmlite/numba."""
        fn = _fma_kernel(k) if self.device.type == "cpu" else None
        if fn is None:
            return None
        import numba

        drive = _fma_driver()
        base, n = self.buf.data_ptr(), self.buf.numel()
        drive(fn, base, min(n, 1 << 16), numba.get_num_threads())  # compiled, threads up, before the timed pass
        t = time.perf_counter()
        drive(fn, base, n, numba.get_num_threads())
        return self.bytes / (time.perf_counter() - t)


def _stream_fma_ir(k: int) -> str:
    """stream_fma_k{k}(p, n, out): the n floats at p (n in 16s) read 16 at a time, each vector added into one sum and
    multiplied into k more with fused multiply-adds (spread over 8 sums, each its own constant, so that no FMA waits
    on the one before it and none repeats another), every sum added into *out: each byte read once, with k FMAs
    of 16 lanes per 64 bytes."""
    const = lambda j: "<" + ", ".join([f"float {1.0 + (j + 1) / 1024:.10f}"] * 16) + ">"  # noqa: E731
    head = [f"define void @stream_fma_k{k}(i64 %p.i, i64 %n, i64 %out.i) {{\nentry:\n"
            "  %p = inttoptr i64 %p.i to ptr\n  %out = inttoptr i64 %out.i to ptr\n"
            "  %any = icmp sgt i64 %n, 0\n  br i1 %any, label %loop, label %done\nloop:\n"
            "  %i = phi i64 [0, %entry], [%i1, %loop]\n"]
    body = ["  %va = getelementptr float, ptr %p, i64 %i\n  %v = load <16 x float>, ptr %va, align 4\n"
            "  %f0.0 = fadd <16 x float> %a0, %v\n"]
    cur = {j: f"%a{j}" for j in range(9)}  # each sum's value at the end of the loop body
    cur[0] = "%f0.0"
    for j in range(k):
        a = 1 + j % 8
        body.append(f"  %f{a}.{j} = call <16 x float> @llvm.fma.v16f32(<16 x float> %v, <16 x float> {const(j % 8)}, "
                    f"<16 x float> {cur[a]})\n")
        cur[a] = f"%f{a}.{j}"
    for j in range(9):  # a sum no FMA touches stays zero: its phi takes itself
        head.append(f"  %a{j} = phi <16 x float> [zeroinitializer, %entry], [{cur[j]}, %loop]\n")
    L = head + body
    L.append("  %i1 = add i64 %i, 16\n  %more = icmp slt i64 %i1, %n\n  br i1 %more, label %loop, label %end\nend:\n")
    prev = cur[0]
    for j in range(1, 9):  # (the loop is the end block's one way in: its last values are the sums)
        L.append(f"  %s{j} = fadd <16 x float> {prev}, {cur[j]}\n")
        prev = f"%s{j}"
    L.append(f"  %tot = call reassoc float @llvm.vector.reduce.fadd.v16f32(float -0.0, <16 x float> {prev})\n"
             "  store float %tot, ptr %out, align 4\n  br label %done\ndone:\n  ret void\n}\n")
    return ("declare <16 x float> @llvm.fma.v16f32(<16 x float>, <16 x float>, <16 x float>)\n"
            "declare float @llvm.vector.reduce.fadd.v16f32(float, <16 x float>)\n" + "".join(L))


_fma_kernels: dict[int, int] = {}


def _fma_kernel(k: int) -> int | None:
    """The address of stream_fma_k{k} compiled for this CPU, or None without llvmlite/numba."""
    from engine.attention import attn_ir

    if attn_ir.llvm is None:
        return None
    with _lock:
        if k not in _fma_kernels:
            _fma_kernels[k] = attn_ir.compile_ir(_stream_fma_ir(k), [f"stream_fma_k{k}"])[0]
    return _fma_kernels[k]


_driver = None


def _fma_driver():
    """A numba function (fn, address, floats, parts) -> float: the stream_fma kernel at fn over the buffer cut into
    `parts` equal pieces (in 16s), one a thread (prange), the pieces' sums added."""
    global _driver
    if _driver is None:
        import numpy as np
        from numba import njit, prange

        from engine.attention import attn_ir

        call = attn_ir.call

        @njit(parallel=True, nogil=True)
        def drive(fn, base, nfloats, parts):  # pragma: no cover - compiled
            out = np.zeros(parts, np.float32)
            per = (nfloats // parts) // 16 * 16
            for i in prange(parts):
                lo = i * per
                n = per if i < parts - 1 else (nfloats - lo) // 16 * 16
                call(fn, (np.int64(base + lo * 4), np.int64(n), np.int64(out.ctypes.data + i * 4)))
            return out.sum()

        _driver = drive
    return _driver


def stream_read(device: str | torch.device = "cpu", mib: int = READ_MIB, repeats: int = REPEATS) -> float:
    """The best of `repeats` StreamRead rates of an `mib` MiB buffer, in bytes per second."""
    probe = StreamRead(device, mib)
    return max(probe.rate() for _ in range(repeats))


def read_bandwidth(tensors: list[torch.Tensor], repeats: int = REPEATS) -> float:
    """Bytes read per second summing `tensors` (resident CPU memory) in place, best of `repeats`: nothing allocated
    beside them. Each tensor is summed as the float32, int32 or uint8 words its bytes are (packed int4 weights are
    bytes); the sums are thrown away."""
    flat = []
    for t in tensors:
        b = t.detach().reshape(-1).view(torch.uint8) if t.is_contiguous() else t.detach().contiguous().view(torch.uint8)
        flat.append(b.view(torch.float32) if b.numel() % 4 == 0 else b)
    total = sum(t.numel() * t.element_size() for t in flat)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for t in flat:
            t.sum().item()
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
                _measured[key] = peak if peak is not None else stream_read(key)
            else:
                weights = _weight_tensors(model) if model is not None else []
                llc = last_level_cache_bytes() or (32 << 20)
                if sum(t.numel() * t.element_size() for t in weights) >= 2 * llc:
                    _measured[key] = read_bandwidth(weights)
                    _measured[key + ":how"] = 1.0
                else:  # four times the cache and at least 128 MiB, freed when measured
                    _measured[key] = stream_read(key, max(128, 4 * llc >> 20))
        bps = _measured[key]
    if device.type == "cuda":
        how = ("the device's peak (NVML: max memory clock × bus width × 2)" if _measured.get(key + ":how")
               else f"a streaming read of {READ_MIB} MiB on the device, measured at start (NVML could not say)")
    elif _measured.get(key + ":how"):
        how = f"the weights read (summed in place, every thread) at start (best of {REPEATS})"
    else:
        how = f"a streaming read of a buffer 4x the last-level cache (summed, every thread) at start (best of {REPEATS})"
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
