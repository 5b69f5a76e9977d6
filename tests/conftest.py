import os
import sys

if os.environ.get("FLEXSPARSE_GPU_TESTS") != "1":
    # On CPU the Triton kernels run under the interpreter; it must be on before triton loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One torch thread per process on CPU. Tests compare runs bit for bit, and torch's
    # multi-threaded CPU reductions do not always sum in the same order (the first 128-float
    # `sum` of a process differed from the later ones in 4 of 80 runs with 2 threads, none of
    # 80 with one; CI failed once on it). Under `-n 2` on two cores it is also faster: the
    # suite took 7m54s against 8m17s with torch's default of 2 threads per worker.
    import torch
    torch.set_num_threads(1)

# Tests share tests/naive.py (the independent second opinion); importlib mode needs the path.
sys.path.insert(0, os.path.dirname(__file__))
