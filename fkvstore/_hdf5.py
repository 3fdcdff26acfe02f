"""Opening an SWMR reader with a bound on HDF5's metadata retries, which h5py does not expose.

An SWMR reader re-reads metadata whose checksum fails, since a writer may be in the middle of
rewriting it: by default up to 100 times with growing pauses, so one flipped bit in an object
header keeps a reader busy for minutes before it fails. ``H5Pset_metadata_read_attempts`` bounds
that; it is called through ctypes on the libhdf5 that h5py itself loaded (looked up through
h5py's extension module, whose dependencies include it). Where the symbol cannot be found,
HDF5's default stays.
"""

from __future__ import annotations

import ctypes
import os

import h5py
from h5py import h5f, h5p

__all__ = ["METADATA_READ_ATTEMPTS", "open_swmr_reader"]

#: read attempts of a metadata block with a bad checksum (HDF5's default for SWMR readers is
#: 100); a writer's in-place rewrite of a block takes far fewer
METADATA_READ_ATTEMPTS = 20


def _set_attempts_function():
    try:
        fn = ctypes.CDLL(h5p.__file__).H5Pset_metadata_read_attempts
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int64, ctypes.c_uint]  # hid_t is 64-bit since HDF5 1.10
    fn.restype = ctypes.c_int
    return fn


_SET_ATTEMPTS = _set_attempts_function()


def open_swmr_reader(path: str | os.PathLike, libver: tuple[str, str]) -> h5py.File:
    """``h5py.File(path, "r", swmr=True, libver=libver, locking=False)`` with at most
    :data:`METADATA_READ_ATTEMPTS` reads of a damaged metadata block; OSError as h5py raises."""
    fapl = h5p.create(h5p.FILE_ACCESS)
    low, high = (getattr(h5f, f"LIBVER_{v.upper()}") for v in libver)
    fapl.set_libver_bounds(low, high)
    fapl.set_file_locking(False, False)
    if _SET_ATTEMPTS is not None and _SET_ATTEMPTS(fapl.id, METADATA_READ_ATTEMPTS) < 0:
        raise OSError("HDF5 refused to bound the metadata read attempts")
    fid = h5f.open(os.fsencode(path), h5f.ACC_RDONLY | h5f.ACC_SWMR_READ, fapl=fapl)
    return h5py.File(fid)
