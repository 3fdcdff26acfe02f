"""How an archive lies in its HDF5 file: names, attributes, datasets and the commit record.

Everything here speaks h5py and numpy only; :mod:`fkvstore._session`, :mod:`fkvstore._stored`,
:mod:`fkvstore.stream` and :mod:`fkvstore.archive` build the user-facing objects on top.
``docs/format.md`` describes the same layout for readers without fkvstore.

File ::

    /                       attrs fkv_format="fkvstore", fkv_format_version=1, fkv_library_version
    /streams/<name>/        one group per stream; attrs describe the codec (see STREAM_ATTRS)
        points              float64 (full_spans, width, 2): one walk point per complete span
        tail                float64 (2, width, 2): two slots for the point of the open last span
        block_crc           uint32 (blocks,): CRC-32 of every complete block of points
        aux/<key>           optional per-stream arrays (derived data such as a search index)
    /arrays/<name>          auxiliary arrays; attr fkv_crc32
    points.attrs["fkv_commit"]  the commit record (COMMIT_FIELDS), written last
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import astuple, dataclass

import h5py
import numpy as np

from fkvstore._bounds import check_array_size
from fkvstore.errors import ArchiveFormatError, ArchiveLinkError, ChecksumError

__all__ = [
    "ARRAYS",
    "AUX",
    "COMMIT_ATTR",
    "COMMIT_FIELDS",
    "DURABILITY_ATTR",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "REMOTE_HEAD_ATTR",
    "RESERVED_PREFIX",
    "STREAMS",
    "UNFINISHED_PREFIX",
    "Commit",
    "StreamInfo",
    "block_spans_for",
    "checksum",
    "child",
    "dataset",
    "has_link",
    "create_stream_group",
    "finished_names",
    "attrs_crc",
    "attrs_problem",
    "attrs_problems",
    "damaged_metadata",
    "get_checked_array",
    "put_checked_array",
    "seal_attrs",
    "read_block",
    "read_commit",
    "read_stream_info",
    "read_tail",
    "record_durability",
    "recorded_durability",
    "stream_path",
    "write_block",
    "write_commit",
    "write_tail",
]

FORMAT_NAME = "fkvstore"
FORMAT_VERSION = 2  # the newest version this fkvstore reads and writes
# version 1 for archives written at durability "process"; version 2 adds the attribute
# DURABILITY_ATTR = "fsync" and the rollback journal beside the file (docs/format.md)
DURABILITY_ATTR = "fkv_durability"
RESERVED_PREFIX = "fkv_"
STREAMS = "streams"
ARRAYS = "arrays"
AUX = "aux"
POINTS = "points"
TAIL = "tail"
BLOCK_CRC = "block_crc"
COMMIT_ATTR = "fkv_commit"
# on '/' of a copy laid out for remote reads (fkvstore/_repack.py): the number of leading bytes
# that hold all metadata and small data; a remote reader fetches them in one request
REMOTE_HEAD_ATTR = "fkv_remote_head"
#: CRC-32s of a group's attributes: fkvstore's own (``fkv_*``, these two and the remote head
#: aside) and the user's (format version 1, additive: absent in older files, then unchecked)
CONFIG_CRC_ATTR = "fkv_config_crc32"
USER_CRC_ATTR = "fkv_attrs_crc32"
_UNSEALED = (CONFIG_CRC_ATTR, USER_CRC_ATTR, REMOTE_HEAD_ATTR)
COMMIT_FIELDS = (
    "length",  # committed rows
    "full_spans",  # complete spans stored in `points` (= length // span)
    "tail_slot",  # which row of `tail` holds the open span's point
    "tail_count",  # symbols per column in the open span (= length % span; 0: no open span)
    "partial_crc",  # CRC-32 of the rows of the last, incomplete block of `points`
    "tail_crc",  # CRC-32 of the active tail slot (0 when tail_count == 0)
    "generation",  # +1 per commit
    "rewinds",  # +1 per truncate below the committed length
)
POINT_DTYPE = np.dtype("<f8")
CRC_DTYPE = np.dtype("<u4")
DEFAULT_CHUNK_BYTES = 1 << 15  # 32 KiB: one chunk read + CRC is a cold random read


@dataclass(frozen=True)
class Commit:
    """The commit record of one stream; see COMMIT_FIELDS."""

    length: int = 0
    full_spans: int = 0
    tail_slot: int = 0
    tail_count: int = 0
    partial_crc: int = 0
    tail_crc: int = 0
    generation: int = 0
    rewinds: int = 0

    def to_array(self) -> np.ndarray:
        return np.array(astuple(self), dtype="<u8")


@dataclass(frozen=True)
class StreamInfo:
    """The fixed description of a stream, from its group's attributes."""

    kind: str  # "symbols" or "text"
    codec_config: dict
    width: int
    block_spans: int


