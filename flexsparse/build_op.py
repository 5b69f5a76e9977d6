"""Per-step mask builds in one op call (issue 16): `flexsparse::build_document`,
`flexsparse::build_prefix_lm`, `flexsparse::build_column_ranges` and
`flexsparse::build_block_lists` (schemas and fakes in ops/schema.py; kernels in
csrc/build_ops.h and csrc/build_masks.cu, part of flexsparse._C).

Each call allocates every output in C++ and, on CUDA, runs two kernels for the usual
sizes (one more for a row of more than 2048 documents, one more past ~160K tokens at
block 128; with FLEXSPARSE_CUDA_DEBUG=8589934592, measured no faster, one for
documents and prefix-LM up to 256K tokens): no host synchronization, sizes from the
shapes only. Documents and prefix-LM get the range form of
`blocklists.column_range_range_descriptor` (what the compact build gives them; O(N /
block) at any length, and the form the kernels run fastest): the same column ranges and
block grid as the static build, which would hold padded (nQB x nKB) lists. FlashMask
column ranges (user data, not always range-shaped) get exactly the static build's
tensors, padded lists included, up to STATIC_MAX_BLOCKS in eager builds.
Block layouts (`masks.block_sparse` at the call's block size), and the block states of
every other mask built at static shapes (`lists`: dense masks, shared-question,
combinations, converted FlexAttention masks), get the static build's padded lists too,
in one launch (the torch build of the lists takes ~35).

Used by `masks.document`, `masks.prefix_lm(tensor)` and `masks.column_ranges` (each used
alone) when the op is built and the mask is compiled for CUDA tensors, eager or inside
torch.compile (the op has a fake kernel). CPU tensors take the op only inside `use(True)`
(tests), because the CPU op reports bad values as a ValueError also in compiled graphs,
where the torch build raises RuntimeError from torch._assert_async; `use(False)` turns
the op off everywhere (benchmarks of the torch builds).

Checks of values: on CUDA a device-side assert inside the kernels (as the static torch
build's torch._assert_async); on CPU the ValueError of the torch build's eager path, with
the same text. With FLEXSPARSE_DEBUG=1, eager CUDA builds read the values back first and
raise that ValueError (one host sync).
"""
import contextlib
import os
from typing import Optional

import torch

from .descriptor import BlockDescriptor, DescriptorParts, Sizes, static_shapes

_OPS = ("flexsparse::build_document", "flexsparse::build_prefix_lm",
        "flexsparse::build_column_ranges", "flexsparse::build_block_lists")
# the overloads themselves: calling them skips the packet's overload lookup (host time)
_DOCUMENT = torch.ops.flexsparse.build_document.default
_PREFIX_LM = torch.ops.flexsparse.build_prefix_lm.default
_COLUMN_RANGES = torch.ops.flexsparse.build_column_ranges.default
_BLOCK_LISTS = torch.ops.flexsparse.build_block_lists.default
_MODE: Optional[bool] = None      # None: CUDA only; True: CPU too; False: never
_HAVE = {}                        # dispatch key -> True once the kernels are registered


def available(device_type: str) -> bool:
    """Whether the build ops have a kernel for this device type ("cpu", "cuda"). Looked up
    eagerly (at import and until found); inside torch.compile only the last answer is read
    (Dynamo cannot trace the dispatcher query)."""
    key = "CUDA" if device_type == "cuda" else "CPU"
    if torch.compiler.is_compiling():
        return _HAVE.get(key, False)
    if not _HAVE.get(key):
        _HAVE[key] = all(torch._C._dispatch_has_kernel_for_dispatch_key(op, key) for op in _OPS)
    return _HAVE[key]


for _device_type in ("cpu", "cuda"):     # flexsparse._C is loaded by now (flexsparse.ops)
    available(_device_type)


def wanted(device: torch.device) -> bool:
    """Whether masks compiled for `device` build through the op."""
    if _MODE is False or device.type not in ("cuda", "cpu"):
        return False
    if device.type == "cpu" and _MODE is not True:
        return False
    return available(device.type)


