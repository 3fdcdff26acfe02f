"""Shapes the kernels take, the variant that runs a problem, and the split layout (pure
Python and torch: importable without triton, so the ``auto`` decision costs no triton import)."""

from __future__ import annotations

import functools
import math

import torch

VARIANTS = ("onehot", "atomic")
MAX_HEADS_PER_PROGRAM = 16  # query heads of one GQA group handled together (they share codes)
MAX_HISTOGRAM_COLUMNS = 1 << 16  # value stages x codebook size (padded to a power of two)
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis: (batch, kv head, chunk) programs
MAX_SPLITS = 1024


def pow2(x: int, floor: int = 1) -> int:
    """The smallest power of two >= ``x`` and >= ``floor``."""
    return max(floor, 1 << max(0, int(x) - 1).bit_length())


def floor_pow2(x: int) -> int:
    """The largest power of two <= ``max(1, x)``."""
    return 1 << (max(1, x).bit_length() - 1)


def variant_for(group: int, batch: int) -> str:
    """The variant measured faster on the H200 (``docs/kernels.md``, "Which variant runs") for
    ``group`` query heads per kv head and ``batch`` sequences: the one-hot kernel for GQA
    groups and for MHA at batch 1, the atomic kernel for MHA at larger batches, where its one
    atomic add per value stage costs less."""
    return "onehot" if group >= 2 or batch == 1 else "atomic"


def choose_variant(problem) -> str:
    """:func:`variant_for` of a :class:`~kernels.coded_cache.DecodeProblem`."""
    return variant_for(problem.q_heads // problem.kv_heads, problem.batch)


def problem_dims(problem) -> tuple[int, ...]:
    """``(batch, q_heads, head_dim, kv_heads, group, key_stages, key_codebook, value_stages,
    value_codebook)`` of a :class:`~kernels.coded_cache.DecodeProblem`."""
    batch, q_heads, head_dim = problem.query.shape
    kv_heads = problem.kv_heads
    key_stages, key_codebook = problem.cache.key_codebooks.shape[1:3]
    value_stages, value_codebook = problem.cache.value_codebooks.shape[1:3]
    return (batch, q_heads, head_dim, kv_heads, q_heads // kv_heads, key_stages, key_codebook,
            value_stages, value_codebook)


def split_layout(capacity: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """``(split length, splits)`` for about ``num_splits`` splits of ``capacity`` positions:
    lengths are whole blocks of ``block_n``, and no split is left empty (so there may be
    fewer)."""
    split_len = max(block_n, math.ceil(max(capacity, 1) / num_splits / block_n) * block_n)
    return split_len, max(1, math.ceil(capacity / split_len))


def histogram_columns(value_stages: int, value_codebook_size: int) -> int:
    """Columns of the value histogram of one query head (codebook padded to a power of two)."""
    return value_stages * pow2(value_codebook_size)


def supports_shape(batch: int, q_heads: int, kv_heads: int, value_stages: int,
                   value_codebook: int) -> bool:
    """Whether a kernel variant takes problems of these shapes: the atomic kernel takes every
    one whose value histogram fits ``MAX_HISTOGRAM_COLUMNS`` and whose (batch, kv head, chunk)
    programs fit ``MAX_GRID_Y``; the one-hot kernel a subset."""
    return (histogram_columns(value_stages, value_codebook) <= MAX_HISTOGRAM_COLUMNS
            and grid_rows(batch, q_heads, kv_heads) <= MAX_GRID_Y)


def grid_rows(batch: int, q_heads: int, kv_heads: int) -> int:
    group = q_heads // kv_heads
    return batch * kv_heads * math.ceil(group / heads_per_program(group))


def heads_per_program(group: int) -> int:
    return min(MAX_HEADS_PER_PROGRAM, pow2(group))


def block_positions(group: int) -> int:
    """Positions per loop step: about 256 (head, position) pairs in flight per program."""
    return max(32, 256 // heads_per_program(group))


@functools.lru_cache(maxsize=16)
def multiprocessors(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (asked once per device: a decode call needs it up to
    three times); the CPU (Triton's interpreter) stands in for 4."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
