"""Checks of the raw op's inputs: the 14 mask tensors (and query/key/value/bias) against
the contract in docs/design.md ("The raw op's contract"), before any kernel runs.

Only shapes, dtypes, devices and the two floats are read, never tensor data (except under
FLEXSPARSE_DEBUG=1, at the end of this file): no host sync, and the same
code runs in the op's eager kernels (`backends.py`) and in its fake kernels while
torch.compile traces (`schema.py`), where sizes are SymInts. Comparisons are plain Python
ones on those sizes (under torch.compile they become guards on the input shapes).

Errors: TypeError for a wrong dtype or type, ValueError for a wrong shape, device or a
missing partner tensor, each naming the argument, what it got and what was expected.
The Python API (flexsparse/api.py) checks the same things first with its own messages;
every descriptor the library builds passes these checks.
"""
import collections
import math
import os
import weakref

import torch

from .schema import MAX_RANGES, WINDOW_LIMIT

_INT = (torch.int32, torch.int64)
# (count, index, rows): rows "q" = query blocks (kv lists), "k" = key blocks (q lists)
_LISTS = (("kv_count", "kv_index", "q"), ("kv_full_count", "kv_full_index", "q"),
          ("q_count", "q_index", "k"), ("q_full_count", "q_full_index", "k"))
_PREDICATES = ("dense_mask", "col_ranges", "partial_bits_index", "partial_bits")


def shown_size(x):
    """A size for a message: the int, or a SymInt's value in the example being traced (an
    f-string of a SymInt stops Dynamo's trace with "BUILD_STRING type error")."""
    if isinstance(x, torch.SymInt):
        hint = getattr(x.node, "hint", None)
        return int(hint) if hint is not None else str(x)
    return int(x)


def shown_shape(t):
    """A tensor's shape for a message (shown_size of each size)."""
    return tuple(shown_size(s) for s in t.shape)


def _one_of(x, *allowed) -> bool:
    # `x in allowed` compares with ==, which works for ints and SymInts alike
    return any(x == a for a in allowed)


def _check_tensor(name, t, dtypes, what, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: must be a tensor or None, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: must be {what}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: is on {t.device} but query is on {device}")


def check_qkv(query, key, value):
    """What the mask checks need of query/key/value (4-D, one batch, GQA heads, one
    device); the API's checks (flexsparse/api.py) say more and run first."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: must be 4-D (B, H, L, D), got shape {shown_shape(t)}")
    for name, t in (("key", key), ("value", value)):
        if t.device != query.device:
            raise ValueError(f"{name}: is on {t.device} but query is on {query.device}")
        if t.shape[0] != query.shape[0]:
            raise ValueError(f"{name}: batch {shown_size(t.shape[0])} must match query batch "
                             f"{shown_size(query.shape[0])}")
    if value.shape[1] != key.shape[1] or value.shape[2] != key.shape[2]:
        raise ValueError(f"value: shape {shown_shape(value)} must have key's (Hkv, Lk) = "
                         f"{shown_shape(key)[1:3]}")
    if key.shape[3] != query.shape[3]:
        raise ValueError(f"key: head dim {shown_size(key.shape[3])} must match query head dim "
                         f"{shown_size(query.shape[3])}")
    if query.shape[3] == 0:
        raise ValueError(f"query: head dim must be > 0, got shape {shown_shape(query)}")
    Hq, Hkv = query.shape[1], key.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"key: query heads Hq={shown_size(Hq)} must be a multiple of key/value "
                         f"heads Hkv={shown_size(Hkv)}")


def check_scalars(scale, softcap):
    """scale finite and > 0; softcap finite and >= 0 (0 = no softcap). Plain floats only:
    a SymFloat (a float input that torch.compile traces symbolically) is left to the
    op's kernel, which sees the number when the graph runs (a check here would
    specialize the graph on the value)."""
    if type(scale) in (float, int) and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: must be a finite positive float, got {scale!r}")
    if type(softcap) in (float, int) and not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap: must be a finite float >= 0 (0 or None: no softcap), "
                         f"got {softcap!r}")


def check_bias_tensor(bias, query):
    """A bias (not None): a floating tensor on the query's device. Shared with the API."""
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias: must be a tensor or None, got {type(bias).__name__}")
    if not bias.dtype.is_floating_point:
        raise TypeError(f"bias: must be a floating tensor, got {bias.dtype}")
    if bias.device != query.device:
        raise ValueError(f"bias: is on {bias.device} but query is on {query.device}")


