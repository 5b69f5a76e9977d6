"""Recorded calls (ops/triton_block.py `_Call`, ops/triton_launch.py `LaunchPlan`): a repeat
call with the same layouts replays the recorded launches with its own data pointers. Here
on CPU with a stand-in for the compiled kernel (the real launches run in the GPU tests):
every replayed argument list must equal the one a fresh build makes for the same tensors,
and any change that changes the kernel arguments must miss the recorded call."""
import pytest
import torch

from flexsparse import masks as M
from flexsparse.ops import triton_block as tb
from flexsparse.ops import triton_launch
from flexsparse.ops.kernel_options import KernelOptions

B, H, L, D = 2, 4, 96, 32


class _FakeCompiled:
    """What triton_launch calls on a compiled kernel: run(), function, packed_metadata."""
    function = "fn"
    packed_metadata = "meta"

    def __init__(self, kernel, log):
        self.kernel, self.log = kernel, log

    def run(self, gx, gy, gz, stream, function, meta, launch_md, enter, exit_, *flat):
        self.log.append((self.kernel.fn.__name__, (gx, gy, gz), list(flat)))


class _Pool:
    """Allocations in call order from a fixed pool, so two runs of one call see the same
    output and scratch tensors (and hence the same data pointers)."""

    def __init__(self):
        self.tensors, self.i = [], 0

    def __call__(self, shape, dtype=None, device=None, fill=0.0):
        if self.i == len(self.tensors):
            self.tensors.append(torch.full(tuple(shape), fill, dtype=dtype, device=device))
        t = self.tensors[self.i]
        assert t.shape == tuple(shape) and t.dtype == dtype
        self.i += 1
        return t


@pytest.fixture
def fake_launches(monkeypatch):
    log = []

    def fake_launch(kernel, grid, args, kwargs, warps, stages):
        params = triton_launch.param_names(kernel)
        # tensors as data pointers, also inside tuple arguments (what the launcher is given)
        flat = [triton_launch._spec_and_pointer(a)[1] for a in args]
        flat += [kwargs[n] for n in params[len(args):]]
        g = tuple(grid) + (1, 1)
        log.append((kernel.fn.__name__, g[:3], flat))
        return _FakeCompiled(kernel, log)

    pool = _Pool()
    monkeypatch.setattr(tb, "_launch", fake_launch)
    monkeypatch.setattr(tb, "direct_launch_allowed", lambda: True)
    monkeypatch.setattr(triton_launch, "direct_launch_allowed", lambda: True)
    monkeypatch.setattr(triton_launch, "_device", lambda: 0)
    monkeypatch.setattr(triton_launch, "_stream", lambda device: 0)
    monkeypatch.setattr(tb, "_empty", lambda shape, dtype=None, device=None: pool(shape, dtype,
                                                                                 device))
    monkeypatch.setattr(tb, "_zeros", lambda shape, dtype=None, device=None: pool(shape, dtype,
                                                                                 device))
    monkeypatch.setattr(tb, "_CALLS", tb._MaskKeyedCache(tb._CALLS.size))
    return log, pool


