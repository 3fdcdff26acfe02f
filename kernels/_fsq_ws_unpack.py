"""The unpack partition of the warp-specialized FSQ kernel (``_fsq_ws``): a block's packed
code rows -> ``(BLOCK_N, BLOCK_W)`` codes in the decoder's dtype, into a ring of shared
buffers the keys partition reads; and the program's split range, which all partitions share.
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from kernels._fsq_plan import WS_BLOCK_N

BLOCK_N = gl.constexpr(WS_BLOCK_N)

# The fast unpack: a register's four bytes b0..b3 -> the low nibbles (b0, b1), (b2, b3)
# and the high nibbles likewise as 16-bit floats, exactly: a nibble k becomes the float
# (magic + k) by bit operations, and `fma(x, 1, -magic)` takes the magic off.
_NIBBLE_ASM = """{
.reg .b32 t0, t1, one, off;
mov.b32 one, ONE;
mov.b32 off, OFF;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
lop3.b32 $0, t0, 0x000F000F, MAGIC, 0xEA;
lop3.b32 $1, t1, 0x000F000F, MAGIC, 0xEA;
shr.b32 t0, t0, 4;
shr.b32 t1, t1, 4;
lop3.b32 $2, t0, 0x000F000F, MAGIC, 0xEA;
lop3.b32 $3, t1, 0x000F000F, MAGIC, 0xEA;
fma.rn.TYPE $0, $0, one, off;
fma.rn.TYPE $1, $1, one, off;
fma.rn.TYPE $2, $2, one, off;
fma.rn.TYPE $3, $3, one, off;
}"""
# bf16: 128 + k is 0x4300 | k (k < 128); fp16: 1024 + k is 0x6400 | k (k < 1024)
NIBBLE_ASM_BF16 = gl.constexpr(_NIBBLE_ASM.replace("MAGIC", "0x43004300").replace(
    "ONE", "0x3F803F80").replace("OFF", "0xC300C300").replace("TYPE", "bf16x2"))
NIBBLE_ASM_FP16 = gl.constexpr(_NIBBLE_ASM.replace("MAGIC", "0x64006400").replace(
    "ONE", "0x3C003C00").replace("OFF", "0xE400E400").replace("TYPE", "f16x2"))


@functools.lru_cache(maxsize=64)
def byte_layout(block_b: int, vec: int) -> gl.BlockedLayout:
    """Rows of ``block_b`` bytes, ``vec`` contiguous bytes per thread, 4 warps. With ``vec``
    bytes holding 8 codes, the 8 lanes of a quarter warp store 8 consecutive 16-byte chunks
    of one row: distinct banks of the swizzled code buffer."""
    across = max(1, min(32, block_b // vec))
    return gl.BlockedLayout([1, vec], [32 // across, across], [4, 1], [1, 0])


@gluon.jit
def _nibbles(byte, DTYPE: gl.constexpr):
    """``(low, high)`` nibbles of ``byte`` as codes in ``DTYPE``, each of ``byte``'s shape."""
    if DTYPE == gl.bfloat16:
        return gl.inline_asm_elementwise(NIBBLE_ASM_BF16, "=r,=r,=r,=r,r", [byte],
                                         dtype=(gl.bfloat16, gl.bfloat16), is_pure=True,
                                         pack=4)
    else:
        return gl.inline_asm_elementwise(NIBBLE_ASM_FP16, "=r,=r,=r,=r,r", [byte],
                                         dtype=(gl.float16, gl.float16), is_pure=True,
                                         pack=4)


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
def code_of(c, BLOCK_B: gl.constexpr, FAST: gl.constexpr):
    """The code coordinate a column of the code tile holds: with ``FAST`` the tile holds
    the even coordinates (low nibbles) in its first ``BLOCK_B`` columns, then the odd ones."""
    if FAST:
        return 2 * (c % BLOCK_B) + c // BLOCK_B
    else:
        return c


@gluon.jit
def split_range(alen_ptr, KV_GROUPS, SPLIT_LEN, HEADS: gl.constexpr):
    """``(b, first kv head, split, start, end)`` of this program, which takes ``HEADS`` kv
    heads (``KV_GROUPS`` programs per sequence and split)."""
    split = gl.program_id(0)
    pid = gl.program_id(1)
    b = pid // KV_GROUPS
    start = split * SPLIT_LEN
    return (b, (pid % KV_GROUPS) * HEADS, split, start,
            gl.minimum(start + SPLIT_LEN, gl.load(alen_ptr + b)))


