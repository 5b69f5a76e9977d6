"""Executed SASS instructions per opcode of one or two kernels, from
`ncu --import R -k regex:K --page source --csv --print-source sass` output: where two
kernels that do the same work differ in what they execute.

    python3 tests/gpu/ncu_opcode_hist.py ours.csv [theirs.csv] [--per N] [--top 30] [--stall stall_wait]

--per N divides the counts by N (e.g. the number of 128x128 tiles) to read them per tile.
--stall COLUMN sums that warp-stall sampling column per opcode instead of the executed
instructions (stall_wait, stall_short_sb, ...: where the two kernels' warps wait by opcode,
docs/perf-notes.md C63).
"""
import csv
import sys
from collections import Counter


def read_source_csv(path):
    """The header and instruction rows of an `ncu --page source --csv` export; ([], []) for
    an export without them (a kernel the profile did not record)."""
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.strip() and not ln.startswith("==")]
    rows = list(csv.reader(lines))
    head_i = next((i for i, r in enumerate(rows) if any(c.strip() == "Source" for c in r)), None)
    if head_i is None:
        return [], []
    head = rows[head_i]
    return head, [r for r in rows[head_i + 1:] if len(r) == len(head)]


def opcode(source):
    """The opcode with its modifiers (MUFU.EX2) of one SASS line, past a predicate; "" if none."""
    toks = source.strip().split()
    if not toks:
        return ""
    return toks[1] if toks[0].startswith("@") and len(toks) > 1 else toks[0]


def hist(path, column=None):
    head, body = read_source_csv(path)
    if not head:
        return Counter()
    src = next(i for i, c in enumerate(head) if c.strip() == "Source")
    if column is None:
        ex = next(i for i, c in enumerate(head) if c.strip().startswith("Instructions Executed"))
    else:
        ex = next(i for i, c in enumerate(head) if c.strip() == column)
    per_op = Counter()
    for r in body:
        try:
            n = float(r[ex].replace(",", ""))
        except ValueError:
            continue
        op = opcode(r[src])
        if op:
            per_op[op.split(".")[0]] += n
    return per_op


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    per = float(sys.argv[sys.argv.index("--per") + 1]) if "--per" in sys.argv else 1.0
    top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 30
    stall = sys.argv[sys.argv.index("--stall") + 1] if "--stall" in sys.argv else None
    values = {sys.argv[sys.argv.index(o) + 1] for o in ("--per", "--top", "--stall") if o in sys.argv}
    args = [a for a in args if a not in values]
    hs = [hist(p, stall) for p in args]
    if not any(hs):
        print("no instruction rows in", ", ".join(args), "(kernels not profiled)")
        return
    ops = sorted(set().union(*hs), key=lambda o: -max(h[o] for h in hs))
    print("opcode | " + " | ".join(args) + (" | difference" if len(hs) == 2 else ""))
    print("total | " + " | ".join(f"{sum(h.values()) / per:.0f}" for h in hs))
    for op in ops[:top]:
        vals = [h[op] / per for h in hs]
        diff = f" | {vals[0] - vals[1]:+.0f}" if len(hs) == 2 else ""
        print(f"{op} | " + " | ".join(f"{v:.0f}" for v in vals) + diff)


if __name__ == "__main__":
    main()
