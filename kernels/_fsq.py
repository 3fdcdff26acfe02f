"""Triton decode attention straight from packed FSQ codes (flash-decoding, two launches).

1. ``_split_kernel``: one program per (sequence split, batch, kv head). It loads the key
   decoder's halves once; per block of ``BLOCK_N`` positions it loads the packed rows whole
   (optionally the next block's during this one), unpacks them in place to ``(BLOCK_N,
   width)`` integers held in the decoder's dtype (exact: levels <= 256), reconstructs the two
   halves of the keys with two tensor-core products against the decoder halves (so RoPE's
   rotate-half needs no shuffle), applies the bias, RMSNorm (k_norm) and RoPE at each
   position's absolute position, scores the group's query heads (padded to 16 rows for
   ``tl.dot``), and keeps an online softmax whose weights multiply the *codes*: ``acc[g] +=
   sum_n p[g, n] code_n`` (``width`` floats per head). No key or value leaves the registers.
2. ``_merge_kernel``: one program per (batch, query head) merges the splits, runs the exact sink
   and recent tokens (``_common.exact_tokens``) and applies the value decoder once:
   ``sum_n p_n v_n = value_decoder @ (sum_n p_n code_n) + value_bias * sum_n p_n``.

RoPE with a theta uses exact argument reduction: ``pos = hi * 2^11 + lo``, the angles of both
parts come from float64-computed float32 tables (``_fsq_plan.theta_tables``, in L2) and are
combined with the angle-sum formula, so angles stay exact to float32 at any position below
2^22 (no float32 product ``pos * inv_freq``; cos and sin within a few ulp). Without explicit
positions (consecutive ones) a block takes ``angle(base)`` once and ``angle(j)`` from the low
table's first ``BLOCK_N`` rows (two angle-sum steps); explicit ``(cos, sin)`` tables are read
at the position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import LOG2E, NEG_BIG, exact_tokens, interpreted, launchable
from kernels._fsq_block import (
    _block_weights,
    _decoder_halves,
    _head_constants,
    _load_rows,
    _mm,
    _program_split,
    _unpack,
)
from kernels._fsq_plan import (
    ROPE_RADIX_BITS,
    SPLIT_TUNING,
    TILE_WIDTH,
    WIDE_TUNING,
    WS_BLOCK_N,
    FsqProblem,
    kernel_limit,
    kernel_tensors,
    split_block_n,
    splits_for,
    uniform_bits,
    uses_ws,
)
from kernels._plan import pow2
from kernels._validate import check_num_splits

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
MERGE_TILE = 8192  # floats of a merge step's tiles at most (64 per thread)
MERGE_SPLITS = 64  # splits a merge step reads at most
# the merge's warps and exact tokens per step (`python bench/fsq_kernels.py --merge`)
MERGE_TUNING = {"num_warps": 4, "block_e": 16}


@triton.jit
def _split_kernel(q_ptr, codes_ptr, pos_ptr, alen_ptr, slen_ptr, kd_ptr, kb_ptr, kn_ptr,
                  cos_a, sin_a, cos_b, sin_b, acc_ptr, ml_ptr, qk_scale, eps,
                  q_sb, q_sh, c_sb, c_sn, p_sb, p_sn, kd_sh, kd_sd, kd_sw, kb_sh,
                  a_sb, a_sh, a_sp, ml_sb, ml_sh, ml_sp,
                  KV_HEADS, GROUP, HALF: tl.constexpr, WIDTH, SPLIT_LEN, NBYTES: tl.constexpr,
                  BITS: tl.constexpr, SUBS: tl.constexpr, ROPE: tl.constexpr,
                  HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_POS: tl.constexpr,
                  DEC_F32: tl.constexpr, NO_LICM: tl.constexpr, PREFETCH: tl.constexpr,
                  CODE_T: tl.constexpr,
                  Q_T: tl.constexpr, KEY_ROUND: tl.constexpr, P_ROUND: tl.constexpr,
                  BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    split, b, kvh, start, end = _program_split(alen_ptr, KV_HEADS, SPLIT_LEN)
    if start < end:  # the merge reads only the splits that hold positions
        g_ok, heads, dd, dd_ok, q1, q2, b1, b2, w1, w2 = _head_constants(
            q_ptr, kb_ptr, kn_ptr, b, kvh, q_sb, q_sh, kb_sh, GROUP, HALF, HAS_BIAS, HAS_NORM,
            Q_T, BLOCK_M, BLOCK_H)
        c = tl.arange(0, BLOCK_W)
        c_ok = c < WIDTH
        # the decoder halves (width, head_dim / 2), loaded once per program
        dec1, dec2 = _decoder_halves(kd_ptr, kvh, kd_sh, kd_sd, kd_sw, c, c_ok, dd, dd_ok, HALF,
                                     CODE_T)
        sink = tl.load(slen_ptr + b)
        row_base = codes_ptr + b.to(tl.int64) * c_sb
        pos_base = pos_ptr + b.to(tl.int64) * p_sb
        m = tl.full([BLOCK_M], NEG_BIG, tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
        step = tl.arange(0, BLOCK_N)
        nxt = _load_rows(row_base + (start + step).to(tl.int64) * c_sn, start + step < end,
                         NBYTES, BLOCK_B)
        for n0 in tl.range(start, end, BLOCK_N, disable_licm=NO_LICM):
            n = n0 + step
            n_ok = n < end
            if PREFETCH:  # the next block's rows load while this one is computed
                byte = nxt
                after = n + BLOCK_N
                nxt = _load_rows(row_base + after.to(tl.int64) * c_sn, after < end, NBYTES,
                                 BLOCK_B)
            else:
                byte = _load_rows(row_base + n.to(tl.int64) * c_sn, n_ok, NBYTES, BLOCK_B)
            z = _unpack(byte, BITS, SUBS, BLOCK_N, BLOCK_B, CODE_T)
            # the bias is the products' initial accumulator
            k1 = _mm(z, dec1, tl.broadcast_to(b1[None, :], (BLOCK_N, BLOCK_H)), DEC_F32)
            k2 = _mm(z, dec2, tl.broadcast_to(b2[None, :], (BLOCK_N, BLOCK_H)), DEC_F32)
            p, alpha, m, l = _block_weights(
                k1, k2, q1, q2, w1, w2, m, l, eps, qk_scale, n, n0, n_ok, sink, pos_base, p_sn,
                cos_a, sin_a, cos_b, sin_b, dd, dd_ok, HALF, BLOCK_H, ROPE, HAS_NORM, HAS_POS,
                Q_T, KEY_ROUND, P_ROUND, CODE_T)
            acc = _mm(p, z, acc * alpha[:, None], DEC_F32)
        out = acc_ptr + b * a_sb + split * a_sp
        tl.store(out + heads[:, None] * a_sh + c[None, :], acc,
                 mask=g_ok[:, None] & c_ok[None, :])
        ml = ml_ptr + b * ml_sb + heads * ml_sh + split * ml_sp
        tl.store(ml, m, mask=g_ok)
        tl.store(ml + 1, l, mask=g_ok)


@triton.jit
def _merge_kernel(q_ptr, sk_ptr, sv_ptr, rk_ptr, rv_ptr, slen_ptr, rlen_ptr, alen_ptr,
                  acc_ptr, ml_ptr, vd_ptr, vb_ptr, out_ptr, qk_scale,
                  q_sb, q_sh, sk_sb, sk_sh, sk_sn, sv_sb, sv_sh, sv_sn,
                  rk_sb, rk_sh, rk_sn, rv_sb, rv_sh, rv_sn,
                  a_sb, a_sh, a_sp, ml_sb, ml_sh, ml_sp, vd_sh, vd_sd, vd_sw, vb_sh,
                  o_sb, o_sh, Q_HEADS, GROUP, HEAD_DIM, WIDTH, SPLIT_LEN,
                  HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
                  ONE_STEP: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // Q_HEADS
    head = pid % Q_HEADS
    kvh = head // GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    # the exact tokens, with the one head in the first of 16 rows (tl.dot's least)
    g = tl.arange(0, 16)
    first = g == 0
    m_e, l_e, o_e = exact_tokens(q_ptr, sk_ptr, sv_ptr, rk_ptr, rv_ptr, slen_ptr, rlen_ptr, b,
                                 kvh, head + g * 0, first, d, d_ok, qk_scale, q_sb, q_sh,
                                 sk_sb, sk_sh, sk_sn, sv_sb, sv_sh, sv_sn,
                                 rk_sb, rk_sh, rk_sn, rv_sb, rv_sh, rv_sn, 16, BLOCK_D, BLOCK_E)
    m_e = tl.max(tl.where(first, m_e, NEG_BIG), axis=0)
    l_e = tl.sum(tl.where(first, l_e, 0.0), axis=0)
    o_e = tl.sum(tl.where(first[:, None], o_e, 0.0), axis=0)
    # the archive: the splits' (max, weight sum), BLOCK_S splits a step (each step waits on
    # memory once; batch 1 runs ~32 splits) merged online per lane, then per BLOCK_C codes
    # the splits' weighted sums through the value decoder's rows
    active = tl.cdiv(tl.load(alen_ptr + b), SPLIT_LEN)
    ml_row = ml_ptr + b * ml_sb + head * ml_sh
    m_lane = tl.full([BLOCK_S], NEG_BIG, tl.float32)
    l_lane = tl.zeros([BLOCK_S], tl.float32)
    for s0 in range(0, active, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        m_s = tl.load(ml_row + s * ml_sp, mask=s < active, other=NEG_BIG)
        l_s = tl.load(ml_row + s * ml_sp + 1, mask=s < active, other=0.0)
        m_new = tl.maximum(m_lane, m_s)
        l_lane = l_lane * tl.math.exp2(m_lane - m_new) + l_s * tl.math.exp2(m_s - m_new)
        m_lane = m_new
    m_a = tl.max(m_lane, axis=0)
    l_a = tl.sum(l_lane * tl.math.exp2(m_lane - m_a), axis=0)
    # ONE_STEP (every split in one tile): the lanes hold the splits' own maxima
    beta_one = tl.math.exp2(m_lane - m_a)
    values = tl.zeros([BLOCK_D], tl.float32)
    acc_row = acc_ptr + b * a_sb + head * a_sh
    for c0 in tl.static_range(0, BLOCK_W, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        c_ok = c < WIDTH
        if ONE_STEP:
            s = tl.arange(0, BLOCK_S)
            part = tl.load(acc_row + s[:, None] * a_sp + c[None, :],
                           mask=(s < active)[:, None] & c_ok[None, :], other=0.0)
            code_sum = tl.sum(part * beta_one[:, None], axis=0)
        else:
            code_sum = tl.zeros([BLOCK_C], tl.float32)
            for s0 in range(0, active, BLOCK_S):
                s = s0 + tl.arange(0, BLOCK_S)
                beta = tl.math.exp2(
                    tl.load(ml_row + s * ml_sp, mask=s < active, other=NEG_BIG) - m_a)
                part = tl.load(acc_row + s[:, None] * a_sp + c[None, :],
                               mask=(s < active)[:, None] & c_ok[None, :], other=0.0)
                code_sum += tl.sum(part * beta[:, None], axis=0)
        vd = tl.load(vd_ptr + kvh * vd_sh + d[None, :] * vd_sd + c[:, None] * vd_sw,
                     mask=c_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        values += tl.sum(code_sum[:, None] * vd, axis=0)
    if HAS_BIAS:
        values += l_a * tl.load(vb_ptr + kvh * vb_sh + d, mask=d_ok, other=0.0).to(tl.float32)
    m = tl.maximum(m_e, m_a)
    w_e = tl.math.exp2(m_e - m)
    w_a = tl.math.exp2(m_a - m)
    out = (o_e * w_e + values * w_a) / (l_e * w_e + l_a * w_a)
    tl.store(out_ptr + b * o_sb + head * o_sh + d, out.to(out_ptr.dtype.element_ty),
             mask=d_ok)


def decode(problem: FsqProblem, *, num_splits: int | None = None, num_warps: int | None = None,
           block_n: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """Run the two kernels on a validated problem; ``(batch, q_heads, head_dim)`` in the
    query's dtype. ``block_n`` (positions per step, a power of two >= 16), ``num_warps`` and
    ``num_stages`` of the split kernel are tuning knobs (``None``:
    :data:`~kernels._fsq_plan.SPLIT_TUNING`, as is the prefetch and whether a Hopper GPU runs
    the warp-specialized split kernel, ``kernels._fsq_ws``). Never waits for the GPU."""
    p = problem
    reason = kernel_limit(p)
    if reason is not None:
        raise ValueError(f"backend='triton': {reason}")
    tune = SPLIT_TUNING
    ws = block_n is None and num_warps is None and num_stages is None and uses_ws(p)
    if block_n is None:  # (an explicit knob runs the Triton split kernel at its own default)
        block_n = WS_BLOCK_N if ws else split_block_n(p)
    if block_n < 16 or block_n & (block_n - 1) or block_n > 1 << ROPE_RADIX_BITS:
        # (a block's angles come from the first block_n rows of the 2^11-row low table)
        raise ValueError(f"block_n must be a power of two in [16, {1 << ROPE_RADIX_BITS}], "
                         f"got {block_n}")
    check_num_splits(num_splits)
    batch, q_heads, head_dim = p.query.shape
    split_len, splits = splits_for(p, num_splits, None if ws else block_n)
    device = p.query.device
    acc = torch.empty(batch, q_heads, splits, pow2(p.width, 16), dtype=torch.float32,
                      device=device)
    ml = torch.empty(batch, q_heads, splits, 2, dtype=torch.float32, device=device)
    codes = p.codes
    if codes.shape[1] == 0:  # no archived slot: real (never read) memory for the launcher
        codes = codes.new_zeros(batch, 1, codes.shape[2])
    if ws:
        from kernels import _fsq_ws

        _fsq_ws.launch_split(p, codes, acc, ml, split_len, splits)
    else:
        _launch_split(p, codes, acc, ml, split_len, splits, block_n,
                      tune["num_warps"] if num_warps is None else num_warps,
                      tune["num_stages"] if num_stages is None else num_stages)
    return _merge(p, acc, ml, split_len)


def _launch_split(p: FsqProblem, codes: torch.Tensor, acc: torch.Tensor, ml: torch.Tensor,
                  split_len: int, splits: int, block_n: int, num_warps: int,
                  num_stages: int) -> None:
    batch, q_heads, head_dim = p.query.shape
    kv_heads, width = p.kv_heads, p.width
    group = q_heads // kv_heads
    half = head_dim // 2
    kind, (cos_a, sin_a, cos_b, sin_b), kd, kb, kn = kernel_tensors(p, acc)
    pos = p.positions if p.positions is not None else p.archived_lengths
    p_sb, p_sn = (pos.stride(0), pos.stride(1)) if p.positions is not None else (0, 0)
    bits = uniform_bits(p.levels)
    subs = 8 // bits
    nbytes = codes.shape[2]
    # the interpreter reads bfloat16 dot operands as raw bits: there the operands are float32,
    # rounded first to the dtypes the GPU's products take (keys: the query's; weights: the
    # codes'), so interpreted runs check that rounding too
    widen = interpreted()
    p_round = tl.float32 if kd.dtype == torch.float32 else _TL[kd.dtype]
    code_t = tl.float32 if widen else p_round
    args = (p.query, codes, pos, p.archived_lengths, p.sink_lengths, kd, kb, kn,
            cos_a, sin_a, cos_b, sin_b, acc, ml, p.scale * LOG2E, p.eps,
            p.query.stride(0), p.query.stride(1), codes.stride(0), codes.stride(1), p_sb, p_sn,
            *kd.stride(), kb.stride(0), *acc.stride()[:3], *ml.stride()[:3],
            kv_heads, group, half, width, split_len)
    consts = dict(NBYTES=nbytes, BITS=bits, SUBS=subs, ROPE=kind,
                  HAS_BIAS=p.key_bias is not None, HAS_NORM=p.k_norm is not None,
                  HAS_POS=p.positions is not None, DEC_F32=kd.dtype == torch.float32,
                  NO_LICM=SPLIT_TUNING["no_licm"], CODE_T=code_t,
                  Q_T=tl.float32 if widen else _TL[p.query.dtype], KEY_ROUND=_TL[p.query.dtype],
                  P_ROUND=p_round, BLOCK_M=max(16, pow2(group)), BLOCK_N=block_n,
                  BLOCK_H=pow2(half, 16), num_warps=num_warps, num_stages=num_stages)
    grid = (splits, batch * kv_heads)
    if width > TILE_WIDTH:  # (codes in tiles: kernels._fsq_wide)
        from kernels import _fsq_wide

        count, tile_b = _fsq_wide.tiles(width, bits, WIDE_TUNING["tile"])
        _fsq_wide._split_kernel_wide[grid](*args, **consts, TILES=count, TILE_B=tile_b)
        return
    block_b = max(pow2(nbytes), 16 // subs)
    _split_kernel[grid](*args, **consts, PREFETCH=SPLIT_TUNING["prefetch"], BLOCK_B=block_b,
                        BLOCK_W=block_b * subs)


def _merge(p: FsqProblem, acc: torch.Tensor, ml: torch.Tensor, split_len: int) -> torch.Tensor:
    """The merge kernel over the splits' scratch: the exact tokens, the value decoder."""
    batch, q_heads, head_dim = p.query.shape
    kv_heads = p.kv_heads
    group = q_heads // kv_heads
    sk, sv, rk, rv = (launchable(t) for t in (p.sink_keys, p.sink_values, p.recent_keys,
                                                p.recent_values))
    vd = p.value_decoder
    vb = p.value_bias if p.value_bias is not None else vd
    out = torch.empty(batch, q_heads, head_dim, dtype=p.query.dtype, device=p.query.device)
    block_w, block_d = pow2(p.width, 16), pow2(head_dim, 16)
    block_s = min(pow2(acc.shape[2]), MERGE_SPLITS)
    # (codes per step: the (splits, codes) and (codes, head dims) tiles within MERGE_TILE)
    block_c = max(1, min(block_w, MERGE_TILE // block_s, MERGE_TILE // block_d))
    _merge_kernel[(batch * q_heads,)](
        p.query, sk, sv, rk, rv, p.sink_lengths, p.recent_lengths, p.archived_lengths,
        acc, ml, vd, vb, out, p.scale * LOG2E, p.query.stride(0), p.query.stride(1),
        *sk.stride()[:3], *sv.stride()[:3], *rk.stride()[:3], *rv.stride()[:3],
        *acc.stride()[:3], *ml.stride()[:3], *vd.stride(), vb.stride(0),
        out.stride(0), out.stride(1), q_heads, group, head_dim, p.width, split_len,
        HAS_BIAS=p.value_bias is not None, BLOCK_D=block_d, BLOCK_W=block_w,
        BLOCK_E=MERGE_TUNING["block_e"], BLOCK_S=block_s, BLOCK_C=block_c,
        ONE_STEP=acc.shape[2] <= block_s, num_warps=MERGE_TUNING["num_warps"])
    return out
