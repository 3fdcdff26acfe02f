"""The index layer: exact suffix search over a symbol stream (:mod:`.suffix`, KD-trees on the
chaos-game walk) and its Numba kernels (:mod:`._kernels`). Depends on the codec only; the
archive's streams offer search through :mod:`fkvstore.stream_search`."""

from __future__ import annotations

from fkvstore.index.suffix import TREE_FORMAT, SuffixIndex

__all__ = ["TREE_FORMAT", "SuffixIndex"]
