"""The FSQ split kernel, warp-specialized for Hopper (Gluon): three 4-warp partitions hand
blocks of ``BLOCK_N`` positions to each other through shared memory.

Same work and scratch as ``_fsq._split_kernel`` (the merge kernel is shared), arranged so
the unpack of block ``i + 2``, the keys of block ``i + 1`` and the scores of block ``i`` run
at the same time on different warps:

- *unpack* (``_unpacker``): a block's packed rows -> ``(BLOCK_N, BLOCK_W)`` codes in the
  decoder's dtype (exact: levels <= 256) in a ring of ``STAGES`` buffers;
- *keys* (``_keys``): the two key-half products on warp-group MMA against the decoder halves
  (in shared memory for the whole program), bias, RMSNorm and RoPE in float32 (the angles of
  offsets ``0 .. BLOCK_N - 1`` from shared memory, the block's base angle from the exact
  tables, combined by the angle-sum formula), the keys rounded to the query's dtype into
  shared memory;
- *scores* (``_scores``, the kernel's own warps): ``keys @ queryᵀ`` with positions as the MMA
  rows (M = 64), the online softmax over positions, ``acc += codesᵀ @ weights``.

Every buffer has a ready and a free mbarrier. Hopper only (warp-group MMA, ``setmaxnreg``);
``_fsq_plan.ws_limit`` says which problems it runs. The Triton interpreter cannot run Gluon,
so this kernel is checked on the GPU only.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kernels._common import LOG2E, NEG_BIG
from kernels._fsq_plan import (
    ROPE_RADIX_BITS,
    WS_BLOCK_N,
    FsqProblem,
    kernel_tensors,
    uniform_bits,
    ws_block_bytes,
)

BLOCK_N = gl.constexpr(WS_BLOCK_N)
STAGES = gl.constexpr(2)  # code buffers in flight between the partitions
_GL = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
RADIX_BITS = gl.constexpr(ROPE_RADIX_BITS)
RADIX_MASK = gl.constexpr((1 << ROPE_RADIX_BITS) - 1)


@functools.lru_cache(maxsize=64)
def byte_layout(block_b: int, vec: int) -> gl.BlockedLayout:
    """Rows of ``block_b`` bytes, ``vec`` contiguous bytes per thread, 4 warps."""
    across = max(1, min(32, block_b // vec))
    return gl.BlockedLayout([1, vec], [32 // across, across], [4, 1], [1, 0])


@gluon.jit
def _unpack(byte, BITS: gl.constexpr, BLOCK_B: gl.constexpr, DTYPE: gl.constexpr):
    """Codes ``(BLOCK_N, BLOCK_B * 8 // BITS)`` of packed rows ``byte`` (the packing contract:
    coordinate ``2k`` is the low nibble of byte ``k``)."""
    x = byte.to(gl.int32)
    if BITS == 8:
        z = x
    else:
        z = gl.reshape(gl.join(x & 15, x >> 4), [BLOCK_N, BLOCK_B * 2])
    return z.to(gl.float32).to(DTYPE)


@gluon.jit
def _split_range(alen_ptr, KV_HEADS, SPLIT_LEN):
    """``(b, kv head, split, start, end)`` of this program."""
    split = gl.program_id(0)
    pid = gl.program_id(1)
    b = pid // KV_HEADS
    start = split * SPLIT_LEN
    return b, pid % KV_HEADS, split, start, gl.minimum(start + SPLIT_LEN, gl.load(alen_ptr + b))


@gluon.jit
def _unpacker(codes_ptr, alen_ptr, z_bufs, z_ready, z_free, KV_HEADS, SPLIT_LEN, c_sb, c_sn,
              NBYTES: gl.constexpr, BITS: gl.constexpr, BLOCK_B: gl.constexpr,
              LAYOUT: gl.constexpr, DTYPE: gl.constexpr):
    """Partition 1: packed rows -> codes in shared memory, a block ahead of the keys."""
    layout: gl.constexpr = LAYOUT
    b, kvh, split, start, end = _split_range(alen_ptr, KV_HEADS, SPLIT_LEN)
    rows0 = gl.arange(0, BLOCK_N, gl.SliceLayout(1, layout))
    j = gl.arange(0, BLOCK_B, gl.SliceLayout(0, layout))
    base = codes_ptr + b.to(gl.int64) * c_sb + j[None, :]
    i = 0
    for n0 in range(start, end, BLOCK_N):
        rows = n0 + rows0
        ok = (rows < end)[:, None] & (j < NBYTES)[None, :]
        byte = gl.load(base + rows.to(gl.int64)[:, None] * c_sn, mask=ok, other=0)
        z = _unpack(byte, BITS, BLOCK_B, DTYPE)
        slot = i % STAGES
        mbarrier.wait(z_free.index(slot), ((i // STAGES) & 1) ^ 1)
        z_bufs.index(slot).store(z)
        fence_async_shared()
        mbarrier.arrive(z_ready.index(slot), count=1)
        i += 1


@gluon.jit
def _angle_sum(cos_a, sin_a, cos_b, sin_b):
    return cos_a * cos_b - sin_a * sin_b, sin_a * cos_b + cos_a * sin_b


@gluon.jit
def _keys(alen_ptr, slen_ptr, kb_ptr, kn_ptr, cos_a, sin_a, cos_b, sin_b, eps, kb_sh,
          z_bufs, k_bufs, dec1, dec2, angles, z_ready, k_ready, k_free, KV_HEADS, SPLIT_LEN,
          HALF: gl.constexpr, ROPE: gl.constexpr, HAS_BIAS: gl.constexpr,
          HAS_NORM: gl.constexpr, DTYPE: gl.constexpr):
    """Partition 2: codes -> keys (the two halves' products, bias, RMSNorm, RoPE), rounded
    to the query's dtype into shared memory, as a dense cache holds them."""
    kl: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, HALF, 16])
    b, kvh, split, start, end = _split_range(alen_ptr, KV_HEADS, SPLIT_LEN)
    dd = gl.arange(0, HALF, gl.SliceLayout(0, kl))
    sink = gl.load(slen_ptr + b)
    zero_k = gl.zeros([BLOCK_N, HALF], gl.float32, kl)
    i = 0
    for n0 in range(start, end, BLOCK_N):
        slot = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(z_ready.index(slot), phase)
        z = z_bufs.index(slot)
        k1 = warpgroup_mma(z, dec1, zero_k, use_acc=False, is_async=True)
        k2 = warpgroup_mma(z, dec2, zero_k, use_acc=False, is_async=True)
        if ROPE == 1:  # the block's angles load while the products run
            base = sink + n0
            lo = (base & RADIX_MASK) * HALF + dd
            hi = (base >> RADIX_BITS) * HALF + dd
            cb, sb = _angle_sum(gl.load(cos_a + lo), gl.load(sin_a + lo),
                                gl.load(cos_b + hi), gl.load(sin_b + hi))
            cos, sin = _angle_sum(angles.index(0).load(kl), angles.index(1).load(kl),
                                  cb[None, :], sb[None, :])
        k1, k2 = warpgroup_mma_wait(num_outstanding=0, deps=(k1, k2))
        if HAS_BIAS:  # (loaded per block: registers are scarce, the vectors stay in L1)
            k1 = k1 + gl.load(kb_ptr + kvh * kb_sh + dd).to(gl.float32)[None, :]
            k2 = k2 + gl.load(kb_ptr + kvh * kb_sh + HALF + dd).to(gl.float32)[None, :]
        if HAS_NORM:
            ms = (gl.sum(k1 * k1, axis=1) + gl.sum(k2 * k2, axis=1)) / (2 * HALF)
            r = gl.rsqrt(ms + eps)
            k1 = k1 * r[:, None] * gl.load(kn_ptr + dd).to(gl.float32)[None, :]
            k2 = k2 * r[:, None] * gl.load(kn_ptr + HALF + dd).to(gl.float32)[None, :]
        if ROPE == 1:
            k1, k2 = k1 * cos - k2 * sin, k2 * cos + k1 * sin
        mbarrier.wait(k_free.index(slot), phase ^ 1)
        k_bufs.index(2 * slot).store(k1.to(DTYPE))
        k_bufs.index(2 * slot + 1).store(k2.to(DTYPE))
        fence_async_shared()
        mbarrier.arrive(k_ready.index(slot), count=1)
        i += 1


