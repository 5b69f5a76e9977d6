"""Host time per call: forward and forward + backward on a problem so small that the GPU
waits for the CPU, so wall time per call is the Python / dispatch / launch cost. Ours
(flexsparse.attention, backend="triton"), optionally an older copy of ops/triton_block.py
(--ab-old, as in benchmarks/bench.py) and FlexAttention (compiled).

    python3 tests/gpu/host_overhead.py [--kind sliding] [--ab-old PATH] [--calls 300]
"""
import os
import sys
import argparse
import contextlib
import time

import torch

import flexsparse
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
from benchmarks import bench


def per_call_us(fn, calls):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def breakdown(q, k, v, do, desc, calls):
    """Per-call host time of each layer of our forward and backward."""
    import triton
    from flexsparse.ops import triton_block as tb
    mt = desc.mask_tensors()
    scale = q.shape[-1] ** -0.5
    qd, kd, vd = (t.detach() for t in (q, k, v))
    out, lse = tb.forward(qd, kd, vd, None, mt, 128, 128, scale, 0.0, False)
    layers = {
        "triton_block.forward": lambda: tb.forward(qd, kd, vd, None, mt, 128, 128, scale, 0.0,
                                                   False),
        "triton_block.backward": lambda: tb.backward(do, None, qd, kd, vd, out, lse, None, mt,
                                                     128, 128, scale, 0.0, False, False),
        "op forward": lambda: torch.ops.flexsparse.attention(
            qd, kd, vd, None, *mt, 128, 128, scale, 0.0, "triton", False),
        "api forward, no grad": lambda: flexsparse.attention(qd, kd, vd, desc, backend="triton"),
        "api forward, grad": lambda: flexsparse.attention(q, k, v, desc, backend="triton"),
    }
    from flexsparse.ops import triton_launch
    for name, fn in layers.items():
        full = per_call_us(fn, calls)       # also records the calls' launches
        with bench._swapped(triton_launch.LaunchPlan, "__call__", lambda self, pointers: None):
            prep = per_call_us(fn, calls)
        print(f"layer {name:24}: {full:6.0f} us/call, {prep:6.0f} without the launches")
    o = flexsparse.attention(q, k, v, desc, backend="triton")
    exposed = {
        "forward": lambda: flexsparse.attention(qd, kd, vd, desc, backend="triton"),
        "backward (autograd.grad)": lambda: torch.autograd.grad(o, (q, k, v), do,
                                                                retain_graph=True),
    }
    for name, fn in exposed.items():
        ms = triton.testing.do_bench(fn, warmup=10, rep=50)
        print(f"do_bench of a tiny problem, ours {name}: {ms * 1e3:.0f} us")


