"""Which C++ errors an extension built on this machine can raise without killing Python
(csrc/checks.h says why it matters). Builds a CPU-only extension with load_inline (~20 s)
whose ops fail in different ways, calls each in a subprocess, and prints its exit code
and what it raised. On the device (torch 2.11.0+cu130, 2026-11-27): every case that
formats an integer through a std::ostream died with SIGSEGV (-11), even the one that
only formats and returns; string messages, std::to_string and std::invalid_argument
raised normally.

    PYTHONPATH=$PWD python3 tests/gpu/probe_cpp_errors.py
"""
import subprocess
import sys
import time

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/library.h>
#include <c10/util/Exception.h>
#include <sstream>

int64_t check_value_int(int64_t x) { TORCH_CHECK_VALUE(x >= 0, "x must be >= 0, got ", x); return x; }
int64_t check_type_int(int64_t x) { TORCH_CHECK_TYPE(x >= 0, "x must be >= 0, got ", x); return x; }
int64_t check_int(int64_t x) { TORCH_CHECK(x >= 0, "x must be >= 0, got ", x); return x; }
int64_t check_value_text(int64_t x) { TORCH_CHECK_VALUE(x >= 0, "x must be >= 0"); return x; }
int64_t check_value_to_string(int64_t x) {
  TORCH_CHECK_VALUE(x >= 0, std::string("x must be >= 0, got ") + std::to_string(x));
  return x;
}
int64_t std_invalid_argument(int64_t x) {
  if (x < 0) throw std::invalid_argument("x must be >= 0");
  return x;
}
int64_t ostream_then_throw(int64_t x) {
  if (x < 0) {
    std::ostringstream os;
    os << "got " << x;
    throw std::invalid_argument(os.str());
  }
  return x;
}
int64_t ostream_no_error(int64_t x) {
  std::ostringstream os;
  os << "got " << x;
  return static_cast<int64_t>(os.str().size());
}

TORCH_LIBRARY(cpp_error_probe, m) {
  m.def("check_value_int(int x) -> int", &check_value_int);
  m.def("check_type_int(int x) -> int", &check_type_int);
  m.def("check_int(int x) -> int", &check_int);
  m.def("check_value_text(int x) -> int", &check_value_text);
  m.def("check_value_to_string(int x) -> int", &check_value_to_string);
  m.def("std_invalid_argument(int x) -> int", &std_invalid_argument);
  m.def("ostream_then_throw(int x) -> int", &ostream_then_throw);
  m.def("ostream_no_error(int x) -> int", &ostream_no_error);
}
"""
CASES = ("check_value_int", "check_type_int", "check_int", "check_value_text",
         "check_value_to_string", "std_invalid_argument", "ostream_then_throw", "ostream_no_error")


def build():
    load_inline("cpp_error_probe", cpp_sources=SOURCE, is_python_module=False)


def call(name):
    build()
    arg = 5 if name == "ostream_no_error" else -1
    try:
        print("returned", getattr(torch.ops.cpp_error_probe, name)(arg))
    except Exception as e:  # noqa: BLE001 (the probe reports whatever is raised)
        print("raised", type(e).__name__, str(e).splitlines()[0])


def main():
    t0 = time.time()
    build()
    print(f"built in {time.time() - t0:.0f} s")
    for name in CASES:
        r = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True)
        said = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
        print(f"{name}: exit {r.returncode} {said}")


if __name__ == "__main__":
    call(sys.argv[1]) if len(sys.argv) > 1 else main()
