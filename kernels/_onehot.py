"""Atomic-free Triton decode attention on residual-VQ codes: one-hot products on tensor cores.

Four launches per call; only the split kernel's work grows with the context:

1. ``_table_kernel``: the score table ``q . C_k[stage, c]`` (times ``scale * log2(e)``) of each
   (batch, kv head, query-head chunk), once for all its splits, one program per key stage and
   block of centroids, with each block's best score per head.
2. ``_split_kernel``: one program per (sequence split, batch, kv head, chunk), plus one extra
   program per (batch, kv head, chunk) for the exact sink and recent tokens. An archive
   program walks its positions in blocks. Weights are taken against a fixed reference, the
   largest score the table allows (the sum over key stages of each stage's best centroid), so
   no block needs a reduction or a rescale; a split whose best score lies far below that bound
   is walked a second time against its true maximum. The value histogram ``W[stage, head, c]``
   (total weight of the positions whose value code at that stage is ``c``) is accumulated with
   ``tl.dot`` instead of atomic adds: a code is split into a high and a low part,
   ``c = hi * LO + lo``, and

       W[s, (g, hi), lo] += sum_n (p[g, n] * [hi_code[s, n] == hi]) * [lo_code[s, n] == lo]

   is one batched matrix product per block (its positions cut in runs so that every warp
   computes its own batch entry, :func:`position_parts`). Both one-hot factors are rows of
   an identity matrix read at the code, so per position and stage the kernel loads
   ``HI + LO`` entries and multiplies ``heads * HI`` of them by the weights (instead of
   ``codebook_size`` comparisons). The program writes its histogram, reference and weight sum.
3. ``_value_kernel``: one program per (batch, kv head, chunk, value stage, block of
   centroids) merges the splits' histograms against their common maximum and multiplies the
   merged block by the value codebook: a partial output (flash-decoding style).
4. ``_combine_kernel``: one program per (batch, query head) merges the partial outputs with
   the exact tokens' one.

The table and the codebook product are launches of their own because done in every split
program, that repeated fixed work took 8% (batch 32, 128K) to 45% (batch 1, 32K) of the time
on the H200 (docs/kernels.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels._common import (
    LOG2E,
    NEG_BIG,
    exact_tokens,
    head_base,
    interpreted,
    launchable,
    program_heads,
)
from kernels._onehot_plan import (
    MAX_REGISTERS,
    PREFETCH_STEPS,
    Plan,
    choose_num_splits,
    default_block_c,
    group_chunks,
    plan_for,
    position_parts,
)
from kernels._plan import pow2, problem_dims, split_layout
from kernels._validate import check_num_splits
from kernels.coded_cache import DecodeProblem

REF_HEADROOM = tl.constexpr(8.0)  # weights up to 2^8 against the score bound (float16 safe)
REF_SLACK = tl.constexpr(4.0)  # best weight below 2^-4: redo the split with its true maximum


@triton.jit
def _prefetch_l2(ptrs, mask):
    """A hint: start moving the lines at ``ptrs`` (where ``mask``) from memory into L2."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _table_index(s, c, g, KEY_CODEBOOK_P: tl.constexpr, BLOCK_G: tl.constexpr,
                 CENTROID_MAJOR: tl.constexpr):
    """Offset of stage ``s``, centroid ``c``, head ``g`` in a program's score table.
    Centroid-major (``[stage, centroid, head]``) serves a position's heads with one wide load:
    fewer look-up instructions, which pays with many key stages (see :class:`Plan`)."""
    if CENTROID_MAJOR:
        return (s * KEY_CODEBOOK_P + c) * BLOCK_G + g
    return (s * BLOCK_G + g) * KEY_CODEBOOK_P + c


