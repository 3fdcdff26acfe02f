"""The single-writer lock of an archive file.

HDF5's own file locking is switched off for every fkvstore open (h5py ``locking=False``): an
HDF5 writer in SWMR mode gives its lock up so that readers can get in, which would let a second
writer in too, and its lock cannot tell a live writer from a dead one. Instead a writer holds an
exclusive ``flock`` on its own descriptor of the archive file for as long as the archive is open.
The kernel drops the lock when the process dies, so a lock that can be taken means that no writer
is alive, and the consistency flags a dead writer left in the file can be cleared safely.
Readers take no lock.
"""

from __future__ import annotations

import os
import weakref

from fkvstore.errors import ArchiveLockedError

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows: no cross-process writer check
    fcntl = None  # type: ignore[assignment]  # the module or None, tested before each use

__all__ = ["WriterLock"]


class WriterLock:
    """An exclusive, non-blocking lock on ``path`` held through a descriptor of its own.

    ``create=True`` creates the file when missing; ``exclusive_create=True`` fails with
    ``FileExistsError`` when it already exists; ``readonly=True`` only probes whether a writer is
    alive (release the lock right after).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        create: bool,
        exclusive_create: bool = False,
        readonly: bool = False,
    ):
        flags = os.O_RDONLY if readonly else os.O_RDWR
        if create:
            flags |= os.O_CREAT
        if exclusive_create:
            flags |= os.O_CREAT | os.O_EXCL
        self.path = os.fspath(path)
        self._fd: int | None = os.open(self.path, flags, 0o666)
        self._finalizer = weakref.finalize(self, os.close, self._fd)
        if fcntl is None:
            return
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.release()
            raise ArchiveLockedError(
                f"{self.path!r} is already open for writing by another process; open it with "
                "mode 'r' to read it while that writer runs, or close the other writer first"
            ) from None

    def fsync(self) -> None:
        """fsync the locked file (any descriptor of a file flushes all of its written pages)."""
        if self._fd is not None:
            getattr(os, "fdatasync", os.fsync)(self._fd)  # data and size, as the journal does

    def release(self) -> None:
        if self._fd is not None:
            self._finalizer()  # closing the descriptor drops the flock
            self._fd = None
