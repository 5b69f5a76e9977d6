"""BlockDescriptor: a mask compiled for one set of sizes, holding exactly what the op reads.

Layout and meaning of every tensor: docs/design.md. Per query block, a list of partial
key blocks (element predicates apply) and a list of full key blocks (no predicate); the
transposed lists serve the dK/dV pass; blocks in neither list are skipped. A list is
either explicit, index (Bd, Hd, n, W), or in range form, index (Bd, Hd, n, R, 2) of
half-open block ranges (O(N / block) for the named column-range masks); the count is the
number of blocks either way. For index masks the lists are None and `attn_indices` holds
the per-query key lists.
"""
import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree

from .ops import visibility
from .ops.schema import MAX_RANGES, MaskTensors

SKIP, PARTIAL, FULL = 0, 1, 2
_STATE_CHARS = {SKIP: ".", PARTIAL: "+", FULL: "#"}


@dataclass(eq=False)
class BlockDescriptor:
    seq_lengths: Tuple[int, int]          # (Lq, Lk)
    block_size: Tuple[int, int]           # (block_q, block_k)
    num_heads: Tuple[int, int]            # (Hq, Hkv) it was compiled for
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
    # int32 (2,) = (left, right) where col_ranges are exactly sliding_window(left, right)'s
    # (a hint: kernels may hide scores by the window instead of reading col_ranges; the
    # builder of sliding_window sets it, docs/design.md)
    window: Optional[torch.Tensor] = None

    # ------------------------------------------------------------ construction

    @staticmethod
    def from_block_state(state: torch.Tensor, *, seq_lengths, block_size, num_heads,
                         kv_width: Optional[int] = None, q_width: Optional[int] = None,
                         **predicates) -> "BlockDescriptor":
        """Build the block lists from a block-state tensor (Bd, Hd, nQB, nKB) of SKIP/PARTIAL/FULL.

        Widths, when given, must bound the number of blocks of each kind in a row
        (an analytic mask knows this); they keep the lists O(N) for banded masks.
        """
        # A state whose query-block rows are one row expanded (stride 0: the full mask, a
        # key-padding mask) gives kv lists of that row, expanded the same way: the CUDA
        # forward sees from the stride that every row reads the same lists, so its work
        # tiles need not lie within one descriptor row (csrc/params.h, BlockListParams).
        # Key-block columns expanded from one (the full mask) give q lists of one row the
        # same way: with both, the CUDA backward may walk all query rows in steps that
        # straddle the blocks (csrc/bwd_sm90.cuh, kRowSteps).
        nQB, nKB = state.shape[-2], state.shape[-1]
        one_row = nQB > 1 and state.stride(-2) == 0
        one_col = nKB > 1 and state.stride(-1) == 0
        kv_state = state[..., :1, :] if one_row else state
        st = state.transpose(-1, -2)
        q_state = st[..., :1, :] if one_col else st
        sels = (kv_state == PARTIAL, kv_state == FULL, q_state == PARTIAL, q_state == FULL)
        lists = None
        if not static_shapes():
            lists = _as_ranges(sels)          # few runs of blocks per row: range form
        if lists is None:
            widths = (kv_width, kv_width, q_width, q_width)
            lists = [t for sel, w in zip(sels, widths) for t in _block_lists(sel, w)]
        if one_row:
            lists[:4] = [t.expand(*t.shape[:2], nQB, *t.shape[3:]) for t in lists[:4]]
        if one_col:
            lists[4:] = [t.expand(*t.shape[:2], nKB, *t.shape[3:]) for t in lists[4:]]
        return BlockDescriptor(tuple(seq_lengths), tuple(block_size), tuple(num_heads),
                               *lists, **predicates)

    # ------------------------------------------------------------ what the op reads

    def mask_tensors(self) -> MaskTensors:
        # (written out: a generator of getattr took ~5 µs per call, twice per attention call)
        return MaskTensors(self.kv_count, self.kv_index, self.kv_full_count, self.kv_full_index,
                           self.q_count, self.q_index, self.q_full_count, self.q_full_index,
                           self.dense_mask, self.col_ranges, self.partial_bits_index,
                           self.partial_bits, self.attn_indices, self.window)

    @property
    def is_index_mask(self) -> bool:
        return self.attn_indices is not None

    @property
    def device(self) -> torch.device:
        t = self.attn_indices if self.is_index_mask else self.kv_count
        return t.device

    @property
    def has_ranges(self) -> bool:
        """True when some block list is in range form (index (Bd, Hd, n, R, 2) of [lo, hi))."""
        return any(t is not None and t.dim() == 5 for t in
                   (self.kv_index, self.kv_full_index, self.q_index, self.q_full_index))

    def with_lists(self) -> "BlockDescriptor":
        """The same descriptor with every range-form list expanded to explicit indices
        (padded to the longest row: O(nQB x nKB) for dense-ish masks)."""
        if not self.has_ranges:
            return self
        nQB = -(-self.seq_lengths[0] // self.block_size[0])
        nKB = -(-self.seq_lengths[1] // self.block_size[1])
        out = {}
        for name, n in (("kv_index", nKB), ("kv_full_index", nKB), ("q_index", nQB),
                        ("q_full_index", nQB)):
            index = getattr(self, name)
            if index.dim() == 5:
                count = getattr(self, name.replace("_index", "_count"))
                hit = visibility.ranges_to_grid(index, n, count)
                width = int(hit.sum(-1).max()) if hit.numel() else 0
                index = _block_lists(hit, width)[1]
            out[name] = index
        return dataclasses.replace(self, **out)

    # ------------------------------------------------------------ reading it back

    def block_state(self) -> torch.Tensor:
        """int32 (Bd, Hd, nQB, nKB) of SKIP / PARTIAL / FULL (block masks only)."""
        if self.is_index_mask:
            raise ValueError("mask: an index mask has no block state")
        nKB = -(-self.seq_lengths[1] // self.block_size[1])
        return visibility.block_state(self.mask_tensors(), 0, self.kv_count.shape[-1], nKB,
                                      self.device)

    def visible_rows(self, r0: int, r1: int) -> torch.Tensor:
        """Group-form bool (b, hkv|1, g|1, r1-r0, Lk): what query rows [r0, r1) may see.

        For block masks r0 must be a multiple of block_q.
        """
        Lq, Lk = self.seq_lengths
        Hq, Hkv = self.num_heads
        G = Hq // Hkv
        if self.is_index_mask:
            idx = self.attn_indices[:, :, r0:r1].to(torch.int64)
            valid = (idx >= 0) & (idx < Lk)
            hits = torch.zeros(idx.shape[:-1] + (Lk,), dtype=torch.int32, device=idx.device)
            hits.scatter_add_(-1, torch.where(valid, idx, 0), valid.to(torch.int32))
            return visibility.to_groups(hits > 0, Hkv, G)
        bq, bk = self.block_size
        return visibility.visible_rows(self.mask_tensors(), r0, r1, Lk, bq, bk, Hkv, G)

    def to_dense(self) -> torch.Tensor:
        """bool (B|1, H|1, Lq, Lk), H the query heads (or 1 / Hkv when the mask is shared)."""
        Lq, _ = self.seq_lengths
        return groups_to_heads(self.visible_rows(0, Lq), self.num_heads)

    def num_visible(self, batch: int = 1) -> int:
        """Visible (query, key) pairs summed over batch and query heads, computed in row chunks."""
        Lq, Lk = self.seq_lengths
        Hq, Hkv = self.num_heads
        step = visibility.chunk_rows(Lq, Hq * Lk, self.block_size[0])
        total = 0
        for r0 in range(0, Lq, step):
            vis = self.visible_rows(r0, min(Lq, r0 + step))
            b, h, g = vis.shape[:3]
            n = int(vis.sum())
            total += n * (batch // b) * (Hkv // h) * (Hq // Hkv // g)
        return total

    def __str__(self) -> str:
        Lq, Lk = self.seq_lengths
        head = (f"BlockDescriptor(Lq={Lq}, Lk={Lk}, block_size={self.block_size}, "
                f"heads={self.num_heads}")
        if self.is_index_mask:
            return head + f", attn_indices={tuple(self.attn_indices.shape)})"
        state = self.block_state()
        preds = [n for n in ("dense_mask", "col_ranges", "partial_bits") if getattr(self, n) is not None]
        lines = [head + f", predicates={preds})"]
        Bd, Hd = state.shape[:2]
        for b in range(min(Bd, 2)):
            for h in range(min(Hd, 2)):
                lines.append(f"[b={b}, h={h}]  # full, + partial, . skipped")
                for row in state[b, h].tolist():
                    lines.append("".join(_STATE_CHARS[x] for x in row))
        return "\n".join(lines)

    __repr__ = __str__


# ---- static shapes: building without reading the data on the host

# Masks that hold GPU tensors are built at static shapes (full-width lists, no decision
# on the data, so no host synchronization and CUDA-graph capturable) when a (b, h) slice
# has at most this many blocks (128K tokens at block 128); beyond, the compact O(N)
# lists, whose sizes are read on the host (one synchronization per build).
STATIC_MAX_BLOCKS = 1 << 20
_STATIC = contextvars.ContextVar("flexsparse_static_shapes", default=False)


def static_shapes() -> bool:
    """Build at static shapes: inside torch.compile, and inside `building_static()`."""
    return torch.compiler.is_compiling() or _STATIC.get()


@contextlib.contextmanager
def building_static(on: bool = True):
    token = _STATIC.set(on)
    try:
        yield
    finally:
        _STATIC.reset(token)


def groups_to_heads(vis: torch.Tensor, num_heads) -> torch.Tensor:
    """Group form (b, hkv|1, g|1, ...) -> head form (b, H, ...) with H in {1, Hkv, Hq}."""
    Hq, Hkv = num_heads
    if vis.shape[2] > 1:
        return vis.expand(vis.shape[0], Hkv, *vis.shape[2:]).flatten(1, 2)
    return vis.squeeze(2)


def _as_ranges(selections):
    """(count, ranges) pairs of bool block grids (.., n, N) when every row is at most
    MAX_RANGES runs of blocks, else None (one host sync)."""
    runs = []
    for sel in selections:
        prev = torch.nn.functional.pad(sel[..., :-1], (1, 0), value=False)
        runs.append(sel & ~prev)
    widest = torch.stack([r.sum(-1).amax() if r.numel() else r.new_zeros((), dtype=torch.int64)
                          for r in runs])
    if int(widest.max()) > MAX_RANGES:
        return None
    out = []
    for sel, start in zip(selections, runs):
        N = sel.shape[-1]
        pos = torch.arange(N, device=sel.device)
        nxt = torch.nn.functional.pad(sel[..., 1:], (0, 1), value=False)
        end = sel & ~nxt
        k = min(MAX_RANGES, N)
        lo = torch.where(start, pos, N).topk(k, -1, largest=False).values
        hi = torch.where(end, pos + 1, N).topk(k, -1, largest=False).values
        rng = torch.stack([lo, hi], -1).to(torch.int32)
        if k < MAX_RANGES:
            rng = torch.nn.functional.pad(rng, (0, 0, 0, MAX_RANGES - k), value=N)
        out += [sel.sum(-1, dtype=torch.int32), rng.contiguous()]
    return out


def _block_lists(selected: torch.Tensor, width: Optional[int]):
    """Counts and ascending indices of the True entries of the last dim, padded to `width`."""
    # A stable partition by scatter (True entries first, each group in index order), the
    # result of a stable argsort of ~selected: a sort cost ~120 us of host time per call
    # on the H100 and is one of few ops Inductor leaves unfused (docs/dynamic-masks.md).
    ones = selected.to(torch.int32)
    count = ones.sum(-1, dtype=torch.int32)
    before = torch.cumsum(ones, -1, dtype=torch.int32) - ones      # True entries before
    pos = torch.arange(selected.shape[-1], device=selected.device, dtype=torch.int32)
    dest = torch.where(selected, before, count[..., None] + (pos - before))
    order = torch.empty_like(dest).scatter_(-1, dest.to(torch.int64), pos.expand_as(dest))
    if width is not None:
        order = order[..., :max(1, width)]
    return count, order.contiguous()


# ---- checks that hold inside torch.compile (docs/dynamic-masks.md)

def dim_in(n, *allowed) -> bool:
    """`n in allowed` for sizes, written with `==`: under torch.compile a size that Dynamo
    has specialized to an int compared with `in` against a symbolic size is False even
    when the two are equal (a (B, n) lengths tensor was refused with "batch dim 2 must be
    1 or B=2"); `==` compares symbolically and guards."""
    for a in allowed:
        if n == a:
            return True
    return False


@torch.library.custom_op("flexsparse::check_sizes", mutates_args=())
def _check_sizes_op(got: List[int], want: List[int], message: str) -> None:
    if list(got) != list(want):
        raise ValueError(_size_message(message, got, want))


@_check_sizes_op.register_fake
def _check_sizes_fake(got, want, message) -> None:
    return None


try:    # keep the check in compiled graphs: an op without outputs is otherwise removed
    torch.library._register_effectful_op("flexsparse::check_sizes",
                                         torch.library.EffectType.ORDERED)
except (AttributeError, TypeError):        # pragma: no cover - other torch versions
    pass


def _size_message(message: str, got, want) -> str:
    got, want = tuple(int(x) for x in got), tuple(int(x) for x in want)
    return message.format(got=got[0] if len(got) == 1 else got,
                          want=want[0] if len(want) == 1 else want)


def check_sizes(got: Sequence, want: Sequence, message: str) -> None:
    """ValueError(message) unless the sizes `got` equal `want`; `message` may name
    {got} and {want} (a number for one size, else a tuple).

    Eager, the check runs here. Under torch.compile it is an op of the graph
    (`flexsparse::check_sizes`, registered as effectful so that it is kept) that raises
    the ValueError when the graph runs, with the actual numbers: no guard on the sizes, so
    no recompilation, and a readable error from the compiled call instead of Dynamo's
    "Observed exception" with symbols."""
    got, want = tuple(got), tuple(want)
    # (under Dynamo isinstance(size, int) is True for symbolic sizes too: no shortcut)
    if not torch.compiler.is_compiling():
        if got != want:
            raise ValueError(_size_message(message, got, want))
        return
    torch.ops.flexsparse.check_sizes(list(got), list(want), message)


def assert_in_graph(ok: torch.Tensor, message: str) -> None:
    """Under torch.compile, a value check that needs the data (e.g. document lengths
    summing to L): `torch._assert_async(ok.all(), message)`, a graph op with no host
    sync. It raises RuntimeError(message) when the graph runs on CPU; on CUDA it is a
    device-side assert (the process's CUDA context is lost, the message is not shown).
    `torch._check` on `.item()` values would need capture_scalar_outputs and still
    drops the message, so it is not used."""
    torch._assert_async(ok.all(), message)


# ---- builders: the parts every mask kind compiles to, and the generic bitmap builder

@dataclass(frozen=True)
class Sizes:
    """The sizes a mask is compiled for."""
    B: int
    Hq: int
    Hkv: int
    Lq: int
    Lk: int
    block_q: int
    block_k: int
    device: torch.device

    @property
    def nQB(self):
        return -(-self.Lq // self.block_q)

    @property
    def nKB(self):
        return -(-self.Lk // self.block_k)

    @property
    def offset(self):
        return self.Lk - self.Lq


@dataclass
class DescriptorParts:
    """A compiled mask before its block lists are built: the block state and the
    element predicates (`to_descriptor` builds the lists)."""
    state: Optional[torch.Tensor] = None          # (Bd, Hd, nQB, nKB) SKIP/PARTIAL/FULL
    dense_mask: Optional[torch.Tensor] = None
    col_ranges: Optional[torch.Tensor] = None
    partial_bits_index: Optional[torch.Tensor] = None
    partial_bits: Optional[torch.Tensor] = None
    attn_indices: Optional[torch.Tensor] = None

    def to_descriptor(self, sz: Sizes) -> BlockDescriptor:
        common = dict(seq_lengths=(sz.Lq, sz.Lk), block_size=(sz.block_q, sz.block_k),
                      num_heads=(sz.Hq, sz.Hkv))
        if self.attn_indices is not None:
            return BlockDescriptor(common["seq_lengths"], common["block_size"],
                                   common["num_heads"], attn_indices=self.attn_indices)
        return BlockDescriptor.from_block_state(
            self.state, **common, dense_mask=self.dense_mask, col_ranges=self.col_ranges,
            partial_bits_index=self.partial_bits_index, partial_bits=self.partial_bits)



def pack_bits(vis: torch.Tensor) -> torch.Tensor:
    """bool (..., bk) -> int32 (..., ceil(bk/32)); bit c%32 of word c//32."""
    bk = vis.shape[-1]
    nw = -(-bk // 32)
    v = torch.nn.functional.pad(vis, (0, nw * 32 - bk)).view(*vis.shape[:-1], nw, 32)
    weights = torch.tensor([1 << c for c in range(32)], dtype=torch.int64, device=vis.device)
    words = (v.to(torch.int64) * weights).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def parts_from_visible(visible: Callable[[int, int], torch.Tensor], sz: Sizes) -> DescriptorParts:
    """Block state + bitmaps of partial blocks from a row-chunk visibility function.

    `visible(r0, r1)` returns group form (b, hkv|1, g|1, rows, Lk). Memory stays
    O(rows x Lk) per step plus the bits of partial blocks. Eager only (data-dependent sizes):
    inside torch.compile a ValueError saying so, instead of Dynamo's "Could not guard on
    data-dependent expression" from deep inside.
    """
    if torch.compiler.is_compiling():
        raise ValueError(
            "mask: this mask is evaluated element-wise into block bitmaps (block_sparse at "
            "another block size than the call, or_/and_ mixing index lists or dense masks "
            "with other kinds, converted FlexAttention masks at another block size), which "
            "has data-dependent sizes and is not done inside torch.compile; compile it "
            "outside (desc = mask.compile(B, Hq, Hkv, Lq, Lk, block_size=...)) and pass the "
            "descriptor, or for block_sparse pass the block_size of its layout")
    bq, bk = sz.block_q, sz.block_k
    step = visibility.chunk_rows(sz.Lq, sz.B * sz.Hq * sz.Lk, bq)
    states, bit_chunks, index_chunks = [], [], []
    n_bits = 0
    for r0 in range(0, sz.Lq, step):
        r1 = min(sz.Lq, r0 + step)
        vis = groups_to_heads(visible(r0, r1), (sz.Hq, sz.Hkv))     # (b, h, rows, Lk)
        b, h, rows, _ = vis.shape
        nq = -(-rows // bq)
        padded = torch.nn.functional.pad(vis, (0, sz.nKB * bk - sz.Lk, 0, nq * bq - rows))
        tiles = padded.view(b, h, nq, bq, sz.nKB, bk).permute(0, 1, 2, 4, 3, 5)  # b h nq nk bq bk
        in_range = torch.nn.functional.pad(
            torch.ones((rows, sz.Lk), dtype=torch.bool, device=vis.device),
            (0, sz.nKB * bk - sz.Lk, 0, nq * bq - rows)).view(nq, bq, sz.nKB, bk).permute(0, 2, 1, 3)
        any_ = tiles.any(-1).any(-1)
        all_ = (tiles | ~in_range).all(-1).all(-1)
        state = torch.where(all_, FULL, torch.where(any_, PARTIAL, SKIP)).to(torch.int32)
        partial = state == PARTIAL
        index = torch.full(state.shape, -1, dtype=torch.int32, device=vis.device)
        n = int(partial.sum())
        index[partial] = torch.arange(n_bits, n_bits + n, dtype=torch.int32, device=vis.device)
        bit_chunks.append(pack_bits(tiles[partial]))
        n_bits += n
        states.append(state)
        index_chunks.append(index)
    state = cat_rows(states)
    index = cat_rows(index_chunks)
    bits = torch.cat(bit_chunks) if bit_chunks else torch.zeros(
        (0, bq, -(-bk // 32)), dtype=torch.int32, device=sz.device)
    if n_bits == 0:
        return DescriptorParts(state=state)
    return DescriptorParts(state=state, partial_bits_index=index, partial_bits=bits.contiguous())


def cat_rows(chunks):
    shape = torch.broadcast_shapes(*[c.shape[:2] for c in chunks])
    return torch.cat([c.expand(*shape, *c.shape[2:]) for c in chunks], dim=2).contiguous()


# ---- pytree: descriptors can flow through torch.compile'd functions and torch.export

def _flatten(d: BlockDescriptor):
    names = [f.name for f in dataclasses.fields(d)][3:]
    return [getattr(d, n) for n in names], (d.seq_lengths, d.block_size, d.num_heads)


def _unflatten(children, context):
    return BlockDescriptor(*context, *children)


def _flatten_with_keys(d: BlockDescriptor):
    children, context = _flatten(d)
    names = [f.name for f in dataclasses.fields(d)][3:]
    return [(pytree.GetAttrKey(n), c) for n, c in zip(names, children)], context


pytree.register_pytree_node(BlockDescriptor, _flatten, _unflatten,
                            flatten_with_keys_fn=_flatten_with_keys)
