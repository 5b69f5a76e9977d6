"""Index attention forward, CUDA (csrc/index_fwd.cu) against our Triton kernel, in one
process, against the random-row gather ceiling of benchmarks/gather_probe.py (issue 17).

    python -m benchmarks.cuda_index_bench [--lengths 8192,32768] [--widths 16,64,256]
    python -m benchmarks.cuda_index_bench --backward [--split] [--lengths ...] [--widths ...]

--variants 1,2 adds columns: the CUDA forward timed again under each of those
FLEXSPARSE_CUDA_DEBUG values, in the same process (a same-build A/B of probe bits, the
settings taking turns --rounds times; the index forward's: 536870912, the kernel before
C70's arithmetic; 1073741824, 64-bit row addressing; 2147483648, the pipelined kernel
instead of the one-stage one, C71; 4294967296, one query row per warp,
the default before C79). Values add:
3221225472 = the default before C71 (pipelined, 64-bit addressing). --head-dim 64 or 256 times that head dim instead of 128;
--heads 8,8 (query, kv heads) another ratio.

--backward prints the backward table instead: the CUDA index backward (csrc/index_bwd.cu,
no float atomics, deterministic) against the Triton index backward in its two modes
(atomic dK/dV, and the deterministic sorted mode), each over the CUDA forward's out and
lse, with the CUDA backward's time over the CUDA forward's (issue 17 asks <= 2) and the
largest difference of dq, dk, dv from the Triton deterministic backward. With --variants
the CUDA backward is timed again under each value (34359738368: the pipelined dQ pass
the one-stage default replaced, perf-notes C74; 17179869184: the dK/dV pass on the CUDA
cores, the default before C78; 68719476736: the tensor-core dK/dV pass with one
dependency chain, the default before C80; 137438953472: the preprocess with 2-byte loads,
the default before C81; 549755813888: the transposed lists on the caller's stream, the
default before C83). --split
adds the CUDA backward's GPU time per kernel (prep, dQ pass, the transposed lists' count,
scan and sort, dK/dV pass; benchmarks/kernel_split.py) after the table.

Random sorted lists (B=1, Hq=16, Hkv=4, hd 128, bf16). "gathered TB/s" counts the K and V
rows each kv head's lists name (B*Hkv*L*W*(D+Dv)*2 bytes) over the forward's time: the G
query heads of a kv head share those rows, so it is the traffic an ideal gather kernel
moves.

"ceiling TB/s" is `gather_probe.ceiling(row bytes, working set)`: the best rate of the
probe's Triton gather-and-sum kernel over uniform random rows of D*2 = 256 bytes drawn
from a table the size of ONE kv head's K and V (L*(D+Dv)*2 bytes: both kernels run a kv
head's query rows together, query row fastest, so that is the set their gathers hit at a
time), measured in this process, bytes counted the same way (gathered rows x row bytes).
"/ ceil" is a kernel's gathered TB/s over it (issue 17 asks >= 0.85 at W = 16-256).

The "index_select TB/s" column gathers the same rows with torch.index_select into a
buffer (K and V of the same lists, bytes read): a CUDA-free baseline that writes what it
reads and gathers per entry; on the H100 it reached only 0.42 TB/s, so it is no ceiling.
"""
import argparse
import math

import torch
import triton.testing

import flexsparse  # noqa: F401  (registers torch.ops.flexsparse)
from flexsparse.ops import MaskTensors

from .debug_bits import in_turns
from .gather_probe import ceiling
from .kernel_split import per_kernel, print_split