@contextlib.contextmanager
def use(mode: Optional[bool]):
    """Inside: True = the op also for CPU masks, False = never, None = the default (CUDA).
    A module-level setting (not per thread), read when a mask is compiled and while
    torch.compile traces."""
    global _MODE
    if mode not in (None, True, False):
        raise TypeError(f"use: mode must be None, True or False, got {mode!r}")
    old, _MODE = _MODE, mode
    try:
        yield
    finally:
        _MODE = old


def debug_checks() -> bool:
    """FLEXSPARSE_DEBUG=1 and not compiling: check values on the host before an eager build."""
    return not torch.compiler.is_compiling() and os.environ.get("FLEXSPARSE_DEBUG") == "1"


def _descriptor(outputs, sz: Sizes) -> BlockDescriptor:
    cr, *lists = outputs
    return BlockDescriptor((sz.Lq, sz.Lk), (sz.block_q, sz.block_k), (sz.Hq, sz.Hkv), *lists,
                           col_ranges=cr)


def document(lengths: torch.Tensor, sz: Sizes, causal: bool) -> BlockDescriptor:
    """The descriptor of masks.document(lengths, causal) for `sz`; lengths (n,) or (Bl, n)
    on sz.device, shapes already checked (Lq == Lk, Bl in (1, B))."""
    return _descriptor(_DOCUMENT(
        lengths, sz.Lk, sz.block_q, sz.block_k, causal), sz)


def prefix_lm(prefix_len: torch.Tensor, sz: Sizes) -> BlockDescriptor:
    """The descriptor of masks.prefix_lm(prefix_len) for `sz`; prefix_len (Bp,) on
    sz.device, Bp in (1, B)."""
    return _descriptor(_PREFIX_LM(
        prefix_len, sz.Lq, sz.Lk, sz.block_q, sz.block_k), sz)


def column_ranges(startend: torch.Tensor, sz: Sizes, causal: bool) -> BlockDescriptor:
    """The descriptor of masks.column_ranges(startend, causal) for `sz` (shapes checked):
    the static build's tensors (padded lists: user data need not be range-shaped)."""
    return _descriptor(_COLUMN_RANGES(startend, sz.Lq, sz.Lk, sz.block_q, sz.block_k, causal),
                       sz)


def lists(grid: torch.Tensor, sz: Sizes, **predicates) -> BlockDescriptor:
    """The descriptor with the static build's padded lists of a block grid (B|1, H|1, nQB,
    nKB) on sz.device: a bool layout (True = FULL, masks.block_sparse) or block states
    (SKIP / PARTIAL / FULL, any integer dtype); `predicates`: the descriptor's element
    predicates (dense_mask, col_ranges, partial_bits_index, partial_bits)."""
    if grid.dtype not in (torch.bool, torch.int32):
        grid = grid.to(torch.int32)
    return BlockDescriptor((sz.Lq, sz.Lk), (sz.block_q, sz.block_k), (sz.Hq, sz.Hkv),
                           *_BLOCK_LISTS(grid), **predicates)


def descriptor_of(parts: DescriptorParts, sz: Sizes) -> BlockDescriptor:
    """parts.to_descriptor(sz), with the padded lists of a static build (inside
    torch.compile, or eager where building_static is on) from one `lists` call where the
    op is used for sz.device: the same tensors as the torch build of the lists, one launch
    instead of ~35. Other builds keep to_descriptor (the range form where every row is a
    few runs of blocks)."""
    if (parts.attn_indices is None and parts.state is not None and static_shapes()
            and parts.state.device == sz.device and wanted(sz.device)):
        return lists(parts.state, sz, dense_mask=parts.dense_mask, col_ranges=parts.col_ranges,
                     partial_bits_index=parts.partial_bits_index,
                     partial_bits=parts.partial_bits)
    return parts.to_descriptor(sz)
