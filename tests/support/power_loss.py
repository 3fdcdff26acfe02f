"""A power-failure simulator for archives written at durability "fsync".

The model of a power cut (the one SQLite's crash tests use): a write that a completed ``fsync``
of its file covered is on the disk; every write after the last completed fsync of its file may
be lost, kept, or kept in part, in any combination, in 512-byte sectors. So:

1. :func:`recording` swaps the journal's disk layer (``fkvstore._journal.DISK``) for a recorder
   that passes every ``pwrite``, ``ftruncate`` and ``fsync`` of the archive and its journal
   through and logs it, and keeps the two files' bytes from before (which the previous sync made
   durable);
2. :func:`cuts` replays the log: a cut just before each fsync, and one after the last event,
   gives per file the durable bytes (everything up to its last completed fsync) and the bytes
   the file would hold had every later write landed;
3. :func:`images` builds disk images from the 4 KiB pages in which those two differ: every
   subset of them when there are at most ``exhaustive`` pages, else ``random`` random subsets
   (plus none and all), and ``torn`` images in which pages are mixed sector by sector. A file
   whose new length was not kept ends at its old length; in random images the new length may
   be kept with pages of zeros;
4. :func:`check_image` writes an image into a directory and opens it as a reader and as a
   writer: it must hold exactly one of the committed states, no older than the last completed
   sync, and take appends afterwards.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from h5reader import read_stream_with_h5py

import fkvstore
from fkvstore import _journal

PAGE = 4096
SECTOR = 512


@dataclass(frozen=True)
class Event:
    kind: str  # "write", "truncate" or "fsync"
    path: str
    offset: int = 0
    data: bytes = b""


class Recorder(_journal._Disk):
    """The journal's disk layer, logging every call (the data too) before making it."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def pwrite(self, path, fd, data, offset):
        self.events.append(Event("write", path, offset, bytes(data)))
        super().pwrite(path, fd, data, offset)

    def ftruncate(self, path, fd, size):
        self.events.append(Event("truncate", path, size))
        super().ftruncate(path, fd, size)

    def fsync(self, path, fd):
        self.events.append(Event("fsync", path))
        super().fsync(path, fd)


@dataclass
class Capture:
    """The files' bytes before the recorded change, and the change's disk calls."""

    base: dict[str, bytes]
    events: list[Event] = field(default_factory=list)


@contextmanager
def recording(archive: str | os.PathLike) -> Iterator[Capture]:
    """Record the disk calls made to ``archive`` and its journal inside the block. Call it when
    both are durable (right after a sync)."""
    paths = [os.fspath(archive), _journal.journal_path(archive)]
    base = {p: Path(p).read_bytes() if os.path.exists(p) else b"" for p in paths}
    capture = Capture(base)
    recorder, saved = Recorder(), _journal.DISK
    _journal.DISK = recorder
    try:
        yield capture
    finally:
        _journal.DISK = saved
        capture.events = [e for e in recorder.events if e.path in base]


@dataclass(frozen=True)
class Cut:
    """A moment a power failure may strike: ``durable`` and ``written`` bytes per file, and
    whether an fsync of the archive file had completed in the capture: the change is then
    durable and only the new state may appear (each recorded change commits in its first sync;
    a close's second sync only rewrites the superblock)."""

    durable: dict[str, bytes]
    written: dict[str, bytes]
    change_durable: bool


def _apply(img: bytearray, event: Event) -> None:
    if event.kind == "write":
        end = event.offset + len(event.data)
        if len(img) < end:
            img.extend(bytes(end - len(img)))
        img[event.offset : end] = event.data
    elif event.kind == "truncate":
        del img[event.offset :]
        img.extend(bytes(max(0, event.offset - len(img))))


def cuts(capture: Capture, archive: str | os.PathLike) -> list[Cut]:
    """A cut before each fsync of the capture, and one after its last event."""
    archive = os.fspath(archive)
    current = {p: bytearray(b) for p, b in capture.base.items()}
    durable = {p: bytes(b) for p, b in capture.base.items()}
    first_main_sync = min((k for k, e in enumerate(capture.events)
                           if e.kind == "fsync" and e.path == archive), default=-1)
    out = []
    for k, event in enumerate(capture.events):
        if event.kind == "fsync":
            out.append(Cut(dict(durable), {p: bytes(b) for p, b in current.items()},
                           k > first_main_sync))
            durable[event.path] = bytes(current[event.path])
        else:
            _apply(current[event.path], event)
    out.append(Cut(dict(durable), {p: bytes(b) for p, b in current.items()}, True))
    return out


def _page(data: bytes, index: int) -> bytes:
    return data[index * PAGE : (index + 1) * PAGE].ljust(PAGE, b"\0")


