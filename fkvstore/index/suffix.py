"""Suffix search on the chaos-game walk: KD-tree filter, exact verification from span points.

Every position ``p`` of a stream has a walk point ``w_p`` (:meth:`Codec.walk`). If the ``L``
symbols ending at ``p`` equal a query ``q``, then ``w_p = F_q(w_{p-L})`` and the query's own walk
from the origin ends at ``Q = F_q(0)``, so ``|w_p - Q| <= r**L * R`` (R: the walk's radius).
A ball query around ``Q`` therefore finds every occurrence (recall 1 by construction); it may
also return neighbours from adjacent cells, and for long queries float64 stops resolving the
oldest symbols, so every candidate is verified by decoding the stream's stored span points
(precision 1). Nearest-neighbour distance is a graded suffix similarity, but only a filter.

The index is derived data: it is built from the symbols (or from a persisted walk), and kept
current as a stream grows by the logarithmic method: new positions collect in a small buffer
that is scanned by brute force; a full buffer becomes a KD-tree, and trees of similar size are
merged, so each position takes part in O(log n) tree builds (amortised O(log n) per append)
and a query visits O(log n) trees.

Memory per position: 16 B of walk point, about 10 B of KD-tree (indices and nodes), and the
stored span points (16 / span B); see docs/search.md for measurements.
"""

from __future__ import annotations

import numpy as np
import scipy
from scipy.spatial import cKDTree

from fkvstore._validate import integer, raise_out_of_range, symbol_array
from fkvstore.codec import Codec
from fkvstore.errors import InvalidPointError
from fkvstore.index import _kernels as _ik
from fkvstore.index._tree_state import stored_trees_valid

__all__ = ["TREE_FORMAT", "SuffixIndex"]

_BUFFER = 4096  # positions scanned by brute force before they become a tree
_LEAF = 16
#: what persisted KD-tree node bytes depend on: scipy's node layout and the leaf size
TREE_FORMAT = f"scipy-{scipy.__version__}-leaf{_LEAF}"
# slack on the ball radius for float64 rounding of walk points (the walk's forward error is
# below 8 ulps of the radius; a generous margin only costs candidates that verification drops)
_SLACK = 2.0**-46


class _GrowingArray:
    """Append-only array with amortised O(1) appends (capacity doubles)."""

    def __init__(self, shape_tail: tuple[int, ...], dtype) -> None:
        self._data = np.empty((1024, *shape_tail), dtype=dtype)
        self.n = 0

    def extend(self, rows: np.ndarray) -> None:
        need = self.n + rows.shape[0]
        if need > self._data.shape[0]:
            cap = max(need, 2 * self._data.shape[0])
            grown = np.empty((cap, *self._data.shape[1:]), dtype=self._data.dtype)
            grown[: self.n] = self._data[: self.n]
            self._data = grown
        self._data[self.n: need] = rows
        self.n = need

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)

    @property
    def view(self) -> np.ndarray:
        return self._data[: self.n]


