"""Hugging Face transformers backend: `attn_implementation="flexsparse"`.

    from flexsparse.integrations import transformers as fs_hf
    fs_hf.register()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="flexsparse")

`register()` adds the name to both of transformers' registries (5.x): the attention
function (`AttentionInterface`) and the mask function (`AttentionMaskInterface`). Without
the mask function transformers would pass no mask at all.

Masks (docs/transformers.md). transformers describes each layer's mask as a mask function
`f(b, h, q_idx, kv_idx) -> bool` built from its own pieces (causal, sliding-window and
chunked overlays, packed sequences from position_ids) plus a 2-D padding mask. `mask()`
recognizes those pieces and returns an O(N) flexsparse mask instead of a dense
(B, 1, Lq, Lk) bool tensor:
- plain causal (or bidirectional) without padding, positions aligned bottom-right (no cache,
  or a dynamic / sliding-window KV cache): `masks.causal()` / `masks.sliding_window(w - 1)`
  / `masks.full()`, whose descriptors are cached across layers and steps;
- anything else it recognizes (padding, packed sequences, chunked attention, a static cache,
  offsets): one visible query-row interval per key column, as a FlashMask-style
  `masks.column_ranges` mask built with O(B x Lk) tensor ops (no data-dependent shapes).
Recognition reads the structure of transformers' closures (private: names, free
variables); anything it does not know (or_masks, blockwise overlays, custom functions, a
changed transformers) goes to the generic path, transformers' `sdpa_mask`: a dense bool
mask. `CHECK = True` (or FLEXSPARSE_HF_CHECK=1) compares every recognized mask with the
generic one (dense, slow; for tests). Softcap (Gemma 2), scaling and GQA are passed through.
"""
import os

import torch

import flexsparse
from flexsparse import masks

NAME = "flexsparse"

# Compare each recognized mask with transformers' dense mask (AssertionError on mismatch).
CHECK = os.environ.get("FLEXSPARSE_HF_CHECK") == "1"

# Counters for tests and curious users: how each mask call was served.
STATS = {"named": 0, "column_ranges": 0, "generic": 0}

_MU = "transformers.masking_utils"


# ------------------------------------------------------------------ recognition

class _Unknown(Exception):
    """The mask function has a structure this module does not know."""


def _free_vars(fn):
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    if code is None or len(code.co_freevars) != len(cells):
        raise _Unknown(fn)
    return {n: c.cell_contents for n, c in zip(code.co_freevars, cells)}


def _kind(fn):
    """(qualname, free variables) of a transformers.masking_utils function, else _Unknown."""
    if getattr(fn, "__module__", None) != _MU:
        raise _Unknown(fn)
    return fn.__qualname__, _free_vars(fn)


def _parse(fn, s, remapped=False):
    """Fill the dict `s` with the terms of an AND of known pieces; raise _Unknown otherwise."""
    import transformers.masking_utils as mu
    if fn is mu.causal_mask_function:
        s["causal"] = True
        return
    if fn is mu.bidirectional_mask_function:
        return                                  # no constraint
    name, fv = _kind(fn)
    if name == "and_masks.<locals>.and_mask" and set(fv) == {"mask_functions"}:
        for f in fv["mask_functions"]:
            _parse(f, s, remapped)
        return
    if name == "sliding_window_overlay.<locals>.inner_mask" and set(fv) == {"sliding_window"}:
        w = fv["sliding_window"]
        if not isinstance(w, int) or isinstance(w, bool):
            raise _Unknown(fn)
        s["windows"].append(w)
        return
    if (name == "sliding_window_bidirectional_overlay.<locals>.inner_mask"
            and set(fv) == {"sliding_window"}):
        w = fv["sliding_window"]
        if not isinstance(w, int) or isinstance(w, bool):
            raise _Unknown(fn)
        s["bi_windows"].append(w)
        return
    if name == "chunked_overlay.<locals>.inner_mask" and set(fv) == {"chunk_size", "left_padding"}:
        c, lp = fv["chunk_size"], fv["left_padding"]
        if not isinstance(c, int) or c <= 0 or not isinstance(lp, torch.Tensor) or lp.dim() != 1:
            raise _Unknown(fn)
        s["chunks"].append((c, lp))
        return
    if (name == "padding_mask_function.<locals>.inner_mask" and set(fv) == {"padding_mask"}
            and not remapped):
        s["paddings"].append(fv["padding_mask"])
        return
    if (name == "packed_sequence_mask_function.<locals>.inner_mask"
            and set(fv) == {"packed_sequence_mask"} and not remapped):
        s["packed"].append(fv["packed_sequence_mask"])
        return
    if (name == "remap_positions_for_packed_sequence.<locals>.inner_mask"
            and set(fv) == {"mask_function", "position_ids"} and not remapped):
        s["positions"].append(fv["position_ids"])
        _parse(fv["mask_function"], s, remapped=True)
        return
    raise _Unknown(fn)