@gluon.jit
def _scores(alen_ptr, acc_ptr, ml_ptr, qk_scale, a_sb, a_sh, a_sp, ml_sb, ml_sh, ml_sp,
            z_bufs, k_bufs, q1, q2, p_buf, k_ready, k_free, z_free, KV_HEADS, GROUP, WIDTH,
            SPLIT_LEN, BLOCK_M: gl.constexpr, BLOCK_W: gl.constexpr, DTYPE: gl.constexpr):
    """Partition 3 (the kernel's warps): keys -> scores of the group's heads (positions as
    the MMA rows), the online softmax over positions, ``acc += codesᵀ @ weights``."""
    sl: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, BLOCK_M, 16])
    b, kvh, split, start, end = _split_range(alen_ptr, KV_HEADS, SPLIT_LEN)
    sn = gl.arange(0, BLOCK_N, gl.SliceLayout(1, sl))
    m = gl.full([BLOCK_M], NEG_BIG, gl.float32, gl.SliceLayout(0, sl))
    # the weight sums per (row, head), summed over rows once at the end
    lt = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, sl)
    acc = gl.zeros([BLOCK_W, BLOCK_M], gl.float32, sl)
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, sl)
    i = 0
    for n0 in range(start, end, BLOCK_N):
        slot = i % STAGES
        mbarrier.wait(k_ready.index(slot), (i // STAGES) & 1)
        s = warpgroup_mma(k_bufs.index(2 * slot), q1.permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
        s = warpgroup_mma(k_bufs.index(2 * slot + 1), q2.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.arrive(k_free.index(slot), count=1)
        s = gl.where((n0 + sn < end)[:, None], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, axis=0))
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s - m_new[None, :]).to(DTYPE)
        lt = lt * alpha[None, :] + p.to(gl.float32)
        m = m_new
        p_buf.store(p)
        fence_async_shared()
        acc = warpgroup_mma(z_bufs.index(slot).permute((1, 0)), p_buf, acc * alpha[None, :],
                            is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(z_free.index(slot), count=1)
        i += 1
    l = gl.sum(lt, axis=0)
    g = gl.arange(0, BLOCK_M, gl.SliceLayout(0, sl))
    c = gl.arange(0, BLOCK_W, gl.SliceLayout(1, sl))
    heads = kvh * GROUP + g
    out = acc_ptr + b * a_sb + split * a_sp + heads[None, :] * a_sh + c[:, None]
    gl.store(out, acc, mask=(g < GROUP)[None, :] & (c < WIDTH)[:, None])
    ml = ml_ptr + b * ml_sb + heads * ml_sh + split * ml_sp
    gl.store(ml, m, mask=g < GROUP)
    gl.store(ml + 1, l, mask=g < GROUP)


@gluon.jit
def _split_kernel_ws(q_ptr, codes_ptr, alen_ptr, slen_ptr, kd_ptr, kb_ptr, kn_ptr,
                     cos_a, sin_a, cos_b, sin_b, acc_ptr, ml_ptr, qk_scale, eps,
                     q_sb, q_sh, c_sb, c_sn, kd_sh, kd_sd, kd_sw, kb_sh,
                     a_sb, a_sh, a_sp, ml_sb, ml_sh, ml_sp,
                     KV_HEADS, GROUP, WIDTH, SPLIT_LEN, HALF: gl.constexpr,
                     NBYTES: gl.constexpr, BITS: gl.constexpr, ROPE: gl.constexpr,
                     HAS_BIAS: gl.constexpr, HAS_NORM: gl.constexpr, DTYPE: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_B: gl.constexpr, BLOCK_W: gl.constexpr,
                     BYTES: gl.constexpr, UNPACK_REGS: gl.constexpr, KEY_REGS: gl.constexpr):
    pid = gl.program_id(1)
    b = pid // KV_HEADS
    kvh = pid % KV_HEADS
    # the decoder halves (BLOCK_W, HALF) and the group's query halves (BLOCK_M, HALF) go to
    # shared memory once: the MMAs' B operands for the whole program
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    c = gl.arange(0, BLOCK_W, gl.SliceLayout(1, ld))
    d = gl.arange(0, HALF, gl.SliceLayout(0, ld))
    dec = kd_ptr + kvh * kd_sh + d[None, :] * kd_sd + c[:, None] * kd_sw
    dec_ok = (c < WIDTH)[:, None] & (d < HALF)[None, :]
    dec_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_W, HALF], DTYPE)
    dec1 = gl.allocate_shared_memory(DTYPE, [BLOCK_W, HALF], dec_layout,
                                     gl.load(dec, mask=dec_ok, other=0.0))
    dec2 = gl.allocate_shared_memory(DTYPE, [BLOCK_W, HALF], dec_layout,
                                     gl.load(dec + HALF * kd_sd, mask=dec_ok, other=0.0))
    g = gl.arange(0, BLOCK_M, gl.SliceLayout(1, ld))
    q_rows = q_ptr + b * q_sb + (kvh * GROUP + g)[:, None] * q_sh + d[None, :]
    q_ok = (g < GROUP)[:, None] & (d < HALF)[None, :]
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF], DTYPE)
    q1 = gl.allocate_shared_memory(DTYPE, [BLOCK_M, HALF], q_layout,
                                   gl.load(q_rows, mask=q_ok, other=0.0))
    q2 = gl.allocate_shared_memory(DTYPE, [BLOCK_M, HALF], q_layout,
                                   gl.load(q_rows + HALF, mask=q_ok, other=0.0))
    z_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_W], DTYPE)
    z_bufs = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_N, BLOCK_W], z_layout)
    # the finished key halves, (2 * STAGES, BLOCK_N, HALF): the score products' A operands
    k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], DTYPE)
    k_bufs = gl.allocate_shared_memory(DTYPE, [2 * STAGES, BLOCK_N, HALF], k_layout)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], DTYPE)
    p_buf = gl.allocate_shared_memory(DTYPE, [BLOCK_N, BLOCK_M], p_layout)
    # RoPE: the angles of a block's offsets 0 .. BLOCK_N - 1, the same for every block, in
    # shared memory (L1 is too small beside the buffers to keep them)
    a_layout: gl.constexpr = gl.SwizzledSharedLayout(2, 1, 8, [1, 0])
    if ROPE == 1:
        rows = gl.arange(0, BLOCK_N, gl.SliceLayout(1, ld))[:, None] * HALF + d[None, :]
        angles = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N, HALF], a_layout)
        angles.index(0).store(gl.load(cos_a + rows))
        angles.index(1).store(gl.load(sin_a + rows))
    else:
        angles = gl.allocate_shared_memory(gl.float32, [2, 1, HALF], a_layout)
    z_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    z_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(z_ready.index(s), count=1)
        mbarrier.init(z_free.index(s), count=1)
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(k_free.index(s), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_scores, (alen_ptr, acc_ptr, ml_ptr, qk_scale, a_sb, a_sh, a_sp, ml_sb, ml_sh, ml_sp,
                   z_bufs, k_bufs, q1, q2, p_buf, k_ready, k_free, z_free, KV_HEADS, GROUP,
                   WIDTH, SPLIT_LEN, BLOCK_M, BLOCK_W, DTYPE)),
        (_unpacker, (codes_ptr, alen_ptr, z_bufs, z_ready, z_free, KV_HEADS, SPLIT_LEN, c_sb,
                     c_sn, NBYTES, BITS, BLOCK_B, BYTES, DTYPE)),
        (_keys, (alen_ptr, slen_ptr, kb_ptr, kn_ptr, cos_a, sin_a, cos_b, sin_b, eps, kb_sh,
                 z_bufs, k_bufs, dec1, dec2, angles, z_ready, k_ready, k_free, KV_HEADS,
                 SPLIT_LEN, HALF, ROPE, HAS_BIAS, HAS_NORM, DTYPE)),
    ], [4, 4], [UNPACK_REGS, KEY_REGS])


