"""Benchmark: flexsparse (Triton backend) vs FlexAttention vs SDPA, in the same run.

    python -m benchmarks.bench [--quick] [--rows causal,document@16384,...] [--out PATH]
                               [--no-flex] [--no-sdpa] [--no-indices] [--repeat N]
                               [--bwd {direct,subtract}]
                               [--sweep [--sweep-passes P] [--sweep-configs C]]
                               [--profile]
                               [--bwd-mode {auto,two_pass,one_launch,atomic_dq,all}]
                               [--no-dq-from-ds]

bf16, H=16 (Hq = Hkv), B*L = 16K tokens. Times are medians of triton.testing.do_bench.
Forward: the call on inputs without grad. Backward, timed directly for all three: one
forward on requires_grad inputs outside the timed region, then do_bench of
`torch.autograd.grad(out, (q, k, v[, bias]), grad_out, retain_graph=True)` alone. For
FlexAttention that needs AOTAutograd's donated buffers off (they forbid retain_graph);
the bench turns them off for its compile. If direct timing raises for an
implementation, that implementation falls back to backward = (fwd+bwd) - fwd for the
row, and its backward cells are marked "(sub)". `--bwd subtract` uses the old
subtraction everywhere (it proved noisy on partial-heavy rows, see docs/perf-notes.md).
`--repeat N` runs each row N times (implementations interleaved within a run) and
reports the median of the N per-run medians. The flexsparse descriptor and the
FlexAttention BlockMask are built outside the timed region. Effective TFLOP/s count only
visible score entries: 4*D flops per entry forward, 2.5x that backward.

Rows: full, causal, sliding window 1024, document (12 docs), prefix-LM (L/4),
shared-question (question L/4 + 4 answers), random block-sparse 20% (128x128 blocks +
diagonal) at L = 8K and 16K, hd128 (full and causal also hd64), and causal + full
(B, H, L, L) bias with dbias at 4K. Index-attention rows come from
`benchmarks.bench_indices` (if present), in a table of their own.

`--sweep` times each pass of our kernels alone per tile config (the backward directly,
through the op's backward on a saved (out, lse)); `--profile` prints torch.profiler
kernel times of our forward+backward steps.

`--bwd-mode` picks the structure of our backward (kernel option `bwd_mode`): auto
(default: one_launch for head dims > 64, else two_pass), two_pass, one_launch or
atomic_dq; `all` times our backward in each mode in the same run
(extra columns "ours bwd <mode>"; the sweep and the profile run once per mode). Where a
mode does not apply it runs two_pass: both new modes do on the causal_bias row (its dQ
pass reads the stored dS), atomic_dq also with deterministic=True.
"""
import argparse
import contextlib
import math
import os
import statistics
import sys
import time

import torch

BWD_MODES = ("auto", "two_pass", "one_launch", "atomic_dq")
H = 16
TOKENS = 16384
DTYPE = torch.bfloat16

# (mask kind, L, D)
ROWS = [(kind, L, 128) for kind in ("full", "causal", "sliding", "document", "prefix_lm",
                                    "shared_question", "block_sparse")
        for L in (8192, 16384)]
ROWS += [("full", 8192, 64), ("causal", 8192, 64), ("causal_bias", 4096, 128)]
QUICK = [("full", 8192, 128), ("causal", 8192, 128), ("sliding", 8192, 128),
         ("document", 8192, 128), ("causal_bias", 4096, 128)]


# ---------------------------------------------------------------- the masks, both ways

