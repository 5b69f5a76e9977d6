"""Where a call's GPU time goes, per kernel (torch.profiler's CUDA activity): shared by
the benchmarks that print a split (cuda_index_bench --split, tests/gpu/profile_cuda_split.py).
"""
import torch
from torch.profiler import ProfilerActivity, profile


def per_kernel(fn, reps=5, warmup=3):
    """[(kernel name, GPU µs per call, launches per call)] of `fn`, largest first: `reps`
    profiled calls after `warmup` unprofiled ones."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / reps, e.count // reps)
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def print_split(rows, title, top=12):
    total = sum(t for _, t, _ in rows)
    print(f"## {title}: GPU time per call by kernel (us)")
    for name, t, n in rows[:top]:
        print(f"{t:9.1f} us {100 * t / max(total, 1e-9):5.1f}%  x{n}  {name[:110]}")
    print(f"{total:9.1f} us total", flush=True)
