"""A copy of an archive laid out for reading over the network: metadata first, then small data,
then the streams' points.

A file written by appends has its metadata (object headers, chunk indexes, attributes) spread
between the data, wherever the file ended when HDF5 needed it; a reader over the network pays a
request for each piece. :func:`repack` writes the same archive with all metadata in one block
at the start (HDF5's ``meta_block_size``, made large enough, retried larger if it was not),
then the small datasets (tails, block checksums, arrays up to ``SMALL_BYTES``), then the large
ones (points and large arrays), and stores the length of everything before the large data in
the root attribute ``fkv_remote_head`` (:data:`fkvstore.layout.REMOTE_HEAD_ATTR`). A remote
reader fetches that head in one request when it opens the archive; after that only chunks of
points and large arrays cost requests (``docs/remote.md``).

The copy is otherwise the same archive (datasets with their creation properties and stored
chunk bytes, groups and attributes as they are, unfinished ``.new_`` arrays left out): any
fkvstore and any HDF5 reader reads it, and opened for writing locally it behaves as any archive
(the head attribute is then a hint that may be stale; correctness never depends on it).
"""

from __future__ import annotations

import os

import h5py
import numpy as np

from fkvstore import layout

__all__ = ["SMALL_BYTES", "repack"]

SMALL_BYTES = 64 << 10  # datasets up to this size go into the head (points never do)
_ATTEMPTS = 4


def repack(src: h5py.File, dst_path: str | os.PathLike) -> int:
    """Write the archive open in ``src`` to a new file at ``dst_path`` (replaced if present);
    returns the head size in bytes (everything but the large data)."""
    groups, small, large = _plan(src)
    nchunks = sum(_num_chunks(src[name]) for name in large)
    meta = _round_up(16384 + 1024 * (len(groups) + len(small) + len(large)) + 24 * nchunks)
    for _ in range(_ATTEMPTS):
        head, spilled = _write(src, dst_path, groups, small + large, large, meta)
        if not spilled:
            break
        meta *= 2  # metadata did not fit in the first block: some lies between large data
    return head


def _plan(src: h5py.File) -> tuple[list[str], list[str], list[str]]:
    """Paths of the groups, the small datasets and the large datasets, in copy order
    (unfinished ``.new_`` arrays of a killed writer left out)."""
    groups, small, large = [], [], []

    def visit(name, obj):
        if name.rsplit("/", 1)[-1].startswith(layout.UNFINISHED_PREFIX):
            return None
        if isinstance(obj, h5py.Group):
            groups.append(name)
            return None
        parent, _, leaf = name.rpartition("/")
        layout.child(src[parent or "/"], leaf)  # refuses virtual and externally stored data
        if name.endswith("/" + layout.POINTS) or obj.id.get_storage_size() > SMALL_BYTES:
            large.append(name)
        else:
            small.append(name)
        return None

    src.visititems(visit)
    return groups, small, large


def _write(src, dst_path, groups, datasets, large, meta_bytes):
    """One attempt: ``(head, spilled)``, spilled when metadata lies beyond the head."""
    with h5py.File(dst_path, "w", libver=("v110", "v110"), meta_block_size=meta_bytes,
                   locking=False) as dst:
        _copy_attrs(src, dst)
        dst.attrs.create(layout.REMOTE_HEAD_ATTR, np.uint64(0))
        for name in groups:
            _copy_attrs(src[name], dst.create_group(name))
        for name in datasets:
            parent, _, leaf = name.rpartition("/")
            _copy_dataset(src[name], dst[parent or "/"], leaf)
        dst.flush()
        extents = sorted(e for name in large for e in _extents(dst[name]))
        eof = dst.id.get_filesize()
        head = extents[0][0] if extents else eof
        pos, spilled = head, False
        for start, size in extents:
            spilled |= start > pos
            pos = max(pos, start + size)
        spilled |= eof > pos
        dst.attrs.modify(layout.REMOTE_HEAD_ATTR, np.uint64(head))  # same size: in place
    return head, spilled


def _copy_dataset(ds: h5py.Dataset, group: h5py.Group, leaf: str) -> None:
    """``ds`` as ``group[leaf]``: its creation properties (chunks, filters, fill value) as
    they are, chunks copied as stored bytes (no decompressing), attributes with their types.
    (Not HDF5's object copy: that fails on a file reopened for writing in SWMR mode.)"""
    new = h5py.h5d.create(group.id, leaf.encode(), ds.id.get_type(), ds.id.get_space(),
                          dcpl=ds.id.get_create_plist())
    out = h5py.Dataset(new)
    if ds.chunks:
        def move(info):
            mask, data = ds.id.read_direct_chunk(info.chunk_offset)
            out.id.write_direct_chunk(info.chunk_offset, data, mask)

        ds.id.chunk_iter(move)
    elif ds.size:
        out[...] = ds[...]
    _copy_attrs(ds, out)


def _copy_attrs(src, dst) -> None:
    """Attributes of ``src`` onto ``dst`` with their stored types (the head attribute aside)."""
    for name in src.attrs:
        if name == layout.REMOTE_HEAD_ATTR:
            continue
        aid = src.attrs.get_id(name)
        dst.attrs.create(name, src.attrs[name], shape=aid.shape, dtype=aid.dtype)


def _num_chunks(ds: h5py.Dataset) -> int:
    return ds.id.get_num_chunks() if ds.chunks else 1


def _extents(ds: h5py.Dataset) -> list[tuple[int, int]]:
    """``(file offset, bytes)`` of the raw data of ``ds`` (each chunk, or the one block)."""
    if not ds.chunks:
        offset = ds.id.get_offset()
        return [] if offset is None else [(offset, ds.id.get_storage_size())]
    out = []
    ds.id.chunk_iter(lambda info: out.append((info.byte_offset, info.size)))
    return out


def _round_up(n: int, unit: int = 4096) -> int:
    return -(-n // unit) * unit