def images(cut: Cut, rng: np.random.Generator, *, exhaustive: int, random: int,
           torn: int) -> Iterator[dict[str, bytes]]:
    """Disk images the cut may leave (see the module docstring)."""
    diffs = [(p, i) for p in cut.durable
             for i in range(max(len(cut.durable[p]), len(cut.written[p])) // PAGE + 1)
             if _page(cut.durable[p], i) != _page(cut.written[p], i)]
    n = len(diffs)
    if n <= exhaustive:
        masks: list[np.ndarray] = [np.array(bits, bool)
                                   for bits in itertools.product((False, True), repeat=n)]
    else:
        masks = [np.zeros(n, bool), np.ones(n, bool)]
        masks += [rng.random(n) < rng.uniform(0.1, 0.9) for _ in range(random)]
    for mask in masks:
        yield _build(cut, diffs, mask.astype(np.int64) * 8, keep_length=None)
    if n == 0:
        return
    for _ in range(torn):
        # per page: how many of its 8 sectors landed is not enough, which ones: a bit mask
        sectors = rng.integers(0, 256, n)
        yield _build(cut, diffs, -sectors - 1, keep_length=bool(rng.integers(0, 2)))
    for _ in range(min(torn, random)):
        yield _build(cut, diffs, (rng.random(n) < 0.5).astype(np.int64) * 8, keep_length=True)


def _build(cut: Cut, diffs, choice: np.ndarray, keep_length: bool | None) -> dict[str, bytes]:
    """``choice[k]``: 0 the old page, 8 the new page, ``-m-1`` the new sectors of bit mask m."""
    out = {}
    for path in cut.durable:
        old, new = cut.durable[path], cut.written[path]
        img = bytearray(old.ljust(max(len(old), len(new)), b"\0"))
        reached = len(old)
        for (p, index), how in zip(diffs, choice, strict=True):
            if p != path or how == 0:
                continue
            page = _page(new, index)
            if how == 8:
                sectors = range(PAGE // SECTOR)
            else:
                mask = -int(how) - 1
                sectors = [s for s in range(PAGE // SECTOR) if mask >> s & 1]
            for s in sectors:
                lo = index * PAGE + s * SECTOR
                img[lo : lo + SECTOR] = page[s * SECTOR : (s + 1) * SECTOR]
                reached = max(reached, min(lo + SECTOR, len(new)))
        length = len(new) if keep_length else (reached if keep_length is None else len(old))
        out[path] = bytes(img[: max(length, 0)])
    return out


def read_state(path: str | os.PathLike, mode: str = "r") -> dict[str, np.ndarray]:
    """Every stream's rows and every array of the archive, by name (arrays as ``arrays/<n>``)."""
    with fkvstore.open(path, mode) as ar:
        state = {name: ar[name].read() for name in ar}
        state.update({f"arrays/{n}": ar.get_array(n) for n in ar.array_names()})
    return state


def same_state(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def which_state(found: dict[str, np.ndarray], states: list[dict[str, np.ndarray]]) -> int:
    for k, state in enumerate(states):
        if same_state(found, state):
            return k
    raise AssertionError(f"the archive holds none of the committed states: {sorted(found)}, "
                         f"lengths {[len(v) for v in found.values()]}")


class _Unsynced(_journal._Disk):
    """The checks' disk: an image is thrown away after its check, so its fsyncs are skipped."""

    def fsync(self, path, fd):
        pass


@contextmanager
def _unsynced() -> Iterator[None]:
    saved, _journal.DISK = _journal.DISK, _Unsynced()
    try:
        yield
    finally:
        _journal.DISK = saved


def check_image(image: dict[str, bytes], where: Path, states: list[dict[str, np.ndarray]],
                oldest: int, *, writer: bool) -> int:
    """Write ``image`` (archive and journal, by their original paths) under ``where``, open it
    read-only, then (``writer``) as a writer, which recovers the file and must take an append:
    each must hold one of ``states``, index ``oldest`` or newer. Returns that index."""
    with _unsynced():
        return _check_image(image, where, states, oldest, writer)


def _check_image(image, where, states, oldest, writer) -> int:
    where.mkdir(parents=True, exist_ok=True)
    archive = None
    for path, data in image.items():
        target = where / Path(path).name
        target.write_bytes(data)
        if not path.endswith("-journal"):
            archive = target
    assert archive is not None
    k = which_state(read_state(archive), states)
    assert k >= oldest, f"state {k} is older than the last completed sync (state {oldest})"
    if writer:  # also the reader written from docs/format.md alone, journal included
        for name, rows in states[k].items():
            if not name.startswith("arrays/"):
                np.testing.assert_array_equal(read_stream_with_h5py(archive, name), rows)
        with fkvstore.open(archive, "a") as ar:
            assert ar.durability == "fsync"
            assert same_state({name: ar[name].read() for name in ar}
                              | {f"arrays/{n}": ar.get_array(n) for n in ar.array_names()},
                              states[k])
            for name in ar:
                s = ar[name]
                s.extend(np.zeros((1, s.width), np.int64))
        after = read_state(archive)
        for name, rows in states[k].items():
            if not name.startswith("arrays/"):
                np.testing.assert_array_equal(after[name][:-1], rows)
    return k
