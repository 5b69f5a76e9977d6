"""The fused mask build's shortcut (csrc/build_masks.h, monotone_key_block_bounds): for
documents and prefix-LM a key block's bounds follow from its first and last column alone.
Compiled as host C++ and checked against the bounds over every column (the column
kernel's and the CPU build's) on random lengths, prefixes, odd sizes and block shapes,
zero-length documents included."""
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from host_programs import host_program
DOCUMENT_CAUSAL, DOCUMENT, PREFIX_LM = 0, 1, 2


@pytest.fixture(scope="module")
def bounds_two_ways(tmp_path_factory):
    exe = host_program(tmp_path_factory, "build_stats")

    def run(kind, Lq, Lk, bq, bk, values):
        text = f"{kind} {Lq} {Lk} {bq} {bk} {len(values)} {' '.join(map(str, values))}\n"
        out = subprocess.run([str(exe)], input=text, capture_output=True, text=True,
                             check=True).stdout.splitlines()
        assert len(out) == -(-Lk // bk)
        return [tuple(line.split("|")[0].split()) for line in out], \
            [tuple(line.split("|")[1].split()) for line in out]
    return run


def split_lengths(L, cuts):
    """Document lengths summing to L from cut points (repeats give zero-length documents)."""
    points = sorted(min(max(c, 0), L) for c in cuts)
    edges = [0] + points + [L]
    return [b - a for a, b in zip(edges, edges[1:])]


blocks = st.sampled_from([1, 3, 16, 64, 100, 128])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(L=st.integers(1, 700), cuts=st.lists(st.integers(0, 700), max_size=12), bq=blocks, bk=blocks,
       causal=st.booleans())
def test_documents(bounds_two_ways, L, cuts, bq, bk, causal):
    lengths = split_lengths(L, cuts)
    every, two = bounds_two_ways(DOCUMENT_CAUSAL if causal else DOCUMENT, L, L, bq, bk, lengths)
    assert every == two


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(Lq=st.integers(1, 700), Lk=st.integers(1, 700), prefix=st.integers(0, 800), bq=blocks,
       bk=blocks)
def test_prefix_lm(bounds_two_ways, Lq, Lk, prefix, bq, bk):
    every, two = bounds_two_ways(PREFIX_LM, Lq, Lk, bq, bk, [prefix])
    assert every == two


def test_the_harness_sees_a_difference(bounds_two_ways):
    """A case where the blocks differ from each other, so that equal lists are not equal
    by accident: document boundaries inside key blocks, both slots used."""
    every, two = bounds_two_ways(DOCUMENT_CAUSAL, 300, 300, 64, 64, [50, 100, 150])
    assert len(set(every)) > 1 and every == two
    # key block 0 (keys 0-63): upper hull [0, 1), no cover; lower hull [0, 5), cover [3, 5)
    assert every[0] == ("0", "1", "0", "0", "0", "5", "3", "5")