def _doc_lengths(L, n, seed):
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(L - 1, generator=g)[:n - 1].add(1).sort().values.tolist()
    bounds = [0] + cuts + [L]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def make_case(kind, B, L, device="cuda"):
    """(flexsparse mask, flex mask_mod or None, flex mask needs per-head BlockMask,
    SDPA is_causal or None when SDPA cannot express it, has_bias)."""
    from flexsparse import masks as M

    def causal_mod(b, h, q, kv):
        return q >= kv

    if kind.endswith("_bias"):     # any row with a trainable (B, H, L, L) bias, e.g. causal_bias
        fs_mask, mod, per_head, _, _ = make_case(kind[:-len("_bias")], B, L, device)
        return fs_mask, mod, per_head, None, True
    if kind == "full":
        return M.full(), None, False, False, False
    if kind == "causal":
        return M.causal(), causal_mod, False, True, False
    if kind.startswith("sliding"):     # "sliding" (window 1024) or "sliding<W>", e.g. sliding256
        W = int(kind[len("sliding"):] or 1024)

        def mod(b, h, q, kv):
            return (q >= kv) & (q - kv <= W)
        return M.sliding_window(W), mod, False, None, False
    if kind == "document":
        lengths = _doc_lengths(L, 12, seed=L)
        doc = torch.repeat_interleave(torch.arange(12), torch.tensor(lengths)).to(device)

        def mod(b, h, q, kv):
            return (doc[q] == doc[kv]) & (q >= kv)
        return M.document(lengths), mod, False, None, False
    if kind == "prefix_lm":
        P = L // 4

        def mod(b, h, q, kv):
            return (kv < P) | (q >= kv)
        return M.prefix_lm(P), mod, False, None, False
    if kind == "shared_question":
        Q = L // 4
        answers = _doc_lengths(L - Q, 4, seed=L + 1)
        seg = torch.repeat_interleave(torch.arange(5) - 1,
                                      torch.tensor([Q] + answers)).to(device)

        def mod(b, h, q, kv):
            return (q >= kv) & ((seg[kv] == -1) | (seg[kv] == seg[q]))
        return M.shared_question(Q, answers), mod, False, None, False
    if kind == "block_sparse":
        nb = L // 128
        g = torch.Generator(device=device).manual_seed(L)
        layout = torch.rand(1, H, nb, nb, device=device, generator=g) < 0.2
        layout |= torch.eye(nb, dtype=torch.bool, device=device)
        lay = layout[0]

        def mod(b, h, q, kv):
            return lay[h, q // 128, kv // 128]
        return M.block_sparse(layout, 128), mod, True, None, False
    raise ValueError(f"unknown row kind {kind!r}")


def flex_block_mask(desc, mask_mod, per_head, L, dev):
    """FlexAttention's BlockMask for a row from make_case (None for the full mask)."""
    if per_head:
        # create_block_mask evaluates (H, L, L) at once (32 GiB at 16K): build the same
        # BlockMask (every listed block full) from the layout's lists instead.
        from flexsparse.flex import to_block_mask
        return to_block_mask(desc)
    if mask_mod is not None:
        from torch.nn.attention.flex_attention import create_block_mask
        return create_block_mask(mask_mod, None, None, L, L, device=dev)
    return None


# ---------------------------------------------------------------- timing

def _bench(fn, grad_to_none=None):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=50, grad_to_none=grad_to_none,
                                   return_mode="median")


def _time_bwd_direct(grad_fwd, inputs, grad_out):
    """Backward alone: one forward with grad outside the timed region, then do_bench of
    autograd.grad over the retained graph (nothing accumulates into .grad)."""
    out = grad_fwd()
    return _bench(lambda: torch.autograd.grad(out, inputs, grad_out, retain_graph=True))


def _time_bwd_subtract(grad_fwd, inputs, grad_out, fwd_ms):
    """The old method: (forward + backward) - forward."""
    fb = _bench(lambda: torch.autograd.grad(grad_fwd(), inputs, grad_out))
    return fb - fwd_ms


def _no_donated_buffers():
    """AOTAutograd refuses retain_graph=True on a compiled backward with donated buffers
    (torch >= 2.6); turn them off for FlexAttention's compile so the graph can be kept."""
    try:
        import torch._functorch.config as fconfig
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(fconfig, "donated_buffer"):
        return contextlib.nullcontext()
    return fconfig.patch(donated_buffer=False)


