"""The op schemas, defined once. See docs/design.md for what every argument means.

`attention` returns (out, lse); `attention_backward` returns (dq, dk, dv, dbias). Both
dispatch on their `backend` argument to a module registered in `backends.py`; the
Python API resolves "auto" before calling, and the op resolves it itself when called
directly (backends._resolve).
"""
from typing import NamedTuple, Optional

import torch
import torch.autograd.forward_ad as _forward_ad

# The 14 optional tensors that describe a mask to the op, in schema order.
MASK_TENSOR_NAMES = (
    "kv_count", "kv_index", "kv_full_count", "kv_full_index",
    "q_count", "q_index", "q_full_count", "q_full_index",
    "dense_mask", "col_ranges", "partial_bits_index", "partial_bits",
    "attn_indices", "window",
)


class MaskTensors(NamedTuple):
    """The mask as the op sees it: plain tensors, no mask classes."""
    kv_count: Optional[torch.Tensor] = None
    kv_index: Optional[torch.Tensor] = None
    kv_full_count: Optional[torch.Tensor] = None
    kv_full_index: Optional[torch.Tensor] = None
    q_count: Optional[torch.Tensor] = None
    q_index: Optional[torch.Tensor] = None
    q_full_count: Optional[torch.Tensor] = None
    q_full_index: Optional[torch.Tensor] = None
    dense_mask: Optional[torch.Tensor] = None
    col_ranges: Optional[torch.Tensor] = None
    partial_bits_index: Optional[torch.Tensor] = None
    partial_bits: Optional[torch.Tensor] = None
    attn_indices: Optional[torch.Tensor] = None
    window: Optional[torch.Tensor] = None


assert MaskTensors._fields == MASK_TENSOR_NAMES

# `window` holds bounds below this (a larger one reaches past any sequence; the kernels add
# Lq - Lk + 1 to them in int32): masks.sliding_window clamps to it, FLEXSPARSE_DEBUG checks it.
WINDOW_LIMIT = 1 << 29

# Range-form block lists: index (Bd, Hd, n, MAX_RANGES, 2) of half-open block ranges
# [lo, hi) instead of explicit indices (docs/design.md). Builders always emit this many
# ranges per row (unused ones empty), so shapes depend on the lengths only.
MAX_RANGES = 4

_MASK_ARGS = ", ".join(f"Tensor? {name}" for name in MASK_TENSOR_NAMES)
_TAIL_ARGS = "int block_q, int block_k, float scale, float softcap, str backend, bool deterministic"

torch.library.define(
    "flexsparse::attention",
    f"(Tensor query, Tensor key, Tensor value, Tensor? bias, {_MASK_ARGS}, {_TAIL_ARGS})"
    " -> (Tensor out, Tensor lse)",
)
torch.library.define(
    "flexsparse::attention_backward",
    f"(Tensor grad_out, Tensor? grad_lse, Tensor query, Tensor key, Tensor value, Tensor out,"
    f" Tensor lse, Tensor? bias, {_MASK_ARGS}, {_TAIL_ARGS}, bool bias_requires_grad)"
    " -> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias)",
)


# The CUDA backend's ops: the same schemas without the backend name; their CUDA kernels
# come from C++ (csrc/attention_ops.cpp), their fakes are the ones below.
_BACKEND_TAIL = "int block_q, int block_k, float scale, float softcap, bool deterministic"
torch.library.define(
    "flexsparse::cuda_attention",
    f"(Tensor query, Tensor key, Tensor value, Tensor? bias, {_MASK_ARGS}, {_BACKEND_TAIL})"
    " -> (Tensor out, Tensor lse)",
)
torch.library.define(
    "flexsparse::cuda_attention_backward",
    f"(Tensor grad_out, Tensor? grad_lse, Tensor query, Tensor key, Tensor value, Tensor out,"
    f" Tensor lse, Tensor? bias, {_MASK_ARGS}, {_BACKEND_TAIL}, bool bias_requires_grad)"
    " -> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias)",
)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- mask-build ops (issue 16): a per-step mask's descriptor in one call
#
# Kernels: csrc/build_ops.h (CPU loops and CUDA launches, csrc/build_masks.cu), when
# flexsparse._C is built; flexsparse/build_op.py calls them. Outputs: col_ranges
# (Bl, 1, Lk, 2m) and the eight range-form block lists (counts (Bl, 1, n), indices
# (Bl, 1, n, MAX_RANGES, 2)), all int32, in BlockDescriptor order; every size follows
# from the arguments' shapes (no data-dependent size, so no host sync and no guard on data).
BUILD_OUTPUTS = ("col_ranges",) + MASK_TENSOR_NAMES[:8]
_BUILD_RETURNS = "(" + ", ".join(f"Tensor {n}" for n in BUILD_OUTPUTS) + ")"
torch.library.define(
    "flexsparse::build_document",
    f"(Tensor lengths, SymInt L, int block_q, int block_k, bool causal) -> {_BUILD_RETURNS}")
