"""Probe for issue 16's "no host syncs": for each mask kind, a mask build + forward +
backward under torch.cuda.set_sync_debug_mode("error"), per backend; prints "no sync" or
where the first synchronizing call came from (the innermost flexsparse frame). Then a
CUDA-graph capture of build + forward + backward with the mask built from tensors inside
the captured region, replayed after the tensors change in place, compared with eager.

    python3 tests/gpu/sync_probe.py [--backends triton,triton-nofacts,cuda]
"""
import sys
import traceback

import torch

import flexsparse
from flexsparse import masks as M
from flexsparse.ops import backends as B_

DEV = "cuda"
B, H, L, D = 1, 2, 512, 64


def cases():
    lens = torch.tensor([100, 250, 162], device=DEV)
    cr = torch.randint(0, L + 1, (B, H, L, 2), device=DEV).sort(-1).values
    layout = torch.rand(1, H, L // 128, L // 128, device=DEV) < 0.5
    layout |= torch.eye(L // 128, dtype=torch.bool, device=DEV)
    dm = torch.rand(B, 1, L, L, device=DEV) < 0.7
    idx = torch.randint(-1, L, (B, H, L, 16), device=DEV, dtype=torch.int32)
    prefix = torch.tensor([77], device=DEV)     # made here: a host-to-device copy syncs
    return {
        "causal": lambda: M.causal(),
        "sliding": lambda: M.sliding_window(100),
        "document(list)": lambda: M.document([100, 250, 162]),
        "document(tensor)": lambda: M.document(lens),
        "prefix_lm(tensor)": lambda: M.prefix_lm(prefix),
        "column_ranges": lambda: M.column_ranges(cr, causal=True),
        "block_sparse": lambda: M.block_sparse(layout, 128),
        "dense": lambda: M.dense(dm),
        "indices": lambda: M.indices(idx),
        "and(dense, causal)": lambda: M.and_(M.dense(dm), M.causal()),
    }


def where(exc):
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "flexsparse" in f.filename
              or "/ops/" in f.filename]
    f = frames[-1] if frames else traceback.extract_tb(exc.__traceback__)[-1]
    return f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}: {str(exc).splitlines()[0][:90]}"


def backend_and_options(name):
    """"triton-nofacts": the Triton backend with kernel_options trim_lists=False (no host
    reads of mask data)."""
    if name.endswith("-nofacts"):
        return name[:-len("-nofacts")], {"trim_lists": False}
    return name, None


def step(make, backend):
    q, k, v = (torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    name, options = backend_and_options(backend)
    out = flexsparse.attention(q, k, v, make(), backend=name, kernel_options=options)
    out.float().square().sum().backward()
    return out


def main():
    names = sys.argv[sys.argv.index("--backends") + 1].split(",") if "--backends" in sys.argv \
        else [b for b in ("triton", "triton-nofacts", "cuda")
              if backend_and_options(b)[0] in B_.available()]
    for backend in names:
        for name, make in cases().items():
            try:
                step(make, backend)                       # warm-up: kernels compiled
                torch.cuda.synchronize()
            except Exception as e:                        # noqa: BLE001 - a probe reports all
                print(f"sync {backend:14s} {name:20s} does not run: {where(e)}")
                continue
            torch.cuda.set_sync_debug_mode("error")
            try:
                step(make, backend)
                print(f"sync {backend:14s} {name:20s} no sync")
            except RuntimeError as e:
                print(f"sync {backend:14s} {name:20s} SYNC at {where(e)}")
            finally:
                torch.cuda.set_sync_debug_mode("default")
    # CUDA graph: the mask built inside the captured region from tensors changed in place.
    for backend in names:
        lens = torch.tensor([100, 250, 162], device=DEV)
        qkv = [torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3)]

        def run():
            name, options = backend_and_options(backend)
            out = flexsparse.attention(*qkv, M.document(lens), backend=name,
                                       kernel_options=options)
            return out, torch.autograd.grad(out.float().square().sum(), qkv)
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                run()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                got = run()
            lens.copy_(torch.tensor([300, 12, 200], device=DEV))
            g.replay()
            want = run()
            ok = all(torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)
                     for a, b in zip((got[0], *got[1]), (want[0], *want[1])))
            print(f"graph  {backend:14s} document(tensor) replay after in-place lengths change: "
                  f"{'matches eager' if ok else 'DIFFERS from eager (stale mask)'}")
        except Exception as e:                             # noqa: BLE001
            print(f"graph  {backend:14s} document(tensor): capture failed at {where(e)}")


if __name__ == "__main__":
    main()
