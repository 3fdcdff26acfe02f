"""Triton kernels for decode attention on residual-VQ codes (split over the sequence).

Three launches per call:

1. ``_score_table_kernel``: the table ``q . C_k[stage, c]`` for every query head, key stage and
   key centroid, pre-multiplied by ``scale * log2(e)`` so the softmax can use ``exp2``.
2. ``_archived_split_kernel``: one program per (sequence split, batch, kv head, chunk of up to
   16 query heads of its group). A position's score is the sum of ``stages`` table look-ups;
   an online softmax runs over the split, and instead of a weighted sum of value vectors the
   program keeps, per value stage and centroid, the total attention weight of the positions
   that chose that centroid (a one-hot matmul on tensor cores). It writes its running max,
   sum and histogram.
3. ``_exact_and_combine_kernel``: one program per (batch, kv head, query-head chunk). Runs the
   online softmax over the exact sink and recent tokens, merges it with every split's partial
   state, and finishes with one small matmul of the merged histogram against the value
   codebooks.

The dense K/V of the archived part is never formed, in memory or in registers.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._validate import DecodeProblem

LOG2E = 1.4426950408889634
HEADS_PER_PROGRAM = 16  # tl.dot needs at least 16 rows; GQA groups are padded up to it
NEG_BIG = -1.0e30  # finite "minus infinity": keeps exp2(m_old - m_new) defined for empty blocks
MAX_HISTOGRAM_COLUMNS = 2048  # value stages x codebook size (both padded to powers of two)


@triton.jit
def _score_table_kernel(q_ptr, cb_ptr, table_ptr, qk_scale,
                        q_sb, q_sh,
                        cb_sh, cb_ss, cb_sc,
                        t_sb, t_sh, t_ss,
                        KV_HEADS, GROUP, GROUP_CHUNKS, CODEBOOK, HEAD_DIM,
                        BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_bhg = tl.program_id(0)
    stage = tl.program_id(1)
    pid_c = tl.program_id(2)
    chunk = pid_bhg % GROUP_CHUNKS
    kvh = (pid_bhg // GROUP_CHUNKS) % KV_HEADS
    b = pid_bhg // (GROUP_CHUNKS * KV_HEADS)

    g = chunk * BLOCK_G + tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    heads = kvh * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < CODEBOOK

    q = tl.load(q_ptr + b * q_sb + heads[:, None] * q_sh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    cb = tl.load(cb_ptr + kvh * cb_sh + stage * cb_ss + c[:, None] * cb_sc + d[None, :],
                 mask=c_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    table = tl.dot(q, tl.trans(cb), input_precision="ieee") * qk_scale
    tl.store(table_ptr + b * t_sb + heads[:, None] * t_sh + stage * t_ss + c[None, :], table,
             mask=g_ok[:, None] & c_ok[None, :])


@triton.jit
def _archived_split_kernel(table_ptr, kc_ptr, vc_ptr, alen_ptr, ml_ptr, hist_ptr,
                           t_sb, t_sh, t_ss,
                           kc_sb, kc_sh, kc_sn, kc_ss,
                           vc_sb, vc_sh, vc_sn, vc_ss,
                           ml_sb, ml_sh, ml_ss,
                           h_sb, h_sh, h_ss,
                           KV_HEADS, GROUP, GROUP_CHUNKS, SPLIT_LEN,
                           KEY_STAGES: tl.constexpr, VALUE_STAGES: tl.constexpr,
                           VALUE_STAGES_P: tl.constexpr, VALUE_CODEBOOK_P: tl.constexpr,
                           BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
    split = tl.program_id(0)
    pid_bhg = tl.program_id(1)
    chunk = pid_bhg % GROUP_CHUNKS
    kvh = (pid_bhg // GROUP_CHUNKS) % KV_HEADS
    b = pid_bhg // (GROUP_CHUNKS * KV_HEADS)

    g = chunk * BLOCK_G + tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    heads = kvh * GROUP + g
    COLUMNS: tl.constexpr = VALUE_STAGES_P * VALUE_CODEBOOK_P
    stage_v = tl.arange(0, VALUE_STAGES_P)
    centroid = tl.arange(0, VALUE_CODEBOOK_P)

    n_archived = tl.load(alen_ptr + b)
    start = split * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, n_archived)

    m = tl.full([BLOCK_G], NEG_BIG, tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    hist = tl.zeros([BLOCK_G, COLUMNS], tl.float32)
    table_rows = table_ptr + b * t_sb + heads[:, None] * t_sh
    kc_base = kc_ptr + b * kc_sb + kvh * kc_sh
    vc_base = vc_ptr + b * vc_sb + kvh * vc_sh
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        score = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
        for s in tl.static_range(KEY_STAGES):
            code = tl.load(kc_base + n * kc_sn + s * kc_ss, mask=n_ok, other=0).to(tl.int32)
            score += tl.load(table_rows + s * t_ss + code[None, :],
                             mask=g_ok[:, None] & n_ok[None, :], other=0.0)
        score = tl.where(n_ok[None, :], score, float("-inf"))
        m_new = tl.maximum(m, tl.max(score, axis=1))
        alpha = tl.math.exp2(m - m_new)
        p = tl.math.exp2(score - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)

        # one-hot of every (position, value stage) code, laid out stage-major over the columns
        v_ok = n_ok[:, None] & (stage_v[None, :] < VALUE_STAGES)
        vcode = tl.load(vc_base + n[:, None] * vc_sn + stage_v[None, :] * vc_ss, mask=v_ok,
                        other=0).to(tl.int32)
        vcode = tl.where(v_ok, vcode, -1)  # padding matches no centroid
        onehot = (vcode[:, :, None] == centroid[None, None, :]).to(tl.float16)
        onehot = tl.reshape(onehot, [BLOCK_N, COLUMNS])
        hist = hist * alpha[:, None] + tl.dot(p.to(tl.float16), onehot)
        m = m_new

    tl.store(ml_ptr + b * ml_sb + heads * ml_sh + split * ml_ss, m, mask=g_ok)
    tl.store(ml_ptr + b * ml_sb + heads * ml_sh + split * ml_ss + 1, l, mask=g_ok)
    cols = tl.arange(0, COLUMNS)
    tl.store(hist_ptr + b * h_sb + heads[:, None] * h_sh + split * h_ss + cols[None, :], hist,
             mask=g_ok[:, None])


@triton.jit
def _exact_segment(q, k_base, v_base, n_tokens, m, l, acc, k_sn, v_sn, d, d_ok,
                   HEAD_DIM, BLOCK_E: tl.constexpr):
    for n0 in range(0, n_tokens, BLOCK_E):
        n = n0 + tl.arange(0, BLOCK_E)
        n_ok = n < n_tokens
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + n[:, None] * k_sn + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + n[:, None] * v_sn + d[None, :], mask=kv_mask, other=0.0)
        score = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        score = tl.where(n_ok[None, :], score, float("-inf"))
        m_new = tl.maximum(m, tl.max(score, axis=1))
        alpha = tl.math.exp2(m - m_new)
        p = tl.math.exp2(score - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        m = m_new
    return m, l, acc


@triton.jit
def _exact_and_combine_kernel(q_ptr, sk_ptr, sv_ptr, rk_ptr, rv_ptr, slen_ptr, rlen_ptr,
                              ml_ptr, hist_ptr, vcb_ptr, out_ptr, qk_scale,
                              q_sb, q_sh,
                              sk_sb, sk_sh, sk_sn, sv_sb, sv_sh, sv_sn,
                              rk_sb, rk_sh, rk_sn, rv_sb, rv_sh, rv_sn,
                              ml_sb, ml_sh, ml_ss,
                              h_sb, h_sh, h_ss,
                              vcb_sh, vcb_ss, vcb_sc,
                              o_sb, o_sh,
                              KV_HEADS, GROUP, GROUP_CHUNKS, NUM_SPLITS, HEAD_DIM, VALUE_CODEBOOK,
                              VALUE_STAGES: tl.constexpr, VALUE_CODEBOOK_P: tl.constexpr,
                              COLUMNS: tl.constexpr, BLOCK_G: tl.constexpr,
                              BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                              BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    pid_bhg = tl.program_id(0)
    chunk = pid_bhg % GROUP_CHUNKS
    kvh = (pid_bhg // GROUP_CHUNKS) % KV_HEADS
    b = pid_bhg // (GROUP_CHUNKS * KV_HEADS)

    g = chunk * BLOCK_G + tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    heads = kvh * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    q = tl.load(q_ptr + b * q_sb + heads[:, None] * q_sh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32) * qk_scale
    m = tl.full([BLOCK_G], NEG_BIG, tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    m, l, acc = _exact_segment(q, sk_ptr + b * sk_sb + kvh * sk_sh,
                               sv_ptr + b * sv_sb + kvh * sv_sh, tl.load(slen_ptr + b),
                               m, l, acc, sk_sn, sv_sn, d, d_ok, HEAD_DIM, BLOCK_E)
    m, l, acc = _exact_segment(q, rk_ptr + b * rk_sb + kvh * rk_sh,
                               rv_ptr + b * rv_sb + kvh * rv_sh, tl.load(rlen_ptr + b),
                               m, l, acc, rk_sn, rv_sn, d, d_ok, HEAD_DIM, BLOCK_E)

    # merge the splits' partial states: first the common maximum, then the rescaled sums
    splits = tl.arange(0, BLOCK_S)
    ml_rows = ml_ptr + b * ml_sb + heads[:, None] * ml_sh
    split_ok = g_ok[:, None] & (splits[None, :] < NUM_SPLITS)
    m_split = tl.load(ml_rows + splits[None, :] * ml_ss, mask=split_ok, other=NEG_BIG)
    l_split = tl.load(ml_rows + splits[None, :] * ml_ss + 1, mask=split_ok, other=0.0)
    m_all = tl.maximum(m, tl.max(m_split, axis=1))
    w_split = tl.math.exp2(m_split - m_all[:, None])
    w_exact = tl.math.exp2(m - m_all)
    total = l * w_exact + tl.sum(l_split * w_split, axis=1)
    out = acc * w_exact[:, None]

    hist_rows = hist_ptr + b * h_sb + heads[:, None] * h_sh
    for c0 in tl.static_range(0, COLUMNS, BLOCK_C):
        col = c0 + tl.arange(0, BLOCK_C)
        weight = tl.zeros([BLOCK_G, BLOCK_C], tl.float32)
        for i in range(0, NUM_SPLITS):
            w_i = tl.sum(tl.where(splits[None, :] == i, w_split, 0.0), axis=1)
            part = tl.load(hist_rows + i * h_ss + col[None, :], mask=g_ok[:, None], other=0.0)
            weight += part * w_i[:, None]
        stage = col // VALUE_CODEBOOK_P
        code = col % VALUE_CODEBOOK_P
        col_ok = (stage < VALUE_STAGES) & (code < VALUE_CODEBOOK)
        vcb = tl.load(vcb_ptr + kvh * vcb_sh + stage[:, None] * vcb_ss + code[:, None] * vcb_sc
                      + d[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        out += tl.dot(weight, vcb.to(tl.float32), input_precision="ieee")

    out = out / total[:, None]
    tl.store(out_ptr + b * o_sb + heads[:, None] * o_sh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def _launchable(exact: torch.Tensor) -> torch.Tensor:
    """An exact K/V segment with unit stride over head_dim and at least one (unread) slot."""
    if exact.shape[2] == 0:
        return exact.new_zeros(exact.shape[0], exact.shape[1], 1, exact.shape[3])
    return exact if exact.stride(3) == 1 else exact.contiguous()


def _pow2(x: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(int(x)))


def histogram_columns(value_stages: int, value_codebook_size: int) -> int:
    """Columns of the per-split value histogram (both factors padded to powers of two)."""
    return _pow2(value_stages) * _pow2(value_codebook_size)


def choose_num_splits(problem: DecodeProblem, block_n: int) -> int:
    """Enough splits for a few waves of programs over the GPU, never empty ones."""
    capacity = problem.key_codes.shape[2]
    if capacity == 0:
        return 1
    chunks = math.ceil(problem.q_heads // problem.kv_heads / HEADS_PER_PROGRAM)
    programs = problem.batch * problem.kv_heads * chunks
    if problem.query.is_cuda:
        sms = torch.cuda.get_device_properties(problem.query.device).multi_processor_count
    else:
        sms = 4
    wanted = math.ceil(4 * sms / programs)
    return max(1, min(wanted, math.ceil(capacity / block_n), 256))


def decode(problem: DecodeProblem, *, num_splits: int | None = None, block_n: int = 64,
           num_warps: int = 4) -> torch.Tensor:
    """Run the three kernels on a validated problem; returns ``(batch, q_heads, head_dim)``."""
    p = problem
    batch, q_heads, head_dim = p.query.shape
    kv_heads = p.kv_heads
    group = q_heads // kv_heads
    key_stages, key_codebook = p.key_codebooks.shape[1:3]
    value_stages, value_codebook = p.value_codebooks.shape[1:3]
    columns = histogram_columns(value_stages, value_codebook)
    if columns > MAX_HISTOGRAM_COLUMNS:
        raise ValueError(
            f"the Triton path keeps a histogram over value stages x codebook size padded to "
            f"powers of two, {columns} columns here; at most {MAX_HISTOGRAM_COLUMNS} fit "
            f"(value_codebooks {tuple(p.value_codebooks.shape)}); use backend='torch'")
    if num_splits is None:
        num_splits = choose_num_splits(p, block_n)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    capacity = p.key_codes.shape[2]
    split_len = max(block_n, math.ceil(max(capacity, 1) / num_splits / block_n) * block_n)
    device = p.query.device
    block_g = HEADS_PER_PROGRAM
    chunks = math.ceil(group / block_g)
    block_d = _pow2(head_dim, 16)
    qk_scale = p.scale * LOG2E

    table = torch.empty(batch, q_heads, key_stages, key_codebook, dtype=torch.float32,
                        device=device)
    block_c = min(64, _pow2(key_codebook, 16))
    _score_table_kernel[(batch * kv_heads * chunks, key_stages, triton.cdiv(key_codebook,
                                                                           block_c))](
        p.query, p.key_codebooks, table, qk_scale,
        p.query.stride(0), p.query.stride(1),
        *p.key_codebooks.stride()[:3],
        *table.stride()[:3],
        kv_heads, group, chunks, key_codebook, head_dim,
        BLOCK_G=block_g, BLOCK_C=block_c, BLOCK_D=block_d, num_warps=num_warps)

    ml = torch.empty(batch, q_heads, num_splits, 2, dtype=torch.float32, device=device)
    hist = torch.empty(batch, q_heads, num_splits, columns, dtype=torch.float32, device=device)
    kc, vc = p.key_codes, p.value_codes
    if capacity == 0:  # no archived slot at all: give the launcher real (never read) memory
        kc = kc.new_zeros(batch, kv_heads, 1, key_stages)
        vc = vc.new_zeros(batch, kv_heads, 1, value_stages)
    _archived_split_kernel[(num_splits, batch * kv_heads * chunks)](
        table, kc, vc, p.archived_lengths, ml, hist,
        *table.stride()[:3],
        *kc.stride(), *vc.stride(),
        *ml.stride()[:3],
        *hist.stride()[:3],
        kv_heads, group, chunks, split_len,
        KEY_STAGES=key_stages, VALUE_STAGES=value_stages,
        VALUE_STAGES_P=_pow2(value_stages), VALUE_CODEBOOK_P=_pow2(value_codebook),
        BLOCK_G=block_g, BLOCK_N=block_n, num_warps=num_warps)

    out = torch.empty(batch, q_heads, head_dim, dtype=p.query.dtype, device=device)
    sk, sv, rk, rv = (_launchable(t) for t in (p.sink_keys, p.sink_values, p.recent_keys,
                                                 p.recent_values))
    vcb = p.value_codebooks
    _exact_and_combine_kernel[(batch * kv_heads * chunks,)](
        p.query, sk, sv, rk, rv, p.sink_lengths, p.recent_lengths,
        ml, hist, vcb, out, qk_scale,
        p.query.stride(0), p.query.stride(1),
        *sk.stride()[:3], *sv.stride()[:3], *rk.stride()[:3], *rv.stride()[:3],
        *ml.stride()[:3],
        *hist.stride()[:3],
        *vcb.stride()[:3],
        out.stride(0), out.stride(1),
        kv_heads, group, chunks, num_splits, head_dim, value_codebook,
        VALUE_STAGES=value_stages, VALUE_CODEBOOK_P=_pow2(value_codebook),
        COLUMNS=columns, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_E=32,
        BLOCK_S=_pow2(num_splits), BLOCK_C=min(64, columns), num_warps=num_warps)
    return out
