"""Remote archives without a server: the block-cached file object, the publish layout and the
URL rules, on fsspec's in-memory and local filesystems (tests/fkvstore/test_remote_s3.py runs
the same archive against a real S3 API)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import h5py
import numpy as np
import pytest
from h5reader import read_stream_with_h5py
from s3_server import skip_unless_installed

skip_unless_installed(("fsspec",))

import fsspec  # noqa: E402

import fkvstore  # noqa: E402
from fkvstore import layout  # noqa: E402
from fkvstore.errors import (  # noqa: E402
    ArchiveExistsError,
    ArchiveNotFoundError,
    ChecksumError,
    RemoteModeError,
)


def make_archive(path, rows=20000, width=4, seed=0):
    """An archive with a symbol stream of many small chunks (2 KiB), a text stream with a
    persisted search index, an array and attributes; returns the symbol rows."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, width))
    with fkvstore.open(path, "w") as ar:
        ar.create_stream("kv", 256, width=width, chunk_bytes=2048).extend(data)
        text = ar.create_text_stream("log", chunk_bytes=4096)
        text.extend(b"".join(b"step %d loss %.3f\n" % (i, 1 / (i + 1)) for i in range(3000)))
        text.build_index(persist=True)
        ar.put_array("codebooks", rng.random((4, 16, 8)).astype(np.float32))
        ar.attrs["model"] = "gpt2"
        ar["kv"].attrs["layer"] = 3
    return data


@pytest.fixture(scope="module")
def local_archive(tmp_path_factory):
    path = tmp_path_factory.mktemp("remote") / "run.h5"
    return path, make_archive(path)


@pytest.fixture
def memory_url():
    url = f"memory://fkv-test-{uuid.uuid4().hex}/run.h5"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url)


def test_urls_and_paths_are_told_apart():
    from fkvstore._remote import is_url

    assert is_url("s3://bucket/run.h5") and is_url("memory://x/run.h5")
    assert is_url("simplecache::s3://bucket/run.h5")
    assert not is_url("run.h5") and not is_url("/data/run.h5") and not is_url("./s3:/x")
    assert is_url("blockcache::simplecache::s3://bucket/run.h5")
    assert not is_url("run::v2.h5") and not is_url("./run::v2.h5")  # a local name with ::


def test_a_copy_to_a_missing_folder_or_onto_a_folder_names_the_destination(local_archive,
                                                                           tmp_path):
    path, _ = local_archive
    with pytest.raises(FileNotFoundError, match=r"nodir/x\.h5.*does not exist"):
        fkvstore.copy(path, tmp_path / "nodir" / "x.h5")
    (tmp_path / "folder.h5").mkdir()
    with pytest.raises(IsADirectoryError, match=r"folder\.h5.*is a folder"):
        fkvstore.copy(path, tmp_path / "folder.h5", overwrite=True)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".fkv-publish")]


def test_a_local_name_with_a_double_colon_is_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with fkvstore.open("run::v2.h5", "w") as ar:
        ar.create_stream("kv", 16).extend([1, 2, 3])
    with fkvstore.open("run::v2.h5") as ar:
        assert ar["kv"][:, 0].tolist() == [1, 2, 3]


def test_a_caching_chain_opens(local_archive, memory_url):
    path, data = local_archive
    fkvstore.copy(path, memory_url)
    with fkvstore.open("simplecache::" + memory_url) as ar:  # a local file behind the chain
        np.testing.assert_array_equal(ar["kv"][:], data)


@pytest.mark.parametrize("mode", ["r+", "a", "w", "w-", "x"])
def test_a_url_opens_read_only(mode):
    url = "memory://fkv-nowhere/run.h5"
    with pytest.raises(RemoteModeError, match=f"'{mode}'") as err:
        fkvstore.open(url, mode)
    assert isinstance(err.value, ValueError) and url in str(err.value)
    assert not fsspec.filesystem("memory").exists(url)  # nothing was created


def test_publish_to_memory_round_trip(local_archive, memory_url):
    path, data = local_archive
    fkvstore.copy(path, memory_url)
    with fkvstore.open(memory_url) as ar, fkvstore.open(path) as local:
        assert ar.path == memory_url and not ar.writable
        assert sorted(ar) == sorted(local) and ar.array_names() == local.array_names()
        np.testing.assert_array_equal(ar["kv"][:], data)
        assert ar["log"].bytes() == local["log"].bytes()
        np.testing.assert_array_equal(ar.get_array("codebooks"), local.get_array("codebooks"))
        assert ar.attrs["model"] == "gpt2" and ar["kv"].attrs["layer"] == 3
        assert ar["log"].search("loss 0.5").tolist() == local["log"].search("loss 0.5").tolist()
        assert not any(ar.verify().values())
        ar.refresh()  # a published object does not change: a no-op, not an error
        with pytest.raises(fkvstore.errors.ArchiveReadOnlyError, match="from a URL is read-only"):
            ar["kv"].append([1, 2, 3, 4])


