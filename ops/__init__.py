"""flexsparse.ops: op schemas, fake kernels, autograd, and the backends behind them.

Installed as `flexsparse.ops` (setuptools package_dir); never import it as a top-level
`ops` module, which would register the schemas twice.
"""
import importlib.util

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
