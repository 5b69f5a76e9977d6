"""The CUDA backend: the handwritten Hopper kernels of csrc/, built as `flexsparse._C`.

Its ops, `flexsparse::cuda_attention` and `flexsparse::cuda_attention_backward`, have their
schemas and fake kernels in Python (schema.py) and their CUDA kernels in C++
(csrc/attention_ops.cpp, TORCH_LIBRARY_IMPL for the CUDA key): a compiled graph calls
the C++ kernel through the dispatcher with no Python in between.

Index masks (attn_indices): the forward runs csrc/index_fwd.cu; their gradients come from
the Triton index kernels (ops/triton_indices.py, fp32 atomics) or from csrc/index_bwd.cu
(no float atomics): the latter with deterministic=True and where it measured faster
(index_backward_kernel below).
"""
import os

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import mask_checks, triton_indices

NAME = "cuda"
_HEAD_DIMS = (64, 128, 256)
_TILE_M = 128


def _tile_n(head_dim: int) -> int:
    return 64 if head_dim == 256 else 128


# Whether flexsparse._C registered the backward kernels (csrc/bwd_sm90.cu). This module is
# imported after flexsparse._C (ops/__init__.py), so the answer is known and fixed here;
# a plain bool also keeps the check traceable inside torch.compile.
_HAS_BACKWARD = torch._C._dispatch_has_kernel_for_dispatch_key(
    "flexsparse::cuda_attention_backward", "CUDA")


def has_backward() -> bool:
    return _HAS_BACKWARD


def not_supported_reasons(query, key, value, bias, mask) -> list:
    """Why the forward kernels cannot run these inputs (empty: they can)."""
    reasons = []
    if not query.is_cuda:
        return ["cuda: CUDA tensors only"]
    if torch.cuda.get_device_capability(query.device)[0] != 9:
        reasons.append("cuda: kernels are built for sm_90a (Hopper) only")
    if query.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"cuda: dtype {query.dtype} (float16 or bfloat16)")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        reasons.append("cuda: query, key and value must share a dtype")
    D = query.shape[-1]
    if D not in _HEAD_DIMS or value.shape[-1] != D:
        reasons.append(f"cuda: head dims (D={mask_checks.shown_size(D)}, "
                       f"Dv={mask_checks.shown_size(value.shape[-1])}): D = Dv in {_HEAD_DIMS}")
    if bias is not None and bias.dim() != 4:
        reasons.append("cuda: bias must be 4-D")
    if mask.attn_indices is not None:
        return reasons          # csrc/index_fwd.cu takes any lists the op's checks pass
    if any(t is None for t in (mask.kv_count, mask.kv_index, mask.kv_full_count,
                               mask.kv_full_index, mask.q_count, mask.q_index,
                               mask.q_full_count, mask.q_full_index)):
        reasons.append("cuda: needs all eight block lists of a descriptor")
    if mask.dense_mask is not None and mask.dense_mask.dim() != 4:
        reasons.append("cuda: dense_mask must be 4-D")
    return reasons


