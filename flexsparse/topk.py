"""Top-k key selection per query (Flash-DMA's dynamic mask) -> index lists for index mode.

`topk_indices(scores, k, causal=...)` keeps, for every query row, the k keys with the
largest score and returns their positions as int32 (..., Lq, k), -1 where fewer than k
keys are allowed (causal, Lk < k, or -inf / NaN scores). On CUDA, bf16 / fp16 / fp32 rows
go to the kernel of csrc/topk.cu (`flexsparse::topk_rows`, when flexsparse._C is built;
rows longer than 64K keys in segments), other rows of up to 8K keys to a Triton kernel
(flexsparse/triton_topk.py); both read the scores in place and write only the (Lq, k)
result, all rows in one launch. Otherwise rows are processed in chunks, so beyond the
input itself only O(chunk_rows x Lk) memory is used. `scores` can also be a callable
`scores(r0, r1) -> (..., r1 - r0, Lk)` that produces each chunk on the fly (then
`num_queries` gives Lq), so no (Lq, Lk) tensor ever exists.

The result feeds `flexsparse.masks.indices(...)`; its leading dims are the score's
(B|1, H|1) when scores are (B|1, H|1, Lq, Lk).
"""
import math
from typing import Callable, Optional, Union

import torch

# Elements of one score chunk (all leading dims x rows x Lk) when chunk_rows is not given,
# on the torch path: each chunk is copied once (NaN -> -inf). torch.topk over few rows
# leaves the GPU partly idle, so on CUDA larger chunks are faster: on the H100 (bf16,
# docs/benchmarks.md 2026-11-26, against torch.topk over all rows) 1.29-1.50x at 2^26
# elements, 1.10-1.40x at 2^28 (1.10-1.13x at L = 32K), at a 512 MB copy in bf16. The
# CUDA rows that a kernel takes (_cuda_op_takes, _on_triton) are read in place instead:
# a tensor's rows go in one launch, only a callable's chunks are sized.
CHUNK_ELEMENTS = 1 << 26
CUDA_CHUNK_ELEMENTS = 1 << 28


def chunk_elements(device: torch.device) -> int:
    """Score elements per chunk of the torch path on this device."""
    return CUDA_CHUNK_ELEMENTS if device.type == "cuda" else CHUNK_ELEMENTS


def _triton_topk():
    """flexsparse/triton_topk.py (the GPU path: one kernel, no copy of the scores), or None."""
    try:
        from . import triton_topk
    except ImportError:
        return None
    return triton_topk


# Keys per row that csrc/topk.cu holds in shared memory; longer rows go through it in
# segments of this many keys (_segmented_topk).
CUDA_OP_MAX_KEYS = 65536


