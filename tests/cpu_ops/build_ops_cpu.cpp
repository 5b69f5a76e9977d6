// The mask-build ops' CPU kernels alone (csrc/build_ops.h without CUDA), built by
// tests/cpu_build_ops.py for CPU-only test runs: CI's CPU torch has no flexsparse._C, and
// tests/test_build_op.py needs these kernels. The schemas come from ops/schema.py (Python),
// so flexsparse is imported before this library is loaded.
#define FLEXSPARSE_CPU_ONLY
#include "build_ops.h"
