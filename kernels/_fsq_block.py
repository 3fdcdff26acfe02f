"""One block's work of the Triton FSQ split kernels (``_fsq._split_kernel`` and the tiled
``_fsq_wide._split_kernel_wide``): loading and unpacking packed rows, the program's
constants, and a block's softmax weights from its raw keys (RMSNorm, RoPE by exact argument
reduction, scores, the online softmax's step)."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels._fsq_plan import ROPE_RADIX_BITS

RADIX_BITS = tl.constexpr(ROPE_RADIX_BITS)
RADIX_MASK = tl.constexpr((1 << ROPE_RADIX_BITS) - 1)


@triton.jit
def _row_bytes(rows, n_ok, first, NBYTES: tl.constexpr, BLOCK_B: tl.constexpr):
    """Bytes ``[first, first + BLOCK_B)`` of the packed rows at ``rows`` ``(BLOCK_N,)``:
    ``(BLOCK_N, BLOCK_B)`` uint8, zero past a row or a masked position (``first`` may be a
    loop variable)."""
    j = first + tl.arange(0, BLOCK_B)
    return tl.load(rows[:, None] + j[None, :], mask=n_ok[:, None] & (j < NBYTES)[None, :],
                   other=0)


@triton.jit
def _load_rows(rows, n_ok, NBYTES: tl.constexpr, BLOCK_B: tl.constexpr, FIRST: tl.constexpr = 0):
    """:func:`_row_bytes` at a constant first byte: where the bytes lie within every row, the
    mask is constant along the row, which keeps the loads wide."""
    if FIRST + BLOCK_B <= NBYTES:
        j = FIRST + tl.arange(0, BLOCK_B)
        return tl.load(rows[:, None] + j[None, :], mask=n_ok[:, None], other=0)
    return _row_bytes(rows, n_ok, FIRST, NBYTES, BLOCK_B)


@triton.jit
def _unpack(byte, BITS: tl.constexpr, SUBS: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_B: tl.constexpr, DTYPE: tl.constexpr):
    """Codes ``(BLOCK_N, BLOCK_B * SUBS)`` in ``DTYPE`` (exact: levels <= 256) of packed rows
    ``byte`` ``(BLOCK_N, BLOCK_B)``: coordinate ``k * SUBS + j`` is bits ``j * BITS`` of byte
    ``k`` (the packing contract). The ``SUBS = 8 // BITS`` fields of a byte are split off
    and joined in place (``tl.join`` keeps them in the thread that loaded the byte)."""
    x = byte.to(tl.int32)
    mask = (1 << BITS) - 1
    if SUBS == 1:
        z = x
    elif SUBS == 2:
        z = tl.reshape(tl.join(x & mask, x >> 4), (BLOCK_N, BLOCK_B * 2))
    elif SUBS == 4:
        z = tl.reshape(tl.join(tl.join(x & mask, (x >> 4) & mask),
                               tl.join((x >> 2) & mask, x >> 6)), (BLOCK_N, BLOCK_B * 4))
    else:
        z = tl.reshape(tl.join(tl.join(tl.join(x & 1, (x >> 4) & 1),
                                       tl.join((x >> 2) & 1, (x >> 6) & 1)),
                               tl.join(tl.join((x >> 1) & 1, (x >> 5) & 1),
                                       tl.join((x >> 3) & 1, x >> 7))),
                       (BLOCK_N, BLOCK_B * 8))
    # via float32: the interpreter casts int32 to bfloat16 as raw bits (exact either way)
    return z.to(tl.float32).to(DTYPE)


@triton.jit
def _mm(a, b, acc, TF32: tl.constexpr):
    """``a @ b + acc`` in float32; ``TF32`` (float32 operands) rounds them to tf32."""
    if TF32:
        return tl.dot(a, b, acc, input_precision="tf32")
    return tl.dot(a, b, acc)


@triton.jit
def _angle_sum(cos_a, sin_a, cos_b, sin_b):
    """``(cos(a + b), sin(a + b))``."""
    return cos_a * cos_b - sin_a * sin_b, sin_a * cos_b + cos_a * sin_b


@triton.jit
def _rope_angles(cos_a, sin_a, cos_b, sin_b, pos, base, n_ok, dd, dd_ok, HALF: tl.constexpr,
                 FULL: tl.constexpr, ROPE: tl.constexpr, CONSECUTIVE: tl.constexpr):
    """``(cos1, sin1, cos2, sin2)`` ``(BLOCK_N, BLOCK_H)`` float32 for the first and second key
    halves at positions ``pos``; ``CONSECUTIVE``: ``pos`` is ``base + arange`` (base the
    block's first position, below the RoPE table's 2^22); ``FULL``: ``HALF`` fills the
    block's columns."""
    ok = n_ok[:, None] & dd_ok[None, :]
    if ROPE == 1:  # theta: angle(pos) = angle(hi * 2^11) + angle(lo), both from exact tables
        if CONSECUTIVE:
            # positions base, base + 1, ... (as a cache without explicit positions holds them):
            # angle(base) once as a vector, angle(pos - base) from the low table's first
            # rows, the same rows for every block (they stay in L1)
            base_lo = (base & RADIX_MASK) * HALF + dd
            base_hi = (base >> RADIX_BITS) * HALF + dd
            cb, sb = _angle_sum(tl.load(cos_a + base_lo, mask=dd_ok, other=1.0),
                                tl.load(sin_a + base_lo, mask=dd_ok, other=0.0),
                                tl.load(cos_b + base_hi, mask=dd_ok, other=1.0),
                                tl.load(sin_b + base_hi, mask=dd_ok, other=0.0))
            # rows below BLOCK_N <= 2^11 always exist, so only padded columns (head_dim / 2
            # not a power of two) are masked: a masked position's angle rotates a key whose
            # score is discarded
            rows = (pos - base)[:, None] * HALF + dd[None, :]
            if FULL:
                cos_j, sin_j = tl.load(cos_a + rows), tl.load(sin_a + rows)
            else:
                cos_j = tl.load(cos_a + rows, mask=dd_ok[None, :], other=1.0)
                sin_j = tl.load(sin_a + rows, mask=dd_ok[None, :], other=0.0)
            cos, sin = _angle_sum(cos_j, sin_j, cb[None, :], sb[None, :])
        else:
            lo = (pos & RADIX_MASK)[:, None] * HALF + dd[None, :]
            hi = (pos >> RADIX_BITS)[:, None] * HALF + dd[None, :]
            cos, sin = _angle_sum(tl.load(cos_a + lo, mask=ok, other=1.0),
                                  tl.load(sin_a + lo, mask=ok, other=0.0),
                                  tl.load(cos_b + hi, mask=ok, other=1.0),
                                  tl.load(sin_b + hi, mask=ok, other=0.0))
        return cos, sin, cos, sin
    else:  # explicit (max_position, head_dim) tables, transformers' layout
        row = pos.to(tl.int64)[:, None] * (2 * HALF) + dd[None, :]
        return (tl.load(cos_a + row, mask=ok, other=1.0), tl.load(sin_a + row, mask=ok, other=0.0),
                tl.load(cos_a + row + HALF, mask=ok, other=1.0),
                tl.load(sin_a + row + HALF, mask=ok, other=0.0))