# lengths: (n,) or (B, n); prefix_len: (B,)
torch.library.define(
    "flexsparse::build_prefix_lm",
    f"(Tensor prefix_len, SymInt Lq, SymInt Lk, int block_q, int block_k) -> {_BUILD_RETURNS}")
# FlashMask column ranges (B|1, H|1, Lk, C): the static build's padded lists instead of
# ranges (index (B|1, H|1, n, N)), as user data need not be range-shaped
torch.library.define(
    "flexsparse::build_column_ranges",
    f"(Tensor startend_row_indices, SymInt Lq, SymInt Lk, int block_q, int block_k, bool causal)"
    f" -> {_BUILD_RETURNS}")


def _build_fake_outputs(data, Bl, Lq, Lk, block_q, block_k, m, Hl=1, padded=False):
    nQB = (Lq + block_q - 1) // block_q
    nKB = (Lk + block_k - 1) // block_k
    opts = dict(dtype=torch.int32, device=data.device)
    out = [data.new_empty((Bl, Hl, Lk, 2 * m), **opts)]
    for n, N in ((nQB, nKB), (nQB, nKB), (nKB, nQB), (nKB, nQB)):   # kv, kv full, q, q full
        out += [data.new_empty((Bl, Hl, n), **opts),
                data.new_empty((Bl, Hl, n, N) if padded else (Bl, Hl, n, MAX_RANGES, 2), **opts)]
    return tuple(out)


@torch.library.register_fake("flexsparse::build_document")
def _build_document_fake(lengths, L, block_q, block_k, causal):
    if lengths.dim() not in (1, 2):
        raise ValueError(f"flexsparse build: lengths must be (n,) or (B, n), got "
                         f"{tuple(lengths.shape)}")
    Bl = lengths.shape[0] if lengths.dim() == 2 else 1
    return _build_fake_outputs(lengths, Bl, L, L, block_q, block_k, 2)


@torch.library.register_fake("flexsparse::build_prefix_lm")
def _build_prefix_lm_fake(prefix_len, Lq, Lk, block_q, block_k):
    if prefix_len.dim() != 1:
        raise ValueError(f"flexsparse build: prefix_len must be (B,), got "
                         f"{tuple(prefix_len.shape)}")
    return _build_fake_outputs(prefix_len, prefix_len.shape[0], Lq, Lk, block_q, block_k, 1)


@torch.library.register_fake("flexsparse::build_column_ranges")
def _build_column_ranges_fake(startend, Lq, Lk, block_q, block_k, causal):
    if startend.dim() != 4:
        raise ValueError(f"flexsparse build: startend_row_indices must be (B, H, Lk, C), got "
                         f"{tuple(startend.shape)}")
    Bc, Hc, _, C = startend.shape
    m = 3 if (C == 4 and causal) else 2
    return _build_fake_outputs(startend, Bc, Lq, Lk, block_q, block_k, m, Hl=Hc, padded=True)


# The eight padded lists (MASK_TENSOR_NAMES[:8]) of a block grid (B|1, H|1, nQB, nKB), as
# descriptor._block_lists gives them: a bool layout (masks.block_sparse at the call's block
# size: True = FULL) or int32 block states (SKIP / PARTIAL / FULL)
torch.library.define(
    "flexsparse::build_block_lists",
    "(Tensor layout) -> (" + ", ".join(f"Tensor {n}" for n in MASK_TENSOR_NAMES[:8]) + ")")


