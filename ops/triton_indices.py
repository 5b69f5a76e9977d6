"""Index-mode attention in Triton: per-query key lists (docs/design.md, "Index mode").

`attn_indices` (Bi, Hi, Lq, W), Hi in {1, Hkv}: key positions per query and kv head,
-1 inactive, gather semantics (a position listed twice counts twice). Any entry < 0 or
>= Lk is treated as inactive, so the kernels never read out of bounds.

Layout. The G = Hq // Hkv query heads of one GQA group share the index list, so one
program handles one (query row, kv head, batch) and all G query heads: the M dimension of
the tile is the G heads (padded to 16 for tl.dot), N is a chunk of BLOCK_W gathered
keys. Each gathered K/V row is loaded once and used by all G heads.

Forward: gather K/V rows by index, online softmax, out in the query dtype, lse float32.

Backward, per-query kernel: recomputes p from lse, writes dq directly, and
- fast mode: scatter-adds dk/dv into float32 buffers with atomics;
- deterministic mode: does not touch dk/dv; a transposed CSR of the index lists (key ->
  queries listing it, built with a stable torch.sort) drives a per-key-row kernel that
  sums each key's contributions in a fixed order (bitwise identical run to run).
dbias: the per-query kernel writes dS per entry (B, Hkv, G, Lq, W); torch reduces it to
the bias's broadcast shape and scatters it onto key positions (scatter_add_, under
torch's deterministic mode when `deterministic`).
"""
import contextlib
import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the backend module guards this import too
    triton = None
    tl = None

from .kernel_options import DEFAULT as DEFAULT_OPTIONS
from .mask_checks import shown_shape, shown_size
from .triton_compat import interpreting

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256


