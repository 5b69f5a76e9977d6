"""Host time of issue 16's whole step (benchmarks/step_bench.py, eager): per mask, the
Python/dispatch time of one fwd+bwd step with the descriptor compiled once and with the
mask built in the step, measured without a sync per step on a problem so small that the
GPU waits for the host; then a cProfile of the built-every-step case.

    PYTHONPATH=/tmp/site:$PWD python3 tests/gpu/profile_step_host.py [--L 8192] [--steps 300]
"""
import argparse
import cProfile
import pstats
import time

import torch

from benchmarks import build_bench, step_bench
from flexsparse import api

ap = argparse.ArgumentParser()
ap.add_argument("--L", type=int, default=8192)
ap.add_argument("--steps", type=int, default=300)
ap.add_argument("--profile", default="document(lengths tensor)")
a = ap.parse_args()
L, B, H = a.L, 1, 2
D = 64
q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
grad_out = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
step = step_bench.stepper(step_bench.attend)


def host_us(fn, steps):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    t1 = time.perf_counter()            # host time: before draining the GPU
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / steps * 1e6, (t2 - t0) / steps * 1e6


print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; B={B} H={H} L={L} D={D} "
      f"(small: the GPU waits for the host); µs per fwd+bwd step, host / with the drain; "
      f"'registered': the CUDA op through register_autograd's wrapper (before C57)")
print("| mask | autograd | once host µs | once wall µs | every step host µs | every step wall µs |")
print("|---|---|---|---|---|---|")
eager_fn = api.cuda_attention_with_grad
for name, (make, _) in build_bench.cases(L, "cuda", H).items():
    desc = make().compile(B, H, H, L, L, device="cuda")
    # the Function twice, before and after the registered op: the spread of one path's two
    # rows is the noise the comparison is read against
    for label, fn in (("eager Function", eager_fn), ("registered", torch.ops.flexsparse.cuda_attention),
                      ("eager Function, again", eager_fn)):
        api.cuda_attention_with_grad = fn
        once = host_us(lambda: step(q, k, v, desc, grad_out), a.steps)  # noqa: B023
        fresh = host_us(lambda: step(q, k, v, make(), grad_out), a.steps)  # noqa: B023
        print(f"| {name} | {label} | {once[0]:.0f} | {once[1]:.0f} | {fresh[0]:.0f} "
              f"| {fresh[1]:.0f} |", flush=True)
    api.cuda_attention_with_grad = eager_fn

make = build_bench.cases(L, "cuda", H)[a.profile][0]
prof = cProfile.Profile()
prof.enable()
for _ in range(a.steps):
    step(q, k, v, make(), grad_out)
torch.cuda.synchronize()
prof.disable()
st = pstats.Stats(prof)
st.sort_stats("tottime").print_stats(25)
st.sort_stats("cumulative").print_stats(30)
