"""Where a pipelined step's time goes (issue 16's whole step, docs/perf-notes.md C57):
10 fwd+bwd steps of one step_bench mask without a sync between them, descriptor compiled
once against built every step, under torch.profiler. Prints per step: wall time, the sum
of GPU kernel times, the GPU's idle time between the first and last kernel, and the
kernels that only the built-every-step run has (the build's).

    PYTHONPATH=/tmp/site:$PWD python3 tests/gpu/profile_step_timeline.py [--mask document] [--L 8192]
"""
import argparse
import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import build_bench, step_bench

ap = argparse.ArgumentParser()
ap.add_argument("--mask", default="document")
ap.add_argument("--L", type=int, default=8192)
ap.add_argument("--steps", type=int, default=10)
a = ap.parse_args()
L, B, H, D = a.L, 2, 16, 128
q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
grad_out = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
step = step_bench.stepper(step_bench.attend)
name = next(n for n in build_bench.cases(L, "cuda", H) if n.startswith(a.mask))
make = build_bench.cases(L, "cuda", H)[name][0]
desc = make().compile(B, H, H, L, L, device="cuda")
runs = {"compiled once": lambda: step(q, k, v, desc, grad_out),
        "built every step": lambda: step(q, k, v, make(), grad_out)}
kernels = {}
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {name}, B={B} H={H} L={L} "
      f"D={D}; {a.steps} steps without a sync between them")
print("| run | wall ms/step | GPU kernel ms/step | GPU idle ms/step (first to last kernel) "
      "| kernels/step |")
print("|---|---|---|---|---|")
for label, fn in runs.items():
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / a.steps
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
           and e.time_range.elapsed_us() > 0]
    evs.sort(key=lambda e: e.time_range.start)
    busy = sum(e.time_range.elapsed_us() for e in evs) / 1e3
    span = (evs[-1].time_range.end - evs[0].time_range.start) / 1e3 if evs else 0.0
    kernels[label] = collections.Counter(e.name for e in evs)
    print(f"| {label} | {wall:.3f} | {busy / a.steps:.3f} | {(span - busy) / a.steps:.3f} "
          f"| {len(evs) / a.steps:.1f} |", flush=True)
extra = kernels["built every step"] - kernels["compiled once"]
print("kernels only when built every step (count over all steps):")
for kname, n in extra.most_common(12):
    print(f"  {n:4d}  {kname[:110]}")
