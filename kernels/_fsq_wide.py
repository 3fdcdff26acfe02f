"""The FSQ split kernel for codes wider than one tile (``_fsq_plan.TILE_WIDTH`` coordinates,
e.g. Qwen3-8B at 12x: ``w = 682``), tiled over the code coordinates.

Same scratch, merge and per-block softmax as ``_fsq._split_kernel``; what differs is what a
program can hold. A block's codes, the decoder and the weighted code sums no longer fit its
registers whole, so per block of ``BLOCK_N`` positions:

1. for each tile of ``TILE_W`` coordinates (``TILE_B`` bytes of every packed row), the tile's
   bytes are loaded and unpacked and the key halves accumulate ``z_tile @ decoder_tile``
   (the decoder's tiles are read again every block, from L2: too large to stay resident);
2. the block's softmax weights from the finished keys (``_fsq_block._block_weights``);
3. for each tile again, its bytes are reloaded (from L1/L2: the block's rows were just
   read) and its weighted code sums ``acc_tile += p @ z_tile``; the ``TILES`` accumulators
   are a tuple carried across the block loop.

No key, value or code tile leaves the program; the scratch is the same ``(batch, q_heads,
splits, pow2(width))`` float32 as for narrow codes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels._common import NEG_BIG
from kernels._fsq_block import (
    _block_weights,
    _decoder_halves,
    _head_constants,
    _load_rows,
    _mm,
    _program_split,
    _row_bytes,
    _unpack,
)


@triton.jit
def _zero_tiles(TILES: tl.constexpr, BLOCK_M: tl.constexpr, TILE_W: tl.constexpr):
    tiles = ()
    for _ in tl.static_range(TILES):
        tiles = tiles + (tl.zeros([BLOCK_M, TILE_W], tl.float32),)
    return tiles


@triton.jit
def _split_kernel_wide(q_ptr, codes_ptr, pos_ptr, alen_ptr, slen_ptr, kd_ptr, kb_ptr, kn_ptr,
                       cos_a, sin_a, cos_b, sin_b, acc_ptr, ml_ptr, qk_scale, eps,
                       q_sb, q_sh, c_sb, c_sn, p_sb, p_sn, kd_sh, kd_sd, kd_sw, kb_sh,
                       a_sb, a_sh, a_sp, ml_sb, ml_sh, ml_sp,
                       KV_HEADS, GROUP, HALF: tl.constexpr, WIDTH, SPLIT_LEN,
                       NBYTES: tl.constexpr, BITS: tl.constexpr, SUBS: tl.constexpr,
                       ROPE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr,
                       HAS_POS: tl.constexpr, DEC_F32: tl.constexpr, NO_LICM: tl.constexpr,
                       CODE_T: tl.constexpr, Q_T: tl.constexpr, KEY_ROUND: tl.constexpr,
                       P_ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_H: tl.constexpr, TILES: tl.constexpr, TILE_B: tl.constexpr):
    TILE_W: tl.constexpr = TILE_B * SUBS
    split, b, kvh, start, end = _program_split(alen_ptr, KV_HEADS, SPLIT_LEN)
    if start < end:  # the merge reads only the splits that hold positions
        g_ok, heads, dd, dd_ok, q1, q2, b1, b2, w1, w2 = _head_constants(
            q_ptr, kb_ptr, kn_ptr, b, kvh, q_sb, q_sh, kb_sh, GROUP, HALF, HAS_BIAS, HAS_NORM,
            Q_T, BLOCK_M, BLOCK_H)
        sink = tl.load(slen_ptr + b)
        row_base = codes_ptr + b.to(tl.int64) * c_sb
        pos_base = pos_ptr + b.to(tl.int64) * p_sb
        m = tl.full([BLOCK_M], NEG_BIG, tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        accs = _zero_tiles(TILES, BLOCK_M, TILE_W)
        step = tl.arange(0, BLOCK_N)
        for n0 in tl.range(start, end, BLOCK_N, disable_licm=NO_LICM):
            n = n0 + step
            n_ok = n < end
            rows = row_base + n.to(tl.int64) * c_sn
            # the bias is the products' initial accumulator
            k1 = tl.broadcast_to(b1[None, :], (BLOCK_N, BLOCK_H))
            k2 = tl.broadcast_to(b2[None, :], (BLOCK_N, BLOCK_H))
            for t in tl.range(0, TILES, disable_licm=NO_LICM):
                z = _unpack(_row_bytes(rows, n_ok, t * TILE_B, NBYTES, TILE_B), BITS, SUBS,
                            BLOCK_N, TILE_B, CODE_T)
                c = t * TILE_W + tl.arange(0, TILE_W)
                dec1, dec2 = _decoder_halves(kd_ptr, kvh, kd_sh, kd_sd, kd_sw, c, c < WIDTH,
                                             dd, dd_ok, HALF, CODE_T)
                k1 = _mm(z, dec1, k1, DEC_F32)
                k2 = _mm(z, dec2, k2, DEC_F32)
            p, alpha, m, l = _block_weights(
                k1, k2, q1, q2, w1, w2, m, l, eps, qk_scale, n, n0, n_ok, sink, pos_base, p_sn,
                cos_a, sin_a, cos_b, sin_b, dd, dd_ok, HALF, BLOCK_H, ROPE, HAS_NORM, HAS_POS,
                Q_T, KEY_ROUND, P_ROUND, CODE_T)
            updated = ()
            for t in tl.static_range(TILES):
                z = _unpack(_load_rows(rows, n_ok, NBYTES, TILE_B, t * TILE_B), BITS, SUBS,
                            BLOCK_N, TILE_B, CODE_T)
                updated = updated + (_mm(p, z, accs[t] * alpha[:, None], DEC_F32),)
            accs = updated
        out = acc_ptr + b * a_sb + split * a_sp + heads[:, None] * a_sh
        for t in tl.static_range(TILES):
            c = t * TILE_W + tl.arange(0, TILE_W)
            tl.store(out + c[None, :], accs[t], mask=g_ok[:, None] & (c < WIDTH)[None, :])
        ml = ml_ptr + b * ml_sb + heads * ml_sh + split * ml_sp
        tl.store(ml, m, mask=g_ok)
        tl.store(ml + 1, l, mask=g_ok)


def tiles(width: int, bits: int, tile_width: int) -> tuple[int, int]:
    """``(tiles, bytes per tile)`` of ``width`` coordinates of ``bits``-bit codes in tiles of
    ``tile_width`` coordinates."""
    return -(-width // tile_width), tile_width * bits // 8

