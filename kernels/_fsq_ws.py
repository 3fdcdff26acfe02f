"""The FSQ split kernel, warp-specialized for Hopper (Gluon): three 4-warp partitions hand
blocks of ``BLOCK_N`` positions to each other through shared memory. A program takes
``HEADS`` kv heads (``_fsq_plan.ws_heads``): the codes are shared by all kv heads, so each
block is unpacked once for them and their query heads share one softmax.

Same scratch as ``_fsq._split_kernel`` (the merge kernel is shared), arranged so the unpack
of block ``i + 2``, the keys of block ``i + 1`` and the scores of block ``i`` run at the same
time on different warps:

- *unpack* (``_fsq_ws_unpack.unpacker``): a block's packed rows -> ``(BLOCK_N, BLOCK_W)``
  codes in the decoder's dtype (exact: levels <= 256) in a ring of ``Z_STAGES`` buffers;
  16-level codes by bit operations, even coordinates in the tile's first half, odd ones in
  the second (``code_of``); rows that are not whole 4-byte words (97.5x: 42 bytes) read as
  aligned words and funnel-shifted into place;
- *keys* (``_keys``): one warp-group MMA per block and kv head against its decoder (or two,
  one per column half: ``WS_TUNING["halves"]``; in shared memory for the whole program, head
  dims interleaved so RoPE's pairs sit in one thread), bias, the RMSNorm weight and RoPE
  by the angle of each position's offset in its block (one rotation with the weight folded
  in, held in registers), the keys
  rounded to the query's dtype into a ring of ``K_STAGES`` buffers and the rows' RMSNorm
  scales beside them;
- *scores* (``_scores``, the kernel's own warps): the query turned back by the block's base
  angle (``q . R(base + r) k = R(base)^T q . R(r) k``), ``keys @ queryᵀ`` per kv head with
  positions as the MMA rows (M = 64), times the norm scales, each kv head's query-head
  columns gathered into one score tile, the online softmax over positions,
  ``acc += codesᵀ @ weights``.

Every buffer has a ready and a free mbarrier. Hopper only (warp-group MMA, ``setmaxnreg``);
``_fsq_plan.ws_limit`` says which problems it runs. The Triton interpreter cannot run Gluon,
so this kernel is checked on the GPU only (and compiled for sm_90 in CI).
"""

from __future__ import annotations

import torch
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kernels import _fsq_plan
from kernels._common import LOG2E, NEG_BIG
from kernels._fsq_plan import (
    ROPE_RADIX_BITS,
    WS_TUNING,
    FsqProblem,
    kernel_tensors,
    uniform_bits,
    ws_block_bytes,
    ws_code_columns,
)
from kernels._fsq_ws_unpack import (
    BLOCK_N,
    byte_layout,
    byte_vector,
    code_of,
    split_range,
    unpacker,
)

_GL = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
RADIX_BITS = gl.constexpr(ROPE_RADIX_BITS)
RADIX_MASK = gl.constexpr((1 << ROPE_RADIX_BITS) - 1)

@gluon.jit
def _angle_sum(cos_a, sin_a, cos_b, sin_b):
    return cos_a * cos_b - sin_a * sin_b, sin_a * cos_b + cos_a * sin_b


@gluon.jit
def _halves(x, ROWS: gl.constexpr, HALF: gl.constexpr):
    """``(x[:, 0::2], x[:, 1::2])`` of a ``(ROWS, 2 * HALF)`` tile, in registers: with the
    head dims interleaved, dims ``d`` and ``d + HALF`` (RoPE's pairs)."""
    return gl.split(gl.reshape(x, [ROWS, HALF, 2]))


@gluon.jit
def _interleave(a, b, ROWS: gl.constexpr, HALF: gl.constexpr):
    return gl.reshape(gl.join(a, b), [ROWS, 2 * HALF])


@gluon.jit
def _column_halves(x, ROWS: gl.constexpr, HALF: gl.constexpr):
    """``(x[:, :HALF], x[:, HALF:])`` of a ``(ROWS, 2 * HALF)`` tile, in registers (column
    ``HALF`` is a register bit of a warp-group MMA's accumulator, so no data moves)."""
    return gl.split(gl.permute(gl.reshape(x, [ROWS, 2, HALF]), (0, 2, 1)))


@gluon.jit
def _key_constants(kn_ptr, cos_a, sin_a, part: gl.constexpr, layout: gl.constexpr,
                   HALF: gl.constexpr, Q: gl.constexpr, ROPE: gl.constexpr,
                   HAS_NORM: gl.constexpr, FOLD: gl.constexpr):
    """What the keys of every kv head need for the whole program, for one column part of the
    key product (``part``: the ``Q`` RoPE pairs ``(d, d + HALF)``, ``d`` in ``part * Q +
    [0, Q)``): ``(w_a, w_b, ca, sb, cb, sa)``, the RMSNorm weight of dims ``d`` and ``d +
    HALF`` (row vectors; registers are scarce) and the rotation by the angles of block
    offsets ``0 .. BLOCK_N - 1`` (``(BLOCK_N, Q)`` tiles: ``a' = a ca - b sb``, ``b' = b cb +
    a sa``), in ``layout``; with ``FOLD`` the weight is folded into the rotation (``ca = w_a
    cos``, ``sb = w_b sin``, ``cb = w_b cos``, ``sa = w_a sin``: two products an element
    fewer, two tiles of registers more); unused ones are placeholders."""
    dd = part * Q + gl.arange(0, Q, gl.SliceLayout(0, layout))
    zero = gl.zeros([Q], gl.float32, gl.SliceLayout(0, layout))[None, :]
    w_a = zero
    w_b = zero
    cos = zero
    sin = zero
    if HAS_NORM:
        w_a = gl.load(kn_ptr + dd).to(gl.float32)[None, :]
        w_b = gl.load(kn_ptr + HALF + dd).to(gl.float32)[None, :]
    if ROPE == 1:  # rows of the exact low table
        rows = gl.arange(0, BLOCK_N, gl.SliceLayout(1, layout))[:, None] * HALF + dd[None, :]
        cos = gl.load(cos_a + rows)
        sin = gl.load(sin_a + rows)
    if FOLD:
        return w_a, w_b, w_a * cos, w_b * sin, w_b * cos, w_a * sin
    return w_a, w_b, cos, sin, cos, sin


