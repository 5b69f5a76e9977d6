"""Probe: where the CUDA forward spends its time on partial-heavy masks. Times the kernel
alone (torch.profiler) and the call (do_bench) under FLEXSPARSE_CUDA_DEBUG settings, and
checks that an error raised inside the C++ op reaches Python as RuntimeError."""
import os
import subprocess
import sys

import torch
import triton.testing

import flexsparse
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
from benchmarks.bench import make_case


def kernel_us(fn):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names = {}
    for e in ev:
        names.setdefault(e.name[:60], []).append(e.device_time)
    return {k: sum(v) / len(v) for k, v in names.items()}


def main():
    if sys.argv[1:2] == ["raise"]:
        from flexsparse import masks as M
        dtype = torch.float32 if sys.argv[2] == "dtype" else torch.float16
        q = torch.randn(1, 2, 256, 128, device="cuda", dtype=dtype)
        desc = M.causal().compile(1, 2, 2, 256, 256, device=q.device,
                                  block_size=(64, 64) if sys.argv[2] == "block" else (128, 128))
        try:
            torch.ops.flexsparse.cuda_attention(q, q, q, None, *desc.mask_tensors(),
                                                *desc.block_size, 0.1, 0.0, False)
        except RuntimeError as e:
            print("raised RuntimeError:", str(e)[:120])
        return
    for case in ("dtype", "block"):
        r = subprocess.run([sys.executable, __file__, "raise", case], capture_output=True, text=True,
                           env=dict(os.environ, FLEXSPARSE_CUDA_TRACE="1"))
        print(f"error path {case}: rc", r.returncode, (r.stdout + r.stderr)[-400:])
    for kind in sys.argv[1].split(",") if len(sys.argv) > 1 else ("document", "causal", "full"):
        B, H, L, D = 2, 16, 8192, 128
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        fs, *_ = make_case(kind, B, L, device=q.device)
        desc = fs.compile(B, H, H, L, L, device=q.device)
        flops = 4.0 * D * desc.num_visible(batch=B)
        for dbg in os.environ.get("PROBE_DEBUG", "0,1,2,6").split(","):
            os.environ["FLEXSPARSE_CUDA_DEBUG"] = dbg
            f = lambda: flexsparse.attention(q, k, v, desc, backend="cuda")  # noqa: E731
            ms = triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")
            ks = kernel_us(f)
            print(f"{kind} debug={dbg}: {ms * 1e3:.0f} us ({flops / ms * 1e-9:.0f} TFLOP/s); kernels "
                  + ", ".join(f"{n} {t:.0f} us" for n, t in ks.items()), flush=True)
        os.environ["FLEXSPARSE_CUDA_DEBUG"] = "0"
        ms = triton.testing.do_bench(lambda: flexsparse.attention(q, k, v, desc, backend="triton"),
                                     warmup=10, rep=50, return_mode="median")
        print(f"{kind} triton: {ms * 1e3:.0f} us", flush=True)


if __name__ == "__main__":
    main()
