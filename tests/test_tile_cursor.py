"""The CUDA kernels' block-list walk (TileCursor, csrc/block_lists.cuh), compiled as host C++
and run on random lists against the descriptor's semantics (docs/design.md): a row's
partial list, then its full list; explicit entries in order up to the count, or range-form
blocks range after range up to the count; entries outside [0, n_blocks) skipped whole;
each block split into `sub` kernel tiles. Every walk is also taken from cursors started
beforehand and copied (the forward producer's hand-off to its consumers) and must match.
Random lists include what a corrupted or hand-made descriptor may hold: negative and
too-large entries, counts past the width or past the blocks the ranges hold, empty and
reversed ranges."""
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from host_programs import host_program


@pytest.fixture(scope="module")
def walker(tmp_path_factory):
    exe = host_program(tmp_path_factory, "tile_cursor")

    def walk(sub, n_blocks, lists):
        text = f"{sub} {n_blocks}\n"
        for count, ranges, entries in lists:
            text += f"{count} {ranges} {len(entries)} {' '.join(map(str, entries))}\n"
        out = subprocess.run([str(exe)], input=text, capture_output=True, text=True,
                             check=True).stdout.split("\n")
        end = out.index("end")
        end2 = out.index("end", end + 1)
        tiles = [tuple(map(int, line.split())) for line in out[:end]]
        # the forward consumers' walk, from cursors started by the producer and copied
        handed = [tuple(map(int, line.split())) for line in out[end + 1:end2]]
        assert handed == tiles, (tiles, handed)
        return tiles
    return walk


def expected_walk(sub, n_blocks, lists):
    tiles = []
    for partial, (count, ranges, entries) in zip((1, 0), lists):
        if ranges == 0:
            blocks = entries[:max(min(count, len(entries)), 0)]
        else:
            blocks = []
            for k in range(ranges):
                blocks += range(entries[2 * k], entries[2 * k + 1])
            blocks = blocks[:max(count, 0)]
        for e in blocks:
            if 0 <= e < n_blocks:
                tiles += [(e * sub + s, partial) for s in range(sub)]
    return tiles


ENTRY = st.integers(-3, 12)


@st.composite
def block_list(draw):
    if draw(st.booleans()):       # explicit entries
        entries = draw(st.lists(ENTRY, max_size=6))
        return draw(st.integers(-2, 8)), 0, entries
    ranges = draw(st.integers(1, 4))
    entries = []
    for _ in range(ranges):
        lo = draw(ENTRY)
        entries += [lo, lo + draw(st.integers(-2, 6))]
    return draw(st.integers(-2, 20)), ranges, entries


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sub=st.sampled_from([1, 2, 3]), n_blocks=st.integers(0, 10),
       partial=block_list(), full=block_list())
def test_cursor_walks_the_lists(walker, sub, n_blocks, partial, full):
    lists = [partial, full]
    assert walker(sub, n_blocks, lists) == expected_walk(sub, n_blocks, lists)


def test_cursor_examples(walker):
    # causal-like row: partial [3, 4), full [0, 3) with two unused (0, 0) slots
    lists = [(1, 4, [3, 4, 0, 0, 0, 0, 0, 0]), (3, 4, [0, 3, 0, 0, 0, 0, 0, 0])]
    assert walker(2, 8, lists) == [(6, 1), (7, 1), (0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (5, 0)]
    # a count that stops inside a range, and a range that starts below 0
    lists = [(0, 1, [0, 0]), (4, 2, [-2, 2, 5, 9])]
    assert walker(1, 8, lists) == [(0, 0), (1, 0)]
    # nothing listed
    assert walker(1, 8, [(0, 0, []), (0, 0, [])]) == []
