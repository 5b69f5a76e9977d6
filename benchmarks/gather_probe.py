"""Random-row gather bandwidth on the GPU: the ceiling index attention is measured against
(issue 17: "the forward reaches >= 85% of that ceiling at W = 16-256").

    python -m benchmarks.gather_probe [--quick] [--budget-s 60] [--out PATH]

A Triton kernel (`_gather_sum_kernel`, plain `kernel[grid]` launch) reads rows of a table
(R, D) by an int32 index list and sums them in fp32 registers; each program writes one
(D,) fp32 partial sum, so nothing is optimized away and almost nothing is written. Bytes
moved = gathered rows x row bytes (the index list's 4 bytes per row and the tiny output
are not counted), the same count as the index benchmarks' "gathered K/V" (every listed
K and V row once per kv head list entry).

Rows of the table: row bytes 128 and 256 (bf16 rows of head dim 64 and 128) x working
set (the table's size, 8 MB = L2-resident on an H100 with its 50 MB L2, up to 512 MB,
10x L2) x index pattern:
  uniform  N = max(R, 2M) rows drawn uniformly from the R table rows;
  local    lists of W=64 sorted keys, each drawn from a window of 4W rows around a
           centre that advances 16 rows per list, sweeping the whole table (each row is
           gathered about 4 times, by neighbouring lists: reuse like top-k / local lists).
Kernel variants: BLOCK_R rows per load (rows in flight per program, with num_stages
software-pipelined loads and the programs resident per SM) x num_warps x num_stages
(compile-time) x rows per program (runtime). The full run first sweeps every variant on
the uniform pattern at the smallest and the largest working set of each row size, then
times the best few on every row and reports the best one (the ceiling is the best
achievable). Baselines in the same process, CUDA-free torch: `index_select` into a
buffer (writes what it reads) and `F.embedding_bag(mode="sum")` over bags of 64 (reads
and reduces, like the kernel). Times: `triton.testing.do_bench` medians (L2 flushed
before each call, as in the other benchmarks).

`ceiling(row_bytes, working_set_bytes)` -> GB/s of the best quick variant on the uniform
pattern for that size (measured in the calling process, cached): what
benchmarks/cuda_index_bench.py and benchmarks/bench_indices.py divide by.
"""
import argparse
import functools
import math
import sys
import time

import torch
import triton
import triton.language as tl

from flexsparse.ops import triton_compat  # noqa: F401  (the interpreter patch for the CPU tests)

ROW_BYTES = (128, 256)
WORKING_SETS_MB = (8, 16, 32, 64, 128, 256, 512)
QUICK_WORKING_SETS_MB = (8, 32, 128, 512)
PATTERNS = ("uniform", "local")
MIN_ROWS = 1 << 21          # gathered rows per call at least (uniform)
LOCAL_W, LOCAL_WINDOW, LOCAL_STEP = 64, 256, 16
ROW_ALIGN = 8192            # N is a multiple of this (the largest rows per program): no masks
BAG = 64                    # embedding_bag baseline: rows per bag

# (BLOCK_R, num_warps, num_stages); rows per program are a runtime argument
CONFIGS = [(32, 4, 3), (32, 2, 4), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3),
           (128, 8, 2), (128, 8, 3)]
QUICK_CONFIGS = [(32, 4, 4), (64, 4, 2), (64, 4, 3), (128, 8, 2)]
ROWS_PER_PROG = (512, 2048, 8192)
QUICK_ROWS_PER_PROG = (1024, 4096)
KEEP = 4                    # variants kept from the full run's pre-sweep