def _empty(shape, dtype, device):
    """Allocation of every buffer a kernel must fill completely (tests swap in one that
    fills it with NaN first, so that an entry a kernel forgets to write shows up)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


# ====================================================================== support checks

def not_supported_reasons(query, key, value, bias, mask) -> list:
    reasons = []
    if triton is None:
        return ["triton_indices: triton is not installed"]
    idx = mask.attn_indices
    if idx is None:
        return ["triton_indices: no attn_indices (index mode only)"]
    others = [n for n, t in zip(mask._fields, mask) if t is not None and n != "attn_indices"]
    if others:
        reasons.append(f"triton_indices: index mode takes no other mask tensors, got {others}")
    dev = query.device.type
    if dev != "cuda" and not (dev == "cpu" and interpreting()):
        reasons.append(f"triton_indices: needs CUDA tensors (or CPU under TRITON_INTERPRET=1), "
                       f"got {query.device}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            reasons.append(f"triton_indices: {name} must be 4-D")
            return reasons
        if t.dtype not in _SUPPORTED_DTYPES:
            reasons.append(f"triton_indices: {name} dtype {t.dtype} not supported "
                           f"(float16, bfloat16, float32)")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        reasons.append("triton_indices: query, key and value must share a dtype")
    D, Dv = query.shape[-1], value.shape[-1]
    if not (1 <= D <= _MAX_HEAD_DIM) or not (1 <= Dv <= _MAX_HEAD_DIM):
        reasons.append(f"triton_indices: head dims must be in [1, {_MAX_HEAD_DIM}], got "
                       f"D={shown_size(D)}, Dv={shown_size(Dv)}")
    B, Hq, Lq = query.shape[:3]
    Hkv = key.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        reasons.append("triton_indices: Hq must be a multiple of Hkv")
    if idx.dtype not in (torch.int32, torch.int64):
        reasons.append(f"triton_indices: attn_indices must be int32 or int64, got {idx.dtype}")
    if idx.dim() != 4 or idx.shape[0] not in (1, B) or idx.shape[1] not in (1, Hkv) \
            or idx.shape[2] != Lq:
        reasons.append(f"triton_indices: attn_indices shape {shown_shape(idx)} must be "
                       f"(B|1, Hkv|1, Lq, W)")
    if idx.device != query.device:
        reasons.append("triton_indices: attn_indices must be on the query's device")
    if bias is not None:
        if bias.dim() != 4 or bias.shape[0] not in (1, B) or bias.shape[1] not in (1, Hkv, Hq) \
                or bias.shape[2] not in (1, Lq) or bias.shape[3] not in (1, key.shape[2]):
            reasons.append(f"triton_indices: bias shape {shown_shape(bias)} not broadcastable")
        if bias.dtype not in _SUPPORTED_DTYPES:
            reasons.append(f"triton_indices: bias dtype {bias.dtype} not supported")
        if bias.device != query.device:
            reasons.append("triton_indices: bias must be on the query's device")
    return reasons


# ====================================================================== kernels

if triton is not None:

    @triton.jit
    def _tanh(x):
        # 1 - 2 / (e^{2x} + 1): exact limits at +-inf, no libdevice (runs in the interpreter).
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)

    @triton.jit
    def _lt(offs, n, EVEN: tl.constexpr):
        # Column mask; all-true when the head dim is a power of two, so that the gathers
        # and atomics along it stay vectorized.
        if EVEN:
            return tl.full(offs.shape, 1, tl.int1)
        else:
            return offs < n

    @triton.jit
    def _fwd_kernel(
        Q, K, V, IDX, BIAS, OUT, LSE,
        sqb, sqh, sqg, sqm, sqd,
        skb, skh, skn, skd,
        svb, svh, svn, svd,
        sib, sih, sim, siw,
        sbb, sbh, sbg, sbm, sbn,
        sob, soh, sog, som, sod,
        slb, slh, slg, slm,
        G, Lk, W, D, DV,
        scale, softcap,
        G_PAD: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
        EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
        BLOCK_W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        i = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        b = tl.program_id(2).to(tl.int64)

        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D_PAD)
        offs_dv = tl.arange(0, DV_PAD)
        offs_w0 = tl.arange(0, BLOCK_W)
        g_ok = offs_g < G
        d_ok = _lt(offs_d, D, EVEN_D)
        dv_ok = _lt(offs_dv, DV, EVEN_DV)

        q = tl.load(Q + b * sqb + h * sqh + i * sqm + offs_g[:, None] * sqg + offs_d[None, :] * sqd,
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        k_base = K + b * skb + h * skh
        v_base = V + b * svb + h * svh
        i_base = IDX + b * sib + h * sih + i * sim
        b_base = BIAS + b * sbb + h * sbh + i * sbm

        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, DV_PAD], tl.float32)
        for w0 in range(0, W, BLOCK_W):
            offs_w = w0 + offs_w0
            ix = tl.load(i_base + offs_w * siw, mask=offs_w < W, other=-1).to(tl.int64)
            valid = (ix >= 0) & (ix < Lk)
            ix = tl.where(valid, ix, 0)
            k = tl.load(k_base + ix[:, None] * skn + offs_d[None, :] * skd,
                        mask=valid[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_base + ix[:, None] * svn + offs_dv[None, :] * svd,
                        mask=valid[:, None] & dv_ok[None, :], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            if HAS_SOFTCAP:
                s = softcap * _tanh(s / softcap)
            if HAS_BIAS:
                bv = tl.load(b_base + offs_g[:, None] * sbg + ix[None, :] * sbn,
                             mask=g_ok[:, None] & valid[None, :], other=0.0)
                s = s + bv.to(tl.float32)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_use)
            p = tl.exp(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        # != 0, not > 0: a row whose sum is NaN keeps its NaN lse, as the reference does
        has = l_i != 0.0
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        tl.store(OUT + b * sob + h * soh + i * som + offs_g[:, None] * sog + offs_dv[None, :] * sod,
                 out.to(OUT.dtype.element_ty), mask=g_ok[:, None] & dv_ok[None, :])
        tl.store(LSE + b * slb + h * slh + i * slm + offs_g * slg, lse, mask=g_ok)

    @triton.jit
    def _bwd_q_kernel(
        Q, K, V, IDX, BIAS, O, DO, LSE, DLSE, DQ, DKP, DVP, DS, DELTA,
        sqb, sqh, sqg, sqm, sqd,
        skb, skh, skn, skd,
        svb, svh, svn, svd,
        sib, sih, sim, siw,
        sbb, sbh, sbg, sbm, sbn,
        sob, soh, sog, som, sod,
        sdob, sdoh, sdog, sdom, sdod,
        slb, slh, slg, slm,
        sdlb, sdlh, sdlg, sdlm,
        sdqb, sdqh, sdqg, sdqm, sdqd,
        sdkb, sdkh, sdkn, sdkd,
        sdvb, sdvh, sdvn, sdvd,
        ssb, ssh, ssg, ssm, ssw,
        sxb, sxh, sxg, sxm,
        G, Lk, W, D, DV,
        scale, softcap,
        G_PAD: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
        EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
        BLOCK_W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
        HAS_DLSE: tl.constexpr, ATOMIC_KV: tl.constexpr, WRITE_DS: tl.constexpr,
        WRITE_DELTA: tl.constexpr, IEEE: tl.constexpr,
    ):
        i = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        b = tl.program_id(2).to(tl.int64)

        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D_PAD)
        offs_dv = tl.arange(0, DV_PAD)
        offs_w0 = tl.arange(0, BLOCK_W)
        g_ok = offs_g < G
        d_ok = _lt(offs_d, D, EVEN_D)
        dv_ok = _lt(offs_dv, DV, EVEN_DV)
        gd_ok = g_ok[:, None] & d_ok[None, :]
        gdv_ok = g_ok[:, None] & dv_ok[None, :]

        q = tl.load(Q + b * sqb + h * sqh + i * sqm + offs_g[:, None] * sqg + offs_d[None, :] * sqd,
                    mask=gd_ok, other=0.0)
        do = tl.load(DO + b * sdob + h * sdoh + i * sdom + offs_g[:, None] * sdog
                     + offs_dv[None, :] * sdod, mask=gdv_ok, other=0.0)
        o = tl.load(O + b * sob + h * soh + i * som + offs_g[:, None] * sog + offs_dv[None, :] * sod,
                    mask=gdv_ok, other=0.0)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
        if HAS_DLSE:
            delta = delta - tl.load(DLSE + b * sdlb + h * sdlh + i * sdlm + offs_g * sdlg,
                                    mask=g_ok, other=0.0).to(tl.float32)
        if WRITE_DELTA:
            tl.store(DELTA + b * sxb + h * sxh + i * sxm + offs_g * sxg, delta, mask=g_ok)
        lse = tl.load(LSE + b * slb + h * slh + i * slm + offs_g * slg, mask=g_ok, other=0.0)
        lse = tl.where(lse == float("-inf"), 0.0, lse)

        k_base = K + b * skb + h * skh
        v_base = V + b * svb + h * svh
        i_base = IDX + b * sib + h * sih + i * sim
        b_base = BIAS + b * sbb + h * sbh + i * sbm
        s_base = DS + b * ssb + h * ssh + i * ssm
        dk_base = DKP + b * sdkb + h * sdkh
        dv_base = DVP + b * sdvb + h * sdvh

        dq = tl.zeros([G_PAD, D_PAD], tl.float32)
        for w0 in range(0, W, BLOCK_W):
            offs_w = w0 + offs_w0
            w_ok = offs_w < W
            ix = tl.load(i_base + offs_w * siw, mask=w_ok, other=-1).to(tl.int64)
            valid = (ix >= 0) & (ix < Lk)
            ix = tl.where(valid, ix, 0)
            k = tl.load(k_base + ix[:, None] * skn + offs_d[None, :] * skd,
                        mask=valid[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_base + ix[:, None] * svn + offs_dv[None, :] * svd,
                        mask=valid[:, None] & dv_ok[None, :], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
                dp = tl.dot(do, tl.trans(v), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
                dp = tl.dot(do, tl.trans(v))
            s = s * scale
            if HAS_SOFTCAP:
                t = _tanh(s / softcap)
                s = softcap * t
            if HAS_BIAS:
                bv = tl.load(b_base + offs_g[:, None] * sbg + ix[None, :] * sbn,
                             mask=g_ok[:, None] & valid[None, :], other=0.0)
                s = s + bv.to(tl.float32)
            vis = g_ok[:, None] & valid[None, :]
            p = tl.where(vis, tl.exp(s - lse[:, None]), 0.0)
            ds = p * (dp - delta[:, None])
            if WRITE_DS:
                tl.store(s_base + offs_g[:, None] * ssg + offs_w[None, :] * ssw, ds,
                         mask=g_ok[:, None] & w_ok[None, :])
            if HAS_SOFTCAP:
                ds = ds * (1.0 - t * t)
            ds = ds * scale
            if IEEE:
                dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")
            else:
                dq += tl.dot(ds.to(k.dtype), k)
            if ATOMIC_KV:
                if IEEE:
                    dk_c = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision="ieee")
                    dv_c = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision="ieee")
                else:
                    dk_c = tl.dot(tl.trans(ds.to(q.dtype)), q)
                    dv_c = tl.dot(tl.trans(p.to(do.dtype)), do)
                tl.atomic_add(dk_base + ix[:, None] * sdkn + offs_d[None, :] * sdkd, dk_c,
                              mask=valid[:, None] & d_ok[None, :], sem="relaxed")
                tl.atomic_add(dv_base + ix[:, None] * sdvn + offs_dv[None, :] * sdvd, dv_c,
                              mask=valid[:, None] & dv_ok[None, :], sem="relaxed")
        tl.store(DQ + b * sdqb + h * sdqh + i * sdqm + offs_g[:, None] * sdqg + offs_d[None, :] * sdqd,
                 dq.to(DQ.dtype.element_ty), mask=gd_ok)

    @triton.jit
    def _bwd_kv_kernel(
        Q, K, V, BIAS, DO, LSE, DELTA, ROWPTR, QIDX, DKP, DVP,
        sqb, sqh, sqg, sqm, sqd,
        skb, skh, skn, skd,
        svb, svh, svn, svd,
        sbb, sbh, sbg, sbm, sbn,
        sdob, sdoh, sdog, sdom, sdod,
        slb, slh, slg, slm,
        sxb, sxh, sxg, sxm,
        srb, srh, srn,
        scb, sch,
        sdkb, sdkh, sdkn, sdkd,
        sdvb, sdvh, sdvn, sdvd,
        G, D, DV,
        scale, softcap,
        G_P2: tl.constexpr, BLOCK_E: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
        EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    ):
        # One key row j of one (kv head, batch): sum over the (query, head) pairs that list
        # it, in the stable-sorted order of the transposed CSR -> deterministic.
        j = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        b = tl.program_id(2).to(tl.int64)
        offs_d = tl.arange(0, D_PAD)
        offs_dv = tl.arange(0, DV_PAD)
        d_ok = _lt(offs_d, D, EVEN_D)
        dv_ok = _lt(offs_dv, DV, EVEN_DV)
        offs_r = tl.arange(0, BLOCK_E * G_P2)
        e_loc = offs_r // G_P2
        g = (offs_r % G_P2).to(tl.int64)
        g_ok = g < G

        rp = ROWPTR + b * srb + h * srh + j * srn
        start = tl.load(rp).to(tl.int64)
        end = tl.load(rp + srn).to(tl.int64)
        k = tl.load(K + b * skb + h * skh + j * skn + offs_d * skd, mask=d_ok, other=0.0).to(tl.float32)
        v = tl.load(V + b * svb + h * svh + j * svn + offs_dv * svd, mask=dv_ok, other=0.0).to(tl.float32)
        qidx_base = QIDX + b * scb + h * sch
        dk = tl.zeros([D_PAD], tl.float32)
        dv = tl.zeros([DV_PAD], tl.float32)
        for e0 in range(start, end, BLOCK_E):
            e = e0 + e_loc
            row_ok = (e < end) & g_ok
            qi = tl.load(qidx_base + e, mask=e < end, other=0).to(tl.int64)
            q = tl.load(Q + b * sqb + h * sqh + g[:, None] * sqg + qi[:, None] * sqm
                        + offs_d[None, :] * sqd, mask=row_ok[:, None] & d_ok[None, :],
                        other=0.0).to(tl.float32)
            do = tl.load(DO + b * sdob + h * sdoh + g[:, None] * sdog + qi[:, None] * sdom
                         + offs_dv[None, :] * sdod, mask=row_ok[:, None] & dv_ok[None, :],
                         other=0.0).to(tl.float32)
            lse = tl.load(LSE + b * slb + h * slh + g * slg + qi * slm, mask=row_ok, other=0.0)
            lse = tl.where(lse == float("-inf"), 0.0, lse)
            delta = tl.load(DELTA + b * sxb + h * sxh + g * sxg + qi * sxm, mask=row_ok, other=0.0)
            s = tl.sum(q * k[None, :], 1) * scale
            if HAS_SOFTCAP:
                t = _tanh(s / softcap)
                s = softcap * t
            if HAS_BIAS:
                s = s + tl.load(BIAS + b * sbb + h * sbh + g * sbg + qi * sbm + j * sbn,
                                mask=row_ok, other=0.0).to(tl.float32)
            p = tl.where(row_ok, tl.exp(s - lse), 0.0)
            dp = tl.sum(do * v[None, :], 1)
            ds = p * (dp - delta)
            if HAS_SOFTCAP:
                ds = ds * (1.0 - t * t)
            ds = ds * scale
            dk += tl.sum(ds[:, None] * q, 0)
            dv += tl.sum(p[:, None] * do, 0)
        tl.store(DKP + b * sdkb + h * sdkh + j * sdkn + offs_d * sdkd,
                 dk.to(DKP.dtype.element_ty), mask=d_ok)
        tl.store(DVP + b * sdvb + h * sdvh + j * sdvn + offs_dv * sdvd,
                 dv.to(DVP.dtype.element_ty), mask=dv_ok)


# ====================================================================== helpers

def _groups(t, Hkv, G):
    """(b, h, ...) with h in {1, Hkv, Hkv*G} -> (b, hkv|1, g|1, ...) view."""
    if t.shape[1] == Hkv * G and G > 1:
        return t.unflatten(1, (Hkv, G))
    return t.unsqueeze(2)


def _bias5(bias, B, Hkv, G, Lq, Lk):
    """Bias as an expanded (B, Hkv, G, Lq, Lk) view (stride 0 on broadcast dims)."""
    return _groups(bias, Hkv, G).expand(B, Hkv, G, Lq, Lk)


def _idx4(idx, B, Hkv, Lq, W):
    return idx.expand(B, Hkv, Lq, W)


def _fwd_config(D_PAD, DV_PAD, W, options):
    """(BLOCK_W, num_warps, num_stages) of the forward: kernel option index_fwd_config, or
    the tuned choice."""
    if options.index_fwd_config is not None:
        return options.index_fwd_config
    bw = 32 if max(D_PAD, DV_PAD) > 128 else 64
    return min(bw, max(16, _next_pow2(W))), 4, 2


def _bwd_config(D_PAD, DV_PAD, W, options):
    """(BLOCK_W, num_warps, num_stages) of the per-query backward: index_bwd_config, or the
    tuned choice."""
    if options.index_bwd_config is not None:
        return options.index_bwd_config
    bw = 16 if max(D_PAD, DV_PAD) > 128 else 32
    return min(bw, max(16, _next_pow2(W))), 4, 2


def _bwd_kv_config(D_PAD, DV_PAD, G_P2, options):
    """(list entries per step, num_warps) of the per-key backward: from
    index_bwd_kv_config's (rows, num_warps), or the tuned choice."""
    rows, warps = options.index_bwd_kv_config or (32 if max(D_PAD, DV_PAD) > 128 else 64, 4)
    return max(1, rows // G_P2), warps


def _pads(G, D, Dv):
    return max(16, _next_pow2(G)), max(16, _next_pow2(D)), max(16, _next_pow2(Dv))


def _launch_opts(num_warps, num_stages):
    if interpreting():
        return {}
    return {"num_warps": num_warps, "num_stages": num_stages}


# ====================================================================== forward

def forward(query, key, value, bias, mask, scale, softcap, options=DEFAULT_OPTIONS):
    idx = mask.attn_indices
    B, Hq, Lq, D = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    Dv = value.shape[-1]
    G = Hq // Hkv
    W = idx.shape[-1]
    out = _empty((B, Hq, Lq, Dv), query.dtype, query.device)
    lse = _empty((B, Hq, Lq), torch.float32, query.device)
    if B == 0 or Hq == 0 or Lq == 0:
        return out, lse
    if W == 0 or Lk == 0:
        out.zero_()
        lse.fill_(-math.inf)
        return out, lse
    G_PAD, D_PAD, DV_PAD = _pads(G, D, Dv)
    q5 = query.unflatten(1, (Hkv, G))
    o5 = out.unflatten(1, (Hkv, G))
    l4 = lse.unflatten(1, (Hkv, G))
    i4 = _idx4(idx, B, Hkv, Lq, W)
    has_bias = bias is not None
    b5 = _bias5(bias, B, Hkv, G, Lq, Lk) if has_bias else None
    bstr = b5.stride() if has_bias else (0, 0, 0, 0, 0)
    block_w, num_warps, num_stages = _fwd_config(D_PAD, DV_PAD, W, options)
    grid = (Lq, Hkv, B)
    _fwd_kernel[grid](
        q5, key, value, i4, b5 if has_bias else q5, o5, l4,
        *q5.stride(), *key.stride(), *value.stride(), *i4.stride(), *bstr,
        *o5.stride(), *l4.stride(),
        G, Lk, W, D, Dv,
        float(scale), float(softcap),
        G_PAD=G_PAD, D_PAD=D_PAD, DV_PAD=DV_PAD, EVEN_D=D == D_PAD, EVEN_DV=Dv == DV_PAD, BLOCK_W=block_w,
        HAS_BIAS=has_bias, HAS_SOFTCAP=softcap > 0, IEEE=query.dtype == torch.float32,
        **_launch_opts(num_warps, num_stages))
    return out, lse


# ====================================================================== backward

@contextlib.contextmanager
def _torch_deterministic(enabled: bool):
    """Turn on torch's deterministic algorithms for a scatter (restored afterwards)."""
    if not enabled:
        yield
        return
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=prev_warn)


