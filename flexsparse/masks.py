"""Mask builders. Every mask compiles, for given sizes, into a BlockDescriptor.

Three families, by how the element predicate is stored (docs/design.md):
- column ranges, O(Lk): causal, sliding_window, document, prefix_lm, shared_question,
  column_ranges, and any and_/or_ of them (intervals are closed under both);
- dense / block-level / bitmaps: dense, block_sparse, full, and the generic fallback
  that evaluates any mix in row chunks and keeps bits only for partial blocks;
- index lists: indices (and_ with other masks turns invisible entries into -1).

Conventions: query i sees key j; with Lq != Lk causal masks align bottom-right,
i' = i + (Lk - Lq).
"""
import functools
import numbers
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from . import build_op, intervals
from .blocklists import (column_range_descriptor, column_range_range_descriptor,
                         key_block_stats)
from .descriptor import (FULL, PARTIAL, SKIP, STATIC_MAX_BLOCKS, BlockDescriptor,
                         DescriptorParts, Sizes, assert_in_graph, building_static, dim_in,
                         groups_to_heads, parts_from_visible, static_shapes)
from .index_blocks import indices_to_blocks, prefer_blocks
from .intervals import COL, CONST, DOC_END, DOC_START, Interval, IntervalSpec, Term
from .ops import visibility
from .ops.schema import WINDOW_LIMIT
from .topk import topk_indices

DEFAULT_BLOCK_SIZE = (128, 128)


