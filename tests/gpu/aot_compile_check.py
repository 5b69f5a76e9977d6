"""Compile the block kernels (forward; backward dK/dV with atomic dQ; one_launch) for sm_90
ahead of time, without a GPU: the interpreter accepts things the GPU compiler rejects.

    python tests/gpu/aot_compile_check.py

Needs TRITON_INTERPRET unset. bf16, D=128, the H100 tile configs of ops/triton_block_common.py.
Prints shared memory per kernel and, where ptxas is found (Triton's bundled one or
TRITON_PTXAS_PATH), its register and spill counts. These lack the run-time argument
specializations (unit strides, divisibility), so they overstate spills: the forward that
spills here has none at run time (tests/gpu/kernel_stats.py on the GPU).
Exit status 1 if any compile fails.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("aot_compile_check: unset TRITON_INTERPRET (it compiles for the GPU)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flexsparse.ops import triton_block_bwd  # noqa: E402
from flexsparse.ops.triton_block_bwd import DB_ATOMIC, DB_NONE  # noqa: E402
from flexsparse.ops import triton_block_common as common  # noqa: E402
from flexsparse.ops import triton_block_fwd  # noqa: E402
from flexsparse.ops.triton_block_mask import EMPTY_LIST, KIND_LOWER, KIND_UPPER  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
DTYPE = "bf16"
# Pointer arguments that are not int32 lists / predicate tensors.
POINTERS = {"Q": DTYPE, "K": DTYPE, "V": DTYPE, "DO": DTYPE, "DK": DTYPE, "DV": DTYPE,
            "DQ": DTYPE, "Bias": DTYPE, "DB": "fp32", "DBQ": "fp32", "DQA": "fp32",
            "LSE2": "fp32", "DEL": "fp32", "DM": "u8"}
INTS = {"Hq", "Hkv", "Lq", "Lk", "D"}
FLOATS = {"scale", "qk_scale", "cap_log2"}


def signature(fn, constexprs):
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in POINTERS:
            sig[name] = "*" + POINTERS[name]
        elif name[0].isupper() and name not in INTS:
            sig[name] = "*i32"             # block lists, col ranges, bitmaps
        elif name in FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def ptxas_info(ptx):
    ptxas = os.environ.get("TRITON_PTXAS_PATH") or os.path.join(
        os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        ptxas = shutil.which("ptxas")
    if not ptxas:
        return "ptxas not found"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.o")],
                             capture_output=True, text=True)
    text = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if not regs:
        return "ptxas: " + text.strip()[-300:]
    return (f"{regs.group(1)} registers"
            + (f", spill stores/loads {spills.group(1)}/{spills.group(2)} bytes" if spills else ""))


def compile_one(label, fn, constexprs, num_warps, num_stages):
    src = ASTSource(fn=fn, signature=signature(fn, constexprs), constexprs=constexprs)
    try:
        k = triton.compile(src, target=TARGET,
                           options=dict(num_warps=num_warps, num_stages=num_stages))
    except Exception as err:
        print(f"FAIL {label}: {type(err).__name__}: {str(err)[:2000]}")
        return False
    print(f"ok   {label}: shared {k.metadata.shared} B, {ptxas_info(k.asm['ptx'])}")
    return True


def main():
    D_PAD = 128
    BM1, BN1, W1, S1 = common._GPU_CONFIGS["dkdv"][D_PAD]
    BM2, BN2, _, _ = common._GPU_CONFIGS["dq"][D_PAD]
    # (label, flags): a plain causal-like case and one with every element predicate,
    # bias + dbias, softcap and ragged lengths / head dim.
    variants = [
        ("lists only, even", dict(HAS_BIAS=False, SOFTCAP=False, HAS_DM=False, N_COL_RANGES=0,
                                  HAS_BITS=False, DB_MODE=DB_NONE, ZERO_SKIPPED=False,
                                  EVEN_D=True, BLOCK_D=D_PAD, Q_PARTIAL_RANGES=0,
                                  Q_FULL_RANGES=0, KV_PARTIAL_RANGES=0, KV_FULL_RANGES=0,
                                  CR_KINDS=0), True),
        ("causal-like col range, slot kind upper (starts all 0)",
         dict(HAS_BIAS=False, SOFTCAP=False, HAS_DM=False, N_COL_RANGES=1, HAS_BITS=False,
              DB_MODE=DB_NONE, ZERO_SKIPPED=False, EVEN_D=True, BLOCK_D=D_PAD,
              Q_PARTIAL_RANGES=4, Q_FULL_RANGES=4, KV_PARTIAL_RANGES=4, KV_FULL_RANGES=4,
              CR_KINDS=KIND_UPPER), True),
        ("col ranges (range-form lists), bias + atomic dbias, softcap, ragged",
         dict(HAS_BIAS=True, SOFTCAP=True, HAS_DM=True, N_COL_RANGES=2, HAS_BITS=True,
              DB_MODE=DB_ATOMIC, ZERO_SKIPPED=False, EVEN_D=False, BLOCK_D=D_PAD,
              Q_PARTIAL_RANGES=4, Q_FULL_RANGES=4, KV_PARTIAL_RANGES=4, KV_FULL_RANGES=4,
              CR_KINDS=KIND_UPPER | (KIND_LOWER << 2)), False),
        ("full mask (partial lists EMPTY_LIST, one range), GQA",
         dict(HAS_BIAS=False, SOFTCAP=False, HAS_DM=False, N_COL_RANGES=0, HAS_BITS=False,
              DB_MODE=DB_NONE, ZERO_SKIPPED=False, EVEN_D=True, BLOCK_D=D_PAD,
              Q_PARTIAL_RANGES=EMPTY_LIST, Q_FULL_RANGES=1, KV_PARTIAL_RANGES=EMPTY_LIST,
              KV_FULL_RANGES=1,
              CR_KINDS=0, G=4), True),
    ]
    BM0, BN0, W0, S0 = common._GPU_CONFIGS["fwd"][D_PAD]
    BQ = BK = 128       # descriptor block size (constexpr, like the sub-tile counts)
    ok = True
    for label, flags, even in variants:
        flags = dict(dict(G=1), **flags)
        fwd = {k: flags[k] for k in ("HAS_BIAS", "SOFTCAP", "HAS_DM", "N_COL_RANGES", "CR_KINDS",
                                     "HAS_BITS", "EVEN_D", "BLOCK_D", "KV_PARTIAL_RANGES",
                                     "KV_FULL_RANGES", "G")}
        fwd.update(EVEN_M=even, EVEN_N=even, BLOCK_M=BM0, BLOCK_N=BN0, block_q=BQ, block_k=BK,
                   SUB=BK // BN0)
        ok &= compile_one(f"_attn_fwd [{label}] ({BM0}x{BN0}, {W0} warps, {S0} stages)",
                          triton_block_fwd._attn_fwd, fwd, W0, S0)
        dkdv = dict(flags, DQ_ATOMIC=True, EVEN_M=even, EVEN_N=even,
                    BLOCK_M=BM1, BLOCK_N=BN1, block_q=BQ, block_k=BK, SUB=BQ // BM1)
        dkdv.pop("KV_PARTIAL_RANGES")
        dkdv.pop("KV_FULL_RANGES")
        ok &= compile_one(f"_attn_bwd_dkdv DQ_ATOMIC [{label}] ({BM1}x{BN1}, {W1} warps, "
                          f"{S1} stages)", triton_block_bwd._attn_bwd_dkdv, dkdv, W1, S1)
        fused = dict(flags, DB_COLSUM=False, EVEN_M1=even, EVEN_N1=even, EVEN_M2=even,
                     EVEN_N2=even, BLOCK_M1=BM1, BLOCK_N1=BN1, BLOCK_M2=BM2, BLOCK_N2=BN2,
                     block_q=BQ, block_k=BK, SUB1=BQ // BM1, SUB2=BK // BN2)
        ok &= compile_one(f"_attn_bwd_one_launch [{label}] (dkdv {BM1}x{BN1}, dq {BM2}x{BN2}, "
                          f"{W1} warps, {S1} stages)", triton_block_bwd._attn_bwd_one_launch,
                          fused, W1, S1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