def _empty_cache(dev):
    if dev.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _swapped(obj, name, value):
    """obj.name = value inside the block, restored after."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


# The kernel options "ours" runs with (flexsparse.attention(..., kernel_options=...)):
# main() sets them from the command line, _bwd_mode swaps the backward mode for a block.
OURS_OPTIONS = {}


def _ours_options():
    return dict(OURS_OPTIONS)


def _bwd_mode(mode):
    """Run our backward in `mode` (kernel option bwd_mode) inside the block."""
    return _swapped(sys.modules[__name__], "OURS_OPTIONS", dict(OURS_OPTIONS, bwd_mode=mode))


def load_block_module(path):
    """Another copy of the Triton block backend, for a same-run A/B: either a directory
    holding copies of ops/triton_block*.py (e.g. `mkdir /tmp/old && cp ops/triton_block*.py
    /tmp/old` before a change), or one file, a copy of ops/triton_block.py from before it
    was split into triton_block_*.py (`git show a461f6f:ops/triton_block.py`). Loaded as
    package flexsparse.ops._ab_old: the copies import each other, and every other module of
    flexsparse.ops (schema, reference, triton_launch, ...) is the current one."""
    import importlib
    import importlib.util
    import types
    import flexsparse.ops
    name = "flexsparse.ops._ab_old"
    if not os.path.isdir(path):
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]
    pkg = types.ModuleType(name)
    pkg.__path__ = [os.path.abspath(path)]
    pkg.__package__ = name
    sys.modules[name] = pkg
    for key, mod in list(sys.modules.items()):
        short = key[len("flexsparse.ops."):] if key.startswith("flexsparse.ops.") else ""
        if short and "." not in short and not short.startswith(("triton_block", "_ab_old")):
            sys.modules[f"{name}.{short}"] = mod      # the current module, shared
    for short in ("reference", "schema", "kernel_options", "triton_compat", "triton_launch"):
        sys.modules.setdefault(f"{name}.{short}",
                               importlib.import_module(f"flexsparse.ops.{short}"))
    return importlib.import_module(f"{name}.triton_block")


def _block_module(mod):
    """Route the Triton backend's block-mask calls to `mod` inside the block."""
    from flexsparse.ops import triton_backend
    return _swapped(triton_backend, "triton_block", mod)


def _ours(mode):
    """Implementation name of our kernels with the backward in `mode`."""
    return f"ours {mode}"


def time_row(kind, L, D, *, flex=True, sdpa=True, repeat=1, bwd="direct", device=None,
             extra_modes=(), log=print, old_block=None):
    """Time one row: forward and backward (ms, medians) and TFLOP/s of each implementation.

    `bwd="direct"` times the backward alone (see `_time_bwd_direct`); an implementation
    whose direct timing raises falls back to the subtraction for the rest of the row and
    is labelled "(sub)" in the table. `repeat` runs the whole row that many times (the
    implementations interleaved within each run) and keeps the median of the per-run
    medians. `extra_modes`: backward modes of ours to time besides OURS_OPTIONS' bwd_mode,
    as implementations named `_ours(mode)`. `old_block`: another copy of the block
    backend (see load_block_module), timed as implementation "old" in the same
    runs, for A/B of a kernel change."""
    dev = torch.device(device) if device is not None else torch.device(
        "cuda", torch.cuda.current_device())
    try:
        return _time_row(kind, L, D, dev, flex=flex, sdpa=sdpa, repeat=repeat, bwd=bwd,
                         extra_modes=extra_modes, log=log, old_block=old_block)
    finally:                                     # the row's tensors are gone by now
        _empty_cache(dev)