@gluon.jit
def _key_bias(kb_s, h, part: gl.constexpr, PARTS: gl.constexpr, layout: gl.constexpr):
    """Head ``h``'s key bias for dims ``d`` and ``d + HALF`` of column part ``part``, row
    vectors in ``layout`` (``kb_s`` holds a head's ``2 * PARTS`` rows: the parts' ``d``
    rows, then their ``d + HALF`` rows)."""
    row: gl.constexpr = gl.SliceLayout(0, layout)
    return (kb_s.index(2 * PARTS * h + part).load(row)[None, :],
            kb_s.index(2 * PARTS * h + PARTS + part).load(row)[None, :])


@gluon.jit
def _key_product(z, dec, zero, K_CHUNKS: gl.constexpr, ones, bias_dec,
                 BIAS_MMA: gl.constexpr):
    """Issue (not wait for) one column half of a block's raw keys, codes ``z`` ``(BLOCK_N,
    BLOCK_W)`` @ decoder part ``dec`` ``(BLOCK_W, HALF)``. With ``K_CHUNKS``, ``(column,
    count)`` pairs of powers of two, only those code columns take part (the others are
    padding: zero decoder rows); ``len(K_CHUNKS)`` MMA groups, else one over all columns.
    With ``BIAS_MMA`` one group more adds the bias: ``ones`` ``(BLOCK_N, 16)`` (registers)
    @ ``bias_dec`` ``(16, HALF)``, whose first two rows hold its two 16-bit parts."""
    if len(K_CHUNKS) == 0:
        k = warpgroup_mma(z, dec, zero, use_acc=False, is_async=True)
    else:
        k = warpgroup_mma(z.slice(K_CHUNKS[0][0], K_CHUNKS[0][1], dim=1),
                          dec.slice(K_CHUNKS[0][0], K_CHUNKS[0][1], dim=0), zero,
                          use_acc=False, is_async=True)
        for c in gl.static_range(1, len(K_CHUNKS)):
            k = warpgroup_mma(z.slice(K_CHUNKS[c][0], K_CHUNKS[c][1], dim=1),
                              dec.slice(K_CHUNKS[c][0], K_CHUNKS[c][1], dim=0), k,
                              is_async=True)
    if BIAS_MMA:
        k = warpgroup_mma(ones, bias_dec, k, is_async=True)
    return k


@gluon.jit
def _key_part(k, w_a, w_b, ca, sb, cb, sa, bias_a, bias_b, Q: gl.constexpr,
              ROPE: gl.constexpr, ADD_BIAS: gl.constexpr, HAS_NORM: gl.constexpr,
              FOLD: gl.constexpr, DTYPE: gl.constexpr):
    """One column half of a block's keys from its raw product ``k`` ``(BLOCK_N, 2 Q)`` (pairs
    interleaved): bias (unless it came with the product), the RMSNorm weight (``FOLD``: in
    the rotation), RoPE by the offsets' angles (``_key_constants``); ``(keys in DTYPE, the
    rows' partial sums of squares)``."""
    ka, kb = _halves(k, BLOCK_N, Q)
    if ADD_BIAS:
        ka = ka + bias_a
        kb = kb + bias_b
    if HAS_NORM:
        ss = gl.sum(ka * ka, axis=1) + gl.sum(kb * kb, axis=1)
        if not FOLD:
            ka = ka * w_a
            kb = kb * w_b
    else:
        ss = gl.zeros([BLOCK_N], gl.float32, gl.SliceLayout(1, ka.type.layout))
    if ROPE == 1:
        ka, kb = ka * ca - kb * sb, kb * cb + ka * sa
    return _interleave(ka, kb, BLOCK_N, Q).to(DTYPE), ss


