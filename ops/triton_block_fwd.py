"""The forward block kernel and the host code that plans its launch.

One program = one BLOCK_M query tile of one (b, query head). It walks the partial key-block
list (kv_count / kv_index, element predicates applied), then the full list (kv_full_count /
kv_full_index, no element masking at all). Blocks in neither list are never touched.
Online softmax in the exp2 domain; out and lse (natural log) are written once at the end.
"""
import math

import triton
import triton.language as tl

from .triton_block_common import (
    _K, _LSE, _OUT, _Q, _V, FWD_SHORT_BLOCKS, CallArgs, CallPlan, _cdiv, _config, _even,
    _load_tile, _score, _strides, _tile_order, call_args)
from .triton_block_mask import (
    _cached_fact, _list_count, _list_row, _list_tile, _query_tile_visible, _ranges_load)


# ======================================================================================= kernel

@triton.jit
def _fwd_inner(acc, l_i, m_i, q, i, offs_n, offs_d, b, h,
               Kh, Vh, skn, skd, svn, svd, Bh, sbq, sbk,
               idx_ptr, n_iters, SUB: tl.constexpr, Lq, Lk, D, qb, block_q: tl.constexpr,
               block_k: tl.constexpr, qk_scale, cap_log2, preds,
               PARTIAL: tl.constexpr, HAS_DM: tl.constexpr, N_COL_RANGES: tl.constexpr,
               CR_KINDS: tl.constexpr,
               HAS_BITS: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
               EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
               RANGES: tl.constexpr):
    """One block list's key tiles into the running (acc, l_i, m_i); PARTIAL applies the
    element predicates."""
    d_ok = offs_d[:, None] < D
    if RANGES >= 0:      # else EMPTY_LIST: no row has a block
        walk = _ranges_load(idx_ptr, n_iters, RANGES)
        for it in range(n_iters):
            kb, pen, j = _list_tile(idx_ptr, walk, it, SUB, Lk, block_k, BLOCK_N, offs_n, RANGES)
            j_ok = j[None, :] < Lk
            kT = _load_tile(Kh + j[None, :] * skn + offs_d[:, None] * skd, j_ok, d_ok,
                            not EVEN_N, not EVEN_D)
            qk = tl.dot(q, kT)
            s, _ = _score(qk, qk_scale, cap_log2, pen, Bh, sbq, sbk, i[:, None], j[None, :],
                          i[:, None] < Lq, j_ok, HAS_BIAS, SOFTCAP)
            if PARTIAL:
                vis = _query_tile_visible(i, j, kb, qb, b, h, Lq, Lk, block_q, block_k, preds,
                                          HAS_DM, N_COL_RANGES, CR_KINDS, HAS_BITS, not EVEN_N)
                s = tl.where(vis, s, float("-inf"))

            elif not EVEN_N:
                s = tl.where(j_ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_use)
            p = tl.math.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            v = _load_tile(Vh + j[:, None] * svn + offs_d[None, :] * svd, j[:, None] < Lk,
                           offs_d[None, :] < D, not EVEN_N, not EVEN_D)
            acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, V, Out, Lse, Bias, q_strides, k_strides, v_strides, o_strides,
              bias_strides, kv_partial, kv_full, preds,
              Hq, G: tl.constexpr, Lq, Lk, D, block_q: tl.constexpr, block_k: tl.constexpr,
              SUB: tl.constexpr, qk_scale, cap_log2, rev_q,
              HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, HAS_DM: tl.constexpr,
              N_COL_RANGES: tl.constexpr, CR_KINDS: tl.constexpr, HAS_BITS: tl.constexpr,
              EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              KV_PARTIAL_RANGES: tl.constexpr, KV_FULL_RANGES: tl.constexpr):
    """One program per query tile. *_strides: (batch, head, row, column) of Q, K, V and Out;
    bias_strides: (batch, head, query, key, head divisor); kv_partial, kv_full:
    BlockListArgs tuples; preds: the PredicateArgs tuple (triton_block_mask)."""
    sqb, sqh, sqm, sqd = q_strides
    skb, skh, skn, skd = k_strides
    svb, svh, svn, svd = v_strides
    sob, soh, som, sod = o_strides
    sbb, sbh, sbq, sbk, b_hdiv = bias_strides
    KV_COUNT, KV_INDEX, kvp_sb, kvp_sh, kvp_hdiv, kvp_W, kvp_rs = kv_partial
    KV_FULL_COUNT, KV_FULL_INDEX, kvf_sb, kvf_sh, kvf_hdiv, kvf_W, kvf_rs = kv_full
    pid_m = _tile_order(tl.program_id(0), tl.num_programs(0), rev_q)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // G
    m0 = pid_m * BLOCK_M
    qb = m0 // block_q
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    i = m0 + offs_m
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    hk64 = hk.to(tl.int64)

    q = _load_tile(Q + b64 * sqb + h64 * sqh + i[:, None] * sqm + offs_d[None, :] * sqd,
                   i[:, None] < Lq, offs_d[None, :] < D, not EVEN_M, not EVEN_D)
    Kh = K + b64 * skb + hk64 * skh
    Vh = V + b64 * svb + hk64 * svh
    Bh = Bias + b64 * sbb + (h // b_hdiv).to(tl.int64) * sbh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    row = _list_row(b, h, qb, kvp_sb, kvp_sh, kvp_hdiv, kvp_rs)
    n_iters = _list_count(KV_COUNT + row, kvp_W, tl.cdiv(Lk, block_k), KV_PARTIAL_RANGES) * SUB
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, i, offs_n, offs_d, b, h, Kh, Vh, skn, skd, svn, svd, Bh, sbq, sbk,
        KV_INDEX + row.to(tl.int64) * kvp_W, n_iters, SUB, Lq, Lk, D, qb, block_q, block_k,
        qk_scale, cap_log2, preds,
        True, HAS_DM, N_COL_RANGES, CR_KINDS, HAS_BITS, HAS_BIAS, SOFTCAP, EVEN_N, EVEN_D, BLOCK_N,
        KV_PARTIAL_RANGES)
    row = _list_row(b, h, qb, kvf_sb, kvf_sh, kvf_hdiv, kvf_rs)
    n_iters = _list_count(KV_FULL_COUNT + row, kvf_W, tl.cdiv(Lk, block_k), KV_FULL_RANGES) * SUB
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, i, offs_n, offs_d, b, h, Kh, Vh, skn, skd, svn, svd, Bh, sbq, sbk,
        KV_FULL_INDEX + row.to(tl.int64) * kvf_W, n_iters, SUB, Lq, Lk, D, qb, block_q, block_k,
        qk_scale, cap_log2, preds,
        False, HAS_DM, N_COL_RANGES, CR_KINDS, HAS_BITS, HAS_BIAS, SOFTCAP, EVEN_N, EVEN_D, BLOCK_N,
        KV_FULL_RANGES)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"),
                   (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    o_ptrs = Out + b64 * sob + h64 * soh + i[:, None] * som + offs_d[None, :] * sod
    if EVEN_M and EVEN_D:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty))
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty),
                 mask=(i[:, None] < Lq) & (offs_d[None, :] < D))
    l_ptrs = Lse + (b64 * Hq + h64) * Lq + i
    if EVEN_M:
        tl.store(l_ptrs, lse)
    else:
        tl.store(l_ptrs, lse, mask=i < Lq)


