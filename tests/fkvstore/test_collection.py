"""fkvstore.Collection: search over many archives, in-process and on a Dask LocalCluster of two
worker processes, against a brute-force oracle that reads every stream back with numpy."""

import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fkvstore
from fkvstore import Collection, Hit
from fkvstore.errors import (
    ArchiveClosedError,
    ArchiveNotFoundError,
    RemoteAuthError,
    StreamNotFoundError,
)


# ------------------------------------------------------------------------------------ helpers
def naive_hits(paths, query, streams=None, column=0):
    """Every occurrence of ``query`` by a full read of each stream: [(path, stream, ends)]."""
    out = []
    for path in paths:
        with fkvstore.open(path) as ar:
            for name in sorted(ar) if streams is None else streams:
                s = ar[name]
                if isinstance(query, (bytes, str)):
                    q = np.frombuffer(query.encode() if isinstance(query, str) else query,
                                      np.uint8).astype(np.int64)
                else:
                    q = np.asarray(query, np.int64)
                data = s.read()[:, column].astype(np.int64)
                if len(data) < len(q):
                    continue
                windows = np.lib.stride_tricks.sliding_window_view(data, len(q))
                ends = np.flatnonzero((windows == q).all(axis=1)) + len(q) - 1
                if len(ends):
                    out.append((path, name, ends))
    return out


def assert_hits_equal(hits, expected):
    assert [(h.archive, h.stream) for h in hits] == [(p, n) for p, n, _ in expected]
    for h, (_, _, ends) in zip(hits, expected, strict=True):
        assert isinstance(h, Hit)
        assert h.positions.dtype == np.int64
        np.testing.assert_array_equal(h.positions, ends)


def write_archives(folder, streams_per_archive):
    """``streams_per_archive``: per archive, ``{name: (alphabet, rows)}`` (alphabet None:
    a text stream of bytes ``rows``). Returns the paths."""
    paths = []
    for k, streams in enumerate(streams_per_archive):
        path = os.path.join(folder, f"session-{k:03d}.h5")
        with fkvstore.open(path, "w") as ar:
            for name, (alphabet, rows) in streams.items():
                if alphabet is None:
                    ar.create_text_stream(name).extend(rows)
                else:
                    rows = np.asarray(rows)
                    rows = rows[:, None] if rows.ndim == 1 else rows
                    ar.create_stream(name, alphabet_size=alphabet, width=rows.shape[1]).extend(rows)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def client():
    """Two single-threaded worker processes, shared by the module's Dask tests."""
    distributed = pytest.importorskip(
        "distributed", reason="dask distributed is not installed (pip install fkvstore[dask])")
    import logging

    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                       dashboard_address=None, silence_logs=logging.CRITICAL)
    with cluster, distributed.Client(cluster) as c:
        c.wait_for_workers(2)
        yield c


