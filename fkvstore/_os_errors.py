"""The operating system's refusals (a full disk, a read-only file system, no permission) as
named :class:`~fkvstore.errors.ArchiveIOError` subclasses.

HDF5 reports them as ``OSError`` with ``errno`` set, or as ``RuntimeError`` whose message holds
``errno = N`` (a failed flush), and Python's own ``open`` as ``OSError``; :func:`named_os_error`
recognises all three, and the two decorators apply it to a method of an object with a ``path``
(a plain method, or the generator behind a ``contextmanager``, whose ``with`` body's errors
pass through it too).
"""

from __future__ import annotations

import errno
import functools
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

from fkvstore.errors import (
    ArchiveDiskFullError,
    ArchiveIOError,
    ArchivePermissionError,
    ArchiveReadOnlyFileSystemError,
    FkvError,
)

__all__ = ["named_os_error", "named_os_errors", "named_os_errors_in_generator", "naming_os_errors"]

_BY_ERRNO: dict[int, type[ArchiveIOError]] = {
    errno.ENOSPC: ArchiveDiskFullError,
    errno.EDQUOT: ArchiveDiskFullError,
    errno.EACCES: ArchivePermissionError,
    errno.EPERM: ArchivePermissionError,
    errno.EROFS: ArchiveReadOnlyFileSystemError,
}
_ERRNO_IN_MESSAGE = re.compile(r"errno = (\d+)")


def named_os_error(exc: BaseException, path: str | os.PathLike) -> ArchiveIOError | None:
    """The :class:`ArchiveIOError` subclass instance for ``exc`` (about the archive at
    ``path``), or None when ``exc`` is no refusal of the operating system named here."""
    if isinstance(exc, FkvError) or not isinstance(exc, (OSError, RuntimeError)):
        return None
    code = exc.errno if isinstance(exc, OSError) else None
    if code is None:
        found = _ERRNO_IN_MESSAGE.search(str(exc))
        code = int(found.group(1)) if found else None
    cls = _BY_ERRNO.get(code) if code is not None else None
    if cls is None or code is None:
        return None
    detail = str(exc).split("\n", 1)[0]
    return cls(code, f"{os.strerror(code)} ({detail})", os.fspath(path))


@contextmanager
def naming_os_errors(owner) -> Iterator[None]:
    """Refusals of the operating system raised inside leave as :func:`named_os_error` names
    them (about the archive at ``owner.path``); other errors pass unchanged, except that after
    a refusal (remembered as ``owner.os_failure``) HDF5's errors without an errno (its state
    after a failed write: "slist already enabled?") leave as that refusal too."""
    try:
        yield
    except (OSError, RuntimeError) as exc:
        if isinstance(exc, FkvError):
            raise
        named = named_os_error(exc, getattr(owner, "path", ""))
        earlier = getattr(owner, "os_failure", None)
        if named is None and earlier is not None:
            detail = str(exc).split("\n", 1)[0]
            named = type(earlier)(
                earlier.errno,
                f"{os.strerror(earlier.errno)} earlier, so the file can no longer be written "
                f"({detail}); reopen the archive",
                earlier.filename,
            )
        if named is None:
            raise
        owner.os_failure = named
        raise named from exc


def named_os_errors(method):
    """Decorate ``method`` of an object with a ``path``: its body runs in
    :func:`naming_os_errors`."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with naming_os_errors(self):
            return method(self, *args, **kwargs)

    return wrapper


def named_os_errors_in_generator(method):
    """:func:`named_os_errors` for a generator method (the body of a ``contextmanager``)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with naming_os_errors(self):
            return (yield from method(self, *args, **kwargs))

    return wrapper