def launch_breakdown(q, k, v, do, desc, calls):
    """Per-launch host time of our direct launch path, split: the whole launch(), the
    argument pass that builds the cache key and the raw-pointer list, the compiled
    launcher alone (compiled.run with a prebuilt list), and Triton's own kernel[grid]."""
    import triton
    from flexsparse.ops import triton_block as tb
    from flexsparse.ops import triton_launch as tl_
    mt = desc.mask_tensors()
    scale = q.shape[-1] ** -0.5
    qd, kd, vd = (t.detach() for t in (q, k, v))
    seen = {}
    real = tl_.launch

    def spy(kernel, grid, args, kwargs, warps, stages):
        seen[kernel.fn.__name__] = (kernel, grid, args, kwargs, warps, stages)
        return real(kernel, grid, args, kwargs, warps, stages)
    tb._CALLS.clear()                       # so that the calls below launch through launch()
    with bench._swapped(tb, "launch", spy):
        out, lse = tb.forward(qd, kd, vd, None, mt, 128, 128, scale, 0.0, False)
        tb.backward(do, None, qd, kd, vd, out, lse, None, mt, 128, 128, scale, 0.0, False, False)
    device = torch.cuda.current_device()
    for name, (kernel, grid, args, kwargs, warps, stages) in seen.items():
        real(kernel, grid, args, kwargs, warps, stages)
        compiled = [c for key, c in tl_._COMPILED.items() if key[0] is kernel][-1]
        names = [p.name for p in kernel.params]

        def keypass():
            key, flat = tl_.key_and_pointers(kernel, device, args, kwargs, warps, stages)
            tl_._COMPILED.get(key)
            return flat
        flat = keypass() + [kwargs[n] for n in names[len(args):]]
        g = tuple(grid) + (1, 1)
        stream = triton.runtime.driver.active.get_current_stream(device)
        run = compiled.run
        parts = {
            "launch()": lambda: real(kernel, grid, args, kwargs, warps, stages),
            "key + pointer pass": keypass,
            "compiled.run (prebuilt args)": lambda: run(g[0], g[1], g[2], stream,
                                                        compiled.function,
                                                        compiled.packed_metadata, None, None,
                                                        None, *flat),
            "get_current_stream": lambda: triton.runtime.driver.active.get_current_stream(device),
            "kernel[grid] (Triton)": lambda: kernel[grid](*args, **kwargs, num_warps=warps,
                                                          num_stages=stages),
        }
        n_args = len(flat)
        for part, fn in parts.items():
            print(f"launch {name:22} ({n_args} args) {part:30}: {per_call_us(fn, calls):6.1f} us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="sliding")
    ap.add_argument("--L", type=int, default=256)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--ab-old", metavar="PATH")
    ap.add_argument("--profile", action="store_true",
                    help="also cProfile our forward + backward calls (top functions by own time)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time each layer of our call alone (kernel launches stubbed out "
                         "for 'prep'), and the do_bench time of a tiny problem, which is the "
                         "host time a benchmark sees")
    args = ap.parse_args()
    dev = torch.device("cuda")
    B, H, L, D = 1, 2, args.L, 64
    mk = lambda: torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16,  # noqa: E731
                             requires_grad=True)
    q, k, v = mk(), mk(), mk()
    do = torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16)
    fs_mask, mask_mod, per_head, _, _ = bench.make_case(args.kind, B, L, device=dev)
    desc = fs_mask.compile(B, H, H, L, L, device=dev)
    from flexsparse.ops import triton_launch
    if args.breakdown:
        breakdown(q, k, v, do, desc, args.calls)
        launch_breakdown(q, k, v, do, desc, args.calls)
    impls = {"ours": contextlib.nullcontext,
             "ours, Triton's launch path": lambda: bench._swapped(triton_launch, "FAST_LAUNCH",
                                                                  False)}
    if args.ab_old:
        old = bench.load_block_module(args.ab_old)
        impls["old"] = lambda: bench._block_module(old)
    for name, ctx in impls.items():
        with ctx():
            with torch.no_grad():
                fwd = per_call_us(lambda: flexsparse.attention(q, k, v, desc, backend="triton"),
                                  args.calls)
            fb = per_call_us(lambda: flexsparse.attention(q, k, v, desc, backend="triton")
                             .backward(do), args.calls)
        print(f"host {name} {args.kind} L={L}: fwd {fwd:.0f} us/call, fwd+bwd {fb:.0f} us/call")
    if args.profile:
        import cProfile
        import pstats
        step = lambda: flexsparse.attention(q, k, v, desc, backend="triton").backward(do)  # noqa
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            step()
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
    from torch.nn.attention.flex_attention import flex_attention
    fa = torch.compile(flex_attention, dynamic=False)
    bm = bench.flex_block_mask(desc, mask_mod, per_head, L, dev)
    with contextlib.ExitStack() as stack:
        if args.breakdown:      # its backward timing retains the graph, as the bench does
            stack.enter_context(bench._no_donated_buffers())
        with torch.no_grad():
            fwd = per_call_us(lambda: fa(q, k, v, block_mask=bm), args.calls)
        fb = per_call_us(lambda: fa(q, k, v, block_mask=bm).backward(do), args.calls)
        print(f"host flex {args.kind} L={L}: fwd {fwd:.0f} us/call, fwd+bwd {fb:.0f} us/call")
        if args.breakdown:
            import triton
            qd, kd, vd = (t.detach() for t in (q, k, v))
            o = fa(q, k, v, block_mask=bm)
            for name, fn in (("forward", lambda: fa(qd, kd, vd, block_mask=bm)),
                             ("backward (autograd.grad)",
                              lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))):
                ms = triton.testing.do_bench(fn, warmup=10, rep=50)
                print(f"do_bench of a tiny problem, flex {name}: {ms * 1e3:.0f} us")


if __name__ == "__main__":
    main()
