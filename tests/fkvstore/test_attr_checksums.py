"""CRC-32s over attributes (docs/format.md "Checksums over attributes"): strings in HDF5's global
heap have no checksum of their own, so a flipped bit in a user attribute or a codec config is
caught by these, old files without them stay readable, and every change keeps them valid."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fkvstore
from fkvstore import layout
from fkvstore.errors import ChecksumError


@pytest.fixture
def path(tmp_path):
    path = tmp_path / "a.h5"
    with fkvstore.open(path, "w") as ar:
        ar.attrs["model"] = "a-model-name-to-find"
        s = ar.create_stream("s", 200, width=2)
        s.extend(np.arange(40).reshape(20, 2))
        s.attrs["source"] = "a-source-name-to-find"
    return path


def _flip(path, text: bytes, at: int = 3):
    data = bytearray(path.read_bytes())
    where = data.find(text)
    assert where >= 0 and data.find(text, where + 1) < 0
    data[where + at] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_user_attribute_is_caught(path):
    _flip(path, b"a-model-name-to-find")
    with fkvstore.open(path) as ar:
        with pytest.raises(ChecksumError, match="user attributes of '/'"):
            ar.attrs["model"]
        report = ar.verify()
        assert ar["s"][:].sum() == sum(range(40))  # the data is unharmed
    assert any("fkv_attrs_crc32" in p for p in report["/"]) and report["s"] == []


def test_a_flipped_stream_attribute_is_caught(path):
    _flip(path, b"a-source-name-to-find")
    with fkvstore.open(path) as ar:
        with pytest.raises(ChecksumError):
            ar["s"].attrs["source"]
        assert any("user attributes of '/streams/s'" in p for p in ar.verify()["s"])
    with fkvstore.open(path, "a") as ar, pytest.raises(ChecksumError):
        ar["s"].attrs["other"] = 1  # damage is never sealed in


def test_a_flipped_codec_config_refuses_the_stream(path):
    _flip(path, b'"alphabet_size": 200', at=19)  # 200 -> 201: a valid, different codec
    with fkvstore.open(path) as ar, pytest.raises(ChecksumError, match="codec, layout"):
        ar["s"]


def test_files_without_the_checksums_read_unchecked_and_gain_them(path):
    with h5py.File(path, "r+", locking=False) as f:
        for g in (f, f["streams/s"]):
            for name in (layout.CONFIG_CRC_ATTR, layout.USER_CRC_ATTR):
                del g.attrs[name]
            g.attrs["late"] = "written by an older fkvstore"
    with fkvstore.open(path, "a") as ar:
        assert ar.attrs["late"] == "written by an older fkvstore"
        assert not any(ar.verify().values())
        ar.attrs["newer"] = 2
    with h5py.File(path, "r", locking=False) as f:
        assert layout.attrs_problems(f) == [] and layout.USER_CRC_ATTR in f.attrs


VALUES = st.one_of(
    st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False), st.text(max_size=20),
    st.lists(st.integers(-1000, 1000), min_size=1, max_size=5).map(np.array),
)


@settings(max_examples=25, deadline=None)
@example(changes=[("a", 1), ("b", "x\0y"), ("a", None)])
@given(changes=st.lists(st.tuples(st.sampled_from(["a", "b", "c"]),
                                  st.one_of(st.none(), VALUES)), max_size=6))
def test_any_sequence_of_changes_keeps_the_checksums_valid(tmp_path_factory, changes):
    path = tmp_path_factory.mktemp("attrs") / "a.h5"
    model = {}
    with fkvstore.open(path, "w") as ar:
        for name, value in changes:
            if value is None:
                if name in model:
                    del ar.attrs[name]
                    del model[name]
            elif isinstance(value, str) and "\0" in value:
                with pytest.raises(ValueError, match=f"attribute '{name}'.*NUL"):
                    ar.attrs[name] = value  # refused, nothing written
            else:
                ar.attrs[name] = value
                model[name] = value
    with fkvstore.open(path) as ar:
        assert sorted(ar.attrs) == sorted(model)
        for name, value in model.items():
            assert np.array_equal(ar.attrs[name], value)
        assert ar.verify() == {}
