"""Where a forward's or backward's benchmark time goes beyond its kernels, ours (CUDA
backend) against FlexAttention's FLASH backend, in one process: the ratio columns of
cuda_bench come from triton's do_bench (the L2 flushed before each call), while the
profiler's per-kernel split (kernel_split) counts GPU time only.

    python -m benchmarks.timing_probe [rows] [--bwd] [--host-ops] [--flex]   rows: kind@L[@D],... as cuda_bench

(--host-ops: also the host's time of 10 calls by operator, torch.profiler's CPU table;
--flex: FlexAttention's Triton backend as a third backend.)

Per row and backend, in ms per call: `do_bench` (cuda_bench's timer), single calls between
two CUDA events with and without a 256 MB zero fill before each (do_bench's L2 flush, the
medians of 30), `back to back` (cuda_bench's `--timer back_to_back`: calls between two
CUDA events for ~60 ms, no flush, the median of three runs: GPU time plus any gap the host
leaves), `kernels` (the sum of the GPU time of every kernel one call
launches, torch.profiler), `host` (the host's time to issue one call while the GPU is kept
busy, so that no launch waits for the GPU) and the kernels a call launches. The backends
run one after the other (not in turns).
"""
import statistics
import sys
import time

import torch
import triton.testing

import flexsparse
from benchmarks.bench import _no_donated_buffers, flex_block_mask, make_case, parse_rows
from benchmarks.cuda_bench import DTYPE, FLASH, H, HAS_FLASH, TOKENS, back_to_back

BWD = "--bwd" in sys.argv


def row_calls(kind, L, D, bwd):
    """{backend: fn} for one row (cuda_bench's sizes and masks): fn() runs our CUDA
    backend's call or FlexAttention's FLASH backend's (where installed) on fresh inputs,
    the forward, or with `bwd` the backward over a retained graph (its forward run here:
    call this inside benchmarks.bench._no_donated_buffers())."""
    from torch.nn.attention.flex_attention import flex_attention
    B = max(1, TOKENS // L)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=DTYPE, requires_grad=bwd) for _ in range(3))
    torch._dynamo.reset()
    fs_mask, mask_mod, per_head, _, _ = make_case(kind, B, L, device=q.device)
    desc = fs_mask.compile(B, H, H, L, L, device=q.device)
    calls = {"cuda": lambda a, b, c: flexsparse.attention(a, b, c, desc, backend="cuda")}
    fa = torch.compile(flex_attention, dynamic=False)
    bm = flex_block_mask(desc, mask_mod, per_head, L, q.device)
    if "--flex" in sys.argv:     # FlexAttention's Triton backend too
        calls["flex"] = lambda a, b, c: fa(a, b, c, block_mask=bm)
    if HAS_FLASH:
        calls["flash"] = lambda a, b, c: fa(a, b, c, block_mask=bm, kernel_options=FLASH)
    fns = {}
    for name, call in calls.items():
        if bwd:
            out = call(q, k, v)
            fns[name] = (lambda o, d: lambda: torch.autograd.grad(o, (q, k, v), d, retain_graph=True))(
                out, torch.randn_like(out))
        else:
            fns[name] = (lambda c: lambda: c(q, k, v))(call)
    return fns


def single_calls_ms(fn, flush, n=30):
    """Median ms of single calls between two CUDA events, each after a 256 MB zero fill (as
    do_bench flushes the L2) or right after the previous call (flush=False)."""
    cache = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda")
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    fn()
    torch.cuda.synchronize()
    for start, end in events:
        if flush:
            cache.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def host_ms(fn, n=10, runs=3):
    """The host's time per call with the GPU busy (a sleep kernel ahead of the calls): the
    median of `runs` runs of `n` calls."""
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9))   # ~1 s of GPU time at ~2 GHz: the queue never drains
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e3)
        torch.cuda.synchronize()
    return statistics.median(times)


def kernels(fn):
    """[(name, ms)] of the kernels one call of fn launches."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.name, e.device_time_total / 1e3))
    return out


def host_breakdown(fn, top=12):
    """The host's time of one call by operator (torch.profiler, CPU activity, self time),
    the `top` largest, as text: where our 0.13-0.19 ms per call goes (55th session)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            fn()
    torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def main():
    spec = next((a for a in sys.argv[1:] if not a.startswith("--")), "causal@8192,full@8192")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, H={H}, B*L=16K, "
          f"{'backward' if BWD else 'forward'}")
    print("| row | backend | do_bench ms | single, flushed | single, not flushed | back to back ms "
          "| kernels ms | host ms | kernels |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind, L, D in parse_rows(spec):
        with _no_donated_buffers():
            for name, fn in row_calls(kind, L, D, BWD).items():
                try:
                    fn()
                    bench = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
                    b2b = back_to_back(fn)
                    flushed, unflushed = single_calls_ms(fn, True), single_calls_ms(fn, False)
                    ks = kernels(fn)
                    host = host_ms(fn)
                except Exception as e:  # report, keep going
                    print(f"| {kind}@{L}@{D} | {name} | failed: {type(e).__name__}: {str(e)[:200]} |")
                    continue
                if "--host-ops" in sys.argv:
                    print(f"host operators of 10 calls, {kind}@{L}@{D} {name}:\n{host_breakdown(fn)}")
                names = "; ".join(f"{n[:40]} {t:.3f}" for n, t in ks)
                print(f"| {kind}@{L}@{D} | {name} | {bench:.3f} | {flushed:.3f} | {unflushed:.3f} "
                      f"| {b2b:.3f} | {sum(t for _, t in ks):.3f} "
                      f"| {host:.3f} | {names} |", flush=True)


if __name__ == "__main__":
    main()