# Where "auto" picks this backend: head dims 64, 128 and 256, no dense mask, and with
# gradients also where the CUDA backward can run them (not deterministic); with a bias,
# see AUTO_BIAS_HEAD_DIMS below. Measured on the H100 in the same runs as the Triton kernels
# (docs/benchmarks.md, 2026-11-26, three runs): forward and backward ahead of Triton on
# every block-mask row, full, causal, prefix-LM, shared-question and block-sparse
# (1.2-1.4x) and the partial-heavy document and sliding-window rows (1.1-1.3x since the
# interval test and the backward's stores, C26 and C28), hd64 included (1.02-1.05x
# forward, 1.07-1.16x backward). Dense masks and partial bitmaps (converted mask_mods,
# overlapping index lists) are not measured against Triton, so they stay there. hd256
# (H200, 2026-11-26, full/causal 8K, document 16K, sliding 8K): forward 1.5-1.8x Triton
# (613 vs 343 TFLOP/s causal), backward 3.6-4.8x (395 vs 82).
# Partial-block shares beyond the measured rows' (up to about half the listed blocks:
# windows under 1024, many tiny documents) are not measured either; the rule extends to them.
AUTO_HEAD_DIMS = (64, 128, 256)
# With a bias (H200, 2026-11-27, 8K, B=2, H=16, bias (B, H, L, L), cuda_bench, both backends
# in one process; docs/benchmarks.md), where the bias-tile kernels run (keys contiguous,
# Lk % 8 == 0, no softcap: csrc's fwd_bias_tiles_ok / bias_tiles_call):
# - hd128 with its gradient: backward 1.23-1.34x Triton on causal, prefix-LM and full,
#   0.96-1.02x on documents and windows (there both write the mostly-zero dbias at about
#   the same speed). The forward since the bias joins S on the tensor cores (H100,
#   2026-11-27, perf-notes C52): 1.37x causal, 1.45x full, 1.39x prefix-LM, 1.08x
#   document; a scale whose inverse is no 16-bit value within 2^-12 takes the serial
#   kernel, at Triton's speed (1.0x). CUDA either way.
# - hd64: forward 1.21-1.45x (1.71-1.76x since the overlapped bias forward, C51),
#   backward 0.94x (causal) to 1.10x (documents, windows): CUDA either way.
# Latest (H100, 2026-11-27, commit 60de431, perf-notes C54-C55): forward 1.32-1.40x at hd128
# (document 1.18x), 1.86x at hd64; backward 1.19-1.32x at hd128 (document 1.01x), 1.25x at
# hd64. The rule stands.
# Other head dims, a softcap, or rows TMA cannot read run the per-score kernels, far slower
# (backward 84 against Triton's 317 before the tiles, C47): Triton.
AUTO_BIAS_HEAD_DIMS = (64, 128)
# The deterministic backward (dQ added in key-tile order, each CTA waiting its turn) is
# far slower than Triton's deterministic mode (H100: full 8K 241 vs 435 TFLOP/s, causal
# 136 vs 417; docs/perf-notes.md C13), so "auto" leaves deterministic training to Triton.
AUTO_DETERMINISTIC = False
# Index masks: the CUDA index forward (csrc/index_fwd.cu) against the Triton one, in one
# process (H200, 2026-11-29, benchmarks.cuda_index_bench, B=1, bf16, random sorted lists,
# L 8K and 32K, W 16/64/256; docs/benchmarks.md). At 4 query heads per kv head: 1.26-1.75x
# at hd128, 1.46-2.27x at hd64, 1.33-1.67x at hd256. At 1, 2, 8 and 16 (Hq/Hkv 16/16, 16/8,
# 16/2, 32/2): 1.12-3.22x at hd128, 1.21-3.55x at hd64, and at hd256 (1, 2, 16 measured)
# 1.08-1.77x. Without a bias or softcap: "auto" takes it at those group sizes. Gradients
# keep their own route (index_backward_kernel below), over the CUDA forward's out and lse.
AUTO_INDEX_HEAD_DIMS = (64, 128, 256)
AUTO_INDEX_GROUPS = (1, 2, 4, 8, 16)


def preferred_for(query, key, value, bias, mask, needs_grad: bool,
                  deterministic: bool = False, softcap: bool = False) -> bool:
    """Whether "auto" should run these inputs here (call_not_supported_reasons found
    none): the table above, from shapes, strides and flags only (no host sync, so also
    inside torch.compile). `softcap`: whether one is given."""
    if mask.attn_indices is not None:
        if bias is not None or softcap or query.shape[-1] not in AUTO_INDEX_HEAD_DIMS:
            return False
        # heads per kv head read only where known without a guard (as the bias rule below)
        return any(statically_known_true(query.shape[1] == g * key.shape[1])
                   for g in AUTO_INDEX_GROUPS)
    if needs_grad and deterministic and not AUTO_DETERMINISTIC:
        return False
    if mask.dense_mask is not None or mask.partial_bits is not None:
        return False
    D = query.shape[-1]
    if bias is None:
        return D in AUTO_HEAD_DIMS
    if D not in AUTO_BIAS_HEAD_DIMS or softcap:
        return False
    # The bias-tile kernels' TMA: contiguous keys, one row per query (not broadcast), rows of
    # whole 16-byte pieces. Only where that is known without a guard: under torch.compile
    # with dynamic lengths "Lk % 8 == 0" is not, and a guard would compile the graph again
    # for lengths that are not multiples of 8; those calls stay on Triton.
    return all(statically_known_true(c) for c in (
        bias.shape[-1] != 1, bias.stride(-1) == 1, bias.shape[-2] != 1,
        key.shape[2] % 8 == 0, bias.stride(-2) % 8 == 0))


