"""A power failure at any moment of a change leaves an archive at durability "fsync" that opens,
as a reader and as a writer, to a committed state no older than the last completed sync, with
every earlier row intact (the model and the images: tests/support/power_loss.py).

The change is recorded (every page write and fsync of the archive and its journal), then disk
images are built from the pages that differ at each cut: every subset up to ``EXHAUSTIVE``
differing pages, ``RANDOM`` random subsets beyond, and ``TORN`` images torn in 512-byte sectors.
FKV_DEEP=1 runs the issue's numbers (12, 1,000, 200) and opens every image as a writer too.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import fkvstore
from fkvstore import _journal

HERE = Path(__file__).parent
import power_loss as pl  # noqa: E402  (tests/support is on the path, see conftest.py)

DEEP = os.environ.get("FKV_DEEP") == "1"
EXHAUSTIVE, RANDOM, TORN = (12, 1000, 200) if DEEP else (5, 12, 6)
WRITER_EVERY = 1 if DEEP else 6  # open every n-th image as a writer as well

ROWS = np.random.default_rng(18).integers(0, 256, (700, 8))
TEXT = "The Time Traveller (for so it will be convenient to speak of him) was expounding. " * 3


def _build(path: Path) -> None:
    """An archive with two streams and an array, written in several commits."""
    with fkvstore.open(path, "w", durability="fsync") as ar:
        kv = ar.create_stream("kv", 256, width=8, chunk_bytes=512)
        kv.extend(ROWS[:300])
        ar.flush()
        kv.extend(ROWS[300:555])
        ar.create_text_stream("book", chunk_bytes=256).extend(TEXT)
        ar.put_array("codebook", np.linspace(-1, 1, 60).reshape(3, 20))


def _append(ar):
    ar["kv"].extend(ROWS[555:])
    ar["book"].extend("He put it to us in this way.")
    ar.flush()


def _append_many(ar):
    """Enough rows for a change of more than 12 pages (random subsets, not every subset)."""
    ar["kv"].extend(np.random.default_rng(5).integers(0, 256, (4000, 8)))
    ar.flush()


def _unflushed_then_close(ar):
    ar["kv"].extend(ROWS[555:600])
    ar.close()


OPS = {
    "append": _append,
    "append_many": _append_many,
    "truncate": lambda ar: ar["kv"].truncate(123),
    "put_array": lambda ar: ar.put_array("window", np.arange(5000, dtype=np.int32)),
    "replace_array": lambda ar: ar.put_array("codebook", np.zeros((3, 20))),
    "create_stream": lambda ar: ar.create_stream("fresh", 50, width=3),
    "delete_stream": lambda ar: ar.__delitem__("book"),
    "close": _unflushed_then_close,
}


@pytest.mark.parametrize("op", sorted(OPS))
def test_power_cut_during_a_change_leaves_a_committed_state(op, tmp_path):
    path = tmp_path / "a.h5"
    _build(path)
    before = pl.read_state(path)
    ar = fkvstore.open(path, "a")
    assert ar.durability == "fsync"
    with pl.recording(path) as capture:
        OPS[op](ar)
    ar.close()
    after = pl.read_state(path)
    assert not pl.same_state(before, after)
    states = [before, after]
    rng = np.random.default_rng(sum(map(ord, op)))
    cuts = pl.cuts(capture, path)
    assert any(e.kind == "fsync" for e in capture.events)
    seen = set()
    count = 0
    for k, cut in enumerate(cuts):
        for image in pl.images(cut, rng, exhaustive=EXHAUSTIVE, random=RANDOM, torn=TORN):
            seen.add(pl.check_image(image, tmp_path / "img", states,
                                    1 if cut.change_durable else 0,
                                    writer=count % WRITER_EVERY == 0))
            count += 1
        assert k < len(cuts) - 1 or seen  # the last cut was checked
    assert seen == {0, 1}  # images of both states came up: the cuts reach into the change
    assert count > len(cuts)


def test_cut_inside_the_journal_write_keeps_the_old_state(tmp_path):
    """Images from the first cut (the journal written, not yet fsynced) never roll anything
    back: the archive file was not touched yet."""
    path = tmp_path / "a.h5"
    _build(path)
    before = pl.read_state(path)
    with fkvstore.open(path, "a") as ar, pl.recording(path) as capture:
        _append(ar)
    first = pl.cuts(capture, path)[0]
    assert first.durable[str(path)] == first.written[str(path)]
    rng = np.random.default_rng(1)
    for image in pl.images(first, rng, exhaustive=4, random=8, torn=4):
        assert pl.check_image(image, tmp_path / "img", [before], 0, writer=False) == 0


def test_the_harness_catches_torn_hdf5_metadata_at_the_process_level(tmp_path):
    """The same images over a flush at durability "process" (no journal; the pages that differ
    between before and after a synced flush) do break committed data: the harness can tell."""
    path = tmp_path / "p.h5"
    with fkvstore.open(path, "w") as ar:
        kv = ar.create_stream("kv", 256, width=8, chunk_bytes=512)
        kv.extend(ROWS[:300])
        ar.flush(sync=True)
    before = pl.read_state(path)
    old = path.read_bytes()
    with fkvstore.open(path, "a") as ar:
        ar["kv"].extend(ROWS[300:])
        ar.flush(sync=True)
        new = path.read_bytes()
    after = pl.read_state(path)
    cut = pl.Cut({str(path): old}, {str(path): new}, change_durable=False)
    rng = np.random.default_rng(48)
    broken = 0
    for image in pl.images(cut, rng, exhaustive=0, random=40, torn=0):
        try:
            pl.check_image(image, tmp_path / "img", [before, after], 0, writer=False)
        except (AssertionError, fkvstore.FkvError, OSError):
            broken += 1
    assert broken > 0


def test_a_journal_left_beside_a_new_file_is_not_applied(tmp_path):
    path = tmp_path / "a.h5"
    _build(path)
    with fkvstore.open(path, "a") as ar, pl.recording(path) as capture:
        _append(ar)
    cut = pl.cuts(capture, path)[1]  # the journal durable, the archive half written
    image = next(pl.images(cut, np.random.default_rng(0), exhaustive=0, random=0, torn=0))
    jpath = _journal.journal_path(path)
    Path(jpath).write_bytes(image[jpath])
    assert _journal.read_journal(path) is not None
    path.unlink()
    with fkvstore.open(path, "w", durability="fsync") as ar:  # a new archive of that name
        ar.create_stream("x", 4).extend([1, 2, 3])
    assert pl.read_state(path)["x"].ravel().tolist() == [1, 2, 3]
    for mode in ("w", "x"):
        path.unlink()
        Path(jpath).write_bytes(image[jpath])
        with fkvstore.open(path, mode) as ar:  # "process" level, with the stale journal there
            ar.create_stream("y", 4).extend([3, 2])
        assert pl.read_state(path)["y"].ravel().tolist() == [3, 2]
