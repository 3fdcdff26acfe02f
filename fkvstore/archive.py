"""The persistent archive: named symbol streams in one HDF5 file (the facade of fkvstore).

``fkvstore.open(path, mode)`` returns an :class:`Archive`. A :class:`~fkvstore.stream.Stream` of
width W holds rows of W symbols from one alphabet; rows are appended, read back by position in
O(1) and can be truncated. Appends are buffered in memory and become durable at
:meth:`Archive.flush` (also run by :meth:`Archive.close` and whenever a stream's buffer passes
``spill_symbols``).

Writers work in HDF5's single-writer/multiple-reader (SWMR) mode, so readers in other processes
can follow a growing archive and a killed writer leaves a readable file; see ``docs/archive.md``
for the guarantees and ``docs/format.md`` for the layout. The file itself (modes, lock, recovery,
SWMR, the commit) is :class:`~fkvstore._session.Session`'s.

A URL (``s3://bucket/run.h5``, any fsspec URL) opens read-only through a block cache;
:func:`copy` and :meth:`Archive.publish` put a verified copy, laid out for remote reads, in
object storage (``docs/remote.md``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import h5py
import numpy as np

from fkvstore import _remote, _repack, _validate, layout
from fkvstore._attrs import Attrs
from fkvstore._session import MODES, Session
from fkvstore._version import __version__
from fkvstore.codec import Codec
from fkvstore.errors import (
    ArchiveExistsError,
    ArchiveFormatError,
    ChecksumError,
    FkvError,
    StreamNotFoundError,
)
from fkvstore.stream import Stream, TextStream

__all__ = ["Archive", "Stream", "TextStream", "copy", "open"]

DEFAULT_CACHE_BYTES = 64 << 20
DEFAULT_SPILL_SYMBOLS = 1 << 22
TEXT_ALPHABET = 256
_MAX_CHUNK_BYTES = (1 << 32) - 1  # HDF5 refuses larger chunks


def open(  # noqa: A001 - mirrors h5py.File / builtins.open on purpose
    path: str | os.PathLike,
    mode: str = "r",
    *,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    spill_symbols: int = DEFAULT_SPILL_SYMBOLS,
    durability: str | None = None,
    storage_options: dict | None = None,
    block_bytes: int = _remote.DEFAULT_BLOCK_BYTES,
    block_cache_bytes: int = _remote.DEFAULT_BLOCK_CACHE_BYTES,
) -> Archive:
    """Open the archive at ``path``: a local file, or a URL (``s3://bucket/run.h5``, any fsspec
    URL), which opens read-only.

    Modes as in h5py: ``"r"`` read only (the file must exist), ``"r+"`` read/write (must exist),
    ``"a"`` read/write, created if missing, ``"w"`` create, replacing an existing file,
    ``"w-"`` or ``"x"`` create, failing if the file exists. Only one writer may have a file open
    (:class:`~fkvstore.errors.ArchiveLockedError` otherwise); any number of ``"r"`` readers may
    follow it. ``cache_bytes`` bounds the decoded-chunk cache of each stream; ``spill_symbols`` is
    the number of buffered symbols per stream after which appends are committed automatically.

    ``durability`` (writers; docs/archive.md "Durability levels"): ``"process"``, a commit
    survives a killed process; ``"fsync"``, every commit and change of structure also survives
    a power failure (a rollback journal ``<path>-journal`` beside the file, two fsyncs per
    commit, format version 2, no SWMR readers while the writer is open); ``None`` (default):
    the level the file was written at, ``"process"`` for a new file. ``"fsync"`` on a version 1
    archive converts it to version 2.

    For a URL (mode ``"r"`` only, :class:`~fkvstore.errors.RemoteModeError` otherwise):
    ``storage_options`` go to fsspec (credentials, ``endpoint_url``, ...); reads are fetched in
    aligned blocks of ``block_bytes`` and cached up to ``block_cache_bytes`` (0: no cache, each
    read is one request). All three are ignored for a local path.
    """
    return Archive(path, mode, cache_bytes=cache_bytes, spill_symbols=spill_symbols,
                   durability=durability, storage_options=storage_options, block_bytes=block_bytes,
                   block_cache_bytes=block_cache_bytes)


def copy(src: str | os.PathLike, dst: str | os.PathLike, *, storage_options: dict | None = None,
         overwrite: bool = False) -> None:
    """Copy the archive at ``src`` to ``dst`` (each a local path or a URL), repacked for remote
    reads (docs/remote.md) and verified before it is put in place; a reader never sees a
    partial ``dst``. Uploading a local archive is ``copy("run.h5", "s3://bucket/run.h5")``.

    ``src`` is read as a reader (its committed rows). ``storage_options`` apply to whichever of
    the two is a URL. ``dst`` must not exist unless ``overwrite``
    (:class:`~fkvstore.errors.ArchiveExistsError`); a copy that fails its verification
    (:class:`~fkvstore.errors.ChecksumError`) is not put in place.
    """
    with open(src, "r", storage_options=storage_options) as ar:
        ar.publish(dst, storage_options=storage_options, overwrite=overwrite)


def _same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two local paths name one file (through links too)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return False


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
        durability: str | None = None,
        storage_options: dict | None = None,
        block_bytes: int = _remote.DEFAULT_BLOCK_BYTES,
        block_cache_bytes: int = _remote.DEFAULT_BLOCK_CACHE_BYTES,
    ):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {', '.join(map(repr, MODES))}")
        self.cache_bytes = _validate.positive_int(cache_bytes, "cache_bytes")
        self.spill_symbols = _validate.positive_int(spill_symbols, "spill_symbols")
        self.path = os.fspath(path)
        self.mode = mode
        self.writable = mode != "r"
        self._streams: dict[str, Stream] = {}
        block_bytes = _validate.positive_int(block_bytes, "block_bytes")
        block_cache_bytes = _validate.integer(block_cache_bytes, "block_cache_bytes", low=0)
        self._session = Session(self.path, mode, __version__, durability=durability,
                                storage_options=storage_options,
                                block_bytes=block_bytes, block_cache_bytes=block_cache_bytes)

    # -- state -------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._session.closed

    def __repr__(self) -> str:
        if self.closed:
            return f"<fkvstore.Archive {self.path!r} (closed)>"
        n = len(self._session.h5[layout.STREAMS])
        return f"<fkvstore.Archive {self.path!r} mode={self.mode!r}, {n} stream(s)>"

    def __enter__(self) -> Archive:
        self._session.check_open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def attrs(self) -> Attrs:
        """User metadata of the archive (a mutable mapping over the root group's attributes)."""
        self._session.check_open()
        return Attrs(self._session, "/")

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
        _validate.object_name(name, "stream")
        self._session.check_writable()
        width = _validate.positive_int(width, "width")
        chunk_bytes = _validate.integer(chunk_bytes, "chunk_bytes", low=16)
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
        with self._session.structural():
            streams = self._session.h5[layout.STREAMS]
            try:
                layout.create_stream_group(
                    streams,
                    name,
                    kind=kind,
                    codec_config=codec.config(),
                    width=width,
                    block_spans=layout.block_spans_for(width, chunk_bytes),
                )
            except BaseException:
                if name in streams:  # leave no half-created stream behind
                    del streams[name]
                raise
        return self[name]

    def __getitem__(self, name: str) -> Stream:
        self._session.check_open()
        s = self._streams.get(name)
        if s is not None:
            return s
        try:
            group = self._session.read_structure(
                lambda: (layout.child(self._session.h5[layout.STREAMS], name)
                         if isinstance(name, str) else None), f"looking up stream {name!r}")
        except FkvError:
            raise
        except (OSError, RuntimeError, KeyError) as exc:
            raise ArchiveFormatError(f"{self.path!r} is damaged: {exc}") from exc
        if group is None:
            if isinstance(name, str) and name in self.array_names():
                raise StreamNotFoundError(
                    f"{name!r} in {self.path!r} is an array, not a stream: read it with "
                    f"get_array({name!r})")
            known = ", ".join(map(repr, self)) or "none"
            raise StreamNotFoundError(
                f"no stream {name!r} in {self.path!r} (streams: {known}); create it with "
                "create_stream()"
            )

        def make() -> Stream:
            info = layout.read_stream_info(self._session.h5[layout.stream_path(name)])
            cls = TextStream if info.kind == "text" else Stream
            return cls(self._session, name, layout.stream_path(name), info,
                       cache_bytes=self.cache_bytes, spill_symbols=self.spill_symbols)

        try:
            s = self._session.read_structure(make, f"opening stream {name!r}")
        except FkvError:
            raise
        except (OSError, RuntimeError, KeyError) as exc:
            raise ArchiveFormatError(
                f"stream {name!r} of {self.path!r} cannot be read ({exc}); the file is damaged"
            ) from exc
        self._streams[name] = s
        return s

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._session.read_structure(
            lambda: layout.has_link(self._session.h5[layout.STREAMS], name),
            f"looking up stream {name!r}")

    def __iter__(self) -> Iterator[str]:
        return iter(self._session.read_structure(
            lambda: list(self._session.h5[layout.STREAMS].keys()), "listing the streams"))

    def __len__(self) -> int:
        return self._session.read_structure(
            lambda: len(self._session.h5[layout.STREAMS]), "counting the streams")

    def keys(self) -> list[str]:
        """Names of the streams."""
        return list(self)

    def __delitem__(self, name: str) -> None:
        """Delete a stream (its file space is not reclaimed; ``h5repack`` compacts a file)."""
        self._session.check_writable()
        if name not in self:
            raise StreamNotFoundError(f"no stream {name!r} in {self.path!r} to delete")
        with self._session.structural():
            del self._session.h5[layout.STREAMS][name]
        if self._streams.pop(name, None) is not None:
            self._session.unbind(layout.stream_path(name))

    # -- auxiliary arrays ----------------------------------------------------------------------
    def put_array(self, name: str, array) -> None:
        """Store ``array`` (numeric, bool or fixed-size bytes ``S``) under ``name``, replacing
        an array of that name; it is checksummed and written durably before this returns."""
        _validate.object_name(name, "array")
        self._session.check_writable()
        arr = _validate.storable_array(array, name)
        with self._session.structural():
            layout.put_checked_array(self._session.h5[layout.ARRAYS], name, arr)

    def get_array(self, name: str) -> np.ndarray:
        """The array stored under ``name``; ChecksumError when its bytes were damaged."""
        return layout.get_checked_array(self._array_dataset(name))

    def array_info(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        """``(dtype, shape)`` of the array stored under ``name``, without reading (or checking)
        its data."""
        ds = self._array_dataset(name)
        return ds.dtype, ds.shape

    def _array_dataset(self, name: str):
        g = self._session.h5[layout.ARRAYS]
        ds = layout.child(g, name) if isinstance(name, str) else None
        if ds is None:
            known = ", ".join(map(repr, g.keys())) or "none"
            raise StreamNotFoundError(f"no array {name!r} in {self.path!r} (arrays: {known})")
        if not isinstance(ds, h5py.Dataset):
            raise ArchiveFormatError(
                f"{self.path!r}: array {name!r} is not a dataset; the file is damaged")
        return ds

    def array_names(self) -> list[str]:
        """Names of the auxiliary arrays."""
        return layout.finished_names(self._session.h5[layout.ARRAYS])

    def delete_array(self, name: str) -> None:
        self._session.check_writable()
        if name not in self.array_names():
            raise StreamNotFoundError(f"no array {name!r} in {self.path!r} to delete")
        with self._session.structural():
            del self._session.h5[layout.ARRAYS][name]

    # -- durability ----------------------------------------------------------------------------
    @property
    def durability(self) -> str:
        """``"fsync"`` or ``"process"``: what a commit survives (docs/archive.md)."""
        self._session.check_open()
        return self._session.durability

    def flush(self, sync: bool = False) -> None:
        """Commit every stream's buffered rows. When this returns they survive a killed process.

        At durability ``"fsync"`` every flush survives a power failure as well (journaled, two
        fsyncs). At ``"process"``, ``sync=True`` adds an fsync of the file: what is committed
        is then on the disk, but a power failure during a *later* write may still tear HDF5
        metadata that earlier data depends on; open with ``durability="fsync"`` for that."""
        self._session.check_writable()
        self._session.flush(sync=bool(sync))

    def verify(self, progress=None) -> dict[str, list[str]]:
        """Check every stream (:meth:`Stream.verify`) and array; ``{name: problems}`` with an
        entry for every stream and array (``arrays/<name>`` for arrays), empty lists when intact,
        and an entry ``"/"`` when the archive's own attributes do not match their CRC-32."""
        report = {}
        root = layout.attrs_problems(self._session.h5)
        if root:
            report["/"] = root
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

    def publish(self, dst: str | os.PathLike, *, storage_options: dict | None = None,
                overwrite: bool = False) -> None:
        """Put a copy of this archive at ``dst`` (a URL, or a local path), as :func:`copy` does:
        buffered rows are committed first (a writer), the copy is repacked for remote reads,
        verified (:meth:`verify` on the copy: ChecksumError names the problems, nothing is
        written) and then uploaded whole, or moved into place for a local ``dst``."""
        self._session.check_open()
        local = _remote.file_url_path(dst)
        if local is not None:  # file:// is a local path: same checks, same atomic rename
            dst = local
        url = dst if _remote.is_url(dst) else None  # None: a local path
        if url is None and not self._session.remote and _same_file(dst, self.path):
            raise ValueError(f"cannot copy {self.path!r} onto itself ({os.fspath(dst)!r}); "
                             "choose another path")
        if not overwrite and (_remote.remote_exists(url, storage_options) if url is not None
                              else os.path.exists(dst)):
            raise ArchiveExistsError(f"{os.fspath(dst)!r} already exists; pass overwrite=True "
                                     "to replace it")
        where = None if url is not None else os.path.dirname(os.path.abspath(dst))
        if where is not None and not os.path.isdir(where):
            raise FileNotFoundError(f"cannot publish to {os.fspath(dst)!r}: its folder "
                                    f"{where!r} does not exist")
        if url is None and os.path.isdir(dst):
            raise IsADirectoryError(f"cannot publish to {os.fspath(dst)!r}: it is a folder")
        if self.writable:
            self._session.flush()
        fd, tmp = tempfile.mkstemp(suffix=".h5", prefix=".fkv-publish-", dir=where)
        os.close(fd)
        try:
            _repack.repack(self._session.h5, tmp)
            self._check_copy(tmp)
            if url is not None:
                _remote.upload(tmp, url, storage_options, overwrite=overwrite)
            else:
                os.replace(tmp, dst)  # same directory: an atomic rename
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _check_copy(self, path: str) -> None:
        """The copy at ``path`` holds every stream (its committed length) and array, intact."""
        with open(path) as copy_:
            problems = {k: v for k, v in copy_.verify().items() if v}
            missing = sorted(set(self) ^ set(copy_)) + sorted(
                set(self.array_names()) ^ set(copy_.array_names()))
            lengths = {n: (copy_[n].committed_length, self[n].committed_length)
                       for n in set(self) & set(copy_)}
        short = {n: pair for n, pair in lengths.items() if pair[0] != pair[1]}
        if problems or short or missing:
            raise ChecksumError(
                f"the copy of {self.path!r} is not intact, nothing was published: problems "
                f"{problems or 'none'}; length (copy, source) {short or 'all equal'}; names in "
                f"one only {missing or 'none'}"
            )

    def refresh(self) -> None:
        """Reader side: see what the writer has committed since this archive was opened or
        last refreshed: new rows, and on a local file new streams and arrays too (the file is
        opened again: ~1.3 ms plus ~0.5 ms per open stream). Streams the writer deleted are
        dropped; a Stream object of one raises ArchiveClosedError."""
        self._session.check_open()
        if self._session.is_local_reader:
            self._session.reopen_reader()
            self._streams = {name: s for name, s in self._streams.items()
                             if self._session.is_bound(layout.stream_path(name))}
        for s in self._streams.values():
            s.refresh()

    def close(self) -> None:
        """Commit buffered rows, close the file and release the writer lock. Idempotent."""
        if self._session.closed:
            return
        try:
            if self.writable:
                self._session.flush()
        finally:
            self._streams.clear()
            self._session.close()
