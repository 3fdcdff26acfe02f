"""The exceptions fkvstore raises.

Every error derives from :class:`FkvError`; the subclasses also derive from the built-in
exception a caller would already catch (``ValueError``, ``IndexError``, ...), so
``except ValueError`` keeps working around fkvstore calls.
"""

from __future__ import annotations

__all__ = [
    "FkvError",
    "InvalidPointError",
    "ArchiveClosedError",
    "ArchiveFormatError",
    "ArchiveLinkError",
    "ArchiveParentError",
    "ArchiveLockedError",
    "ChecksumError",
    "StreamNotFoundError",
    "ArchiveNotFoundError",
    "PositionError",
    "ArchiveExistsError",
    "ArchiveReadOnlyError",
    "ArchiveIOError",
    "ArchiveDiskFullError",
    "ArchivePermissionError",
    "ArchiveReadOnlyFileSystemError",
    "RemoteArchiveError",
    "RemoteAuthError",
    "RemoteModeError",
    "RemoteObjectChangedError",
]


class FkvError(Exception):
    """Base class of every error fkvstore raises."""


class InvalidPointError(FkvError, ValueError):
    """A stored point does not decode back to a valid span (damaged or foreign data)."""


class ArchiveClosedError(FkvError, ValueError):
    """An operation on an archive (or one of its streams) after it was closed."""


class ArchiveFormatError(FkvError, ValueError):
    """A file that is not an fkvstore archive, or one written by an unknown format version."""


class ArchiveLinkError(ArchiveFormatError):
    """An object of the archive is a link (external or soft), a virtual dataset or a dataset
    with external raw storage: fkvstore never follows these, so that a file cannot make it read
    (or write) anything outside itself."""


class ArchiveParentError(ArchiveLinkError):
    """An attribute naming another archive file (a serving fork's ``parent``) that is not a
    relative path, resolves (symbolic links followed) outside the directory the caller allows,
    closes a cycle, or starts a chain of parents deeper than the limit."""


class ArchiveLockedError(FkvError, OSError):
    """A second writer tried to open an archive that already has one."""


class ChecksumError(FkvError, ValueError):
    """Stored data does not match its checksum."""


class StreamNotFoundError(FkvError, KeyError):
    """No stream or array of that name in the archive."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class ArchiveNotFoundError(FkvError, FileNotFoundError):
    """Opening an archive for reading that does not exist."""


class PositionError(FkvError, IndexError):
    """A position outside a stream."""


class ArchiveExistsError(FkvError, FileExistsError):
    """Creating an archive (mode ``"w-"``/``"x"``) where a file already exists."""


class ArchiveReadOnlyError(FkvError, PermissionError):
    """A change to an archive that was opened read-only (mode ``"r"``)."""


class ArchiveIOError(FkvError, OSError):
    """The operating system refused to read or write an archive's file (or its lock).
    ``errno``, ``strerror`` and ``filename`` are those of the refusal; the message keeps the
    underlying (HDF5) report."""


class ArchiveDiskFullError(ArchiveIOError):
    """No space left on the device (``ENOSPC``) or the user's disk quota exceeded (``EDQUOT``)
    while writing an archive."""


class ArchivePermissionError(ArchiveIOError, PermissionError):
    """The file or its folder may not be read or written by this user (``EACCES``, ``EPERM``)."""


class ArchiveReadOnlyFileSystemError(ArchiveIOError):
    """A write to an archive on a file system mounted read-only (``EROFS``): open it with mode
    ``"r"``."""


class RemoteArchiveError(FkvError, OSError):
    """Object storage failed while opening, reading or uploading a remote archive (a URL)."""


class RemoteAuthError(RemoteArchiveError, PermissionError):
    """Object storage refused the credentials, or the request (wrong keys, no permission)."""


class RemoteObjectChangedError(RemoteArchiveError):
    """The object behind an open remote archive was overwritten or deleted since it was opened
    (its ETag or version no longer matches): reads that need new bytes cannot go on."""


class RemoteModeError(FkvError, ValueError):
    """A mode other than ``"r"`` for a URL: remote archives are read-only (publish a local
    archive with ``Archive.publish`` or ``fkvstore.copy`` instead)."""
