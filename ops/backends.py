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
kernels run the same checks (schema.FAKE_CHECKS) but leave a refusal to the kernel, so
that compiled code raises the same ValueError/TypeError when the graph runs
(`_at_run_time`).
"""
import torch
from torch._subclasses.fake_tensor import FakeTensor

from . import kernel_options, mask_checks
from .visibility import complete_mask
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


def block_size_reasons(name, query, mask: MaskTensors, block_q, block_k) -> list:
    """Why a Python backend cannot run a descriptor of this block size (empty: it can; the
    CUDA backend's own check is part of cuda_backend.call_not_supported_reasons).
    The Triton block kernels tile a block with powers of two >= 16 (triton_block.py,
    _pow2_divisor raised NotImplementedError at launch); index masks have no blocks."""
    if name == "triton" and mask.attn_indices is None and (block_q % 16 or block_k % 16):
        return [f"triton: descriptor block size ({mask_checks.shown_size(block_q)}, "
                f"{mask_checks.shown_size(block_k)}): the block kernels need multiples of 16"]
    return []


def choose(query, key, value, bias, mask: MaskTensors, needs_grad: bool = True,
           block_size=(128, 128), deterministic: bool = False, softcap: bool = False) -> str:
    """The first backend in preference order that supports these inputs; "cuda" only where
    its table of measurements says it wins (cuda_backend.preferred_for).

    CPU tensors always get the reference: the Triton interpreter runs on CPU for
    tests, but only when asked for by name.
    """
    if query.device.type == "cpu":
        return "reference"

    def runs(name):
        return name in _REGISTRY and not call_not_supported_reasons(
            name, query, key, value, bias, mask, *block_size, needs_grad, deterministic)

    if runs("cuda") and _REGISTRY["cuda"].preferred_for(query, key, value, bias, mask,
                                                         needs_grad, deterministic, softcap):
        return "cuda"
    for name in _AUTO_ORDER:
        if runs(name):
            return name
    raise ValueError("backend: no backend supports these inputs")  # unreachable: reference takes all


def call_not_supported_reasons(name, query, key, value, bias, mask: MaskTensors, block_q,
                               block_k, needs_grad, deterministic) -> list:
    """Why backend `name` cannot run this call (empty: it can): its not_supported_reasons
    and block sizes (block_size_reasons); for "cuda" its own check of both and of its
    backward when gradients are wanted (cuda_backend.call_not_supported_reasons)."""
    module = get(name)
    if name == "cuda":
        return module.call_not_supported_reasons(query, key, value, bias, mask, block_q, block_k,
                                                 needs_grad, deterministic)
    return (module.not_supported_reasons(query, key, value, bias, mask)
            or block_size_reasons(name, query, mask, block_q, block_k))


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
    block_q, block_k, scale, softcap, backend, deterministic = rest[_N_MASK:]
    name, options = kernel_options.decode(backend)
    mask_checks.check_inputs(query, key, value, bias, mask, block_q, block_k)
    mask_checks.check_scalars(scale, softcap)
    if name != "auto":
        _check_backend(name, query, key, value, bias, mask, block_q, block_k, deterministic)
    return mask, name, options


def check_attention_backward_args(grad_out, grad_lse, query, key, value, out, lse, bias, *rest):
    """check_attention_args for the backward op, and its own tensors' shapes."""
    mask = MaskTensors(*rest[:_N_MASK])
    block_q, block_k, scale, softcap, backend, deterministic, _ = rest[_N_MASK:]
    name, options = kernel_options.decode(backend)
    mask_checks.check_inputs(query, key, value, bias, mask, block_q, block_k)
    mask_checks.check_scalars(scale, softcap)
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
    mask_checks.check_scalars(rest[_N_MASK + 2], rest[_N_MASK + 3])


def _at_run_time(check, n_before_query):
    """The fake-kernel check of an op whose kernel is Python (`attention`,
    `attention_backward`): that kernel runs the same check first whenever the graph runs,
    so a refusal is left to it. A compiled call then raises the check's own ValueError or
    TypeError, with the sizes of that call, as an eager call does; raised while tracing
    it would reach the caller as Dynamo's TorchRuntimeError. The comparisons the check
    made still guard the graph (a call that passes them does not reuse it). Refused here
    when the fake outputs cannot be shaped (query, key, value not 4-D tensors), and
    outside tracing (meta tensors: then this is the op's only kernel). The CUDA backend's
    ops keep refusing while tracing: their C++ kernels do not run these checks."""
    def fake_check(*args):
        try:
            check(*args)
        except (ValueError, TypeError):
            qkv = args[n_before_query:n_before_query + 3]
            if not (all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in qkv)
                    and isinstance(qkv[0], FakeTensor)):
                raise
    return fake_check


