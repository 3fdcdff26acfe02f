"""Durability levels: the API, format version 2 and its golden file, the journaled file against
a plain bytes oracle, and recovery from a journal (the power-loss images are in
test_power_loss.py)."""

from __future__ import annotations

import os
import shutil
import struct
import sys
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fkvstore
from fkvstore import _journal
from fkvstore.errors import ArchiveFormatError, ArchiveLockedError

HERE = Path(__file__).parent
GOLDEN = HERE.parent / "golden"
sys.path.insert(0, str(HERE))
import power_loss as pl  # noqa: E402
from test_archive_integrity import assert_golden_content, golden_content  # noqa: E402

DEEP = os.environ.get("FKV_DEEP") == "1"


# -- the API ---------------------------------------------------------------------------------------
def test_durability_is_checked_and_reported(tmp_path):
    with pytest.raises(ValueError, match="'disk'"):
        fkvstore.open(tmp_path / "a.h5", "w", durability="disk")
    assert not (tmp_path / "a.h5").exists()
    with fkvstore.open(tmp_path / "a.h5", "w") as ar:
        assert ar.durability == "process"
    with fkvstore.open(tmp_path / "b.h5", "w", durability="fsync") as ar:
        assert ar.durability == "fsync"
    with fkvstore.open(tmp_path / "b.h5", "a") as ar:  # the file's own level
        assert ar.durability == "fsync"
    with fkvstore.open(tmp_path / "b.h5") as ar:
        assert ar.durability == "fsync"
    with fkvstore.open(tmp_path / "b.h5", "a", durability="process") as ar:  # this writer only
        assert ar.durability == "process"
        ar.create_stream("s", 4).extend([1, 2])
    with fkvstore.open(tmp_path / "b.h5", "a") as ar:
        assert ar.durability == "fsync"
        assert ar["s"][:].tolist() == [1, 2]


def test_flush_sync_at_the_process_level_fsyncs(tmp_path, monkeypatch):
    synced = []
    for name in ("fsync", "fdatasync"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda fd, real=real: (synced.append(fd), real(fd)))
    with fkvstore.open(tmp_path / "a.h5", "w") as ar:
        s = ar.create_stream("s", 256)
        s.extend(range(100))
        ar.flush()
        assert synced == []
        s.extend(range(5))
        ar.flush(sync=True)
        assert len(synced) == 2  # the file, and its directory (the file is new)
        ar.flush(sync=True)  # nothing pending: still an fsync, of the file alone
        assert len(synced) == 3
    with fkvstore.open(tmp_path / "a.h5") as ar:
        assert len(ar["s"]) == 105


def test_every_commit_at_the_fsync_level_goes_through_the_journal(tmp_path):
    path = tmp_path / "a.h5"
    with fkvstore.open(path, "w", durability="fsync") as ar:
        s = ar.create_stream("s", 256, width=2)
        s.extend(np.ones((10, 2), int))
        ar.flush()
        for change in (lambda: (s.extend(np.zeros((3, 2), int)), ar.flush()),
                       lambda: s.truncate(4),
                       lambda: ar.put_array("a", np.arange(3)),
                       lambda: ar.attrs.__setitem__("note", "x")):
            with pl.recording(path) as capture:
                change()
            kinds = [(e.kind, e.path.endswith("-journal")) for e in capture.events]
            # journal, fsync, pages, fsync: the journal is durable before the file changes
            assert kinds[0] == ("write", True) and kinds[1] == ("fsync", True)
            assert kinds[-1] == ("fsync", False)
            assert all(not j for _, j in kinds[2:])
        with pl.recording(path) as capture:
            ar.flush()  # nothing pending: nothing written
        assert capture.events == []


def test_no_reader_beside_an_fsync_writer(tmp_path):
    path = tmp_path / "a.h5"
    with fkvstore.open(path, "w", durability="fsync") as ar:
        ar.create_stream("s", 4).extend([1, 2, 3])
        ar.flush()
        with pytest.raises(ArchiveLockedError, match="'fsync'"):
            fkvstore.open(path)
    with fkvstore.open(path) as ar:
        assert ar["s"][:].tolist() == [1, 2, 3]


def test_fsync_on_a_version_1_archive_converts_it(tmp_path):
    path = tmp_path / "v1.h5"
    shutil.copy(GOLDEN / "v1.h5", path)
    with fkvstore.open(path, "a", durability="fsync") as ar:
        assert ar.durability == "fsync"
        ar["grid1"].extend([[7]])
    with h5py.File(path, "r", locking=False) as f:
        assert f.attrs["fkv_format_version"] == 2 and f.attrs["fkv_durability"] == "fsync"
    with fkvstore.open(path) as ar:
        assert ar.durability == "fsync"
        data = golden_content()["grid1"][3]
        np.testing.assert_array_equal(ar["grid1"].read(), np.vstack([data, [[7]]]))


