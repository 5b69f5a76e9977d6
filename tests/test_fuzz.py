"""Fuzzing flexsparse.attention with random valid and invalid inputs (issue 19).

Every example either raises ValueError/TypeError whose message starts with the name of
the bad argument ("scale: ...", "mask: ...") -- and the reference backend refuses the
same call with the same message, unless the refusal is the backend's own ("backend: ...")
-- or returns what the float64 reference returns on the same inputs: NaN exactly where
it has NaN, the same infinities, finite values close; on finite inputs the gradients too.
Never an exception of another kind, a crash or a hang.

Drawn: shapes (GQA, Lq != Lk), dtypes (float16/32/64, bfloat16 on the reference; int and
mismatched dtypes), masks (valid and invalid constructor arguments, dense masks and
biases of SDPA-broadcastable and other shapes), descriptors compiled for other sizes
(batch, heads, lengths; refused with "mask: ..." whenever their sizes do not fit),
hand-corrupted descriptors (CORRUPTIONS, compared with the reference on the same
descriptor; with FLEXSPARSE_DEBUG=1 refused by name), NaN and +-inf in q/k/v/bias, and
bad scalars and flags. Backends: the reference, and the Triton kernels under the CPU
interpreter (TRITON_INTERPRET=1, set by conftest.py). A smaller variant runs the same
draws inside torch.compile(fullgraph=True, dynamic=True).
FUZZ_EXAMPLES / FUZZ_COMPILED_EXAMPLES set the example counts (CI: 150 and 10: 49 and 42 s
on the 2-core CI machine); FUZZ_RANDOM=1 draws new examples each run instead of CI's fixed ones.
"""
import copy
import math
import os
import re
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, Phase, event, given, settings, strategies as st

import flexsparse
from flexsparse import masks as M
from flexsparse.ops import mask_checks
from flexsparse.ops.schema import MASK_TENSOR_NAMES

BACKENDS = ["reference"]
if os.environ.get("TRITON_INTERPRET") == "1":
    import triton  # noqa: F401  (asked for by TRITON_INTERPRET: missing is an error, not a skip)
    BACKENDS.append("triton")

BLOCK = (16, 16)
# What a refusal's message may start with ("<name>: ..."): the arguments of
# flexsparse.attention, of the mask constructors, and the op's mask tensors.
NAMES = {"query", "key", "value", "bias", "mask", "scale", "softcap", "return_lse",
         "deterministic", "backend", "block_size", "lengths", "answer_lengths", "prefix_len",
         "left", "right", "attn_indices", "layout", "startend_row_indices", "causal",
         "num_kv_heads", *MASK_TENSOR_NAMES}

# ---------------------------------------------------------------- corrupted descriptors

# Hand corruptions of a descriptor's mask tensors, applied in place: (the descriptor they
# apply to, the corruption). Each breaks what the builders guarantee: list entries outside
# the block grid, counts outside [0, width], ranges outside the grid or with lo > hi,
# bitmap indices past the pool, index entries outside [-1, Lk).
CORRUPTIONS = {
    "kv_index_past_grid": ("ranges", lambda mt: mt.kv_index.fill_(99)),
    "kv_count_past_width": ("ranges", lambda mt: mt.kv_count.fill_(50)),
    "kv_full_count_negative": ("ranges", lambda mt: mt.kv_full_count.fill_(-3)),
    "kv_count_negative": ("ranges", lambda mt: mt.kv_count.fill_(-1)),
    "range_lo_negative": ("ranges", lambda mt: mt.kv_full_index[..., 0, 0].fill_(-2)),
    "range_hi_past_grid": ("ranges", lambda mt: mt.kv_full_index[..., 0, 1].fill_(10 ** 6)),
    "explicit_entry_negative": ("lists", lambda mt: mt.kv_full_index.fill_(-7)),
    "explicit_entry_past_grid": ("lists", lambda mt: mt.kv_index.fill_(99)),
    # forward reads the kv lists only: out and lse stay the reference's
    "q_lists": ("ranges", lambda mt: (mt.q_full_count.fill_(9), mt.q_index.fill_(-7))),
    "bitmap_index_past_pool": (
        "bits", lambda mt: mt.partial_bits_index.fill_(mt.partial_bits.shape[0] + 3)),
    "attn_indices_out_of_range": (
        "indices", lambda mt: (mt.attn_indices[..., 0].fill_(1000),
                               mt.attn_indices[..., 1].fill_(-7))),
}
# Kernel bugs this file found, now fixed and checked below: the Triton block kernels read
# a bitmap index past the pool (`p < P` in triton_block_mask._visible); the Triton index
# kernel stored lse -inf for a row with NaN scores (`l_i != 0`); the block kernels hid an
# out-of-grid entry's tile by adding -inf (a select in triton_block_common._score).


