"""The Triton kernel variants and which one runs for a problem (importable without triton)."""

from __future__ import annotations

VARIANTS = ("onehot", "atomic")


def variant_for_group(group: int) -> str:
    """The variant measured faster (H200, ``docs/kernels.md``) for ``group`` query heads per kv
    head: with GQA groups (Qwen3-8B shapes) the one-hot kernel won at every batch size and
    context measured; for MHA (GPT-2 shapes) the atomic kernel's per-position cost, one atomic
    add per value stage, stays lower at batch 8 and 32."""
    return "onehot" if group >= 2 else "atomic"
