"""FlexAttention interop: BlockMask / mask_mod -> flexsparse masks, and back.

    from torch.nn.attention.flex_attention import create_block_mask
    bm = create_block_mask(mask_mod, B, H, L, L, device="cuda")
    out = flexsparse.attention(q, k, v, bm)                     # same as flex_attention(q, k, v, block_mask=bm)
    m = flexsparse.flex.from_mask_mod(mask_mod, B, H, L, L)     # no BlockMask, no (L, L) tensor
    bm2 = flexsparse.flex.to_block_mask(masks.causal(), B, H, L, L)   # any mask or BlockDescriptor

Semantics follow FlexAttention's kernels: for each (query block, key block) the
BlockMask lists the block as full (attended, mask_mod never called), partial (mask_mod
decides element by element) or not at all (skipped); positions past the sequence
lengths are masked; mask_mod is called with the actual batch index and query head even
when the BlockMask's batch/head dims broadcast. Rows that see nothing give output 0 and
lse -inf, as in FlexAttention.

Costs (docs/flex.md has the table): `from_block_mask` calls mask_mod only inside the
partial blocks (O(partial blocks x block area), i.e. O(N x block) for causal, sliding
windows and documents) plus O(size of the BlockMask's own lists). `from_mask_mod`
evaluates every element once in tiles (O(Lq x Lk) time, O(tile + visited blocks +
partial bits) memory) unless `recognize=True`, which finds the per-column visible row
interval by binary search (O(Lk log Lq) calls) and checks it on probes; a recognized
mask is a flexsparse column-range mask whose descriptor builds in O(N).
"""
import itertools
import math
from typing import Optional

import torch

from . import build_op
from . import masks as masks_mod
from .blocklists import descriptor_from_entries
from .descriptor import (FULL, PARTIAL, BlockDescriptor, DescriptorParts, Sizes, assert_in_graph,
                         check_sizes, dim_in, pack_bits, parts_from_visible)
from .masks import Mask

# Elements of mask_mod evaluated per vectorized call (bounds the transient memory).
EVAL_CHUNK = 1 << 22
# Counters for tests: how many (b, h, q, kv) points were passed to a mask_mod.
STATS = {"mask_mod_points": 0}


def _flex():
    import torch.nn.attention.flex_attention as fa
    return fa


def _transform_ctx():
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    return TransformGetItemToIndex()


# ------------------------------------------------------------------ evaluating mask_mod

def _eval_points(mask_mod, b, h, q, kv) -> torch.Tensor:
    """mask_mod at flat points (all int64 of one shape (n,)) -> bool (n,)."""
    f = torch.vmap(mask_mod, in_dims=(0, 0, 0, 0))
    out = torch.empty(q.shape, dtype=torch.bool, device=q.device)
    for s in range(0, q.numel(), EVAL_CHUNK):
        e = min(q.numel(), s + EVAL_CHUNK)
        with _transform_ctx():
            r = f(b[s:e], h[s:e], q[s:e], kv[s:e])
        out[s:e] = r.to(torch.bool).expand(e - s)
        STATS["mask_mod_points"] += e - s
    return out


