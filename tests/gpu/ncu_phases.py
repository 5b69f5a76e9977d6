"""Warp-stall samples of one kernel's main loop by phase, from an `ncu --page source --csv
--print-source sass` export with SourceCounters (tests/gpu.sh ncuhist and ncusrc write
them): the loop's instructions are those executed about as often as its HGMMAs (once per
step or tile); a phase starts at each wgmma group, wgmma wait, named barrier, async-proxy
fence or mbarrier wait, so the phases of two kernels that do the same work can be set
side by side (docs/perf-notes.md C104, C110). A kernel with more than one copy of its
loop (FLASH's backward: one for masked steps, one for the others, C114) has an HGMMA
execution count per copy: every count that holds at least 10% of the HGMMA executions
makes its copy part of the loop (its phases follow in address order).

    python3 tests/gpu/ncu_phases.py ours.csv [theirs.csv] [--min 0.4] [--stalls 2]

--min: leave out phases under that percentage of the kernel's samples;
--stalls: how many of each phase's largest stall reasons to name.
"""
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_opcode_hist import opcode, read_source_csv  # noqa: E402

LANDMARKS = ("HGMMA", "WARPGROUP.DEPBAR", "BAR.", "FENCE")


def is_landmark(source):
    op = opcode(source)
    return op.startswith(LANDMARKS) or "TRYWAIT" in op


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def phases(path):
    """(total samples, [(address, first instruction, samples, instructions, Counter of
    stall reasons)]) of the loop, consecutive HGMMAs of one group folded into one phase."""
    head, body = read_source_csv(path)
    if not head:
        return 0.0, []
    col = {c.strip(): i for i, c in enumerate(head)}
    src, addr = col["Source"], col["Address"]
    samples = col["Warp Stall Sampling (All Samples)"]
    executed = next(i for c, i in col.items() if c.startswith("Instructions Executed"))
    stalls = [(c, i) for c, i in col.items() if c.startswith("stall_") and "Not Issued" not in c]
    total = sum(number(r[samples]) for r in body)
    counts = Counter(number(r[executed]) for r in body if opcode(r[src]).startswith("HGMMA"))
    if not counts:
        return total, []
    # the loop copies: the HGMMA execution counts that hold >= 10% of all HGMMA executions
    executions = {n: n * k for n, k in counts.items()}
    steps = [n for n, e in executions.items() if n > 0 and e >= 0.1 * sum(executions.values())]
    out = []
    for r in body:
        n = number(r[executed])
        if not any(0.5 * step <= n <= 2.5 * step for step in steps):
            continue
        source = r[src].strip()
        fold = out and opcode(source).startswith("HGMMA") and opcode(out[-1][1]).startswith("HGMMA")
        if not out or (is_landmark(source) and not fold):
            out.append([r[addr].strip(), source, 0.0, 0, Counter()])
        phase = out[-1]
        phase[2] += number(r[samples])
        phase[3] += 1
        for c, i in stalls:
            phase[4][c[len("stall_"):]] += number(r[i])
    return total, out


def main():
    args = sys.argv[1:]
    minimum = float(args[args.index("--min") + 1]) if "--min" in args else 0.4
    n_stalls = int(args[args.index("--stalls") + 1]) if "--stalls" in args else 2
    values = {args[args.index(o) + 1] for o in ("--min", "--stalls") if o in args}
    for path in [a for a in args if not a.startswith("--") and a not in values]:
        total, rows = phases(path)
        if not rows:
            print(f"{path}: no loop found (kernel not profiled)")
            continue
        in_loop = sum(r[2] for r in rows)
        print(f"{path}: {total:.0f} samples, {in_loop / total:.0%} in the loop's {len(rows)} phases")
        print("address | samples (K) | % | instructions | first instruction | largest stalls")
        for address, source, s, n, why in rows:
            if s < minimum / 100 * total:
                continue
            top = ", ".join(f"{k} {v / 1000:.1f}K" for k, v in why.most_common(n_stalls))
            print(f"{address[-6:]} | {s / 1000:.1f} | {s / total:.1%} | {n} | {source[:56]} | {top}")


if __name__ == "__main__":
    main()