@triton.jit
def _gather_sum_kernel(table, idx, out, n_rows, rows_per_prog, D: tl.constexpr,
                       BLOCK_R: tl.constexpr, EVEN: tl.constexpr):
    """Program p sums rows table[idx[r]] for r in [p*rows_per_prog, (p+1)*rows_per_prog)
    and r < n_rows (rows_per_prog a multiple of BLOCK_R) into out[p, :] (fp32). EVEN:
    n_rows is a multiple of rows_per_prog (no masks)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, D)
    acc = tl.zeros((BLOCK_R, D), dtype=tl.float32)
    start = pid * rows_per_prog
    for i in range(0, rows_per_prog, BLOCK_R):
        r = start + i + tl.arange(0, BLOCK_R)
        if EVEN:
            rows = tl.load(idx + r)
            x = tl.load(table + rows.to(tl.int64)[:, None] * D + cols[None, :])
        else:
            ok = r < n_rows
            rows = tl.load(idx + r, mask=ok, other=0)
            x = tl.load(table + rows.to(tl.int64)[:, None] * D + cols[None, :],
                        mask=ok[:, None], other=0.0)
        acc += x.to(tl.float32)
    tl.store(out + pid * D + cols, tl.sum(acc, axis=0))


def _rows_per_prog(block_r, rows_per_prog):
    return max(block_r, rows_per_prog // block_r * block_r)


def _programs(n_rows, block_r, rows_per_prog):
    return max(1, triton.cdiv(n_rows, _rows_per_prog(block_r, rows_per_prog)))


def gather_sum(table, idx, block_r=64, rows_per_prog=2048, num_warps=4, num_stages=3,
               out=None):
    """fp32 (programs, D): program p's sum of table[idx[r]] over its rows_per_prog rows.
    table (R, D) contiguous, D a power of two; idx (N,) int32 in [0, R)."""
    R, D = table.shape
    if not table.is_contiguous() or D & (D - 1):
        raise ValueError(f"table: contiguous (R, D) with D a power of two, got {tuple(table.shape)}")
    if idx.dtype != torch.int32 or idx.dim() != 1:
        raise ValueError("idx: 1-D int32")
    rows_per_prog = _rows_per_prog(block_r, rows_per_prog)
    N = idx.numel()
    grid = _programs(N, block_r, rows_per_prog)
    if out is None:
        out = torch.empty((grid, D), device=table.device, dtype=torch.float32)
    if N == 0:
        return out.zero_()
    even = N % rows_per_prog == 0
    _gather_sum_kernel[(grid,)](table, idx, out, N, rows_per_prog, D=D, BLOCK_R=block_r,
                                EVEN=even, num_warps=num_warps, num_stages=num_stages)
    return out


# ------------------------------------------------------------------ inputs

def make_indices(pattern, R, device="cuda", seed=0):
    """int32 (N,) indices into R rows, N a multiple of ROW_ALIGN (see the module doc)."""
    g = torch.Generator(device=device).manual_seed(seed)
    if pattern == "uniform":
        N = max(R, MIN_ROWS)
        N = -(-N // ROW_ALIGN) * ROW_ALIGN
        return torch.randint(0, R, (N,), device=device, dtype=torch.int32, generator=g)
    if pattern == "local":
        per = ROW_ALIGN // LOCAL_W           # lists per ROW_ALIGN rows
        n_lists = -(-R // LOCAL_STEP // per) * per
        centre = torch.arange(n_lists, device=device, dtype=torch.int64)[:, None] * LOCAL_STEP
        off = torch.randint(0, LOCAL_WINDOW, (n_lists, LOCAL_W), device=device, generator=g)
        keys = (centre - LOCAL_WINDOW // 2 + off) % R
        return keys.sort(-1).values.to(torch.int32).reshape(-1).contiguous()
    raise ValueError(f"pattern: {pattern!r}, choose from {PATTERNS}")


def make_table(row_bytes, working_set_bytes, dtype=torch.bfloat16, device="cuda", seed=0):
    esize = torch.tensor([], dtype=dtype).element_size()
    D = row_bytes // esize
    R = max(1, working_set_bytes // row_bytes)
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn((R, D), device=device, dtype=dtype, generator=g)


# ------------------------------------------------------------------ timing

def _bench(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")


def _gbs(nbytes, ms):
    return nbytes / ms / 1e6


def time_variant(table, idx, cfg, rpp):
    """GB/s of gathered rows for one kernel variant (NaN if it fails)."""
    block_r, warps, stages = cfg
    out = torch.empty((_programs(idx.numel(), block_r, rpp), table.shape[1]),
                      device=table.device, dtype=torch.float32)
    fn = lambda: gather_sum(table, idx, block_r, rpp, warps, stages, out=out)  # noqa: E731
    try:
        fn()
        ms = _bench(fn)
    except Exception as err:  # e.g. out of shared memory for a config: skipped
        print(f"# variant {label(cfg, rpp)} failed: {type(err).__name__}: {str(err)[:200]}",
              file=sys.stderr)
        return math.nan
    return _gbs(idx.numel() * table.shape[1] * table.element_size(), ms)


def label(cfg, rpp):
    block_r, warps, stages = cfg
    return f"R{block_r} w{warps} s{stages} rpp{rpp}"


def sweep(table, idx, variants):
    """[(GB/s, cfg, rpp)] best first."""
    res = [(time_variant(table, idx, cfg, rpp), cfg, rpp) for cfg, rpp in variants]
    res = [r for r in res if not math.isnan(r[0])]
    return sorted(res, key=lambda r: -r[0])


def torch_baselines(table, idx):
    """(index_select GB/s, embedding_bag GB/s) of the same gathered rows."""
    nbytes = idx.numel() * table.shape[1] * table.element_size()
    res = []
    try:
        buf = torch.empty((idx.numel(), table.shape[1]), device=table.device, dtype=table.dtype)
        res.append(_gbs(nbytes, _bench(lambda: torch.index_select(table, 0, idx, out=buf))))
        del buf
    except Exception as err:
        print(f"# index_select failed: {type(err).__name__}: {str(err)[:200]}", file=sys.stderr)
        res.append(math.nan)
    try:
        bags = idx[: idx.numel() // BAG * BAG].view(-1, BAG)
        nb = bags.numel() * table.shape[1] * table.element_size()
        fn = lambda: torch.nn.functional.embedding_bag(bags, table, mode="sum")  # noqa: E731
        fn()
        res.append(_gbs(nb, _bench(fn)))
    except Exception as err:
        print(f"# embedding_bag failed: {type(err).__name__}: {str(err)[:200]}", file=sys.stderr)
        res.append(math.nan)
    torch.cuda.empty_cache()
    return tuple(res)


def _variants(configs, rpps):
    return [(c, r) for c in configs for r in rpps]


@functools.lru_cache(maxsize=None)
def measure(row_bytes, working_set_bytes, pattern="uniform", dtype=torch.bfloat16, device="cuda"):
    """(GB/s, label) of the best quick variant for this row; cached per process."""
    table = make_table(row_bytes, working_set_bytes, dtype, device)
    idx = make_indices(pattern, table.shape[0], device)
    res = sweep(table, idx, _variants(QUICK_CONFIGS, QUICK_ROWS_PER_PROG))
    del table, idx
    torch.cuda.empty_cache()
    if not res:
        return math.nan, "all variants failed"
    gbs, cfg, rpp = res[0]
    return gbs, label(cfg, rpp)


def ceiling(row_bytes, working_set_bytes, pattern="uniform", dtype=torch.bfloat16, device="cuda"):
    """GB/s of gathered rows the best probe variant reaches, for rows of `row_bytes` drawn
    (uniformly by default) from a table of `working_set_bytes`. Measured on the current
    GPU on first use (compiles the quick variants, times each once), then cached."""
    return measure(int(row_bytes), int(working_set_bytes), pattern, dtype, device)[0]


# ------------------------------------------------------------------ the table

HEADER = ("| row bytes | working set MB | pattern | gathered rows | triton GB/s | best config "
          "| torch index_select GB/s | torch embedding_bag GB/s |\n"
          "|---|---|---|---|---|---|---|---|")


def _f(x, fmt=".0f"):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def format_row(r):
    return (f"| {r['row_bytes']} | {r['ws_mb']} | {r['pattern']} | {r['rows']} | {_f(r['gbs'])} "
            f"| {r['config']} | {_f(r['index_select'])} | {_f(r['embedding_bag'])} |")


def run(quick=False, budget_s=60.0, row_bytes=ROW_BYTES, log=print, working_sets_mb=None,
        dtype=torch.bfloat16, device="cuda"):
    """One dict per (row bytes, working set, pattern): the best variant's GB/s and the
    torch baselines'. The full run ranks the variants first (see the module doc)."""
    t0 = time.time()
    configs = QUICK_CONFIGS if quick else CONFIGS
    rpps = QUICK_ROWS_PER_PROG if quick else ROWS_PER_PROG
    sets = working_sets_mb or (QUICK_WORKING_SETS_MB if quick else WORKING_SETS_MB)
    mb_bytes = lambda mb: int(mb * 2**20)  # noqa: E731
    rows = []
    for rb in row_bytes:
        variants = _variants(configs, rpps)
        if budget_s is not None and time.time() - t0 > budget_s:
            log(f"# budget of {budget_s:.0f}s spent: no rows of {rb} B")
            continue
        if not quick:   # pre-sweep: every variant at the smallest and largest working set
            score = {}
            for mb in (sets[0], sets[-1]):
                table = make_table(rb, mb_bytes(mb), dtype, device)
                idx = make_indices("uniform", table.shape[0], device)
                for gbs, cfg, rpp in sweep(table, idx, variants):
                    score.setdefault((cfg, rpp), []).append(gbs)
                    log(f"# pre-sweep {rb} B rows, {mb} MB: {label(cfg, rpp)} {gbs:.0f} GB/s")
                del table, idx
                torch.cuda.empty_cache()
            # mean over the two sizes (a variant that failed at one counts 0 there)
            variants = sorted(score, key=lambda v: -sum(score[v]) / 2)[:KEEP]
        for mb in sets:
            for pattern in PATTERNS:
                if budget_s is not None and time.time() - t0 > budget_s:
                    log(f"# budget of {budget_s:.0f}s spent: no row {rb} B {mb} MB {pattern}")
                    continue
                table = make_table(rb, mb_bytes(mb), dtype, device)
                idx = make_indices(pattern, table.shape[0], device)
                res = sweep(table, idx, variants)
                isel, ebag = torch_baselines(table, idx)
                best = res[0] if res else (math.nan, None, None)
                row = dict(row_bytes=rb, ws_mb=mb, pattern=pattern, rows=idx.numel(),
                           gbs=best[0], config=label(best[1], best[2]) if res else "failed",
                           index_select=isel, embedding_bag=ebag)
                rows.append(row)
                log(format_row(row))
                del table, idx
                torch.cuda.empty_cache()
    return rows


def format_table(rows):
    title = (f"Random-row gather probe ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"Triton {triton.__version__}, bf16 rows); GB/s of gathered rows (1 GB = 1e9 B)")
    return "\n".join([title, "", HEADER] + [format_row(r) for r in rows])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"working sets {QUICK_WORKING_SETS_MB} MB, {len(QUICK_CONFIGS)} configs, no pre-sweep")
    ap.add_argument("--budget-s", type=float, default=60.0,
                    help="start no new row after this many seconds")
    ap.add_argument("--out", help="also write the markdown table here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gather_probe: needs a CUDA device", file=sys.stderr)
        return 1
    log = lambda s: print(s, flush=True)  # noqa: E731
    log(HEADER)
    rows = run(quick=args.quick, budget_s=args.budget_s, log=log)
    table = format_table(rows)
    print()
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