@triton.jit
def _weights_pass(tab, eye, kc_base, vc_base, start, end, m, g_ok, kc_sn, kc_ss, vc_sn, vc_ss,
                  KEY_STAGES: tl.constexpr, VALUE_STAGES: tl.constexpr,
                  VALUE_STAGES_P: tl.constexpr, KEY_CODEBOOK_P: tl.constexpr,
                  HI: tl.constexpr, LO: tl.constexpr, LO_BITS: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, EYE: tl.constexpr,
                  PREFETCH: tl.constexpr, CENTROID_MAJOR: tl.constexpr, K_PARTS: tl.constexpr):
    """Transposed value histogram, weight sum and largest score of positions [start, end)
    against the reference ``m``:

        W^T[s, lo, (g, hi)] += [lo_code == lo]^T @ (p[n, g] [hi_code == hi])

    Both one-hot factors are rows of an identity matrix read at the code (``eye``, ``EYE``
    columns): loads instead of comparisons. The right operand holds each position's
    ``heads * HI`` entries side by side, so packed half-precision products build it in the
    tensor cores' register layout instead of 16-bit shared-memory stores. The codes of the
    block ``PREFETCH`` steps ahead are requested into L2 at each step (0: no requests).

    Each block's positions are cut into ``K_PARTS`` runs, each its own entry of the batched
    product (summed at the end), so the product has one entry per warp: Triton lays the warps
    of a batched ``tl.dot`` along the batch, and with fewer entries than warps (two value
    stages, four warps) two warps compute the same products (see :func:`position_parts`).
    """
    rows = tl.arange(0, BLOCK_G)
    hi_ar = tl.arange(0, HI)
    lo_ar = tl.arange(0, LO)
    vs = tl.arange(0, VALUE_STAGES_P)
    acc = tl.zeros([VALUE_STAGES_P * K_PARTS, LO, BLOCK_G * HI], tl.float32)
    l = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    top = tl.full([BLOCK_N, BLOCK_G], float("-inf"), tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        # a step takes less time than a load from memory: ask early, one request per 16
        # positions (every 128-byte line while a position's codes fit 8 bytes)
        if PREFETCH > 0:
            ahead = n0 + PREFETCH * BLOCK_N + tl.arange(0, BLOCK_N // 16) * 16
            _prefetch_l2(kc_base + ahead * kc_sn, ahead < end)
            _prefetch_l2(vc_base + ahead * vc_sn, ahead < end)
        score = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
        for s in tl.static_range(KEY_STAGES):
            code = tl.load(kc_base + n * kc_sn + s * kc_ss, mask=n_ok, other=0).to(tl.int32)
            score += tl.load(tab + _table_index(s, code[:, None], rows[None, :],
                                                KEY_CODEBOOK_P, BLOCK_G, CENTROID_MAJOR))
        score = tl.where(n_ok[:, None] & g_ok[None, :], score, float("-inf"))
        top = tl.maximum(top, score)
        p = tl.math.exp2(score - m[None, :]).to(tl.float16)
        l += p.to(tl.float32)
        ok = (vs[:, None] < VALUE_STAGES) & n_ok[None, :]
        vcode = tl.load(vc_base + n[None, :] * vc_sn + vs[:, None] * vc_ss, mask=ok,
                        other=0).to(tl.int32)
        hot_hi = tl.load(eye + (vcode >> LO_BITS)[:, :, None] * EYE + hi_ar[None, None, :],
                         mask=ok[:, :, None], other=0.0)
        right = tl.reshape(p[None, :, :, None] * hot_hi[:, :, None, :],
                           (VALUE_STAGES_P, BLOCK_N, BLOCK_G * HI))
        hot_lo = tl.load(eye + (vcode & (LO - 1))[:, :, None] * EYE + lo_ar[None, None, :])
        if K_PARTS > 1:
            right = tl.reshape(right, (VALUE_STAGES_P * K_PARTS, BLOCK_N // K_PARTS,
                                       BLOCK_G * HI))
            hot_lo = tl.reshape(hot_lo, (VALUE_STAGES_P * K_PARTS, BLOCK_N // K_PARTS, LO))
        acc = tl.dot(tl.trans(hot_lo, (0, 2, 1)), right, acc)
    hist = acc
    if K_PARTS > 1:
        hist = tl.sum(tl.reshape(acc, (VALUE_STAGES_P, K_PARTS, LO, BLOCK_G * HI)), axis=1)
    return hist, tl.sum(l, axis=0), tl.max(top, axis=0)


@triton.jit
def _table_kernel(q_ptr, kcb_ptr, tab_ptr, smax_ptr, qk_scale, q_sb, q_sh,
                  kcb_sh, kcb_ss, kcb_sc, KV_HEADS, GROUP, GROUP_CHUNKS, HEAD_DIM, KEY_CODEBOOK,
                  TABLE_BLOCKS, KEY_STAGES: tl.constexpr, KEY_CODEBOOK_P: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_C: tl.constexpr, TABLE_IEEE: tl.constexpr, CENTROID_MAJOR: tl.constexpr):
    """``BLOCK_C`` centroids of one key stage of a (batch, kv head, chunk)'s score table
    ``q . C_k[stage, c] * scale * log2(e)``, shared by all its splits, and their best score per
    head (``smax[bhg, stage, block, g]``)."""
    pid = tl.program_id(0)  # one axis: (bhg, stage, block) can pass the other axes' 65,535
    pid_bhg = pid // (KEY_STAGES * TABLE_BLOCKS)
    stage_block = pid % (KEY_STAGES * TABLE_BLOCKS)
    s = stage_block // TABLE_BLOCKS
    block = stage_block % TABLE_BLOCKS
    b, kvh, _, _, row_ok, heads_row = program_heads(pid_bhg, KV_HEADS, GROUP, GROUP_CHUNKS,
                                                     BLOCK_G, BLOCK_M)
    row = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + b * q_sb + heads_row[:, None] * q_sh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    c = block * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < KEY_CODEBOOK
    cb = tl.load(kcb_ptr + kvh * kcb_sh + s * kcb_ss + c[:, None] * kcb_sc + d[None, :],
                 mask=c_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    if TABLE_IEEE:
        t = tl.dot(q, tl.trans(cb), input_precision="ieee")
    else:  # float16 and bfloat16 are exact in tf32
        t = tl.dot(q, tl.trans(cb), input_precision="tf32")
    t = t * qk_scale
    tab = tab_ptr + pid_bhg.to(tl.int64) * (KEY_STAGES * BLOCK_G * KEY_CODEBOOK_P)
    tl.store(tab + _table_index(s, c[None, :], row[:, None], KEY_CODEBOOK_P, BLOCK_G,
                                CENTROID_MAJOR),
             t, mask=(row[:, None] < BLOCK_G) & c_ok[None, :])
    top = tl.max(tl.where(c_ok[None, :], t, float("-inf")), axis=1)
    tl.store(smax_ptr + pid.to(tl.int64) * BLOCK_G + row, top, mask=row < BLOCK_G)


@triton.jit
def _split_kernel(q_ptr, kc_ptr, vc_ptr, alen_ptr,
                  sk_ptr, sv_ptr, rk_ptr, rv_ptr, slen_ptr, rlen_ptr,
                  tab_ptr, smax_ptr, hist_ptr, mla_ptr, eye_ptr, o_ptr, ml_ptr, qk_scale,
                  q_sb, q_sh,
                  kc_sb, kc_sh, kc_sn, kc_ss, vc_sb, vc_sh, vc_sn, vc_ss,
                  sk_sb, sk_sh, sk_sn, sv_sb, sv_sh, sv_sn,
                  rk_sb, rk_sh, rk_sn, rv_sb, rv_sh, rv_sn,
                  o_sb, o_sh, o_sp, ml_sb, ml_sh, ml_sp,
                  KV_HEADS, GROUP, GROUP_CHUNKS, SPLIT_LEN, NUM_SPLITS, EXACT_PART, HEAD_DIM,
                  TABLE_BLOCKS,
                  KEY_STAGES: tl.constexpr, VALUE_STAGES: tl.constexpr,
                  VALUE_STAGES_P: tl.constexpr, KEY_CODEBOOK_P: tl.constexpr,
                  HI: tl.constexpr, LO: tl.constexpr, LO_BITS: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, EYE: tl.constexpr,
                  PREFETCH: tl.constexpr, CENTROID_MAJOR: tl.constexpr, K_PARTS: tl.constexpr):
    split = tl.program_id(0)
    pid_bhg = tl.program_id(1)
    if split == NUM_SPLITS:  # the exact sink and recent tokens of these heads
        # BLOCK_G heads in BLOCK_M >= 16 rows (tl.dot needs 16)
        b, kvh, _, _, row_ok, heads_row = program_heads(pid_bhg, KV_HEADS, GROUP,
                                                         GROUP_CHUNKS, BLOCK_G, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        m_out, l_out, o_out = exact_tokens(
            q_ptr, sk_ptr, sv_ptr, rk_ptr, rv_ptr, slen_ptr, rlen_ptr, b, kvh, heads_row,
            row_ok, d, d_ok, qk_scale, q_sb, q_sh, sk_sb, sk_sh, sk_sn, sv_sb, sv_sh, sv_sn,
            rk_sb, rk_sh, rk_sn, rv_sb, rv_sh, rv_sn, BLOCK_M, BLOCK_D, BLOCK_E)
        base = b * ml_sb + heads_row * ml_sh + EXACT_PART * ml_sp
        tl.store(ml_ptr + base, m_out, mask=row_ok)
        tl.store(ml_ptr + base + 1, l_out, mask=row_ok)
        tl.store(o_ptr + b * o_sb + heads_row[:, None] * o_sh + EXACT_PART * o_sp + d[None, :],
                 o_out, mask=row_ok[:, None] & d_ok[None, :])
    else:
        chunk = pid_bhg % GROUP_CHUNKS
        kvh = (pid_bhg // GROUP_CHUNKS) % KV_HEADS
        b = pid_bhg // (GROUP_CHUNKS * KV_HEADS)
        start = split * SPLIT_LEN
        end = tl.minimum(start + SPLIT_LEN, tl.load(alen_ptr + b))
        if start < end:  # the value kernel reads only the splits that hold positions
            tab = tab_ptr + pid_bhg.to(tl.int64) * (KEY_STAGES * BLOCK_G * KEY_CODEBOOK_P)
            g = tl.arange(0, BLOCK_G)
            g_ok = chunk * BLOCK_G + g < GROUP
            kc_base = head_base(kc_ptr, b, kvh, kc_sb, kc_sh)
            vc_base = head_base(vc_ptr, b, kvh, vc_sb, vc_sh)
            # a fixed softmax reference instead of a running maximum: no per-block reductions
            # or rescaling. The largest score any position could reach is the sum over stages
            # of the table's row maxima; weights are at most 2^REF_HEADROOM in float16.
            bound = tl.zeros([BLOCK_G], tl.float32)
            smax = smax_ptr + pid_bhg * (KEY_STAGES * TABLE_BLOCKS * BLOCK_G) + g
            for s in tl.static_range(KEY_STAGES):
                top = tl.full([BLOCK_G], float("-inf"), tl.float32)
                for block in range(0, TABLE_BLOCKS):
                    top = tl.maximum(top, tl.load(smax + (s * TABLE_BLOCKS + block) * BLOCK_G))
                bound += top
            m = bound - REF_HEADROOM
            acc, l, top = _weights_pass(
                tab, eye_ptr, kc_base, vc_base, start, end, m, g_ok, kc_sn, kc_ss, vc_sn, vc_ss,
                KEY_STAGES, VALUE_STAGES, VALUE_STAGES_P, KEY_CODEBOOK_P, HI, LO, LO_BITS,
                BLOCK_G, BLOCK_N, EYE, PREFETCH, CENTROID_MAJOR, K_PARTS)
            # float16 keeps full precision down to 2^-14: if the best position lies far below
            # the bound, the weights near it would lose digits; redo with the true maximum
            if tl.max(tl.where(g_ok, m - top, 0.0), axis=0) > REF_SLACK:
                m = tl.where(g_ok, top, m)
                acc, l, top = _weights_pass(
                    tab, eye_ptr, kc_base, vc_base, start, end, m, g_ok, kc_sn, kc_ss, vc_sn,
                    vc_ss, KEY_STAGES, VALUE_STAGES, VALUE_STAGES_P, KEY_CODEBOOK_P, HI, LO,
                    LO_BITS, BLOCK_G, BLOCK_N, EYE, PREFETCH, CENTROID_MAJOR, K_PARTS)
            # the split's histogram W[stage, head, c] (c = hi * LO + lo), reference and sum
            prog = (pid_bhg * NUM_SPLITS + split).to(tl.int64)
            hist = hist_ptr + prog * (VALUE_STAGES_P * BLOCK_G * HI * LO)
            cols = tl.arange(0, BLOCK_G * HI)  # (head, hi)
            tl.store(hist + tl.arange(0, VALUE_STAGES_P)[:, None, None] * (BLOCK_G * HI * LO)
                     + tl.arange(0, LO)[None, :, None] + cols[None, None, :] * LO, acc)
            tl.store(mla_ptr + prog * (2 * BLOCK_G) + g, tl.where(g_ok, m, NEG_BIG))
            tl.store(mla_ptr + prog * (2 * BLOCK_G) + BLOCK_G + g, tl.where(g_ok, l, 0.0))


@triton.jit
def _value_kernel(vcb_ptr, hist_ptr, mla_ptr, alen_ptr, o_ptr, ml_ptr,
                  vcb_sh, vcb_ss, vcb_sc, o_sb, o_sh, o_sp, ml_sb, ml_sh, ml_sp,
                  KV_HEADS, GROUP, GROUP_CHUNKS, SPLIT_LEN, NUM_SPLITS, HEAD_DIM, VALUE_CODEBOOK,
                  VALUE_STAGES_P: tl.constexpr, CODEBOOK_P: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """One piece (value stage, block of ``BLOCK_C`` centroids) of a (batch, kv head, chunk):
    the splits' histograms merged against their largest reference (``BLOCK_S`` splits per
    step: their loads are in flight together), times the value codebook. Writes a partial
    output with the merged reference and, for piece 0, the weight sum."""
    pid_bhg = tl.program_id(0)
    piece = tl.program_id(1)
    c_blocks = tl.cdiv(VALUE_CODEBOOK, BLOCK_C)
    s = piece // c_blocks
    b, kvh, _, _, row_ok, heads_row = program_heads(pid_bhg, KV_HEADS, GROUP, GROUP_CHUNKS,
                                                     BLOCK_G, BLOCK_M)
    g = tl.arange(0, BLOCK_G)
    c = (piece % c_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < VALUE_CODEBOOK
    active = tl.cdiv(tl.load(alen_ptr + b), SPLIT_LEN)  # splits that hold positions
    mla = mla_ptr + pid_bhg.to(tl.int64) * NUM_SPLITS * (2 * BLOCK_G)
    hist = (hist_ptr + pid_bhg.to(tl.int64) * NUM_SPLITS * (VALUE_STAGES_P * BLOCK_G * CODEBOOK_P)
            + s * (BLOCK_G * CODEBOOK_P))
    m = tl.full([BLOCK_G], NEG_BIG, tl.float32)
    for s0 in range(0, active, BLOCK_S):
        sp = s0 + tl.arange(0, BLOCK_S)
        m_sp = tl.load(mla + sp[:, None] * (2 * BLOCK_G) + g[None, :],
                       mask=(sp < active)[:, None], other=NEG_BIG)
        m = tl.maximum(m, tl.max(m_sp, axis=0))
    w = tl.zeros([BLOCK_G, BLOCK_C], tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    for s0 in range(0, active, BLOCK_S):
        sp = s0 + tl.arange(0, BLOCK_S)
        sp_ok = sp < active
        rescale = tl.math.exp2(tl.load(mla + sp[:, None] * (2 * BLOCK_G) + g[None, :],
                                       mask=sp_ok[:, None], other=NEG_BIG) - m[None, :])
        l += tl.sum(rescale * tl.load(mla + sp[:, None] * (2 * BLOCK_G) + BLOCK_G + g[None, :],
                                      mask=sp_ok[:, None], other=0.0), axis=0)
        h = tl.load(hist + sp[:, None, None] * (VALUE_STAGES_P * BLOCK_G * CODEBOOK_P)
                    + g[None, :, None] * CODEBOOK_P + c[None, None, :],
                    mask=sp_ok[:, None, None] & c_ok[None, None, :], other=0.0)
        w += tl.sum(rescale[:, :, None] * h, axis=0)
    # from BLOCK_G heads to the BLOCK_M >= 16 rows tl.dot needs
    if BLOCK_M == BLOCK_G:
        w_rows, m_rows, l_rows = w, m, l
    else:
        row = tl.arange(0, BLOCK_M)
        sel = row[:, None] == g[None, :]
        w_rows = tl.sum(tl.where(sel[:, :, None], w[None, :, :], 0.0), axis=1)
        m_rows = tl.max(tl.where(sel, m[None, :], NEG_BIG), axis=1)
        l_rows = tl.sum(tl.where(sel, l[None, :], 0.0), axis=1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    cv = tl.load(vcb_ptr + kvh * vcb_sh + s * vcb_ss + c[:, None] * vcb_sc + d[None, :],
                 mask=c_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.dot(w_rows, cv.to(tl.float32), input_precision="tf32")
    base = b * ml_sb + heads_row * ml_sh + piece * ml_sp
    tl.store(ml_ptr + base, m_rows, mask=row_ok)
    tl.store(ml_ptr + base + 1, tl.where(piece == 0, l_rows, 0.0), mask=row_ok)
    tl.store(o_ptr + b * o_sb + heads_row[:, None] * o_sh + piece * o_sp + d[None, :], o,
             mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_kernel(o_ptr, ml_ptr, out_ptr, o_sb, o_sh, o_sp, ml_sb, ml_sh, ml_sp,
                    out_sb, out_sh, Q_HEADS, PARTS, HEAD_DIM,
                    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    h = pid % Q_HEADS
    b = pid // Q_HEADS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    parts = tl.arange(0, BLOCK_P)
    ml = ml_ptr + b * ml_sb + h * ml_sh
    m_all = tl.full([BLOCK_P], NEG_BIG, tl.float32)
    for p0 in range(0, PARTS, BLOCK_P):
        m_all = tl.maximum(m_all, tl.load(ml + (p0 + parts) * ml_sp, mask=p0 + parts < PARTS,
                                          other=NEG_BIG))
    m = tl.max(m_all, axis=0)
    total = tl.zeros([BLOCK_P], tl.float32)
    acc = tl.zeros([BLOCK_P, BLOCK_D], tl.float32)
    for p0 in range(0, PARTS, BLOCK_P):
        ok = p0 + parts < PARTS
        m_p = tl.load(ml + (p0 + parts) * ml_sp, mask=ok, other=NEG_BIG)
        w = tl.where(ok, tl.math.exp2(m_p - m), 0.0)
        total += w * tl.load(ml + (p0 + parts) * ml_sp + 1, mask=ok, other=0.0)
        o = tl.load(o_ptr + b * o_sb + h * o_sh + (p0 + parts)[:, None] * o_sp + d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0)
        acc += w[:, None] * o
    out = tl.sum(acc, axis=0) / tl.sum(total, axis=0)
    tl.store(out_ptr + b * out_sb + h * out_sh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


_IDENTITIES: dict = {}


def _identity(size: int, device: torch.device) -> torch.Tensor:
    """The one-hot rows the kernel reads: ``[code == j]`` over ``j`` is row ``code``."""
    key = (size, device)
    eye = _IDENTITIES.get(key)
    if eye is None:
        eye = torch.eye(size, dtype=torch.float16, device=device)
        # one made while a CUDA graph is captured is filled only by the graph's replays
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _IDENTITIES[key] = eye
    return eye


class _Launch(NamedTuple):
    """Everything about one decode call that depends only on the problem's shapes, device and
    tuning: block sizes, split layout, grids and the offsets of the scratch buffer."""

    plan: Plan
    block_c: int
    split_len: int
    num_splits: int
    chunks: int
    block_d: int
    bhg: int
    pieces: int
    table_blocks: int
    offsets: tuple[int, ...]  # tab, smax, hist, ml_arch, o_part, ml_part, end (float32)
    parts: int
    k_parts: int
    block_s: int
    block_p: int
    prefetch: int
    compile_options: dict


_LAUNCHES: dict = {}


def _launch_for(p: DecodeProblem, num_splits, num_warps, block_n, hi_bits, block_c, prefetch,
                centroid_major) -> _Launch:
    """The launch description of ``p`` (computed once per shape, device and tuning: a decode
    step repeats the same shapes, so its host work is the kernel launches)."""
    dims = problem_dims(p)
    key = (dims, p.cache.key_codes.shape[2], p.query.device, num_splits, num_warps, block_n,
           hi_bits, block_c, prefetch, centroid_major)
    launch = _LAUNCHES.get(key)
    if launch is None:
        if len(_LAUNCHES) >= 1024:  # a process that sees ever new shapes
            _LAUNCHES.clear()
        launch = _LAUNCHES[key] = _make_launch(p, dims, num_splits, num_warps, block_n, hi_bits,
                                               block_c, prefetch, centroid_major)
    return launch


def _make_launch(p, dims, num_splits, num_warps, block_n, hi_bits, block_c, prefetch,
                 centroid_major) -> _Launch:
    (batch, q_heads, head_dim, kv_heads, _, key_stages, key_codebook, value_stages,
     value_codebook) = dims
    for name, value in (("block_n", block_n), ("block_c", block_c)):
        if value is not None and (value < 16 or value & (value - 1)):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    # Triton's interpreter runs no inline assembly and allocates no registers; the L2 request
    # and the register cap are NVIDIA's
    nvidia = not interpreted() and torch.version.hip is None
    if prefetch is None:
        prefetch = PREFETCH_STEPS if nvidia else 0
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    plan = plan_for(p, hi_bits=hi_bits, block_n=block_n, centroid_major=centroid_major)
    if not plan.supported:
        raise ValueError(f"value_codebooks {tuple(p.cache.value_codebooks.shape)}: the histogram "
                         f"does not fit the one-hot kernel")
    if block_c is None:
        block_c = default_block_c(p, plan)
    if num_splits is None:
        num_splits = choose_num_splits(p, num_warps)
    check_num_splits(num_splits)
    split_len, num_splits = split_layout(p.cache.key_codes.shape[2], num_splits, plan.block_n)
    chunks = group_chunks(p, plan)
    bhg = batch * kv_heads * chunks
    programs = num_splits * bhg
    pieces = value_stages * triton.cdiv(value_codebook, block_c)
    table_blocks = triton.cdiv(key_codebook, block_c)
    parts = pieces + 1  # the last part holds the exact tokens
    sizes = (bhg * plan.table_floats(key_stages), bhg * key_stages * table_blocks * plan.block_g,
             programs * plan.hist_floats, programs * 2 * plan.block_g,
             batch * q_heads * parts * head_dim, batch * q_heads * parts * 2)
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    return _Launch(
        plan, block_c, split_len, num_splits, chunks, pow2(head_dim, 16), bhg, pieces,
        table_blocks, tuple(offsets), parts,
        position_parts(num_warps, plan.value_stages_p, plan.block_n),
        max(1, min(16, 2048 // (plan.block_g * block_c))), min(32, pow2(parts)), prefetch,
        {"maxnreg": MAX_REGISTERS} if nvidia else {})


def decode(problem: DecodeProblem, *, num_splits: int | None = None, num_warps: int = 4,
           num_stages: int = 1, block_n: int | None = None, hi_bits: int | None = None,
           block_c: int | None = None, prefetch: int | None = None,
           centroid_major: bool | None = None) -> torch.Tensor:
    """Run the four kernels on a validated problem; ``(batch, q_heads, head_dim)``.

    ``num_stages`` (software pipelining depth of the split kernel; 1, none, was fastest on the
    H200), ``block_n`` (positions per step, a power of two >= 16), ``hi_bits`` (see
    :class:`Plan`), ``block_c`` (centroids per program of the score table and of the value
    merge, a power of two >= 16; default :func:`_block_c`), ``prefetch`` (blocks ahead whose
    codes are requested into L2; 0 for none, default ``PREFETCH_STEPS`` on a GPU) and
    ``centroid_major`` (the score table's layout, see :class:`Plan`) override the defaults,
    for tuning. Host work per call: one scratch allocation, the output and four launches
    (the rest is computed once per shape, :func:`_launch_for`).
    """
    p = problem
    L = _launch_for(p, num_splits, num_warps, block_n, hi_bits, block_c, prefetch,
                    centroid_major)
    plan = L.plan
    query, c = p.query, p.cache
    batch, q_heads, head_dim = query.shape
    kv_heads, key_stages, key_codebook = c.key_codebooks.shape[:3]
    value_codebook = c.value_codebooks.shape[2]
    device = query.device
    qk_scale = p.scale * LOG2E
    scratch = torch.empty(L.offsets[-1], dtype=torch.float32, device=device)
    tab, smax, hist, ml_arch, o_flat, ml_flat = (
        scratch[a:b] for a, b in zip(L.offsets[:-1], L.offsets[1:], strict=True))
    o_part = o_flat.view(batch, q_heads, L.parts, head_dim)
    ml_part = ml_flat.view(batch, q_heads, L.parts, 2)
    kc, vc = c.key_codes, c.value_codes
    if kc.shape[2] == 0:  # no archived slot at all: give the launcher real (never read) memory
        kc = kc.new_zeros(batch, kv_heads, 1, key_stages)
        vc = vc.new_zeros(batch, kv_heads, 1, c.value_codebooks.shape[1])
    sk, sv, rk, rv = (launchable(t) for t in (c.sink_keys, c.sink_values, c.recent_keys,
                                                c.recent_values))
    kcb, vcb = c.key_codebooks, c.value_codebooks
    group = q_heads // kv_heads
    heads = dict(BLOCK_G=plan.block_g, BLOCK_M=max(16, plan.block_g), BLOCK_D=L.block_d)
    _table_kernel[(L.bhg * key_stages * L.table_blocks,)](
        query, kcb, tab, smax, qk_scale, query.stride(0), query.stride(1),
        *kcb.stride()[:3], kv_heads, group, L.chunks, head_dim, key_codebook, L.table_blocks,
        KEY_STAGES=key_stages, KEY_CODEBOOK_P=plan.key_codebook_p, BLOCK_C=L.block_c,
        TABLE_IEEE=kcb.dtype == torch.float32, CENTROID_MAJOR=plan.centroid_major, **heads,
        num_warps=num_warps)
    _split_kernel[(L.num_splits + 1, L.bhg)](
        query, kc, vc, c.archived_lengths,
        sk, sv, rk, rv, c.sink_lengths, c.recent_lengths,
        tab, smax, hist, ml_arch, _identity(plan.eye, device), o_part, ml_part, qk_scale,
        query.stride(0), query.stride(1),
        *kc.stride(), *vc.stride(),
        *sk.stride()[:3], *sv.stride()[:3], *rk.stride()[:3], *rv.stride()[:3],
        *o_part.stride()[:3], *ml_part.stride()[:3],
        kv_heads, group, L.chunks, L.split_len, L.num_splits, L.pieces, head_dim,
        L.table_blocks,
        KEY_STAGES=key_stages, VALUE_STAGES=c.value_codebooks.shape[1],
        VALUE_STAGES_P=plan.value_stages_p, KEY_CODEBOOK_P=plan.key_codebook_p,
        HI=plan.hi, LO=plan.lo, LO_BITS=plan.lo_bits, BLOCK_N=plan.block_n, BLOCK_E=16,
        EYE=plan.eye, PREFETCH=L.prefetch, CENTROID_MAJOR=plan.centroid_major,
        K_PARTS=L.k_parts, **heads,
        num_warps=num_warps, num_stages=num_stages, **L.compile_options)
    _value_kernel[(L.bhg, L.pieces)](
        vcb, hist, ml_arch, c.archived_lengths, o_part, ml_part, *vcb.stride()[:3],
        *o_part.stride()[:3], *ml_part.stride()[:3],
        kv_heads, group, L.chunks, L.split_len, L.num_splits, head_dim, value_codebook,
        VALUE_STAGES_P=plan.value_stages_p, CODEBOOK_P=plan.codebook_p, BLOCK_C=L.block_c,
        BLOCK_S=L.block_s, **heads, num_warps=num_warps)
    out = torch.empty(batch, q_heads, head_dim, dtype=query.dtype, device=device)
    _combine_kernel[(batch * q_heads,)](
        o_part, ml_part, out, *o_part.stride()[:3], *ml_part.stride()[:3],
        out.stride(0), out.stride(1), q_heads, L.parts, head_dim,
        BLOCK_P=L.block_p, BLOCK_D=L.block_d, num_warps=num_warps)
    return out