@torch.library.register_fake("flexsparse::build_block_lists")
def _build_block_lists_fake(layout):
    if layout.dim() != 4 or layout.dtype not in (torch.bool, torch.int32):
        raise ValueError(f"flexsparse build: layout must be a 4-D bool or int32 tensor, got "
                         f"{layout.dtype} {tuple(layout.shape)}")
    Bd, Hd, nQB, nKB = layout.shape
    out = []
    for kind, (n, N) in enumerate(((nQB, nKB), (nQB, nKB), (nKB, nQB), (nKB, nQB))):
        # a layout's partial lists (all empty): one row per (b, h), expanded over the rows,
        # as the kernels store them (csrc/build_masks.h, partial_one_row)
        one_row = layout.dtype == torch.bool and kind % 2 == 0
        rows = 1 if one_row else n
        count = layout.new_empty((Bd, Hd, rows), dtype=torch.int32)
        index = layout.new_empty((Bd, Hd, rows, N), dtype=torch.int32)
        if one_row:
            count, index = count.expand(Bd, Hd, n), index.expand(Bd, Hd, n, N)
        out += [count, index]
    return tuple(out)


# ---- top-k positions per score row (issue 17): CUDA kernel in csrc/topk.cu when
# flexsparse._C is built; flexsparse/topk.py calls it for bf16 / fp16 / fp32 scores.
torch.library.define(
    "flexsparse::topk_rows",
    "(Tensor scores, int k, bool causal, int row0, int num_queries, int warps_per_row=0) -> Tensor")


@torch.library.register_fake("flexsparse::topk_rows")
def _topk_rows_fake(scores, k, causal, row0, num_queries, warps_per_row=0):
    if scores.dim() < 2:
        raise ValueError(f"flexsparse topk_rows: scores must be (..., rows, Lk), got {tuple(scores.shape)}")
    return scores.new_empty(tuple(scores.shape[:-1]) + (k,), dtype=torch.int32)


# Input checks the fake kernels run before they make outputs, keyed by op name: the same
# checks as the ops' kernels (mask_checks.py: shapes, dtypes, devices, scale and softcap;
# the backend's support). For `attention` and `attention_backward` a refusal is left to
# the kernel, which runs when the compiled graph runs, so that the caller gets the
# ValueError/TypeError itself (backends._at_run_time); the CUDA ops refuse while tracing.
# backends.py fills this; they need the backend registry, which sits above this module.
FAKE_CHECKS = {}


def _fake_check(op_name, *args):
    check = FAKE_CHECKS.get(op_name)
    if check is not None:
        check(*args)


def _fake_outputs(query, value):
    B, Hq, Lq, _ = query.shape
    Dv = value.shape[-1]
    out = query.new_empty((B, Hq, Lq, Dv))
    lse = query.new_empty((B, Hq, Lq), dtype=lse_dtype(query.dtype))
    return out, lse


@torch.library.register_fake("flexsparse::attention")
def _attention_fake(query, key, value, bias, *args):
    _fake_check("attention", query, key, value, bias, *args)
    return _fake_outputs(query, value)


@torch.library.register_fake("flexsparse::cuda_attention")
def _cuda_attention_fake(query, key, value, bias, *args):
    _fake_check("cuda_attention", query, key, value, bias, *args)
    return _fake_outputs(query, value)


@torch.library.register_fake("flexsparse::attention_backward")
def _attention_backward_fake(grad_out, grad_lse, query, key, value, out, lse, bias, *args):
    _fake_check("attention_backward", grad_out, grad_lse, query, key, value, out, lse, bias,
                *args)
    return _backward_fake_outputs(query, key, value, bias, args[-1])


@torch.library.register_fake("flexsparse::cuda_attention_backward")
def _cuda_attention_backward_fake(grad_out, grad_lse, query, key, value, out, lse, bias, *args):
    _fake_check("cuda_attention_backward", grad_out, grad_lse, query, key, value, out, lse,
                bias, *args)
    return _backward_fake_outputs(query, key, value, bias, args[-1])


def _backward_fake_outputs(query, key, value, bias, bias_requires_grad):
    dbias = bias.new_empty(bias.shape) if (bias is not None and bias_requires_grad) else query.new_empty((0,))
    return (query.new_empty(query.shape), key.new_empty(key.shape),
            value.new_empty(value.shape), dbias)


# ---- autograd: forward saves its inputs, backward calls the backward op ----

