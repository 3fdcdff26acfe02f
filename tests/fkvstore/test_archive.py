"""The archive's API: modes, streams, reading and writing, truncate, attrs, arrays, bad input."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from h5reader import read_stream_with_h5py

import fkvstore
from fkvstore.errors import (
    ArchiveClosedError,
    ArchiveExistsError,
    ArchiveFormatError,
    ArchiveNotFoundError,
    ArchiveReadOnlyError,
    ChecksumError,
    FkvError,
    PositionError,
    StreamNotFoundError,
)


@pytest.fixture
def path(tmp_path):
    return tmp_path / "a.h5"


def rows(n, width, alphabet, seed=0):
    return np.random.default_rng(seed).integers(0, alphabet, (n, width))


# -- modes and life cycle ------------------------------------------------------------------------
def test_modes(path):
    with pytest.raises(ArchiveNotFoundError, match="no archive"):
        fkvstore.open(path, "r")
    with pytest.raises(ArchiveNotFoundError, match="mode 'a' or 'w'"):
        fkvstore.open(path, "r+")
    with pytest.raises(ValueError, match="mode 'rw'"):
        fkvstore.open(path, "rw")
    with fkvstore.open(path, "x") as ar:
        ar.create_stream("s", 5).extend([1, 2, 3])
    for mode in ("x", "w-"):
        with pytest.raises(ArchiveExistsError, match="already exists"):
            fkvstore.open(path, mode)
    with fkvstore.open(path, "a") as ar:  # existing: kept
        assert ar["s"][:, 0].tolist() == [1, 2, 3]
        ar["s"].append(4)
    with fkvstore.open(path, "r+") as ar:
        assert ar["s"][:, 0].tolist() == [1, 2, 3, 4]
    with fkvstore.open(path, "w") as ar:  # replaced
        assert list(ar) == []
    with fkvstore.open(path.with_name("new.h5"), "a") as ar:  # missing: created
        assert len(ar) == 0


def test_closed_archive_fails_loudly(path):
    ar = fkvstore.open(path, "w")
    s = ar.create_stream("s", 10)
    s.extend([1, 2])
    assert "mode='w'" in repr(ar) and str(path) in repr(ar)
    ar.close()
    ar.close()  # idempotent
    assert ar.closed and "closed" in repr(ar)
    for op in (
        lambda: ar["s"],
        lambda: len(ar),
        lambda: ar.flush(),
        lambda: s[0],
        lambda: s.append(1),
        lambda: ar.attrs,
        lambda: list(ar),
    ):
        with pytest.raises(ArchiveClosedError):
            op()
    with fkvstore.open(path) as ar2:  # close() committed the buffered rows
        assert ar2["s"][:, 0].tolist() == [1, 2]


def test_read_only_mode_refuses_writes(path):
    with fkvstore.open(path, "w") as ar:
        ar.create_stream("s", 10)
    with fkvstore.open(path, "r") as ar:
        s = ar["s"]
        for op in (
            lambda: s.append(1),
            lambda: s.extend([1]),
            lambda: s.truncate(0),
            lambda: ar.create_stream("t", 3),
            lambda: ar.put_array("a", [1]),
            lambda: ar.attrs.__setitem__("k", 1),
            lambda: ar.flush(),
            lambda: ar.__delitem__("s"),
        ):
            with pytest.raises(ArchiveReadOnlyError, match="mode 'a' or 'r\\+'"):
                op()


# -- streams --------------------------------------------------------------------------------------
def test_stream_mapping(path):
    with fkvstore.open(path, "w") as ar:
        ar.create_stream("a", 4)
        ar.create_stream("b", 300, geometry="ring", width=3)
        ar.create_text_stream("t")
        assert sorted(ar) == ["a", "b", "t"] and len(ar) == 3 and "a" in ar and "z" not in ar
        with pytest.raises(ValueError, match="already exists"):
            ar.create_stream("a", 4)
        with pytest.raises(StreamNotFoundError, match="no stream 'z'.*'a', 'b', 't'") as ei:
            ar["z"]
        assert isinstance(ei.value, KeyError)
        for bad in ("", "x/y", ".hidden"):
            with pytest.raises(ValueError, match="invalid stream name"):
                ar.create_stream(bad, 4)
        with pytest.raises(TypeError, match="stream name must be a str"):
            ar.create_stream(3, 4)
        with pytest.raises(ValueError, match="width must be a positive int"):
            ar.create_stream("w", 4, width=0)
        with pytest.raises(ValueError, match="alphabet_size"):
            ar.create_stream("w", 1)
        a = ar["a"]
        del ar["a"]
        assert "a" not in ar
        with pytest.raises(ArchiveClosedError):
            len(a)
        with pytest.raises(StreamNotFoundError):
            del ar["a"]
    with fkvstore.open(path) as ar:
        assert sorted(ar) == ["b", "t"]
        b = ar["b"]
        assert (b.width, b.alphabet_size, b.codec.geometry) == (3, 300, "ring")
        assert isinstance(ar["t"], fkvstore.TextStream)


@pytest.mark.parametrize("geometry", ["grid", "ring"])
@pytest.mark.parametrize("width", [1, 4])
def test_read_shapes_and_indexing(path, geometry, width):
    data = rows(2000, width, 50, seed=width)
    with fkvstore.open(path, "w") as ar:
        s = ar.create_stream("s", 50, geometry=geometry, width=width, chunk_bytes=256)
        s.extend(data[:1500])
        ar.flush()
        s.extend(data[1500:])  # the last 500 rows stay buffered: reads must see them too
        for st in (s,):
            assert len(st) == 2000
            one = st[7]
            if width == 1:
                assert isinstance(one, int) and one == data[7, 0]
            else:
                assert one.shape == (width,) and one.dtype == np.int64
                np.testing.assert_array_equal(one, data[7])
            np.testing.assert_array_equal(st[-1], data[-1] if width > 1 else data[-1, 0])
            # width 1 reads like a 1-D array: (n,) where a wider stream gives (n, width)
            want = data if width > 1 else data[:, 0]
            np.testing.assert_array_equal(st[10:1700], want[10:1700])
            assert st[10:1700].shape == want[10:1700].shape == st[10:1700].shape
            assert st[5:5].shape == want[5:5].shape
            np.testing.assert_array_equal(st[::97], want[::97])
            idx = np.array([0, 1999, 3, -2, 1499, 1500])
            np.testing.assert_array_equal(st[idx], want[idx])
            assert st.shape == want.shape and np.asarray(st).shape == want.shape
            np.testing.assert_array_equal(st[1:9, 0], data[1:9, 0])
            np.testing.assert_array_equal(st[(7,)], st[7])  # a 1-tuple is its element
            np.testing.assert_array_equal(st[()], want)
            with pytest.raises(IndexError, match="too many indices for stream 's': 3 given"):
                st[0, 0, 0]
            for bad in ((3, width), (slice(0, 4), -width - 1), ([1, 2], [0, width])):
                with pytest.raises(IndexError, match=f"column index .* stream 's' of width "
                                                     f"{width}"):
                    st[bad]
            np.testing.assert_array_equal(st.read(), data)
            got = np.array(list(st))
            np.testing.assert_array_equal(got.reshape(2000, width), data)
            for bad in (2000, -2001):
                with pytest.raises(PositionError, match="out of range") as ei:
                    st[bad]
                assert isinstance(ei.value, IndexError)
            with pytest.raises(PositionError):
                st[np.array([1, 2000])]
            with pytest.raises(TypeError, match="ints, slices or integer arrays"):
                st[1.5]
    with fkvstore.open(path) as ar:
        np.testing.assert_array_equal(ar["s"].read(), data)
        np.testing.assert_array_equal(read_stream_with_h5py(path, "s"), data)


def test_truncate(path):
    data = rows(3000, 2, 7)
    with fkvstore.open(path, "w") as ar:
        s = ar.create_stream("s", 7, width=2, chunk_bytes=512)
        s.extend(data)
        ar.flush()
        s.truncate(2999)
        s.truncate(1234)  # into committed rows: durable at once
        assert len(s) == s.committed_length == 1234
        np.testing.assert_array_equal(s[:], data[:1234])
        s.extend(data[1234:2000])
        s.truncate(1500)  # only buffered rows
        assert s.committed_length == 1234
        s.truncate(0)
        s.extend(data[:10])
        with pytest.raises(PositionError, match="cannot truncate"):
            s.truncate(11)
        with pytest.raises(TypeError):
            s.truncate(1.0)
    with fkvstore.open(path, "a") as ar:
        s = ar["s"]
        np.testing.assert_array_equal(s[:], data[:10])
        s.extend(data[10:])
    with fkvstore.open(path) as ar:
        np.testing.assert_array_equal(ar["s"][:], data)
        np.testing.assert_array_equal(read_stream_with_h5py(path, "s"), data)


def test_text_stream(path):
    text = "Zeit und Raum — „Zeitmaschine“ ∞ 時間"
    raw = text.encode("utf-8")
    with fkvstore.open(path, "w") as ar:
        t = ar.create_text_stream("t")
        t.extend(text[:10])
        t.extend(raw[len(text[:10].encode()) : 20])
        t.append(raw[20:21])
        t.append(raw[21])
        t.extend(bytearray(raw[22:]))
        assert t.text() == text and len(t) == len(raw)
        assert t.bytes(3, 9) == raw[3:9]
        with pytest.raises(ValueError, match="256 is outside 0..255"):
            t.append(256)
    with fkvstore.open(path) as ar:
        t = ar["t"]
        assert t.text() == text and t.bytes() == raw
        cut = raw.index("—".encode()) + 1  # a byte offset inside a character
        assert t.text(0, cut).endswith("\ufffd")
        assert t.text(0, cut, errors="ignore") == text[: text.index("—")]
        np.testing.assert_array_equal(t[:, 0], np.frombuffer(raw, np.uint8))


def test_bad_input_appends_nothing(path):
    with fkvstore.open(path, "w") as ar:
        s = ar.create_stream("s", 10, width=2)
        s.extend([[1, 2]])
        for bad, exc, msg in [
            ([[1, 2.5]], TypeError, "must be integers, got 2.5"),
            ([[1, np.nan]], ValueError, "NaN"),
            ([[1, 10]], ValueError, "alphabet_size=10, got 10"),
            ([[-1, 0]], ValueError, ">= 0, got -1"),
            ([[1, 2, 3]], ValueError, "rows of width 2"),
            (np.ones((2, 2), np.float32), TypeError, "integer dtype, got float32"),
            ([["a", "b"]], TypeError, "must be integers"),
            ([[1, 1]] * 50 + [[1, "a"]], TypeError, r"got 'a' \(str\) at index \(50, 1\)"),
        ]:
            with pytest.raises(exc, match=msg):
                s.extend(bad)
        s.extend([])  # nothing, at any width
        s.extend(row for row in ([3, 4], [5, 6]))  # an iterator of rows
        assert s[1:].tolist() == [[3, 4], [5, 6]]
        s.truncate(1)
        for bad, exc, msg in [(3, ValueError, "2 symbol"), ([1, 10], ValueError, "got 10")]:
            with pytest.raises(exc, match=msg):
                s.append(bad)
        assert len(s) == 1
        one = ar.create_stream("one", 3)
        with pytest.raises(ValueError, match="outside 0..2"):
            one.append(3)
        with pytest.raises(TypeError, match="booleans"):
            one.append(True)
        with pytest.raises(TypeError, match=r"got True \(bool\) at index 0"):
            s.append([True, 1])
        with pytest.raises(TypeError, match=r"got True \(bool\) at index \(1, 1\)"):
            s.extend([[1, 2], [3, True]])
        with pytest.raises(ValueError, match=f"got {2**70} at index 1"):
            s.append([1, 2**70])
        assert len(one) == 0
    with fkvstore.open(path) as ar:
        assert ar["s"][:].tolist() == [[1, 2]] and len(ar["one"]) == 0


# -- attrs and arrays ---------------------------------------------------------------------
def test_attrs(path):
    with fkvstore.open(path, "w") as ar:
        ar.attrs["model"] = "gpt2"
        ar.attrs["layers"] = 12
        s = ar.create_stream("s", 4)
        s.attrs["unit"] = "token"
        s.extend([1, 2, 3])
        with pytest.raises(ValueError, match="reserved"):
            ar.attrs["fkv_format"] = "x"
        del ar.attrs["layers"]
        with pytest.raises(KeyError):
            del ar.attrs["layers"]
        with pytest.raises(KeyError, match="^'nope'$"):
            ar.attrs["nope"]
        assert ar.attrs.get("nope", 7) == 7
        for bad in ("a\0b", b"a\0b"):
            with pytest.raises(ValueError, match="attribute 'nul'.* NUL .*uint8 array"):
                ar.attrs["nul"] = bad
        for bad in (None, object(), {"k": 1}):
            with pytest.raises(TypeError, match="attribute 'odd' of .* nothing was written"):
                s.attrs["odd"] = bad
    with fkvstore.open(path) as ar:
        assert dict(ar.attrs) == {"model": "gpt2"}
        assert dict(ar["s"].attrs) == {"unit": "token"}
        with pytest.raises(KeyError):
            ar.attrs["fkv_format"]
        assert ar["s"][:, 0].tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    "value",
    [
        np.arange(12.0).reshape(3, 4),
        np.array([1, 2], ">i4"),
        np.array(b"config-hash-123"),
        np.zeros((0, 5), np.uint8),
        np.array([True, False]),
        np.float16(3.5),
        np.array(["a", "bc"], "S"),
    ],
)
def test_arrays_round_trip(path, value):
    with fkvstore.open(path, "w") as ar:
        ar.put_array("v", value)
        ar.put_array("v", value)  # replacing is allowed
    with fkvstore.open(path) as ar:
        got = ar.get_array("v")
        assert got.shape == np.shape(value) and got.dtype.str[1:] == np.asarray(value).dtype.str[1:]
        np.testing.assert_array_equal(got, value)
        assert ar.array_names() == ["v"]


def test_array_errors(path):
    with fkvstore.open(path, "w") as ar:
        with pytest.raises(TypeError, match="dtype <U1"):
            ar.put_array("u", np.array(["x"]))
        with pytest.raises(TypeError, match="dtype object"):
            ar.put_array("o", np.array([{}], dtype=object))
        with pytest.raises(StreamNotFoundError, match="no array 'nope'"):
            ar.get_array("nope")
        ar.put_array("x", [1, 2])
        ar.delete_array("x")
        assert ar.array_names() == []


def test_array_info_reads_no_data(tmp_archive):
    tmp_archive.put_array("codebooks", np.zeros((4, 256, 8), np.float32))
    assert tmp_archive.array_info("codebooks") == (np.dtype(np.float32), (4, 256, 8))
    with pytest.raises(StreamNotFoundError, match="no array 'nope' .*arrays: 'codebooks'"):
        tmp_archive.array_info("nope")
    path = tmp_archive.path
    tmp_archive.close()
    with h5py.File(path, "r+", locking=False) as f:  # damage the data, not the header
        f["arrays/codebooks"][0, 0, 0] = 1.0
    with fkvstore.open(path) as ar:
        assert ar.array_info("codebooks")[1] == (4, 256, 8)
        with pytest.raises(ChecksumError):
            ar.get_array("codebooks")


def test_aux_arrays_beside_a_stream(path):
    with fkvstore.open(path, "w") as ar:
        s = ar.create_stream("s", 4)
        s.extend([0, 1, 2, 3])
        s.put_aux_array("walk", np.ones((4, 2)), attrs={"length": 4})
        assert s.aux_array_names() == ["walk"]
    with fkvstore.open(path) as ar:
        arr, attrs = ar["s"].get_aux_array("walk")
        np.testing.assert_array_equal(arr, np.ones((4, 2)))
        assert attrs == {"length": 4}
        with pytest.raises(StreamNotFoundError):
            ar["s"].get_aux_array("tree")


@pytest.mark.parametrize(
    "kwargs, what",
    [
        ({"chunk_bytes": 2**40}, "chunk_bytes"),
        ({"chunk_bytes": 2**32}, "chunk_bytes"),
        ({"width": 2**28}, "width"),
    ],
)
def test_create_stream_beyond_hdf5_chunk_limit_writes_nothing(path, kwargs, what):
    with fkvstore.open(path, "w") as ar:
        with pytest.raises(ValueError, match=what):
            ar.create_stream("x", 10, **kwargs)
        assert "x" not in ar
        assert ar.verify() == {}
        ar.create_stream("x", 10).extend([1, 2])  # the name is still free
    with fkvstore.open(path) as ar:
        assert ar.verify() == {"x": []}
        assert ar["x"][:].ravel().tolist() == [1, 2]


def test_create_stream_removes_a_half_created_group(path, monkeypatch):
    from fkvstore import layout

    def failing(streams, name, **kw):
        streams.create_group(name).attrs["fkv_kind"] = "symbols"
        raise RuntimeError("disk full")

    with fkvstore.open(path, "w") as ar:
        monkeypatch.setattr(layout, "create_stream_group", failing)
        with pytest.raises(RuntimeError, match="disk full"):
            ar.create_stream("x", 10)
        monkeypatch.undo()
        assert "x" not in ar and ar.verify() == {}
        ar.create_stream("x", 10)


def test_checked_array_is_replaced_only_once_written(tmp_path, monkeypatch):
    from fkvstore import layout

    def disk_full(arr):
        raise OSError("disk full")

    with h5py.File(tmp_path / "plain.h5", "w") as f:
        layout.put_checked_array(f, "a", np.arange(3))
        monkeypatch.setattr(layout, "_le_bytes", disk_full)
        with pytest.raises(OSError, match="disk full"):
            layout.put_checked_array(f, "a", np.zeros(5))
        monkeypatch.undo()
        assert list(f.keys()) == ["a"]  # no partial write left, the previous array kept
        np.testing.assert_array_equal(layout.get_checked_array(f["a"]), np.arange(3))


def test_unfinished_array_of_a_killed_writer_is_not_listed(path):
    with fkvstore.open(path, "w") as ar:
        ar.put_array("a", np.arange(3))
        ar.create_stream("s", 4).put_aux_array("walk", np.ones(2))
    with h5py.File(path, "a") as f:  # what a writer killed mid-write leaves
        f["arrays"].create_dataset(".new_a", data=np.zeros(9))
        f["streams/s/aux"].create_dataset(".new_walk", data=np.zeros(9))
    with fkvstore.open(path) as ar:
        assert ar.array_names() == ["a"]
        assert ar["s"].aux_array_names() == ["walk"]
        np.testing.assert_array_equal(ar.get_array("a"), np.arange(3))


def test_put_aux_array_with_an_unstorable_attribute_stores_nothing(path):
    with fkvstore.open(path, "w") as ar:
        s = ar.create_stream("s", 4)
        s.extend([0, 1, 2, 3])
        with pytest.raises(TypeError):
            s.put_aux_array("walk", np.ones(3), attrs={"bad": {"nested": 1}})
        assert s.aux_array_names() == []
        s.put_aux_array("walk", np.ones(3), attrs={"length": 3})
        with pytest.raises(TypeError):  # replacing: the previous array stays
            s.put_aux_array("walk", np.zeros(5), attrs={"bad": object()})
        assert s.aux_array_names() == ["walk"]
    with fkvstore.open(path) as ar:
        arr, attrs = ar["s"].get_aux_array("walk")
        np.testing.assert_array_equal(arr, np.ones(3))
        assert attrs == {"length": 3}
        assert ar.verify() == {"s": []}


def test_cache_bytes_bounds_a_writers_cache(path):
    budget = 64 << 10
    data = rows(200 * 300, 8, 256, seed=3)
    with fkvstore.open(path, "w", cache_bytes=budget) as ar:
        s = ar.create_stream("kv", 256, width=8, chunk_bytes=4096)
        for k in range(200):
            s.extend(data[k * 300 : (k + 1) * 300])
            ar.flush()
            assert s.cached_bytes <= budget
        assert s.cached_bytes > 0
        np.testing.assert_array_equal(s[:], data)  # reads through an evicting cache
        assert s.cached_bytes <= budget
        np.testing.assert_array_equal(s[len(data) - 1], data[-1])
    with fkvstore.open(path, cache_bytes=budget) as ar:
        s = ar["kv"]
        for i in range(0, len(data), 997):
            np.testing.assert_array_equal(s[i], data[i])
        assert 0 < s.cached_bytes <= budget


# -- foreign and damaged files ------------------------------------------------------------
def test_foreign_files(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not hdf5 at all " * 100)
    with pytest.raises(ArchiveFormatError, match="not an HDF5 file|not a readable HDF5"):
        fkvstore.open(text)
    with pytest.raises(ArchiveFormatError):
        fkvstore.open(text, "a")
    plain = tmp_path / "plain.h5"
    with h5py.File(plain, "w") as f:
        f["x"] = np.arange(3)
    for mode in ("r", "a", "r+"):
        with pytest.raises(ArchiveFormatError, match="not an fkvstore archive"):
            fkvstore.open(plain, mode)
    with h5py.File(plain) as f:  # untouched
        assert f["x"][:].tolist() == [0, 1, 2]


def test_newer_format_version(path):
    with fkvstore.open(path, "w"):
        pass
    with h5py.File(path, "r+", locking=False) as f:
        f.attrs["fkv_format_version"] = 99
    for mode in ("r", "a"):
        with pytest.raises(ArchiveFormatError, match="version 99.*upgrade fkvstore"):
            fkvstore.open(path, mode)


def test_truncated_file(path, tmp_path):
    with fkvstore.open(path, "w") as ar:
        ar.create_stream("s", 256).extend(rows(50_000, 1, 256))
    data = path.read_bytes()
    for keep in (10, 100, len(data) // 2):
        cut = tmp_path / f"cut{keep}.h5"
        cut.write_bytes(data[:keep])
        with pytest.raises(FkvError):
            with fkvstore.open(cut) as ar:
                ar["s"][:]


def test_inconsistent_commit_record(path):
    with fkvstore.open(path, "w") as ar:
        ar.create_stream("s", 256).extend(rows(100, 1, 256))
    with h5py.File(path, "r+", locking=False) as f:
        rec = f["streams/s/points"].attrs["fkv_commit"]
        rec[0] += 1  # length no longer matches full_spans * span + tail_count
        f["streams/s/points"].attrs["fkv_commit"] = rec
    with fkvstore.open(path) as ar, pytest.raises(ArchiveFormatError, match="inconsistent"):
        ar["s"]


def test_stream_group_missing_dataset(path):
    with fkvstore.open(path, "w") as ar:
        ar.create_stream("s", 256)
    with h5py.File(path, "r+", locking=False) as f:
        del f["streams/s/tail"]
    with fkvstore.open(path) as ar, pytest.raises(ArchiveFormatError, match="incomplete"):
        ar["s"]


def test_checksum_error_is_an_fkv_error():
    assert issubclass(ChecksumError, FkvError) and issubclass(ChecksumError, ValueError)


def test_an_array_name_is_not_a_stream_and_the_error_says_so(path):
    with fkvstore.open(path, "w") as ar:
        ar.put_array("codebooks", np.zeros(3))
        with pytest.raises(KeyError, match=r"'codebooks' .* is an array, not a stream: read it "
                                           r"with get_array\('codebooks'\)"):
            ar["codebooks"]