@pytest.fixture(params=["in-process", "dask"])
def mode(request):
    """Keyword arguments of Collection for each way of running it."""
    if request.param == "dask":
        return {"client": request.getfixturevalue("client")}
    return {}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Seven archives of token streams (one empty, one long, shared prefixes) and a text stream;
    the last archive has no "tok" stream."""
    rng = np.random.default_rng(7)
    prompt = [3, 1, 4, 1, 5]
    specs = []
    for k in range(6):
        n = [0, 50, 400, 1200, 90, 3000][k]
        tok = rng.integers(0, 6, n)
        tok[: min(5, n)] = prompt[: min(5, n)]
        wide = rng.integers(0, 3, (40 + k, 3))
        specs.append({"tok": (6, tok), "wide": (3, wide),
                      "txt": (None, b"the session %d said: hello hello world" % k)})
    specs.append({"txt": (None, b"hello from the odd one")})
    return write_archives(str(tmp_path_factory.mktemp("fleet")), specs)


# ------------------------------------------------------------------------------------ search
QUERIES = [[3, 1, 4, 1, 5], [1], [0, 0, 0], [5, 5, 5, 5, 5, 5, 5, 5], [2, 3, 2, 3, 2, 3, 2, 3, 2]]


def test_search_equals_a_sequential_scan(fleet, mode):
    token_archives = fleet[:-1]
    with Collection(token_archives, **mode) as coll:
        for q in QUERIES:
            assert_hits_equal(coll.search(np.array(q), stream="tok"),
                              naive_hits(token_archives, q, ["tok"]))
        many = coll.search_many([np.array(q) for q in QUERIES], stream="tok", batch=2)
        assert [[(h.archive, h.stream, h.positions.tolist()) for h in r] for r in many] == [
            [(h.archive, h.stream, h.positions.tolist()) for h in coll.search(q, "tok")]
            for q in QUERIES]
        # one column of a wide stream; and several streams at once
        assert_hits_equal(coll.search([2, 2], stream="wide", column=2),
                          naive_hits(token_archives, [2, 2], ["wide"], column=2))
        assert_hits_equal(coll.search([1, 2], stream=["wide", "tok"]),
                          naive_hits(token_archives, [1, 2], ["tok", "wide"]))
    with Collection(fleet, **mode) as coll:  # every stream: text queries reach text streams only
        assert_hits_equal(coll.search("hello", stream="txt"), naive_hits(fleet, "hello", ["txt"]))
        assert coll.search(b"absent", stream="txt") == []


@settings(max_examples=25)
@given(data=st.data())
def test_search_equals_brute_force_property(client, data):
    alphabet = data.draw(st.integers(2, 4), label="alphabet")
    streams = data.draw(st.lists(
        st.lists(st.integers(0, alphabet - 1), max_size=300), min_size=1, max_size=5),
        label="streams")
    queries = []
    for _ in range(4):
        source = data.draw(st.sampled_from(streams))
        if source and data.draw(st.booleans()):  # a slice of an archive: at least one hit
            a = data.draw(st.integers(0, len(source) - 1))
            b = data.draw(st.integers(a + 1, min(len(source), a + 20)))
            queries.append(source[a:b])
        else:
            queries.append(data.draw(st.lists(st.integers(0, alphabet - 1), min_size=1,
                                              max_size=8)))
    with tempfile.TemporaryDirectory() as folder:
        paths = write_archives(folder, [{"s": (alphabet, np.array(s, np.int64))}
                                        for s in streams])
        expected = [naive_hits(paths, q, ["s"]) for q in queries]
        for kwargs in ({}, {"client": client}):
            with Collection(paths, **kwargs) as coll:
                for q, want in zip(queries, expected, strict=True):
                    assert_hits_equal(coll.search(q, stream="s"), want)
                for got, want in zip(coll.search_many(queries, "s", batch=3), expected,
                                     strict=True):
                    assert_hits_equal(got, want)


def test_context_equals_the_slice_read_back(fleet, mode):
    with Collection(fleet[:-1], **mode) as coll:
        for stream, query in (("tok", [1, 5]), ("txt", "hello"), ("wide", [0, 1])):
            hits = coll.search(query, stream=stream, column=0)
            assert hits
            for h in hits[:3]:
                with fkvstore.open(h.archive) as ar:
                    s = ar[stream]
                    for p in (int(h.positions[0]), int(h.positions[-1])):
                        got = coll.context(h.archive, stream, p, before=4, after=3)
                        rows = s.read(max(0, p - 4), min(len(s), p + 4))
                        if stream == "txt":
                            assert got == bytes(rows[:, 0].astype(np.uint8))
                        elif stream == "wide":
                            np.testing.assert_array_equal(got, rows)
                        else:
                            np.testing.assert_array_equal(got, rows[:, 0])
        # an archive may also be named by its place in the collection
        np.testing.assert_array_equal(coll.context(5, "wide", 0, 0, 1, column=2),
                                      naive_read(fleet[5], "wide")[0:2, 2])


def naive_read(path, stream):
    with fkvstore.open(path) as ar:
        return ar[stream].read()


def test_warm_builds_every_index_once_per_worker(fleet, mode):
    with Collection(fleet[:-1], **mode) as coll:
        stats = coll.warm(stream="tok")
        assert len(stats) == (2 if mode else 1)
        assert sum(w["archives"] for w in stats) == len(fleet) - 1
        assert sorted(a["archive"] for w in stats for a in w["per_archive"]) == list(range(6))
        assert all(w["index_bytes"] > 0 for w in stats)
        if mode:
            assert len({w["pid"] for w in stats}) == 2  # two processes, archives split
            assert [w["archives"] for w in stats] == [3, 3]
        again = coll.warm(stream="tok")
        assert [w["index_bytes"] for w in again] == [w["index_bytes"] for w in stats]


def test_close_closes_the_archives_the_workers_hold(fleet, client):
    from fkvstore import collection as module

    coll = Collection(fleet[:3], client=client)
    with coll:
        coll.search([1], stream="tok")
        assert client.run(lambda cid: cid in module._SHARDS, coll._id) == {
            w: True for w in client.scheduler_info()["workers"]}
    assert set(client.run(lambda cid: cid in module._SHARDS, coll._id).values()) == {False}
    with pytest.raises(ArchiveClosedError, match="closed"):
        coll.search([1], stream="tok")
    coll.close()  # idempotent
    # the files are no longer held: a writer can open them
    with fkvstore.open(fleet[0], "r+") as ar:
        assert "tok" in ar


def test_own_local_cluster(fleet):
    pytest.importorskip("distributed", reason="dask distributed is not installed")
    with Collection(fleet[:2], workers=1) as coll:
        assert coll.client is not None
        assert_hits_equal(coll.search([1], "tok"), naive_hits(fleet[:2], [1], ["tok"]))
        client = coll.client
    assert client.status == "closed"


def test_a_worker_that_leaves_is_replaced(fleet, client):
    """Tasks pinned to a worker that left are submitted again to the new workers."""
    with Collection(fleet[:-1], client=client) as coll:
        want = [(h.archive, h.positions.tolist()) for h in coll.search([1, 5], "tok")]
        client.restart()  # new worker processes at new addresses
        assert [(h.archive, h.positions.tolist()) for h in coll.search([1, 5], "tok")] == want


# ------------------------------------------------------------------------------------ errors
def test_missing_archives_are_named_before_any_work(fleet, tmp_path):
    missing = str(tmp_path / "gone.h5")
    with pytest.raises(ArchiveNotFoundError, match="gone.h5") as info:
        Collection([*fleet, missing], client=object())  # the client is never touched
    assert isinstance(info.value, FileNotFoundError)
    many = [str(tmp_path / f"x{k}.h5") for k in range(5)]
    with pytest.raises(FileNotFoundError, match=r"x0\.h5.*x2\.h5.* and 2 more"):
        Collection(many)


def test_bad_collections_are_refused(fleet):
    with pytest.raises(ValueError, match="at least one"):
        Collection([])
    with pytest.raises(ValueError, match="given twice"):
        Collection([fleet[0], fleet[1], os.path.relpath(fleet[0])])
    with pytest.raises(TypeError, match="list of paths"):
        Collection(fleet[0])
    with pytest.raises(TypeError, match="path or URL"):
        Collection([fleet[0], 3])
    with pytest.raises(ValueError, match="nosuchproto"):  # fsspec knows no such protocol
        Collection(["nosuchproto://bucket/session-000.h5"])
    with pytest.raises(TypeError, match="storage_options must be a dict or None, got str"):
        Collection(fleet, storage_options="key=secret")
    with pytest.raises(ValueError, match="not both"):
        Collection(fleet, client=object(), workers=2)
    with pytest.raises(ValueError, match="workers must be a positive int, got 0"):
        Collection(fleet, workers=0)


def test_a_folder_is_no_archive(tmp_path):
    with pytest.raises(ArchiveNotFoundError, match="no archive at"):
        Collection([str(tmp_path)])


def test_a_repeated_stream_name_counts_once(fleet, mode):
    def flat(hits):
        return [(h.archive, h.stream, list(h.positions)) for h in hits]

    with Collection(fleet[:2], **mode) as coll:
        once = flat(coll.search([3, 1, 4], stream="tok"))
        assert once and flat(coll.search([3, 1, 4], stream=["tok", "tok"])) == once
        assert (sum(w["index_bytes"] for w in coll.warm(["tok", "tok"]))
                == sum(w["index_bytes"] for w in coll.warm("tok")) > 0)


def test_file_urls_are_local_paths(fleet):
    url = "file://" + os.path.abspath(fleet[1])
    with Collection([url, fleet[2]]) as coll:
        hits = coll.search([3, 1, 4], stream="tok")
        assert [h.archive for h in hits] == [url, fleet[2]]
        assert coll.context(url, "tok", 2, 2, 0).tolist() == [3, 1, 4]


def test_bad_queries_name_the_archive_and_stream(fleet, mode):
    with Collection(fleet, **mode) as coll:
        with pytest.raises(StreamNotFoundError, match=r"no stream 'tok' in .*session-006\.h5"):
            coll.search([1], stream="tok")  # the odd archive has none
        assert coll.search([1], stream="txt") == []  # still usable after an error
    with Collection(fleet[:-1], **mode) as coll:
        with pytest.raises(ValueError, match=r"session-000\.h5.*stream 'tok'.*alphabet"):
            coll.search([1, 9], stream="tok")
        with pytest.raises(ValueError, match="query is empty"):
            coll.search(b"", stream="txt")
        with pytest.raises(ValueError, match="non-empty 1-D"):
            coll.search(np.zeros((2, 2), int), stream="tok")
        with pytest.raises(ValueError, match="column must be a non-negative int, got -1"):
            coll.search([1], stream="tok", column=-1)
        with pytest.raises(ValueError, match=r"session-000\.h5.*column"):
            coll.search([1], stream="tok", column=1)
        with pytest.raises(TypeError, match="stream names must be str"):
            coll.search([1], stream=[b"tok"])
        for bad in (5, b"tok"):
            with pytest.raises(TypeError, match="stream must be a name"):
                coll.search([1], stream=bad)
        with pytest.raises(ValueError, match="batch must be a positive int"):
            coll.search_many([[1]], stream="tok", batch=0)
        with pytest.raises(ValueError, match="'nowhere.h5' is not in this collection"):
            coll.context("nowhere.h5", "tok", 0)
        with pytest.raises(ValueError, match="archive 6 is outside 0..5"):
            coll.context(6, "tok", 0)
        with pytest.raises(ValueError, match=r"session-001\.h5.*stream 'tok'.*pos must be <= 49"):
            coll.context(fleet[1], "tok", 10_000)
        with pytest.raises(StreamNotFoundError, match="no stream 'nope'"):
            coll.context(fleet[1], "nope", 0)


def test_import_fkvstore_does_not_import_dask():
    code = ("import sys, fkvstore; fkvstore.Collection; "
            "bad = [m for m in ('dask', 'distributed') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


# ------------------------------------------------------------------------- remote archives (S3)
@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on 127.0.0.1, IAM authentication on (tests/support/s3_server.py);
    skipped without the remote/test extras, a failure instead under FKV_REQUIRE_REMOTE=1."""
    from s3_server import S3Server, skip_unless_installed

    skip_unless_installed()
    server = S3Server(auth=True).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def published(s3, fleet):
    """The token archives of the fleet published to the server: ``(urls, local paths)``."""
    urls = []
    for path in fleet[:-1]:
        url = s3.url("fleet/" + os.path.basename(path))
        fkvstore.copy(path, url, storage_options=s3.storage_options)
        urls.append(url)
    return urls, fleet[:-1]


