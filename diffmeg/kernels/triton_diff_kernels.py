"""Triton kernels of the fused differential flash-attention; `triton_diff.py` holds the math and launches.

Importing this module imports triton. Whether `triton.jit` builds compiled kernels or interpreted ones is
decided by TRITON_INTERPRET when this module is imported; `INTERPRETED` records it so the launcher can
reload the module if the variable changed afterwards (tests set it before their first launch).

Conventions shared by all kernels:
  * scores are kept in log2 units (`scale_log2 = scale * log2(e)`, `exp2`), so the saved
    log-sum-exps LSE1/LSE2 are base-2: P = exp2(s * scale_log2 - LSE).
  * causal with queries aligned to the end of the keys: query row i sits at key position
    i + (SK - SQ) and sees keys j <= i + (SK - SQ).
  * only builtins of triton.language are used, none of its own @jit functions (tl.zeros, tl.max,
    tl.sum, tl.cdiv): those are compiled-or-interpreted once, when triton is first imported (by
    megatron-core, say), and a compiled one cannot be called from an interpreted kernel. Row max/sum go
    through tl.reduce with triton's own combine functions (the same IR as tl.max/tl.sum on fp32, and
    the interpreter's numpy fast path), so TRITON_INTERPRET=1 works whenever it is set.
  * sequence offsets inside one (batch, head) are int32 (the launcher makes inputs contiguous when
    rows * row-stride would not fit); batch and head offsets are int64.
  * a head dim (or V width) that is not a power of two but the sum of two (96 = 64 + 32, V: 192 = 128 + 64)
    is held as two exact tiles, BLOCK_D and BLOCK_D2 (HAS_D2; likewise BLOCK_DV2 / HAS_DV2): every dot
    over it is two dots and every [rows, d] accumulator two accumulators, so nothing is padded. Other
    widths are padded to the next power of two and masked (PAD_D / PAD_DV). Without HAS_D2 the "b"
    arguments are unused placeholders.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

INTERPRETED: bool = bool(knobs.runtime.interpret)


@triton.jit
def _row_max(x):
    return tl.reduce(x, 1, tl.standard._elementwise_max)


@triton.jit
def _row_sum(x):
    return tl.reduce(x, 1, tl.standard._sum_combine)


@triton.jit
def _load_tile(ptrs, rows, n_rows, cols, n_cols, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """Load a 2-D tile, masking rows/cols only where the constexpr flags say padding exists."""
    if MASK_ROWS:
        if MASK_COLS:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
        else:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        if MASK_COLS:
            x = tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _store_tile(ptrs, x, rows, n_rows, cols, n_cols, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    if MASK_ROWS:
        if MASK_COLS:
            tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))
        else:
            tl.store(ptrs, x, mask=rows[:, None] < n_rows)
    else:
        if MASK_COLS:
            tl.store(ptrs, x, mask=cols[None, :] < n_cols)
        else:
            tl.store(ptrs, x)


@triton.jit
def _load_rows(ptrs, rows, n_rows, MASK_ROWS: tl.constexpr):
    if MASK_ROWS:
        x = tl.load(ptrs, mask=rows < n_rows, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


# ----------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(
    acc1,
    acc1b,
    acc2,
    acc2b,
    m1,
    m2,
    l1,
    l2,
    q1,
    q1b,
    q2,
    q2b,
    k1_ptrs,
    k1b_ptrs,
    k2_ptrs,
    k2b_ptrs,
    v_ptrs,
    vb_ptrs,
    stride_k1s,
    stride_k2s,
    stride_vs,
    offs_m,
    offs_n,
    offs_d,
    offs_d2,
    offs_c,
    offs_c2,
    lo,
    hi,
    SK,
    HEAD_DIM,
    DV_WIDTH,
    causal,
    scale_log2,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAD_D: tl.constexpr,
    PAD_DV: tl.constexpr,
    HAS_D2: tl.constexpr,
    HAS_DV2: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Keys [lo, hi): both online softmaxes share each K/V tile; MASKED applies causal + length masks."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k1 = _load_tile(k1_ptrs + start_n * stride_k1s, cols, SK, offs_d, HEAD_DIM, MASKED, PAD_D)
        k2 = _load_tile(k2_ptrs + start_n * stride_k2s, cols, SK, offs_d, HEAD_DIM, MASKED, PAD_D)
        v = _load_tile(v_ptrs + start_n * stride_vs, cols, SK, offs_c, DV_WIDTH, MASKED, PAD_DV)
        # Map 1 then map 2 on the same K/V tile (sequential keeps fewer [BM, BN] tiles live).
        s1 = tl.dot(q1, tl.trans(k1), input_precision=PRECISION)  # [BM, BN]
        if HAS_D2:
            k1b = _load_tile(k1b_ptrs + start_n * stride_k1s, cols, SK, offs_d2, HEAD_DIM, MASKED, False)
            s1 = tl.dot(q1b, tl.trans(k1b), s1, input_precision=PRECISION)
        s1 = s1 * scale_log2
        if MASKED:
            keep = (cols[None, :] <= offs_m[:, None] + causal) & (cols[None, :] < SK)
            s1 = tl.where(keep, s1, float("-inf"))
        # Every row sees key 0 (SK >= SQ) and tiles are visited from key 0 on, so m stays finite after the
        # first tile, and a fully masked row of a later tile just contributes exp2(-inf) = 0.
        m1_new = tl.maximum(m1, _row_max(s1))
        alpha1 = tl.exp2(m1 - m1_new)
        p1 = tl.exp2(s1 - m1_new[:, None])
        l1 = l1 * alpha1 + _row_sum(p1)
        acc1 = tl.dot(p1.to(v.dtype), v, acc1 * alpha1[:, None], input_precision=PRECISION)
        if HAS_DV2:
            vb = _load_tile(vb_ptrs + start_n * stride_vs, cols, SK, offs_c2, DV_WIDTH, MASKED, False)
            acc1b = tl.dot(p1.to(vb.dtype), vb, acc1b * alpha1[:, None], input_precision=PRECISION)
        m1 = m1_new

        s2 = tl.dot(q2, tl.trans(k2), input_precision=PRECISION)
        if HAS_D2:
            k2b = _load_tile(k2b_ptrs + start_n * stride_k2s, cols, SK, offs_d2, HEAD_DIM, MASKED, False)
            s2 = tl.dot(q2b, tl.trans(k2b), s2, input_precision=PRECISION)
        s2 = s2 * scale_log2
        if MASKED:
            s2 = tl.where(keep, s2, float("-inf"))
        m2_new = tl.maximum(m2, _row_max(s2))
        alpha2 = tl.exp2(m2 - m2_new)
        p2 = tl.exp2(s2 - m2_new[:, None])
        l2 = l2 * alpha2 + _row_sum(p2)
        acc2 = tl.dot(p2.to(v.dtype), v, acc2 * alpha2[:, None], input_precision=PRECISION)
        if HAS_DV2:
            acc2b = tl.dot(p2.to(vb.dtype), vb, acc2b * alpha2[:, None], input_precision=PRECISION)
        m2 = m2_new
    return acc1, acc1b, acc2, acc2b, m1, m2, l1, l2


@triton.jit
def diff_fwd_kernel(
    Q1,
    Q2,
    K1,
    K2,
    V,
    LAM,
    OUT,
    O2,
    LSE1,
    LSE2,
    stride_q1b,
    stride_q1h,
    stride_q1s,
    stride_q2b,
    stride_q2h,
    stride_q2s,
    stride_k1b,
    stride_k1h,
    stride_k1s,
    stride_k2b,
    stride_k2h,
    stride_k2s,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_ob,
    stride_oh,
    stride_os,
    H,
    REP,
    SQ,
    SK,
    HEAD_DIM,
    DV_WIDTH,
    scale_log2,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DV2: tl.constexpr,
    MASK_M: tl.constexpr,
    PAD_D: tl.constexpr,
    PAD_DV: tl.constexpr,
    HAS_D2: tl.constexpr,
    HAS_DV2: tl.constexpr,
    STORE_O2: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One query block of one head, one slice of V's columns: O = A1 V - lam A2 V in a single K/V pass.

    grid = (cdiv(SQ, BLOCK_M), B * H, V slices); DV_WIDTH = 2d / slices columns per program.
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_v = tl.program_id(2)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    g = h // REP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)  # the second tile of a split head dim (HAS_D2)
    offs_c = tl.arange(0, BLOCK_DV)
    offs_c2 = BLOCK_DV + tl.arange(0, BLOCK_DV2)
    col0 = pid_v * DV_WIDTH

    # Pointer tiles are written out in full for each tile (no shared [rows, 1] base: ptxas spills more).
    q1 = _load_tile(
        Q1 + b * stride_q1b + h * stride_q1h + offs_m[:, None] * stride_q1s + offs_d[None, :],
        offs_m, SQ, offs_d, HEAD_DIM, MASK_M, PAD_D,
    )  # fmt: skip
    q2 = _load_tile(
        Q2 + b * stride_q2b + h * stride_q2h + offs_m[:, None] * stride_q2s + offs_d[None, :],
        offs_m, SQ, offs_d, HEAD_DIM, MASK_M, PAD_D,
    )  # fmt: skip
    q1b = q1
    q2b = q2
    if HAS_D2:
        q1b = _load_tile(
            Q1 + b * stride_q1b + h * stride_q1h + offs_m[:, None] * stride_q1s + offs_d2[None, :],
            offs_m, SQ, offs_d2, HEAD_DIM, MASK_M, False,
        )  # fmt: skip
        q2b = _load_tile(
            Q2 + b * stride_q2b + h * stride_q2h + offs_m[:, None] * stride_q2s + offs_d2[None, :],
            offs_m, SQ, offs_d2, HEAD_DIM, MASK_M, False,
        )  # fmt: skip
    k1_ptrs = K1 + b * stride_k1b + g * stride_k1h + offs_n[:, None] * stride_k1s + offs_d[None, :]
    k1b_ptrs = K1 + b * stride_k1b + g * stride_k1h + offs_n[:, None] * stride_k1s + offs_d2[None, :]
    k2_ptrs = K2 + b * stride_k2b + g * stride_k2h + offs_n[:, None] * stride_k2s + offs_d[None, :]
    k2b_ptrs = K2 + b * stride_k2b + g * stride_k2h + offs_n[:, None] * stride_k2s + offs_d2[None, :]
    v_ptrs = V + b * stride_vb + g * stride_vh + offs_n[:, None] * stride_vs + col0 + offs_c[None, :]
    vb_ptrs = V + b * stride_vb + g * stride_vh + offs_n[:, None] * stride_vs + col0 + offs_c2[None, :]

    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    m2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l1 = tl.full([BLOCK_M], 0.0, tl.float32)
    l2 = tl.full([BLOCK_M], 0.0, tl.float32)
    acc1 = tl.full([BLOCK_M, BLOCK_DV], 0.0, tl.float32)
    acc2 = tl.full([BLOCK_M, BLOCK_DV], 0.0, tl.float32)
    if HAS_DV2:
        acc1b = tl.full([BLOCK_M, BLOCK_DV2], 0.0, tl.float32)
        acc2b = tl.full([BLOCK_M, BLOCK_DV2], 0.0, tl.float32)
    else:
        acc1b = tl.full([1, 1], 0.0, tl.float32)  # unused placeholders
        acc2b = tl.full([1, 1], 0.0, tl.float32)

    causal = SK - SQ
    # Keys [0, n_full) are inside SK and visible to every row of the block: no masks there.
    n_full = (tl.minimum(start_m + causal + 1, SK) // BLOCK_N) * BLOCK_N
    n_end = tl.minimum(SK, start_m + BLOCK_M + causal)
    acc1, acc1b, acc2, acc2b, m1, m2, l1, l2 = _fwd_inner(
        acc1, acc1b, acc2, acc2b, m1, m2, l1, l2, q1, q1b, q2, q2b, k1_ptrs, k1b_ptrs, k2_ptrs, k2b_ptrs,
        v_ptrs, vb_ptrs, stride_k1s, stride_k2s, stride_vs, offs_m, offs_n, offs_d, offs_d2, offs_c, offs_c2,
        0, n_full, SK, HEAD_DIM, DV_WIDTH, causal, scale_log2,
        False, BLOCK_N, PAD_D, PAD_DV, HAS_D2, HAS_DV2, PRECISION,
    )  # fmt: skip
    acc1, acc1b, acc2, acc2b, m1, m2, l1, l2 = _fwd_inner(
        acc1, acc1b, acc2, acc2b, m1, m2, l1, l2, q1, q1b, q2, q2b, k1_ptrs, k1b_ptrs, k2_ptrs, k2b_ptrs,
        v_ptrs, vb_ptrs, stride_k1s, stride_k2s, stride_vs, offs_m, offs_n, offs_d, offs_d2, offs_c, offs_c2,
        n_full, n_end, SK, HEAD_DIM, DV_WIDTH, causal, scale_log2,
        True, BLOCK_N, PAD_D, PAD_DV, HAS_D2, HAS_DV2, PRECISION,
    )  # fmt: skip

    lam = tl.load(LAM).to(tl.float32)
    o2 = acc2 / l2[:, None]
    out = acc1 / l1[:, None] - lam * o2
    o_off = b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + col0 + offs_c[None, :]
    _store_tile(OUT + o_off, out.to(OUT.dtype.element_ty), offs_m, SQ, offs_c, DV_WIDTH, MASK_M, PAD_DV)
    if STORE_O2:
        _store_tile(O2 + o_off, o2.to(O2.dtype.element_ty), offs_m, SQ, offs_c, DV_WIDTH, MASK_M, PAD_DV)
    if HAS_DV2:
        o2b = acc2b / l2[:, None]
        outb = acc1b / l1[:, None] - lam * o2b
        ob_off = b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + col0 + offs_c2[None, :]
        _store_tile(OUT + ob_off, outb.to(OUT.dtype.element_ty), offs_m, SQ, offs_c2, DV_WIDTH, MASK_M, False)
        if STORE_O2:
            o2b = o2b.to(O2.dtype.element_ty)
            _store_tile(O2 + ob_off, o2b, offs_m, SQ, offs_c2, DV_WIDTH, MASK_M, False)
    if pid_v == 0:
        lse_off = pid_bh.to(tl.int64) * SQ + offs_m
        if MASK_M:
            tl.store(LSE1 + lse_off, m1 + tl.log2(l1), mask=offs_m < SQ)
            tl.store(LSE2 + lse_off, m2 + tl.log2(l2), mask=offs_m < SQ)
        else:
            tl.store(LSE1 + lse_off, m1 + tl.log2(l1))
            tl.store(LSE2 + lse_off, m2 + tl.log2(l2))


# ----------------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------------


@triton.jit
def diff_bwd_preprocess_kernel(
    OUT,
    O2,
    DO,
    LAM,
    DELTA1,
    DELTA2,
    stride_ob,
    stride_oh,
    stride_os,
    stride_dob,
    stride_doh,
    stride_dos,
    H,
    SQ,
    DV,
    BLOCK_M: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    MASK_M: tl.constexpr,
    PAD_DV: tl.constexpr,
):
    """Row sums delta2 = dO . O2 and delta1 = dO . O1 = dO . (O + lam O2); O2 = A2 V from the forward."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, BLOCK_DV)
    o_off = b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_c[None, :]
    do_off = b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_c[None, :]
    o = _load_tile(OUT + o_off, offs_m, SQ, offs_c, DV, MASK_M, PAD_DV).to(tl.float32)
    o2 = _load_tile(O2 + o_off, offs_m, SQ, offs_c, DV, MASK_M, PAD_DV).to(tl.float32)
    do = _load_tile(DO + do_off, offs_m, SQ, offs_c, DV, MASK_M, PAD_DV).to(tl.float32)
    lam = tl.load(LAM).to(tl.float32)
    d2 = _row_sum(do * o2)
    d1 = _row_sum(do * o) + lam * d2
    row = pid_bh.to(tl.int64) * SQ + offs_m
    if MASK_M:
        tl.store(DELTA1 + row, d1, mask=offs_m < SQ)
        tl.store(DELTA2 + row, d2, mask=offs_m < SQ)
    else:
        tl.store(DELTA1 + row, d1)
        tl.store(DELTA2 + row, d2)


