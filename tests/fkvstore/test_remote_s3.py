"""Remote archives against a real S3 API: moto's server, started here on 127.0.0.1 with IAM
authentication on, every request counted at the server (tests/support/s3_server.py).

Skipped with the reason when the ``remote``/``test`` extras are missing, a failure instead with
``FKV_REQUIRE_REMOTE=1`` (set by ``make test`` and CI).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from s3_server import S3Server, skip_unless_installed

skip_unless_installed()

import fsspec  # noqa: E402

import fkvstore  # noqa: E402
from fkvstore.errors import (  # noqa: E402
    ArchiveExistsError,
    ArchiveFormatError,
    ArchiveNotFoundError,
    ChecksumError,
    RemoteAuthError,
    RemoteModeError,
    RemoteObjectChangedError,
)

BLOCK = 4096  # small blocks, so that the test archive spans many of them
QUERIES = [b"loss 0.5", b"step 7", b"0.001\n", b"not in the log"]


def make_archive(path, seed=0):
    """A symbol stream in 2 KiB chunks (about 50 of them), a text stream with a persisted
    search index, an array, attributes; returns the symbol rows."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (20000, 4))
    with fkvstore.open(path, "w") as ar:
        ar.create_stream("kv", 256, width=4, chunk_bytes=2048).extend(data)
        log = ar.create_text_stream("log", chunk_bytes=4096)
        log.extend(b"".join(b"step %d loss %.3f\n" % (i, 1 / (i + 1)) for i in range(3000)))
        log.build_index(persist=True)
        ar.put_array("codebooks", rng.random((4, 16, 8)).astype(np.float32))
        ar.attrs["model"] = "gpt2"
    return data


@pytest.fixture(scope="module")
def s3():
    server = S3Server(auth=True).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def published(s3, tmp_path_factory):
    """``(url, local path, rows)`` of an archive published once for the module."""
    path = tmp_path_factory.mktemp("s3") / "run.h5"
    data = make_archive(path)
    url = s3.url("run.h5")
    fkvstore.copy(path, url, storage_options=s3.storage_options)
    return url, path, data


def open_remote(s3, url, **kw):
    kw.setdefault("block_bytes", BLOCK)
    return fkvstore.open(url, storage_options=s3.storage_options, **kw)


def test_round_trip(s3, published, tmp_path):
    url, path, data = published
    with open_remote(s3, url) as ar, fkvstore.open(path) as local:
        assert sorted(ar) == sorted(local)
        np.testing.assert_array_equal(ar["kv"][:], data)
        assert ar["log"].bytes() == local["log"].bytes()
        np.testing.assert_array_equal(ar.get_array("codebooks"), local.get_array("codebooks"))
        assert dict(ar.attrs) == {"model": "gpt2"}
        assert not any(ar.verify().values())
    back = tmp_path / "back.h5"  # and down again: an ordinary, appendable archive
    fkvstore.copy(url, back, storage_options=s3.storage_options)
    with fkvstore.open(back, "a") as ar:
        np.testing.assert_array_equal(ar["kv"][:], data)
        ar["kv"].extend(data[:3])
        assert len(ar["kv"]) == len(data) + 3


def test_request_counts_at_the_server(s3, published):
    """open: a HEAD and at most two GETs; opening streams and arrays: nothing more; a random
    row: one GET per uncached chunk, at most 3 requests; a cached row: none."""
    url, _, data = published
    with s3.counting() as opened:
        ar = open_remote(s3, url)
    with ar:
        assert [r.method for r in opened.requests].count("HEAD") == 1
        assert opened.gets <= 2 and opened.n <= 3, opened.requests
        with s3.counting() as streams:
            kv = ar["kv"]
            ar["log"]
            ar.get_array("codebooks")
        assert streams.n == 0, streams.requests
        rows = np.random.default_rng(5).integers(0, len(data), 30).tolist()
        misses = 0
        for i in rows:
            with s3.counting() as one:
                np.testing.assert_array_equal(kv[i], data[i])
            assert one.n <= 1 and all(r.method == "GET" and r.status == 206
                                      for r in one.requests), one.requests
            misses += one.n
        assert misses >= 10  # most of them were cold
        with s3.counting() as warm:
            for i in rows:
                kv[i]
        assert warm.n == 0


def test_random_reads_without_the_block_cache(s3, published):
    url, _, data = published
    with open_remote(s3, url, block_cache_bytes=0) as ar:
        kv = ar["kv"]
        idx = np.random.default_rng(6).integers(0, len(data), 20)
        np.testing.assert_array_equal(kv[idx], data[idx])
        np.testing.assert_array_equal(kv[-5:], data[-5:])


def test_search_returns_exactly_the_local_result(s3, published):
    url, path, _ = published
    with open_remote(s3, url) as ar, fkvstore.open(path) as local:
        for q in QUERIES:
            np.testing.assert_array_equal(ar["log"].search(q), local["log"].search(q))
        got = ar["log"].longest_suffix(b"loss 0.25", k=3)
        want = local["log"].longest_suffix(b"loss 0.25", k=3)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
        hit = int(local["log"].search(b"step 7")[0])
        assert ar["log"].context(hit, 20, 20) == local["log"].context(hit, 20, 20)
        np.testing.assert_array_equal(ar["kv"].search([5, 17], column=2),
                                      local["kv"].search([5, 17], column=2))


