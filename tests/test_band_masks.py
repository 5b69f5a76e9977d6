"""The forward's band masks (csrc/block_lists.cuh: key_band, column_mask), compiled as host
C++ and checked against the column-range semantics: where every key of a tile has one
visible interval of rows and all of them the same band, the per-row bounds that the band
gives select exactly the visible scores, in each thread's columns of the accumulator
(offsets 8 (c / 2) + c % 2 past 2 (lane % 4)). perf-notes C112."""
import random
import subprocess

import pytest

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


def hidden_ranges(kind, j, R, p):
    """(start, length) pairs of the rows key j hides, as the builders' column ranges."""
    if kind == "causal":                      # rows i >= j see key j
        return [(0, j), (0, 0)]
    if kind == "sliding":                     # rows j <= i < j + W
        return [(0, j), (j + p, max(R - j - p, 0))]
    if kind == "lookahead":                   # rows j - p <= i <= j + p (clipped at 0)
        return [(0, max(j - p, 0)), (j + p + 1, max(R - j - p - 1, 0))]
    if kind == "document":                    # causal within documents of length p
        end = (j // p + 1) * p
        return [(0, j), (end, max(R - end, 0))]
    if kind == "random":                      # FlashMask-like: any two ranges
        rng = random.Random(j * 7919 + p)
        return [(rng.randrange(-5, R + 5), rng.randrange(0, R)) for _ in range(2)]
    raise ValueError(kind)


@pytest.mark.parametrize("kind,p", [("causal", 0), ("sliding", 256), ("sliding", 64),
                                    ("lookahead", 40), ("document", 300), ("random", 1)])
@pytest.mark.parametrize("R", [1000, 777])
def test_band_rows_equal_the_intervals(run, kind, p, R):
    Lk = 1100
    banded = 0
    for j0 in range(0, Lk, TILE):
        keys = list(range(j0, min(j0 + TILE, Lk)))
        lines = []
        for j in keys:
            (s0, l0), (s1, l1) = hidden_ranges(kind, j, R, p)
            lines.append(f"B {R} {j} {s0} {l0} {s1} {l1}")
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
                assert bool(m >> c & 1) == (s <= i < s + n), (kind, p, R, j0, i, j)
    # causal and window masks have banded tiles; documents (each key's rows end at its
    # document's end) and random ranges need not
    assert banded > 0 or kind in ("document", "random")