# The backward kernels (csrc/bwd_sm90.cuh): 64-row query steps over 128-key tiles (64-key
# tiles at head dim 256).
_BWD_HEAD_DIMS = (64, 128, 256)


def _bwd_tile_n(head_dim: int) -> int:
    return 64 if head_dim == 256 else 128


def backward_not_supported_reasons(query, block_q: int, block_k: int, deterministic: bool = False) -> list:
    """Why the CUDA backward cannot differentiate this call (empty: it can); checked before
    the forward runs when gradients are wanted."""
    reasons = []
    if not has_backward():
        reasons.append("cuda: this build of flexsparse._C has forward kernels only")
    if query.shape[-1] not in _BWD_HEAD_DIMS:
        reasons.append(f"cuda: backward head dim {mask_checks.shown_size(query.shape[-1])} "
                       f"(backward: {_BWD_HEAD_DIMS})")
    tn = _bwd_tile_n(query.shape[-1])
    if block_q % 64 or block_k % tn:
        reasons.append(f"cuda: backward needs block sizes that are multiples of (64, {tn}), got "
                       f"({mask_checks.shown_size(block_q)}, {mask_checks.shown_size(block_k)})")
    return reasons


# The index backward: the Triton index kernels (ops/triton_indices.py) or csrc/index_bwd.cu
# (through flexsparse::cuda_attention_backward: no float atomics, bitwise deterministic).
# Measured on the H200 (benchmarks.cuda_index_bench --backward: B=1, bf16, Hq=16, Hkv=4,
# L 8K and 32K, W 16/64/256; docs/benchmarks.md, 2026-11-29, the 39th session): the CUDA
# one is 2.4-4.4x faster than Triton's deterministic mode at hd 64/128/256, so
# deterministic calls take it. Against Triton's atomic mode it is 1.08-1.34x faster at
# hd256 on every row (INDEX_BWD_OVER_ATOMIC below: those calls take it too), 0.91-1.08x at
# hd128 and 0.76-0.79x at hd64 (those stay on Triton). Only 4 query heads per kv head
# were measured, so only they move. The environment variable FLEXSPARSE_CUDA_INDEX_BWD ("1"/"cuda" or "0"/"triton"), read at
# each backward call, overrides that for A/B runs: an environment switch like
# FLEXSPARSE_CUDA_DEBUG, as backend="cuda" calls the CUDA op, whose schema carries no
# options string.
_INDEX_BWD_HEAD_DIMS = (64, 128, 256)
_INDEX_BWD_DTYPES = (torch.float16, torch.bfloat16)
# (head dim, query heads per kv head) where the CUDA backward beat Triton's atomic one on
# every measured row
INDEX_BWD_OVER_ATOMIC = ((256, 4),)


