"""Backend registry and the op implementations that dispatch to it.

Each backend is a module with
    NAME: str
    not_supported_reasons(query, key, value, bias, mask) -> list[str]   (empty = supported)
    forward(query, key, value, bias, mask, block_q, block_k, scale, softcap, deterministic,
            options) -> (out, lse)
    backward(grad_out, grad_lse, query, key, value, out, lse, bias, mask, block_q, block_k,
             scale, softcap, deterministic, bias_requires_grad, options) -> (dq, dk, dv, dbias)
where `mask` is a `schema.MaskTensors` and `options` a `kernel_options.KernelOptions`
(backends ignore the options they have no use for). The op's CPU and CUDA kernels both
route here by the op's `backend` argument, which carries the options too
(`kernel_options.decode`); "auto" is resolved by `choose` before the op is called.
"""
import torch

from . import kernel_options
from .reference import LIST_NAMES, complete_mask
from .schema import EAGER_KERNELS, MASK_TENSOR_NAMES, MaskTensors

_N_MASK = len(MASK_TENSOR_NAMES)
_REGISTRY = {}
# Preference order for "auto": fastest first. "cuda" is chosen only by name until its
# backward runs and a measured table says where it wins.
_AUTO_ORDER = ("triton", "reference")
_ALL = ("cuda", "triton", "reference")


def register(module) -> None:
    _REGISTRY[module.NAME] = module


def available() -> list:
    return [name for name in _ALL if name in _REGISTRY]


def get(name: str):
    if name not in _REGISTRY:
        raise ValueError(f"backend: unknown or unavailable backend {name!r}; available: {available()}")
    return _REGISTRY[name]


def not_supported_reasons(name, query, key, value, bias, mask: MaskTensors) -> list:
    return get(name).not_supported_reasons(query, key, value, bias, mask)


def choose(query, key, value, bias, mask: MaskTensors, needs_grad: bool = True,
           block_size=(128, 128), deterministic: bool = False) -> str:
    """The first backend in preference order that supports these inputs; "cuda" only where
    its table of measurements says it wins (cuda_backend.preferred_for).

    CPU tensors always get the reference: the Triton interpreter runs on CPU for
    tests, but only when asked for by name.
    """
    if query.device.type == "cpu":
        return "reference"
    cuda = _REGISTRY.get("cuda")
    if (cuda is not None and not cuda.not_supported_reasons(query, key, value, bias, mask)
            and not cuda.check_block_size(*block_size, query.shape[-1])
            and cuda.preferred_for(query, key, value, bias, mask, needs_grad, block_size,
                                   deterministic)):
        return "cuda"
    for name in _AUTO_ORDER:
        if name in _REGISTRY and not _REGISTRY[name].not_supported_reasons(query, key, value, bias, mask):
            return name
    raise ValueError("backend: no backend supports these inputs")  # unreachable: reference takes all


def _check_op_mask(mask: MaskTensors, block_q, block_k):
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"block_q, block_k: must be positive, got ({block_q}, {block_k})")
    for name in LIST_NAMES + ("col_ranges", "partial_bits_index", "partial_bits",
                               "attn_indices"):
        t = getattr(mask, name)
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32,
                                                                                 torch.int64)):
            raise TypeError(f"{name}: must be an int32 or int64 tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
    if mask.dense_mask is not None and mask.dense_mask.dtype != torch.bool:
        raise TypeError(f"dense_mask: must be a bool tensor, got {mask.dense_mask.dtype}")


def _resolve(backend, query, key, value, bias, mask, block_q, block_k, deterministic):
    # The raw op resolves "auto" as if gradients were wanted, so that its forward and
    # backward always agree.
    if backend != "auto":
        return backend
    return choose(query, key, value, bias, mask, True, (block_q, block_k), deterministic)


def _attention_impl(query, key, value, bias, *rest):
    mask = MaskTensors(*rest[:_N_MASK])
    block_q, block_k, scale, softcap, backend, deterministic = rest[_N_MASK:]
    backend, options = kernel_options.decode(backend)
    _check_op_mask(mask, block_q, block_k)
    mask = complete_mask(mask, query.shape[2], key.shape[2], block_q, block_k, query.device)
    backend = _resolve(backend, query, key, value, bias, mask, block_q, block_k, deterministic)
    return get(backend).forward(query, key, value, bias, mask, block_q, block_k, scale, softcap,
                                deterministic, options)


def _attention_backward_impl(grad_out, grad_lse, query, key, value, out, lse, bias, *rest):
    mask = MaskTensors(*rest[:_N_MASK])
    block_q, block_k, scale, softcap, backend, deterministic, bias_requires_grad = rest[_N_MASK:]
    backend, options = kernel_options.decode(backend)
    _check_op_mask(mask, block_q, block_k)
    mask = complete_mask(mask, query.shape[2], key.shape[2], block_q, block_k, query.device)
    backend = _resolve(backend, query, key, value, bias, mask, block_q, block_k, deterministic)
    return get(backend).backward(grad_out, grad_lse, query, key, value, out, lse, bias, mask,
                                 block_q, block_k, scale, softcap, deterministic, bias_requires_grad,
                                 options)


for _name, _kernel in (("attention", _attention_impl),
                      ("attention_backward", _attention_backward_impl)):
    torch.library.impl(f"flexsparse::{_name}", ("CPU", "CUDA"))(_kernel)
    EAGER_KERNELS[getattr(torch.ops.flexsparse, _name)] = _kernel
