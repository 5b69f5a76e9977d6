"""The mask-build ops (issue 16; flexsparse/build_op.py, csrc/build_masks.cu) on the GPU:
the CUDA kernels against the CPU kernel (bit for bit) and against the torch builds (same
column ranges, counts and block grids; FlashMask column ranges: the static build's
tensors), no host synchronization in a build and in a forward/backward with the built
descriptor, CUDA-graph capture with the lengths changed in place,
torch.compile(fullgraph=True, dynamic=True), and the device-side assert for bad lengths
(in a subprocess: it ends the CUDA context). Skipped without CUDA or without the
built extension. No hypothesis needed (seeded cases)."""
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import flexsparse  # noqa: E402
from flexsparse import build_op  # noqa: E402
from flexsparse import masks as M  # noqa: E402
from flexsparse.ops import backends  # noqa: E402

if not build_op.available("cuda"):
    pytest.skip("flexsparse._C (the mask-build ops) is not built", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from build_checks import LISTS, check_range_rows, grids, state_masks  # noqa: E402

DEV = "cuda"
FIELDS = ("col_ranges",) + tuple(f"{n}_{w}" for n in LISTS for w in ("count", "index"))


def _lengths(L, n, rows, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        cuts = torch.randint(0, L + 1, (n - 1,), generator=g).sort().values.tolist()
        out.append([b - a for a, b in zip([0] + cuts, cuts + [L])])
    return torch.tensor(out, dtype=torch.int64)


def _cases():
    """(id, make(device) -> mask, B, Hq, Hkv, Lq, Lk, block)."""
    out = []
    for L, n, rows, block in [(8192, 8, 1, 128), (1000, 5, 2, 128), (999, 30, 3, 64),
                              (200, 1, 1, 32), (300, 300, 1, 16), (5000, 2500, 2, 128),
                              (4097, 3, 1, 128), (77, 4, 2, 128)]:
        lens = _lengths(L, n, rows, seed=L + n)
        for causal in (True, False):
            out.append((f"doc-L{L}-n{n}-rows{rows}-b{block}-{'c' if causal else 'nc'}",
                        lambda d, lens=lens, causal=causal: M.document(lens.to(d), causal=causal),
                        rows, 4, 2, L, L, (block, block)))
    for Lq, Lk, pre, block in [(8192, 8192, [2048], 128), (1000, 1500, [0, 700, 1499], 128),
                               (999, 999, [5, 998], 64), (300, 100, [40, 0, 300], 16)]:
        p = torch.tensor(pre)
        out.append((f"prefix-{Lq}x{Lk}-B{len(pre)}-b{block}",
                    lambda d, p=p: M.prefix_lm(p.to(d)), len(pre), 4, 2, Lq, Lk, (block, block)))
    return out


CASES = _cases()


def _build(make, device, B, Hq, Hkv, Lq, Lk, block, mode):
    M.clear_cache()
    with build_op.use(mode):
        return make(device).compile(B, Hq, Hkv, Lq, Lk, block_size=block, device=device)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cuda_equals_cpu_kernel_and_torch_builds(case):
    _, make, B, Hq, Hkv, Lq, Lk, block = case
    got = _build(make, DEV, B, Hq, Hkv, Lq, Lk, block, None)
    assert got.kv_index.dim() == 5 and got.kv_index.is_cuda
    cpu_op = _build(make, "cpu", B, Hq, Hkv, Lq, Lk, block, True)
    for name in FIELDS:                       # the two kernels agree bit for bit
        assert torch.equal(getattr(got, name).cpu(), getattr(cpu_op, name)), name
    got_cpu = flexsparse.BlockDescriptor(got.seq_lengths, got.block_size, got.num_heads,
                                         *[t.cpu() if t is not None else None
                                           for t in got.mask_tensors()])
    check_range_rows(got_cpu)
    compact = _build(make, "cpu", B, Hq, Hkv, Lq, Lk, block, False)
    assert torch.equal(got_cpu.col_ranges, compact.col_ranges)
    want, have = grids(compact), grids(got_cpu)
    for name in LISTS:
        assert torch.equal(have[name][0], want[name][0]), name
        assert torch.equal(have[name][1], want[name][1]), name
    if Lq * Lk <= 1 << 22:                    # the static torch build on the GPU
        static = _build(make, DEV, B, Hq, Hkv, Lq, Lk, block, False)
        assert torch.equal(got.col_ranges, static.col_ranges)
        assert torch.equal(got.block_state(), static.block_state())


FLASH = [(C, causal, bh, L) for C, causal in [(1, True), (2, True), (4, True), (2, False),
                                            (4, False)]
         for bh, L in [((1, 1), 8192), ((2, 2), 1000), ((1, 2), 77)]]


@pytest.mark.parametrize("C,causal,bh,L", FLASH)
def test_column_ranges_equal_cpu_kernel_and_static_build(C, causal, bh, L):
    """FlashMask column ranges (random, out-of-range row indices): the static build's
    padded lists, bit for bit, from the CUDA kernels, the CPU kernel and the torch build."""
    g = torch.Generator().manual_seed(C * 1000 + L)
    t = torch.randint(-5, L + 6, (*bh, L, C), generator=g)
    B, Hq, Hkv = 2, 4, 2
    got = _build(lambda d: M.column_ranges(t.to(d), causal=causal), DEV, B, Hq, Hkv, L, L,
                 (128, 128), None)
    cpu_op = _build(lambda d: M.column_ranges(t.to(d), causal=causal), "cpu", B, Hq, Hkv, L, L,
                    (128, 128), True)
    static = _build(lambda d: M.column_ranges(t.to(d), causal=causal), DEV, B, Hq, Hkv, L, L,
                    (128, 128), False)
    for name in FIELDS:
        a, b, c = getattr(got, name), getattr(cpu_op, name), getattr(static, name)
        assert torch.equal(a.cpu(), b) and torch.equal(a, c), name


LAYOUTS = [((1, 1), 8192, 8192, (128, 128)), ((2, 4), 1000, 1000, (128, 128)),
           ((1, 2), 77, 300, (64, 32)), ((2, 1), 4097, 999, (128, 64)), ((1, 4), 5, 256, (128, 128)),
           ((1, 2), 131072, 100000, (128, 128))]


@pytest.mark.parametrize("bh,Lq,Lk,block", LAYOUTS)
def test_block_layout_equals_cpu_kernel_and_static_build(bh, Lq, Lk, block):
    """masks.block_sparse(layout) at the call's block size: one build_block_lists call
    gives the static build's padded lists, bit for bit, from the CUDA and CPU kernels.
    Random layouts with empty and full rows and columns; batch and heads (Hkv, Hq or 1)."""
    g = torch.Generator().manual_seed(Lq * 7 + Lk)
    nq, nk = -(-Lq // block[0]), -(-Lk // block[1])
    lay = torch.rand(*bh, nq, nk, generator=g) < 0.3
    if nq > 2 and nk > 2:
        lay[..., 1, :] = False
        lay[..., 2, :] = True
        lay[..., :, 0] = False
    B, Hq, Hkv = 2, 4, 2
    make = lambda d: M.block_sparse(lay.to(d), block)   # noqa: E731
    got = _build(make, DEV, B, Hq, Hkv, Lq, Lk, block, None)
    cpu_op = _build(make, "cpu", B, Hq, Hkv, Lq, Lk, block, True)
    static = _build(make, DEV, B, Hq, Hkv, Lq, Lk, block, False)
    assert got.kv_index.shape == (*bh, nq, nk) and got.kv_index.is_cuda
    for name in FIELDS[1:]:
        a, b, c = getattr(got, name), getattr(cpu_op, name), getattr(static, name)
        assert torch.equal(a.cpu(), b) and torch.equal(a, c), name
    assert got.col_ranges is None and got.dense_mask is None


# (bh, nQB, nKB) of the grids of test_block_grid_tiles_equal_the_warp_per_row_build: the
# LAYOUTS' grids, then sizes that reach each of grid_list_kernel's paths (csrc/build_masks.cu):
# slabs (rows 16-byte aligned: nKB a multiple of 16 for layouts, of 4 for states) around 32,
# 256 (a dK/dV tile), 1024 (a slab register) and the 4096 blocks held in registers; rows
# not aligned (the two-pass build); lists longer than 4096 blocks (the two-pass build for
# that kind, or for both when the dK/dV lists are the long ones).
GRID_SHAPES = [(bh, -(-Lq // bq), -(-Lk // bk)) for bh, Lq, Lk, (bq, bk) in LAYOUTS] + [
    ((1, 1), 1, 1), ((1, 1), 1, 4), ((1, 1), 4, 1), ((1, 1), 1, 16), ((1, 2), 31, 32),
    ((2, 1), 33, 48), ((1, 1), 32, 36), ((1, 1), 255, 256), ((1, 1), 256, 272),
    ((1, 1), 257, 240), ((1, 1), 100, 1024), ((1, 1), 40, 1040), ((1, 1), 1025, 12),
    ((1, 1), 4095, 4096), ((1, 1), 4096, 4096), ((1, 1), 4097, 4112), ((1, 1), 64, 4100),
    ((1, 1), 3, 5000), ((1, 1), 5000, 3), ((1, 1), 5000, 16), ((1, 1), 16, 5008)]


@pytest.mark.parametrize("bh,nq,nk", GRID_SHAPES, ids=[f"{bh[0]}x{bh[1]}x{q}x{k}" for bh, q, k in GRID_SHAPES])
@pytest.mark.parametrize("states", [False, True])
@pytest.mark.parametrize("offset", [0, 1])
def test_block_grid_tiles_equal_the_warp_per_row_build(bh, nq, nk, states, offset, monkeypatch):
    """grid_list_kernel (by default slabs: each list row read once, 16 bytes per load, into
    bit masks in registers; the two-pass build for grids not 16-byte aligned and lists
    longer than 4096 blocks) against list_kernel's warp per list row (FLEXSPARSE_CUDA_DEBUG
    bit 274877906944) and against the two-pass build alone (bit 35184372088832), bit for
    bit, on bool layouts and int32 states with partial blocks. offset 1: the grid one
    element past an aligned allocation (a contiguous view whose base is not 16-byte
    aligned: the two-pass build)."""
    g = torch.Generator().manual_seed(nq + 3 * nk + offset)
    grid = torch.randint(0, 3, (*bh, nq, nk), generator=g, dtype=torch.int32)
    if nq > 2 and nk > 2:
        grid[..., 1, :] = 0
        grid[..., 2, :] = 2
        grid[..., :, 0] = 1
    grid = grid if states else grid == 2
    flat = torch.zeros(grid.numel() + 16, dtype=grid.dtype, device=DEV)
    grid_dev = flat[offset:offset + grid.numel()].view(grid.shape)
    grid_dev.copy_(grid)
    monkeypatch.delenv("FLEXSPARSE_CUDA_DEBUG", raising=False)
    tiles = torch.ops.flexsparse.build_block_lists(grid_dev)
    monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", "274877906944")
    warps = torch.ops.flexsparse.build_block_lists(grid_dev)
    monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", "35184372088832")
    two_pass = torch.ops.flexsparse.build_block_lists(grid_dev)
    assert len(tiles) == len(warps) == len(two_pass) == 8
    for a, b, c in zip(tiles, warps, two_pass):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("name", list(state_masks(8)))
@pytest.mark.parametrize("L,block", [(1000, (128, 128)), (4097, (128, 64))])
def test_block_states_equal_cpu_kernel_and_torch_lists(name, L, block):
    """Static builds through block states (dense masks, shared-question, combinations,
    ...): the CUDA build_block_lists call on the int32 states gives the torch build's
    lists bit for bit, as the CPU kernel does."""
    from flexsparse.descriptor import Sizes, building_static
    B, Hq, Hkv = 2, 4, 2
    out = {}
    for label, device, mode in (("cuda", DEV, None), ("cpu", "cpu", True), ("torch", DEV, False)):
        M.clear_cache()
        sz = Sizes(B, Hq, Hkv, L, L, *block, M.canonical_device(device))
        with building_static(), build_op.use(mode):
            out[label] = state_masks(L, device)[name]._descriptor(sz)
    for field in FIELDS[1:] + ("dense_mask", "col_ranges", "partial_bits_index", "partial_bits"):
        a, b, c = (getattr(out[k], field) for k in ("cuda", "cpu", "torch"))
        assert (a is None) == (b is None) == (c is None), field
        assert a is None or (torch.equal(a.cpu(), b) and torch.equal(a, c)), field


@pytest.mark.parametrize("case", CASES + [
    ("doc-L262144-n9", lambda d: M.document(_lengths(262144, 9, 2, 3).to(d)), 2, 4, 2, 262144,
     262144, (128, 128))], ids=[c[0] for c in CASES] + ["doc-L262144-n9"])
def test_fused_build_equals_the_two_kernel_build(case, monkeypatch):
    """FLEXSPARSE_CUDA_DEBUG bit 8589934592: documents and prefix-LM in one launch
    (fused_kernel: each row's query-block lists from key-block bounds taken from the blocks'
    first and last columns); the default two-kernel build's row CTA reads the bounds the
    key blocks' CTAs reduced over every column. The same tensors bit for bit (cases past
    2048 documents take the two-kernel build either way)."""
    _, make, B, Hq, Hkv, Lq, Lk, block = case
    monkeypatch.delenv("FLEXSPARSE_CUDA_DEBUG", raising=False)
    two = _build(make, DEV, B, Hq, Hkv, Lq, Lk, block, None)
    monkeypatch.setenv("FLEXSPARSE_CUDA_DEBUG", "8589934592")
    fused = _build(make, DEV, B, Hq, Hkv, Lq, Lk, block, None)
    for name in FIELDS:
        assert torch.equal(getattr(fused, name), getattr(two, name)), name


@pytest.mark.parametrize("L", [131072, 1 << 20])
def test_long_sequences_equal_the_cpu_kernel(L):
    """128K and 1M: the longer rows' kernels past ~160K tokens; 256K at the fused build's
    limit (2048 key blocks) is in test_fused_build_equals_the_two_kernel_build."""
    for make in (lambda d: M.document(_lengths(L, 16, 1, 1).to(d)),
                 lambda d: M.document(_lengths(L, 4000, 1, 2).to(d), causal=False),
                 lambda d: M.prefix_lm(torch.tensor([L // 3]).to(d))):
        got = _build(make, DEV, 1, 16, 16, L, L, (128, 128), None)
        ref = _build(make, "cpu", 1, 16, 16, L, L, (128, 128), True)
        for name in FIELDS:
            assert torch.equal(getattr(got, name).cpu(), getattr(ref, name)), name


def _qkv(B, Hq, Hkv, L, D=128, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, Hq, L, D, device=DEV, dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, Hkv, L, D, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, Hkv, L, D, device=DEV, dtype=torch.bfloat16, generator=g)
    return [t.requires_grad_() for t in (q, k, v)]


BACKENDS = [("triton", {"trim_lists": False})] + (
    [("cuda", None)] if "cuda" in backends.available() else [])


@pytest.mark.parametrize("backend,options", BACKENDS, ids=[b for b, _ in BACKENDS])
@pytest.mark.parametrize("kind", ["document", "document-noncausal", "prefix_lm", "column_ranges",
                                  "block_sparse"])
def test_no_host_sync_build_forward_backward(kind, backend, options):
    """Build + forward + backward under set_sync_debug_mode("error"); the result equals
    the torch build's."""
    B, Hq, Hkv, L = 2, 4, 2, 2048
    lens = torch.tensor([[300, 1000, 748], [2048, 0, 0]], device=DEV)
    prefix = torch.tensor([100, 1500], device=DEV)
    cr = torch.randint(0, L + 1, (B, Hkv, L, 2), device=DEV).sort(-1).values
    layout = torch.rand(B, Hq, L // 128, L // 128, device=DEV) < 0.3
    layout[:, :, 3] = False                               # fully masked query rows too
    make = {"document": lambda: M.document(lens),
            "document-noncausal": lambda: M.document(lens, causal=False),
            "prefix_lm": lambda: M.prefix_lm(prefix),
            "column_ranges": lambda: M.column_ranges(cr, causal=True),
            "block_sparse": lambda: M.block_sparse(layout, 128)}[kind]
    q, k, v = _qkv(B, Hq, Hkv, L)
    kw = dict(backend=backend, kernel_options=options) if options else dict(backend=backend)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        desc = make().compile(B, Hq, Hkv, L, L)
        out = flexsparse.attention(q, k, v, desc, **kw)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert desc.kv_index.dim() == (4 if kind in ("column_ranges", "block_sparse") else 5)
    with build_op.use(False):
        ref = make().compile(B, Hq, Hkv, L, L)
    want = flexsparse.attention(q, k, v, ref, **kw)
    want_grads = torch.autograd.grad(want.float().square().sum(), (q, k, v))
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


def test_cuda_graph_replay_after_lengths_change_in_place():
    B, H, L = 1, 2, 4096
    lens = torch.tensor([1000, 3096], device=DEV)
    static_out = {}

    def step():
        desc = M.document(lens).compile(B, H, H, L, L)
        static_out["t"] = desc.mask_tensors()

    step()                                    # warm up (allocator, kernels)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    lens.copy_(torch.tensor([2500, 1596], device=DEV))
    graph.replay()
    torch.cuda.synchronize()
    want = M.document(lens.clone()).compile(B, H, H, L, L).mask_tensors()
    for a, b in zip(static_out["t"], want):
        assert (a is None) == (b is None)
        assert a is None or torch.equal(a, b)


def test_a_mask_owning_its_lengths_builds_once_per_sizes():
    """A document mask from a CUDA tensor holds its own copy: compiled again for the same
    sizes (a model's next layer) it returns the descriptor it built, for other sizes a new
    one; while a CUDA graph is being captured it builds anew (inside the graph) and keeps
    nothing."""
    lens = _lengths(1000, 5, 2, 7).to(DEV)
    m = M.document(lens)
    a = m.compile(2, 4, 2, 1000, 1000)
    assert m.compile(2, 4, 2, 1000, 1000) is a and m.compile(2, 4, 1, 1000, 1000) is not a
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        b = m.compile(2, 4, 2, 1000, 1000)
    graph.replay()
    torch.cuda.synchronize()
    assert b is not a and m.compile(2, 4, 2, 1000, 1000) is a
    for x, y in zip(a.mask_tensors(), b.mask_tensors()):
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y))


def test_inside_torch_compile():
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounter
    counter = CompileCounter()

    def build(lens, q):
        B, H, L, _ = q.shape
        return M.document(lens).compile(B, H, H, L, L).mask_tensors()

    f = torch.compile(build, backend=counter, fullgraph=True, dynamic=True)
    for L in (1024, 3000, 8192):
        lens = torch.tensor([[L // 2, L - L // 2]], device=DEV)
        q = torch.zeros(1, 2, L, 8, device=DEV)
        for a, b in zip(f(lens, q), build(lens, q)):
            assert (a is None) == (b is None)
            assert a is None or torch.equal(a, b)
    assert counter.frame_count == 1


def test_block_layout_inside_torch_compile():
    """block_sparse(layout) built inside a compiled function (the op through its fake
    kernel): one frame over three lengths, the eager op's tensors."""
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounter
    counter = CompileCounter()

    def build(layout, q):
        B, H, L, _ = q.shape
        return M.block_sparse(layout, 128).compile(B, H, H, L, L).mask_tensors()

    f = torch.compile(build, backend=counter, fullgraph=True, dynamic=True)
    for L in (1024, 3000, 8192):
        n = -(-L // 128)
        layout = torch.rand(1, 2, n, n, device=DEV) < 0.4
        q = torch.zeros(1, 2, L, 16, device=DEV)   # (n = 8 at 1024: not the head dim)
        for a, b in zip(f(layout, q), build(layout, q)):
            assert (a is None) == (b is None)
            assert a is None or torch.equal(a, b)
    assert counter.frame_count == 1


@pytest.mark.parametrize("code", [
    "M.document(torch.tensor([100, 27], device='cuda')).compile(1, 1, 1, 128, 128)",
    "M.document(torch.tensor([200, -72], device='cuda')).compile(1, 1, 1, 128, 128)",
    "M.document(torch.ones(3000, dtype=torch.long, device='cuda')).compile(1, 1, 1, 2999, 2999)",
    "M.prefix_lm(torch.tensor([-1], device='cuda')).compile(1, 1, 1, 128, 128)",
], ids=["sum", "negative", "sum-many-docs", "prefix-negative"])
def test_bad_values_stop_with_a_device_assert(code):
    src = ("import torch\nfrom flexsparse import masks as M\n" + code
           + "\ntorch.cuda.synchronize()\nprint('no error')\n")
    r = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "no error" not in r.stdout, r.stdout + r.stderr
    assert "lengths" in r.stderr or "prefix_len" in r.stderr or "assert" in r.stderr.lower(), \
        r.stderr[-2000:]
