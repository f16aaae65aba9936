"""fp32 matmuls of a few rows: quant_ir's f32 kernel or MKL, picked per shape by measuring both on this CPU
(engine/model/kernel_choice.py), kept per CPU in the cache directory, and followed by linear() and the fused layers.
No timing is asserted: the measurement is replaced where a test needs a given winner."""

from __future__ import annotations

import json
import os

import pytest
import torch

from engine.model import kernel_choice, quant_ir

pytestmark = pytest.mark.skipif(quant_ir.library() is None, reason="no IR kernels here: MKL is the only kernel")


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty cache directory and no picks in memory; KVSCOPE_F32_KERNEL unset."""
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVSCOPE_F32_KERNEL", raising=False)
    monkeypatch.setattr(kernel_choice, "_picks", None)
    monkeypatch.setattr(kernel_choice, "_measured_now", set())
    monkeypatch.setattr(kernel_choice, "_used", set())
    return tmp_path / kernel_choice.FILE


def _winner(monkeypatch, kernel: str) -> list:
    """measure() replaced: `kernel` wins every shape; returns the (shape, rows) measured."""
    calls = []

    def measure(w, t, repeats=kernel_choice.REPEATS):
        calls.append((tuple(w.shape), t))
        return kernel_choice.Pick(kernel, 10.0 if kernel == "ir" else 20.0, 10.0 if kernel == "mkl" else 20.0)

    monkeypatch.setattr(kernel_choice, "measure", measure)
    return calls


def test_both_kernels_are_measured_on_the_weight_itself(fresh):
    w = torch.randn(96, 64)
    p = kernel_choice.measure(w, 2, repeats=3)
    assert p.kernel in ("ir", "mkl") and p.ir_us > 0 and p.mkl_us > 0
    assert p.kernel == ("ir" if p.ir_us <= p.mkl_us else "mkl")


def test_a_pick_is_measured_once_per_cpu_and_read_back(fresh, monkeypatch):
    calls = _winner(monkeypatch, "mkl")
    w = torch.randn(96, 64)
    assert not kernel_choice.use_ir(w, 3) and not kernel_choice.use_ir(w, 4)  # rows 3 and 4: one tile, one pick
    assert calls == [((96, 64), 4)]
    data = json.loads(fresh.read_text())
    assert data[kernel_choice.cpu_key()] == {"96x64@4": {"kernel": "mkl", "ir_us": 20.0, "mkl_us": 10.0}}
    # a new process on the same CPU: read from the file, nothing measured
    monkeypatch.setattr(kernel_choice, "_picks", None)
    monkeypatch.setattr(kernel_choice, "_measured_now", set())
    monkeypatch.setattr(kernel_choice, "measure", lambda *a, **k: pytest.fail("measured again"))
    assert not kernel_choice.use_ir(w, 4)
    assert kernel_choice.summary() == ["96x64@4: mkl (f32 kernel 20 us, MKL 10 us; from kernel-choice.json)"]
    # another CPU's picks in the same file are not this one's
    data = {"another CPU": {"96x64@8": {"kernel": "ir", "ir_us": 1, "mkl_us": 2}}, **data}
    fresh.write_text(json.dumps(data))
    monkeypatch.setattr(kernel_choice, "_picks", None)
    calls = _winner(monkeypatch, "ir")
    assert kernel_choice.use_ir(w, 8) and calls == [((96, 64), 8)]
    assert set(json.loads(fresh.read_text())) == {"another CPU", kernel_choice.cpu_key()}


@pytest.mark.parametrize("content", [b"\xff\xfe not utf-8", b"[" * 100000, b'{"k": 3}', b"[1, 2]", b"",
                                     json.dumps({"CPU": {"96x64@1": {"kernel": "gpu"}}}).encode()])
def test_a_file_not_written_here_is_measured_anew_and_rewritten(fresh, monkeypatch, content):
    fresh.write_bytes(content)
    calls = _winner(monkeypatch, "ir")
    assert kernel_choice.use_ir(torch.randn(96, 64), 1) and len(calls) == 1
    assert json.loads(fresh.read_text())[kernel_choice.cpu_key()]["96x64@1"]["kernel"] == "ir"


def test_a_fifo_in_the_files_place_is_not_opened(fresh, monkeypatch):
    os.mkfifo(fresh)
    calls = _winner(monkeypatch, "mkl")
    assert not kernel_choice.use_ir(torch.randn(96, 64), 1) and len(calls) == 1  # would block if opened
    assert not os.path.isfile(fresh)


@pytest.mark.parametrize("kernel", ["ir", "mkl"])
def test_linear_follows_the_pick_and_both_give_the_product(fresh, monkeypatch, kernel):
    from engine.model import llama_family

    _winner(monkeypatch, kernel)
    ran = []
    real_ir, real_mkl = quant_ir.matmul_f32, kernel_choice.mkl
    monkeypatch.setattr(quant_ir, "matmul_f32", lambda *a: ran.append("ir") or real_ir(*a))
    monkeypatch.setattr(kernel_choice, "mkl", lambda *a: ran.append("mkl") or real_mkl(*a))
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 64, generator=g), torch.randn(3, 64, generator=g)
    got = llama_family.linear(x, w)
    assert ran == [kernel]
    want = (x.double() @ w.double().T).float()
    # fp32 sums of 64 products: within 64 eps of the sum of their magnitudes
    bound = 64 * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double().T)
    assert ((got.double() - want.double()).abs() <= bound).all()


@pytest.mark.parametrize("kernel", ["ir", "mkl"])
def test_fp32_layers_are_fused_only_where_the_kernel_wins(fresh, monkeypatch, tiny_llama, kernel):
    from engine.model.loader import load_model

    _winner(monkeypatch, kernel)
    model = load_model(tiny_llama)
    from engine.config import CacheConfig, EngineOptions
    from engine.runtime.engine import Engine

    eng = Engine(model, CacheConfig(device_budget_mb=1, host_budget_mb=0), EngineOptions())
    assert all((f is not None) == (kernel == "ir") for f in eng.model.fused)


def test_forced_kernel_measures_nothing(fresh, monkeypatch):
    monkeypatch.setenv("KVSCOPE_F32_KERNEL", "mkl")
    monkeypatch.setattr(kernel_choice, "measure", lambda *a, **k: pytest.fail("measured"))
    assert not kernel_choice.use_ir(torch.randn(96, 64), 1)
    assert not kernel_choice.fuse_layer([torch.randn(96, 64)])
    assert kernel_choice.summary() == ["fp32 matmuls of 1-8 rows: mkl (KVSCOPE_F32_KERNEL=mkl, nothing measured)"]
    assert not fresh.exists()
