"""Power-loss safety for ``durability="fsync"`` archives: a page-level rollback journal.

HDF5 rewrites its own metadata (superblock, object headers, chunk indexes, heaps) in place, at
addresses fkvstore does not choose, so a power cut in the middle of a flush can leave pages of
committed metadata half old, half new. Protecting only fkvstore's commit record cannot prevent
that. Instead the writer's HDF5 file goes through :class:`JournaledFile`, a file object h5py
writes into (``h5py.File(fileobj)``): every write lands in memory, page by page, and reaches the
disk only at :meth:`JournaledFile.sync`, which runs

1. the journal ``<archive>-journal``: the old contents of every page of the file that the sync
   will overwrite, the CRC-32 of the new contents of every page it will write, the old and the
   new file size, all under one checksum; ``fsync`` of the journal;
2. the new pages written into the archive file; ``fsync`` of the archive file (the commit point).

After a power cut the journal tells the three cases apart: a journal that fails its checksum was
not yet complete, so the archive file was not yet touched; a journal whose new-page CRCs all
match the file describes a sync that completed; otherwise the sync was cut in step 2 and the old
pages are written back (:func:`recover`), or shown in their place to a reader that may not write
(:func:`rollback_view`). That is SQLite's rollback journal applied to pages HDF5 wrote, without
understanding them. The journal stays valid after a sync (invalidating it would cost a third
fsync); a clean close zeroes its header. The byte layout is in ``docs/format.md``.

The page I/O goes through :data:`DISK`, which a power-loss test may replace with a recorder.
"""

from __future__ import annotations

import io
import os
import secrets
import struct
import zlib
from dataclasses import dataclass

from fkvstore.errors import ArchiveClosedError

__all__ = [
    "DISK",
    "PAGE",
    "JournalState",
    "JournaledFile",
    "SizedFile",
    "clear",
    "fsync_directory",
    "journal_path",
    "read_journal",
    "recover",
    "rollback_view",
]

PAGE = 4096
MAGIC = b"fkvjrnl\x01"
VERSION = 1
HEADER = 512  # one sector: the header is written whole or not at all, and checksummed anyway
# magic, version, page size, nonce, old size, new size, written pages, saved pages, body crc
_HEAD = struct.Struct("<8sIIQQQQQI")
_HEAD_CRC = struct.Struct("<I")
_NEW = struct.Struct("<QI")  # page index, CRC-32 of the page's new bytes
_OLD = struct.Struct("<Q")  # page index, then PAGE bytes of old contents


def journal_path(path: str | os.PathLike) -> str:
    """The rollback journal of the archive at ``path``: ``<path>-journal``."""
    return os.fspath(path) + "-journal"


# fdatasync where there is one (Linux): it flushes the data and the size, what reading the file
# back needs, without the timestamps (SQLite's choice as well); fsync elsewhere
_datasync = getattr(os, "fdatasync", os.fsync)


