"""The C++ op kernels refuse bad arguments with a Python ValueError / TypeError whose text
names the argument and its value, and the process lives on. Each call runs in a
subprocess: on the device's torch 2.11 a TORCH_CHECK that formatted an integer through
c10::str killed the process with SIGSEGV (csrc/checks.h), which a test in-process would
only report as a crashed run. Skipped without CUDA or without the built extension."""
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import flexsparse.ops  # noqa: E402,F401  (defines the schemas and loads flexsparse._C)

if not torch._C._dispatch_has_kernel_for_dispatch_key("flexsparse::topk_rows", "CUDA"):
    pytest.skip("flexsparse._C is not built", allow_module_level=True)

SCORES = "torch.randn(2, 3, 8, 300, device='cuda', dtype=torch.bfloat16)"
LENGTHS = "torch.tensor([4, 4], device='cuda', dtype=torch.int32)"
CASES = [
    # (call, Python exception, text it must contain)
    (f"torch.ops.flexsparse.topk_rows({SCORES}, 4, False, 0, 8, 3)", "ValueError",
     "warps_per_row must be 0, 1, 4, 8 or 16, got 3"),
    (f"torch.ops.flexsparse.topk_rows({SCORES}, -1, False, 0, 8)", "ValueError",
     "k must be in [0, 2^31), got -1"),
    ("torch.ops.flexsparse.topk_rows(torch.randn(2, 3, 8, 300, device='cuda', dtype=torch.float64), 4, False, 0, 8)",
     "TypeError", "scores must be bf16, fp16 or fp32, got Double"),
    (f"torch.ops.flexsparse.build_document({LENGTHS}, 8, 0, 128, False)", "ValueError",
     "block sizes must be positive, got (0, 128)"),
    (f"torch.ops.flexsparse.build_document({LENGTHS}.float(), 8, 128, 128, False)", "TypeError",
     "lengths must be an integer tensor, got Float"),
]


@pytest.mark.parametrize("call,error,text", CASES, ids=[c[2][:30] for c in CASES])
def test_op_errors_raise(call, error, text):
    src = ("import torch, flexsparse.ops\n"
           f"try:\n    {call}\n    print('no error')\n"
           "except Exception as e:\n    print('raised', type(e).__name__, str(e).splitlines()[0])\n")
    r = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-1500:]}"
    assert f"raised {error}" in r.stdout and text in r.stdout, r.stdout
