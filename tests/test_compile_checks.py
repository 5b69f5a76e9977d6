"""Checks that hold inside torch.compile(fullgraph=True, dynamic=True) (issue 16, CPU items).

- value checks that need the data (document lengths summing to L, prefix lengths >= 0,
  index entries in range) are `torch._assert_async` ops of the graph: RuntimeError with
  the message when the graph runs on CPU (eager: ValueError with the numbers);
- a descriptor used at other sizes: ValueError naming both sizes, raised by the graph op
  `flexsparse::check_sizes` (eager: the same ValueError);
- (B, n) lengths with a symbolic batch (the `in (1, B)` bug);
- converted FlexAttention masks know their sizes in `flex.to_block_mask`.
docs/dynamic-masks.md describes which check runs where.
"""
import math
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import flexsparse
from flexsparse import flex
from flexsparse import masks as M

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
BLOCK = (16, 16)


def _q(B, L, H=2, D=8, seed=0):
    return torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(seed))


def _compiled(fn, backend="aot_eager"):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    return torch.compile(fn, backend=counter, fullgraph=True, dynamic=True), counter


def _doc_attention(q, lengths):
    return flexsparse.attention(q, q, q, M.document(lengths), block_size=BLOCK)


def _doc_lengths(B, L, n, rows):
    """(B, n) lengths summing to L per row (zero padded), different per row when rows."""
    lens = torch.zeros(B, n, dtype=torch.int64)
    for b in range(B):
        first = L // 2 - (3 * b if rows else 0)
        lens[b, 0], lens[b, 1] = first, L - first
    return lens


# ------------------------------------------------------------------ documents

# Bad document lengths at L = 64: 1-D (batched False) and (B, n) (batched True).
BAD_LENGTHS = {
    False: [torch.tensor([10, 20])],                 # sums to 30, L = 64
    True: [torch.tensor([[32, 32], [10, 20]]),       # second row wrong
           torch.tensor([[80, -16], [32, 32]])],     # sums to 64 but negative
}


