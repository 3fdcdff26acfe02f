"""What the FSQ decode kernel takes, one decode call over packed FSQ codes, the level-to-bit
layout, the split count and the RoPE angle tables (pure Python and torch: no triton import).

Packing contract (shared with the model side): coordinate ``i`` of a code row with levels
``L_i`` takes ``b_i = ceil(log2 L_i)`` bits, at bits ``[o_i, o_i + b_i)`` of the row's bit
stream, ``o_i = b_0 + ... + b_{i-1}``, least significant bit first; byte ``j`` of the packed
row holds stream bits ``8j .. 8j + 7``, bit ``8j`` in its least significant bit. So with a
uniform ``L = 16`` coordinate ``2k`` is the low nibble of byte ``k``. Bits past the last
coordinate are zero when packed and ignored when read.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
import os
import warnings
from dataclasses import dataclass

import torch

from kernels._plan import MAX_SPLITS, multiprocessors, pow2, split_layout

# torch.compile traces the body of an lru_cache'd function and warns that the cache is
# skipped; the cached helpers a compiled FSQ step calls (the packing contract's, the triton
# probe) are pure, so tracing them is exact
warnings.filterwarnings("ignore", message=r"Dynamo detected a call to a `functools\.lru_cache`"
                        r"-wrapped function at '(_fsq_plan|fsq_codes|rvq_decode)\.py")

KERNEL_BITS = (1, 2, 4, 8)  # uniform power-of-two levels 2, 4, 16, 256
TILE_WIDTH = 256  # code coordinates a split program holds whole (registers)
# code coordinates the Triton kernel takes: wider codes run in tiles of TILE_WIDTH
# (kernels._fsq_wide), whose weighted sums a program holds all at once
MAX_KERNEL_WIDTH = 4 * TILE_WIDTH
MAX_KERNEL_GROUP = 64  # query heads per kv head one kernel program serves
MAX_KERNEL_HEAD_DIM = 256
ROPE_RADIX_BITS = 11  # theta mode: position = hi * 2^11 + lo, one angle table per part
MAX_THETA_POSITION = 1 << (2 * ROPE_RADIX_BITS)  # 4,194,304: positions the theta tables cover
MIN_SPLIT_LEN = 256  # archived positions per split program, at least
# the split kernel's defaults: positions per step, warps, software-pipeline stages, whether the
# next block's codes are loaded during this block's work, and whether the block loop keeps
# loop-invariant work inside it (Triton's `disable_licm`: shorter live ranges, fewer spills)
# (the fastest correct setting of `python bench/fsq_kernels.py --sweep` on an H200 at both
# Qwen3-8B widths, 256 and 84; bench/results/fsq_kernels.json)
SPLIT_TUNING = {"block_n": 128, "num_warps": 8, "num_stages": 1, "prefetch": True,
                "no_licm": True, "ws": True}
# the split kernel for codes wider than TILE_WIDTH (kernels._fsq_wide): positions per step
# and code coordinates per tile (H100, one process, 12x, CUDA graph, every setting checked
# first, bench/results/fsq_kernels_wide.json: 128 positions by 64 coordinates at 8 warps 21%
# faster than 64 x 64 at batch 8, 32K and 7% at batch 1, though it spills 400 bytes per
# thread; 128-coordinate tiles and 4 warps slower)
WIDE_TUNING = {"block_n": 128, "tile": 64}
WS_BLOCK_N = 64  # positions per step of the warp-specialized kernel: one warp group's rows
WS_CODE_STAGES = 3  # its code buffers: one being unpacked, one for the keys, one weighted
# positions a split program's fixed work stands for (decoder load, its share of the merge),
# fitted to the H200 at batch 1, 32K (one wave of 16 splits 4% faster than two of 33)
PROGRAM_COST = 128
SPLIT_MARGIN = 0.03  # modelled gain more splits must bring (see best_split_len)


def level_list(levels, width: int) -> tuple[int, ...]:
    """Per-coordinate levels of a ``width``-coordinate code from an int (uniform) or a
    sequence of ``width`` ints; each level >= 2. ValueError otherwise."""
    # every decode call passes the same levels: plain ints are checked once (a cache key
    # would not tell 2.0 or True from 2)
    if type(levels) is int or (type(levels) is tuple and all(type(v) is int for v in levels)):
        return _cached_levels(levels, width)
    return _level_list(levels, width)


@functools.lru_cache(maxsize=64)
def _cached_levels(levels: int | tuple, width: int) -> tuple[int, ...]:
    return _level_list(levels, width)


def _level_list(levels, width: int) -> tuple[int, ...]:
    if isinstance(levels, bool):
        raise ValueError(f"levels must be an int >= 2 or a sequence of them, got {levels!r}")
    if isinstance(levels, numbers.Integral):
        values = (int(levels),) * width
    else:
        try:
            values = tuple(int(v) for v in levels)
            bad = [v for v in levels if isinstance(v, bool) or not isinstance(v, numbers.Integral)]
        except TypeError:
            raise ValueError(f"levels must be an int >= 2 or a sequence of them, got "
                             f"{levels!r}") from None
        if bad:
            raise ValueError(f"levels must hold ints, got {bad[:4]!r}")
        if len(values) != width:
            raise ValueError(f"levels has {len(values)} entries; the code width is {width}")
    low = [v for v in values if v < 2]
    if low:
        raise ValueError(f"every level must be >= 2, got {low[:4]!r}")
    return values


@functools.lru_cache(maxsize=64)
def level_bits(levels: tuple[int, ...]) -> tuple[int, ...]:
    """Bits of each coordinate: ``ceil(log2 L)``. Cached: every decode call asks."""
    return tuple((v - 1).bit_length() for v in levels)


@functools.lru_cache(maxsize=64)
def packed_bytes(levels: tuple[int, ...]) -> int:
    """Bytes of one packed code row."""
    return math.ceil(sum(level_bits(levels)) / 8)


@functools.lru_cache(maxsize=64)
def uniform_bits(levels: tuple[int, ...]) -> int | None:
    """The bits per coordinate when the kernel reads these levels (one uniform level among
    2, 4, 16, 256), else ``None``. Cached: every decode call asks (a model has one or two
    level lists)."""
    if levels and len(set(levels)) == 1:
        bits = (levels[0] - 1).bit_length()
        if bits in KERNEL_BITS and levels[0] == 1 << bits:
            return bits
    return None


@dataclass(frozen=True)
class RopeFrequencies:
    """RoPE at given inverse frequencies, ``head_dim / 2`` positive floats (a model's own
    ``inv_freq``, e.g. rounded to bfloat16 by ``model.to(torch.bfloat16)``, read back once).
    The kernel treats them as it treats a theta's: angles ``pos * inv_freq`` reduced exactly
    in float64 tables (``theta_tables``), exact to float32 below position 2^22, no table of
    positions to grow, and the warp-specialized kernel takes them. Hashable: the tables are
    cached per value."""

    inv_freq: tuple[float, ...]


@dataclass(frozen=True)
class FsqProblem:
    """One validated decode call over packed FSQ codes (every length filled in).

    Attributes:
        query: ``(batch, q_heads, head_dim)`` float16 / bfloat16, contiguous.
        codes: ``(batch, seq, packed_bytes)`` uint8, one packed row per archived token,
            shared by every kv head.
        levels: per-coordinate levels, ``width`` ints.
        key_decoder, value_decoder: ``(kv_heads, head_dim, width)`` float16 / bfloat16 /
            float32: ``key_raw[h] = key_decoder[h] @ code + key_bias[h]`` on integer codes.
        key_bias, value_bias: ``(kv_heads, head_dim)`` or ``None``.
        k_norm: ``(head_dim,)`` RMSNorm weight applied to the raw key, or ``None``.
        eps: the RMSNorm epsilon.
        rope: ``None``, a float theta, or ``(cos, sin)`` float32 ``(max_position, head_dim)``.
        positions: ``(batch, seq)`` integer absolute positions, or ``None`` (``sink_lengths[b]
            + index``).
        sink_keys, sink_values, recent_keys, recent_values: ``(batch, kv_heads, n, head_dim)``
            exact tokens in the query's dtype (keys as the model caches them: normed, rotated).
        sink_lengths, archived_lengths, recent_lengths: ``(batch,)`` int32 on the device.
        scale: the softmax scale.
    """

    query: torch.Tensor
    codes: torch.Tensor
    levels: tuple[int, ...]
    key_decoder: torch.Tensor
    value_decoder: torch.Tensor
    key_bias: torch.Tensor | None
    value_bias: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float
    rope: object
    positions: torch.Tensor | None
    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    recent_keys: torch.Tensor
    recent_values: torch.Tensor
    sink_lengths: torch.Tensor
    archived_lengths: torch.Tensor
    recent_lengths: torch.Tensor
    scale: float

    @property
    def width(self) -> int:
        return self.key_decoder.shape[2]

    @property
    def kv_heads(self) -> int:
        return self.key_decoder.shape[0]


def kernel_limit(problem: FsqProblem) -> str | None:
    """Why the Triton kernel cannot run this problem (a sentence naming the limit), or
    ``None`` when it can. Reads no tensor contents."""
    batch, q_heads, head_dim = problem.query.shape
    if uniform_bits(problem.levels) is None:
        return (f"levels {sorted(set(problem.levels))[:4]} are not one uniform level among "
                "2, 4, 16, 256 (the kernel's packed layouts); use backend='torch'")
    if problem.width > MAX_KERNEL_WIDTH:
        return (f"code width {problem.width} exceeds the kernel's limit of {MAX_KERNEL_WIDTH} "
                "coordinates; use backend='torch'")
    group = q_heads // problem.kv_heads
    if group > MAX_KERNEL_GROUP:
        return f"{group} query heads per kv head exceed the kernel's {MAX_KERNEL_GROUP}"
    if head_dim % 2 or head_dim > MAX_KERNEL_HEAD_DIM:
        return (f"head_dim {head_dim}: the kernel takes even head_dims up to "
                f"{MAX_KERNEL_HEAD_DIM}")
    if batch * problem.kv_heads > 65535:
        return f"batch x kv_heads = {batch * problem.kv_heads} exceeds a grid axis (65,535)"
    return None


WS_MIN_TRITON = (3, 6)  # Gluon's warp_specialize takes (function, args) pairs from 3.6 on


@functools.lru_cache(maxsize=1)
def _triton_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed Triton, ``(0, 0)`` without one (not imported)."""
    from importlib import metadata

    try:
        parts = metadata.version("triton").split(".")[:2]
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (metadata.PackageNotFoundError, ValueError, IndexError):
        return (0, 0)