def _time_row(kind, L, D, dev, *, flex, sdpa, repeat, bwd, extra_modes, log, old_block):
    import flexsparse
    B = max(1, TOKENS // L)
    torch.manual_seed(0)
    mk = lambda *s: torch.randn(*s, device=dev, dtype=DTYPE)  # noqa: E731
    q, k, v = mk(B, H, L, D), mk(B, H, L, D), mk(B, H, L, D)
    do = mk(B, H, L, D)
    fs_mask, mask_mod, per_head, sdpa_causal, has_bias = make_case(kind, B, L, device=dev)
    bias = mk(B, H, L, L) if has_bias else None
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    bias_g = bias.detach().clone().requires_grad_() if has_bias else None
    inputs = tuple(leaves) + ((bias_g,) if has_bias else ())

    desc = fs_mask.compile(B, H, H, L, L, device=dev)
    visible = desc.num_visible(batch=B)
    flops_fwd = 4.0 * D * visible
    from flexsparse.ops import triton_block_mask
    facts0 = triton_block_mask.FACT_COMPUTES
    row = dict(kind=kind, L=L, D=D, B=B, visible=visible, flops_fwd=flops_fwd)
    where = f"{kind} L={L} D={D}"

    # name -> (forward without grad, forward with grad on `inputs`, context to run under)
    impls = {"ours": (
        lambda: flexsparse.attention(q, k, v, desc, bias=bias, backend="triton",
                                     kernel_options=_ours_options()),
        lambda: flexsparse.attention(*leaves, desc, bias=bias_g, backend="triton",
                                     kernel_options=_ours_options()),
        contextlib.nullcontext)}
    for mode in extra_modes:
        impls[_ours(mode)] = impls["ours"][:2] + (lambda mode=mode: _bwd_mode(mode),)
    if old_block is not None:
        impls["old"] = impls["ours"][:2] + (lambda: _block_module(old_block),)

    from flexsparse.ops import backends as _backends
    if "cuda" in _backends.available():      # the csrc kernels: forward only so far
        impls["cuda"] = (lambda: flexsparse.attention(q, k, v, desc, bias=bias, backend="cuda"),
                         None, contextlib.nullcontext)

    if flex:
        try:
            from torch.nn.attention.flex_attention import flex_attention
            fa = torch.compile(flex_attention, dynamic=False)
            bm = flex_block_mask(desc, mask_mod, per_head, L, dev)
            if has_bias:
                def score_mod(score, b, h, qi, kv):
                    return score + bias_g[b, h, qi, kv]

                def fwd_score_mod(score, b, h, qi, kv):
                    return score + bias[b, h, qi, kv]
            else:
                score_mod = fwd_score_mod = None
            impls["flex"] = (
                lambda: fa(q, k, v, score_mod=fwd_score_mod, block_mask=bm),
                lambda: fa(*leaves, score_mod=score_mod, block_mask=bm),
                _no_donated_buffers if bwd == "direct" else contextlib.nullcontext)
        except Exception as err:  # report, keep going
            log(f"  flex {where}: set-up failed: {type(err).__name__}: {str(err)[:300]}")

    if sdpa and sdpa_causal is not None and not has_bias:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        F = torch.nn.functional
        impls["sdpa"] = (
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=sdpa_causal),
            lambda: F.scaled_dot_product_attention(*leaves, is_causal=sdpa_causal),
            lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION))

    method = {name: bwd for name in impls}
    samples = {name: [] for name in impls}      # name -> [(fwd ms, bwd ms, method)]
    for _ in range(max(1, repeat)):
        for name, (fwd_fn, grad_fwd, ctx) in impls.items():
            if method[name] is None:             # failed in an earlier run
                continue
            try:
                with ctx():
                    fwd_ms = _bench(fwd_fn)
                    if grad_fwd is None:                 # forward-only implementation
                        samples[name].append((fwd_ms, float("nan"), "direct"))
                        continue
                    if method[name] == "direct":
                        try:
                            bwd_ms = _time_bwd_direct(grad_fwd, inputs, do)
                        except Exception as err:
                            log(f"  {name} {where}: direct backward failed "
                                f"({type(err).__name__}: {str(err)[:200]}); using "
                                "(fwd+bwd) - fwd for this implementation")
                            method[name] = "subtract"
                    if method[name] == "subtract":
                        _empty_cache(dev)
                        bwd_ms = _time_bwd_subtract(grad_fwd, inputs, do, fwd_ms)
                samples[name].append((fwd_ms, bwd_ms, method[name]))
            except Exception as err:  # report, keep going
                log(f"  {name} {where}: failed: {type(err).__name__}: {str(err)[:300]}")
                method[name] = None
            _empty_cache(dev)

    for name, runs in samples.items():
        if not runs:
            continue
        fwd_ms = statistics.median(r[0] for r in runs)
        bwd_ms = statistics.median(r[1] for r in runs)
        row[f"{name}_fwd_ms"], row[f"{name}_bwd_ms"] = fwd_ms, bwd_ms
        row[f"{name}_bwd_runs"] = [r[1] for r in runs]
        row[f"{name}_fwd_runs"] = [r[0] for r in runs]
        row[f"{name}_bwd_method"] = ("direct" if all(r[2] == "direct" for r in runs)
                                     else "subtract")
        row[f"{name}_fwd"] = flops_fwd / fwd_ms * 1e-9
        row[f"{name}_bwd"] = 2.5 * flops_fwd / bwd_ms * 1e-9 if bwd_ms > 0 else None

    # host syncs for descriptor facts (ops/triton_block_mask.py _cached_fact): one per new
    # descriptor
    row["fact_syncs"] = triton_block_mask.FACT_COMPUTES - facts0
    if row.get("ours_fwd") and row.get("old_fwd") and row.get("ours_bwd") and row.get("old_bwd"):
        row["ab_fwd"] = row["ours_fwd"] / row["old_fwd"]
        row["ab_bwd"] = row["ours_bwd"] / row["old_bwd"]
    if row.get("ours_fwd") and row.get("flex_fwd"):
        row["ratio_fwd"] = row["ours_fwd"] / row["flex_fwd"]
    if row.get("ours_bwd") and row.get("flex_bwd"):
        row["ratio_bwd"] = row["ours_bwd"] / row["flex_bwd"]
    return row


