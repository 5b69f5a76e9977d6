import os

# On CPU the Triton kernels run under the interpreter; it must be on before triton loads.
if os.environ.get("FLEXSPARSE_GPU_TESTS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
