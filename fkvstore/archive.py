"""The persistent archive: named symbol streams in one HDF5 file.

``fkvstore.open(path, mode)`` returns an :class:`Archive`. A :class:`Stream` of width W holds rows
of W symbols from one alphabet; rows are appended, read back by position in O(1) and can be
truncated. Appends are buffered in memory and become durable at :meth:`Archive.flush` (also run
by :meth:`Archive.close` and whenever a stream's buffer passes ``spill_symbols``).

Writers work in HDF5's single-writer/multiple-reader (SWMR) mode, so readers in other processes
can follow a growing archive and a killed writer leaves a readable file; see ``docs/archive.md``
for the guarantees and ``docs/format.md`` for the layout.
"""

from __future__ import annotations

import os
import re
import time
from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager

import h5py
import numpy as np

from fkvstore import layout
from fkvstore._codec_kernels import grid_decode as _grid_decode
from fkvstore._lock import WriterLock
from fkvstore._superblock import clear_status_flags, open_cleared_view, read_superblock
from fkvstore._validate import symbol_array
from fkvstore.codec import Codec
from fkvstore.errors import (
    ArchiveClosedError,
    ArchiveExistsError,
    ArchiveFormatError,
    ArchiveLockedError,
    ArchiveNotFoundError,
    ArchiveReadOnlyError,
    ChecksumError,
    FkvError,
    InvalidPointError,
    PositionError,
    StreamNotFoundError,
)
from fkvstore.layout import Commit
from fkvstore.stream_search import SearchMixin

__all__ = ["Archive", "Stream", "TextStream", "open"]

MODES = ("r", "r+", "a", "w", "w-", "x")
LIBVER = ("v110", "v110")  # the oldest format with SWMR: readable by HDF5 >= 1.10
DEFAULT_CACHE_BYTES = 64 << 20
DEFAULT_SPILL_SYMBOLS = 1 << 22
TEXT_ALPHABET = 256
_NAME = re.compile(r"^[^/.][^/]*$")
_READ_BATCH_ROWS = 1 << 16
_MAX_CHUNK_BYTES = (1 << 32) - 1  # HDF5 refuses larger chunks


def _library_version() -> str:
    from fkvstore import __version__

    return __version__


def _check_name(name: object, what: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"{what} name must be a str, got {type(name).__name__} {name!r}")
    if not _NAME.match(name):
        raise ValueError(
            f"invalid {what} name {name!r}: use a non-empty name without '/' that does not "
            "start with '.'"
        )
    return name


def _symbol_dtype(alphabet_size: int) -> np.dtype:
    if alphabet_size <= 1 << 8:
        return np.dtype(np.uint8)
    if alphabet_size <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def open(  # noqa: A001 - mirrors h5py.File / builtins.open on purpose
    path: str | os.PathLike,
    mode: str = "r",
    *,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    spill_symbols: int = DEFAULT_SPILL_SYMBOLS,
) -> Archive:
    """Open the archive at ``path``.

    Modes as in h5py: ``"r"`` read only (the file must exist), ``"r+"`` read/write (must exist),
    ``"a"`` read/write, created if missing, ``"w"`` create, replacing an existing file,
    ``"w-"`` or ``"x"`` create, failing if the file exists. Only one writer may have a file open
    (:class:`~fkvstore.errors.ArchiveLockedError` otherwise); any number of ``"r"`` readers may
    follow it. ``cache_bytes`` bounds the decoded-chunk cache of each stream; ``spill_symbols`` is
    the number of buffered symbols per stream after which appends are committed automatically.
    """
    return Archive(path, mode, cache_bytes=cache_bytes, spill_symbols=spill_symbols)


class _Attrs(MutableMapping):
    """User attributes of an archive or stream (names starting with ``fkv_`` are reserved)."""

    def __init__(self, owner: Archive, group_path: str):
        self._owner = owner
        self._path = group_path

    def _group(self) -> h5py.Group:
        return self._owner._h5()[self._path]

    def _check_key(self, key: object) -> str:
        if not isinstance(key, str):
            raise TypeError(f"attribute names are str, got {type(key).__name__} {key!r}")
        if key.startswith(layout.RESERVED_PREFIX):
            raise ValueError(
                f"attribute name {key!r} is reserved (prefix {layout.RESERVED_PREFIX!r}); "
                "choose another name"
            )
        return key

    def __getitem__(self, key: str):
        if not isinstance(key, str) or key.startswith(layout.RESERVED_PREFIX):
            raise KeyError(key)
        value = self._group().attrs[key]
        return value.decode("utf-8") if isinstance(value, bytes) else value

    def __setitem__(self, key: str, value) -> None:
        key = self._check_key(key)
        with self._owner._structural():
            self._group().attrs[key] = value

    def __delitem__(self, key: str) -> None:
        key = self._check_key(key)
        if key not in self:
            raise KeyError(key)
        with self._owner._structural():
            del self._group().attrs[key]

    def __iter__(self) -> Iterator[str]:
        keys = list(self._group().attrs.keys())
        return iter([k for k in keys if not k.startswith(layout.RESERVED_PREFIX)])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"<fkvstore attrs {dict(self.items())!r}>"


