"""The Triton backend: block-descriptor masks here (kernels in `triton_block.py`), index
masks (`attn_indices`) in `triton_indices.py`, imported lazily.

Runs on CUDA tensors; on CPU tensors only under TRITON_INTERPRET=1 (tests), where
"auto" never picks it (not_supported_reasons reports CPU tensors) but an explicit
backend="triton" call runs.
"""
from . import triton_block
from .kernel_options import DEFAULT

NAME = "triton"


def _indices():
    from . import triton_indices
    return triton_indices


def not_supported_reasons(query, key, value, bias, mask) -> list:
    if mask.attn_indices is not None:
        try:
            mod = _indices()
        except ImportError as e:
            return [f"triton: index masks need ops/triton_indices.py ({e})"]
        return mod.not_supported_reasons(query, key, value, bias, mask)
    return triton_block.not_supported_reasons(query, key, value, bias, mask)


def forward(query, key, value, bias, mask, block_q, block_k, scale, softcap, deterministic,
            options=DEFAULT):
    if mask.attn_indices is not None:
        return _indices().forward(query, key, value, bias, mask, scale, softcap, options)
    return triton_block.forward(query, key, value, bias, mask, block_q, block_k, scale, softcap,
                                deterministic, options)


def backward(grad_out, grad_lse, query, key, value, out, lse, bias, mask, block_q, block_k,
             scale, softcap, deterministic, bias_requires_grad, options=DEFAULT):
    if mask.attn_indices is not None:
        return _indices().backward(grad_out, grad_lse, query, key, value, out, lse, bias, mask,
                                   scale, softcap, deterministic, bias_requires_grad, options)
    return triton_block.backward(grad_out, grad_lse, query, key, value, out, lse, bias, mask,
                                 block_q, block_k, scale, softcap, deterministic,
                                 bias_requires_grad, options)
