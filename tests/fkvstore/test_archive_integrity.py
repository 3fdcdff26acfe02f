"""Checksums, SWMR readers, golden files and a stateful model test of the archive."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from h5reader import read_stream_with_h5py
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import fkvstore
from fkvstore import cli
from fkvstore.errors import (
    ArchiveClosedError,
    ArchiveFormatError,
    ArchiveLockedError,
    ChecksumError,
    PositionError,
)

HERE = Path(__file__).parent
GOLDEN = HERE.parent / "golden"


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(HERE.parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _points_file_range(path, stream):
    """Byte ranges of the stored point chunks (and tail chunks) of ``stream`` in the file."""
    out = []
    with h5py.File(path, "r", locking=False) as f:
        for ds_name in ("points", "tail"):
            ds = f[f"streams/{stream}/{ds_name}"]
            for k in range(ds.id.get_num_chunks()):
                info = ds.id.get_chunk_info(k)
                out.append((ds_name, info.chunk_offset, info.byte_offset, info.size))
    return out


@pytest.mark.parametrize("geometry", ["grid", "ring"])
def test_flipped_bytes_are_reported_never_decoded(tmp_path, geometry):
    path = tmp_path / "a.h5"
    rng = np.random.default_rng(5)
    data = rng.integers(0, 200, (3000, 2))
    with fkvstore.open(path, "w") as ar:
        ar.create_stream("s", 200, geometry=geometry, width=2, chunk_bytes=1024).extend(data)
    clean = path.read_bytes()
    chunks = _points_file_range(path, "s")
    with h5py.File(path, "r", locking=False) as f:
        tail_slot = int(f["streams/s/points"].attrs["fkv_commit"][2])  # COMMIT_FIELDS
    trials = 0
    for ds_name, chunk_offset, byte_offset, size in chunks:
        if ds_name == "tail" and chunk_offset[0] != tail_slot:
            continue  # the inactive tail slot is not part of the archive
        for pos in rng.integers(0, size, 2):
            if ds_name == "points":  # only the committed rows of the last chunk matter
                with h5py.File(path, "r", locking=False) as f:
                    full = int(f["streams/s/points"].attrs["fkv_commit"][1])
                if chunk_offset[0] + pos // 32 >= full:
                    continue
            damaged = bytearray(clean)
            damaged[byte_offset + pos] ^= 1 << int(rng.integers(8))
            path.write_bytes(damaged)
            trials += 1
            with fkvstore.open(path) as ar:
                s = ar["s"]
                with pytest.raises(ChecksumError, match="CRC-32"):
                    s[:]
                # every row either reads back right or raises: never a wrong symbol
                for i in range(0, 3000, 37):
                    try:
                        got = s[i]
                    except ChecksumError:
                        continue
                    np.testing.assert_array_equal(got, data[i])
            assert cli.main(["verify", "--quiet", str(path)]) == 1
    assert trials >= 10
    path.write_bytes(clean)
    with fkvstore.open(path) as ar:
        np.testing.assert_array_equal(ar["s"][:], data)


def test_flipped_array_byte(tmp_path):
    path = tmp_path / "a.h5"
    value = np.arange(1000, dtype=np.float64)
    with fkvstore.open(path, "w") as ar:
        ar.put_array("codebook", value)
    with h5py.File(path, "r", locking=False) as f:
        offset = f["arrays/codebook"].id.get_offset()
    raw = bytearray(path.read_bytes())
    raw[offset + 4000] ^= 0x10
    path.write_bytes(raw)
    with fkvstore.open(path) as ar, pytest.raises(ChecksumError, match="codebook"):
        ar.get_array("codebook")


def test_swmr_reader_sees_the_stream_grow(tmp_path):
    """A writer in another process appends and flushes; this reader refreshes and follows."""
    path = tmp_path / "a.h5"
    with fkvstore.open(path, "w") as ar:
        ar.create_stream("s", 100, width=3, chunk_bytes=512)
    code = (
        "import sys, numpy as np, fkvstore\n"
        "ar = fkvstore.open(sys.argv[1], 'a')\n"
        "s = ar['s']\n"
        "for step in range(1, 6):\n"
        "    sys.stdin.readline()\n"
        "    s.extend(np.arange(step * 300 * 3).reshape(-1, 3)[-300:] % 100)\n"
        "    if step == 4:\n"
        "        s.truncate(500)\n"
        "    ar.flush()\n"
        "    print(len(s), flush=True)\n"
        "ar.close()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(path)],
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    expect = np.arange(1500 * 3).reshape(-1, 3) % 100
    seen = []
    with fkvstore.open(path, "r") as ar:
        s = ar["s"]
        assert len(s) == 0
        s[0:0]
        for _ in range(5):
            proc.stdin.write("go\n")
            proc.stdin.flush()
            n = int(proc.stdout.readline())
            ar.refresh()
            assert len(s) == n
            want = expect[:n] if n != 500 else expect[:500]
            if len(seen) >= 3:  # after the truncate at step 4 the writer re-grows from 500
                want = np.concatenate([expect[:500], expect[1200 : 1200 + n - 500]])
            np.testing.assert_array_equal(s[:], want)
            np.testing.assert_array_equal(s[n - 1], want[-1])
            seen.append(n)
    assert proc.wait() == 0
    assert seen == [300, 600, 900, 500, 800]


def test_reader_behind_two_commits_is_not_told_the_file_is_damaged(tmp_path):
    """The writer reuses the tail slot a reader's (unread) commit record points to."""
    path = tmp_path / "a.h5"
    w = fkvstore.open(path, "w")
    s = w.create_stream("s", 256)
    s.extend([1, 2, 3])
    w.flush()
    r = fkvstore.open(path, "r")
    rs = r["s"]
    assert len(rs) == 3
    s.extend([4])
    w.flush()
    s.extend([5])
    w.flush()
    assert rs[0] == 1  # the reader takes up the newer commit instead of raising
    np.testing.assert_array_equal(rs[:].ravel(), [1, 2, 3, 4, 5])
    assert r.verify() == {"s": []}
    r.close()
    w.close()


