"""The SASS instructions of one kernel with the most warp-stall samples, from
`ncu --import R --page source --csv --print-source sass` output (tests/gpu.sh ncusrc).

    python3 tests/gpu/ncu_source_top.py src.csv [--top 40]

Prints the CSV's sampling columns, then the top instructions with their sample counts and
their neighbourhood (address, opcode), and the samples summed per opcode.
"""
import csv
import sys
from collections import Counter


def main():
    path = sys.argv[1]
    top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 40
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.strip() and not ln.startswith("==")]
    rows = list(csv.reader(lines))
    head_i = next(i for i, r in enumerate(rows) if any("Source" in c for c in r))
    head, body = rows[head_i], rows[head_i + 1:]
    print("columns:", " | ".join(head))
    src = next(i for i, c in enumerate(head) if c.strip() == "Source")
    addr = next((i for i, c in enumerate(head) if "Address" in c), None)
    samp = [i for i, c in enumerate(head) if "Sampling" in c and "Not" not in c]
    if not samp:
        print("no sampling column found"); return
    key = samp[0]

    def num(x):
        try:
            return float(x.replace(",", ""))
        except ValueError:
            return 0.0
    body = [r for r in body if len(r) == len(head)]
    total = sum(num(r[key]) for r in body) or 1.0
    print(f"{len(body)} instructions, {total:.0f} samples in '{head[key]}'")
    ranked = sorted(range(len(body)), key=lambda i: -num(body[i][key]))
    for i in ranked[:top]:
        r = body[i]
        extra = " ".join(f"{head[j]}={r[j]}" for j in samp[1:3])
        print(f"{100 * num(r[key]) / total:5.1f}%  {r[addr] if addr is not None else i:>8}  "
              f"{r[src].strip()[:70]:70s} {extra}")
    per_op = Counter()
    for r in body:
        op = r[src].strip().split(" ")[0].lstrip("@!P0123456789T ").split(".")[0] or "?"
        per_op[op] += num(r[key])
    print("per opcode:", ", ".join(f"{op} {100 * v / total:.1f}%" for op, v in per_op.most_common(15)))


if __name__ == "__main__":
    main()
