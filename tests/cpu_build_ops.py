"""The mask-build ops' CPU kernels for CPU-only test runs: where flexsparse._C is not built
(CI's CPU torch), tests/cpu_ops/build_ops_cpu.cpp (csrc/build_ops.h with
FLEXSPARSE_CPU_ONLY) is compiled with torch.utils.cpp_extension and loaded, so that
tests/test_build_op.py runs against the same C++ as the device's build. Needs a C++
compiler and ninja; `load()` says why when it cannot."""
import os

import torch

from flexsparse import build_op

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(os.path.dirname(HERE), "csrc")


def load():
    """None once the CPU kernels are registered (built here if needed), else the reason
    they are not."""
    if build_op.available("cpu"):
        return None
    lib = os.environ.get("FLEXSPARSE_TEST_BUILD_LIB")
    if lib:
        torch.ops.load_library(lib)
    else:
        from torch.utils import cpp_extension
        if not cpp_extension.is_ninja_available():
            return "ninja is not installed (pip install ninja), so the CPU build ops cannot be built"
        try:
            # the torch version in the name: a library cached for another torch is not reused
            tag = "".join(ch if ch.isalnum() else "_" for ch in torch.__version__)
            cpp_extension.load(
                name=f"flexsparse_build_ops_cpu_{tag}",
                sources=[os.path.join(HERE, "cpu_ops", "build_ops_cpu.cpp")],
                extra_include_paths=[CSRC], extra_cflags=["-O1"], is_python_module=False,
                verbose=False)
        except Exception as err:   # no compiler, or headers that do not build: say so
            return f"the CPU build ops did not build: {type(err).__name__}: {str(err)[:300]}"
    build_op._HAVE.pop("CPU", None)   # looked up again: the kernels are registered now
    return None if build_op.available("cpu") else "the CPU build ops did not register"