def test_reader_behind_a_truncation_reads_the_new_rows(tmp_path):
    """Chunks a reader has not loaded were rewritten after a truncation: not damage."""
    path = tmp_path / "a.h5"
    w = fkvstore.open(path, "w")
    s = w.create_stream("s", 100, width=2, chunk_bytes=256)
    first = np.arange(2000).reshape(-1, 2) % 100
    s.extend(first)
    w.flush()
    r = fkvstore.open(path, "r")
    rs = r["s"]
    assert len(rs) == 1000
    s.truncate(10)
    second = (np.arange(1990 * 2).reshape(-1, 2) * 7) % 100
    s.extend(second)
    w.flush()
    want = np.concatenate([first[:10], second])
    np.testing.assert_array_equal(rs[500], want[500])
    assert len(rs) == 2000
    np.testing.assert_array_equal(rs[:], want)
    assert r["s"].verify() == []
    # a reader whose view is current still reports real damage (covered in detail above)
    r.close()
    w.close()


def test_reader_verify_behind_a_truncation(tmp_path):
    path = tmp_path / "a.h5"
    w = fkvstore.open(path, "w")
    s = w.create_stream("s", 100, chunk_bytes=256)
    s.extend(np.arange(3000) % 100)
    w.flush()
    r = fkvstore.open(path, "r")
    assert len(r["s"]) == 3000
    s.truncate(5)
    s.extend((np.arange(2995) * 3) % 100)
    w.flush()
    assert r.verify() == {"s": []}
    assert len(r["s"]) == 3000
    r.close()
    w.close()


