"""The forward's band masks (csrc/block_lists.cuh: key_band, column_mask), compiled as host
C++ and checked against the column ranges the library's builders give the kernels: where
every key of a tile has one visible interval of rows and all of them the same band, the
per-row bounds that the band gives select exactly the visible scores, in each thread's
columns of the accumulator (offsets 8 (c / 2) + c % 2 past 2 (lane % 4)). perf-notes C112."""
import subprocess

import pytest
import torch

from flexsparse import masks as M
from host_programs import host_program

TILE = 128     # keys per tile (kBlockN)
COLS = 32      # a thread's columns of an m64n128 accumulator


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


def key_ranges(mask, Lq, Lk):
    """Each key's two hidden row ranges as (start, length), from the column ranges that the
    library's builders give the kernels (as the forward's load_extras stages them)."""
    cr = mask.compile(1, 1, 1, Lq, Lk).col_ranges[0, 0].tolist()
    out = []
    for row in cr:
        pairs = [(row[k], max(row[k + 1] - row[k], 0)) for k in range(0, len(row), 2)]
        out.append((pairs + [(0, 0)])[:2])
    return out


def masks_under_test():
    g = torch.Generator().manual_seed(7)
    lts = torch.randint(0, 1000, (1, 1, 1100, 1), generator=g)
    flashmask = torch.cat([lts, lts + torch.randint(0, 300, lts.shape, generator=g),
                           torch.zeros_like(lts), torch.randint(0, 200, lts.shape, generator=g)], -1)
    return {"causal": (M.causal(), 1000, 1100), "sliding256": (M.sliding_window(255), 1000, 1100),
            "sliding64": (M.sliding_window(63), 777, 777),
            "lookahead": (M.sliding_window(200, 30), 1000, 1100),
            "lookahead_cross": (M.sliding_window(200, 30), 1100, 900),
            "document": (M.document([300, 1, 400, 299]), 1000, 1000),
            "prefix": (M.prefix_lm(300), 1000, 1100),
            "flashmask": (M.column_ranges(flashmask, causal=False), 1000, 1100)}


@pytest.mark.parametrize("kind", list(masks_under_test()))
def test_band_rows_equal_the_intervals(run, kind):
    mask, R, Lk = masks_under_test()[kind]
    ranges = key_ranges(mask, R, Lk)
    banded = 0
    for j0 in range(0, Lk, TILE):
        keys = list(range(j0, min(j0 + TILE, Lk)))
        lines = [f"B {R} {j} {s0} {l0} {s1} {l1}" for j in keys
                 for (s0, l0), (s1, l1) in [ranges[j]]]
        out = [line.split() for line in run(lines)]
        if any(o[0] != "ok" for o in out) or len({(o[3], o[4]) for o in out}) != 1:
            continue            # the kernel takes the staged intervals for this tile
        banded += 1
        a, b = int(out[0][3]), int(out[0][4])
        vis = {j: (int(o[1]), int(o[2])) for j, o in zip(keys, out)}
        # the kernel's bounds per row, then per thread column (col_base = 2 (lane % 4))
        queries = []
        for i in range(R):
            lo, hi = i - b + 1 - j0, i - a + 1 - j0
            for col_base in (0, 2, 4, 6):
                queries.append((i, col_base, f"M {lo - col_base} {hi - col_base} {COLS}"))
        masks = run([q[2] for q in queries])
        for (i, col_base, _), m in zip(queries, masks):
            m = int(m)
            for c, off in enumerate(thread_offsets(COLS)):
                j = j0 + col_base + off
                if j not in vis:
                    continue
                s, n = vis[j]
                assert bool(m >> c & 1) == (s <= i < s + n), (kind, R, j0, i, j)
    # causal and window masks have banded tiles; documents (each key's rows end at its
    # document's end), prefix-LM and FlashMask ranges need not
    assert banded > 0 or kind in ("document", "prefix", "flashmask")
