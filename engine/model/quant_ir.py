"""Weight-only quantized matmuls written as LLVM IR vector code, compiled for this CPU by llvmlite (the LLVM that
numba brings) and driven over threads by numba. The CPU path of engine/model/quant.py.

Why IR: numba compiles scalar loops, and the loops of quant_kernels.py leave LLVM accumulators in memory and one
float conversion per weight; written as vector IR the inner step is what llama.cpp's ggml-cpu does by hand:

  int4 weights, int8 activations ("int8", the default; llama.cpp's Q4_x x Q8 dot):
      16 packed bytes -> 32 nibbles (and, shift) -> u8 x s8 products summed in pairs (pmaddubsw), then in fours
      (pmaddwd) -> 8 int32 -> float, times scale[g] * xscale[g] into 8 float accumulators; zero[g] * sum(x[g])
      added per group. With AVX-512 VNNI (kernel_ir_vnni4b) 8 groups at a time: their bytes permuted so that one
      vpdpbusd takes 4 inputs of each, x laid out to match, the groups' integer sums converted and scaled once.
  int8 weights, int8 activations: with groups of 32 or more, 32 bytes a step as llama.cpp's Q8_0 dot does it
      (pmaddubsw(|w|, x * sign(w)), then pmaddwd); groups of 16 (a GGUF's Q6_K) 16 bytes a step, sign-extended to
      int16, products summed in pairs (pmaddwd). With AVX-512 VNNI, groups of exactly 32 (Q8_0) 8 groups at a time
      (kernel_ir_vnni8b, w + 128 as the unsigned operand, 128 * sum(x) taken away per group).
  fp32 activations ("fp32", exact: equal to the dequantized weight's matmul up to float rounding): nibbles / bytes
      converted to float and multiplied by x, four 8-lane products per group folded, times scale[g].

Activations are quantized per group of 32 inputs (int8, scale max|x| / 127, round to nearest) once per call, as
llama.cpp quantizes them to Q8_0 / Q8_1 before its integer dots: the integer path's error is that rounding (about
1e-2 of a row's largest output on random data; `kvscope bench --weights-quality` reports what it does to tokens).

Each function takes T rows of x at once (T = 1, 2, 4, 8: a batch's rows share each weight load) and a range of
weight rows; the numba driver splits the rows over threads (prange) and the batch into tiles. On x86 with AVX2 the
integer dots call LLVM's x86 intrinsics (pmaddubsw, pmaddwd); elsewhere they are plain vector IR, which LLVM lowers
for whatever the CPU has. If the IR does not compile (no llvmlite, an LLVM without these intrinsics), quant.py falls
back to quant_kernels.py, and says why in `status()`. KVSCOPE_QUANT_IR=portable compiles the plain IR on x86 too
(the tests check both); KVSCOPE_QUANT_IR=off uses quant_kernels.py.
"""

from __future__ import annotations

import os
import threading

import numpy as np

try:
    import llvmlite.binding as llvm
    import numba
    from numba import njit, prange

    _IMPORT_ERROR = ""
except Exception as e:  # pragma: no cover - numba/llvmlite missing or broken
    llvm = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

TILES = (8, 4, 2, 1)  # rows of x one call takes
XL_PLAIN, XL_Q4B, XL_Q8B = 0, 1, 2  # the order an operand's kernels read int8 x in: as it is, _interleave_q4b's,
# _interleave_q8b's
ACT_GROUP = 32  # inputs per activation scale (int8 activations)
KINDS = ("q4f", "q4i", "q8f", "q8i", "q8w")  # int4 / int8 weights x fp32 / int8 activations; q8w: q8i 32 wide


# -- IR -------------------------------------------------------------------------------------------------------------


def _seq(lo: int, hi: int) -> str:
    return ", ".join(f"i32 {i}" for i in range(lo, hi))


def _splat(t: str, n: int, v) -> str:
    return "<" + ", ".join(f"{t} {v}" for _ in range(n)) + ">"


_DECLARE_X86 = """
declare <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8>, <32 x i8>)
declare <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16>, <16 x i16>)
declare <32 x i8> @llvm.x86.avx2.psign.b(<32 x i8>, <32 x i8>)
declare <32 x i8> @llvm.abs.v32i8(<32 x i8>, i1)
"""
_DECLARE = """
declare <8 x float> @llvm.fma.v8f32(<8 x float>, <8 x float>, <8 x float>)
declare float @llvm.fma.f32(float, float, float)
declare float @llvm.vector.reduce.fadd.v8f32(float, <8 x float>)
"""

# Arguments of every kernel (all 64-bit: pointers are passed as integers by the numba driver):
#   q, s, z: the weight's packed values [N, ...], scales and zeros [N, Gw] float32
#   x: T rows of activations (float32, or int8 for the integer kernels), row stride xst elements
#   dx: their per-32 scales [T, K/32] float32 (integer kernels), row stride dst
#   xs: their per-group sums [T, ...] float32 (the zero term), row stride sst
#   out: [T, N] float32, row stride ost
#   gidx: int32 [K/16]: the weight group of each 16 inputs (int8 weights)
#   n0, n1: the weight rows to compute; Gw: groups per weight row; K: inputs
_ARGS = ("q", "s", "z", "x", "dx", "xs", "out", "gidx", "n0", "n1", "Gw", "K", "xst", "dst", "sst", "ost")


def _int_dot4(w: str, xv: str, out: str, x86: bool) -> str:
    """<8 x i32> %out = sums of 4 neighbouring products of u8 <32 x i8> %w and s8 %xv."""
    if x86:
        return (f"  {out}.p = call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> {w}, <32 x i8> {xv})\n"
                f"  {out} = call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> {out}.p, <16 x i16> "
                f"{_splat('i16', 16, 1)})\n")
    return (f"  {out}.a = zext <32 x i8> {w} to <32 x i32>\n"
            f"  {out}.b = sext <32 x i8> {xv} to <32 x i32>\n"
            f"  {out}.m = mul <32 x i32> {out}.a, {out}.b\n"
            + _fold32(f"{out}.m", out, "i32", "add"))


def _int_dot4s(w: str, xv: str, out: str, x86: bool) -> str:
    """<8 x i32> %out = sums of 4 neighbouring products of s8 <32 x i8> %w and s8 %xv (|xv| <= 127): on x86
    pmaddubsw(|w|, xv * sign(w)) then pmaddwd, llama.cpp's trick for two signed operands (no pair of products
    reaches the int16 limit: 128 * 127 * 2 < 32768)."""
    if x86:
        return (f"  {out}.aw = call <32 x i8> @llvm.abs.v32i8(<32 x i8> {w}, i1 false)\n"
                f"  {out}.sx = call <32 x i8> @llvm.x86.avx2.psign.b(<32 x i8> {xv}, <32 x i8> {w})\n"
                + _int_dot4(f"{out}.aw", f"{out}.sx", out, True))
    return (f"  {out}.a = sext <32 x i8> {w} to <32 x i32>\n"
            f"  {out}.b = sext <32 x i8> {xv} to <32 x i32>\n"
            f"  {out}.m = mul <32 x i32> {out}.a, {out}.b\n"
            + _fold32(f"{out}.m", out, "i32", "add"))


def _int_dot2(w16: str, xv: str, out: str, x86: bool) -> str:
    """<8 x i32> %out = sums of 2 neighbouring products of <16 x i16> %w16 and s8 <16 x i8> %xv."""
    if x86:
        return (f"  {out}.x = sext <16 x i8> {xv} to <16 x i16>\n"
                f"  {out} = call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> {w16}, <16 x i16> {out}.x)\n")
    return (f"  {out}.a = sext <16 x i16> {w16} to <16 x i32>\n"
            f"  {out}.b = sext <16 x i8> {xv} to <16 x i32>\n"
            f"  {out}.m = mul <16 x i32> {out}.a, {out}.b\n"
            f"  {out}.lo = shufflevector <16 x i32> {out}.m, <16 x i32> poison, <8 x i32> <{_seq(0, 8)}>\n"
            f"  {out}.hi = shufflevector <16 x i32> {out}.m, <16 x i32> poison, <8 x i32> <{_seq(8, 16)}>\n"
            f"  {out} = add <8 x i32> {out}.lo, {out}.hi\n")


def _fold32(src: str, out: str, t: str, op: str) -> str:
    """<8 x t> %out = the four 8-lane quarters of <32 x t> %src combined with op."""
    q = [f"  {out}.q{i} = shufflevector <32 x {t}> {src}, <32 x {t}> poison, <8 x i32> <{_seq(8 * i, 8 * i + 8)}>\n"
         for i in range(4)]
    return ("".join(q) + f"  {out}.s0 = {op} <8 x {t}> {out}.q0, {out}.q1\n"
            f"  {out}.s1 = {op} <8 x {t}> {out}.q2, {out}.q3\n  {out} = {op} <8 x {t}> {out}.s0, {out}.s1\n")


def _bcast(src: str, out: str) -> str:
    return (f"  {out}.i = insertelement <8 x float> poison, float {src}, i64 0\n"
            f"  {out} = shufflevector <8 x float> {out}.i, <8 x float> poison, <8 x i32> zeroinitializer\n")


def _load(t: str, base: str, idx: str, out: str, vec: str | None = None) -> str:
    ty = vec or t
    return f"  {out}.a = getelementptr {t}, ptr {base}, i64 {idx}\n  {out} = load {ty}, ptr {out}.a, align 1\n"


