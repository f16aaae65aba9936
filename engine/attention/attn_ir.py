"""Decode attention's two inner loops, and the softmax between them, as LLVM IR vector code, compiled for this CPU by
llvmlite (the LLVM numba brings) and called from numba_kernel.decode_plain, block by block.

For one block of one kv head (its n tokens' K or V: n x D contiguous elements of the pool, fp32, fp16 bits or bf16
bits) and the G query rows that share the head:

  kscore: the G scores of each token, q[r] . k[t], each written to s[r * ss + t]. The G query rows stay in
      registers for the whole block (G x D/16 16-lane vectors); each key is loaded and converted once and used for
      the G dot products (D/16 FMAs each), then summed across its lanes.
  vacc:   acc[r] += p[r * ps + t] * v[t] over the block's tokens, the G x D sums held in registers for the whole
      block and stored once at its end (the numba loop kept them in memory: a load and a store per key and row).
  softmax: between the two passes, each query row's scores replaced by exp(score - max), their max and sum
      written out (Cephes' expf as numba_kernel.exp_row computes it, with fused multiply-adds, 16 lanes at a time).

numba compiles these loops too (the fallback, KVSCOPE_ATTN_IR=off), but it cannot keep the sums in registers across
keys (they are array elements) and converts each key once per query row; these take 2-3x less time per block.
Sums are reassociated (each dot's lanes added in a tree): equal to the numba loops up to float rounding.

Kernels are compiled per (G, D) on first use (all three storage formats, a few tens of milliseconds), where
G x D/16 <= 16 (the sums fit the registers); other shapes, or no llvmlite, run the numba loops. `kernels(G, D)`
gives the addresses decode_plain takes.
"""

from __future__ import annotations

import os
import threading

import numpy as np

try:
    import llvmlite.binding as llvm
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    _IMPORT_ERROR = ""
except Exception as e:  # pragma: no cover - numba/llvmlite missing or broken
    llvm = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

FORMATS = ("f32", "f16", "bf16")  # the element each kernel reads: fp32, fp16 bits, bf16 bits (FORMAT_CODE's order)
MAX_VECTORS = 16  # G x D/16 at most: the sums (and the query rows) kept in registers
NONE = np.zeros((len(FORMATS), 3), dtype=np.int64)  # kernels() where there are none: decode_plain's own loops

if llvm is not None:

    @intrinsic
    def call(typingctx, fn, args):  # pragma: no cover - compiled
        """Call the function at address fn (int64) with the int64s of tuple args (no result). Its code is compiled
        into numba functions cached on disk under other files' names (numba_kernel.decode_plain, quant_ir._drive),
        whose caches numba keys by those files alone: a change here must come with a change there (or a cleared
        cache)."""
        n = args.count

        def codegen(context, builder, signature, llargs):
            fnaddr, tup = llargs
            fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(64)] * n)
            builder.call(builder.inttoptr(fnaddr, fnty.as_pointer()), [builder.extract_value(tup, i) for i in range(n)])
            return context.get_dummy_value()

        return types.void(fn, args), codegen


_DECLARE = """
declare <16 x float> @llvm.fma.v16f32(<16 x float>, <16 x float>, <16 x float>)
declare float @llvm.vector.reduce.fadd.v16f32(float, <16 x float>)
declare <16 x float> @llvm.floor.v16f32(<16 x float>)
declare float @llvm.floor.f32(float)
declare float @llvm.fma.f32(float, float, float)
"""


def _chunk(fmt: str, base: str, idx: str, out: str) -> str:
    """%out = <16 x float>: 16 elements of format fmt at element index idx of base, converted exactly."""
    ty = "float" if fmt == "f32" else "i16"
    L = [f"  {out}.a = getelementptr {ty}, ptr {base}, i64 {idx}\n"]
    if fmt == "f32":
        return L[0] + f"  {out} = load <16 x float>, ptr {out}.a, align 4\n"
    L.append(f"  {out}.b = load <16 x i16>, ptr {out}.a, align 2\n")
    if fmt == "f16":
        L.append(f"  {out}.h = bitcast <16 x i16> {out}.b to <16 x half>\n"
                 f"  {out} = fpext <16 x half> {out}.h to <16 x float>\n")
    else:
        L.append(f"  {out}.z = zext <16 x i16> {out}.b to <16 x i32>\n"
                 f"  {out}.s = shl <16 x i32> {out}.z, <" + ", ".join(["i32 16"] * 16) + ">\n"
                 f"  {out} = bitcast <16 x i32> {out}.s to <16 x float>\n")
    return "".join(L)


