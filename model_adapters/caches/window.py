"""The exact window both caches keep, and the one crop rule they share.

A cache layer keeps its first ``sinks`` and last ``recent`` positions exact (``rewind`` more
behind the recent window in the codes-only cache; positions leave in groups of ``block``).
"""

from __future__ import annotations

__all__ = ["check_window", "crop_target"]


def check_window(**counts: int) -> None:
    """Raise ValueError naming the first cache-window count that is not an int >= 0 (``block``:
    >= 1, a group of positions)."""
    for name, v in counts.items():
        low = 1 if name == "block" else 0
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            kind = "a positive" if low else "a non-negative"
            raise ValueError(f"{name} must be {kind} int, got {v!r}")


def crop_target(tokens_to_remove: int, length: int) -> int:
    """The length a cache of ``length`` positions keeps under ``crop(tokens_to_remove)``, in
    both transformers conventions: ``n < 0`` drops the last ``-n`` positions, ``n > 0`` keeps
    the first ``n``, ``0`` keeps everything. TypeError for a non-int; ValueError, naming the
    length, when the cut would pass the start or ``n`` exceeds what the cache holds."""
    if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
        raise TypeError(f"crop takes an int, got {tokens_to_remove!r}")
    if tokens_to_remove == 0:
        return length
    target = tokens_to_remove if tokens_to_remove > 0 else length + tokens_to_remove
    if target < 0:
        raise ValueError(
            f"cannot remove {-tokens_to_remove} positions: the cache holds only {length}")
    if target > length:
        raise ValueError(f"cannot keep {target} positions: the cache holds only {length}")
    return target

