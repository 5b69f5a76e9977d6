"""Where a descriptor build spends its time on the GPU (kernels vs host), for issue 5.

    python tests/gpu/profile_build.py [L ...]
"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from scale import flexsparse_masks  # noqa: E402

from flexsparse.masks import clear_cache  # noqa: E402


def main():
    sizes = [int(x) for x in sys.argv[1:]] or [1 << 20]
    for L in sizes:
        for name, m in flexsparse_masks(L, "cuda").items():
            def build():
                clear_cache()
                return m.compile(1, 16, 16, L, L, device="cuda", block_size=(128, 128))
            for _ in range(3):
                build()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                build()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t) / 20 * 1e3
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                build()
                torch.cuda.synchronize()
            kern = [(e.key, e.device_time_total) for e in prof.key_averages()
                    if e.device_time_total > 0]
            kern.sort(key=lambda x: -x[1])
            top = ", ".join(f"{k[:28]} {t:.0f}us" for k, t in kern[:5])
            print(f"{name} {L // 1024}K wall {wall:.3f} ms | {top}", flush=True)


if __name__ == "__main__":
    main()