def _combine(x: str, y: str, w: int, out: str) -> str:
    """%out = one level of the 16-key transposed sum: x and y each hold the partial sums of w keys' dot products
    in lanes l (key l mod w); out holds 2w keys' (x's then y's) in lanes l (key l mod 2w), each lane the sum of
    two of x's or y's."""
    lo, hi = [], []
    for j in range(16 // (2 * w)):
        b = 2 * w * j
        lo += list(range(b, b + w)) + list(range(16 + b, 16 + b + w))
        hi += list(range(b + w, b + 2 * w)) + list(range(16 + b + w, 16 + b + 2 * w))
    mask = lambda idx: "<16 x i32> <" + ", ".join(f"i32 {i}" for i in idx) + ">"  # noqa: E731
    return (f"  {out}.l = shufflevector <16 x float> {x}, <16 x float> {y}, {mask(lo)}\n"
            f"  {out}.h = shufflevector <16 x float> {x}, <16 x float> {y}, {mask(hi)}\n"
            f"  {out} = fadd reassoc <16 x float> {out}.l, {out}.h\n")


def kscore_ir(fmt: str, G: int, C: int) -> str:
    """kscore for format fmt, G query rows, D = 16 C: (q [G, D] fp32, k [n, D], n, s, ss). Keys 16 at a time: each
    key's G dot products left as 16-lane partial sums, the 16 keys' sums of a row added across lanes together (a
    tree of 15 two-shuffle-and-add steps: lane i ends as key i's score) and stored as one vector; the last n % 16
    keys one at a time, each dot summed across its lanes."""
    L = [f"define void @kscore_{fmt}_g{G}_c{C}(i64 %q.i, i64 %k.i, i64 %n, i64 %s.i, i64 %ss) {{\nentry:\n"
         "  %q = inttoptr i64 %q.i to ptr\n  %k = inttoptr i64 %k.i to ptr\n  %s = inttoptr i64 %s.i to ptr\n"]
    for r in range(G):
        for c in range(C):
            L.append(_chunk("f32", "%q", str((r * C + c) * 16), f"%q{r}.{c}"))
        L.append(f"  %so{r} = mul i64 %ss, {r}\n")
    L.append("  %n16 = and i64 %n, -16\n  %has16 = icmp sgt i64 %n16, 0\n"
             "  br i1 %has16, label %blk, label %tailhead\n")

    def dots(t: str, sfx: str) -> str:
        """%m{r}{sfx}: row r's 16-lane partial sums of q . k for the key at index %t."""
        D = [f"  %base{sfx} = mul i64 {t}, {16 * C}\n"]
        for c in range(C):
            D.append(f"  %o{c}{sfx} = add i64 %base{sfx}, {16 * c}\n" + _chunk(fmt, "%k", f"%o{c}{sfx}", f"%k{c}{sfx}"))
        for r in range(G):
            D.append(f"  %p{r}.0{sfx} = fmul <16 x float> %q{r}.0, %k0{sfx}\n")
            for c in range(1, C):
                D.append(f"  %p{r}.{c}{sfx} = call <16 x float> @llvm.fma.v16f32(<16 x float> %q{r}.{c}, "
                         f"<16 x float> %k{c}{sfx}, <16 x float> %p{r}.{c - 1}{sfx})\n")
            D.append(f"  %m{r}{sfx} = fadd <16 x float> %p{r}.{C - 1}{sfx}, <" + ", ".join(["float -0.0"] * 16)
                     + ">\n")
        return "".join(D)

    # 16 keys a step
    L.append("blk:\n  %tb = phi i64 [0, %entry], [%tb1, %blk]\n")
    stacks: list[list[tuple[str, int]]] = [[] for _ in range(G)]  # per row: (vector, keys it holds)
    for i in range(16):
        L.append(f"  %t.{i} = add i64 %tb, {i}\n" + dots(f"%t.{i}", f".{i}"))
        for r in range(G):
            cur, w = f"%m{r}.{i}", 1
            while stacks[r] and stacks[r][-1][1] == w:  # two sums of w keys each: one of 2w keys
                prev, _ = stacks[r].pop()
                name = f"%c{r}.{i}.{w}"
                L.append(_combine(prev, cur, w, name))
                cur, w = name, 2 * w
            stacks[r].append((cur, w))
    for r in range(G):
        (vec, w), = stacks[r]
        L.append(f"  %si{r}.b = add i64 %so{r}, %tb\n  %sa{r}.b = getelementptr float, ptr %s, i64 %si{r}.b\n"
                 f"  store <16 x float> {vec}, ptr %sa{r}.b, align 4\n")
    L.append("  %tb1 = add i64 %tb, 16\n  %moreb = icmp slt i64 %tb1, %n16\n"
             "  br i1 %moreb, label %blk, label %tailhead\n")
    # the last keys one at a time
    L.append("tailhead:\n  %rest = icmp slt i64 %n16, %n\n  br i1 %rest, label %key, label %done\n")
    L.append("key:\n  %t = phi i64 [%n16, %tailhead], [%t1, %key]\n" + dots("%t", ""))
    for r in range(G):
        L.append(f"  %d{r} = call reassoc float @llvm.vector.reduce.fadd.v16f32(float -0.0, <16 x float> %m{r})\n"
                 f"  %si{r} = add i64 %so{r}, %t\n"
                 f"  %sa{r} = getelementptr float, ptr %s, i64 %si{r}\n  store float %d{r}, ptr %sa{r}, align 4\n")
    L.append("  %t1 = add i64 %t, 1\n  %more = icmp slt i64 %t1, %n\n  br i1 %more, label %key, label %done\n")
    L.append("done:\n  ret void\n}\n")
    return "".join(L)


def vacc_ir(fmt: str, G: int, C: int) -> str:
    """vacc for format fmt, G query rows, D = 16 C: (p, ps, v [n, D], n, acc [G, D] fp32)."""
    L = [f"define void @vacc_{fmt}_g{G}_c{C}(i64 %p.i, i64 %ps, i64 %v.i, i64 %n, i64 %acc.i) {{\nentry:\n"
         "  %p = inttoptr i64 %p.i to ptr\n  %v = inttoptr i64 %v.i to ptr\n  %acc = inttoptr i64 %acc.i to ptr\n"]
    for r in range(G):
        for c in range(C):
            L.append(_chunk("f32", "%acc", str((r * C + c) * 16), f"%a{r}.{c}.in"))
    L.append("  %empty = icmp sle i64 %n, 0\n  br i1 %empty, label %done, label %key\n")
    L.append("key:\n  %t = phi i64 [0, %entry], [%t1, %key]\n")
    for r in range(G):
        for c in range(C):
            L.append(f"  %a{r}.{c} = phi <16 x float> [%a{r}.{c}.in, %entry], [%a{r}.{c}.n, %key]\n")
    L.append(f"  %base = mul i64 %t, {16 * C}\n")
    for c in range(C):
        L.append(f"  %o{c} = add i64 %base, {16 * c}\n" + _chunk(fmt, "%v", f"%o{c}", f"%v{c}"))
    for r in range(G):
        L.append(f"  %po{r} = mul i64 %ps, {r}\n  %pi{r} = add i64 %po{r}, %t\n"
                 f"  %pa{r} = getelementptr float, ptr %p, i64 %pi{r}\n  %pv{r} = load float, ptr %pa{r}, align 4\n"
                 f"  %pb{r}.i = insertelement <16 x float> poison, float %pv{r}, i64 0\n"
                 f"  %pb{r} = shufflevector <16 x float> %pb{r}.i, <16 x float> poison, <16 x i32> zeroinitializer\n")
        for c in range(C):
            L.append(f"  %a{r}.{c}.n = call <16 x float> @llvm.fma.v16f32(<16 x float> %pb{r}, <16 x float> %v{c}, "
                     f"<16 x float> %a{r}.{c})\n")
    L.append("  %t1 = add i64 %t, 1\n  %more = icmp slt i64 %t1, %n\n  br i1 %more, label %key, label %end\n")
    L.append("end:\n")
    for r in range(G):
        for c in range(C):
            L.append(f"  %a{r}.{c}.o = getelementptr float, ptr %acc, i64 {(r * C + c) * 16}\n"
                     f"  store <16 x float> %a{r}.{c}.n, ptr %a{r}.{c}.o, align 4\n")
    L.append("  br label %done\ndone:\n  ret void\n}\n")
    return "".join(L)


def _exp(ty: str, x: str, out: str) -> str:
    """%out = exp(%x) of type ty (float or <16 x float>) as numba_kernel.exp_row computes it, Cephes' expf (expf_parts:
    x clamped to fp32's range, Cody-Waite reduction, the degree-6 polynomial) times 2^k built from its bits, 0 where x
    is -inf; here with fused multiply-adds (exp_row rounds each product: the two differ by an ulp or so)."""
    vec = ty != "float"
    itype = "<16 x i32>" if vec else "i32"

    def c(v: float | int, t: str = ty) -> str:
        lit = f"{v}" if "i32" in t else f"0x{np.array(v, np.float32).astype(np.float64).view(np.uint64):016X}"
        return f"<{', '.join([('i32 ' if 'i32' in t else 'float ') + lit] * 16)}>" if vec else lit

    fl = "@llvm.floor.v16f32" if vec else "@llvm.floor.f32"
    fma = "@llvm.fma.v16f32" if vec else "@llvm.fma.f32"
    return (f"  {out}.lo = fcmp olt {ty} {x}, {c(-87.33654)}\n"
            f"  {out}.c0 = select {'<16 x i1>' if vec else 'i1'} {out}.lo, {ty} {c(-87.33654)}, {ty} {x}\n"
            f"  {out}.hi = fcmp ogt {ty} {out}.c0, {c(88.72283)}\n"
            f"  {out}.c = select {'<16 x i1>' if vec else 'i1'} {out}.hi, {ty} {c(88.72283)}, {ty} {out}.c0\n"
            f"  {out}.f1 = call {ty} {fma}({ty} {out}.c, {ty} {c(1.44269504088896341)}, {ty} {c(0.5)})\n"
            f"  {out}.fx = call {ty} {fl}({ty} {out}.f1)\n"
            f"  {out}.r1 = call {ty} {fma}({ty} {out}.fx, {ty} {c(-0.693359375)}, {ty} {out}.c)\n"
            f"  {out}.r = call {ty} {fma}({ty} {out}.fx, {ty} {c(2.12194440e-4)}, {ty} {out}.r1)\n"
            f"  {out}.y1 = call {ty} {fma}({ty} {c(1.9875691500e-4)}, {ty} {out}.r, {ty} {c(1.3981999507e-3)})\n"
            + "".join(f"  {out}.y{i} = call {ty} {fma}({ty} {out}.y{i - 1}, {ty} {out}.r, {ty} {c(k)})\n"
                      for i, k in enumerate((8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1),
                                            start=2)) +
            f"  {out}.xx = fmul {ty} {out}.r, {out}.r\n"
            f"  {out}.p1 = call {ty} {fma}({ty} {out}.y5, {ty} {out}.xx, {ty} {out}.r)\n"
            f"  {out}.p = fadd {ty} {out}.p1, {c(1.0)}\n"
            f"  {out}.k = fptosi {ty} {out}.fx to {itype}\n  {out}.k1 = add {itype} {out}.k, {c(127, itype)}\n"
            f"  {out}.kb = shl {itype} {out}.k1, {c(23, itype)}\n  {out}.two = bitcast {itype} {out}.kb to {ty}\n"
            f"  {out}.ninf = fcmp oeq {ty} {x}, {c(float('-inf'))}\n"
            f"  {out}.pz = select {'<16 x i1>' if vec else 'i1'} {out}.ninf, {ty} {c(0.0)}, {ty} {out}.p\n"
            f"  {out} = fmul {ty} {out}.pz, {out}.two\n")


def softmax_ir() -> str:
    """softmax(s, n, m, l): the max of the n >= 1 floats at s into *m, each replaced by exp(it - max) (_exp: as
    exp_row), and their sum into *l. 16 at a time, the rest one by one; max and sum over lanes, then across them."""
    ninf = "0x" + "FFF0000000000000"
    v = lambda x: "<" + ", ".join([f"float {x}"] * 16) + ">"  # noqa: E731
    return f"""
define void @softmax(i64 %s.i, i64 %n, i64 %m.i, i64 %l.i) {{
entry:
  %s = inttoptr i64 %s.i to ptr
  %m = inttoptr i64 %m.i to ptr
  %l = inttoptr i64 %l.i to ptr
  %n16 = and i64 %n, -16
  %has16 = icmp sgt i64 %n16, 0
  br i1 %has16, label %vmax, label %vmaxend
vmax:
  %t = phi i64 [0, %entry], [%t1, %vmax]
  %mv = phi <16 x float> [{v(ninf)}, %entry], [%mv1, %vmax]
  %a = getelementptr float, ptr %s, i64 %t
  %x = load <16 x float>, ptr %a, align 4
  %gt = fcmp ogt <16 x float> %x, %mv
  %mv1 = select <16 x i1> %gt, <16 x float> %x, <16 x float> %mv
  %t1 = add i64 %t, 16
  %more = icmp slt i64 %t1, %n16
  br i1 %more, label %vmax, label %vmaxend
vmaxend:
  %mvf = phi <16 x float> [{v(ninf)}, %entry], [%mv1, %vmax]
{_lane_max("%mvf", "%mlanes")}
  %rest = icmp slt i64 %n16, %n
  br i1 %rest, label %smax, label %maxed
smax:
  %u = phi i64 [%n16, %vmaxend], [%u1, %smax]
  %ms = phi float [%mlanes, %vmaxend], [%ms1, %smax]
  %ua = getelementptr float, ptr %s, i64 %u
  %ux = load float, ptr %ua, align 4
  %ugt = fcmp ogt float %ux, %ms
  %ms1 = select i1 %ugt, float %ux, float %ms
  %u1 = add i64 %u, 1
  %umore = icmp slt i64 %u1, %n
  br i1 %umore, label %smax, label %maxed
maxed:
  %mx = phi float [%mlanes, %vmaxend], [%ms1, %smax]
  store float %mx, ptr %m, align 4
  %mxv.i = insertelement <16 x float> poison, float %mx, i64 0
  %mxv = shufflevector <16 x float> %mxv.i, <16 x float> poison, <16 x i32> zeroinitializer
  br i1 %has16, label %vexp, label %vexpend
vexp:
  %e = phi i64 [0, %maxed], [%e1, %vexp]
  %sv = phi <16 x float> [zeroinitializer, %maxed], [%sv1, %vexp]
  %ea = getelementptr float, ptr %s, i64 %e
  %ex = load <16 x float>, ptr %ea, align 4
  %ed = fsub <16 x float> %ex, %mxv
{_exp("<16 x float>", "%ed", "%ev")}
  store <16 x float> %ev, ptr %ea, align 4
  %sv1 = fadd <16 x float> %sv, %ev
  %e1 = add i64 %e, 16
  %emore = icmp slt i64 %e1, %n16
  br i1 %emore, label %vexp, label %vexpend
vexpend:
  %svf = phi <16 x float> [zeroinitializer, %maxed], [%sv1, %vexp]
  %vsum = call reassoc float @llvm.vector.reduce.fadd.v16f32(float -0.0, <16 x float> %svf)
  br i1 %rest, label %sexp, label %done
sexp:
  %w = phi i64 [%n16, %vexpend], [%w1, %sexp]
  %ss = phi float [%vsum, %vexpend], [%ss1, %sexp]
  %wa = getelementptr float, ptr %s, i64 %w
  %wx = load float, ptr %wa, align 4
  %wd = fsub float %wx, %mx
{_exp("float", "%wd", "%we")}
  store float %we, ptr %wa, align 4
  %ss1 = fadd float %ss, %we
  %w1 = add i64 %w, 1
  %wmore = icmp slt i64 %w1, %n
  br i1 %wmore, label %sexp, label %done
done:
  %tot = phi float [%vsum, %vexpend], [%ss1, %sexp]
  store float %tot, ptr %l, align 4
  ret void
}}
"""


def _lane_max(x: str, out: str) -> str:
    """%out = the largest of vector %x's 16 lanes (halving: 8, 4, 2, 1 lanes compared at a time)."""
    L, cur = [], x
    for w in (8, 4, 2, 1):
        idx = ", ".join(f"i32 {i + w if i < w else i}" for i in range(16))
        L.append(f"  {out}.s{w} = shufflevector <16 x float> {cur}, <16 x float> poison, <16 x i32> <{idx}>\n"
                 f"  {out}.g{w} = fcmp ogt <16 x float> {out}.s{w}, {cur}\n"
                 f"  {out}.m{w} = select <16 x i1> {out}.g{w}, <16 x float> {out}.s{w}, <16 x float> {cur}\n")
        cur = f"{out}.m{w}"
    L.append(f"  {out} = extractelement <16 x float> {cur}, i64 0\n")
    return "".join(L)


def module_ir(G: int, C: int) -> str:
    return _DECLARE + softmax_ir() + "".join(kscore_ir(f, G, C) + vacc_ir(f, G, C) for f in FORMATS)


_lock = threading.Lock()
_compiled: dict[tuple[int, int], np.ndarray] = {}
_engines: list = []  # the compiled modules' owners, kept alive with the process
_error = _IMPORT_ERROR


def kernels(G: int, D: int) -> np.ndarray:
    """The kernels for G query rows a kv head and head dim D: int64 [format, 3], row FORMATS' index, the [kscore,
    vacc, softmax] addresses decode_plain takes for blocks of that format; or NONE (zeros: decode_plain's numba
    loops) where there are none: D not in 16s, G x D/16 > MAX_VECTORS, no llvmlite, KVSCOPE_ATTN_IR=off, or an LLVM
    that refused the IR (status())."""
    global _error
    C = D // 16
    if _error or D % 16 or D <= 0 or G <= 0 or G * C > MAX_VECTORS or os.environ.get("KVSCOPE_ATTN_IR") == "off":
        return NONE
    key = (G, C)
    got = _compiled.get(key)
    if got is not None:
        return got
    with _lock:
        if key not in _compiled:
            try:
                _compiled[key] = _compile(G, C)
            except Exception as e:  # an LLVM that refuses the IR: the numba loops serve
                _error = f"{type(e).__name__}: {e}"
                return NONE
    return _compiled[key]


def describe(G: int, D: int) -> str:
    """What decode attention's block loops are for G query rows a kv head and head dim D: these kernels, or numba's
    own loops and why (kernels()'s rules)."""
    if kernels(G, D).any():
        return f"LLVM IR kernels ({G} query rows x head dim {D})"
    why = (_error or ("KVSCOPE_ATTN_IR=off" if os.environ.get("KVSCOPE_ATTN_IR") == "off" else
                      f"head dim {D} not in 16s" if D % 16 or D <= 0 else
                      f"{G} x {D // 16} sums past the {MAX_VECTORS} registers kept"))
    return f"numba's loops ({why})"


def compile_ir(text: str, names: list[str], isa: str = "native") -> list[int]:
    """The addresses of functions `names` of LLVM IR module `text`, compiled at -O3 for this CPU (isa "native"), or
    for it without AVX-512 ("avx2": what a CPU with AVX2 only runs, 16-lane vectors as two 8-lane halves). The
    compiled code lives as long as the process. Raises what LLVM raises for IR it refuses."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    features = llvm.get_host_cpu_features()
    if isa == "avx2":
        for name in list(features):
            if name.startswith("avx512") or name.startswith("amx"):
                features[name] = False
    cpu = llvm.get_host_cpu_name() if isa == "native" else "haswell"
    tm = llvm.Target.from_default_triple().create_target_machine(cpu=cpu, features=features.flatten(), opt=3)
    mod = llvm.parse_assembly(text)
    mod.triple = tm.triple
    mod.data_layout = str(tm.target_data)
    mod.verify()
    pb = llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=3))
    pb.getModulePassManager().run(mod, pb)
    engine = llvm.create_mcjit_compiler(mod, tm)
    engine.finalize_object()
    _engines.append(engine)
    return [engine.get_function_address(n) for n in names]


def _compile(G: int, C: int, isa: str = "native") -> np.ndarray:
    """The kernels' addresses for (G, C), compiled for this CPU (isa "native"), or for it without AVX-512 ("avx2";
    compile_ir; the tests run both where this CPU can)."""
    names = [f"{k}_{f}_g{G}_c{C}" for f in FORMATS for k in ("kscore", "vacc")] + ["softmax"]
    a = compile_ir(module_ir(G, C), names, isa)
    return np.array([[a[2 * i], a[2 * i + 1], a[-1]] for i in range(len(FORMATS))], dtype=np.int64)


def status() -> str:
    return "unavailable (" + _error + ")" if _error else "LLVM IR block loops (compiled per query-rows x head-dim)"