# ---------------------------------------------------------------- table

LABELS = {"full": "full", "causal": "causal", "sliding": "sliding window 1024",
          "document": "document (12 docs)", "prefix_lm": "prefix-LM (L/4)",
          "shared_question": "shared-question (L/4 + 4 answers)",
          "block_sparse": "block-sparse 20% + diag", "causal_bias": "causal + full bias (dbias)"}

HEADER = ("| mask | L | D | B | ours fwd | ours bwd | flex fwd | flex bwd | SDPA fwd | SDPA bwd "
          "| ours/flex fwd | ours/flex bwd | CUDA fwd | CUDA/flex fwd |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def header(extra_modes=()):
    """HEADER with one more column per extra backward mode of ours."""
    names, rule = HEADER.split("\n")
    return (names + "".join(f" ours bwd {m} |" for m in extra_modes) + "\n"
            + rule + "---|" * len(extra_modes))


def _ratio(r, a, b):
    return r[a] / r[b] if r.get(a) and r.get(b) else None


def _f(x, fmt=".0f"):
    return "n/a" if x is None else format(x, fmt)


def _bwd_cell(r, name):
    cell = _f(r.get(f"{name}_bwd"))
    if r.get(f"{name}_bwd_method") == "subtract" and cell != "n/a":
        cell += " (sub)"
    return cell


def format_row(r, extra_modes=()):
    return (f"| {LABELS.get(r['kind'], r['kind'])} | {r['L'] // 1024}K | {r['D']} | {r['B']} "
            f"| {_f(r.get('ours_fwd'))} | {_bwd_cell(r, 'ours')} "
            f"| {_f(r.get('flex_fwd'))} | {_bwd_cell(r, 'flex')} "
            f"| {_f(r.get('sdpa_fwd'))} | {_bwd_cell(r, 'sdpa')} "
            f"| {_f(r.get('ratio_fwd'), '.2f')} | {_f(r.get('ratio_bwd'), '.2f')} "
            f"| {_f(r.get('cuda_fwd'))} | {_f(_ratio(r, 'cuda_fwd', 'flex_fwd'), '.2f')} |"
            + "".join(f" {_bwd_cell(r, _ours(m))} |" for m in extra_modes))


def method_line(bwd="direct", repeat=1, bwd_mode="auto"):
    """How the numbers were taken, one line (printed above the table header)."""
    if bwd == "direct":
        how = ("backward timed directly: autograd.grad over a retained graph, its forward "
               "outside the timed region; \"(sub)\" = that cell fell back to (fwd+bwd) - fwd")
    else:
        how = "backward = (fwd+bwd) - fwd"
    runs = f"median of {repeat} runs of " if repeat > 1 else ""
    mode = "" if bwd_mode == "auto" else f" Our backward: bwd_mode={bwd_mode}."
    return f"Times: {runs}the do_bench median; {how}.{mode}"


def format_table(rows, bwd="direct", repeat=1, bwd_mode="auto", extra_modes=()):
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    title = (f"Effective TFLOP/s (visible entries only), bf16, H={H}, B*L={TOKENS // 1024}K "
             f"tokens, median of do_bench ({dev}, torch {torch.__version__})")
    return "\n".join([title, method_line(bwd, repeat, bwd_mode), "", header(extra_modes)]
                     + [format_row(r, extra_modes) for r in rows])


# ---------------------------------------------------------------- config sweep (ours)

SWEEP = {
    "fwd": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2),
            (64, 64, 4, 3), (128, 64, 8, 4)],
    "dkdv": [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3),
             (128, 128, 8, 2), (32, 128, 8, 3)],
    "dq": [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2),
           (128, 32, 4, 3), (64, 128, 8, 2)],
}