@triton.jit
def _program_split(alen_ptr, KV_HEADS, SPLIT_LEN):
    """A split program's ``(split, sequence, kv head, first position, end)``; ``end <=
    first`` for a split past its sequence's archive."""
    split = tl.program_id(0)
    pid = tl.program_id(1)
    b = pid // KV_HEADS
    start = split * SPLIT_LEN
    return split, b, pid % KV_HEADS, start, tl.minimum(start + SPLIT_LEN,
                                                        tl.load(alen_ptr + b))


@triton.jit
def _head_constants(q_ptr, kb_ptr, kn_ptr, b, kvh, q_sb, q_sh, kb_sh, GROUP,
                    HALF: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr,
                    Q_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """What a split program of kv head ``kvh`` holds for all its blocks: ``(g_ok, heads, dd,
    dd_ok, q1, q2, b1, b2, w1, w2)``: its query heads (``BLOCK_M`` rows, ``g_ok`` the real
    ones), the head-dim lanes of a half (``BLOCK_H``, ``dd_ok`` the real ones), the query's
    halves ``(BLOCK_M, BLOCK_H)`` in ``Q_T``, the key bias's and RMSNorm weight's halves
    ``(BLOCK_H,)`` float32 (zeros / unread placeholders where absent)."""
    g = tl.arange(0, BLOCK_M)
    g_ok = g < GROUP
    heads = kvh * GROUP + g
    dd = tl.arange(0, BLOCK_H)
    dd_ok = dd < HALF
    q_ok = g_ok[:, None] & dd_ok[None, :]
    q_rows = q_ptr + b * q_sb + heads[:, None] * q_sh + dd[None, :]
    q1 = tl.load(q_rows, mask=q_ok, other=0.0).to(Q_T)
    q2 = tl.load(q_rows + HALF, mask=q_ok, other=0.0).to(Q_T)
    if HAS_BIAS:
        b1 = tl.load(kb_ptr + kvh * kb_sh + dd, mask=dd_ok, other=0.0).to(tl.float32)
        b2 = tl.load(kb_ptr + kvh * kb_sh + HALF + dd, mask=dd_ok, other=0.0).to(tl.float32)
    else:
        b1 = tl.zeros([BLOCK_H], tl.float32)
        b2 = tl.zeros([BLOCK_H], tl.float32)
    w1 = b1  # (unread without the norm)
    w2 = b2
    if HAS_NORM:
        w1 = tl.load(kn_ptr + dd, mask=dd_ok, other=0.0).to(tl.float32)
        w2 = tl.load(kn_ptr + HALF + dd, mask=dd_ok, other=0.0).to(tl.float32)
    return g_ok, heads, dd, dd_ok, q1, q2, b1, b2, w1, w2


@triton.jit
def _decoder_halves(kd_ptr, kvh, kd_sh, kd_sd, kd_sw, c, c_ok, dd, dd_ok, HALF: tl.constexpr,
                    CODE_T: tl.constexpr):
    """Code coordinates ``c`` of kv head ``kvh``'s key decoder, as its two head-dim halves
    ``(len(c), BLOCK_H)`` in ``CODE_T`` (zero past ``c_ok`` / ``dd_ok``)."""
    dec = kd_ptr + kvh * kd_sh + dd[None, :] * kd_sd + c[:, None] * kd_sw
    dec_ok = c_ok[:, None] & dd_ok[None, :]
    return (tl.load(dec, mask=dec_ok, other=0.0).to(CODE_T),
            tl.load(dec + HALF * kd_sd, mask=dec_ok, other=0.0).to(CODE_T))


@triton.jit
def _block_weights(k1, k2, q1, q2, w1, w2, m, l, eps, qk_scale, n, n0, n_ok, sink, pos_base,
                   p_sn, cos_a, sin_a, cos_b, sin_b, dd, dd_ok, HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr, ROPE: tl.constexpr, HAS_NORM: tl.constexpr,
                   HAS_POS: tl.constexpr, Q_T: tl.constexpr, KEY_ROUND: tl.constexpr,
                   P_ROUND: tl.constexpr, CODE_T: tl.constexpr):
    """One block's softmax weights from its raw key halves ``k1, k2`` ``(BLOCK_N, BLOCK_H)``
    float32 (bias included): RMSNorm (``w1, w2`` its weight halves), RoPE at the positions
    ``n`` (``sink + n``, or read at ``pos_base``), the scores of the query halves ``q1, q2``
    ``(BLOCK_M, BLOCK_H)`` and the online softmax's step from running ``(m, l)``: ``(p
    (BLOCK_M, BLOCK_N) in CODE_T, alpha, m, l)``, ``alpha`` the factor on what the running
    sums hold."""
    if HAS_NORM:  # padded columns are zero: the sums cover the head exactly
        ms = (tl.sum(k1 * k1, axis=1) + tl.sum(k2 * k2, axis=1)) / (2 * HALF)
        r = tl.math.rsqrt(ms + eps)
        k1 = k1 * r[:, None] * w1[None, :]
        k2 = k2 * r[:, None] * w2[None, :]
    if ROPE > 0:
        if HAS_POS:
            pos = tl.load(pos_base + n * p_sn, mask=n_ok, other=0).to(tl.int32)
        else:
            pos = sink + n
        cos1, sin1, cos2, sin2 = _rope_angles(cos_a, sin_a, cos_b, sin_b, pos, sink + n0,
                                              n_ok, dd, dd_ok, HALF, HALF == BLOCK_H,
                                              ROPE, not HAS_POS)
        k1, k2 = k1 * cos1 - k2 * sin1, k2 * cos2 + k1 * sin2
    # keys rounded to the query's dtype (as a dense cache holds them); the weights to the
    # codes' dtype (the codes are exact in it, the weight sum uses the rounded weights too)
    score = _mm(q1, tl.trans(k1.to(KEY_ROUND).to(Q_T)),
                tl.zeros([q1.shape[0], k1.shape[0]], tl.float32), False)
    score = _mm(q2, tl.trans(k2.to(KEY_ROUND).to(Q_T)), score, False) * qk_scale
    score = tl.where(n_ok[None, :], score, float("-inf"))
    m_new = tl.maximum(m, tl.max(score, axis=1))
    alpha = tl.math.exp2(m - m_new)
    p = tl.math.exp2(score - m_new[:, None]).to(P_ROUND).to(CODE_T)
    l = l * alpha + tl.sum(p.to(tl.float32), axis=1)
    return p, alpha, m_new, l