@functools.lru_cache(maxsize=16)
def _is_hopper(device: torch.device) -> bool:
    """An NVIDIA GPU of compute capability 9.x (ROCm reports 9.x for MI200-MI350 too)."""
    return (device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] == 9)


def _interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's CPU interpreter (which has no Gluon)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


WS_SHARED_LIMIT = 227 * 1024  # shared memory one block may use on sm_90
WS_SHARED_SLACK = 4096  # the compiler's own shared memory beside the buffers (barriers)


# bytes per kv head and head dim of the key bias in shared memory, by how the kernel adds it:
# as one more MMA step's (16, head_dim) 16-bit tile, or in float as head_dim fp32s; none where
# it rides in padding codes (ws_code_columns) or there is no bias
WS_BIAS_BYTES = {"mma": 32, "float": 4, None: 0}


def ws_shared_bytes(width: int, head_dim: int, bits: int, norm: bool = True, heads: int = 1,
                    code_stages: int = WS_CODE_STAGES, bias: str | None = "mma",
                    key_stages: int = 2) -> int:
    """Shared memory of the warp-specialized kernel's buffers, bytes: the key decoders (and
    their biases held as ``bias``, a key of :data:`WS_BIAS_BYTES`; the plan counts the
    largest, ``"mma"``, since which form a launch takes depends on the codes' padding) of
    ``heads`` kv heads, ``code_stages`` code buffers, ``key_stages`` key buffers (and with
    ``norm`` their RMSNorm scales), the query and the weights. ``block_w`` as the launcher
    pads it."""
    if bias not in WS_BIAS_BYTES:
        raise ValueError(f"bias must be 'mma', 'float' or None, got {bias!r}")
    block_w = ws_block_bytes(width, bits) * (8 // bits)
    return (heads * 2 * block_w * head_dim + code_stages * 2 * WS_BLOCK_N * block_w
            + key_stages * (2 * WS_BLOCK_N * head_dim + (4 * WS_BLOCK_N if norm else 0))
            + 2 * 16 * head_dim + 2 * WS_BLOCK_N * 16 + heads * WS_BIAS_BYTES[bias] * head_dim)


WS_MAX_HEADS = 4  # kv heads one program of the warp-specialized kernel takes at most
# query heads one program scores at most (H200, CUDA graph, batch 1 to 32: Qwen3-8B at
# 97.5x runs fastest with 2 kv heads = 8 query heads per program, 4 were 11% to 24% slower;
# GPT-2 with 4 kv heads = 4 query heads)
WS_MAX_COLUMNS = 8
# (code buffers, key buffers) a program of several kv heads may take, the first that fits.
# Four key buffers first (H100, same process, `--heads --choices h2z3k2 h2z3k4 h2z3k6`,
# fsq_kernels_heads_key_buffers.json: at 97.5x, the only Qwen3-8B width they fit, 0.5% to
# 1.4% faster than two at all four points; six fit only GPT-2, whose plan takes 4 kv heads
# with two)
WS_BUFFER_CHOICES = ((WS_CODE_STAGES, 4), (WS_CODE_STAGES, 2), (2, 2), (2, 1))


@functools.lru_cache(maxsize=256)
def ws_heads(kv_heads: int, group: int, width: int, head_dim: int, bits: int,
             norm: bool = True, bias: bool = True) -> tuple[int, int, int]:
    """``(heads, code_stages, key_stages)``: kv heads per program of the warp-specialized
    kernel and its code and key buffers. The codes are shared by all kv heads, so a program
    that takes several unpacks each block once for all of them and scores their query heads
    with one softmax; the most heads, a power of two up to ``WS_MAX_HEADS`` dividing
    ``kv_heads`` with at most ``WS_MAX_COLUMNS`` query heads in all, whose decoders fit in
    shared memory with the first of ``WS_BUFFER_CHOICES`` that fits (one head: three code
    and two key buffers)."""
    heads = WS_MAX_HEADS
    while heads > 1:
        if kv_heads % heads == 0 and heads * group <= WS_MAX_COLUMNS:
            for code_stages, key_stages in WS_BUFFER_CHOICES:
                need = ws_shared_bytes(width, head_dim, bits, norm, heads, code_stages,
                                       "mma" if bias else None, key_stages)
                if need + WS_SHARED_SLACK <= WS_SHARED_LIMIT:
                    return heads, code_stages, key_stages
        heads //= 2
    return 1, WS_CODE_STAGES, 2


def ws_block_bytes(width: int, bits: int) -> int:
    """Bytes of a packed row the warp-specialized kernel loads per position: a power of two
    >= 16, and at least 64 codes (the codes are the rows of a warp-group MMA, 64 a step)."""
    return max(pow2(math.ceil(width * bits / 8), 16), 64 * bits // 8)


# the warp-specialized kernel's knobs (bench/fsq_kernels.py --variants turns them on and off
# to time the difference in one process): the key bias carried in the padding codes and the
# key product trimmed to the code columns (ws_code_columns); elsewhere the bias added by one
# more MMA step (ones times a tile of its two parts) rather than by the keys' float work
# (with the halves 8% faster at 32x, with the whole product 1-2% slower); the key product in
# two column halves rather than one over all head_dim columns (H100, same process: the whole
# product 2-3% faster at Qwen3 shapes from batch 8, 13-16% for GPT-2); and the keys
# partition's next key product issued before the one in hand is waited for (with the halves
# 3-5% faster; with the whole product two accumulators spill; on top of the fold below, 1-2%
# faster at 97.5x, 3-18% slower at 32x and GPT-2); and the RMSNorm weight folded into RoPE's
# rotation tables (two products an element fewer, two register tiles more; H100, same
# process: 5-6% faster at 97.5x from batch 8, 2-4% at 32x); and the scores partition's
# weighted-code product run beside the next block's turned query and first head's scores
# (pv_ahead; passes its GPU cases; H100, same process: 3-7% slower at 97.5x, within 2%
# elsewhere); and
# "regs", the three partitions' registers per thread (None: WS_REGS)
WS_TUNING = {"bias_pad": True, "trim": True, "key_ahead": False, "bias_mma": False,
             "halves": False, "fold_norm": True, "pv_ahead": False, "regs": None}

# registers per thread of the scores, unpack and keys partitions (setmaxnreg). The keys
# partition's RoPE and RMSNorm tables take the most; ptxas (CPU compile, Triton 3.9) spills
# none at 97.5x, 136 bytes at 32x and 224 for GPT-2 with this split, none for GPT-2 with
# (168, 152, 192), which is no faster (H100, same process: within 0.6%)
WS_REGS = (168, 104, 232)


# the launch's registers per thread (the scores partition's maxnreg) times its 384 threads
# must fit the 64K-register file, or the driver refuses the launch ("out of resource:
# threads": 176 allows only 256 threads)
WS_MAX_LAUNCH_REGS = 65536 // 384 // 8 * 8


def check_ws_regs(regs) -> tuple[int, int, int]:
    """``regs`` as three register counts (scores, unpack, keys partitions), or ValueError
    naming it: each a multiple of 8 in [24, 256] (``setmaxnreg``'s range), at most 512 in
    all, so the three warp groups fit one multiprocessor's register file."""
    try:
        counts = tuple(operator.index(r) for r in regs)
    except TypeError:
        counts = ()
    if (len(counts) != 3 or any(r % 8 or not 24 <= r <= 256 for r in counts)
            or sum(counts) > 512 or counts[0] > WS_MAX_LAUNCH_REGS):
        raise ValueError("regs must be three multiples of 8 in [24, 256] (scores, unpack, "
                         f"keys partitions) summing to at most 512, the scores' at most "
                         f"{WS_MAX_LAUNCH_REGS}, got {regs!r}")
    return counts


@functools.lru_cache(maxsize=256)
def ws_code_columns(width: int, bits: int, nbytes: int, fast: bool, words: bool, bias: bool,
                    bias_pad: bool = True, trim: bool = True
                    ) -> tuple[int, tuple[tuple[int, int], ...]]:
    """``(bias code, chunks)``: where the warp-specialized kernel's key product finds the
    bias, and which columns of a block's code tile it multiplies.

    The unpack reads every byte past a packed row as 1, from the first byte it reads
    reliably there on (``nbytes``, or the next 4-byte word's first byte for rows read as
    shifted words, whose last word's tail is the next row's): so the low nibble (or the byte,
    for 8-bit codes) of each such padding byte is a code 1. With ``bias`` and two such bytes
    inside the tile, the decoder's rows of their two code coordinates hold the key bias (in
    two 16-bit parts) and the product adds it: ``bias code`` is the first coordinate, else
    -1. With ``trim`` the product covers only the tile's columns that can hold a code or
    those ones, as ``(first column, count)`` chunks whose counts are powers of two >= 16 (a
    shared-memory slice's shape must be a power of two): the bit-operation unpack's tile
    holds the even coordinates in columns ``[0, block_b)``, the odd ones from ``block_b``
    on; ``()``: all columns, one MMA."""
    block_b = ws_block_bytes(width, bits)
    step = 8 // bits
    first_pad = -(-nbytes // 4) * 4 if words else nbytes
    bias_code = first_pad * step if bias and bias_pad and first_pad + 1 < block_b else -1
    if not trim:
        return bias_code, ()
    used = first_pad + 2 if bias_code >= 0 else nbytes  # bytes whose codes can count
    spans = [(0, used), (block_b, nbytes)] if fast else [(0, used * step)]
    chunks = tuple(chunk for start, count in spans for chunk in pow2_chunks(start, count))
    full = 2 * block_b if fast else block_b * step
    return bias_code, chunks if sum(c for _, c in chunks) < full else ()


def pow2_chunks(start: int, count: int) -> list[tuple[int, int]]:
    """``[start, start + count)`` rounded up to whole MMA steps of 16, as ``(first, count)``
    chunks of powers of two, largest first."""
    left = -(-count // 16) * 16
    out = []
    size = 1 << (left.bit_length() - 1) if left else 0
    while left:
        if size <= left:
            out.append((start, size))
            start += size
            left -= size
        size //= 2
    return out


def ws_limit(problem: FsqProblem) -> str | None:
    """Why the warp-specialized split kernel (``kernels._fsq_ws``) cannot run this problem,
    or ``None``: it needs a 16-bit query and key decoder of one dtype, 16- or 256-level codes
    of at most 256 coordinates, at most 16 query heads per kv head, head_dim a power of two in
    [32, 128], RoPE by theta at consecutive positions (or none), its buffers within a
    Hopper block's shared memory, no interpreter, Triton >= 3.6 and an NVIDIA Hopper GPU.
    (Every decode call asks: the part that depends on shapes, dtypes and levels is cached.)"""
    q = problem.query
    reason = _ws_shape_limit(q.dtype, problem.key_decoder.dtype, problem.levels, q.shape[1],
                             q.shape[2], problem.kv_heads, problem.width,
                             "tables" if isinstance(problem.rope, tuple)
                             else "none" if problem.rope is None else "theta",
                             problem.positions is not None)
    if reason is not None:
        return reason
    if _interpreting():
        return "does not run under TRITON_INTERPRET (Gluon)"
    found = _triton_version()
    if found < WS_MIN_TRITON:
        return (f"needs Triton >= {WS_MIN_TRITON[0]}.{WS_MIN_TRITON[1]} (Gluon), found "
                f"{found[0]}.{found[1]}")
    if not _is_hopper(q.device):
        return "needs a Hopper GPU (compute capability 9.x)"
    return None


@functools.lru_cache(maxsize=256)
def _ws_shape_limit(dtype, decoder_dtype, levels, q_heads, head_dim, kv_heads, width, rope,
                    has_positions) -> str | None:
    """The part of :func:`ws_limit` that depends on the problem's shapes alone."""
    if dtype not in (torch.float16, torch.bfloat16) or decoder_dtype != dtype:
        return "needs a float16/bfloat16 query and key decoder of the same dtype"
    bits = uniform_bits(levels)
    if bits not in (4, 8):
        return "needs 16- or 256-level codes"
    half = head_dim // 2
    if half < 16 or half > 64 or half & (half - 1):  # (the keys' registers: at most 64)
        return "needs head_dim a power of two in [32, 128]"
    if q_heads // kv_heads > 16:
        return "needs at most 16 query heads per kv head"
    if rope == "tables" or (rope == "theta" and has_positions):
        return "needs RoPE by theta at consecutive positions, or no RoPE"
    if width > TILE_WIDTH:
        return f"needs at most {TILE_WIDTH} code coordinates"
    shared = ws_shared_bytes(width, head_dim, bits)
    if shared + WS_SHARED_SLACK > WS_SHARED_LIMIT:
        return (f"needs its buffers within {WS_SHARED_LIMIT // 1024} KB of shared memory; "
                f"width {width} at head_dim {head_dim} takes {shared // 1024} KB")
    return None


def uses_ws(problem: FsqProblem) -> bool:
    """Whether the default split kernel of this problem is the warp-specialized one
    (``SPLIT_TUNING["ws"]`` and :func:`ws_limit` allow it)."""
    return bool(SPLIT_TUNING["ws"]) and ws_limit(problem) is None


def split_block_n(problem: FsqProblem) -> int:
    """Positions per step of the Triton split kernel on this problem (codes in tiles take
    :data:`WIDE_TUNING`'s)."""
    return (WIDE_TUNING["block_n"] if problem.width > TILE_WIDTH
            else SPLIT_TUNING["block_n"])


def default_block_n(problem: FsqProblem) -> int:
    """Positions per step of the split kernel this problem runs by default."""
    return WS_BLOCK_N if uses_ws(problem) else split_block_n(problem)


def ws_program_heads(problem: FsqProblem) -> tuple[int, int, int]:
    """:func:`ws_heads` of a problem: ``(kv heads per program, code buffers, key buffers)``."""
    q_heads, head_dim = problem.query.shape[1:]
    return ws_heads(problem.kv_heads, q_heads // problem.kv_heads, problem.width, head_dim,
                    uniform_bits(problem.levels), problem.k_norm is not None,
                    problem.key_bias is not None)


def choose_num_splits(problem: FsqProblem, block_n: int | None = None, heads: int = 1) -> int:
    """Splits of the archive per (sequence, group of ``heads`` kv heads) for
    ``block_n``-position steps (``None``: the default, :func:`default_block_n`):
    :func:`split_count` over all such pairs on this device's multiprocessors."""
    capacity = problem.codes.shape[1]
    if capacity == 0:
        return 1
    block_n = default_block_n(problem) if block_n is None else block_n
    return split_count(problem.query.shape[0] * problem.kv_heads // heads, capacity,
                       multiprocessors(problem.query.device), block_n)


def split_count(pairs: int, capacity: int, multiprocessors: int, block_n: int) -> int:
    """The split count for ``capacity`` positions: of the split lengths :func:`best_split_len`
    picks for the capacity rounded down and up to a 64th of its power of two (at least a
    block), so a cache that grows a position per step finds the answers cached, the one
    whose splits (as many as ``capacity`` needs) the model finds faster at ``capacity``
    itself (rounded up alone, a capacity just past a wave's worth of splits took 17% longer
    in the model than its best)."""
    unit = max(block_n, 1 << max(0, capacity.bit_length() - 6))
    most = max(1, min(math.ceil(capacity / MIN_SPLIT_LEN), MAX_SPLITS))
    counts = set()
    for bucket in (capacity // unit * unit, -(-capacity // unit) * unit):
        if bucket:
            split_len = best_split_len(pairs, bucket, multiprocessors, block_n, PROGRAM_COST,
                                       SPLIT_MARGIN, MIN_SPLIT_LEN)
            counts.add(min(most, max(1, -(-capacity // split_len))))
    return min(counts, key=lambda count: (split_cost(pairs, capacity, multiprocessors, block_n,
                                                     count)[0], count))


def split_cost(pairs: int, capacity: int, multiprocessors: int, block_n: int, wanted: int,
               program_cost: int = PROGRAM_COST) -> tuple[int, int, int]:
    """``(modelled time, splits, split length)`` of asking :func:`split_layout` for ``wanted``
    splits: a split program holds a whole multiprocessor (registers and shared memory), so
    the busiest one runs ``ceil(pairs x splits / multiprocessors)`` programs one after
    another, each its split's positions plus ``program_cost``."""
    split_len, splits = split_layout(capacity, wanted, block_n)
    waves = math.ceil(pairs * splits / multiprocessors)
    return waves * (split_len + program_cost), splits, split_len


@functools.lru_cache(maxsize=1024)
def best_split_len(pairs: int, capacity: int, multiprocessors: int, block_n: int,
                   program_cost: int, margin: float, min_split_len: int) -> int:
    """The split length of the fewest splits whose :func:`split_cost` is within ``margin`` of
    the least (the model leaves out the merge's work per split, so more programs must win
    clearly), at most one split per ``min_split_len`` positions and ``MAX_SPLITS``. What it
    avoids is a partial last wave: on the H200, Qwen3-8B shapes at batch 8, 128K, 8 splits
    per pair (3.9 waves of programs) took 4.16 ms and 2 (one wave) 4.18 ms, where 9 (4.4
    waves) had taken 4.63 ms in an earlier run."""
    most = max(1, min(math.ceil(capacity / min_split_len), MAX_SPLITS))
    costs = [split_cost(pairs, capacity, multiprocessors, block_n, wanted, program_cost)
             for wanted in range(1, most + 1)]
    least = min(cost for cost, _, _ in costs)
    return min((splits, split_len) for cost, splits, split_len in costs
               if cost <= least * (1 + margin))[1]


def splits_for(problem: FsqProblem, num_splits: int | None, block_n: int | None = None):
    """``(split length, splits)`` the kernel runs (``block_n`` None: the default kernel, whose
    programs may take several kv heads each)."""
    heads = 1
    if block_n is None:
        block_n = default_block_n(problem)
        if uses_ws(problem):
            heads = ws_program_heads(problem)[0]
    wanted = (choose_num_splits(problem, block_n, heads) if num_splits is None
              else num_splits)
    return split_layout(problem.codes.shape[1], wanted, block_n)


def scratch_bytes(problem: FsqProblem, splits: int) -> int:
    """Bytes of the kernel's scratch: per (sequence, query head, split) the weighted code sum
    (``pow2(width)`` float32) and the running maximum and weight sum; it grows with the splits,
    never with the positions."""
    batch, q_heads, _ = problem.query.shape
    return batch * q_heads * splits * (pow2(problem.width, 16) + 2) * 4


_TABLES: dict = {}


def inverse_frequencies(rope: float | RopeFrequencies, head_dim: int, device) -> torch.Tensor:
    """``(head_dim / 2,)`` float64: ``theta ** (-2i / head_dim)`` for a theta, or the given
    :class:`RopeFrequencies`."""
    if isinstance(rope, RopeFrequencies):
        return torch.tensor(rope.inv_freq, dtype=torch.float64, device=device)
    i = torch.arange(head_dim // 2, dtype=torch.float64, device=device)
    return torch.pow(torch.tensor(float(rope), dtype=torch.float64, device=device),
                     -2.0 * i / head_dim)


def theta_tables(rope: float | RopeFrequencies, head_dim: int,
                 device) -> tuple[torch.Tensor, ...]:
    """``(cos_lo, sin_lo, cos_hi, sin_hi)``, each ``(2^11, head_dim / 2)`` float32: the angles
    ``lo * inv_freq`` and ``hi * 2^11 * inv_freq`` computed in float64 (reduced exactly
    before rounding), for the angle-sum formula the kernel applies at ``pos = hi * 2^11 + lo``
    (positions below ``MAX_THETA_POSITION``). 64 KB each at head_dim 128: they stay in L2.
    Cached per (theta or frequencies, head_dim, device); computed on the device (for a
    theta no host copy, so a first call inside a CUDA-graph capture works, and is then not
    cached; given frequencies are copied from the host, so their first call must run outside
    a capture, as ``kernels.CapturedCall``'s warm-up does)."""
    device = torch.device(device)
    key = (rope if isinstance(rope, RopeFrequencies) else float(rope), head_dim, device)
    tables = _TABLES.get(key)
    if tables is None:
        inv = inverse_frequencies(rope, head_dim, device)
        steps = torch.arange(1 << ROPE_RADIX_BITS, dtype=torch.float64, device=device)
        lo = steps[:, None] * inv[None, :]
        hi = (steps * (1 << ROPE_RADIX_BITS))[:, None] * inv[None, :]
        tables = tuple(t.to(torch.float32).contiguous()
                       for t in (lo.cos(), lo.sin(), hi.cos(), hi.sin()))
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _TABLES[key] = tables
    return tables


def kernel_tensors(problem: FsqProblem, placeholder: torch.Tensor) -> tuple:
    """What both split kernels read beside the codes: ``(rope kind, (cos_a, sin_a, cos_b,
    sin_b), key decoder, key bias, k_norm)``; an absent table, bias or norm is a real tensor
    the kernel never reads (``placeholder`` or the decoder)."""
    p = problem
    kind = rope_kind(p.rope)
    if kind == 1:
        tables = theta_tables(p.rope, p.query.shape[2], p.query.device)
    elif kind == 2:
        tables = (p.rope[0], p.rope[1], p.rope[0], p.rope[1])
    else:
        tables = (placeholder,) * 4
    kd = p.key_decoder
    return (kind, tables, kd, p.key_bias if p.key_bias is not None else kd,
            p.k_norm if p.k_norm is not None else kd)


def rope_kind(rope) -> int:
    """The kernel's ROPE constant: 0 none, 1 theta (angle-sum tables), 2 explicit tables."""
    if rope is None:
        return 0
    return 2 if isinstance(rope, tuple) else 1
