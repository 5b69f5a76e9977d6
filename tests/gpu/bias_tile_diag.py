"""Where the forward's bias-tile kernels (csrc/fwd_sm90.cuh, FwdTraits::kBiasTiles) differ from
the per-score-load kernel (FLEXSPARSE_CUDA_DEBUG bit 65536) on the same inputs: per
configuration the largest difference of the outputs and which query tiles and (batch,
head) pairs hold rows that differ by more than 0.05. Each configuration runs in its own
process (a hang or a device fault stops only that line). This is how the bias buffer's
race of perf-notes C49 was found: wrong rows at L = 904 and 1024, none at 8K, none under
compute-sanitizer.

    python tests/gpu/bias_tile_diag.py                  # the default set
    python tests/gpu/bias_tile_diag.py B,Hq,Hkv,L,D,MASK,BITS [...]

MASK: causal or doc (three documents); BITS: FLEXSPARSE_CUDA_DEBUG of the variant (0: the
default, overlapped; 32: the serial schedule).
"""
import os
import subprocess
import sys

import torch

import flexsparse
from flexsparse import masks as M

REFERENCE_BITS = "65536"     # the per-score bias loads


def one(spec):
    B, Hq, Hkv, L, D, kind, bits = spec.split(",")
    B, Hq, Hkv, L, D = int(B), int(Hq), int(Hkv), int(L), int(D)
    torch.manual_seed(0)
    dt = torch.bfloat16
    q = torch.randn(B, Hq, L, D, device="cuda", dtype=dt)
    k = torch.randn(B, Hkv, L, D, device="cuda", dtype=dt)
    v = torch.randn(B, Hkv, L, D, device="cuda", dtype=dt)
    bias = torch.randn(B, Hq, L, L, device="cuda", dtype=dt)
    mask = {"causal": M.causal(), "doc": M.document([L // 3, L // 2, L - L // 3 - L // 2])}[kind]
    desc = mask.compile(B, Hq, Hkv, L, L, device="cuda")
    outs = []
    for var in (REFERENCE_BITS, bits):
        os.environ["FLEXSPARSE_CUDA_DEBUG"] = var
        outs.append(flexsparse.attention(q, k, v, desc, bias=bias, backend="cuda").float())
    err = (outs[0] - outs[1]).abs().amax(-1)                  # (B, H, L)
    bad = (err > 0.05).nonzero().tolist()
    tiles = sorted({i // 128 for _, _, i in bad})
    heads = sorted({(b, h) for b, h, _ in bad})
    print(f"{spec}: max diff {float(err.max()):.3g}, rows over 0.05: {len(bad)} "
          f"(query tiles {tiles[:16]}, (b, h) {heads[:8]})", flush=True)


def default_specs():
    specs = [f"2,4,{hkv},{L},{D},{kind},{bits}"
             for bits in ("0", "32") for D in (128, 64) for L in (1024, 904)
             for kind in ("causal", "doc") for hkv in (4, 2)]
    return specs + ["2,16,16,2048,128,doc,0", "1,16,16,8192,128,causal,0"]


def main(argv):
    if len(argv) == 1 and not argv[0].startswith("-") and argv[0].count(",") == 6 \
            and os.environ.get("_BIAS_TILE_DIAG_CHILD"):
        one(argv[0])
        return
    env = dict(os.environ, _BIAS_TILE_DIAG_CHILD="1")
    for spec in argv or default_specs():
        r = subprocess.run([sys.executable, __file__, spec], capture_output=True, text=True,
                           timeout=120, env=env)
        lines = (r.stdout + r.stderr).strip().splitlines()
        print(lines[-1] if lines and r.returncode == 0
              else f"{spec}: exit {r.returncode}: " + " | ".join(lines[-3:]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