def _structure(mask_function):
    """The recognized terms of `mask_function`, or None."""
    s = dict(causal=False, windows=[], bi_windows=[], chunks=[], paddings=[], packed=[],
             positions=[])
    try:
        _parse(mask_function, s)
    except _Unknown:
        return None
    # Packed sequences: one packed-id mask (the documents are the runs of equal ids), with
    # one position remap (transformers >= 5.24: positions restart in each document) or
    # without (earlier 5.x: the mask function sees the row's own indices).
    if len(s["packed"]) > 1 or len(s["positions"]) > len(s["packed"]):
        return None
    return s


def _doc_bounds(ids):
    """(start, end) of the run of equal ids around each index: ids (B, L) -> two (B, L)."""
    B, L = ids.shape
    idx = torch.arange(L, device=ids.device).expand(B, L)
    new = torch.ones_like(ids, dtype=torch.bool)
    new[:, 1:] = ids[:, 1:] != ids[:, :-1]
    start = torch.where(new, idx, torch.zeros_like(idx)).cummax(-1).values
    last = torch.ones_like(new)
    last[:, :-1] = new[:, 1:]
    end = torch.where(last, idx + 1, torch.full_like(idx, L)).flip(-1).cummin(-1).values.flip(-1)
    return start, end


def _column_intervals(s, B, Lq, Lk, q_offset, kv_offset, attention_mask, device):
    """Visible query rows [lo, hi) of each key column, int64 (B, Lk), for the structure s.

    Row i is at position qpos(i), key column j at kpos(j): without packing qpos = q_offset + i,
    kpos = kv_offset + j; with packing both are position_ids, consecutive inside a document,
    so for rows of key j's document qpos(i) = i + A_j with A_j = pos_j - j.
    """
    j = torch.arange(Lk, device=device, dtype=torch.int64).expand(B, Lk)
    lo = torch.zeros(B, Lk, dtype=torch.int64, device=device)
    hi = torch.full((B, Lk), Lq, dtype=torch.int64, device=device)
    if s["packed"]:
        if not (isinstance(q_offset, int) and isinstance(kv_offset, int)
                and q_offset == 0 and kv_offset == 0 and Lq == Lk):
            return None
        ids = s["packed"][0]
        if ids.shape != (B, Lk):
            return None
        start, end = _doc_bounds(ids.to(device))
        lo, hi = torch.maximum(lo, start), torch.minimum(hi, end)
        if s["positions"]:
            pos = s["positions"][0]
            if pos.shape[-1] != Lk:
                return None
            pos = pos.to(device=device, dtype=torch.int64).expand(B, Lk)
            kpos, A = pos, pos - j
        else:
            kpos, A = j, torch.zeros((), device=device, dtype=torch.int64)
    else:
        kpos = j + kv_offset
        A = torch.as_tensor(q_offset, device=device, dtype=torch.int64)
    if s["causal"]:
        lo = torch.maximum(lo, kpos - A)                    # qpos >= kpos
    for w in s["windows"]:
        hi = torch.minimum(hi, kpos - A + w)                # kpos > qpos - w
    for w in s["bi_windows"]:
        lo = torch.maximum(lo, kpos - A - w)                # |qpos - kpos| <= w
        hi = torch.minimum(hi, kpos - A + w + 1)
    for c, lp in s["chunks"]:
        lp = lp.to(device=device, dtype=torch.int64)[:, None]
        if lp.shape[0] != B:
            return None
        first = torch.div(kpos - lp, c, rounding_mode="floor") * c + lp    # chunk start
        lo = torch.maximum(lo, first - A)
        hi = torch.minimum(hi, first + c - A)
    pads = list(s["paddings"])
    if attention_mask is not None:
        pads.append(attention_mask)
    for pm in pads:
        if pm.dim() != 2 or pm.shape[0] not in (1, B):
            return None
        pm = pm.to(device=device, dtype=torch.bool)
        need = kv_offset + Lk - pm.shape[-1]                # transformers pads with False
        if need > 0:
            pm = torch.nn.functional.pad(pm, (0, need))
        seen = pm[:, kv_offset:kv_offset + Lk]
        hi = torch.where(seen, hi, lo)                      # a padding key: no row sees it
    return lo.clamp(0, Lq), hi.clamp(0, Lq)


def recognize(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
              attention_mask=None, device="cpu"):
    """The flexsparse mask equal to transformers' mask for these arguments, or None when the
    structure is not recognized. Named masks where they are exact, else column ranges."""
    r = _recognize(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                   attention_mask, device)
    return None if r is None else r[0]


