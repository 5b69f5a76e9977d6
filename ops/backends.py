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
Before any of that, `check_attention_args` / `check_attention_backward_args` check the
op's inputs (mask_checks.py, and the named backend's not_supported_reasons); the fake
kernels run the same checks (schema.FAKE_CHECKS).
"""
import torch

from . import kernel_options, mask_checks
from .reference import complete_mask
from .schema import EAGER_KERNELS, FAKE_CHECKS, MASK_TENSOR_NAMES, MaskTensors

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
    if (cuda is not None
            and not cuda.call_not_supported_reasons(query, key, value, bias, mask, *block_size,
                                                    needs_grad, deterministic)
            and cuda.preferred_for(query, key, value, bias, mask, needs_grad, deterministic)):
        return "cuda"
    for name in _AUTO_ORDER:
        if name in _REGISTRY and not _REGISTRY[name].not_supported_reasons(query, key, value, bias, mask):
            return name
    raise ValueError("backend: no backend supports these inputs")  # unreachable: reference takes all


def call_not_supported_reasons(name, query, key, value, bias, mask: MaskTensors, block_q,
                               block_k, needs_grad, deterministic) -> list:
    """Why backend `name` cannot run this call (empty: it can): its not_supported_reasons;
    for "cuda" also its block sizes, and its backward when gradients are wanted
    (cuda_backend.call_not_supported_reasons)."""
    module = get(name)
    if name == "cuda":
        return module.call_not_supported_reasons(query, key, value, bias, mask, block_q, block_k,
                                                 needs_grad, deterministic)
    return module.not_supported_reasons(query, key, value, bias, mask)


def _check_backend(name, query, key, value, bias, mask: MaskTensors, block_q, block_k,
                   deterministic, backward=False):
    """A concrete backend name: registered, and able to run these inputs (the backward
    too when this is the backward op). The Python API reports the same reasons before
    calling the op."""
    reasons = call_not_supported_reasons(name, query, key, value, bias, mask, block_q, block_k,
                                         backward, deterministic)
    if reasons:
        raise ValueError(f"backend: {name!r} cannot run these inputs: {'; '.join(reasons)}")


def check_attention_args(query, key, value, bias, *rest):
    """The forward op's arguments, checked before any kernel runs (docs/design.md, "The
    raw op's contract"); shapes, dtypes and devices only, so the fake kernel runs it too.
    Returns (mask, backend name, kernel options)."""
    mask = MaskTensors(*rest[:_N_MASK])
    block_q, block_k, _, _, backend, deterministic = rest[_N_MASK:]
    name, options = kernel_options.decode(backend)
    mask_checks.check_inputs(query, key, value, bias, mask, block_q, block_k)
    if name != "auto":
        _check_backend(name, query, key, value, bias, mask, block_q, block_k, deterministic)
    return mask, name, options


def check_attention_backward_args(grad_out, grad_lse, query, key, value, out, lse, bias, *rest):
    """check_attention_args for the backward op, and its own tensors' shapes."""
    mask = MaskTensors(*rest[:_N_MASK])
    block_q, block_k, _, _, backend, deterministic, _ = rest[_N_MASK:]
    name, options = kernel_options.decode(backend)
    mask_checks.check_inputs(query, key, value, bias, mask, block_q, block_k)
    mask_checks.check_backward(grad_out, grad_lse, query, value, out, lse)
    if name != "auto":
        _check_backend(name, query, key, value, bias, mask, block_q, block_k, deterministic,
                       backward=True)
    return mask, name, options


def _check_cuda_op_args(query, key, value, bias, *rest):
    """The CUDA backend's own ops (no backend argument): the mask checks, in their fakes
    (their C++ kernels check the rest)."""
    mask_checks.check_inputs(query, key, value, bias, MaskTensors(*rest[:_N_MASK]),
                             rest[_N_MASK], rest[_N_MASK + 1])


def _check_cuda_op_backward_args(grad_out, grad_lse, query, key, value, out, lse, bias, *rest):
    _check_cuda_op_args(query, key, value, bias, *rest)
    mask_checks.check_backward(grad_out, grad_lse, query, value, out, lse)


def _resolve(backend, query, key, value, bias, mask, block_q, block_k, deterministic):
    # The raw op resolves "auto" as if gradients were wanted, so that its forward and
    # backward always agree.
    if backend != "auto":
        return backend
    return choose(query, key, value, bias, mask, True, (block_q, block_k), deterministic)


def _attention_impl(query, key, value, bias, *rest):
    mask, backend, options = check_attention_args(query, key, value, bias, *rest)
    block_q, block_k, scale, softcap, _, deterministic = rest[_N_MASK:]
    mask = complete_mask(mask, query.shape[2], key.shape[2], block_q, block_k, query.device)
    backend = _resolve(backend, query, key, value, bias, mask, block_q, block_k, deterministic)
    return get(backend).forward(query, key, value, bias, mask, block_q, block_k, scale, softcap,
                                deterministic, options)


def _attention_backward_impl(grad_out, grad_lse, query, key, value, out, lse, bias, *rest):
    mask, backend, options = check_attention_backward_args(
        grad_out, grad_lse, query, key, value, out, lse, bias, *rest)
    block_q, block_k, scale, softcap, _, deterministic, bias_requires_grad = rest[_N_MASK:]
    mask = complete_mask(mask, query.shape[2], key.shape[2], block_q, block_k, query.device)
    backend = _resolve(backend, query, key, value, bias, mask, block_q, block_k, deterministic)
    return get(backend).backward(grad_out, grad_lse, query, key, value, out, lse, bias, mask,
                                 block_q, block_k, scale, softcap, deterministic, bias_requires_grad,
                                 options)


for _name, _kernel in (("attention", _attention_impl),
                      ("attention_backward", _attention_backward_impl)):
    torch.library.impl(f"flexsparse::{_name}", ("CPU", "CUDA"))(_kernel)
    EAGER_KERNELS[getattr(torch.ops.flexsparse, _name)] = _kernel

# The fake kernels (schema.py) run the same checks while torch.compile traces.
FAKE_CHECKS.update({
    "attention": check_attention_args,
    "attention_backward": check_attention_backward_args,
    "cuda_attention": _check_cuda_op_args,
    "cuda_attention_backward": _check_cuda_op_backward_args,
})
