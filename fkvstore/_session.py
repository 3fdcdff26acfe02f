"""The open HDF5 file behind an archive: modes, the writer lock, recovery, SWMR and the commit.

A :class:`Session` is what the user-facing objects (:class:`~fkvstore.archive.Archive`,
:class:`~fkvstore.stream.Stream`, :class:`~fkvstore._attrs.Attrs`) share. They reach the file
only through its small interface:

``h5``
    the open ``h5py.File`` (:class:`~fkvstore.errors.ArchiveClosedError` once closed);
``check_open()``, ``check_writable()``
    raise unless the archive is open, or the archive may be changed;
``structural()``
    a context in which objects and attributes may be created or deleted (outside SWMR mode);
``bind(group_path, ...)`` / ``unbind(group_path)``
    register a stream: it gets its group again whenever ``structural()`` reopens the file, is
    detached on close, and its buffered rows are committed by ``flush()``;
``commit(stages, sync)``
    THE two-phase commit (appends, spills, truncations, flushes all go through it): data, an
    HDF5 flush, the commit records, another flush; then, at the ``fsync`` level, the journaled
    sync that makes it survive a power cut.

Two durability levels (``docs/archive.md``). ``"process"`` (format version 1): writers work in
HDF5's single-writer/multiple-reader (SWMR) mode on the file itself. ``"fsync"`` (format version
2): the writer's HDF5 writes into a :class:`~fkvstore._journal.JournaledFile`, and every commit
and change of structure ends in its journaled sync; no SWMR readers while such a writer is open.
``docs/format.md`` gives the layout. A URL opens read-only through a block-cached fsspec
file object (:mod:`fkvstore._remote`, ``docs/remote.md``): no lock, no recovery, no SWMR.
"""

from __future__ import annotations

import atexit
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import h5py

from fkvstore import _journal, _remote, layout
from fkvstore._bounds import check_recorded_end
from fkvstore._hdf5 import open_swmr_reader
from fkvstore._lock import WriterLock
from fkvstore._os_errors import named_os_errors, named_os_errors_in_generator
from fkvstore._superblock import clear_status_flags, open_cleared_view, read_superblock
from fkvstore.errors import (
    ArchiveClosedError,
    ArchiveExistsError,
    ArchiveFormatError,
    ArchiveLockedError,
    ArchiveNotFoundError,
    ArchiveReadOnlyError,
    FkvError,
    RemoteModeError,
)

__all__ = ["DURABILITY", "LIBVER", "MODES", "Pending", "Session"]

MODES = ("r", "r+", "a", "w", "w-", "x")
DURABILITY = ("process", "fsync")
LIBVER = ("v110", "v110")  # the oldest format with SWMR: readable by HDF5 >= 1.10
_T = TypeVar("_T")
_FLAG_ERRORS = ("already open for write", "not already open for SWMR")
_STRUCTURE_RETRY_DELAYS = (0.02, 0.1, 0.3, 0.6, 0.8)  # a reader's pauses for a writer's change


@dataclass(frozen=True)
class Pending:
    """A stream's staged change: its data is written, ``record`` is not yet. ``apply`` runs once
    the record is durable (the stream takes the new state up)."""

    points: h5py.Dataset  # the dataset whose attribute holds the commit record
    record: layout.Commit
    apply: Callable[[], None]


class _Member(NamedTuple):
    """A stream bound to the session (see :meth:`Session.bind`)."""

    rebind: Callable[[h5py.Group], None]
    detach: Callable[[], None]
    has_pending: Callable[[], bool]
    stage: Callable[[], Pending]


