"""A writer SIGKILLed at random moments leaves an archive that opens ("r" and "a") and holds
exactly a prefix of what was appended, at least up to the last completed flush.

Two chains of writer processes run side by side (2 cores); each chain reuses one archive, so
every writer also starts from the file its killed predecessor left. Most kills are aimed at a
chosen phase (inside extend, append, flush or truncate) by watching the phase the writer
publishes in shared memory; the phase it was really in when it died is read back afterwards.
FKV_DEEP=1 runs 400 kills instead of 50.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import h5py
import numpy as np
import pytest

import fkvstore
from fkvstore._superblock import open_cleared_view
from fkvstore.errors import ArchiveLockedError

HERE = Path(__file__).parent
SUPPORT = HERE.parent / "support"
import crash_writer as cw  # noqa: E402

DEEP = os.environ.get("FKV_DEEP") == "1"
KILLS = 400 if DEEP else 50
TARGETS = ("extend", "flush", "append", "truncate", None)


def _env() -> dict:
    env = dict(os.environ)
    root = str(HERE.parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def check_archive(path: Path, status: cw.Status) -> list[int]:
    """Open read-only, compare every stream to the expected sequence; return the lengths."""
    lengths = []
    with fkvstore.open(path, "r") as ar:
        assert sorted(ar) == sorted(cw.STREAMS)
        for k, name in enumerate(cw.STREAMS):
            s = ar[name]
            n = len(s)
            assert status.flushed(k) <= n <= max(status.intended(k), status.flushed(k)), (
                name,
                status.flushed(k),
                n,
                status.intended(k),
            )
            got = s.read()
            np.testing.assert_array_equal(got, cw.expected_rows(name, 0, n), err_msg=name)
            lengths.append(n)
    return lengths


def assert_no_shared_bytes(path: Path) -> None:
    """No two chunks of the file occupy the same bytes (space a dead writer used, handed out
    again by the next one, shows up here before it shows up as a checksum error)."""
    extents = []

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset) and obj.chunks:
            for i in range(obj.id.get_num_chunks()):
                info = obj.id.get_chunk_info(i)
                extents.append((info.byte_offset, info.byte_offset + info.size, name))

    with open_cleared_view(path) as view, h5py.File(view, "r") as f:
        f.visititems(visit)
    extents.sort()
    for a, b in zip(extents, extents[1:], strict=False):
        assert b[0] >= a[1], f"chunks of {a[2]} and {b[2]} share bytes {b[0]}..{a[1]}"


def run_chain(tmp: Path, chain: int, kills: int) -> Counter:
    rng = np.random.default_rng(1000 + chain)
    path = tmp / f"chain{chain}.h5"
    status_path = tmp / f"status{chain}.bin"
    status_path.write_bytes(bytes(cw.STATUS_BYTES))
    cw.create(str(path))
    status = cw.Status(str(status_path))
    phases: Counter = Counter()
    for trial in range(kills):
        status.mem[:] = bytes(cw.STATUS_BYTES)
        proc = subprocess.Popen(
            [
                sys.executable,
                str(SUPPORT / "crash_writer.py"),
                str(path),
                str(status_path),
                str(int(rng.integers(1 << 30))),
            ],
            env=_env(),
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 60
        while status.phase() in ("idle", "open") and proc.poll() is None:
            assert time.monotonic() < deadline, "writer never started writing"
            time.sleep(0.001)
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(float(rng.uniform(0, 0.25)))
        target = TARGETS[trial % len(TARGETS)]
        if target is not None:
            until = time.monotonic() + 0.5
            while status.phase() != target and time.monotonic() < until:
                time.sleep(0.0002)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()
        phases[status.phase()] += 1
        check_archive(path, status)
        assert_no_shared_bytes(path)
    return phases


def test_killed_writers_leave_a_prefix(tmp_path):
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda c: run_chain(tmp_path, c, KILLS // 2), range(2)))
    phases = sum(results, Counter())
    print("kills by phase:", dict(phases))
    assert sum(phases.values()) == KILLS
    # the aimed kills must really have landed inside the operations they aim at
    assert phases["flush"] >= KILLS // 10
    assert phases["extend"] >= KILLS // 25
    # and every file opens for writing again with all its streams: in a fresh process, as the
    # next writer would, so no HDF5 state of this process's two checking threads is in the way
    # (once in CI this process's own "a" open was refused as "already open for read-only"
    # after both chains had closed every reader; not reproduced since)
    code = ("import sys, fkvstore\n"
            "with fkvstore.open(sys.argv[1], 'a') as ar:\n"
            "    print(sorted(ar))\n")
    for c in range(2):
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / f"chain{c}.h5")],
                              env=_env(), capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == str(sorted(cw.STREAMS))


def test_writer_dead_outside_swmr_mode_is_readable(tmp_path):
    """A writer can also die while the file is open in ordinary (non-SWMR) mode, e.g. while
    creating a stream: the flags it leaves block even SWMR readers, yet "r" and "a" open it."""
    path = tmp_path / "a.h5"
    with fkvstore.open(path, "w") as ar:
        ar.create_stream("s", 100).extend(np.arange(1000) % 100)
    code = (
        "import h5py, os, signal, sys\n"
        "f = h5py.File(sys.argv[1], 'r+', libver=('v110', 'v110'), locking=False)\n"
        "f.flush()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(path)], env=_env())
    assert proc.returncode == -signal.SIGKILL
    with pytest.raises(OSError, match="already open for write"):
        h5py.File(path, "r", locking=False)
    with fkvstore.open(path, "r") as ar:  # read-only: the file is not modified
        np.testing.assert_array_equal(ar["s"][:, 0], np.arange(1000) % 100)
    with fkvstore.open(path, "a") as ar:
        ar["s"].append(7)
    with h5py.File(path, "r", locking=False) as f:  # flags cleared: plain HDF5 opens it again
        assert f["streams/s/points"].attrs["fkv_commit"][0] == 1001


def test_second_writer_is_refused_while_first_lives(tmp_path):
    path = tmp_path / "a.h5"
    code = (
        "import sys, time, fkvstore\n"
        "ar = fkvstore.open(sys.argv[1], 'w')\n"
        "ar.create_stream('s', 10).extend([1, 2, 3])\n"
        "ar.flush()\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(path)], env=_env(), stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout.readline().strip() == b"ready"
        with pytest.raises(ArchiveLockedError, match="already open for writing"):
            fkvstore.open(path, "a")
        with pytest.raises(ArchiveLockedError):
            fkvstore.open(path, "w")  # and "w" did not truncate it
        with fkvstore.open(path, "r") as ar:  # readers are welcome
            assert ar["s"][:, 0].tolist() == [1, 2, 3]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with fkvstore.open(path, "a") as ar:  # the dead writer's lock is gone
            assert ar["s"][:, 0].tolist() == [1, 2, 3]
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("reader_opened", ["beside a writer", "alone"])
def test_a_writer_beside_a_reader_in_this_process_is_refused_by_name(tmp_path, reader_opened):
    # HDF5 shares one open file per process: a writer cannot start while a reader is open
    path = tmp_path / "a.h5"
    with fkvstore.open(path, "w") as ar:
        ar.create_stream("s", 8).extend([1, 2, 3])
    if reader_opened == "beside a writer":
        with fkvstore.open(path, "a"):
            reader = fkvstore.open(path)
    else:
        reader = fkvstore.open(path)
    try:
        for mode in ("a", "r+", "w"):
            with pytest.raises(ArchiveLockedError, match="already open in this process"):
                fkvstore.open(path, mode)
        assert reader["s"][:, 0].tolist() == [1, 2, 3]
    finally:
        reader.close()
    with fkvstore.open(path, "a") as ar:  # nothing was changed, no lock left behind
        ar["s"].append(4)
    with fkvstore.open(path) as ar:
        assert ar["s"][:, 0].tolist() == [1, 2, 3, 4]