def _inputs(seed, bias_shape=None, G=1, lse_grad=False):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float16)  # noqa: E731
    q, do = r(B, H, L, D), r(B, H, L, D)
    k, v = r(B, H // G, L, D), r(B, H // G, L, D)
    out, lse = r(B, H, L, D), torch.randn(B, H, L, generator=g)
    bias = r(*bias_shape) if bias_shape else None
    glse = torch.randn(B, H, L, generator=g) if lse_grad else None
    return q, k, v, do, out, lse, bias, glse


CASES = {
    "causal": dict(mask=M.causal()),
    "document, gqa": dict(mask=M.document([40, 30, 26]), G=2),
    "sliding + lse grad": dict(mask=M.sliding_window(24), lse_grad=True),
    "full bias, dbias stored": dict(mask=M.causal(), bias=(B, H, L, L)),
    "broadcast bias, atomics": dict(mask=M.causal(), bias=(1, 1, L, L)),
    "broadcast bias, deterministic": dict(mask=M.causal(), bias=(1, H, L, L), det=True),
    "row bias": dict(mask=M.prefix_lm(20), bias=(B, H, 1, L)),
    "column bias": dict(mask=M.causal(), bias=(B, 1, L, 1)),
    "two_pass": dict(mask=M.causal(), mode="two_pass"),
    "atomic_dq": dict(mask=M.causal(), mode="atomic_dq"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_replay_matches_a_fresh_build(fake_launches, monkeypatch, name):
    log, pool = fake_launches
    case = CASES[name]
    options = KernelOptions(bwd_mode=case.get("mode", "auto"))
    G = case.get("G", 1)
    desc = case["mask"].compile(B, H, H // G, L, L, device="cpu", block_size=(32, 32))
    mt = desc.mask_tensors()
    det = case.get("det", False)

    def call(seed):
        q, k, v, do, out, lse, bias, glse = _inputs(seed, case.get("bias"), G,
                                                    case.get("lse_grad", False))
        pool.i = 0
        tb.forward(q, k, v, bias, mt, 32, 32, 0.3, 0.0, False, options)
        tb.backward(do, glse, q, k, v, out, lse, bias, mt, 32, 32, 0.3, 0.0, det,
                    bias is not None, options)
        return (q, k, v, do, out, lse, bias, glse)

    keep0 = call(0)                          # builds and records (inputs kept alive)
    first = list(log)
    assert all(isinstance(f[2][0], int) for f in first)
    log.clear()
    hits = triton_launch.FAST_HITS
    keep = call(1)                           # replays: new inputs, same pool outputs
    replayed = list(log)
    assert len(tb._CALLS) == 2 and len(replayed) == len(first)
    assert triton_launch.FAST_HITS - hits == len(replayed)     # all through LaunchPlans
    # a fresh build for the same tensors (nothing cached)
    log.clear()
    tb._CALLS.clear()
    pool.i = 0
    q, k, v, do, out, lse, bias, glse = keep
    tb.forward(q, k, v, bias, mt, 32, 32, 0.3, 0.0, False, options)
    tb.backward(do, glse, q, k, v, out, lse, bias, mt, 32, 32, 0.3, 0.0, det, bias is not None,
                options)
    assert replayed == log
    assert replayed != first                 # the inputs' pointers did change:
    assert keep[0].data_ptr() != keep0[0].data_ptr()   # (keep0 kept them alive)


def test_changes_that_change_arguments_miss(fake_launches, monkeypatch):
    log, pool = fake_launches
    monkeypatch.setattr(tb, "_CALLS", tb._MaskKeyedCache(32))   # room for every variant below
    def compiled(mask, block=32):
        return mask.compile(B, H, H, L, L, device="cpu", block_size=(block, block)).mask_tensors()
    mt = compiled(M.causal())
    q, k, v, do, out, lse, bias, glse = _inputs(0, (B, H, L, L), lse_grad=True)

    def fwd(q=q, k=k, bias=None, scale=0.3, softcap=0.0, mask=mt, block=32,
            options=KernelOptions()):
        pool.i = 0
        tb.forward(q, k, v, bias, mask, block, block, scale, softcap, False, options)

    fwd()
    variants = [
        lambda: fwd(q=q.transpose(1, 2).contiguous().transpose(1, 2)),    # strides
        lambda: fwd(k=k.float().half()[:, :2]),                             # shape (GQA)
        lambda: fwd(bias=bias),
        lambda: fwd(bias=bias[:1]),
        lambda: fwd(scale=0.25),
        lambda: fwd(softcap=5.0),
        lambda: fwd(mask=compiled(M.causal(), 16), block=16),
        lambda: fwd(mask=compiled(M.sliding_window(9))),
    ]
    for i, variant in enumerate(variants):
        n = len(tb._CALLS)
        variant()
        assert len(tb._CALLS) == n + 1, f"variant {i} reused a recorded call"
    # kernel options are part of the key: a tile override, untrimmed lists
    for options in (KernelOptions(fwd_config=(32, 32, 4, 1)), KernelOptions(trim_lists=False)):
        n = len(tb._CALLS)
        fwd(options=options)
        assert len(tb._CALLS) == n + 1, options
    # a mask tensor written in place (its version changes) is a new descriptor
    dm = torch.rand(B, H, L, L) < 0.5
    mt_dm = compiled(M.dense(dm))
    fwd(mask=mt_dm)
    n = len(tb._CALLS)
    mt_dm.dense_mask.logical_not_()
    fwd(mask=mt_dm)
    assert len(tb._CALLS) == n + 1
    # the same again hits
    fwd(mask=mt_dm)
    assert len(tb._CALLS) == n + 1
    # backward: grad_lse present or not, deterministic, bias gradient wanted or not
    bwd_cases = [(None, False, False), (glse, False, False), (None, True, False)]
    for i, (g, det, want_db) in enumerate(bwd_cases + [(None, False, True)]):
        n = len(tb._CALLS)
        pool.i = len(pool.tensors)          # fresh outputs and scratch
        tb.backward(do, g, q, k, v, out, lse, bias if want_db else None, mt, 32, 32, 0.3, 0.0,
                    det, want_db)
        assert len(tb._CALLS) == n + 1, f"backward case {i} reused a recorded call"


def test_no_recording_under_the_interpreter_or_with_launch_hooks(monkeypatch):
    monkeypatch.setattr(tb, "_CALLS", tb._MaskKeyedCache(tb._CALLS.size))
    monkeypatch.setattr(triton_launch, "FAST_LAUNCH", False)
    assert not triton_launch.direct_launch_allowed()
    assert tb._cached_call(("any",), []) is None
    tb._keep_call(("any",), object(), [], torch.device("cpu"))
    assert len(tb._CALLS) == 0
