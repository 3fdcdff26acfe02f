"""Archives in object storage: URLs, a block-cached read-only file object for h5py, the upload.

A URL (``s3://bucket/run.h5``, any fsspec URL or chain such as ``simplecache::s3://...``) is
read through an fsspec file object opened with no cache of its own: :class:`RemoteObject` puts
a block cache in front of it, so every miss is exactly one ranged request. The fsspec file
pins the object it opened where the backend can (s3fs: its ETag through ``If-Match`` on every
read, or its version in a version-aware filesystem), so an object overwritten under an open
reader is detected (:class:`~fkvstore.errors.RemoteObjectChangedError`), never mixed in.

fsspec (and s3fs for ``s3://``) is the ``remote`` extra, imported only when a URL is used.
``docs/remote.md`` gives the request counts.
"""

from __future__ import annotations

import errno
import io
import os
import re
import uuid
from collections import OrderedDict
from typing import Any, TypeGuard
from urllib.parse import unquote, urlparse

from fkvstore.errors import (
    ArchiveExistsError,
    ArchiveNotFoundError,
    FkvError,
    RemoteArchiveError,
    RemoteAuthError,
    RemoteObjectChangedError,
)

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_BLOCK_CACHE_BYTES",
    "OPEN_BYTES",
    "RemoteObject",
    "is_url",
    "missing_objects",
    "remote_exists",
    "upload",
]

DEFAULT_BLOCK_BYTES = 256 << 10
DEFAULT_BLOCK_CACHE_BYTES = 32 << 20
OPEN_BYTES = 64 << 10  # fetched first by an open: superblock, root group and its attributes
_MAX_READAHEAD_BYTES = 8 << 20  # the largest single request of a sequential scan
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_PROTOCOL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*")
# backends whose single PUT appears whole or not at all; others get a temporary name first
_ATOMIC_PUT = {"s3", "s3a", "gs", "gcs", "abfs", "az", "memory"}


def is_url(path: object) -> TypeGuard[str]:
    """Whether ``path`` names an object through fsspec (``proto://...``, or a chain of
    protocols ending in one: ``simplecache::s3://...``) rather than a local file (which may
    hold ``::``, as ``run::v2.h5``)."""
    if not isinstance(path, str):
        return False
    *chain, last = path.split("::")
    return _URL.match(last) is not None and all(_PROTOCOL.fullmatch(p) for p in chain)


def file_url_path(path: object) -> str | None:
    """The local path a plain ``file://`` URL names (no ``::`` chain, no host but
    ``localhost``), else ``None``."""
    if not is_url(path) or "::" in path:
        return None
    url = urlparse(path)
    if url.scheme == "file" and url.netloc in ("", "localhost"):
        return unquote(url.path)
    return None


def _filesystem(url: str, storage_options: dict | None):
    """``(fs, path)`` for ``url``; ImportError naming the extra when fsspec is missing."""
    try:
        import fsspec.core
    except ImportError as exc:
        raise ImportError(
            f"opening {url!r} needs fsspec (and s3fs for s3:// URLs): "
            "pip install 'fkvstore[remote]'"
        ) from exc
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as exc:  # fsspec names the backend package (s3fs, gcsfs, ...)
        raise ImportError(f"opening {url!r}: {exc}") from exc


def _expired(exc: BaseException) -> bool:
    # s3fs raises FileExpired (errno EBUSY) when If-Match fails: the object was overwritten
    return type(exc).__name__ == "FileExpired" or getattr(exc, "errno", None) == errno.EBUSY


def storage_error(exc: BaseException, url: str, action: str) -> FkvError:
    """The named fkvstore error for ``exc``, raised by the storage layer while ``action``
    (``"opening"``, ``"reading"``, ``"uploading to"``) ``url``."""
    if isinstance(exc, FkvError):
        return exc
    detail = f"{type(exc).__name__}: {exc}"
    if _expired(exc) or (action == "reading" and isinstance(exc, FileNotFoundError)):
        return RemoteObjectChangedError(
            f"{url!r} was overwritten or deleted after it was opened ({detail}); the bytes "
            "this read needs are gone: open the archive again"
        )
    if isinstance(exc, FileNotFoundError):
        return ArchiveNotFoundError(f"{action} {url!r}: no such object or bucket ({detail})")
    if isinstance(exc, PermissionError):
        return RemoteAuthError(
            f"object storage refused {action} {url!r} ({detail}); check the credentials "
            "(storage_options or the environment) and the permissions"
        )
    return RemoteArchiveError(f"{action} {url!r} failed ({detail})")