def _setup_context(ctx, inputs, output):
    query, key, value, bias = inputs[:4]
    mask = inputs[4:4 + len(MASK_TENSOR_NAMES)]
    ctx.tail = inputs[4 + len(MASK_TENSOR_NAMES):]
    ctx.eager = False           # _EagerAttention sets True
    ctx.index_mode = mask[MASK_TENSOR_NAMES.index("attn_indices")] is not None
    ctx.device_key = "CUDA" if query.is_cuda else "CPU"   # (_cuda_backward's kernel check)
    out, lse = output
    ctx.n_mask = len(mask)
    ctx.save_for_backward(query, key, value, out, lse, bias, *mask)


def _backward(ctx, grad_out, grad_lse, backward_op=None):
    """backward_op: the backward op of the forward op being differentiated (default
    flexsparse::attention_backward)."""
    query, key, value, out, lse, bias, *mask = ctx.saved_tensors
    if grad_out is None:        # only lse was used (grads are not materialized, see below)
        grad_out = torch.zeros_like(out)
    bias_requires_grad = bias is not None and ctx.needs_input_grad[3]
    args = (grad_out, grad_lse, query, key, value, out, lse, bias, *mask, *ctx.tail,
            bias_requires_grad)
    if backward_op is not None:
        dq, dk, dv, dbias = backward_op(*args)
    elif ctx.eager:
        dq, dk, dv, dbias = _below_autograd(torch.ops.flexsparse.attention_backward, args)
    else:
        dq, dk, dv, dbias = torch.ops.flexsparse.attention_backward(*args)
    n_rest = len(MASK_TENSOR_NAMES) + len(ctx.tail)
    return (dq, dk, dv, dbias if bias_requires_grad else None) + (None,) * n_rest


torch.library.register_autograd("flexsparse::attention", _backward, setup_context=_setup_context)


def _cuda_index_backward(*args):
    """The backward of the CUDA op for index masks: the generic backward op with backend
    "cuda", where cuda_backend.backward picks the kernel (index_backward_kernel: the Triton
    index kernels by default, csrc/index_bwd.cu when chosen). args: the CUDA backward op's,
    whose tail has no backend name."""
    *head, deterministic, bias_requires_grad = args
    return torch.ops.flexsparse.attention_backward(*head, "cuda", deterministic,
                                                   bias_requires_grad)


# The CUDA backend's op: the same saved tensors, its own backward op (C++ kernels too,
# registered only once they exist; index masks: see _cuda_index_backward).
def _cuda_backward(ctx, grad_out, grad_lse):
    if ctx.index_mode:
        return _backward(ctx, grad_out, grad_lse, _cuda_index_backward)
    if not _has_cuda_backward_kernel(ctx.device_key):
        raise NotImplementedError(
            "backend='cuda': this build of flexsparse._C has forward kernels only (no "
            "csrc/bwd_sm90.cu yet); use backend='triton' or 'auto' for training")
    return _backward(ctx, grad_out, grad_lse, torch.ops.flexsparse.cuda_attention_backward)


_CUDA_BACKWARD_REGISTERED = []    # [True] once the CUDA key was found to have the kernel


def _has_cuda_backward_kernel(device_key: str) -> bool:
    """Whether flexsparse::cuda_attention_backward has a kernel for the key ("CUDA" or
    "CPU"). The dispatcher's answer costs ~8 µs of host time per backward; for the CUDA key
    (registered when flexsparse._C loads, never taken back) a True is kept. Tests register
    and remove CPU kernels, so the CPU key is asked every time."""
    if device_key == "CUDA" and _CUDA_BACKWARD_REGISTERED:
        return True
    found = torch._C._dispatch_has_kernel_for_dispatch_key("flexsparse::cuda_attention_backward", device_key)
    if found and device_key == "CUDA":
        _CUDA_BACKWARD_REGISTERED.append(True)
    return found


torch.library.register_autograd("flexsparse::cuda_attention", _cuda_backward,
                                setup_context=_setup_context)


def _eager_function(name, forward_call, backward_fn, doc):
    """An autograd.Function with the registered autograd's context (_setup_context) for
    eager calls: forward_call(args) runs the op below autograd, backward_fn(ctx, grad_out,
    grad_lse) is the registered backward. An unused lse gets grad None, not a zero tensor
    (saves a fill and the kernels' grad_lse reads); _backward fills a missing grad_out."""

    def forward(ctx, *args):
        ctx.set_materialize_grads(False)
        output = forward_call(args)
        _setup_context(ctx, args, output)
        ctx.eager = True
        return output

    return type(name, (torch.autograd.Function,), dict(
        __doc__=doc, forward=staticmethod(forward), backward=staticmethod(backward_fn)))


