"""Search on archive streams: against brute force, across appends, truncation, reopening."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fkvstore
import naive
from fkvstore.errors import ArchiveClosedError


@pytest.mark.parametrize("geometry", ["grid", "ring"])
@given(ops=st.lists(st.tuples(st.sampled_from(["extend", "truncate", "search", "flush",
                                               "persist", "reopen"]),
                              st.integers(0, 2**32 - 1)), min_size=1, max_size=12))
def test_search_tracks_appends_and_truncation(tmp_path_factory, geometry, ops):
    path = tmp_path_factory.mktemp("s") / "a.h5"
    model: list[int] = []
    ar = fkvstore.open(path, "w")
    try:
        s = ar.create_stream("s", alphabet_size=5, geometry=geometry)
        for op, seed in ops:
            rng = np.random.default_rng(seed)
            if op == "extend":
                rows = rng.integers(0, 3, int(rng.integers(1, 300)))
                s.extend(rows)
                model.extend(rows.tolist())
            elif op == "truncate":
                n = int(rng.integers(0, len(model) + 1))
                s.truncate(n)
                del model[n:]
            elif op == "flush":
                s.flush() if hasattr(s, "flush") else ar.flush()
            elif op == "persist":
                s.build_index(persist=True)
            elif op == "reopen":
                ar.close()
                ar = fkvstore.open(path, "a")
                s = ar["s"]
            q = rng.integers(0, 3, int(rng.integers(1, 6))).tolist()
            assert s.search(q).tolist() == naive.find_all(model, q)
        if model:
            p, n = s.longest_suffix([4, 0, 1, 2], 3)
            assert list(zip(p.tolist(), n.tolist(), strict=True)) == \
                naive.longest_suffix(model, [4, 0, 1, 2], 3)
    finally:
        ar.close()


def test_text_stream_search_context_and_persisted_index(tmp_path):
    from fkvstore.demo import load_book

    book = load_book()[:60_000]
    path = tmp_path / "book.h5"
    with fkvstore.open(path, "w") as ar:
        s = ar.create_text_stream("book")
        s.extend(book)
        hits = s.search("Time Traveller")
        expect = [i + len("Time Traveller") - 1 for i in naive.find_bytes(book, b"Time Traveller")]
        assert hits.tolist() == expect and len(expect) > 5
        pos = int(hits[0])
        assert s.context(pos, 13, 0) == b"Time Traveller"
        assert s.context(pos, 3, 2) == book[pos - 3:pos + 3]
        s.build_index(persist=True)
    with fkvstore.open(path, "a") as ar:
        s = ar["book"]
        assert "search_0_walk" in s.aux_array_names()
        walk, attrs = s.get_aux_array("search_0_walk")
        assert int(attrs["length"]) == len(book)
        assert np.array_equal(walk, s.codec.walk(np.frombuffer(book, dtype=np.uint8)))
        tail = " and the Time Traveller returned"
        s.extend(tail)
        last = len(book) + tail.index("returned") - 2
        assert s.search("Time Traveller").tolist()[-1] == last
        assert s.search("é").tolist() == [i + 1 for i in naive.find_bytes(book, "é".encode())]
    ar.close()
    with pytest.raises(ArchiveClosedError):
        s.search("Time")


def test_wide_stream_columns_and_bad_input(tmp_archive):
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 4, (500, 3))
    s = tmp_archive.create_stream("kv", alphabet_size=300, width=3)
    s.extend(rows)
    for col in range(3):
        q = rows[100:104, col].tolist()
        assert s.search(q, column=col).tolist() == naive.find_all(rows[:, col].tolist(), q)
    assert np.array_equal(s.context(10, 2, 2), rows[8:13])
    assert np.array_equal(s.context(10, 2, 2, column=1), rows[8:13, 1])
    with pytest.raises(ValueError, match="column must be <= 2, got 3"):
        s.search([1], column=3)
    with pytest.raises(ValueError, match="empty query"):
        s.search([])
    with pytest.raises(ValueError, match="got 300"):
        s.search([1, 300])
    with pytest.raises(ValueError, match="pos must be <= 499"):
        s.context(500)


def test_bad_column_of_a_persisted_index_commits_nothing(tmp_archive):
    s = tmp_archive.create_stream("s", alphabet_size=5)
    s.extend([1, 2, 3])
    with pytest.raises(ValueError, match="column must be <= 0, got 5"):
        s.build_index(column=5, persist=True)
    assert s.committed_length == 0


def test_persisted_index_describes_committed_rows_only(tmp_path):
    # an index persisted over buffered rows, which are then truncated and replaced without a
    # rewind of the committed stream, must not be restored over the new rows
    path = tmp_path / "stale.h5"
    with fkvstore.open(path, "w") as ar:
        s = ar.create_stream("s", 4)
        s.extend([0] * 100)
        s.build_index(persist=True)
        assert s.committed_length == 100  # persisting committed the rows it describes
        s.truncate(0)
        s.extend([1] * 100)
    with fkvstore.open(path) as ar:
        s = ar["s"]
        model = s.read()[:, 0].tolist()
        assert model == [1] * 100
        for q in ([1, 1], [0], [1] * 7):
            assert s.search(q).tolist() == naive.find_all(model, q)


@pytest.mark.parametrize("written", [1, 2, 3, 4])
def test_torn_persisted_index_is_ignored(tmp_path, monkeypatch, written):
    # a writer killed while replacing a persisted index leaves arrays of two builds
    rng = np.random.default_rng(written)
    path = tmp_path / "torn.h5"
    with fkvstore.open(path, "w") as ar:
        s = ar.create_stream("s", 16)
        s.extend(rng.integers(0, 16, 10_000))
        s.build_index(persist=True)
        s.truncate(0)
        s.extend(rng.integers(0, 16, 10_000))
        ar.flush()
        put, calls = type(s).put_aux_array, []

        def dying_put(self, key, array, attrs=None):
            if len(calls) == written:
                raise KeyboardInterrupt("killed")
            calls.append(key)
            put(self, key, array, attrs)

        monkeypatch.setattr(type(s), "put_aux_array", dying_put)
        with pytest.raises(KeyboardInterrupt):
            s.build_index(persist=True)
        monkeypatch.undo()
    with fkvstore.open(path) as ar:
        s = ar["s"]
        model = s.read()[:, 0].tolist()
        for start in (0, 3, 5000, 9990):
            q = model[start:start + 4]
            assert s.search(q).tolist() == naive.find_all(model, q)


@pytest.mark.parametrize("name", ["walk", "trees", "nodes", "indices", "boxes"])
def test_damaged_persisted_index_is_rebuilt_and_reported(tmp_path, name):
    import h5py

    book = b"the time traveller " * 1000
    path = tmp_path / "damaged.h5"
    with fkvstore.open(path, "w") as ar:
        ar.create_text_stream("book").extend(book)
        ar["book"].build_index(persist=True)
    with h5py.File(path, "r") as f:
        ds = f[f"streams/book/aux/search_0_{name}"]
        off = ds.id.get_offset() + ds.id.get_storage_size() // 2
    with open(path, "r+b") as fh:
        fh.seek(off)
        b = fh.read(1)
        fh.seek(off)
        fh.write(bytes([b[0] ^ 0xFF]))
    with fkvstore.open(path) as ar:
        problems = ar.verify()["book"]
        assert len(problems) == 1 and f"search_0_{name}" in problems[0]
        s = ar["book"]
        for q in (b"time", b"r t", b"traveller the"):
            assert s.search(q).tolist() == [i + len(q) - 1 for i in naive.find_bytes(book, q)]


def test_queries_and_context_arguments_fit_the_stream(tmp_path):
    with fkvstore.open(tmp_path / "q.h5", "w") as ar:
        s = ar.create_stream("s", alphabet_size=256)
        s.extend(np.arange(30) % 10)
        for text in (b"\x01", "a", bytearray(b"\x01")):  # no silent search of byte values
            with pytest.raises(TypeError, match="'s' holds integer symbols"):
                s.search(text)
            with pytest.raises(TypeError, match="holds integer symbols"):
                s.longest_suffix(text)
        assert s.search([1, 2]).tolist() == [2, 12, 22]
        t = ar.create_text_stream("t")
        t.extend("hello world")
        assert t.context(4, 2, 2, column=0) == b"llo w"
        with pytest.raises(ValueError, match="column"):
            t.context(4, 2, 2, column=1)
        e = ar.create_stream("e", alphabet_size=4)
        for pos in (0, 5):  # empty first, whatever the position
            with pytest.raises(IndexError, match="'e' is empty"):
                e.context(pos)