def _check_cuda_op_backward_args(grad_out, grad_lse, query, key, value, out, lse, bias, *rest):
    _check_cuda_op_args(query, key, value, bias, *rest)
    mask_checks.check_backward(grad_out, grad_lse, query, value, out, lse)


def _resolve(backend, query, key, value, bias, mask, block_q, block_k, deterministic, softcap):
    # The raw op resolves "auto" as if gradients were wanted, so that its forward and
    # backward always agree.
    if backend != "auto":
        return backend
    return choose(query, key, value, bias, mask, True, (block_q, block_k), deterministic,
                  softcap != 0.0)


def _check_data(mask, query, key, block_q, block_k):
    """FLEXSPARSE_DEBUG=1: the mask tensors' values too (a host sync; mask_checks.py)."""
    if mask_checks.debug_enabled():
        mask_checks.check_mask_data(mask, query.shape[2], key.shape[2], block_q, block_k)


def _attention_impl(query, key, value, bias, *rest):
    mask, backend, options = check_attention_args(query, key, value, bias, *rest)
    block_q, block_k, scale, softcap, _, deterministic = rest[_N_MASK:]
    _check_data(mask, query, key, block_q, block_k)
    mask = complete_mask(mask, query.shape[2], key.shape[2], block_q, block_k, query.device)
    backend = _resolve(backend, query, key, value, bias, mask, block_q, block_k, deterministic,
                       softcap)
    return get(backend).forward(query, key, value, bias, mask, block_q, block_k, scale, softcap,
                                deterministic, options)


def _attention_backward_impl(grad_out, grad_lse, query, key, value, out, lse, bias, *rest):
    mask, backend, options = check_attention_backward_args(
        grad_out, grad_lse, query, key, value, out, lse, bias, *rest)
    block_q, block_k, scale, softcap, _, deterministic, bias_requires_grad = rest[_N_MASK:]
    _check_data(mask, query, key, block_q, block_k)
    mask = complete_mask(mask, query.shape[2], key.shape[2], block_q, block_k, query.device)
    backend = _resolve(backend, query, key, value, bias, mask, block_q, block_k, deterministic,
                       softcap)
    return get(backend).backward(grad_out, grad_lse, query, key, value, out, lse, bias, mask,
                                 block_q, block_k, scale, softcap, deterministic, bias_requires_grad,
                                 options)


for _name, _kernel in (("attention", _attention_impl),
                      ("attention_backward", _attention_backward_impl)):
    torch.library.impl(f"flexsparse::{_name}", ("CPU", "CUDA"))(_kernel)
    EAGER_KERNELS[getattr(torch.ops.flexsparse, _name)] = _kernel

# The fake kernels (schema.py) run the same checks while torch.compile traces.
FAKE_CHECKS.update({
    "attention": _at_run_time(check_attention_args, 0),
    "attention_backward": _at_run_time(check_attention_backward_args, 2),
    "cuda_attention": _check_cuda_op_args,
    "cuda_attention_backward": _check_cuda_op_backward_args,
})
