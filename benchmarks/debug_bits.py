"""FLEXSPARSE_CUDA_DEBUG for one call: the CUDA ops read it per call, so a benchmark can
time a kernel variant beside the default in one process (same-build A/Bs; the bits are
listed where the kernels read them and in docs/perf-notes.md)."""
import os
import statistics


def with_debug(bits, fn):
    """fn() with FLEXSPARSE_CUDA_DEBUG set to `bits`, restored after."""
    old = os.environ.get("FLEXSPARSE_CUDA_DEBUG")
    os.environ["FLEXSPARSE_CUDA_DEBUG"] = str(bits)
    try:
        return fn()
    finally:
        if old is None:
            del os.environ["FLEXSPARSE_CUDA_DEBUG"]
        else:
            os.environ["FLEXSPARSE_CUDA_DEBUG"] = old


def in_turns(measure, variants, rounds):
    """[default, *one per value in `variants`]: the median of `rounds` calls of measure()
    (a time) by default and under each FLEXSPARSE_CUDA_DEBUG value, the settings taking
    turns, so that a drift of the machine reaches all of them alike."""
    times = [[] for _ in range(1 + len(variants))]
    for _ in range(rounds):
        times[0].append(measure())
        for i, bits in enumerate(variants):
            times[1 + i].append(with_debug(bits, measure))
    return [statistics.median(t) for t in times]
