"""The contract every stream type keeps, checked against a plain Python list of rows.

One class of tests runs against each kind of stream: integer streams of width 1 and of width W,
a TextStream and a ring-geometry stream. Small chunks (``chunk_bytes=256``) put every stream
over several chunks, so reads cross chunk and span boundaries.
"""

from __future__ import annotations

import numpy as np
import pytest

import fkvstore
import naive
from fkvstore.errors import PositionError

# name: (create_stream keyword arguments or "text", alphabet size, width)
KINDS = {
    "int-width-1": ({"alphabet_size": 37}, 37, 1),
    "int-width-3": ({"alphabet_size": 300, "width": 3}, 300, 3),
    "text": ("text", 256, 1),
    "ring-width-2": ({"alphabet_size": 11, "geometry": "ring", "width": 2}, 11, 2),
}


class Model:
    """A stream and its oracle: ``rows``, a list of lists of ``width`` ints."""

    def __init__(self, archive, kind: str, seed: int = 0):
        spec, self.alphabet, self.width = KINDS[kind]
        self.kind = kind
        self.rng = np.random.default_rng(seed)
        if spec == "text":
            self.stream = archive.create_text_stream("s", chunk_bytes=256)
        else:
            self.stream = archive.create_stream("s", chunk_bytes=256, **spec)
        self.rows: list[list[int]] = []

    def new_rows(self, n: int) -> np.ndarray:
        # few distinct symbols, so searches find repeats
        return self.rng.integers(0, min(self.alphabet, 4), (n, self.width))

    def extend(self, n: int) -> None:
        rows = self.new_rows(n)
        if self.kind == "text":
            self.stream.extend(rows[:, 0].astype(np.uint8).tobytes())  # the bytes path
        elif self.width == 1:
            self.stream.extend(rows[:, 0])
        else:
            self.stream.extend(rows)
        self.rows += rows.tolist()

    def append(self, n: int) -> None:
        for row in self.new_rows(n).tolist():
            self.stream.append(row[0] if self.width == 1 else row)
            self.rows.append(row)

    def reopen(self, archive) -> None:
        self.stream = archive["s"]

    def check(self) -> None:
        s = self.stream
        assert len(s) == len(self.rows)
        # a width-1 stream reads like a 1-D array; read() gives (n, width) rows for any width
        flat = self.rows if self.width > 1 else [r[0] for r in self.rows]
        assert s[:].tolist() == flat and np.asarray(s).tolist() == flat
        assert s.shape == np.asarray(s).shape == s[:].shape and s.dtype == s[:].dtype
        assert s.read().tolist() == self.rows
        assert s.read().shape == (len(self.rows), self.width)


@pytest.fixture(params=list(KINDS))
def kind(request):
    return request.param


class TestStreamContract:
    def fill(self, archive, kind) -> Model:
        m = Model(archive, kind)
        m.extend(300)
        archive.flush()
        m.append(5)
        m.extend(200)  # part committed, part buffered
        return m

    def test_len_and_indexing(self, tmp_archive, kind):
        m = self.fill(tmp_archive, kind)
        s, rows, n = m.stream, m.rows, len(m.rows)
        assert len(s) == n and s.committed_length == 300
        for i in [0, 1, 16, 17, 299, 300, 304, 305, n - 1, -1, -n, -200]:
            got = s[i]
            want = rows[i]
            assert (got == want[0]) if m.width == 1 else (got.tolist() == want)
            assert s[np.int64(i)] is not None
        # a width-1 stream reads like a 1-D array (numpy's shapes), a wider one like 2-D
        flat = rows if m.width > 1 else [r[0] for r in rows]
        for sl in [slice(None), slice(3, 40), slice(290, 320), slice(-30, None),
                   slice(None, None, 7), slice(400, 10, -13), slice(10, 5), slice(n, n + 5)]:
            assert s[sl].tolist() == flat[sl], sl
            assert s[sl].shape == np.asarray(flat, dtype=np.int64).reshape(s.shape)[sl].shape
        idx = np.array([5, -1, 300, 17, 5, -n])
        assert s[idx].tolist() == [flat[i] for i in idx.tolist()]
        assert s[[0, 2]].tolist() == [flat[0], flat[2]]
        assert s[10:20, m.width - 1].tolist() == [r[-1] for r in rows[10:20]]
        assert s[[3, 4], 0].tolist() == [rows[3][0], rows[4][0]]
        assert s[7, m.width - 1] == rows[7][-1]
        for bad in [n, -n - 1]:
            with pytest.raises(PositionError):
                s[bad]
        with pytest.raises(IndexError):
            s[np.array([0, n])]

    def test_iteration(self, tmp_archive, kind):
        m = self.fill(tmp_archive, kind)
        got = list(m.stream)
        if m.width == 1:
            assert got == [r[0] for r in m.rows]
        else:
            assert [r.tolist() for r in got] == m.rows

    def test_append_extend_flush_reopen(self, tmp_archive, kind):
        path = tmp_archive.path
        m = self.fill(tmp_archive, kind)
        m.check()
        tmp_archive.flush()
        assert m.stream.committed_length == len(m.rows)
        m.extend(33)  # left buffered: close commits it
        tmp_archive.close()
        with fkvstore.open(path) as ar:
            m.reopen(ar)
            m.check()
            assert m.stream.committed_length == len(m.rows)
        with fkvstore.open(path, "a") as ar:
            m.reopen(ar)
            m.append(3)
            m.extend(50)
            m.check()
        with fkvstore.open(path) as ar:
            m.reopen(ar)
            m.check()

    def test_truncate(self, tmp_archive, kind):
        path = tmp_archive.path
        m = self.fill(tmp_archive, kind)
        span = m.stream.span
        # into the buffer, into committed rows mid-span, on a span boundary, to nothing
        for n in [450, 301, 250, 7 * span, 3 * span + 1, 0]:
            m.stream.truncate(n)
            del m.rows[n:]
            m.check()
            assert m.stream.committed_length == min(n, m.stream.committed_length)
            m.extend(40)
            m.check()
        with pytest.raises(PositionError):
            m.stream.truncate(len(m.rows) + 1)
        tmp_archive.close()
        with fkvstore.open(path) as ar:
            m.reopen(ar)
            m.check()
            assert not ar.verify()["s"]

    def test_search_round_trip(self, tmp_archive, kind):
        m = self.fill(tmp_archive, kind)
        s = m.stream
        column = m.width - 1
        haystack = [r[column] for r in m.rows]
        for a, length in [(10, 3), (295, 8), (len(haystack) - 4, 4), (0, 1)]:
            query = haystack[a : a + length]
            hits = s.search(query, column=column).tolist()
            assert hits == naive.find_all(haystack, query)
            assert a + length - 1 in hits
            for p in hits:
                assert s[p - length + 1 : p + 1, column].tolist() == query
        s.truncate(200)  # the index follows a truncation into committed rows
        del m.rows[200:]
        m.extend(20)
        haystack = [r[column] for r in m.rows]
        query = haystack[-5:]
        assert s.search(query, column=column).tolist() == naive.find_all(haystack, query)
