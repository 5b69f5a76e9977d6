"""Index-attention benchmark: the Triton index kernels vs a plain-PyTorch gather baseline.

    python -m benchmarks.bench_indices [--out PATH] [--sweep] [--quick] [--patterns random,local]

Rows: B=1, Hq=16, Hkv=4, D=Dv=128, bfloat16, uniform random key indices (sorted per row,
no -1), W in (64, 256, 1024), L = Lq = Lk in (8K, 32K). Times are medians of
triton.testing.do_bench, forward and forward+backward, through torch.ops.flexsparse.*
(the op the public API calls). Effective TFLOP/s counts 4*D flops per visible (query head,
key) entry forward and 2.5x that backward. K/V bandwidth = bytes of gathered K/V rows,
Lq*Hkv*W*(D+Dv)*2, divided by the forward time (the H100's measured copy ceiling is about
3.0 TB/s; gathers that hit in L2 can exceed it). "gather ceiling" (random rows, unless
--no-ceiling) is benchmarks/gather_probe.py's `ceiling(D*2, L*(D+Dv)*2)`, measured in the
same process: the best rate of its Triton gather-and-sum kernel on uniform random rows of
one kv head's K and V (the kernel's grid runs a kv head's query rows together, so that
is the set its gathers hit at a time), bytes counted the same way (gathered rows x row
bytes); the percentage is the forward's K/V TB/s over it (issue 17 asks >= 85%).
"CUDA fwd ms" is the same forward on backend "cuda" (csrc/index_fwd.cu), where the
extension is built, with its share of the gather ceiling; n/a elsewhere.

Local rows (`--patterns local`, after the random rows and their compiled baselines, each
started only while `--budget-s` lasts): the issue's overlapping patterns, keys
q-W+1..q (W = 64, 256, 1024) and a dilated window q-4(W-1)..q step 4 (W = 256), one list
shared by all heads (-1 before key 0), L in (8K, 32K). Timed three ways: the gather kernel,
the block path (masks.indices(layout="blocks"): the lists as a block descriptor with
per-block bitmaps, flexsparse/index_blocks.py; built outside the timed region, the
build's median wall time reported separately) and the eager/compiled gather baseline.
Their effective TFLOP/s count only the listed entries (4*D flops each forward, 3.5x that
forward+backward), not the block cells the block kernels compute; "density" is listed
entries per computed block cell (estimate_density's sample / exact), "auto" what
layout="auto" would pick, "max abs d" the largest difference between the block and gather
kernel outputs.

Baseline ("gather"): per chunk of query rows, index_select K/V rows, einsum, masked fp32
softmax, einsum; the best of eager and torch.compile'd, in the same run. Chunks keep the
gathered K/V under ~2 GB; with more than one chunk the backward uses activation
checkpointing per chunk (without it the gathered K/V of all chunks would not fit).

Measured on one H100 80GB HBM3 (torch 2.11, Triton 3.6), this file at commit bc8a046:
forward 0.25 / 0.66 / 2.36 ms at L=8K and 0.97 / 2.63 / 9.39 ms at L=32K for W=64/256/1024,
i.e. 4.3-7.3 TB/s of gathered K/V (one kv head's K/V stays in L2, so this exceeds the HBM
copy ceiling); 7.5-12x faster than the compiled gather baseline (13-21x than eager).
Forward+backward 6.3-9.4x vs compiled gather; the backward is bound by the fp32 atomics
into dK/dV (~2.8 TB/s of atomic payload).
"""
import argparse
import math
import sys
import time

import torch

B, HQ, HKV, D = 1, 16, 4, 128
LENGTHS = (8192, 32768)
WIDTHS = (64, 256, 1024)
HBM_CEILING_TBS = 3.0
GATHER_CHUNK_BYTES = 2 << 30
# (label, W, stride) of the local rows; descriptor block size of the block path
LOCAL_PATTERNS = (("local", 64, 1), ("local", 256, 1), ("local", 1024, 1), ("dilated", 256, 4))
BLOCK = (128, 128)
PATTERNS = ("random", "local")


def _ops():
    import flexsparse  # noqa: F401  (registers torch.ops.flexsparse)
    from flexsparse.ops import MaskTensors
    from flexsparse.ops import triton_indices as ti
    return MaskTensors, ti


