"""The exact window both caches keep, and the rules they share: where the archive ends, how far
a crop can go back, what a query of a multi-token forward sees.

A cache layer keeps its first ``sinks`` and last ``recent`` positions exact; positions in between
are archived (coded), in groups of ``block`` aligned on ``sinks``. The archive of a cache holding
``length`` positions ends at :func:`archive_end` ``(length)``, the same whether the positions came
one token at a time or in chunks: a query at position ``p`` sees the cache as it stood after
``p + 1`` positions (:func:`archive_end` ``(p + 1)``), which is what makes every chunking of a
sequence compute what token-by-token decoding computes. Both caches also keep exact copies of the
last ``rewind`` archived positions, so that ``crop`` can make them exact again.
"""

from __future__ import annotations

import torch

from model_adapters._checks import count

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)

__all__ = [
    "DEFAULT_REWIND",
    "archive_end",
    "archived_per_sequence",
    "check_window",
    "crop_target",
    "shortest_crop",
]

#: archived positions both caches keep exact copies of by default: transformers' assistant drafts
#: 20 tokens per round by default, and a crop back by ``k`` positions needs ``k + block - 1``
DEFAULT_REWIND = 32


def check_window(**counts: int) -> None:
    """Raise ValueError naming the first cache-window count that is not an int >= 0 (``block``:
    >= 1, a group of positions)."""
    for name, v in counts.items():
        count(v, name, low=1 if name == "block" else 0)


def archive_end(length: int, sinks: int, recent: int, block: int) -> int:
    """End of the archived span ``[sinks, end)`` of a layer holding ``length`` positions: whole
    groups of ``block`` positions from ``sinks`` on, all of them at least ``recent`` positions
    behind the newest (``sinks`` when nothing is archived)."""
    return sinks + block * (max(0, length - recent - sinks) // block)


def shortest_crop(end: int, sinks: int, recent: int, block: int) -> int:
    """The shortest length whose :func:`archive_end` is at least ``end`` (a crop to a shorter
    length needs exact K/V below ``end``)."""
    if end <= sinks:
        return 0
    return sinks + recent + block * -(-(end - sinks) // block)


def crop_target(tokens_to_remove: int, length: int) -> int:
    """The length a cache of ``length`` positions keeps under ``crop(tokens_to_remove)``, in
    both transformers conventions: ``n < 0`` drops the last ``-n`` positions, ``n > 0`` keeps
    the first ``n``, ``0`` keeps everything. A 0-d integer tensor counts as its int
    (transformers 5.17's assisted decoding passes one). TypeError for a non-int; ValueError,
    naming the length, when the cut would pass the start or ``n`` exceeds what the cache
    holds."""
    if (isinstance(tokens_to_remove, torch.Tensor) and tokens_to_remove.ndim == 0
            and tokens_to_remove.dtype in _INT_DTYPES):
        tokens_to_remove = int(tokens_to_remove)
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


def archived_per_sequence(layers) -> list[int]:
    """Archived positions of each sequence of a batch, from cache layers that each report
    theirs (``layer.archived_counts()``, ``batch`` ints; in a left-padded batch counted in the
    sequence's own tokens): the smallest over the layers, which agree between forward passes.
    Empty before the first update."""
    counts = [layer.archived_counts() for layer in layers]
    return [min(c) for c in zip(*counts, strict=False)]