class RemoteObject(io.RawIOBase):
    """One object in fsspec storage as a read-only, seekable file for ``h5py.File``.

    Reads are served from an LRU cache of aligned blocks of ``block_bytes``; the blocks a read
    misses are fetched in ONE ranged request (sequential misses fetch up to
    ``_MAX_READAHEAD_BYTES`` ahead, doubling). ``cache_bytes=0`` turns the cache off: every read
    is then one request for exactly its bytes. :meth:`prefetch` pins the start of the object
    (a published archive's metadata) in one request. ``requests`` and ``bytes_fetched`` count
    what this object asked the storage for (opening the fsspec file costs one more: the HEAD
    that gives size and ETag)."""

    def __init__(self, url: str, storage_options: dict | None = None, *,
                 block_bytes: int = DEFAULT_BLOCK_BYTES,
                 cache_bytes: int = DEFAULT_BLOCK_CACHE_BYTES):
        super().__init__()
        self.url = url
        fs, path = _filesystem(url, storage_options)
        try:
            # a listing cached by fsspec may describe an older object: ask the storage (HEAD)
            fs.invalidate_cache(path)
            # cache_type "none": each read of the fsspec file is one request (ours decides)
            self._f = fs.open(path, "rb", cache_type="none", block_size=block_bytes)
            size = getattr(self._f, "size", None)
            if size is None:  # a caching chain (simplecache::...) hands back a local file
                size = self._f.seek(0, io.SEEK_END)
                self._f.seek(0)
            self.size = int(size)
        except Exception as exc:
            raise storage_error(exc, url, "opening") from exc
        self.block_bytes = block_bytes
        # any cache holds at least one block: only cache_bytes=0 turns it off
        self._max_blocks = -(-cache_bytes // block_bytes)
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self._pinned: dict[int, bytes] = {}
        self._pos = 0
        self._next = -1  # the block after the last fetched run (a sequential read continues it)
        self._ahead = 1
        self.requests = 0
        self.bytes_fetched = 0

    # -- the file interface h5py uses -------------------------------------------------------
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer) -> int:
        out = memoryview(buffer).cast("B")
        start, end = self._pos, min(self._pos + len(out), self.size)
        if end <= start:
            return 0
        if self._max_blocks == 0:
            out[: end - start] = self._fetch(start, end)
        else:
            S = self.block_bytes
            first, last = start // S, (end - 1) // S
            cached = {k: self._cached(k) for k in range(first, last + 1)}
            blocks = {k: v for k, v in cached.items() if v is not None}
            missing = [k for k, v in cached.items() if v is None]
            if missing:
                blocks.update(self._load(missing[0], missing[-1]))
            for k in range(first, last + 1):
                lo, hi = max(start, k * S), min(end, (k + 1) * S)
                out[lo - start : hi - start] = blocks[k][lo - k * S : hi - k * S]
        self._pos = end
        return end - start

    def close(self) -> None:
        if not self.closed:
            self._blocks.clear()
            self._pinned.clear()
            try:
                self._f.close()
            finally:
                super().close()

    # -- the cache ---------------------------------------------------------------------------
    def prefetch(self, nbytes: int) -> None:
        """Fetch the object's first ``nbytes`` (what is not cached yet) in one request and keep
        them for as long as the object is open (up to half the cache; beyond that they are
        ordinary cached blocks)."""
        S = self.block_bytes
        last = (min(int(nbytes), self.size) - 1) // S
        if self._max_blocks == 0 or last < 0:
            return
        missing = [k for k in range(last + 1) if self._cached(k) is None]
        if missing:
            self._load(missing[0], missing[-1], ahead=False)
        if last + 1 <= self._max_blocks // 2:
            for k in range(last + 1):
                if k in self._blocks:
                    self._pinned[k] = self._blocks.pop(k)

    def _cached(self, k: int) -> bytes | None:
        blk = self._pinned.get(k)
        if blk is None:
            blk = self._blocks.get(k)
            if blk is not None:
                self._blocks.move_to_end(k)
        return blk

    def _load(self, first: int, last: int, ahead: bool = True) -> dict[int, bytes]:
        """Fetch blocks ``first..last`` (and, for a sequential read, more ahead) in one
        request; cache and return them."""
        S = self.block_bytes
        if ahead:
            cap = max(1, min(_MAX_READAHEAD_BYTES // S, self._max_blocks // 4))
            self._ahead = min(self._ahead * 2, cap) if first == self._next else 1
            last = max(last, min(first + self._ahead - 1, (self.size - 1) // S))
        data = self._fetch(first * S, min((last + 1) * S, self.size))
        self._next = last + 1
        got = {k: data[(k - first) * S : (k - first + 1) * S] for k in range(first, last + 1)}
        for k, blk in got.items():
            if k not in self._pinned:
                self._blocks[k] = blk
                self._blocks.move_to_end(k)
        while len(self._blocks) > self._max_blocks:
            self._blocks.popitem(last=False)
        return got

    def _fetch(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object: one request."""
        try:
            self._f.seek(start)
            data = self._f.read(end - start)
        except Exception as exc:
            raise storage_error(exc, self.url, "reading") from exc
        self.requests += 1
        self.bytes_fetched += len(data)
        if len(data) != end - start:  # the object shrank: it was replaced
            raise RemoteObjectChangedError(
                f"{self.url!r} returned {len(data)} bytes for bytes {start}..{end - 1} of an "
                f"object of {self.size} when opened: it was overwritten; open it again"
            )
        return data


def remote_exists(url: str, storage_options: dict | None = None) -> bool:
    """Whether an object exists at ``url`` (RemoteAuthError when the storage refuses)."""
    fs, path = _filesystem(url, storage_options)
    try:
        return bool(fs.exists(path))
    except Exception as exc:
        raise storage_error(exc, url, "checking") from exc


def missing_objects(urls: list[str], storage_options: dict | None = None) -> list[str]:
    """The ``urls`` at which no object exists, checked with as few requests as reasonable: one
    listing per folder holding two or more of them (a page per 1,000 objects on S3), then one
    ``info`` (a HEAD) for each not listed, or for each if the listing fails or is refused. A
    listing only ever confirms objects, so a backend that lists loosely (HTTP) costs requests,
    never a wrong answer. RemoteAuthError (naming the URL) when the storage refuses a check."""
    groups: dict[tuple[int, str], list[tuple[str, Any, str]]] = {}  # (url, filesystem, path)
    for url in urls:
        fs, path = _filesystem(url, storage_options)
        path = fs._strip_protocol(path).rstrip("/")
        groups.setdefault((id(fs), fs._parent(path)), []).append((url, fs, path))
    missing = []
    for (_, parent), members in groups.items():
        listed: set[str] = set()
        fs = members[0][1]
        if len(members) > 1:
            try:
                fs.invalidate_cache(parent)
                listed = {fs._strip_protocol(e["name"]).rstrip("/")
                          for e in fs.ls(parent, detail=True) if e.get("type") == "file"}
            except Exception:  # refused (no list permission), no such bucket, no listing
                listed = set()
        for url, fs, path in members:
            if path in listed:
                continue
            try:
                fs.invalidate_cache(path)
                found = fs.info(path).get("type") == "file"  # a prefix ("folder") is no archive
            except FileNotFoundError:
                found = False
            except Exception as exc:
                raise storage_error(exc, url, "checking") from exc
            if not found:
                missing.append(url)
    return missing


def upload(local_path: str | os.PathLike, url: str, storage_options: dict | None = None, *,
           overwrite: bool = False) -> None:
    """Put the local file at ``url`` so that no reader sees a partial object: object stores
    make a PUT visible only once complete; elsewhere it is written under a temporary name and
    moved. ArchiveExistsError if an object is there and not ``overwrite``."""
    fs, path = _filesystem(url, storage_options)
    size = os.path.getsize(local_path)
    try:
        if not overwrite and fs.exists(path):
            raise ArchiveExistsError(
                f"{url!r} already exists; pass overwrite=True to replace it (readers that have "
                "it open then get RemoteObjectChangedError)"
            )
        protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
        if protocols & _ATOMIC_PUT:
            fs.put_file(os.fspath(local_path), path)
        else:
            partial = f"{path}.fkv-partial-{uuid.uuid4().hex}"
            try:
                fs.put_file(os.fspath(local_path), partial)
                fs.mv(partial, path)
            finally:
                if fs.exists(partial):
                    fs.rm(partial)
        fs.invalidate_cache(path)
        stored = int(fs.info(path)["size"])
    except FkvError:
        raise
    except Exception as exc:
        raise storage_error(exc, url, "uploading to") from exc
    if stored != size:
        raise RemoteArchiveError(
            f"uploaded {size} bytes to {url!r} but the storage reports {stored}"
        )