# ========================================================================================= host

def _mean_blocks_per_row(c: CallArgs, host_facts: bool):
    """Key blocks a query block visits on average (partial + full lists): one host sync
    per descriptor, cached; infinite (so: not short) while a CUDA graph is captured or
    without host facts (kernel option trim_lists=False)."""
    if not host_facts:
        return math.inf
    counts = (c.mask.kv_partial.count, c.mask.kv_full.count)

    def mean_blocks_per_row():
        return sum(t.float().mean().item() if t.numel() else 0.0 for t in counts)
    value = _cached_fact(counts, mean_blocks_per_row)
    return math.inf if value is None else value


def forward_plan(query, key, value, bias, mask, block_q, block_k, scale, softcap,
                 options) -> CallPlan:
    """The forward's launch for these layouts; its per-call tensors are the slots q, k, v,
    bias, out and lse."""
    B, Hq, Lq, D = query.shape
    Lk = key.shape[2]
    c = call_args(query, key, value, bias, mask, block_q, block_k, scale, softcap, options)
    m = c.mask
    short_work = (m.flags.N_COL_RANGES > 0 and not m.reverse_query_tiles
                  and _mean_blocks_per_row(c, options.trim_lists) <= FWD_SHORT_BLOCKS)
    BM, BN, warps, stages = _config("fwd", c.BLOCK_D, block_q, block_k, options,
                                    c.constexprs["HAS_BIAS"], short_work)
    o_strides = (Hq * Lq * value.shape[-1], Lq * value.shape[-1], value.shape[-1], 1)
    launch = (_attn_fwd, (_cdiv(Lq, BM), B * Hq), (
        _Q, _K, _V, _OUT, _LSE, c.bias.pointer,
        _strides(query), _strides(key), _strides(value), o_strides, c.bias.strides,
        tuple(m.kv_partial), tuple(m.kv_full), tuple(m.predicates),
        Hq, c.G, Lq, Lk, D, block_q, block_k, block_k // BN, c.qk_scale, c.cap_log2,
        m.reverse_query_tiles),
        dict(**c.constexprs, **m.ranges.kv_constexprs(), EVEN_M=_even(Lq, BM, block_q),
             EVEN_N=_even(Lk, BN, block_k),
             BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=c.BLOCK_D), warps, stages)
    return CallPlan(c, [launch], {}, None)
