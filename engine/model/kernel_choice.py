"""fp32 matmuls of a few rows on the CPU (decode steps): quant_ir's f32 kernel or MKL's gemm, chosen per weight shape
by measuring both on this CPU at first use, as the self-checks do, and remembered per CPU.

The f32 kernel reads each weight once for up to 8 rows at the memory's rate on the AMD EPYC the project was tuned on
(MKL's gemm at 1-8 rows streams it at about half that there); on an Intel Xeon with AVX-512 + AMX MKL's gemm won at
one row (`bench --compare hf`: 0.88x transformers with the kernel). Which is faster is a fact of the CPU, not of
the code, so it is measured: for a weight [N, K] and a row count T (1, 2, 4, 8: the kernel's tiles), both run on
the weight itself with random rows, alternately, after a warm-up, and the lower median wins. The picks are kept in
$KVSCOPE_CACHE_DIR/kernel-choice.json under a key naming the CPU (its model name, LLVM's name for it, torch's thread
count and version) and the kernel's code, so a later process on the same CPU and code measures nothing; a file that
cannot be read or parsed is measured anew and rewritten. KVSCOPE_F32_KERNEL=ir or mkl forces one side (the tests
compare both).

A decoder layer's fp32 matmuls run fused into two compiled calls (engine/model/quant_layer.py) only where the kernel
wins the layer: `fuse_layer` compares the sum of its four matmuls' medians at one row.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import threading
import time
from dataclasses import asdict, dataclass

import torch

from engine.model import quant_ir

TILES = (1, 2, 4, 8)
REPEATS = 5
FILE = "kernel-choice.json"


@dataclass(frozen=True)
class Pick:
    kernel: str  # "ir" (quant_ir's f32 kernel) or "mkl" (torch.mm)
    ir_us: float  # median microseconds of one call, each side, as measured
    mkl_us: float


_lock = threading.Lock()
_picks: dict[str, Pick] | None = None
_measured_now: set[str] = set()  # shapes measured by this process (the others came from the file)
_used: set[str] = set()  # shapes this process asked for


def forced() -> str | None:
    v = os.environ.get("KVSCOPE_F32_KERNEL", "")
    return v if v in ("ir", "mkl") else None


def cpu_key() -> str:
    """The CPU a pick holds for: its model name, LLVM's name for it, torch's threads and version, and the f32 kernel's
    code (a digest of its IR: a changed kernel is measured anew)."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f.read(1 << 16).splitlines():
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    lib = quant_ir.library()
    code = hashlib.sha256("".join(quant_ir.kernel_ir_f32(t) for t in TILES).encode()).hexdigest()[:12]
    return (f"{name} | {lib.cpu if lib else 'no IR kernels'} | {torch.get_num_threads()} threads | torch "
            f"{torch.__version__} | f32 kernel {code}")


def _path() -> str:
    from engine.model.gguf_cache import cache_root

    return os.path.join(cache_root(), FILE)


def _read() -> dict:
    """The file's JSON object ({} where there is none, or it is not a regular file of JSON: a FIFO is not opened)."""
    path = _path()
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.loads(f.read(1 << 20))
    return data if isinstance(data, dict) else {}


def _load() -> dict[str, Pick]:
    global _picks
    if _picks is None:
        _picks = {}
        try:
            data = _read()
            for shape, p in data.get(cpu_key(), {}).items():
                pick = Pick(str(p["kernel"]), float(p["ir_us"]), float(p["mkl_us"]))
                if pick.kernel in ("ir", "mkl"):
                    _picks[shape] = pick
        except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
            _picks = {}  # no file, or one not written by this module: measured anew, and rewritten
    return _picks


def _save() -> None:
    path = _path()
    try:
        data = _read()
    except (OSError, ValueError, RecursionError):
        data = {}
    data[cpu_key()] = {shape: asdict(p) for shape, p in sorted(_picks.items())}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.exists(path) and not os.path.isfile(path):
            return  # a FIFO or a directory where the file would be: left alone, the picks hold for this process
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: the picks hold for this process and are measured again by the next


def mkl(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ w [N, K].T by MKL's gemm with the weight as the left operand (w @ x.T streams the weight up to 3x
    faster than F.linear's x @ w.T at a few rows), one row padded to two (the one-column case takes a slow gemv)."""
    if x.shape[0] == 1:
        return torch.mm(w, torch.cat((x, x)).t())[:, :1].t()
    return torch.mm(w, x.t()).t().contiguous()


def tile(t: int) -> int:
    return next(n for n in TILES if n >= t)


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e6


def measure(w: torch.Tensor, t: int, repeats: int = REPEATS) -> Pick:
    """Both kernels on weight w at t rows: medians of `repeats` calls each, interleaved, after a warm-up."""
    x = torch.randn(t, w.shape[1], generator=torch.Generator().manual_seed(t))
    wn, xn = w.detach().numpy(), x.numpy()
    ir = lambda: quant_ir.matmul_f32(xn, wn)  # noqa: E731
    gemm = lambda: mkl(x, w)  # noqa: E731
    if ir() is None:
        return Pick("mkl", float("inf"), _median(gemm, repeats))
    gemm()
    ir_times, mkl_times = [], []
    for _ in range(repeats):  # interleaved: a drift in the machine's speed falls on both
        ir_times.append(_median(ir, 1))
        mkl_times.append(_median(gemm, 1))
    ir_us, mkl_us = sorted(ir_times)[repeats // 2], sorted(mkl_times)[repeats // 2]
    return Pick("ir" if ir_us <= mkl_us else "mkl", ir_us, mkl_us)


def pick(w: torch.Tensor, t: int) -> Pick:
    """The kernel for x [t, K] @ w.T on this CPU (measured at the first call for this shape and tile, then kept)."""
    key = f"{w.shape[0]}x{w.shape[1]}@{tile(t)}"
    with _lock:
        picks = _load()
        if key not in picks:
            picks[key] = measure(w, tile(t))
            _measured_now.add(key)
            _save()
        _used.add(key)
        return picks[key]


def use_ir(w: torch.Tensor, t: int) -> bool:
    """Whether linear() should run x [t, K] @ w.T through quant_ir's f32 kernel here."""
    f = forced()
    if f is not None:
        return f == "ir"
    return pick(w, t).kernel == "ir"


def fuse_layer(weights: list[torch.Tensor]) -> bool:
    """Whether a layer's fp32 matmuls (qkv, o, gate_up, down) should run in quant_ir's kernel, fused: its four
    medians at one row summed against MKL's."""
    f = forced()
    if f is not None:
        return f == "ir"
    picks = [pick(w, 1) for w in weights]
    return sum(p.ir_us for p in picks) <= sum(p.mkl_us for p in picks)


def summary() -> list[str]:
    """One line per shape this process asked for: the shape, both medians, the pick, and whether it was measured
    now or read from the file."""
    f = forced()
    if f is not None:
        return [f"fp32 matmuls of 1-8 rows: {f} (KVSCOPE_F32_KERNEL={f}, nothing measured)"]
    with _lock:
        picks = {k: p for k, p in _load().items() if k in _used}
    return [f"{shape}: {p.kernel} (f32 kernel {p.ir_us:.0f} us, MKL {p.mkl_us:.0f} us; "
            f"{'measured now' if shape in _measured_now else 'from ' + FILE})" for shape, p in sorted(picks.items())]