class Session:
    """The file of one open archive. ``mode`` as in :func:`fkvstore.open`; for a URL,
    ``storage_options``, ``block_bytes`` and ``block_cache_bytes`` configure the
    :class:`~fkvstore._remote.RemoteObject` it reads through (``remote`` is then that object)."""

    @named_os_errors
    def __init__(self, path: str | os.PathLike, mode: str, library_version: str, *,
                 durability: str | None = None, storage_options: dict | None = None,
                 block_bytes: int | None = None, block_cache_bytes: int | None = None):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {', '.join(map(repr, MODES))}")
        if durability is not None and durability not in DURABILITY:
            raise ValueError(f"durability {durability!r} is not one of "
                             f"{', '.join(map(repr, DURABILITY))} (or None: the file's own)")
        self.path = os.fspath(path)
        self.mode = mode
        self.writable = mode != "r"
        self._file: h5py.File | None = None
        self._lock: WriterLock | None = None
        self._journaled: _journal.JournaledFile | None = None  # the "fsync" level's file
        self._created = False  # this writer created the file: its name is not fsynced yet
        self._swmr = False
        self._members: dict[str, _Member] = {}
        self.remote: _remote.RemoteObject | None = None
        if _remote.is_url(self.path):
            if mode != "r":
                raise RemoteModeError(
                    f"{self.path!r} is a URL: remote archives open read-only (mode 'r'), not "
                    f"mode {mode!r}; write a local archive and publish it (Archive.publish or "
                    "fkvstore.copy)"
                )
            self._open_remote(storage_options, block_bytes, block_cache_bytes)
            return
        if mode == "a":
            mode = "r+" if os.path.exists(self.path) else "w"
        if mode == "r":
            self._file = _open_reader(self.path)
        elif mode == "r+":
            self._open_writer_existing(durability)
        else:
            self._create(exclusive=mode in ("w-", "x"), library_version=library_version,
                         durability=durability or "process")

    @property
    def durability(self) -> str:
        """``"fsync"`` when every commit goes through the rollback journal, else ``"process"``
        (readers report the level recorded in the file)."""
        if self._journaled is not None:
            return "fsync"
        if self._file is None or self.writable:
            return "process"
        return layout.recorded_durability(self._file)

    # -- the interface the archive's objects use ----------------------------------------------
    @property
    def closed(self) -> bool:
        return self._file is None

    @property
    def h5(self) -> h5py.File:
        """The open file; ArchiveClosedError once the archive is closed."""
        if self._file is None:
            raise ArchiveClosedError(
                f"archive {self.path!r} is closed; open it again with fkvstore.open()"
            )
        return self._file

    def check_open(self) -> None:
        """Raise ArchiveClosedError once the archive is closed."""
        self.h5  # noqa: B018 - the property raises

    def check_writable(self) -> None:
        self.check_open()
        if not self.writable:
            fix = ("an archive opened from a URL is read-only: change a local copy and "
                   "publish it" if self.remote else
                   "open it with mode 'a' or 'r+' to change it")
            raise ArchiveReadOnlyError(
                f"archive {self.path!r} is open read-only (mode 'r'); {fix}") from None

    def bind(self, group_path: str, rebind: Callable[[h5py.Group], None], *,
             detach: Callable[[], None], has_pending: Callable[[], bool],
             stage: Callable[[], Pending]) -> None:
        """Register the stream in ``group_path``: ``rebind(group)`` runs now and whenever the
        file is reopened, ``detach()`` when the stream is deleted or the archive closed;
        :meth:`flush` commits it through ``stage()`` while ``has_pending()``."""
        self._members[group_path] = _Member(rebind, detach, has_pending, stage)
        rebind(self.h5[group_path])

    def read_structure(self, read: Callable[[], _T], what: str) -> _T:
        """``read()``, a read of the file's structure (the streams' names, a stream's group),
        done by a local reader as often as it takes a live writer to finish changing that
        structure: a writer creating streams or attributes leaves SWMR mode for a moment, and a
        reader that looks then gets HDF5 errors (a bad metadata checksum, a missing chunk, or
        the damage ``layout`` reports for them), not damage. Each such failure while the
        writer lives reopens the file and tries again (5 tries
        over ~1.8 s), then ArchiveLockedError. A writer's own reads, a URL's, and any read
        with no live writer beside it raise the first error."""
        self.check_open()
        last: Exception | None = None
        for delay in _STRUCTURE_RETRY_DELAYS:
            if self._file is not None:
                try:
                    return read()
                except (OSError, RuntimeError, KeyError, ArchiveFormatError) as exc:
                    if (not self.is_local_reader or not _hdf5_error(exc)
                            or not _writer_alive(self.path)):
                        raise
                    last = exc
            time.sleep(delay)
            try:
                self._reopen_reader()
            except ArchiveLockedError as exc:
                last = exc
        raise ArchiveLockedError(
            f"{self.path!r}: {what} failed while its writer kept changing the file's "
            f"structure ({last}); open it again in a moment") from last

    @property
    def is_local_reader(self) -> bool:
        """Open read-only on a local file (an SWMR reader, or a view of a writer's leftovers)."""
        return not self.writable and self.remote is None

    def reopen_reader(self) -> None:
        """A local reader's file closed and opened again, so it shows the structure a writer
        has made since (HDF5 keeps a reader's view of the objects until then): streams
        created meanwhile appear, deleted ones are detached, every other stream gets its
        group again. Waits out a writer's change of structure like :meth:`read_structure`;
        if the file cannot be opened again the archive is left closed (ArchiveLockedError)."""
        self.check_open()
        last: Exception | None = None
        for delay in (0.0, *_STRUCTURE_RETRY_DELAYS):
            time.sleep(delay)
            try:
                self._reopen_reader()
                return
            except ArchiveLockedError as exc:
                last = exc
        raise ArchiveLockedError(
            f"{self.path!r} could not be opened again while its writer kept changing the "
            f"file's structure ({last}); the reader is closed: open it again in a moment"
        ) from last

    def is_bound(self, group_path: str) -> bool:
        return group_path in self._members

    def _reopen_reader(self) -> None:
        """Close and reopen the reader's file; ``_file`` stays None if the open fails."""
        if self._file is not None:
            self._file.close()
            self._file = None
        f = _open_reader(self.path)
        for group_path in [g for g in self._members if g not in f]:
            self._members.pop(group_path).detach()  # the writer deleted the stream
        for group_path, member in self._members.items():
            member.rebind(f[group_path])
        self._file = f

    def unbind(self, group_path: str) -> None:
        """Detach and forget the stream in ``group_path`` (it was deleted)."""
        member = self._members.pop(group_path, None)
        if member is not None:
            member.detach()

    @contextmanager
    @named_os_errors_in_generator
    def structural(self) -> Iterator[None]:
        """Run a change of the file's structure (new objects, attributes) outside SWMR mode.

        HDF5 keeps the file consistent for readers and against a killed writer only for appends
        made in SWMR mode; creating objects or attributes is not covered, so the file is reopened
        in ordinary mode for the change and goes back to SWMR mode right after.
        """
        self.check_writable()
        if self._journaled is not None:  # no SWMR mode to leave; the sync makes it atomic
            try:
                yield
            finally:
                self.h5.flush()
                self._journaled.sync()
            return
        if self._swmr:
            self.h5.close()
            self._file = _h5_open(self.path, "r+")
            self._swmr = False
            for group_path, member in self._members.items():
                member.rebind(self._file[group_path])
        try:
            yield
        finally:
            self._enter_swmr()

    @named_os_errors
    def commit(self, stages: Iterable[Callable[[], Pending]], sync: bool = False) -> None:
        """Two-phase commit of the streams whose ``stage()`` callables are given: each writes its
        data and returns its :class:`Pending` record; after an HDF5 flush the records are
        written, after another flush every stream applies its new state. A process killed at
        any point leaves each stream at its old or its new commit. At the ``fsync`` level the
        journaled sync follows (power-loss safe); ``sync=True`` at the ``process`` level
        fsyncs the file."""
        stages = list(stages)
        if not stages:
            if sync:
                self._sync()
            return
        f = self.h5
        if not self._swmr and self._journaled is None:
            self._enter_swmr()
        pending = [stage() for stage in stages]
        f.flush()
        for p in pending:
            layout.write_commit(p.points, p.record)
        f.flush()
        if sync or self._journaled is not None:
            self._sync()
        for p in pending:
            p.apply()

    def flush(self, sync: bool = False) -> None:
        """Commit every bound stream that has buffered rows (and fsync, see :meth:`commit`)."""
        self.commit([m.stage for m in self._members.values() if m.has_pending()], sync)

    def _sync(self) -> None:
        """Everything the file holds reaches the disk: the journaled sync (``fsync`` level) or
        an fsync of the file (``process`` level, through the writer lock's descriptor)."""
        if self._journaled is not None:
            self.h5.flush()
            self._journaled.sync()
        elif self._lock is not None:
            self._lock.fsync()
            if self._created:  # the new file's name, once
                _journal.fsync_directory(self.path)
                self._created = False

    @named_os_errors
    def close(self) -> None:
        """Detach every bound stream, close the file and release the writer lock. Idempotent;
        commits nothing (:meth:`flush` first)."""
        members, self._members = self._members, {}
        for member in members.values():
            member.detach()
        try:
            if self._file is not None:
                try:
                    self._file.close()
                finally:
                    self._file = None
            if self._journaled is not None:
                journaled, self._journaled = self._journaled, None
                try:
                    journaled.sync()  # what HDF5 wrote while closing: the clean superblock
                finally:
                    journaled.close_clean()
        finally:
            if self.remote is not None:  # after the HDF5 file, which reads through it
                self.remote.close()
                _OPEN_REMOTE.discard(self)
            if self._lock is not None:  # also when closing failed (a full disk): not ours now
                self._lock.release()
                self._lock = None

    # -- opening ------------------------------------------------------------------------------
    def _open_remote(self, storage_options, block_bytes, block_cache_bytes) -> None:
        """Open the object at the URL ``self.path`` as a reader: a block-cached file object, the
        format check, then the head of a published archive (all its metadata) in one request."""
        self.remote = _remote.RemoteObject(
            self.path, storage_options,
            block_bytes=block_bytes or _remote.DEFAULT_BLOCK_BYTES,
            cache_bytes=(_remote.DEFAULT_BLOCK_CACHE_BYTES if block_cache_bytes is None
                         else block_cache_bytes))
        _OPEN_REMOTE.add(self)
        try:
            # the superblock and root group of any HDF5 file: one request, not HDF5's several
            self.remote.prefetch(_remote.OPEN_BYTES)
            try:
                self._file = h5py.File(self.remote, "r")
            except FkvError:  # the storage failed (named by _remote), not the format
                raise
            except (OSError, RuntimeError) as exc:
                raise ArchiveFormatError(
                    f"{self.path!r} is not a readable HDF5 archive ({exc}); the object may be "
                    "truncated or damaged"
                ) from exc
            try:
                layout.check_format(self._file, self.path)
                head = int(self._file.attrs.get(layout.REMOTE_HEAD_ATTR, 0))
            except FkvError:
                raise
            except (KeyError, OSError, RuntimeError, TypeError) as exc:
                raise ArchiveFormatError(f"{self.path!r} is damaged: {exc}") from exc
            self.remote.prefetch(min(head, self.remote.size))
        except BaseException:
            self.close()
            raise

    def _open_writer_existing(self, durability: str | None) -> None:
        if not os.path.exists(self.path):
            raise ArchiveNotFoundError(
                f"no archive at {self.path!r}; open it with mode 'a' or 'w' to create one"
            )
        self._lock = WriterLock(self.path, create=False)
        try:
            _journal.recover(self.path)  # a sync cut by a power failure is undone first
            _recover_if_needed(self.path)
            try:
                self._file = _h5_open(self.path, "r+")
            except (OSError, RuntimeError) as exc:
                _raise_if_open_here(exc, self.path)
                raise ArchiveFormatError(
                    f"{self.path!r} cannot be opened as an HDF5 archive ({exc}); it may be "
                    "truncated or damaged"
                ) from exc
            layout.check_format(self._file, self.path)
            if (durability or layout.recorded_durability(self._file)) == "fsync":
                self._file.close()
                self._file = None
                self._open_journaled(create=False)
                if layout.recorded_durability(self.h5) != "fsync":
                    with self.structural():  # format version 2, in one journaled sync
                        layout.record_durability(self.h5, "fsync")
            else:
                self._enter_swmr()
        except BaseException:
            self.close()
            raise

    def _open_journaled(self, create: bool) -> None:
        """Open the file for the ``fsync`` level: HDF5 writes through a JournaledFile."""
        self._journaled = _journal.JournaledFile(self.path, create=create)
        self._file = h5py.File(self._journaled, "w" if create else "r+", libver=LIBVER,
                               locking=False)

    def _create(self, exclusive: bool, library_version: str, durability: str) -> None:
        try:
            self._lock = WriterLock(self.path, create=True, exclusive_create=exclusive)
        except FileExistsError:
            raise ArchiveExistsError(
                f"{self.path!r} already exists; open it with mode 'a' or 'r+' to add to it, "
                "or 'w' to replace it"
            ) from None
        try:
            if durability == "fsync":
                self._open_journaled(create=True)
                layout.init_file(self.h5, library_version)
                layout.record_durability(self.h5, "fsync")
                self._sync()
            else:
                try:
                    self._file = h5py.File(self.path, "w", libver=LIBVER, locking=False)
                except OSError as exc:
                    _raise_if_open_here(exc, self.path)
                    raise
                self._created = True
                layout.init_file(self._file, library_version)
                self._enter_swmr()
                _journal.clear(self.path)  # a journal left by an earlier file of this name
        except BaseException:
            self.close()
            raise

    def _enter_swmr(self) -> None:
        f = self.h5
        f.flush()
        try:
            f.swmr_mode = True
        except RuntimeError as exc:
            _raise_if_open_here(exc, self.path)
            raise
        self._swmr = True


