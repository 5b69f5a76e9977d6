"""Host time of the per-step build op (issue 16): per mask kind at 8K, the build with a sync,
the mask object alone, one object compiled again, host µs per build without syncs, and a
cProfile of 2,000 builds (docs/perf-notes.md, "Where the build op's host time goes").

    PYTHONPATH=/tmp/site:$PWD python3 tests/gpu/profile_build_host.py
"""
import cProfile
import pstats
import time

import torch

from flexsparse import build_op
from benchmarks.build_bench import cases, time_us

L, H = 8192, 16
cs = cases(L)
for name in ("document(lengths tensor)", "prefix_lm(tensor)", "column_ranges(tensor)"):
    make = cs[name][0]

    def build():
        return make().compile(1, H, H, L, L, device="cuda", block_size=128)

    with build_op.use(None):
        print(name, "build µs", round(time_us(build, 200), 1))
        print(name, "mask object only µs", round(time_us(make, 200), 1))
        m = make()
        compile_one = lambda: m.compile(1, H, H, L, L, device="cuda", block_size=128)  # noqa: E731
        print(name, "compile of one object µs", round(time_us(compile_one, 200), 1))
        # host time only: no sync per call
        for _ in range(20):
            build()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(500):
            build()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(name, f"host µs per build (no sync) {(t1 - t0) / 500 * 1e6:.1f}, "
                    f"with drain {(t2 - t0) / 500 * 1e6:.1f}")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(2000):
            build()
        pr.disable()
        torch.cuda.synchronize()
        pstats.Stats(pr).sort_stats("tottime").print_stats(22)
