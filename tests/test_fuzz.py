"""Fuzzing flexsparse.attention with random valid and invalid inputs (issue 19): every
example either raises ValueError/TypeError naming the bad argument, or matches the float64
reference (NaN exactly where the reference has NaN). Never a crash of another kind, never a
hang. Runs the reference backend and the Triton kernels (CPU interpreter; fp32 there)."""
import copy
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import flexsparse
from flexsparse import masks as M

BACKENDS = ["reference"]
if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton  # noqa: F401
        BACKENDS.append("triton")
    except ImportError:
        pass

# Hand corruptions of a descriptor's block lists (applied in place to its mask tensors).
CORRUPTIONS = {
    "index": lambda mt: mt.kv_index.fill_(99),
    "count": lambda mt: mt.kv_count.fill_(50),
    "negative": lambda mt: mt.kv_full_count.fill_(-3),
    "negative_partial": lambda mt: mt.kv_count.fill_(-1),
    "explicit": lambda mt: mt.q_full_index.fill_(-7),
}

SETTINGS = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 40)), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _mask(data, B, Hkv, Lq, Lk):
    """(mask argument, names an error may mention when the mask is invalid for these sizes)."""
    kind = data.draw(st.sampled_from(["none", "causal", "sliding", "document", "prefix",
                                      "dense", "reused", "corrupt"]), label="mask")
    if kind == "none":
        return None
    if kind == "causal":
        return M.causal()
    if kind == "sliding":
        return M.sliding_window(data.draw(st.integers(0, 20), label="window"))
    if kind == "document":
        lengths = data.draw(st.lists(st.integers(1, 12), min_size=1, max_size=4), label="docs")
        return M.document(lengths)              # invalid when they do not sum to Lk
    if kind == "prefix":
        return M.prefix_lm(data.draw(st.one_of(st.integers(-3, 40), st.just(2.5)), label="n"))
    if kind == "dense":
        shape = data.draw(st.sampled_from([(Lq, Lk), (1, 1, Lq, Lk), (B, Hkv, Lq, Lk),
                                           (Lq + 1, Lk)]), label="dense shape")
        g = torch.Generator().manual_seed(data.draw(st.integers(0, 99), label="dense seed"))
        return torch.rand(*shape, generator=g) < 0.6
    # a descriptor compiled for other sizes, or hand-corrupted
    other = data.draw(st.sampled_from(["same", "batch", "length"]), label="compiled for")
    b2 = B + 1 if other == "batch" else B
    lk2 = Lk + 16 if other == "length" else Lk
    desc = M.causal().compile(b2, Hkv, Hkv, Lq, lk2, device="cpu", block_size=(16, 16))
    if kind == "corrupt":
        desc = copy.deepcopy(desc)
        mt = desc.mask_tensors()
        how = data.draw(st.sampled_from(["index", "count", "negative"]), label="corruption")
        CORRUPTIONS[how](mt)
    return desc


def _value(data, label, good):
    return data.draw(st.sampled_from(good + [0.0, -1.0, math.nan, math.inf, "x", True]),
                     label=label)


