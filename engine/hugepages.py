"""CPU buffers on 2 MiB pages: the large memory a decode step streams (the KV pool's tiers, the weights read from
safetensors) and the streaming read the memory floor is measured by.

A CPU decode step reads its KV blocks scattered over the pool (a block's K or V is a few KiB, the next block
anywhere) and every weight once: on 4 KiB pages that is a TLB miss and a page walk every 4 KiB. Linux maps a
range advised MADV_HUGEPAGE with 2 MiB pages (transparent huge pages) where
/sys/kernel/mm/transparent_hugepage/enabled is "always" or "madvise" and free 2 MiB pages exist; elsewhere the
advice does nothing and the buffers are plain pages.

Measured on EPYC-z4 (AMD EPYC znver4, 2 CPUs; 2026-12-07, the same work on both kinds of pages in one process):
decode attention over 8 x 2,048 fp32 tokens of the default model 16.6-16.9 ms on 4 KiB pages, 15.5-16.3 on 2 MiB
at a 62 GB/s read; the 120 fp32 matmuls of a step at 8 rows 12.6-14.0 ms from one 4 KiB-page buffer, 11.2-11.6
from one on 2 MiB pages.

The cost: memory is committed 2 MiB at a time where first written, not 4 KiB. Weights are written whole at load,
so theirs is nothing; but a KV tier is one buffer per layer for K and one for V, so its first block written commits
a page in each (2 MiB x 60 on the default model: `kvscope generate "hi"` took 120 MiB more at its peak). The pool's
layers go on 2 MiB pages only from POOL_MIN up, where that is at most 3 % of what the tier was given. Buffers under
2 MiB stay on plain pages. KVSCOPE_HUGE_PAGES=off: plain pages everywhere.
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import torch

PAGE = 2 << 20  # a transparent huge page on x86-64 and most arm64 kernels
POOL_MIN = 64 << 20  # a KV tier's layer buffer from which it goes on 2 MiB pages (a page ahead of its blocks <= 3 %)
_SYSFS = "/sys/kernel/mm/transparent_hugepage/enabled"


def system_mode() -> str:
    """The kernel's transparent-huge-page setting ("always", "madvise", "never"), or "not available" (no such
    setting: not Linux, or a kernel without them)."""
    try:
        with open(_SYSFS, encoding="ascii") as f:
            text = f.read(200)
    except (OSError, UnicodeDecodeError):
        return "not available"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "not available"


def enabled() -> bool:
    """Whether buffers here are advised onto 2 MiB pages: the kernel honours the advice (always / madvise), Python's
    mmap can give it, and KVSCOPE_HUGE_PAGES is not "off"."""
    return (os.environ.get("KVSCOPE_HUGE_PAGES", "").lower() not in ("off", "0")
            and hasattr(mmap, "MADV_HUGEPAGE") and system_mode() in ("always", "madvise"))


def describe() -> str:
    """One line for `kvscope info`: whether the pool and weights are on 2 MiB pages, and why not where they are not."""
    mode = system_mode()
    if enabled():
        return (f"2 MiB pages advised for the weights, the floor's read and KV tier layers of {POOL_MIN >> 20} MiB or "
                f"more (transparent huge pages: {mode})")
    if os.environ.get("KVSCOPE_HUGE_PAGES", "").lower() in ("off", "0"):
        return "4 KiB pages (KVSCOPE_HUGE_PAGES=off)"
    return f"4 KiB pages (transparent huge pages: {mode})"


def _map(nbytes: int, huge: bool) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping of at least nbytes (zero pages until written) and the offset its buffer starts
    at: 2 MiB aligned and its whole 2 MiB pages advised onto huge pages where `huge` (a last part page would commit
    up to 2 MiB past the buffer's end; the slack before and after it is never touched)."""
    buf = mmap.mmap(-1, nbytes + (PAGE if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if not huge:
        return buf, 0
    offset = -np.frombuffer(buf, dtype=np.uint8, count=1).ctypes.data % PAGE
    buf.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // PAGE * PAGE)
    return buf, offset


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def zeros(shape: tuple[int, ...], dtype: torch.dtype, min_bytes: int = PAGE) -> torch.Tensor:
    """CPU zeros whose memory the OS commits as it is first written, not up front: a private anonymous mapping
    is zero pages until written (torch.zeros writes every byte: a 16 GB host tier would commit 16 GB at start).
    On 2 MiB pages where enabled() and the buffer is `min_bytes` or more (aligned to 2 MiB, each whole 2 MiB of it
    one page, the rest past the last whole one on 4 KiB pages), else 4 KiB ones. Bytes reinterpreted as `dtype`
    (bf16 and fp8 have no numpy dtype); the mapping lives as long as the tensor."""
    nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    if not hasattr(mmap, "MAP_PRIVATE"):  # Windows: pagefile-backed, also committed lazily
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)
    buf, offset = _map(nbytes, nbytes >= max(PAGE, min_bytes) and enabled())
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)


def carve(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Uninitialized CPU tensors of `shapes`, each its own storage (64-byte aligned), all in one mapping on 2 MiB
    pages where enabled() and they add up to 2 MiB or more, else torch.empty each: for buffers written whole at
    once (weights), so a page committed is a page used, small tensors and each one's last part included."""
    item = torch.empty((), dtype=dtype).element_size()
    sizes = [_numel(shape) * item for shape in shapes]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // 64) * 64
    if total < PAGE or not enabled():
        return [torch.empty(shape, dtype=dtype) for shape in shapes]
    buf, base = _map(total, True)
    return [torch.frombuffer(buf, dtype=torch.uint8, count=size, offset=base + o).view(dtype).view(shape) if size
            else torch.empty(shape, dtype=dtype) for o, size, shape in zip(offsets, sizes, shapes)]


def mappings(tensors: list[torch.Tensor]) -> dict | None:
    """What the memory of CPU `tensors` lies in (/proc/self/smaps, read once): {"bytes": their storages' bytes,
    "advised": bytes of those in mappings advised onto 2 MiB pages (VmFlags hg), "huge": bytes the mappings hold
    on 2 MiB pages now (AnonHugePages, committed only)}, each storage counted once; None where the system does not
    say (not Linux)."""
    spans = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.device.type == "cpu" and st.nbytes():
            spans[st.data_ptr()] = st.data_ptr() + st.nbytes()
    out = {"bytes": sum(hi - lo for lo, hi in spans.items()), "advised": 0, "huge": 0}
    try:
        with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    region, over, huge = None, 0, 0
    for line in lines + ["0-0 end"]:
        head = line.split(" ", 1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
            a, b = (int(x, 16) for x in head.split("-"))
            region = (a, b)
            over = sum(max(0, min(b, hi) - max(a, lo)) for lo, hi in spans.items())
            huge = 0
        elif region and over and line.startswith("AnonHugePages:"):
            huge = int(line.split()[1]) * 1024
            out["huge"] += min(huge, over)
        elif region and over and line.startswith("VmFlags:") and " hg" in " " + line.split(":", 1)[1]:
            out["advised"] += over
    return out
