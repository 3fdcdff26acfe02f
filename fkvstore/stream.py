"""Streams of an archive: :class:`Stream` (rows of W symbols) and :class:`TextStream` (bytes).

A stream reads its committed rows from :class:`~fkvstore._stored.StoredPoints` (verified,
cached chunks of walk points) and decodes them with its :class:`~fkvstore.codec.Codec`;
appended rows wait in a buffer until the archive's session commits them
(:meth:`~fkvstore._session.Session.commit`). Search comes from
:class:`~fkvstore.stream_search.SearchMixin`.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import h5py
import numpy as np

from fkvstore import _validate, layout
from fkvstore._attrs import Attrs, check_attrs_storable
from fkvstore._session import Pending, Session
from fkvstore._stored import StaleView, StoredPoints
from fkvstore.codec import Codec
from fkvstore.codec._kernels import grid_decode as _grid_decode
from fkvstore.errors import (
    ArchiveClosedError,
    ArchiveFormatError,
    ArchiveLockedError,
    ChecksumError,
    InvalidPointError,
    PositionError,
    StreamNotFoundError,
)
from fkvstore.stream_search import SearchMixin

__all__ = ["Stream", "TextStream"]

_READ_BATCH_ROWS = 1 << 16
_STALE_RETRIES = 8


def _symbol_dtype(alphabet_size: int) -> np.dtype:
    if alphabet_size <= 1 << 8:
        return np.dtype(np.uint8)
    if alphabet_size <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def _stored_codec(group_path: str, info: layout.StreamInfo) -> Codec:
    """The codec a stream group's ``fkv_codec`` describes; ArchiveFormatError when it is no
    valid codec (a span beyond what its alphabet and geometry allow, ...) or, for a text
    stream, not UTF-8 bytes (alphabet 256, width 1, grid)."""
    try:
        codec = Codec.from_config(info.codec_config)
    except (ValueError, TypeError) as exc:
        raise ArchiveFormatError(
            f"stream group {group_path!r} is damaged: fkv_codec={info.codec_config!r} is not a "
            f"valid codec ({exc})"
        ) from exc
    text = (codec.alphabet_size, codec.geometry, info.width) == (256, "grid", 1)
    if info.kind == "text" and not text:
        raise ArchiveFormatError(
            f"stream group {group_path!r} is damaged: a text stream has alphabet 256, grid "
            f"geometry and width 1, not fkv_codec={info.codec_config!r}, fkv_width={info.width}"
        )
    return codec


class Stream(SearchMixin):
    """Rows of ``width`` symbols from ``{0, ..., alphabet_size-1}``, stored in an archive.

    Reading: a stream reads like a numpy array of :attr:`shape` ``(len, width)``, or ``(len,)``
    when ``width == 1``, and dtype int64: ``len(s)``, ``s[i]`` (a ``(width,)`` row, or an int),
    ``s[i:j]`` and ``s[index_array]`` (``(n, width)``, or ``(n,)``), negative indices,
    ``s[rows, columns]`` as in numpy, iteration, ``np.asarray(s)``; :meth:`read` always gives
    ``(n, width)`` rows, whatever the width.
    Writing: :meth:`append`, :meth:`extend`, :meth:`truncate`. Reading one position decodes one
    span per column and reads (once, then cached) the chunk that holds it.

    Created by :class:`~fkvstore.archive.Archive`; ``group_path`` is the stream's HDF5 group,
    ``cache_bytes`` and ``spill_symbols`` as in :func:`fkvstore.open`.
    """

    def __init__(self, session: Session, name: str, group_path: str, info: layout.StreamInfo,
                 *, cache_bytes: int, spill_symbols: int):
        self._session = session
        self._writable = session.writable
        self._spill_symbols = spill_symbols
        self.name = name
        self.kind = info.kind
        self.codec = _stored_codec(group_path, info)
        self.width = info.width
        self.alphabet_size = self.codec.alphabet_size
        self.span = self.codec.span
        self.block_spans = info.block_spans
        self._dtype = _symbol_dtype(self.alphabet_size)
        # fast single-row path (grid only): the codec's kernel on a cached chunk, no slicing
        self._grid_args = self.codec.kernel_args() if self.codec.geometry == "grid" else None
        self._out = np.empty((1, self.width), dtype=np.int64)
        self._buf = np.empty((0, self.width), dtype=self._dtype)
        self._nbuf = 0
        self._detached = False
        self._search_indexes = {}
        self._group_path = group_path
        self._stored = StoredPoints(name, self.codec, self.width, self.block_spans, cache_bytes,
                                    session.writable, self._search_rewound)
        session.bind(group_path, self._stored.bind, detach=self._detach,
                     has_pending=self._has_pending, stage=self._stage)
        try:
            self._stored.load()
        except BaseException:
            session.unbind(group_path)  # a stream that cannot be read is not kept
            raise

    def _detach(self) -> None:
        self._detached = True
        self._stored.detach()

    def _check_open(self) -> None:
        if self._detached:
            raise ArchiveClosedError(
                f"stream {self.name!r} belongs to a closed archive (or was deleted); open the "
                "archive again"
            )

    # -- sizes and description -------------------------------------------------------------------
    def __len__(self) -> int:
        self._check_open()
        return self._stored.commit.length + self._nbuf

    @property
    def committed_length(self) -> int:
        """Rows made durable by the last commit (flush); ``len(s)`` adds the buffered rows."""
        self._check_open()
        return self._stored.commit.length

    @property
    def attrs(self) -> Attrs:
        """User metadata of this stream."""
        self._check_open()
        return Attrs(self._session, self._group_path)

    @property
    def cached_bytes(self) -> int:
        """Bytes of decoded-ready chunks this stream holds in its read cache (bounded by the
        archive's ``cache_bytes``, but at least one chunk: the most recently used, or for a
        writer with a partly filled last chunk, that chunk)."""
        self._check_open()
        return self._stored.cached_bytes

    def __repr__(self) -> str:
        state = "detached" if self._detached else f"{len(self)} rows"
        return (
            f"<fkvstore.{type(self).__name__} {self.name!r} of {self._session.path!r}: {state} x "
            f"width {self.width}, alphabet {self.alphabet_size}, {self.codec.geometry}, "
            f"span {self.span}>"
        )

    # -- reading ----------------------------------------------------------------------------------
    def _retry_stale(self, fn, *args):
        """``fn(*args)`` again after a StaleView, a bounded number of times."""
        for _ in range(_STALE_RETRIES):
            try:
                return fn(*args)
            except StaleView:
                continue
        raise ArchiveLockedError(
            f"stream {self.name!r} changed under {_STALE_RETRIES + 1} consecutive reads (a "
            "writer is committing faster than this reader reads); try again"
        )

    def _decode(self, start: int, stop: int) -> np.ndarray:
        """Committed rows ``[start, stop)``: (stop-start, width) int64."""
        m = self.span
        s0, s1 = start // m, (stop - 1) // m + 1
        pts = self._stored.span_points(s0, s1)
        count = min(self._stored.commit.length, s1 * m) - s0 * m
        try:
            out = self.codec.decode_range(pts, count, start - s0 * m, stop - s0 * m)
        except InvalidPointError as exc:
            raise ChecksumError(
                f"stream {self.name!r}: rows {start}..{stop - 1} do not decode ({exc}) although "
                "their checksum matches; the archive was written wrongly"
            ) from exc
        return np.asarray(out, dtype=np.int64).reshape(stop - start, self.width)

    def _rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` (0 <= start <= stop <= len), committed or buffered."""
        L = self._stored.commit.length
        if stop <= L:
            return self._decode(start, stop) if stop > start else self._empty()
        buffered = self._buf[max(start, L) - L : stop - L].astype(np.int64)
        if start >= L:
            return buffered
        return np.concatenate([self._decode(start, L), buffered])

    def _empty(self) -> np.ndarray:
        return np.empty((0, self.width), dtype=np.int64)

    def _row(self, i: int):
        stored = self._stored
        c = stored.commit
        L = c.length
        if i >= L:
            row = self._buf[i - L].astype(np.int64)
        else:
            m = self.span
            span = i // m
            off = i - span * m
            if span < c.full_spans:
                b = span // self.block_spans
                blk = stored.cached_block(b)
                if blk is None:
                    blk = stored.block(b)
                if self._grid_args is not None:
                    # the kernel reads the one symbol straight from the cached chunk
                    if (
                        _grid_decode(
                            blk, b * self.block_spans, L, i, i + 1, *self._grid_args, self._out
                        )
                        < 0
                    ):
                        return int(self._out[0, 0]) if self.width == 1 else self._out[0].copy()
                j = span - b * self.block_spans
                pts, count = blk[j : j + 1], m
            else:
                pts, count = stored.tail_point()[None], c.tail_count
            try:
                row = self.codec.decode_range(pts, count, off, off + 1)[0]
            except InvalidPointError as exc:
                raise ChecksumError(
                    f"stream {self.name!r}: row {i} does not decode ({exc})"
                ) from exc
        return int(row[0]) if self.width == 1 else np.asarray(row, dtype=np.int64)

    def __getitem__(self, key):
        try:
            if type(key) is int and not self._detached:  # the hot path: one row
                n = self._stored.commit.length + self._nbuf
                i = key + n if key < 0 else key
                if 0 <= i < n:
                    return self._row(i)
            return self._getitem(key)
        except StaleView:  # a reader took up a newer commit: read again (bounded)
            return self._retry_stale(self._getitem, key)

    def _getitem(self, key):
        self._check_open()
        n = self._stored.commit.length + self._nbuf
        if isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
            i = int(key)
            if i < 0:
                i += n
            if not 0 <= i < n:
                raise PositionError(
                    f"row {int(key)} out of range for stream {self.name!r} of {n} rows"
                )
            return self._row(i)
        if isinstance(key, tuple):  # (rows, columns), as numpy
            if len(key) > 2:
                raise IndexError(f"too many indices for stream {self.name!r}: {len(key)} given, "
                                 "at most 2 (rows, columns)")
            if len(key) < 2:
                return self._getitem(key[0] if key else slice(None))
            rows, columns = key
            one = isinstance(rows, (int, np.integer)) and not isinstance(rows, bool)
            picked = np.atleast_1d(self[rows]) if one else self._select(rows, n)
            try:
                return picked[columns] if one else picked[:, columns]
            except IndexError:
                raise IndexError(f"column index {columns!r} out of range for stream "
                                 f"{self.name!r} of width {self.width}") from None
        rows = self._select(key, n)
        return rows[:, 0] if self.width == 1 else rows

    def _select(self, key, n: int) -> np.ndarray:
        """The ``(m, width)`` rows a slice or an integer index array picks."""
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step == 1:
                return self._rows(start, max(start, stop))
            return self._fancy(np.arange(start, stop, step))
        idx = np.asarray(key)
        if idx.dtype == bool or idx.dtype.kind not in "iu":
            raise TypeError(
                f"stream indices must be ints, slices or integer arrays, got {type(key).__name__}"
                f" of dtype {idx.dtype}"
            )
        if idx.ndim != 1:
            raise ValueError(f"index arrays must be one-dimensional, got shape {idx.shape}")
        idx = idx.astype(np.int64)
        bad = (idx < -n) | (idx >= n)
        if bad.any():
            raise PositionError(
                f"row {int(idx[bad][0])} out of range for stream {self.name!r} of {n} rows"
            )
        return self._fancy(np.where(idx < 0, idx + n, idx))

    def _fancy(self, idx: np.ndarray) -> np.ndarray:
        out = np.empty((len(idx), self.width), dtype=np.int64)
        for k, i in enumerate(idx.tolist()):
            out[k] = self._row(i)
        return out

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows ``[start, stop)`` as an ``(n, width)`` int64 array (default: the whole stream),
        two-dimensional for every width."""
        return self._read_rows(slice(start, stop))

    def _read_rows(self, key: slice) -> np.ndarray:
        try:
            self._check_open()
            return self._select(key, len(self))
        except StaleView:
            return self._retry_stale(self._read_rows, key)

    @property
    def shape(self) -> tuple[int, ...]:
        """``(len, width)``, or ``(len,)`` for a width-1 stream: what ``np.asarray`` gives."""
        return (len(self),) if self.width == 1 else (len(self), self.width)

    @property
    def ndim(self) -> int:
        return 1 if self.width == 1 else 2

    @property
    def dtype(self) -> np.dtype:
        """The dtype of what reading returns (int64; the file stores fewer bytes)."""
        return np.dtype(np.int64)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        rows = self[:]
        return rows if dtype is None else rows.astype(dtype, copy=False)

    def __iter__(self) -> Iterator:
        self._check_open()
        n = len(self)
        for a in range(0, n, _READ_BATCH_ROWS):
            rows = self[a : min(n, a + _READ_BATCH_ROWS)]  # a reader may see a truncation
            if len(rows) == 0:
                return
            yield from (rows.tolist() if self.width == 1 else rows)

    # -- writing ----------------------------------------------------------------------------------
    def _check_symbols(self, rows, what: str, ndim: tuple[int, ...]) -> np.ndarray:
        return _validate.symbol_array(rows, self.alphabet_size, ndim=ndim,
                                      name=f"{what} of {self.name!r}")

    def _reserve(self, extra: int) -> None:
        need = self._nbuf + extra
        if need > len(self._buf):
            cap = max(need, 2 * len(self._buf), 1024)
            buf = np.empty((cap, self.width), dtype=self._dtype)
            buf[: self._nbuf] = self._buf[: self._nbuf]
            self._buf = buf

    def append(self, row) -> None:
        """Append one row: an int when width == 1, else a sequence/array of ``width`` ints."""
        self._check_open()
        if not self._writable:
            self._session.check_writable()
        if type(row) is int and self.width == 1:  # the hot path of a growing cache
            if not 0 <= row < self.alphabet_size:
                raise ValueError(
                    f"symbol {row} is outside 0..{self.alphabet_size - 1} (alphabet_size of "
                    f"stream {self.name!r}); nothing was appended"
                )
            if self._nbuf == len(self._buf):
                self._reserve(1)
            self._buf[self._nbuf, 0] = row
        else:
            arr = self._check_symbols(row, "row", (0, 1))
            if arr.shape not in ((self.width,), () if self.width == 1 else (self.width,)):
                raise ValueError(
                    f"a row of stream {self.name!r} has {self.width} symbol(s), got shape "
                    f"{arr.shape}; use extend() for several rows"
                )
            self._reserve(1)
            self._buf[self._nbuf] = arr
        self._nbuf += 1
        if self._nbuf * self.width >= self._spill_symbols:
            self._session.commit([self._stage])

    def extend(self, rows) -> None:
        """Append rows: an (n, width) integer array or sequence ((n,) also when width == 1)."""
        self._check_open()
        self._session.check_writable()
        arr = self._check_symbols(rows, "rows", (1, 2))
        if arr.ndim == 1 and (self.width == 1 or arr.size == 0):  # (n,), or [] at any width
            arr = arr.reshape(-1, self.width)
        if arr.ndim != 2 or arr.shape[1] != self.width:
            raise ValueError(
                f"stream {self.name!r} takes rows of width {self.width}: pass shape "
                f"(n, {self.width}){' or (n,)' if self.width == 1 else ''}, got {arr.shape}"
            )
        n = len(arr)
        if n == 0:
            return
        self._reserve(n)
        self._buf[self._nbuf : self._nbuf + n] = arr
        self._nbuf += n
        if self._nbuf * self.width >= self._spill_symbols:
            self._session.commit([self._stage])

    def _has_pending(self) -> bool:
        return self._nbuf > 0

    def _stage(self) -> Pending:
        """The buffered rows written to the file, waiting for their commit record."""
        pending = self._stored.stage_append(self._buf[: self._nbuf])

        def apply() -> None:
            pending.apply()
            self._nbuf = 0
            if len(self._buf) * self.width > (1 << 16):
                self._buf = np.empty((0, self.width), dtype=self._dtype)

        return Pending(pending.points, pending.record, apply)

    def truncate(self, n: int) -> None:
        """Drop rows ``n, n+1, ...``. Cutting into committed rows commits at once (durably)."""
        self._check_open()
        self._session.check_writable()
        n = _validate.integer(n, "the row count given to truncate")
        if not 0 <= n <= len(self):
            raise PositionError(
                f"cannot truncate stream {self.name!r} of {len(self)} rows to {n} rows"
            )
        committed = self._stored.commit.length
        self._search_truncated(n)
        if n >= committed:
            self._nbuf = n - committed
            return
        start = n - n % self.span
        open_rows = self._decode(start, n) if n > start else None
        self._session.commit([partial(self._stored.stage_truncate, n, open_rows)])
        self._nbuf = 0

    def refresh(self) -> None:
        """Reader side: pick up rows committed by a writer in another process since the last
        look (HDF5 SWMR). A writer's own streams are always current."""
        self._check_open()
        if self._writable:
            return
        self._stored.refresh()

    def verify(self, progress=None) -> list[str]:
        """Check every stored chunk's CRC-32, decode every span and check every aux array's
        CRC-32; return the problems found (empty when the stream is intact). ``progress(n)`` is
        called per chunk checked."""
        self._check_open()
        try:
            return self._verify(progress)
        except StaleView:  # a reader's view was outdated: check the writer's newer commit
            return self._retry_stale(self._verify, progress)

    def _verify(self, progress) -> list[str]:
        problems = []
        c, m, B = self._stored.commit, self.span, self.block_spans
        nblocks = -(-c.full_spans // B)
        for b in range(nblocks + (1 if c.tail_count else 0)):
            is_tail = b == nblocks
            s0 = c.full_spans if is_tail else b * B
            s1 = c.full_spans + 1 if is_tail else min(c.full_spans, (b + 1) * B)
            self._stored.forget(b)  # re-read from the file, do not trust the cache
            if is_tail:
                self._stored.forget(-1)
            try:
                self._decode(s0 * m, min(c.length, s1 * m))
            except (ChecksumError, InvalidPointError, ArchiveFormatError) as exc:
                problems.append(str(exc))
            if progress is not None:
                progress(1)
        problems += layout.attrs_problems(self._session.h5[self._group_path])
        try:  # derived data, but damage is damage (a link or an alias too)
            keys = self.aux_array_names()
        except ArchiveFormatError as exc:
            problems.append(str(exc))
            keys = []
        for key in keys:
            try:
                self.get_aux_array(key)
            except (ChecksumError, ArchiveFormatError) as exc:
                problems.append(str(exc))
        return problems

    # -- per-stream auxiliary arrays (derived data, e.g. a search index) ---------------------------
    def put_aux_array(self, key: str, array, attrs: dict | None = None) -> None:
        """Store a checksummed array beside this stream (under ``aux/<key>`` of its group),
        with optional attributes (e.g. the stream length it was derived from)."""
        self._check_open()
        _validate.object_name(key, "aux array")
        arr = _validate.storable_array(array, key)
        attrs = dict(attrs or {})
        self._session.check_writable()
        # before the file is touched: a failed attribute write inside it upsets HDF5's SWMR
        # state (seen with h5py 3.16), beyond what the unfinished-name write can undo
        check_attrs_storable(attrs, f"aux array {key!r}")
        with self._session.structural():
            group = self._session.h5[self._group_path]
            g = layout.child(group, layout.AUX) or group.create_group(layout.AUX)
            layout.put_checked_array(g, key, arr, attrs)

    def get_aux_array(self, key: str) -> tuple[np.ndarray, dict]:
        """The array stored under ``key`` and its attributes (CRC-checked)."""
        self._check_open()
        aux = layout.child(self._session.h5[self._group_path], layout.AUX)
        is_group = isinstance(aux, h5py.Group)
        ds = layout.child(aux, key) if is_group and isinstance(key, str) else None
        if ds is None:
            raise StreamNotFoundError(f"stream {self.name!r} has no aux array {key!r}")
        if not isinstance(ds, h5py.Dataset):
            raise ArchiveFormatError(f"stream {self.name!r}: aux {key!r} is not a dataset")
        with layout.damaged_metadata(f"the attributes of aux array {ds.name!r}"):
            attrs = {k: v for k, v in ds.attrs.items()
                     if not k.startswith(layout.RESERVED_PREFIX)}
        return layout.get_checked_array(ds), attrs

    def aux_array_names(self) -> list[str]:
        self._check_open()
        aux = layout.child(self._session.h5[self._group_path], layout.AUX)
        return layout.finished_names(aux) if isinstance(aux, h5py.Group) else []


class TextStream(Stream):
    """A stream of UTF-8 bytes (alphabet 256, width 1); positions are byte offsets.

    ``append`` and ``extend`` also take ``bytes`` or ``str`` (encoded as UTF-8);
    :meth:`bytes` and :meth:`text` read ranges back.
    """

    def append(self, row) -> None:
        if isinstance(row, str):
            return self.extend(row)
        if isinstance(row, (bytes, bytearray)) and len(row) == 1:
            row = row[0]
        return super().append(row)

    def extend(self, rows) -> None:
        if isinstance(rows, str):
            rows = rows.encode("utf-8")
        if isinstance(rows, (bytes, bytearray, memoryview)):
            rows = np.frombuffer(bytes(rows), dtype=np.uint8)
        return super().extend(rows)

    def _search_query(self, query):
        return query.encode("utf-8") if isinstance(query, str) else query

    def context(self, pos: int, before: int = 32, after: int = 32, column=None) -> bytes:
        """Bytes ``[pos - before, pos + after]`` (clipped) around a hit, from the store
        (``column``: None or 0, the one a text stream has)."""
        if column is not None:
            self._search_column(column)  # ValueError past column 0
        return super().context(pos, before, after).astype(np.uint8).tobytes()

    def bytes(self, start: int = 0, stop: int | None = None) -> bytes:
        """Bytes ``[start, stop)`` of the stream."""
        return self[slice(start, stop)].astype(np.uint8).tobytes()

    def text(self, start: int = 0, stop: int | None = None, errors: str = "replace") -> str:
        """Bytes ``[start, stop)`` decoded as UTF-8 (a cut character follows ``errors``)."""
        return self.bytes(start, stop).decode("utf-8", errors)