def _base_descriptor(kind, B, Hq, Hkv, Lq, Lk, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "indices":
        idx = torch.randint(-1, Lk, (B, Hkv, Lq, 4), generator=g)
        return M.indices(idx).compile(B, Hq, Hkv, Lq, Lk, device="cpu", block_size=BLOCK)
    if kind == "bits":
        idx = torch.randint(0, Lk, (1, Hkv, Lq, 2), generator=g)
        return M.or_(M.indices(idx), M.sliding_window(3)).compile(B, Hq, Hkv, Lq, Lk,
                                                                  device="cpu", block_size=BLOCK)
    desc = M.causal().compile(B, Hq, Hkv, Lq, Lk, device="cpu", block_size=BLOCK)
    return desc.with_lists() if kind == "lists" else desc


def corrupted(how, B, Hq, Hkv, Lq, Lk, seed=0):
    """A descriptor for these sizes with corruption `how`, or None where the base
    descriptor lacks the tensor (no partial blocks to hold bitmaps) or the corruption
    changes nothing that is read (entries past every row's count)."""
    kind, corrupt = CORRUPTIONS[how]
    desc = copy.deepcopy(_base_descriptor(kind, B, Hq, Hkv, Lq, Lk, seed))
    mt = desc.mask_tensors()
    if kind == "bits" and mt.partial_bits_index is None:
        return None
    before = [None if t is None else t.clone() for t in mt]
    corrupt(mt)
    if all(a is None or torch.equal(a, b) for a, b in zip(before, mt)):
        return None
    # explicit lists are padded to at least one entry: with every count 0 the corrupted
    # entries are padding that nothing reads (not a corrupted descriptor)
    count = {"explicit_entry_negative": "kv_full_count", "explicit_entry_past_grid": "kv_count"}.get(how)
    if count is not None and int(getattr(desc, count).max()) <= 0:
        return None
    return desc


@contextmanager
def debug_mode(on=True):
    old = os.environ.get("FLEXSPARSE_DEBUG")
    os.environ["FLEXSPARSE_DEBUG"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["FLEXSPARSE_DEBUG"]
        else:
            os.environ["FLEXSPARSE_DEBUG"] = old


# ---------------------------------------------------------------- comparing

def _tolerance(dtype):
    return {torch.float16: 5e-3, torch.bfloat16: 3e-2}.get(dtype, 2e-4)


def assert_matches(got, want, tol, tiled_v=False, what="out"):
    """got equals the float64 `want`: NaN exactly where want has NaN, the same
    infinities, finite values close. tiled_v: a non-finite V in a tiled kernel may also
    reach rows that share a partially masked tile with its key (docs/semantics.md): there
    non-finite entries of want stay non-finite, and finite ones may become NaN."""
    a, r = got.double(), want.double()
    if tiled_v:
        assert bool((~torch.isfinite(a))[~torch.isfinite(r)].all()), \
            f"{what}: a non-finite row vanished"
        fin = torch.isfinite(a) & torch.isfinite(r)
    else:
        assert torch.equal(torch.isnan(a), torch.isnan(r)), \
            f"{what}: NaN pattern differs from float64"
        assert torch.equal(a == math.inf, r == math.inf), f"{what}: +inf pattern differs"
        assert torch.equal(a == -math.inf, r == -math.inf), f"{what}: -inf pattern differs"
        fin = torch.isfinite(r)
    torch.testing.assert_close(a[fin], r[fin], atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


def assert_named(err):
    msg = str(err)
    name = msg.split(":", 1)[0]
    assert isinstance(err, (ValueError, TypeError)), repr(err)
    assert ":" in msg and name in NAMES, f"not named: {type(err).__name__}: {msg}"


# ---------------------------------------------------------------- drawing a call

def _poison_at(data, t, label):
    """An index into t, drawn."""
    return tuple(data.draw(st.integers(0, n - 1), label=f"{label}[{d}]")
                 for d, n in enumerate(t.shape))


def _pick(data, good, bad_values, bad, label):
    """One of `good`, or (when this example may be bad) of `good` and `bad_values`."""
    return data.draw(st.sampled_from(list(good) + (list(bad_values) if bad else [])), label=label)


def _mask(data, g, B, Hq, Hkv, Lq, Lk, backend, bad):
    """(mask argument, corruption name or None, refusal expected): drawn masks, invalid
    ones (constructor arguments, shapes, descriptors for other sizes) only when `bad`.
    The constructors may raise (their own argument errors)."""
    kind = data.draw(st.sampled_from([
        "none", "causal", "sliding", "document", "prefix", "dense", "indices", "block_sparse",
        "reused", "reused", "corrupt", "corrupt"]), label="mask")
    if kind == "none":
        return None, None, False
    if kind == "causal":
        return M.causal(), None, False
    if kind == "sliding":
        return M.sliding_window(_pick(data, [0, 3, 20, None], [-1, 2.5, True], bad, "left")), \
            None, False
    if kind == "document":
        if bad:                                 # invalid unless they sum to Lk = Lq
            lengths = data.draw(st.lists(st.integers(-2, 12), min_size=0, max_size=4),
                                label="docs")
        else:
            cut = data.draw(st.integers(0, Lk), label="doc cut")
            lengths = [n for n in (cut, Lk - cut) if n] or [Lk]
        return M.document(lengths), None, False
    if kind == "prefix":
        n = data.draw(st.integers(0, 45), label="n") if not bad else data.draw(
            st.one_of(st.integers(-3, 45), st.sampled_from([2.5, True])), label="n")
        return M.prefix_lm(n), None, False
    if kind == "dense":
        shape = _pick(data, [(Lq, Lk), (1, 1, Lq, Lk), (B, Hkv, Lq, Lk), (Hq, Lq, Lk), (Lq, 1)],
                      [(Lq + 1, Lk), (Lk,)], bad, "dense shape")
        return torch.rand(*shape, generator=g) < 0.6, None, False
    if kind == "indices":
        hi = _pick(data, [Lk], [Lk + 5], bad, "index high")
        idx = torch.randint(-1, hi, (data.draw(st.sampled_from([1, B]), label="index batch"),
                                     Hkv, Lq, data.draw(st.integers(1, 5), label="W")),
                            generator=g)
        return M.indices(idx), None, False
    if kind == "block_sparse":
        nq, nk = -(-Lq // BLOCK[0]), -(-Lk // BLOCK[1])
        nq += _pick(data, [0], [1], bad, "layout rows extra")
        return M.block_sparse(torch.rand(1, Hq, nq, nk, generator=g) < 0.6, BLOCK), None, False
    if kind == "corrupt":
        names = list(CORRUPTIONS)
        how = data.draw(st.sampled_from(names), label="corruption")
        desc = corrupted(how, B, Hq, Hkv, Lq, Lk, seed=data.draw(st.integers(0, 9), label="cseed"))
        if desc is None:                        # no bitmaps, or nothing changed: another one
            how = "kv_count_past_width"
            desc = corrupted(how, B, Hq, Hkv, Lq, Lk)
        return desc, how, False
    # a descriptor compiled separately (batch 1 is valid for any B), or for other sizes:
    # then refused ("mask: ...")
    base = data.draw(st.sampled_from(["causal", "sliding", "document", "indices"]),
                     label="reused kind")
    B2 = _pick(data, [B, 1], [B + 1], bad, "compiled B")
    Hkv2 = _pick(data, [Hkv], [Hkv + 1], bad, "compiled Hkv")
    Hq2 = Hkv2 * _pick(data, [Hq // Hkv], [2], bad, "compiled group")
    Lq2 = _pick(data, [Lq], [Lq + 1, Lq + 16], bad, "compiled Lq")
    Lk2 = Lq2 if base == "document" else _pick(data, [Lk], [Lk + 16], bad, "compiled Lk")
    if base == "causal":
        mask = M.causal()
    elif base == "sliding":
        mask = M.sliding_window(5)
    elif base == "document":             # per-batch lengths: the descriptor has batch B2
        mask = M.document(torch.tensor([[Lq2 // 2 + b, Lq2 - Lq2 // 2 - b] for b in range(B2)]))
    else:
        mask = M.indices(torch.randint(-1, Lk2, (B2, Hkv2, Lq2, 3), generator=g))
    desc = mask.compile(B2, Hq2, Hkv2, Lq2, Lk2, device="cpu", block_size=BLOCK)
    batches = {t.shape[0] for n, t in zip(MASK_TENSOR_NAMES, desc.mask_tensors())
               if t is not None and n != "partial_bits"}
    fits = ((Lq2, Lk2) == (Lq, Lk) and (Hq2, Hkv2) == (Hq, Hkv)
            and batches <= {1, B})
    return desc, None, not fits


def _draw_call(data, backends, compiled=False):
    """Everything for one call: (build, info). build() returns (args, kwargs) for
    flexsparse.attention (constructors may raise there); info describes the draw. About
    half the examples may hold bad arguments (`bad`), the others only valid ones (non-finite
    values and corrupted descriptors included: those must give the reference's result)."""
    bad = data.draw(st.booleans(), label="bad")
    backend = data.draw(st.sampled_from(backends), label="backend")
    B = data.draw(st.integers(1, 2), label="B")
    Hkv = data.draw(st.integers(1, 2), label="Hkv")
    Hq = Hkv * data.draw(st.integers(1, 2), label="group")
    Lq = data.draw(st.integers(1, 40), label="Lq")
    Lk = data.draw(st.integers(1, 40), label="Lk")
    D = data.draw(st.sampled_from([8, 16]), label="D")
    dtypes = [torch.float32] if compiled else [torch.float32, torch.float32, torch.float16,
                                               torch.float64]
    if backend == "reference" and not compiled:
        dtypes.append(torch.bfloat16)       # (bf16 tl.dot is wrong in the Triton interpreter)
    dtype = data.draw(st.sampled_from(dtypes), label="dtype")
    seed = data.draw(st.integers(0, 10_000), label="seed")
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Lq, D, generator=g)
    k = torch.randn(B, Hkv, Lk, D, generator=g)
    v = torch.randn(B, Hkv, Lk, D, generator=g)
    shape_bug = _pick(data, ["none"] * 3, ["key_dim", "value_len", "heads", "int_dtype",
                                           "key_dtype"], bad, "shape bug")
    if shape_bug == "key_dim":
        k = torch.randn(B, Hkv, Lk, D + 1, generator=g)
    elif shape_bug == "value_len":
        v = torch.randn(B, Hkv, Lk + 1, D, generator=g)
    elif shape_bug == "heads":
        k, v = (torch.randn(B, Hq + 1, Lk, D, generator=g) for _ in range(2))
    bias = None
    if data.draw(st.booleans(), label="bias"):
        bias = torch.randn(_pick(data, [(B, Hq, Lq, Lk), (1, 1, Lq, Lk), (Lq, Lk), (Hkv, 1, Lk),
                                        (1, Lk), (B, 1, Lq, 1)],
                                 [(Lk,), (B, Hq, Lq, Lk + 1)], bad, "bias shape"), generator=g)
    poison = data.draw(st.sampled_from(["none"] * 3 + ["q", "k", "v", "bias"]), label="poison")
    target = {"q": q, "k": k, "v": v, "bias": bias}.get(poison)
    if target is not None and target.numel() > 0:
        target[_poison_at(data, target, poison)] = data.draw(
            st.sampled_from([math.nan, math.inf, -math.inf]), label="poison value")
    else:
        poison = "none"
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if shape_bug == "int_dtype":
        q = q.to(torch.int32)
    elif shape_bug == "key_dtype":
        k = k.to(torch.float64 if dtype != torch.float64 else torch.float32)
    if bias is not None:
        bias = bias.to(dtype)
    kw = dict(backend=backend, return_lse=True)
    if data.draw(st.booleans(), label="set scale"):
        kw["scale"] = _pick(data, [0.3, 2], [0, -1.0, math.nan, math.inf, "x", True], bad, "scale")
    if data.draw(st.booleans(), label="set softcap"):
        kw["softcap"] = _pick(data, [5.0, 0.0, None], [-1.0, math.nan, math.inf, "x"], bad,
                              "softcap")
    if data.draw(st.integers(0, 3), label="set flags") == 0:
        kw["return_lse"] = _pick(data, [True, False], ["yes", 1], bad, "return_lse")
        kw["deterministic"] = _pick(data, [False, True], ["no"], bad, "deterministic")
    if data.draw(st.integers(0, 3), label="set block") == 0:
        # (8, 8) is valid, but not for the Triton block kernels: refused by the backend
        kw["block_size"] = _pick(data, [(32, 16), 16, (8, 8)], [(0, 16), (16,)], bad,
                                 "block_size")
    info = dict(backend=backend, dtype=dtype, poison=poison, corrupted=None,
                must_refuse=False, shape_bug=shape_bug, bad=bad)

    def build():
        mask, how, must_refuse = _mask(data, g, B, Hq, Hkv, Lq, Lk, backend, bad)
        index = (isinstance(mask, M._Indices)
                 or isinstance(mask, flexsparse.BlockDescriptor) and mask.is_index_mask)
        info.update(corrupted=how, must_refuse=must_refuse, index=index)
        return (q, k, v, mask), dict(kw, bias=bias)
    return build, info


def _reference(args, kw):
    """The float64 reference on the same inputs (rounded as the call's)."""
    q, k, v, mask = args
    bias = kw["bias"]
    return flexsparse.attention(q.double(), k.double(), v.double(), mask,
                                **dict(kw, bias=None if bias is None else bias.double(),
                                       backend="reference"))


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _refused_the_same(err, args, kw):
    """The reference backend refuses the same call with the same message (a refusal is
    about the arguments, not the backend), unless the backend refused ("backend: ...")."""
    if str(err).startswith("backend:") or kw["backend"] == "reference":
        return
    with pytest.raises(type(err)) as info:
        flexsparse.attention(*args, **dict(kw, backend="reference"))
    assert str(info.value) == str(err)


# ---------------------------------------------------------------- the fuzz tests

# No shrinking: a failing example is reported as drawn (shrinking one took over 5 minutes,
# each try running kernels under the interpreter); its draws are printed.
SETTINGS = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 150)), deadline=None,
                    derandomize=not os.environ.get("FUZZ_RANDOM"),
                    phases=[Phase.explicit, Phase.reuse, Phase.generate],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@SETTINGS
@given(st.data())
def test_fuzz_attention(data):
    build, info = _draw_call(data, BACKENDS)
    debug = data.draw(st.integers(0, 4), label="debug") == 0
    args = None
    try:
        args, kw = build()                      # constructors check their own arguments
        with debug_mode(debug):
            got = flexsparse.attention(*args, **kw)
    except (ValueError, TypeError) as err:
        assert_named(err)
        event(f"refused{'' if info['bad'] else ' (valid draw)'}: {str(err).split(':', 1)[0]}")
        if not info["bad"]:
            _refusal_of_a_valid_draw(str(err), info, debug)
        if args is not None:
            with debug_mode(debug):
                _refused_the_same(err, args, kw)
        return
    event(f"compared: {info['backend']} {info['dtype']}"
          + (f" corrupted {info['corrupted']}" if info["corrupted"] else "")
          + (f" poison {info['poison']}" if info["poison"] != "none" else ""))
    assert not info["must_refuse"], "a descriptor compiled for other sizes was used"
    assert not (debug and info["corrupted"]), \
        "FLEXSPARSE_DEBUG=1 let a corrupted descriptor through"
    assert info["shape_bug"] == "none", f"{info['shape_bug']} was accepted"
    want = _reference(args, kw)
    tol = _tolerance(info["dtype"])
    tiled_v = info["poison"] == "v" and info["backend"] != "reference"
    for name, a, r in zip(("out", "lse"), _as_tuple(got), _as_tuple(want)):
        assert a.dtype == (info["dtype"] if name == "out" else
                           (torch.float64 if info["dtype"] == torch.float64 else torch.float32))
        assert_matches(a, r, tol, tiled_v, name)
    if (info["poison"] == "none" and info["corrupted"] is None
            and info["dtype"] in (torch.float32, torch.float64)
            and data.draw(st.integers(0, 2), label="grads") == 0):
        event(f"grads: {info['backend']}")
        _check_grads(args, kw, info)


def _refusal_of_a_valid_draw(msg, info, debug):
    """A draw without bad arguments may be refused only for these reasons, each a limit the
    draw can hit: a descriptor compiled for other sizes or corrupted (checked), a Triton
    limit (float64, 8 x 8 blocks), a document mask with Lq != Lk."""
    expected = (msg.startswith("mask:") and (info["must_refuse"] or info["corrupted"] is not None)
                or info["backend"] == "triton"
                and msg.startswith("backend: 'triton' cannot run these inputs")
                or msg.startswith("lengths: needs Lq == Lk"))
    assert expected, f"a valid call was refused (debug={debug}): {msg}"


def _check_grads(args, kw, info):
    """Gradients of q, k, v and a float bias against the float64 reference's (finite
    inputs, valid descriptors)."""
    q, k, v, mask = args
    bias = kw["bias"]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if bias is not None:
        leaves.append(bias.detach().clone().requires_grad_())
    w = torch.randn(q.shape[:3] + v.shape[-1:], generator=torch.Generator().manual_seed(7))

    def grads(leaves, backend, dtype):
        ls = [t.to(dtype) for t in leaves]
        out = flexsparse.attention(*ls[:3], mask, **dict(kw, backend=backend, return_lse=True,
                                                        bias=ls[3] if len(ls) > 3 else None))
        o, lse = out
        loss = (o * w.to(o.dtype)).sum() + lse.masked_fill(~torch.isfinite(lse), 0).sum()
        return torch.autograd.grad(loss, leaves)

    got = grads(leaves, info["backend"], info["dtype"])
    want = grads(leaves, "reference", torch.float64)
    tol = 1e-3 if info["dtype"] == torch.float32 else 1e-7
    for name, a, r in zip(("dq", "dk", "dv", "dbias"), got, want):
        assert a.shape == r.shape
        assert_matches(a, r, tol, what=name)


# 10 draws by default (20 took 109 s of CI's CPU suite); FUZZ_COMPILED_EXAMPLES for more.
COMPILED_SETTINGS = settings(max_examples=int(os.environ.get("FUZZ_COMPILED_EXAMPLES", 10)),
                             deadline=None, derandomize=not os.environ.get("FUZZ_RANDOM"),
                             phases=[Phase.explicit, Phase.reuse, Phase.generate],
                             suppress_health_check=[HealthCheck.too_slow,
                                                    HealthCheck.data_too_large])


@COMPILED_SETTINGS
@given(st.data())
def test_fuzz_attention_compiled(data):
    """The same draws inside torch.compile(fullgraph=True, dynamic=True) (aot_eager,
    float32): a call eager refuses is refused with the same exception
    and message (a ValueError/TypeError raised when the graph runs), or, for checks made
    while tracing, with Dynamo's Unsupported whose text carries that exception and
    message (docs/dynamic-masks.md); a call eager accepts gives the same result."""
    build, info = _draw_call(data, BACKENDS, compiled=True)
    try:
        args, kw = build()
    except (ValueError, TypeError) as err:
        assert_named(err)
        return
    q, k, v, mask = args
    try:
        want = flexsparse.attention(*args, **kw)
    except (ValueError, TypeError) as err:
        assert_named(err)
        want = err

    def call(q, k, v, bias, mask):
        return flexsparse.attention(q, k, v, mask, **dict(kw, bias=bias))
    torch._dynamo.reset()
    f = torch.compile(call, backend="aot_eager", fullgraph=True, dynamic=True)
    try:
        got = f(q, k, v, kw["bias"], mask)
    except Exception as err:    # noqa: BLE001 - compared with eager's below
        if not isinstance(want, Exception):
            # the one refusal of compiled code only: masks built element-wise (eager only)
            assert isinstance(err, torch._dynamo.exc.Unsupported), repr(err)
            assert re.search(r"raised exception ValueError\(['\"]mask: this mask is evaluated "
                             r"element-wise", str(err)), f"compiled refused what eager ran: {err!r}"
            event("compiled only: element-wise mask refused")
            return
        text = str(err)
        if type(err) is type(want) and text == str(want):
            event("refused when the graph ran, as eager")
            return
        if isinstance(err, torch._dynamo.exc.Unsupported):
            # refused while tracing: Dynamo's Unsupported carrying the exception and its
            # message (a symbolic int's value is not shown there: masks.shown)
            found = re.search(r"raised exception (ValueError|TypeError)\((['\"])(\w+):", text)
            assert found and found.group(3) in NAMES, text
            same = (found.group(1) == type(want).__name__
                    and found.group(3) == str(want).split(":")[0])
        elif isinstance(err, RuntimeError) and "(checked inside torch.compile)" in text:
            # a data value checked when the graph runs (torch._assert_async: a RuntimeError,
            # docs/dynamic-masks.md "Which check runs where"), before eager's first refusal
            assert text.split(":")[0] in NAMES, text
            same = False
        else:
            assert_named(err)
            same = False
        # Another argument may be named first when several are bad: compiled code checks
        # some while tracing and the rest when the graph runs, eager in one order.
        event("refused while tracing, as eager" if same else "refused, naming another argument")
        return
    assert not isinstance(want, Exception), f"compiled ran what eager refused: {want!r}"
    event(f"compared: {info['backend']}")
    for a, r in zip(_as_tuple(got), _as_tuple(want)):
        assert_matches(a, r.double(), 1e-5)


# ---------------------------------------------------------------- corrupted descriptors

SAFE = [(how, b) for how in CORRUPTIONS for b in BACKENDS]


@pytest.mark.parametrize("how,backend", SAFE, ids=[f"{h}-{b}" for h, b in SAFE])
def test_corrupted_descriptor_reads_in_bounds_and_matches_reference(how, backend):
    """Hand-corrupted mask tensors never make a backend read out of bounds: entries
    outside the grid are skipped, counts clamped to [0, width], bitmap indices past the
    pool read no bitmap (as -1), index entries outside [0, Lk) read nothing; out and lse
    equal the float64 reference on the same descriptor (docs/semantics.md)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(3))
    desc = corrupted(how, 1, 2, 2, 40, 40)
    assert desc is not None
    got = flexsparse.attention(q, k, v, desc, backend=backend, return_lse=True)
    want = flexsparse.attention(q.double(), k.double(), v.double(), desc, backend="reference",
                                return_lse=True)
    for name, a, r in zip(("out", "lse"), got, want):
        assert_matches(a, r, 2e-4, what=name)


def test_bitmap_index_past_pool_reads_no_bitmap():
    """The reference reads a bitmap index outside [0, P) as -1 (no bitmap: the partial
    block's entries all visible), as it reads -1; it used to raise IndexError."""
    q = torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(5))
    desc = corrupted("bitmap_index_past_pool", 1, 2, 2, 40, 40)
    as_none = copy.deepcopy(desc)
    as_none.partial_bits_index.fill_(-1)
    torch.testing.assert_close(flexsparse.attention(q, q, q, desc, backend="reference"),
                               flexsparse.attention(q, q, q, as_none, backend="reference"))


@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_debug_mode_refuses_corrupted_descriptors(how, monkeypatch):
    """FLEXSPARSE_DEBUG=1: every mask tensor's values are checked before any kernel, in
    the op's kernel (so for the raw op, on every backend whose kernel is Python, and when
    a compiled graph runs): a ValueError naming the tensor. A valid descriptor passes."""
    monkeypatch.setenv("FLEXSPARSE_DEBUG", "1")
    q = torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(6))
    kind = CORRUPTIONS[how][0]
    valid = _base_descriptor(kind, 1, 2, 2, 40, 40)
    flexsparse.attention(q, q, q, valid, backend="reference")
    desc = corrupted(how, 1, 2, 2, 40, 40)
    pattern = r"^mask: descriptor (list|tensor) \w+ holds"
    for backend in BACKENDS:            # Triton too: refused before its kernel runs
        with pytest.raises(ValueError, match=pattern):
            flexsparse.attention(q, q, q, desc, backend=backend)
    with pytest.raises(ValueError, match=pattern):
        torch.ops.flexsparse.attention(q, q, q, None, *desc.mask_tensors(), *BLOCK, 0.25, 0.0,
                                       "auto", False)
    torch._dynamo.reset()
    f = torch.compile(lambda q, d: flexsparse.attention(q, q, q, d), backend="aot_eager",
                      fullgraph=True, dynamic=True)
    torch.testing.assert_close(f(q, valid), flexsparse.attention(q, q, q, valid))
    with pytest.raises(ValueError, match=pattern):
        f(q, desc)


def test_debug_asserts_in_graph():
    """mask_checks.assert_mask_data, what a compiled call on the CUDA backend runs under
    FLEXSPARSE_DEBUG=1 (its C++ kernel runs no Python): graph asserts, no host sync; on
    CPU a RuntimeError naming the tensor when the graph runs."""
    def check(desc):
        Lq, Lk = desc.seq_lengths
        mt = desc.mask_tensors()
        mask_checks.assert_mask_data(mt, Lq, Lk, *desc.block_size)
        return sum(t.sum() for t in mt if t is not None)

    torch._dynamo.reset()
    f = torch.compile(check, backend="aot_eager", fullgraph=True, dynamic=True)
    f(_base_descriptor("ranges", 1, 2, 2, 40, 40))
    for how in ("kv_count_past_width", "explicit_entry_negative", "attn_indices_out_of_range"):
        name = {"kv_count_past_width": "kv_count", "explicit_entry_negative": "kv_full_index",
                "attn_indices_out_of_range": "attn_indices"}[how]
        with pytest.raises(RuntimeError, match=f"mask: descriptor tensor {name} holds a value "
                                               f"outside its range"):
            f(corrupted(how, 1, 2, 2, 40, 40))


# ---------------------------------------------------------------- non-finite input

L = 40


def _rule_inputs(where, value, i, j):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 1, L, 16, generator=g) for _ in range(3))
    bias = torch.zeros(1, 1, L, L)
    target = {"q": (q, (0, 0, i, 0)), "k": (k, (0, 0, j, 0)), "v": (v, (0, 0, j, 0)),
              "bias": (bias, (0, 0, i, j))}
    if where == "bias_row":
        bias[0, 0, i, :] = value
    else:
        t, at = target[where]
        t[at] = value
    return q, k, v, bias


# (where, value, query row i, key j, rows whose out and lse are NaN): causal, so row i
# sees keys j <= i; docs/semantics.md, "Non-finite input"
RULES = [
    ("bias", math.nan, 5, 30, []),          # invisible entry: never matters
    ("bias", math.inf, 5, 30, []),
    ("bias", math.nan, 30, 5, [30]),        # visible NaN or +inf score: the row is NaN
    ("bias", math.inf, 30, 5, [30]),
    ("k", math.nan, 0, 39, [39]),           # only row 39 sees key 39
    ("q", math.nan, 3, 0, [3]),
    ("q", math.inf, 3, 0, [3]),             # (+-inf scores, some +inf)
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", RULES, ids=[f"{w}={v}@{i},{j}" for w, v, i, j, _ in RULES])
def test_non_finite_rules(backend, rule):
    where, value, i, j, nan_rows = rule
    q, k, v, bias = _rule_inputs(where, value, i, j)
    desc = M.causal().compile(1, 1, 1, L, L, device="cpu", block_size=BLOCK)
    out, lse = flexsparse.attention(q, k, v, desc, bias=bias, backend=backend, return_lse=True)
    assert out.isnan().any(-1)[0, 0].nonzero().flatten().tolist() == nan_rows
    assert lse.isnan()[0, 0].nonzero().flatten().tolist() == nan_rows
    fine = torch.ones(L, dtype=torch.bool)
    fine[nan_rows] = False
    assert bool(torch.isfinite(out[0, 0, fine]).all())
    assert bool(torch.isfinite(lse[0, 0, fine]).all())
    clean = flexsparse.attention(*_rule_inputs(where, 0.0, i, j)[:3], desc, backend="reference",
                                 bias=torch.zeros(1, 1, L, L), return_lse=True)
    if where in ("bias", "k") and not nan_rows:
        torch.testing.assert_close(out, clean[0], atol=2e-5, rtol=1e-4)


@pytest.mark.skipif("triton" not in BACKENDS, reason="needs Triton (TRITON_INTERPRET=1 on CPU)")
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_index_kernel_lse_of_nan_rows(value):
    """A row of an index mask that sees a NaN or +inf score: out and lse NaN, as in the
    reference and the block kernels (docs/semantics.md)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=g) for _ in range(3))
    q[0, 0, 2, 0] = value
    idx = torch.randint(0, 20, (1, 2, 20, 4), generator=g)
    out, lse = flexsparse.attention(q, k, v, M.indices(idx), backend="triton", return_lse=True)
    assert bool(out[0, 0, 2].isnan().all())
    assert math.isnan(lse[0, 0, 2])


@pytest.mark.skipif("triton" not in BACKENDS, reason="needs Triton (TRITON_INTERPRET=1 on CPU)")
def test_corrupted_entry_hides_non_finite_scores():
    """A NaN query row whose only listed block is outside the grid (a corrupted list):
    the row sees nothing, out 0 and lse -inf, as in the reference."""
    g = torch.Generator().manual_seed(1794)
    q = torch.randn(1, 4, 17, 8, generator=g)
    k, v = (torch.randn(1, 2, 27, 8, generator=g) for _ in range(2))
    q[0, 2, 13, 4] = math.nan
    desc = corrupted("kv_index_past_grid", 1, 4, 2, 17, 27)
    ref = flexsparse.attention(q.double(), k.double(), v.double(), desc, backend="reference")
    assert bool((ref[0, 2, 13] == 0).all())
    out = flexsparse.attention(q, k, v, desc, backend="triton")
    assert bool((out[0, 2, 13] == 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_inf_bias_is_a_mask(backend):
    """A -inf bias entry is the same as masking that entry; a row of -inf is fully masked
    (out 0, lse -inf, zero gradients)."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 1, L, 16, generator=g, requires_grad=True) for _ in range(3))
    vis = torch.ones(L, L, dtype=torch.bool).tril()
    bias = torch.zeros(L, L)
    bias[20, 3] = bias[21, 21] = -math.inf
    bias[30, :] = -math.inf
    vis2 = vis.clone()
    vis2[20, 3] = vis2[21, 21] = False
    vis2[30, :] = False
    out, lse = flexsparse.attention(q, k, v, vis, bias=bias, backend=backend, return_lse=True,
                                    block_size=BLOCK)
    ref, ref_lse = flexsparse.attention(q, k, v, vis2, backend="reference", return_lse=True,
                                        block_size=BLOCK)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=1e-4)
    assert bool((out[0, 0, 30] == 0).all()) and lse[0, 0, 30] == -math.inf
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert bool((dq[0, 0, 30] == 0).all())
    assert all(bool(torch.isfinite(t).all()) for t in (dq, dk, dv))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["v", "k"])
def test_non_finite_invisible_key(backend, where):
    """NaN in key 39 (seen only by row 39 under causal): which rows it reaches."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 1, L, 16, generator=g) for _ in range(3))
    (v if where == "v" else k)[0, 0, L - 1, 0] = math.nan
    desc = M.causal().compile(1, 1, 1, L, L, device="cpu", block_size=BLOCK)
    out = flexsparse.attention(q, k, v, desc, backend=backend)
    nan_rows = out.isnan().any(-1)[0, 0].nonzero().flatten().tolist()
    if where == "k" or backend == "reference":
        assert nan_rows == [L - 1]          # only the row that sees the key
    else:
        # the documented exception: rows 32..38 share the last 16x16 tile with key 39
        assert nan_rows == list(range(32, L))


def test_names_cover_the_messages():
    """assert_named is a real check: unnamed errors fail it."""
    assert_named(ValueError("scale: must be a finite positive float, got nan"))
    for bad in (ValueError("must be positive"), RuntimeError("scale: x"),
                ValueError("expected sequence of length 2 at dim 1 (got 1)")):
        with pytest.raises(AssertionError):
            assert_named(bad)
