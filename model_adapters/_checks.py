"""Argument checks shared across model_adapters (the lowest layer: imports nothing of ours)."""

from __future__ import annotations


def count(value, name: str, low: int = 0) -> int:
    """``value`` if it is an int (not a bool) >= ``low`` (0 or 1), else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "a positive" if low >= 1 else "a non-negative"
        raise ValueError(f"{name} must be {kind} int, got {value!r}")
    return value