def parse_combos(text):
    """'dkdv:64x128x8x3+dq:128x64x8x2,fwd:128x64x8x3' -> [{pass: (BM, BN, warps, stages)}]"""
    combos = []
    for item in filter(None, text.split(",")):
        combo = {}
        for part in item.split("+"):
            which, cfg = part.split(":")
            combo[which] = tuple(int(x) for x in cfg.split("x"))
        combos.append(combo)
    return combos


def sweep(cases, log=print, modes=("auto",), passes=("fwd", "dkdv", "dq"), combos=()):
    """Time each pass of our kernels alone for candidate (BM, BN, warps, stages); the
    backward passes once per backward mode in `modes` (atomic_dq has no dQ pass; one_launch
    takes warps / stages from the dkdv config). `passes` limits which passes are swept;
    `combos` (see parse_combos) replaces the per-pass lists by explicit candidates."""
    from flexsparse.ops import kernel_options
    from flexsparse.ops import triton_block as tb
    for kind, L, D in cases:
        B = max(1, TOKENS // L)
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=DTYPE)  # noqa: E731
        q, k, v, do = mk(B, H, L, D), mk(B, H, L, D), mk(B, H, L, D), mk(B, H, L, D)
        dev = torch.device("cuda", torch.cuda.current_device())
        fs_mask, _, _, _, has_bias = make_case(kind, B, L, device=dev)
        bias = mk(B, H, L, L) if has_bias else None      # the bias row: with dbias
        desc = fs_mask.compile(B, H, H, L, L, device=dev)
        mt = desc.mask_tensors()
        scale = 1 / math.sqrt(D)
        flops = 4.0 * D * desc.num_visible(batch=B)
        out, lse = tb.forward(q, k, v, bias, mt, 128, 128, scale, 0.0, False)
        if combos:      # explicit candidates: each one a dict of pass -> config
            todo = [("fwd" if set(c) == {"fwd"} else "bwd", mode, c)
                    for mode in modes for c in combos]
        else:           # each pass alone over its SWEEP list (atomic_dq has no dQ pass)
            per_pass = [("fwd", None)] + [(w, mode) for mode in modes for w in ("dkdv", "dq")
                                          if not (mode == "atomic_dq" and w == "dq")]
            todo = [(w, m, {w: cfg}) for w, m in per_pass if w in passes for cfg in SWEEP[w]]
        for which, mode, override in todo:
            tag = "" if mode in (None, "auto") else f" [{mode}]"
            cfg = " + ".join(f"{k} {v}" for k, v in override.items())
            options = kernel_options.from_dict(dict(
                _ours_options(), **({"bwd_mode": mode} if mode else {}),
                **{f"{w}_config": c for w, c in override.items()}))
            try:
                if which == "fwd":
                    ms = _bench(lambda: tb.forward(q, k, v, bias, mt, 128, 128, scale, 0.0,
                                                   False, options))
                    tf = flops / ms * 1e-9
                else:
                    ms = _bench(lambda: tb.backward(do, None, q, k, v, out, lse, bias,
                                                    mt, 128, 128, scale, 0.0, False,
                                                    has_bias, options))
                    tf = 2.5 * flops / ms * 1e-9
                log(f"sweep {kind} L={L} D={D} {which}{tag} {cfg}: {ms:.3f} ms "
                    f"{tf:.0f} TFLOP/s" + (" (whole backward)" if which != "fwd" else ""))
            except Exception as err:
                log(f"sweep {kind} L={L} D={D} {which}{tag} {cfg}: failed "
                    f"{type(err).__name__}: {str(err)[:200]}")
        q = k = v = do = out = lse = bias = None     # free before the next row
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- per-kernel profile

