"""A/B of the CUDA backend against our Triton kernels, FlexAttention (compiled, Triton
path) and SDPA, in one process: forward and backward, effective TFLOP/s (visible entries,
4*D each forward, 2.5x that backward).

    python -m benchmarks.cuda_bench [rows] [--no-bwd] [--rounds N] [--per-round]
                                    [--timer do_bench|back_to_back|call_by_call]   rows: kind@L[@D],...
    python -m benchmarks.cuda_bench --merge FILE...   (the tables of several runs as one)

(default rows: a quick set). --rounds N: the backends take turns N times per row and each
column is the median of its N do_bench medians, so that the machine's drift over a row
(same-build passes differ by up to 10% on one H200, docs/perf-notes.md C67) falls on every
column alike and the ratios hold better than the absolute numbers.

Kinds as in benchmarks.bench.make_case; "sliding<W>" is a sliding window of W tokens (the
default rows include W = 64, 256 and 4096 besides 1024: issue 16's small windows), and
"<kind>_bias" (causal_bias, document_bias, sliding256_bias, ...) that mask with a trainable
(B, H, L, L) bias (its gradient timed too).
"""
import statistics
import sys

import torch
import triton.testing

import flexsparse
from benchmarks.bench import _no_donated_buffers, flex_block_mask, make_case, parse_rows
from benchmarks.debug_bits import rotated

H, TOKENS, DTYPE = 16, 16384, torch.bfloat16
BWD = "--no-bwd" not in sys.argv
CUDA_ONLY = "--cuda-only" in sys.argv     # probes: the CUDA columns alone
DET = "--deterministic" in sys.argv       # our backwards in deterministic mode
ROUNDS = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 1
# --per-round: every timing printed as it is taken (round, place in the round's order,
# ms), so that a place's effect on a column can be read (docs/perf-notes.md, 55th session)
PER_ROUND = "--per-round" in sys.argv
# FlexAttention's FLASH backend (FA4, CuTe-DSL), where its wheels are installed
# (../shared/tools/flash-backend-wheels.sh).
FLASH = {"BACKEND": "FLASH"}
try:
    import flash_attn.cute  # noqa: F401
    HAS_FLASH = True
except Exception:  # not installed: the column stays empty
    HAS_FLASH = False
DEFAULT = ("full@8192,causal@8192,causal@16384,document@8192,document@16384,sliding@8192,prefix_lm@16384,"
           "shared_question@16384,block_sparse@8192,full@8192@64,causal@8192@64,"
           "sliding64@8192,sliding256@8192,sliding4096@8192,sliding256@8192@64,causal_bias@8192")


# --timer: how a backend's time per call is taken.
#   do_bench      triton's do_bench per backend and round (flushed single calls, ~60 ms).
#   back_to_back  calls back to back between two CUDA events, no L2 flush (sustained
#                 throughput, what a training loop sees).
#   call_by_call  the backends' flushed single calls alternating call by call (call_by_call
#                 below), so that all of them meet the same clock and power state.
# The 56th session found the first two reading a backend up to 12% fast when it ran right
# after the GPU had idled (a compile, a row's setup): the H200's clock falls over the
# first ~100 ms of load (docs/perf-notes.md C123), so a 60 ms do_bench run times whoever
# comes first in a round at a higher clock than the others.
TIMERS = ("do_bench", "back_to_back", "call_by_call")
TIMER = sys.argv[sys.argv.index("--timer") + 1] if "--timer" in sys.argv else "do_bench"
if TIMER not in TIMERS:
    raise SystemExit(f"--timer: one of {', '.join(TIMERS)}, got {TIMER!r}")