def test_swmr_reader_follows_a_fast_writer_without_false_damage(tmp_path):
    """A writer process commits in a loop (with truncations); every read here must succeed
    and return the symbols the writer wrote (position i always holds i % 251)."""
    path = tmp_path / "a.h5"
    with fkvstore.open(path, "w") as ar:
        ar.create_stream("s", 251, chunk_bytes=256).extend(np.arange(100) % 251)
    code = (
        "import sys, fkvstore\n"
        "ar = fkvstore.open(sys.argv[1], 'a')\n"
        "s = ar['s']\n"
        "print('ready', flush=True)\n"
        "for k in range(400):\n"
        "    if k % 50 == 49:\n"
        "        s.truncate(len(s) // 2)\n"
        "    n = len(s)\n"
        "    s.extend([(n + j) % 251 for j in range(1 + k % 7)])\n"
        "    ar.flush()\n"
        "ar.close()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(path)], env=_env(), stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    reads = 0
    with fkvstore.open(path, "r") as ar:
        s = ar["s"]
        while True:
            done = proc.poll() is not None
            n = len(s)
            for i in (0, n // 2, n - 1, n - 2):
                try:
                    assert s[i] == i % 251
                except PositionError:  # the read took up a newer commit: a truncation
                    assert i >= len(s)
            a = max(0, n - 40)
            got = s[a:n].ravel()  # shorter if a truncation was taken up
            np.testing.assert_array_equal(got, np.arange(a, a + len(got)) % 251)
            reads += 1
            if done:
                break
            ar.refresh()
            time.sleep(0.002)  # let the writer commit (twice or more) before the next reads
        ar.refresh()
        n = len(s)
        np.testing.assert_array_equal(s[:].ravel(), np.arange(n) % 251)
    assert proc.wait() == 0
    assert reads > 1


# -- golden files --------------------------------------------------------------------------------
def golden_content():
    """What the golden archives hold; tests/golden/make_golden.py writes them from this."""
    rng = np.random.default_rng(20261130)
    return {
        "grid1": ("grid", 256, 1, rng.integers(0, 256, (1000, 1))),
        "ring3": ("ring", 27, 3, rng.integers(0, 27, (257, 3))),
        "wide": ("grid", 50257, 8, rng.integers(0, 50257, (40, 8))),
        "empty": ("grid", 5, 2, np.zeros((0, 2), np.int64)),
    }


GOLDEN_TEXT = "The Time Traveller (for so it will be convenient to speak of him) — ∞\n"


def test_golden_files_read_exactly():
    assert_golden_content(GOLDEN / "v1.h5", 1)


def assert_golden_content(path, version: int) -> None:
    """The golden archive of format ``version`` at ``path`` holds golden_content() exactly."""
    assert path.exists(), "run tests/golden/make_golden.py"
    with fkvstore.open(path) as ar:
        assert ar.attrs["purpose"] == f"golden archive, format version {version}"
        for name, (geometry, alphabet, width, data) in golden_content().items():
            s = ar[name]
            assert (s.codec.geometry, s.alphabet_size, s.width) == (geometry, alphabet, width)
            np.testing.assert_array_equal(s.read(), data)
            np.testing.assert_array_equal(read_stream_with_h5py(path, name), data)
        assert ar["text"].text() == GOLDEN_TEXT
        np.testing.assert_array_equal(
            ar.get_array("codebook"), np.linspace(-1, 1, 24).reshape(2, 3, 4)
        )


def test_golden_file_is_reproduced_byte_for_byte(tmp_path):
    """The writer still produces the same stored bytes (points, tails, checksums)."""
    sys.path.insert(0, str(GOLDEN))
    import make_golden

    fresh = tmp_path / "v1.h5"
    make_golden.write(fresh)
    with (
        h5py.File(GOLDEN / "v1.h5", "r", locking=False) as old,
        h5py.File(fresh, "r", locking=False) as new,
    ):
        for name in golden_content().keys() | {"text"}:
            for ds in ("points", "block_crc"):
                a, b = old[f"streams/{name}/{ds}"], new[f"streams/{name}/{ds}"]
                assert a[:].tobytes() == b[:].tobytes(), (name, ds)
            assert (
                old[f"streams/{name}/points"].attrs["fkv_commit"]
                == new[f"streams/{name}/points"].attrs["fkv_commit"]
            ).all()


# -- stateful model test ---------------------------------------------------------------------------
class ArchiveModel(RuleBasedStateMachine):
    """append / extend / truncate / flush / reopen / read against a plain list."""

    def __init__(self):
        super().__init__()
        import tempfile

        self.dir = tempfile.TemporaryDirectory()
        self.path = Path(self.dir.name) / "m.h5"

    @initialize(
        geometry=st.sampled_from(["grid", "ring"]),
        alphabet=st.sampled_from([2, 5, 256, 3000]),
        width=st.integers(1, 3),
    )
    def setup(self, geometry, alphabet, width):
        self.alphabet, self.width = alphabet, width
        self.ar = fkvstore.open(self.path, "w")
        self.s = self.ar.create_stream(
            "s", alphabet, geometry=geometry, width=width, chunk_bytes=64
        )
        self.model: list[list[int]] = []

    @rule(data=st.data())
    def extend(self, data):
        n = data.draw(st.integers(0, 40))
        rows = data.draw(
            st.lists(
                st.lists(
                    st.integers(0, self.alphabet - 1), min_size=self.width, max_size=self.width
                ),
                min_size=n,
                max_size=n,
            )
        )
        self.s.extend(np.array(rows, dtype=np.int64).reshape(n, self.width))
        self.model.extend(rows)

    @rule(data=st.data())
    def append(self, data):
        row = data.draw(
            st.lists(st.integers(0, self.alphabet - 1), min_size=self.width, max_size=self.width)
        )
        self.s.append(row[0] if self.width == 1 else row)
        self.model.append(row)

    @rule(data=st.data())
    def truncate(self, data):
        n = data.draw(st.integers(0, len(self.model)))
        self.s.truncate(n)
        del self.model[n:]

    @rule()
    def flush(self):
        self.ar.flush()

    @rule()
    def reopen(self):
        self.ar.close()
        self.ar = fkvstore.open(self.path, "a")
        self.s = self.ar["s"]

    @precondition(lambda self: len(self.model) > 0)
    @rule(data=st.data())
    def read_one(self, data):
        i = data.draw(st.integers(-len(self.model), len(self.model) - 1))
        got = self.s[i]
        assert np.atleast_1d(got).tolist() == self.model[i]

    @invariant()
    def same_content(self):
        if hasattr(self, "s"):
            assert len(self.s) == len(self.model)
            assert self.s.read().tolist() == self.model

    def teardown(self):
        if hasattr(self, "ar"):
            self.ar.close()
            with fkvstore.open(self.path) as ar:
                assert ar["s"].read().tolist() == self.model
            assert read_stream_with_h5py(self.path, "s").tolist() == self.model
        self.dir.cleanup()


TestArchiveModel = ArchiveModel.TestCase
TestArchiveModel.settings = __import__("hypothesis").settings(
    max_examples=200 if os.environ.get("FKV_DEEP") else 25, stateful_step_count=30, deadline=None
)


# -- readers across a writer's changes of structure --------------------------------------------
_HOLD_OPEN = (
    "import sys, fkvstore\n"
    "ar = fkvstore.open(sys.argv[1], 'a')\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()\n"
    "ar.close()\n"
)


def test_reader_refresh_sees_streams_created_and_deleted_since_it_opened(tmp_path):
    path = tmp_path / "a.h5"
    with fkvstore.open(path, "w") as ar:
        ar.create_stream("kv", 16, width=4).extend(np.zeros((10, 4), int))
        ar.create_stream("old", 16).extend([1, 2, 3])
    code = (
        "import sys, numpy as np, fkvstore\n"
        "with fkvstore.open(sys.argv[1], 'a') as ar:\n"
        "    ar.create_stream('new', 16).extend([5, 6, 7, 8])\n"
        "    ar['kv'].extend(np.ones((5, 4), int))\n"
        "    del ar['old']\n"
    )
    with fkvstore.open(path, "r") as ar:
        old = ar["old"]
        assert ar.keys() == ["kv", "old"]
        subprocess.run([sys.executable, "-c", code, str(path)], env=_env(), check=True)
        ar.refresh()
        assert sorted(ar.keys()) == ["kv", "new"] and "new" in ar and len(ar) == 2
        assert ar["new"][:].tolist() == [5, 6, 7, 8]
        assert len(ar["kv"]) == 15 and ar["kv"][14].tolist() == [1, 1, 1, 1]
        with pytest.raises(ArchiveClosedError):
            old[0]


@pytest.mark.parametrize("reported", [False, True], ids=["raw", "as-damage"])
def test_reader_retries_a_structure_read_while_a_writer_lives(tmp_path, monkeypatch, reported):
    """HDF5 errors on the file's structure are a writer's change in progress while a writer
    lives (the reader reopens and reads again), damage when none does; also when the layout
    has already reported the HDF5 error as damage (as ``layout.child`` does for a link it
    cannot check: seen with a writer creating streams)."""
    path = tmp_path / "a.h5"
    with fkvstore.open(path, "w") as ar:
        ar.create_stream("kv", 16).extend([1, 2, 3])
    real_child = fkvstore.layout.child
    failures = []

    def flaky_child(group, name):
        if name == "kv" and not failures:
            failures.append(name)
            exc = RuntimeError("incorrect metadata checksum after all read attempts")
            if reported:
                raise ArchiveFormatError(f"'/streams/kv' cannot be opened ({exc}): the file "
                                         "is damaged") from exc
            raise exc
        return real_child(group, name)

    monkeypatch.setattr(fkvstore.layout, "child", flaky_child)
    with fkvstore.open(path, "r") as ar:  # no writer: the error is damage
        with pytest.raises(ArchiveFormatError, match="metadata checksum"):
            ar["kv"]
    failures.clear()
    writer = subprocess.Popen([sys.executable, "-c", _HOLD_OPEN, str(path)], env=_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        with fkvstore.open(path, "r") as ar:
            assert ar["kv"][:].tolist() == [1, 2, 3] and failures == ["kv"]
    finally:
        writer.communicate("\n")
    assert writer.returncode == 0


def test_readers_beside_a_writer_creating_streams_see_no_false_damage(tmp_path):
    """A writer process creates (and deletes) streams in a loop; readers opened meanwhile list
    and read them. Before readers retried structure reads, some of them failed with HDF5's
    metadata-checksum errors or were told the file was damaged (timing-dependent)."""
    path = tmp_path / "a.h5"
    with fkvstore.open(path, "w") as ar:
        ar.create_stream("s0", 251).extend(np.arange(20) % 251)
    code = (
        "import sys, fkvstore\n"
        "print('ready', flush=True)\n"
        "for k in range(1, 120):\n"
        "    with fkvstore.open(sys.argv[1], 'a') as ar:\n"
        "        ar.create_stream(f's{k}', 251).extend([j % 251 for j in range(k, k + 20)])\n"
        "        if k % 10 == 0:\n"
        "            del ar[f's{k - 5}']\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], env=_env(),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    reads = locked = 0
    while proc.poll() is None or reads == 0:
        try:
            ar = fkvstore.open(path, "r")
        except ArchiveLockedError:  # opened mid-change: documented, "try again in a moment"
            locked += 1
            continue
        with ar:
            for name in ar.keys()[-3:]:
                k = int(name[1:])  # (created empty, then its rows in one commit)
                assert ar[name][:].tolist() in ([], [j % 251 for j in range(k, k + 20)])
        reads += 1
    assert proc.wait() == 0
    assert reads > 1
