"""Sustained forward (or backward) calls of ours and FLASH's in turns, with the SM clock
and board power sampled by nvidia-smi meanwhile: whether one kernel runs at a lower clock
under the power cap than the other (the do_bench ratios against the profiler's split).

    python -m benchmarks.power_probe [kind@L[@D]] [--seconds S] [--bwd]
"""
import statistics
import subprocess
import sys
import threading
import time

import torch

from benchmarks.bench import _no_donated_buffers, parse_rows
from benchmarks.timing_probe import row_calls

SECONDS = float(sys.argv[sys.argv.index("--seconds") + 1]) if "--seconds" in sys.argv else 3.0
BWD = "--bwd" in sys.argv


def sampled(fn):
    """(ms per call, median SM MHz, median W) over SECONDS of back-to-back calls."""
    samples, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            r = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True).stdout.split(",")
            samples.append((float(r[0]), float(r[1])))
            time.sleep(0.1)
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    th = threading.Thread(target=poll)
    th.start()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < SECONDS:
        for _ in range(10):
            fn()
        n += 10
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    stop.set()
    th.join()
    late = samples[len(samples) // 3:]   # past the ramp
    return dt / n * 1e3, statistics.median(s[0] for s in late), statistics.median(s[1] for s in late)


def main():
    spec = next((a for a in sys.argv[1:] if not a.startswith("--") and "@" in a), "prefix_lm@16384")
    print("| row | backend | ms per call | SM MHz | W |")
    print("|---|---|---|---|---|")
    for kind, L, D in parse_rows(spec):
        with _no_donated_buffers():
            fns = row_calls(kind, L, D, BWD)
            for r in range(2):
                for name, fn in (fns.items() if r == 0 else reversed(list(fns.items()))):
                    ms, mhz, w = sampled(fn)
                    print(f"| {kind}@{L}@{D} | {name} | {ms:.3f} | {mhz:.0f} | {w:.0f} |", flush=True)


if __name__ == "__main__":
    main()
