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
@given(ops=st.lists(st.tuples(st.sampled_from(["extend", "truncate", "search", "flush"]),
                              st.integers(0, 2**32 - 1)), min_size=1, max_size=12))
def test_search_tracks_appends_and_truncation(tmp_path_factory, geometry, ops):
    path = tmp_path_factory.mktemp("s") / "a.h5"
    model: list[int] = []
    with fkvstore.open(path, "w") as ar:
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
            q = rng.integers(0, 3, int(rng.integers(1, 6))).tolist()
            assert s.search(q).tolist() == naive.find_all(model, q)
        if model:
            p, n = s.longest_suffix([4, 0, 1, 2], 3)
            assert list(zip(p.tolist(), n.tolist(), strict=True)) == \
                naive.longest_suffix(model, [4, 0, 1, 2], 3)


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


def test_wide_stream_columns_and_bad_input(tmp_path):
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 4, (500, 3))
    with fkvstore.open(tmp_path / "w.h5", "w") as ar:
        s = ar.create_stream("kv", alphabet_size=300, width=3)
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
