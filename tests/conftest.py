import os
import sys

# On CPU the Triton kernels run under the interpreter; it must be on before triton loads.
if os.environ.get("FLEXSPARSE_GPU_TESTS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests share tests/naive.py (the independent second opinion); importlib mode needs the path.
sys.path.insert(0, os.path.dirname(__file__))
