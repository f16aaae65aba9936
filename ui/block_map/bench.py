"""Fake snapshots and the block map bench: a plausible snapshot from numpy alone (for demos, screenshots and
the bench), and the frame time of a shown block map per colour mode. `python -m ui.block_map.bench [N ...]`."""

from __future__ import annotations

import time

import numpy as np
from PySide6.QtWidgets import QApplication

from engine.telemetry.snapshot import SeqTable, Snapshot, TierSnapshot
from ui.block_map.widget import MODES, BlockMap


def fake_snapshot(capacities: tuple[int, int] = (24_000, 72_000), *, block_size: int = 16, n_seqs: int = 40,
                  seed: int = 0, t: float = 0.0, tables: bool = True, used: tuple[float, float] = (0.85, 0.6)
                  ) -> Snapshot:
    """A plausible snapshot built from numpy alone: runs of blocks per sequence, a shared prefix, cached
    blocks with decaying heat, free slots. For demos, screenshots and the bench."""
    rng = np.random.default_rng(seed)
    tiers = []
    slots_of: dict[int, list[tuple[int, np.ndarray]]] = {}
    for ti, (cap, frac) in enumerate(zip(capacities, used)):
        state = np.zeros(cap, np.uint8)
        owner = np.full(cap, -1, np.int32)
        ref = np.zeros(cap, np.int32)
        fill = np.zeros(cap, np.int32)
        n_used = int(cap * frac)
        if n_used:
            # allocations come in runs (one sequence's blocks), scattered by churn
            pick = np.sort(rng.choice(cap, n_used, replace=False))
            run = max(8, n_used // (3 * n_seqs))
            run_owner = np.repeat(rng.integers(0, n_seqs, n_used // run + 1), run)[:n_used]
            state[pick] = np.where(rng.random(n_used) < 0.7, 2, 1)
            owner[pick] = run_owner
            ref[pick] = np.where(state[pick] == 2, 1 + (rng.random(n_used) < 0.15) * rng.integers(1, 5, n_used), 0)
            fill[pick] = np.where(rng.random(n_used) < 0.85, block_size, rng.integers(0, block_size + 1, n_used))
        age = rng.exponential(2.0 if ti == 0 else 20.0, cap).astype(np.float32)
        heat = (rng.gamma(1.2, 3.0, cap) * np.exp(-age / 30)).astype(np.float32)
        heat[state == 0] = 0
        owner[state == 1] = np.where(rng.random(int((state == 1).sum())) < 0.5, -1, owner[state == 1])
        hashed = (fill == block_size) & (state != 0)
        erng = np.random.default_rng((seed, ti))  # its own stream: the arrays above stay what they were
        kerr = np.where(state != 0, erng.lognormal(np.log(0.006), 0.4, cap), np.nan).astype(np.float32)
        kerr[erng.random(cap) < 0.03] = np.nan  # some blocks not measured (re-laid, copied on write)
        verr = (kerr * erng.uniform(0.7, 1.1, cap)).astype(np.float32)
        tiers.append(TierSnapshot(name=("device", "host")[ti], capacity=cap, block_bytes=2 * block_size * 8 * 64 * 2
                                  * 24, state=state, owner=owner, ref=ref, fill=fill, heat=heat, age=age,
                                  hashed=hashed, kerr=kerr, verr=verr))
        inuse = np.flatnonzero(owner >= 0)
        order = np.argsort(owner[inuse], kind="stable")
        ids, starts = np.unique(owner[inuse][order], return_index=True)
        for sid, part in zip(ids, np.split(inuse[order], starts[1:])):
            slots_of.setdefault(int(sid), []).append((ti, part))
    ids = np.arange(n_seqs, dtype=np.int32)
    bt, bsl = [], []
    for sid in ids:
        parts = slots_of.get(int(sid), [])
        bt.append(np.concatenate([np.full(len(p), ti, np.int8) for ti, p in parts]) if parts and tables
                  else np.zeros(0, np.int8))
        bsl.append(np.concatenate([p for _, p in parts]).astype(np.int64) if parts and tables
                   else np.zeros(0, np.int64))
    z = np.zeros(n_seqs, np.int32)
    seqs = SeqTable(id=ids, state=np.ones(n_seqs, np.int8), tokens=z, generated=z,
                    blocks_device=np.array([sum(len(p) for ti, p in slots_of.get(int(s), []) if ti == 0) for s in ids],
                                           np.int32),
                    blocks_host=np.array([sum(len(p) for ti, p in slots_of.get(int(s), []) if ti == 1) for s in ids],
                                         np.int32),
                    tokens_per_s=np.zeros(n_seqs, np.float32), ttft=np.zeros(n_seqs, np.float32),
                    prefix_reused=z, labels=tuple(f"req-{i}" for i in ids), block_tier=tuple(bt),
                    block_slot=tuple(bsl))
    return Snapshot(t=t, model={}, config={"block_size": block_size}, tiers=tuple(tiers), seqs=seqs, counters={},
                    windowed={}, memory={}, series={}, residency={})


def bench_block_map(n_blocks: int, frames: int = 30) -> dict:
    """Median / max ms per frame (set_snapshot + the event loop's repaint of a shown 1400×700 map) per mode,
    over `frames` frames alternating between three random snapshots of n_blocks (¼ device, ¾ host), with a
    sequence selected. Also splits each frame into set_snapshot (numpy codes) and paint."""
    app = QApplication.instance() or QApplication([])
    dev = n_blocks // 4
    snaps = [fake_snapshot((dev, n_blocks - dev), n_seqs=500, seed=s, tables=False) for s in range(3)]
    w = BlockMap()
    w.resize(1400, 700)
    w.show()
    app.processEvents()
    w.set_snapshot(snaps[0])
    w.set_selected(7)
    app.processEvents()
    out: dict = {"n_blocks": n_blocks, "frames": frames, "image_shape": w.codes.shape, "modes": {}}
    for mode in MODES:
        w.set_mode(mode)
        app.processEvents()
        total, setsnap, paints = [], [], 0
        for f in range(frames):
            p0 = w.image.paints
            t0 = time.perf_counter()
            w.set_snapshot(snaps[f % 3])
            t1 = time.perf_counter()
            app.processEvents()
            if w.image.paints == p0:  # the event loop did not paint: force it, and count that too
                w.view.viewport().repaint()
            t2 = time.perf_counter()
            paints += w.image.paints - p0
            total.append(1e3 * (t2 - t0))
            setsnap.append(1e3 * (t1 - t0))
        out["modes"][mode] = {"median_ms": float(np.median(total)), "max_ms": float(np.max(total)),
                              "set_snapshot_median_ms": float(np.median(setsnap)),
                              "paint_median_ms": float(np.median(np.subtract(total, setsnap))),
                              "paints_per_frame": paints / frames}
    w.close()
    w.deleteLater()
    app.processEvents()
    return out


if __name__ == "__main__":
    import json
    import sys

    for n in (int(a) for a in sys.argv[1:] or ["1000000", "100000"]):
        print(json.dumps(bench_block_map(n), indent=1))
