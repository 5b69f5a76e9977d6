"""Comparisons of block descriptors shared by tests/test_build_op.py and
tests/gpu/test_build_op_gpu.py (no hypothesis here: the GPU machine may lack it)."""
import torch

from flexsparse import masks as M
from flexsparse.ops import visibility
from flexsparse.ops.schema import MAX_RANGES

LISTS = ("kv", "kv_full", "q", "q_full")


def grids(desc):
    """Per list: (count, bool grid of the listed blocks), whatever the list form."""
    Lq, Lk = desc.seq_lengths
    bq, bk = desc.block_size
    nQB, nKB = -(-Lq // bq), -(-Lk // bk)
    out = {}
    for name in LISTS:
        count, index = getattr(desc, name + "_count"), getattr(desc, name + "_index")
        n = nKB if name.startswith("kv") else nQB
        if index.dim() == 5:
            grid = visibility.ranges_to_grid(index, n, count)
        else:
            cols = torch.arange(index.shape[-1])
            valid = cols < count[..., None].long()
            hits = torch.zeros(index.shape[:-1] + (n,), dtype=torch.int32)
            hits.scatter_add_(-1, torch.where(valid, index.long(), 0), valid.to(torch.int32))
            grid = hits > 0
        out[name] = (count, grid)
    return out


def check_range_rows(desc):
    """Range form with MAX_RANGES sorted, disjoint, nonempty ranges first, then (0, 0)."""
    for name in LISTS:
        index = getattr(desc, name + "_index")
        assert index.dim() == 5 and index.shape[-2:] == (MAX_RANGES, 2), name
        assert index.dtype == torch.int32 and index.is_contiguous()
        lo, hi = index[..., 0], index[..., 1]
        nonempty = hi > lo
        assert ((lo == 0) & (hi == 0) | nonempty).all(), name
        # nonempty ranges first, in order, not touching
        assert (nonempty[..., 1:] <= nonempty[..., :-1]).all(), name
        both = nonempty[..., 1:] & nonempty[..., :-1]
        assert (~both | (lo[..., 1:] > hi[..., :-1])).all(), name


def state_masks(L, device="cpu"):
    """Masks whose static build reaches the descriptor through block states
    (DescriptorParts.state) rather than a build op of their own."""
    g = torch.Generator().manual_seed(L)
    dense = (torch.rand(2, 1, L, L, generator=g) < 0.6).to(device)
    return {
        "causal": M.causal(),
        "sliding": M.sliding_window(L // 5),
        "shared_question": M.shared_question(L // 3, [L // 3, L - 2 * (L // 3)]),
        "dense": M.dense(dense),
        "and(dense, causal)": M.and_(M.dense(dense), M.causal()),
        "or(sliding, prefix)": M.or_(M.sliding_window(7), M.prefix_lm(L // 4)),
        "document | global": M.or_(M.document([L // 2, L - L // 2]), M.global_tokens(3)),
    }