def canonical_device(device) -> torch.device:
    """`cuda` -> `cuda:<current>`, so that devices compare equal to tensors' devices."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


# Eager compile results of value-only masks (causal, windows, documents from lists, ...),
# keyed by (repr, sizes): a training loop that passes masks.causal() every step builds the
# descriptor once. Bounded because long-context descriptors can be large.
CACHE_SIZE = 8
_CACHE = {}


def clear_cache() -> None:
    """Drop all cached descriptors."""
    _CACHE.clear()


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


def _values_text(t: torch.Tensor) -> str:
    """A tensor's values for a mask's text; a GPU tensor's device only (reading its values
    would synchronize with the device, and fails during CUDA-graph capture)."""
    return f"{t.tolist()}" if t.device.type == "cpu" else f"<{t.device.type} tensor>"


def shown(v) -> str:
    """repr(v) for an error message. Inside torch.compile an int or float argument may be
    symbolic, which Dynamo cannot format into a string ("BUILD_STRING type error" would
    replace the message): there only its type is shown."""
    if not _is_compiling():
        return repr(v)
    if isinstance(v, (tuple, list)):
        inner = ", ".join(shown(x) for x in v)
        return f"({inner},)" if isinstance(v, tuple) and len(v) == 1 else (
            f"({inner})" if isinstance(v, tuple) else f"[{inner}]")
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return f"a {type(v).__name__} (its value is not shown inside torch.compile)"
    return repr(v)


def _is_int(v) -> bool:
    # (a plain int first: the Integral check is an ABC lookup, paid per mask build)
    return type(v) is int or (isinstance(v, (int, numbers.Integral)) and not isinstance(v, bool))


def _check_count(name, v, allow_none=False) -> None:
    """A non-negative int argument (None too when allow_none): TypeError for another type
    (bool and float included), ValueError for a negative value."""
    if v is None and allow_none:
        return
    what = "a non-negative int" + (" or None" if allow_none else "")
    if not _is_int(v):
        raise TypeError(f"{name}: must be {what}, got {shown(v)}")
    if v < 0:
        raise ValueError(f"{name}: must be {what}, got {shown(v)}")


def _check_bool(name, v) -> None:
    if not isinstance(v, bool):
        raise TypeError(f"{name}: must be a bool, got {shown(v)}")


def block_pair(block_size, name: str = "block_size") -> Tuple[int, int]:
    """(block_q, block_k) from a positive int or a pair of positive ints."""
    if type(block_size) is tuple and len(block_size) == 2:      # the usual call, checked fast
        bq, bk = block_size
        if type(bq) is int and type(bk) is int and bq > 0 and bk > 0:
            return bq, bk
    pair = (block_size, block_size) if _is_int(block_size) else block_size
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(map(_is_int, pair)):
        raise TypeError(f"{name}: must be an int or a (block_q, block_k) pair of ints, got "
                        f"{shown(block_size)}")
    if pair[0] <= 0 or pair[1] <= 0:
        raise ValueError(f"{name}: must be positive, got {shown(block_size)}")
    return pair[0], pair[1]


def _cached(table: dict, key, make):
    """table[key], made by make() where missing; the most recently used entry last, at
    most CACHE_SIZE entries (the value cache, and a mask's own descriptors)."""
    value = table.pop(key, None)
    if value is None:
        value = make()
    table[key] = value
    while len(table) > CACHE_SIZE:
        table.pop(next(iter(table)))
    return value


def _build_descriptor(mask, sz):
    return mask._descriptor(sz)


@functools.lru_cache(maxsize=None)
def _compiled_builder():
    """Mask._descriptor under torch.compile (dynamic shapes, one graph): made on first use."""
    return torch.compile(_build_descriptor, dynamic=True, fullgraph=True)


class Mask:
    """Base class. Subclasses implement `_parts(sizes) -> DescriptorParts` and `__repr__`."""

    def compile(self, B: int, Hq: int, Hkv: int, Lq: int, Lk: int, *, device=None,
                block_size: Tuple[int, int] = DEFAULT_BLOCK_SIZE,
                compiled_build: bool = False) -> BlockDescriptor:
        """The BlockDescriptor of this mask for these sizes (H = query heads).

        `compiled_build`: build at static shapes through torch.compile (one compile per
        mask kind and device, seconds, then a few fused kernels per build instead of one
        launch per tensor op; docs/dynamic-masks.md). For masks rebuilt every step from
        tensors; masks without tensors are cached and built once anyway. Grids of more
        than STATIC_MAX_BLOCKS blocks build as without it."""
        if Hkv <= 0 or Hq % Hkv != 0:
            raise ValueError(f"num_kv_heads: Hq={Hq} must be a multiple of Hkv={Hkv}")
        _check_bool("compiled_build", compiled_build)
        bq, bk = block_pair(block_size)
        sz = Sizes(B, Hq, Hkv, Lq, Lk, bq, bk, canonical_device(device or self._default_device()))
        if _is_compiling():
            return self._descriptor(sz)
        # past STATIC_MAX_BLOCKS the static build's full-width lists cost more than the
        # compact build's host syncs (1M tokens: 23-26 ms against 0.6-1.5 ms on the H100)
        static_ok = sz.nQB * sz.nKB <= STATIC_MAX_BLOCKS
        if compiled_build and static_ok:
            with building_static(True):
                return _compiled_builder()(self, sz)
        key = self._cache_key()
        if key is None:       # holds tensors: built per call, without host syncs
            kept = self._kept_descriptors(sz)
            build = lambda: self._tensor_descriptor(sz, static_ok)  # noqa: E731
            return build() if kept is None else _cached(kept, sz, build)
        return _cached(_CACHE, (key, sz), lambda: self._descriptor(sz))

    def _tensor_descriptor(self, sz: Sizes, static_ok: bool) -> BlockDescriptor:
        """The build of a mask holding tensors: one op call where the op builds it, else
        at static shapes on CUDA up to STATIC_MAX_BLOCKS."""
        desc = self._op_descriptor(sz)
        if desc is not None:
            return desc
        with building_static(sz.device.type == "cuda" and static_ok):
            return self._descriptor(sz)

    # (B, H, Lq, Lk) for masks converted from FlexAttention (flex.from_block_mask,
    # flex.from_mask_mod), which know the sizes they were made for; None for the others.
    known_sizes: Optional[Tuple[Optional[int], Optional[int], int, int]] = None

    # True where the mask's tensors are its own copies (documents and prefix-LM from
    # tensors; masks the transformers integration makes from tensors it made): nothing
    # else can write to them, so the mask keeps the descriptors it builds from them, per
    # sizes, and a model that passes one mask object to all its layers builds it once per
    # step. Masks holding the caller's tensors build on every call (the caller may write
    # to them in place).
    owns_tensors = False

    def _kept_descriptors(self, sz: Sizes) -> Optional[dict]:
        """This mask's descriptors by sizes, where it owns its tensors; None otherwise and
        while a CUDA graph is being captured (the build must then be part of the graph,
        so that replays rebuild from the tensors' new values)."""
        if not self.owns_tensors:
            return None
        if sz.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        kept = self.__dict__.get("_kept")
        if kept is None:
            kept = self.__dict__["_kept"] = {}
        return kept

    def to_dense(self, B: int, H: int, Lq: int, Lk: int, *, num_kv_heads: Optional[int] = None,
                 device=None) -> torch.Tensor:
        """bool (B|1, H|1, Lq, Lk), True = attend. For small sizes."""
        Hkv = num_kv_heads or self._kv_heads_hint(H)
        return self.compile(B, H, Hkv, Lq, Lk, device=device, block_size=(16, 16)).to_dense()

    def show(self, Lq: int, Lk: Optional[int] = None, *, B: int = 1, H: int = 1, b: int = 0,
             h: int = 0) -> str:
        """A text grid of the mask for batch b, head h: '#' attend, '.' masked."""
        Lk = Lq if Lk is None else Lk
        dense = self.to_dense(B, H, Lq, Lk)
        grid = dense[min(b, dense.shape[0] - 1), min(h, dense.shape[1] - 1)]
        return "\n".join("".join("#" if x else "." for x in row) for row in grid.tolist())

    def __and__(self, other):
        return and_(self, other)

    def __or__(self, other):
        return or_(self, other)

    # hooks
    def _parts(self, sz: Sizes) -> DescriptorParts:
        raise NotImplementedError

    def _descriptor(self, sz: Sizes) -> BlockDescriptor:
        return build_op.descriptor_of(self._parts(sz), sz)

    def _op_descriptor(self, sz: Sizes) -> Optional[BlockDescriptor]:
        """The descriptor from one build-op call (flexsparse/build_op.py), or None where
        the op does not build this mask for these sizes and device."""
        return None

    def _default_device(self):
        return "cpu"

    def _kv_heads_hint(self, H: int) -> int:
        return H

    def _cache_key(self):
        """A value that identifies this mask's meaning, or None when it holds user tensors
        (which could change in place): only value-keyed masks share compiled descriptors."""
        return None


# =============================================================== full / dense / blocks

class _Full(Mask):
    def _parts(self, sz):
        # One value for every block (descriptor.from_block_state keeps its lists one row:
        # the CUDA kernels see from the strides that every row reads the same lists).
        state = torch.full((1, 1, 1, 1), FULL, dtype=torch.int32, device=sz.device)
        return DescriptorParts(state=state.expand(1, 1, sz.nQB, sz.nKB))

    def __repr__(self):
        return "full()"

    def _cache_key(self):
        return repr(self)


def full() -> Mask:
    """Every query sees every key (what mask=None means)."""
    return _Full()


def _check_heads_dim(name, n, sz: Sizes, allow_hq=True):
    ok = (1, sz.Hkv, sz.Hq) if allow_hq else (1, sz.Hkv)
    if not dim_in(n, *ok):
        raise ValueError(f"{name}: head dim {n} must be 1, Hkv={sz.Hkv}"
                         + (f" or Hq={sz.Hq}" if allow_hq else ""))


def _pool_blocks(vis: torch.Tensor, sz: Sizes) -> torch.Tensor:
    """State (b, h, nQB|1, nKB|1) from a bool (b, h, Lq|1, Lk|1); out-of-range cells are neutral."""
    b, h, lq, lk = vis.shape
    nq = sz.nQB if lq != 1 else 1
    nk = sz.nKB if lk != 1 else 1
    bq = sz.block_q if lq != 1 else 1
    bk = sz.block_k if lk != 1 else 1
    pad = (0, nk * bk - lk, 0, nq * bq - lq)
    any_ = torch.nn.functional.pad(vis, pad, value=False).view(b, h, nq, bq, nk, bk).any(5).any(3)
    all_ = torch.nn.functional.pad(vis, pad, value=True).view(b, h, nq, bq, nk, bk).all(5).all(3)
    state = torch.where(all_, FULL, torch.where(any_, PARTIAL, SKIP)).to(torch.int32)
    return state.expand(b, h, sz.nQB, sz.nKB)


class _Dense(Mask):
    def __init__(self, mask: torch.Tensor):
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask: expected a bool tensor, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            raise TypeError(f"mask: a dense mask must be torch.bool, got {mask.dtype}")
        if not 2 <= mask.dim() <= 4:
            raise ValueError(f"mask: a dense mask must be 2-D to 4-D, broadcastable to "
                             f"(B, H, Lq, Lk), got shape {tuple(mask.shape)}")
        # SDPA's rule: missing leading dims broadcast (an (Lq, Lk) mask serves every head).
        self.mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))

    def _parts(self, sz):
        m = self.mask
        b, h, lq, lk = m.shape
        if not (dim_in(b, 1, sz.B) and dim_in(lq, 1, sz.Lq) and dim_in(lk, 1, sz.Lk)):
            raise ValueError(f"mask: shape {tuple(m.shape)} is not broadcastable to "
                             f"(B={sz.B}, H, Lq={sz.Lq}, Lk={sz.Lk})")
        _check_heads_dim("mask", h, sz)
        if m.device != sz.device:
            raise ValueError(f"mask: is on {m.device} but the inputs are on {sz.device}")
        return DescriptorParts(state=_pool_blocks(m, sz), dense_mask=m)

    def _default_device(self):
        return self.mask.device

    def _kv_heads_hint(self, H):
        return self.mask.shape[1] if self.mask.shape[1] not in (1, H) else H

    def __repr__(self):
        return f"dense(<bool {tuple(self.mask.shape)}>)"


