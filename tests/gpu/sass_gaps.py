"""How closely a kernel issues one opcode after another: the gaps (in instructions) between
consecutive executions of OPCODE (default MUFU.EX2) in program order, from either

    cuobjdump -sass file.o > k.sass           (a local build, no GPU: the static code), or
    ncu ... --page source --csv --print-source sass > k.csv   (tests/gpu.sh ncuhist's CSVs)

    python3 tests/gpu/sass_gaps.py k.sass|k.csv [...] [--op MUFU.EX2] [--kernel bwd_kernel]

A gap of 1 is back to back. With in-order issue a warp waits at each MUFU for the unit
while independent FFMAs sit behind it; FLASH's backward spaces its exponentials 2-9
instructions apart, ours ran them in runs of 4-5 (docs/perf-notes.md C63). From a CSV only
instructions executed more than --min-exec times count (the hot loop); from cuobjdump
output, the named kernel's whole code.
"""
import re
import sys
from collections import Counter

from ncu_opcode_hist import opcode, read_source_csv   # (this directory, run as a script)


def arg(name, default):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def ops_from_sass(path, kernel):
    ops, inside = [], False
    for line in open(path):
        if "Function :" in line:
            inside = kernel in line
        if inside:
            m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
            if m:
                ops.append(m.group(1).strip())
    return ops


def ops_from_csv(path, min_exec):
    head, body = read_source_csv(path)
    if not head:
        return []
    src = next(i for i, c in enumerate(head) if c.strip() == "Source")
    ex = next(i for i, c in enumerate(head) if c.strip().startswith("Instructions Executed"))
    ops = []
    for r in body:
        try:
            n = float(r[ex].replace(",", ""))
        except ValueError:
            n = 0.0
        ops.append(r[src].strip() if n > min_exec else "")
    return ops


def main():
    op = arg("--op", "MUFU.EX2")
    kernel = arg("--kernel", "bwd_kernel")
    min_exec = float(arg("--min-exec", "1e5"))
    values = {arg(o, None) for o in ("--op", "--kernel", "--min-exec")}
    for path in [a for a in sys.argv[1:] if not a.startswith("--") and a not in values]:
        ops = ops_from_csv(path, min_exec) if path.endswith(".csv") else ops_from_sass(path, kernel)
        if not ops:
            print(f"{path}: no instruction rows (kernel not profiled)")
            continue
        at = [i for i, o in enumerate(ops) if opcode(o).startswith(op)]
        gaps = Counter(min(b - a, 9) for a, b in zip(at, at[1:]) if b - a < 40)
        print(f"{path}: {len(at)} x {op}; gaps (9 = 9 or more): {dict(sorted(gaps.items()))}; "
              f"back to back {gaps.get(1, 0)} of {sum(gaps.values())}")


if __name__ == "__main__":
    main()