class Archive:
    """Named streams and auxiliary arrays in one HDF5 file. Create with :func:`fkvstore.open`.

    Supports ``with``, ``ar[name]``, ``name in ar``, ``for name in ar``, ``len(ar)`` and
    ``del ar[name]``. One Archive object must not be used from several threads at once.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        mode: str = "r",
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        spill_symbols: int = DEFAULT_SPILL_SYMBOLS,
    ):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {', '.join(map(repr, MODES))}")
        for what, v in (("cache_bytes", cache_bytes), ("spill_symbols", spill_symbols)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{what} must be a positive int, got {v!r}")
        self.path = os.fspath(path)
        self.mode = mode
        self.cache_bytes = int(cache_bytes)
        self.spill_symbols = int(spill_symbols)
        self._file: h5py.File | None = None
        self._lock: WriterLock | None = None
        self._swmr = False
        self._streams: dict[str, Stream] = {}
        self.writable = mode != "r"
        if mode == "a":
            mode = "r+" if os.path.exists(self.path) else "w"
        if mode == "r":
            self._file = _open_reader(self.path)
        elif mode == "r+":
            self._open_writer_existing()
        else:
            self._create(exclusive=mode in ("w-", "x"))

    # -- opening ------------------------------------------------------------------------------
    def _open_writer_existing(self) -> None:
        if not os.path.exists(self.path):
            raise ArchiveNotFoundError(
                f"no archive at {self.path!r}; open it with mode 'a' or 'w' to create one"
            )
        self._lock = WriterLock(self.path, create=False)
        try:
            _recover_if_needed(self.path)
            try:
                self._file = _h5_open(self.path, "r+")
            except (OSError, RuntimeError) as exc:
                raise ArchiveFormatError(
                    f"{self.path!r} cannot be opened as an HDF5 archive ({exc}); it may be "
                    "truncated or damaged"
                ) from exc
            layout.check_format(self._file, self.path)
            self._enter_swmr()
        except BaseException:
            self._abandon()
            raise

    def _create(self, exclusive: bool) -> None:
        try:
            self._lock = WriterLock(self.path, create=True, exclusive_create=exclusive)
        except FileExistsError:
            raise ArchiveExistsError(
                f"{self.path!r} already exists; open it with mode 'a' or 'r+' to add to it, "
                "or 'w' to replace it"
            ) from None
        try:
            self._file = h5py.File(self.path, "w", libver=LIBVER, locking=False)
            layout.init_file(self._file, _library_version())
            self._enter_swmr()
        except BaseException:
            self._abandon()
            raise

    def _abandon(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            finally:
                self._file = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _enter_swmr(self) -> None:
        self._file.flush()
        self._file.swmr_mode = True
        self._swmr = True

    @contextmanager
    def _structural(self):
        """Run a change of the file's structure (new objects, attributes) outside SWMR mode.

        HDF5 keeps the file consistent for readers and against a killed writer only for appends
        made in SWMR mode; creating objects or attributes is not covered, so the file is reopened
        in ordinary mode for the change and goes back to SWMR mode right after.
        """
        self._check_writable()
        if self._swmr:
            self._file.close()
            self._file = _h5_open(self.path, "r+")
            self._swmr = False
            for s in self._streams.values():
                s._bind(self._file[f"{layout.STREAMS}/{s.name}"])
        try:
            yield
        finally:
            self._enter_swmr()

    # -- state -------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._file is None

    def _h5(self) -> h5py.File:
        if self._file is None:
            raise ArchiveClosedError(
                f"archive {self.path!r} is closed; open it again with fkvstore.open()"
            )
        return self._file

    def _check_writable(self) -> None:
        self._h5()
        if not self.writable:
            raise ArchiveReadOnlyError(
                f"archive {self.path!r} is open read-only (mode 'r'); open it with mode 'a' or "
                "'r+' to change it"
            ) from None

    def __repr__(self) -> str:
        if self.closed:
            return f"<fkvstore.Archive {self.path!r} (closed)>"
        n = len(self._h5()[layout.STREAMS])
        return f"<fkvstore.Archive {self.path!r} mode={self.mode!r}, {n} stream(s)>"

    def __enter__(self) -> Archive:
        self._h5()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def attrs(self) -> _Attrs:
        """User metadata of the archive (a mutable mapping over the root group's attributes)."""
        self._h5()
        return _Attrs(self, "/")

    # -- streams -----------------------------------------------------------------------------
    def create_stream(
        self,
        name: str,
        alphabet_size: int,
        *,
        geometry: str = "grid",
        width: int = 1,
        ratio: float | None = None,
        span: int | None = None,
        chunk_bytes: int = layout.DEFAULT_CHUNK_BYTES,
    ) -> Stream:
        """Create an empty stream of rows of ``width`` symbols in ``{0, ..., alphabet_size-1}``.

        ``geometry``, ``ratio`` and ``span`` go to :class:`fkvstore.codec.Codec`; ``chunk_bytes``
        is the target size of one stored chunk (the unit of checksums and of disk reads).
        """
        return self._create_stream(
            name, alphabet_size, geometry, width, ratio, span, chunk_bytes, kind="symbols"
        )

    def create_text_stream(
        self, name: str, *, chunk_bytes: int = layout.DEFAULT_CHUNK_BYTES
    ) -> TextStream:
        """Create an empty stream of UTF-8 bytes (alphabet 256, grid geometry, width 1)."""
        return self._create_stream(name, TEXT_ALPHABET, "grid", 1, None, None, chunk_bytes, "text")

    def _create_stream(self, name, alphabet_size, geometry, width, ratio, span, chunk_bytes, kind):
        _check_name(name, "stream")
        self._check_writable()
        if isinstance(width, bool) or not isinstance(width, (int, np.integer)) or width < 1:
            raise ValueError(f"width must be a positive int, got {width!r}")
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, (int, np.integer)):
            raise TypeError(f"chunk_bytes must be an int, got {chunk_bytes!r}")
        if chunk_bytes < 16:
            raise ValueError(f"chunk_bytes must be at least 16, got {chunk_bytes}")
        if chunk_bytes > _MAX_CHUNK_BYTES:
            raise ValueError(
                f"chunk_bytes must be below 4 GiB (HDF5's limit on one chunk), got {chunk_bytes}"
            )
        if 16 * width > _MAX_CHUNK_BYTES:
            raise ValueError(
                f"width {width} makes one stored row {16 * width} bytes, beyond HDF5's 4 GiB "
                f"limit on one chunk; use width <= {_MAX_CHUNK_BYTES // 16}"
            )
        if name in self:
            raise ValueError(
                f"a stream named {name!r} already exists in {self.path!r}; use ar[{name!r}] or "
                "delete it first"
            )
        codec = Codec(alphabet_size, geometry=geometry, ratio=ratio, span=span)
        with self._structural():
            streams = self._file[layout.STREAMS]
            try:
                layout.create_stream_group(
                    streams,
                    name,
                    kind=kind,
                    codec_config=codec.config(),
                    width=int(width),
                    block_spans=layout.block_spans_for(int(width), int(chunk_bytes)),
                )
            except BaseException:
                if name in streams:  # leave no half-created stream behind
                    del streams[name]
                raise
        return self[name]

    def __getitem__(self, name: str) -> Stream:
        f = self._h5()
        s = self._streams.get(name)
        if s is not None:
            return s
        try:
            found = isinstance(name, str) and name in f[layout.STREAMS]
        except (OSError, RuntimeError, KeyError) as exc:
            raise ArchiveFormatError(f"{self.path!r} is damaged: {exc}") from exc
        if not found:
            known = ", ".join(map(repr, self)) or "none"
            raise StreamNotFoundError(
                f"no stream {name!r} in {self.path!r} (streams: {known}); create it with "
                "create_stream()"
            )
        try:
            g = f[layout.STREAMS][name]
            info = layout.read_stream_info(g)
            cls = TextStream if info.kind == "text" else Stream
            s = cls(self, name, g, info)
        except (OSError, RuntimeError, KeyError) as exc:
            raise ArchiveFormatError(
                f"stream {name!r} of {self.path!r} cannot be read ({exc}); the file is damaged"
            ) from exc
        self._streams[name] = s
        return s

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._h5()[layout.STREAMS]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._h5()[layout.STREAMS].keys()))

    def __len__(self) -> int:
        return len(self._h5()[layout.STREAMS])

    def keys(self) -> list[str]:
        """Names of the streams."""
        return list(self)

    def __delitem__(self, name: str) -> None:
        """Delete a stream (its file space is not reclaimed; ``h5repack`` compacts a file)."""
        self._check_writable()
        if name not in self:
            raise StreamNotFoundError(f"no stream {name!r} in {self.path!r} to delete")
        with self._structural():
            del self._file[layout.STREAMS][name]
        s = self._streams.pop(name, None)
        if s is not None:
            s._detach()

    # -- auxiliary arrays ----------------------------------------------------------------------
    def put_array(self, name: str, array) -> None:
        """Store ``array`` (numeric, bool or fixed-size bytes ``S``) under ``name``, replacing
        an array of that name; it is checksummed and written durably before this returns."""
        _check_name(name, "array")
        self._check_writable()
        arr = _checked_array(array, name)
        with self._structural():
            layout.put_checked_array(self._file[layout.ARRAYS], name, arr)

    def get_array(self, name: str) -> np.ndarray:
        """The array stored under ``name``; ChecksumError when its bytes were damaged."""
        g = self._h5()[layout.ARRAYS]
        if not isinstance(name, str) or name not in g:
            known = ", ".join(map(repr, g.keys())) or "none"
            raise StreamNotFoundError(f"no array {name!r} in {self.path!r} (arrays: {known})")
        return layout.get_checked_array(g[name])

    def array_names(self) -> list[str]:
        """Names of the auxiliary arrays."""
        return layout.finished_names(self._h5()[layout.ARRAYS])

    def delete_array(self, name: str) -> None:
        self._check_writable()
        if name not in self.array_names():
            raise StreamNotFoundError(f"no array {name!r} in {self.path!r} to delete")
        with self._structural():
            del self._file[layout.ARRAYS][name]

    # -- durability ----------------------------------------------------------------------------
    def flush(self) -> None:
        """Commit every stream's buffered rows. When this returns they survive a killed process
        (not a power failure: the file is not fsynced)."""
        self._check_writable()
        self._commit([s for s in self._streams.values() if s._nbuf])

    def _commit(self, streams: list[Stream]) -> None:
        """Two-phase commit: data, then (after an HDF5 flush) the commit records."""
        if not streams:
            return
        f = self._h5()
        if not self._swmr:
            self._enter_swmr()
        staged = [(s, s._stage()) for s in streams]
        f.flush()
        for s, st in staged:
            layout.write_commit(s._points, st.commit)
        f.flush()
        for s, st in staged:
            s._apply(st)

    def verify(self, progress=None) -> dict[str, list[str]]:
        """Check every stream (:meth:`Stream.verify`) and array; ``{name: problems}`` with an
        entry for every stream and array (``arrays/<name>`` for arrays), empty lists when intact."""
        report = {}
        for name in self:
            try:
                report[name] = self[name].verify(progress)
            except FkvError as exc:
                report[name] = [str(exc)]
        for name in self.array_names():
            try:
                self.get_array(name)
                report[f"arrays/{name}"] = []
            except FkvError as exc:
                report[f"arrays/{name}"] = [str(exc)]
        return report

    def refresh(self) -> None:
        """Reader side: see what the writer has committed since this archive was opened."""
        self._h5()
        for s in self._streams.values():
            s.refresh()

    def close(self) -> None:
        """Commit buffered rows, close the file and release the writer lock. Idempotent."""
        if self._file is None:
            return
        try:
            if self.writable:
                self._commit([s for s in self._streams.values() if s._nbuf])
        finally:
            for s in self._streams.values():
                s._detach()
            self._streams.clear()
            self._abandon()


