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


EXT_SHAPES = "#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED"


def compile_weight(path):
    """Sort key, heaviest translation units first: the forward's per-head-dim files (each a
    dozen kernels), then the backward's, then the rest. The extension lists its sources in
    this order, so that where the build starts them in list order and there are more files
    than jobs (MAX_JOBS), the light ones wait, not the heavy ones."""
    return (0 if "fwd_sm90_hd" in path else 1 if "bwd_sm90_hd" in path else 2, path)


def unity_sources(sources):
    """FLEXSPARSE_UNITY_TUS=N: the .cu files compiled as N translation units that include
    them (build/unity/), for CI's compile check on two cores. Each nvcc run pays ~50 s of
    front end for the CuTe headers whatever it compiles (two backward files: 72 s each
    apart, 95 s together), so on few cores a handful of large units builds faster than a
    file each; with many cores (the device's 16) a file each builds fastest."""
    n = int(os.environ.get("FLEXSPARSE_UNITY_TUS", "0") or 0)
    # Dealt round-robin, the heaviest files first (compile_weight), so that the units take
    # about the same time.
    cu = sorted((s for s in sources if s.endswith(".cu")), key=compile_weight)
    if n <= 0 or not cu:
        return sources
    os.makedirs(os.path.join("build", "unity"), exist_ok=True)
    units = []
    for i in range(min(n, len(cu))):
        path = os.path.join("build", "unity", f"unity_{i}.cu")
        # A file that enables CuTe's extended wgmma shapes defines the macro before its
        # first include; in a unit it must come before any file's, so the unit starts with it.
        ext = any(EXT_SHAPES in open(f).read() for f in cu[i::n])
        text = (f"{EXT_SHAPES}\n" if ext else "") + "".join(
            f'#include "{os.path.abspath(f)}"\n' for f in cu[i::n])
        if not os.path.exists(path) or open(path).read() != text:
            with open(path, "w") as out:
                out.write(text)
        units.append(path)
    return [s for s in sources if not s.endswith(".cu")] + units


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
    sources = unity_sources(sorted((os.path.join("csrc", f) for f in os.listdir("csrc")
                                    if f.endswith((".cu", ".cpp"))), key=compile_weight))
    # The backward op is registered only once its kernels exist.
    defines = ["-DFLEXSPARSE_HAS_BACKWARD"] if os.path.exists(os.path.join("csrc", "bwd_sm90.cu")) else []
    # FLEXSPARSE_COMPILE_CHECK=1: CI's proof that csrc compiles, on two cores (.ci/run):
    # C++ to compute_90a PTX without ptxas, and the bf16 kernels alone (sm90_utils.cuh,
    # Fp16Element). Not a usable build; the device's builds are full.
    check_only = os.environ.get("FLEXSPARSE_COMPILE_CHECK") == "1"
    check_defines = ["-DFLEXSPARSE_COMPILE_CHECK_BF16_ONLY"] if check_only else []
    # FLEXSPARSE_NVCC_FLAGS: extra nvcc flags for probe builds (tests/gpu.sh trace:
    # -DFLEXSPARSE_FWD_TRACE). Its defines go to the C++ files too: attention_ops.cpp
    # registers the probes' ops and defines the host arrays their kernels' launchers fill;
    # without them the .so has an undefined symbol and does not load.
    probe_flags = os.environ.get("FLEXSPARSE_NVCC_FLAGS", "").split()
    probe_defines = [f for f in probe_flags if f.startswith("-D")]
    ext = CUDAExtension(
        "flexsparse._C", sources,
        include_dirs=[os.path.abspath("csrc"), cutlass],
        extra_compile_args={"cxx": ["-O3"] + defines + check_defines + probe_defines,
                            # NDEBUG: CUTLASS/CuTe's device-side asserts compiled out (they put
                            # a compare, a branch and a trap three times in every tile of the
                            # forward's main loop), as FlashAttention-3 builds.
                            "nvcc": ["-O3", "-DNDEBUG", "--use_fast_math", "--expt-relaxed-constexpr",
                                     "-gencode=arch=compute_90a,code="
                                     + ("compute_90a" if check_only else "sm_90a")] + check_defines
                                    + probe_flags})
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = cuda_extensions()
setup(packages=PACKAGES, package_dir=PACKAGE_DIR, ext_modules=ext_modules, cmdclass=cmdclass)
