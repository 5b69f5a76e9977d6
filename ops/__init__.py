"""flexsparse.ops: op schemas, fake kernels, autograd, and the backends behind them.

The directory lives at the top of the checkout (next to csrc/); `flexsparse/ops` is a
symlink to it, so the checkout imports it as `flexsparse.ops` exactly like an installed
copy (setup.py installs the same files as `flexsparse.ops`). It must never be imported
as a top-level `ops` module: that would define the op schemas a second time.
"""
import importlib.util

if __name__ != "flexsparse.ops":
    raise ImportError(f"ops/ is the package flexsparse.ops; import it as that, not as {__name__!r}")

from . import schema, backends, reference
from .schema import MASK_TENSOR_NAMES, MaskTensors

backends.register(reference)

# Triton backend: on CUDA, or on CPU under TRITON_INTERPRET=1 for tests.
if importlib.util.find_spec("triton") is not None:
    from . import triton_backend
    backends.register(triton_backend)

# CUDA backend: the csrc/ extension, when it was built (setup.py); importing it registers
# its C++ kernels for the ops defined in schema.py.
try:
    from .. import _C  # noqa: F401
except ImportError:
    _C = None
if _C is not None:
    from . import cuda_backend
    backends.register(cuda_backend)

__all__ = ["schema", "backends", "reference", "MASK_TENSOR_NAMES", "MaskTensors"]
