"""Reading and repairing the HDF5 superblock (format versions 2 and 3) without the HDF5 library.

A process that dies while it has an HDF5 file open for writing leaves the "file consistency flags"
of the superblock set, and HDF5 then refuses every ordinary open ("file is already open for
write"). HDF5's ``h5clear -s`` tool resets them, but h5py does not ship it, so this module does the
same small edit itself: zero the flags byte and rewrite the superblock checksum.

Superblock version 2/3 layout (all integers little-endian; see the HDF5 File Format Specification,
section "Superblock", and ``docs/format.md``)::

    offset  size  field
    0       8     signature  \\x89HDF\\r\\n\\x1a\\n
    8       1     superblock version (2 or 3)
    9       1     size of offsets  (O, normally 8)
    10      1     size of lengths  (normally 8)
    11      1     file consistency flags (bit 0: open for write, bit 2: open for SWMR write)
    12      O     base address
    12+O    O     superblock extension address
    12+2O   O     end-of-file address (relative to the base address)
    12+3O   O     root group object header address
    12+4O   4     checksum: Jenkins lookup3 over every byte before it, initial value 0

The superblock sits at byte 0, or at 512, 1024, 2048, ... when the file has a user block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
from dataclasses import dataclass

from fkvstore._journal import SizedFile
from fkvstore.errors import ArchiveFormatError

__all__ = ["Superblock", "clear_status_flags", "lookup3", "open_cleared_view", "read_superblock"]

SIGNATURE = b"\x89HDF\r\n\x1a\n"
_MASK = 0xFFFFFFFF


def _rot(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & _MASK


def lookup3(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 ``hashlittle`` of ``data``: the checksum HDF5 puts on its metadata."""
    length = len(data)
    a = b = c = (0xDEADBEEF + length + initval) & _MASK
    i = 0
    while length > 12:
        a = (a + int.from_bytes(data[i : i + 4], "little")) & _MASK
        b = (b + int.from_bytes(data[i + 4 : i + 8], "little")) & _MASK
        c = (c + int.from_bytes(data[i + 8 : i + 12], "little")) & _MASK
        a = (a - c) & _MASK
        a ^= _rot(c, 4)
        c = (c + b) & _MASK
        b = (b - a) & _MASK
        b ^= _rot(a, 6)
        a = (a + c) & _MASK
        c = (c - b) & _MASK
        c ^= _rot(b, 8)
        b = (b + a) & _MASK
        a = (a - c) & _MASK
        a ^= _rot(c, 16)
        c = (c + b) & _MASK
        b = (b - a) & _MASK
        b ^= _rot(a, 19)
        a = (a + c) & _MASK
        c = (c - b) & _MASK
        c ^= _rot(b, 4)
        b = (b + a) & _MASK
        length -= 12
        i += 12
    if length == 0:
        return c
    tail = data[i:] + bytes(12 - length)
    a = (a + int.from_bytes(tail[0:4], "little")) & _MASK
    b = (b + int.from_bytes(tail[4:8], "little")) & _MASK
    c = (c + int.from_bytes(tail[8:12], "little")) & _MASK
    c ^= b
    c = (c - _rot(b, 14)) & _MASK
    a ^= c
    a = (a - _rot(c, 11)) & _MASK
    b ^= a
    b = (b - _rot(a, 25)) & _MASK
    c ^= b
    c = (c - _rot(b, 16)) & _MASK
    a ^= c
    a = (a - _rot(c, 4)) & _MASK
    b ^= a
    b = (b - _rot(a, 14)) & _MASK
    c ^= b
    c = (c - _rot(b, 24)) & _MASK
    return c


@dataclass(frozen=True)
class Superblock:
    """The fields of a version 2/3 superblock that recovery needs."""

    offset: int  # byte position of the superblock in the file
    version: int
    status_flags: int
    base_address: int
    eof_address: int  # end of the file's allocated space, relative to base_address
    size: int  # bytes of the superblock, checksum included