def _recognize(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
               attention_mask, device):
    """(mask, "named" | "column_ranges") or None."""
    import transformers.masking_utils as mu
    if torch.compiler.is_compiling():
        # Dynamo cannot read the closures it builds (and reading them corrupts its cell
        # tracking): compiled models get transformers' dense mask.
        return None
    s = _structure(mu.causal_mask_function if mask_function is None else mask_function)
    if s is None:
        return None
    if attention_mask is not None and attention_mask.dim() != 2:
        return None
    windows, bi = s["windows"], s["bi_windows"]
    plain = (not s["packed"] and not s["chunks"] and not s["paddings"]
             and len(windows) + len(bi) <= 1 and all(w >= 1 for w in windows)
             and isinstance(q_offset, int) and isinstance(kv_offset, int)
             and q_offset - kv_offset == kv_length - q_length
             and (attention_mask is None or _all_true(attention_mask, kv_length, kv_offset)))
    if plain:       # bottom-right aligned, as flexsparse's named masks are
        right = 0 if s["causal"] else None
        if windows:      # kpos > qpos - w: qpos - kpos <= w - 1
            return masks.sliding_window(windows[0] - 1, right), "named"
        if bi:           # |qpos - kpos| <= w
            return masks.sliding_window(bi[0], 0 if s["causal"] else bi[0]), "named"
        return (masks.causal() if s["causal"] else masks.full()), "named"
    iv = _column_intervals(s, batch_size, q_length, kv_length, q_offset, kv_offset,
                           attention_mask, torch.device(device))
    if iv is None:
        return None
    lo, hi = iv
    # FlashMask non-causal C=2: rows >= hi and rows < lo are masked.
    t = torch.stack([hi, lo], -1)[:, None].contiguous()      # (B, 1, Lk, 2)
    m = masks.column_ranges(t, causal=False)
    m.owns_tensors = True     # `t` is made here: the mask keeps its descriptors (Mask.compile),
    return m, "column_ranges"  # so a forward's layers share one build


def _all_true(attention_mask, kv_length, kv_offset):
    """The 2-D mask keeps every key of this layer (an eager, host-synchronizing check)."""
    if torch.compiler.is_compiling() or attention_mask.shape[-1] < kv_offset + kv_length:
        return False
    return bool(attention_mask[:, kv_offset:kv_offset + kv_length].all())


def mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
         attention_mask=None, device="cpu", **kwargs):
    """transformers' mask-function contract (AttentionMaskInterface): a flexsparse mask
    where the structure is recognized, else transformers' sdpa_mask (dense bool or None)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask
    mask_function = causal_mask_function if mask_function is None else mask_function
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.bool()
    r = _recognize(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                   attention_mask, device)
    if r is None:
        STATS["generic"] += 1
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                         q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                         attention_mask=attention_mask, device=device, **kwargs)
    m, kind = r
    STATS[kind] += 1
    if CHECK and not torch.compiler.is_compiling():
        check(m, batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
              attention_mask, device, **kwargs)
    return m


def generic_dense(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, device="cpu", **kwargs):
    """transformers' own mask as a dense bool (B, 1, Lq, Lk) tensor, never None."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask
    kwargs = {k: v for k, v in kwargs.items()
              if k not in ("allow_is_causal_skip", "allow_is_bidirectional_skip")}
    d = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                  q_offset=q_offset, kv_offset=kv_offset,
                  mask_function=mask_function or causal_mask_function,
                  attention_mask=attention_mask, allow_is_causal_skip=False,
                  allow_is_bidirectional_skip=False, device=device, **kwargs)
    return d.expand(batch_size, 1, q_length, kv_length)


def check(m, batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
          attention_mask=None, device="cpu", **kwargs):
    """AssertionError unless the flexsparse mask `m` equals transformers' dense mask."""
    want = generic_dense(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                         attention_mask, device, **kwargs)
    got = m.to_dense(batch_size, 1, q_length, kv_length, device=want.device)
    got = got.expand(batch_size, 1, q_length, kv_length)
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[:5].tolist()
        raise AssertionError(f"flexsparse: recognized mask {m!r} differs from transformers' "
                             f"mask at (b, h, q, kv) {bad} (Lq={q_length}, Lk={kv_length}, "
                             f"q_offset={q_offset}, kv_offset={kv_offset})")


# ------------------------------------------------------------------ attention

def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, softcap=None, **kwargs):
    """transformers' attention-function contract: q (B, Hq, Lq, D), k/v (B, Hkv, Lk, D);
    returns (out (B, Lq, Hq, D), None)."""
    if dropout and module.training:
        raise ValueError(f"dropout: attention dropout is not supported by flexsparse, got {dropout}")
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions: flexsparse does not materialize attention weights")
    B, Hq, Lq = query.shape[:3]
    Hkv, Lk = key.shape[1], key.shape[2]
    bias = None
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        mask = masks.causal() if (causal and Lq > 1) else None
    elif isinstance(attention_mask, masks.Mask):
        mask = attention_mask
    elif attention_mask.dtype == torch.bool:
        mask = attention_mask
    else:   # an additive float mask (0 / large negative): a bias
        mask, bias = None, attention_mask.to(query.dtype)
    out = flexsparse.attention(query, key, value, mask, bias=bias, scale=scaling,
                               softcap=softcap or None)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make `attn_implementation="flexsparse"` available (transformers >= 5)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask)
