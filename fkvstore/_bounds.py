"""Bounds, from the file's own size, on what stored values may make fkvstore allocate or grow.

A hostile file can declare any shape, length or end of file in a few bytes of metadata. Data
fkvstore writes is stored unfiltered and whole, so every byte it reads back exists in the file:
a declared size beyond the file's size is damage (or a trap), refused before anything is read
or allocated. The one place a file may legitimately claim more than it holds is the space a
writer had allocated but not yet written when it died; that gap is bounded too.
"""

from __future__ import annotations

import os

import h5py

from fkvstore.errors import ArchiveFormatError

__all__ = ["MAX_UNWRITTEN_BYTES", "check_array_size", "check_recorded_end", "file_bytes"]

#: the largest gap a dead writer may leave between its file's real end and the end its
#: superblock records (allocated, never written) that a writer fills with zeros; beyond it and
#: beyond the file's own size, the file is refused rather than grown
MAX_UNWRITTEN_BYTES = 256 << 20


def file_bytes(f: h5py.File) -> int:
    """The size in bytes of the file behind ``f`` now (a reader sees a writer's growth)."""
    size = f.id.get_filesize()
    if f.driver == "sec2":  # HDF5 does not re-read the size of a file another process grows
        size = max(size, os.fstat(f.id.get_vfd_handle()).st_size)
    return size


def check_array_size(ds: h5py.Dataset) -> None:
    """ArchiveFormatError unless reading ``ds`` whole allocates at most the file's size: its
    data must be unfiltered (fkvstore writes no filters; a compressed array can expand a
    thousandfold) and its declared bytes no more than the file holds."""
    nfilters = ds.id.get_create_plist().get_nfilters()
    if nfilters:
        raise ArchiveFormatError(
            f"array {ds.name!r} is stored through {nfilters} HDF5 filter(s) (compression?): "
            "fkvstore writes arrays unfiltered and reads no others (a filtered array can "
            "expand far beyond the file)"
        )
    declared = ds.dtype.itemsize * int(ds.size or 0)
    size = file_bytes(ds.file)
    if declared > size:
        raise ArchiveFormatError(
            f"array {ds.name!r} declares shape {ds.shape} of {ds.dtype} ({declared} bytes), "
            f"more than the {size} bytes of the whole file: the file is damaged"
        )


def check_recorded_end(path: str | os.PathLike, recorded_end: int) -> None:
    """ArchiveFormatError when the file at ``path`` is shorter than the end of file its
    superblock records (``recorded_end``, bytes) by more than :data:`MAX_UNWRITTEN_BYTES` and
    more than its own size: a writer would otherwise extend it to that size with zeros."""
    real = os.path.getsize(path)
    missing = recorded_end - real
    if missing > max(MAX_UNWRITTEN_BYTES, real):
        raise ArchiveFormatError(
            f"{os.fspath(path)!r} is {real} bytes long but its superblock records an end of "
            f"file at {recorded_end} bytes: more missing than a dead writer leaves; the file is "
            "truncated or damaged and is not extended (it can still be opened read-only)"
        )
