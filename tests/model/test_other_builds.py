"""The kernel tests under every build this CPU can execute besides its own, so that the path another CPU takes is
not first run by a user there.

The engine picks one build per machine (engine/model/quant_ir.py): AVX-512 VNNI where the CPU has it (this AMD
EPYC, an Intel Xeon with AMX), AVX2 intrinsics elsewhere on x86, the portable vector IR off x86; without numba
(and the llvmlite it brings) the packed kernels fall back to dequantize + matmul and `--attention cpu` to the
chunked torch path. test_quant_ir.py checks each build's kernels against numpy; here the tests of what uses them
(the fused decode layer, quantized weights in the engine, the attention wiring without numba) run in a pytest of
their own with the build forced (KVSCOPE_QUANT_IR=avx2 / portable) or numba kept out (KVSCOPE_TEST_WITHOUT,
tests/workers.py). The native build is the rest of the suite's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from workers import ROOT

quant_ir = pytest.importorskip("engine.model.quant_ir")

USERS = ["tests/model/test_quant_layer.py", "tests/model/test_quant_weights.py"]
BUILDS = {
    "avx2": ({"KVSCOPE_QUANT_IR": "avx2"}, USERS),
    "portable": ({"KVSCOPE_QUANT_IR": "portable"}, USERS),
    "no-numba": ({"KVSCOPE_TEST_WITHOUT": "numba,llvmlite"}, USERS + ["tests/attention/test_attention_wiring.py"]),
}


def _native() -> str:
    lib = quant_ir.library()
    if lib is None:
        return "none"
    return "vnni" if lib.vnni else "avx2" if lib.x86 else "portable"


@pytest.mark.slow
@pytest.mark.parametrize("build", list(BUILDS))
def test_kernel_users_pass_under_another_build(build):
    native = _native()
    if build == native:
        pytest.skip(f"{build} is this CPU's own build: the rest of the suite runs it")
    if native == "none" and build != "no-numba":
        pytest.skip(f"no IR kernels here ({quant_ir.status()}): no build of them to force")
    if build == "avx2" and native == "portable":
        pytest.skip("this CPU has no AVX2: it cannot execute the AVX2 build")
    extra, files = BUILDS[build]
    env = {k: v for k, v in os.environ.items() if k not in ("KVSCOPE_QUANT_IR", "KVSCOPE_TEST_WITHOUT")}
    # The same converted-model cache as this session's (kept: the inner session removes only a cache it made).
    env.update(extra, KVSCOPE_TEST_CACHE_DIR=os.environ["KVSCOPE_CACHE_DIR"])
    said = "numba and llvmlite kept out"
    if "KVSCOPE_QUANT_IR" in extra:
        probe = subprocess.run([sys.executable, "-c", "from engine.model import quant_ir; print(quant_ir.status())"],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        said = probe.stdout.strip()
        assert {"avx2": "avx2 (pmaddubsw", "portable": "portable vector IR"}[build] in said, said + probe.stderr
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *files],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = "\n".join(run.stdout.strip().splitlines()[-15:])
    assert run.returncode == 0, f"{build} build ({said}):\n{tail}\n{run.stderr[-2000:]}"
    print(f"\n{build} ({said}): {tail.splitlines()[-1]}")