def transposed_csr(idx, Lk):
    """Key -> entries of the index lists, stable in (query, slot) order.

    idx (Bi, Hi, Lq, W) -> rowptr (Bi, Hi, Lk + 1) and qidx (Bi, Hi, Lq*W): entries
    rowptr[j]:rowptr[j+1] of qidx are the query rows that list key j (once per occurrence),
    ascending. Entries < 0 or >= Lk are dropped (sorted past the end).
    """
    Bi, Hi, Lq, W = idx.shape
    n = Lq * W
    flat = idx.reshape(Bi * Hi, n)
    kdt = torch.int32 if Lk < 2**31 - 1 else torch.int64
    keys = torch.where((flat >= 0) & (flat < Lk), flat, Lk).to(kdt)
    sorted_keys, perm = torch.sort(keys, dim=-1, stable=True)
    bounds = torch.arange(Lk + 1, device=idx.device, dtype=kdt).expand(Bi * Hi, Lk + 1).contiguous()
    rowptr = torch.searchsorted(sorted_keys, bounds, out_int32=n < 2**31 - 1)
    qidx = torch.div(perm, W, rounding_mode="floor").to(torch.int32 if Lq < 2**31 else torch.int64)
    return rowptr.view(Bi, Hi, Lk + 1), qidx.view(Bi, Hi, n)


