"""Compile every Triton kernel variant kvserve launches for NVIDIA GPUs, without a GPU.

Triton's compiler runs on any machine: each kernel is lowered through TTIR, TTGIR and LLVM
to PTX and assembled to a cubin by the ptxas Triton ships, for sm_80 (A100) and sm_90
(H100). This catches what the interpreter cannot (types, layouts, unsupported
conversions). Run without TRITON_INTERPRET (the kernels must be defined compiled):

    python scripts/triton_compile_check.py [--arch 80 90]

Prints one line per variant and target; exits 1 if any fails to compile.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "0"

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvserve.model import triton_attention as ta
from kvserve.model import triton_kv_write as tw
from kvserve.model import triton_ops as tops

FP8_MIN_ARCH = 89  # fp8 e4m3/e5m2 conversions need Ada/Hopper


# (name, kernel, pointer element types, constexprs)
def _variants() -> list[tuple[str, object, dict[str, str], dict[str, object]]]:
    out = []
    bm, bq, gp = ta.tile_shape(4)
    attn = dict(GROUP=4, PAGE=16, BM=bm, BQ=bq, GP=gp, BN=ta.BLOCK_N, SPL=ta.SPLIT)
    caches = [("bf16", "bf16", 0), ("fp16", "fp16", 0), ("fp32", "fp32", 0),
              ("bf16", "i8", 1), ("bf16", "fp8e4nv", 1), ("bf16", "fp8e5", 1),
              ("bf16", "fp8e4nv", 2)]  # fmt: skip
    for q, c, scales in caches:
        for d, window in ((128, False), (80, True)):
            ptrs = dict(Q=q, K=c, V=c, KS="fp16" if scales == 1 else "fp32" if scales else c,
                        SL="fp32", Out=q)  # fmt: skip
            ptrs["VS"] = ptrs["KS"]
            # the windowed variant also with gpt-oss's sink logits
            const = dict(attn, D=d, DP=triton.next_power_of_2(d), SCALES=scales, WINDOW=window,
                         HAS_SINK=window)  # fmt: skip
            out.append((f"attention q={q} kv={c} d={d} window={window}",
                        ta._attention_kernel, ptrs, const))  # fmt: skip
    mqa = dict(attn, GROUP=32, BM=32, BQ=1, GP=32, D=128, DP=128, SCALES=0, WINDOW=False,
               HAS_SINK=False)  # fmt: skip
    ptrs = dict(Q="bf16", K="bf16", V="bf16", KS="bf16", VS="bf16", SL="fp32", Out="bf16")
    out.append(("attention q=bf16 MQA (32 heads on 1)", ta._attention_kernel, ptrs, mqa))
    ptrs = dict(Q="bf16", K="bf16", V="bf16", KS="bf16", VS="bf16", PM="fp32", PL="fp32",
                PACC="fp32")  # fmt: skip
    const = dict(attn, D=128, DP=128, SCALES=0, WINDOW=True, NSPLIT=8)
    out.append(("split-KV q=bf16 d=128", ta._split_kernel, ptrs, const))
    ptrs = dict(PM="fp32", PL="fp32", PACC="fp32", SL="fp32", Out="bf16")
    for sink in (False, True):
        const = dict(GROUP=4, BM=bm, BQ=bq, GP=gp, D=128, DP=128, SPL=ta.SPLIT, NSPLIT=8,
                     HAS_SINK=sink)  # fmt: skip
        out.append((f"merge d=128 sinks={sink}", ta._merge_kernel, ptrs, const))
    out.append(("write bf16", tw._write_plain_kernel, dict(X="bf16", C="bf16"),
               dict(D=128, DP=128)))  # fmt: skip
    for code, int8, mbits, emin in (("i8", True, 0, 0), ("fp8e4nv", False, 3, -6),
                                    ("fp8e5", False, 2, -14)):  # fmt: skip
        ptrs = dict(X="bf16", C=code, S="fp16", SHIFT="fp32", STEPS="fp32")
        const = dict(D=128, DP=128, INT8=int8, NCAND=1 if int8 else 8, SHIFTED=True,
                     MBITS=mbits, EMIN=emin)  # fmt: skip
        out.append((f"write {code}", tw._write_quant_kernel, ptrs, const))
    for dt in ("bf16", "fp16", "fp32"):  # --batch-invariant's GEMM and element-wise ops
        ptrs = dict(A=dt, B=dt, C=dt, BIAS=dt)
        const = dict(BM=tops.GEMM_BM, BN=tops.GEMM_BN, BK=tops.GEMM_BK, HAS_BIAS=True)
        out.append((f"gemm {dt}", tops._matmul_kernel, ptrs, const))
        for add in (False, True):
            ptrs = dict(X=dt, R=dt, W=dt, Y=dt)
            out.append((f"rms_norm {dt} add={add}", tops._rms_norm_kernel, ptrs,
                        dict(BH=2048, ADD=add)))  # fmt: skip
        out.append((f"silu_mul {dt}", tops._silu_mul_kernel, dict(X=dt, Y=dt), dict(BI=1024)))
        ptrs = dict(X=dt, POS="i64", COS=dt, SIN=dt)
        out.append((f"rope {dt}", tops._rope_kernel, ptrs, dict(HALF=64)))
    return out


def _signature(kernel, ptrs: dict[str, str], const: dict[str, object]) -> dict[str, str]:
    sig = {}
    for name in kernel.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = "*" + ptrs[name]
        elif name in ("tables", "query_start", "seq_lens", "SLOTS"):
            sig[name] = "*i64"
        elif name in ("scale", "qmax", "eps"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    args = parser.parse_args()
    failed = 0
    for name, kernel, ptrs, const in _variants():
        for arch in args.arch:
            if arch < FP8_MIN_ARCH and any("fp8" in t for t in ptrs.values()):
                continue  # the backend keeps fp8 caches off these GPUs (triton_backend.py)
            sig = _signature(kernel, ptrs, const)
            names = kernel.arg_names
            const_at = {(names.index(k),): v for k, v in const.items()}
            src = ASTSource(kernel, sig, constexprs=const_at)
            start = time.perf_counter()
            try:
                k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                   options={"enable_fp_fusion": False})  # fmt: skip
                took = time.perf_counter() - start
                print(f"ok   sm_{arch} {name}: {len(k.asm['cubin'])} B cubin, {took:.1f} s")
            except Exception as e:  # report every variant, then fail
                failed += 1
                print(f"FAIL sm_{arch} {name}: {type(e).__name__}: {str(e)[:400]}")
    print(f"{failed} of the variants failed" if failed else "every variant compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
