"""The backward block kernels and the host code that plans their launches.

* preprocess: delta = rowsum(dO * O) - grad_lse and lse in log2 units, per query row.
* dK/dV pass: one program = one BLOCK_N key tile of one (b, kv head); it loops over the G
  query heads of that kv head and walks the transposed lists (q_count / q_index, then
  q_full_count / q_full_index). No atomics for dK/dV.
* dQ pass: one program = one BLOCK_M query tile of one (b, query head), walking the kv lists
  again and recomputing P and dS (or, with a stored full-shape dS, reading it back).

The kernel option `bwd_mode` picks how the passes are launched:
  "two_pass":   a dK/dV launch, then a dQ launch that recomputes P and dS (7 matmuls/tile).
  "one_launch": the same two kinds of programs in one grid (FlexAttention's layout);
                two_pass where the dQ pass reads the stored dS (dq_from_ds).
  "atomic_dq":  the dK/dV pass also adds dS @ K into a float32 dQ with atomics, no dQ pass
                (FlashAttention-2; 5 matmuls/tile); two_pass when deterministic, with a
                per-query-row bias gradient (summed in the dQ pass) or dq_from_ds.
  "auto":       one_launch for head dims > 64, else two_pass (H100, docs/perf-notes.md
                change 6; the other modes are kept to time against these).

The bias gradient (DB_MODE of the dK/dV pass, or DB_COLSUM of the dQ pass) is planned in
backward_plan: summed over keys in the dQ pass for a (.., Lq, 1) bias, over queries in the
dK/dV pass for a (.., 1, Lk) bias, stored per element for a full-shape one (then the dQ
pass can read dS back instead of recomputing it), else added with float32 atomics.
"""
import torch
import triton
import triton.language as tl

from .visibility import from_groups_sum
from .triton_block_common import (
    _DB, _DBQ, _DELTA, _DK, _DO, _DQ, _DQA, _DV, _GLSE, _K, _LSE, _LSE2, _OUT, _Q, _V,
    CallPlan, _cdiv, _config, _even, _load_tile, _score, _strides, _tile_order, call_args)
from .triton_block_mask import (
    _cr_prefetch, _head_div, _in_ranges, _list_count, _list_row, _list_tile, _query_tile_visible,
    _ranges_load, _slots_on_rows, _visible)

# dbias modes of the dK/dV pass
DB_NONE, DB_STORE, DB_ATOMIC, DB_ROWSUM = 0, 1, 2, 3


# =================================================================================== preprocess