def _cuda_op_takes(s: torch.Tensor, k: int) -> bool:
    """CUDA scores that csrc/topk.cu selects from (a warp or a CTA per row, the row's keys
    in shared memory; longer rows in segments, as long as the segments' candidates fit one
    row), when flexsparse._C has the kernel: bf16, fp16 and fp32 rows (fp32 at 8K keys on
    the H200: 0.63-0.73x torch.topk, against the Triton kernel's 1.43-1.66x)."""
    return (s.is_cuda and s.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and (s.shape[-1] <= CUDA_OP_MAX_KEYS
                 or -(-s.shape[-1] // CUDA_OP_MAX_KEYS) * k <= CUDA_OP_MAX_KEYS)
            and torch._C._dispatch_has_kernel_for_dispatch_key("flexsparse::topk_rows", "CUDA"))


# Candidate entries (rows x segments x k, over the leading dims) that one pass of
# _segmented_topk holds; more rows go in row chunks. Each entry costs 14-16 bytes at once
# (int32 position, int64 gather index, the score): 2^24 entries, 235-270 MB, where all rows
# at once took 1.4 GB at 128K bf16 keys, k = 256 (more than torch.topk's own 1.0 GB).
SEGMENT_CANDIDATES = 1 << 24


def _segmented_topk(s: torch.Tensor, k: int, causal: bool, r0: int, Lq: int, select,
                    seg: int, max_candidates: int = SEGMENT_CANDIDATES) -> torch.Tensor:
    """Ascending top-k positions of rows longer than `seg` keys through a selector of rows of
    at most `seg` keys, `select(scores, k, causal, row0, num_queries)` (topk_rows' contract).
    Each segment's top k, then the top k of those candidates: every key the row keeps is
    among its segment's top k (a segment keeps its keys above the row's threshold and its
    first ties in position order, at least as many as the row keeps there), and the
    candidates are in position order, so the ties the row keeps are its first ones too.
    Rows go in chunks of at most `max_candidates` candidate entries."""
    rows, Lk = s.shape[-2], s.shape[-1]
    lead = math.prod(s.shape[:-2])
    per_row = max(1, lead * -(-Lk // seg) * k)
    step = max(1, max_candidates // per_row)
    if step < rows:
        return torch.cat([_segmented_topk(s[..., a:a + step, :], k, causal, r0 + a, Lq, select, seg,
                                          max_candidates)
                          for a in range(0, rows, step)], dim=-2)
    parts = []
    for s0 in range(0, Lk, seg):
        s1 = min(Lk, s0 + seg)
        # causal: key s0 + j is visible to query row0 + r iff j <= row0 + r + (Lk - Lq) - s0,
        # the selector's rule for a row of s1 - s0 keys with this num_queries
        ind = select(s[..., s0:s1], k, causal, r0, (s1 - s0) - (Lk - Lq - s0))
        parts.append(torch.where(ind >= 0, ind + s0, ind))
    cand = torch.cat(parts, dim=-1)
    vals = s.gather(-1, cand.clamp_min(0).long()).masked_fill_(cand < 0, -math.inf)
    pick = select(vals, k, False, 0, vals.shape[-2])
    return torch.where(pick >= 0, cand.gather(-1, pick.clamp_min(0).long()), pick)


def _on_triton(s: torch.Tensor) -> bool:
    """CUDA scores whose rows the Triton kernel holds in registers (where it beats the
    torch path; longer rows take torch.topk in chunks)."""
    tk = _triton_topk()
    return s.is_cuda and tk is not None and s.shape[-1] <= tk.RESIDENT_MAX


def topk_indices(scores: Union[torch.Tensor, Callable[[int, int], torch.Tensor]], k: int,
                 causal: bool = False, chunk_rows: Optional[int] = None, *,
                 num_queries: Optional[int] = None, sort: bool = True) -> torch.Tensor:
    """Positions of the top-k keys per query row, int32 (..., Lq, k), -1 padded.

    scores: tensor (..., Lq, Lk), or callable (r0, r1) -> tensor (..., r1 - r0, Lk)
        (then `num_queries` = Lq is required). Higher score = kept.
    k: keys kept per query (>= 0). Rows with fewer than k allowed keys are -1 padded.
    causal: key j is allowed for query i only if j <= i + (Lk - Lq) (bottom-right
        aligned, as the other causal masks).
    chunk_rows: query rows per chunk (default: about 2^26 score elements per chunk, 2^28
        on CUDA; CUDA rows that a kernel takes, bf16 / fp16 / fp32 and others up to 8K
        keys: all rows at once).
    sort: if True, each row's kept positions are ascending, -1 entries last; otherwise in
        descending score order (-1 entries last too).
    Entries whose score is -inf or NaN are never kept.
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"k: must be a non-negative int, got {k!r}")
    if callable(scores) and not isinstance(scores, torch.Tensor):
        if num_queries is None:
            raise ValueError("num_queries: required when scores is a callable")
        Lq = int(num_queries)
        get = scores
        probe = None
    else:
        if not isinstance(scores, torch.Tensor):
            raise TypeError(f"scores: must be a tensor or a callable, got {type(scores).__name__}")
        if scores.dim() < 2:
            raise ValueError(f"scores: must be at least 2-D (..., Lq, Lk), got {tuple(scores.shape)}")
        Lq = scores.shape[-2]
        if num_queries is not None and num_queries != Lq:
            raise ValueError(f"num_queries: {num_queries} does not match scores' Lq={Lq}")
        get = lambda r0, r1: scores[..., r0:r1, :]
        probe = scores
    if Lq < 0:
        raise ValueError(f"num_queries: must be >= 0, got {Lq}")

    out = None
    r0 = 0
    step = chunk_rows
    if step is not None and (not isinstance(step, int) or step <= 0):
        raise ValueError(f"chunk_rows: must be a positive int, got {chunk_rows!r}")
    if probe is not None and step is None and (_cuda_op_takes(probe, k) or _on_triton(probe)):
        step = max(1, Lq)     # no copy per chunk: all rows in one launch
    if probe is not None and step is None:
        lead = math.prod(probe.shape[:-2])
        step = max(1, chunk_elements(probe.device) // max(1, lead * probe.shape[-1]))
    while r0 < Lq or out is None:
        if step is None:  # callable: size the chunks from the first one (one row)
            first = get(0, min(1, Lq))
            lead = math.prod(first.shape[:-2])
            step = max(1, chunk_elements(first.device) // max(1, lead * first.shape[-1]))
        r1 = min(Lq, r0 + step)
        s = get(r0, r1)
        if not isinstance(s, torch.Tensor) or s.dim() < 2 or s.shape[-2] != r1 - r0:
            raise ValueError(f"scores: chunk ({r0}, {r1}) must be a tensor (..., {r1 - r0}, Lk), "
                             f"got {getattr(s, 'shape', type(s).__name__)}")
        part = _topk_chunk(s, k, causal, r0, Lq, sort)
        if out is None:
            out = torch.empty(part.shape[:-2] + (Lq, k), dtype=torch.int32, device=part.device)
        elif part.shape[:-2] != out.shape[:-2]:
            raise ValueError(f"scores: chunk ({r0}, {r1}) has leading dims {tuple(part.shape[:-2])}, "
                             f"earlier chunks {tuple(out.shape[:-2])}")
        out[..., r0:r1, :] = part
        r0 = r1
        if Lq == 0:
            break
    return out


def _topk_chunk(s: torch.Tensor, k: int, causal: bool, r0: int, Lq: int, sort: bool):
    """int32 (..., rows, k) for one chunk of rows r0.. of the scores. No host sync. On CUDA:
    csrc/topk.cu's select for bf16 / fp16 / fp32 rows, else the Triton select of
    flexsparse/triton_topk.py for rows of up to 8K keys. Else a fixed handful of torch ops
    per chunk: one pass writes the chunk's own copy with NaN turned into -inf (causal: only
    the columns some row of the chunk may see, and -inf written into the band above the
    diagonal in place), then torch.topk, then the (rows, k) results are fixed up."""
    if _cuda_op_takes(s, k):
        topk_rows = torch.ops.flexsparse.topk_rows
        if s.shape[-1] <= CUDA_OP_MAX_KEYS:
            ind = topk_rows(s, k, causal, r0, Lq)
        else:
            ind = _segmented_topk(s, k, causal, r0, Lq, topk_rows, CUDA_OP_MAX_KEYS)
        return ind if sort else _by_descending_score(s, ind)
    if _on_triton(s):
        tk = _triton_topk()
        if not tk.supports(s):
            s = s.float()
        ind = tk.topk_rows(s, k, causal=causal, row0=r0, num_queries=Lq)
        return ind if sort else _by_descending_score(s, ind)
    rows, Lk = s.shape[-2], s.shape[-1]
    width = Lk
    if causal:   # row i sees j <= i + (Lk - Lq): no row of this chunk sees past r0 + rows - 1 + off
        off = Lk - Lq
        width = max(0, min(Lk, r0 + rows + off))
        s = s[..., :width]
    kk = min(k, width)
    if kk == 0 or rows == 0:
        return torch.full(s.shape[:-1] + (k,), -1, dtype=torch.int32, device=s.device)
    if s.dtype.is_floating_point:
        s = torch.nan_to_num(s, nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    else:
        s = s.float()
    if causal:
        lo = max(0, min(width, r0 + off + 1))    # columns before lo are visible to every row
        if lo < width:
            i = torch.arange(r0, r0 + rows, device=s.device)[:, None]
            j = torch.arange(lo, width, device=s.device)[None, :]
            s[..., lo:width].masked_fill_(j > i + off, -math.inf)
    # sorted by position afterwards anyway: skip topk's own sort then
    vals, ind = torch.topk(s, kk, dim=-1, largest=True, sorted=not sort)
    ind = ind.to(torch.int32).masked_fill_(vals == -math.inf, -1 if not sort else width)
    if sort:     # ascending positions, the -1 entries (parked at `width`) last
        ind = ind.sort(dim=-1).values
        ind.masked_fill_(ind == width, -1)
    if kk < k:
        pad = torch.full(ind.shape[:-1] + (k - kk,), -1, dtype=torch.int32, device=s.device)
        ind = torch.cat([ind, pad], dim=-1)
    return ind


def _by_descending_score(s: torch.Tensor, ind: torch.Tensor) -> torch.Tensor:
    """The kept positions of each row reordered by descending score, -1 entries last."""
    vals = torch.gather(s, -1, ind.clamp_min(0).long()).float().masked_fill_(ind < 0, -math.inf)
    order = vals.sort(dim=-1, descending=True, stable=True).indices
    return torch.gather(ind, -1, order)