def make_inputs(L, W, device="cuda", dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn((B, HQ, L, D), device=device, dtype=dtype, generator=g)
    k = torch.randn((B, HKV, L, D), device=device, dtype=dtype, generator=g)
    v = torch.randn((B, HKV, L, D), device=device, dtype=dtype, generator=g)
    idx = torch.randint(0, L, (B, HKV, L, W), device=device, dtype=torch.int32, generator=g)
    idx = idx.sort(dim=-1).values.contiguous()
    return q, k, v, idx


def make_local_inputs(L, W, stride=1, device="cuda", dtype=torch.bfloat16, seed=0):
    """q, k, v as make_inputs; idx (1, 1, L, W): keys q - stride*(W-1-t), ascending, ending
    at the query itself; -1 where that is before key 0."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn((B, HQ, L, D), device=device, dtype=dtype, generator=g)
    k = torch.randn((B, HKV, L, D), device=device, dtype=dtype, generator=g)
    v = torch.randn((B, HKV, L, D), device=device, dtype=dtype, generator=g)
    i = torch.arange(L, device=device)[:, None]
    keys = i - stride * (W - 1 - torch.arange(W, device=device)[None, :])
    idx = torch.where(keys >= 0, keys, -1).to(torch.int32)[None, None].contiguous()
    return q, k, v, idx


# ------------------------------------------------------------------ the kernels via the op

def flex_fwd_fn(q, k, v, idx, scale, backend="triton"):
    MaskTensors, _ = _ops()
    mt = MaskTensors(attn_indices=idx)

    def fn():
        return torch.ops.flexsparse.attention(q, k, v, None, *mt, 128, 128, scale, 0.0,
                                              backend, False)[0]
    return fn


def cuda_available() -> bool:
    """Whether backend "cuda" (the csrc/ extension) is built here."""
    from flexsparse.ops import backends
    return "cuda" in backends.available()


def flex_fwd_bwd_fn(q, k, v, idx, scale, deterministic=False):
    MaskTensors, _ = _ops()
    mt = MaskTensors(attn_indices=idx)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)

    def fn():
        out = torch.ops.flexsparse.attention(qg, kg, vg, None, *mt, 128, 128, scale, 0.0,
                                             "triton", deterministic)[0]
        out.backward(do)
    return fn, (qg, kg, vg)


def block_fwd_fn(q, k, v, desc, scale):
    mt = desc.mask_tensors()
    bq, bk = desc.block_size

    def fn():
        return torch.ops.flexsparse.attention(q, k, v, None, *mt, bq, bk, scale, 0.0,
                                              "triton", False)[0]
    return fn


def block_fwd_bwd_fn(q, k, v, desc, scale):
    mt = desc.mask_tensors()
    bq, bk = desc.block_size
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)

    def fn():
        out = torch.ops.flexsparse.attention(qg, kg, vg, None, *mt, bq, bk, scale, 0.0,
                                             "triton", False)[0]
        out.backward(do)
    return fn, (qg, kg, vg)


def build_descriptor(idx, L, repeats=4):
    """(descriptor, median build ms of the runs after the first) for the block path."""
    from flexsparse import index_blocks as ib
    times = []
    desc = None
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        desc = ib.indices_to_blocks(idx, L, L, BLOCK, num_heads=(HQ, HKV))
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    rest = sorted(times[1:] or times)
    return desc, rest[len(rest) // 2]


# ------------------------------------------------------------------ gather baseline

def _gather_chunk(q5, kf, vf, ix, base, scale):
    """q5 (B, Hkv, G, R, D); kf/vf (B*Hkv*Lk, D); ix (B, Hkv, R, W); base (B, Hkv, 1, 1)."""
    Bq, Hkv, G, R, Dq = q5.shape
    W = ix.shape[-1]
    valid = ix >= 0
    flat = (ix.clamp_min(0).to(torch.int64) + base).reshape(-1)
    ks = kf.index_select(0, flat).view(Bq, Hkv, R, W, kf.shape[-1])
    vs = vf.index_select(0, flat).view(Bq, Hkv, R, W, vf.shape[-1])
    s = torch.einsum("bhgrd,bhrwd->bhgrw", q5, ks).float() * scale
    s = s.masked_fill(~valid[:, :, None], -math.inf)
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bhgrw,bhrwd->bhgrd", p.to(q5.dtype), vs)


_COMPILED = {}


def gather_attention(q, k, v, idx, scale, compiled=False, checkpoint=None):
    Bq, Hq, Lq, Dq = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = Hq // Hkv
    W = idx.shape[-1]
    fn = _gather_chunk
    if compiled:
        if "fn" not in _COMPILED:
            _COMPILED["fn"] = torch.compile(_gather_chunk, dynamic=True)
        fn = _COMPILED["fn"]
    per_row = Bq * Hkv * W * (Dq + Dv) * q.element_size()
    chunk = max(1, min(Lq, GATHER_CHUNK_BYTES // max(1, per_row)))
    chunk = 1 << (chunk.bit_length() - 1)
    n_chunks = -(-Lq // chunk)
    if checkpoint is None:
        checkpoint = n_chunks > 1 and torch.is_grad_enabled() and q.requires_grad
    kf = k.reshape(Bq * Hkv * Lk, Dq)
    vf = v.reshape(Bq * Hkv * Lk, Dv)
    base = (torch.arange(Bq * Hkv, device=q.device) * Lk).view(Bq, Hkv, 1, 1)
    q5 = q.unflatten(1, (Hkv, G))
    outs = []
    for r0 in range(0, Lq, chunk):
        r1 = min(Lq, r0 + chunk)
        args = (q5[:, :, :, r0:r1], kf, vf, idx[:, :, r0:r1], base, scale)
        if checkpoint:
            o = torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
        else:
            o = fn(*args)
        outs.append(o)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)
    return out.flatten(1, 2)


# ------------------------------------------------------------------ timing

def _bench(fn, grad_to_none=None):
    import triton
    return triton.testing.do_bench(fn, warmup=10, rep=50, grad_to_none=grad_to_none,
                                   return_mode="median")


def _time_gather(q, k, v, idx, scale, compiled):
    """(fwd ms, fwd+bwd ms) of the gather baseline, eager or torch.compile'd; NaN on failure."""
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)
    name = "compiled" if compiled else "eager"
    try:
        with torch.no_grad():
            fwd = _bench(lambda: gather_attention(q, k, v, idx, scale, compiled))

        def fb():
            gather_attention(qg, kg, vg, idx, scale, compiled).backward(do)
        return fwd, _bench(fb, grad_to_none=[qg, kg, vg])
    except Exception as err:  # OOM or compile failure: reported as n/a
        print(f"# gather baseline {name} failed: {type(err).__name__}: {err}"[:300], file=sys.stderr)
        torch.cuda.empty_cache()
        return math.nan, math.nan