# -- format version 2 and its golden file --------------------------------------------------------
def test_golden_v2_reads_exactly():
    path = GOLDEN / "v2.h5"
    assert not Path(f"{path}-journal").exists()
    assert_golden_content(path, 2)
    with fkvstore.open(path) as ar:
        assert ar.durability == "fsync"
    with h5py.File(path, "r", locking=False) as f:
        assert f.attrs["fkv_format_version"] == 2


def test_golden_v2_is_reproduced_byte_for_byte(tmp_path):
    sys.path.insert(0, str(GOLDEN))
    import make_golden

    fresh = tmp_path / "v2.h5"
    make_golden.write(fresh, version=2)
    assert not Path(f"{fresh}-journal").exists()
    with (h5py.File(GOLDEN / "v2.h5", "r", locking=False) as old,
          h5py.File(fresh, "r", locking=False) as new):
        for name in golden_content().keys() | {"text"}:
            for ds in ("points", "block_crc"):
                a, b = old[f"streams/{name}/{ds}"], new[f"streams/{name}/{ds}"]
                assert a[:].tobytes() == b[:].tobytes(), (name, ds)
            assert (old[f"streams/{name}/points"].attrs["fkv_commit"]
                    == new[f"streams/{name}/points"].attrs["fkv_commit"]).all()


def test_a_newer_format_is_refused(tmp_path):
    path = tmp_path / "v3.h5"
    shutil.copy(GOLDEN / "v2.h5", path)
    with h5py.File(path, "r+", locking=False) as f:
        f.attrs["fkv_format_version"] = 3
    with pytest.raises(ArchiveFormatError, match="version 3"):
        fkvstore.open(path)


