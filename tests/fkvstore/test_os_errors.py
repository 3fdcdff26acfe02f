"""Refusals of the operating system arrive as named FkvErrors that keep errno and the path: a
full disk, a read-only file system, no permission; and ``import fkvstore`` works where Numba
can write no cache."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest

import fkvstore
from fkvstore._lock import WriterLock
from fkvstore._os_errors import named_os_error
from fkvstore.errors import (
    ArchiveDiskFullError,
    ArchiveIOError,
    ArchivePermissionError,
    ArchiveReadOnlyError,
    ArchiveReadOnlyFileSystemError,
    FkvError,
)

REPO = Path(__file__).resolve().parents[2]

HDF5_FLUSH = ("Unable to flush file (file write failed: time = now\n, filename = 'x.h5', "
              "errno = {}, error message = 'whatever')")


@pytest.mark.parametrize("code, hdf5, cls", [
    (errno.ENOSPC, False, ArchiveDiskFullError),
    (errno.ENOSPC, True, ArchiveDiskFullError),
    (errno.EDQUOT, True, ArchiveDiskFullError),
    (errno.EACCES, False, ArchivePermissionError),
    (errno.EPERM, False, ArchivePermissionError),
    (errno.EROFS, False, ArchiveReadOnlyFileSystemError),
])
def test_refusals_are_named_and_keep_errno_and_path(code, hdf5, cls):
    # Python's own I/O raises OSError with errno; HDF5's failed flush a RuntimeError naming it
    exc = RuntimeError(HDF5_FLUSH.format(code)) if hdf5 else OSError(code, os.strerror(code))
    named = named_os_error(exc, "/data/a.h5")
    assert type(named) is cls and isinstance(named, (FkvError, OSError))
    assert (named.errno, named.filename) == (code, "/data/a.h5")
    assert os.strerror(named.errno) in str(named) and "a.h5" in str(named)
    if cls is ArchivePermissionError:
        assert isinstance(named, PermissionError)


@pytest.mark.parametrize("exc", [OSError("no errno"), RuntimeError("slist already enabled?"),
                                 OSError(errno.EIO, "I/O error"), ValueError("x"),
                                 ArchiveReadOnlyError("mode 'r'")])
def test_other_errors_are_left_alone(exc):
    assert named_os_error(exc, "a.h5") is None


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs (skipped where mounting is not allowed); unmounted afterwards."""
    where = tmp_path / f"fs-{uuid.uuid4().hex[:8]}"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
                          capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_is_an_archive_disk_full_error(small_fs):
    path = small_fs / "a.h5"
    rows = np.random.default_rng(0).integers(0, 256, 100_000)
    ar = fkvstore.open(path, "w")
    s = ar.create_stream("s", 256)
    s.extend(rows[:1000])
    ar.flush()
    with pytest.raises(ArchiveDiskFullError) as caught:
        for _ in range(40):  # 40 x 123 KB of points into 1 MiB
            s.extend(rows)
            ar.flush()
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(path)
    # HDF5 cannot write this file any more: what follows fails as the full disk, named
    with pytest.raises(ArchiveDiskFullError):
        ar.put_array("big", np.zeros(200_000))
    with pytest.raises(ArchiveDiskFullError):
        ar.close()
    WriterLock(path, create=False).release()  # the failed close released the writer lock
    with fkvstore.open(path) as ar:  # what was committed before the disk filled is intact
        assert len(ar["s"]) >= 1000 and np.array_equal(ar["s"][:1000], rows[:1000])
        assert not ar.verify()["s"]


def test_a_read_only_file_system_refuses_writers_and_serves_readers(small_fs):
    path = small_fs / "a.h5"
    with fkvstore.open(path, "w") as ar:
        ar.create_stream("s", 10).extend([1, 2, 3])
    done = subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot remount read-only: {done.stderr.decode().strip()}")
    for mode in ("a", "r+", "w"):
        with pytest.raises(ArchiveReadOnlyFileSystemError) as caught:
            fkvstore.open(path, mode)
        assert caught.value.errno == errno.EROFS and caught.value.filename == str(path)
    with fkvstore.open(path) as ar:
        assert ar["s"][:].tolist() == [1, 2, 3]


def test_every_refusal_is_an_archive_io_error():
    assert all(issubclass(c, ArchiveIOError) for c in
               (ArchiveDiskFullError, ArchivePermissionError, ArchiveReadOnlyFileSystemError))


def test_import_works_where_numba_can_write_no_cache(tmp_path):
    # a read-only install (no __pycache__ beside the source) and a HOME that cannot exist
    code = textwrap.dedent(f"""
        import sys
        import numba.core.caching as caching
        caching.InTreeCacheLocator.from_function = classmethod(lambda cls, f, s: None)
        sys.path.insert(0, {str(REPO)!r})
        import fkvstore
        codec = fkvstore.Codec(16)
        print(codec.decode(codec.encode([1, 2, 3]), 3).tolist())
    """)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(HOME="/dev/null/home", XDG_CACHE_HOME="/dev/null/cache")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["[1,", "2,", "3]"]