def checksum(rows: np.ndarray, value: int = 0) -> int:
    """CRC-32 (zlib) of the little-endian float64 bytes of ``rows``, continuing from ``value``."""
    return zlib.crc32(np.ascontiguousarray(rows, dtype=POINT_DTYPE).data, value)


def stream_path(name: str) -> str:
    """The absolute path of stream ``name``'s group."""
    return f"/{STREAMS}/{name}"


def block_spans_for(width: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Spans per chunk: the largest power of two whose chunk of (spans, width, 2) float64 fits."""
    n = max(1, chunk_bytes // (16 * width))
    return 1 << (n.bit_length() - 1)


def create_stream_group(
    streams: h5py.Group, name: str, *, kind: str, codec_config: dict, width: int, block_spans: int
) -> h5py.Group:
    """Create the group, datasets and attributes of an empty stream."""
    g = streams.create_group(name)
    g.attrs["fkv_kind"] = kind
    g.attrs["fkv_codec"] = json.dumps(codec_config, sort_keys=True)
    # the main codec parameters again as plain attributes, for h5dump/h5ls readers
    g.attrs["fkv_alphabet_size"] = int(codec_config["alphabet_size"])
    g.attrs["fkv_geometry"] = str(codec_config["geometry"])
    g.attrs["fkv_ratio"] = float(codec_config["ratio"])
    g.attrs["fkv_span"] = int(codec_config["span"])
    g.attrs["fkv_width"] = int(width)
    g.attrs["fkv_block_spans"] = int(block_spans)
    pts = g.create_dataset(
        POINTS,
        shape=(0, width, 2),
        maxshape=(None, width, 2),
        chunks=(block_spans, width, 2),
        dtype=POINT_DTYPE,
    )
    pts.attrs.create(COMMIT_ATTR, Commit().to_array())
    g.create_dataset(TAIL, shape=(2, width, 2), chunks=(1, width, 2), dtype=POINT_DTYPE)
    g.create_dataset(BLOCK_CRC, shape=(0,), maxshape=(None,), chunks=(1024,), dtype=CRC_DTYPE)
    seal_attrs(g)
    return g


def child(group: h5py.Group, name: str) -> h5py.Group | h5py.Dataset | None:
    """Object ``name`` of ``group``, or None when there is none; ArchiveLinkError when it is a
    soft or external link, an object with more than one hard link (an alias), a virtual
    dataset or a dataset with external raw storage.

    The link is inspected before it is followed: an external link would open another file
    (even ``name in group`` does), a virtual dataset or external storage reads other files'
    bytes. An archive written by fkvstore holds none of these."""
    if "/" in name:  # a path: its leading parts would be resolved unchecked
        return None
    where = f"{group.name.rstrip('/')}/{name}"
    try:
        link = group.get(name, getlink=True)
        if link is None:
            return None
        if not isinstance(link, h5py.HardLink):
            raise ArchiveLinkError(
                f"{where!r} is a {type(link).__name__}: fkvstore archives hold no links, and "
                "fkvstore does not follow them (a link can point outside the file)"
            )
        obj = group[name]
        links = h5py.h5o.get_info(obj.id).rc
    except (KeyError, OSError, RuntimeError) as exc:  # damaged metadata, or a writer's change
        if _gone(group, name):  # a writer deleted it meanwhile
            return None
        raise ArchiveFormatError(f"{where!r} cannot be opened ({exc}): the file is damaged") \
            from exc
    if links != 1:  # one object under two names: writes through one would corrupt the other
        raise ArchiveLinkError(
            f"{where!r} is one object under {links} names (hard links): fkvstore archives "
            "give each object one name, and an alias would let two streams or arrays share, "
            "and overwrite, the same data"
        )
    if isinstance(obj, h5py.Dataset) and (obj.is_virtual or obj.external):
        what = "a virtual dataset" if obj.is_virtual else "stored in external files"
        raise ArchiveLinkError(
            f"dataset {where!r} is {what}: fkvstore reads only data inside the archive file"
        )
    return obj


@contextmanager
def damaged_metadata(where: str) -> Iterator[None]:
    """HDF5's reports of metadata it cannot decode (``OSError``, ``RuntimeError``, a
    ``KeyError`` about a checksum) raised inside leave as ChecksumError naming ``where``."""
    try:
        yield
    except (OSError, RuntimeError, KeyError) as exc:
        if isinstance(exc, KeyError) and "checksum" not in str(exc):
            raise  # a missing name
        raise ChecksumError(f"{where} cannot be read ({exc}): the file is damaged") from exc


def _gone(group: h5py.Group, name: str) -> bool:
    try:
        return group.get(name, getlink=True) is None
    except (KeyError, OSError, RuntimeError):
        return False


def has_link(group: h5py.Group, name: str) -> bool:
    """Whether ``group`` has a member ``name``, without following it (``name in group``
    resolves an external link, opening the file it names)."""
    return "/" not in name and group.get(name, getlink=True) is not None


def dataset(g: h5py.Group, name: str) -> h5py.Dataset:
    """Dataset ``name`` of ``g`` (see :func:`child`); ArchiveFormatError when there is none."""
    obj = child(g, name)
    if not isinstance(obj, h5py.Dataset):
        raise ArchiveFormatError(
            f"stream group {g.name!r} is incomplete or damaged (no dataset {name!r}); the "
            "archive was not written by a compatible fkvstore"
        )
    return obj


def _unfiltered_chunks(ds: h5py.Dataset, chunks: tuple[int, ...]) -> bool:
    return ds.chunks == chunks and ds.id.get_create_plist().get_nfilters() == 0


def read_stream_info(g: h5py.Group) -> StreamInfo:
    """The description of the stream in group ``g``; ChecksumError when its attributes do not
    match their CRC-32, ArchiveFormatError when it is incomplete, or when an attribute that
    decides a size disagrees with the datasets: the readers trust ``fkv_width`` and
    ``fkv_block_spans`` when they lay out raw chunk bytes, so a mismatch would make them read
    or write past a buffer."""
    problem = attrs_problem(g, user=False)
    if problem is not None:
        raise ChecksumError(problem)
    try:
        info = StreamInfo(
            kind=str(g.attrs["fkv_kind"]),
            codec_config=json.loads(g.attrs["fkv_codec"]),
            width=int(g.attrs["fkv_width"]),
            block_spans=int(g.attrs["fkv_block_spans"]),
        )
    except (KeyError, ValueError, TypeError, OSError, RuntimeError) as exc:
        raise ArchiveFormatError(
            f"stream group {g.name!r} is incomplete or damaged ({exc}); the archive was not "
            "written by a compatible fkvstore"
        ) from exc
    points, tail, crc = (dataset(g, n) for n in (POINTS, TAIL, BLOCK_CRC))
    W, B = info.width, info.block_spans
    problem = None
    if info.kind not in ("symbols", "text"):
        problem = f"fkv_kind={info.kind!r} is neither 'symbols' nor 'text'"
    elif W < 1:
        problem = f"fkv_width={W} is not positive"
    elif B < 1 or B & (B - 1):
        problem = f"fkv_block_spans={B} is not a power of two"
    elif points.dtype != POINT_DTYPE or points.ndim != 3 or points.shape[1:] != (W, 2):
        problem = (f"fkv_width={W} disagrees with points of shape {points.shape} and dtype "
                   f"{points.dtype} (expected (spans, {W}, 2) {POINT_DTYPE})")
    elif not _unfiltered_chunks(points, (B, W, 2)):
        problem = (f"fkv_block_spans={B} and fkv_width={W} disagree with the chunks "
                   f"{points.chunks} of points (expected ({B}, {W}, 2), no filters)")
    elif (tail.dtype != POINT_DTYPE or tail.shape != (2, W, 2)
          or not _unfiltered_chunks(tail, (1, W, 2))):
        problem = (f"fkv_width={W} disagrees with tail of shape {tail.shape}, dtype "
                   f"{tail.dtype}, chunks {tail.chunks} (expected (2, {W}, 2) {POINT_DTYPE} "
                   f"in (1, {W}, 2) chunks, no filters)")
    elif crc.dtype != CRC_DTYPE or crc.ndim != 1:
        problem = (f"block_crc has shape {crc.shape} and dtype {crc.dtype}, expected (K,) "
                   f"{CRC_DTYPE}")
    if problem is not None:
        raise ArchiveFormatError(f"stream group {g.name!r} is damaged: {problem}")
    return info


def read_commit(points: h5py.Dataset) -> Commit:
    stored = np.asarray(points.attrs[COMMIT_ATTR])
    if stored.dtype.kind not in "iu":
        raise ArchiveFormatError(
            f"{points.name}: commit record has dtype {stored.dtype}, expected {np.dtype('<u8')}"
        )
    raw = stored.astype(np.uint64)
    if raw.shape != (len(COMMIT_FIELDS),):
        raise ArchiveFormatError(
            f"{points.name}: commit record has shape {raw.shape}, expected ({len(COMMIT_FIELDS)},)"
        )
    return Commit(*(int(v) for v in raw))


def write_commit(points: h5py.Dataset, commit: Commit) -> None:
    # same shape and type as at creation, so HDF5 rewrites the value in place
    points.attrs.modify(COMMIT_ATTR, commit.to_array())


def read_block(points: h5py.Dataset, block: int, block_spans: int, rows: int) -> np.ndarray:
    """Rows ``[0, rows)`` of chunk ``block`` of ``points``, unverified, shape (rows, width, 2)."""
    width = points.shape[1]
    _, raw = points.id.read_direct_chunk((block * block_spans, 0, 0))
    arr = np.frombuffer(raw, dtype=POINT_DTYPE).reshape(block_spans, width, 2)
    return arr[:rows]


def write_block(points: h5py.Dataset, block: int, block_spans: int, rows: np.ndarray) -> None:
    """Write chunk ``block`` whole: ``rows`` (n <= block_spans, width, 2), zero-padded."""
    width = points.shape[1]
    out = np.zeros((block_spans, width, 2), dtype=POINT_DTYPE)
    out[: len(rows)] = rows
    # unfiltered fixed-size chunks keep their file address, so a rewrite is in place and leaves
    # the bytes of committed rows as they were even if the writer dies mid-write
    points.id.write_direct_chunk((block * block_spans, 0, 0), out.tobytes())


def read_tail(tail: h5py.Dataset, slot: int) -> np.ndarray:
    width = tail.shape[1]
    _, raw = tail.id.read_direct_chunk((slot, 0, 0))
    return np.frombuffer(raw, dtype=POINT_DTYPE).reshape(width, 2)


def write_tail(tail: h5py.Dataset, slot: int, point: np.ndarray) -> None:
    tail.id.write_direct_chunk((slot, 0, 0), np.ascontiguousarray(point, POINT_DTYPE).tobytes())


def check_format(f: h5py.File, path: str | os.PathLike) -> None:
    """Raise ArchiveFormatError unless ``f`` is an fkvstore archive this version can read."""
    try:
        name = f.attrs.get("fkv_format")
        version = int(f.attrs.get("fkv_format_version", -1))
    except (OSError, RuntimeError, KeyError, ValueError, TypeError) as exc:
        raise ArchiveFormatError(f"{os.fspath(path)!r}: root attributes damaged ({exc})") \
            from exc
    if isinstance(name, bytes):
        name = name.decode("utf-8", "replace")
    if name != FORMAT_NAME:
        raise ArchiveFormatError(
            f"{os.fspath(path)!r} is an HDF5 file but not an fkvstore archive (no "
            "fkv_format='fkvstore' attribute on '/'); open it with h5py instead"
        )
    if version > FORMAT_VERSION:
        raise ArchiveFormatError(
            f"{os.fspath(path)!r} uses archive format version {version}; this fkvstore reads "
            f"versions up to {FORMAT_VERSION}: upgrade fkvstore"
        )
    problem = attrs_problem(f, user=False)
    if problem is not None:
        raise ChecksumError(f"{os.fspath(path)!r}: {problem}")
    if version < 1 or not all(isinstance(child(f, g), h5py.Group) for g in (STREAMS, ARRAYS)):
        raise ArchiveFormatError(f"{os.fspath(path)!r}: archive layout incomplete or damaged")


def init_file(f: h5py.File, library_version: str) -> None:
    f.attrs["fkv_format"] = FORMAT_NAME
    f.attrs["fkv_format_version"] = 1
    f.attrs["fkv_library_version"] = library_version
    seal_attrs(f)
    f.create_group(STREAMS)
    f.create_group(ARRAYS)


def recorded_durability(f: h5py.File) -> str:
    """The durability level the archive ``f`` was written at: ``"fsync"`` for format version 2
    archives that record it, else ``"process"``."""
    level = f.attrs.get(DURABILITY_ATTR)
    if isinstance(level, bytes):
        level = level.decode("utf-8", "replace")
    return "fsync" if level == "fsync" and int(f.attrs.get("fkv_format_version", 1)) >= 2 \
        else "process"


def record_durability(f: h5py.File, level: str) -> None:
    """Mark ``f`` as written at durability ``level``; ``"fsync"`` makes it format version 2
    (older fkvstore versions refuse it: they would not apply its journal)."""
    if level == "fsync":
        f.attrs["fkv_format_version"] = 2
    f.attrs[DURABILITY_ATTR] = level
    seal_attrs(f)  # the file's format was checked (CRC included) when it was opened


def _le_bytes(arr: np.ndarray) -> bytes:
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()


UNFINISHED_PREFIX = ".new_"  # a checked array being written; user names never start with "."


def put_checked_array(group: h5py.Group, name: str, arr: np.ndarray,
                      attrs: dict | None = None) -> h5py.Dataset:
    """Store ``arr`` as dataset ``name`` of ``group`` with its CRC-32 and ``attrs``, replacing
    one of that name only once the new one is complete: it is written under
    ``UNFINISHED_PREFIX + name`` and then renamed, so a failure (an attribute HDF5 cannot
    store, a full disk, a killed process) leaves the previous dataset and no partial one."""
    tmp = UNFINISHED_PREFIX + name
    if has_link(group, tmp):
        del group[tmp]
    try:
        ds = group.create_dataset(tmp, data=arr)
        ds.attrs["fkv_crc32"] = np.uint32(zlib.crc32(_le_bytes(arr)))
        for k, v in (attrs or {}).items():
            ds.attrs[k] = v
    except BaseException:
        if has_link(group, tmp):
            del group[tmp]
        raise
    if has_link(group, name):
        del group[name]
    group.move(tmp, name)
    return group[name]


def finished_names(group: h5py.Group) -> list[str]:
    """Names of the checked arrays of ``group``, without unfinished writes."""
    return [n for n in group.keys() if not n.startswith(UNFINISHED_PREFIX)]


def get_checked_array(ds: h5py.Dataset) -> np.ndarray:
    """The array stored by :func:`put_checked_array`; ChecksumError when its bytes changed,
    ArchiveFormatError (before reading) when it is filtered or declares more than the file."""
    from fkvstore.errors import FkvError

    check_array_size(ds)
    try:
        arr = ds[()]
    except FkvError:  # a named failure of the storage (a remote archive): not damage
        raise
    except (OSError, RuntimeError) as exc:  # HDF5 reports damaged metadata or data so
        raise ChecksumError(f"array {ds.name!r} cannot be read: {exc}") from exc
    arr = np.asarray(arr)
    expected = ds.attrs.get("fkv_crc32")
    if expected is None or zlib.crc32(_le_bytes(arr)) != int(expected):
        raise ChecksumError(
            f"array {ds.name!r} does not match its stored CRC-32: the file is damaged"
        )
    return arr


# -- checksums over attributes --------------------------------------------------------------
def _attr_bytes(name: str, value) -> bytes:
    """A canonical encoding of one attribute as h5py reads it back."""
    if isinstance(value, bytes):
        body = b"b" + value
    elif isinstance(value, str):
        body = b"s" + value.encode("utf-8", "surrogatepass")
    else:
        arr = np.asarray(value)
        body = (b"o" + repr(arr.tolist()).encode() if arr.dtype.kind == "O" else
                arr.dtype.str.encode() + repr(arr.shape).encode() + arr.tobytes())
    key = name.encode("utf-8", "surrogatepass")
    return len(key).to_bytes(4, "little") + key + len(body).to_bytes(8, "little") + body


def attrs_crc(obj: h5py.Group | h5py.Dataset, *, user: bool) -> int:
    """CRC-32 over the attributes of ``obj`` in name order: the user's (``user=True``, names
    without the ``fkv_`` prefix) or fkvstore's own (the CRC attributes and the remote head
    aside)."""
    crc = 0
    for name in sorted(obj.attrs.keys()):
        if name in _UNSEALED or name.startswith(RESERVED_PREFIX) == user:
            continue
        crc = zlib.crc32(_attr_bytes(name, obj.attrs[name]), crc)
    return crc


def seal_attrs(obj: h5py.Group | h5py.Dataset) -> None:
    """Store both attribute CRC-32s of ``obj``; call after every change of its attributes."""
    obj.attrs[CONFIG_CRC_ATTR] = np.uint32(attrs_crc(obj, user=False))
    obj.attrs[USER_CRC_ATTR] = np.uint32(attrs_crc(obj, user=True))


def attrs_problem(obj: h5py.Group | h5py.Dataset, *, user: bool) -> str | None:
    """What is wrong with the user's (``user=True``) or fkvstore's attributes of ``obj``
    against their stored CRC-32, or None (also when no CRC is stored: an older file)."""
    name = USER_CRC_ATTR if user else CONFIG_CRC_ATTR
    try:
        stored = obj.attrs.get(name)
        if stored is None:
            return None
        actual = attrs_crc(obj, user=user)
    except (OSError, RuntimeError, KeyError, ValueError, TypeError) as exc:
        return f"the attributes of {obj.name!r} cannot be read ({exc}): the file is damaged"
    if actual != int(stored):
        what = "user attributes" if user else "fkvstore's attributes (codec, layout)"
        return (f"the {what} of {obj.name!r} do not match their CRC-32 ({name}): the file is "
                "damaged")
    return None


def attrs_problems(obj: h5py.Group | h5py.Dataset) -> list[str]:
    """:func:`attrs_problem` for fkvstore's and the user's attributes of ``obj``."""
    return [p for p in (attrs_problem(obj, user=u) for u in (False, True)) if p is not None]