B, HQ, HKV, D = 1, 16, 4, 128


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def inputs(L, W, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn((B, HQ, L, D), device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn((B, HKV, L, D), device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    idx = torch.randint(0, L, (B, HKV, L, W), device="cuda", dtype=torch.int32, generator=g)
    return q, k, v, idx.sort(-1).values.contiguous()


def forward(backend, q, k, v, idx):
    mt = MaskTensors(attn_indices=idx)
    scale = 1 / math.sqrt(D)
    return lambda: torch.ops.flexsparse.attention(q, k, v, None, *mt, 128, 128, scale, 0.0,
                                                  backend, False)[0]


def probe(k, v, idx):
    """ms of gathering every listed K and V row once (index_select), bytes read."""
    L = k.shape[2]
    flat = (idx.to(torch.int64) + (torch.arange(B * HKV, device="cuda") * L).view(B, HKV, 1, 1))
    flat = flat.reshape(-1)
    kf, vf = k.reshape(-1, D), v.reshape(-1, D)
    out_k = torch.empty((flat.numel(), D), device="cuda", dtype=k.dtype)
    out_v = torch.empty_like(out_k)

    def fn():
        torch.index_select(kf, 0, flat, out=out_k)
        torch.index_select(vf, 0, flat, out=out_v)
    return bench(fn), 2 * flat.numel() * D * k.element_size()


def backward_table(lengths, widths, split=False, variants=(), rounds=1):
    from flexsparse.ops import triton_indices as ti
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, B={B} Hq={HQ} "
          f"Hkv={HKV} D={D}, random sorted lists; backward over the CUDA forward's out, lse")
    print("| L | W | cuda fwd ms | triton bwd ms (atomic) | triton bwd ms (det.) | cuda bwd ms "
          "| cuda bwd / cuda fwd | triton atomic / cuda bwd | max abs diff dq, dk, dv vs det. |"
          + "".join(f" cuda bwd ms, debug {bits} |" for bits in variants))
    print("|---" * (9 + len(variants)) + "|")
    scale = 1 / math.sqrt(D)
    splits = []
    for L in lengths:
        for W in widths:
            q, k, v, idx = inputs(L, W)
            mt = MaskTensors(attn_indices=idx)
            try:
                out, lse = torch.ops.flexsparse.cuda_attention(q, k, v, None, *mt, 128, 128,
                                                               scale, 0.0, False)
                do = torch.randn_like(out)

                def tri(det):
                    return lambda: ti.backward(do, None, q, k, v, out, lse, None, mt, scale, 0.0,
                                               det, False)

                def cuda():
                    return torch.ops.flexsparse.cuda_attention_backward(
                        do, None, q, k, v, out, lse, None, *mt, 128, 128, scale, 0.0, False,
                        False)
                t_fwd = bench(forward("cuda", q, k, v, idx))
                t_atomic = bench(tri(False))
                t_det = bench(tri(True))
                t_cuda, *t_var = in_turns(lambda: bench(cuda), variants, rounds)
                ref = tri(True)()[:3]
                got = cuda()[:3]
                diffs = ", ".join(f"{(a.float() - b.float()).abs().max().item():.1e}"
                                  for a, b in zip(got, ref))
            except Exception as err:   # reported in the row, the others still run
                print(f"| {L} | {W} | failed: {type(err).__name__}: {str(err)[:150]} |")
                continue
            print(f"| {L} | {W} | {t_fwd:.3f} | {t_atomic:.3f} | {t_det:.3f} | {t_cuda:.3f} | "
                  f"{t_cuda / t_fwd:.2f} | {t_atomic / t_cuda:.2f} | {diffs} |"
                  + "".join(f" {t:.3f} |" for t in t_var), flush=True)
            if split:
                splits.append((L, W, per_kernel(cuda)))
            del q, k, v, idx
            torch.cuda.empty_cache()
    for L, W, rows in splits:
        print_split(rows, f"CUDA index backward, L={L} W={W}")


def main():
    global D, HQ, HKV
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--widths", default="16,64,256")
    ap.add_argument("--backward", action="store_true",
                    help="the backward table (CUDA index backward vs Triton) instead")
    ap.add_argument("--split", action="store_true",
                    help="with --backward: the CUDA backward's GPU time per kernel (profiler)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="the CUDA timings (default and --variants) taking turns this many "
                         "times, medians reported")
    ap.add_argument("--head-dim", type=int, default=D, choices=(64, 128, 256))
    ap.add_argument("--heads", default=f"{HQ},{HKV}",
                    help="query heads,kv heads (the rule of \"auto\" for index masks is "
                         "measured per ratio: ops/cuda_backend.AUTO_INDEX_GROUPS)")
    ap.add_argument("--variants", default="",
                    help="FLEXSPARSE_CUDA_DEBUG values to time the CUDA forward under too")
    a = ap.parse_args()
    D = a.head_dim
    HQ, HKV = map(int, a.heads.split(","))
    variants = [int(x) for x in a.variants.split(",") if x]
    if a.backward:
        backward_table(list(map(int, a.lengths.split(","))), list(map(int, a.widths.split(","))),
                       a.split, variants, a.rounds)
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, B={B} Hq={HQ} "
          f"Hkv={HKV} D={D}, random sorted lists; TB/s of gathered K/V rows")
    print("| L | W | triton fwd ms | cuda fwd ms | cuda / triton speed | triton TB/s | cuda TB/s "
          "| kv head K+V MB | ceiling TB/s | triton / ceil | cuda / ceil "
          "| index_select TB/s | max abs diff |"
          + "".join(f" cuda ms, debug {bits} |" for bits in variants))
    print("|---" * (13 + len(variants)) + "|")
    for L in map(int, a.lengths.split(",")):
        for W in map(int, a.widths.split(",")):
            q, k, v, idx = inputs(L, W)
            gathered = B * HKV * L * W * 2 * D * q.element_size()
            try:
                t_tri = bench(forward("triton", q, k, v, idx))
                cuda = forward("cuda", q, k, v, idx)
                t_cuda, *t_var = in_turns(lambda: bench(cuda), variants, a.rounds)
                diff = (forward("triton", q, k, v, idx)().float()
                        - forward("cuda", q, k, v, idx)().float()).abs().max().item()
                t_probe, probe_bytes = probe(k, v, idx)
                head_bytes = L * 2 * D * q.element_size()    # one kv head's K and V
                ceil_tbs = ceiling(D * q.element_size(), head_bytes) / 1e3
            except Exception as err:   # reported in the row, the others still run
                print(f"| {L} | {W} | failed: {type(err).__name__}: {str(err)[:150]} |")
                continue
            tbs = lambda t: gathered / t / 1e9  # noqa: E731  (ms -> TB/s)
            probe_tbs = probe_bytes / t_probe / 1e9
            print(f"| {L} | {W} | {t_tri:.3f} | {t_cuda:.3f} | {t_tri / t_cuda:.2f} | "
                  f"{tbs(t_tri):.2f} | {tbs(t_cuda):.2f} | {head_bytes / 2**20:.0f} | "
                  f"{ceil_tbs:.2f} | {tbs(t_tri) / ceil_tbs:.2f} | {tbs(t_cuda) / ceil_tbs:.2f} | "
                  f"{probe_tbs:.2f} | {diff:.1e} |" + "".join(f" {t:.3f} |" for t in t_var),
                  flush=True)
            del q, k, v, idx
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
