"""Host blocks streamed to the compute device one layer ahead (host_reads=stream, and promote's overflow).

A step whose tables hold blocks on the host tier reads them through a staging buffer on the compute device: the
step's distinct host slots U are gathered, as stored (int8 and its scales, not decoded), from the host tier's
parts into staging rows 0..U-1, and attention reads them there through `PagedBatch.staged_table` (row of each
host block). The copy of a layer is issued when the layer before it begins (its K/V write), so it runs while that
layer computes, as offloaded caches prefetch the next layer:

    write(l) -> issue copy(l+1)           on CUDA, an async copy on the side stream
    read(l)  -> wait copy(l)              the compute stream waits on the copy's event

On the CPU the device tier is host memory standing in for device memory: the copy is made at issue time, in
the same program order, and waiting is a no-op. A CPU has no copy engine to overlap with: a copy thread was
measured slower on this 2-core machine (default model, 4 streamed sequences, fp32: 219 ms/step with a thread,
169 ms inline, 161 ms reading the host tier directly without staging).

Ordering (CUDA events):
- source written -> copy: the step's own writes into host blocks happen at write(l), after copy(l) was issued,
  so `refresh` re-copies the blocks written at layer l once copy(l) has landed (a few tail blocks).
- copy -> destination readable: the first read of layer l waits on copy(l).
- readers done -> staging reused: two staging buffers alternate between staged layers; copy(l+2) is issued at
  write(l+1) or later, after layer l's attention (CUDA: the side stream first waits on an event recorded on
  the compute stream then), and on CUDA the pinned bounce buffer of layer l is reused only once copy(l) has
  completed.
Layers the device tier keeps in host memory (`device_layers`) are attended on the host where the host tier is,
and are not staged. The staging buffers stay allocated between steps (grown by doubling) and are reported in
the memory breakdown.

Self-check (engine/runtime/self_check.py): a HostStream's first step is checked: when a layer's copy is issued, the
host rows are also read directly (the reference), and when the copy has landed (the first wait on it, before
attention or a refresh touches the staging) the staging is compared with them byte for byte. On a mismatch, or an
exception while staging, that layer's staging is rewritten from the reference, so the step reads what it would
have, and the stream is marked `failed`: the model runner stops staging, and host blocks are read from the host
tier at each read (`read_blocks` without `staged`). `copy` (the gather of host rows into a staging or bounce
buffer) is a seam: tests put a copy that corrupts a byte there.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from engine.kv.codecs import Parts

SIDES = ("k", "v")


class HostStream:
    """The engine's staging buffers and copy engine (a side stream on CUDA; on the CPU, the copy runs inline)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._side = torch.cuda.Stream(device) if self.cuda else None
        self._bufs: dict[tuple, torch.Tensor] = {}  # (side, name, parity) -> [capacity, ...] on the device
        self._bounce: dict[tuple, torch.Tensor] = {}  # CUDA: the same in pinned host memory
        self._bounce_free: dict[int, torch.cuda.Event] = {}  # parity -> copy that last read its bounce buffers
        self.log: list[tuple[str, int]] | None = None  # tests: ("issue" | "ready" | "refresh", layer), in order
        # False: each layer's copy is issued when the layer reads it, not a layer ahead (no overlap): the A/B
        # app/stress/gpu_check.py measures the overlap with
        self.ahead = True
        self.copy = gather_rows  # (src [N, ...], slots [n] CPU, out [n, ...]): gathers host rows into a buffer
        self.checked = False  # the first step's staging was compared with the host tier (see the module doc)
        self.failed = False  # ...and differed: stage nothing from now on

    def nbytes(self) -> int:
        """Bytes held for staging (device buffers, and pinned bounce buffers on CUDA)."""
        return sum(t.numel() * t.element_size() for d in (self._bufs, self._bounce) for t in d.values())

    def begin(self, host_k: Parts, host_v: Parts, slots: np.ndarray, layers: list[int]) -> "StepStream":
        """A step's stream of host-tier slots `slots` (sorted, distinct) for `layers` (ascending)."""
        names = {(side, name) for side, parts in (("k", host_k), ("v", host_v)) for name in parts}
        for store in (self._bufs, self._bounce):  # a format change: buffers of parts it no longer has go
            for key in [key for key in store if key[:2] not in names]:
                del store[key]
        return StepStream(self, {"k": host_k, "v": host_v}, slots, layers, check=not self.checked)

    def _buf(self, side: str, name: str, parity: int, like: torch.Tensor, n: int, pinned: bool = False) -> torch.Tensor:
        """Rows [:n] of a staging buffer shaped like one layer's part `like` [N, ...]; grown by doubling."""
        store = self._bounce if pinned else self._bufs
        key = (side, name, parity)
        buf = store.get(key)
        if buf is None or buf.shape[0] < n or buf.shape[1:] != like.shape[1:] or buf.dtype != like.dtype:
            size = max(8, 1 << max(n - 1, 1).bit_length())
            if pinned:
                buf = torch.empty((size, *like.shape[1:]), dtype=like.dtype, pin_memory=True)
            else:
                buf = torch.empty((size, *like.shape[1:]), dtype=like.dtype, device=self.device)
            store[key] = buf
        return buf[:n]

    def _say(self, what: str, layer: int) -> None:
        if self.log is not None:
            self.log.append((what, layer))