def read_superblock(path: str | os.PathLike, base: io.IOBase | None = None
                    ) -> Superblock | None:
    """The superblock of the HDF5 file at ``path`` (read through the file object ``base`` when
    given); ``None`` for superblock versions 0 and 1.

    Raises :class:`ArchiveFormatError` when no HDF5 signature is found or the checksum is wrong.
    """
    with (open(path, "rb") if base is None else contextlib.nullcontext(base)) as fh:
        size = fh.seek(0, io.SEEK_END)
        offset = 0
        while True:
            fh.seek(offset)
            head = fh.read(12)
            if head[:8] == SIGNATURE:
                break
            offset = 512 if offset == 0 else offset * 2
            if offset + 12 > size:
                raise ArchiveFormatError(f"{os.fspath(path)!r} is not an HDF5 file (no signature)")
        version = head[8]
        if version < 2:
            return None
        if version > 3:
            raise ArchiveFormatError(
                f"{os.fspath(path)!r} has HDF5 superblock version {version}, which fkvstore "
                "cannot repair; open it with a newer fkvstore"
            )
        o = head[9]
        block_size = 12 + 4 * o + 4
        fh.seek(offset)
        block = fh.read(block_size)
    if len(block) < block_size:
        raise ArchiveFormatError(f"{os.fspath(path)!r} is truncated inside its HDF5 superblock")
    stored = int.from_bytes(block[-4:], "little")
    if lookup3(block[:-4]) != stored:
        raise ArchiveFormatError(f"{os.fspath(path)!r}: the HDF5 superblock checksum is wrong")
    return Superblock(
        offset=offset,
        version=version,
        status_flags=block[11],
        base_address=int.from_bytes(block[12 : 12 + o], "little"),
        eof_address=int.from_bytes(block[12 + 2 * o : 12 + 3 * o], "little"),
        size=block_size,
    )


def clear_status_flags(path: str | os.PathLike) -> bool:
    """Reset the consistency flags a killed writer left behind (what ``h5clear -s`` does).

    Call this only while holding the archive's writer lock, so that no live writer owns the flags.
    Also extends a file that is shorter than the end-of-file address its superblock records (space
    a writer had allocated but not yet written when it died) with zero bytes, which HDF5 otherwise
    rejects as a truncated file. Returns whether anything was changed; the edit is fsynced.
    """
    sb = read_superblock(path)
    if sb is None:
        return False
    changed = False
    with open(path, "r+b") as fh:
        if sb.status_flags:
            # A writer that died inside a flush may have written chunk-index entries for space
            # it allocated past the recorded end of file (the superblock is written last). HDF5
            # would hand that space out again and two chunks would share bytes, so the recorded
            # end of file is moved past everything the file holds.
            fh.seek(sb.offset)
            block = bytearray(fh.read(sb.size))
            block[11] = 0
            o = block[9]
            real_end = os.fstat(fh.fileno()).st_size - sb.base_address
            if real_end > sb.eof_address:
                block[12 + 2 * o : 12 + 3 * o] = real_end.to_bytes(o, "little")
                sb = dataclasses.replace(sb, eof_address=real_end)
            block[-4:] = lookup3(bytes(block[:-4])).to_bytes(4, "little")
            fh.seek(sb.offset)
            fh.write(block)
            changed = True
        end = sb.base_address + sb.eof_address
        if os.fstat(fh.fileno()).st_size < end:
            fh.truncate(end)
            changed = True
        if changed:
            fh.flush()
            os.fsync(fh.fileno())
    return changed


class _ClearedView(SizedFile):
    """A read-only view of an HDF5 file whose superblock shows cleared status flags, and which
    reads zeros past the end of the file up to the recorded end-of-file address. Lets a reader
    open a file a writer died with, without changing a byte of it. ``fh`` is the file (a binary
    file object, owned by the view from here on)."""

    def __init__(self, fh, sb: Superblock):
        self._fh = fh
        self._pos = 0
        self._fh.seek(sb.offset)
        block = bytearray(self._fh.read(sb.size))
        block[11] = 0
        block[-4:] = lookup3(bytes(block[:-4])).to_bytes(4, "little")
        self._sb_offset = sb.offset
        self._sb = bytes(block)
        real = self._fh.seek(0, io.SEEK_END)
        self._size = max(real, sb.base_address + sb.eof_address)

    def readinto(self, buf) -> int:
        view = memoryview(buf).cast("B")
        n = max(0, min(len(view), self._size - self._pos))
        self._fh.seek(self._pos)
        got = self._fh.readinto(view[:n])
        view[got:n] = bytes(n - got)
        lo = max(self._pos, self._sb_offset)
        hi = min(self._pos + n, self._sb_offset + len(self._sb))
        if lo < hi:
            view[lo - self._pos : hi - self._pos] = self._sb[
                lo - self._sb_offset : hi - self._sb_offset
            ]
        self._pos += n
        return n

    def close(self) -> None:
        self._fh.close()
        super().close()


def open_cleared_view(path: str | os.PathLike, base: io.RawIOBase | None = None
                      ) -> io.RawIOBase:
    """A read-only file object of ``path`` with the superblock's status flags shown cleared;
    ``base``, when given, is the file object to read ``path`` through (the view takes it over
    and closes it).

    Pass it to ``h5py.File(view, "r")``. Raises ArchiveFormatError for superblocks older than
    version 2 (those carry no status flags).
    """
    fh = open(path, "rb") if base is None else base  # noqa: SIM115 - the view closes it
    try:
        sb = read_superblock(path, fh)
        if sb is None:
            raise ArchiveFormatError(f"{os.fspath(path)!r} has no status flags to clear")
        return _ClearedView(fh, sb)
    except BaseException:
        fh.close()
        raise