@triton.jit
def _bwd_dkdv_inner(
    dv,
    dvb,
    dk1,
    dk1b,
    dk2,
    dk2b,
    k1,
    k1b,
    k2,
    k2b,
    v,
    vb,
    lam,
    q1_ptrs,
    q1b_ptrs,
    q2_ptrs,
    q2b_ptrs,
    do_ptrs,
    dob_ptrs,
    lse1_ptr,
    lse2_ptr,
    d1_ptr,
    d2_ptr,
    stride_q1s,
    stride_q2s,
    stride_dos,
    offs_n,
    offs_mb,
    offs_d,
    offs_d2,
    offs_c,
    offs_c2,
    lo,
    hi,
    SQ,
    HEAD_DIM,
    DV,
    causal,
    scale_log2,
    MASKED: tl.constexpr,
    MASK_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PAD_D: tl.constexpr,
    PAD_DV: tl.constexpr,
    HAS_D2: tl.constexpr,
    HAS_DV2: tl.constexpr,
    PRECISION: tl.constexpr,
    DO_DV: tl.constexpr,
    DO_DK1: tl.constexpr,
    DO_DK2: tl.constexpr,
):
    """Query blocks [lo, hi) against one key block, in the transposed [keys, queries] layout.

    Query rows past SQ load q = dO = delta = 0, so they add exactly nothing to dV and dK.
    """
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_mb
        q1 = _load_tile(q1_ptrs + start_m * stride_q1s, rows, SQ, offs_d, HEAD_DIM, MASK_M, PAD_D)
        q2 = _load_tile(q2_ptrs + start_m * stride_q2s, rows, SQ, offs_d, HEAD_DIM, MASK_M, PAD_D)
        do = _load_tile(do_ptrs + start_m * stride_dos, rows, SQ, offs_c, DV, MASK_M, PAD_DV)
        lse1 = _load_rows(lse1_ptr + rows, rows, SQ, MASK_M)
        lse2 = _load_rows(lse2_ptr + rows, rows, SQ, MASK_M)
        d1 = _load_rows(d1_ptr + rows, rows, SQ, MASK_M)
        d2 = _load_rows(d2_ptr + rows, rows, SQ, MASK_M)
        if MASKED:
            keep = (offs_n[:, None] <= rows[None, :] + causal) & (rows[None, :] < SQ)
        if DO_DV or DO_DK1:
            s1t = tl.dot(k1, tl.trans(q1), input_precision=PRECISION)
            if HAS_D2:
                q1b = _load_tile(q1b_ptrs + start_m * stride_q1s, rows, SQ, offs_d2, HEAD_DIM, MASK_M, False)
                s1t = tl.dot(k1b, tl.trans(q1b), s1t, input_precision=PRECISION)
            p1t = tl.exp2(s1t * scale_log2 - lse1[None, :])
            if MASKED:
                p1t = tl.where(keep, p1t, 0.0)
        if DO_DV or DO_DK2:
            s2t = tl.dot(k2, tl.trans(q2), input_precision=PRECISION)
            if HAS_D2:
                q2b = _load_tile(q2b_ptrs + start_m * stride_q2s, rows, SQ, offs_d2, HEAD_DIM, MASK_M, False)
                s2t = tl.dot(k2b, tl.trans(q2b), s2t, input_precision=PRECISION)
            p2t = tl.exp2(s2t * scale_log2 - lse2[None, :])
            if MASKED:
                p2t = tl.where(keep, p2t, 0.0)
        if HAS_DV2:
            dob = _load_tile(dob_ptrs + start_m * stride_dos, rows, SQ, offs_c2, DV, MASK_M, False)
        if DO_DV:  # dV = (A1 - lam A2)^T dO: one matmul for both maps
            pt = (p1t - lam * p2t).to(do.dtype)
            dv = tl.dot(pt, do, dv, input_precision=PRECISION)
            if HAS_DV2:
                dvb = tl.dot(pt, dob, dvb, input_precision=PRECISION)
        if DO_DK1 or DO_DK2:
            dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # [BN, BM]: dP shared by both maps
            if HAS_DV2:
                dpt = tl.dot(vb, tl.trans(dob), dpt, input_precision=PRECISION)
        # dS1 = A1 (dP - delta1); dS2 = -lam A2 (dP - delta2), the -lam applied once at the end.
        if DO_DK1:
            ds1t = (p1t * (dpt - d1[None, :])).to(q1.dtype)
            dk1 = tl.dot(ds1t, q1, dk1, input_precision=PRECISION)
            if HAS_D2:
                dk1b = tl.dot(ds1t, q1b, dk1b, input_precision=PRECISION)
        if DO_DK2:
            ds2t = (p2t * (dpt - d2[None, :])).to(q2.dtype)
            dk2 = tl.dot(ds2t, q2, dk2, input_precision=PRECISION)
            if HAS_D2:
                dk2b = tl.dot(ds2t, q2b, dk2b, input_precision=PRECISION)
    return dv, dvb, dk1, dk1b, dk2, dk2b