def _reduce_dbias(ds5, idx, bias, B, Hkv, G, Lq, Lk, W, deterministic):
    """ds5 (B, Hkv, G, Lq, W) float32: dL/d(gathered bias) -> dbias in the bias's shape."""
    Bb, Hb, Lqb, Lkb = bias.shape
    Bi, Hi = idx.shape[:2]
    t = ds5
    keep_g = Hb == Hkv * G and G > 1
    if not keep_g:
        t = t.sum(2, keepdim=True)                      # (B, Hkv, 1, Lq, W)
    # Sums over broadcast batch / head dims commute with the scatter when the index lists
    # are shared along that dim.
    if Hb == 1 and Hi == 1 and Hkv > 1:
        t = t.sum(1, keepdim=True)
    if Bb == 1 and Bi == 1 and B > 1:
        t = t.sum(0, keepdim=True)
    if Lkb == 1:
        t = t.sum(-1, keepdim=True)                     # (., ., ., Lq, 1)
        if Lqb == 1:
            t = t.sum(-2, keepdim=True)
    else:
        ix = idx.to(torch.int64)
        ix = torch.where((ix >= 0) & (ix < Lk), ix, torch.zeros_like(ix))  # ds is 0 there
        ix = ix.unsqueeze(2).expand(t.shape[0], t.shape[1], t.shape[2], Lq, W)
        if Lqb == 1:
            t = t.flatten(-2, -1).unsqueeze(-2)
            ix = ix.flatten(-2, -1).unsqueeze(-2)
        full = torch.zeros(t.shape[:-1] + (Lk,), dtype=torch.float32, device=t.device)
        with _torch_deterministic(deterministic and t.device.type == "cuda"):
            full.scatter_add_(-1, ix, t)
        t = full
    # Remaining broadcast dims.
    if Hb == 1 and t.shape[1] > 1:
        t = t.sum(1, keepdim=True)
    if Bb == 1 and t.shape[0] > 1:
        t = t.sum(0, keepdim=True)
    t = t.flatten(1, 2) if keep_g else t.squeeze(2)
    return t.reshape(bias.shape).to(bias.dtype)


