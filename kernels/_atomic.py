"""Triton kernels for decode attention on residual-VQ codes (split over the sequence).

The atomic-add variant (``kernels/_onehot.py`` is the other; ``kernels/rvq_decode.py`` picks
one per problem). Four launches per call, none of which forms a dense key or value of the
archived part:

1. ``_score_table_kernel``: the table ``q . C_k[stage, c]`` for every query head, key stage and
   key centroid, pre-multiplied by ``scale * log2(e)`` so the softmax can use ``exp2``.
2. ``_split_max_kernel``: one program per (sequence split, batch, kv head, query-head chunk).
   A position's score is the sum of ``key_stages`` table look-ups; the program writes the
   largest score of its split. Split 0 also clears the value histogram of its heads.
3. ``_value_histogram_kernel``: same grid. Every program takes the maximum over all splits of
   its heads as the common softmax reference, recomputes its scores, and adds each position's
   weight ``exp2(score - max)`` to the histogram bin of every value centroid the position
   chose (one atomic add per position, head and value stage), and its weight sum to ``l``.
   A common reference makes the histograms of all splits addable: they share out at most
   ``MAX_REPLICAS`` copies per head (fewer atomics meet at one address) instead of one each.
4. ``_exact_and_combine_kernel``: one program per (batch, kv head, query-head chunk). Runs an
   online softmax over the exact sink and recent tokens, merges it with the archived part, and
   finishes with one small matmul of the histogram against the value codebooks.

Why a histogram and atomics: a value is the sum of its stages' centroids, so the attention
output over archived positions is ``sum_stage sum_c W[stage, c] C_v[stage, c]`` where ``W`` is the
total weight of the positions that chose centroid ``c``. Building ``W`` costs one add per
position and stage instead of reading a ``head_dim`` vector.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._common import (
    LOG2E,
    NEG_BIG,
    exact_tokens,
    head_base,
    launchable,
    program_heads,
)
from kernels._plan import (
    MAX_GRID_Y,
    MAX_HISTOGRAM_COLUMNS,
    MAX_SPLITS,
    block_positions,
    grid_rows,
    heads_per_program,
    histogram_columns,
    multiprocessors,
    pow2,
    problem_dims,
    split_layout,
    supports_shape,
)
from kernels._validate import check_num_splits
from kernels.coded_cache import DecodeProblem

MAX_REPLICAS = 8  # copies of each head's histogram that the splits share out


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
    b, kvh, _, g, g_ok, heads = program_heads(pid_bhg, KV_HEADS, GROUP, GROUP_CHUNKS,
                                               BLOCK_G, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < CODEBOOK

    q = tl.load(q_ptr + b * q_sb + heads[:, None] * q_sh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    cb = tl.load(cb_ptr + kvh * cb_sh + stage * cb_ss + c[:, None] * cb_sc + d[None, :],
                 mask=c_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    table = tl.sum(q[:, None, :] * cb[None, :, :], axis=2) * qk_scale
    tl.store(table_ptr + b * t_sb + heads[:, None] * t_sh + stage * t_ss + c[None, :], table,
             mask=g_ok[:, None] & c_ok[None, :])


@triton.jit
def _archived_scores(table_rows, g_ok, kc_base, n, n_ok, kc_sn, kc_ss, t_ss,
                     KEY_STAGES: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
    score = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
    for s in tl.static_range(KEY_STAGES):
        code = tl.load(kc_base + n * kc_sn + s * kc_ss, mask=n_ok, other=0).to(tl.int32)
        score += tl.load(table_rows + s * t_ss + code[None, :],
                         mask=g_ok[:, None] & n_ok[None, :], other=0.0)
    return tl.where(g_ok[:, None] & n_ok[None, :], score, float("-inf"))


@triton.jit
def _split_max_kernel(table_ptr, kc_ptr, alen_ptr, mx_ptr, hist_ptr, l_ptr,
                      t_sb, t_sh, t_ss,
                      kc_sb, kc_sh, kc_sn, kc_ss,
                      mx_sb, mx_sh, h_sb, h_sh, l_sb, l_sh,
                      KV_HEADS, GROUP, GROUP_CHUNKS, SPLIT_LEN, HIST_LEN,
                      KEY_STAGES: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_Z: tl.constexpr):
    split = tl.program_id(0)
    pid_bhg = tl.program_id(1)
    b, kvh, _, g, g_ok, heads = program_heads(pid_bhg, KV_HEADS, GROUP, GROUP_CHUNKS,
                                               BLOCK_G, BLOCK_G)

    if split == 0:  # the histogram kernel accumulates with atomics: start it from zero
        zeros = tl.zeros([BLOCK_G, BLOCK_Z], tl.float32)
        for c0 in range(0, HIST_LEN, BLOCK_Z):
            col = c0 + tl.arange(0, BLOCK_Z)
            tl.store(hist_ptr + b * h_sb + heads[:, None] * h_sh + col[None, :], zeros,
                     mask=g_ok[:, None] & (col[None, :] < HIST_LEN))
        tl.store(l_ptr + b * l_sb + heads * l_sh, tl.zeros([BLOCK_G], tl.float32), mask=g_ok)

    n_archived = tl.load(alen_ptr + b)
    start = split * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, n_archived)
    table_rows = table_ptr + b * t_sb + heads[:, None] * t_sh
    kc_base = head_base(kc_ptr, b, kvh, kc_sb, kc_sh)
    m = tl.full([BLOCK_G, BLOCK_N], NEG_BIG, tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        score = _archived_scores(table_rows, g_ok, kc_base, n, n < end, kc_sn, kc_ss, t_ss,
                                 KEY_STAGES, BLOCK_G, BLOCK_N)
        m = tl.maximum(m, score)
    tl.store(mx_ptr + b * mx_sb + heads * mx_sh + split, tl.max(m, axis=1), mask=g_ok)


@triton.jit
def _value_histogram_kernel(table_ptr, kc_ptr, vc_ptr, alen_ptr, mx_ptr, hist_ptr, l_ptr,
                            t_sb, t_sh, t_ss,
                            kc_sb, kc_sh, kc_sn, kc_ss,
                            vc_sb, vc_sh, vc_sn, vc_ss,
                            mx_sb, mx_sh, h_sb, h_sh, l_sb, l_sh,
                            KV_HEADS, GROUP, GROUP_CHUNKS, SPLIT_LEN, NUM_SPLITS, COLUMNS,
                            REPLICAS, KEY_STAGES: tl.constexpr, VALUE_STAGES: tl.constexpr,
                            VALUE_CODEBOOK_P: tl.constexpr, BLOCK_G: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
    split = tl.program_id(0)
    pid_bhg = tl.program_id(1)
    b, kvh, _, g, g_ok, heads = program_heads(pid_bhg, KV_HEADS, GROUP, GROUP_CHUNKS,
                                               BLOCK_G, BLOCK_G)

    n_archived = tl.load(alen_ptr + b)
    start = split * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, n_archived)
    if start < end:
        splits = tl.arange(0, BLOCK_S)
        m_all = tl.load(mx_ptr + b * mx_sb + heads[:, None] * mx_sh + splits[None, :],
                        mask=g_ok[:, None] & (splits[None, :] < NUM_SPLITS), other=NEG_BIG)
        m = tl.max(m_all, axis=1)
        table_rows = table_ptr + b * t_sb + heads[:, None] * t_sh
        kc_base = head_base(kc_ptr, b, kvh, kc_sb, kc_sh)
        vc_base = head_base(vc_ptr, b, kvh, vc_sb, vc_sh)
        # splits spread over a few histogram copies: fewer atomics meet at one address
        hist_rows = hist_ptr + b * h_sb + heads[:, None] * h_sh + (split % REPLICAS) * COLUMNS
        l = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < end
            score = _archived_scores(table_rows, g_ok, kc_base, n, n_ok, kc_sn, kc_ss, t_ss,
                                     KEY_STAGES, BLOCK_G, BLOCK_N)
            p = tl.math.exp2(score - m[:, None])
            l += p
            ok = g_ok[:, None] & n_ok[None, :]
            for s in tl.static_range(VALUE_STAGES):
                code = tl.load(vc_base + n * vc_sn + s * vc_ss, mask=n_ok, other=0).to(tl.int32)
                tl.atomic_add(hist_rows + s * VALUE_CODEBOOK_P + code[None, :], p, mask=ok,
                              sem="relaxed")
        tl.atomic_add(l_ptr + b * l_sb + heads * l_sh, tl.sum(l, axis=1), mask=g_ok, sem="relaxed")


@triton.jit
def _exact_and_combine_kernel(q_ptr, sk_ptr, sv_ptr, rk_ptr, rv_ptr, slen_ptr, rlen_ptr,
                              mx_ptr, l_ptr, hist_ptr, vcb_ptr, out_ptr, qk_scale,
                              q_sb, q_sh,
                              sk_sb, sk_sh, sk_sn, sv_sb, sv_sh, sv_sn,
                              rk_sb, rk_sh, rk_sn, rv_sb, rv_sh, rv_sn,
                              mx_sb, mx_sh, l_sb, l_sh, h_sb, h_sh,
                              vcb_sh, vcb_ss, vcb_sc,
                              o_sb, o_sh,
                              KV_HEADS, GROUP, GROUP_CHUNKS, NUM_SPLITS, HEAD_DIM, VALUE_CODEBOOK,
                              COLUMNS,
                              VALUE_STAGES: tl.constexpr, VALUE_CODEBOOK_P: tl.constexpr,
                              REPLICAS: tl.constexpr, BLOCK_G: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                              BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
                              BLOCK_C: tl.constexpr):
    # BLOCK_G heads of the group, in BLOCK_M >= 16 rows so that tl.dot applies
    pid_bhg = tl.program_id(0)
    b, kvh, _, g, g_ok, heads = program_heads(pid_bhg, KV_HEADS, GROUP, GROUP_CHUNKS,
                                               BLOCK_G, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    m, l, acc = exact_tokens(q_ptr, sk_ptr, sv_ptr, rk_ptr, rv_ptr, slen_ptr, rlen_ptr,
                              b, kvh, heads, g_ok, d, d_ok, qk_scale, q_sb, q_sh,
                              sk_sb, sk_sh, sk_sn, sv_sb, sv_sh, sv_sn,
                              rk_sb, rk_sh, rk_sn, rv_sb, rv_sh, rv_sn, BLOCK_M, BLOCK_D, BLOCK_E)

    # the archived part: its reference maximum, weight sum and histogram
    splits = tl.arange(0, BLOCK_S)
    m_split = tl.load(mx_ptr + b * mx_sb + heads[:, None] * mx_sh + splits[None, :],
                      mask=g_ok[:, None] & (splits[None, :] < NUM_SPLITS), other=NEG_BIG)
    m_arch = tl.max(m_split, axis=1)
    l_arch = tl.load(l_ptr + b * l_sb + heads * l_sh, mask=g_ok, other=0.0)
    m_all = tl.maximum(m, m_arch)
    w_exact = tl.math.exp2(m - m_all)
    w_arch = tl.math.exp2(m_arch - m_all)
    total = tl.where(g_ok, l * w_exact + l_arch * w_arch, 1.0)

    values = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hist_rows = hist_ptr + b * h_sb + heads[:, None] * h_sh
    for s in tl.static_range(VALUE_STAGES):
        for c0 in range(0, VALUE_CODEBOOK, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            c_ok = c < VALUE_CODEBOOK
            weight = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
            for r in tl.static_range(REPLICAS):
                weight += tl.load(hist_rows + r * COLUMNS + s * VALUE_CODEBOOK_P + c[None, :],
                                  mask=g_ok[:, None] & c_ok[None, :], other=0.0)
            vcb = tl.load(vcb_ptr + kvh * vcb_sh + s * vcb_ss + c[:, None] * vcb_sc + d[None, :],
                          mask=c_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            values += tl.dot(weight, vcb, input_precision="ieee")

    out = (acc * w_exact[:, None] + values * w_arch[:, None]) / total[:, None]
    tl.store(out_ptr + b * o_sb + heads[:, None] * o_sh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def supports(problem: DecodeProblem) -> bool:
    """Whether a kernel variant takes this problem (:func:`supports_shape`)."""
    _, stages, size, _ = problem.cache.value_codebooks.shape
    return supports_shape(problem.batch, problem.q_heads, problem.kv_heads, stages, size)


def _grid_rows(problem: DecodeProblem) -> int:
    """(batch, kv head, head chunk) programs of the atomic kernel."""
    return grid_rows(problem.batch, problem.q_heads, problem.kv_heads)


def choose_num_splits(problem: DecodeProblem) -> int:
    """Enough splits for a few waves of programs over the GPU, never empty ones."""
    capacity = problem.cache.key_codes.shape[2]
    if capacity == 0:
        return 1
    group = problem.q_heads // problem.kv_heads
    wanted = math.ceil(8 * multiprocessors(problem.query.device) / _grid_rows(problem))
    return max(1, min(wanted, math.ceil(capacity / block_positions(group)), MAX_SPLITS))


def decode(problem: DecodeProblem, *, num_splits: int | None = None,
           num_warps: int = 4) -> torch.Tensor:
    """Run the four kernels on a validated problem; returns ``(batch, q_heads, head_dim)``."""
    p = problem
    (batch, q_heads, head_dim, kv_heads, group, key_stages, key_codebook, value_stages,
     value_codebook) = problem_dims(p)
    columns = histogram_columns(value_stages, value_codebook)
    if columns > MAX_HISTOGRAM_COLUMNS:
        raise ValueError(
            f"the value histogram would have {columns} "
            f"columns per head (value_codebooks {tuple(p.cache.value_codebooks.shape)}); at most "
            f"{MAX_HISTOGRAM_COLUMNS} are supported")
    if _grid_rows(p) > MAX_GRID_Y:
        raise ValueError(
            f"batch x kv_heads x head chunks is {_grid_rows(p)} programs (batch {batch}, "
            f"kv_heads {kv_heads}); a CUDA grid axis holds at most {MAX_GRID_Y}: split the "
            f"batch")
    if num_splits is None:
        num_splits = choose_num_splits(p)
    check_num_splits(num_splits)
    block_g = heads_per_program(group)
    block_n = block_positions(group)
    capacity = p.cache.key_codes.shape[2]
    split_len, num_splits = split_layout(capacity, num_splits, block_n)
    device = p.query.device
    chunks = math.ceil(group / block_g)
    block_d = pow2(head_dim, 16)
    qk_scale = p.scale * LOG2E

    table = torch.empty(batch, q_heads, key_stages, key_codebook, dtype=torch.float32,
                        device=device)
    replicas = min(MAX_REPLICAS, num_splits)
    # one scratch buffer: per head the split maxima, the weight sum and the value histograms
    scratch = torch.empty(batch, q_heads, num_splits + 1 + replicas * columns,
                          dtype=torch.float32, device=device)
    split_max, weight_sum, hist = (scratch[..., :num_splits], scratch[..., num_splits],
                                   scratch[..., num_splits + 1:])
    block_c = min(32, pow2(key_codebook))
    _score_table_kernel[(batch * kv_heads * chunks, key_stages, triton.cdiv(key_codebook,
                                                                           block_c))](
        p.query, p.cache.key_codebooks, table, qk_scale,
        p.query.stride(0), p.query.stride(1),
        *p.cache.key_codebooks.stride()[:3],
        *table.stride()[:3],
        kv_heads, group, chunks, key_codebook, head_dim,
        BLOCK_G=block_g, BLOCK_C=block_c, BLOCK_D=block_d, num_warps=num_warps)

    kc, vc = p.cache.key_codes, p.cache.value_codes
    if capacity == 0:  # no archived slot at all: give the launcher real (never read) memory
        kc = kc.new_zeros(batch, kv_heads, 1, key_stages)
        vc = vc.new_zeros(batch, kv_heads, 1, value_stages)
    grid = (num_splits, batch * kv_heads * chunks)
    _split_max_kernel[grid](
        table, kc, p.cache.archived_lengths, split_max, hist, weight_sum,
        *table.stride()[:3], *kc.stride(),
        split_max.stride(0), split_max.stride(1), hist.stride(0), hist.stride(1),
        weight_sum.stride(0), weight_sum.stride(1),
        kv_heads, group, chunks, split_len, replicas * columns,
        KEY_STAGES=key_stages, BLOCK_G=block_g, BLOCK_N=block_n,
        BLOCK_Z=min(1024 // block_g, pow2(replicas * columns)), num_warps=num_warps)
    _value_histogram_kernel[grid](
        table, kc, vc, p.cache.archived_lengths, split_max, hist, weight_sum,
        *table.stride()[:3], *kc.stride(), *vc.stride(),
        split_max.stride(0), split_max.stride(1), hist.stride(0), hist.stride(1),
        weight_sum.stride(0), weight_sum.stride(1),
        kv_heads, group, chunks, split_len, num_splits, columns, replicas,
        KEY_STAGES=key_stages, VALUE_STAGES=value_stages,
        VALUE_CODEBOOK_P=pow2(value_codebook), BLOCK_G=block_g, BLOCK_N=block_n,
        BLOCK_S=pow2(num_splits), num_warps=num_warps)

    out = torch.empty(batch, q_heads, head_dim, dtype=p.query.dtype, device=device)
    c = p.cache
    sk, sv, rk, rv = (launchable(t) for t in (c.sink_keys, c.sink_values, c.recent_keys,
                                                c.recent_values))
    vcb = p.cache.value_codebooks
    _exact_and_combine_kernel[(batch * kv_heads * chunks,)](
        p.query, sk, sv, rk, rv, p.cache.sink_lengths, p.cache.recent_lengths,
        split_max, weight_sum, hist, vcb, out, qk_scale,
        p.query.stride(0), p.query.stride(1),
        *sk.stride()[:3], *sv.stride()[:3], *rk.stride()[:3], *rv.stride()[:3],
        split_max.stride(0), split_max.stride(1), weight_sum.stride(0), weight_sum.stride(1),
        hist.stride(0), hist.stride(1),
        *vcb.stride()[:3],
        out.stride(0), out.stride(1),
        kv_heads, group, chunks, num_splits, head_dim, value_codebook, columns,
        VALUE_STAGES=value_stages, VALUE_CODEBOOK_P=pow2(value_codebook), REPLICAS=replicas,
        BLOCK_G=block_g, BLOCK_M=max(16, block_g), BLOCK_D=block_d, BLOCK_E=16,
        BLOCK_S=pow2(num_splits), BLOCK_C=min(64, pow2(value_codebook, 16)),
        num_warps=num_warps)
    return out