@pytest.mark.parametrize("batched", [False, True])
def test_document_lengths_one_frame_over_lengths(batched):
    """Good lengths: one frame over three lengths, equal to eager (1-D and (B, n); the
    (B, n) case is the `lens.shape[0] in (1, B)` bug with a symbolic B). Then BAD_LENGTHS
    into the same compiled function (compiled once: compiles are the slow part): refused
    when the graph runs, a RuntimeError with the message, as eager refuses them
    (ValueError)."""
    f, counter = _compiled(_doc_attention)
    B = 2
    for L in (32, 48, 64):
        q = _q(B, L, seed=L)
        lens = _doc_lengths(B, L, 3, rows=True) if batched else torch.tensor([L // 4, L - L // 4])
        torch.testing.assert_close(f(q, lens), _doc_attention(q, lens))
    assert counter.frame_count == 1
    for bad in BAD_LENGTHS[batched]:
        with pytest.raises(ValueError, match="lengths"):
            _doc_attention(q, bad)
        with pytest.raises(RuntimeError,
                           match="lengths must be non-negative and each row must sum"):
            f(q, bad)


def test_document_batched_lengths_inductor():
    f, counter = _compiled(_doc_attention, "inductor")
    for L in (32, 48, 64):
        q = _q(2, L, seed=L)
        lens = _doc_lengths(2, L, 3, rows=True)
        torch.testing.assert_close(f(q, lens), _doc_attention(q, lens), atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1


def test_document_batch_dim_mismatch_raises_compiled():
    """(3, n) lengths for B=2: refused (a shape check, at trace time under compile)."""
    q = _q(2, 32)
    lens = _doc_lengths(3, 32, 2, rows=False)
    with pytest.raises(ValueError, match="batch dim 3 must be 1 or B=2"):
        _doc_attention(q, lens)
    f, _ = _compiled(_doc_attention)
    with pytest.raises(Exception, match="batch dim 3 must be 1 or B=2"):
        f(q, lens)


def test_shared_question_lengths_checked_eager():
    q = _q(1, 32)
    with pytest.raises(ValueError, match="sum to L=32"):
        flexsparse.attention(q, q, q, M.shared_question(8, [8, 8]), block_size=BLOCK)


# ------------------------------------------------------------------ prefix lengths

def _prefix_attention(q, prefix):
    return flexsparse.attention(q, q, q, M.prefix_lm(prefix), block_size=BLOCK)


def test_prefix_lengths_compiled():
    f, counter = _compiled(_prefix_attention)
    for L in (32, 48, 64):
        q = _q(2, L, seed=L)
        prefix = torch.tensor([L // 4, L // 2])
        torch.testing.assert_close(f(q, prefix), _prefix_attention(q, prefix))
    assert counter.frame_count == 1
    bad = torch.tensor([3, -1])
    with pytest.raises(ValueError, match="prefix_len: must be >= 0"):
        _prefix_attention(q, bad)
    with pytest.raises(RuntimeError, match="prefix_len: must be >= 0"):
        f(q, bad)
    with pytest.raises(ValueError, match="prefix_len"):
        M.prefix_lm(-1)


# ------------------------------------------------------------------ index lists

def _index_attention(q, idx):
    return flexsparse.attention(q, q, q, M.indices(idx))


@pytest.mark.parametrize("bad_value", [-2, 64, 1000])
def test_index_values_out_of_range(bad_value):
    q = _q(1, 64)
    good = torch.randint(0, 64, (1, 2, 64, 4), generator=torch.Generator().manual_seed(1))
    bad = good.clone()
    bad[0, 1, 5, 2] = bad_value
    with pytest.raises(ValueError, match="attn_indices"):
        _index_attention(q, bad)
    f, _ = _compiled(_index_attention)
    torch.testing.assert_close(f(q, good), _index_attention(q, good))
    with pytest.raises(RuntimeError, match=r"attn_indices: entries must be -1 or in \[0, Lk\)"):
        f(q, bad)


def test_index_lists_one_frame_over_lengths():
    f, counter = _compiled(_index_attention)
    for L in (32, 48, 64):
        q = _q(1, L, seed=L)
        idx = torch.randint(-1, L, (1, 2, L, 4), generator=torch.Generator().manual_seed(L))
        torch.testing.assert_close(f(q, idx), _index_attention(q, idx))
    assert counter.frame_count == 1


# ------------------------------------------------------------------ column ranges, block layouts

def test_column_ranges_wrong_length_fails_loudly():
    """A shape check: eager ValueError; compiled, Dynamo stops tracing with it (no zeros)."""
    def fn(q, t):
        return flexsparse.attention(q, q, q, M.column_ranges(t, causal=True), block_size=BLOCK)
    q = _q(1, 32)
    t = torch.full((1, 1, 40, 1), 32, dtype=torch.int32)
    with pytest.raises(ValueError, match="startend_row_indices"):
        fn(q, t)
    f, _ = _compiled(fn)
    with pytest.raises(Exception, match="startend_row_indices"):
        f(q, t)
    good = torch.full((1, 1, 32, 1), 32, dtype=torch.int32)
    torch.testing.assert_close(f(q, good), fn(q, good))


def test_block_layout_wrong_grid_fails_loudly():
    def fn(q, layout):
        return flexsparse.attention(q, q, q, M.block_sparse(layout, 16), block_size=BLOCK)
    q = _q(1, 32)
    bad = torch.ones(1, 1, 3, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="layout"):
        fn(q, bad)
    f, _ = _compiled(fn)
    with pytest.raises(Exception, match="layout"):
        f(q, bad)
    good = torch.tensor([[[[True, False], [True, True]]]])
    torch.testing.assert_close(f(q, good), fn(q, good))


# ------------------------------------------------------------------ descriptors at other sizes

def _desc_attention(q, desc):
    return flexsparse.attention(q, q, q, desc)


# Refusals inside compiled code are ValueErrors raised when the graph runs, by the
# check_sizes graph op the API emits (descriptor sizes against the inputs), which runs
# before the attention op. (The op's fake kernel leaves its own refusals, e.g. of the
# list shapes, to the op's kernel: the same checks when the graph runs.)

@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_descriptor_at_other_length_value_error(backend):
    desc = M.causal().compile(1, 2, 2, 32, 32, block_size=BLOCK)
    q64 = _q(1, 64)
    msg = r"descriptor was compiled for \(Lq, Lk\)=\(32, 32\), inputs have \(64, 64\)"
    with pytest.raises(ValueError, match=msg):
        _desc_attention(q64, desc)
    f, counter = _compiled(_desc_attention, backend)
    q32 = _q(1, 32)
    torch.testing.assert_close(f(q32, desc), _desc_attention(q32, desc), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=msg):
        f(q64, desc)
    torch.testing.assert_close(f(q32, desc), _desc_attention(q32, desc), atol=1e-5, rtol=1e-5)
    # the call at 64 may trace a second frame (the first is not reused for L=64); its
    # graph op refuses it
    assert 1 <= counter.frame_count <= 2


def test_descriptor_other_heads_and_batch_value_error():
    desc = M.document(torch.tensor([[16, 16], [8, 24]])).compile(2, 2, 2, 32, 32,
                                                                block_size=BLOCK)
    f, _ = _compiled(_desc_attention)
    q = _q(2, 32)
    torch.testing.assert_close(f(q, desc), _desc_attention(q, desc))
    for bad, msg in ((_q(2, 32, H=4), r"\(Hq, Hkv\)=\(2, 2\), inputs have \(4, 4\)"),
                     (_q(3, 32), r"has batch 2, inputs have B=3")):
        with pytest.raises(ValueError, match=msg):
            _desc_attention(bad, desc)
        with pytest.raises(ValueError, match=msg):
            f(bad, desc)


def test_descriptors_of_several_lengths():
    """A descriptor per length: right results, and the wrong one is refused."""
    f, _ = _compiled(_desc_attention)
    descs = {L: M.sliding_window(7).compile(1, 2, 2, L, L, block_size=BLOCK) for L in (32, 48, 64)}
    for L, desc in descs.items():
        q = _q(1, L, seed=L)
        torch.testing.assert_close(f(q, desc), _desc_attention(q, desc))
    with pytest.raises(ValueError, match=r"\(Lq, Lk\)=\(48, 48\), inputs have \(64, 64\)"):
        f(_q(1, 64), descs[48])


# ------------------------------------------------------------------ converted masks know their sizes

def _causal_mod(b, h, q, kv):
    return q >= kv


def test_to_block_mask_from_mask_mod_needs_no_sizes():
    m = flex.from_mask_mod(_causal_mod, 2, 4, 40, 40, block_size=16)
    bm = flex.to_block_mask(m)
    assert bm.seq_lengths == (40, 40)
    assert tuple(bm.kv_num_blocks.shape) == (2, 4, 3)
    assert bm.BLOCK_SIZE == (16, 16)
    dense = torch.ones(40, 40, dtype=torch.bool).tril()
    assert torch.equal(bm.to_dense()[0, 0], torch.ones(3, 3, dtype=torch.bool).tril().int())
    assert torch.equal(m.to_dense(2, 4, 40, 40)[1, 3], dense)


def test_to_block_mask_from_block_mask_needs_no_sizes():
    from torch.nn.attention.flex_attention import create_block_mask
    bm0 = create_block_mask(_causal_mod, 2, 1, 40, 40, device="cpu", BLOCK_SIZE=16)
    bm = flex.to_block_mask(flex.from_block_mask(bm0))
    assert bm.seq_lengths == (40, 40)
    assert tuple(bm.kv_num_blocks.shape) == (2, 1, 3)
    assert torch.equal(bm.to_dense(), bm0.to_dense())
    q = _q(2, 40)
    torch.testing.assert_close(flexsparse.attention(q, q, q, bm), flexsparse.attention(q, q, q, bm0))


def test_to_block_mask_recognized_and_plain_masks():
    m = flex.from_mask_mod(_causal_mod, None, None, 40, 40, recognize=True)
    assert flex.to_block_mask(m, block_size=16).seq_lengths == (40, 40)
    with pytest.raises(ValueError, match="Lq and Lk are required"):
        flex.to_block_mask(M.causal())


# ------------------------------------------------------------------ scale and softcap

def _scaled_attention(q, scale, softcap):
    return flexsparse.attention(q, q, q, M.causal(), scale=scale, softcap=softcap,
                                block_size=BLOCK)


def test_scale_and_softcap_arguments_compiled():
    """Floats passed into a compiled function are traced symbolically until the op call
    (which specializes them: a frame per value): good values match eager (the API's value
    checks once failed to trace, math.isfinite on a SymFloat), bad ones are refused by
    the op's kernel when the graph runs, with the value, as eager refuses them. softcap 0
    is no softcap, as None."""
    f, _ = _compiled(_scaled_attention)
    q = _q(1, 32)
    for scale, softcap in ((0.3, 5.0), (0.7, 20.0)):
        torch.testing.assert_close(f(q, scale, softcap), _scaled_attention(q, scale, softcap))
    torch.testing.assert_close(_scaled_attention(q, 0.3, 0.0), _scaled_attention(q, 0.3, None))
    bad = ((math.nan, 5.0, "scale: must be a finite positive float, got nan"),
           (-0.3, 5.0, r"scale: must be a finite positive float, got -0.3"),
           (0.3, float("inf"), "softcap: must be a finite float >= 0"),
           (0.3, -2.0, r"softcap: must be a finite float >= 0 .*got -2.0"))
    for scale, softcap, msg in bad:
        with pytest.raises(ValueError, match=msg):
            _scaled_attention(q, scale, softcap)
    # Compiled: one bad scale and one bad softcap (each value is a new frame, ~12 s on CI).
    for scale, softcap, msg in (bad[0], bad[3]):
        with pytest.raises(ValueError, match=msg):
            f(q, scale, softcap)


# ------------------------------------------------------------------ int arguments of masks

def _int_mask_arguments_compiled(make):
    """The good values of test_int_mask_arguments_compiled; returns the compiled function,
    the eager one and q."""
    def fn(q, n):
        return flexsparse.attention(q, q, q, make(n), block_size=BLOCK)
    f, _ = _compiled(fn)
    q = _q(1, 32)
    for n in (5, 7):
        torch.testing.assert_close(f(q, n), fn(q, n))
    assert repr(make(5)) == repr(make(5)) != repr(make(7)) and "5" in repr(make(5))
    return f, fn, q


@pytest.mark.parametrize("make", [
    lambda n: M.prefix_lm(n), lambda n: M.global_tokens(n),
    lambda n: M.shared_question(n, [32 - n]), lambda n: M.sliding_window(3) | M.prefix_lm(n),
], ids=["prefix_lm", "global_tokens", "shared_question", "or_"])
def test_int_mask_arguments_compiled(make):
    """A Python int passed into a compiled function is symbolic under dynamic=True: masks
    taking one traced into Dynamo's "BUILD_STRING type error" (their repr text was an
    f-string of the value, built at construction). Now it is built when first asked for.
    (sliding_window: in test_bad_int_mask_argument_compiled_names_it, on the same compile.)"""
    _int_mask_arguments_compiled(make)


def test_bad_int_mask_argument_compiled_names_it():
    """sliding_window's good values as in test_int_mask_arguments_compiled, then a bad
    symbolic int argument into the same compiled function (a compile fewer than a function
    of its own): refused while tracing, the message naming the argument (its value cannot
    be formatted there: masks.shown)."""
    f, fn, q = _int_mask_arguments_compiled(lambda n: M.sliding_window(n))
    with pytest.raises(ValueError, match=r"left: must be a non-negative int or None, got -3"):
        fn(q, -3)
    with pytest.raises(torch._dynamo.exc.Unsupported,
                       match=r"raised exception ValueError\('left: must be a non-negative int"):
        f(q, -3)


def test_element_wise_masks_refused_by_name_compiled():
    """Masks evaluated element-wise into bitmaps (eager only, data-dependent sizes):
    inside torch.compile a ValueError saying so and what to do, not Dynamo's "Could not
    guard on data-dependent expression" from deep inside; eager they work."""
    layout = torch.tensor([[[[True, False], [True, True]]]])

    def fn(q):
        return flexsparse.attention(q, q, q, M.block_sparse(layout, 16), block_size=(32, 32))
    q = _q(1, 32)
    fn(q)
    f, _ = _compiled(fn)
    with pytest.raises(torch._dynamo.exc.Unsupported,
                       match=r"ValueError\(['\"]mask: this mask is evaluated element-wise"):
        f(q)
    desc = M.block_sparse(layout, 16).compile(1, 2, 2, 32, 32, block_size=(32, 32))
    g, _ = _compiled(_desc_attention)
    torch.testing.assert_close(g(q, desc), _desc_attention(q, desc))


def test_bad_block_size_of_symbolic_ints_compiled_names_it():
    """A bad block_size whose ints are symbolic (passed into the compiled function): the
    refusal while tracing names block_size (formatting the tuple's repr used to stop
    Dynamo with "repr_impl not implemented" instead)."""
    def fn(q, bq):
        return flexsparse.attention(q, q, q, M.causal(), block_size=(bq, 16))
    f, _ = _compiled(fn)
    q = _q(1, 32)
    torch.testing.assert_close(f(q, 32), fn(q, 32))
    with pytest.raises(ValueError, match=r"block_size: must be positive, got \(-16, 16\)"):
        fn(q, -16)
    with pytest.raises(torch._dynamo.exc.Unsupported,
                       match=r"raised exception ValueError\(['\"]block_size: must be positive"):
        f(q, -16)


def test_descriptor_block_size_a_backend_refuses_compiled_names_it():
    """A descriptor of block size (8, 8) passed into compiled code with backend="triton"
    (whose block kernels need multiples of 16): the refusal while tracing carries eager's
    ValueError. The descriptor's block sizes are symbolic there, and the message's f-string
    of them stopped Dynamo with "BUILD_STRING type error" instead (found by test_fuzz with
    FUZZ_COMPILED_EXAMPLES=60)."""
    desc = M.causal().compile(1, 2, 1, 27, 12, block_size=(8, 8))
    q, kv = torch.randn(1, 2, 27, 8), torch.randn(1, 1, 12, 8)

    def fn(q, k, v, desc):
        return flexsparse.attention(q, k, v, desc, backend="triton")
    msg = r"backend: 'triton' cannot run these inputs: triton: descriptor block size \(8, 8\)"
    with pytest.raises(ValueError, match=msg):
        fn(q, kv, kv, desc)
    f, _ = _compiled(fn)
    with pytest.raises(torch._dynamo.exc.Unsupported,
                       match=r"raised exception ValueError\(['\"]" + msg):
        f(q, kv, kv, desc)


def test_check_sizes_op_opcheck():
    """torch.library.opcheck on the check_sizes graph op (schema, fake kernel, AOT
    dispatch), and its refusal: the ValueError with both sizes in the message."""
    op = torch.ops.flexsparse.check_sizes.default
    msg = "descriptor sizes {want}, inputs {got}"
    torch.library.opcheck(op, ([2, 3], [2, 3], msg))
    with pytest.raises(ValueError, match=r"descriptor sizes \(2, 4\), inputs \(2, 3\)"):
        op([2, 3], [2, 4], msg)
