"""The CPU buffers a decode step streams on 2 MiB pages (engine/hugepages.py): the KV pool's large tier
layers, the weights read from safetensors and the streaming read of the memory floor are advised onto them
(VmFlags "hg" in /proc/self/smaps: the advice, whatever pages the kernel found), lazily committed and zero; small
buffers and KVSCOPE_HUGE_PAGES=off keep plain pages."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from engine import hugepages

pytestmark = pytest.mark.skipif(hugepages.mappings([torch.zeros(1)]) is None, reason="no /proc/self/smaps here")
needs_thp = pytest.mark.skipif(
    not hugepages.enabled(), reason=f"transparent huge pages: {hugepages.system_mode()} (the advice would be ignored)")


@needs_thp
def test_zeros_are_lazy_zeros_on_advised_2mib_aligned_pages():
    t = hugepages.zeros((3, 1 << 20), torch.float32)  # 12 MiB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32
    assert t.data_ptr() % hugepages.PAGE == 0  # every whole 2 MiB of it can be one page
    m = hugepages.mappings([t])
    assert m["bytes"] == 12 << 20 and m["advised"] == 12 << 20
    assert m["huge"] == 0  # nothing written: nothing committed
    assert not t.any()
    t[1, 5] = 2.5
    assert t.sum().item() == 2.5 and hugepages.mappings([t])["huge"] <= hugepages.PAGE  # one page at most
    b = hugepages.zeros((hugepages.PAGE,), torch.bfloat16)  # dtypes numpy lacks
    assert b.dtype == torch.bfloat16 and hugepages.mappings([b])["advised"] == 2 * hugepages.PAGE
    # only whole 2 MiB pages of it are advised: a page over its end would commit memory past the buffer
    odd = hugepages.zeros((5 << 18,), torch.float32)  # 5 MiB: 2 pages, and 1 MiB on plain ones
    assert hugepages.mappings([odd]) == {"bytes": 5 << 20, "advised": 4 << 20, "huge": 0}


def test_small_buffers_and_off_keep_plain_pages(monkeypatch):
    small = hugepages.zeros((1 << 18,), torch.float32)  # 1 MiB: under a page
    assert hugepages.mappings([small])["advised"] == 0 and not small.any()
    monkeypatch.setenv("KVSCOPE_HUGE_PAGES", "off")
    assert not hugepages.enabled() and "KVSCOPE_HUGE_PAGES=off" in hugepages.describe()
    big = hugepages.zeros((4 << 18,), torch.float32)
    assert hugepages.mappings([big])["advised"] == 0 and not big.any()
    # carve leaves them to torch's allocator: no mapping of its own (whose memory might lie where numpy advised
    # before, numpy advising its own large arrays: so the flag is not asked of those)
    made = []
    monkeypatch.setattr(hugepages, "_map", lambda *a: made.append(a))
    ts = hugepages.carve([(4 << 18,), (5,)], torch.float32)
    assert made == [] and [t.shape for t in ts] == [(4 << 18,), (5,)]


def test_system_mode_reads_the_bracketed_setting(tmp_path, monkeypatch):
    f = tmp_path / "enabled"
    for text, mode, on in (("always madvise [never]\n", "never", False), ("[always] madvise never\n", "always", True),
                           ("always [madvise] never\n", "madvise", True), ("garbage\n", "not available", False)):
        f.write_text(text)
        monkeypatch.setattr(hugepages, "_SYSFS", str(f))
        assert hugepages.system_mode() == mode
        assert hugepages.enabled() == (on and hasattr(__import__("mmap"), "MADV_HUGEPAGE"))
    monkeypatch.setattr(hugepages, "_SYSFS", str(tmp_path / "missing"))
    assert hugepages.system_mode() == "not available" and not hugepages.enabled()
    assert "not available" in hugepages.describe()


@needs_thp
def test_pool_tiers_weights_and_the_floor_read_are_advised(tmp_path):
    from engine.kv.codecs import Geometry, codecs_for
    from engine.config import KVDtype
    from engine.model.safetensors_io import read_safetensors
    from engine.runtime.bandwidth import StreamRead

    # a tier's layer of POOL_MIN or more: advised (nothing committed); a smaller one (32 MiB): plain pages
    kc, _ = codecs_for(KVDtype.FP32)
    g = Geometry(layers=2, kv_heads=2, block_size=16, head_dim=64)
    per_block = 2 * 16 * 64 * 4
    big = kc.alloc(g, hugepages.POOL_MIN // per_block, torch.device("cpu"), pin=False)
    small = kc.alloc(g, hugepages.POOL_MIN // per_block // 2, torch.device("cpu"), pin=False)
    for parts, advised in ((big, True), (small, False)):
        for layers in parts.values():
            for t in layers:
                m = hugepages.mappings([t])
                assert m["advised"] == (m["bytes"] if advised else 0) and not t.any()
    # weights: read from safetensors straight into one advised mapping, each tensor its own storage, small ones
    # too (here the norm, first in the file; the mapping's last part page, the embedding's last 4 KiB, is not)
    tensors = {"model.norm.weight": torch.randn(1024), "model.embed_tokens.weight": torch.randn(1024, 1024)}
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        raw = t.numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    w = read_safetensors(str(tmp_path))
    assert torch.equal(w["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    assert torch.equal(w["model.norm.weight"], tensors["model.norm.weight"])
    for t in w.values():
        assert t.untyped_storage().nbytes() == t.numel() * 4  # its own storage: weight_bytes counts it alone
    norm = hugepages.mappings([w["model.norm.weight"]])
    assert norm["bytes"] == 4096 and norm["advised"] == 4096
    assert hugepages.mappings([w["model.embed_tokens.weight"]])["advised"] == (4 << 20) - 4096
    # the floor's read: over the kind of pages the step reads
    probe = StreamRead("cpu", 8)
    assert hugepages.mappings([probe.buf])["advised"] == 8 << 20 and probe.buf.sum().item() == 2 << 20
    assert probe.rate() > 0
