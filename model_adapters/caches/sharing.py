"""Deep copies of a cache that share its codebooks.

A cache copy (``copy.deepcopy``, as generate and beam-search helpers make) needs its own K/V
and codes, but the quantizer's codebooks and look-up tables are read-only while a cache runs:
copying them would duplicate the largest fixed cost once per copy.
"""

from __future__ import annotations

import copy

__all__ = ["deepcopy_sharing"]


def deepcopy_sharing(obj, memo: dict, shared) -> object:
    """``copy.deepcopy(obj)`` where every object in ``shared`` is kept by reference (the
    copy's attributes, and anything reached from them, point at the same objects)."""
    for s in shared:
        memo[id(s)] = s
    new = obj.__class__.__new__(obj.__class__)
    memo[id(obj)] = new
    new.__dict__.update(copy.deepcopy(obj.__dict__, memo))
    return new