def put_bytes(s3, key, blob):
    fs = fsspec.filesystem("s3", **s3.storage_options)
    fs.pipe_file(f"{s3.bucket}/{key}", blob)
    return s3.url(key)


def test_a_damaged_object_raises_named_errors(s3, published, tmp_path):
    url, _, _ = published
    with fsspec.open(url, "rb", **s3.storage_options) as f:
        blob = bytearray(f.read())
    pub = tmp_path / "pub.h5"
    pub.write_bytes(blob)
    import h5py

    with h5py.File(pub, "r") as f:
        chunk = f["streams/kv/points"].id.get_chunk_info(20)
        B = int(f["streams/kv"].attrs["fkv_block_spans"])
        span = int(f["streams/kv"].attrs["fkv_span"])
    blob[chunk.byte_offset + 64 : chunk.byte_offset + 72] = b"\x7f" * 8
    damaged = put_bytes(s3, "damaged.h5", bytes(blob))
    with open_remote(s3, damaged) as ar:
        with pytest.raises(ChecksumError, match="chunk 20"):
            ar["kv"][20 * B * span]
        assert ar["kv"][0] is not None  # the rest reads
        assert ar.verify()["kv"]
    with pytest.raises(ArchiveFormatError):  # cut short: the metadata is there, the data not
        with open_remote(s3, put_bytes(s3, "short.h5", bytes(blob[: len(blob) // 3]))) as ar:
            ar["kv"][:]
    with pytest.raises(ArchiveFormatError, match="not a readable HDF5"):
        open_remote(s3, put_bytes(s3, "noise.h5", b"not an archive" * 100))


def test_a_missing_key_or_bucket(s3):
    for url in (s3.url("missing.h5"), "s3://no-such-bucket/run.h5"):
        with pytest.raises(ArchiveNotFoundError, match=url) as err:
            open_remote(s3, url)
        assert isinstance(err.value, FileNotFoundError)


def test_wrong_credentials_are_refused_and_nothing_is_written(s3, published):
    url, path, _ = published
    with pytest.raises(RemoteAuthError, match="credentials") as err:
        fkvstore.open(url, storage_options=s3.bad_options)
    assert isinstance(err.value, PermissionError)
    target = s3.url("never.h5")
    leftovers = set(Path(tempfile.gettempdir()).glob(".fkv-publish-*"))
    with pytest.raises(RemoteAuthError):
        fkvstore.copy(path, target, storage_options=s3.bad_options)
    assert not fsspec.filesystem("s3", **s3.storage_options).exists(target)
    assert set(Path(tempfile.gettempdir()).glob(".fkv-publish-*")) == leftovers


@pytest.mark.parametrize("mode", ["r+", "a", "w", "x"])
def test_modes_other_than_read_are_refused_without_a_request(s3, published, mode):
    url, _, _ = published
    with s3.counting() as counts, pytest.raises(RemoteModeError, match=f"mode '{mode}'"):
        fkvstore.open(url, mode, storage_options=s3.storage_options)
    assert counts.n == 0


def test_an_overwritten_object_is_detected(s3, published, tmp_path):
    _, path, data = published
    url = s3.url("overwritten.h5")
    fkvstore.copy(path, url, storage_options=s3.storage_options)
    with pytest.raises(ArchiveExistsError):
        fkvstore.copy(path, url, storage_options=s3.storage_options)
    with open_remote(s3, url, block_cache_bytes=4 * BLOCK) as ar:
        kv = ar["kv"]
        first = kv[0]
        other = tmp_path / "other.h5"
        make_archive(other, seed=1)
        fkvstore.copy(other, url, storage_options=s3.storage_options, overwrite=True)
        np.testing.assert_array_equal(kv[0], first)  # cached: still the version it opened
        with pytest.raises(RemoteObjectChangedError, match="overwritten") as err:
            kv[len(data) // 2]  # needs bytes of the old object: refused, never mixed in
        assert isinstance(err.value, OSError)
    with open_remote(s3, url) as ar:  # opened again: the new object
        np.testing.assert_array_equal(ar["kv"][:5], make_archive(tmp_path / "x.h5", seed=1)[:5])


def test_a_version_aware_reader_keeps_the_version_it_opened(s3, published, tmp_path):
    import boto3

    _, path, data = published
    opts = s3.storage_options
    client = boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1",
                          aws_access_key_id=opts["key"], aws_secret_access_key=opts["secret"])
    client.create_bucket(Bucket="fkv-versioned")
    client.put_bucket_versioning(Bucket="fkv-versioned",
                                 VersioningConfiguration={"Status": "Enabled"})
    url = "s3://fkv-versioned/run.h5"
    fkvstore.copy(path, url, storage_options=opts)
    other = tmp_path / "other.h5"
    new = make_archive(other, seed=1)
    versioned = dict(opts, version_aware=True)
    with fkvstore.open(url, storage_options=versioned, block_bytes=BLOCK,
                       block_cache_bytes=4 * BLOCK) as ar:
        kv = ar["kv"]
        kv[0]
        fkvstore.copy(other, url, storage_options=opts, overwrite=True)
        np.testing.assert_array_equal(kv[:], data)  # all of it from the version it opened
    with fkvstore.open(url, storage_options=versioned) as ar:
        np.testing.assert_array_equal(ar["kv"][:], new)
