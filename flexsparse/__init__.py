"""flexsparse: sparse and masked flash attention for PyTorch, forward and backward.

    import flexsparse
    out = flexsparse.attention(q, k, v, flexsparse.masks.causal(), bias=bias)
"""
from . import ops  # registers torch.ops.flexsparse.*
from . import masks
from .api import attention, compile_mask
from .descriptor import BlockDescriptor

__all__ = ["attention", "compile_mask", "masks", "BlockDescriptor", "ops"]
__version__ = "0.1.0"