def backward(grad_out, grad_lse, query, key, value, out, lse, bias, mask, scale, softcap,
             deterministic, bias_requires_grad, options=DEFAULT_OPTIONS):
    idx = mask.attn_indices
    B, Hq, Lq, D = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    Dv = value.shape[-1]
    G = Hq // Hkv
    W = idx.shape[-1]
    dev = query.device
    want_dbias = bias is not None and bias_requires_grad
    dq = _empty(query.shape, query.dtype, dev)
    if B == 0 or Hq == 0 or Lq == 0 or W == 0 or Lk == 0:
        dq.zero_()
        dbias = torch.zeros_like(bias) if want_dbias else query.new_empty((0,))
        return dq, torch.zeros_like(key), torch.zeros_like(value), dbias

    G_PAD, D_PAD, DV_PAD = _pads(G, D, Dv)
    q5 = query.unflatten(1, (Hkv, G))
    o5 = out.unflatten(1, (Hkv, G))
    do5 = grad_out.unflatten(1, (Hkv, G))
    l4 = lse.unflatten(1, (Hkv, G))
    has_dlse = grad_lse is not None
    dl4 = grad_lse.unflatten(1, (Hkv, G)) if has_dlse else l4
    dq5 = dq.unflatten(1, (Hkv, G))
    i4 = _idx4(idx, B, Hkv, Lq, W)
    has_bias = bias is not None
    b5 = _bias5(bias, B, Hkv, G, Lq, Lk) if has_bias else None
    bstr = b5.stride() if has_bias else (0, 0, 0, 0, 0)

    atomic = not deterministic
    if atomic:
        kv_f32 = key.dtype == torch.float32
        dk_acc = torch.zeros(key.shape, dtype=torch.float32, device=dev)
        dv_acc = torch.zeros(value.shape, dtype=torch.float32, device=dev)
        delta = l4  # unused
    else:
        dk_acc, dv_acc = key, value  # unused by the per-query kernel
        delta = _empty((B, Hkv, G, Lq), torch.float32, dev)
    ds5 = _empty((B, Hkv, G, Lq, W), torch.float32, dev) if want_dbias else None
    dsx = ds5 if want_dbias else l4.unsqueeze(-1)

    block_w, num_warps, num_stages = _bwd_config(D_PAD, DV_PAD, W, options)
    _bwd_q_kernel[(Lq, Hkv, B)](
        q5, key, value, i4, b5 if has_bias else q5, o5, do5, l4, dl4, dq5, dk_acc, dv_acc,
        dsx, delta,
        *q5.stride(), *key.stride(), *value.stride(), *i4.stride(), *bstr,
        *o5.stride(), *do5.stride(), *l4.stride(), *dl4.stride(), *dq5.stride(),
        *dk_acc.stride(), *dv_acc.stride(), *dsx.stride(), *delta.stride(),
        G, Lk, W, D, Dv,
        float(scale), float(softcap),
        G_PAD=G_PAD, D_PAD=D_PAD, DV_PAD=DV_PAD, EVEN_D=D == D_PAD, EVEN_DV=Dv == DV_PAD, BLOCK_W=block_w,
        HAS_BIAS=has_bias, HAS_SOFTCAP=softcap > 0, HAS_DLSE=has_dlse,
        ATOMIC_KV=atomic, WRITE_DS=want_dbias, WRITE_DELTA=not atomic,
        IEEE=query.dtype == torch.float32,
        **_launch_opts(num_warps, num_stages))

    if atomic:
        dk = dk_acc if kv_f32 else dk_acc.to(key.dtype)
        dv = dv_acc if kv_f32 else dv_acc.to(value.dtype)
    else:
        dk = _empty(key.shape, key.dtype, dev)
        dv = _empty(value.shape, value.dtype, dev)
        rowptr, qidx = transposed_csr(idx, Lk)
        rp = rowptr.expand(B, Hkv, Lk + 1)
        qx = qidx.expand(B, Hkv, qidx.shape[-1])
        G_P2 = _next_pow2(G)
        block_e, nw = _bwd_kv_config(D_PAD, DV_PAD, G_P2, options)
        _bwd_kv_kernel[(Lk, Hkv, B)](
            q5, key, value, b5 if has_bias else q5, do5, l4, delta, rp, qx, dk, dv,
            *q5.stride(), *key.stride(), *value.stride(), *bstr, *do5.stride(),
            *l4.stride(), *delta.stride(), *rp.stride(), qx.stride(0), qx.stride(1),
            *dk.stride(), *dv.stride(),
            G, D, Dv,
            float(scale), float(softcap),
            G_P2=G_P2, BLOCK_E=block_e, D_PAD=D_PAD, DV_PAD=DV_PAD, EVEN_D=D == D_PAD, EVEN_DV=Dv == DV_PAD,
            HAS_BIAS=has_bias, HAS_SOFTCAP=softcap > 0,
            **_launch_opts(nw, 1))

    if want_dbias:
        dbias = _reduce_dbias(ds5, idx, bias, B, Hkv, G, Lq, Lk, W, deterministic)
    else:
        dbias = query.new_empty((0,))
    return dq, dk, dv, dbias
