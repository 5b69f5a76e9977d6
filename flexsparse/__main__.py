"""`python -m flexsparse demo|info|env`. (The benchmarks live in the checkout's
benchmarks/ folder: `python -m benchmarks.bench`.)

demo: runs several mask kinds forward and backward on the best available device with
backend="auto", checks each against the float64 reference and prints a table.
"""
import argparse
import os
import sys
import time

import torch

import flexsparse
from flexsparse import masks as M
from flexsparse.ops import backends


def _demo_masks(L, B, device):
    g = torch.Generator().manual_seed(0)
    third = L // 3
    # half of the 128-blocks: the diagonal plus random off-diagonal ones
    nb = -(-L // 128)
    layout = torch.eye(nb, dtype=torch.bool)
    off = (~layout).flatten().nonzero().flatten()
    pick = off[torch.randperm(off.numel(), generator=g)[:max(round(nb * nb / 2) - nb, 0)]]
    layout = layout.flatten().index_fill(0, pick, True).view(1, 1, nb, nb)
    idx = torch.randint(-1, L, (B, 2, L, 32), generator=g)
    return [
        ("full", None),
        ("causal", M.causal()),
        ("sliding_window(256)", M.sliding_window(256)),
        ("document(3 docs)", M.document([third, third, L - 2 * third])),
        ("prefix_lm(L/4)", M.prefix_lm(L // 4)),
        ("shared_question", M.shared_question(L // 4, [L // 4, L // 4, L - 3 * (L // 4)])),
        ("block_sparse(50%)", M.block_sparse(layout.to(device))),
        ("dense bool", M.dense((torch.rand(B, 1, L, L, generator=g) > 0.3).to(device))),
        ("causal | global(16)", M.or_(M.causal(), M.column_ranges(_global_cols(L, 16, device), False))),
        ("indices(W=32)", M.indices(idx.to(device))),
    ]


def _global_cols(L, n, device):
    """Columns < n seen by every row; other columns masked for rows >= n (FlashMask form)."""
    j = torch.arange(L)
    lts = torch.where(j < n, L, n)
    return torch.stack([lts, torch.zeros_like(lts)], -1).view(1, 1, L, 2).to(torch.int32).to(device)


def demo(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    B, Hq, Hkv, L, D = (2, 8, 2, 1024, 64) if device.type == "cuda" else (1, 4, 2, 384, 32)
    L = args.length or L
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, h, L, D, generator=g).to(device, dtype) for h in (Hq, Hkv, Hkv))
    bias = (0.5 * torch.randn(1, Hq, L, L, generator=g)).to(device, dtype)
    print(f"flexsparse {flexsparse.__version__} on {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}), "
          f"{dtype}, B={B} Hq={Hq} Hkv={Hkv} L={L} D={D}, bias (1, Hq, L, L) with gradient; "
          f"backends usable here: {usable_backends(device)}")
    rows, failed = [], 0
    for name, mask in _demo_masks(L, B, device):
        desc = flexsparse.compile_mask(mask, B, Hq, Hkv, L, L, device=device)
        mt = desc.mask_tensors()
        chosen = backends.choose(q, k, v, bias, mt)
        go = torch.randn(q.shape, generator=g).to(device, dtype)

        def step():
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
            t0 = time.perf_counter()
            out = flexsparse.attention(*leaves[:3], desc, bias=leaves[3])
            grads = torch.autograd.grad(out, leaves, go)
            if device.type == "cuda":
                torch.cuda.synchronize()
            return out, grads, (time.perf_counter() - t0) * 1e3
        # The first call of a kind compiles its kernels (Triton JIT); the second is warm.
        _, _, first_ms = step()
        out, grads, ms = step()
        ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
        ref = flexsparse.attention(*ref_leaves[:3], desc, bias=ref_leaves[3], backend="reference")
        ref_grads = torch.autograd.grad(ref, ref_leaves, go.double())
        # errors relative to the float64 reference, as in FlashAttention's tests
        fwd_err = _rel(out, ref)
        bwd_err = max(_rel(a, b) for a, b in zip(grads, ref_grads))
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        ok = fwd_err < tol and bwd_err < tol
        failed += not ok
        density = desc.num_visible(B) / (B * Hq * L * L)
        rows.append((name, f"{density:.3f}", chosen, f"{fwd_err:.1e}", f"{bwd_err:.1e}",
                     f"{ms:.1f}", f"{first_ms:.0f}", "ok" if ok else "FAIL"))
    head = ("mask", "density", "backend", "fwd rel err", "bwd rel err", "fwd+bwd ms (warm)",
            "first call ms (compile)", "check")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    for r in [head, tuple("-" * w for w in widths)] + rows:
        print("| " + " | ".join(str(x).ljust(w) for x, w in zip(r, widths)) + " |")
    print(f"{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def usable_backends(device):
    """Registered backends that can run on `device`: on CPU the Triton kernels run only
    under the interpreter (TRITON_INTERPRET=1), and the CUDA backend never."""
    names = backends.available()
    if device.type == "cpu":
        names = [n for n in names if n == "reference"
                 or (n == "triton" and os.environ.get("TRITON_INTERPRET") == "1")]
    return names


def info(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"flexsparse {flexsparse.__version__}, torch {torch.__version__}, "
          f"cuda {torch.cuda.is_available()}")
    print(f"backends registered: {backends.available()}; usable on {device}: "
          f"{usable_backends(device)}")
    if "cuda" in backends.available():
        from flexsparse.ops import cuda_backend as C
        print(f"cuda backend: forward and backward hd 64/128/256 "
              f"(backward kernels built: {C.has_backward()})")
        dims = "/".join(map(str, C.AUTO_HEAD_DIMS))
        with_bias = "hd " + "/".join(map(str, C.AUTO_BIAS_HEAD_DIMS))
        print(f'"auto" takes cuda for: block masks at hd {dims} without a dense mask or bitmaps, '
              f"for training only when not deterministic; with a bias ({with_bias}; no softcap, "
              f"keys contiguous, Lk % 8 == 0); triton otherwise (measured table: "
              f"docs/benchmarks.md)")
        idx_dims = "/".join(map(str, C.AUTO_INDEX_HEAD_DIMS))
        groups = "/".join(map(str, C.AUTO_INDEX_GROUPS))
        faster = ", ".join(f"hd {d} with {g} query heads per kv head"
                           for d, g in C.INDEX_BWD_OVER_ATOMIC)
        print(f'"auto" takes cuda for index masks at hd {idx_dims} with {groups} query heads '
              f"per kv head, no bias or softcap; their gradients: the CUDA index backward "
              f"(deterministic) when deterministic=True or at {faster}, Triton's atomic "
              f"backward otherwise (FLEXSPARSE_CUDA_INDEX_BWD=1/0 forces either)")
    else:
        print('"auto": triton on a GPU, the reference on CPU')
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m flexsparse")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("demo", help="run several masks forward+backward and check them")
    p.add_argument("--length", type=int, default=None)
    sub.add_parser("info", help="versions, available backends and what auto picks")
    sub.add_parser("env", help="same as info")
    args = parser.parse_args(argv)
    return {"demo": demo, "info": info, "env": info}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