def dense(mask: torch.Tensor) -> Mask:
    """A dense bool mask (True = attend), broadcastable to (B, H, Lq, Lk); H may be Hkv."""
    return _Dense(mask)


class _BlockSparse(Mask):
    def __init__(self, layout: torch.Tensor, block_size):
        if not isinstance(layout, torch.Tensor) or layout.dtype != torch.bool:
            raise TypeError("layout: must be a bool tensor (B|1, H|1, ceil(Lq/bq), ceil(Lk/bk))")
        if layout.dim() != 4:
            raise ValueError(f"layout: must be 4-D, got shape {tuple(layout.shape)}")
        self.layout, self.block = layout, block_pair(block_size)

    def _check(self, sz):
        lay = self.layout
        bq, bk = self.block
        nq, nk = -(-sz.Lq // bq), -(-sz.Lk // bk)
        if not dim_in(lay.shape[0], 1, sz.B) or lay.shape[2] != nq or lay.shape[3] != nk:
            raise ValueError(f"layout: shape {tuple(lay.shape)} does not match "
                             f"(B|1, H|1, {nq}, {nk}) for Lq={sz.Lq}, Lk={sz.Lk}, "
                             f"block_size={self.block}")
        _check_heads_dim("layout", lay.shape[1], sz)

    def _op_descriptor(self, sz):
        # At the call's block size, the static build's lists in one op call (build_op.py).
        if (self.block != (sz.block_q, sz.block_k) or self.layout.device != sz.device
                or not build_op.wanted(sz.device)):
            return None
        if not _is_compiling() and sz.nQB * sz.nKB > STATIC_MAX_BLOCKS:
            return None      # padded lists too large: the compact build, as without the op
        self._check(sz)
        return build_op.lists(self.layout, sz)

    def _descriptor(self, sz):
        desc = self._op_descriptor(sz)
        return desc if desc is not None else super()._descriptor(sz)

    def _parts(self, sz):
        self._check(sz)
        lay = self.layout
        bq, bk = self.block
        if (bq, bk) == (sz.block_q, sz.block_k):
            return DescriptorParts(state=torch.where(lay, FULL, SKIP).to(torch.int32))
        # Other block sizes: evaluate at element level in row chunks.
        Hkv, G = sz.Hkv, sz.Hq // sz.Hkv
        j = torch.arange(sz.Lk, device=lay.device) // bk

        def visible(r0, r1):
            i = torch.arange(r0, r1, device=lay.device) // bq
            return visibility.to_groups(lay[:, :, i][..., j], Hkv, G)
        return parts_from_visible(visible, sz)

    def _default_device(self):
        return self.layout.device

    def __repr__(self):
        return f"block_sparse(<bool {tuple(self.layout.shape)}>, block_size={self.block})"


def block_sparse(layout: torch.Tensor, block_size=DEFAULT_BLOCK_SIZE) -> Mask:
    """Block-level layout (B|1, H|1, ceil(Lq/bq), ceil(Lk/bk)), True = the block is attended."""
    return _BlockSparse(layout, block_size)


# =============================================================== generic fallback

# =============================================================== column ranges

UPPER, LOWER, GENERAL = "upper", "lower", "general"   # [0, e) / [s, Lq) / [s, e)


class _ColumnRanges(Mask):
    """Masked row intervals per key column; `build(sz)` returns [(kind, (Bc,Hc,Lk,2) int64)]."""

    def __init__(self, build: Callable[[Sizes], List[Tuple[str, torch.Tensor]]], text: str,
                 device=None, kv_heads_hint=None, cacheable=True,
                 spec: Optional[Callable[[Sizes], Optional[IntervalSpec]]] = None,
                 fast: Optional[Callable[[Sizes], Optional[BlockDescriptor]]] = None,
                 window: Optional[Tuple[int, int]] = None):
        # text: the repr, or a function making it when first asked (eagerly: under
        # torch.compile a mask's int arguments may be symbolic, and Dynamo cannot format
        # them into a string, "BUILD_STRING type error", so the text waits)
        self._text = text
        self.build, self.device, self.kv_hint = build, device, kv_heads_hint
        self.cacheable = cacheable   # False when `text` does not pin down the values
        # The same column ranges in closed form (flexsparse/intervals.py): one launch on GPUs.
        self.spec = spec
        # The whole descriptor from one op call (flexsparse/build_op.py), or None where
        # the op is not used for these sizes and device (then the builds below run).
        self.fast = fast
        # (left, right) where the ranges are sliding_window(left, right)'s: the descriptor's
        # `window` hint (the CUDA forward then hides scores by it, perf-notes C113).
        self.window = window

    @property
    def text(self) -> str:
        if callable(self._text):
            self._text = self._text()
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._text = value

    def _cache_key(self):
        return self.text if self.cacheable else None

    def slots(self, sz: Sizes):
        return _simplify(self.build(sz), sz)

    def _parts(self, sz):
        slots = self.slots(sz)
        if not slots:   # nothing masked
            return _Full()._parts(sz)
        cr = _stack_slots(slots, sz)
        return DescriptorParts(state=col_ranges_block_state(cr, sz), col_ranges=cr)

    def _column_ranges(self, sz) -> Optional[torch.Tensor]:
        """Eager: the normalized column ranges (None: nothing masked), from the interval
        spec in one launch on CUDA, else from the torch slots."""
        spec = self.spec(sz) if self.spec is not None and sz.device.type == "cuda" else None
        if intervals.fits(spec, sz.Lq, sz.Lk):
            cr = intervals.column_ranges(spec, sz.B, sz.Lq, sz.Lk, sz.device)
            return cr if cr.shape[-1] else None
        slots = self.slots(sz)
        return _stack_slots(slots, sz) if slots else None

    def _op_descriptor(self, sz):
        return self.fast(sz) if self.fast is not None else None

    def _descriptor(self, sz):
        desc = self._ranges_descriptor(sz)
        if self.window is not None and desc.col_ranges is not None:
            # (left, right) on the device, without a host-to-device copy (no sync)
            window = torch.full((2,), self.window[0], dtype=torch.int32, device=desc.col_ranges.device)
            window[1] = self.window[1]
            desc.window = window
        return desc

    def _ranges_descriptor(self, sz):
        desc = self._op_descriptor(sz)
        if desc is not None:
            return desc
        # Eager: O(N) without the dense block grid (flexsparse/blocklists.py).
        cr = None if static_shapes() else self._column_ranges(sz)
        if cr is None:
            return build_op.descriptor_of(self._parts(sz), sz)
        common = dict(seq_lengths=(sz.Lq, sz.Lk), block_size=(sz.block_q, sz.block_k),
                      num_heads=(sz.Hq, sz.Hkv))
        # Range form when every row is a few block ranges (the named masks), else lists.
        return (column_range_range_descriptor(cr, **common)
                or column_range_descriptor(cr, **common))

    def _default_device(self):
        return self.device or "cpu"

    def _kv_heads_hint(self, H):
        return self.kv_hint if self.kv_hint not in (None, 1) else H

    def __repr__(self):
        return self.text


def _aligned_heads(ts: Sequence[torch.Tensor], sz: Sizes):
    """Make head dims broadcast: a mix of Hkv and Hq heads becomes Hq."""
    hs = {t.shape[1] for t in ts} - {1}
    if len(hs) <= 1:
        return list(ts)
    G = sz.Hq // sz.Hkv
    return [t.repeat_interleave(G, dim=1) if t.shape[1] == sz.Hkv else t for t in ts]


def _simplify(slots, sz: Sizes):
    """Union of masked intervals: all UPPER merge into one (max end), all LOWER into one (min start)."""
    uppers = [t for k, t in slots if k == UPPER]
    lowers = [t for k, t in slots if k == LOWER]
    out = [(k, t) for k, t in slots if k == GENERAL]
    if uppers:
        ends = torch.broadcast_tensors(*_aligned_heads([t[..., 1] for t in uppers], sz))
        end = torch.stack(ends).amax(0)
        out.insert(0, (UPPER, torch.stack([torch.zeros_like(end), end], -1)))
    if lowers:
        starts = torch.broadcast_tensors(*_aligned_heads([t[..., 0] for t in lowers], sz))
        start = torch.stack(starts).amin(0)
        out.insert(len(uppers) > 0, (LOWER, torch.stack([start, torch.full_like(start, sz.Lq)], -1)))
    return out


def _stack_slots(slots, sz: Sizes) -> torch.Tensor:
    """int32 (Bc, Hc, Lk, 2m), clamped to [0, Lq]; empty intervals normalized to (0, 0)/(Lq, Lq)."""
    ts = torch.broadcast_tensors(*_aligned_heads([t for _, t in slots], sz))
    fixed = []
    for (kind, _), t in zip(slots, ts):
        t = t.clamp(0, sz.Lq)
        s, e = t[..., 0], t[..., 1]
        empty = s >= e
        fill = sz.Lq if kind == LOWER else 0      # keeps per-block min/max stats tight
        s = torch.where(empty, fill, s)
        e = torch.where(empty, fill, e)
        fixed.append(torch.stack([s, e], -1))
    return torch.cat(fixed, -1).to(torch.int32).contiguous()


def col_ranges_block_state(cr: torch.Tensor, sz: Sizes) -> torch.Tensor:
    """SKIP/PARTIAL/FULL per block from per-key-block min/max of the intervals: O(Lk + blocks).

    Sound, not always tight: SKIP only if one interval covers the block's rows in every
    column; FULL only if every interval misses them in every column; else PARTIAL. The
    statistics are blocklists.key_block_stats (padded columns neutral, empty intervals
    neither cover nor touch anything).
    """
    Bc, Hc, Lk, two_m = cr.shape
    nQB, nKB = sz.nQB, sz.nKB
    stats = [t.view(Bc, Hc, 1, nKB, -1) for t in key_block_stats(cr, nKB, sz.block_k)]
    s_cov, e_cov, s_miss, e_miss = stats                     # (Bc, Hc, 1, nKB, m)
    r0 = torch.arange(nQB, device=cr.device) * sz.block_q
    r1 = (r0 + sz.block_q).clamp(max=sz.Lq)
    r0, r1 = r0[:, None], r1[:, None]                        # (nQB, 1) against (.., 1, nKB)
    skip = torch.zeros((Bc, Hc, nQB, nKB), dtype=torch.bool, device=cr.device)
    full = torch.ones((Bc, Hc, nQB, nKB), dtype=torch.bool, device=cr.device)
    for r in range(two_m // 2):
        skip |= (s_cov[..., r] <= r0) & (e_cov[..., r] >= r1)
        full &= (s_miss[..., r] >= r1) | (e_miss[..., r] <= r0)
    return torch.where(skip, SKIP, torch.where(full, FULL, PARTIAL)).to(torch.int32)


def _cols(sz: Sizes) -> torch.Tensor:
    return torch.arange(sz.Lk, device=sz.device, dtype=torch.int64)


def _interval(start, end):
    """Starts/ends of shape (Lk,) or (Bl, Lk) -> one slot tensor (Bc, 1, Lk, 2)."""
    start, end = torch.broadcast_tensors(start, end)
    t = torch.stack([start, end], -1)
    return t[None, None] if t.dim() == 2 else t[:, None]


def causal() -> Mask:
    """Query i sees key j iff j <= i + (Lk - Lq)."""
    def build(sz):
        j = _cols(sz)
        return [(UPPER, _interval(torch.zeros_like(j), j - sz.offset))]

    def spec(sz):
        return IntervalSpec((Interval(lo=(Term(COL, -sz.offset),)),))
    return _ColumnRanges(build, "causal()", spec=spec)


def sliding_window(left: Optional[int], right: Optional[int] = 0) -> Mask:
    """Query i sees key j iff i' - left <= j <= i' + right, i' = i + (Lk - Lq); None = unbounded."""
    for name, v in (("left", left), ("right", right)):
        _check_count(name, v, allow_none=True)

    def build(sz):
        j = _cols(sz)
        slots = []
        if right is not None:     # rows i < j - off - right are masked
            slots.append((UPPER, _interval(torch.zeros_like(j), j - sz.offset - right)))
        if left is not None:      # rows i > j - off + left are masked
            slots.append((LOWER, _interval(j - sz.offset + left + 1, torch.full_like(j, sz.Lq))))
        return slots

    def spec(sz):
        lo = () if right is None else (Term(COL, -sz.offset - right),)
        hi = () if left is None else (Term(COL, -sz.offset + left + 1),)
        return IntervalSpec((Interval(lo, hi),))
    # (a bound past any sequence kept below WINDOW_LIMIT: int32 with room to add)
    window = None if left is None or right is None else (min(left, WINDOW_LIMIT - 1),
                                                         min(right, WINDOW_LIMIT - 1))
    return _ColumnRanges(build, lambda: f"sliding_window(left={left}, right={right})",
                         spec=spec, window=window)


def _as_lengths(lengths, name) -> torch.Tensor:
    """Lengths as an int64 tensor (a copy: the mask is a value). A list is checked here
    (no device data to read); a tensor's values when the mask is compiled."""
    try:
        t = lengths.detach() if isinstance(lengths, torch.Tensor) else torch.as_tensor(lengths)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(f"{name}: must be a list or tensor of integers, 1-D (n,) or 2-D "
                        f"(B, n), got {shown(lengths)} ({err})") from None
    if t.numel() == 0:
        raise ValueError(f"{name}: must not be empty, got {shown(lengths)}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name}: must be integers, got {t.dtype}")
    if t.dim() not in (1, 2):
        raise ValueError(f"{name}: must be 1-D (n,) or 2-D (B, n), got shape {tuple(t.shape)}")
    if not isinstance(lengths, torch.Tensor) and bool((t < 0).any()):
        raise ValueError(f"{name}: must be non-negative, got {shown(lengths)}")
    # one copy, cast included (as_tensor of a list is new already; of an array it is not)
    return t.to(torch.int64, copy=not isinstance(lengths, (list, tuple)))


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on device; no `.to` call where it is there already (a per-step build's host time)."""
    return t if t.device == device else t.to(device)


def _check_lengths_shape(lengths: torch.Tensor, sz: Sizes, name: str) -> None:
    """Document lengths (n,) or (Bl, n): their shape against the sizes."""
    if sz.Lq != sz.Lk:
        raise ValueError(f"{name}: needs Lq == Lk, got Lq={sz.Lq}, Lk={sz.Lk}")
    rows = lengths.shape[0] if lengths.dim() == 2 else 1
    if not dim_in(rows, 1, sz.B):
        raise ValueError(f"{name}: batch dim {rows} must be 1 or B={sz.B}")


def _checked_lengths(lengths: torch.Tensor, sz: Sizes, name: str) -> torch.Tensor:
    """Document lengths as (Bl, n), checked where they live (a CPU copy: no device sync)."""
    _check_lengths_shape(lengths, sz, name)
    lens = lengths[None] if lengths.dim() == 1 else lengths
    totals = lens.sum(-1)
    if static_shapes():
        # the values are data: checked by the graph when it runs (torch._assert_async)
        assert_in_graph((lens >= 0).all() & (totals == sz.Lk).all(),
                        f"{name}: lengths must be non-negative and each row must sum to the "
                        f"sequence length L (checked inside torch.compile)")
    else:
        if bool((lens < 0).any()):
            raise ValueError(f"{name}: lengths must be non-negative")
        if bool((totals != sz.Lk).any()):
            raise ValueError(f"{name}: lengths must sum to L={sz.Lk}, got {totals.tolist()}")
    return lens


def _doc_bounds(lengths: torch.Tensor, sz: Sizes, name: str):
    """Per key column: (start, end) of its document, each (Bl, Lk)."""
    lens = _checked_lengths(lengths, sz, name).to(sz.device)
    ends = lens.cumsum(-1)
    starts = ends - lens
    j = _cols(sz).expand(lens.shape[0], sz.Lk).contiguous()
    d = torch.searchsorted(ends, j, right=True).clamp(max=lens.shape[1] - 1)
    return starts.gather(-1, d), ends.gather(-1, d)


def document(lengths, causal: bool = True) -> Mask:
    """Packed sequences: attention only within a document (and causal inside it by default).

    `lengths`: 1-D (n,) summing to L, or (B, n) padded with zeros, each row summing to L.
    """
    lens = _as_lengths(lengths, "lengths")
    _check_bool("causal", causal)
    use_causal = causal

    def build(sz):
        s, e = _doc_bounds(lens, sz, "lengths")
        j = _cols(sz)
        upper_end = torch.maximum(s, j - sz.offset) if use_causal else s
        return [(UPPER, _interval(torch.zeros_like(upper_end), upper_end)),
                (LOWER, _interval(e, torch.full_like(e, sz.Lq)))]

    def spec(sz):
        lo = (Term(DOC_START),) + ((Term(COL, -sz.offset),) if use_causal else ())
        return IntervalSpec((Interval(lo, (Term(DOC_END),)),),
                            _checked_lengths(lens, sz, "lengths"))

    def fast(sz):    # one op call (flexsparse/build_op.py); the op checks the values
        if not build_op.wanted(sz.device):
            return None
        if build_op.debug_checks():
            with building_static(False):
                _checked_lengths(lens, sz, "lengths")
        _check_lengths_shape(lens, sz, "lengths")
        return build_op.document(_to_device(lens, sz.device), sz, use_causal)
    # a lengths tensor on the GPU builds there unless compile() names another device
    mask = _ColumnRanges(build, lambda: f"document(lengths={_values_text(lens)}, causal={causal})",
                         device=lens.device, spec=spec, cacheable=lens.device.type == "cpu",
                         fast=fast)
    mask.owns_tensors = True          # `lens` is the mask's own copy (_as_lengths)
    return mask


def prefix_lm(prefix_len) -> Mask:
    """Key j is visible iff j < prefix_len or causal. prefix_len: int or (B,) tensor."""
    if isinstance(prefix_len, bool) or isinstance(prefix_len, float):
        raise TypeError(f"prefix_len: must be an int or an integer (B,) tensor, got "
                        f"{shown(prefix_len)}")
    if isinstance(prefix_len, torch.Tensor) and (prefix_len.dtype.is_floating_point
                                                 or prefix_len.dtype == torch.bool):
        raise TypeError(f"prefix_len: tensor dtype must be an integer type, got {prefix_len.dtype}")
    if isinstance(prefix_len, int) and prefix_len < 0:
        raise ValueError(f"prefix_len: must be >= 0, got {shown(prefix_len)}")
    is_int = isinstance(prefix_len, int)
    p = (prefix_len.detach().to(torch.int64, copy=True) if isinstance(prefix_len, torch.Tensor)
         else torch.as_tensor(prefix_len, dtype=torch.int64).clone())    # one copy: a value
    if p.dim() > 1:
        raise ValueError(f"prefix_len: must be an int or a (B,) tensor, got shape {tuple(p.shape)}")

    def rows(sz):
        pl = p.reshape(-1)
        if not dim_in(pl.shape[0], 1, sz.B):
            raise ValueError(f"prefix_len: batch dim {pl.shape[0]} must be 1 or B={sz.B}")
        return pl

    def checked(sz):
        pl = rows(sz)
        if is_int:
            return pl
        if static_shapes():
            assert_in_graph(pl >= 0, "prefix_len: must be >= 0 (checked inside torch.compile)")
        elif bool((pl < 0).any()):
            raise ValueError(f"prefix_len: must be >= 0, got {pl.tolist()}")
        return pl

    def build(sz):
        j = _cols(sz)
        pl = checked(sz).to(sz.device)[:, None]              # (Bp, 1)
        end = torch.where(j < pl, 0, j - sz.offset)          # (Bp, Lk)
        return [(UPPER, _interval(torch.zeros_like(end), end))]

    def spec(sz):
        return IntervalSpec((Interval(lo=(Term(COL, -sz.offset, below=checked(sz), alt=0),)),))
    def text():
        return f"prefix_lm({prefix_len})" if is_int else f"prefix_lm({_values_text(p)})"

    def fast(sz):    # one op call (flexsparse/build_op.py); the op checks the values
        if is_int or not build_op.wanted(sz.device):
            return None     # an int prefix is a value mask, built once and cached
        if build_op.debug_checks():
            with building_static(False):
                checked(sz)
        return build_op.prefix_lm(_to_device(rows(sz), sz.device), sz)
    mask = _ColumnRanges(build, text, device=p.device, spec=spec,
                         cacheable=p.device.type == "cpu", fast=fast)
    mask.owns_tensors = True          # `p` is the mask's own copy
    return mask


def shared_question(question_len: int, answer_lengths: Sequence[int]) -> Mask:
    """Causal; every answer sees the question and itself, never another answer."""
    answers = _as_lengths(answer_lengths, "answer_lengths")
    if answers.dim() != 1:
        raise ValueError(f"answer_lengths: must be 1-D, got shape {tuple(answers.shape)}")
    _check_count("question_len", question_len)

    lengths = torch.cat([torch.tensor([question_len]), answers])

    def build(sz):
        s, e = _doc_bounds(lengths, sz, "shared_question lengths")
        j = _cols(sz)
        lower = torch.where(j < question_len, sz.Lq, e)      # question columns: no lower interval
        return [(UPPER, _interval(torch.zeros_like(j), j - sz.offset)),
                (LOWER, _interval(lower, torch.full_like(lower, sz.Lq)))]

    def spec(sz):
        docs = _checked_lengths(lengths, sz, "shared_question lengths")
        return IntervalSpec((Interval((Term(COL, -sz.offset),),
                                      (Term(DOC_END, below=question_len, alt=sz.Lq),)),), docs)
    return _ColumnRanges(build, lambda: f"shared_question({question_len}, {answers.tolist()})",
                         spec=spec)


def global_tokens(n: int) -> Mask:
    """The first n tokens are global: query i sees key j iff i < n or j < n (Longformer /
    BigBird global attention; combine with or_, e.g. or_(sliding_window(w), global_tokens(n)))."""
    _check_count("n", n)

    def build(sz):
        j = _cols(sz)
        start = torch.where(j < n, sz.Lq, n)                 # rows >= n masked in columns >= n
        return [(LOWER, _interval(start, torch.full_like(start, sz.Lq)))]

    def spec(sz):
        return IntervalSpec((Interval(hi=(Term(CONST, n, below=n, alt=sz.Lq),)),))
    return _ColumnRanges(build, lambda: f"global_tokens({n})", spec=spec)


def column_ranges(startend_row_indices: torch.Tensor, causal: bool) -> Mask:
    """FlashMask's column-wise mask. Tensor (B|1, Hkv|1, Lk, C) of row indices:

    causal, C=1: rows [LTS, Lq) of column j are masked; causal, C=2: rows [LTS, LTE);
    non-causal, C=2: rows >= LTS and rows < UTE; C=4: [LTS, LTE) and [UTS, UTE).
    With causal the part above the diagonal is masked too.
    """
    t = startend_row_indices
    _check_bool("causal", causal)
    if not isinstance(t, torch.Tensor):
        raise TypeError("startend_row_indices: must be an integer tensor")
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise TypeError(f"startend_row_indices: must be an integer tensor, got {t.dtype}")
    if t.dim() != 4:
        raise ValueError(f"startend_row_indices: must be 4-D (B|1, Hkv|1, Lk, C), "
                         f"got shape {tuple(t.shape)}")
    C = t.shape[-1]
    if C not in ((1, 2, 4) if causal else (2, 4)):
        raise ValueError(f"startend_row_indices: last dim C={C} is not valid with causal={causal} "
                         f"(causal: 1, 2 or 4; non-causal: 2 or 4)")

    def check(sz):
        if not dim_in(t.shape[0], 1, sz.B) or t.shape[2] != sz.Lk:
            raise ValueError(f"startend_row_indices: shape {tuple(t.shape)} must be "
                             f"(B|1, Hkv|1, Lk={sz.Lk}, C)")
        _check_heads_dim("startend_row_indices", t.shape[1], sz)
        if t.device != sz.device:
            raise ValueError(f"startend_row_indices: is on {t.device}, inputs on {sz.device}")

    def build(sz):
        check(sz)
        x = t.to(torch.int64)
        lq = torch.full_like(x[..., 0], sz.Lq)
        zero = torch.zeros_like(lq)
        if C == 1:
            slots = [(LOWER, torch.stack([x[..., 0], lq], -1))]
        elif C == 2 and causal:
            slots = [(GENERAL, x[..., 0:2])]
        elif C == 2:
            slots = [(LOWER, torch.stack([x[..., 0], lq], -1)),
                     (UPPER, torch.stack([zero, x[..., 1]], -1))]
        else:
            slots = [(GENERAL, x[..., 0:2]), (GENERAL, x[..., 2:4])]
        if causal:
            slots.append((UPPER, _interval(torch.zeros_like(_cols(sz)), _cols(sz) - sz.offset)))
        return slots
    def fast(sz):    # one op call giving the static build's padded lists (build_op.py)
        if not build_op.wanted(sz.device):
            return None
        if not _is_compiling() and sz.nQB * sz.nKB > STATIC_MAX_BLOCKS:
            return None      # padded lists too large: the compact build, as without the op
        check(sz)
        return build_op.column_ranges(t, sz, causal)
    return _ColumnRanges(build, lambda: f"column_ranges(<{tuple(t.shape)}>, causal={causal})",
                         device=t.device, kv_heads_hint=t.shape[1], cacheable=False, fast=fast)


# =============================================================== index lists

INDEX_LAYOUTS = ("gather", "blocks", "auto")


class _Indices(Mask):
    def __init__(self, attn_indices: torch.Tensor, causal: bool, validate: bool,
                 layout: str = "gather"):
        if layout not in INDEX_LAYOUTS:
            raise ValueError(f"layout: must be one of {INDEX_LAYOUTS}, got {layout!r}")
        _check_bool("causal", causal)
        _check_bool("validate", validate)
        self.layout = layout
        t = attn_indices
        if not isinstance(t, torch.Tensor):
            raise TypeError("attn_indices: must be an integer tensor")
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"attn_indices: must be int32 or int64, got {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"attn_indices: must be 4-D (B|1, Hkv|1, Lq, W), got shape {tuple(t.shape)}")
        self.indices, self.causal, self.validate = t, causal, validate

    def _parts(self, sz):
        t = self.indices
        if not dim_in(t.shape[0], 1, sz.B) or t.shape[2] != sz.Lq:
            raise ValueError(f"attn_indices: shape {tuple(t.shape)} must be (B|1, Hkv|1, Lq={sz.Lq}, W)")
        if not dim_in(t.shape[1], 1, sz.Hkv):
            raise ValueError(f"attn_indices: head dim {t.shape[1]} must be 1 or Hkv={sz.Hkv}")
        if t.device != sz.device:
            raise ValueError(f"attn_indices: is on {t.device} but the inputs are on {sz.device}")
        if self.validate and static_shapes():
            assert_in_graph((t >= -1) & (t < sz.Lk),
                            "attn_indices: entries must be -1 or in [0, Lk) (checked inside "
                            "torch.compile)")
        elif self.validate and t.numel() > 0:
            lo, hi = int(t.min()), int(t.max())
            if lo < -1 or hi >= sz.Lk:
                raise ValueError(f"attn_indices: entries must be -1 or in [0, Lk={sz.Lk}), "
                                 f"found values in [{lo}, {hi}]")
        idx = t.to(torch.int32)
        if self.causal:
            i = torch.arange(sz.Lq, device=t.device, dtype=torch.int32)[:, None]
            idx = torch.where(idx > i + sz.offset, -1, idx)
        return DescriptorParts(attn_indices=idx.contiguous())

    def _descriptor(self, sz):
        # layout "blocks" / "auto": the lists as block lists + bitmaps (flexsparse/index_blocks.py).
        # Only for the mask used alone: in and_/or_ the combination compiles _parts().
        parts = self._parts(sz)
        # "auto" and "blocks" read the lists (host syncs): eager only, even for GPU tensors
        if self.layout == "gather" or (self.layout == "auto" and _is_compiling()):
            return parts.to_descriptor(sz)
        if _is_compiling():
            raise ValueError("indices: layout='blocks' has data-dependent sizes and cannot be "
                             "built inside torch.compile; compile the mask outside "
                             "(desc = mask.compile(...)) and pass the descriptor")
        block = (sz.block_q, sz.block_k)
        idx = parts.attn_indices
        if self.layout == "auto" and not prefer_blocks(idx, sz.Lq, sz.Lk, block):
            return parts.to_descriptor(sz)
        desc = indices_to_blocks(idx, sz.Lq, sz.Lk, block, num_heads=(sz.Hq, sz.Hkv))
        if desc is not None:
            return desc
        if self.layout == "blocks":
            raise ValueError("indices: layout='blocks' needs lists without repeated keys (a key "
                             "listed twice in one query's list counts twice, a block bitmap "
                             "cannot); use layout='gather' or 'auto'")
        return parts.to_descriptor(sz)

    def _default_device(self):
        return self.indices.device

    def _kv_heads_hint(self, H):
        return self.indices.shape[1] if self.indices.shape[1] != 1 else H

    def __repr__(self):
        extra = "" if self.layout == "gather" else f", layout={self.layout!r}"
        return f"indices(<{tuple(self.indices.shape)}>, causal={self.causal}{extra})"


def indices(attn_indices: torch.Tensor, causal: bool = False, *, validate: bool = True,
            layout: str = "gather") -> Mask:
    """Per-query key lists (B|1, Hkv|1, Lq, W); -1 = inactive; each entry counts once per occurrence.

    causal=True turns entries with j > i + (Lk - Lq) into -1. `validate=False` skips the
    range check (kernels still never read out of bounds).
    `layout`: "gather" (default) runs the index kernels; "blocks" compiles the lists into
    block lists with per-block bitmaps for the block-sparse kernels (fast when neighbouring
    queries share keys: local/dilated windows, clustered top-k; ValueError when a query
    lists a key twice); "auto" takes "blocks" when `index_blocks.prefer_blocks` estimates
    it pays off and the lists have no repeated keys, else "gather". Both non-default
    layouts cost a conversion per compile, with host syncs (eager only; "auto" under
    torch.compile is "gather"): compile the mask once and reuse the descriptor. Used alone only; inside
    and_/or_ the index lists are combined as with "gather".
    """
    return _Indices(attn_indices, causal, validate, layout)


# =============================================================== combinations

def _flatten_children(cls, masks):
    out = []
    for m in masks:
        out.extend(m.children if isinstance(m, cls) else [m])
    return out


class _Combination(Mask):
    """and_/or_ of masks that do not reduce to one column-range mask."""
    NAME = ""

    def __init__(self, children):
        self.children = children

    def _cache_key(self):
        keys = [m._cache_key() for m in self.children]
        return None if None in keys else repr(self)

    def _default_device(self):
        return self.children[0]._default_device()

    def _kv_heads_hint(self, H):
        return min(m._kv_heads_hint(H) for m in self.children)

    def __repr__(self):
        return f"{self.NAME}(" + ", ".join(repr(m) for m in self.children) + ")"


class _And(_Combination):
    NAME = "and_"

    def _parts(self, sz):
        cols = [m for m in self.children if isinstance(m, _ColumnRanges)]
        idx = [m for m in self.children if isinstance(m, _Indices)]
        rest = [m for m in self.children if not isinstance(m, (_ColumnRanges, _Indices))]
        if len(idx) > 1:
            raise NotImplementedError("mask: and_ of two index masks is not supported")
        merged = []
        if cols:
            merged.append(and_(*cols))
        others = merged + rest
        if idx:
            return _filter_indices(idx[0]._parts(sz), others, sz)
        parts = [m._parts(sz) for m in others]
        if len(parts) == 1:
            return parts[0]
        if sum(p.partial_bits is not None for p in parts) > 1:
            return parts_from_visible(_visible_and(parts, sz), sz)
        state = parts[0].state
        for p in parts[1:]:
            state = _and_state(state, p.state, sz)
        dense = [p.dense_mask for p in parts if p.dense_mask is not None]
        crs = [p.col_ranges for p in parts if p.col_ranges is not None]
        bits = [p for p in parts if p.partial_bits is not None]
        dm = None
        for d in dense:
            dm = d if dm is None else _and_dense(dm, d, sz)
        cr = None
        if crs:
            crs = _aligned_heads(crs, sz)
            lead = torch.broadcast_shapes(*[c.shape[:2] for c in crs])
            cr = torch.cat([c.expand(*lead, *c.shape[2:]) for c in crs], -1).contiguous()
        out = DescriptorParts(state=state, dense_mask=dm, col_ranges=cr)
        if bits:
            out.partial_bits_index = bits[0].partial_bits_index
            out.partial_bits = bits[0].partial_bits
        return out


def _and_state(a, b, sz):
    a, b = torch.broadcast_tensors(*_aligned_heads([a, b], sz))
    skip = (a == SKIP) | (b == SKIP)
    full = (a == FULL) & (b == FULL)
    return torch.where(skip, SKIP, torch.where(full, FULL, PARTIAL)).to(torch.int32)


def _and_dense(a, b, sz):
    a, b = _aligned_heads([a, b], sz)
    return a & b


def _visible_and(parts: List[DescriptorParts], sz: Sizes):
    descs = [p.to_descriptor(sz) for p in parts]

    def visible(r0, r1):
        out = descs[0].visible_rows(r0, r1)
        for d in descs[1:]:
            out = out & d.visible_rows(r0, r1)
        return out
    return visible


def _filter_indices(idx_parts: DescriptorParts, others: List[Mask], sz: Sizes) -> DescriptorParts:
    """and_ with an index mask: entries whose (i, j) another mask hides become -1."""
    idx = idx_parts.attn_indices
    if not others:
        return idx_parts
    descs = [m._parts(sz).to_descriptor(sz) for m in others]
    out = []
    step = visibility.chunk_rows(sz.Lq, sz.B * sz.Hq * sz.Lk, 1)
    for r0 in range(0, sz.Lq, step):
        r1 = min(sz.Lq, r0 + step)
        vis = descs[0].visible_rows(r0, r1)
        for d in descs[1:]:
            vis = vis & d.visible_rows(r0, r1)
        if vis.shape[2] > 1:
            raise NotImplementedError("mask: and_ of an index mask with a mask that differs "
                                      "between the query heads of a KV group is not supported")
        vis = vis.squeeze(2)                                   # (b, hkv|1, rows, Lk)
        rows_idx = idx[:, :, r0:r1].to(torch.int64)
        shape = torch.broadcast_shapes(vis.shape[:2], rows_idx.shape[:2])
        vis = vis.expand(*shape, *vis.shape[2:])
        rows_idx = rows_idx.expand(*shape, *rows_idx.shape[2:])
        ok = torch.gather(vis, -1, rows_idx.clamp(0, sz.Lk - 1)) & (rows_idx >= 0)
        out.append(torch.where(ok, rows_idx, -1).to(torch.int32))
    return DescriptorParts(attn_indices=torch.cat(out, dim=2).contiguous())


class _Or(_Combination):
    NAME = "or_"

    def _parts(self, sz):
        descs = [m._parts(sz).to_descriptor(sz) for m in self.children]

        def visible(r0, r1):
            out = descs[0].visible_rows(r0, r1)
            for d in descs[1:]:
                out = out | d.visible_rows(r0, r1)
            return out
        return parts_from_visible(visible, sz)


def _or_slots(slot_lists, sz: Sizes):
    """Masked sets intersect under or_: the product of the interval lists."""
    acc = slot_lists[0]
    for nxt in slot_lists[1:]:
        prod = []
        for ka, a in acc:
            for kb, b in nxt:
                a2, b2 = torch.broadcast_tensors(*_aligned_heads([a, b], sz))
                s = torch.maximum(a2[..., 0], b2[..., 0])
                e = torch.minimum(a2[..., 1], b2[..., 1])
                kind = ka if ka == kb else GENERAL
                prod.append((kind, torch.stack([s, e], -1)))
        acc = _simplify(prod, sz)
    return acc


def and_(*masks: Mask) -> Mask:
    """Visible where every mask is visible."""
    masks = _check_masks("and_", masks)
    if len(masks) == 1:
        return masks[0]
    def text():
        return "and_(" + ", ".join(repr(m) for m in masks) + ")"
    if all(isinstance(m, _ColumnRanges) for m in masks):   # masked intervals: union
        return _owning(_ColumnRanges(lambda sz: [x for m in masks for x in m.slots(sz)], text,
                                     cacheable=all(m.cacheable for m in masks),
                                     spec=_combined_spec(intervals.and_spec, masks)), masks)
    return _And(_flatten_children(_And, masks))


def or_(*masks: Mask) -> Mask:
    """Visible where any mask is visible."""
    masks = _check_masks("or_", masks)
    if len(masks) == 1:
        return masks[0]
    def text():
        return "or_(" + ", ".join(repr(m) for m in masks) + ")"
    if all(isinstance(m, _ColumnRanges) for m in masks):   # masked intervals: intersection
        return _owning(_ColumnRanges(lambda sz: _or_slots([m.slots(sz) for m in masks], sz), text,
                                     cacheable=all(m.cacheable for m in masks),
                                     spec=_combined_spec(intervals.or_spec, masks)), masks)
    return _Or(_flatten_children(_Or, masks))


def _owning(mask: "_ColumnRanges", parts: Sequence["_ColumnRanges"]) -> "_ColumnRanges":
    """A combination of column-range masks owns its tensors where each part owns its own
    or is a value (`cacheable`: its text pins it down), e.g. a document mask from a tensor
    and a sliding window (Mask.owns_tensors). (Not the parts' cache keys: their text may
    hold symbolic sizes inside torch.compile.)"""
    mask.owns_tensors = all(m.owns_tensors or m.cacheable for m in parts)
    return mask


def _combined_spec(combine, masks):
    if any(m.spec is None for m in masks):
        return None
    return lambda sz: combine(*[m.spec(sz) for m in masks])


def _check_masks(name, masks):
    if not masks:
        raise ValueError(f"{name}: needs at least one mask")
    out = []
    for m in masks:
        if isinstance(m, torch.Tensor):
            m = dense(m)
        if not isinstance(m, Mask):
            raise TypeError(f"{name}: expected flexsparse masks, got {type(m).__name__}")
        out.append(m)
    return out


def topk(scores, k: int, causal: bool = False, **kwargs) -> Mask:
    """Flash-DMA's dynamic mask: per query, the k keys with the largest score, as index lists.

    `scores`: (B|1, Hkv|1, Lq, Lk) tensor (e.g. the bias) or a callable (r0, r1) -> rows
    r0..r1-1 of it (then pass num_queries=Lq), so no (Lq, Lk) tensor needs to exist.
    Processed in row chunks on the scores' device, without host syncs; -inf / NaN scores
    are never kept, and rows with fewer than k allowed keys (causal, Lk < k) are -1
    padded. `causal`: key j only for query i with j <= i + (Lk - Lq). Other keyword
    arguments (`chunk_rows`, `num_queries`, `sort`) go to `flexsparse.topk.topk_indices`.
    Returns `indices(lists)`, the lists int32 (B|1, Hkv|1, Lq, k) in `.indices`.
    """
    return indices(topk_indices(scores, k, causal=causal, **kwargs), validate=False)
