"""Hand-corrupted and reused descriptors on the GPU backends (issue 19): out-of-range list
entries, counts past the width or negative, in explicit and range form, for the forward
and the backward of the Triton and CUDA kernels. Each either raises a ValueError naming
the mask or gives what the float64 reference gives on the same descriptor (the rules of
docs/semantics.md, "Non-finite input" and "Corrupted descriptors"). Run under
compute-sanitizer by `bash tests/gpu.sh fuzz`: no out-of-bounds access whatever the lists."""
import copy
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import flexsparse  # noqa: E402
from flexsparse import masks as M  # noqa: E402
from flexsparse.ops import backends  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import test_triton_gpu as T  # noqa: E402

DEV = T.DEV
BACKENDS = [b for b in ("triton", "cuda") if b in backends.available()]
CORRUPTIONS = {
    "index_out_of_range": lambda mt: mt.kv_index.fill_(10_000),
    "negative_index": lambda mt: mt.kv_full_index.fill_(-7),
    "count_past_width": lambda mt: mt.kv_count.fill_(1 << 20),
    "negative_count": lambda mt: mt.kv_full_count.fill_(-3),
    "q_lists_too": lambda mt: (mt.q_index.fill_(10_000), mt.q_full_count.fill_(1 << 20)),
}


def _run(backend, desc, q, k, v, do, dtype):
    leaves = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
    out, lse = flexsparse.attention(*leaves, desc, backend=backend, return_lse=True)
    grads = torch.autograd.grad(out, leaves, do.to(dtype))
    return (out, lse) + grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
@pytest.mark.parametrize("form", ["ranges", "explicit"])
def test_corrupted_descriptor(backend, corruption, form):
    torch.manual_seed(len(corruption))
    B, H, L, D = 1, 2, 700, 128
    layout = (torch.rand(1, 1, 6, 6, device=DEV) < 0.5) | torch.eye(6, dtype=torch.bool, device=DEV)
    mask = M.causal() if form == "ranges" else M.block_sparse(layout, 128)
    desc = mask.compile(B, H, H, L, L, device=DEV)
    desc = copy.deepcopy(desc if form == "ranges" else desc.with_lists())
    assert desc.has_ranges == (form == "ranges")
    CORRUPTIONS[corruption](desc.mask_tensors())
    q, k, v, do = (torch.randn(B, H, L, D, device=DEV) for _ in range(4))
    got = _run(backend, desc, q, k, v, do, torch.bfloat16)
    want = _run("reference", desc, q, k, v, do, torch.float64)
    # What can be compared (docs/semantics.md, "Corrupted descriptors"): the reference
    # reads only the kv lists; the kernels read them for out and lse (and Triton for dQ),
    # but walk the q lists for dK/dV (CUDA: for dQ too), which disagree with the kv lists
    # once either is corrupted. A count past an explicit list's entries exposes its
    # padding (block 0, again and again): the kernels visit a block as often as it is
    # listed, the reference once. Whatever is not compared must be free of NaN (and in
    # bounds: `bash tests/gpu.sh fuzz` runs this file under compute-sanitizer).
    if corruption == "count_past_width" and form == "explicit":
        n = 0
    elif corruption == "q_lists_too" or backend == "cuda":
        n = 2
    else:
        n = 3
    for name, a in zip(("out", "lse", "dq", "dk", "dv"), got):
        assert not torch.isnan(a).any(), name
    for name, a, r in list(zip(("out", "lse", "dq", "dk", "dv"), got, want))[:n]:
        a = a.double()
        assert torch.equal(torch.isfinite(a), torch.isfinite(r)), name
        fin = torch.isfinite(r)
        torch.testing.assert_close(a[fin], r[fin], atol=6e-2, rtol=6e-2, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("other", ["batch", "length", "heads"])
def test_descriptor_reused_at_other_sizes_is_refused(backend, other):
    # per-batch mask tensors (a dense mask of batch 2), so that batch 3 cannot broadcast
    dense = torch.rand(2, 1, 700, 700, device=DEV) < 0.5
    desc = M.dense(dense).compile(2, 2, 2, 700, 700, device=DEV)
    B, H, L = {"batch": (3, 2, 700), "length": (2, 2, 699), "heads": (2, 4, 700)}[other]
    q = torch.randn(B, H, L, 128, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="mask"):
        flexsparse.attention(q, q, q, desc, backend=backend)


def test_index_entries_out_of_range_read_nothing():
    """attn_indices entries outside [-1, Lk) (a hand-made index descriptor): the Triton
    index kernels skip them, forward and backward, as the reference does; in bounds under
    compute-sanitizer."""
    torch.manual_seed(11)
    B, H, L, D = 1, 2, 700, 128
    idx = torch.randint(-1, L, (B, H, L, 8), device=DEV)
    desc = copy.deepcopy(M.indices(idx).compile(B, H, H, L, L, device=DEV))
    desc.attn_indices[..., 0] = 10_000
    desc.attn_indices[..., 1] = -7
    q, k, v, do = (torch.randn(B, H, L, D, device=DEV) for _ in range(4))
    got = _run("triton", desc, q, k, v, do, torch.bfloat16)
    want = _run("reference", desc, q, k, v, do, torch.float64)
    for name, a, r in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        a = a.double()
        assert torch.equal(torch.isfinite(a), torch.isfinite(r)), name
        fin = torch.isfinite(r)
        torch.testing.assert_close(a[fin], r[fin], atol=6e-2, rtol=6e-2, msg=name)


# A partial_bits_index entry past the pool reads no bitmap (docs/semantics.md, "Corrupted
# descriptors"): the kernels check `idx < P`; run under compute-sanitizer by tests/gpu.sh fuzz.
@pytest.mark.parametrize("backend", BACKENDS)
def test_bitmap_index_past_pool(backend):
    torch.manual_seed(12)
    B, H, L, D = 1, 2, 700, 128
    idx = torch.randint(0, L, (1, H, L, 2), device=DEV)
    desc = M.or_(M.indices(idx), M.sliding_window(64)).compile(B, H, H, L, L, device=DEV)
    desc = copy.deepcopy(desc)
    assert desc.partial_bits_index is not None
    desc.partial_bits_index.fill_(desc.partial_bits.shape[0] + 3)
    q, k, v, do = (torch.randn(B, H, L, D, device=DEV) for _ in range(4))
    got = _run(backend, desc, q, k, v, do, torch.bfloat16)
    want = _run("reference", desc, q, k, v, do, torch.float64)
    for name, a, r in list(zip(("out", "lse"), got, want)):
        a = a.double()
        assert torch.equal(torch.isfinite(a), torch.isfinite(r)), name
        fin = torch.isfinite(r)
        torch.testing.assert_close(a[fin], r[fin], atol=6e-2, rtol=6e-2, msg=name)