class SuffixIndex:
    """Exact substring and longest-suffix search over one symbol stream.

    Build with :meth:`build` (from the stream's symbols) and keep current with :meth:`extend`.
    Verification decodes the stream's span points, which the index holds as the codec wrote
    them: the same float64 pairs the archive stores, so search needs no copy of the symbols.

    Parameters: ``codec``, the stream's :class:`~fkvstore.codec.Codec`.
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._walk = _GrowingArray((2,), np.float64)
        self._points = _GrowingArray((1, 2), np.float64)
        self._length = 0
        self._trees: list[tuple[int, int, cKDTree]] = []  # (start, stop, tree) in order
        self._indexed = 0  # positions [0, _indexed) live in trees, the rest in the buffer
        self._ring = codec.geometry == "ring"
        args = codec.kernel_args()
        if self._ring:
            self._grid_args = (args[0], 0, codec.alphabet_size)
            self._ring_args = args[1:]
        else:
            self._grid_args = args
            self._ring_args = (np.zeros((1, 2)), 1.0, 1.0, np.zeros(1))

    # ------------------------------------------------------------------ building
    @classmethod
    def build(cls, codec: Codec, symbols, walk: np.ndarray | None = None) -> SuffixIndex:
        """Index a whole stream: ``symbols`` int ``(n,)``; ``walk`` its persisted walk points
        ``(n, 2)`` float64 if available (skips recomputing them)."""
        index = cls(codec)
        index._append(symbols, walk)
        index._absorb_buffer()
        return index

    def extend(self, symbols, walk: np.ndarray | None = None) -> None:
        """Index positions appended to the stream: ``symbols`` int ``(k,)``."""
        self._append(symbols, walk)
        if self._length - self._indexed >= _BUFFER:
            self._absorb_buffer()

    def _append(self, symbols, walk: np.ndarray | None) -> None:
        arr = symbol_array(symbols, self.codec.alphabet_size, ndim=(1,))
        if arr.shape[0] == 0:
            return
        if walk is None:
            start = self._walk.view[-1] if self._walk.n else None
            walk = self.codec.walk(arr, start=start)
        elif walk.shape != (arr.shape[0], 2):
            raise ValueError(f"walk must have shape {(arr.shape[0], 2)}, got {walk.shape}")
        self._walk.extend(walk)
        tail_count = self._length % self.codec.span
        tail = self._points.view[-1] if tail_count else None
        new_points = self.codec.extend(tail, tail_count, arr.reshape(-1, 1))
        self._points.truncate(self._points.n - (1 if tail_count else 0))
        self._points.extend(new_points)
        self._length += arr.shape[0]

    # ------------------------------------------------------------------ persistence
    def state(self) -> dict[str, np.ndarray]:
        """The index as plain arrays (no pickles), for :meth:`from_state`:

        ``walk`` float64 ``(n, 2)``; ``trees`` int64 ``(T, 4)`` rows (first position, end,
        offset and length of the tree's node bytes); ``nodes`` uint8 (scipy's cKDTree node
        records, valid only for the scipy version that wrote them, :data:`TREE_FORMAT`);
        ``indices`` int64 (each tree's point order, concatenated); ``boxes`` float64 ``(T, 4)``
        (each tree's maxes then mins)."""
        trees, nodes, indices, boxes = [], [], [], []
        offset = 0
        for a, b, tree in self._trees:
            st = tree.__getstate__()
            raw = np.frombuffer(st[0].tobytes(), dtype=np.uint8)
            trees.append((a, b, offset, raw.shape[0]))
            offset += raw.shape[0]
            nodes.append(raw)
            indices.append(np.asarray(st[7], dtype=np.int64))
            boxes.append(np.concatenate([st[5], st[6]]))
        return {"walk": self._walk.view.copy(),
                "trees": np.array(trees, dtype=np.int64).reshape(-1, 4),
                "nodes": np.concatenate(nodes) if nodes else np.zeros(0, np.uint8),
                "indices": np.concatenate(indices) if indices else np.zeros(0, np.int64),
                "boxes": np.array(boxes, dtype=np.float64).reshape(-1, 4)}

    @classmethod
    def from_state(cls, codec: Codec, symbols, state: dict[str, np.ndarray],
                   tree_format: str) -> SuffixIndex:
        """Rebuild an index from :meth:`state` arrays and the stream's symbols ``(n,)`` (n at
        least the persisted length). The KD-trees are restored without rebuilding when
        ``tree_format`` equals this machine's :data:`TREE_FORMAT` and the stored trees pass
        their checks (shapes, ranges, point orders, node links); otherwise rebuilt from the
        walk. Pass ``tree_format=""`` to always rebuild."""
        arr = symbol_array(symbols, codec.alphabet_size, ndim=(1,))
        walk = np.asarray(state["walk"], dtype=np.float64)
        n = walk.shape[0]
        if walk.ndim != 2 or walk.shape[1] != 2 or n > arr.shape[0]:
            raise ValueError(f"persisted walk of shape {walk.shape} does not fit a stream of "
                             f"{arr.shape[0]} positions")
        if not np.isfinite(walk).all():
            raise ValueError("persisted walk holds non-finite points")
        index = cls(codec)
        index._append(arr[:n], walk)
        trees = np.asarray(state["trees"], dtype=np.int64)
        if tree_format == TREE_FORMAT and index._restore_trees(trees, state):
            pass
        else:
            index._absorb_buffer()
        index.extend(arr[n:])
        return index

    def _restore_trees(self, trees: np.ndarray, state) -> bool:
        """Restore the KD-trees from their node bytes if every array checks out (see
        :mod:`fkvstore.index._tree_state`: scipy would follow bad links into memory)."""
        nodes, indices, boxes = state["nodes"], state["indices"], state["boxes"]
        nodes = np.asarray(nodes, dtype=np.uint8)
        indices = np.asarray(indices, dtype=np.int64)
        boxes = np.asarray(boxes, dtype=np.float64)
        if not stored_trees_valid(trees, nodes, indices, boxes, self._length):
            return False
        restored: list[cKDTree] = []
        pos = 0
        for a, b, off, size in trees.tolist():
            tree = cKDTree.__new__(cKDTree)
            tree.__setstate__((nodes[off:off + size].view("S1"), self._walk.view[a:b], b - a, 2,
                               _LEAF, boxes[len(restored), :2].copy(),
                               boxes[len(restored), 2:].copy(), indices[pos:pos + b - a].copy(),
                               None, None))
            pos += b - a
            restored.append((a, b, tree))
        self._trees = restored
        self._indexed = restored[-1][1] if restored else 0
        return True

    def truncate(self, length: int) -> None:
        """Forget positions ``>= length`` (the stream was truncated)."""
        length = integer(length, "length", low=0, high=self._length)
        if length == self._length:
            return
        symbols = self.symbols(0, length) if length % self.codec.span else None
        keep_spans = length // self.codec.span
        self._points.truncate(keep_spans)
        if symbols is not None:  # re-encode the partial last span from its symbols
            last = symbols[keep_spans * self.codec.span:]
            self._points.extend(self.codec.encode(last.reshape(-1, 1)))
        self._walk.truncate(length)
        self._length = length
        self._trees = [t for t in self._trees if t[1] <= length]
        self._indexed = self._trees[-1][1] if self._trees else 0

    def _absorb_buffer(self) -> None:
        start = self._indexed
        if start == self._length:
            return
        self._trees.append((start, self._length, self._tree(start, self._length)))
        # logarithmic method: merge while the newest tree is at least half its predecessor
        while len(self._trees) >= 2 and (
                (self._trees[-1][1] - self._trees[-1][0]) * 2
                >= self._trees[-2][1] - self._trees[-2][0]):
            a, _, _ = self._trees[-2]
            _, b, _ = self._trees[-1]
            del self._trees[-2:]
            self._trees.append((a, b, self._tree(a, b)))
        self._indexed = self._length

    def _tree(self, start: int, stop: int) -> cKDTree:
        return cKDTree(self._walk.view[start:stop], leafsize=_LEAF, balanced_tree=False,
                       compact_nodes=False)

    # ------------------------------------------------------------------ state
    def __len__(self) -> int:
        return self._length

    @property
    def walk(self) -> np.ndarray:
        """The walk points, float64 ``(n, 2)`` (what an archive may persist)."""
        return self._walk.view

    @property
    def tree_sizes(self) -> list[int]:
        """Sizes of the KD-trees, oldest first (the rest of the positions are in the buffer)."""
        return [b - a for a, b, _ in self._trees]

    def nbytes(self) -> int:
        """Bytes held: walk points, span points and KD-tree indices and nodes (estimated at
        the tree's index array plus one node per leaf-size positions)."""
        tree = sum(t.indices.nbytes + (b - a) // _LEAF * 2 * 72 for a, b, t in self._trees)
        return self._walk.view.nbytes + self._points.view.nbytes + tree

    def symbols(self, start: int, stop: int) -> np.ndarray:
        """Symbols ``[start, stop)`` decoded from the span points (int64)."""
        return self.codec.decode_range(self._points.view, self._length, start, stop)[:, 0]

    # ------------------------------------------------------------------ queries
    def candidates(self, query: np.ndarray) -> np.ndarray:
        """Positions whose walk point lies in the query's ball (unverified, unsorted)."""
        q = self.codec.walk(query)[-1]
        radius = self.codec.ratio ** query.shape[0] * self.codec.walk_radius + _SLACK
        q2 = q.reshape(1, 2)
        found = [np.asarray(tree.query_ball_point(q2, radius, return_sorted=False)[0],
                            dtype=np.int64) + a for a, _, tree in self._trees]
        buf = self._walk.view[self._indexed:]
        if buf.shape[0]:
            found.append(_ik.ball_brute(buf, q[0], q[1], radius, self._indexed))
        if not found:
            return np.empty(0, dtype=np.int64)
        return np.concatenate(found) if len(found) > 1 else found[0]

    def common_suffix(self, positions: np.ndarray, query: np.ndarray) -> np.ndarray:
        """For each position, how many of the query's last symbols end there (exact)."""
        out = np.empty(positions.shape[0], dtype=np.int64)
        pts = self._points.view
        err = _ik.common_suffix(pts, self._length, positions, query, self._ring,
                                self._grid_args, self._ring_args, out)
        if err >= 0:
            span = int(err) // 8
            raise InvalidPointError(f"span {span} of the indexed stream does not decode")
        return out

    def search(self, query) -> np.ndarray:
        """Sorted int64 positions of the last symbol of every occurrence of ``query``."""
        q = self._query(query)
        cand = self.candidates(q)
        cand = cand[cand >= q.shape[0] - 1]
        if cand.shape[0] == 0:
            return cand
        hits = cand[self.common_suffix(cand, q) == q.shape[0]]
        hits.sort()
        return hits

    def longest_suffix(self, query, k: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` positions whose preceding symbols share the longest common suffix with
        ``query``; ties go to the most recent position. Returns int64 ``(positions, lengths)``,
        longest first (fewer than k if the stream is shorter; lengths >= 1 only)."""
        q = self._query(query)
        k = integer(k, "k", low=1)
        chosen: dict[int, int] = {}
        # positions matching the last `ell` symbols are nested in ell: descend until k found
        for ell in range(q.shape[0], 0, -1):
            cand = self.candidates(q[-ell:])
            cand = cand[cand >= ell - 1]
            if cand.shape[0] == 0:
                continue
            lengths = self.common_suffix(cand, q)
            keep = lengths >= ell
            for p, n in zip(cand[keep].tolist(), lengths[keep].tolist(), strict=True):
                chosen.setdefault(p, n)
            if len(chosen) >= k:
                break
        order = sorted(chosen.items(), key=lambda pn: (-pn[1], -pn[0]))[:k]
        return (np.array([p for p, _ in order], dtype=np.int64),
                np.array([n for _, n in order], dtype=np.int64))

    def _query(self, query) -> np.ndarray:
        if isinstance(query, str):
            query = query.encode("utf-8")
        q = symbol_array(query, self.codec.alphabet_size, ndim=(1,), name="query",
                         check_range=False)
        if q.shape[0] == 0:
            raise ValueError("query must hold at least one symbol, got an empty query")
        if q.min() < 0 or q.max() >= self.codec.alphabet_size:
            raise_out_of_range(q, self.codec.alphabet_size, "query")
        return q.astype(np.int64, copy=False)