@gluon.jit
def unpacker(codes_ptr, alen_ptr, z_bufs, z_ready, z_free, KV_GROUPS, SPLIT_LEN, c_sb, c_sn,
              HEADS: gl.constexpr, NBYTES: gl.constexpr, BITS: gl.constexpr, BLOCK_B: gl.constexpr,
              LAYOUT: gl.constexpr, WORD_LAYOUT: gl.constexpr, DTYPE: gl.constexpr,
              FAST: gl.constexpr, WORDS: gl.constexpr, Z_STAGES: gl.constexpr,
              PREFETCH: gl.constexpr, PAD: gl.constexpr):
    """Partition 1: packed rows -> codes in shared memory, a block ahead of the keys. With
    ``WORDS`` (16-level rows that are not whole 4-byte words apart) a row's bytes are read
    as aligned 4-byte words and shifted into place. Once per block for all the program's kv
    heads. Bytes past a row (and rows past the split) read as ``PAD``."""
    b, kvh0, split, start, end = split_range(alen_ptr, KV_GROUPS, SPLIT_LEN, HEADS)
    if WORDS:
        layout: gl.constexpr = WORD_LAYOUT
        j = gl.arange(0, BLOCK_B // 4, gl.SliceLayout(0, layout))
        row_base = codes_ptr.to(gl.pointer_type(gl.int32))
        offs = b.to(gl.int64) * c_sb  # (the row bytes' offset from the words' start)
    else:
        layout: gl.constexpr = LAYOUT
        j = gl.arange(0, BLOCK_B, gl.SliceLayout(0, layout))
        row_base = codes_ptr + b.to(gl.int64) * c_sb
    rows0 = gl.arange(0, BLOCK_N, gl.SliceLayout(1, layout))
    if not WORDS:
        offs = rows0[:, None] * c_sn + j[None, :]  # (within a block: int32)
    # with PREFETCH, the next block's rows are in flight while a block is unpacked and stored
    if PREFETCH:
        after = _load_rows(row_base, offs, start, end, rows0, j, c_sn, NBYTES, WORDS, PAD)
    i = 0
    for n0 in range(start, end, BLOCK_N):
        if PREFETCH:
            byte = after
            after = _load_rows(row_base, offs, n0 + BLOCK_N, end, rows0, j, c_sn, NBYTES,
                               WORDS, PAD)
        else:
            byte = _load_rows(row_base, offs, n0, end, rows0, j, c_sn, NBYTES, WORDS, PAD)
        if WORDS:
            byte = gl.convert_layout(_word_bytes(byte, BLOCK_B), LAYOUT)
        slot = i % Z_STAGES
        free_phase = ((i // Z_STAGES) & 1) ^ 1
        if FAST:
            lo, hi = _nibbles(byte, DTYPE)
            mbarrier.wait(z_free.index(slot), free_phase)
            z_bufs.index(slot).slice(0, BLOCK_B, dim=1).store(lo)
            z_bufs.index(slot).slice(BLOCK_B, BLOCK_B, dim=1).store(hi)
        else:
            z = _unpack(byte, BITS, BLOCK_B, DTYPE)
            mbarrier.wait(z_free.index(slot), free_phase)
            z_bufs.index(slot).store(z)
        fence_async_shared()
        mbarrier.arrive(z_ready.index(slot), count=1)
        i += 1


@gluon.jit
def _load_rows(row_base, offs, n0, end, rows0, j, c_sn, NBYTES: gl.constexpr,
               WORDS: gl.constexpr, PAD: gl.constexpr):
    """The packed rows ``n0 + rows0`` (bytes ``PAD`` past ``end`` and past ``NBYTES``; with
    ``WORDS`` from the first whole word past ``NBYTES`` on, the bytes between are the next
    row's); with ``WORDS`` as ``(word, next word, shift)``: bytes ``4j .. 4j + 3`` of a row
    are ``(word, next word) >> shift``, ``row_base`` the 4-byte words, ``offs`` the rows'
    byte offset from them."""
    live = (n0 + rows0 < end)[:, None]
    if WORDS:
        o = offs + (n0 + rows0).to(gl.int64) * c_sn  # each row's first byte
        word = (o >> 2)[:, None] + j[None, :]
        stop = (o + NBYTES)[:, None]
        shift = ((o & 3) * 8).to(gl.int32)[:, None]
        lo = gl.load(row_base + word, mask=live & (word * 4 < stop), other=PAD * 0x01010101)
        hi = gl.load(row_base + word + 1, mask=live & (word * 4 + 4 < stop) & (shift != 0),
                     other=PAD * 0x01010101)
        return lo, hi, gl.broadcast(shift, lo)[0]
    else:
        ok = live & (j < NBYTES)[None, :]
        return gl.load(row_base + n0.to(gl.int64) * c_sn + offs, mask=ok, other=PAD)


@gluon.jit
def _word_bytes(words, BLOCK_B: gl.constexpr):
    """``(BLOCK_N, BLOCK_B)`` bytes of the ``(word, next word, shift)`` triples
    ``_load_rows`` gives (a funnel shift, then the word's bytes in order)."""
    lo, hi, shift = words
    w = gl.inline_asm_elementwise("shf.r.clamp.b32 $0, $1, $2, $3;", "=r,r,r,r",
                                  [lo, hi, shift], dtype=gl.int32, is_pure=True, pack=1)
    b0 = (w & 255).to(gl.uint8)
    b1 = ((w >> 8) & 255).to(gl.uint8)
    b2 = ((w >> 16) & 255).to(gl.uint8)
    b3 = ((w >> 24) & 255).to(gl.uint8)
    # (join makes a new last axis: this order gives b0 b1 b2 b3 once flattened)
    return gl.reshape(gl.join(gl.join(b0, b2), gl.join(b1, b3)), [BLOCK_N, BLOCK_B])


def byte_vector(nbytes: int, row_stride: int, most: int = 16) -> int:
    """Bytes one thread loads at once: the largest power of two up to ``most`` dividing both
    the row length and the row stride (so every vector load is aligned)."""
    vec = most
    while vec > 1 and (nbytes % vec or row_stride % vec):
        vec //= 2
    return vec
