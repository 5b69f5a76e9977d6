"""Index lists as a block descriptor: run index attention on the block-sparse kernels.

`masks.indices(attn_indices)` normally runs the gather kernels (ops/triton_indices.py):
each query gathers its W key/value rows, ~17-29 TFLOP/s on an H100 whatever the pattern.
When neighbouring queries list overlapping keys (local windows, dilated windows,
neighbour sets, top-k that clusters) the same attention can run on the block kernels
(ops/triton_block.py, ~250-450 TFLOP/s on the blocks they visit): every (query block,
key block) that holds at least one listed pair is visited; blocks where every in-range
pair is listed are *full*, the others *partial* with a per-block bitmap
(`partial_bits_index` / `partial_bits`, docs/design.md).

Exactness: visible(q, k) = k is in q's list. That is the gather semantics only when no
query lists a key twice (the gather kernel counts each occurrence, a bitmap cannot), so
`indices_to_blocks` returns None for lists with duplicates, and the caller keeps the
gather kernel. A bias is exact too: both paths add bias[q, k] at the same visible (q, k)
and produce dbias there (zeros elsewhere).

Cost: O(Bi·Hi·Lq·W) work in row chunks (bounded temporaries), O(partial blocks x
block_q x block_k / 32) bitmap words, and two int32 grids of (Bi, Hi, nQB, nKB) (the
per-block counts, and the bitmap index that the descriptor format requires); never an
(Lq, Lk) tensor. Vectorized torch ops, eager only (the number of visited blocks is data
dependent); host syncs: the duplicate check, the number of visited / partial blocks, and
the list widths in `blocklists.descriptor_from_entries`.

Whether the block path pays off depends on how many block cells the kernels compute per
listed pair: `estimate_density` measures that on a sample of query blocks and
`prefer_blocks` turns it into the decision that `masks.indices(..., layout="auto")` uses.
"""
from typing import Optional, Tuple

import torch

from .blocklists import descriptor_from_entries
from .descriptor import BlockDescriptor

# Index entries (query rows x W) handled per step: bounds the int64 temporaries (~50 B each).
CHUNK_ENTRIES = 1 << 23
# Listed pairs per computed block cell above which "auto" takes the block path. Model: the
# gather kernels reach ~17-29 TFLOP/s on listed pairs, the block kernels ~200-280 on the
# cells of partial-heavy block lists (sliding window / document rows of docs/benchmarks.md),
# so blocks should win above ~1/8 of the computed cells being listed pairs; the gather
# backward (fp32 atomics, 4-6x its forward) makes blocks win by more in training.
# Measured on the H100 (docs/benchmarks.md, 8K): density 0.22-0.25 (local W=64, dilated x4
# W=256) ran the forward 0.7x the gather kernel's speed (fwd+bwd 0.9-1.4x); 0.67 (local
# W=256) 2.2x, 0.89 (W=1024) 5.8x. So the threshold sits between: 0.3.
MIN_DENSITY = 0.3
# Query blocks sampled (evenly spaced) by estimate_density.
SAMPLE_QUERY_BLOCKS = 16


def _check(attn_indices, Lq, Lk, block_size):
    t = attn_indices
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int16, torch.int32, torch.int64):
        raise TypeError("attn_indices: must be an int32 or int64 tensor (B|1, Hkv|1, Lq, W)")
    if t.dim() != 4 or t.shape[2] != Lq:
        raise ValueError(f"attn_indices: shape {tuple(t.shape)} must be (B|1, Hkv|1, Lq={Lq}, W)")
    bq, bk = block_size
    if bq <= 0 or bk <= 0 or Lk < 0:
        raise ValueError(f"block_size: must be positive, got {block_size}")
    return bq, bk


