"""Checks of persisted KD-tree arrays before scipy is handed them.

``cKDTree.__setstate__`` trusts its input: node records whose child links point outside the
node buffer, or point indices outside the tree, make it (or a later query) read and write
arbitrary memory. A persisted index comes from a file, so everything that decides an address
is checked here first; a set that fails any check is rebuilt from the walk points instead.

The node record is scipy's ``ckdtreenode`` (``scipy/spatial/ckdtree/src/ckdtree_decl.h``), the
same in every scipy release since 1.0: split_dim, children, split, start_idx, end_idx, two raw
pointers (rewritten on restore), and the child node numbers ``_less``/``_greater``. Node bytes
are only restored when written by this scipy version (``TREE_FORMAT``), and a layout other than
this one fails these checks, so it is rebuilt, never misread.
"""

from __future__ import annotations

import numpy as np

__all__ = ["NODE_DTYPE", "MAX_DEPTH", "stored_trees_valid"]

NODE_DTYPE = np.dtype([
    ("split_dim", "<i8"), ("children", "<i8"), ("split", "<f8"), ("start_idx", "<i8"),
    ("end_idx", "<i8"), ("less", "<u8"), ("greater", "<u8"), ("_less", "<i8"),
    ("_greater", "<i8"),
])
#: scipy restores the node links recursively: a deeper tree could exhaust the C stack
MAX_DEPTH = 2048


def stored_trees_valid(trees: np.ndarray, nodes: np.ndarray, indices: np.ndarray,
                       boxes: np.ndarray, length: int) -> bool:
    """Whether persisted index arrays (``SuffixIndex.state()``: ``trees`` int64 (T, 4) rows of
    first position, end, node byte offset and size; ``nodes`` uint8; ``indices`` int64;
    ``boxes`` float64 (T, 4)) describe well-formed KD-trees over positions ``[0, length)``."""
    if not (trees.ndim == 2 and trees.shape[1] == 4 and boxes.shape == (len(trees), 4)
            and nodes.ndim == 1 and indices.ndim == 1):
        return False
    if len(trees) == 0:
        return nodes.shape[0] == 0 and indices.shape[0] == 0
    starts, ends, offsets, sizes = (trees[:, k] for k in range(4))
    if not (starts[0] == 0 and np.all(starts[1:] == ends[:-1]) and np.all(ends > starts)
            and int(ends[-1]) <= length and int((ends - starts).sum()) == indices.shape[0]
            and np.all(sizes > 0) and np.all(sizes % NODE_DTYPE.itemsize == 0)
            and offsets[0] == 0 and np.all(offsets[1:] == (offsets + sizes)[:-1])
            and int(sizes.sum()) == nodes.shape[0] and np.isfinite(boxes).all()):
        return False
    pos = 0
    for a, b, off, size in trees.tolist():
        n = b - a
        order = indices[pos:pos + n]
        pos += n
        if not np.array_equal(np.sort(order), np.arange(n)):  # a permutation of the tree's points
            return False
        if not _nodes_valid(np.frombuffer(nodes[off:off + size].tobytes(), NODE_DTYPE), n):
            return False
    return True


def _nodes_valid(nd: np.ndarray, n: int) -> bool:
    """Whether node records ``nd`` form one binary tree over points ``[0, n)``: node 0 the
    root; each inner node's two children later in the buffer, every other node the child of
    exactly one node; children splitting their parent's point range into two non-empty parts;
    depth at most MAX_DEPTH."""
    count = len(nd)
    dim, lo, hi = nd["split_dim"], nd["start_idx"], nd["end_idx"]
    if not (np.all((dim >= -1) & (dim <= 1)) and np.all((0 <= lo) & (lo < hi) & (hi <= n))
            and np.all(nd["children"] == hi - lo) and lo[0] == 0 and hi[0] == n):
        return False
    inner = np.flatnonzero(dim >= 0)
    less, greater = nd["_less"][inner], nd["_greater"][inner]
    if not (np.all((less > inner) & (less < count)) and np.all((greater > inner)
                                                                & (greater < count))):
        return False
    child = np.concatenate([less, greater])
    if not np.array_equal(np.sort(child), np.arange(1, count)):
        return False
    if not (np.all(lo[less] == lo[inner]) and np.all(hi[less] == lo[greater])
            and np.all(hi[greater] == hi[inner]) and np.isfinite(nd["split"][inner]).all()):
        return False
    links = np.full((count, 2), -1, dtype=np.int64)
    links[inner, 0], links[inner, 1] = less, greater
    level, depth = np.array([0]), 0
    while level.size:  # breadth first: each node is reached once (one parent each)
        depth += 1
        if depth > MAX_DEPTH:
            return False
        level = links[level].ravel()
        level = level[level >= 0]
    return True