def _as_floats(convert: str, n: int, sx: str) -> str:
    """The fp32-activation steps' weights: `convert` (a conversion of n weights) as <8 x float> parts %wf0{sx}..,
    and the step's scale broadcast, %svb{sx}."""
    L = [f"  %wf{sx} = {convert} to <{n} x float>\n"]
    for i in range(n // 8):
        L.append(f"  %wf{i}{sx} = shufflevector <{n} x float> %wf{sx}, <{n} x float> poison, "
                 f"<8 x i32> <{_seq(8 * i, 8 * i + 8)}>\n")
    return "".join(L) + _bcast(f"%sv{sx}", f"%svb{sx}")


def _scaled_into(t: int, sx: str, acc: str) -> str:
    """%acc{t}{sx} = acc + float(%p{t}{sx}) * (weight scale %sv{sx} * input scale %dv{t}{sx})."""
    return (f"  %f{t}{sx} = sitofp <8 x i32> %p{t}{sx} to <8 x float>\n"
            f"  %sd{t}{sx} = fmul float %sv{sx}, %dv{t}{sx}\n" + _bcast(f"%sd{t}{sx}", f"%sdb{t}{sx}")
            + f"  %acc{t}{sx} = call <8 x float> @llvm.fma.v8f32(<8 x float> %f{t}{sx}, <8 x float> %sdb{t}{sx}, "
            f"<8 x float> {acc})\n")


def _step(int4: bool, integer: bool, T: int, x86: bool, c: str, sx: str, acc: list[str], zacc: list[str],
          wide: bool = False) -> str:
    """One inner step (a group of 32 inputs for int4, 16 for int8, 32 for wide int8) at step index %c for T x
    rows, every name suffixed sx: acc[t] / zacc[t] are the running sums it adds to, %acc{t}{sx} / %zacc{t}{sx}
    the new ones."""
    L = []
    if wide:  # int8 weights x int8 activations, 32 inputs (one activation group) a step
        L.append(f"  %qa.o{sx} = mul i64 {c}, 32\n" + _load("i8", "%qp", f"%qa.o{sx}", f"%qv{sx}", "<32 x i8>"))
        L.append(_load("i32", "%gidx", c, f"%gi{sx}") + f"  %gi64{sx} = sext i32 %gi{sx} to i64\n")
        L.append(_load("float", "%sp", f"%gi64{sx}", f"%sv{sx}"))
        for t in range(T):
            L.append(_load("i8", f"%xb{t}", f"%qa.o{sx}", f"%xv{t}{sx}", "<32 x i8>"))
            L.append(_int_dot4s(f"%qv{sx}", f"%xv{t}{sx}", f"%p{t}{sx}", x86))
            L.append(_load("float", f"%db{t}", c, f"%dv{t}{sx}"))
            L.append(_scaled_into(t, sx, acc[t]))
        return "".join(L)
    if int4:
        L.append(f"  %qa.o{sx} = mul i64 {c}, 16\n" + _load("i8", "%qp", f"%qa.o{sx}", f"%qv{sx}", "<16 x i8>"))
        L.append(f"  %lo{sx} = and <16 x i8> %qv{sx}, {_splat('i8', 16, 15)}\n"
                 f"  %hi{sx} = lshr <16 x i8> %qv{sx}, {_splat('i8', 16, 4)}\n")
        L.append(f"  %w{sx} = shufflevector <16 x i8> %lo{sx}, <16 x i8> %hi{sx}, <32 x i32> <{_seq(0, 32)}>\n")
        L.append(_load("float", "%sp", c, f"%sv{sx}") + _load("float", "%zp", c, f"%zv{sx}"))
        if not integer:
            L.append(_as_floats(f"uitofp <32 x i8> %w{sx}", 32, sx))
        L.append(f"  %xo{sx} = mul i64 {c}, 32\n")
    else:
        L.append(f"  %qa.o{sx} = mul i64 {c}, 16\n")
        L.append(_load("i8", "%qp", f"%qa.o{sx}", f"%qv{sx}", "<16 x i8>"))
        L.append(_load("i32", "%gidx", c, f"%gi{sx}") + f"  %gi64{sx} = sext i32 %gi{sx} to i64\n")
        L.append(_load("float", "%sp", f"%gi64{sx}", f"%sv{sx}"))
        if integer:
            L.append(f"  %w16{sx} = sext <16 x i8> %qv{sx} to <16 x i16>\n  %dc{sx} = lshr i64 {c}, 1\n")
        else:
            L.append(_as_floats(f"sitofp <16 x i8> %qv{sx}", 16, sx))
        L.append(f"  %xo{sx} = mul i64 {c}, 16\n")
    for t in range(T):
        if integer:
            if int4:
                L.append(_load("i8", f"%xb{t}", f"%xo{sx}", f"%xv{t}{sx}", "<32 x i8>"))
                L.append(_int_dot4(f"%w{sx}", f"%xv{t}{sx}", f"%p{t}{sx}", x86))
                L.append(_load("float", f"%db{t}", c, f"%dv{t}{sx}"))
            else:
                L.append(_load("i8", f"%xb{t}", f"%xo{sx}", f"%xv{t}{sx}", "<16 x i8>"))
                L.append(_int_dot2(f"%w16{sx}", f"%xv{t}{sx}", f"%p{t}{sx}", x86))
                L.append(_load("float", f"%db{t}", f"%dc{sx}", f"%dv{t}{sx}"))
            L.append(_scaled_into(t, sx, acc[t]))
        else:
            parts = 4 if int4 else 2
            for i in range(parts):
                L.append(f"  %xo{t}.{i}{sx} = add i64 %xo{sx}, {8 * i}\n")
                L.append(_load("float", f"%xb{t}", f"%xo{t}.{i}{sx}", f"%xv{t}.{i}{sx}", "<8 x float>"))
            L.append(f"  %m{t}.0{sx} = fmul <8 x float> %wf0{sx}, %xv{t}.0{sx}\n")
            for i in range(1, parts):
                L.append(f"  %m{t}.{i}{sx} = call <8 x float> @llvm.fma.v8f32(<8 x float> %wf{i}{sx}, <8 x float> "
                         f"%xv{t}.{i}{sx}, <8 x float> %m{t}.{i - 1}{sx})\n")
            L.append(f"  %acc{t}{sx} = call <8 x float> @llvm.fma.v8f32(<8 x float> %m{t}.{parts - 1}{sx}, "
                     f"<8 x float> %svb{sx}, <8 x float> {acc[t]})\n")
        if int4:
            L.append(_load("float", f"%sb{t}", c, f"%xsv{t}{sx}"))
            L.append(f"  %zacc{t}{sx} = call float @llvm.fma.f32(float %zv{sx}, float %xsv{t}{sx}, float {zacc[t]})\n")
    return "".join(L)


def _row_bases(T: int, x_type: str, xs_type: str = "float") -> str:
    """Each x row's base pointers, %xb{t} (x), %db{t} (dx), %sb{t} (xs) and %ob{t} (out), from the row strides."""
    return "".join(f"  %xo{t} = mul i64 %xst.i, {t}\n  %xb{t} = getelementptr {x_type}, ptr %x, i64 %xo{t}\n"
                   f"  %do{t} = mul i64 %dst.i, {t}\n  %db{t} = getelementptr float, ptr %dx, i64 %do{t}\n"
                   f"  %so{t} = mul i64 %sst.i, {t}\n  %sb{t} = getelementptr {xs_type}, ptr %xs, i64 %so{t}\n"
                   f"  %oo{t} = mul i64 %ost.i, {t}\n  %ob{t} = getelementptr float, ptr %out, i64 %oo{t}\n"
                   for t in range(T))


def _block_sums(t: int, W: list[str], off: str, chains: int) -> tuple[str, str]:
    """x row t's four vpdpbusd of a block (the step operands W, x's 64 bytes at byte off + 64 j) into `chains`
    independent integer sums, added: (the IR, the name of the 16-lane sum)."""
    L, sums = [], ["zeroinitializer"] * chains
    for j in range(4):
        c = j % chains
        L.append(f"  %xo{t}.{j} = add i64 {off}, {64 * j}\n"
                 f"  %xa{t}.{j} = getelementptr i8, ptr %xb{t}, i64 %xo{t}.{j}\n"
                 f"  %xv{t}.{j} = load <16 x i32>, ptr %xa{t}.{j}, align 1\n"
                 f"  %ia{t}.{j} = call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> {sums[c]}, "
                 f"<16 x i32> {W[j]}, <16 x i32> %xv{t}.{j})\n")
        sums[c] = f"%ia{t}.{j}"
    if chains == 1:
        return "".join(L), sums[0]
    L.append(f"  %ic{t} = add <16 x i32> {sums[0]}, {sums[1]}\n")
    return "".join(L), f"%ic{t}"


def _row_store(T: int, sums: str) -> str:
    """Each x row's 8-lane sum `sums` ({t} formatted) added across its lanes and stored at out[t, r]; then the next
    weight row, or %done."""
    return "".join(f"  %tot{t} = call reassoc float @llvm.vector.reduce.fadd.v8f32(float 0.0, <8 x float> "
                   f"{sums.format(t=t)})\n"
                   f"  %oa{t} = getelementptr float, ptr %ob{t}, i64 %r\n  store float %tot{t}, ptr %oa{t}, align 4\n"
                   for t in range(T)) + ("  %r1 = add i64 %r, 1\n  %rc = icmp slt i64 %r1, %n1.i\n"
                                         "  br i1 %rc, label %row, label %done\ndone:\n  ret void\n}\n")


def _loop_exit(var: str, bound: str, loop: str, exit_: str, entry: str, ty: str, name: str, val: str, T: int) -> str:
    """The back edge of loop block %loop (counter %var, while below bound) and its exit block %exit_, which starts
    with each x row's phi `name` ({t} formatted): zero from %entry (the loop not run), `val` from the loop."""
    return (f"  %{var}1 = add i64 %{var}, 1\n  %{var}more = icmp ult i64 %{var}1, {bound}\n"
            f"  br i1 %{var}more, label %{loop}, label %{exit_}\n{exit_}:\n"
            + "".join(f"  {name.format(t=t)} = phi {ty} [zeroinitializer, %{entry}], [{val.format(t=t)}, %{loop}]\n"
                      for t in range(T)))


def _prologue(name: str, T: int, int4: bool, x_type: str, counts: str) -> str:
    """A kernel's entry block (arguments as pointers, the step counts `counts` defines, each x row's base
    pointers) and the head of its row loop (the row's weight, scale and zero pointers), ending in a branch to
    %step when %haspair, else %pairend."""
    L = [f"define void @{name}(" + ", ".join(f"i64 %{n}.i" for n in _ARGS) + ") {\nentry:\n"]
    for n in _ARGS[:8]:
        L.append(f"  %{n} = inttoptr i64 %{n}.i to ptr\n")
    L.append(counts)
    L.append("  %rowq = " + ("udiv i64 %K.i, 2\n" if int4 else "add i64 %K.i, 0\n"))
    L.append(_row_bases(T, x_type))  # each x row's base pointers
    L.append("  %empty = icmp sge i64 %n0.i, %n1.i\n  br i1 %empty, label %done, label %row\n")
    L.append("row:\n  %r = phi i64 [%n0.i, %entry], [%r1, %rowend]\n")
    L.append("  %qo = mul i64 %r, %rowq\n  %qp = getelementptr i8, ptr %q, i64 %qo\n")
    L.append("  %so = mul i64 %r, %Gw.i\n  %sp = getelementptr float, ptr %s, i64 %so\n"
             "  %zp = getelementptr float, ptr %z, i64 %so\n  br i1 %haspair, label %step, label %pairend\n")
    return "".join(L)


def _sums_from_step(T: int, int4: bool, sfx: str) -> str:
    """The phis of the A and B sums (%acc{t}A{sfx}, ...): zero when coming from %row, the step's new ones when
    from %step (at the step loop's head, sfx "", and after it, ".f")."""
    L = []
    for t in range(T):
        for ab in "AB":
            L.append(f"  %acc{t}{ab}{sfx} = phi <8 x float> [zeroinitializer, %row], [%acc{t}.{ab}, %step]\n")
            if int4:
                L.append(f"  %zacc{t}{ab}{sfx} = phi float [0.0, %row], [%zacc{t}.{ab}, %step]\n")
    return "".join(L)


def kernel_ir(kind: str, T: int, x86: bool) -> str:
    """One kernel's IR: `kind` (KINDS) for T rows of x. The inner loop takes two steps at a time into two sets
    of sums (A, B: independent chains, so a step does not wait on the previous one's FMA), then an odd last step
    into A; A and B are added at the row's end."""
    int4, wide = kind.startswith("q4"), kind == "q8w"
    integer = kind.endswith("i") or wide
    step = 32 if int4 or wide else 16  # inputs per inner step: a group of 32 (int4, wide int8), 16 (int8)
    name = f"{kind}_t{T}"
    counts = (f"  %steps = udiv i64 %K.i, {step}\n  %pairs2 = and i64 %steps, -2\n  %odd = and i64 %steps, 1\n"
              "  %haspair = icmp ne i64 %pairs2, 0\n  %isodd = icmp ne i64 %odd, 0\n")
    L = [_prologue(name, T, int4, "i8" if integer else "float", counts)]
    # -- two steps at a time
    L.append("step:\n  %c = phi i64 [0, %row], [%c2, %step]\n" + _sums_from_step(T, int4, ""))
    L.append("  %cb = add i64 %c, 1\n")
    L.append(_step(int4, integer, T, x86, "%c", ".A", [f"%acc{t}A" for t in range(T)], [f"%zacc{t}A" for t in range(T)],
                   wide))
    L.append(_step(int4, integer, T, x86, "%cb", ".B", [f"%acc{t}B" for t in range(T)], [f"%zacc{t}B" for t in range(T)],
                   wide))
    L.append("  %c2 = add i64 %c, 2\n  %more = icmp ult i64 %c2, %pairs2\n  br i1 %more, label %step, label %pairend\n")
    # -- the sums after the pairs, and an odd last step into A
    L.append("pairend:\n  %cend = phi i64 [0, %row], [%c2, %step]\n" + _sums_from_step(T, int4, ".f"))
    L.append("  br i1 %isodd, label %tail, label %rowend\n")
    L.append("tail:\n")
    L.append(_step(int4, integer, T, x86, "%cend", ".T", [f"%acc{t}A.f" for t in range(T)],
                   [f"%zacc{t}A.f" for t in range(T)], wide))
    L.append("  br label %rowend\n")
    # -- row end: one horizontal sum per x row
    L.append("rowend:\n")
    for t in range(T):  # phis first: they lead the block
        L.append(f"  %accA{t}.r = phi <8 x float> [%acc{t}A.f, %pairend], [%acc{t}.T, %tail]\n")
        if int4:
            L.append(f"  %zaccA{t}.r = phi float [%zacc{t}A.f, %pairend], [%zacc{t}.T, %tail]\n")
    for t in range(T):
        L.append(f"  %accs{t} = fadd <8 x float> %accA{t}.r, %acc{t}B.f\n")
        if int4:
            L.append(f"  %zs{t} = fadd float %zaccA{t}.r, %zacc{t}B.f\n")
        init = f"%zs{t}" if int4 else "0.0"
        L.append(f"  %tot{t} = call reassoc float @llvm.vector.reduce.fadd.v8f32(float {init}, <8 x float> %accs{t})\n")
        L.append(f"  %oa{t} = getelementptr float, ptr %ob{t}, i64 %r\n  store float %tot{t}, ptr %oa{t}, align 4\n")
    L.append("  %r1 = add i64 %r, 1\n  %rc = icmp slt i64 %r1, %n1.i\n  br i1 %rc, label %row, label %done\n")
    L.append("done:\n  ret void\n}\n")
    return "".join(L)


_DECLARE_VNNI = """
declare <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32>, <16 x i32>, <16 x i32>)
declare <64 x i8> @llvm.abs.v64i8(<64 x i8>, i1)
declare <8 x float> @llvm.masked.load.v8f32.p0(ptr, i32, <8 x i1>, <8 x float>)
"""
VNNI_KINDS = {"q4b": "q4i", "q8v": "q8w"}  # AVX-512 VNNI kernel -> the kind whose work it does


def _prefetch(ptr: str, locality: int) -> str:
    """A read prefetch of the line at %ptr (a hint: it never faults, past an array's end included). locality is
    llvm.prefetch's: 0 prefetchnta, 1 prefetcht2, 2 prefetcht1 (into the L2 on Zen 4 and Intel cores), 3 prefetcht0."""
    return f"  call void @llvm.prefetch.p0(ptr {ptr}, i32 0, i32 {locality}, i32 1)\n"


# Bytes of packed weights ahead of each block that the int4 VNNI kernel prefetches (scales and zeros: the same
# groups ahead, 16 bytes of weights a group; the Q8_0 kernel twice as far, 32 a group). Over the default model's 120
# int4 matmuls (which do not fit the cache), through _mm: 4.29 ms at 1 row of x and 7.64 at 8 with 2 KiB, against
# 4.58 / 8.65 with none, 4.41 / 7.75 with 1 KiB and 4.70 / 7.82 with 4 KiB (EPYC znver4, 2026-12-07, medians of 9
# alternating).
Q4_PREFETCH = 2048
Q4_LOCALITY = 0  # prefetchnta (measured with the kernel before the block ones: 2.69 ms at 1 row against 3.04 with
# prefetcht1, 8.85 vs 9.29 at 8)


Q4B_GROUPS = 8  # activation groups a block of the blocked int4 VNNI kernel takes (256 inputs, 128 packed bytes)
Q4B_BLOCK = Q4B_GROUPS * 32  # inputs a block: the interleaved activations' block (_interleave_q4b)


def kernel_ir_vnni4b(T: int) -> str:
    """q4i's work with AVX-512 VNNI over blocks of 8 groups (256 inputs), each group's integer sum kept in integer
    lanes until its block ends. A block's 128 packed bytes (8 groups of 16; byte k of group i: input k in its low
    nibble, 16 + k in its high one: the weight's layout as it is) are loaded as two 16-dword registers and
    permuted (two vpermt2d) so that step j (0-3) holds dword j of every group: its low nibbles (inputs 4j..4j+3 of
    group i, lane i) and high ones (inputs 16+4j.., lane 8+i) make one 64-byte vpdpbusd operand. The x rows are laid
    out to match (_interleave_q4b): per block and step 64 bytes, lane i group i's inputs 4j.., lane 8+i its 16+4j...
    Four vpdpbusd into one integer sum, lanes i and 8+i added, and the block's 8 groups converted to float once,
    times scale[g] * xscale[g], plus zero[g] * sum(x[g]): 8-lane float work per 8 groups. The groups after the last
    whole block (K = 576: 2 of 18) go two at a time in one vpdpbusd (lanes 0-7 the first group's sums of four, 8-15
    the second's; x in its natural order there), converted and scaled 16 lanes a pair, an odd last one with its upper
    half zero. Same arguments as q4i, x in _interleave_q4b's layout.
    Measured over the default model's 120 int4 matmuls (EPYC znver4, 2026-12-07), against the kernel it replaced
    (every two groups one vpdpbusd, then 16 lanes converted, scaled and added): 6.13 vs 8.26 ms at 8 rows of x,
    2.60 vs 2.85 at 1 (medians of 7, alternating)."""
    name = f"q4b_t{T}"
    chains = 2 if T < 4 else 1  # independent integer sums per x row (a chain of 4 dependent vpdpbusd at 1-2 rows)
    L = [f"define void @{name}(" + ", ".join(f"i64 %{n}.i" for n in _ARGS) + ") {\nentry:\n"]
    for n in _ARGS[:8]:
        L.append(f"  %{n} = inttoptr i64 %{n}.i to ptr\n")
    L.append("  %nb = lshr i64 %Gw.i, 3\n  %m = and i64 %Gw.i, 7\n  %hasblk = icmp ne i64 %nb, 0\n"
             "  %np = lshr i64 %m, 1\n  %haspair = icmp ne i64 %np, 0\n  %odd = and i64 %m, 1\n"
             "  %isodd = icmp ne i64 %odd, 0\n  %rowq = udiv i64 %K.i, 2\n"
             "  %mt = trunc i64 %m to i32\n  %mi = insertelement <8 x i32> poison, i32 %mt, i64 0\n"
             "  %ms = shufflevector <8 x i32> %mi, <8 x i32> poison, <8 x i32> zeroinitializer\n"
             f"  %m8 = icmp ult <8 x i32> <{_seq(0, 8)}>, %ms\n"
             "  %tailq = shl i64 %nb, 7\n  %tailg = shl i64 %nb, 3\n  %tailx = shl i64 %nb, 8\n"
             "  %lastg = sub i64 %Gw.i, 1\n  %lastq = shl i64 %lastg, 4\n  %lastx = shl i64 %lastg, 5\n")
    L.append(_row_bases(T, "i8"))
    L.append("  %empty = icmp sge i64 %n0.i, %n1.i\n  br i1 %empty, label %done, label %row\n")
    L.append("row:\n  %r = phi i64 [%n0.i, %entry], [%r1, %rowend]\n"
             "  %qo = mul i64 %r, %rowq\n  %qp = getelementptr i8, ptr %q, i64 %qo\n"
             "  %so = mul i64 %r, %Gw.i\n  %sp = getelementptr float, ptr %s, i64 %so\n"
             "  %zp = getelementptr float, ptr %z, i64 %so\n  br i1 %hasblk, label %blk, label %pend\n")

    def fload(base: str, g0: str, out: str, masked: bool = False) -> str:
        a = f"  {out}.a = getelementptr float, ptr {base}, i64 {g0}\n"
        if masked:
            return a + (f"  {out} = call <8 x float> @llvm.masked.load.v8f32.p0(ptr {out}.a, i32 4, <8 x i1> %m8, "
                        "<8 x float> zeroinitializer)\n")
        return a + f"  {out} = load <8 x float>, ptr {out}.a, align 4\n"

    # -- whole blocks of 8 groups
    L.append("blk:\n  %b = phi i64 [0, %row], [%b1, %blk]\n")
    L.append("".join(f"  %acc{t} = phi <8 x float> [zeroinitializer, %row], [%a{t}.n, %blk]\n" for t in range(T)))
    L.append("  %bq = shl i64 %b, 7\n  %bg = shl i64 %b, 3\n  %bx = shl i64 %b, 8\n"
             "  %qa = getelementptr i8, ptr %qp, i64 %bq\n  %qb = getelementptr i8, ptr %qa, i64 64\n"
             "  %A = load <16 x i32>, ptr %qa, align 1\n  %B = load <16 x i32>, ptr %qb, align 1\n")
    if Q4_PREFETCH:  # the block's two lines of weight bytes, and its scales and zeros, that far ahead
        L.append(f"  %pq = getelementptr i8, ptr %qa, i64 {Q4_PREFETCH}\n" + _prefetch("%pq", Q4_LOCALITY)
                 + f"  %pq2 = getelementptr i8, ptr %qa, i64 {Q4_PREFETCH + 64}\n" + _prefetch("%pq2", Q4_LOCALITY)
                 + f"  %pg = add i64 %bg, {Q4_PREFETCH // 16}\n"
                 "  %ps = getelementptr float, ptr %sp, i64 %pg\n" + _prefetch("%ps", Q4_LOCALITY)
                 + "  %pz = getelementptr float, ptr %zp, i64 %pg\n" + _prefetch("%pz", Q4_LOCALITY))
    W = []
    for h in (0, 1):  # steps 2h and 2h + 1: dwords 2h and 2h + 1 of the 8 groups
        idx = [4 * i + 2 * h for i in range(8)] + [4 * i + 2 * h + 1 for i in range(8)]
        L.append(f"  %P{h} = shufflevector <16 x i32> %A, <16 x i32> %B, <16 x i32> <"
                 + ", ".join(f"i32 {i}" for i in idx) + ">\n"
                 f"  %Pb{h} = bitcast <16 x i32> %P{h} to <64 x i8>\n"
                 f"  %lo{h} = and <64 x i8> %Pb{h}, {_splat('i8', 64, 15)}\n"
                 f"  %hi{h} = lshr <64 x i8> %Pb{h}, {_splat('i8', 64, 4)}\n")
        for k in (0, 1):
            j, a = 2 * h + k, 32 * k
            L.append(f"  %W{j}b = shufflevector <64 x i8> %lo{h}, <64 x i8> %hi{h}, <64 x i32> <"
                     + ", ".join(f"i32 {i}" for i in list(range(a, a + 32)) + list(range(64 + a, 96 + a))) + ">\n"
                     f"  %W{j} = bitcast <64 x i8> %W{j}b to <16 x i32>\n")
            W.append(f"%W{j}")
    L.append(fload("%sp", "%bg", "%S") + fload("%zp", "%bg", "%Z"))
    for t in range(T):
        ir_, tot = _block_sums(t, W, "%bx", chains)
        L.append(ir_)
        L.append(f"  %il{t} = shufflevector <16 x i32> {tot}, <16 x i32> poison, <8 x i32> <{_seq(0, 8)}>\n"
                 f"  %ih{t} = shufflevector <16 x i32> {tot}, <16 x i32> poison, <8 x i32> <{_seq(8, 16)}>\n"
                 f"  %is{t} = add <8 x i32> %il{t}, %ih{t}\n  %f{t} = sitofp <8 x i32> %is{t} to <8 x float>\n")
        L.append(fload(f"%db{t}", "%bg", f"%D{t}") + fload(f"%sb{t}", "%bg", f"%XS{t}"))
        L.append(f"  %sd{t} = fmul <8 x float> %S, %D{t}\n"
                 f"  %a{t}.1 = call <8 x float> @llvm.fma.v8f32(<8 x float> %f{t}, <8 x float> %sd{t}, <8 x float> %acc{t})\n"
                 f"  %a{t}.n = call <8 x float> @llvm.fma.v8f32(<8 x float> %Z, <8 x float> %XS{t}, <8 x float> %a{t}.1)\n")
    L.append(_loop_exit("b", "%nb", "blk", "pend", "row", "<8 x float>", "%acc{t}.p", "%a{t}.n", T))
    L.append("  br i1 %haspair, label %pair, label %pairend\n")

    # -- the groups after the blocks: two at a time (one vpdpbusd, lanes 0-7 / 8-15 a group each), then an odd one,
    # into 16-lane sums
    pick = "<16 x i32> <" + ", ".join(["i32 0"] * 8 + ["i32 1"] * 8) + ">"
    order = list(range(0, 16)) + list(range(32, 48)) + list(range(16, 32)) + list(range(48, 64))

    def pair(sfx: str, qoff: str, g0: str, xoff: str, one: bool, into: str) -> str:
        """Groups g0, g0 + 1 (one: g0 alone, the upper half zero) at packed byte qoff, x byte xoff."""
        P = [f"  %tq{sfx} = getelementptr i8, ptr %qp, i64 {qoff}\n"]
        if one:
            P.append(f"  %tqh{sfx} = load <16 x i8>, ptr %tq{sfx}, align 1\n"
                     f"  %tqv{sfx} = shufflevector <16 x i8> %tqh{sfx}, <16 x i8> zeroinitializer, <32 x i32> <{_seq(0, 32)}>\n")
        else:
            P.append(f"  %tqv{sfx} = load <32 x i8>, ptr %tq{sfx}, align 1\n")
        P.append(f"  %tlo{sfx} = and <32 x i8> %tqv{sfx}, {_splat('i8', 32, 15)}\n"
                 f"  %thi{sfx} = lshr <32 x i8> %tqv{sfx}, {_splat('i8', 32, 4)}\n"
                 f"  %tw{sfx} = shufflevector <32 x i8> %tlo{sfx}, <32 x i8> %thi{sfx}, <64 x i32> <"
                 + ", ".join(f"i32 {i}" for i in order) + ">\n"
                 f"  %twi{sfx} = bitcast <64 x i8> %tw{sfx} to <16 x i32>\n")
        if one:
            P.append(f"  %ts1{sfx}.a = getelementptr float, ptr %sp, i64 {g0}\n  %ts1{sfx} = load float, ptr %ts1{sfx}.a\n"
                     f"  %tsv{sfx} = insertelement <2 x float> zeroinitializer, float %ts1{sfx}, i64 0\n")
        else:
            P.append(_load("float", "%sp", g0, f"%tsv{sfx}", "<2 x float>"))
        for t in range(T):
            P.append(f"  %tx{t}{sfx}.a = getelementptr i8, ptr %xb{t}, i64 {xoff}\n")
            if one:
                P.append(f"  %txh{t}{sfx} = load <32 x i8>, ptr %tx{t}{sfx}.a, align 1\n"
                         f"  %txv{t}{sfx} = shufflevector <32 x i8> %txh{t}{sfx}, <32 x i8> zeroinitializer, "
                         f"<64 x i32> <{_seq(0, 64)}>\n"
                         f"  %td1{t}{sfx}.a = getelementptr float, ptr %db{t}, i64 {g0}\n"
                         f"  %td1{t}{sfx} = load float, ptr %td1{t}{sfx}.a\n"
                         f"  %tdv{t}{sfx} = insertelement <2 x float> zeroinitializer, float %td1{t}{sfx}, i64 0\n")
            else:
                P.append(f"  %txv{t}{sfx} = load <64 x i8>, ptr %tx{t}{sfx}.a, align 1\n"
                         + _load("float", f"%db{t}", g0, f"%tdv{t}{sfx}", "<2 x float>"))
            P.append(f"  %txi{t}{sfx} = bitcast <64 x i8> %txv{t}{sfx} to <16 x i32>\n"
                     f"  %tp{t}{sfx} = call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> zeroinitializer, "
                     f"<16 x i32> %twi{sfx}, <16 x i32> %txi{t}{sfx})\n"
                     f"  %tf{t}{sfx} = sitofp <16 x i32> %tp{t}{sfx} to <16 x float>\n"
                     f"  %tsd{t}{sfx} = fmul <2 x float> %tsv{sfx}, %tdv{t}{sfx}\n"
                     f"  %tsdv{t}{sfx} = shufflevector <2 x float> %tsd{t}{sfx}, <2 x float> poison, {pick}\n"
                     f"  %t{t}{sfx} = call <16 x float> @llvm.fma.v16f32(<16 x float> %tf{t}{sfx}, "
                     f"<16 x float> %tsdv{t}{sfx}, <16 x float> {into.format(t=t)})\n")
        return "".join(P)

    L.append("pair:\n  %c = phi i64 [0, %pend], [%c1, %pair]\n")
    L.append("".join(f"  %tacc{t} = phi <16 x float> [zeroinitializer, %pend], [%t{t}.n, %pair]\n" for t in range(T)))
    L.append("  %cq0 = shl i64 %c, 5\n  %cq = add i64 %tailq, %cq0\n  %cg0 = shl i64 %c, 1\n  %cg = add i64 %tailg, %cg0\n"
             "  %cx0 = shl i64 %c, 6\n  %cx = add i64 %tailx, %cx0\n")
    L.append(pair(".n", "%cq", "%cg", "%cx", False, "%tacc{t}"))
    L.append(_loop_exit("c", "%np", "pair", "pairend", "pend", "<16 x float>", "%tacc{t}.p", "%t{t}.n", T))
    L.append("  br i1 %isodd, label %one, label %rowend\n")
    L.append("one:\n" + pair(".o", "%lastq", "%lastg", "%lastx", True, "%tacc{t}.p") + "  br label %rowend\n")
    # -- row end: the tail's zero term (masked: none without a tail), its sums folded in, one horizontal sum
    L.append("rowend:\n" + "".join(f"  %tacc{t}.r = phi <16 x float> [%tacc{t}.p, %pairend], [%t{t}.o, %one]\n"
                                   for t in range(T)))
    L.append(fload("%zp", "%tailg", "%TZ", True))
    for t in range(T):
        L.append(fload(f"%sb{t}", "%tailg", f"%TXS{t}", True)
                 + f"  %e{t}.1 = call <8 x float> @llvm.fma.v8f32(<8 x float> %TZ, <8 x float> %TXS{t}, <8 x float> %acc{t}.p)\n"
                 f"  %tl{t} = shufflevector <16 x float> %tacc{t}.r, <16 x float> poison, <8 x i32> <{_seq(0, 8)}>\n"
                 f"  %th{t} = shufflevector <16 x float> %tacc{t}.r, <16 x float> poison, <8 x i32> <{_seq(8, 16)}>\n"
                 f"  %e{t}.2 = fadd <8 x float> %tl{t}, %th{t}\n  %e{t} = fadd <8 x float> %e{t}.1, %e{t}.2\n")
    L.append(_row_store(T, "%e{t}"))
    return "".join(L)


def kernel_ir_vnni8b(T: int) -> str:
    """q8w's work for groups of exactly 32 (a GGUF's Q8_0) with AVX-512 VNNI over blocks of 8 groups (256 inputs),
    as kernel_ir_vnni4b: a block's 256 bytes loaded as four 16-dword registers and permuted (vpermt2d, then
    vshufi64x2) so that step j (0-3) holds dwords j and 4 + j of every group (lanes 0-3: groups 0-3's dword j, 4-7
    their dword 4 + j, 8-15 the same of groups 4-7), flipped to unsigned (w + 128: vpdpbusd multiplies u8 by s8),
    and four vpdpbusd into one integer sum; x laid out to match (_interleave_q8b). At the block's end each group's
    two lanes are added, 128 * sum(x[g]) (exact, in integers: _interleave_q8b's sums) taken away, and the 8 groups
    converted and scaled once. Groups after the last whole block: two at a time as kernel_ir_vnni8 takes them
    (|w| x (x * sign(w)), lanes 0-7 / 8-15 a group each), an odd last one through AVX2's step. Same arguments as
    q8w, x in _interleave_q8b's layout and xs the int32 sums 128 * sum(x[g])."""
    name = f"q8b_t{T}"
    chains = 2 if T < 4 else 1
    counts = ("  %nb = lshr i64 %Gw.i, 3\n  %m = and i64 %Gw.i, 7\n  %hasblk = icmp ne i64 %nb, 0\n"
              "  %np = lshr i64 %m, 1\n  %haspair = icmp ne i64 %np, 0\n  %odd = and i64 %m, 1\n"
              "  %isodd = icmp ne i64 %odd, 0\n  %tailg = shl i64 %nb, 3\n  %tailx = shl i64 %nb, 8\n"
              "  %last = sub i64 %Gw.i, 1\n")
    L = [f"define void @{name}(" + ", ".join(f"i64 %{n}.i" for n in _ARGS) + ") {\nentry:\n"]
    for n in _ARGS[:8]:
        L.append(f"  %{n} = inttoptr i64 %{n}.i to ptr\n")
    L.append(counts)
    L.append(_row_bases(T, "i8", "i32"))
    L.append("  %empty = icmp sge i64 %n0.i, %n1.i\n  br i1 %empty, label %done, label %row\n")
    L.append("row:\n  %r = phi i64 [%n0.i, %entry], [%r1, %rowend]\n"
             "  %qo = mul i64 %r, %K.i\n  %qp = getelementptr i8, ptr %q, i64 %qo\n"
             "  %so = mul i64 %r, %Gw.i\n  %sp = getelementptr float, ptr %s, i64 %so\n"
             "  br i1 %hasblk, label %blk, label %pend\n")
    # -- whole blocks of 8 groups
    L.append("blk:\n  %b = phi i64 [0, %row], [%b1, %blk]\n")
    L.append("".join(f"  %acc{t} = phi <8 x float> [zeroinitializer, %row], [%a{t}.n, %blk]\n" for t in range(T)))
    L.append("  %bq = shl i64 %b, 8\n  %bg = shl i64 %b, 3\n")
    L.append("  %qa = getelementptr i8, ptr %qp, i64 %bq\n")
    for i in range(4):
        L.append(f"  %qa{i} = getelementptr i8, ptr %qa, i64 {64 * i}\n  %R{i} = load <16 x i32>, ptr %qa{i}, align 1\n")
    if Q4_PREFETCH:
        for i in range(4):
            L.append(f"  %pq{i} = getelementptr i8, ptr %qa, i64 {2 * Q4_PREFETCH + 64 * i}\n" + _prefetch(f"%pq{i}", Q4_LOCALITY))
        L.append(f"  %pg = add i64 %bg, {2 * Q4_PREFETCH // 32}\n  %ps = getelementptr float, ptr %sp, i64 %pg\n"
                 + _prefetch("%ps", Q4_LOCALITY))
    W = []
    flip = _splat("i32", 16, -2139062144)  # 0x80808080: every byte + 128 (mod 256)
    for h in (0, 1):  # steps 2h and 2h + 1
        idx = [k for j in (2 * h, 2 * h + 1) for k in [8 * i + j for i in range(4)] + [8 * i + 4 + j for i in range(4)]]
        ids = "<16 x i32> <" + ", ".join(f"i32 {i}" for i in idx) + ">"
        L.append(f"  %PA{h} = shufflevector <16 x i32> %R0, <16 x i32> %R1, {ids}\n"
                 f"  %PC{h} = shufflevector <16 x i32> %R2, <16 x i32> %R3, {ids}\n")
        for k, (a, c) in enumerate(((0, 16), (8, 24))):
            j = 2 * h + k
            L.append(f"  %W{j}s = shufflevector <16 x i32> %PA{h}, <16 x i32> %PC{h}, <16 x i32> <"
                     + ", ".join(f"i32 {i}" for i in list(range(a, a + 8)) + list(range(c, c + 8))) + ">\n"
                     f"  %W{j} = xor <16 x i32> %W{j}s, {flip}\n")
            W.append(f"%W{j}")
    L.append("  %Sa = getelementptr float, ptr %sp, i64 %bg\n  %S = load <8 x float>, ptr %Sa, align 4\n")
    swap = "<16 x i32> <" + ", ".join(f"i32 {i}" for i in (4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11)) + ">"
    for t in range(T):
        ir_, tot = _block_sums(t, W, "%bq", chains)
        L.append(ir_)
        L.append(f"  %iw{t} = shufflevector <16 x i32> {tot}, <16 x i32> poison, {swap}\n"
                 f"  %it{t} = add <16 x i32> {tot}, %iw{t}\n"
                 f"  %ig{t} = shufflevector <16 x i32> %it{t}, <16 x i32> poison, <8 x i32> <i32 0, i32 1, i32 2, "
                 "i32 3, i32 8, i32 9, i32 10, i32 11>\n"
                 f"  %cs{t}.a = getelementptr i32, ptr %sb{t}, i64 %bg\n  %cs{t} = load <8 x i32>, ptr %cs{t}.a, align 4\n"
                 f"  %is{t} = sub <8 x i32> %ig{t}, %cs{t}\n  %f{t} = sitofp <8 x i32> %is{t} to <8 x float>\n"
                 f"  %D{t}.a = getelementptr float, ptr %db{t}, i64 %bg\n  %D{t} = load <8 x float>, ptr %D{t}.a, align 4\n"
                 f"  %sd{t} = fmul <8 x float> %S, %D{t}\n"
                 f"  %a{t}.n = call <8 x float> @llvm.fma.v8f32(<8 x float> %f{t}, <8 x float> %sd{t}, <8 x float> %acc{t})\n")
    L.append(_loop_exit("b", "%nb", "blk", "pend", "row", "<8 x float>", "%acc{t}.p", "%a{t}.n", T))
    L.append("  br i1 %haspair, label %pair, label %pairend\n")
    # -- pairs after the blocks (kernel_ir_vnni8's step, x natural there)
    pick = "<16 x i32> <" + ", ".join(["i32 0"] * 8 + ["i32 1"] * 8) + ">"
    L.append("pair:\n  %c = phi i64 [0, %pend], [%c1, %pair]\n")
    L.append("".join(f"  %tacc{t} = phi <16 x float> [zeroinitializer, %pend], [%t{t}.n, %pair]\n" for t in range(T)))
    L.append("  %cg0 = shl i64 %c, 1\n  %g0 = add i64 %tailg, %cg0\n  %tq = shl i64 %g0, 5\n"
             + _load("i8", "%qp", "%tq", "%tqv", "<64 x i8>")
             + "  %neg = icmp slt <64 x i8> %tqv, zeroinitializer\n"
             "  %aw = call <64 x i8> @llvm.abs.v64i8(<64 x i8> %tqv, i1 false)\n  %awi = bitcast <64 x i8> %aw to <16 x i32>\n"
             + _load("float", "%sp", "%g0", "%tsv", "<2 x float>"))
    for t in range(T):
        L.append(_load("i8", f"%xb{t}", "%tq", f"%txv{t}", "<64 x i8>")
                 + f"  %tnx{t} = sub <64 x i8> zeroinitializer, %txv{t}\n"
                 f"  %tsx{t} = select <64 x i1> %neg, <64 x i8> %tnx{t}, <64 x i8> %txv{t}\n"
                 f"  %txi{t} = bitcast <64 x i8> %tsx{t} to <16 x i32>\n"
                 f"  %tp{t} = call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> zeroinitializer, "
                 f"<16 x i32> %awi, <16 x i32> %txi{t})\n  %tf{t} = sitofp <16 x i32> %tp{t} to <16 x float>\n"
                 + _load("float", f"%db{t}", "%g0", f"%tdv{t}", "<2 x float>")
                 + f"  %tsd{t} = fmul <2 x float> %tsv, %tdv{t}\n"
                 f"  %tsdv{t} = shufflevector <2 x float> %tsd{t}, <2 x float> poison, {pick}\n"
                 f"  %t{t}.n = call <16 x float> @llvm.fma.v16f32(<16 x float> %tf{t}, <16 x float> %tsdv{t}, "
                 f"<16 x float> %tacc{t})\n")
    L.append(_loop_exit("c", "%np", "pair", "pairend", "pend", "<16 x float>", "%tacc{t}.p", "%t{t}.n", T))
    L.append("  br i1 %isodd, label %tail, label %rowend\n")
    L.append("tail:\n" + _step(False, True, T, True, "%last", ".T", ["zeroinitializer"] * T, ["0.0"] * T, wide=True)
             + "  br label %rowend\n")
    L.append("rowend:\n")
    for t in range(T):
        L.append(f"  %oacc{t} = phi <8 x float> [zeroinitializer, %pairend], [%acc{t}.T, %tail]\n")
    for t in range(T):
        L.append(f"  %tl{t} = shufflevector <16 x float> %tacc{t}.p, <16 x float> poison, <8 x i32> <{_seq(0, 8)}>\n"
                 f"  %th{t} = shufflevector <16 x float> %tacc{t}.p, <16 x float> poison, <8 x i32> <{_seq(8, 16)}>\n"
                 f"  %e{t}.1 = fadd <8 x float> %tl{t}, %th{t}\n  %e{t}.2 = fadd <8 x float> %acc{t}.p, %oacc{t}\n"
                 f"  %e{t} = fadd <8 x float> %e{t}.1, %e{t}.2\n")
    L.append(_row_store(T, "%e{t}"))
    return "".join(L)


def kernel_ir_vnni(kind: str, T: int) -> str:
    """The AVX-512 VNNI kernel `kind` (VNNI_KINDS) for T rows of x."""
    return kernel_ir_vnni4b(T) if kind == "q4b" else kernel_ir_vnni8(T)


def kernel_ir_vnni8(T: int) -> str:
    """q8w's work with AVX-512 VNNI: two activation groups (64 inputs) a step in one 512-bit register, |w| x
    (x * sign(w)) summed in fours by one vpdpbusd (lanes 0-7 the first group's, 8-15 the second's), scaled by
    [s0 d0 x 8, s1 d1 x 8]; an odd last group through the AVX2 step. Same arguments and arithmetic as q8w."""
    name = f"q8v_t{T}"
    counts = ("  %steps = udiv i64 %K.i, 32\n  %pairs = lshr i64 %steps, 1\n  %odd = and i64 %steps, 1\n"
              "  %last = sub i64 %steps, 1\n  %haspair = icmp ne i64 %pairs, 0\n  %isodd = icmp ne i64 %odd, 0\n")
    L = [_prologue(name, T, False, "i8", counts)]

    def sums(sfx: str) -> str:  # the 16-lane sums: zero from %row, the step's from %step
        return "".join(f"  %acc{t}{sfx} = phi <16 x float> [zeroinitializer, %row], [%acc{t}.n, %step]\n"
                       for t in range(T))

    L.append("step:\n  %c = phi i64 [0, %row], [%c1, %step]\n" + sums(""))
    L.append("  %g0 = shl i64 %c, 1\n  %g1 = add i64 %g0, 1\n")
    L.append("  %qa.o = mul i64 %c, 64\n" + _load("i8", "%qp", "%qa.o", "%qv", "<64 x i8>"))
    L.append("  %neg = icmp slt <64 x i8> %qv, zeroinitializer\n"
             "  %aw = call <64 x i8> @llvm.abs.v64i8(<64 x i8> %qv, i1 false)\n"
             "  %wi = bitcast <64 x i8> %aw to <16 x i32>\n")
    for i in (0, 1):
        L.append(_load("i32", "%gidx", f"%g{i}", f"%gi{i}") + f"  %gi{i}.w = sext i32 %gi{i} to i64\n")
        L.append(_load("float", "%sp", f"%gi{i}.w", f"%s{i}"))
    L.append("  %sv2.a = insertelement <2 x float> poison, float %s0, i64 0\n"
             "  %sv2 = insertelement <2 x float> %sv2.a, float %s1, i64 1\n")
    L.append("  %xo = mul i64 %c, 64\n")
    pick = "<16 x i32> <" + ", ".join("i32 0" for _ in range(8)) + ", " + ", ".join("i32 1" for _ in range(8)) + ">"
    for t in range(T):
        L.append(_load("i8", f"%xb{t}", "%xo", f"%xv{t}", "<64 x i8>"))
        L.append(f"  %nx{t} = sub <64 x i8> zeroinitializer, %xv{t}\n"  # x * sign(w): |w| is the unsigned operand
                 f"  %sx{t} = select <64 x i1> %neg, <64 x i8> %nx{t}, <64 x i8> %xv{t}\n"
                 f"  %xi{t} = bitcast <64 x i8> %sx{t} to <16 x i32>\n")
        L.append(f"  %p{t} = call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> zeroinitializer, "
                 f"<16 x i32> %wi, <16 x i32> %xi{t})\n")
        L.append(f"  %f{t} = sitofp <16 x i32> %p{t} to <16 x float>\n")
        L.append(_load("float", f"%db{t}", "%g0", f"%dv{t}", "<2 x float>"))
        L.append(f"  %sd{t} = fmul <2 x float> %sv2, %dv{t}\n"
                 f"  %sdv{t} = shufflevector <2 x float> %sd{t}, <2 x float> poison, {pick}\n")
        L.append(f"  %acc{t}.n = call <16 x float> @llvm.fma.v16f32(<16 x float> %f{t}, <16 x float> %sdv{t}, "
                 f"<16 x float> %acc{t})\n")
    L.append("  %c1 = add i64 %c, 1\n  %more = icmp ult i64 %c1, %pairs\n  br i1 %more, label %step, label %pairend\n")
    L.append("pairend:\n" + sums(".f"))
    L.append("  br i1 %isodd, label %tail, label %rowend\n")
    L.append("tail:\n")  # the odd last group, AVX2's step into 8-lane sums
    L.append(_step(False, True, T, True, "%last", ".T", ["zeroinitializer"] * T, ["0.0"] * T, wide=True))
    L.append("  br label %rowend\n")
    L.append("rowend:\n")
    for t in range(T):
        L.append(f"  %tacc{t} = phi <8 x float> [zeroinitializer, %pairend], [%acc{t}.T, %tail]\n")
    for t in range(T):
        L.append(f"  %t1{t} = call reassoc float @llvm.vector.reduce.fadd.v8f32(float 0.0, <8 x float> %tacc{t})\n")
        L.append(f"  %tot{t} = call reassoc float @llvm.vector.reduce.fadd.v16f32(float %t1{t}, <16 x float> "
                 f"%acc{t}.f)\n")
        L.append(f"  %oa{t} = getelementptr float, ptr %ob{t}, i64 %r\n  store float %tot{t}, ptr %oa{t}, align 4\n")
    L.append("  %r1 = add i64 %r, 1\n  %rc = icmp slt i64 %r1, %n1.i\n  br i1 %rc, label %row, label %done\n")
    L.append("done:\n  ret void\n}\n")
    return "".join(L)


_DECLARE_F32 = """
declare <16 x float> @llvm.fma.v16f32(<16 x float>, <16 x float>, <16 x float>)
declare float @llvm.vector.reduce.fadd.v16f32(float, <16 x float>)
declare void @llvm.prefetch.p0(ptr, i32, i32, i32)
"""
# The f32 kernel's prefetches fill the L2 (prefetcht1). A prefetch into the L1 (prefetcht0, and prefetcht2 or
# prefetchnta as Zen 4 runs them) holds one of the core's few L1 miss buffers until its line comes: with 8 rows' FMAs
# between loads one core streamed the default model's fp32 weights at 11.0 GB/s so, at 21.1 GB/s with prefetcht1 (its
# rate from the L3: 22.7), and two cores at 27.6 GB/s against 20.5 (AMD EPYC znver4, 2026-12-07, A/B in one process).
F32_LOCALITY = 2
F32_PREFETCH = 2048  # floats ahead of each weight row's load that the f32 kernel prefetches (8 KiB; 4 KiB measured
# 7 % slower at 8 rows, 16 and 32 KiB the same)
F32_ROWS = {1: 4, 2: 4, 4: 2, 8: 2}  # weight rows a step of the f32 kernel for T rows of x (its sums: T x rows)


F32_PANEL_BYTES = 24 << 10  # the most bytes of x (T rows x a panel of inputs) a pass over the weight rows reads


def kernel_ir_f32(T: int) -> str:
    """fp32 weights [N, K] (K in 16s) times T rows of fp32 x: R = F32_ROWS[T] weight rows at a time, 16 inputs a
    step: each row's 16 floats loaded once (and prefetched F32_PREFETCH floats or more ahead), each x row's 16 once,
    multiplied into T x R 16-lane sums (fma); at the rows' end each sum added across its lanes. Rows left over
    (fewer than R) one at a time. The weight is read once for the T rows, where MKL's gemm at 5-8 rows streams it
    at half the memory's rate (`kvscope bench --long`).
    Where T rows of x are more than F32_PANEL_BYTES (K > 768 at 8 rows) the inputs are cut into equal panels and
    the rows passed over once a panel, each row's sums added into out after the first: x read from the L1 (one core
    streamed an fp32 [576, 1536] weight at 8 rows at 9.2 GB/s with x from the L2, 14.7 in panels of 24 KiB (16 KiB:
    14.2, 12 KiB: 13.5), 21.6 at K 576).
    Sums in another order than MKL's: equal up to float rounding. Arguments as the other kernels' (s, z, dx, xs,
    gidx, Gw unused); K >= 16."""
    R = F32_ROWS[T]
    L = [f"define void @f32_t{T}(" + ", ".join(f"i64 %{n}.i" for n in _ARGS) + ") {\nentry:\n"]
    for n in ("q", "x", "out"):
        L.append(f"  %{n} = inttoptr i64 %{n}.i to ptr\n")
    L.append("  %steps = udiv i64 %K.i, 16\n")
    # Panels: n = ceil(T K 4 / F32_PANEL_BYTES) of ceil(steps / n) steps each (the last one shorter).
    L.append(f"  %xbytes = mul i64 %K.i, {4 * T}\n  %np0 = add i64 %xbytes, {F32_PANEL_BYTES - 1}\n"
             f"  %np = udiv i64 %np0, {F32_PANEL_BYTES}\n  %pl0 = add i64 %steps, %np\n  %pl1 = sub i64 %pl0, 1\n"
             "  %plen = udiv i64 %pl1, %np\n")
    # Prefetch distance: whole groups of R rows, at least F32_PREFETCH floats: each row's load is prefetched at the
    # same place of its row that many groups on, so every line is prefetched that far ahead whatever K is.
    L.append(f"  %grp = mul i64 %K.i, {R}\n  %pfg = add i64 %grp, {F32_PREFETCH - 1}\n"
             f"  %pfn = udiv i64 %pfg, %grp\n  %pfd = mul i64 %pfn, %grp\n")
    for t in range(T):
        L.append(f"  %xo{t} = mul i64 %xst.i, {t}\n  %xb{t} = getelementptr float, ptr %x, i64 %xo{t}\n")
        L.append(f"  %oo{t} = mul i64 %ost.i, {t}\n  %ob{t} = getelementptr float, ptr %out, i64 %oo{t}\n")
    L.append("  br label %panel\n")
    # panel: steps [%cs, %ce) of every row
    L.append("panel:\n  %cs = phi i64 [0, %entry], [%ce, %pdone]\n  %ce0 = add i64 %cs, %plen\n"
             "  %cfit = icmp ult i64 %ce0, %steps\n  %ce = select i1 %cfit, i64 %ce0, i64 %steps\n"
             "  %later = icmp ne i64 %cs, 0\n  br label %head\n")

    def rows(n: int, lab: str, back: str) -> str:
        """Blocks {lab}, {lab}.step, {lab}.end: rows %r .. %r + n - 1 over the panel's steps, then a branch to
        %back."""
        out = [f"{lab}:\n"]
        for j in range(n):
            out.append(f"  %{lab}.r{j} = add i64 %r, {j}\n  %{lab}.wo{j} = mul i64 %{lab}.r{j}, %K.i\n"
                       f"  %{lab}.wb{j} = getelementptr float, ptr %q, i64 %{lab}.wo{j}\n")
        out.append(f"  br label %{lab}.step\n{lab}.step:\n"
                   f"  %{lab}.c = phi i64 [%cs, %{lab}], [%{lab}.c1, %{lab}.step]\n")
        for t in range(T):
            for j in range(n):
                out.append(f"  %{lab}.a{t}.{j} = phi <16 x float> [zeroinitializer, %{lab}], [%{lab}.n{t}.{j}, "
                           f"%{lab}.step]\n")
        out.append(f"  %{lab}.o = mul i64 %{lab}.c, 16\n")
        for j in range(n):
            out.append(_load("float", f"%{lab}.wb{j}", f"%{lab}.o", f"%{lab}.w{j}", "<16 x float>"))
            if F32_PREFETCH:  # (a prefetch past the weight's end is a hint and never faults)
                out.append(f"  %{lab}.pfo{j} = add i64 %{lab}.o, %pfd\n"
                           f"  %{lab}.pfa{j} = getelementptr float, ptr %{lab}.wb{j}, i64 %{lab}.pfo{j}\n"
                           + _prefetch(f"%{lab}.pfa{j}", F32_LOCALITY))
        for t in range(T):
            out.append(_load("float", f"%xb{t}", f"%{lab}.o", f"%{lab}.x{t}", "<16 x float>"))
            for j in range(n):
                out.append(f"  %{lab}.n{t}.{j} = call <16 x float> @llvm.fma.v16f32(<16 x float> %{lab}.w{j}, "
                           f"<16 x float> %{lab}.x{t}, <16 x float> %{lab}.a{t}.{j})\n")
        out.append(f"  %{lab}.c1 = add i64 %{lab}.c, 1\n  %{lab}.more = icmp ult i64 %{lab}.c1, %ce\n"
                   f"  br i1 %{lab}.more, label %{lab}.step, label %{lab}.end\n{lab}.end:\n")
        for t in range(T):
            for j in range(n):
                out.append(f"  %{lab}.s{t}.{j} = call reassoc float @llvm.vector.reduce.fadd.v16f32(float 0.0, "
                           f"<16 x float> %{lab}.n{t}.{j})\n"
                           f"  %{lab}.p{t}.{j} = getelementptr float, ptr %ob{t}, i64 %{lab}.r{j}\n"
                           # (the first panel loads and drops what out held)
                           f"  %{lab}.q{t}.{j} = load float, ptr %{lab}.p{t}.{j}, align 4\n"
                           f"  %{lab}.b{t}.{j} = select i1 %later, float %{lab}.q{t}.{j}, float 0.0\n"
                           f"  %{lab}.t{t}.{j} = fadd float %{lab}.b{t}.{j}, %{lab}.s{t}.{j}\n"
                           f"  store float %{lab}.t{t}.{j}, ptr %{lab}.p{t}.{j}, align 4\n")
        out.append(f"  br label %{back}\n")
        return "".join(out)

    # head: R rows while R are left, then single rows while any are left; then the next panel
    L.append(f"head:\n  %r = phi i64 [%n0.i, %panel], [%rR, %many.end], [%r1, %one.end]\n"
             f"  %rR = add i64 %r, {R}\n  %r1 = add i64 %r, 1\n  %fitR = icmp sle i64 %rR, %n1.i\n"
             f"  br i1 %fitR, label %many, label %left\n"
             f"left:\n  %any = icmp slt i64 %r, %n1.i\n  br i1 %any, label %one, label %pdone\n")
    L.append(rows(R, "many", "head") + rows(1, "one", "head"))
    L.append("pdone:\n  %pmore = icmp ult i64 %ce, %steps\n  br i1 %pmore, label %panel, label %done\n")
    L.append("done:\n  ret void\n}\n")
    return "".join(L)


def module_ir(x86: bool, vnni: bool = False) -> str:
    ir_ = (_DECLARE_X86 if x86 else "") + _DECLARE + "".join(kernel_ir(k, t, x86) for k in KINDS for t in TILES)
    ir_ += _DECLARE_F32 + "".join(kernel_ir_f32(t) for t in TILES)  # (the VNNI kernels use its declarations)
    if vnni:
        ir_ += _DECLARE_VNNI + "".join(kernel_ir_vnni(k, t) for k in VNNI_KINDS for t in TILES)
        ir_ += "".join(kernel_ir_vnni8b(t) for t in TILES)
    return ir_


# -- compiled library -----------------------------------------------------------------------------------------------


class _Library:
    """The kernels compiled for this CPU: addresses[kind] = int64 array, [T] = kernel for T rows (0 elsewhere)."""

    def __init__(self, portable: bool = False, vnni: bool | None = None) -> None:
        """portable: the plain vector IR even where the x86 intrinsics would do (KVSCOPE_QUANT_IR=portable);
        vnni: the AVX-512 VNNI kernels for the integer int4 and wide int8 work (None: where the CPU has them and
        not portable; KVSCOPE_QUANT_IR=avx2 says False)."""
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        features = llvm.get_host_cpu_features()
        self.cpu = llvm.get_host_cpu_name()
        self.x86 = (llvm.get_process_triple().startswith(("x86_64", "i686", "i386")) and bool(features.get("avx2"))
                    and not portable)
        target = llvm.Target.from_default_triple()
        self._tm = target.create_target_machine(cpu=self.cpu, features=features.flatten(), opt=3)
        has_vnni = all(features.get(f) for f in ("avx512f", "avx512bw", "avx512vl", "avx512vnni"))
        self.vnni = self.x86 and has_vnni and (vnni is None or vnni)
        mod = llvm.parse_assembly(module_ir(self.x86, self.vnni))
        mod.triple = self._tm.triple
        mod.data_layout = str(self._tm.target_data)
        mod.verify()
        pb = llvm.create_pass_builder(self._tm, llvm.create_pipeline_tuning_options(speed_level=3))
        pb.getModulePassManager().run(mod, pb)
        self._engine = llvm.create_mcjit_compiler(mod, self._tm)  # owns the code: kept alive with the library
        self._engine.finalize_object()
        self.addresses = {}
        for kind in (*KINDS, "f32"):
            table = np.zeros(max(TILES) + 1, dtype=np.int64)
            for t in TILES:
                table[t] = self._engine.get_function_address(f"{kind}_t{t}")
            self.addresses[kind] = table
        if self.vnni:  # the VNNI kernels do q4i's and q8w's work: they take those names
            for kind, replaces in VNNI_KINDS.items():
                table = np.zeros(max(TILES) + 1, dtype=np.int64)
                for t in TILES:
                    table[t] = self._engine.get_function_address(f"{kind}_t{t}")
                self.addresses[replaces] = table
            table = np.zeros(max(TILES) + 1, dtype=np.int64)
            for t in TILES:
                table[t] = self._engine.get_function_address(f"q8b_t{t}")
            self.addresses["q8b"] = table  # q8w's work for groups of 32
        self.isa = ("avx512-vnni (vpdpbusd) + avx2" if self.vnni else "avx2 (pmaddubsw/pmaddwd)" if self.x86
                    else "portable vector IR")


_lock = threading.Lock()
_lib: "_Library | None" = None
_error = _IMPORT_ERROR


def library() -> "_Library | None":
    """The compiled kernels (compiled on first use, about a second), or None where they cannot be (status() says)."""
    global _lib, _error
    if _lib is not None or _error:
        return _lib
    if os.environ.get("KVSCOPE_QUANT_IR") == "off":
        _error = "KVSCOPE_QUANT_IR=off"
        return None
    with _lock:
        if _lib is None and not _error:
            try:
                mode = os.environ.get("KVSCOPE_QUANT_IR")
                _lib = _Library(portable=mode == "portable", vnni=False if mode == "avx2" else None)
            except Exception as e:  # an LLVM that refuses the IR: quant.py uses quant_kernels.py instead
                _error = f"{type(e).__name__}: {e}"
    return _lib


def status() -> str:
    lib = library()
    return f"LLVM IR kernels for {lib.cpu}, {lib.isa}" if lib is not None else f"unavailable ({_error})"


# -- numba glue -----------------------------------------------------------------------------------------------------

if llvm is not None:
    from engine.attention.attn_ir import call as _call  # a call of a compiled function by address, from numba

    @njit(parallel=True, nogil=True, cache=True)
    def _drive(fns, q, s, z, x, dx, xs, out, gidx, Gw, K, chunk):  # pragma: no cover - compiled
        """out[b, n] for every row b of x and n of the weight: weight rows in chunks over threads, x rows in tiles."""
        N, B = out.shape[1], out.shape[0]
        xst, dst, sst, ost = x.strides[0] // x.itemsize, dx.strides[0] // 4, xs.strides[0] // 4, out.strides[0] // 4
        qp, sp, zp, gp = np.int64(q.ctypes.data), np.int64(s.ctypes.data), np.int64(z.ctypes.data), np.int64(gidx.ctypes.data)
        xp, dp, xsp, op = np.int64(x.ctypes.data), np.int64(dx.ctypes.data), np.int64(xs.ctypes.data), np.int64(out.ctypes.data)
        for c in prange((N + chunk - 1) // chunk):
            n0 = c * chunk
            n1 = min(N, n0 + chunk)
            b = 0
            while b < B:
                left = B - b
                T = 8 if left >= 8 else (4 if left >= 4 else (2 if left >= 2 else 1))
                _call(fns[T], (qp, sp, zp, xp + b * xst * x.itemsize, dp + b * dst * 4, xsp + b * sst * 4,
                               op + b * ost * 4, gp, np.int64(n0), np.int64(n1), np.int64(Gw), np.int64(K),
                               np.int64(xst), np.int64(dst), np.int64(sst), np.int64(ost)))
                b += T

    @njit(nogil=True, cache=True, fastmath={"reassoc", "nsz", "contract"})
    def _group_stats(x, dx, xs):  # pragma: no cover - compiled
        """dx[b, g] = max|x| / 127 and xs[b, g] = the sum of x over each 32 inputs g (the sums in any order: the
        loop vectorizes; the max is the same in any order)."""
        for b in range(x.shape[0]):
            for g in range(x.shape[1] // 32):
                m = np.float32(0.0)
                t = np.float32(0.0)
                for j in range(32 * g, 32 * g + 32):
                    v = x[b, j]
                    t += v
                    a = abs(v)
                    m = a if a > m else m
                dx[b, g] = m / np.float32(127.0)
                xs[b, g] = t

    @njit(nogil=True, cache=True)
    def _round_rows(x, dx, xq):  # pragma: no cover - compiled
        """xq = x / d rounded to the nearest int8 level (ties to even, as np.rint: adding and taking away 1.5 * 2^23
        rounds any |v| < 2^22 so, and vectorizes where np.rint is a call per element); compiled strict, so the two
        additions are kept."""
        for b in range(x.shape[0]):
            for g in range(x.shape[1] // 32):
                d = dx[b, g]
                inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
                for j in range(32 * g, 32 * g + 32):
                    v = x[b, j] * inv
                    xq[b, j] = np.int8((v + np.float32(12582912.0)) - np.float32(12582912.0))

    @njit(nogil=True, cache=True)
    def _quantize_rows(x, xq, dx, xs):  # pragma: no cover - compiled
        """x [B, K] float32 -> int8 xq (round to nearest of x / d), d = max|x| / 127 per 32 inputs, and the sums of
        x per 32 (the zero term's)."""
        _group_stats(x, dx, xs)
        _round_rows(x, dx, xq)

    @njit(nogil=True, cache=True)
    def _interleave_q4b(xq, xi):  # pragma: no cover - compiled
        """xq [B, K] int8 in kernel_ir_vnni4b's order, into xi: each whole block of 8 groups (256 inputs, from input
        256 b) as 4 steps of 64 bytes, step j holding at bytes 4i..4i+3 inputs 4j..4j+3 of the block's group i and
        at 32+4i.. its inputs 16+4j..; the groups after the last whole block as they are."""
        K = xq.shape[1]
        whole = (K // Q4B_BLOCK) * Q4B_BLOCK
        for b in range(xq.shape[0]):
            for g in range(whole // 32):
                base = (g // 8) * Q4B_BLOCK + 4 * (g % 8)
                for j in range(4):
                    for e in range(4):
                        xi[b, base + 64 * j + e] = xq[b, 32 * g + 4 * j + e]
                        xi[b, base + 64 * j + 32 + e] = xq[b, 32 * g + 16 + 4 * j + e]
            for k in range(whole, K):
                xi[b, k] = xq[b, k]

    @njit(nogil=True, cache=True)
    def _interleave_q8b(xq, xi, x128):  # pragma: no cover - compiled
        """xq [B, K] int8 in kernel_ir_vnni8b's order, into xi: each whole block of 8 groups as 4 steps of 64 bytes,
        step j holding in its 16-byte quarter k (of lanes 4k..4k+3) at bytes 4i.. the inputs 16 (k % 2) + 4j.. of
        the block's group i + 4 (k // 2); the groups after the last whole block as they are. x128[b, g] = 128 times
        the sum of group g's int8 values (what the kernel's w + 128 adds)."""
        K = xq.shape[1]
        whole = (K // Q4B_BLOCK) * Q4B_BLOCK
        for b in range(xq.shape[0]):
            for g in range(K // 32):
                t = np.int32(0)
                for k in range(32):
                    t += np.int32(xq[b, 32 * g + k])
                x128[b, g] = t * np.int32(128)
            for g in range(whole // 32):
                i, blk = g % 8, g // 8
                for half in range(2):  # inputs 0-15, 16-31 of the group
                    base = blk * Q4B_BLOCK + 16 * (2 * (i // 4) + half) + 4 * (i % 4)
                    for j in range(4):
                        for e in range(4):
                            xi[b, base + 64 * j + e] = xq[b, 32 * g + 16 * half + 4 * j + e]
            for k in range(whole, K):
                xi[b, k] = xq[b, k]

    @njit(nogil=True, cache=True)
    def _group_sums(x, group, xs):  # pragma: no cover - compiled
        for b in range(x.shape[0]):
            for g in range(x.shape[1] // group):
                t = np.float32(0.0)
                for j in range(group * g, group * g + group):
                    t += x[b, j]
                xs[b, g] = t


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [B, K] float32 (K a multiple of 32) -> (int8 [B, K], scales [B, K/32], sums [B, K/32])."""
    B, K = x.shape
    xq = np.empty((B, K), dtype=np.int8)
    dx = np.empty((B, K // ACT_GROUP), dtype=np.float32)
    xs = np.empty((B, K // ACT_GROUP), dtype=np.float32)
    _quantize_rows(x, xq, dx, xs)
    return xq, dx, xs


def _chunk(n: int) -> int:
    per = -(-n // (8 * numba.get_num_threads()))  # ~8 chunks a thread: balance without tiny calls
    return max(16, per)


_NO_GIDX = np.zeros(1, dtype=np.int32)


def operand(kind: str, q: np.ndarray, scale: np.ndarray, zero: np.ndarray, group: int, activations: str,
            lib: "_Library | None" = None) -> tuple | None:
    """How the IR kernels run a packed weight (quant.py's layouts), as the tuple _mm takes: (kernels, q, scale, zero,
    the weight group of each inner step, groups a row, inputs K, int8 activations?, rows a thread's chunk, the order
    the kernels read int8 x in: XL_PLAIN, XL_Q4B or XL_Q8B); None where they cannot (int8 weights with groups or
    inputs not in 16s). int8 activations need K in 32s (else fp32 ones); int8 weights with groups of 32 or more take
    32 inputs a step (q8w; with AVX-512 VNNI, groups of exactly 32 the block kernel q8b), else 16. lib: the compiled
    kernels (library() by default)."""
    lib = lib or library()
    N = q.shape[0]
    K = q.shape[1] * (2 if kind == "int4" else 1)
    if kind == "int4":
        act8 = activations == "int8"
        name, gidx = ("q4i" if act8 else "q4f"), _NO_GIDX
    else:
        if group % 16 or K % 16:
            return None
        act8 = activations == "int8" and K % ACT_GROUP == 0
        step = 32 if act8 and group % 32 == 0 else 16
        name = "q8w" if step == 32 else "q8i" if act8 else "q8f"
        gidx = (np.arange(K // step, dtype=np.int64) * step // group).astype(np.int32)
    layout = XL_PLAIN
    if lib.vnni and name == "q4i":  # the kernel q4i names there: kernel_ir_vnni4b
        layout = XL_Q4B
    elif lib.vnni and name == "q8w" and group == 32:
        name, layout = "q8b", XL_Q8B
    return (lib.addresses[name], q, scale, zero, gidx, scale.shape[1], K, act8, _chunk(N), layout)


if llvm is not None:

    @njit(nogil=True, cache=True)
    def _mm(w, x, out):  # pragma: no cover - compiled
        """out = x @ W.T for an operand() tuple w: x rounded to int8 first where it says so."""
        fns, q, s, z, gidx, Gw, K, act8, chunk, layout = w
        B = x.shape[0]
        xs = np.empty((B, K // 32), dtype=np.float32)
        if act8:
            xq = np.empty((B, K), dtype=np.int8)
            dx = np.empty((B, K // 32), dtype=np.float32)
            _quantize_rows(x, xq, dx, xs)
            if layout == XL_Q4B:
                xi = np.empty((B, K), dtype=np.int8)
                _interleave_q4b(xq, xi)
                xq = xi
            elif layout == XL_Q8B:
                xi = np.empty((B, K), dtype=np.int8)
                x128 = np.empty((B, K // 32), dtype=np.int32)
                _interleave_q8b(xq, xi, x128)
                _drive(fns, q, s, z, xi, dx, x128, out, gidx, Gw, K, chunk)
                return
            _drive(fns, q, s, z, xq, dx, xs, out, gidx, Gw, K, chunk)
        else:
            if Gw != 0:  # the int4 kernels' zero term (int8 ones read no zeros; fp32 weights, Gw 0, no groups)
                _group_sums(x, 32, xs)
            _drive(fns, q, s, z, x, np.empty((1, 1), dtype=np.float32), xs, out, gidx, Gw, K, chunk)


def matmul(x: np.ndarray, op: tuple, zero_group: int = 0) -> np.ndarray:
    """x [B, K] float32 @ the weight of operand() op -> [B, N] float32. zero_group: the group size of an int8
    weight with nonzero zeros (only int8 weights made from int4 ones, quant.stack_rows of mixed formats, have
    them; the int8 kernels read none): its zero term added here; 0: none."""
    out = np.empty((x.shape[0], op[1].shape[0]), dtype=np.float32)
    _mm(op, x, out)
    if zero_group:
        xs = np.empty((x.shape[0], x.shape[1] // zero_group), dtype=np.float32)
        _group_sums(x, zero_group, xs)
        out += xs @ op[3].T
    return out


_NO_F32 = np.zeros((1, 1), dtype=np.float32)

if llvm is not None:

    @njit(nogil=True, cache=True)
    def _mm_f32(fns, w, x, out, chunk):  # pragma: no cover - compiled
        _drive(fns, w, _NO_F32, _NO_F32, x, _NO_F32, _NO_F32, out, _NO_GIDX, 0, w.shape[1], chunk)


def operand_f32(w: np.ndarray, lib: "_Library | None" = None) -> tuple | None:
    """An fp32 weight [N, K] (C-contiguous, K in 16s) as the tuple _mm takes, multiplied by the f32 kernels; None
    where they cannot take it."""
    lib = lib or library()
    if lib is None or w.dtype != np.float32 or w.ndim != 2 or w.shape[1] % 16 or not w.shape[1] \
            or not w.flags.c_contiguous:
        return None
    return (lib.addresses["f32"], w, _NO_F32, _NO_F32, _NO_GIDX, 0, w.shape[1], False, _chunk(w.shape[0]), XL_PLAIN)


def matmul_f32(x: np.ndarray, w: np.ndarray, lib: "_Library | None" = None) -> np.ndarray | None:
    """x [B, K] float32 @ w [N, K].T float32 (both C-contiguous, K in 16s) by the f32 kernels (kernel_ir_f32), or
    None where they are not compiled here or the arrays do not suit them (the caller's gemm then). lib: the compiled
    kernels (library() by default)."""
    op = operand_f32(w, lib)
    if op is None or x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != w.shape[1] or not x.flags.c_contiguous:
        return None
    out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    _mm_f32(op[0], w, x, out, op[8])
    return out