def _row_chunks(n_rows: int, W: int):
    step = max(1, CHUNK_ENTRIES // max(1, W))
    for r0 in range(0, n_rows, step):
        yield r0, min(n_rows, r0 + step)


def has_duplicates(attn_indices: torch.Tensor, Lk: int) -> bool:
    """Does any query list an in-range key more than once? (one host sync)"""
    t = attn_indices
    W = t.shape[-1]
    if W < 2 or t.numel() == 0:
        return False
    rows = t.reshape(-1, W)
    found = torch.zeros((), dtype=torch.bool, device=t.device)
    for r0, r1 in _row_chunks(rows.shape[0], W):
        x = rows[r0:r1]
        x = torch.where((x >= 0) & (x < Lk), x, -1)
        s = torch.sort(x, dim=-1).values
        found = found | ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any()
    return bool(found)


def _entries(rows: torch.Tensor, r0: int, Lq: int, Lk: int, bq: int, bk: int, nQB: int,
             nKB: int, dump: int):
    """For a chunk of flattened index rows [r0, r0 + len): per entry its flat block key
    ((bh * nQB + qb) * nKB + kb, or `dump` when inactive), row in block (per row, (R, 1))
    and column in block."""
    rr = torch.arange(r0, r0 + rows.shape[0], device=rows.device, dtype=torch.int64)[:, None]
    bh, q = rr // Lq, rr % Lq
    base = (bh * nQB + q // bq) * nKB                       # per row
    valid = (rows >= 0) & (rows < Lk)
    k = rows.clamp(0, max(Lk - 1, 0))                       # inactive ones go to `dump` below
    k = k.to(torch.int32) if Lk < 1 << 31 else k.to(torch.int64)
    kb = k // bk
    key = torch.where(valid, base + kb, dump)
    return key, q % bq, k - kb * bk


def indices_to_blocks(attn_indices: torch.Tensor, Lq: int, Lk: int,
                      block_size: Tuple[int, int] = (128, 128), *,
                      num_heads: Optional[Tuple[int, int]] = None
                      ) -> Optional[BlockDescriptor]:
    """A BlockDescriptor with visible(q, k) = k in q's list, or None if no such exists.

    attn_indices: (Bi, Hi, Lq, W) int32/int64; -1 (and anything outside [0, Lk)) is
    inactive, as in the kernels. The descriptor's batch/head dims are (Bi, Hi); pass
    num_heads=(Hq, Hkv) of the attention call (default (Hi, Hi)). Returns None when a
    query lists a key twice (the gather semantics count it twice; a bitmap cannot).
    Blocks whose in-range pairs are all listed are full (no bitmap), the other visited
    blocks partial with a bitmap. Apply causal filtering before (masks.indices does).
    """
    bq, bk = _check(attn_indices, Lq, Lk, block_size)
    t = attn_indices
    Bi, Hi, _, W = t.shape
    if num_heads is None:
        num_heads = (Hi, Hi)
    device = t.device
    nQB, nKB = -(-Lq // bq), -(-Lk // bk)
    nw = -(-bk // 32)
    n_blocks = Bi * Hi * nQB * nKB
    if has_duplicates(t, Lk):
        return None
    rows = t.reshape(Bi * Hi * Lq, W)

    # 1. listed pairs per block (slot n_blocks collects the inactive entries)
    # (int32 grids, as large as the partial_bits_index the descriptor format needs anyway)
    counts = torch.zeros(n_blocks + 1, dtype=torch.int32, device=device)
    one = torch.ones(1, dtype=torch.int32, device=device)
    for r0, r1 in _row_chunks(rows.shape[0], W):
        key = _entries(rows[r0:r1], r0, Lq, Lk, bq, bk, nQB, nKB, n_blocks)[0].flatten()
        counts.index_add_(0, key, one.expand_as(key))
    counts = counts[:n_blocks]

    # 2. visited blocks in (bh, qb, kb) order; full = every in-range pair listed
    visited = torch.nonzero(counts).squeeze(1)                      # sync: number of blocks
    kb = visited % nKB
    qb = (visited // nKB) % nQB
    bh = visited // (nQB * nKB)
    cells = (torch.clamp(Lq - qb * bq, max=bq) * torch.clamp(Lk - kb * bk, max=bk))
    full = counts[visited] == cells
    del counts

    # 3. bitmaps of the partial blocks: distinct bits per word (no duplicates), so a sum is an OR
    partial_keys = visited[~full]                                    # sync: number of partials
    P = partial_keys.numel()
    predicates = {}
    if P:
        slot = torch.full((n_blocks + 1,), -1, dtype=torch.int32, device=device)
        slot[partial_keys] = torch.arange(P, dtype=torch.int32, device=device)
        dump = P * bq * nw
        words = torch.zeros(dump + 1, dtype=torch.int64, device=device)
        one = torch.ones(1, dtype=torch.int64, device=device)
        for r0, r1 in _row_chunks(rows.shape[0], W):
            key, r, c = _entries(rows[r0:r1], r0, Lq, Lk, bq, bk, nQB, nKB, n_blocks)
            p = slot[key].to(torch.int64)                        # -1: not a partial block
            pos = torch.where(p >= 0, (p * bq + r) * nw + c // 32, dump).flatten()
            words.index_add_(0, pos, (one << (c % 32)).flatten())
        words = words[:dump]
        words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
        predicates = dict(
            partial_bits_index=slot[:n_blocks].view(Bi, Hi, nQB, nKB),
            partial_bits=words.view(P, bq, nw))
    return descriptor_from_entries((Bi, Hi), nQB, nKB, bh, qb, kb, full, order="kv",
                                   seq_lengths=(Lq, Lk), block_size=(bq, bk),
                                   num_heads=tuple(num_heads), **predicates)


def estimate_density(attn_indices: torch.Tensor, Lq: int, Lk: int,
                     block_size: Tuple[int, int] = (128, 128), *,
                     max_query_blocks: int = SAMPLE_QUERY_BLOCKS) -> float:
    """Listed pairs per block cell the block kernels would compute (0..1), on a sample.

    Takes up to `max_query_blocks` evenly spaced query blocks (all batch/heads of the
    index tensor), counts their distinct key blocks, and returns
    listed pairs / (visited blocks x block_q x block_k). One host sync; costs
    O(samples x block_q x W), independent of Lq. Duplicates are counted as listed pairs.
    """
    bq, bk = _check(attn_indices, Lq, Lk, block_size)
    t = attn_indices
    Bi, Hi, _, W = t.shape
    nQB, nKB = -(-Lq // bq), -(-Lk // bk)
    if nQB == 0 or nKB == 0 or W == 0 or t.numel() == 0:
        return 0.0
    n = min(nQB, max(1, max_query_blocks))
    qbs = torch.linspace(0, nQB - 1, n).round().to(torch.int64).unique()
    r = (qbs[:, None] * bq + torch.arange(bq)[None, :]).flatten()
    in_rows = (r < Lq).to(t.device)
    sample = t.index_select(2, r.clamp(max=Lq - 1).to(t.device)).to(torch.int64)
    valid = (sample >= 0) & (sample < Lk) & in_rows[:, None]
    kb = torch.where(valid, sample // bk, nKB).reshape(Bi * Hi * qbs.numel(), bq * W)
    hit = torch.zeros((kb.shape[0], nKB + 1), dtype=torch.bool, device=t.device)
    hit.scatter_(1, kb, True)
    listed, blocks = torch.stack([valid.sum(), hit[:, :nKB].sum()]).tolist()
    return listed / (blocks * bq * bk) if blocks else 0.0


def prefer_blocks(attn_indices: torch.Tensor, Lq: int, Lk: int,
                  block_size: Tuple[int, int] = (128, 128), *,
                  min_density: float = MIN_DENSITY) -> bool:
    """The "auto" decision: take the block path when the estimated density is at least
    `min_density` (module constant MIN_DENSITY). Does not check for duplicates
    (indices_to_blocks does, and returns None)."""
    return estimate_density(attn_indices, Lq, Lk, block_size) >= min_density