# register_autograd's wrapper refills the schema defaults on every call with grad
# (torch/_library/utils.py fill_defaults reads the 23-argument schema's argument list once
# per argument): about 0.35 ms of host time per call on the H100 machine, longer than many
# of our kernels. Inside these Functions grad mode is off, so the op takes its no-grad path.
_EagerAttention = _eager_function(
    "_EagerAttention", lambda args: _below_autograd(torch.ops.flexsparse.attention, args),
    _backward, "flexsparse::attention with autograd, for eager calls from flexsparse.attention.")


# The Python kernels of the ops (backends.py fills this when it registers them), for eager
# calls that nothing observes at the dispatcher level: see _below_autograd.
EAGER_KERNELS = {}


def _nothing_observes_dispatch(args) -> bool:
    """No dispatch or function mode, no profiler, no tensor subclass among the inputs (fake
    tensors, functorch wrappers): then the dispatcher would only box and unbox the arguments."""
    if (torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled()
            or torch.autograd.profiler._is_profiler_enabled):
        return False
    return all(type(a) is torch.Tensor for a in args if isinstance(a, torch.Tensor))


def _below_autograd(op, args):
    """op(*args) for eager callers that have already handled autograd: straight to the op's
    Python kernel when nothing observes the dispatcher (the dispatcher's boxing of ~25
    arguments costs ~25 us of host time per call), else through the dispatcher below the
    Autograd key (register_autograd's wrapper there would only find that no graph is
    needed, another ~20 us)."""
    kernel = EAGER_KERNELS.get(op)
    if kernel is not None and _nothing_observes_dispatch(args):
        return kernel(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def _needs_grad(args) -> bool:
    """Grad mode on and one of query, key, value and bias (the ops' first four arguments)
    requiring grad: otherwise an eager call needs no autograd node. Inside a forward-mode
    AD level (torch.autograd.forward_ad.dual_level) always True: the Function then
    refuses dual inputs (it has no jvp) where the kernels below autograd would drop their
    tangents silently."""
    if getattr(_forward_ad, "_current_level", -1) >= 0:
        return True
    return torch.is_grad_enabled() and any(a is not None and a.requires_grad for a in args[:4])


def attention_with_grad(*args):
    """torch.ops.flexsparse.attention(*args) with autograd: the registered op itself when
    compiling (what torch.compile sees), the eager Function above where an input needs
    grad, else the op below autograd (an inference call with grad mode on, as in most
    benchmarks, would otherwise pay the Function's ~15-60 µs: perf-notes C124)."""
    if torch.compiler.is_compiling():
        return torch.ops.flexsparse.attention(*args)
    if not _needs_grad(args):
        return _below_autograd(torch.ops.flexsparse.attention, args)
    return _EagerAttention.apply(*args)


def _cuda_attention_below_autograd(args):
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.flexsparse.cuda_attention(*args)


# The CUDA op's C++ kernel through the dispatcher below the Autograd key. Its fill_defaults
# (22 arguments): ~95 us per call on CI's CPU; cProfile on the H100 machine put 0.4 ms of
# an eager fwd+bwd step in it, its own overhead included (docs/perf-notes.md C57). An
# unused lse's grad None also spares the C++ backward its conversion of a zero grad_lse.
_EagerCudaAttention = _eager_function(
    "_EagerCudaAttention", _cuda_attention_below_autograd, _cuda_backward,
    "flexsparse::cuda_attention with autograd, for eager calls from flexsparse.attention.")


def cuda_attention_with_grad(*args):
    """torch.ops.flexsparse.cuda_attention(*args) with autograd: the registered op when
    compiling, the eager Function above where an input needs grad, else the op below
    autograd (its C++ kernel without the autograd wrapper's fill_defaults)."""
    if torch.compiler.is_compiling():
        return torch.ops.flexsparse.cuda_attention(*args)
    if not _needs_grad(args):
        return _cuda_attention_below_autograd(args)
    return _EagerCudaAttention.apply(*args)