@triton.jit
def diff_bwd_dkdv_kernel(
    Q1,
    Q2,
    K1,
    K2,
    V,
    DO,
    LAM,
    LSE1,
    LSE2,
    DELTA1,
    DELTA2,
    DK1,
    DK2,
    DV_OUT,
    stride_q1b,
    stride_q1h,
    stride_q1s,
    stride_q2b,
    stride_q2h,
    stride_q2s,
    stride_k1b,
    stride_k1h,
    stride_k1s,
    stride_k2b,
    stride_k2h,
    stride_k2s,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_dob,
    stride_doh,
    stride_dos,
    stride_dkb,
    stride_dkh,
    stride_dks,
    stride_dvb,
    stride_dvh,
    stride_dvs,
    H,
    G,
    REP,
    SQ,
    SK,
    HEAD_DIM,
    DV,
    scale,
    scale_log2,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DV2: tl.constexpr,
    MASK_M: tl.constexpr,
    MASK_N: tl.constexpr,
    PAD_D: tl.constexpr,
    PAD_DV: tl.constexpr,
    HAS_D2: tl.constexpr,
    HAS_DV2: tl.constexpr,
    PRECISION: tl.constexpr,
    DO_DV: tl.constexpr,
    DO_DK1: tl.constexpr,
    DO_DK2: tl.constexpr,
):
    """dK1, dK2, dV of one key block of one KV head, summed over the REP query heads that share it (GQA).

    grid = (cdiv(SK, BLOCK_N), B * G). No atomics: each program owns its rows of dK1, dK2, dV.
    dK1, dK2 (same layout) are written contiguous by the launcher. DO_DV / DO_DK1 / DO_DK2 select the
    outputs: all in one pass (accumulators [BN, 4d]); dV and dK in two launches ([BN, 2d] each; P1, P2
    recomputed by both: 20d instead of 16d FLOPs per query-key pair); or dV, dK1, dK2 in three ([BN, 2d],
    [BN, d], [BN, d]; 24d) where even [BN, 2d] with both K tiles resident does not fit the registers.
    """
    pid_n = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = (pid_bg // G).to(tl.int64)
    g = (pid_bg % G).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_mb = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
    offs_c = tl.arange(0, BLOCK_DV)
    offs_c2 = BLOCK_DV + tl.arange(0, BLOCK_DV2)

    k1 = _load_tile(
        K1 + b * stride_k1b + g * stride_k1h + offs_n[:, None] * stride_k1s + offs_d[None, :],
        offs_n, SK, offs_d, HEAD_DIM, MASK_N, PAD_D,
    )  # fmt: skip
    k2 = _load_tile(
        K2 + b * stride_k2b + g * stride_k2h + offs_n[:, None] * stride_k2s + offs_d[None, :],
        offs_n, SK, offs_d, HEAD_DIM, MASK_N, PAD_D,
    )  # fmt: skip
    v = _load_tile(
        V + b * stride_vb + g * stride_vh + offs_n[:, None] * stride_vs + offs_c[None, :],
        offs_n, SK, offs_c, DV, MASK_N, PAD_DV,
    )  # fmt: skip
    k1b = k1  # placeholders unless the widths are split
    k2b = k2
    vb = v
    if HAS_D2:
        k1b = _load_tile(
            K1 + b * stride_k1b + g * stride_k1h + offs_n[:, None] * stride_k1s + offs_d2[None, :],
            offs_n, SK, offs_d2, HEAD_DIM, MASK_N, False,
        )  # fmt: skip
        k2b = _load_tile(
            K2 + b * stride_k2b + g * stride_k2h + offs_n[:, None] * stride_k2s + offs_d2[None, :],
            offs_n, SK, offs_d2, HEAD_DIM, MASK_N, False,
        )  # fmt: skip
    if HAS_DV2:
        vb = _load_tile(
            V + b * stride_vb + g * stride_vh + offs_n[:, None] * stride_vs + offs_c2[None, :],
            offs_n, SK, offs_c2, DV, MASK_N, False,
        )  # fmt: skip
    lam = tl.load(LAM).to(tl.float32)
    dv = tl.full([1, 1], 0.0, tl.float32)  # placeholders for the outputs this launch does not make
    dvb = tl.full([1, 1], 0.0, tl.float32)
    dk1 = tl.full([1, 1], 0.0, tl.float32)
    dk2 = tl.full([1, 1], 0.0, tl.float32)
    dk1b = tl.full([1, 1], 0.0, tl.float32)
    dk2b = tl.full([1, 1], 0.0, tl.float32)
    if DO_DV:
        dv = tl.full([BLOCK_N, BLOCK_DV], 0.0, tl.float32)
        if HAS_DV2:
            dvb = tl.full([BLOCK_N, BLOCK_DV2], 0.0, tl.float32)
    if DO_DK1:
        dk1 = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
        if HAS_D2:
            dk1b = tl.full([BLOCK_N, BLOCK_D2], 0.0, tl.float32)
    if DO_DK2:
        dk2 = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
        if HAS_D2:
            dk2b = tl.full([BLOCK_N, BLOCK_D2], 0.0, tl.float32)

    causal = SK - SQ
    # Rows before m_lo see no key of this block; rows from m_full on see all of it (causally).
    m_lo = (tl.maximum(start_n - causal, 0) // BLOCK_M) * BLOCK_M
    m_full = tl.minimum(
        (tl.maximum(start_n + BLOCK_N - 1 - causal, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M, SQ
    )
    m_full = tl.maximum(m_full, m_lo)
    for r in range(0, REP):
        h = g * REP + r
        bh = b * H + h
        q1_ptrs = Q1 + b * stride_q1b + h * stride_q1h + offs_mb[:, None] * stride_q1s + offs_d[None, :]
        q1b_ptrs = Q1 + b * stride_q1b + h * stride_q1h + offs_mb[:, None] * stride_q1s + offs_d2[None, :]
        q2_ptrs = Q2 + b * stride_q2b + h * stride_q2h + offs_mb[:, None] * stride_q2s + offs_d[None, :]
        q2b_ptrs = Q2 + b * stride_q2b + h * stride_q2h + offs_mb[:, None] * stride_q2s + offs_d2[None, :]
        do_ptrs = DO + b * stride_dob + h * stride_doh + offs_mb[:, None] * stride_dos + offs_c[None, :]
        dob_ptrs = DO + b * stride_dob + h * stride_doh + offs_mb[:, None] * stride_dos + offs_c2[None, :]
        lse1_ptr = LSE1 + bh * SQ
        lse2_ptr = LSE2 + bh * SQ
        d1_ptr = DELTA1 + bh * SQ
        d2_ptr = DELTA2 + bh * SQ
        dv, dvb, dk1, dk1b, dk2, dk2b = _bwd_dkdv_inner(
            dv, dvb, dk1, dk1b, dk2, dk2b, k1, k1b, k2, k2b, v, vb, lam, q1_ptrs, q1b_ptrs, q2_ptrs, q2b_ptrs,
            do_ptrs, dob_ptrs, lse1_ptr, lse2_ptr, d1_ptr, d2_ptr, stride_q1s, stride_q2s, stride_dos,
            offs_n, offs_mb, offs_d, offs_d2, offs_c, offs_c2, m_lo, m_full, SQ, HEAD_DIM, DV, causal,
            scale_log2, True, MASK_M, BLOCK_M, BLOCK_D, BLOCK_DV, PAD_D, PAD_DV, HAS_D2, HAS_DV2, PRECISION,
            DO_DV, DO_DK1, DO_DK2,
        )  # fmt: skip
        dv, dvb, dk1, dk1b, dk2, dk2b = _bwd_dkdv_inner(
            dv, dvb, dk1, dk1b, dk2, dk2b, k1, k1b, k2, k2b, v, vb, lam, q1_ptrs, q1b_ptrs, q2_ptrs, q2b_ptrs,
            do_ptrs, dob_ptrs, lse1_ptr, lse2_ptr, d1_ptr, d2_ptr, stride_q1s, stride_q2s, stride_dos,
            offs_n, offs_mb, offs_d, offs_d2, offs_c, offs_c2, m_full, SQ, SQ, HEAD_DIM, DV, causal,
            scale_log2, False, MASK_M, BLOCK_M, BLOCK_D, BLOCK_DV, PAD_D, PAD_DV, HAS_D2, HAS_DV2, PRECISION,
            DO_DV, DO_DK1, DO_DK2,
        )  # fmt: skip

    dk_off = b * stride_dkb + g * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :]
    dkb_off = b * stride_dkb + g * stride_dkh + offs_n[:, None] * stride_dks + offs_d2[None, :]
    if DO_DK1:
        dk1 = dk1 * scale
        _store_tile(DK1 + dk_off, dk1.to(DK1.dtype.element_ty), offs_n, SK, offs_d, HEAD_DIM, MASK_N, PAD_D)
        if HAS_D2:
            dk1b = (dk1b * scale).to(DK1.dtype.element_ty)
            _store_tile(DK1 + dkb_off, dk1b, offs_n, SK, offs_d2, HEAD_DIM, MASK_N, False)
    if DO_DK2:
        dk2 = dk2 * (-lam * scale)
        _store_tile(DK2 + dk_off, dk2.to(DK2.dtype.element_ty), offs_n, SK, offs_d, HEAD_DIM, MASK_N, PAD_D)
        if HAS_D2:
            dk2b = (dk2b * (-lam * scale)).to(DK2.dtype.element_ty)
            _store_tile(DK2 + dkb_off, dk2b, offs_n, SK, offs_d2, HEAD_DIM, MASK_N, False)
    if DO_DV:
        dv_off = b * stride_dvb + g * stride_dvh + offs_n[:, None] * stride_dvs + offs_c[None, :]
        _store_tile(DV_OUT + dv_off, dv.to(DV_OUT.dtype.element_ty), offs_n, SK, offs_c, DV, MASK_N, PAD_DV)
        if HAS_DV2:
            dvb_off = b * stride_dvb + g * stride_dvh + offs_n[:, None] * stride_dvs + offs_c2[None, :]
            dvb = dvb.to(DV_OUT.dtype.element_ty)
            _store_tile(DV_OUT + dvb_off, dvb, offs_n, SK, offs_c2, DV, MASK_N, False)


@triton.jit
def _bwd_dq_inner(
    dq1,
    dq1b,
    dq2,
    dq2b,
    q1,
    q1b,
    q2,
    q2b,
    do,
    dob,
    lse1,
    lse2,
    d1,
    d2,
    k1_ptrs,
    k1b_ptrs,
    k2_ptrs,
    k2b_ptrs,
    v_ptrs,
    vb_ptrs,
    stride_k1s,
    stride_k2s,
    stride_vs,
    offs_m,
    offs_n,
    offs_d,
    offs_d2,
    offs_c,
    offs_c2,
    lo,
    hi,
    SK,
    HEAD_DIM,
    DV,
    causal,
    scale_log2,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAD_D: tl.constexpr,
    PAD_DV: tl.constexpr,
    HAS_D2: tl.constexpr,
    HAS_DV2: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Key blocks [lo, hi) for one query block."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k1 = _load_tile(k1_ptrs + start_n * stride_k1s, cols, SK, offs_d, HEAD_DIM, MASKED, PAD_D)
        k2 = _load_tile(k2_ptrs + start_n * stride_k2s, cols, SK, offs_d, HEAD_DIM, MASKED, PAD_D)
        v = _load_tile(v_ptrs + start_n * stride_vs, cols, SK, offs_c, DV, MASKED, PAD_DV)
        s1 = tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
        if HAS_D2:
            k1b = _load_tile(k1b_ptrs + start_n * stride_k1s, cols, SK, offs_d2, HEAD_DIM, MASKED, False)
            s1 = tl.dot(q1b, tl.trans(k1b), s1, input_precision=PRECISION)
        p1 = tl.exp2(s1 * scale_log2 - lse1[:, None])
        s2 = tl.dot(q2, tl.trans(k2), input_precision=PRECISION)
        if HAS_D2:
            k2b = _load_tile(k2b_ptrs + start_n * stride_k2s, cols, SK, offs_d2, HEAD_DIM, MASKED, False)
            s2 = tl.dot(q2b, tl.trans(k2b), s2, input_precision=PRECISION)
        p2 = tl.exp2(s2 * scale_log2 - lse2[:, None])
        if MASKED:
            keep = (cols[None, :] <= offs_m[:, None] + causal) & (cols[None, :] < SK)
            p1 = tl.where(keep, p1, 0.0)
            p2 = tl.where(keep, p2, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # [BM, BN]
        if HAS_DV2:
            vb = _load_tile(vb_ptrs + start_n * stride_vs, cols, SK, offs_c2, DV, MASKED, False)
            dp = tl.dot(dob, tl.trans(vb), dp, input_precision=PRECISION)
        ds1 = (p1 * (dp - d1[:, None])).to(k1.dtype)
        ds2 = (p2 * (dp - d2[:, None])).to(k2.dtype)
        dq1 = tl.dot(ds1, k1, dq1, input_precision=PRECISION)
        dq2 = tl.dot(ds2, k2, dq2, input_precision=PRECISION)
        if HAS_D2:
            dq1b = tl.dot(ds1, k1b, dq1b, input_precision=PRECISION)
            dq2b = tl.dot(ds2, k2b, dq2b, input_precision=PRECISION)
    return dq1, dq1b, dq2, dq2b


@triton.jit
def diff_bwd_dq_kernel(
    Q1,
    Q2,
    K1,
    K2,
    V,
    DO,
    LAM,
    LSE1,
    LSE2,
    DELTA1,
    DELTA2,
    DQ1,
    DQ2,
    stride_q1b,
    stride_q1h,
    stride_q1s,
    stride_q2b,
    stride_q2h,
    stride_q2s,
    stride_k1b,
    stride_k1h,
    stride_k1s,
    stride_k2b,
    stride_k2h,
    stride_k2s,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_dob,
    stride_doh,
    stride_dos,
    stride_dqb,
    stride_dqh,
    stride_dqs,
    H,
    REP,
    SQ,
    SK,
    HEAD_DIM,
    DV,
    scale,
    scale_log2,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DV2: tl.constexpr,
    MASK_M: tl.constexpr,
    PAD_D: tl.constexpr,
    PAD_DV: tl.constexpr,
    HAS_D2: tl.constexpr,
    HAS_DV2: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dQ1, dQ2 of one query block of one head, recomputing P1, P2 tile by tile from the saved LSEs.

    grid = (cdiv(SQ, BLOCK_M), B * H). dQ1, dQ2 (same layout) are written contiguous by the launcher.
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    g = h // REP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
    offs_c = tl.arange(0, BLOCK_DV)
    offs_c2 = BLOCK_DV + tl.arange(0, BLOCK_DV2)

    q1 = _load_tile(
        Q1 + b * stride_q1b + h * stride_q1h + offs_m[:, None] * stride_q1s + offs_d[None, :],
        offs_m, SQ, offs_d, HEAD_DIM, MASK_M, PAD_D,
    )  # fmt: skip
    q2 = _load_tile(
        Q2 + b * stride_q2b + h * stride_q2h + offs_m[:, None] * stride_q2s + offs_d[None, :],
        offs_m, SQ, offs_d, HEAD_DIM, MASK_M, PAD_D,
    )  # fmt: skip
    do = _load_tile(
        DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_c[None, :],
        offs_m, SQ, offs_c, DV, MASK_M, PAD_DV,
    )  # fmt: skip
    q1b = q1  # placeholders unless the widths are split
    q2b = q2
    dob = do
    dq1b = tl.full([1, 1], 0.0, tl.float32)
    dq2b = tl.full([1, 1], 0.0, tl.float32)
    if HAS_D2:
        q1b = _load_tile(
            Q1 + b * stride_q1b + h * stride_q1h + offs_m[:, None] * stride_q1s + offs_d2[None, :],
            offs_m, SQ, offs_d2, HEAD_DIM, MASK_M, False,
        )  # fmt: skip
        q2b = _load_tile(
            Q2 + b * stride_q2b + h * stride_q2h + offs_m[:, None] * stride_q2s + offs_d2[None, :],
            offs_m, SQ, offs_d2, HEAD_DIM, MASK_M, False,
        )  # fmt: skip
        dq1b = tl.full([BLOCK_M, BLOCK_D2], 0.0, tl.float32)
        dq2b = tl.full([BLOCK_M, BLOCK_D2], 0.0, tl.float32)
    if HAS_DV2:
        dob = _load_tile(
            DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_c2[None, :],
            offs_m, SQ, offs_c2, DV, MASK_M, False,
        )  # fmt: skip
    row = pid_bh.to(tl.int64) * SQ + offs_m
    lse1 = _load_rows(LSE1 + row, offs_m, SQ, MASK_M)
    lse2 = _load_rows(LSE2 + row, offs_m, SQ, MASK_M)
    d1 = _load_rows(DELTA1 + row, offs_m, SQ, MASK_M)
    d2 = _load_rows(DELTA2 + row, offs_m, SQ, MASK_M)
    k1_ptrs = K1 + b * stride_k1b + g * stride_k1h + offs_n[:, None] * stride_k1s + offs_d[None, :]
    k1b_ptrs = K1 + b * stride_k1b + g * stride_k1h + offs_n[:, None] * stride_k1s + offs_d2[None, :]
    k2_ptrs = K2 + b * stride_k2b + g * stride_k2h + offs_n[:, None] * stride_k2s + offs_d[None, :]
    k2b_ptrs = K2 + b * stride_k2b + g * stride_k2h + offs_n[:, None] * stride_k2s + offs_d2[None, :]
    v_ptrs = V + b * stride_vb + g * stride_vh + offs_n[:, None] * stride_vs + offs_c[None, :]
    vb_ptrs = V + b * stride_vb + g * stride_vh + offs_n[:, None] * stride_vs + offs_c2[None, :]
    dq1 = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    dq2 = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)

    causal = SK - SQ
    n_full = (tl.minimum(start_m + causal + 1, SK) // BLOCK_N) * BLOCK_N
    n_end = tl.minimum(SK, start_m + BLOCK_M + causal)
    dq1, dq1b, dq2, dq2b = _bwd_dq_inner(
        dq1, dq1b, dq2, dq2b, q1, q1b, q2, q2b, do, dob, lse1, lse2, d1, d2, k1_ptrs, k1b_ptrs, k2_ptrs,
        k2b_ptrs, v_ptrs, vb_ptrs, stride_k1s, stride_k2s, stride_vs, offs_m, offs_n, offs_d, offs_d2, offs_c,
        offs_c2, 0, n_full,
        SK, HEAD_DIM, DV, causal, scale_log2, False, BLOCK_N, PAD_D, PAD_DV, HAS_D2, HAS_DV2, PRECISION,
    )  # fmt: skip
    dq1, dq1b, dq2, dq2b = _bwd_dq_inner(
        dq1, dq1b, dq2, dq2b, q1, q1b, q2, q2b, do, dob, lse1, lse2, d1, d2, k1_ptrs, k1b_ptrs, k2_ptrs,
        k2b_ptrs, v_ptrs, vb_ptrs, stride_k1s, stride_k2s, stride_vs, offs_m, offs_n, offs_d, offs_d2, offs_c,
        offs_c2, n_full, n_end,
        SK, HEAD_DIM, DV, causal, scale_log2, True, BLOCK_N, PAD_D, PAD_DV, HAS_D2, HAS_DV2, PRECISION,
    )  # fmt: skip

    lam = tl.load(LAM).to(tl.float32)
    dq1 = dq1 * scale
    dq2 = dq2 * (-lam * scale)
    dq_off = b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :]
    _store_tile(DQ1 + dq_off, dq1.to(DQ1.dtype.element_ty), offs_m, SQ, offs_d, HEAD_DIM, MASK_M, PAD_D)
    _store_tile(DQ2 + dq_off, dq2.to(DQ2.dtype.element_ty), offs_m, SQ, offs_d, HEAD_DIM, MASK_M, PAD_D)
    if HAS_D2:
        dqb_off = b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d2[None, :]
        dq1b = (dq1b * scale).to(DQ1.dtype.element_ty)
        _store_tile(DQ1 + dqb_off, dq1b, offs_m, SQ, offs_d2, HEAD_DIM, MASK_M, False)
        dq2b = (dq2b * (-lam * scale)).to(DQ2.dtype.element_ty)
        _store_tile(DQ2 + dqb_off, dq2b, offs_m, SQ, offs_d2, HEAD_DIM, MASK_M, False)