@triton.jit
def _bwd_preprocess(O, DO, LSE, GLSE, DEL, LSE2, o_strides, do_strides, Hq, Lq, D,
                    HAS_GLSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """delta = rowsum(dO * O) - grad_lse; lse2 = lse * log2(e), with -inf -> +inf (p = 0)."""
    sob, soh, som, sod = o_strides
    sdob, sdoh, sdom, sdod = do_strides
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    i = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (i[:, None] < Lq) & (offs_d[None, :] < D)
    o = tl.load(O + b * sob + h * soh + i[:, None] * som + offs_d[None, :] * sod, mask=ok,
                other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + i[:, None] * sdom + offs_d[None, :] * sdod, mask=ok,
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    r = (b * Hq + h) * Lq + i
    if HAS_GLSE:
        delta -= tl.load(GLSE + r, mask=i < Lq, other=0.0)
    lse = tl.load(LSE + r, mask=i < Lq, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(DEL + r, delta, mask=i < Lq)
    tl.store(LSE2 + r, lse2, mask=i < Lq)


# =================================================================================== dK/dV pass

@triton.jit
def _zero_skipped(DBh, sdbq, sdbk, j, offs_m, QIp, pc, QIf, fc, nQB, Lq, Lk, block_q: tl.constexpr,
                  SUB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  P_RANGES: tl.constexpr, F_RANGES: tl.constexpr):
    """Write zeros to the dbias tiles of the query blocks that this key tile skips
    (explicit lists are ascending: a merge walk; range-form lists: a range test)."""
    zero = tl.zeros([BLOCK_N, BLOCK_M], tl.float32).to(DBh.dtype.element_ty)
    pp = pc * 0
    fp = fc * 0
    for qb in range(nQB):
        if P_RANGES == 0:
            hit_p = tl.load(QIp + pp, mask=pp < pc, other=-1) == qb
        else:
            hit_p = _in_ranges(QIp, qb, P_RANGES)
        if F_RANGES == 0:
            hit_f = tl.load(QIf + fp, mask=fp < fc, other=-1) == qb
        else:
            hit_f = _in_ranges(QIf, qb, F_RANGES)
        miss = (hit_p.to(tl.int32) + hit_f.to(tl.int32)) == 0
        if miss:
            for t in range(SUB):
                i = qb * block_q + t * BLOCK_M + offs_m
                tl.store(DBh + i[None, :] * sdbq + j[:, None] * sdbk, zero,
                         mask=(i[None, :] < Lq) & (j[:, None] < Lk))
        pp += hit_p.to(tl.int32)
        fp += hit_f.to(tl.int32)


@triton.jit
def _bwd_kv_inner(dk, dv, dbacc, k, v, j, offs_m, offs_d, b, h,
                  Qh, sqm, sqd, DOh, sdm, sdd, LSE2h, DELh, Bh, sbq, sbk, DBh, sdbq, sdbk,
                  DQAh, idx_ptr, n_iters, SUB: tl.constexpr, Lq, Lk, D, kb, block_q: tl.constexpr,
                  block_k: tl.constexpr, scale, qk_scale, cap_log2, preds, slots,
                  PARTIAL: tl.constexpr, HAS_DM: tl.constexpr, N_COL_RANGES: tl.constexpr,
                  CR_KINDS: tl.constexpr,
                  HAS_BITS: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
                  DB_MODE: tl.constexpr, EVEN_M: tl.constexpr, EVEN_D: tl.constexpr,
                  BLOCK_M: tl.constexpr, RANGES: tl.constexpr, DQ_ATOMIC: tl.constexpr):
    """One block list's query tiles into (dk, dv, dbacc). Transposed tiles: rows = keys
    (BLOCK_N), columns = queries (BLOCK_M). slots: the key tile's column ranges
    (_cr_prefetch). DQ_ATOMIC: also add each tile's dQ share into the float32 (Lq, D) rows
    at DQAh."""
    d_okT = offs_d[:, None] < D
    d_ok = offs_d[None, :] < D
    j_ok = j[:, None] < Lk
    if RANGES >= 0:      # else EMPTY_LIST: no row has a block
        walk = _ranges_load(idx_ptr, n_iters, RANGES)
        for it in range(n_iters):
            qb, pen, i = _list_tile(idx_ptr, walk, it, SUB, Lq, block_q, BLOCK_M, offs_m, RANGES)
            i_ok = i < Lq
            qT = _load_tile(Qh + i[None, :] * sqm + offs_d[:, None] * sqd, i_ok[None, :], d_okT,
                            not EVEN_M, not EVEN_D)
            if EVEN_M:
                lse2 = tl.load(LSE2h + i)
                delta = tl.load(DELh + i)
            else:
                lse2 = tl.load(LSE2h + i, mask=i_ok, other=float("inf"))
                delta = tl.load(DELh + i, mask=i_ok, other=0.0)
            qk = tl.dot(k, qT)
            s, t = _score(qk, qk_scale, cap_log2, pen, Bh, sbq, sbk, i[None, :], j[:, None],
                          i_ok[None, :], j_ok, HAS_BIAS, SOFTCAP)
            pT = tl.math.exp2(s - lse2[None, :])
            if PARTIAL:
                vis = _visible(i[None, :], j[:, None], Lq, Lk, qb, kb, block_q, block_k, b, h,
                               preds, _slots_on_rows(slots),
                               HAS_DM, N_COL_RANGES, CR_KINDS, HAS_BITS, False, False)
                pT = tl.where(vis, pT, 0.0)
            do = _load_tile(DOh + i[:, None] * sdm + offs_d[None, :] * sdd, i_ok[:, None], d_ok,
                            not EVEN_M, not EVEN_D)
            dv = tl.dot(pT.to(do.dtype), do, dv)
            dpT = tl.dot(v, tl.trans(do))
            dsT = pT * (dpT - delta[None, :])
            if DB_MODE == 1:
                tl.store(DBh + i[None, :] * sdbq + j[:, None] * sdbk,
                         dsT.to(DBh.dtype.element_ty), mask=i_ok[None, :] & j_ok)
            elif DB_MODE == 2:
                tl.atomic_add(DBh + i[None, :] * sdbq + j[:, None] * sdbk, dsT,
                              mask=i_ok[None, :] & j_ok, sem="relaxed")
            elif DB_MODE == 3:
                dbacc += tl.sum(dsT, 1)
            if SOFTCAP:
                dsT = dsT * (1.0 - t * t)
            dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk)
            if DQ_ATOMIC:
                # Rows i >= Lq have p = 0 (lse2 = +inf) and columns j >= Lk meet zero K rows, so
                # only the stores need masking.
                dq = tl.dot(tl.trans(dsT.to(k.dtype)), k) * scale
                dq_ptrs = DQAh + i[:, None] * D + offs_d[None, :]
                if EVEN_M and EVEN_D:
                    tl.atomic_add(dq_ptrs, dq, sem="relaxed")
                else:
                    tl.atomic_add(dq_ptrs, dq, mask=i_ok[:, None] & d_ok, sem="relaxed")
    return dk, dv, dbacc


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE2, DEL, Bias, DB, DK, DV, DQA,
                   q_strides, k_strides, v_strides, do_strides, bias_strides, db_strides,
                   q_partial, q_full, preds,
                   Hq, Hkv, G: tl.constexpr, Lq, Lk, D, block_q: tl.constexpr,
                   block_k: tl.constexpr, SUB: tl.constexpr, nQB, scale, qk_scale, cap_log2,
                   HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, HAS_DM: tl.constexpr,
                   N_COL_RANGES: tl.constexpr, CR_KINDS: tl.constexpr, HAS_BITS: tl.constexpr,
                   DB_MODE: tl.constexpr,
                   ZERO_SKIPPED: tl.constexpr,
                   EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   Q_PARTIAL_RANGES: tl.constexpr, Q_FULL_RANGES: tl.constexpr,
                   DQ_ATOMIC: tl.constexpr):
    """The dK/dV pass (two_pass, atomic_dq): one program per key tile. Arguments as in
    _bwd_dkdv_program."""
    _bwd_dkdv_program(
        tl.program_id(0), tl.program_id(1), Q, K, V, DO, LSE2, DEL, Bias, DB, DK, DV, DQA,
        q_strides, k_strides, v_strides, do_strides, bias_strides, db_strides,
        q_partial, q_full, preds,
        Hq, Hkv, G, Lq, Lk, D, block_q, block_k, SUB, nQB, scale, qk_scale, cap_log2,
        HAS_BIAS, SOFTCAP, HAS_DM, N_COL_RANGES, CR_KINDS, HAS_BITS, DB_MODE, ZERO_SKIPPED,
        EVEN_M, EVEN_N, EVEN_D, BLOCK_M, BLOCK_N, BLOCK_D, Q_PARTIAL_RANGES, Q_FULL_RANGES,
        DQ_ATOMIC)


@triton.jit
def _bwd_dkdv_program(pid_n, pid_bh, Q, K, V, DO, LSE2, DEL, Bias, DB, DK, DV, DQA,
                      q_strides, k_strides, v_strides, do_strides, bias_strides, db_strides,
                      q_partial, q_full, preds,
                      Hq, Hkv, G: tl.constexpr, Lq, Lk, D, block_q: tl.constexpr,
                      block_k: tl.constexpr, SUB: tl.constexpr, nQB, scale, qk_scale,
                      cap_log2,
                      HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, HAS_DM: tl.constexpr,
                      N_COL_RANGES: tl.constexpr, CR_KINDS: tl.constexpr, HAS_BITS: tl.constexpr,
                      DB_MODE: tl.constexpr,
                      ZERO_SKIPPED: tl.constexpr,
                      EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      Q_PARTIAL_RANGES: tl.constexpr, Q_FULL_RANGES: tl.constexpr,
                      DQ_ATOMIC: tl.constexpr):
    """One dK/dV program: key tile pid_n of (b, kv head) pid_bh = b * Hkv + kv head.
    q/k/v/do_strides: (batch, head, row, column); bias_strides, db_strides: (batch, head,
    query, key, head divisor); q_partial, q_full: BlockListArgs tuples; preds: the
    PredicateArgs tuple (triton_block_mask)."""
    sqb, sqh, sqm, sqd = q_strides
    skb, skh, skn, skd = k_strides
    svb, svh, svn, svd = v_strides
    sdob, sdoh, sdom, sdod = do_strides
    sbb, sbh, sbq, sbk, b_hdiv = bias_strides
    sdbb, sdbh, sdbq, sdbk, db_hdiv = db_strides
    Q_COUNT, Q_INDEX, qp_sb, qp_sh, qp_hdiv, qp_W, qp_rs = q_partial
    Q_FULL_COUNT, Q_FULL_INDEX, qf_sb, qf_sh, qf_hdiv, qf_W, qf_rs = q_full
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    n0 = pid_n * BLOCK_N
    kb = n0 // block_k
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    j = n0 + offs_n
    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)
    j_ok = j[:, None] < Lk
    d_ok = offs_d[None, :] < D
    k = _load_tile(K + b64 * skb + hk64 * skh + j[:, None] * skn + offs_d[None, :] * skd,
                   j_ok, d_ok, not EVEN_N, not EVEN_D)
    v = _load_tile(V + b64 * svb + hk64 * svh + j[:, None] * svn + offs_d[None, :] * svd,
                   j_ok, d_ok, not EVEN_N, not EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(G):
        h = hk * G + g
        h64 = h.to(tl.int64)
        Qh = Q + b64 * sqb + h64 * sqh
        DOh = DO + b64 * sdob + h64 * sdoh
        LSE2h = LSE2 + (b64 * Hq + h64) * Lq
        DELh = DEL + (b64 * Hq + h64) * Lq
        Bh = Bias + b64 * sbb + (h // b_hdiv).to(tl.int64) * sbh
        DBh = DB + b64 * sdbb + (h // db_hdiv).to(tl.int64) * sdbh
        DQAh = DQA + (b64 * Hq + h64) * Lq * D
        dbacc = tl.zeros([BLOCK_N], tl.float32)
        slots = _cr_prefetch(preds, b, h, j, Lk, N_COL_RANGES, CR_KINDS, True)
        row = _list_row(b, h, kb, qp_sb, qp_sh, qp_hdiv, qp_rs)
        n_iters = _list_count(Q_COUNT + row, qp_W, tl.cdiv(Lq, block_q), Q_PARTIAL_RANGES) * SUB
        dk, dv, dbacc = _bwd_kv_inner(
            dk, dv, dbacc, k, v, j, offs_m, offs_d, b, h,
            Qh, sqm, sqd, DOh, sdom, sdod, LSE2h, DELh, Bh, sbq, sbk, DBh, sdbq, sdbk,
            DQAh, Q_INDEX + row.to(tl.int64) * qp_W, n_iters, SUB, Lq, Lk, D, kb, block_q,
            block_k, scale, qk_scale, cap_log2, preds, slots,
            True, HAS_DM, N_COL_RANGES, CR_KINDS, HAS_BITS, HAS_BIAS, SOFTCAP,
            DB_MODE, EVEN_M, EVEN_D, BLOCK_M, Q_PARTIAL_RANGES, DQ_ATOMIC)
        row = _list_row(b, h, kb, qf_sb, qf_sh, qf_hdiv, qf_rs)
        n_iters = _list_count(Q_FULL_COUNT + row, qf_W, tl.cdiv(Lq, block_q), Q_FULL_RANGES) * SUB
        dk, dv, dbacc = _bwd_kv_inner(
            dk, dv, dbacc, k, v, j, offs_m, offs_d, b, h,
            Qh, sqm, sqd, DOh, sdom, sdod, LSE2h, DELh, Bh, sbq, sbk, DBh, sdbq, sdbk,
            DQAh, Q_FULL_INDEX + row.to(tl.int64) * qf_W, n_iters, SUB, Lq, Lk, D, kb, block_q,
            block_k, scale, qk_scale, cap_log2, preds, slots,
            False, HAS_DM, N_COL_RANGES, CR_KINDS, HAS_BITS, HAS_BIAS, SOFTCAP,
            DB_MODE, EVEN_M, EVEN_D, BLOCK_M, Q_FULL_RANGES, DQ_ATOMIC)
        if DB_MODE == 3:
            tl.store(DBh + j * sdbk, dbacc, mask=j < Lk)
        if ZERO_SKIPPED:
            # both rows of this key block (`row` is still the full list's), block counts
            prow = _list_row(b, h, kb, qp_sb, qp_sh, qp_hdiv, qp_rs)     # the partial list's
            _zero_skipped(DBh, sdbq, sdbk, j, offs_m,
                          Q_INDEX + prow.to(tl.int64) * qp_W,
                          _list_count(Q_COUNT + prow, qp_W, tl.cdiv(Lq, block_q), Q_PARTIAL_RANGES),
                          Q_FULL_INDEX + row.to(tl.int64) * qf_W,
                          _list_count(Q_FULL_COUNT + row, qf_W, tl.cdiv(Lq, block_q),
                                      Q_FULL_RANGES),
                          nQB, Lq, Lk,
                          block_q, SUB, BLOCK_M, BLOCK_N, Q_PARTIAL_RANGES, Q_FULL_RANGES)
    dk = dk * scale
    # dK, dV outputs are contiguous (B, Hkv, Lk, D)
    o = (b64 * Hkv + hk64) * Lk * D + j[:, None] * D + offs_d[None, :]
    if EVEN_N and EVEN_D:
        tl.store(DK + o, dk.to(DK.dtype.element_ty))
        tl.store(DV + o, dv.to(DV.dtype.element_ty))
    else:
        tl.store(DK + o, dk.to(DK.dtype.element_ty), mask=j_ok & d_ok)
        tl.store(DV + o, dv.to(DV.dtype.element_ty), mask=j_ok & d_ok)


# ====================================================================================== dQ pass

@triton.jit
def _bwd_q_inner(dq, dbacc, q, do, lse2, delta, i, offs_n, offs_d, b, h,
                 Kh, Vh, skn, skd, svn, svd, Bh, sbq, sbk,
                 idx_ptr, n_iters, SUB: tl.constexpr, Lq, Lk, D, qb, block_q: tl.constexpr,
                 block_k: tl.constexpr, qk_scale, cap_log2, preds,
                 PARTIAL: tl.constexpr, HAS_DM: tl.constexpr, N_COL_RANGES: tl.constexpr,
                 CR_KINDS: tl.constexpr,
                 HAS_BITS: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
                 DB_COLSUM: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
                 BLOCK_N: tl.constexpr, RANGES: tl.constexpr):
    """One block list's key tiles into (dq, dbacc), recomputing P and dS."""
    d_okT = offs_d[:, None] < D
    if RANGES >= 0:      # else EMPTY_LIST: no row has a block
        walk = _ranges_load(idx_ptr, n_iters, RANGES)
        for it in range(n_iters):
            kb, pen, j = _list_tile(idx_ptr, walk, it, SUB, Lk, block_k, BLOCK_N, offs_n, RANGES)
            j_ok = j[None, :] < Lk
            kT = _load_tile(Kh + j[None, :] * skn + offs_d[:, None] * skd, j_ok, d_okT,
                            not EVEN_N, not EVEN_D)
            vT = _load_tile(Vh + j[None, :] * svn + offs_d[:, None] * svd, j_ok, d_okT,
                            not EVEN_N, not EVEN_D)
            qk = tl.dot(q, kT)
            s, t = _score(qk, qk_scale, cap_log2, pen, Bh, sbq, sbk, i[:, None], j[None, :],
                          i[:, None] < Lq, j_ok, HAS_BIAS, SOFTCAP)
            p = tl.math.exp2(s - lse2[:, None])
            if PARTIAL:
                vis = _query_tile_visible(i, j, kb, qb, b, h, Lq, Lk, block_q, block_k, preds,
                                          HAS_DM, N_COL_RANGES, CR_KINDS, HAS_BITS, not EVEN_N)
                p = tl.where(vis, p, 0.0)

            elif not EVEN_N:
                p = tl.where(j_ok, p, 0.0)
            dp = tl.dot(do, vT)
            ds = p * (dp - delta[:, None])
            if DB_COLSUM:
                dbacc += tl.sum(ds, 1)
            if SOFTCAP:
                ds = ds * (1.0 - t * t)
            dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq)
    return dq, dbacc


@triton.jit
def _bwd_q_from_ds_inner(dq, i, offs_n, offs_d, Kh, skn, skd, DSh, sdsq, sdsk,
                         idx_ptr, n_iters, SUB: tl.constexpr, Lq, Lk, D, block_k: tl.constexpr,
                         EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         RANGES: tl.constexpr):
    """dQ += dS @ K with dS read back from what the dK/dV pass stored (full-shape dbias)."""
    d_okT = offs_d[:, None] < D
    if RANGES >= 0:      # else EMPTY_LIST: no row has a block
        walk = _ranges_load(idx_ptr, n_iters, RANGES)
        for it in range(n_iters):
            kb, pen, j = _list_tile(idx_ptr, walk, it, SUB, Lk, block_k, BLOCK_N, offs_n, RANGES)
            j_ok = j[None, :] < Lk
            kT = _load_tile(Kh + j[None, :] * skn + offs_d[:, None] * skd, j_ok, d_okT,
                            not EVEN_N, not EVEN_D)
            ds = tl.load(DSh + i[:, None] * sdsq + j[None, :] * sdsk,
                         mask=(i[:, None] < Lq) & j_ok, other=0.0)
            ds = tl.where(pen == 0.0, ds, 0.0)     # a tile listed out of range adds nothing
            dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, LSE2, DEL, Bias, DBQ, DQ, DS,
                 q_strides, k_strides, v_strides, do_strides, bias_strides, ds_strides,
                 kv_partial, kv_full, preds,
                 Hq, G: tl.constexpr, Lq, Lk, D, block_q: tl.constexpr, block_k: tl.constexpr,
                 SUB: tl.constexpr, scale, qk_scale, cap_log2, rev_q,
                 HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, HAS_DM: tl.constexpr,
                 N_COL_RANGES: tl.constexpr, CR_KINDS: tl.constexpr, HAS_BITS: tl.constexpr,
                 DB_COLSUM: tl.constexpr,
                 DQ_FROM_DS: tl.constexpr,
                 EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 KV_PARTIAL_RANGES: tl.constexpr, KV_FULL_RANGES: tl.constexpr):
    """The dQ pass (two_pass): one program per query tile. Arguments as in
    _bwd_dq_program."""
    _bwd_dq_program(
        _tile_order(tl.program_id(0), tl.num_programs(0), rev_q), tl.program_id(1), Q, K, V,
        DO, LSE2, DEL, Bias, DBQ, DQ, DS,
        q_strides, k_strides, v_strides, do_strides, bias_strides, ds_strides,
        kv_partial, kv_full, preds,
        Hq, G, Lq, Lk, D, block_q, block_k, SUB, scale, qk_scale, cap_log2,
        HAS_BIAS, SOFTCAP, HAS_DM, N_COL_RANGES, CR_KINDS, HAS_BITS, DB_COLSUM, DQ_FROM_DS,
        EVEN_M, EVEN_N, EVEN_D, BLOCK_M, BLOCK_N, BLOCK_D, KV_PARTIAL_RANGES, KV_FULL_RANGES)


@triton.jit
def _bwd_dq_program(pid_m, pid_bh, Q, K, V, DO, LSE2, DEL, Bias, DBQ, DQ, DS,
                    q_strides, k_strides, v_strides, do_strides, bias_strides, ds_strides,
                    kv_partial, kv_full, preds,
                    Hq, G: tl.constexpr, Lq, Lk, D, block_q: tl.constexpr, block_k: tl.constexpr,
                    SUB: tl.constexpr, scale, qk_scale, cap_log2,
                    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, HAS_DM: tl.constexpr,
                    N_COL_RANGES: tl.constexpr, CR_KINDS: tl.constexpr, HAS_BITS: tl.constexpr,
                    DB_COLSUM: tl.constexpr,
                    DQ_FROM_DS: tl.constexpr,
                    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    KV_PARTIAL_RANGES: tl.constexpr, KV_FULL_RANGES: tl.constexpr):
    """One dQ program: query tile pid_m of (b, query head) pid_bh = b * Hq + query head.
    q/k/v/do_strides, ds_strides: (batch, head, row, column); bias_strides: (batch, head,
    query, key, head divisor); kv_partial, kv_full: BlockListArgs tuples; preds: the
    PredicateArgs tuple (triton_block_mask)."""
    skb, skh, skn, skd = k_strides
    sdsb, sdsh, sdsq, sdsk = ds_strides
    KV_COUNT, KV_INDEX, kvp_sb, kvp_sh, kvp_hdiv, kvp_W, kvp_rs = kv_partial
    KV_FULL_COUNT, KV_FULL_INDEX, kvf_sb, kvf_sh, kvf_hdiv, kvf_W, kvf_rs = kv_full
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // G
    m0 = pid_m * BLOCK_M
    qb = m0 // block_q
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    i = m0 + offs_m
    i_ok = i < Lq
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    hk64 = hk.to(tl.int64)
    d_ok = offs_d[None, :] < D
    rbase = (b64 * Hq + h64) * Lq
    Kh = K + b64 * skb + hk64 * skh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if DQ_FROM_DS:
        DSh = DS + b64 * sdsb + h64 * sdsh
        row = _list_row(b, h, qb, kvp_sb, kvp_sh, kvp_hdiv, kvp_rs)
        dq = _bwd_q_from_ds_inner(
            dq, i, offs_n, offs_d, Kh, skn, skd, DSh, sdsq, sdsk,
            KV_INDEX + row.to(tl.int64) * kvp_W,
            _list_count(KV_COUNT + row, kvp_W, tl.cdiv(Lk, block_k), KV_PARTIAL_RANGES) * SUB,
            SUB, Lq, Lk, D, block_k, EVEN_N, EVEN_D, BLOCK_N, KV_PARTIAL_RANGES)
        row = _list_row(b, h, qb, kvf_sb, kvf_sh, kvf_hdiv, kvf_rs)
        dq = _bwd_q_from_ds_inner(
            dq, i, offs_n, offs_d, Kh, skn, skd, DSh, sdsq, sdsk,
            KV_FULL_INDEX + row.to(tl.int64) * kvf_W,
            _list_count(KV_FULL_COUNT + row, kvf_W, tl.cdiv(Lk, block_k), KV_FULL_RANGES) * SUB,
            SUB, Lq, Lk, D, block_k, EVEN_N, EVEN_D, BLOCK_N, KV_FULL_RANGES)
    else:
        dq = _bwd_dq_recompute(
            dq, Q, DO, LSE2, DEL, Kh, V, Bias, DBQ, rbase, b, h, b64, h64, hk64, i, i_ok, qb,
            offs_n, offs_d, d_ok,
            q_strides, k_strides, v_strides, do_strides, bias_strides, kv_partial, kv_full, preds,
            Lq, Lk, D, block_q, block_k, SUB, qk_scale, cap_log2,
            HAS_BIAS, SOFTCAP, HAS_DM, N_COL_RANGES, CR_KINDS, HAS_BITS, DB_COLSUM, EVEN_M, EVEN_N,
            EVEN_D, BLOCK_M, BLOCK_N, KV_PARTIAL_RANGES, KV_FULL_RANGES)
    dq = dq * scale
    o = rbase * D + i[:, None] * D + offs_d[None, :]
    if EVEN_M and EVEN_D:
        tl.store(DQ + o, dq.to(DQ.dtype.element_ty))
    else:
        tl.store(DQ + o, dq.to(DQ.dtype.element_ty), mask=i_ok[:, None] & d_ok)


@triton.jit
def _bwd_dq_recompute(dq, Q, DO, LSE2, DEL, Kh, V, Bias, DBQ, rbase, b, h, b64, h64, hk64, i,
                      i_ok, qb, offs_n, offs_d, d_ok,
                      q_strides, k_strides, v_strides, do_strides, bias_strides,
                      kv_partial, kv_full, preds,
                      Lq, Lk, D, block_q: tl.constexpr, block_k: tl.constexpr, SUB: tl.constexpr,
                      qk_scale, cap_log2,
                      HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, HAS_DM: tl.constexpr,
                      N_COL_RANGES: tl.constexpr, CR_KINDS: tl.constexpr, HAS_BITS: tl.constexpr,
                      DB_COLSUM: tl.constexpr,
                      EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      KV_PARTIAL_RANGES: tl.constexpr, KV_FULL_RANGES: tl.constexpr):
    """The dQ pass proper: recompute P and dS per key tile (and the key-summed dbias)."""
    sqb, sqh, sqm, sqd = q_strides
    skb, skh, skn, skd = k_strides
    svb, svh, svn, svd = v_strides
    sdob, sdoh, sdom, sdod = do_strides
    sbb, sbh, sbq, sbk, b_hdiv = bias_strides
    KV_COUNT, KV_INDEX, kvp_sb, kvp_sh, kvp_hdiv, kvp_W, kvp_rs = kv_partial
    KV_FULL_COUNT, KV_FULL_INDEX, kvf_sb, kvf_sh, kvf_hdiv, kvf_W, kvf_rs = kv_full
    q = _load_tile(Q + b64 * sqb + h64 * sqh + i[:, None] * sqm + offs_d[None, :] * sqd,
                   i_ok[:, None], d_ok, not EVEN_M, not EVEN_D)
    do = _load_tile(DO + b64 * sdob + h64 * sdoh + i[:, None] * sdom + offs_d[None, :] * sdod,
                    i_ok[:, None], d_ok, not EVEN_M, not EVEN_D)
    if EVEN_M:
        lse2 = tl.load(LSE2 + rbase + i)
        delta = tl.load(DEL + rbase + i)
    else:
        lse2 = tl.load(LSE2 + rbase + i, mask=i_ok, other=float("inf"))
        delta = tl.load(DEL + rbase + i, mask=i_ok, other=0.0)
    Vh = V + b64 * svb + hk64 * svh
    Bh = Bias + b64 * sbb + (h // b_hdiv).to(tl.int64) * sbh
    dbacc = tl.zeros([BLOCK_M], tl.float32)

    row = _list_row(b, h, qb, kvp_sb, kvp_sh, kvp_hdiv, kvp_rs)
    n_iters = _list_count(KV_COUNT + row, kvp_W, tl.cdiv(Lk, block_k), KV_PARTIAL_RANGES) * SUB
    dq, dbacc = _bwd_q_inner(
        dq, dbacc, q, do, lse2, delta, i, offs_n, offs_d, b, h,
        Kh, Vh, skn, skd, svn, svd, Bh, sbq, sbk,
        KV_INDEX + row.to(tl.int64) * kvp_W, n_iters, SUB, Lq, Lk, D, qb, block_q, block_k,
        qk_scale, cap_log2, preds,
        True, HAS_DM, N_COL_RANGES, CR_KINDS, HAS_BITS, HAS_BIAS, SOFTCAP,
        DB_COLSUM, EVEN_N, EVEN_D, BLOCK_N, KV_PARTIAL_RANGES)
    row = _list_row(b, h, qb, kvf_sb, kvf_sh, kvf_hdiv, kvf_rs)
    n_iters = _list_count(KV_FULL_COUNT + row, kvf_W, tl.cdiv(Lk, block_k), KV_FULL_RANGES) * SUB
    dq, dbacc = _bwd_q_inner(
        dq, dbacc, q, do, lse2, delta, i, offs_n, offs_d, b, h,
        Kh, Vh, skn, skd, svn, svd, Bh, sbq, sbk,
        KV_FULL_INDEX + row.to(tl.int64) * kvf_W, n_iters, SUB, Lq, Lk, D, qb, block_q, block_k,
        qk_scale, cap_log2, preds,
        False, HAS_DM, N_COL_RANGES, CR_KINDS, HAS_BITS, HAS_BIAS, SOFTCAP,
        DB_COLSUM, EVEN_N, EVEN_D, BLOCK_N, KV_FULL_RANGES)
    if DB_COLSUM:
        tl.store(DBQ + rbase + i, dbacc, mask=i_ok)
    return dq


# ====================================================================== both passes, one launch

@triton.jit
def _attn_bwd_one_launch(Q, K, V, DO, LSE2, DEL, Bias, DB, DK, DV, DBQ, DQ,
                         q_strides, k_strides, v_strides, do_strides, bias_strides, db_strides,
                         q_partial, q_full, kv_partial, kv_full, preds,
                         Hq, Hkv, G: tl.constexpr, Lq, Lk, D, block_q: tl.constexpr,
                         block_k: tl.constexpr, SUB1: tl.constexpr, SUB2: tl.constexpr, nQB,
                         n_kv_tiles, n_q_tiles, scale, qk_scale, cap_log2, rev_q,
                         HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, HAS_DM: tl.constexpr,
                         N_COL_RANGES: tl.constexpr, CR_KINDS: tl.constexpr, HAS_BITS: tl.constexpr,
                         DB_MODE: tl.constexpr,
                         ZERO_SKIPPED: tl.constexpr, DB_COLSUM: tl.constexpr,
                         EVEN_M1: tl.constexpr, EVEN_N1: tl.constexpr,
                         EVEN_M2: tl.constexpr, EVEN_N2: tl.constexpr, EVEN_D: tl.constexpr,
                         BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
                         BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr, BLOCK_D: tl.constexpr,
                         Q_PARTIAL_RANGES: tl.constexpr, Q_FULL_RANGES: tl.constexpr,
                         KV_PARTIAL_RANGES: tl.constexpr, KV_FULL_RANGES: tl.constexpr):
    """Both backward passes in one launch (FlexAttention's layout): grid (n_kv_tiles +
    G * n_q_tiles, B * Hkv); programs below n_kv_tiles are dK/dV programs (tiles
    BLOCK_M1 x BLOCK_N1), the rest dQ programs of the G query heads of that kv head
    (BLOCK_M2 x BLOCK_N2). The dQ half recomputes P and dS, so it needs nothing from the
    dK/dV half."""
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    if pid < n_kv_tiles:
        _bwd_dkdv_program(
            pid, pid_bh, Q, K, V, DO, LSE2, DEL, Bias, DB, DK, DV, DQ,
            q_strides, k_strides, v_strides, do_strides, bias_strides, db_strides,
            q_partial, q_full, preds,
            Hq, Hkv, G, Lq, Lk, D, block_q, block_k, SUB1, nQB, scale, qk_scale, cap_log2,
            HAS_BIAS, SOFTCAP, HAS_DM, N_COL_RANGES, CR_KINDS, HAS_BITS, DB_MODE, ZERO_SKIPPED,
            EVEN_M1, EVEN_N1, EVEN_D, BLOCK_M1, BLOCK_N1, BLOCK_D, Q_PARTIAL_RANGES,
            Q_FULL_RANGES, False)
    else:
        p = pid - n_kv_tiles
        # b * Hq + hk * G + g == (b * Hkv + hk) * G + g
        _bwd_dq_program(
            _tile_order(p % n_q_tiles, n_q_tiles, rev_q), pid_bh * G + p // n_q_tiles, Q, K, V,
            DO, LSE2, DEL, Bias, DBQ, DQ,
            DQ, q_strides, k_strides, v_strides, do_strides, bias_strides, (0, 0, 0, 0),
            kv_partial, kv_full, preds,
            Hq, G, Lq, Lk, D, block_q, block_k, SUB2, scale, qk_scale, cap_log2,
            HAS_BIAS, SOFTCAP, HAS_DM, N_COL_RANGES, CR_KINDS, HAS_BITS, DB_COLSUM, False,
            EVEN_M2, EVEN_N2, EVEN_D, BLOCK_M2, BLOCK_N2, BLOCK_D, KV_PARTIAL_RANGES,
            KV_FULL_RANGES)


# ========================================================================================= host

def backward_plan(grad_out, grad_lse, query, key, value, out, bias, mask, block_q, block_k,
                  scale, softcap, deterministic, bias_requires_grad, options) -> CallPlan:
    """The backward's plan for these layouts: scratch to allocate per call, launches (with
    Slot markers for the per-call tensors), and how dq / dk / dv / dbias come out."""
    B, Hq, Lq, D = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    G = Hq // Hkv
    want_dbias = bias is not None and bias_requires_grad
    c = call_args(query, key, value, bias, mask, block_q, block_k, scale, softcap, options)
    m = c.mask

    # dbias plan (module docstring): which pass produces it, and where.
    # scratch: name -> (shape, dtype, zeroed) allocated per call; finish_db: tensors -> dbias.
    db_mode, db_colsum, zero_skipped = DB_NONE, False, False
    db_ptr, db_strides, db_hdiv = m.dummy, (0, 0, 0, 0), 1
    dbq_ptr = m.dummy
    scratch = {}
    finish_db = None
    if want_dbias:
        Bb, Hb, Lqb, Lkb = bias.shape
        bias_shape, bias_dtype = bias.shape, bias.dtype

        def reduce_to_bias(t4):
            return from_groups_sum(t4.unflatten(1, (Hkv, G)), bias_shape).to(bias_dtype)

        if Lkb == 1:                      # sum over keys inside the dQ pass
            db_colsum = True
            scratch["dbq"] = ((B, Hq, Lq), torch.float32, True)
            dbq_ptr = _DBQ
            finish_db = lambda t: reduce_to_bias(t["dbq"][..., None])
        elif Lqb == 1:                    # sum over queries inside the dK/dV pass
            db_mode = DB_ROWSUM
            scratch["db"] = ((B, Hq, Lk), torch.float32, True)
            db_ptr, db_strides = _DB, (Hq * Lk, Lk, 0, 1)
            finish_db = lambda t: reduce_to_bias(t["db"][:, :, None, :])
        elif Bb == B and Hb == Hq:        # one writer per element: store directly
            db_mode, zero_skipped = DB_STORE, True   # the kernel zeroes the skipped tiles
            scratch["db"] = (tuple(bias_shape), bias_dtype, False)
            db_ptr, db_strides = _DB, (Hq * Lq * Lk, Lq * Lk, Lk, 1)
            finish_db = lambda t: t["db"]
        elif deterministic:               # per-(b, h) float32 scratch + fixed-order torch sum
            db_mode, zero_skipped = DB_STORE, True
            scratch["db"] = ((B, Hq, Lq, Lk), torch.float32, False)
            db_ptr, db_strides = _DB, (Hq * Lq * Lk, Lq * Lk, Lk, 1)
            finish_db = lambda t: reduce_to_bias(t["db"])
        else:                             # float32 atomics into the broadcast shape
            db_mode = DB_ATOMIC
            scratch["db"] = (tuple(bias_shape), torch.float32, True)
            db_ptr = _DB
            db_strides = (0 if Bb == 1 else Hb * Lqb * Lkb, 0 if Hb == 1 else Lqb * Lkb, Lkb, 1)
            db_hdiv = _head_div(Hb, Hq, Hkv, "bias")
            finish_db = lambda t: t["db"].to(bias_dtype)
    db_dtype = scratch["db"][1] if "db" in scratch else None

    # With dS stored per (b, h, i, j) by the dK/dV pass (full-shape dbias, no softcap), the
    # dQ pass is one matmul per tile, dQ = dS @ K, instead of recomputing P and dS.
    dq_from_ds = (db_mode == DB_STORE and float(softcap) <= 0 and options.dq_from_ds
                  and db_dtype in (query.dtype, torch.float32))
    mode = options.bwd_mode
    if mode == "auto":
        mode = "one_launch" if c.BLOCK_D > 64 else "two_pass"
    if mode == "one_launch" and dq_from_ds:
        mode = "two_pass"
    if mode == "atomic_dq" and (deterministic or db_colsum or dq_from_ds):
        mode = "two_pass"

    # The kernels' tuple arguments: (batch, head, row, column) strides of Q, K, V and dO and
    # the bias's (triton_block_common); the dbias strides with its head divisor; the
    # descriptor's block lists and predicates (triton_block_mask.MaskArgs) as plain tuples.
    strides = (_strides(query), _strides(key), _strides(value), _strides(grad_out),
               c.bias.strides)
    db_args = (*db_strides, db_hdiv)
    q_partial, q_full, kv_partial, kv_full, preds = (
        tuple(t) for t in (m.q_partial, m.q_full, m.kv_partial, m.kv_full, m.predicates))
    # Short per-tile work: explicit block lists (not the range form), or column ranges that
    # also hide rows below the keys (windows, documents); not full, causal or prefix-LM.
    list_form = m.ranges.q_full == 0 and m.ranges.kv_full == 0
    short_work = list_form or (m.flags.N_COL_RANGES > 0 and not m.reverse_query_tiles)
    cfg = dict(has_bias=dq_from_ds, short_work=short_work)
    BM, BN, warps, stages = _config("dkdv", c.BLOCK_D, block_q, block_k, options, **cfg)
    n_kv_tiles = _cdiv(Lk, BN)
    dkdv_constexprs = dict(**c.constexprs, DB_MODE=db_mode, ZERO_SKIPPED=zero_skipped)
    # dQ pass config (the dQ half of one_launch takes its tiles, not its warps / stages)
    BM2, BN2, warps2, stages2 = _config("dq", c.BLOCK_D, block_q, block_k, options, **cfg)
    n_q_tiles = _cdiv(Lq, BM2)
    PRE_M = 64
    glse = _GLSE if grad_lse is not None else m.dummy
    launches = [(_bwd_preprocess, (_cdiv(Lq, PRE_M), B * Hq), (
        _OUT, _DO, _LSE, glse, _DELTA, _LSE2, _strides(out), _strides(grad_out), Hq, Lq, D),
        dict(HAS_GLSE=grad_lse is not None, BLOCK_M=PRE_M, BLOCK_D=c.BLOCK_D), 4, 3)]
    dq_atomic = mode == "atomic_dq"
    if mode == "one_launch":
        launches.append((_attn_bwd_one_launch, (n_kv_tiles + G * n_q_tiles, B * Hkv), (
            _Q, _K, _V, _DO, _LSE2, _DELTA, c.bias.pointer, db_ptr, _DK, _DV, dbq_ptr,
            _DQ, *strides, db_args, q_partial, q_full, kv_partial, kv_full, preds,
            Hq, Hkv, G, Lq, Lk, D, block_q, block_k, block_q // BM, block_k // BN2,
            -(-Lq // block_q), n_kv_tiles, n_q_tiles, scale, c.qk_scale, c.cap_log2,
            m.reverse_query_tiles),
            dict(**dkdv_constexprs, **m.ranges.q_constexprs(), **m.ranges.kv_constexprs(),
                 DB_COLSUM=db_colsum,
                 EVEN_M1=_even(Lq, BM, block_q), EVEN_N1=_even(Lk, BN, block_k),
                 EVEN_M2=_even(Lq, BM2, block_q), EVEN_N2=_even(Lk, BN2, block_k),
                 BLOCK_M1=BM, BLOCK_N1=BN, BLOCK_M2=BM2, BLOCK_N2=BN2,
                 BLOCK_D=c.BLOCK_D), warps, stages))
    else:
        if dq_atomic:   # float32 dQ from the dK/dV pass's atomics; unreached rows stay zero
            scratch["dqa"] = ((B, Hq, Lq, D), torch.float32, True)
        launches.append((_attn_bwd_dkdv, (n_kv_tiles, B * Hkv), (
            _Q, _K, _V, _DO, _LSE2, _DELTA, c.bias.pointer, db_ptr, _DK, _DV,
            _DQA if dq_atomic else m.dummy,
            *strides, db_args, q_partial, q_full, preds,
            Hq, Hkv, G, Lq, Lk, D, block_q, block_k, block_q // BM, -(-Lq // block_q), scale,
            c.qk_scale, c.cap_log2),
            dict(**dkdv_constexprs, **m.ranges.q_constexprs(), DQ_ATOMIC=dq_atomic,
                 EVEN_M=_even(Lq, BM, block_q), EVEN_N=_even(Lk, BN, block_k), BLOCK_M=BM,
                 BLOCK_N=BN, BLOCK_D=c.BLOCK_D),
            warps, stages))
        if not dq_atomic:
            ds_ptr, ds_strides = (db_ptr, db_strides) if dq_from_ds else (m.dummy, (0,) * 4)
            launches.append((_attn_bwd_dq, (n_q_tiles, B * Hq), (
                _Q, _K, _V, _DO, _LSE2, _DELTA, c.bias.pointer, dbq_ptr, _DQ, ds_ptr,
                *strides, ds_strides, kv_partial, kv_full, preds,
                Hq, G, Lq, Lk, D, block_q, block_k, block_k // BN2, scale, c.qk_scale,
                c.cap_log2, m.reverse_query_tiles),
                dict(**c.constexprs, **m.ranges.kv_constexprs(), DB_COLSUM=db_colsum,
                     DQ_FROM_DS=dq_from_ds, EVEN_M=_even(Lq, BM2, block_q),
                     EVEN_N=_even(Lk, BN2, block_k),
                     BLOCK_M=BM2, BLOCK_N=BN2, BLOCK_D=c.BLOCK_D), warps2, stages2))

    q_dtype = query.dtype

    def finish(t):
        dq = t["dqa"].to(q_dtype) if dq_atomic else t["dq"]
        return dq, t["dk"], t["dv"], finish_db(t) if want_dbias else t["dk"].new_empty((0,))
    return CallPlan(c, launches, scratch, finish)