def back_to_back(fn, ms=60.0):
    """Median ms per call over three runs of back-to-back calls, each ~`ms` long."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    n = max(1, int(ms / max(start.elapsed_time(end), 1e-3)))
    runs = []
    for _ in range(3):
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) / n)
    return statistics.median(runs)


def bench(fn):
    if TIMER == "back_to_back":
        return back_to_back(fn)
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def interleaved(fns, rounds, timer=bench, report=print, turns=None):
    """{name: median ms} of the callables in `fns` ({name: fn}), each timed `rounds` times,
    taking turns within a round, in an order rotated every round (debug_bits.rotated: no
    callable holds one place in every round). A callable that raises is reported and
    takes no more turns (FlexAttention's compile failing on a mask, for instance).
    `turns`, where given, is called with (round, place, name, ms) for every timing."""
    times = {name: [] for name in fns}
    live = dict(fns)
    names = list(fns)
    for r in range(rounds):
        place = 0
        for name in (names[i] for i in rotated(len(names), r)):
            if name not in live:
                continue
            fn = live[name]
            try:
                times[name].append(timer(fn))
            except Exception as e:  # report, keep going
                report(f"{name}: {type(e).__name__}: {str(e)[:200]}")
                del live[name]
                continue
            if turns is not None:
                turns(r, place, name, times[name][-1])
            place += 1
    return {name: statistics.median(t) for name, t in times.items() if t}


def call_by_call(fns, rounds, report=print, turns=None, ms=60.0, flush=True, event=None, synchronize=None):
    """{name: median ms} of the callables in `fns` ({name: fn}) timed call by call: every
    cycle calls each live callable once, in an order rotated every cycle, each call
    between two CUDA events after a 256 MB zero fill (do_bench's L2 flush; flush=False
    leaves it out), for about `ms` per callable and round after a fifth as many untimed
    cycles. Unlike taking turns by runs (`interleaved`), a clock that drifts during the
    measurement reaches every callable alike. A callable that raises on its first call is
    reported and left out. `turns`, where given, is called with (round, None, name, ms)
    for the median of each round's share of the cycles. (`event` and `synchronize` stand
    in for torch.cuda.Event and torch.cuda.synchronize in the CPU test.)"""
    event = event or (lambda: torch.cuda.Event(enable_timing=True))
    synchronize = synchronize or torch.cuda.synchronize
    live = {}
    for name, fn in fns.items():
        try:
            fn()
            live[name] = fn
        except Exception as e:  # report, keep going
            report(f"{name}: {type(e).__name__}: {str(e)[:200]}")
    if not live:
        return {}
    names = list(live)
    cache = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda") if flush else None

    def cycles(n, order_from=0):
        events = []
        for c in range(n):
            for i in rotated(len(names), order_from + c):
                start, end = event(), event()
                if cache is not None:
                    cache.zero_()
                start.record()
                live[names[i]]()
                end.record()
                events.append((names[i], start, end))
        synchronize()
        return [(name, s.elapsed_time(e)) for name, s, e in events]

    one = cycles(1)
    cycle_ms = sum(t for _, t in one)
    per_round = max(3, int(ms * len(names) / max(cycle_ms, 1e-3)))
    cycles(max(1, per_round // 5))
    times = {name: [] for name in names}
    for r in range(rounds):
        got = cycles(per_round, order_from=r * per_round)
        for name in names:
            mine = [t for n, t in got if n == name]
            times[name] += mine
            if turns is not None:
                turns(r, None, name, statistics.median(mine))
    return {name: statistics.median(t) for name, t in times.items()}


def measure(fns, rounds, report=print, turns=None):
    """The timer that --timer names, over the backends of one row."""
    if TIMER == "call_by_call":
        return call_by_call(fns, rounds, report=report, turns=turns)
    return interleaved(fns, rounds, report=report, turns=turns)


def row(kind, L, D):
    from torch.nn.attention.flex_attention import flex_attention
    B = max(1, TOKENS // L)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=DTYPE) for _ in range(3))
    torch._dynamo.reset()      # a fresh recompile budget for FlexAttention per row
    fs_mask, mask_mod, per_head, sdpa_causal, has_bias = make_case(kind, B, L, device=q.device)
    # A trainable bias (Flash-DMA): only our backends take it (with its gradient).
    bias = torch.randn(B, H, L, L, device="cuda", dtype=DTYPE) if has_bias else None
    desc = fs_mask.compile(B, H, H, L, L, device=q.device)
    flops = 4.0 * D * desc.num_visible(batch=B)
    ref = flexsparse.attention(q, k, v, desc, bias=bias, backend="triton")
    got = flexsparse.attention(q, k, v, desc, bias=bias, backend="cuda")
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    fwd = {"cuda": lambda: flexsparse.attention(q, k, v, desc, bias=bias, backend="cuda")}
    fa = bm = None
    if not CUDA_ONLY:
        fwd["triton"] = lambda: flexsparse.attention(q, k, v, desc, bias=bias, backend="triton")
    if not CUDA_ONLY and bias is None:
        try:
            fa = torch.compile(flex_attention, dynamic=False)
            bm = flex_block_mask(desc, mask_mod, per_head, L, q.device)
            fwd["flex"] = lambda: fa(q, k, v, block_mask=bm)
        except Exception as e:  # report, keep going
            print(f"flex {kind}: {type(e).__name__}: {str(e)[:200]}")
            fa = None
        if fa is not None and HAS_FLASH:
            fwd["flash"] = lambda: fa(q, k, v, block_mask=bm, kernel_options=FLASH)
    F = torch.nn.functional
    if sdpa_causal is not None and not CUDA_ONLY and bias is None:
        fwd["sdpa"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=sdpa_causal)
    turns = (lambda r, i, n, ms: print(f"{kind}@{L}@{D} round {r}" + ("" if i is None else f" place {i}")
                                       + f" {n}: {ms:.3f} ms")) if PER_ROUND else None
    res = measure(fwd, ROUNDS, report=lambda m: print(f"{kind} {m}"), turns=turns)
    if "flex" not in res:
        fa = None
    gerr = float("nan")
    if BWD:
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        bg = None if bias is None else bias.detach().requires_grad_()
        leaves = (qg, kg, vg) if bg is None else (qg, kg, vg, bg)
        do = torch.randn_like(q)

        def bwd_of(fn):
            out = fn(qg, kg, vg)
            return lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)
        runs = {"cuda": lambda a, b, c: flexsparse.attention(a, b, c, desc, bias=bg, backend="cuda",
                                                             deterministic=DET),
                "triton": lambda a, b, c: flexsparse.attention(a, b, c, desc, bias=bg, backend="triton",
                                                               deterministic=DET)}
        g_cuda, g_tri = bwd_of(runs["cuda"])(), bwd_of(runs["triton"])()
        gerr = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                   for a, b in zip(g_cuda, g_tri))
        if fa is not None:
            runs["flex"] = lambda a, b, c: fa(a, b, c, block_mask=bm)
            if "flash" in res:
                runs["flash"] = lambda a, b, c: fa(a, b, c, block_mask=bm, kernel_options=FLASH)
        if sdpa_causal is not None and not CUDA_ONLY and bias is None:
            runs["sdpa"] = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=sdpa_causal)
        if CUDA_ONLY:
            runs = {"cuda": runs["cuda"]}
        # A compiled backward with donated buffers refuses retain_graph=True (the FLASH
        # row of full 8K failed so on 2026-11-25); bench.py turns them off too.
        with _no_donated_buffers():
            steps = {}
            for name, fn in runs.items():
                try:
                    steps[name + "_bwd"] = bwd_of(fn)
                except Exception as e:  # report, keep going
                    print(f"{name} bwd {kind}: {type(e).__name__}: {str(e)[:200]}")
            res.update(measure(steps, ROUNDS, report=lambda m: print(f"{kind} {m}"), turns=turns))
    tf = {n: (2.5 if n.endswith("_bwd") else 1.0) * flops / ms * 1e-9 for n, ms in res.items()}
    print(table_line(f"{kind} | {L // 1024}K | {D}", tf, err, gerr), flush=True)


HEADER = ("| mask | L | D | cuda fwd | triton fwd | flex fwd | flash fwd | sdpa fwd | cuda bwd "
          "| triton bwd | flex bwd | flash bwd | sdpa bwd | cuda / flash (else flex) fwd / bwd "
          "| rel err vs triton out / grads |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
COLUMNS = ("cuda", "triton", "flex", "flash", "sdpa",
           "cuda_bwd", "triton_bwd", "flex_bwd", "flash_bwd", "sdpa_bwd")


def table_line(key, tf, err, gerr):
    """One row of the table: `key` (mask | L | D), the TFLOP/s of each column (missing
    ones nan), the CUDA backend's ratio to FLASH (else Flex) forward and backward, and the
    errors against Triton."""
    nan = float("nan")
    cells = " | ".join(f"{tf.get(n, nan):6.0f}" for n in COLUMNS)
    have = {n for n, v in tf.items() if v == v}
    anchor = "flash" if "flash" in have else "flex"     # the fastest FlexAttention backend run
    ratio = tf["cuda"] / tf[anchor] if {"cuda", anchor} <= have else nan
    ratio_b = tf["cuda_bwd"] / tf[anchor + "_bwd"] if {"cuda_bwd", anchor + "_bwd"} <= have else nan
    return f"| {key} | {cells} | {ratio:.2f} / {ratio_b:.2f} | {err:.1e} / {gerr:.1e} |"


def merge_tables(texts):
    """The tables that several runs of this script printed (their text), as one: per row
    (mask, L, D), each TFLOP/s column the median of the runs that have it, the ratios
    recomputed from those medians, the errors the largest. Rows keep the first run's
    order; lines that are no table row are dropped."""
    rows = {}
    for text in texts:
        for line in text.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) != 3 + len(COLUMNS) + 2 or not cells[2].isdigit():
                continue
            key = " | ".join(cells[:3])
            values = [float(c) for c in cells[3:3 + len(COLUMNS)]]
            errs = [float(e) for e in cells[-1].split("/")]
            rows.setdefault(key, []).append((values, errs))
    out = []
    for key, runs in rows.items():
        tf = {}
        for i, name in enumerate(COLUMNS):
            got = [v[i] for v, _ in runs if v[i] == v[i]]
            tf[name] = statistics.median(got) if got else float("nan")
        err = max(e[0] for _, e in runs)
        gerr = max(e[1] for _, e in runs)
        out.append(table_line(key, tf, err, gerr))
    return "\n".join(out)


def row_spec(argv):
    """The row list among the arguments (options and their values left out: --rounds N,
    --timer NAME)."""
    args = [a for i, a in enumerate(argv) if not a.startswith("--")
            and not (i > 0 and argv[i - 1] in ("--rounds", "--timer"))]
    return args[0] if args else DEFAULT


def main():
    if "--merge" in sys.argv:    # --merge FILE...: the tables of several runs as one
        files = sys.argv[sys.argv.index("--merge") + 1:]
        texts = [open(f).read() for f in files]
        print(f"{len(files)} runs merged: each column the median of the runs' values")
        print(HEADER)
        print(merge_tables(texts))
        return
    spec = row_spec(sys.argv[1:])
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, H={H}, B*L=16K"
          + (f"; {ROUNDS} rounds, the backends taking turns, medians" if ROUNDS > 1 else "")
          + {"do_bench": "; do_bench per backend (flushed single calls)",
             "back_to_back": "; timed back to back (no L2 flush)",
             "call_by_call": "; flushed single calls, the backends alternating call by call"}[TIMER])
    print(HEADER)
    for kind, L, D in parse_rows(spec):
        try:
            row(kind, L, D)
        except Exception as e:  # report, keep going
            print(f"| {kind}@{L}@{D} | failed: {type(e).__name__}: {str(e)[:300]} |", flush=True)


if __name__ == "__main__":
    main()