class _StaleView(Exception):
    """Internal: a reader's commit record was outdated and has been refreshed; retry."""


_STALE_RETRIES = 8


class _Staged:
    __slots__ = ("commit", "blocks", "crcs", "tail")

    def __init__(self, commit, blocks, crcs, tail):
        self.commit = commit
        self.blocks = blocks
        self.crcs = crcs
        self.tail = tail


class Stream(SearchMixin):
    """Rows of ``width`` symbols from ``{0, ..., alphabet_size-1}``, stored in an archive.

    Reading: ``len(s)``, ``s[i]`` (shape (width,) int64, or an int when width == 1), ``s[i:j]``
    and ``s[index_array]`` (shape (n, width) int64), negative indices, ``s[rows, columns]`` as in
    numpy, iteration, :meth:`read`.
    Writing: :meth:`append`, :meth:`extend`, :meth:`truncate`. Reading one position decodes one
    span per column and reads (once, then cached) the chunk that holds it.
    """

    def __init__(self, archive: Archive, name: str, group: h5py.Group, info: layout.StreamInfo):
        self._ar = archive
        self.name = name
        self.kind = info.kind
        self.codec = Codec.from_config(info.codec_config)
        self.width = info.width
        self.alphabet_size = self.codec.alphabet_size
        self.span = self.codec.span
        self.block_spans = info.block_spans
        self._block_bytes = self.block_spans * self.width * 16
        self._dtype = _symbol_dtype(self.alphabet_size)
        # fast single-row path (grid only): the codec's kernel on a cached chunk, no slicing
        self._grid_args = self.codec.kernel_args() if self.codec.geometry == "grid" else None
        self._out = np.empty((1, self.width), dtype=np.int64)
        self._buf = np.empty((0, self.width), dtype=self._dtype)
        self._nbuf = 0
        self._blocks: OrderedDict[int, np.ndarray] = OrderedDict()
        self._tail: np.ndarray | None = None
        self._detached = False
        self._search_indexes = {}
        self._bind(group)
        self._load_commit()

    # -- binding to the file ---------------------------------------------------------------------
    def _bind(self, group: h5py.Group) -> None:
        self._group_path = group.name
        self._points = group[layout.POINTS]
        self._tail_ds = group[layout.TAIL]
        self._crc_ds = group[layout.BLOCK_CRC]

    def _detach(self) -> None:
        self._detached = True
        self._points = self._tail_ds = self._crc_ds = None

    def _check_open(self) -> None:
        if self._detached:
            raise ArchiveClosedError(
                f"stream {self.name!r} belongs to a closed archive (or was deleted); open the "
                "archive again"
            )

    def _load_commit(self) -> None:
        c = _read_commit_checked(self._points, self.span)
        nblocks = c.full_spans // self.block_spans
        if self._crc_ds.shape[0] < nblocks:
            raise ArchiveFormatError(
                f"stream {self.name!r}: {nblocks} block checksums expected, "
                f"{self._crc_ds.shape[0]} stored; the file is damaged"
            )
        self._crcs = [int(v) for v in self._crc_ds[:nblocks]] if nblocks else []
        self._commit = c

    # -- sizes and description -------------------------------------------------------------------
    def __len__(self) -> int:
        self._check_open()
        return self._commit.length + self._nbuf

    @property
    def committed_length(self) -> int:
        """Rows made durable by the last commit (flush); ``len(s)`` adds the buffered rows."""
        self._check_open()
        return self._commit.length

    @property
    def attrs(self) -> _Attrs:
        """User metadata of this stream."""
        self._check_open()
        return _Attrs(self._ar, self._group_path)

    def __repr__(self) -> str:
        state = "detached" if self._detached else f"{len(self)} rows"
        return (
            f"<fkvstore.{type(self).__name__} {self.name!r} of {self._ar.path!r}: {state} x "
            f"width {self.width}, alphabet {self.alphabet_size}, {self.codec.geometry}, "
            f"span {self.span}>"
        )

    # -- reading ----------------------------------------------------------------------------------
    def _block(self, b: int) -> np.ndarray:
        """Verified rows of stored chunk ``b``: (rows, width, 2) float64, rows <= block_spans."""
        blk = self._blocks.get(b)
        if blk is not None:
            self._blocks.move_to_end(b)
            return blk
        full = self._commit.full_spans
        rows = min(self.block_spans, full - b * self.block_spans)
        try:
            blk = layout.read_block(self._points, b, self.block_spans, rows)
        except (OSError, ValueError) as exc:
            self._raise_if_stale()
            raise ChecksumError(
                f"stream {self.name!r}: chunk {b} cannot be read ({exc}); the file is damaged"
            ) from exc
        expected = self._crcs[b] if rows == self.block_spans else self._commit.partial_crc
        if layout.checksum(blk) != expected:
            self._raise_if_stale()
            raise ChecksumError(
                f"stream {self.name!r}: chunk {b} (spans {b * self.block_spans}.."
                f"{b * self.block_spans + rows - 1}) does not match its CRC-32; the file is "
                "damaged there (run `fkv verify` for a full report)"
            )
        self._blocks[b] = blk
        if len(self._blocks) * self._block_bytes > self._ar.cache_bytes:
            self._evict()
        return blk

    def _evict(self, keep: int | None = None) -> None:
        """Drop least recently used chunks until the cache fits ``cache_bytes`` (counting whole
        chunks). One chunk always stays: ``keep`` when given, else the most recently used."""
        blocks, budget = self._blocks, self._ar.cache_bytes
        while len(blocks) > 1 and len(blocks) * self._block_bytes > budget:
            b = next(iter(blocks))
            if b == keep:
                blocks.move_to_end(b)
                continue
            del blocks[b]

    @property
    def cached_bytes(self) -> int:
        """Bytes of decoded-ready chunks this stream holds in its read cache (bounded by the
        archive's ``cache_bytes``, but at least one chunk: the most recently used, or for a
        writer with a partly filled last chunk, that chunk)."""
        self._check_open()
        return sum(blk.nbytes for blk in self._blocks.values())

    def _tail_point(self) -> np.ndarray:
        """The verified point of the open span, (width, 2) float64."""
        if self._tail is None:
            c = self._commit
            try:
                t = layout.read_tail(self._tail_ds, c.tail_slot)
            except (OSError, ValueError) as exc:
                self._raise_if_stale()
                raise ChecksumError(f"stream {self.name!r}: tail unreadable ({exc})") from exc
            if layout.checksum(t) != c.tail_crc:
                self._raise_if_stale()
                raise ChecksumError(
                    f"stream {self.name!r}: the open span's point does not match its CRC-32; "
                    "the file is damaged"
                )
            self._tail = t
        return self._tail

    def _raise_if_stale(self) -> None:
        """Called before reporting a bad checksum. A reader loads chunks and the open span
        lazily, so a writer may have reused their file space (the inactive tail slot, chunks
        past a truncation) since this reader last read the commit record: if a new commit
        exists, take it up and raise _StaleView so that the caller retries."""
        if self._ar.writable:
            return
        generation = self._commit.generation
        self.refresh()
        if self._commit.generation != generation:
            raise _StaleView

    def _retry_stale(self, fn, *args):
        """``fn(*args)`` again after a _StaleView, a bounded number of times."""
        for _ in range(_STALE_RETRIES):
            try:
                return fn(*args)
            except _StaleView:
                continue
        raise ArchiveLockedError(
            f"stream {self.name!r} changed under {_STALE_RETRIES + 1} consecutive reads (a "
            "writer is committing faster than this reader reads); try again"
        )

    def _span_points(self, s0: int, s1: int) -> np.ndarray:
        """Stored points of spans ``[s0, s1)``, (s1-s0, width, 2) float64, all verified."""
        full = self._commit.full_spans
        B = self.block_spans
        parts = []
        s = s0
        while s < min(s1, full):
            b = s // B
            blk = self._block(b)
            hi = min(s1, full, (b + 1) * B)
            parts.append(blk[s - b * B : hi - b * B])
            s = hi
        if s1 > full:
            parts.append(self._tail_point()[None])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _decode(self, start: int, stop: int) -> np.ndarray:
        """Committed rows ``[start, stop)``: (stop-start, width) int64."""
        m = self.span
        s0, s1 = start // m, (stop - 1) // m + 1
        pts = self._span_points(s0, s1)
        count = min(self._commit.length, s1 * m) - s0 * m
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
        L = self._commit.length
        if stop <= L:
            return self._decode(start, stop) if stop > start else self._empty()
        buffered = self._buf[max(start, L) - L : stop - L].astype(np.int64)
        if start >= L:
            return buffered
        return np.concatenate([self._decode(start, L), buffered])

    def _empty(self) -> np.ndarray:
        return np.empty((0, self.width), dtype=np.int64)

    def _row(self, i: int):
        L = self._commit.length
        if i >= L:
            row = self._buf[i - L].astype(np.int64)
        else:
            m = self.span
            span = i // m
            off = i - span * m
            if span < self._commit.full_spans:
                b = span // self.block_spans
                blk = self._blocks.get(b)
                if blk is None:
                    blk = self._block(b)
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
                pts, count = self._tail_point()[None], self._commit.tail_count
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
                n = self._commit.length + self._nbuf
                i = key + n if key < 0 else key
                if 0 <= i < n:
                    return self._row(i)
            return self._getitem(key)
        except _StaleView:  # a reader took up a newer commit: read again (bounded)
            return self._retry_stale(self._getitem, key)

    def _getitem(self, key):
        self._check_open()
        n = self._commit.length + self._nbuf
        if isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
            i = int(key)
            if i < 0:
                i += n
            if not 0 <= i < n:
                raise PositionError(
                    f"row {int(key)} out of range for stream {self.name!r} of {n} rows"
                )
            return self._row(i)
        if isinstance(key, tuple) and len(key) == 2:  # (rows, columns), as numpy
            rows = self[key[0]]
            if np.ndim(rows) < 2:
                return np.atleast_1d(rows)[key[1]]
            return rows[:, key[1]]
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
        """Rows ``[start, stop)`` as an (n, width) int64 array (default: the whole stream)."""
        return self[slice(start, stop)]

    def __iter__(self) -> Iterator:
        self._check_open()
        n = len(self)
        for a in range(0, n, _READ_BATCH_ROWS):
            rows = self[a : min(n, a + _READ_BATCH_ROWS)]  # a reader may see a truncation
            if len(rows) == 0:
                return
            if self.width == 1:
                yield from (int(v) for v in rows[:, 0])
            else:
                yield from rows

    # -- writing ----------------------------------------------------------------------------------
    def _check_symbols(self, rows, what: str, ndim: tuple[int, ...]) -> np.ndarray:
        return symbol_array(rows, self.alphabet_size, ndim=ndim, name=f"{what} of {self.name!r}")

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
        if self._ar._file is None or not self._ar.writable:
            self._ar._check_writable()
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
        if self._nbuf * self.width >= self._ar.spill_symbols:
            self._ar._commit([self])

    def extend(self, rows) -> None:
        """Append rows: an (n, width) integer array or sequence ((n,) also when width == 1)."""
        self._check_open()
        self._ar._check_writable()
        arr = self._check_symbols(rows, "rows", (1, 2))
        if arr.ndim == 1 and self.width == 1:
            arr = arr[:, None]
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
        if self._nbuf * self.width >= self._ar.spill_symbols:
            self._ar._commit([self])

    def _stage(self) -> _Staged:
        """Write buffered rows as complete spans, block checksums and a new tail (not committed)."""
        c = self._commit
        m, B = self.span, self.block_spans
        syms = self._buf[: self._nbuf]
        tail = self._tail_point() if c.tail_count else None
        pts = np.asarray(self.codec.extend(tail, c.tail_count, syms), dtype=np.float64)
        pts = pts.reshape(-1, self.width, 2)
        length = c.length + self._nbuf
        full, tail_count = divmod(length, m)
        ncomplete = full - c.full_spans
        if len(pts) != ncomplete + (1 if tail_count else 0):
            raise FkvError(
                f"codec returned {len(pts)} points for {ncomplete} complete span(s) and "
                f"{'an' if tail_count else 'no'} open one"
            )
        blocks: dict[int, np.ndarray] = {}
        crcs: list[int] = []
        partial_crc = c.partial_crc
        if ncomplete:
            if self._points.shape[0] < full:
                self._points.resize(full, axis=0)
            b0 = c.full_spans // B
            first = c.full_spans - b0 * B
            rows = pts[:ncomplete]
            if first:
                rows = np.concatenate([self._block(b0)[:first], rows])
            for k in range(0, len(rows), B):
                chunk = rows[k : k + B]
                layout.write_block(self._points, b0 + k // B, B, chunk)
                blocks[b0 + k // B] = chunk
                if len(chunk) == B:
                    crcs.append(layout.checksum(chunk))
            rest = len(rows) % B
            partial_crc = layout.checksum(rows[len(rows) - rest :]) if rest else 0
            if crcs:
                n0 = b0
                if self._crc_ds.shape[0] < n0 + len(crcs):
                    self._crc_ds.resize(n0 + len(crcs), axis=0)
                self._crc_ds[n0 : n0 + len(crcs)] = np.array(crcs, dtype=layout.CRC_DTYPE)
        slot, tail_crc, new_tail = c.tail_slot, 0, None
        if tail_count:
            slot = 1 - c.tail_slot  # the committed slot stays intact until the commit
            new_tail = np.ascontiguousarray(pts[-1])
            layout.write_tail(self._tail_ds, slot, new_tail)
            tail_crc = layout.checksum(new_tail)
        commit = Commit(
            length, full, slot, tail_count, partial_crc, tail_crc, c.generation + 1, c.rewinds
        )
        return _Staged(commit, blocks, crcs, new_tail)

    def _apply(self, st: _Staged) -> None:
        self._commit = st.commit
        self._crcs.extend(st.crcs)
        for b, rows in st.blocks.items():
            self._blocks[b] = rows
        c, B = st.commit, self.block_spans
        # the partial last chunk stays: the next flush appends to it
        self._evict(keep=c.full_spans // B if c.full_spans % B else None)
        self._tail = st.tail
        self._nbuf = 0
        if len(self._buf) * self.width > (1 << 16):
            self._buf = np.empty((0, self.width), dtype=self._dtype)

    def truncate(self, n: int) -> None:
        """Drop rows ``n, n+1, ...``. Cutting into committed rows commits at once (durably)."""
        self._check_open()
        self._ar._check_writable()
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"truncate takes an int row count, got {type(n).__name__} {n!r}")
        n = int(n)
        if not 0 <= n <= len(self):
            raise PositionError(
                f"cannot truncate stream {self.name!r} of {len(self)} rows to {n} rows"
            )
        c = self._commit
        self._search_truncated(n)
        if n >= c.length:
            self._nbuf = n - c.length
            return
        m, B = self.span, self.block_spans
        full, tail_count = divmod(n, m)
        slot, tail_crc, new_tail = c.tail_slot, 0, None
        if tail_count:
            keep = self._decode(full * m, n)
            new_tail = np.ascontiguousarray(
                np.asarray(self.codec.encode(keep), dtype=np.float64).reshape(self.width, 2)
            )
        b = full // B
        first = full - b * B
        partial = self._block(b)[:first].copy() if first else None
        ar = self._ar
        if not ar._swmr:
            ar._enter_swmr()
        if tail_count:
            slot = 1 - c.tail_slot
            layout.write_tail(self._tail_ds, slot, new_tail)
            tail_crc = layout.checksum(new_tail)
        commit = Commit(
            n,
            full,
            slot,
            tail_count,
            layout.checksum(partial) if first else 0,
            tail_crc,
            c.generation + 1,
            c.rewinds + 1,
        )
        ar._file.flush()
        layout.write_commit(self._points, commit)
        ar._file.flush()
        self._commit = commit
        self._nbuf = 0
        del self._crcs[full // B :]
        for k in [k for k in self._blocks if k >= b]:
            del self._blocks[k]
        if first:
            self._blocks[b] = partial
        self._tail = new_tail

    def refresh(self) -> None:
        """Reader side: pick up rows committed by a writer in another process since the last
        look (HDF5 SWMR). A writer's own streams are always current."""
        self._check_open()
        if self._ar.writable:
            return
        self._points.refresh()
        old = self._commit
        # the datasets are refreshed again after the commit record is read, so that they
        # include everything the writer wrote before that commit (it may land in between)
        c = _read_commit_checked(self._points, self.span, self._refresh_datasets)
        if c.generation == old.generation:
            return
        B = self.block_spans
        if c.rewinds != old.rewinds:
            self._blocks.clear()
            self._crcs = []
            self._search_rewound()
        else:
            self._blocks.pop(old.full_spans // B, None)
        have, need = len(self._crcs), c.full_spans // B
        if need > have:
            if self._crc_ds.shape[0] < need:
                raise ArchiveFormatError(f"stream {self.name!r}: block checksums missing")
            self._crcs.extend(int(v) for v in self._crc_ds[have:need])
        del self._crcs[need:]
        self._tail = None
        self._commit = c

    def _refresh_datasets(self) -> None:
        for ds in (self._points, self._tail_ds, self._crc_ds):
            ds.refresh()

    def verify(self, progress=None) -> list[str]:
        """Check every stored chunk's CRC-32, decode every span and check every aux array's
        CRC-32; return the problems found (empty when the stream is intact). ``progress(n)`` is
        called per chunk checked."""
        self._check_open()
        try:
            return self._verify(progress)
        except _StaleView:  # a reader's view was outdated: check the writer's newer commit
            return self._retry_stale(self._verify, progress)

    def _verify(self, progress) -> list[str]:
        problems = []
        c, m, B = self._commit, self.span, self.block_spans
        nblocks = -(-c.full_spans // B)
        for b in range(nblocks + (1 if c.tail_count else 0)):
            is_tail = b == nblocks
            s0 = c.full_spans if is_tail else b * B
            s1 = c.full_spans + 1 if is_tail else min(c.full_spans, (b + 1) * B)
            self._blocks.pop(b, None)  # re-read from the file, do not trust the cache
            if is_tail:
                self._tail = None
            try:
                self._decode(s0 * m, min(c.length, s1 * m))
            except (ChecksumError, InvalidPointError) as exc:
                problems.append(str(exc))
            if progress is not None:
                progress(1)
        for key in self.aux_array_names():  # derived data, but damage is damage
            try:
                self.get_aux_array(key)
            except ChecksumError as exc:
                problems.append(str(exc))
        return problems

    # -- per-stream auxiliary arrays (derived data, e.g. a search index) ---------------------------
    def put_aux_array(self, key: str, array, attrs: dict | None = None) -> None:
        """Store a checksummed array beside this stream (under ``aux/<key>`` of its group),
        with optional attributes (e.g. the stream length it was derived from)."""
        self._check_open()
        _check_name(key, "aux array")
        arr = _checked_array(array, key)
        attrs = dict(attrs or {})
        self._ar._check_writable()
        # before the file is touched: a failed attribute write inside it upsets HDF5's SWMR
        # state (seen with h5py 3.16), beyond what the unfinished-name write can undo
        _check_attrs_storable(attrs, f"aux array {key!r}")
        with self._ar._structural():
            g = self._ar._file[self._group_path].require_group(layout.AUX)
            layout.put_checked_array(g, key, arr, attrs)

    def get_aux_array(self, key: str) -> tuple[np.ndarray, dict]:
        """The array stored under ``key`` and its attributes (CRC-checked)."""
        self._check_open()
        g = self._ar._h5()[self._group_path]
        if layout.AUX not in g or key not in g[layout.AUX]:
            raise StreamNotFoundError(f"stream {self.name!r} has no aux array {key!r}")
        ds = g[layout.AUX][key]
        attrs = {k: v for k, v in ds.attrs.items() if not k.startswith(layout.RESERVED_PREFIX)}
        return layout.get_checked_array(ds), attrs

    def aux_array_names(self) -> list[str]:
        self._check_open()
        g = self._ar._h5()[self._group_path]
        return layout.finished_names(g[layout.AUX]) if layout.AUX in g else []


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
        """Bytes ``[pos - before, pos + after]`` (clipped) around a hit, from the store."""
        return super().context(pos, before, after).astype(np.uint8).tobytes()

    def bytes(self, start: int = 0, stop: int | None = None) -> bytes:
        """Bytes ``[start, stop)`` of the stream."""
        return self[slice(start, stop)].astype(np.uint8).tobytes()

    def text(self, start: int = 0, stop: int | None = None, errors: str = "replace") -> str:
        """Bytes ``[start, stop)`` decoded as UTF-8 (a cut character follows ``errors``)."""
        return self.bytes(start, stop).decode("utf-8", errors)


# -- opening files and small checks ------------------------------------------------------------
def _checked_array(array, name: str) -> np.ndarray:
    arr = np.asarray(array)
    if arr.dtype.kind not in "biufcS":
        raise TypeError(
            f"array {name!r} has dtype {arr.dtype}, which HDF5 cannot store as is; use a numeric,"
            " bool or fixed-size bytes array (encode text with .astype('S'))"
        )
    return arr


def _check_attrs_storable(attrs: dict, what: str) -> None:
    """Raise (TypeError, ValueError) for an attribute HDF5 cannot store, before the file is
    touched: the values are tried on a throwaway in-memory HDF5 file."""
    if not attrs:
        return
    with h5py.File(f"fkv-attr-check-{id(attrs)}", "w", driver="core", backing_store=False) as f:
        for k, v in attrs.items():
            if not isinstance(k, str):
                raise TypeError(f"attribute names of {what} must be str, got {k!r}")
            try:
                f.attrs[k] = v
            except (TypeError, ValueError) as exc:
                raise type(exc)(
                    f"attribute {k!r} of {what} cannot be stored by HDF5 ({exc}); nothing was "
                    "written"
                ) from exc


def _read_commit_checked(points: h5py.Dataset, span: int, after_read=None) -> Commit:
    try:
        c = layout.read_commit(points)
    except (OSError, KeyError) as exc:
        raise ArchiveFormatError(f"{points.name}: commit record unreadable ({exc})") from exc
    if after_read is not None:
        after_read()
    if (
        c.length != c.full_spans * span + c.tail_count
        or c.tail_count >= span
        or c.tail_slot > 1
        or points.shape[0] < c.full_spans
    ):
        raise ArchiveFormatError(f"{points.name}: commit record {c} is inconsistent; damaged file")
    return c


def _h5_open(path: str, h5mode: str, **kw) -> h5py.File:
    return h5py.File(path, h5mode, libver=LIBVER, locking=False, **kw)


def _recover_if_needed(path: str) -> None:
    """Called by a writer holding the lock: a set status flag can only be a dead writer's.

    The file is changed only once it is known to be an fkvstore archive (checked read-only,
    through a view showing the flags cleared), so a refused file keeps every byte."""
    try:
        sb = read_superblock(path)
        if sb is None:
            return
        if sb.status_flags or os.path.getsize(path) < sb.base_address + sb.eof_address:
            view = open_cleared_view(path)
            try:
                try:
                    f = h5py.File(view, "r")
                except (OSError, RuntimeError) as exc:
                    raise ArchiveFormatError(
                        f"{path!r} cannot be opened as an HDF5 archive ({exc}); it may be "
                        "truncated or damaged"
                    ) from exc
                with f:
                    layout.check_format(f, path)
            finally:
                view.close()
        clear_status_flags(path)
    except ArchiveFormatError:
        raise
    except OSError as exc:
        raise ArchiveFormatError(f"{path!r} cannot be read as an HDF5 file: {exc}") from exc


_FLAG_ERRORS = ("already open for write", "not already open for SWMR")


def _open_reader(path: str) -> h5py.File:
    """Open for reading as an SWMR reader, which also works while a writer is (or was) active."""
    if not os.path.exists(path):
        raise ArchiveNotFoundError(f"no archive at {path!r}")
    sb = read_superblock(path)
    if sb is not None and os.path.getsize(path) < sb.base_address + sb.eof_address:
        # Shorter than its superblock says. An SWMR reader skips that check and then retries
        # every unreadable block with growing pauses, so unless a live writer is still
        # extending the file, read it through the zero-padded view in ordinary mode instead.
        if not _writer_alive(path):
            return _open_view(path, None)
    last: Exception | None = None
    f = None
    # a live writer leaves SWMR mode for a moment when it creates streams or attributes
    for delay in (0.0, 0.01, 0.05, 0.2, 0.5):
        time.sleep(delay)
        try:
            f = _h5_open(path, "r", swmr=True)
            break
        except (OSError, RuntimeError) as exc:
            last = exc
            if not any(s in str(exc) for s in _FLAG_ERRORS):
                break
    if f is None:
        f = _open_reader_fallback(path, last)
    try:
        layout.check_format(f, path)
    except (KeyError, OSError, RuntimeError) as exc:
        f.close()
        raise ArchiveFormatError(f"{path!r} is damaged: {exc}") from exc
    except BaseException:
        f.close()
        raise
    return f


def _writer_alive(path: str) -> bool:
    try:
        WriterLock(path, create=False, readonly=True).release()
    except ArchiveLockedError:
        return True
    return False


def _open_view(path: str, first_error: Exception | None) -> h5py.File:
    """Open read-only through a view with cleared flags and zero padding (nothing is written)."""
    view = open_cleared_view(path)
    try:
        return h5py.File(view, "r")
    except (OSError, RuntimeError) as exc:
        view.close()
        raise ArchiveFormatError(
            f"{path!r} is not a readable HDF5 archive ({exc}); it may be truncated or damaged"
        ) from (first_error or exc)


def _open_reader_fallback(path: str, first_error: Exception | None) -> h5py.File:
    try:
        return _h5_open(path, "r")  # an HDF5 file without SWMR support: not ours, but readable
    except (OSError, RuntimeError) as exc:
        msg = str(exc)
    if any(s in msg for s in _FLAG_ERRORS):
        # flags left by a writer that died outside SWMR mode: read through a patched view
        if _writer_alive(path):
            raise ArchiveLockedError(
                f"{path!r} is being restructured by a writer; try again in a moment"
            ) from first_error
        return _open_view(path, first_error)
    raise ArchiveFormatError(
        f"{path!r} is not a readable HDF5 archive ({msg}); it may be truncated or damaged"
    ) from first_error
