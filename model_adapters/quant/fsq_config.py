"""Configurations of FSQ-converted models (``model_type`` ``fsq_qwen3`` and ``fsq_gpt2``).

Each is its base model's configuration plus ``fsq_width`` (code coordinates per token per layer),
``fsq_levels`` (``fsq_width`` ints) and ``fsq_tau`` (finetuning tokens per original parameter,
or None), so a converted checkpoint's ``config.json`` says what its cache holds. This module
imports only transformers' configuration classes (no torch): it is what registration with
``AutoConfig`` needs.
"""

from __future__ import annotations

from transformers.models.gpt2.configuration_gpt2 import GPT2Config
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

__all__ = ["FSQ_MODEL_TYPES", "FsqGPT2Config", "FsqQwen3Config", "fsq_spec"]


class FsqQwen3Config(Qwen3Config):
    """A Qwen3 configuration whose attention layers compute K/V through an FSQ bottleneck."""

    model_type = "fsq_qwen3"


class FsqGPT2Config(GPT2Config):
    """A GPT-2 configuration whose attention layers compute K/V through an FSQ bottleneck."""

    model_type = "fsq_gpt2"


FSQ_MODEL_TYPES = {"qwen3": FsqQwen3Config, "gpt2": FsqGPT2Config}


def fsq_spec(config) -> tuple[int, tuple[int, ...], float | None]:
    """``(width, levels, tau)`` of a converted model's configuration; ValueError naming what is
    missing for any other configuration."""
    width = getattr(config, "fsq_width", None)
    levels = getattr(config, "fsq_levels", None)
    if width is None or levels is None:
        raise ValueError(f"{type(config).__name__} (model_type "
                         f"{getattr(config, 'model_type', None)!r}) is not an FSQ-converted "
                         f"configuration: fsq_width / fsq_levels missing")
    levels = (levels,) * width if isinstance(levels, int) else tuple(levels)
    return int(width), levels, getattr(config, "fsq_tau", None)