def profile(cases, log=print, tag="", flex=False):
    """CUDA time per kernel of our forward + backward (torch.profiler), per row; with
    `flex`, FlexAttention's (compiled) kernels for the same row after ours."""
    import flexsparse
    from torch.profiler import ProfilerActivity, profile as tprofile
    dev = torch.device("cuda", torch.cuda.current_device())
    for kind, L, D in cases:
        B = max(1, TOKENS // L)
        fs_mask, mask_mod, per_head, _, has_bias = make_case(kind, B, L, device=dev)
        desc = fs_mask.compile(B, H, H, L, L, device=dev)
        mk = lambda *s: torch.randn(*s, device=dev, dtype=DTYPE, requires_grad=True)  # noqa
        q, k, v = mk(B, H, L, D), mk(B, H, L, D), mk(B, H, L, D)
        bias = mk(B, H, L, L) if has_bias else None
        do = torch.randn(B, H, L, D, device=dev, dtype=DTYPE)
        steps = {"ours": lambda: flexsparse.attention(q, k, v, desc, bias=bias,
                                                      backend="triton",
                                                      kernel_options=_ours_options()
                                                      ).backward(do)}
        if flex:
            from torch.nn.attention.flex_attention import flex_attention
            fa = torch.compile(flex_attention, dynamic=False)
            bm = flex_block_mask(desc, mask_mod, per_head, L, dev)
            score_mod = ((lambda score, b, h, qi, kv: score + bias[b, h, qi, kv]) if has_bias
                         else None)
            steps["flex"] = lambda: fa(q, k, v, score_mod=score_mod,
                                       block_mask=bm).backward(do)
        for name, step in steps.items():
            step()
            torch.cuda.synchronize()
            with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            log(f"profile {name} {kind} L={L} D={D}{tag} (3 fwd+bwd steps)")
            for key in ("self_device_time_total", "self_cuda_time_total"):
                try:
                    log(prof.key_averages().table(sort_by=key, row_limit=10))
                    break
                except Exception:
                    continue
        q = k = v = bias = do = desc = steps = None   # free before the next row
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- main

def parse_rows(spec):
    """Rows written as "kind@L[@D],..." -> [(kind, L, D)], D = 128 where not given (the
    row syntax of cuda_bench, cuda_ab and tests/gpu/profile_cuda_split.py)."""
    rows = []
    for item in spec.split(","):
        kind, L, *rest = item.strip().split("@")
        rows.append((kind, int(L), int(rest[0]) if rest else 128))
    return rows


def select_rows(spec, quick):
    rows = QUICK if quick else ROWS
    if not spec:
        return rows
    out = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, rest = item.partition("@")
        parts = rest.split("@") if rest else []
        L = int(parts[0]) if parts else None
        D = int(parts[1]) if len(parts) > 1 else None
        hits = [r for r in ROWS if r[0] == name and (L is None or r[1] == L)
                and (D is None or r[2] == D)]
        if not hits and L is not None:
            hits = [(name, L, D or 128)]
        if not hits:
            raise SystemExit(f"bench: no row matches {item!r}")
        out.extend(h for h in hits if h not in out)
    return out


def run_indices(args, out_path, log=print):
    try:
        from benchmarks import bench_indices
    except ImportError:
        return None
    if not hasattr(bench_indices, "rows"):
        return None
    import inspect
    kw = {}
    params = inspect.signature(bench_indices.rows).parameters
    if args.quick and "lengths" in params and hasattr(bench_indices, "LENGTHS"):
        kw["lengths"] = tuple(bench_indices.LENGTHS)[:1]
    if "log" in params:
        kw["log"] = log
    rs = bench_indices.rows(**kw)
    table = (bench_indices.format_table(rs) if hasattr(bench_indices, "format_table")
             else "\n".join(str(r) for r in rs))
    if out_path:
        path = os.path.join(os.path.dirname(os.path.abspath(out_path)), "bench_indices.md")
        with open(path, "w") as f:
            f.write(table + "\n")
    return table


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="also write the markdown table here")
    ap.add_argument("--quick", action="store_true", help=f"only {len(QUICK)} rows at L <= 8K")
    ap.add_argument("--rows", default="",
                    help="comma list of kind[@L[@D]], kinds: " + ", ".join(LABELS))
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    ap.add_argument("--no-sdpa", action="store_true", help="skip SDPA")
    ap.add_argument("--no-indices", action="store_true", help="skip the index-attention rows")
    ap.add_argument("--profile", action="store_true",
                    help="print per-kernel CUDA times of our fwd+bwd (and FlexAttention's, unless "
                         "--no-flex) for the selected rows, then exit")
    ap.add_argument("--sweep", action="store_true",
                    help="first time candidate tile configs of our kernels on the selected rows")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="run each row N times and report the median of the per-run medians "
                         "(default 1)")
    ap.add_argument("--bwd", choices=("direct", "subtract"), default="direct",
                    help="backward timing: 'direct' (default) times autograd.grad alone over a "
                         "retained graph; 'subtract' takes (fwd+bwd) - fwd (the old method)")
    ap.add_argument("--sweep-passes", default="fwd,dkdv,dq",
                    help="with --sweep: which passes to sweep (comma list of fwd, dkdv, dq)")
    ap.add_argument("--sweep-configs", default="",
                    help="with --sweep: explicit candidates, e.g. "
                         "'dkdv:64x128x8x3+dq:128x64x8x2,dq:128x64x8x2' (whole backward timed)")
    ap.add_argument("--bwd-mode", choices=BWD_MODES + ("all",), default="auto",
                    help="structure of our backward (kernel option bwd_mode); 'all' times "
                         "each mode in the same run (extra columns)")
    ap.add_argument("--ab-old", metavar="PATH",
                    help="A/B: also time this copy of the block backend in the same runs: a "
                         "directory of ops/triton_block*.py copies, or an old single-file "
                         "ops/triton_block.py "
                         "(implementation 'old'); prints new/old per row")
    ap.add_argument("--no-dq-from-ds", action="store_true",
                    help="full-shape dbias: recompute P in the dQ pass (or atomic dQ) instead "
                         "of reading back the stored dS (kernel option dq_from_ds)")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if not torch.cuda.is_available():
        print("benchmarks.bench: needs a CUDA GPU (none found); nothing to do.")
        return 0
    import torch._dynamo as dynamo
    dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 64)
    rows = select_rows(args.rows, args.quick)
    log = lambda s: print(s, flush=True)  # noqa: E731
    # "ours" runs in bwd_mode; with "all", the other modes are extra implementations
    modes = BWD_MODES if args.bwd_mode == "all" else (args.bwd_mode,)
    bwd_mode, extra_modes = modes[0], modes[1:]
    OURS_OPTIONS.update(bwd_mode=bwd_mode, dq_from_ds=not args.no_dq_from_ds)
    old_block = None
    if args.ab_old:
        # the copy gets the same kernel options through the backend
        old_block = load_block_module(args.ab_old)
    if args.profile:
        for mode in modes:
            with _bwd_mode(mode):
                profile(rows, log=log, tag="" if mode == "auto" else f" [{mode}]",
                        flex=not args.no_flex)
        return 0
    if args.sweep:
        sweep(rows, log=log, modes=modes, passes=tuple(args.sweep_passes.split(",")),
              combos=parse_combos(args.sweep_configs))
    results = []
    print(method_line(args.bwd, args.repeat, bwd_mode), flush=True)
    print(header(extra_modes), flush=True)
    t0 = time.time()
    for kind, L, D in rows:
        r = time_row(kind, L, D, flex=not args.no_flex, sdpa=not args.no_sdpa,
                     repeat=args.repeat, bwd=args.bwd, extra_modes=extra_modes, log=log,
                     old_block=old_block)
        results.append(r)
        log(format_row(r, extra_modes) + f"  [{time.time() - t0:.0f}s, "
            f"{r['fact_syncs']} descriptor-fact syncs]")
        if "ab_fwd" in r:
            log(f"  A/B {r['kind']} {r['L']} D={r['D']}: old fwd {_f(r.get('old_fwd'))} bwd "
                f"{_f(r.get('old_bwd'))} TFLOP/s; new/old fwd {r['ab_fwd']:.3f} bwd "
                f"{r['ab_bwd']:.3f}")
        if args.repeat > 1:
            log("  fwd ms per run: " + "; ".join(
                f"{name} " + " ".join(f"{ms:.3f}" for ms in r[f"{name}_fwd_runs"])
                for name in ("ours", "old", "flex", "sdpa") if f"{name}_fwd_runs" in r))
            log("  bwd ms per run: " + "; ".join(
                f"{name} " + " ".join(f"{ms:.3f}" for ms in r[f"{name}_bwd_runs"])
                for name in ("ours", *map(_ours, extra_modes), "old", "flex", "sdpa")
                if f"{name}_bwd_runs" in r))
    table = format_table(results, bwd=args.bwd, repeat=args.repeat, bwd_mode=bwd_mode,
                         extra_modes=extra_modes)
    print()
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    if not args.no_indices and not args.rows:
        idx_table = run_indices(args, args.out, log=log)
        if idx_table:
            print()
            print(idx_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