def _finish(row):
    """Best baseline (eager or compiled, per column) and the speedups against it."""
    for col in ("fwd", "fwd_bwd"):
        cands = [(row.get(f"gather_{kind}_{col}_ms", math.nan), kind) for kind in ("eager", "compiled")]
        cands = [c for c in cands if not math.isnan(c[0])]
        if cands:
            best, kind = min(cands)
            row[f"gather_{col}_ms"] = best
            row[f"gather_{col}_kind"] = kind
            row[f"{col}_speedup"] = best / row[f"{col}_ms"]
    return row


def gather_ceiling_tbs(L):
    """TB/s of benchmarks/gather_probe.py's ceiling for one kv head's K/V at length L."""
    from benchmarks.gather_probe import ceiling
    esize = torch.tensor([], dtype=torch.bfloat16).element_size()
    return ceiling(D * esize, L * (D + D) * esize) / 1e3


def rows(lengths=LENGTHS, widths=WIDTHS, compile_baseline=True, baseline=True,
         budget_s=None, log=print, on_update=None, gather_ceiling=True):
    """One dict per (L, W): timings, TFLOP/s, K/V bandwidth, speedups.

    Pass 1 times the kernels and the eager baseline for every row; pass 2 adds the
    torch.compile'd baseline row by row while `budget_s` (seconds since the start) lasts.
    """
    t_start = time.time()
    out = []
    for L in lengths:
        for W in widths:
            torch.cuda.empty_cache()
            q, k, v, idx = make_inputs(L, W)
            scale = 1.0 / math.sqrt(D)
            visible = int((idx >= 0).sum().item()) * (HQ // HKV)
            flops_fwd = 4.0 * D * visible
            kv_bytes = L * HKV * W * (D + D) * q.element_size()
            fwd = _bench(flex_fwd_fn(q, k, v, idx, scale))
            fb_fn, grads = flex_fwd_bwd_fn(q, k, v, idx, scale)
            fb = _bench(fb_fn, grad_to_none=list(grads))
            del grads, fb_fn
            ceil = gather_ceiling_tbs(L) if gather_ceiling else math.nan
            cuda_fwd = _bench(flex_fwd_fn(q, k, v, idx, scale, "cuda")) if cuda_available() else math.nan
            row = dict(L=L, W=W, fwd_ms=fwd, fwd_tflops=flops_fwd / fwd * 1e-9,
                       kv_tbs=kv_bytes / fwd * 1e-9,
                       kv_frac=kv_bytes / fwd * 1e-9 / HBM_CEILING_TBS,
                       fwd_bwd_ms=fb, fwd_bwd_tflops=3.5 * flops_fwd / fb * 1e-9,
                       ceil_tbs=ceil, ceil_frac=kv_bytes / fwd * 1e-9 / ceil,
                       cuda_fwd_ms=cuda_fwd, cuda_ceil_frac=kv_bytes / cuda_fwd * 1e-9 / ceil)
            if baseline:
                row["gather_eager_fwd_ms"], row["gather_eager_fwd_bwd_ms"] = \
                    _time_gather(q, k, v, idx, scale, compiled=False)
            out.append(_finish(row))
            log(_format_row(row))
            if on_update:
                on_update(out)
            del q, k, v, idx
    if baseline and compile_baseline:
        import warnings
        warnings.filterwarnings("ignore", message=".*[Oo]nline softmax.*")
        for row in out:
            if budget_s is not None and time.time() - t_start > budget_s:
                log(f"# budget of {budget_s:.0f}s spent: no compiled baseline for L={row['L']} W={row['W']}")
                continue
            torch.cuda.empty_cache()
            q, k, v, idx = make_inputs(row["L"], row["W"])
            row["gather_compiled_fwd_ms"], row["gather_compiled_fwd_bwd_ms"] = \
                _time_gather(q, k, v, idx, 1.0 / math.sqrt(D), compiled=True)
            _finish(row)
            log(_format_row(row))
            if on_update:
                on_update(out)
            del q, k, v, idx
    return out


def _f(x, fmt):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


HEADER = ("| L | W | fwd ms | fwd TFLOP/s | K/V TB/s (% of 3.0) | gather ceiling TB/s (% reached) "
          "| CUDA fwd ms (% of gather ceiling) | gather fwd ms eager / compiled "
          "| fwd speedup | fwd+bwd ms | fwd+bwd TFLOP/s | gather fwd+bwd ms eager / compiled "
          "| fwd+bwd speedup |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _format_row(r):
    g = lambda key: _f(r.get(key), ".2f")
    return (f"| {r['L'] // 1024}K | {r['W']} | {_f(r['fwd_ms'], '.3f')} | {_f(r['fwd_tflops'], '.1f')} "
            f"| {_f(r['kv_tbs'], '.2f')} ({_f(100 * r['kv_frac'], '.0f')}%) "
            f"| {_f(r.get('ceil_tbs'), '.2f')} ({_f(100 * r.get('ceil_frac', math.nan), '.0f')}%) "
            f"| {_f(r.get('cuda_fwd_ms'), '.3f')} ({_f(100 * r.get('cuda_ceil_frac', math.nan), '.0f')}%) "
            f"| {g('gather_eager_fwd_ms')} / {g('gather_compiled_fwd_ms')} "
            f"| {_f(r.get('fwd_speedup'), '.1f')}x "
            f"| {_f(r['fwd_bwd_ms'], '.3f')} | {_f(r['fwd_bwd_tflops'], '.1f')} "
            f"| {g('gather_eager_fwd_bwd_ms')} / {g('gather_compiled_fwd_bwd_ms')} "
            f"| {_f(r.get('fwd_bwd_speedup'), '.1f')}x |")


def format_table(rs):
    title = (f"Index attention, B={B} Hq={HQ} Hkv={HKV} D=Dv={D} bf16, random sorted indices "
             f"({torch.cuda.get_device_name()}); speedup vs the faster gather baseline")
    return "\n".join([title, "", HEADER] + [_format_row(r) for r in rs])


# ------------------------------------------------------------------ local / dilated rows

def _finish_local(row):
    """Best baseline per column, and the block path's speedups over it and the gather kernel."""
    for col in ("fwd", "fwd_bwd"):
        cands = [(row.get(f"gather_{kind}_{col}_ms", math.nan), kind) for kind in ("eager", "compiled")]
        cands = [c for c in cands if not math.isnan(c[0])]
        if cands:
            row[f"gather_{col}_ms"], row[f"gather_{col}_kind"] = min(cands)
            row[f"blocks_{col}_vs_baseline"] = row[f"gather_{col}_ms"] / row[f"blocks_{col}_ms"]
        row[f"blocks_{col}_vs_kernel"] = row[f"kernel_{col}_ms"] / row[f"blocks_{col}_ms"]
    return row


def local_rows(lengths=LENGTHS, patterns=LOCAL_PATTERNS, compile_baseline=True, baseline=True,
               budget_s=None, log=print, on_update=None):
    """One dict per (L, pattern): gather kernel, block path (build timed apart) and the
    gather baseline. A row starts only while `budget_s` (seconds since this call) lasts;
    pass 2 adds the compiled baseline under the same budget."""
    from flexsparse import index_blocks as ib
    t_start = time.time()
    out = []
    scale = 1.0 / math.sqrt(D)
    for L in lengths:
        for label, W, stride in patterns:
            if budget_s is not None and time.time() - t_start > budget_s:
                log(f"# budget of {budget_s:.0f}s spent: no row for {label} L={L} W={W}")
                continue
            torch.cuda.empty_cache()
            q, k, v, idx = make_local_inputs(L, W, stride)
            listed = int((idx >= 0).sum().item())        # per index head (shared by all heads)
            flops_fwd = 4.0 * D * listed * HQ
            desc, build_ms = build_descriptor(idx, L)
            visited = int((desc.kv_count.sum() + desc.kv_full_count.sum()).item())
            n_partial = int(desc.kv_count.sum().item())
            row = dict(pattern=label if stride == 1 else f"{label} x{stride}", L=L, W=W,
                       stride=stride, build_ms=build_ms,
                       density_est=ib.estimate_density(idx, L, L, BLOCK),
                       density=listed / max(1, visited * BLOCK[0] * BLOCK[1]),
                       partial_frac=n_partial / max(1, visited),
                       auto="blocks" if ib.prefer_blocks(idx, L, L, BLOCK) else "gather")
            kfwd = flex_fwd_fn(q, k, v, idx, scale)
            bfwd = block_fwd_fn(q, k, v, desc, scale)
            row["max_abs_diff"] = (kfwd().float() - bfwd().float()).abs().max().item()
            for name, fwd_fn, fb in (("kernel", kfwd, flex_fwd_bwd_fn(q, k, v, idx, scale)),
                                     ("blocks", bfwd, block_fwd_bwd_fn(q, k, v, desc, scale))):
                row[f"{name}_fwd_ms"] = _bench(fwd_fn)
                row[f"{name}_fwd_bwd_ms"] = _bench(fb[0], grad_to_none=list(fb[1]))
                row[f"{name}_fwd_tflops"] = flops_fwd / row[f"{name}_fwd_ms"] * 1e-9
                row[f"{name}_fwd_bwd_tflops"] = 3.5 * flops_fwd / row[f"{name}_fwd_bwd_ms"] * 1e-9
                del fb
            if baseline:
                row["gather_eager_fwd_ms"], row["gather_eager_fwd_bwd_ms"] = \
                    _time_gather(q, k, v, idx, scale, compiled=False)
            out.append(_finish_local(row))
            log(_format_local_row(row))
            if on_update:
                on_update(out)
            del q, k, v, idx, desc, kfwd, bfwd
    if baseline and compile_baseline:
        import warnings
        warnings.filterwarnings("ignore", message=".*[Oo]nline softmax.*")
        for row in out:
            if budget_s is not None and time.time() - t_start > budget_s:
                log(f"# budget of {budget_s:.0f}s spent: no compiled baseline for "
                    f"{row['pattern']} L={row['L']} W={row['W']}")
                continue
            torch.cuda.empty_cache()
            q, k, v, idx = make_local_inputs(row["L"], row["W"], row["stride"])
            row["gather_compiled_fwd_ms"], row["gather_compiled_fwd_bwd_ms"] = \
                _time_gather(q, k, v, idx, scale, compiled=True)
            _finish_local(row)
            log(_format_local_row(row))
            if on_update:
                on_update(out)
            del q, k, v, idx
    return out


LOCAL_HEADER = (
    "| pattern | L | W | density est / exact (partial blocks) | auto | build ms "
    "| fwd ms gather kernel / blocks | fwd TFLOP/s kernel / blocks | gather baseline fwd ms eager / compiled "
    "| blocks fwd speedup vs kernel / baseline "
    "| fwd+bwd ms kernel / blocks | fwd+bwd TFLOP/s kernel / blocks "
    "| baseline fwd+bwd ms eager / compiled | blocks fwd+bwd speedup vs kernel / baseline | max abs d |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _format_local_row(r):
    g = lambda key, fmt=".2f": _f(r.get(key), fmt)
    return (f"| {r['pattern']} | {r['L'] // 1024}K | {r['W']} "
            f"| {g('density_est', '.3f')} / {g('density', '.3f')} ({100 * r['partial_frac']:.0f}%) "
            f"| {r['auto']} | {g('build_ms')} "
            f"| {g('kernel_fwd_ms', '.3f')} / {g('blocks_fwd_ms', '.3f')} "
            f"| {g('kernel_fwd_tflops', '.1f')} / {g('blocks_fwd_tflops', '.1f')} "
            f"| {g('gather_eager_fwd_ms')} / {g('gather_compiled_fwd_ms')} "
            f"| {g('blocks_fwd_vs_kernel', '.1f')}x / {g('blocks_fwd_vs_baseline', '.1f')}x "
            f"| {g('kernel_fwd_bwd_ms', '.3f')} / {g('blocks_fwd_bwd_ms', '.3f')} "
            f"| {g('kernel_fwd_bwd_tflops', '.1f')} / {g('blocks_fwd_bwd_tflops', '.1f')} "
            f"| {g('gather_eager_fwd_bwd_ms')} / {g('gather_compiled_fwd_bwd_ms')} "
            f"| {g('blocks_fwd_bwd_vs_kernel', '.1f')}x / {g('blocks_fwd_bwd_vs_baseline', '.1f')}x "
            f"| {g('max_abs_diff', '.1e')} |")


def format_local_table(rs):
    title = (f"Index attention on overlapping lists, B={B} Hq={HQ} Hkv={HKV} D=Dv={D} bf16, one list "
             f"shared by all heads ({torch.cuda.get_device_name()}); gather kernel vs block path "
             f"(block {BLOCK[0]}x{BLOCK[1]}, descriptor built outside the timing) vs gather baseline; "
             f"TFLOP/s on listed entries only")
    return "\n".join([title, "", LOCAL_HEADER] + [_format_local_row(r) for r in rs])


# ------------------------------------------------------------------ config sweep

# (BLOCK_W, num_warps, num_stages): kernel options index_fwd_config / index_bwd_config
FWD_CANDIDATES = [(32, 4, 2), (64, 4, 1), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2),
                  (128, 8, 2), (128, 8, 3)]
BWD_CANDIDATES = [(16, 4, 1), (32, 4, 1), (32, 4, 2), (32, 8, 2), (64, 4, 1), (64, 8, 1),
                  (64, 8, 2)]


def sweep(L=8192, widths=WIDTHS, log=print):
    """Time forward and backward alone for the candidate configs (kernel options per call)."""
    MaskTensors, ti = _ops()
    from flexsparse.ops.kernel_options import KernelOptions
    for W in widths:
        q, k, v, idx = make_inputs(L, W)
        mt = MaskTensors(attn_indices=idx)
        scale = 1.0 / math.sqrt(D)
        out, lse = ti.forward(q, k, v, None, mt, scale, 0.0)
        do = torch.randn_like(out)
        for cfg in FWD_CANDIDATES:
            opts = KernelOptions(index_fwd_config=cfg)
            try:
                ms = _bench(lambda: ti.forward(q, k, v, None, mt, scale, 0.0, opts))
                log(f"sweep fwd L={L} W={W} (BLOCK_W, warps, stages)={cfg}: {ms:.3f} ms")
            except Exception as err:
                log(f"sweep fwd L={L} W={W} {cfg}: failed {type(err).__name__}: {str(err)[:200]}")
        for cfg in BWD_CANDIDATES:
            opts = KernelOptions(index_bwd_config=cfg)
            try:
                ms = _bench(lambda: ti.backward(do, None, q, k, v, out, lse, None, mt, scale, 0.0,
                                                False, False, opts))
                log(f"sweep bwd L={L} W={W} (BLOCK_W, warps, stages)={cfg}: {ms:.3f} ms")
            except Exception as err:
                log(f"sweep bwd L={L} W={W} {cfg}: failed {type(err).__name__}: {str(err)[:200]}")
        try:
            ms = _bench(lambda: ti.backward(do, None, q, k, v, out, lse, None, mt, scale, 0.0,
                                            True, False))
            log(f"sweep bwd deterministic (default config) L={L} W={W}: {ms:.3f} ms")
        except Exception as err:
            log(f"sweep bwd deterministic L={L} W={W}: failed {type(err).__name__}: {str(err)[:200]}")
        del q, k, v, idx, out, lse, do
        torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the markdown table here")
    ap.add_argument("--sweep", action="store_true", help="first time candidate kernel configs")
    ap.add_argument("--sweep-only", action="store_true", help="only time candidate configs")
    ap.add_argument("--quick", action="store_true", help="L=8K only")
    ap.add_argument("--no-compile", action="store_true", help="eager gather baseline only")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--no-ceiling", action="store_true",
                    help="no gather-probe ceiling column (benchmarks/gather_probe.py)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="no compiled baseline for rows reached after this many seconds, and "
                         "no local rows started after it")
    ap.add_argument("--patterns", default=",".join(PATTERNS),
                    help="comma list of row kinds: random (uniform random lists), local "
                         "(local and dilated windows: gather kernel vs block path)")
    args = ap.parse_args(argv)
    patterns = [p.strip() for p in args.patterns.split(",") if p.strip()]
    bad = [p for p in patterns if p not in PATTERNS]
    if bad:
        ap.error(f"--patterns: unknown {bad}; choose from {PATTERNS}")
    if not torch.cuda.is_available():
        print("bench_indices: needs a CUDA device", file=sys.stderr)
        return 1
    if args.sweep or args.sweep_only:
        sweep(log=lambda s: print(s, flush=True))
        if args.sweep_only:
            return 0
    t0 = time.time()
    lengths = LENGTHS[:1] if args.quick else LENGTHS
    log = lambda s: print(s, flush=True)
    tables = {}

    def write(key, text):
        tables[key] = text
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n\n".join(tables[k] for k in PATTERNS if k in tables) + "\n")

    if "random" in patterns:
        print(HEADER, flush=True)
        rs = rows(lengths=lengths, compile_baseline=not args.no_compile,
                  baseline=not args.no_baseline, budget_s=args.budget_s, log=log,
                  on_update=lambda r: write("random", format_table(r)),
                  gather_ceiling=not args.no_ceiling)
        print()
        print(format_table(rs))
        write("random", format_table(rs))
    if "local" in patterns:
        left = None if args.budget_s is None else args.budget_s - (time.time() - t0)
        print(LOCAL_HEADER, flush=True)
        ls = local_rows(lengths=lengths, compile_baseline=not args.no_compile,
                        baseline=not args.no_baseline, budget_s=left, log=log,
                        on_update=lambda r: write("local", format_local_table(r)))
        print()
        print(format_local_table(ls))
        write("local", format_local_table(ls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