def index_backward_kernel(query, bias, bias_requires_grad: bool,
                          deterministic: bool = False, key=None) -> str:
    """Which kernel computes the gradients of an index-mask call: "cuda" when preferred
    (deterministic; or head dim and heads per kv head (query's heads over `key`'s) in
    INDEX_BWD_OVER_ATOMIC; or FLEXSPARSE_CUDA_INDEX_BWD, above) and able to (the C++ op is
    registered, head dim 64/128/256, fp16/bf16, no bias gradient wanted: index_bwd.cu
    computes no dbias), else "triton"."""
    env = os.environ.get("FLEXSPARSE_CUDA_INDEX_BWD", "").strip().lower()
    faster = key is not None and key.shape[1] > 0 and query.shape[1] % key.shape[1] == 0 and \
        (query.shape[-1], query.shape[1] // key.shape[1]) in INDEX_BWD_OVER_ATOMIC
    prefer = env in ("1", "cuda") or ((deterministic or faster) and env not in ("0", "triton"))
    if not prefer or not has_backward():
        return "triton"
    if query.shape[-1] not in _INDEX_BWD_HEAD_DIMS or query.dtype not in _INDEX_BWD_DTYPES:
        return "triton"
    if bias is not None and bias_requires_grad:
        return "triton"
    return "cuda"


def check_block_size(block_q: int, block_k: int, head_dim: int) -> list:
    tn = _tile_n(head_dim)
    if block_q % _TILE_M or block_k % tn:
        return [f"cuda: descriptor block size ({mask_checks.shown_size(block_q)}, "
                f"{mask_checks.shown_size(block_k)}) must be multiples of ({_TILE_M}, {tn})"]
    return []


def call_not_supported_reasons(query, key, value, bias, mask, block_q: int, block_k: int,
                               needs_grad: bool, deterministic: bool = False) -> list:
    """Why this backend cannot run a call (empty: it can): its forward kernels; for block
    masks the descriptor's block sizes and, with gradients wanted, the CUDA backward; for
    index masks, with gradients wanted, the Triton index backward (index_backward_kernel
    falls back to it wherever the CUDA one is not chosen or cannot run)."""
    reasons = not_supported_reasons(query, key, value, bias, mask)
    if reasons:
        return reasons
    if mask.attn_indices is not None:
        # the Triton backward gets the bias in the query's dtype (backward below), and the
        # op's checks have seen its shape and device
        return triton_indices.not_supported_reasons(query, key, value, None, mask) \
            if needs_grad else []
    reasons = check_block_size(block_q, block_k, query.shape[-1])
    if needs_grad:
        reasons += backward_not_supported_reasons(query, block_q, block_k, deterministic)
    return reasons


def forward(query, key, value, bias, mask, block_q, block_k, scale, softcap, deterministic,
            options=None):
    # kernel options tune the Triton kernels; the C++ kernels take none
    return torch.ops.flexsparse.cuda_attention(query, key, value, bias, *mask, block_q,
                                               block_k, scale, softcap, deterministic)


def backward(grad_out, grad_lse, query, key, value, out, lse, bias, mask, block_q, block_k,
             scale, softcap, deterministic, bias_requires_grad, options=None):
    if mask.attn_indices is not None:
        if index_backward_kernel(query, bias, bias_requires_grad, deterministic, key) == "cuda":
            # csrc/index_bwd.cu (C++ op: index_attention_backward); dbias: empty (not wanted)
            return torch.ops.flexsparse.cuda_attention_backward(
                grad_out, grad_lse, query, key, value, out, lse, bias, *mask, block_q, block_k,
                scale, softcap, deterministic, bias_requires_grad)
        # By default the Triton index backward, which reads out and lse as the CUDA
        # index forward writes them (out in the query's dtype, lse float32 in natural log,
        # -inf for empty rows). It recomputes the scores with the bias the forward read,
        # rounded to the query's dtype (csrc/attention_ops.cpp).
        bias_read = bias if bias is None else bias.to(query.dtype)
        dq, dk, dv, dbias = triton_indices.backward(
            grad_out, grad_lse, query, key, value, out, lse, bias_read, mask, scale, softcap,
            deterministic, bias_requires_grad)
        return dq, dk, dv, (dbias.to(bias.dtype) if bias_requires_grad else dbias)
    return torch.ops.flexsparse.cuda_attention_backward(
        grad_out, grad_lse, query, key, value, out, lse, bias, *mask, block_q, block_k, scale,
        softcap, deterministic, bias_requires_grad)
