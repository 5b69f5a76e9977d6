"""Packaging. `ops/` is installed as `flexsparse.ops`.

The CUDA extension in csrc/ is optional: it is built only when CUDA and nvcc are
available (or FLEXSPARSE_BUILD_CUDA=1), and skipped cleanly otherwise.
"""
import os
import sys

from setuptools import setup

PACKAGES = ["flexsparse", "flexsparse.ops"]
PACKAGE_DIR = {"flexsparse": "flexsparse", "flexsparse.ops": "ops"}


def cuda_extensions():
    want = os.environ.get("FLEXSPARSE_BUILD_CUDA")
    if want == "0" or not os.path.isdir("csrc"):
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except Exception as err:  # no torch in the build environment
        print(f"flexsparse: skipping the CUDA extension ({err})", file=sys.stderr)
        return [], {}
    if CUDA_HOME is None or (torch.version.cuda is None and want != "1"):
        print("flexsparse: skipping the CUDA extension (no CUDA toolkit or CPU-only torch)",
              file=sys.stderr)
        return [], {}
    sources = sorted(os.path.join("csrc", f) for f in os.listdir("csrc") if f.endswith((".cu", ".cpp")))
    if not sources:
        return [], {}
    ext = CUDAExtension(
        "flexsparse._C", sources,
        extra_compile_args={"cxx": ["-O3"],
                            "nvcc": ["-O3", "--use_fast_math", "-gencode=arch=compute_90a,code=sm_90a",
                                     "-gencode=arch=compute_80,code=sm_80"]})
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = cuda_extensions()
setup(packages=PACKAGES, package_dir=PACKAGE_DIR, ext_modules=ext_modules, cmdclass=cmdclass)
