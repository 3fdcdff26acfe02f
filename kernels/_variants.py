"""The Triton kernel variants and which one runs for a problem (importable without triton)."""

from __future__ import annotations

VARIANTS = ("onehot", "atomic")


def variant_for(group: int, batch: int) -> str:
    """The variant measured faster (H200, ``docs/kernels.md``) for ``group`` query heads per kv
    head and ``batch`` sequences: the one-hot kernel for GQA groups (Qwen3-8B shapes, every
    batch and context measured) and for MHA at batch 1 (GPT-2 shapes: 1.32x the atomic kernel's
    speed at 32K down to 1.05x at 128K with 2+2 stages, 0.96x to 1.08x with 4+2); the atomic
    kernel for MHA at larger batches, where its one atomic add per value stage costs less (1.1x
    to 1.5x faster)."""
    return "onehot" if group >= 2 or batch == 1 else "atomic"