class _Disk:
    """The system calls a sync makes; ``path`` names the file for a recorder."""

    def pwrite(self, path: str, fd: int, data: bytes, offset: int) -> None:
        view = memoryview(data)
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n

    def ftruncate(self, path: str, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def fsync(self, path: str, fd: int) -> None:
        _datasync(fd)


#: the disk the journal writes through (replaced by the power-loss tests' recorder)
DISK = _Disk()


def fsync_directory(path: str | os.PathLike) -> None:
    """fsync the directory holding ``path``, so that a newly created file's name is durable."""
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:  # pragma: no cover - a platform without directory descriptors
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _page_bytes(fd: int, index: int, size: int) -> bytes:
    """Bytes ``[index*PAGE, min((index+1)*PAGE, size))`` of the file ``fd``, zero-padded to the
    range when the file is shorter."""
    lo = index * PAGE
    n = max(0, min(PAGE, size - lo))
    got = os.pread(fd, n, lo)
    return got + bytes(n - len(got))


@dataclass(frozen=True)
class JournalState:
    """A journal read back: ``complete`` when the archive file holds every page the sync wrote
    (nothing to undo); otherwise ``saved`` are the pages to put back and ``old_size`` the file
    size to restore."""

    old_size: int
    new_size: int
    complete: bool
    saved: dict[int, bytes]


def read_journal(path: str | os.PathLike) -> JournalState | None:
    """The journal of the archive at ``path`` if it is valid (a sync's journal that reached the
    disk whole), checked against the archive file; None when there is none to apply."""
    jpath = journal_path(path)
    try:
        with open(jpath, "rb") as fh:
            head = fh.read(HEADER)
            if len(head) < _HEAD.size + _HEAD_CRC.size or head[:8] != MAGIC:
                return None
            fields = _HEAD.unpack_from(head)
            (crc,) = _HEAD_CRC.unpack_from(head, _HEAD.size)
            if zlib.crc32(head[: _HEAD.size]) != crc:
                return None
            _, version, page, _, old_size, new_size, n_new, n_old, body_crc = fields
            body_size = n_new * _NEW.size + n_old * (_OLD.size + PAGE)
            if (version != VERSION or page != PAGE or n_old > n_new or old_size > new_size
                    or HEADER + body_size > os.fstat(fh.fileno()).st_size
                    or old_size > os.path.getsize(path)):
                return None  # cut short, or not a journal of this file
            fh.seek(HEADER)
            body = fh.read(body_size)
    except FileNotFoundError:
        return None
    if len(body) != body_size or zlib.crc32(body) != body_crc:
        return None  # cut while the journal was written: the archive file was not touched
    written = [_NEW.unpack_from(body, k * _NEW.size) for k in range(n_new)]
    saved = {}
    at = n_new * _NEW.size
    for _ in range(n_old):
        (index,) = _OLD.unpack_from(body, at)
        saved[index] = body[at + _OLD.size : at + _OLD.size + PAGE]
        at += _OLD.size + PAGE
    if (len(saved) != n_old or any(i * PAGE >= old_size for i in saved)
            or any(i * PAGE >= new_size for i, _ in written)):
        return None  # pages outside the file: not a journal fkvstore wrote
    with open(path, "rb") as fh:
        fd = fh.fileno()
        complete = os.fstat(fd).st_size >= new_size and all(
            zlib.crc32(_page_bytes(fd, index, new_size)) == crc for index, crc in written)
    return JournalState(old_size, new_size, complete, saved)


def clear(path: str | os.PathLike) -> None:
    """Zero the header of the journal of ``path``, if there is one (it then applies to nothing),
    and fsync it."""
    jpath = journal_path(path)
    try:
        fd = os.open(jpath, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        DISK.pwrite(jpath, fd, bytes(HEADER), 0)
        DISK.fsync(jpath, fd)
    finally:
        os.close(fd)


def recover(path: str | os.PathLike) -> bool:
    """Writer side, holding the writer lock: undo a sync that a power cut interrupted (write the
    saved pages back, restore the old size, fsync), then clear the journal. Returns whether
    pages were written back. Repeating it after a second cut is harmless."""
    path = os.fspath(path)
    state = read_journal(path)
    if state is None:
        return False
    rolled = not state.complete
    if rolled:
        fd = os.open(path, os.O_RDWR)
        try:
            for index in sorted(state.saved):
                lo = index * PAGE
                DISK.pwrite(path, fd, state.saved[index][: max(0, state.old_size - lo)], lo)
            DISK.ftruncate(path, fd, state.old_size)
            DISK.fsync(path, fd)
        finally:
            os.close(fd)
    clear(path)
    return rolled


class SizedFile(io.RawIOBase):
    """A seekable binary file object of ``_size`` bytes, positioned at ``_pos`` (the base of
    the file objects h5py reads through here and in :mod:`fkvstore._superblock`)."""

    _pos = 0
    _size = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = base + pos
        return self._pos

    def tell(self) -> int:
        return self._pos


class _RollbackView(SizedFile):
    """Read-only: the archive file as it was before an interrupted sync."""

    def __init__(self, path: str, state: JournalState):
        self._fh = open(path, "rb")  # noqa: SIM115 - owned, closed in close()
        self._state = state
        self._size = state.old_size

    def readinto(self, buf) -> int:
        view = memoryview(buf).cast("B")
        n = max(0, min(len(view), self._size - self._pos))
        self._fh.seek(self._pos)
        got = self._fh.readinto(view[:n]) or 0
        view[got:n] = bytes(n - got)
        pos, end = self._pos, self._pos + n
        for index in range(pos // PAGE, (end + PAGE - 1) // PAGE if n else pos // PAGE):
            old = self._state.saved.get(index)
            if old is not None:
                lo, hi = max(pos, index * PAGE), min(end, (index + 1) * PAGE)
                view[lo - pos : hi - pos] = old[lo - index * PAGE : hi - index * PAGE]
        self._pos = end
        return n

    def close(self) -> None:
        self._fh.close()
        super().close()


def rollback_view(path: str | os.PathLike) -> io.RawIOBase | None:
    """Reader side: a read-only file object of the archive as it was before a sync that a power
    cut interrupted, or None when the file needs no rollback. Changes nothing on disk."""
    state = read_journal(path)
    if state is None or state.complete:
        return None
    return _RollbackView(os.fspath(path), state)


class JournaledFile(SizedFile):
    """The archive file as the writer's HDF5 sees it: reads and writes at any offset, held in
    memory page by page (4 KiB) until :meth:`sync` writes them through the journal.

    Open on an existing file (``create=False``) after :func:`recover`, or on a new, empty one.
    The file never shrinks: a sync's rollback then only ever has to cut off appended bytes.
    """

    def __init__(self, path: str | os.PathLike, *, create: bool):
        self.path = os.fspath(path)
        self._jpath = journal_path(self.path)
        new_journal = not os.path.exists(self._jpath)
        self._jfd = os.open(self._jpath, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            self._fd = os.open(self.path, os.O_RDWR)
        except BaseException:
            os.close(self._jfd)
            raise
        if create:  # no old journal may be applied to the new file
            DISK.pwrite(self._jpath, self._jfd, bytes(HEADER), 0)
            DISK.fsync(self._jpath, self._jfd)
            DISK.ftruncate(self.path, self._fd, 0)
            DISK.fsync(self.path, self._fd)
        if create or new_journal:
            fsync_directory(self.path)
        self._disk_size = os.fstat(self._fd).st_size
        self._size = self._disk_size
        self._pages: dict[int, bytearray] = {}
        self._pos = 0
        self._failed: BaseException | None = None

    # -- the file object h5py drives ----------------------------------------------------------
    def writable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        view = memoryview(buf).cast("B")
        pos = self._pos
        n = max(0, min(len(view), self._size - pos))
        end = pos + n
        if n:
            got = os.preadv(self._fd, [view[:n]], pos) if pos < self._disk_size else 0
            view[got:n] = bytes(n - got)
            if self._pages:
                for index in range(pos // PAGE, (end - 1) // PAGE + 1):
                    page = self._pages.get(index)
                    if page is not None:
                        lo, hi = max(pos, index * PAGE), min(end, (index + 1) * PAGE)
                        view[lo - pos : hi - pos] = page[lo - index * PAGE : hi - index * PAGE]
        self._pos = end
        return n

    def write(self, data) -> int:
        src = memoryview(data).cast("B")
        pos, end = self._pos, self._pos + len(src)
        for index in range(pos // PAGE, (end - 1) // PAGE + 1 if len(src) else pos // PAGE):
            page = self._pages.get(index)
            if page is None:
                page = bytearray(_page_bytes(self._fd, index, self._disk_size).ljust(PAGE, b"\0"))
                self._pages[index] = page
            lo, hi = max(pos, index * PAGE), min(end, (index + 1) * PAGE)
            page[lo - index * PAGE : hi - index * PAGE] = src[lo - pos : hi - pos]
        self._pos = end
        self._size = max(self._size, end)
        return len(src)

    def truncate(self, size: int | None = None) -> int:
        """Extend to ``size``; a smaller size is ignored (HDF5 truncates to its end of
        allocation at close, and a longer file is valid HDF5)."""
        self._size = max(self._size, self._pos if size is None else size)
        return self._size

    def flush(self) -> None:
        """HDF5's flush: nothing reaches the disk before :meth:`sync`."""

    # -- durability ---------------------------------------------------------------------------
    @property
    def dirty(self) -> bool:
        return bool(self._pages) or self._size > self._disk_size

    def sync(self) -> None:
        """Make everything written so far durable, atomically: the journal, fsync, the pages,
        fsync. A power cut at any moment leaves the old or the new contents (after
        :func:`recover` or through :func:`rollback_view`)."""
        if self._failed is not None:
            raise ArchiveClosedError(
                f"a sync of {self.path!r} failed part-way ({self._failed}); nothing more can be "
                "committed: close the archive and open it again, which rolls that sync back")
        if not self.dirty:
            return
        try:
            self._write_through()
        except BaseException as exc:
            # the file may hold some new pages now: a later sync would journal them as old
            self._failed = exc
            raise

    def _write_through(self) -> None:
        old_size = self._disk_size
        new_size = max(old_size, self._size)
        indexes = sorted(i for i in self._pages if i * PAGE < new_size)
        saved = [i for i in indexes if i * PAGE < old_size]
        if saved:
            table = b"".join(
                _NEW.pack(i, zlib.crc32(self._pages[i][: min(PAGE, new_size - i * PAGE)]))
                for i in indexes)
            olds = b"".join(_OLD.pack(i) + _page_bytes(self._fd, i, old_size).ljust(PAGE, b"\0")
                            for i in saved)
            body = table + olds
            head = _HEAD.pack(MAGIC, VERSION, PAGE, secrets.randbits(64), old_size, new_size,
                              len(indexes), len(saved), zlib.crc32(body))
            head += _HEAD_CRC.pack(zlib.crc32(head))
            DISK.pwrite(self._jpath, self._jfd, head.ljust(HEADER, b"\0") + body, 0)
            DISK.fsync(self._jpath, self._jfd)
        k = 0
        while k < len(indexes):  # runs of adjacent pages in one write each
            j = k
            while j + 1 < len(indexes) and indexes[j + 1] == indexes[j] + 1:
                j += 1
            lo = indexes[k] * PAGE
            data = b"".join(bytes(self._pages[i]) for i in indexes[k : j + 1])
            DISK.pwrite(self.path, self._fd, data[: new_size - lo], lo)
            k = j + 1
        if os.fstat(self._fd).st_size < new_size:
            DISK.ftruncate(self.path, self._fd, new_size)
        DISK.fsync(self.path, self._fd)
        self._disk_size = new_size
        self._pages.clear()

    def close_clean(self) -> None:
        """After the final :meth:`sync` of a closed HDF5 file: clear the journal (a later open
        need not check it) and release the descriptors."""
        try:
            if not self.closed and self._failed is None:
                DISK.pwrite(self._jpath, self._jfd, bytes(HEADER), 0)
                DISK.fsync(self._jpath, self._jfd)
        finally:
            self.close()

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
            os.close(self._jfd)
        super().close()
