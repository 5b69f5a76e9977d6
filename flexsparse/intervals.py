"""Interval specs: the named column-range masks in closed form, for one-launch builds on GPUs.

Every named column-range mask sees, in key column j, one interval of query rows
[lo(j), hi(j)); lo is the max and hi the min of a few terms (`Term`): j + c, a constant,
or the start / end of j's document, each optionally replaced by a constant left of a
threshold column (`alt if j < below`). Examples, i' = i + (Lk - Lq):

    causal                   lo = j - off                       (i' >= j)
    sliding_window(l, r)     lo = j - off - r,  hi = j - off + l + 1
    document(lengths)        lo = max(doc_start, j - off),  hi = doc_end
    prefix_lm(p)             lo = (0 if j < p else j - off)
    shared_question(q, ..)   lo = j - off,  hi = (Lq if j < q else doc_end)
    global_tokens(n)         hi = (Lq if j < n else n)

and_ of specs concatenates terms; or_ of two single-interval specs keeps both intervals.
`column_ranges(spec, sz)` packs the terms into one small int32 table and runs
flexsparse/triton_intervals.py (one launch, no int64 temporaries). The torch builders in
flexsparse/masks.py define the same column ranges; tests check they agree bit for bit.
"""
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

COL, CONST, DOC_START, DOC_END = 1, 2, 3, 4
_LIMIT = 1 << 30          # |values| kept below this: j + c stays inside int32


@dataclass(frozen=True)
class Term:
    """Value in key column j: `alt` if j < below, else by code: COL j + c, CONST c,
    DOC_START / DOC_END the bounds of j's document. `below` may be a (B,) tensor."""
    code: int
    c: int = 0
    below: Union[int, torch.Tensor] = 0
    alt: int = 0


@dataclass(frozen=True)
class Interval:
    """Visible query rows [max(lo), min(hi)) of a key column; no terms = 0 / Lq."""
    lo: Tuple[Term, ...] = ()
    hi: Tuple[Term, ...] = ()


@dataclass(frozen=True)
class IntervalSpec:
    intervals: Tuple[Interval, ...]               # visible = their union (1 or 2)
    doc_lengths: Optional[torch.Tensor] = None    # (Bl, n) documents of DOC_* terms

    def uses_docs(self):
        return any(t.code in (DOC_START, DOC_END)
                   for iv in self.intervals for t in iv.lo + iv.hi)


MAX_TERMS = 4


def and_spec(*specs: Optional[IntervalSpec]) -> Optional[IntervalSpec]:
    """Intersection of single-interval specs (None when it does not fit the kernel)."""
    if any(s is None or len(s.intervals) != 1 for s in specs):
        return None
    docs = [s.doc_lengths for s in specs if s.uses_docs()]
    if len(docs) > 1:
        return None
    lo = sum((s.intervals[0].lo for s in specs), ())
    hi = sum((s.intervals[0].hi for s in specs), ())
    if len(lo) > MAX_TERMS or len(hi) > MAX_TERMS:
        return None
    return IntervalSpec((Interval(lo, hi),), docs[0] if docs else None)


def or_spec(*specs: Optional[IntervalSpec]) -> Optional[IntervalSpec]:
    """Union of two single-interval specs (None when it does not fit the kernel)."""
    if len(specs) != 2 or any(s is None or len(s.intervals) != 1 for s in specs):
        return None
    docs = [s.doc_lengths for s in specs if s.uses_docs()]
    if len(docs) > 1:
        return None
    return IntervalSpec(specs[0].intervals + specs[1].intervals, docs[0] if docs else None)


def _clip(x: int) -> int:
    return max(-_LIMIT, min(_LIMIT, int(x)))


def _per_batch(x, Bp):
    """An int or a (1,)/(B,) tensor as Bp clipped ints."""
    if isinstance(x, torch.Tensor):
        vals = [_clip(v) for v in x.reshape(-1).tolist()]
        return vals * Bp if len(vals) == 1 else vals
    return [_clip(x)] * Bp


def pack(spec: IntervalSpec, B: int):
    """The kernel's parameter table: int32 (Bp, K*2*MAX_TERMS*4 + n + 1) on the CPU, with the
    cumulative document boundaries at column `doc_at`; and the per-interval (lo?, hi?) flags.
    Plain Python lists, one tensor at the end: the build is launch-bound (~0.1 ms saved)."""
    terms = [t for iv in spec.intervals for t in iv.lo + iv.hi]
    per_batch = any(isinstance(t.below, torch.Tensor) and t.below.numel() > 1 for t in terms)
    docs = spec.doc_lengths.tolist() if spec.uses_docs() else None
    Bp = B if per_batch or (docs is not None and len(docs) > 1) else 1
    K = len(spec.intervals)
    doc_at = K * 2 * MAX_TERMS * 4
    rows = [[0] * doc_at for _ in range(Bp)]
    for k, iv in enumerate(spec.intervals):
        for side, bound in enumerate((iv.lo, iv.hi)):
            for t, term in enumerate(bound):
                at = ((k * 2 + side) * MAX_TERMS + t) * 4
                for row, below in zip(rows, _per_batch(term.below, Bp)):
                    row[at:at + 4] = [term.code, _clip(term.c), below, _clip(term.alt)]
    n = 0
    if docs is not None:
        n = len(docs[0])
        for row, lens in zip(rows, docs * Bp if len(docs) == 1 else docs):
            acc = [0]
            for x in lens:
                acc.append(acc[-1] + x)
            row += acc
    else:
        for row in rows:
            row.append(0)
    present = [(bool(iv.lo), bool(iv.hi)) for iv in spec.intervals]
    return torch.tensor(rows, dtype=torch.int32), present, n, doc_at


def column_ranges(spec: IntervalSpec, B: int, Lq: int, Lk: int, device) -> torch.Tensor:
    """Normalized column ranges (Bp, 1, Lk, 2m) int32 of `spec` on a CUDA device, in one
    launch (the same tensor as masks._stack_slots of the mask's torch slots)."""
    from .triton_intervals import interval_column_ranges
    table, present, n_docs, doc_at = pack(spec, B)
    return interval_column_ranges(table.to(device), present, n_docs, doc_at, Lq, Lk)


def fits(spec: Optional[IntervalSpec], Lq: int, Lk: int) -> bool:
    return spec is not None and max(Lq, Lk) < _LIMIT and len(spec.intervals) in (1, 2)