def check_bias(bias, query, key):
    if bias is None:
        return
    check_bias_tensor(bias, query)
    B, Hq, Lq = query.shape[:3]
    Hkv, Lk = key.shape[1], key.shape[2]
    if (bias.dim() != 4 or not _one_of(bias.shape[0], 1, B)
            or not _one_of(bias.shape[1], 1, Hkv, Hq) or not _one_of(bias.shape[2], 1, Lq)
            or not _one_of(bias.shape[3], 1, Lk)):
        raise ValueError(f"bias: shape {shown_shape(bias)} is not (B|1, Hq|Hkv|1, Lq|1, Lk|1) "
                         f"with B={shown_size(B)}, Hq={shown_size(Hq)}, Hkv={shown_size(Hkv)}, "
                         f"Lq={shown_size(Lq)}, Lk={shown_size(Lk)}")


def check_mask(mask, query, key, block_q, block_k):
    """Raise unless the mask tensors (a schema.MaskTensors) fit query (B, Hq, Lq, D) and
    key (B, Hkv, Lk, D) with descriptor blocks (block_q, block_k): docs/design.md."""
    if (not isinstance(block_q, int) or not isinstance(block_k, int)
            or block_q <= 0 or block_k <= 0):
        raise ValueError(f"block_q, block_k: must be positive ints, got ({block_q!r}, "
                         f"{block_k!r})")
    present = [name for name, t in zip(mask._fields, mask) if t is not None]
    if not present:
        return
    device = query.device
    B, Hq, Lq = query.shape[:3]
    Hkv, Lk = key.shape[1], key.shape[2]
    # (messages are built only on failure: these checks run on every eager call)

    def sizes():
        return f"B={shown_size(B)}, Hkv={shown_size(Hkv)}, Hq={shown_size(Hq)}"

    def batch_heads(name, t, kv_heads_only=False):
        b, h = t.shape[0], t.shape[1]
        if not (b == 1 or b == B):
            raise ValueError(f"{name}: shape {shown_shape(t)}: batch dim {shown_size(b)} must be "
                             f"1 or B={shown_size(B)}")
        if not (h == 1 or h == Hkv or (not kv_heads_only and h == Hq)):
            names = "1 or Hkv" if kv_heads_only else "1, Hkv or Hq"
            raise ValueError(f"{name}: shape {shown_shape(t)}: head dim {shown_size(h)} must be "
                             f"{names} ({sizes()})")

    if mask.attn_indices is not None:
        others = [n for n in present if n != "attn_indices"]
        if others:
            raise ValueError(f"attn_indices: an index mask takes no other mask tensors, got "
                             f"{others} too")
        idx = mask.attn_indices
        _check_tensor("attn_indices", idx, _INT, "an int32 or int64 tensor", device)
        if idx.dim() != 4 or idx.shape[2] != Lq:
            raise ValueError(f"attn_indices: shape {shown_shape(idx)}, expected (B|1, Hkv|1, Lq, "
                             f"W) with Lq={shown_size(Lq)}")
        batch_heads("attn_indices", idx, kv_heads_only=True)
        return

    nQB, nKB = -(-Lq // block_q), -(-Lk // block_k)

    def blocks_text(rows):
        if rows == "q":
            return (f"nQB=ceil(Lq/block_q)={shown_size(nQB)} (Lq={shown_size(Lq)}, "
                    f"block_q={shown_size(block_q)})")
        return (f"nKB=ceil(Lk/block_k)={shown_size(nKB)} (Lk={shown_size(Lk)}, "
                f"block_k={shown_size(block_k)})")
    # block lists: a count and its index come together; partial and full lists of a
    # direction too; transposed (q) lists only with the kv lists they transpose
    given = {}
    for count_name, index_name, rows in _LISTS:
        count, index = getattr(mask, count_name), getattr(mask, index_name)
        if (count is None) != (index is None):
            have, miss = (count_name, index_name) if index is None else (index_name, count_name)
            raise ValueError(f"{have}: given without {miss}; a block list is a (count, index) "
                             f"pair (leave both out to have it built)")
        given[count_name] = count is not None
        if count is None:
            continue
        _check_tensor(count_name, count, _INT, "an int32 or int64 tensor", device)
        _check_tensor(index_name, index, _INT, "an int32 or int64 tensor", device)
        if count.dim() != 3 or count.shape[2] != (nQB if rows == "q" else nKB):
            raise ValueError(f"{count_name}: shape {shown_shape(count)}, expected (B|1, H|1, n) "
                             f"with n = {blocks_text(rows)}")
        batch_heads(count_name, count)
        if (index.dim() not in (4, 5) or index.shape[0] != count.shape[0]
                or index.shape[1] != count.shape[1] or index.shape[2] != count.shape[2]
                or (index.dim() == 5 and (index.shape[4] != 2 or index.shape[3] < 1
                                          or index.shape[3] > MAX_RANGES))):
            raise ValueError(f"{index_name}: shape {shown_shape(index)}, expected "
                             f"{shown_shape(count) + ('W',)} (explicit) or "
                             f"{shown_shape(count) + ('R', 2)} with 1 <= R <= {MAX_RANGES} "
                             f"(range form), the dims of {count_name} {shown_shape(count)} first")
    for a, b in (("kv_count", "kv_full_count"), ("q_count", "q_full_count")):
        if given[a] != given[b]:
            have, miss = (a, b) if given[a] else (b, a)
            raise ValueError(f"{have}: given without {miss} (and its index); the partial and "
                             f"full lists of a direction come together (give both or neither)")
    if given["q_count"] and not given["kv_count"]:
        raise ValueError("q_count: the transposed (q) lists were given without the kv lists; "
                         "give the kv lists too, or leave the q lists out to have them built")

    dm = mask.dense_mask
    if dm is not None:
        _check_tensor("dense_mask", dm, (torch.bool,), "a bool tensor", device)
        if dm.dim() != 4 or not (dm.shape[2] == 1 or dm.shape[2] == Lq) or not (
                dm.shape[3] == 1 or dm.shape[3] == Lk):
            raise ValueError(f"dense_mask: shape {shown_shape(dm)} is not broadcastable to "
                             f"(B, Hq, Lq, Lk): expected 4-D (B|1, Hq|Hkv|1, Lq|1, Lk|1) with "
                             f"{sizes()}, Lq={shown_size(Lq)}, Lk={shown_size(Lk)}")
        batch_heads("dense_mask", dm)
    cr = mask.col_ranges
    if cr is not None:
        _check_tensor("col_ranges", cr, _INT, "an int32 or int64 tensor", device)
        if cr.dim() != 4 or cr.shape[2] != Lk or cr.shape[3] % 2 != 0:
            raise ValueError(f"col_ranges: shape {shown_shape(cr)}, expected (B|1, H|1, Lk, 2m) "
                             f"with Lk={shown_size(Lk)} (m masked intervals [start, end) per "
                             f"key column)")
        batch_heads("col_ranges", cr)
    w = mask.window
    if w is not None:
        _check_tensor("window", w, (torch.int32,), "an int32 tensor", device)
        if w.shape != (2,):
            raise ValueError(f"window: shape {shown_shape(w)}, expected (2,): (left, right) of the "
                             f"sliding window that col_ranges hold")
        if cr is None:
            raise ValueError("window: given without col_ranges (it describes them: the kernels "
                             "may read either)")
    pbi, pb = mask.partial_bits_index, mask.partial_bits
    if (pbi is None) != (pb is None):
        have, miss = ("partial_bits_index", "partial_bits") if pb is None else (
            "partial_bits", "partial_bits_index")
        raise ValueError(f"{have}: given without {miss}; the bitmaps need both")
    if pbi is not None:
        _check_tensor("partial_bits_index", pbi, _INT, "an int32 or int64 tensor", device)
        _check_tensor("partial_bits", pb, _INT, "an int32 or int64 tensor", device)
        if pbi.dim() != 4 or pbi.shape[2] != nQB or pbi.shape[3] != nKB:
            raise ValueError(f"partial_bits_index: shape {shown_shape(pbi)}, expected "
                             f"(B|1, H|1, nQB, nKB) with {blocks_text('q')}, {blocks_text('k')}")
        batch_heads("partial_bits_index", pbi)
        words = -(-block_k // 32)
        if pb.dim() != 3 or pb.shape[1] != block_q or pb.shape[2] != words:
            raise ValueError(f"partial_bits: shape {shown_shape(pb)}, expected (P, block_q, "
                             f"ceil(block_k/32)) = (P, {block_q}, {words})")


def _check_inputs(query, key, value, bias, mask, block_q, block_k):
    check_qkv(query, key, value)
    check_bias(bias, query, key)
    check_mask(mask, query, key, block_q, block_k)


# Inputs that passed, by layout: the shapes, dtypes and devices the checks read, and the
# mask tensors by identity and version (weak references: a dropped descriptor is not kept
# alive, and a new tensor at a reused address is told apart). A training step that reuses
# its descriptor costs a key and a lookup (~5 us on a slow CPU) instead of the checks
# (~30 us). Any in-place change of a mask tensor's shape bumps its version.
_PASSED = collections.OrderedDict()
_PASSED_SIZE = 8


def _layout_key(query, key, value, bias, mask, block_q, block_k):
    """The key of a call whose tensors are all plain eager tensors, else None (fake tensors
    while tracing, tensor subclasses, inference tensors without a version counter)."""
    if type(query) is not torch.Tensor or type(key) is not torch.Tensor \
            or type(value) is not torch.Tensor:
        return None
    try:
        present = [t for t in mask if t is not None]
        if any(type(t) is not torch.Tensor for t in present):
            return None
        versions = tuple([t._version for t in present])
    except RuntimeError:            # inference tensors have no version counter
        return None
    b = None if bias is None else (type(bias), bias.shape, bias.dtype, bias.device)
    return (query.shape, key.shape, value.shape, query.device, key.device, value.device, b,
            tuple(map(id, mask)), versions, block_q, block_k), present


def check_inputs(query, key, value, bias, mask, block_q, block_k):
    """All of the forward op's tensor inputs (the backward's also go through check_backward):
    query/key/value, bias and the mask tensors (a schema.MaskTensors)."""
    got = _layout_key(query, key, value, bias, mask, block_q, block_k)
    if got is None:
        _check_inputs(query, key, value, bias, mask, block_q, block_k)
        return
    k, present = got
    hit = _PASSED.get(k)
    if hit is not None and all(r() is t for r, t in zip(hit, present)):
        _PASSED.move_to_end(k)
        return
    _check_inputs(query, key, value, bias, mask, block_q, block_k)
    _PASSED[k] = [weakref.ref(t) for t in present]
    while len(_PASSED) > _PASSED_SIZE:
        _PASSED.popitem(last=False)


def check_backward(grad_out, grad_lse, query, value, out, lse):
    """The backward op's own tensors: out / grad_out (B, Hq, Lq, Dv), lse / grad_lse (B, Hq, Lq)."""
    B, Hq, Lq = query.shape[:3]
    want = (B, Hq, Lq, value.shape[3])
    for name, t, shape in (("grad_out", grad_out, want), ("out", out, want),
                           ("lse", lse, want[:3]), ("grad_lse", grad_lse, want[:3])):
        if t is None and name == "grad_lse":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: must be a tensor, got {type(t).__name__}")
        if t.device != query.device:
            raise ValueError(f"{name}: is on {t.device} but query is on {query.device}")
        if t.dim() != len(shape) or any(a != b for a, b in zip(t.shape, shape)):
            raise ValueError(f"{name}: shape {shown_shape(t)}, expected "
                             f"{tuple(shown_size(s) for s in shape)}")


# ---- FLEXSPARSE_DEBUG=1: the values of the mask tensors (reads data)

def debug_enabled() -> bool:
    """FLEXSPARSE_DEBUG=1 in the environment (read per call)."""
    return os.environ.get("FLEXSPARSE_DEBUG") == "1"


def _data_faults(mask, Lq, Lk, block_q, block_k):
    """(argument name, bool tensor of faults, message for the first fault) of each mask
    tensor whose values can be checked: block lists (entries inside the block grid,
    counts within their rows), partial_bits_index (-1 or a bitmap of the pool),
    attn_indices (-1 or a key). Tensor ops only, on the tensors' device."""
    nQB, nKB = -(-Lq // block_q), -(-Lk // block_k)
    out = []
    for count_name, index_name, rows in _LISTS:
        count, index = getattr(mask, count_name), getattr(mask, index_name)
        if count is None or index is None:
            continue
        n = nKB if rows == "q" else nQB
        count, index = count.long(), index.long()
        if index.dim() == 5:            # range form: [lo, hi) inside [0, n], lo <= hi
            lo, hi = index[..., 0], index[..., 1]
            width = (hi - lo).clamp(min=0).sum(-1)
            bad = (lo < 0) | (hi > n) | (hi < lo)
            out.append((index_name, bad, lambda index=index, bad=bad, n=n, name=index_name:
                        f"mask: descriptor list {name} holds a range outside [0, {n}] or "
                        f"with hi < lo: {index[bad][0].tolist()}"))
        else:
            width = torch.full_like(count, index.shape[-1])
            used = torch.arange(index.shape[-1], device=index.device) < count[..., None]
            bad = used & ((index < 0) | (index >= n))
            out.append((index_name, bad, lambda index=index, bad=bad, n=n, name=index_name:
                        f"mask: descriptor list {name} holds block {int(index[bad][0])} "
                        f"outside [0, {n})"))
        bad_count = (count < 0) | (count > width)
        out.append((count_name, bad_count, lambda count=count, bad=bad_count, name=count_name:
                    f"mask: descriptor list {name} holds {int(count[bad][0])}, outside "
                    f"[0, its row's width]"))
    pbi, pb = mask.partial_bits_index, mask.partial_bits
    if pbi is not None and pb is not None:
        P = pb.shape[0]
        bad = (pbi < -1) | (pbi >= P)
        out.append(("partial_bits_index", bad, lambda pbi=pbi, bad=bad, P=P:
                    f"mask: descriptor tensor partial_bits_index holds {int(pbi[bad][0])}, "
                    f"not -1 or a bitmap of the pool [0, {P})"))
    w = mask.window
    if w is not None:
        bad = (w < 0) | (w >= WINDOW_LIMIT)
        out.append(("window", bad, lambda w=w: f"mask: descriptor tensor window holds "
                    f"{w.tolist()}, not (left, right) in [0, {WINDOW_LIMIT})"))
    idx = mask.attn_indices
    if idx is not None:
        bad = (idx < -1) | (idx >= Lk)
        out.append(("attn_indices", bad, lambda idx=idx, bad=bad:
                    f"mask: descriptor tensor attn_indices holds {int(idx[bad][0])}, not -1 "
                    f"or a key in [0, Lk={Lk})"))
    return out


def check_mask_data(mask, Lq, Lk, block_q, block_k) -> None:
    """FLEXSPARSE_DEBUG=1, before any kernel: ValueError naming the first mask tensor that
    holds a value the kernels would skip or clamp (a hand-made or corrupted descriptor).
    Reads the faults back on the host: one device sync per tensor. Without it the
    kernels stay in bounds but compute what the tensors say (docs/semantics.md,
    "Corrupted descriptors")."""
    for _, bad, message in _data_faults(mask, Lq, Lk, block_q, block_k):
        if bool(bad.any()):
            raise ValueError(message())


def assert_mask_data(mask, Lq, Lk, block_q, block_k) -> None:
    """The checks of check_mask_data as asserts in the graph (torch._assert_async), for
    compiled graphs whose kernels are C++ (the CUDA backend's ops, which run no Python):
    no host sync; on CPU a RuntimeError with the message, on CUDA a device-side assert
    (the CUDA context is lost; the message is not shown)."""
    for name, bad, _ in _data_faults(mask, Lq, Lk, block_q, block_k):
        torch._assert_async(~bad.any(), f"mask: descriptor tensor {name} holds a value "
                                        f"outside its range (FLEXSPARSE_DEBUG=1)")