class StagedParts:
    """One side's staged parts as a backend indexes them, `parts[name][layer]` -> [U, ...]; reading a layer waits
    for its copy. `shape` is [L, U, ...] like a tier's parts."""

    def __init__(self, step: "StepStream", side: str):
        self._step, self._side = step, side

    def __getitem__(self, name: str) -> "_StagedPart":
        return _StagedPart(self._step, self._side, name)


class _StagedPart:
    def __init__(self, step: "StepStream", side: str, name: str):
        self._step, self._side, self._name = step, side, name

    @property
    def shape(self) -> tuple[int, ...]:
        src = self._step.src[self._side][self._name]
        return (len(src), self._step.n, *src.shape[2:])

    @property
    def device(self) -> torch.device:
        return self._step.hs.device

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self._step.ready(layer)[(self._side, self._name)]


class StepStream:
    """One step's copies: issue(l) at layer l-1's write, ready(l) at layer l's first read."""

    def __init__(self, hs: HostStream, src: dict[str, Parts], slots: np.ndarray, layers: list[int],
                 check: bool = False):
        self.hs = hs
        # The self-check (module doc): layers compared so far, and the verdict (path, ok, detail, fallback, seconds)
        # once the step finishes; None when this step is not checked.
        self._check: set[int] | None = set() if check else None
        self._want: dict[tuple, torch.Tensor] = {}  # (layer, (side, name)) -> the host rows, read at issue
        self._bad: str | None = None
        self._check_s = 0.0
        self.verdict: tuple | None = None
        self.src = src
        self.n = len(slots)
        self.slots_np = slots
        self.slots = torch.from_numpy(slots.astype(np.int64))  # host-tier slots, a CPU index
        self.layers = layers
        self._order = {layer: i for i, layer in enumerate(layers)}
        self._pending: dict[int, torch.cuda.Event | None] = {}  # None: copied already (CPU)
        self._staged: dict[int, dict[tuple, torch.Tensor]] = {}
        self._waited: set[int] = set()
        self.bytes = 0  # stored bytes copied host -> staging this step
        if layers:
            self.issue(layers[0])

    @property
    def sides(self) -> tuple[StagedParts, StagedParts]:
        return StagedParts(self, "k"), StagedParts(self, "v")

    def staged_rows(self, slots: np.ndarray) -> np.ndarray:
        """Staging row of each host slot in `slots` (each one of this step's)."""
        return np.searchsorted(self.slots_np, slots)

    def at_layer(self, layer: int) -> None:
        """Layer `layer` begins: issue the copy of the next staged layer, to run while this one computes."""
        if not self.hs.ahead:
            return
        i = np.searchsorted(self.layers, layer, side="right")  # the first staged layer after `layer`
        if i < len(self.layers) and self.layers[i] not in self._pending:
            self.issue(self.layers[i])

    @torch.inference_mode()  # the buffers are inference tensors: made and written in inference mode only
    def issue(self, layer: int) -> None:
        hs = self.hs
        parity = self._order[layer] % 2
        hs._say("issue", layer)
        pairs = []
        for side in SIDES:
            for name, part in self.src[side].items():
                src = part[layer]
                pairs.append(((side, name), src, hs._buf(side, name, parity, src, self.n)))
                self.bytes += self.n * src[0].numel() * src.element_size()
        self._staged[layer] = {key: dst for key, _, dst in pairs}
        if self._check is not None:  # the reference, read directly now: what the copy must deliver
            t0 = time.perf_counter()
            self._want.update({(layer, key): src.index_select(0, self.slots) for key, src, _ in pairs})
            self._check_s += time.perf_counter() - t0
        if not hs.cuda:  # no copy engine: the copy runs here, in program order a layer ahead (see the module doc)
            for _, src, dst in pairs:
                self._copy(src, dst)
            self._pending[layer] = None
            return
        # CUDA: gather on the host into the pinned bounce buffers, then one async copy each on the side stream,
        # after the compute stream's work so far (the readers of this staging buffer, two staged layers back).
        free = hs._bounce_free.get(parity)
        if free is not None:
            free.synchronize()  # the bounce buffers' previous copy has left them
        readers_done = torch.cuda.current_stream(hs.device).record_event()
        with torch.cuda.stream(hs._side):
            hs._side.wait_event(readers_done)
            for (side, name), src, dst in pairs:
                bounce = hs._buf(side, name, parity, src, self.n, pinned=True)
                self._copy(src, bounce)
                dst.copy_(bounce, non_blocking=True)
                dst.record_stream(hs._side)  # a buffer replaced (grown) is not reused while this copy runs
            done = hs._side.record_event()
        hs._bounce_free[parity] = done
        self._pending[layer] = done

    def _copy(self, src: torch.Tensor, out: torch.Tensor) -> None:
        try:
            self.hs.copy(src, self.slots, out)
        except Exception as e:  # noqa: BLE001 - checked: the read rewrites the staging from the host tier
            if self._check is None:
                raise
            self._bad = self._bad or f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def _verify(self, layer: int) -> None:
        """A checked step: layer's staging, as its copy landed, against the host rows read when it was issued."""
        t0 = time.perf_counter()
        for key, dst in self._staged[layer].items():
            want = self._want.pop((layer, key))
            got = dst.to("cpu") if dst.device.type != "cpu" else dst
            a, b = want.reshape(len(want), -1).view(torch.uint8), got.reshape(len(got), -1).view(torch.uint8)
            if not torch.equal(a, b):
                n = int((a != b).sum())
                self._bad = self._bad or f"{key[0]} {key[1]} of layer {layer}: {n} of {a.numel()} bytes differ"
            if self._bad is not None:
                dst.copy_(want.to(dst.device))  # the reference's copy: what attention reads this step
        self._check.add(layer)
        self._check_s += time.perf_counter() - t0

    def ready(self, layer: int) -> dict[tuple, torch.Tensor]:
        """Layer `layer`'s staged parts, once its copy has landed (issued now if it was not)."""
        if layer not in self._waited:
            if layer not in self._pending:
                self.issue(layer)
            self._wait(layer)
            self._waited.add(layer)
            self.hs._say("ready", layer)
        return self._staged[layer]

    def _wait(self, layer: int) -> None:
        got = self._pending[layer]
        if got is not None:  # CUDA: the compute stream waits for the side stream's copy
            torch.cuda.current_stream(self.hs.device).wait_event(got)
        if self._check is not None:
            self._verify(layer)

    @torch.inference_mode()
    def refresh(self, layer: int, slots: torch.Tensor) -> None:
        """The step wrote host-tier blocks `slots` (CPU index) of `layer` after its copy was issued: copy them
        again, once that copy has landed, so attention reads what was just written."""
        if layer not in self._order:
            return
        staged = self.ready(layer)
        rows = torch.from_numpy(self.staged_rows(slots.numpy())).to(self.hs.device)
        self.hs._say("refresh", layer)
        for side in SIDES:
            for name, part in self.src[side].items():
                staged[(side, name)][rows] = part[layer][slots].to(self.hs.device, non_blocking=True)

    def finish(self) -> None:
        """Wait for every copy issued (a layer whose host blocks no read touched, e.g. outside a window), so
        the next step may reuse the buffers; raises what a copy raised. On a checked step, the verdict."""
        for layer in list(self._pending):
            if layer not in self._waited:
                self._wait(layer)
                self._waited.add(layer)
        if self._check is not None and self._check:
            path = "host blocks streamed a layer ahead" + (" (side stream)" if self.hs.cuda else "")
            ok = self._bad is None
            detail = (f"every staged byte equal: {len(self._check)} layers, {self.n} blocks" if ok else self._bad)
            self.verdict = (path, ok, detail, "" if ok else "the host tier read at each read (no staging)",
                            self._check_s)
            self.hs.checked = True  # (a step whose host blocks no read touched leaves the next step to check)
            self.hs.failed = not ok
            self._check = None


def gather_rows(src: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    """out = src[slots] (rows of a host tier's part into a staging or bounce buffer)."""
    torch.index_select(src, 0, slots, out=out)