def as_urls(expected, urls, paths):
    where = dict(zip(paths, urls, strict=True))
    return [(where[p], name, ends) for p, name, ends in expected]


def test_remote_search_equals_a_sequential_scan(s3, published, mode):
    urls, paths = published
    with Collection(urls, storage_options=s3.storage_options, **mode) as coll:
        assert "secret" not in repr(coll) and s3.storage_options["secret"] not in repr(coll)
        coll.warm(stream="tok")
        with s3.counting() as warm:  # warm: the indexes and blocks are held, nothing is fetched
            for q in QUERIES:
                assert_hits_equal(coll.search(np.array(q), stream="tok"),
                                  as_urls(naive_hits(paths, q, ["tok"]), urls, paths))
            many = coll.search_many([np.array(q) for q in QUERIES], stream="tok", batch=2)
        assert warm.n == 0, warm.requests
        assert [[(h.archive, h.positions.tolist()) for h in r] for r in many] == [
            [(h.archive, h.positions.tolist()) for h in coll.search(q, "tok")] for q in QUERIES]
        assert_hits_equal(coll.search([1, 2], stream=["wide", "tok"]),
                          as_urls(naive_hits(paths, [1, 2], ["tok", "wide"]), urls, paths))
        hit = coll.search([3, 1, 4], stream="tok")[0]
        assert coll.context(hit.archive, "tok", int(hit.positions[0]), 2, 0).tolist() == [3, 1, 4]