def test_publish_lays_metadata_out_first(local_archive, tmp_path):
    """After the open's prefetch of the head, opening every stream and reading every array and
    attribute costs no request; a row costs one request per uncached chunk."""
    path, data = local_archive
    pub = tmp_path / "pub.h5"
    fkvstore.copy(path, pub)
    with h5py.File(pub, "r") as f:
        head = int(f.attrs[layout.REMOTE_HEAD_ATTR])
        points = f["streams/kv/points"].id
        chunks = [points.get_chunk_info(k) for k in range(points.get_num_chunks())]
    assert 0 < head <= chunks[0].byte_offset < os.path.getsize(pub)
    np.testing.assert_array_equal(read_stream_with_h5py(pub, "kv"), data)  # plain HDF5 reads it

    url = f"file://{pub}"
    with fkvstore.open(url, block_bytes=2048, block_cache_bytes=1 << 20) as ar:
        remote = ar._session.remote
        opened = remote.requests
        assert opened <= 2  # the first block, then the rest of the head
        kv, log = ar["kv"], ar["log"]
        ar.get_array("codebooks")
        dict(ar.attrs), dict(kv.attrs), log.aux_array_names()
        assert remote.requests == opened
        misses = 0
        for i in np.random.default_rng(1).integers(0, len(kv), 40).tolist():
            chunk = chunks[(i // kv.span) // kv.block_spans]
            end = chunk.byte_offset + chunk.size - 1
            blocks = range(chunk.byte_offset // 2048, end // 2048 + 1)
            uncached = any(remote._cached(k) is None for k in blocks)
            before = remote.requests
            np.testing.assert_array_equal(kv[i], data[i])
            assert remote.requests - before == uncached  # one request per uncached chunk
            misses += uncached
        assert misses >= 10


def test_the_block_cache_reads_exact_bytes(tmp_path):
    from fkvstore._remote import RemoteObject

    blob = np.random.default_rng(2).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    (tmp_path / "blob").write_bytes(blob)
    url = f"file://{tmp_path / 'blob'}"
    rng = np.random.default_rng(3)
    for cache in (0, 5 * 4096, 1 << 20):
        obj = RemoteObject(url, block_bytes=4096, cache_bytes=cache)
        for _ in range(300):
            start = int(rng.integers(0, len(blob) + 10))
            n = int(rng.integers(0, 20_000))
            before = obj.requests
            obj.seek(start)
            assert obj.read(n) == blob[start : start + n]
            assert obj.requests - before <= 1  # a read is at most one request
        obj.close()
    obj = RemoteObject(url, block_bytes=4096, cache_bytes=1000)  # under a block: still one
    for _ in range(3):
        obj.seek(100)
        obj.read(10)
    assert obj.requests == 1
    obj = RemoteObject(url, block_bytes=4096, cache_bytes=0)
    obj.seek(100)
    obj.read(10)
    assert (obj.requests, obj.bytes_fetched) == (1, 10)  # no cache: exactly the bytes asked
    obj = RemoteObject(url, block_bytes=4096, cache_bytes=64 << 20)
    while obj.read(4096):  # a sequential scan reads further ahead each time
        pass
    assert obj.bytes_fetched == len(blob) and obj.requests <= 8


def test_publish_a_local_copy_stays_an_ordinary_archive(local_archive, tmp_path):
    path, data = local_archive
    before = path.read_bytes()
    dst = tmp_path / "copy.h5"
    fkvstore.copy(path, dst)
    assert path.read_bytes() == before  # the source is only read
    with pytest.raises(ArchiveExistsError):
        fkvstore.copy(path, dst)
    with fkvstore.open(dst, "a") as ar:  # appendable like any archive
        ar["kv"].extend(data[:5])
    with fkvstore.open(dst) as ar:
        np.testing.assert_array_equal(ar["kv"][:], np.concatenate([data, data[:5]]))
    with fkvstore.open(path) as ar, pytest.raises(ValueError, match="onto itself"):
        ar.publish(path, overwrite=True)


def test_publish_onto_its_own_file_by_another_name_is_refused(tmp_path):
    # a replaced file would leave an open writer committing to a deleted inode
    (tmp_path / "d").mkdir()
    os.symlink(tmp_path / "d", tmp_path / "link")
    path = tmp_path / "d" / "w.h5"
    with fkvstore.open(path, "w") as ar:
        s = ar.create_stream("kv", 16)
        s.extend(range(10))
        ar.flush()
        for alias in (tmp_path / "link" / "w.h5", "file://" + str(path), tmp_path / "d/./w.h5"):
            with pytest.raises(ValueError, match="onto itself"):
                ar.publish(alias, overwrite=True)
        s.extend(range(10))
    with fkvstore.open(path) as ar:
        assert len(ar["kv"]) == 20  # every commit reached the file the name still names
    with fkvstore.open(path) as ar:  # a file:// destination is a local path (atomic rename)
        ar.publish("file://" + str(tmp_path / "copy.h5"))
    with fkvstore.open(tmp_path / "copy.h5") as ar:
        assert len(ar["kv"]) == 20


def test_publish_from_a_writer_commits_first(tmp_path, memory_url):
    with fkvstore.open(tmp_path / "w.h5", "w") as ar:
        s = ar.create_stream("s", 16)
        s.extend([1, 2, 3])
        ar.flush()
        s.extend([4, 5])  # buffered
        ar.publish(memory_url)
    with fkvstore.open(memory_url) as ar:
        assert ar["s"][:, 0].tolist() == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("mode", ["a", "r+"])
def test_publish_from_a_reopened_writer(tmp_path, memory_url, mode):
    # a file reopened for writing is in SWMR mode, where HDF5's object copy fails
    path = tmp_path / "w.h5"
    with fkvstore.open(path, "w") as ar:
        ar.create_stream("s", 16).extend(np.arange(3000) % 16)
        ar.put_array("table", np.arange(12.0).reshape(3, 4))
    with fkvstore.open(path, mode) as ar:
        ar["s"].extend([5, 6])  # buffered
        ar.publish(memory_url)
        ar["s"].extend([7])  # the writer goes on after publishing
    with fkvstore.open(memory_url) as ar:
        assert ar["s"][:, 0].tolist() == (np.arange(3000) % 16).tolist() + [5, 6]
        assert ar.get_array("table").tolist() == np.arange(12.0).reshape(3, 4).tolist()
    with fkvstore.open(path) as ar:
        assert ar["s"][-3:, 0].tolist() == [5, 6, 7]


def test_a_damaged_source_is_not_published(local_archive, tmp_path, memory_url):
    path, _ = local_archive
    bad = tmp_path / "bad.h5"
    bad.write_bytes(path.read_bytes())
    with h5py.File(bad, "r") as f:
        offset = f["streams/kv/points"].id.get_chunk_info(3).byte_offset
    with open(bad, "r+b") as fh:
        fh.seek(offset + 100)
        fh.write(b"\xff" * 8)
    with pytest.raises(ChecksumError, match="nothing was published"):
        fkvstore.copy(bad, memory_url)
    assert not fsspec.filesystem("memory").exists(memory_url)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".fkv-publish-")]


def test_a_missing_object(memory_url):
    with pytest.raises(ArchiveNotFoundError, match="memory://") as err:
        fkvstore.open(memory_url)
    assert isinstance(err.value, FileNotFoundError)


def test_an_unclosed_remote_archive_does_not_crash_the_interpreter(local_archive):
    path, _ = local_archive
    code = ("import fkvstore, sys; ar = fkvstore.open(sys.argv[1]); ar['kv'][5]; "
            "print('read')")
    done = subprocess.run([sys.executable, "-c", code, f"file://{path}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "read" in done.stdout, done.stderr


def test_missing_extras_skip_or_fail_as_asked(monkeypatch):
    monkeypatch.delenv("FKV_REQUIRE_REMOTE", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no_such_package_fkv"):
        skip_unless_installed(("no_such_package_fkv",))
    monkeypatch.setenv("FKV_REQUIRE_REMOTE", "1")
    with pytest.raises(pytest.fail.Exception, match="forbids skipping"):
        skip_unless_installed(("no_such_package_fkv",))
    skip_unless_installed(("fsspec",))  # present: neither


def test_metadata_beyond_the_first_estimate_is_retried_into_the_head(tmp_path, monkeypatch):
    from fkvstore import _repack

    path = tmp_path / "attrs.h5"
    make_archive(path)
    with fkvstore.open(path, "a") as ar:  # 80 KB of attributes: far past the size estimate
        for k in range(20):
            ar.attrs[f"blob{k}"] = np.arange(500, dtype=np.int64)
    attempts = []  # (head, spilled) of each write
    real = _repack._write

    def write(*args):
        attempts.append(real(*args))
        return attempts[-1]

    monkeypatch.setattr(_repack, "_write", write)
    fkvstore.copy(path, tmp_path / "pub.h5")
    assert len(attempts) >= 2 and attempts[0][1] and not attempts[-1][1]  # spilled, then not
    with fkvstore.open(f"file://{tmp_path / 'pub.h5'}", block_bytes=2048) as ar:
        opened = ar._session.remote.requests
        assert len(dict(ar.attrs)) == 21 and ar["kv"].attrs["layer"] == 3
        ar["log"].aux_array_names()
        assert ar._session.remote.requests == opened