# An h5py file reading through a Python file object must be closed before the interpreter tears
# down (h5py 3.16 crashes at exit otherwise): remote sessions still open at exit are closed.
_OPEN_REMOTE: weakref.WeakSet[Session] = weakref.WeakSet()


@atexit.register
def _close_remote_sessions() -> None:
    for session in list(_OPEN_REMOTE):
        session.close()


def _raise_if_open_here(exc: Exception, path: str) -> None:
    """ArchiveLockedError when HDF5 refused ``path`` because this process has it open (a
    reader, or an earlier handle): HDF5 shares one open file per process, so a writer cannot
    start beside it."""
    if "already open" in str(exc) or "already in SWMR writing mode" in str(exc):
        raise ArchiveLockedError(
            f"{path!r} is already open in this process (a reader or another handle); close it "
            "before opening the file for writing") from exc


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
        check_recorded_end(path, sb.base_address + sb.eof_address)
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


def _open_reader(path: str) -> h5py.File:
    """Open for reading as an SWMR reader, which also works while a writer is (or was) active."""
    if not os.path.exists(path):
        raise ArchiveNotFoundError(f"no archive at {path!r}")
    if os.path.exists(_journal.journal_path(path)):
        if not _writer_alive(path):
            rolled_back = _journal.rollback_view(path)  # a sync a power failure interrupted
            if rolled_back is not None:
                return _open_view(path, None, rolled_back)
        elif (sb := read_superblock(path)) is not None and sb.status_flags == 0:
            # a live writer whose HDF5 left no flags: one at durability "fsync" (HDF5 sets
            # none through a file object; an SWMR writer always has them set)
            raise ArchiveLockedError(
                f"{path!r} is open by a writer at durability 'fsync', which admits no readers "
                "beside it (its syncs are not ordered for SWMR readers); open it once that "
                "writer has closed"
            )
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
            f = open_swmr_reader(path, LIBVER)
            break
        except (OSError, RuntimeError) as exc:
            last = exc
            if not any(s in str(exc) for s in _FLAG_ERRORS) or not _writer_alive(path):
                break  # damage, or flags no live writer will clear: no point in waiting
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


def _hdf5_error(exc: BaseException) -> bool:
    """An error HDF5 raised reading the file (as it is, or as the damage it was reported as),
    not one of fkvstore's own findings."""
    cause = exc.__cause__ if isinstance(exc, ArchiveFormatError) else exc
    return isinstance(cause, (OSError, RuntimeError, KeyError))


def _writer_alive(path: str) -> bool:
    try:
        WriterLock(path, create=False, readonly=True).release()
    except ArchiveLockedError:
        return True
    return False


def _open_view(path: str, first_error: Exception | None, base=None) -> h5py.File:
    """Open read-only through a view with cleared flags and zero padding (nothing is written);
    ``base``: the file object to read the file through (a rollback view), else the file."""
    view = open_cleared_view(path, base)
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
                f"{path!r} is open by a writer that admits no readers now: one at durability "
                "'fsync' (no SWMR readers until it closes), or one changing the file's "
                "structure (try again in a moment)"
            ) from first_error
        return _open_view(path, first_error)
    raise ArchiveFormatError(
        f"{path!r} is not a readable HDF5 archive ({msg}); it may be truncated or damaged"
    ) from first_error