def test_local_and_remote_archives_mix(s3, published, client):
    urls, paths = published
    mixed = [paths[0], urls[1], "file://" + os.path.abspath(paths[2])]
    with Collection(mixed, storage_options=s3.storage_options, client=client) as coll:
        want = naive_hits(paths[:3], [1, 5], ["tok"])
        assert_hits_equal(coll.search([1, 5], stream="tok"),
                          [(mixed[paths.index(p)], n, e) for p, n, e in want])


def test_a_missing_remote_archive_is_named_up_front(s3, published):
    urls, _ = published
    gone = s3.url("fleet/gone.h5")
    with s3.counting() as checks, pytest.raises(ArchiveNotFoundError, match="gone.h5") as info:
        Collection([*urls, gone], storage_options=s3.storage_options, client=object())
    assert isinstance(info.value, FileNotFoundError)
    # one listing of the folder, then only the archive it did not list is asked about (s3fs:
    # a HEAD, and a listing of the key as a prefix)
    methods = [r.method for r in checks.requests]
    assert methods[0] == "GET" and "list-type" in checks.requests[0].query, checks.requests
    assert methods.count("HEAD") == 1 and checks.n <= 3, checks.requests
    with pytest.raises(ArchiveNotFoundError, match="no-such-bucket"):
        Collection(["s3://no-such-bucket/a.h5", "s3://no-such-bucket/b.h5"],
                   storage_options=s3.storage_options)


def test_wrong_credentials_are_named_and_not_shown(s3, published):
    urls, _ = published
    with pytest.raises(RemoteAuthError, match="credentials") as info:
        Collection(urls, storage_options=s3.bad_options)
    assert urls[0] in str(info.value)
    assert isinstance(info.value, PermissionError)
    assert s3.bad_options["secret"] not in str(info.value)
    from fkvstore.collection import _Hidden

    assert repr(_Hidden(s3.storage_options)) == "<storage options hidden>"
