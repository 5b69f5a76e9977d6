"""The CUDA backward's timeline, step by step, from a build with -DFLEXSPARSE_BWD_TRACE
(tests/gpu.sh btrace builds one in a copy of the tree): the first thread of each consumer
warpgroup stamps the SM clock at fixed points of its first query steps, in the CTAs of key
tiles 0, 1 and gridDim.x / 2 of (kv head 0, batch 0); the host copies the stamps out
after the launch and the op flexsparse::bwd_trace returns them (csrc/bwd_sm90.cuh,
BWD_TRACE; the kernel does not print: a printf made ptxas serialize its wgmmas).

    PYTHONPATH=<trace build> python3 tests/gpu/bwd_trace.py full@8192@128 ... [--bits 0,268435456]

Per row and FLEXSPARSE_CUDA_DEBUG value it prints the median cycles of each phase of the
step over the steady steps, the step period and the tensor cores' floor for the step's
five products; and every CTA's life outside its steps (BWD_LIFE: entry, K and V's
arrival, the last step, the epilogue, the gap to the next CTA on the same SM). Events:
0 query stage ready, 1 S^T issued, 2 dO ready and dP^T issued, 3 S^T done, 4 P^T
computed, 5 dP^T done, 6 dS^T computed, dV issued, dS^T stored, 7 both warpgroups' dS^T
stored, 8 dQ issued and dV done, 9 dK issued and dQ done, 10 dQ handed to the writer,
11 dK done. The stamps slow the loop somewhat (spills): compare phases with each other
and across variants, and the trace build's time with the plain one's.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

PHASES = [("S^T issue", 0, 1), ("dO wait, dP^T issue", 1, 2), ("S^T wait", 2, 3),
          ("exponentials", 3, 4), ("dP^T wait", 4, 5), ("dS^T, dV issue, dS^T store", 5, 6),
          ("dS barrier", 6, 7), ("dQ issue, dV wait", 7, 8), ("dK issue, dQ wait", 8, 9),
          ("dQ to the writer", 9, 10), ("dK wait", 10, 11)]


def run_one(row):
    import torch
    import flexsparse
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    from benchmarks import bench
    # (the trace build, not the installed one: PYTHONPATH as tests/gpu.sh btrace sets it)
    assert "btrace" in os.path.dirname(flexsparse.__file__), flexsparse.__file__
    [(kind, L, D)] = bench.parse_rows(row)
    dev = torch.device("cuda")
    B, H = max(1, bench.TOKENS // L), bench.H
    q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=bench.DTYPE, requires_grad=True)
               for _ in range(3))
    desc = bench.make_case(kind, B, L, device=dev)[0].compile(B, H, H, L, L, device=dev)
    out = flexsparse.attention(q, k, v, desc, backend="cuda")
    dout = torch.randn_like(out)
    for rep in range(2):      # the second launch is the one read (the first warms up)
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        torch.cuda.synchronize()
        if rep == 1:
            print("\n".join(trace_lines(torch.ops.flexsparse.bwd_trace())))
            print("\n".join(life_lines(torch.ops.flexsparse.bwd_life())))
        print(f"=== launch {rep} done", flush=True)


TRACE_STEPS = 130    # csrc/kernels.h, kBwdTraceSteps


def trace_lines(buf):
    """The stamps of the op flexsparse::bwd_trace ((CTA slot, step, warpgroup, event) int32
    holding uint32 clocks; row TRACE_STEPS, warpgroup 0: the calibration and the CTA's
    index) as lines "BWDCAL cta c0 g0 c1 g1" and "BWDTRACE cta wg step e0..e11"."""
    lines = []
    for slot in buf.long().bitwise_and(0xFFFFFFFF).tolist():
        cal = slot[TRACE_STEPS][0]
        if not any(cal):
            continue                     # (a slot no CTA recorded)
        cta = cal[4]
        lines.append(f"BWDCAL {cta} " + " ".join(map(str, cal[:4])))
        for wg in range(2):
            for s in range(TRACE_STEPS):
                e = slot[s][wg]
                if any(e):
                    lines.append(f"BWDTRACE {cta} {wg} {s} " + " ".join(map(str, e)))
    return lines


def life_lines(buf):
    """Every CTA's life (the op flexsparse::bwd_life: (CTA, event) int32 holding uint32
    words; event 0 the SM + 1, 0 where no CTA recorded) as lines "BWDLIFE cta e0..e7"."""
    return [f"BWDLIFE {cta} " + " ".join(map(str, e))
            for cta, e in enumerate(buf.long().bitwise_and(0xFFFFFFFF).tolist()) if e[0]]


def life_summary(text):
    """Where a backward CTA's time goes outside its steps, from the BWDLIFE lines of the
    last launch (csrc/bwd_sm90.cuh, BWD_LIFE, per key tile; in the persistent kernel a
    "CTA" here is a tile, its entry the consumers' read of it, and the dQ writer's last
    read is recorded for a CTA's last tile only): per CTA, median SM cycles from its entry
    to K and V in shared memory, from there to the last step's end (and per step), to the
    epilogue's stores read, to its end (the later of that and the dQ writer's last
    reduction read), and from its end to the next CTA's entry on the same SM; and the
    fixed cost per CTA: entry to the next entry less its steps at the median step time."""
    last = text.split("=== launch 0 done")[-1].split("=== launch 1 done")[0]
    ctas = [list(map(int, line.split()[2:])) for line in last.splitlines() if line.startswith("BWDLIFE")]
    if not ctas:
        return "CTA life: no records (not a trace build?)"
    by_sm = {}
    for e in ctas:
        by_sm.setdefault(e[0] - 1, []).append(e)
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    start_kv, kv_last, last_epi, epi_end, gap, per_step, fixed = [], [], [], [], [], [], []
    for sm, es in by_sm.items():
        ref = es[0][1]
        rel = lambda c: ((c - ref + (1 << 31)) % (1 << 32)) - (1 << 31)  # noqa: E731
        es.sort(key=lambda e: rel(e[1]))
        for i, e in enumerate(es):
            end = max(rel(e[4]), rel(e[5])) if e[5] else rel(e[4])
            start_kv.append(dt(e[1], e[2]))
            kv_last.append(dt(e[2], e[3]))
            last_epi.append(dt(e[3], e[4]))
            epi_end.append(end - rel(e[4]))
            if e[7]:
                per_step.append(dt(e[2], e[3]) / e[7])
            if i + 1 < len(es):
                gap.append(rel(es[i + 1][1]) - end)
    step = med(per_step)
    for es in by_sm.values():
        for a, b in zip(es, es[1:]):
            fixed.append(((b[1] - a[1]) % (1 << 32)) - a[7] * step)
    steps = med([e[7] for e in ctas])
    return (f"CTA life ({len(ctas)} CTAs on {len(by_sm)} SMs, median {steps:.0f} steps), median SM "
            f"cycles: entry to K/V {med(start_kv):.0f}, K/V to the last step's end {med(kv_last):.0f} "
            f"({step:.0f} per step), to the epilogue's stores read {med(last_epi):.0f}, to the CTA's end "
            f"{med(epi_end):.0f}, end to the next CTA's entry {med(gap):.0f}; fixed cost per CTA "
            f"(entry to next entry less steps) {med(fixed):.0f}")


def parse(text):
    """({(cta, wg): {step: [12 stamps]}}, {cta: [clock0, ns0, clock1, ns1]}) of the last launch."""
    last = text.split("=== launch 0 done")[-1].split("=== launch 1 done")[0]
    steps, cal = {}, {}
    for line in last.splitlines():
        if line.startswith("BWDTRACE"):
            cta, wg, s, *e = map(int, line.split()[1:])
            steps.setdefault((cta, wg), {})[s] = e
        elif line.startswith("BWDCAL"):
            cta, *c = map(int, line.split()[1:])
            cal[cta] = c
    return steps, cal


def dt(a, b):
    return (b - a) % (1 << 32)


def step_rows(row, bits):
    """Query rows per step of the kernel the row runs (BwdTraits): 80 on the full mask at
    hd128 (64 under bit 268435456), 128 at hd64 (plain calls), else 64."""
    D = int(row.split("@")[2]) if row.count("@") >= 2 else 128
    if D == 128 and row.startswith("full@") and not int(bits) & 268435456:
        return 80
    return 128 if D == 64 else 64


def summarize(row, bits, steps, cal):
    D = int(row.split("@")[2]) if row.count("@") >= 2 else 128
    keys = 64 if D == 256 else 128
    m = step_rows(row, bits)
    floor = 5 * 2 * keys * m * D // 4096      # the CTA's five products at 4096 flop/clk/SM
    lines = [f"### {row}, FLEXSPARSE_CUDA_DEBUG={bits}: {m}-row steps, tensor-core floor per "
             f"step {floor} cycles"]
    for cta, c in sorted(cal.items()):
        if c[3] != c[1]:
            lines.append(f"CTA {cta}: {dt(c[0], c[2]) / dt(c[1], c[3]):.3f} cycles per ns")
    med = lambda xs: int(statistics.median(xs)) if xs else -1  # noqa: E731
    for (cta, wg), by_step in sorted(steps.items()):
        ss = sorted(by_step)
        steady = [s for s in ss if 2 <= s and s + 1 in by_step and s + 2 <= max(ss)]
        if not steady:
            lines.append(f"CTA {cta} wg{wg}: {len(ss)} steps, too few")
            continue
        period = med([dt(by_step[s][0], by_step[s + 1][0]) for s in steady])
        parts = [f"{name} {med([dt(by_step[s][a], by_step[s][b]) for s in steady])}" for name, a, b in PHASES]
        parts.append(f"to the next stage {med([dt(by_step[s][11], by_step[s + 1][0]) for s in steady])}")
        lines.append(f"CTA {cta} wg{wg}: {len(ss)} steps, period {period} "
                     f"({floor / max(period, 1):.0%} of floor, {period * 64 // m} per 64 rows); "
                     + ", ".join(parts))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rows", nargs="*", default=["full@8192@128", "causal@8192@128", "full@8192@64"])
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--bits", default="0", help="FLEXSPARSE_CUDA_DEBUG values, comma-separated")
    ap.add_argument("--raw", help="also write the raw stamps to this directory")
    args = ap.parse_args()
    if args.run:
        return run_one(args.run)
    for row in args.rows:
        for bits in args.bits.split(","):
            env = dict(os.environ, FLEXSPARSE_CUDA_DEBUG=bits)
            res = subprocess.run([sys.executable, __file__, "--run", row], env=env,
                                 capture_output=True, text=True)
            if res.returncode != 0:
                print(f"### {row} {bits}: failed\n{res.stderr[-2000:]}")
                continue
            if args.raw:
                name = re.sub(r"[^A-Za-z0-9]", "_", f"btrace_{row}_{bits}.txt")
                with open(os.path.join(args.raw, name), "w") as f:
                    f.write(res.stdout)
            print(summarize(row, bits, *parse(res.stdout)), flush=True)
            print(life_summary(res.stdout), flush=True)


if __name__ == "__main__":
    main()