def _eval_blocks(mask_mod, b, h, qb, kb, bq, bk, Lq, Lk) -> torch.Tensor:
    """mask_mod inside the blocks (b, h, qb, kb) (each int64 (P,)) -> bool (P, bq, bk).

    Only in-range positions are passed to mask_mod (others are clamped, then masked).
    """
    device = qb.device
    P = qb.numel()
    out = torch.empty((P, bq, bk), dtype=torch.bool, device=device)
    if P == 0:
        return out
    f = torch.vmap(mask_mod, in_dims=(None, None, None, 0))
    f = torch.vmap(f, in_dims=(None, None, 0, None))
    f = torch.vmap(f, in_dims=(0, 0, 0, 0))
    r = torch.arange(bq, device=device)
    c = torch.arange(bk, device=device)
    step = max(1, EVAL_CHUNK // (bq * bk))
    for s in range(0, P, step):
        e = min(P, s + step)
        q = qb[s:e, None] * bq + r
        kv = kb[s:e, None] * bk + c
        inr = (q < Lq)[:, :, None] & (kv < Lk)[:, None, :]
        with _transform_ctx():
            v = f(b[s:e], h[s:e], q.clamp(max=Lq - 1), kv.clamp(max=Lk - 1))
        out[s:e] = v.to(torch.bool).expand(e - s, bq, bk) & inr
        STATS["mask_mod_points"] += (e - s) * bq * bk
    return out


def _eval_grid(mask_mod, Be, He, q0, q1, k0, k1, device) -> torch.Tensor:
    """mask_mod on the grid b < Be, h < He, q in [q0, q1), kv in [k0, k1) -> bool (Be, He, rows, cols)."""
    fa = _flex()
    f = fa._vmap_for_bhqkv(mask_mod, prefix=())
    ar = lambda a, z: torch.arange(a, z, device=device)  # noqa: E731
    with _transform_ctx():
        v = f(ar(0, Be), ar(0, He), ar(q0, q1), ar(k0, k1))
    if not torch.compiler.is_compiling():     # (a global counter would guard the graph)
        STATS["mask_mod_points"] += Be * He * (q1 - q0) * (k1 - k0)
    return v.to(torch.bool).expand(Be, He, q1 - q0, k1 - k0)


def _block_flags(vis: torch.Tensor, qb: torch.Tensor, kb: torch.Tensor, bq, bk, Lq, Lk):
    """(any visible, all in-range visible) per block of vis (P, bq, bk)."""
    r = torch.arange(bq, device=vis.device)
    c = torch.arange(bk, device=vis.device)
    inr = ((qb[:, None] * bq + r) < Lq)[:, :, None] & ((kb[:, None] * bk + c) < Lk)[:, None, :]
    return vis.flatten(1).any(1), (vis | ~inr).flatten(1).all(1)


# ------------------------------------------------------------------ a mask compiled at its own block size

class _BlockListMask(Mask):
    """A mask held as block entries + partial-block bitmaps at a fixed block size.

    `build(B, Hq, device)` returns dict(dims=(Bd, Hd), bh, qb, kb, full, pbits_index, bits)
    for the sizes asked; compile() uses this block size whatever block_size it is given
    (a FlexAttention BlockMask fixes it). Inside and_/or_ with another block size it is
    re-evaluated element-wise in row chunks.
    """

    def __init__(self, seq_lengths, block_size, build, text, device, dims_ok, traced=None):
        # Sizes stay symbolic inside torch.compile (int() would specialize the graph).
        self.seq_lengths = tuple(x if torch.compiler.is_compiling() else int(x)
                                 for x in seq_lengths)
        self.block = tuple(int(x) for x in block_size)
        self.build, self.text, self.device, self.dims_ok = build, text, torch.device(device), dims_ok
        # traced(sz) -> the element visibility, bool (b, h, Lq, Lk): the path taken inside
        # torch.compile, where the block lists' data-dependent sizes cannot be built.
        self.traced = traced
        self._cache = {}

    def _default_device(self):
        return self.device

    def __repr__(self):
        return self.text

    def _check(self, sz: Sizes):
        if torch.compiler.is_compiling():   # the message must be a constant string there
            check_sizes((sz.Lq, sz.Lk), self.seq_lengths, "mask: a converted FlexAttention "
                        "mask was made for (Lq, Lk)={want}, inputs have {got}")
        else:
            check_sizes((sz.Lq, sz.Lk), self.seq_lengths,
                        f"mask: {self.text} was made for (Lq, Lk)={{want}}, inputs have {{got}}")
        if sz.device != self.device:
            raise ValueError(f"mask: {self.text} is on {self.device}, inputs on {sz.device}")
        self.dims_ok(sz.B, sz.Hq)

    def descriptor(self, B: int, Hq: int, Hkv: int) -> BlockDescriptor:
        key = (B, Hq)
        if key not in self._cache:
            self._cache[key] = self.build(B, Hq)
        e = self._cache[key]
        Lq, Lk = self.seq_lengths
        bq, bk = self.block
        return descriptor_from_entries(
            e["dims"], -(-Lq // bq), -(-Lk // bk), e["bh"], e["qb"], e["kb"], e["full"],
            order=e.get("order"), seq_lengths=self.seq_lengths, block_size=self.block,
            num_heads=(Hq, Hkv), partial_bits_index=e["pbits_index"], partial_bits=e["bits"])

    def _descriptor(self, sz: Sizes) -> BlockDescriptor:
        self._check(sz)
        if torch.compiler.is_compiling():
            return build_op.descriptor_of(self._parts(sz), sz)
        return self.descriptor(sz.B, sz.Hq, sz.Hkv)

    def _parts(self, sz: Sizes) -> DescriptorParts:
        self._check(sz)
        if torch.compiler.is_compiling():
            if self.traced is None:
                raise ValueError(f"mask: {self.text} cannot be built inside torch.compile; "
                                 "build it outside and pass it in")
            Lq, Lk = self.seq_lengths
            # The traced path needs equal sizes to build its graph: compared here (a guard;
            # only a call with other sizes retraces, and raises).
            if not (Lq == sz.Lq and Lk == sz.Lk):
                raise ValueError(f"mask: a converted FlexAttention mask was made for (Lq, Lk)="
                                 f"({int(Lq)}, {int(Lk)}), inputs have ({int(sz.Lq)}, "
                                 f"{int(sz.Lk)})")
            return masks_mod.dense(self.traced(sz))._parts(sz)
        d = self.descriptor(sz.B, sz.Hq, sz.Hkv)
        if (sz.block_q, sz.block_k) == self.block:
            return DescriptorParts(state=d.block_state(), partial_bits_index=d.partial_bits_index,
                          partial_bits=d.partial_bits)
        bq = self.block[0]

        def visible(r0, r1):
            a = r0 // bq * bq
            return d.visible_rows(a, r1)[..., r0 - a:, :]
        return parts_from_visible(visible, sz)


def _entries_to_build(dims, bh, qb, kb, full, bits_by_entry, nQB, nKB, order=None):
    """Finish a build: partial entries keep bitmaps (P, bq, nw) in entry order."""
    Bd, Hd = dims
    device = qb.device
    partial = ~full
    P = int(partial.sum())
    pbi, bits = None, None
    if P:
        pbi = torch.full((Bd, Hd, nQB, nKB), -1, dtype=torch.int32, device=device)
        pbi.view(-1)[(bh[partial] * nQB + qb[partial]) * nKB + kb[partial]] = torch.arange(
            P, dtype=torch.int32, device=device)
        bits = bits_by_entry.contiguous()
    return dict(dims=dims, bh=bh, qb=qb, kb=kb, full=full, pbits_index=pbi, bits=bits,
                order=order)


# ------------------------------------------------------------------ BlockMask -> flexsparse

def _list_entries(count, index, nQB, nKB):
    """(index, valid) of one BlockMask list pair, int64 (B_, H_, nQB, W): an entry is valid
    within its row's count and inside the block grid."""
    c = count[..., :nQB].to(torch.int64)
    idx = index[..., :nQB, :].to(torch.int64)
    W = idx.shape[-1]
    valid = (torch.arange(W, device=idx.device) < c[..., None]) & (idx >= 0) & (idx < nKB)
    return idx, valid


def _listed_state(count, index, nQB, nKB, state, times, value):
    """Mark the blocks of one BlockMask list pair in state (B_, H_, nQB, nKB + 1) with
    `value`, and count them in `times`; static shapes (column nKB takes invalid entries)."""
    idx, valid = _list_entries(count, index, nQB, nKB)
    slot = torch.where(valid, idx, nKB)
    state.scatter_(-1, slot, torch.full_like(slot, value, dtype=state.dtype))
    times.scatter_add_(-1, slot, valid.to(times.dtype))


def _traced_visibility(bm, mask_mod, Be, He, Lq, Lk, bq, bk):
    """The BlockMask's element visibility, bool (Be, He, Lq, Lk), at static shapes: full
    blocks all visible, partial blocks mask_mod (evaluated on the whole grid, at the inputs'
    batch and heads where the BlockMask broadcasts, as FlexAttention calls it), the rest
    hidden. A block listed twice fails the graph (torch._assert_async)."""
    nQB, nKB = -(-Lq // bq), -(-Lk // bk)
    B_, H_ = bm.kv_num_blocks.shape[:2]
    device = bm.kv_num_blocks.device
    state = torch.zeros((B_, H_, nQB, nKB + 1), dtype=torch.int32, device=device)
    times = torch.zeros_like(state)
    _listed_state(bm.kv_num_blocks, bm.kv_indices, nQB, nKB, state, times, PARTIAL)
    if bm.full_kv_num_blocks is not None:
        _listed_state(bm.full_kv_num_blocks, bm.full_kv_indices, nQB, nKB, state, times, FULL)
    assert_in_graph(times[..., :nKB] <= 1,
                    "block_mask: a block is listed twice (in both the partial and the full "
                    "lists, or twice in one list) (checked inside torch.compile)")
    # FlexAttention reads list (b % B_, h % H_)
    state = state[..., :nKB].repeat(Be // B_, He // H_, 1, 1)
    # block state per element by index (an expand + reshape to nQB * bq rows guarded
    # the graph on Lq being a multiple of bq)
    rows = (torch.arange(Lq, device=device) // bq)[:, None]
    cols = (torch.arange(Lk, device=device) // bk)[None, :]
    elem = lambda t: t[:, :, rows, cols]  # noqa: E731
    grid = _eval_grid(mask_mod, Be, He, 0, Lq, 0, Lk, device)
    return elem(state == FULL) | (elem(state == PARTIAL) & grid)


def _bm_entries(count, index, nQB, nKB, full_flag):
    """Valid (b, h, qb, kb) of one BlockMask list pair."""
    idx, valid = _list_entries(count, index, nQB, nKB)
    b, h, q, w = valid.nonzero(as_tuple=True)
    kb = idx[b, h, q, w]
    return b, h, q, kb, torch.full_like(q, full_flag, dtype=torch.bool)


def from_block_mask(block_mask, *, assume_broadcast: bool = False) -> Mask:
    """An exact flexsparse mask for a FlexAttention BlockMask.

    `flexsparse.attention(q, k, v, from_block_mask(bm))` computes what
    `flex_attention(q, k, v, block_mask=bm)` computes. The descriptor uses the BlockMask's
    BLOCK_SIZE. Full blocks stay full (mask_mod is never called there); mask_mod is
    evaluated only inside partial blocks (chunked) and stored as partial-block bitmaps;
    a partial block that turns out all visible becomes full, one with nothing visible
    is dropped. FlexAttention calls mask_mod with the real batch index and query head
    even when the BlockMask broadcasts over them; so by default the bitmaps are checked
    for every (b, h) of the inputs and kept per (b, h) when they differ.
    `assume_broadcast=True` skips that check (evaluates b = h = 0 only).

    A block listed twice (in both lists, or twice in one) is rejected: FlexAttention's
    kernels would process it twice, which flexsparse cannot express.
    """
    bm = block_mask
    compiling = torch.compiler.is_compiling()
    Lq, Lk = (x if compiling else int(x) for x in bm.seq_lengths)
    bq, bk = (int(x) for x in bm.BLOCK_SIZE)
    if bq <= 0 or bk <= 0 or bq >= (1 << 30):
        raise ValueError(f"block_mask: unsupported BLOCK_SIZE {bm.BLOCK_SIZE} (the empty "
                         "BlockMask of flex_attention(block_mask=None) is mask=None here)")
    if bm.kv_num_blocks.dim() != 3:
        raise ValueError(f"block_mask: expected kv_num_blocks of shape (B, H, nQB), got "
                         f"{tuple(bm.kv_num_blocks.shape)}")
    nQB, nKB = -(-Lq // bq), -(-Lk // bk)
    B_, H_ = bm.kv_num_blocks.shape[:2]
    mask_mod = bm.mask_mod
    device = bm.kv_num_blocks.device
    if bm.kv_indices.shape[-2] < nQB:
        raise ValueError(f"block_mask: lists have {bm.kv_indices.shape[-2]} query-block rows, "
                         f"need {nQB} for its seq_lengths")

    def dims_ok(B, Hq):
        if B % B_ or Hq % H_:
            raise ValueError(f"block_mask: batch/head dims ({B_}, {H_}) do not divide the "
                             f"inputs' (B={B}, Hq={Hq})")

    def traced(sz):
        Be = B_ if (assume_broadcast or B_ != 1) else sz.B
        He = H_ if (assume_broadcast or H_ != 1) else sz.Hq
        return _traced_visibility(bm, mask_mod, Be, He, Lq, Lk, bq, bk)

    text = ("from_block_mask(<BlockMask> inside torch.compile)" if compiling else
            f"from_block_mask(<BlockMask {tuple(bm.kv_num_blocks.shape[:2])}, "
            f"seq_lengths={(Lq, Lk)}, BLOCK_SIZE={(bq, bk)}>)")
    if compiling:      # the eager lists below have data-dependent sizes
        mask = _BlockListMask((Lq, Lk), (bq, bk), None, text, device, dims_ok, traced)
        mask.known_sizes = (B_, H_, Lq, Lk)
        return mask
    lists = [_bm_entries(bm.kv_num_blocks, bm.kv_indices, nQB, nKB, False)]
    if bm.full_kv_num_blocks is not None:
        lists.append(_bm_entries(bm.full_kv_num_blocks, bm.full_kv_indices, nQB, nKB, True))
    b0, h0, q0, k0, f0 = (torch.cat(x) for x in zip(*lists))

    def build(B, Hq):
        Bt = B_ if dim_in(B_, 1, B) else B
        Ht = H_ if dim_in(H_, 1, Hq) else Hq
        b, h, q, k, f = b0, h0, q0, k0, f0
        if (Bt, Ht) != (B_, H_):          # FlexAttention reads list (b % B_, h % H_)
            b, h, q, k, f = _tile(b, h, q, k, f, B_, H_, Bt, Ht)
        key = ((b * Ht + h) * nQB + q) * nKB + k
        key, order = torch.sort(key)
        if key.numel() > 1 and bool((key[1:] == key[:-1]).any()):
            raise ValueError("block_mask: a block is listed twice (in both the partial and the "
                             "full lists, or twice in one list); FlexAttention would process it "
                             "twice, which flexsparse does not support")
        b, h, q, k, f = b[order], h[order], q[order], k[order], f[order]
        p = ~f
        pb, ph, pq, pk = b[p], h[p], q[p], k[p]
        vis = _eval_blocks(mask_mod, pb, ph, pq, pk, bq, bk, Lq, Lk)
        if not assume_broadcast and (Bt == 1 < B or Ht == 1 < Hq):
            same = True
            for db, dh in itertools.product(range(B if Bt == 1 else 1),
                                             range(Hq if Ht == 1 else 1)):
                if (db, dh) == (0, 0):
                    continue
                other = _eval_blocks(mask_mod, pb + db, ph + dh, pq, pk, bq, bk, Lq, Lk)
                if not torch.equal(other, vis):
                    same = False
                    break
            if not same:   # mask_mod depends on b/h beyond the lists: keep per (b, h)
                return build_full(B, Hq)
        return _classify(b, h, q, k, f, vis, (Bt, Ht), Ht)

    def build_full(B, Hq):
        b, h, q, k, f = _tile(b0, h0, q0, k0, f0, B_, H_, B, Hq)
        key, order = torch.sort(((b * Hq + h) * nQB + q) * nKB + k)
        b, h, q, k, f = b[order], h[order], q[order], k[order], f[order]
        p = ~f
        vis = _eval_blocks(mask_mod, b[p], h[p], q[p], k[p], bq, bk, Lq, Lk)
        return _classify(b, h, q, k, f, vis, (B, Hq), Hq)

    def _classify(b, h, q, k, f, vis, dims, Ht):
        p = ~f
        any_, all_ = _block_flags(vis, q[p], k[p], bq, bk, Lq, Lk)
        keep = torch.ones_like(f)
        full = f.clone()
        pidx = p.nonzero(as_tuple=True)[0]
        full[pidx[all_]] = True               # partial but all visible: full
        keep[pidx[~any_]] = False             # partial with nothing visible: skipped
        still = any_ & ~all_
        bits = pack_bits(vis[still]) if bool(still.any()) else None
        sel = keep
        return _entries_to_build(dims, (b * Ht + h)[sel], q[sel], k[sel], full[sel], bits,
                                 nQB, nKB, order="kv")

    mask = _BlockListMask((Lq, Lk), (bq, bk), build, text, device, dims_ok, traced)
    mask.known_sizes = (int(bm.kv_num_blocks.shape[0]), int(bm.kv_num_blocks.shape[1]), Lq, Lk)
    return mask


def _tile(b, h, q, k, f, B_, H_, Bt, Ht):
    """Entries of lists with dims (B_, H_) read modulo, for dims (Bt, Ht)."""
    rb, rh = Bt // B_ if B_ != Bt else 1, Ht // H_ if H_ != Ht else 1
    if rb > 1:
        off = torch.arange(rb, device=b.device).repeat_interleave(b.numel()) * B_
        b, h, q, k, f = b.repeat(rb) + off, h.repeat(rb), q.repeat(rb), k.repeat(rb), f.repeat(rb)
    if rh > 1:
        off = torch.arange(rh, device=h.device).repeat_interleave(h.numel()) * H_
        b, h, q, k, f = b.repeat(rh), h.repeat(rh) + off, q.repeat(rh), k.repeat(rh), f.repeat(rh)
    return b, h, q, k, f


# BlockMasks passed to flexsparse.attention are converted once per BlockMask object: a
# model passes one BlockMask to every layer, and a conversion evaluates mask_mod in every
# partial block. The conversion is kept on the BlockMask itself, under this attribute
# (not in a table keyed by it: the converted mask refers to its BlockMask, which would
# then never be freed), while the BlockMask's tensors and the tensors its mask_mod
# closes over keep their version counters (no in-place change).
_CONVERTED_ATTR = "_flexsparse_converted"


def _closure_tensors(fn, depth=3):
    """Tensors in fn's closure cells and default arguments, and in those of the functions
    found there (mask_mods made by and_masks / or_masks close over other mask_mods)."""
    if depth == 0 or not callable(fn):
        return []
    found = []
    cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())
             if _cell_set(c)]
    for x in cells + list(getattr(fn, "__defaults__", None) or ()):
        for y in (x if isinstance(x, (tuple, list)) else (x,)):
            if isinstance(y, torch.Tensor):
                found.append(y)
            elif callable(y):
                found += _closure_tensors(y, depth - 1)
    return found


def _cell_set(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:                       # an empty cell
        return False
    return True


def _state(block_mask):
    """What a conversion of `block_mask` depends on: its sizes, its mask_mod, and each of
    its tensors and of the tensors its mask_mod closes over with its version counter; None
    where a tensor has no version counter (an inference tensor)."""
    ts = [t for t in vars(block_mask).values() if isinstance(t, torch.Tensor)]
    ts += _closure_tensors(block_mask.mask_mod)
    try:
        versions = tuple(t._version for t in ts)
    except RuntimeError:
        return None
    return (tuple(block_mask.seq_lengths), tuple(block_mask.BLOCK_SIZE), block_mask.mask_mod,
            tuple(ts), versions)


def _same_state(a, b) -> bool:
    return (a[0] == b[0] and a[1] == b[1] and a[2] is b[2] and len(a[3]) == len(b[3])
            and all(x is y for x, y in zip(a[3], b[3])) and a[4] == b[4])


def converted(block_mask) -> Mask:
    """`from_block_mask(block_mask)`, the same object again for the same BlockMask while
    its sizes, its mask_mod, its tensors and the tensors its mask_mod closes over are the
    same and unchanged in place (what flexsparse.attention uses). Not kept inside
    torch.compile or while a CUDA graph is being captured."""
    if torch.compiler.is_compiling():
        return from_block_mask(block_mask)
    if block_mask.kv_num_blocks.is_cuda and torch.cuda.is_current_stream_capturing():
        return from_block_mask(block_mask)
    state = _state(block_mask)
    hit = getattr(block_mask, _CONVERTED_ATTR, None) if state is not None else None
    if hit is not None and _same_state(hit[0], state):
        return hit[1]
    mask = from_block_mask(block_mask)
    if state is not None:
        setattr(block_mask, _CONVERTED_ATTR, (state, mask))
    return mask


# ------------------------------------------------------------------ mask_mod -> flexsparse

def from_mask_mod(mask_mod, B: Optional[int], H: Optional[int], Lq: int, Lk: int,
                  block_size=128, device=None, *, recognize: bool = False,
                  probes: int = 1 << 16) -> Mask:
    """A flexsparse mask from a FlexAttention mask_mod, without an (Lq, Lk) tensor.

    Like create_block_mask(mask_mod, B, H, Lq, Lk, BLOCK_SIZE=block_size): mask_mod is
    called with b < (B or 1), h < (H or 1) (None = broadcast). Default: every element is
    evaluated once, in tiles of at most EVAL_CHUNK points; only block states of visited
    blocks and the bitmaps of partial blocks are kept (O(N^2) time, O(tile + visited
    blocks + partial bits) memory).

    recognize=True first tries the column-interval form: each key column sees one
    contiguous row interval (causal in either alignment, sliding windows, documents,
    prefix-LM, shared-question, ...). The interval ends are found by binary search from
    an anchor row (O(Lk log Lq) mask_mod calls) and the result is checked on `probes`
    random points plus every interval end; on success the result is a
    `masks.column_ranges` mask (O(N) descriptors at any block size), otherwise it falls
    back to the exact path. The check is by sampling: a mask that agrees with an
    interval form everywhere except at unsampled isolated points would be mis-recognized.
    """
    bq, bk = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    device = torch.device(device or "cpu")
    Be, He = B or 1, H or 1
    name = getattr(mask_mod, "__name__", type(mask_mod).__name__)
    # (inside torch.compile Dynamo would specialize sizes formatted into a string)
    text = (f"from_mask_mod({name}) inside torch.compile" if torch.compiler.is_compiling() else
            f"from_mask_mod({name}, B={B}, H={H}, Lq={Lq}, Lk={Lk}, block_size={(bq, bk)})")

    def dims_ok(Bc, Hq):
        if not (dim_in(Be, 1, Bc) and dim_in(He, 1, Hq)):
            raise ValueError(f"mask: from_mask_mod was built for (B, H)=({B}, {H}), inputs "
                             f"have (B={Bc}, Hq={Hq})")

    def traced(sz):
        return _eval_grid(mask_mod, Be, He, 0, Lq, 0, Lk, device)

    if torch.compiler.is_compiling():
        # Inside torch.compile: every element once, held as a dense mask (recognition and
        # the block lists need host decisions on the data).
        mask = _BlockListMask((Lq, Lk), (bq, bk), None, text, device, dims_ok, traced)
        mask.known_sizes = (B, H, Lq, Lk)
        return mask
    if recognize:
        m = recognize_mask_mod(mask_mod, Be, He, Lq, Lk, device=device, probes=probes)
        if m is not None:
            m.known_sizes = (B, H, Lq, Lk)
            return m
    built = _build_from_mask_mod(mask_mod, Be, He, Lq, Lk, bq, bk, device)
    mask = _BlockListMask((Lq, Lk), (bq, bk), lambda Bc, Hq: built, text, device, dims_ok,
                          traced)
    mask.known_sizes = (B, H, Lq, Lk)
    return mask


def _build_from_mask_mod(mask_mod, Be, He, Lq, Lk, bq, bk, device):
    nQB, nKB = -(-Lq // bq), -(-Lk // bk)
    per_block = Be * He * bq * bk
    tiles = max(1, EVAL_CHUNK // per_block)              # blocks per tile
    nk = min(nKB, tiles)
    nq = max(1, min(nQB, tiles // nk))
    bhs, qbs, kbs, fulls, bits = [], [], [], [], []
    for qb0 in range(0, nQB, nq):
        qb1 = min(nQB, qb0 + nq)
        r0, r1 = qb0 * bq, min(Lq, qb1 * bq)
        for kb0 in range(0, nKB, nk):
            kb1 = min(nKB, kb0 + nk)
            c0, c1 = kb0 * bk, min(Lk, kb1 * bk)
            vis = _eval_grid(mask_mod, Be, He, r0, r1, c0, c1, device)
            n_q, n_k = qb1 - qb0, kb1 - kb0
            pad = (0, n_k * bk - (c1 - c0), 0, n_q * bq - (r1 - r0))
            t = torch.nn.functional.pad(vis, pad, value=False).view(Be, He, n_q, bq, n_k, bk)
            t = t.permute(0, 1, 2, 4, 3, 5)                      # b h nq nk bq bk
            inr = torch.nn.functional.pad(torch.ones((r1 - r0, c1 - c0), dtype=torch.bool,
                                                     device=device), pad)
            inr = inr.view(n_q, bq, n_k, bk).permute(0, 2, 1, 3)
            any_ = t.flatten(-2).any(-1)
            all_ = (t | ~inr).flatten(-2).all(-1)
            bb, hh, qq, kk = any_.nonzero(as_tuple=True)
            full = all_[bb, hh, qq, kk]
            part = ~full
            if bool(part.any()):
                bits.append(pack_bits(t[bb[part], hh[part], qq[part], kk[part]]))
            bhs.append(bb * He + hh)
            qbs.append(qq + qb0)
            kbs.append(kk + kb0)
            fulls.append(full)
    cat = lambda xs, dt: torch.cat(xs) if xs else torch.zeros(0, dtype=dt, device=device)  # noqa: E731
    bh, qb, kb, full = (cat(bhs, torch.int64), cat(qbs, torch.int64), cat(kbs, torch.int64),
                        cat(fulls, torch.bool))
    # bits were appended in the order of the partial entries: keep that order
    return _entries_to_build((Be, He), bh, qb, kb, full, torch.cat(bits) if bits else None,
                             nQB, nKB)


# ------------------------------------------------------------------ recognition

def recognize_mask_mod(mask_mod, B: int, H: int, Lq: int, Lk: int, *, device=None,
                       probes: int = 1 << 16, seed: int = 0) -> Optional[Mask]:
    """A `masks.column_ranges` mask equal to mask_mod on all probes, or None.

    Assumes each key column j sees one contiguous row interval [lo_j, hi_j) (per b, h).
    An anchor row inside it is looked for among: the bottom-right diagonal j - (Lk - Lq),
    the top-left diagonal j, the last row and the first row. lo_j and hi_j are found by
    binary search. Probes: the anchor, lo_j - 1, lo_j, hi_j - 1, hi_j of every column and
    `probes` uniformly random points; any mismatch -> None.
    """
    device = torch.device(device or "cpu")
    if Lq == 0 or Lk == 0:
        return None
    n = B * H * Lk
    bh = torch.arange(B * H, device=device).repeat_interleave(Lk)
    b, h = bh // H, bh % H
    j = torch.arange(Lk, device=device).repeat(B * H)

    def ev(i):
        return _eval_points(mask_mod, b, h, i, j)

    anchor = torch.full((n,), -1, dtype=torch.int64, device=device)
    for cand in (j - (Lk - Lq), j, torch.full_like(j, Lq - 1), torch.zeros_like(j)):
        cand = cand.clamp(0, Lq - 1)
        need = anchor < 0
        hit = ev(cand) & need
        anchor = torch.where(hit, cand, anchor)
    has = anchor >= 0
    a = anchor.clamp(min=0)
    # lo: smallest i <= anchor with [i, anchor] visible (search in [0, anchor])
    lo_l, lo_h = torch.zeros_like(a), a.clone()
    for _ in range(max(1, math.ceil(math.log2(Lq + 1)) + 1)):
        mid = (lo_l + lo_h) // 2
        v = ev(mid)
        lo_h = torch.where(v, mid, lo_h)
        lo_l = torch.where(v, lo_l, mid + 1)
    # hi: largest i >= anchor visible, +1
    hi_l, hi_h = a.clone(), torch.full_like(a, Lq - 1)
    for _ in range(max(1, math.ceil(math.log2(Lq + 1)) + 1)):
        mid = (hi_l + hi_h + 1) // 2
        v = ev(mid)
        hi_l = torch.where(v, mid, hi_l)
        hi_h = torch.where(v, hi_h, mid - 1)
    lo = torch.where(has, lo_h, 0)
    hi = torch.where(has, hi_l + 1, 0)
    # probes
    g = torch.Generator(device="cpu").manual_seed(seed)
    pb = torch.randint(0, B, (probes,), generator=g).to(device)
    ph = torch.randint(0, H, (probes,), generator=g).to(device)
    pi = torch.randint(0, Lq, (probes,), generator=g).to(device)
    pj = torch.randint(0, Lk, (probes,), generator=g).to(device)
    rows = torch.cat([a, lo - 1, lo, hi - 1, hi])
    cols = j.repeat(5)
    ok = (rows >= 0) & (rows < Lq)
    PB = torch.cat([b.repeat(5)[ok], pb])
    PH = torch.cat([h.repeat(5)[ok], ph])
    PI = torch.cat([rows[ok], pi])
    PJ = torch.cat([cols[ok], pj])
    got = _eval_points(mask_mod, PB, PH, PI, PJ)
    col = (PB * H + PH) * Lk + PJ
    want = (lo[col] <= PI) & (PI < hi[col])
    if not torch.equal(got, want):
        return None
    lo4 = lo.view(B, H, Lk)
    hi4 = hi.view(B, H, Lk)
    # column_ranges(non-causal, C=2): rows >= [..., 0] masked, rows < [..., 1] masked
    t = torch.stack([hi4, lo4], -1).to(torch.int32)
    t = _collapse(t)
    m = masks_mod.column_ranges(t, causal=False)
    m.text = f"recognized({getattr(mask_mod, '__name__', 'mask_mod')}: column intervals)"
    return m


def _collapse(t):
    """Drop batch/head dims along which t does not vary."""
    if t.shape[0] > 1 and bool((t == t[:1]).all()):
        t = t[:1]
    if t.shape[1] > 1 and bool((t == t[:, :1]).all()):
        t = t[:, :1]
    return t.contiguous()


# ------------------------------------------------------------------ flexsparse -> BlockMask

_UNSET = object()   # an argument left out (None means broadcast for B and H)


def to_block_mask(mask, B=_UNSET, H=_UNSET, Lq: Optional[int] = None,
                  Lk: Optional[int] = None, *,
                  num_kv_heads: Optional[int] = None, block_size=128, device=None,
                  full_width: bool = True):
    """A FlexAttention BlockMask equal to a flexsparse mask or BlockDescriptor.

    For a Mask, B/H (query heads)/Lq/Lk are the sizes to compile for (B, H None = 1);
    masks converted from FlexAttention take their own sizes for the ones left out.
    For a BlockDescriptor its own sizes and block size are used. The BlockMask's lists
    are the descriptor's (Hd = Hkv lists are repeated per query head); its mask_mod
    evaluates the descriptor exactly: the block state (full / partial / skipped, a
    (Bd, Hd, nQB, nKB) int8 lookup) and, in partial blocks, the element predicates
    (dense mask, column ranges, bitmaps). So create_mask(bm.mask_mod, ...) and eager
    flex_attention agree with the kernels. `full_width` pads the index lists to
    nKB / nQB entries as create_block_mask does (BlockMask.to_dense and _adjust need it).
    Index masks (attn_indices) are converted when no row lists a key twice.
    """
    fa = _flex()
    if isinstance(mask, BlockDescriptor):
        d = mask
    else:
        if not isinstance(mask, Mask):
            raise TypeError(f"mask: expected a flexsparse mask or BlockDescriptor, got "
                            f"{type(mask).__name__}")
        known = mask.known_sizes      # masks converted from FlexAttention know their sizes
        if Lq is None or Lk is None:
            if known is None:
                raise ValueError("to_block_mask: Lq and Lk are required (this mask was not "
                                 "converted from FlexAttention, so it has no sizes of its own)")
            Lq = known[2] if Lq is None else Lq
            Lk = known[3] if Lk is None else Lk
        B = (known[0] if known else None) if B is _UNSET else B
        H = (known[1] if known else None) if H is _UNSET else H
        Hq = H or 1
        Hkv = num_kv_heads or Hq
        bs = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
        d = mask.compile(B or 1, Hq, Hkv, Lq, Lk, device=device, block_size=bs)
    if d.is_index_mask:
        d = _index_descriptor_as_blocks(d)
    d = d.with_lists()                      # a BlockMask holds explicit index lists
    Lq, Lk = d.seq_lengths
    bq, bk = d.block_size
    Hq, Hkv = d.num_heads
    G = Hq // Hkv
    nQB, nKB = -(-Lq // bq), -(-Lk // bk)

    def heads(t):
        if t is None:
            return None
        if t.shape[1] == Hkv and Hkv != Hq:
            t = t.repeat_interleave(G, dim=1)
        return t.contiguous()

    def widen(t, n):
        if t is None or not full_width or t.shape[-1] >= n:
            return t
        return torch.nn.functional.pad(t, (0, n - t.shape[-1]))

    kv_c, kv_i = heads(d.kv_count), widen(heads(d.kv_index), nKB)
    kvf_c, kvf_i = heads(d.kv_full_count), widen(heads(d.kv_full_index), nKB)
    q_c, q_i = heads(d.q_count), widen(heads(d.q_index), nQB)
    qf_c, qf_i = heads(d.q_full_count), widen(heads(d.q_full_index), nQB)
    mask_mod = _descriptor_mask_mod(d)
    return fa.BlockMask(seq_lengths=(Lq, Lk), kv_num_blocks=kv_c, kv_indices=kv_i,
                        full_kv_num_blocks=kvf_c, full_kv_indices=kvf_i, q_num_blocks=q_c,
                        q_indices=q_i, full_q_num_blocks=qf_c, full_q_indices=qf_i,
                        BLOCK_SIZE=(bq, bk), mask_mod=mask_mod)


def _sel(dim_size, idx, Hq=None, Hkv=None):
    """Index into a broadcast dim: size 1 -> 0; size Hkv (< Hq) -> h // G; else idx."""
    if dim_size == 1:
        return 0
    if Hq is not None and dim_size == Hkv and Hkv != Hq:
        return idx // (Hq // Hkv)
    return idx


def _descriptor_mask_mod(d: BlockDescriptor):
    Lq, Lk = d.seq_lengths
    bq, bk = d.block_size
    Hq, Hkv = d.num_heads
    state = d.block_state().to(torch.int8)
    dm, cr = d.dense_mask, d.col_ranges
    pbi, bits = d.partial_bits_index, d.partial_bits
    if bits is not None and bits.shape[0] == 0:
        pbi = bits = None
    m = cr.shape[-1] // 2 if cr is not None else 0

    def mask_mod(b, h, q_idx, kv_idx):
        q = torch.clamp(q_idx, 0, Lq - 1)
        kv = torch.clamp(kv_idx, 0, Lk - 1)
        qb, kb = q // bq, kv // bk
        st = state[_sel(state.shape[0], b), _sel(state.shape[1], h, Hq, Hkv), qb, kb]
        ok = st == PARTIAL
        if dm is not None:
            ok = ok & dm[_sel(dm.shape[0], b), _sel(dm.shape[1], h, Hq, Hkv),
                         _sel(dm.shape[2], q), _sel(dm.shape[3], kv)]
        if cr is not None:
            cb, ch = _sel(cr.shape[0], b), _sel(cr.shape[1], h, Hq, Hkv)
            for r in range(m):
                s = cr[cb, ch, kv, 2 * r]
                e = cr[cb, ch, kv, 2 * r + 1]
                ok = ok & ~((s <= q) & (q < e))
        if pbi is not None:
            p = pbi[_sel(pbi.shape[0], b), _sel(pbi.shape[1], h, Hq, Hkv), qb, kb]
            c = kv % bk
            w = bits[torch.clamp(p, min=0), q % bq, c // 32]
            ok = ok & ((p < 0) | (((w >> (c % 32)) & 1) != 0))
        return (st == FULL) | ok
    return mask_mod


def _index_descriptor_as_blocks(d: BlockDescriptor) -> BlockDescriptor:
    """An index mask without duplicate keys per row, as block lists + a dense predicate.

    The predicate is a dense bool (Bi, Hi, Lq, Lk) built in row chunks: this conversion
    is O(Lq x Lk) memory and meant for the sizes FlexAttention itself handles.
    """
    idx = d.attn_indices.to(torch.int64)
    Lq, Lk = d.seq_lengths
    srt = torch.sort(torch.where((idx >= 0) & (idx < Lk), idx, -1), dim=-1).values
    if bool(((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any()):
        raise ValueError("to_block_mask: an index mask that lists a key twice in a row counts it "
                         "twice; a BlockMask cannot express that")
    dense = d.to_dense()                                   # (Bi, Hi, Lq, Lk)
    return masks_mod.dense(dense).compile(d.attn_indices.shape[0], d.num_heads[0],
                                          d.num_heads[1], Lq, Lk, device=idx.device,
                                          block_size=d.block_size)