@gluon.jit
def _keys(alen_ptr, kn_ptr, cos_a, sin_a, eps, z_bufs, k_bufs, r_bufs, dec, kb_s, kbd, z_ready,
          k_ready, k_free, KV_GROUPS, SPLIT_LEN, HEADS: gl.constexpr, HALF: gl.constexpr,
          ROPE: gl.constexpr, HAS_BIAS: gl.constexpr, BIAS_PAD: gl.constexpr,
          BIAS_MMA: gl.constexpr,
          HAS_NORM: gl.constexpr, DTYPE: gl.constexpr, K_CHUNKS: gl.constexpr,
          KEY_AHEAD: gl.constexpr, PARTS: gl.constexpr, FOLD: gl.constexpr,
          Z_STAGES: gl.constexpr, K_STAGES: gl.constexpr):
    """Partition 2: codes -> keys, a block's ``HEADS`` kv heads one after another, each by a
    key product in ``PARTS`` (1 or 2) column parts whose warp-group MMAs, with
    ``KEY_AHEAD``, are pipelined: the product of the next part (of this head, the next head
    or the next block's first) runs on the tensor cores while this part's elementwise work
    runs. A product gives a head's raw keys with the head dims interleaved (``d``, ``d +
    HALF`` side by side, so RoPE's pairs sit in one thread; each part holds ``HALF / PARTS``
    pairs), with ``BIAS_PAD`` the bias too (it rides in the decoder's rows of two padding
    code columns that hold ones); then the RMSNorm weight and RoPE by the block offset's
    angle, the weight folded into the rotation where there are both (the same for every
    block, so held in registers: the block's base angle turns the query instead). The
    RMSNorm scale, one per row, goes to the scores partition, which applies it to the
    scores. Keys rounded to the query's dtype into shared memory, two
    column halves per (block, head)."""
    Q: gl.constexpr = HALF // PARTS  # RoPE pairs per part
    # (MMA groups one _key_product issues)
    GROUPS: gl.constexpr = max(1, len(K_CHUNKS)) + (1 if BIAS_MMA else 0)
    ADD_BIAS: gl.constexpr = HAS_BIAS and not BIAS_PAD and not BIAS_MMA
    kl: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, 2 * Q, 16])
    b, kvh0, split, start, end = split_range(alen_ptr, KV_GROUPS, SPLIT_LEN, HEADS)
    zero_k = gl.zeros([BLOCK_N, 2 * Q], gl.float32, kl)
    ones = gl.full([BLOCK_N, 16], 1.0, DTYPE,
                   gl.DotOperandLayout(operand_index=0, parent=kl, k_width=2))
    proto, _ = _halves(zero_k, BLOCK_N, Q)
    hl: gl.constexpr = proto.type.layout
    w_a0, w_b0, ca0, sb0, cb0, sa0 = _key_constants(kn_ptr, cos_a, sin_a, 0, hl, HALF, Q,
                                                    ROPE, HAS_NORM, FOLD)
    if PARTS == 2:
        w_a1, w_b1, ca1, sb1, cb1, sa1 = _key_constants(kn_ptr, cos_a, sin_a, 1, hl, HALF, Q,
                                                        ROPE, HAS_NORM, FOLD)
    else:
        w_a1, w_b1, ca1, sb1, cb1, sa1 = w_a0, w_b0, ca0, sb0, cb0, sa0
    bias_a0 = w_a0
    bias_b0 = w_a0
    bias_a1 = w_a0
    bias_b1 = w_a0
    if ADD_BIAS and HEADS == 1:  # (more heads: each head's bias from shared memory)
        bias_a0, bias_b0 = _key_bias(kb_s, 0, 0, PARTS, hl)
        if PARTS == 2:
            bias_a1, bias_b1 = _key_bias(kb_s, 0, 1, PARTS, hl)
    i = 0  # (block, head) pairs done: the key buffers' ring counts those
    blk = 0
    # (not hoisted: the MMA descriptors of every decoder part and step would be held across
    # the loop, and spill)
    for _ in tl.range(start, end, BLOCK_N, disable_licm=True):
        zslot = blk % Z_STAGES
        mbarrier.wait(z_ready.index(zslot), (blk // Z_STAGES) & 1)
        z = z_bufs.index(zslot)
        # a block's PARTS * HEADS parts in turn (decoder part t), each part's product issued
        # before the part ahead of it is waited for (nothing is in flight across blocks:
        # ptxas serializes every MMA when an in-flight accumulator crosses the loop)
        running = _key_product(z, dec.index(0), zero_k, K_CHUNKS, ones, kbd.index(0),
                               BIAS_MMA)
        for t in gl.static_range(PARTS * HEADS):
            if KEY_AHEAD and t + 1 < PARTS * HEADS:
                ahead = _key_product(z, dec.index(t + 1), zero_k, K_CHUNKS, ones,
                                     kbd.index(t + 1), BIAS_MMA)
                k = warpgroup_mma_wait(num_outstanding=GROUPS, deps=(running,))
            else:
                k = warpgroup_mma_wait(num_outstanding=0, deps=(running,))
                ahead = k
            if t % PARTS == 0:
                if ADD_BIAS and HEADS > 1:
                    bias_a0, bias_b0 = _key_bias(kb_s, t // PARTS, 0, PARTS, hl)
                key, ss = _key_part(k, w_a0, w_b0, ca0, sb0, cb0, sa0, bias_a0, bias_b0, Q,
                                    ROPE, ADD_BIAS, HAS_NORM, FOLD, DTYPE)
                slot = i % K_STAGES
                mbarrier.wait(k_free.index(slot), ((i // K_STAGES) & 1) ^ 1)
                if PARTS == 1:  # (the scores partition reads the keys in column halves)
                    lo, hi = _column_halves(key, BLOCK_N, HALF)
                    k_bufs.index(2 * slot).store(lo)
                    k_bufs.index(2 * slot + 1).store(hi)
                else:
                    k_bufs.index(2 * slot).store(key)
            else:
                if ADD_BIAS and HEADS > 1:
                    bias_a1, bias_b1 = _key_bias(kb_s, t // PARTS, 1, PARTS, hl)
                key, ss1 = _key_part(k, w_a1, w_b1, ca1, sb1, cb1, sa1, bias_a1, bias_b1, Q,
                                     ROPE, ADD_BIAS, HAS_NORM, FOLD, DTYPE)
                k_bufs.index(2 * slot + 1).store(key)
                ss = ss + ss1
            if t % PARTS == PARTS - 1:
                if HAS_NORM:
                    r_bufs.index(slot).store(gl.rsqrt(ss / (2 * HALF) + eps))
                fence_async_shared()
                mbarrier.arrive(k_ready.index(slot), count=1)
                i += 1
            if not KEY_AHEAD and t + 1 < PARTS * HEADS:  # (serial: the next part after this)
                ahead = _key_product(z, dec.index(t + 1), zero_k, K_CHUNKS, ones,
                                     kbd.index(t + 1), BIAS_MMA)
            running = ahead
        blk += 1


@gluon.jit
def _query_halves(q_ptr, q_sb, q_sh, b, kvh0, GROUP, part: gl.constexpr, HEADS: gl.constexpr,
                  HALF: gl.constexpr, BLOCK_M: gl.constexpr):
    """The query heads of kv heads ``kvh0 .. kvh0 + HEADS - 1`` as float32 ``(dims d, dims
    d + HALF)`` for ``d`` in column half ``part`` of the keys (``part * HALF / 2 + [0, HALF /
    2)``), each ``(BLOCK_M, HALF / 2)`` (rows past them zero)."""
    Q: gl.constexpr = HALF // 2
    ql: gl.constexpr = gl.BlockedLayout([1, Q // 8], [4, 8], [4, 1], [1, 0])
    g = gl.arange(0, BLOCK_M, gl.SliceLayout(1, ql))
    d = part * Q + gl.arange(0, Q, gl.SliceLayout(0, ql))
    rows = q_ptr + b * q_sb + (kvh0 * GROUP + g)[:, None] * q_sh + d[None, :]
    ok = (g < HEADS * GROUP)[:, None] & (d < HALF)[None, :]
    return (gl.load(rows, mask=ok, other=0.0).to(gl.float32),
            gl.load(rows + HALF, mask=ok, other=0.0).to(gl.float32))


@gluon.jit
def _base_angle(base, cos_a, sin_a, cos_b, sin_b, part: gl.constexpr, HALF: gl.constexpr,
                layout: gl.constexpr):
    """``(cos, sin)`` of position ``base``'s angles for column half ``part``, ``(HALF / 2,)`` in
    ``SliceLayout(0, layout)``: the exact tables combined by the angle-sum formula."""
    d = part * (HALF // 2) + gl.arange(0, HALF // 2, gl.SliceLayout(0, layout))
    lo = (base & RADIX_MASK) * HALF + d
    hi = (base >> RADIX_BITS) * HALF + d
    return _angle_sum(gl.load(cos_a + lo), gl.load(sin_a + lo), gl.load(cos_b + hi),
                      gl.load(sin_b + hi))


@gluon.jit
def _turned_query(qa, qb, q_buf, c, s, HALF: gl.constexpr, BLOCK_M: gl.constexpr,
                  DTYPE: gl.constexpr, ROPE: gl.constexpr):
    """``q_buf`` = the query turned back by a block's base angle ``(c, s)`` (the transpose of
    RoPE's rotation: ``q . R(base + r) k = R(base)^T q . R(r) k``), head dims interleaved;
    as it is without RoPE. One column half of the keys (the caller fences)."""
    if ROPE == 1:
        c = c[None, :]
        s = s[None, :]
        qa, qb = qa * c + qb * s, qb * c - qa * s
    q_buf.store(_interleave(qa, qb, BLOCK_M, HALF // 2).to(DTYPE))


@gluon.jit
def _base_angles(base, cos_a, sin_a, cos_b, sin_b, HALF: gl.constexpr, layout: gl.constexpr):
    """Position ``base``'s ``(cos, sin)`` for both column halves (:func:`_base_angle`)."""
    c0, s0 = _base_angle(base, cos_a, sin_a, cos_b, sin_b, 0, HALF, layout)
    c1, s1 = _base_angle(base, cos_a, sin_a, cos_b, sin_b, 1, HALF, layout)
    return c0, s0, c1, s1


@gluon.jit
def _turn_query(qa0, qb0, qa1, qb1, q_buf, turn, cos_a, sin_a, cos_b, sin_b, sink, nxt, last,
                HALF: gl.constexpr, BLOCK_M: gl.constexpr, DTYPE: gl.constexpr,
                layout: gl.constexpr):
    """Both column halves of ``q_buf`` = the query turned by ``turn`` (a block's angles,
    :func:`_base_angles`), fenced for the score products; returns the angles of position
    ``sink + min(nxt, last)``, which load while this block is scored."""
    _turned_query(qa0, qb0, q_buf.index(0), turn[0], turn[1], HALF, BLOCK_M, DTYPE, 1)
    _turned_query(qa1, qb1, q_buf.index(1), turn[2], turn[3], HALF, BLOCK_M, DTYPE, 1)
    fence_async_shared()
    return _base_angles(sink + gl.minimum(nxt, last), cos_a, sin_a, cos_b, sin_b, HALF, layout)


@gluon.jit
def _head_scores(k_bufs, q_buf, k_ready, zero_s, t, K_STAGES: gl.constexpr, pred=True):
    """Issue the score product of (block, head) pair ``t`` once its keys are ready: the
    keys' two column halves, each against its half of the turned query; ``pred`` false
    skips the wait (then the product reads a stale key buffer, for a caller that drops it)."""
    slot = t % K_STAGES
    mbarrier.wait(k_ready.index(slot), (t // K_STAGES) & 1, pred=pred)
    sh = warpgroup_mma(k_bufs.index(2 * slot), q_buf.index(0).permute((1, 0)), zero_s,
                       use_acc=False, is_async=True)
    return warpgroup_mma(k_bufs.index(2 * slot + 1), q_buf.index(1).permute((1, 0)), sh,
                         is_async=True)


@gluon.jit
def _normed(sh, r_bufs, k_free, t, HAS_NORM: gl.constexpr, K_STAGES: gl.constexpr,
            layout: gl.constexpr, pred=True):
    """Pair ``t``'s finished scores times its keys' RMSNorm scales; its key buffer freed."""
    slot = t % K_STAGES
    if HAS_NORM:
        sh = sh * r_bufs.index(slot).load(gl.SliceLayout(1, layout))[:, None]
    mbarrier.arrive(k_free.index(slot), count=1, pred=pred)
    return sh


@gluon.jit
def _scores(q_ptr, alen_ptr, slen_ptr, cos_a, sin_a, cos_b, sin_b, acc_ptr, ml_ptr, qk_scale,
            q_sb, q_sh, a_sb, a_sh, a_sp, ml_sb, ml_sh, ml_sp, z_bufs, k_bufs, r_bufs, q_buf,
            p_buf, k_ready, k_free, z_free, KV_GROUPS, GROUP, WIDTH, SPLIT_LEN,
            HEADS: gl.constexpr, HALF: gl.constexpr, ROPE: gl.constexpr, HAS_NORM: gl.constexpr,
            BLOCK_M: gl.constexpr, BLOCK_B: gl.constexpr, BLOCK_W: gl.constexpr,
            DTYPE: gl.constexpr, FAST: gl.constexpr, Z_STAGES: gl.constexpr,
            K_STAGES: gl.constexpr, PV_AHEAD: gl.constexpr):
    """Partition 3 (the kernel's warps): keys -> scores of the query heads (positions as
    the MMA rows) against the query turned by the block's base angle, times the keys'
    RMSNorm scales, the online softmax over positions, ``acc += codesᵀ @ weights``. With
    ``HEADS`` kv heads a block's score columns are the query heads of all of them, each
    column from its own kv head's keys: one softmax and one weighted-code product per
    block for all of them. With ``PV_AHEAD`` the next block's query is turned and its first
    head scored while a block's weighted-code product runs (both waited for at once, so
    nothing is in flight across the loop: ptxas would serialize every MMA)."""
    sl: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, BLOCK_M, 16])
    b, kvh0, split, start, end = split_range(alen_ptr, KV_GROUPS, SPLIT_LEN, HEADS)
    sink = gl.load(slen_ptr + b)
    qa0, qb0 = _query_halves(q_ptr, q_sb, q_sh, b, kvh0, GROUP, 0, HEADS, HALF, BLOCK_M)
    qa1, qb1 = _query_halves(q_ptr, q_sb, q_sh, b, kvh0, GROUP, 1, HEADS, HALF, BLOCK_M)
    ql: gl.constexpr = qa0.type.layout
    if ROPE == 1:  # the first block's base angle (each block loads the next one's)
        # (clamped into the sequence: a split past its end has no angle in the tables)
        turn = _base_angles(sink + gl.minimum(start, gl.maximum(end - 1, 0)), cos_a, sin_a,
                            cos_b, sin_b, HALF, ql)
    else:
        zero = gl.zeros([HALF // 2], gl.float32, gl.SliceLayout(0, ql))
        turn = (zero, zero, zero, zero)
        _turned_query(qa0, qb0, q_buf.index(0), zero, zero, HALF, BLOCK_M, DTYPE, ROPE)
        _turned_query(qa1, qb1, q_buf.index(1), zero, zero, HALF, BLOCK_M, DTYPE, ROPE)
        fence_async_shared()
    sn = gl.arange(0, BLOCK_N, gl.SliceLayout(1, sl))
    m = gl.full([BLOCK_M], NEG_BIG, gl.float32, gl.SliceLayout(0, sl))
    # the weight sums per (row, head), summed over rows once at the end
    lt = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, sl)
    acc = gl.zeros([BLOCK_W, BLOCK_M], gl.float32, sl)
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, sl)
    g = gl.arange(0, BLOCK_M, gl.SliceLayout(0, sl))
    column_head = (g // GROUP)[None, :]  # the kv head of each score column
    ahead = zero_s  # (PV_AHEAD: the first head's scores of the block in hand)
    if PV_AHEAD:
        if ROPE == 1:
            turn = _turn_query(qa0, qb0, qa1, qb1, q_buf, turn, cos_a, sin_a, cos_b, sin_b,
                               sink, start + BLOCK_N, gl.maximum(end - 1, 0), HALF, BLOCK_M,
                               DTYPE, ql)
        ahead = _head_scores(k_bufs, q_buf, k_ready, zero_s, 0, K_STAGES, start < end)
        ahead = warpgroup_mma_wait(num_outstanding=0, deps=(ahead,))
        ahead = _normed(ahead, r_bufs, k_free, 0, HAS_NORM, K_STAGES, sl, start < end)
    i = 0
    for n0 in range(start, end, BLOCK_N):
        if ROPE == 1 and not PV_AHEAD:  # (the previous block's score product is done)
            turn = _turn_query(qa0, qb0, qa1, qb1, q_buf, turn, cos_a, sin_a, cos_b, sin_b,
                               sink, n0 + BLOCK_N, end - 1, HALF, BLOCK_M, DTYPE, ql)
        for h in gl.static_range(HEADS):
            t = i * HEADS + h  # (the key buffers' ring counts (block, head) pairs)
            if PV_AHEAD and h == 0:
                sh = ahead
            else:
                sh = _head_scores(k_bufs, q_buf, k_ready, zero_s, t, K_STAGES)
                sh = warpgroup_mma_wait(num_outstanding=0, deps=(sh,))
                sh = _normed(sh, r_bufs, k_free, t, HAS_NORM, K_STAGES, sl)
            if h == 0:
                s = sh
            else:
                s = gl.where(column_head == h, sh, s)
        s = gl.where((n0 + sn < end)[:, None], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, axis=0))
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s - m_new[None, :]).to(DTYPE)
        lt = lt * alpha[None, :] + p.to(gl.float32)
        m = m_new
        p_buf.store(p)
        fence_async_shared()
        zslot = i % Z_STAGES
        acc = warpgroup_mma(z_bufs.index(zslot).permute((1, 0)), p_buf, acc * alpha[None, :],
                            is_async=True)
        if PV_AHEAD:  # the next block's first head while the product runs
            more = n0 + BLOCK_N < end
            if ROPE == 1:
                turn = _turn_query(qa0, qb0, qa1, qb1, q_buf, turn, cos_a, sin_a, cos_b,
                                   sin_b, sink, n0 + 2 * BLOCK_N, end - 1, HALF, BLOCK_M,
                                   DTYPE, ql)
            t = (i + 1) * HEADS
            ahead = _head_scores(k_bufs, q_buf, k_ready, zero_s, t, K_STAGES, more)
            ahead, acc = warpgroup_mma_wait(num_outstanding=0, deps=(ahead, acc))
            mbarrier.arrive(z_free.index(zslot), count=1)
            ahead = _normed(ahead, r_bufs, k_free, t, HAS_NORM, K_STAGES, sl, more)
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(z_free.index(zslot), count=1)
        i += 1
    l = gl.sum(lt, axis=0)
    c = code_of(gl.arange(0, BLOCK_W, gl.SliceLayout(1, sl)), BLOCK_B, FAST)
    heads = kvh0 * GROUP + g
    live = g < HEADS * GROUP
    out = acc_ptr + b * a_sb + split * a_sp + heads[None, :] * a_sh + c[:, None]
    gl.store(out, acc, mask=live[None, :] & (c < WIDTH)[:, None])
    ml = ml_ptr + b * ml_sb + heads * ml_sh + split * ml_sp
    gl.store(ml, m, mask=live)
    gl.store(ml + 1, l, mask=live)


@gluon.jit
def _split_kernel_ws(q_ptr, codes_ptr, alen_ptr, slen_ptr, kd_ptr, kb_ptr, kn_ptr,
                     cos_a, sin_a, cos_b, sin_b, acc_ptr, ml_ptr, qk_scale, eps,
                     q_sb, q_sh, c_sb, c_sn, kd_sh, kd_sd, kd_sw, kb_sh,
                     a_sb, a_sh, a_sp, ml_sb, ml_sh, ml_sp,
                     KV_GROUPS, GROUP, WIDTH, SPLIT_LEN, HEADS: gl.constexpr,
                     HALF: gl.constexpr, NBYTES: gl.constexpr, BITS: gl.constexpr,
                     ROPE: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_NORM: gl.constexpr,
                     DTYPE: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_B: gl.constexpr, BLOCK_W: gl.constexpr,
                     BYTES: gl.constexpr, WORD_BYTES: gl.constexpr, FAST: gl.constexpr,
                     WORDS: gl.constexpr, Z_STAGES: gl.constexpr, K_STAGES: gl.constexpr,
                     PREFETCH: gl.constexpr, BIAS_CODE: gl.constexpr, K_CHUNKS: gl.constexpr,
                     KEY_AHEAD: gl.constexpr, BIAS_MMA: gl.constexpr, PARTS: gl.constexpr,
                     FOLD: gl.constexpr, PV_AHEAD: gl.constexpr,
                     UNPACK_REGS: gl.constexpr, KEY_REGS: gl.constexpr):
    kvh0 = (gl.program_id(1) % KV_GROUPS) * HEADS
    # the key decoders of the program's kv heads go to shared memory once (the key products'
    # B operands), each in PARTS column parts (BLOCK_W, 2 HALF / PARTS), head dims
    # interleaved and rows in the code tile's column order; with BIAS_CODE >= 0 the bias (as
    # two 16-bit parts, so it stays exact to ~2^-16) in the rows of code coordinates
    # BIAS_CODE and the next pad byte's, whose codes are ones; else the biases beside them
    Q: gl.constexpr = HALF // PARTS
    PW: gl.constexpr = 2 * Q  # (a part's columns)
    BIAS_PAD: gl.constexpr = BIAS_CODE >= 0
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (PW // 8), PW // 8], [4, 1], [1, 0])
    c = gl.arange(0, BLOCK_W, gl.SliceLayout(1, ld))
    code = code_of(c, BLOCK_B, FAST)
    dec_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_W, PW], DTYPE)
    dec = gl.allocate_shared_memory(DTYPE, [PARTS * HEADS, BLOCK_W, PW], dec_layout)
    bl: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    dd = gl.arange(0, Q, bl)
    # the biases' buffer only in the form the keys partition reads (the other name stands
    # for it unread, so no compiler's dead-allocation pass decides the kernel's footprint)
    if BIAS_MMA:
        kbd_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([16, PW], DTYPE)
        kbd = gl.allocate_shared_memory(DTYPE, [PARTS * HEADS, 16, PW], kbd_layout)
        kb_s = kbd
    elif HAS_BIAS and not BIAS_PAD:
        kb_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        kb_s = gl.allocate_shared_memory(gl.float32, [2 * PARTS * HEADS, Q], kb_layout)
        kbd = dec
    else:
        kb_s = dec
        kbd = dec
    r16 = gl.arange(0, 16, gl.SliceLayout(1, ld))
    # (a loop, neither unrolled nor hoisted: one head's decoder in registers at a time)
    for h in tl.range(0, HEADS, disable_licm=True):
        for part in gl.static_range(PARTS):
            j = part * PW + gl.arange(0, PW, gl.SliceLayout(0, ld))
            dim = (j >> 1) + (j & 1) * HALF
            rows = kd_ptr + (kvh0 + h) * kd_sh + dim[None, :] * kd_sd + code[:, None] * kd_sw
            tile = gl.load(rows, mask=(code < WIDTH)[:, None], other=0.0)
            if BIAS_PAD:
                bias = gl.load(kb_ptr + (kvh0 + h) * kb_sh + dim).to(gl.float32)
                high = bias.to(DTYPE)
                low = (bias - high.to(gl.float32)).to(DTYPE)
                tile = gl.where((code == BIAS_CODE)[:, None], high[None, :], tile)
                tile = gl.where((code == BIAS_CODE + 8 // BITS)[:, None], low[None, :], tile)
            dec.index(PARTS * h + part).store(tile)
            if BIAS_MMA:
                bias = gl.load(kb_ptr + (kvh0 + h) * kb_sh + dim).to(gl.float32)
                high = bias.to(DTYPE)
                low = (bias - high.to(gl.float32)).to(DTYPE)
                rows16 = gl.where((r16 == 0)[:, None], high[None, :],
                                  gl.where((r16 == 1)[:, None], low[None, :],
                                           gl.zeros([16, PW], DTYPE, ld)))
                kbd.index(PARTS * h + part).store(rows16)
            elif HAS_BIAS and not BIAS_PAD:
                kb_row = kb_ptr + (kvh0 + h) * kb_sh + part * Q + dd
                kb_s.index(2 * PARTS * h + part).store(gl.load(kb_row).to(gl.float32))
                kb_s.index(2 * PARTS * h + PARTS + part).store(
                    gl.load(kb_row + HALF).to(gl.float32))
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF], DTYPE)
    q_buf = gl.allocate_shared_memory(DTYPE, [2, BLOCK_M, HALF], q_layout)
    z_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_W], DTYPE)
    z_bufs = gl.allocate_shared_memory(DTYPE, [Z_STAGES, BLOCK_N, BLOCK_W], z_layout)
    k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], DTYPE)
    k_bufs = gl.allocate_shared_memory(DTYPE, [2 * K_STAGES, BLOCK_N, HALF], k_layout)
    r_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    r_bufs = gl.allocate_shared_memory(gl.float32, [K_STAGES, BLOCK_N], r_layout)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], DTYPE)
    p_buf = gl.allocate_shared_memory(DTYPE, [BLOCK_N, BLOCK_M], p_layout)
    z_ready = gl.allocate_shared_memory(gl.int64, [Z_STAGES, 1], mbarrier.MBarrierLayout())
    z_free = gl.allocate_shared_memory(gl.int64, [Z_STAGES, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(Z_STAGES):
        mbarrier.init(z_ready.index(s), count=1)
        mbarrier.init(z_free.index(s), count=1)
    for s in gl.static_range(K_STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(k_free.index(s), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_scores, (q_ptr, alen_ptr, slen_ptr, cos_a, sin_a, cos_b, sin_b, acc_ptr, ml_ptr,
                   qk_scale, q_sb, q_sh, a_sb, a_sh, a_sp, ml_sb, ml_sh, ml_sp, z_bufs,
                   k_bufs, r_bufs, q_buf, p_buf, k_ready, k_free, z_free, KV_GROUPS, GROUP,
                   WIDTH, SPLIT_LEN, HEADS, HALF, ROPE, HAS_NORM, BLOCK_M, BLOCK_B, BLOCK_W,
                   DTYPE, FAST, Z_STAGES, K_STAGES, PV_AHEAD)),
        (unpacker, (codes_ptr, alen_ptr, z_bufs, z_ready, z_free, KV_GROUPS, SPLIT_LEN, c_sb,
                     c_sn, HEADS, NBYTES, BITS, BLOCK_B, BYTES, WORD_BYTES, DTYPE, FAST, WORDS,
                     Z_STAGES, PREFETCH, 1 if BIAS_PAD else 0)),
        (_keys, (alen_ptr, kn_ptr, cos_a, sin_a, eps, z_bufs, k_bufs, r_bufs, dec, kb_s, kbd,
                 z_ready, k_ready, k_free, KV_GROUPS, SPLIT_LEN, HEADS, HALF, ROPE, HAS_BIAS,
                 BIAS_PAD, BIAS_MMA, HAS_NORM, DTYPE, K_CHUNKS, KEY_AHEAD, PARTS, FOLD, Z_STAGES,
                 K_STAGES)),
    ], [4, 4], [UNPACK_REGS, KEY_REGS])


def kernel_arguments(p: FsqProblem, codes: torch.Tensor, acc: torch.Tensor, ml: torch.Tensor,
                     split_len: int, regs: tuple[int, int, int] | None = None,
                     heads: tuple[int, int, int] | None = None) -> tuple[list, dict, dict]:
    """``(arguments, constexprs, options)`` of one launch of ``_split_kernel_ws`` on a problem
    ``ws_limit`` accepts (``codes`` with at least one row). ``regs``: registers per thread of
    the scores, unpack and keys partitions (``setmaxnreg``; ``_fsq_plan.check_ws_regs``), by
    default ``WS_TUNING["regs"]`` or else ``_fsq_plan.WS_REGS``. ``heads``: ``(kv heads per program,
    code buffers, key buffers)``, by default ``_fsq_plan.ws_program_heads``; the grid's second
    axis is ``batch x kv_heads / heads``."""
    batch, q_heads, head_dim = p.query.shape
    kv_heads, width = p.kv_heads, p.width
    half = head_dim // 2
    if regs is None:
        regs = WS_TUNING["regs"] or _fsq_plan.WS_REGS
    regs = _fsq_plan.check_ws_regs(regs)
    kind, (cos_a, sin_a, cos_b, sin_b), kd, kb, kn = kernel_tensors(p, acc)
    per_program, code_stages, key_stages = _fsq_plan.ws_program_heads(p) if heads is None else heads
    bits = uniform_bits(p.levels)
    nbytes = codes.shape[2]
    block_b = ws_block_bytes(width, bits)
    vec = byte_vector(nbytes, codes.stride(1), 8)  # 8 codes per tile part: 16 bytes
    # 16-level codes go through the bit-operation unpack: rows of whole 4-byte words loaded
    # as they are, other rows as aligned words shifted into place (codes starting at a word)
    fast = bits == 4 and block_b >= 64 and (vec >= 4 or codes.data_ptr() % 4 == 0)
    words = fast and vec < 4
    bias_code, k_chunks = ws_code_columns(width, bits, nbytes, fast, words,
                                          p.key_bias is not None, WS_TUNING["bias_pad"],
                                          WS_TUNING["trim"])
    args = [p.query, codes, p.archived_lengths, p.sink_lengths, kd, kb, kn,
            cos_a, sin_a, cos_b, sin_b, acc, ml, p.scale * LOG2E, p.eps,
            p.query.stride(0), p.query.stride(1), codes.stride(0), codes.stride(1),
            *kd.stride(), kb.stride(0), *acc.stride()[:3], *ml.stride()[:3],
            kv_heads // per_program, q_heads // kv_heads, width, split_len]
    consts = dict(HEADS=per_program, HALF=half, NBYTES=nbytes, BITS=bits, ROPE=kind,
                  HAS_BIAS=p.key_bias is not None, HAS_NORM=p.k_norm is not None,
                  DTYPE=_GL[p.query.dtype], BLOCK_M=16, BLOCK_B=block_b,
                  BLOCK_W=block_b * (8 // bits),
                  BYTES=byte_layout(block_b, 8 if words else vec),
                  WORD_BYTES=byte_layout(block_b // 4, 2), FAST=fast, WORDS=words,
                  Z_STAGES=code_stages, K_STAGES=key_stages,
                  # (H200, b8 128K: prefetching 8% faster for GPT-2, 6% slower at Qwen3 32x)
                  PREFETCH=fast and kind == 0,
                  BIAS_CODE=bias_code, K_CHUNKS=k_chunks,
                  KEY_AHEAD=WS_TUNING["key_ahead"],
                  BIAS_MMA=p.key_bias is not None and bias_code < 0 and WS_TUNING["bias_mma"],
                  PARTS=2 if WS_TUNING["halves"] else 1,
                  FOLD=WS_TUNING["fold_norm"] and kind == 1 and p.k_norm is not None,
                  PV_AHEAD=WS_TUNING["pv_ahead"],
                  UNPACK_REGS=regs[1], KEY_REGS=regs[2])
    return args, consts, {"num_warps": 4, "maxnreg": regs[0]}


def launch_split(p: FsqProblem, codes: torch.Tensor, acc: torch.Tensor, ml: torch.Tensor,
                 split_len: int, splits: int, heads: tuple[int, int, int] | None = None) -> None:
    """Run the warp-specialized split kernel on a problem ``ws_limit`` accepts, writing the
    same ``acc`` / ``ml`` scratch as ``_fsq._split_kernel`` (``heads`` as
    :func:`kernel_arguments`)."""
    args, consts, options = kernel_arguments(p, codes, acc, ml, split_len, heads=heads)
    programs = p.query.shape[0] * p.kv_heads // consts["HEADS"]
    _split_kernel_ws[(splits, programs)](*args, **consts, **options)
