"""Packaging. `ops/` is installed as `flexsparse.ops`.

`ops/` stays at the top of the checkout next to `csrc/`; the checkout imports it through
the symlink `flexsparse/ops -> ../ops`, and package_dir below maps the package to the
real directory, so a wheel holds the files themselves (tests/test_layout.py checks both).

The CUDA extension in csrc/ is optional: it is built only when CUDA and nvcc are
available (or FLEXSPARSE_BUILD_CUDA=1), and skipped cleanly otherwise.
"""
import os
import sys

from setuptools import setup

PACKAGES = ["flexsparse", "flexsparse.integrations", "flexsparse.ops"]
PACKAGE_DIR = {"flexsparse": "flexsparse", "flexsparse.ops": "ops"}


def cutlass_include():
    """CUTLASS/CuTe headers from the installed nvidia-cutlass wheel (found, not imported)."""
    import importlib.util
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "source", "include")
    return path if os.path.isdir(os.path.join(path, "cute")) else None


def cuda_extensions():
    """flexsparse._C from csrc/ (sm_90a), when CUDA torch, nvcc and the CUTLASS headers are
    there (FLEXSPARSE_BUILD_CUDA=0 skips it, =1 makes a missing piece an error)."""
    want = os.environ.get("FLEXSPARSE_BUILD_CUDA")
    if want == "0" or not os.path.isdir("csrc"):
        return [], {}

    def skip(why):
        if want == "1":
            raise RuntimeError(f"flexsparse: cannot build the CUDA extension: {why}")
        print(f"flexsparse: skipping the CUDA extension ({why})", file=sys.stderr)
        return [], {}

    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except Exception as err:  # no torch in the build environment
        return skip(err)
    if CUDA_HOME is None or torch.version.cuda is None:
        return skip("no CUDA toolkit or CPU-only torch")
    cutlass = cutlass_include()
    if cutlass is None:
        return skip("no CUTLASS headers: pip install nvidia-cutlass")
    sources = sorted(os.path.join("csrc", f) for f in os.listdir("csrc") if f.endswith((".cu", ".cpp")))
    # The backward op is registered only once its kernels exist.
    defines = ["-DFLEXSPARSE_HAS_BACKWARD"] if os.path.exists(os.path.join("csrc", "bwd_sm90.cu")) else []
    ext = CUDAExtension(
        "flexsparse._C", sources,
        include_dirs=[os.path.abspath("csrc"), cutlass],
        extra_compile_args={"cxx": ["-O3"] + defines,
                            # NDEBUG: CUTLASS/CuTe's device-side asserts compiled out (they put
                            # a compare, a branch and a trap three times in every tile of the
                            # forward's main loop), as FlashAttention-3 builds.
                            # FLEXSPARSE_NVCC_FLAGS: extra nvcc flags for probe builds
                            # (tests/gpu.sh trace: -DFLEXSPARSE_FWD_TRACE).
                            "nvcc": ["-O3", "-DNDEBUG", "--use_fast_math", "--expt-relaxed-constexpr",
                                     "-gencode=arch=compute_90a,code=sm_90a"]
                                    + os.environ.get("FLEXSPARSE_NVCC_FLAGS", "").split()})
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = cuda_extensions()
setup(packages=PACKAGES, package_dir=PACKAGE_DIR, ext_modules=ext_modules, cmdclass=cmdclass)