@SETTINGS
@given(st.data())
def test_fuzz_attention(data):
    backend = data.draw(st.sampled_from(BACKENDS), label="backend")
    B = data.draw(st.integers(1, 2), label="B")
    Hkv = data.draw(st.integers(1, 2), label="Hkv")
    Hq = Hkv * data.draw(st.integers(1, 2), label="group")
    Lq = data.draw(st.integers(1, 40), label="Lq")
    Lk = data.draw(st.integers(1, 40), label="Lk")
    D = data.draw(st.sampled_from([8, 16]), label="D")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 10_000), label="seed"))
    q = torch.randn(B, Hq, Lq, D, generator=g)
    k = torch.randn(B, Hkv, Lk, D, generator=g)
    v = torch.randn(B, Hkv, Lk, D, generator=g)
    bias = None
    if data.draw(st.booleans(), label="bias"):
        bias = torch.randn(data.draw(st.sampled_from([(B, Hq, Lq, Lk), (1, 1, Lq, Lk), (Lq, Lk),
                                                      (Lk,)]), label="bias shape"), generator=g)
    poison = data.draw(st.sampled_from(["none", "nan_q", "nan_k", "inf_v", "ninf_bias"]),
                       label="non-finite")
    if poison == "nan_q":
        q[0, 0, Lq // 2, 0] = math.nan
    elif poison == "nan_k":
        k[0, 0, Lk // 2, 0] = math.nan
    elif poison == "inf_v":
        v[0, 0, Lk // 2, 0] = math.inf
    elif poison == "ninf_bias" and bias is not None:
        bias.view(-1)[0] = -math.inf
    kw = {}
    if data.draw(st.booleans(), label="set scale"):
        kw["scale"] = _value(data, "scale", [0.3])
    if data.draw(st.booleans(), label="set softcap"):
        kw["softcap"] = _value(data, "softcap", [5.0])
    if data.draw(st.booleans(), label="set flags"):
        kw["return_lse"] = data.draw(st.sampled_from([True, False, "yes", 1]), label="return_lse")
    kw.setdefault("return_lse", True)

    mask = None

    def run(backend, dtype):
        b = None if bias is None else bias.to(dtype)
        return flexsparse.attention(q.to(dtype), k.to(dtype), v.to(dtype), mask, bias=b,
                                    backend=backend, **kw)

    built = False
    try:
        mask = _mask(data, B, Hkv, Lq, Lk)     # constructors check their own arguments
        built = True
        got = run(backend, torch.float32)
    except (ValueError, TypeError) as err:
        msg = str(err)
        assert any(name in msg for name in (
            "mask", "bias", "scale", "softcap", "return_lse", "lengths", "prefix_len",
            "window", "dense", "query", "key", "value", "block")), msg
        if built:   # the float64 reference refuses the same call
            with pytest.raises((ValueError, TypeError)):
                run("reference", torch.float64)
        return
    want = run("reference", torch.float64)
    if not kw["return_lse"]:
        got, want = (got,), (want,)
    # docs/semantics.md: a non-finite V may also reach rows that share a partially masked
    # tile with its key in the tiled kernels; everywhere else the patterns are the same.
    tiled_v = poison == "inf_v" and backend != "reference"
    for a, r in zip(got, want):
        a = a.double()
        if tiled_v:
            assert bool((~torch.isfinite(a))[~torch.isfinite(r)].all()), "a non-finite row vanished"
            fin = torch.isfinite(a) & torch.isfinite(r)
        else:
            assert torch.equal(torch.isnan(a), torch.isnan(r)), "NaN pattern differs from float64"
            fin = torch.isfinite(r)
            assert torch.equal(torch.isfinite(a), fin), "inf pattern differs from float64"
        torch.testing.assert_close(a[fin], r[fin], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["index", "count", "negative", "negative_partial"])
def test_corrupted_descriptor_reads_in_bounds_and_matches_reference(backend, how):
    """Hand-corrupted block lists (entries out of range, counts past the list width or
    negative) never make a backend read out of bounds: out-of-range entries are skipped,
    counts are clamped to [0, width], and every backend computes the same result as the
    float64 reference on the same descriptor."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(3))
    desc = copy.deepcopy(M.causal().compile(1, 2, 2, 40, 40, device="cpu", block_size=(16, 16)))
    mt = desc.mask_tensors()
    CORRUPTIONS[how](mt)
    got = flexsparse.attention(q, k, v, desc, backend=backend, return_lse=True)
    want = flexsparse.attention(q.double(), k.double(), v.double(), desc, backend="reference",
                                return_lse=True)
    for a, r in zip(got, want):
        assert torch.equal(torch.isfinite(a), torch.isfinite(r))
        fin = torch.isfinite(r)
        torch.testing.assert_close(a.double()[fin], r[fin], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["v", "k"])
def test_non_finite_invisible_key(backend, where):
    """NaN in key 39 (seen only by row 39 under causal): which rows it reaches."""
    g = torch.Generator().manual_seed(4)
    L = 40
    q, k, v = (torch.randn(1, 1, L, 16, generator=g) for _ in range(3))
    (v if where == "v" else k)[0, 0, L - 1, 0] = math.nan
    desc = M.causal().compile(1, 1, 1, L, L, device="cpu", block_size=(16, 16))
    out = flexsparse.attention(q, k, v, desc, backend=backend)
    nan_rows = out.isnan().any(-1)[0, 0].nonzero().flatten().tolist()
    if where == "k" or backend == "reference":
        assert nan_rows == [L - 1]          # only the row that sees the key
    else:
        # the documented exception: rows 32..38 share the last 16x16 tile with key 39
        assert nan_rows == list(range(32, L))


@pytest.mark.parametrize("how", ["index", "count", "negative", "negative_partial", "explicit"])
def test_debug_mode_rejects_corrupted_lists(how, monkeypatch):
    """FLEXSPARSE_DEBUG=1 reads the lists back and names the broken one."""
    monkeypatch.setenv("FLEXSPARSE_DEBUG", "1")
    q = torch.randn(1, 2, 40, 16)
    desc = M.causal().compile(1, 2, 2, 40, 40, device="cpu", block_size=(16, 16))
    flexsparse.attention(q, q, q, desc, backend="reference")        # a valid one passes
    if how == "explicit":
        desc = desc.with_lists()
    desc = copy.deepcopy(desc)
    mt = desc.mask_tensors()
    CORRUPTIONS[how](mt)
    with pytest.raises(ValueError, match="mask: descriptor list"):
        flexsparse.attention(q, q, q, desc, backend="reference")