def byte_vector(nbytes: int, row_stride: int) -> int:
    """Bytes one thread loads at once: the largest power of two up to 16 dividing both the
    row length and the row stride (so every vector load is aligned)."""
    vec = 16
    while vec > 1 and (nbytes % vec or row_stride % vec):
        vec //= 2
    return vec


def kernel_arguments(p: FsqProblem, codes: torch.Tensor, acc: torch.Tensor, ml: torch.Tensor,
                     split_len: int, regs: tuple[int, int, int] = (168, 104, 232)
                     ) -> tuple[list, dict, dict]:
    """``(arguments, constexprs, options)`` of one launch of ``_split_kernel_ws`` on a problem
    ``ws_limit`` accepts (``codes`` with at least one row). ``regs``: registers per thread of
    the scores, unpack and keys partitions (``setmaxnreg``; at most 512 in all, so the three
    warp groups fit one multiprocessor's register file)."""
    batch, q_heads, head_dim = p.query.shape
    kv_heads, width = p.kv_heads, p.width
    half = head_dim // 2
    kind, (cos_a, sin_a, cos_b, sin_b), kd, kb, kn = kernel_tensors(p, acc)
    bits = uniform_bits(p.levels)
    nbytes = codes.shape[2]
    block_b = ws_block_bytes(width, bits)
    args = [p.query, codes, p.archived_lengths, p.sink_lengths, kd, kb, kn,
            cos_a, sin_a, cos_b, sin_b, acc, ml, p.scale * LOG2E, p.eps,
            p.query.stride(0), p.query.stride(1), codes.stride(0), codes.stride(1),
            *kd.stride(), kb.stride(0), *acc.stride()[:3], *ml.stride()[:3],
            kv_heads, q_heads // kv_heads, width, split_len]
    consts = dict(HALF=half, NBYTES=nbytes, BITS=bits, ROPE=kind,
                  HAS_BIAS=p.key_bias is not None, HAS_NORM=p.k_norm is not None,
                  DTYPE=_GL[p.query.dtype], BLOCK_M=16, BLOCK_B=block_b,
                  BLOCK_W=block_b * (8 // bits),
                  BYTES=byte_layout(block_b, byte_vector(nbytes, codes.stride(1))),
                  UNPACK_REGS=regs[1], KEY_REGS=regs[2])
    return args, consts, {"num_warps": 4, "maxnreg": regs[0]}


def launch_split(p: FsqProblem, codes: torch.Tensor, acc: torch.Tensor, ml: torch.Tensor,
                 split_len: int, splits: int) -> None:
    """Run the warp-specialized split kernel on a problem ``ws_limit`` accepts, writing the
    same ``acc`` / ``ml`` scratch as ``_fsq._split_kernel``."""
    args, consts, options = kernel_arguments(p, codes, acc, ml, split_len)
    _split_kernel_ws[(splits, p.query.shape[0] * p.kv_heads)](*args, **consts, **options)
