"""The superblock repair that replaces `h5clear -s`, checked against HDF5 itself."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import fkvstore
from fkvstore._superblock import clear_status_flags, lookup3, open_cleared_view, read_superblock
from fkvstore.errors import ArchiveFormatError


def test_lookup3_matches_hdf5_superblock_checksums(tmp_path):
    for i, libver in enumerate([("v110", "v110"), ("v110", "latest"), ("latest", "latest")]):
        path = tmp_path / f"f{i}.h5"
        with h5py.File(path, "w", libver=libver) as f:
            f["x"] = np.arange(i + 3)
        sb = read_superblock(path)  # raises if our lookup3 disagrees with HDF5's
        assert sb is not None and sb.version >= 2 and sb.status_flags == 0
        raw = path.read_bytes()[: sb.size]
        assert lookup3(raw[:-4]) == int.from_bytes(raw[-4:], "little")


def test_lookup3_reference_values():
    # values of Bob Jenkins' published driver for hashlittle (lookup3.c, driver5)
    assert lookup3(b"", 0) == 0xDEADBEEF
    assert lookup3(b"", 0xDEADBEEF) == 0xBD5B7DDE
    assert lookup3(b"Four score and seven years ago", 0) == 0x17770551
    assert lookup3(b"Four score and seven years ago", 1) == 0xCD628161


def _killed_writer(path, swmr: bool):
    code = (
        "import h5py, numpy as np, os, signal, sys\n"
        "f = h5py.File(sys.argv[1], 'w', libver=('v110', 'v110'), locking=False)\n"
        "d = f.create_dataset('x', shape=(0,), maxshape=(None,), chunks=(64,), dtype='i8')\n"
        + ("f.swmr_mode = True\n" if swmr else "")
        + "d.resize((100,)); d[:] = np.arange(100); f.flush()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    res = subprocess.run([sys.executable, "-c", code, str(path)])
    assert res.returncode == -signal.SIGKILL


@pytest.mark.parametrize("swmr", [True, False])
def test_clear_flags_lets_hdf5_open_a_dead_writers_file(tmp_path, swmr):
    path = tmp_path / "dead.h5"
    _killed_writer(path, swmr)
    assert read_superblock(path).status_flags == (5 if swmr else 1)
    with pytest.raises(OSError, match="already open for write"):
        h5py.File(path, "r", locking=False)
    view = open_cleared_view(path)  # read-only: the file keeps its flags
    with h5py.File(view, "r") as f:
        assert f["x"][:].tolist() == list(range(100))
    assert read_superblock(path).status_flags != 0
    assert clear_status_flags(path) is True
    assert read_superblock(path).status_flags == 0
    with h5py.File(path, "r", locking=False) as f:
        assert f["x"][:].tolist() == list(range(100))
    assert clear_status_flags(path) is False  # nothing left to do


def test_space_a_dead_writer_wrote_past_the_recorded_end_is_never_handed_out_again(tmp_path):
    """A writer killed inside a flush can leave chunks (and index entries naming them) past the
    end of file its superblock records; recovery must keep HDF5 from allocating over them."""
    path = tmp_path / "dead.h5"
    _killed_writer(path, True)
    sb = read_superblock(path)
    size = os.path.getsize(path)
    assert sb.base_address + sb.eof_address <= size
    marker = bytes(range(256)) * 64
    with open(path, "ab") as fh:  # what the dead writer wrote beyond the recorded end
        fh.write(marker)
    assert clear_status_flags(path) is True
    sb = read_superblock(path)
    assert sb.base_address + sb.eof_address == size + len(marker)
    with h5py.File(path, "a", locking=False) as f:  # new allocations land after the marker
        f.create_dataset("y", data=np.arange(4096), chunks=(512,))
        f["x"].resize((5000,))
        f["x"][100:] = 7
    with open(path, "rb") as fh:
        fh.seek(size)
        assert fh.read(len(marker)) == marker


def test_file_shorter_than_its_superblock_says(tmp_path):
    path = tmp_path / "a.h5"
    with fkvstore.open(path, "w") as ar:
        ar.create_stream("s", 4).extend([1, 2, 3])
    sb = read_superblock(path)
    end = sb.base_address + sb.eof_address
    with open(path, "ab") as fh:  # pretend space was allocated but never written
        fh.write(bytes(0))
    raw = bytearray(path.read_bytes())
    o = 8
    raw[12 + 2 * o : 12 + 3 * o] = (end + 4096).to_bytes(8, "little")
    raw[sb.size - 4 : sb.size] = lookup3(bytes(raw[: sb.size - 4])).to_bytes(4, "little")
    path.write_bytes(raw)
    with fkvstore.open(path) as ar:  # read through the zero-padded view
        assert ar["s"][:, 0].tolist() == [1, 2, 3]
    assert os.path.getsize(path) == end
    with fkvstore.open(path, "a") as ar:  # a writer extends the file with zeros
        assert ar["s"][:, 0].tolist() == [1, 2, 3]


def test_not_hdf5(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"\0" * 4096)
    with pytest.raises(ArchiveFormatError, match="not an HDF5 file"):
        read_superblock(path)


@pytest.mark.skipif(shutil.which("h5dump") is None, reason="HDF5 command-line tools not installed")
def test_standard_tools_read_an_archive(tmp_path):
    path = tmp_path / "a.h5"
    with fkvstore.open(path, "w") as ar:
        ar.create_stream("s", 5).extend([1, 2, 3, 4])
    out = subprocess.run(
        ["h5dump", "-a", "/streams/s/points/fkv_commit", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "(0): 4, 0," in out
    ls = subprocess.run(["h5ls", "-r", str(path)], capture_output=True, text=True, check=True)
    assert "/streams/s/points" in ls.stdout


@pytest.mark.parametrize("swmr", [True, False])
def test_writer_open_leaves_a_foreign_dead_writers_file_unchanged(tmp_path, swmr):
    """Mode "a"/"r+" on a non-archive HDF5 file with a killed writer's flags is refused
    before the flags are cleared: not one byte changes."""
    path = tmp_path / "foreign.h5"
    _killed_writer(path, swmr)
    before = path.read_bytes()
    assert read_superblock(path).status_flags != 0
    for mode in ("a", "r+"):
        with pytest.raises(ArchiveFormatError, match="not an fkvstore archive"):
            fkvstore.open(path, mode)
        assert path.read_bytes() == before


def test_writer_open_still_repairs_a_dead_writers_archive(tmp_path):
    path = tmp_path / "a.h5"
    code = (
        "import os, signal, sys, fkvstore\n"
        "ar = fkvstore.open(sys.argv[1], 'w')\n"
        "ar.create_stream('s', 10).extend([1, 2, 3]); ar.flush()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    root = str(Path(__file__).parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code, str(path)], env=env)
    assert res.returncode == -signal.SIGKILL
    assert read_superblock(path).status_flags != 0
    with fkvstore.open(path, "a") as ar:
        assert ar["s"][:].ravel().tolist() == [1, 2, 3]
    assert read_superblock(path).status_flags == 0
