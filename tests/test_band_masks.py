"""The band masks (csrc/block_lists.cuh: the forward's column_mask, C113, and the backward's
band_rows, C114), compiled as host C++, and the band of a causal or sliding-window mask
checked against the column ranges the library's builders give the kernels: the forward's
per-row bounds i - b < j <= i - a (and j < Lk), taken to each thread's columns of the
accumulator (offsets 8 (c / 2) + c % 2 past 2 (lane % 4)), and the backward's per-key
interval of rows j + a <= i < j + b (within 0..Lq-1), select exactly the visible scores of
every row and key. docs/perf-notes.md C113, C114."""
import subprocess

import pytest
import torch

from flexsparse import masks as M
from host_programs import host_program

TILE = 128     # keys per tile (kBlockN)
COLS = 32      # a thread's columns of an m64n128 accumulator
OPEN = 1 << 30  # b of a band with no upper end (causal: left = None)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    exe = host_program(tmp_path_factory, "band_masks")

    def run(lines):
        out = subprocess.run([str(exe)], input="\n".join(lines) + "\n", capture_output=True,
                             text=True, check=True).stdout.split("\n")
        return out[:len(lines)]
    return run


def thread_offsets(cols):
    return [8 * (c // 2) + c % 2 for c in range(cols)]


@pytest.mark.parametrize("cols", [32, 16])
def test_column_mask_is_the_columns_in_range(run, cols):
    offsets = thread_offsets(cols)
    cases = [(lo, hi) for lo in range(-9, 8 * cols // 2 + 10, 3) for hi in range(-9, 8 * cols // 2 + 10)]
    cases += [(-(1 << 30), 5), (3, 1 << 30), (-(1 << 30), 1 << 30), (7, 7), (9, 2)]
    got = run([f"M {lo} {hi} {cols}" for lo, hi in cases])
    for (lo, hi), line in zip(cases, got):
        want = sum(1 << c for c, o in enumerate(offsets) if lo <= o < hi)
        assert int(line) == want, (lo, hi, cols)


def band(left, right, Lq, Lk):
    """(a, b) of sliding_window(left, right): key j shows the rows j + a <= i < j + b (what
    the kernels' window_band gives for finite windows)."""
    off = Lk - Lq
    return -off - right, OPEN if left is None else -off + left + 1


def visible_rows(mask, Lq, Lk):
    """visible[i][j] from the column ranges the library's builders give the kernels (each
    key's hidden row ranges [start, end))."""
    cr = mask.compile(1, 1, 1, Lq, Lk).col_ranges[0, 0]
    rows = torch.arange(Lq).view(Lq, 1)
    hidden = torch.zeros(Lq, Lk, dtype=torch.bool)
    for k in range(0, cr.shape[-1], 2):
        hidden |= (rows >= cr[:, k].view(1, Lk)) & (rows < cr[:, k + 1].view(1, Lk))
    return ~hidden


@pytest.mark.parametrize("left,right,Lq,Lk", [(None, 0, 700, 700), (None, 0, 700, 900),
                                              (None, 0, 900, 700), (255, 0, 1000, 1000),
                                              (63, 0, 777, 777), (200, 30, 1000, 1100),
                                              (200, 30, 1100, 900), (0, 0, 300, 300)])
def test_band_rows_equal_the_column_ranges(run, left, right, Lq, Lk):
    a, b = band(left, right, Lq, Lk)
    vis = visible_rows(M.sliding_window(left, right), Lq, Lk)
    offsets = thread_offsets(COLS)
    for j0 in range(0, Lk, TILE):
        queries = [(i, cb, f"M {i - b + 1 - j0 - cb} {min(i - a + 1, Lk) - j0 - cb} {COLS}")
                   for i in range(Lq) for cb in (0, 2, 4, 6)]
        for (i, cb, _), m in zip(queries, run([q[2] for q in queries])):
            m = int(m)
            for c, o in enumerate(offsets):
                j = j0 + cb + o
                if j < Lk:
                    assert bool(m >> c & 1) == bool(vis[i, j]), (left, right, Lq, Lk, i, j)
                else:
                    assert not m >> c & 1, (left, right, Lq, Lk, i, j)


@pytest.mark.parametrize("left,right,Lq,Lk", [(255, 0, 1000, 1000), (63, 0, 777, 777),
                                              (200, 30, 1000, 1100), (200, 30, 1100, 900),
                                              (0, 0, 300, 300), (5000, 0, 700, 700),
                                              ((1 << 29) - 1, 7, 600, 650), (3, (1 << 29) - 1, 650, 600)])
def test_backward_key_intervals_equal_the_column_ranges(run, left, right, Lq, Lk):
    """The backward's per-key intervals from the window (what the kernel computes from the
    descriptor's window tensor, whose bounds the builder keeps below 2^29) against every key's
    visible rows under the builders' column ranges."""
    a, b = band(left, right, Lq, Lk)
    vis = visible_rows(M.sliding_window(left, right), Lq, Lk)
    got = run([f"R {j} {a} {b} {Lq}" for j in range(Lk)])
    for j, line in enumerate(got):
        start, length = map(int, line.split())
        rows = torch.zeros(Lq, dtype=torch.bool)
        rows[start:start + length] = True
        assert 0 <= start and length >= 0 and start + length <= Lq, (j, start, length)
        assert torch.equal(rows, vis[:, j]), (left, right, Lq, Lk, j, start, length)


def test_window_band_is_the_band(run):
    """window_band (csrc/block_lists.cuh, which both passes call on the descriptor's window)
    gives the (a, b) of the band the tests here check against the builders' ranges."""
    cases = [(255, 0, 1000, 1000), (200, 30, 1000, 1100), (200, 30, 1100, 900), (0, 0, 1, 1),
             ((1 << 29) - 1, 7, 600, 650)]
    got = run([f"W {left} {right} {Lq} {Lk}" for left, right, Lq, Lk in cases])
    for (left, right, Lq, Lk), line in zip(cases, got):
        assert tuple(map(int, line.split())) == band(left, right, Lq, Lk), (left, right, Lq, Lk)


def test_sliding_window_descriptors_carry_their_window():
    """sliding_window(left, right) descriptors hold (left, right) as an int32 (2,) tensor
    beside their column ranges (the CUDA forward's band kernels read it); masks whose ranges
    are not one window's (causal alone, combinations, documents) have none."""
    d = M.sliding_window(63).compile(1, 2, 2, 300, 400)
    assert d.window.dtype == torch.int32 and d.window.tolist() == [63, 0]
    assert d.window.device == d.col_ranges.device
    assert M.sliding_window(200, 30).compile(2, 4, 2, 500, 300).window.tolist() == [200, 30]
    # bounds past any sequence are kept below 2^29 (the kernels add Lq - Lk and 1 to them)
    assert M.sliding_window(10**12, 7).compile(1, 2, 2, 300, 300).window.tolist() == [(1 << 29) - 1, 7]
    for mask in (M.causal(), M.sliding_window(None, 5), M.causal() & M.sliding_window(10),
                 M.document([100, 200]), M.prefix_lm(30)):
        assert mask.compile(1, 2, 2, 300, 300).window is None, mask
    # the mask tensors the op reads: the window last
    mt = d.mask_tensors()
    assert mt.window is d.window and mt._fields[-1] == "window"


def test_window_checked_by_the_op():
    """The raw op names `window` when it is not an int32 (2,) tensor on the query's device or
    comes without col_ranges; FLEXSPARSE_DEBUG=1 names a negative one."""
    from flexsparse.ops import mask_checks
    q = torch.randn(1, 2, 300, 8)
    d = M.sliding_window(63).compile(1, 2, 2, 300, 300)
    good = d.mask_tensors()
    for bad, err in ((good._replace(window=torch.tensor([63, 0])), TypeError),
                     (good._replace(window=torch.tensor([63, 0, 1], dtype=torch.int32)), ValueError),
                     (good._replace(col_ranges=None), ValueError)):
        with pytest.raises(err, match="window"):
            torch.ops.flexsparse.attention(q, q, q, None, *bad, 128, 128, 0.5, 0.0, "reference", False)
    negative = good._replace(window=torch.tensor([-1, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="window"):
        mask_checks.check_mask_data(negative, 300, 300, 128, 128)
    out, _ = torch.ops.flexsparse.attention(q, q, q, None, *good, 128, 128, 0.5, 0.0, "reference", False)
    ref, _ = torch.ops.flexsparse.attention(q, q, q, None, *good._replace(window=None), 128, 128, 0.5,
                                            0.0, "reference", False)
    torch.testing.assert_close(out, ref)
