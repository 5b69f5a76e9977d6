"""Where a per-step build spends its time (issue 16): CUDA kernels and host ops of one
`mask.compile` of a document mask from a GPU lengths tensor at 8K, eager static build and
compiled_build, from torch.profiler.

    python3 tests/gpu/profile_compiled_build.py [L]
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from flexsparse import masks as M


def main():
    L = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    lens = torch.full((8,), L // 8, device="cuda")
    for compiled in (False, True):
        def build():
            return M.document(lens).compile(1, 16, 16, L, L, device="cuda", block_size=128,
                                            compiled_build=compiled)
        for _ in range(3):
            build()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                build()
            torch.cuda.synchronize()
        events = prof.key_averages()
        kernels = sum(e.count for e in events if e.device_type.name == "CUDA") / 10
        print(f"== compiled_build={compiled}: {kernels:.0f} CUDA kernels per build")
        print(events.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
