"""The stored side of one stream: its datasets, commit record and verified chunk cache.

:class:`StoredPoints` reads and writes the points of one stream group (``docs/format.md``): it
checks every chunk it loads against its CRC-32, keeps recently used chunks in memory, stages
appends and truncations as :class:`~fkvstore._session.Pending` commits, and lets a reader take
up a writer's newer commits. It knows nothing of symbols beyond what the codec gives it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import h5py
import numpy as np

from fkvstore import layout
from fkvstore._bounds import file_bytes
from fkvstore._session import Pending
from fkvstore.codec import Codec
from fkvstore.errors import ArchiveClosedError, ArchiveFormatError, ChecksumError, FkvError
from fkvstore.layout import Commit

__all__ = ["StaleView", "StoredPoints", "read_commit_checked"]


class StaleView(Exception):
    """A reader's commit record was outdated and has been refreshed; the caller retries."""


class _Datasets(NamedTuple):
    """The datasets of a stream group (``docs/format.md``)."""

    points: h5py.Dataset  # (spans, width, 2) float64; its attribute holds the commit record
    tail: h5py.Dataset  # the two tail slots, (2, width, 2) float64
    crc: h5py.Dataset  # one CRC-32 per complete chunk


class StoredPoints:
    """The committed points of stream ``name``: (spans, width, 2) float64 in chunks of
    ``block_spans`` spans, plus the open span's point in one of two tail slots.

    ``cache_bytes`` bounds the chunk cache; ``writable`` says whether this process is the
    writer (a reader may see a writer's newer commits); ``on_rewind()`` runs when a reader
    finds that the writer truncated below what it had seen."""

    def __init__(self, name: str, codec: Codec, width: int, block_spans: int, cache_bytes: int,
                 writable: bool, on_rewind: Callable[[], None]):
        self.name = name
        self.codec = codec
        self.width = width
        self.block_spans = block_spans
        self._block_bytes = block_spans * width * 16
        self._cache_bytes = cache_bytes
        self._writable = writable
        self._on_rewind = on_rewind
        self._blocks: OrderedDict[int, np.ndarray] = OrderedDict()
        self._tail: np.ndarray | None = None
        self._crcs: list[int] = []
        self.commit = Commit()
        self._bound: _Datasets | None = None

    # -- binding to the file ---------------------------------------------------------------------
    def bind(self, group: h5py.Group) -> None:
        self._bound = _Datasets(*(layout.dataset(group, n)
                                  for n in (layout.POINTS, layout.TAIL, layout.BLOCK_CRC)))

    def detach(self) -> None:
        self._bound = None

    @property
    def _ds(self) -> _Datasets:
        """The bound datasets; ArchiveClosedError once detached (archive closed, stream deleted)."""
        if self._bound is None:
            raise ArchiveClosedError(
                f"stream {self.name!r} belongs to a closed archive (or was deleted); open the "
                "archive again"
            )
        return self._bound

    def load(self) -> None:
        """Read the commit record and the block checksums it covers."""
        ds = self._ds
        c = read_commit_checked(ds.points, self.codec.span)
        nblocks = c.full_spans // self.block_spans
        if ds.crc.shape[0] < nblocks:
            raise ArchiveFormatError(
                f"stream {self.name!r}: {nblocks} block checksums expected, "
                f"{ds.crc.shape[0]} stored; the file is damaged"
            )
        self._crcs = [int(v) for v in ds.crc[:nblocks]] if nblocks else []
        self.commit = c

    # -- reading ----------------------------------------------------------------------------------
    def cached_block(self, b: int) -> np.ndarray | None:
        """Chunk ``b`` if it is in the cache (the hot path of single-row reads), else None."""
        return self._blocks.get(b)

    def block(self, b: int) -> np.ndarray:
        """Verified rows of stored chunk ``b``: (rows, width, 2) float64, rows <= block_spans."""
        blk = self._blocks.get(b)
        if blk is not None:
            self._blocks.move_to_end(b)
            return blk
        B = self.block_spans
        rows = min(B, self.commit.full_spans - b * B)
        try:
            blk = layout.read_block(self._ds.points, b, B, rows)
        except FkvError:  # a named failure of the storage (a remote archive): not damage
            raise
        except (OSError, RuntimeError, ValueError) as exc:
            self._raise_if_stale()
            raise ChecksumError(
                f"stream {self.name!r}: chunk {b} cannot be read ({exc}); the file is damaged"
            ) from exc
        expected = self._crcs[b] if rows == B else self.commit.partial_crc
        if layout.checksum(blk) != expected:
            self._raise_if_stale()
            raise ChecksumError(
                f"stream {self.name!r}: chunk {b} (spans {b * B}..{b * B + rows - 1}) does not "
                "match its CRC-32; the file is damaged there (run `fkv verify` for a full report)"
            )
        self._blocks[b] = blk
        if len(self._blocks) * self._block_bytes > self._cache_bytes:
            self._evict()
        return blk

    def _evict(self, keep: int | None = None) -> None:
        """Drop least recently used chunks until the cache fits ``cache_bytes`` (counting whole
        chunks). One chunk always stays: ``keep`` when given, else the most recently used."""
        blocks, budget = self._blocks, self._cache_bytes
        while len(blocks) > 1 and len(blocks) * self._block_bytes > budget:
            b = next(iter(blocks))
            if b == keep:
                blocks.move_to_end(b)
                continue
            del blocks[b]

    @property
    def cached_bytes(self) -> int:
        return sum(blk.nbytes for blk in self._blocks.values())

    def tail_point(self) -> np.ndarray:
        """The verified point of the open span, (width, 2) float64."""
        if self._tail is None:
            c = self.commit
            try:
                t = layout.read_tail(self._ds.tail, c.tail_slot)
            except FkvError:
                raise
            except (OSError, RuntimeError, ValueError) as exc:
                self._raise_if_stale()
                raise ChecksumError(f"stream {self.name!r}: tail unreadable ({exc})") from exc
            if layout.checksum(t) != c.tail_crc:
                self._raise_if_stale()
                raise ChecksumError(
                    f"stream {self.name!r}: the open span's point does not match its CRC-32; "
                    "the file is damaged"
                )
            self._tail = t
        return self._tail

    def span_points(self, s0: int, s1: int) -> np.ndarray:
        """Stored points of spans ``[s0, s1)``, (s1-s0, width, 2) float64, all verified."""
        full, B = self.commit.full_spans, self.block_spans
        parts = []
        s = s0
        while s < min(s1, full):
            b = s // B
            blk = self.block(b)
            hi = min(s1, full, (b + 1) * B)
            parts.append(blk[s - b * B : hi - b * B])
            s = hi
        if s1 > full:
            parts.append(self.tail_point()[None])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def forget(self, b: int) -> None:
        """Drop chunk ``b`` from the cache (chunk ``-1``: the open span's point), so that the
        next read checks the file again."""
        if b < 0:
            self._tail = None
        else:
            self._blocks.pop(b, None)

    # -- readers following a writer ---------------------------------------------------------------
    def _raise_if_stale(self) -> None:
        """Called before reporting a bad checksum. A reader loads chunks and the open span
        lazily, so a writer may have reused their file space (the inactive tail slot, chunks
        past a truncation) since this reader last read the commit record: if a new commit
        exists, take it up and raise StaleView so that the caller retries."""
        if self._writable:
            return
        generation = self.commit.generation
        self.refresh()
        if self.commit.generation != generation:
            raise StaleView

    def refresh(self) -> None:
        """Reader side: take up the writer's latest commit record (HDF5 SWMR)."""
        ds = self._ds
        ds.points.refresh()
        old = self.commit
        # the datasets are refreshed again after the commit record is read, so that they
        # include everything the writer wrote before that commit (it may land in between)
        c = read_commit_checked(ds.points, self.codec.span, self._refresh_datasets)
        if c.generation == old.generation:
            return
        B = self.block_spans
        if c.rewinds != old.rewinds:
            self._blocks.clear()
            self._crcs = []
            self._on_rewind()
        else:
            self._blocks.pop(old.full_spans // B, None)
        have, need = len(self._crcs), c.full_spans // B
        if need > have:
            if ds.crc.shape[0] < need:
                raise ArchiveFormatError(f"stream {self.name!r}: block checksums missing")
            self._crcs.extend(int(v) for v in ds.crc[have:need])
        del self._crcs[need:]
        self._tail = None
        self.commit = c

    def _refresh_datasets(self) -> None:
        for dataset in self._ds:  # points, tail, crc
            dataset.refresh()

    # -- writing ----------------------------------------------------------------------------------
    def stage_append(self, rows: np.ndarray) -> Pending:
        """Write ``rows`` (n, width) as complete spans, block checksums and a new tail; return
        the commit that makes them part of the stream (not yet written)."""
        c, ds = self.commit, self._ds
        m, B = self.codec.span, self.block_spans
        tail = self.tail_point() if c.tail_count else None
        pts = np.asarray(self.codec.extend(tail, c.tail_count, rows), dtype=np.float64)
        pts = pts.reshape(-1, self.width, 2)
        length = c.length + len(rows)
        full, tail_count = divmod(length, m)
        ncomplete = full - c.full_spans
        if len(pts) != ncomplete + (1 if tail_count else 0):
            raise FkvError(
                f"codec returned {len(pts)} points for {ncomplete} complete span(s) and "
                f"{'an' if tail_count else 'no'} open one"
            )
        blocks: dict[int, np.ndarray] = {}
        crcs: list[int] = []
        partial_crc = c.partial_crc
        if ncomplete:
            if ds.points.shape[0] < full:
                ds.points.resize(full, axis=0)
            b0 = c.full_spans // B
            first = c.full_spans - b0 * B
            chunk_rows = pts[:ncomplete]
            if first:
                chunk_rows = np.concatenate([self.block(b0)[:first], chunk_rows])
            for k in range(0, len(chunk_rows), B):
                chunk = chunk_rows[k : k + B]
                layout.write_block(ds.points, b0 + k // B, B, chunk)
                blocks[b0 + k // B] = chunk
                if len(chunk) == B:
                    crcs.append(layout.checksum(chunk))
            rest = len(chunk_rows) % B
            partial_crc = layout.checksum(chunk_rows[len(chunk_rows) - rest :]) if rest else 0
            if crcs:
                if ds.crc.shape[0] < b0 + len(crcs):
                    ds.crc.resize(b0 + len(crcs), axis=0)
                ds.crc[b0 : b0 + len(crcs)] = np.array(crcs, dtype=layout.CRC_DTYPE)
        slot, tail_crc, new_tail = self._stage_tail(pts[-1] if tail_count else None)
        commit = Commit(
            length, full, slot, tail_count, partial_crc, tail_crc, c.generation + 1, c.rewinds
        )

        def apply() -> None:
            self.commit = commit
            self._crcs.extend(crcs)
            self._blocks.update(blocks)
            # the partial last chunk stays: the next flush appends to it
            self._evict(keep=full // B if full % B else None)
            self._tail = new_tail

        return Pending(ds.points, commit, apply)

    def stage_truncate(self, n: int, open_rows: np.ndarray | None) -> Pending:
        """Cut the stored stream to ``n`` rows (below the committed length); ``open_rows`` are
        rows ``[n - n % span, n)``, re-encoded as the new open span (None when n % span == 0)."""
        c = self.commit
        B = self.block_spans
        full = n // self.codec.span
        b = full // B
        first = full - b * B
        partial = self.block(b)[:first].copy() if first else None
        new_tail = None
        if open_rows is not None:
            new_tail = np.asarray(self.codec.encode(open_rows), dtype=np.float64)
            new_tail = np.ascontiguousarray(new_tail.reshape(self.width, 2))
        slot, tail_crc, new_tail = self._stage_tail(new_tail)
        commit = Commit(
            n,
            full,
            slot,
            n - full * self.codec.span,
            layout.checksum(partial) if partial is not None else 0,
            tail_crc,
            c.generation + 1,
            c.rewinds + 1,
        )

        def apply() -> None:
            self.commit = commit
            del self._crcs[full // B :]
            for k in [k for k in self._blocks if k >= b]:
                del self._blocks[k]
            if partial is not None:
                self._blocks[b] = partial
            self._tail = new_tail

        return Pending(self._ds.points, commit, apply)

    def _stage_tail(self, point: np.ndarray | None):
        """Write the new open span's ``point`` (width, 2) to the inactive tail slot (the
        committed slot stays intact until the commit); ``(slot, crc, point)``."""
        if point is None:
            return self.commit.tail_slot, 0, None
        point = np.ascontiguousarray(point)
        slot = 1 - self.commit.tail_slot
        layout.write_tail(self._ds.tail, slot, point)
        return slot, layout.checksum(point), point


def read_commit_checked(points: h5py.Dataset, span: int, after_read=None) -> Commit:
    """The commit record of ``points``, checked for consistency (ArchiveFormatError)."""
    try:
        c = layout.read_commit(points)
    except FkvError:
        raise
    except (OSError, RuntimeError, KeyError, ValueError, TypeError) as exc:
        raise ArchiveFormatError(f"{points.name}: commit record unreadable ({exc})") from exc
    if after_read is not None:
        after_read()
    problem = None
    if c.length >= 1 << 62:  # positions are int64 everywhere; no real stream comes near
        problem = f"length={c.length} is beyond any stream"
    elif c.length != c.full_spans * span + c.tail_count or c.tail_count >= span:
        problem = (f"length={c.length} is not full_spans={c.full_spans} spans of {span} plus "
                   f"tail_count={c.tail_count} < {span}")
    elif c.tail_slot > 1:
        problem = f"tail_slot={c.tail_slot} is not 0 or 1"
    elif points.shape[0] < c.full_spans:
        problem = f"full_spans={c.full_spans} exceeds the {points.shape[0]} rows of points"
    elif _committed_bytes(points, c) > (size := file_bytes(points.file)):
        problem = (f"full_spans={c.full_spans} needs {_committed_bytes(points, c)} bytes of "
                   f"chunks, more than the {size} bytes of the whole file")
    if problem is not None:
        raise ArchiveFormatError(
            f"{points.name}: commit record {c} is inconsistent ({problem}); damaged file"
        )
    return c


def _committed_bytes(points: h5py.Dataset, c: Commit) -> int:
    """Bytes of the chunks of ``points`` holding ``c``'s full spans (each chunk whole)."""
    rows = points.chunks[0] if points.chunks else 1
    return -(-c.full_spans // rows) * rows * points.dtype.itemsize * int(np.prod(points.shape[1:]))
