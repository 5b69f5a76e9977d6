"""The static-shape build (issue 16: no host synchronization for masks that hold GPU
tensors): on CPU, forced with `building_static()`, every tensor-holding mask kind gives the
same mask and the same attention as the compact build, and reads no data on the host
(`Tensor.item`, `tolist`, `__bool__`, `nonzero` are made to fail inside it)."""
import contextlib

import pytest
import torch

import flexsparse
from flexsparse import masks as M
from flexsparse.descriptor import building_static

B, H, L = 2, 2, 200
BLOCK = (32, 32)


def _cases(L=L):
    """The tensor-holding mask kinds at length L (lengths written for L = 200, scaled)."""
    def s(n):
        return n * L // 200
    g = torch.Generator().manual_seed(0)
    cr = torch.randint(0, L + 1, (B, H, L, 2), generator=g).sort(-1).values
    layout = torch.rand(1, H, -(-L // 32), -(-L // 32), generator=g) < 0.5
    dense = torch.rand(B, 1, L, L, generator=g) < 0.6
    idx = torch.randint(-1, L, (B, H, L, 9), generator=g, dtype=torch.int32)
    return {
        "document(tensor)": M.document(torch.tensor([[s(50), s(90), L - s(50) - s(90)],
                                                     [s(120), 0, L - s(120)]])),
        "prefix_lm(tensor)": M.prefix_lm(torch.tensor([s(30), s(77)])),
        "column_ranges": M.column_ranges(cr, causal=True),
        "block_sparse": M.block_sparse(layout, 32),
        "dense": M.dense(dense),
        "indices": M.indices(idx),
        "and(dense, document)": M.and_(M.dense(dense),
                                       M.document(torch.tensor([s(100), L - s(100)]))),
        "or(prefix, sliding)": M.or_(M.prefix_lm(torch.tensor([s(40), s(9)])),
                                     M.sliding_window(20)),
    }


@contextlib.contextmanager
def _no_host_reads(monkeypatch):
    """Host reads of tensor data raise inside the block."""
    def refuse(name):
        def f(*args, **kwargs):
            raise AssertionError(f"host read of tensor data: Tensor.{name}")
        return f
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "nonzero", "__int__"):
            m.setattr(torch.Tensor, name, refuse(name))
        yield


@pytest.mark.parametrize("name", sorted(_cases()))
def test_static_build_equals_compact_build(name, monkeypatch):
    mask = _cases()[name]
    compact = mask.compile(B, H, H, L, L, block_size=BLOCK)
    with building_static(), _no_host_reads(monkeypatch):
        static = mask._descriptor(_sizes(mask))
    assert torch.equal(static.to_dense(), compact.to_dense())
    q, k, v = (torch.randn(B, H, L, 16, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(i)) for i in range(3))
    torch.testing.assert_close(flexsparse.attention(q, k, v, static),
                               flexsparse.attention(q, k, v, compact))


def _sizes(mask, L=L):
    from flexsparse.descriptor import Sizes
    return Sizes(B, H, H, L, L, *BLOCK, torch.device("cpu"))


def test_the_compact_build_does_read_the_data(monkeypatch):
    """The check above is real: the compact build of a dense mask sizes its lists on the
    host, and is caught by it."""
    mask = _cases()["dense"]
    with pytest.raises(AssertionError, match="host read"), _no_host_reads(monkeypatch):
        mask._descriptor(_sizes(mask))


def test_compiled_build_equals_the_static_build():
    """mask.compile(compiled_build=True) (the static build through torch.compile) gives the
    static build's tensors, for a fresh mask at each of two lengths, with no recompile for
    the second length."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    frames = []
    for n in (L, L + 56):
        lens = torch.tensor([[n // 4, n // 2, n - n // 4 - n // 2], [n // 2, 0, n - n // 2]])
        mask = M.document(lens)
        got = mask.compile(B, H, H, n, n, block_size=BLOCK, compiled_build=True)
        with building_static():
            want = M.document(lens).compile(B, H, H, n, n, block_size=BLOCK)
        for name, a, b in zip(want.mask_tensors()._fields, got.mask_tensors(),
                              want.mask_tensors()):
            assert (a is None) == (b is None), name
            assert a is None or torch.equal(a, b), name
        frames.append(counters["stats"]["unique_graphs"])
    assert frames[1] == frames[0] >= 1
    with pytest.raises(TypeError, match="compiled_build"):
        mask.compile(B, H, H, L, L, compiled_build="yes")


BLOCK_KINDS = ["document(tensor)", "prefix_lm(tensor)", "column_ranges", "block_sparse",
               "dense", "and(dense, document)"]


@pytest.mark.skipif("triton" not in flexsparse.ops.backends.available(),
                    reason="needs Triton (TRITON_INTERPRET=1 on CPU)")
@pytest.mark.parametrize("name", BLOCK_KINDS)
def test_triton_without_host_facts_reads_no_mask_data(name, monkeypatch):
    """kernel_options={"trim_lists": False}: the Triton block kernels run a static-built
    descriptor forward and backward without reading mask data on the host (no list
    trimming, general column-range slot kinds, no short-row plan), and give the
    reference's output and gradients. (At L = 100, four 32-blocks each way with a partial
    last one: the interpreter took ~3x as long at L = 200.)"""
    L = 100
    mask = _cases(L)[name]
    with building_static():
        desc = mask._descriptor(_sizes(mask, L))
    q, k, v = (torch.randn(B, H, L, 16, generator=torch.Generator().manual_seed(i),
                           requires_grad=True) for i in range(3))
    do = torch.randn(B, H, L, 16, generator=torch.Generator().manual_seed(9))
    want = flexsparse.attention(q, k, v, desc, backend="reference")
    want_grads = torch.autograd.grad(want, (q, k, v), do)
    with _no_host_reads(monkeypatch):
        got = flexsparse.attention(q, k, v, desc, backend="triton",
                                   kernel_options={"trim_lists": False})
        got_grads = torch.autograd.grad(got, (q, k, v), do)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif("triton" not in flexsparse.ops.backends.available(),
                    reason="needs Triton (TRITON_INTERPRET=1 on CPU)")
def test_triton_with_host_facts_does_read(monkeypatch):
    """The check above is real: by default the Triton backend reads its facts of a new
    descriptor on the host (one sync on a GPU)."""
    mask = _cases()["column_ranges"]
    with building_static():
        desc = mask._descriptor(_sizes(mask))
    q = torch.randn(B, H, L, 16)
    with pytest.raises(AssertionError, match="host read"), _no_host_reads(monkeypatch):
        flexsparse.attention(q, q, q, desc, backend="triton")
