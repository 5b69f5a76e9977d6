"""FLEXSPARSE_CUDA_DEBUG for one call: the CUDA ops read it per call, so a benchmark can
time a kernel variant beside the default in one process (same-build A/Bs; the bits are
listed where the kernels read them and in docs/perf-notes.md)."""
import os


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
