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


def rotated(n, round_index):
    """The order of n settings in round `round_index`: 0..n-1 rotated by the round, so that
    no setting holds one place in every round. (An H200 A/B of 2026-11-29 read the setting
    in the fifth place ~13% slow in every round, the same setting in places 1-4 not:
    with a fixed order, a place's effect becomes a column's; perf-notes, "The A/B's last
    columns".)"""
    return [(round_index + k) % n for k in range(n)] if n else []


def in_turns(measure, variants, rounds):
    """[default, *one per value in `variants`]: the median of `rounds` calls of measure()
    (a time) by default and under each FLEXSPARSE_CUDA_DEBUG value, the settings taking
    turns (in an order rotated every round), so that a drift of the machine, or an effect
    of the place in the round, reaches all of them alike."""
    settings = [None, *variants]
    times = [[] for _ in settings]
    for r in range(rounds):
        for i in rotated(len(settings), r):
            bits = settings[i]
            times[i].append(measure() if bits is None else with_debug(bits, measure))
    return [statistics.median(t) for t in times]
