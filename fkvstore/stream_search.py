"""Search methods of archive streams: :class:`SearchMixin` gives every
:class:`~fkvstore.stream.Stream` ``search``, ``longest_suffix``, ``context`` and
``build_index``, on top of :class:`~fkvstore.index.SuffixIndex`.

A stream keeps one index per searched column, built from the archive on first use. It is kept
current lazily: appended rows are added to the index (O(log n) amortised each) the next time a
query runs, a truncation cuts the index back at once, and a reader that sees a writer rewind
drops its indexes. ``build_index(persist=True)`` stores the index beside the stream as plain
arrays (``aux/search_<column>_<walk|trees|nodes|indices|boxes>``; docs/format.md), so reopening
a large archive restores the walk instead of recomputing it. The stored arrays share one
tag (build id, committed length, generation, rewind count); a stale, torn or damaged stored index
is ignored and rebuilt, since it is derived data.

The stored index is used only when the stream's ``trust_index`` is set; otherwise the index is
rebuilt from the stream's checksummed points: the KD-trees' node bytes are scipy's in-memory
records, which scipy follows as pointers, so a crafted file could make it touch arbitrary
memory, and a crafted walk (with a valid CRC-32) would hide matches. Trusted node bytes are
still checked (:mod:`fkvstore.index._tree_state`) before use; see docs/search.md.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fkvstore._validate import integer
from fkvstore.codec import Codec
from fkvstore.errors import ArchiveFormatError, ChecksumError, RemoteArchiveError
from fkvstore.index import TREE_FORMAT, SuffixIndex

if TYPE_CHECKING:
    from fkvstore._session import Pending, Session
    from fkvstore._stored import StoredPoints

__all__ = ["SearchMixin"]

_KEY = "search_{}_{}"  # column, state array name
_STATE = ("walk", "trees", "nodes", "indices", "boxes")


@dataclass(frozen=True)
class _Tag:
    """The build tag every array of a persisted index carries (stored as its attributes)."""

    index_id: str
    length: int
    generation: int
    rewinds: int
    codec: str
    tree_format: str


def _tag(attrs: dict) -> _Tag | None:
    """The build tag a persisted index array carries, or None if it has none."""
    try:
        return _Tag(
            index_id=str(attrs["index_id"]),
            length=int(attrs["length"]),
            generation=int(attrs["generation"]),
            rewinds=int(attrs["rewinds"]),
            codec=str(attrs["codec"]),
            tree_format=str(attrs["tree_format"]),
        )
    except (KeyError, TypeError, ValueError):
        return None


class SearchMixin:
    """Suffix search over one column of a stream (see docs/search.md)."""

    _search_indexes: dict[int, SuffixIndex]
    #: restore a persisted index's KD-trees from their stored node bytes (checked, but the
    #: bytes of scipy's own records) and its walk points instead of rebuilding them; set it
    #: before the first query, on archives you wrote yourself (docs/search.md)
    trust_index: bool = False
    # the rest is Stream's, which this class is mixed into (declared for the type checker)
    name: str
    width: int
    codec: Codec
    _session: Session
    _stored: StoredPoints
    _nbuf: int

    if TYPE_CHECKING:
        def __len__(self) -> int: ...
        def _check_open(self) -> None: ...
        def _stage(self) -> Pending: ...
        def read(self, start: int = 0, stop: int | None = None) -> np.ndarray: ...
        def put_aux_array(self, key: str, array, attrs: dict | None = None) -> None: ...
        def get_aux_array(self, key: str) -> tuple[np.ndarray, dict]: ...
        def aux_array_names(self) -> list[str]: ...

    # ------------------------------------------------------------------ public
    def search(self, query, column: int = 0) -> np.ndarray:
        """Sorted int64 positions of the last symbol of every occurrence of ``query`` in
        ``column`` (so ``s[p - len(query) + 1 : p + 1, column]`` equals it). ``query``: an
        integer array, or ``bytes``/``str`` on a text stream. Exact: recall and precision 1."""
        return self._search_index(column).search(self._search_query(query))

    def longest_suffix(self, query, k: int = 1, column: int = 0):
        """``(positions, lengths)``, int64: the ``k`` positions whose preceding symbols share
        the longest common suffix with ``query``, longest first, ties to the most recent."""
        return self._search_index(column).longest_suffix(self._search_query(query), k)

    def context(self, pos: int, before: int = 32, after: int = 32, column: int | None = None):
        """Rows ``[pos - before, pos + after]`` (clipped to the stream) around a hit, decoded
        from the store: ``(n, width)`` int64, ``(n,)`` for one column (or a width-1 stream),
        ``bytes`` on a text stream."""
        self._check_open()
        n = len(self)
        if n == 0:
            raise IndexError(f"stream {self.name!r} is empty: no context to read")
        pos = integer(pos, "pos", low=0, high=n - 1)
        before = integer(before, "before", low=0)
        after = integer(after, "after", low=0)
        rows = self.read(max(0, pos - before), min(n, pos + after + 1))
        if column is not None:
            return rows[:, self._search_column(column)]
        return rows[:, 0] if self.width == 1 else rows

    def build_index(self, column: int = 0, persist: bool = False) -> SuffixIndex:
        """Build (or bring up to date) the index of ``column`` now; with ``persist=True`` also
        store it in the archive (walk points and KD-trees as plain arrays, docs/format.md), so
        the next open restores it instead of recomputing it (needs a writable archive).
        Persisting commits this stream's buffered rows first: the stored index describes
        committed rows only."""
        key_column = self._search_column(column)  # a bad column commits nothing
        if persist:
            self._check_open()
            self._session.check_writable()
            if self._nbuf:
                self._session.commit([self._stage])
        index = self._search_index(column)
        if persist:
            c = self._stored.commit
            # every array carries the same tag, so a set torn by a killed writer is ignored
            tag = {"index_id": uuid.uuid4().hex, "length": c.length,
                   "generation": c.generation, "rewinds": c.rewinds,
                   "codec": str(self.codec.config()), "tree_format": TREE_FORMAT}
            for name, array in index.state().items():
                self.put_aux_array(_KEY.format(key_column, name), array, tag)
        return index

    def has_saved_index(self, column: int = 0) -> bool:
        """Whether the archive holds a stored index of ``column`` (``build_index(persist=
        True)``); a stale or damaged one is still rebuilt when a query runs."""
        names = set(self.aux_array_names())
        return all(_KEY.format(self._search_column(column), n) in names for n in _STATE)

    # ------------------------------------------------------------------ internals
    def _search_query(self, query):
        if isinstance(query, (str, bytes, bytearray, memoryview)):
            raise TypeError(f"stream {self.name!r} holds integer symbols: a query is a sequence "
                            f"of ints, not {type(query).__name__} (text queries are for text "
                            "streams)")
        return query

    def _search_column(self, column) -> int:
        return integer(column, "column", low=0, high=self.width - 1)

    def _search_index(self, column) -> SuffixIndex:
        self._check_open()
        column = self._search_column(column)
        n = len(self)
        index = self._search_indexes.get(column)
        if index is None:
            index = self._load_index(column, n)
            self._search_indexes[column] = index
        if len(index) > n:
            index.truncate(n)
        if len(index) < n:  # rows appended since the last query
            index.extend(self.read(len(index), n)[:, column])
        return index

    def _load_index(self, column: int, n: int) -> SuffixIndex:
        symbols = self.read(0, n)[:, column]
        # an untrusted stored walk could hide matches (a CRC-32 proves nothing against a
        # crafted file): rebuilt from the checksummed points, it costs one linear pass
        saved = self._saved_index_state(column) if self.trust_index else None
        if saved is not None:
            state, tree_format = saved
            return SuffixIndex.from_state(self.codec, symbols, state, tree_format)
        return SuffixIndex.build(self.codec, symbols)

    def _saved_index_state(self, column: int):
        """``(state, tree_format)`` of the persisted index of ``column`` if it is complete,
        intact and describes a prefix of the committed stream; else None (it is rebuilt)."""
        keys = {name: _KEY.format(column, name) for name in _STATE}
        if not set(keys.values()) <= set(self.aux_array_names()):
            return None
        c = self._stored.commit
        state: dict[str, np.ndarray] = {}
        tag: _Tag | None = None
        try:
            for name, key in keys.items():
                array, attrs = self.get_aux_array(key)
                this = _tag(attrs)
                if tag is None:
                    tag = this
                    if (tag is None or tag.rewinds != c.rewinds
                            or tag.generation > c.generation or tag.length > c.length
                            or tag.codec != str(self.codec.config())):
                        return None
                elif this != tag:  # arrays of different builds: a torn write
                    return None
                state[name] = array
        except RemoteArchiveError:  # the storage failed: not damage, say so
            raise
        except (ChecksumError, ArchiveFormatError, OSError):  # damaged: derived data, rebuild
            return None
        if (tag is None or state["walk"].shape != (tag.length, 2)  # tag: set by the loop
                or state["walk"].dtype.kind != "f" or not np.isfinite(state["walk"]).all()):
            return None
        return state, tag.tree_format

    def _search_truncated(self, n: int) -> None:
        for index in self._search_indexes.values():
            if len(index) > n:
                index.truncate(n)

    def _search_rewound(self) -> None:
        self._search_indexes.clear()