# -- recovery --------------------------------------------------------------------------------------
def _half_written(tmp_path):
    """An archive whose last sync was cut after the journal, with half its pages written."""
    path = tmp_path / "a.h5"
    with fkvstore.open(path, "w", durability="fsync") as ar:
        ar.create_stream("s", 256, width=4).extend(np.arange(400).reshape(100, 4) % 256)
    before = pl.read_state(path)
    with fkvstore.open(path, "a") as ar, pl.recording(path) as capture:
        ar["s"].extend(np.ones((50, 4), int))
        ar.flush()
    cut = pl.cuts(capture, path)[1]
    image = next(pl.images(cut, np.random.default_rng(3), exhaustive=0, random=0, torn=0))
    # keep every other differing page of the archive
    main = str(path)
    diffs = [i for i in range(len(cut.written[main]) // pl.PAGE + 1)
             if pl._page(cut.durable[main], i) != pl._page(cut.written[main], i)]
    img = bytearray(cut.written[main])
    for i in diffs[::2]:
        img[i * pl.PAGE : (i + 1) * pl.PAGE] = pl._page(cut.durable[main], i)[
            : len(img[i * pl.PAGE : (i + 1) * pl.PAGE])]
    image[main] = bytes(img)
    for p, data in image.items():
        Path(p).write_bytes(data)
    return path, before


def test_a_reader_rolls_back_in_a_view_and_a_writer_on_disk(tmp_path):
    path, before = _half_written(tmp_path)
    jpath = _journal.journal_path(path)
    state = _journal.read_journal(path)
    assert state is not None and not state.complete
    files = (path.read_bytes(), Path(jpath).read_bytes())
    assert pl.same_state(pl.read_state(path), before)
    assert (path.read_bytes(), Path(jpath).read_bytes()) == files  # the reader wrote nothing
    assert _journal.recover(path) is True
    assert _journal.read_journal(path) is None
    assert _journal.recover(path) is False  # nothing left to do
    assert pl.same_state(pl.read_state(path), before)
    with h5py.File(path, "r", locking=False) as f:  # plain HDF5 reads the rolled-back file too
        assert f["streams/s/points"].shape[0] >= 1


def test_recovery_cut_again_by_a_power_failure_is_repeated(tmp_path):
    path, before = _half_written(tmp_path)
    with pl.recording(path) as capture:
        _journal.recover(path)
    for cut in pl.cuts(capture, path):
        for image in pl.images(cut, np.random.default_rng(5), exhaustive=4, random=6, torn=3):
            assert pl.check_image(image, tmp_path / "img", [before], 0, writer=True) == 0


# -- the journaled file against a bytes oracle -----------------------------------------------------
_OPS = st.lists(st.one_of(
    st.tuples(st.just("write"), st.integers(0, 20000), st.binary(min_size=1, max_size=9000)),
    st.tuples(st.just("read"), st.integers(0, 30000), st.integers(0, 9000)),
    st.tuples(st.just("truncate"), st.integers(0, 30000), st.just(0)),
    st.tuples(st.just("sync"), st.just(0), st.just(0)),
    st.tuples(st.just("reopen"), st.just(0), st.just(0)),
), max_size=25)


@settings(max_examples=2000 if DEEP else 60, deadline=None)
@given(initial=st.binary(max_size=12000), ops=_OPS)
def test_journaled_file_reads_what_was_written(tmp_path_factory, initial, ops):
    """Reads see every write at once; the disk changes only at sync and then holds exactly what
    the file object shows."""
    path = tmp_path_factory.mktemp("j") / "f"
    path.write_bytes(initial)
    oracle, disk = bytearray(initial), bytearray(initial)
    f = _journal.JournaledFile(path, create=False)
    try:
        for op, a, b in ops:
            if op == "write":
                f.seek(a)
                assert f.write(b) == len(b)
                oracle.extend(bytes(max(0, a - len(oracle))))
                oracle[a : a + len(b)] = b
            elif op == "read":
                f.seek(a)
                buf = bytearray(b)
                n = f.readinto(buf)
                assert bytes(buf[:n]) == bytes(oracle[a : a + b])
            elif op == "truncate":
                f.truncate(a)  # extends; never shrinks
                oracle.extend(bytes(max(0, a - len(oracle))))
            else:
                f.sync()
                disk[:] = oracle
                assert path.read_bytes() == bytes(disk)
                if op == "reopen":
                    f.close()
                    f = _journal.JournaledFile(path, create=False)
            if op not in ("sync", "reopen"):
                assert path.read_bytes() == bytes(disk)  # unchanged before the sync
    finally:
        f.close()


def _crafted_journal(path: Path, old_size: int, new_size: int, n_new: int, n_old: int,
                     body: bytes) -> None:
    head = struct.pack("<8sIIQQQQQI", _journal.MAGIC, 1, 4096, 7, old_size, new_size, n_new,
                       n_old, zlib.crc32(body))
    head += struct.pack("<I", zlib.crc32(head))
    Path(_journal.journal_path(path)).write_bytes(head.ljust(512, b"\0") + body)


@pytest.mark.parametrize("case", ["huge count", "old size past the file", "page past the file",
                                  "body cut short"])
def test_a_journal_fkvstore_did_not_write_is_not_applied(tmp_path, case):
    """Valid checksums over values no sync writes: the journal is ignored, nothing allocated or
    written for it, and the archive reads as it is."""
    path = tmp_path / "a.h5"
    with fkvstore.open(path, "w", durability="fsync") as ar:
        ar.create_stream("s", 4).extend([1, 2, 3])
    size = path.stat().st_size
    page = struct.pack("<Q", 0) + bytes(4096)
    args = {"huge count": (size, size, 1 << 60, 0, b""),
            "old size past the file": (size + 4096, size + 4096, 1, 1,
                                       struct.pack("<QI", 0, 0) + page),
            "page past the file": (size, size, 1, 1,
                                   struct.pack("<QI", 1 << 40, 0) + struct.pack("<Q", 1 << 40)
                                   + bytes(4096)),
            "body cut short": (size, size, 3, 1, struct.pack("<QI", 0, 0))}[case]
    _crafted_journal(path, *args)
    before = path.read_bytes()
    assert _journal.read_journal(path) is None
    assert pl.read_state(path)["s"].ravel().tolist() == [1, 2, 3]
    assert _journal.recover(path) is False
    assert path.read_bytes() == before


def test_fkv_info_names_the_level(capsys):
    from fkvstore import cli

    for version, level in ((1, "process"), (2, "fsync")):
        assert cli.main(["info", str(GOLDEN / f"v{version}.h5")]) == 0
        assert f"durability {level}" in capsys.readouterr().out.splitlines()[0]


def test_a_failed_sync_stops_commits_and_is_rolled_back_on_reopen(tmp_path, monkeypatch):
    path = tmp_path / "a.h5"
    with fkvstore.open(path, "w", durability="fsync") as ar:
        ar.create_stream("s", 256).extend(range(50))
    before = pl.read_state(path)

    class Full(_journal._Disk):  # the disk fills up after the journal and one page
        def pwrite(self, path_, fd, data, offset):
            if not path_.endswith("-journal"):
                super().pwrite(path_, fd, data[:4096], offset)
                raise OSError(28, "No space left on device")
            super().pwrite(path_, fd, data, offset)

    ar = fkvstore.open(path, "a")
    ar["s"].extend(np.arange(50, 5000) % 256)
    monkeypatch.setattr(_journal, "DISK", Full())
    with pytest.raises(OSError, match="No space"):
        ar.flush()
    monkeypatch.undo()
    ar["s"].extend([1])
    with pytest.raises(fkvstore.errors.ArchiveClosedError, match="failed part-way"):
        ar.flush()
    with pytest.raises(fkvstore.errors.ArchiveClosedError):
        ar.close()
    assert ar.closed
    assert pl.same_state(pl.read_state(path), before)  # the reader rolls back in a view
    with fkvstore.open(path, "a") as again:  # the writer on disk
        assert len(again["s"]) == 50
