"""What the forward and backward block kernels share: device helpers (tile loads, the
score, the query-tile order) and host decisions taken once per call (tile configs per pass,
the call's scalar and bias arguments, the markers of its per-call tensors).

A descriptor block (block_q x block_k) is covered by (block_q / BLOCK_M) x (block_k /
BLOCK_N) kernel tiles; the list loops are flattened ("iteration it -> list entry it // SUB,
sub-tile it % SUB") so that Triton pipelines one loop. Scores live in the exp2 domain
(log2(e) folded into the scale).
"""
from typing import Callable, NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .kernel_options import DEFAULT as DEFAULT_OPTIONS
from .triton_block_mask import MaskArgs, _bstride, _head_div, mask_args
from .triton_compat import interpreting
from .triton_launch import Slot

LOG2E = 1.4426950408889634


# =============================================================================== device helpers

@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1); saturates cleanly to +-1 in float32.
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def _load_tile(ptrs, r_ok, c_ok, NEED_R: tl.constexpr, NEED_C: tl.constexpr):
    """A tile load with only the bounds masks the caller needs (NEED_R rows, NEED_C
    columns; a tile that divides the length needs none)."""
    if NEED_R and NEED_C:
        x = tl.load(ptrs, mask=r_ok & c_ok, other=0.0)
    elif NEED_R:
        x = tl.load(ptrs, mask=r_ok, other=0.0)
    elif NEED_C:
        x = tl.load(ptrs, mask=c_ok, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _score(qk, qk_scale, cap_log2, pen, Bh, sbq, sbk, i, j, i_ok, j_ok, HAS_BIAS: tl.constexpr,
           SOFTCAP: tl.constexpr):
    """The score in the exp2 domain, qk * scale (through the softcap) + bias * log2(e), and
    tanh's value for the softcap's derivative (the scaled score when there is none).
    i, j (and their bounds checks): query and key indices in the tile's orientation.
    pen: 0, or -inf for a tile a corrupted descriptor listed out of range (_block_at):
    such a tile's scores are all -inf, whatever q, k or the bias hold (a select, since
    adding -inf would let a NaN through)."""
    if SOFTCAP:
        t = _tanh(qk * qk_scale)
        s = t * cap_log2
    else:
        t = qk * qk_scale
        s = qk * qk_scale
    if HAS_BIAS:
        bias = tl.load(Bh + i * sbq + j * sbk, mask=i_ok & j_ok, other=0.0)
        s += bias.to(tl.float32) * 1.4426950408889634
    s = tl.where(pen == 0.0, s, float("-inf"))
    return s, t


@triton.jit
def _tile_order(pid, n, rev_q):
    """Query tile of program pid: last tile first when rev_q, for masks whose work grows
    with the query index (causal, prefix-LM), so that the heavy tiles start first and the
    tail of the grid holds light ones. Kept in order otherwise: sliding windows lost
    reversed (docs/perf-notes.md change 10)."""
    return pid + rev_q * (n - 1 - 2 * pid)


# ================================================================================= tile configs

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256

# Per-pass tile configs (BLOCK_M, BLOCK_N, num_warps, num_stages), keyed by padded head dim,
# from H100 sweeps (docs/perf-notes.md changes 1, 8 and 11). BLOCK_M / BLOCK_N are shrunk
# to divide the descriptor block when needed. hd128 backward: dK/dV at 3 stages and dQ on
# 128x64 tiles (FlexAttention's H100 choice); hd64 forward on 128x128 tiles with 4 warps
# (also FlexAttention's).
_GPU_CONFIGS = {
    "fwd": {64: (128, 128, 4, 3), 128: (128, 128, 8, 3), 256: (64, 64, 4, 2)},
    "dkdv": {64: (64, 64, 4, 3), 128: (64, 128, 8, 3), 256: (32, 64, 4, 1)},
    "dq": {64: (64, 64, 4, 3), 128: (128, 64, 8, 2), 256: (64, 32, 4, 1)},
}
# With a bias tile to load per step (docs/perf-notes.md changes 8, 11 and 15): the hd128
# forward on 128x64 tiles; for a full-shape dbias (the dK/dV pass stores dS, the dQ pass
# reads it back) dK/dV on 32x64 tiles with one warpgroup and 4 stages (~110 KB of shared
# memory: two programs per SM, so one's bias reads and dS stores overlap the other's
# matmuls) and dQ on 128x128 tiles at 3 stages.
_BIAS_CONFIGS = {"fwd": {128: (128, 64, 8, 3)}, "dkdv": {128: (32, 64, 4, 4)},
                 "dq": {128: (128, 128, 8, 3)}}
# Short or irregular per-tile work: one warpgroup per program on small tiles, so two
# programs share an SM and one's softmax (or prologue and epilogue) overlaps the other's
# matmuls. Backward (docs/perf-notes.md change 11): explicit block lists, and column
# ranges that also hide rows below the keys (windows, documents); long uniform loops
# (full, causal, prefix-LM) lose on them and keep the big tiles. Forward (change 19): the
# same column ranges when the query blocks visit at most FWD_SHORT_BLOCKS key blocks on
# average (document 16K, 11.9 blocks per row, lost 10% on them).
_SHORT_WORK_CONFIGS = {"dkdv": {128: (64, 64, 4, 2)}, "dq": {128: (64, 64, 4, 2)},
                       "fwd": {128: (128, 32, 4, 3)}}
FWD_SHORT_BLOCKS = 8
# Under TRITON_INTERPRET=1 (CPU tests) bigger tiles mean fewer interpreted ops.
_INTERPRET_TILE = 32


def _pow2_divisor(pref: int, block: int) -> int:
    t = pref
    while t > 1 and block % t != 0:
        t //= 2
    if t < 16:
        raise NotImplementedError(
            f"triton: descriptor block size {block} has no power-of-two divisor >= 16 "
            f"(kernel tiles need 16 | block size)")
    return t


def _config(kind, D_pad, block_q, block_k, options, has_bias=False, short_work=False):
    """(BLOCK_M, BLOCK_N, warps, stages) of one pass. has_bias: a bias tile per step (for
    the backward passes: the full-shape dbias plan whose dQ pass reads the stored dS);
    short_work: per-tile work is short or irregular (see _SHORT_WORK_CONFIGS); a config
    forced by the kernel options wins."""
    if options.config(kind) is not None:
        bm, bn, warps, stages = options.config(kind)
    elif interpreting():
        bm, bn, warps, stages = _INTERPRET_TILE, _INTERPRET_TILE, 4, 1
    else:
        key = 64 if D_pad <= 64 else (128 if D_pad <= 128 else 256)
        bm, bn, warps, stages = _GPU_CONFIGS[kind][key]
        if has_bias and key in _BIAS_CONFIGS.get(kind, {}):
            bm, bn, warps, stages = _BIAS_CONFIGS[kind][key]
        elif short_work and key in _SHORT_WORK_CONFIGS.get(kind, {}):
            bm, bn, warps, stages = _SHORT_WORK_CONFIGS[kind][key]
    return _pow2_divisor(bm, block_q), _pow2_divisor(bn, block_k), warps, stages


def _even(length, tile, block):
    """True when no tile needs bounds masks along this axis. Along the axis a pass walks
    the lists, it visits whole descriptor blocks tile by tile, so the last block's tiles past
    the length (L=64 at block 128 with 64-wide tiles) must be masked even when the tile
    divides the length. Along its grid axis the tile alone would do; the same test is used
    there too, which only adds masks for lengths that divide the tile but not the block."""
    return length % tile == 0 and length % block == 0


def _cdiv(a, b):
    # plain Python: triton.cdiv is a JIT-aware function, ~7 us of host time per call
    return -(-a // b)


def _strides(t):
    return tuple(t.stride())


# =========================================================================== per-call arguments

# Markers for the per-call tensors in recorded launch arguments (triton_launch.Slot): a
# call's launches are built once with these, and each call fills in its own tensors
# (triton_block._Call).
_Q, _K, _V, _DO, _OUT, _LSE, _GLSE, _DELTA, _LSE2, _DQ, _DK, _DV, _DB, _DBQ, _DQA = map(
    Slot, ("q", "k", "v", "do", "out", "lse", "glse", "delta", "lse2", "dq", "dk", "dv", "db",
           "dbq", "dqa"))
_BIAS = Slot("bias")


class BiasArgs(NamedTuple):
    """The bias as kernel arguments: Bias, and bias_strides = (sbb, sbh, sbq, sbk, b_hdiv)
    in the kernels."""
    pointer: object             # the _BIAS slot, or a dummy tensor without a bias
    strides: tuple              # (batch, head, query, key) strides and the head divisor


class CallArgs(NamedTuple):
    """The arguments a call's launches share: the descriptor's (MaskArgs), the sizes, the
    scale and the constexprs every attention kernel takes."""
    mask: MaskArgs
    B: int
    Hq: int
    Hkv: int
    G: int                      # query heads per kv head
    Lq: int
    Lk: int
    D: int
    BLOCK_D: int                # D padded to a power of two >= 16
    bias: BiasArgs
    qk_scale: float             # scale * log2(e), or scale / softcap under a softcap
    cap_log2: float             # softcap * log2(e), 0 without one
    constexprs: dict            # PredicateFlags + HAS_BIAS, SOFTCAP, EVEN_D


def _bias_args(bias, Hq, Hkv, dummy):
    if bias is None:
        return BiasArgs(dummy, (0, 0, 0, 0, 1))
    # the tensor itself is a per-call argument (a Slot); its layout keys the call
    return BiasArgs(_BIAS, (_bstride(bias, 0), _bstride(bias, 1), _bstride(bias, 2),
                            _bstride(bias, 3), _head_div(bias.shape[1], Hq, Hkv, "bias")))


def call_args(query, key, value, bias, mask, block_q, block_k, scale, softcap,
              options=DEFAULT_OPTIONS) -> CallArgs:
    B, Hq, Lq, D = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    if Hq % Hkv != 0:
        raise ValueError(f"triton: Hq={Hq} not a multiple of Hkv={Hkv}")
    m = mask_args(mask, Hq, Hkv, Lq, Lk, block_q, block_k, query.device, options.trim_lists)
    softcap = float(softcap)
    if softcap > 0:
        qk_scale, cap_log2 = scale / softcap, softcap * LOG2E
    else:
        qk_scale, cap_log2 = scale * LOG2E, 0.0
    BLOCK_D = max(16, 1 << (D - 1).bit_length())
    constexprs = dict(m.flags._asdict(), HAS_BIAS=bias is not None, SOFTCAP=softcap > 0,
                      EVEN_D=BLOCK_D == D)
    return CallArgs(m, B, Hq, Hkv, Hq // Hkv, Lq, Lk, D, BLOCK_D,
                    _bias_args(bias, Hq, Hkv, m.dummy), qk_scale, cap_log2, constexprs)


class CallPlan(NamedTuple):
    """What one forward or backward call does for fixed layouts (triton_block._Call runs
    it): its launches (kernel, grid, args with Slot markers for the call's own tensors,
    constexpr kwargs, warps, stages), the scratch tensors it allocates per call (name ->
    (shape, dtype, zeroed)) and how the results come out of the call's tensors (backward).
    `args` keeps the descriptor's tensors, whose ids key the recorded call, alive."""
    args: CallArgs
    launches: list
    scratch: dict
    finish: Optional[Callable]
