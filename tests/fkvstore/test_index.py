"""The suffix index against brute-force scans: exact hits, longest suffixes, growth."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import naive
from fkvstore.codec import Codec
from fkvstore.index import SuffixIndex

TEXT = Path(__file__).resolve().parents[2] / "fkvstore" / "data" / "the_time_machine.txt"


@st.composite
def stream_and_query(draw):
    alphabet_size = draw(st.sampled_from([2, 3, 4, 5, 27, 256, 1024, 50257]))
    geometry = draw(st.sampled_from(["grid", "ring"]))
    n = draw(st.integers(1, 3000))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    # a small effective alphabet makes repeats (and hence many hits) likely
    used = draw(st.integers(1, min(alphabet_size, 8)))
    pool = rng.choice(alphabet_size, used, replace=False)
    stream = pool[rng.integers(0, used, n)]
    length = draw(st.integers(1, 200))
    if draw(st.booleans()):
        end = draw(st.integers(1, n))
        query = stream[max(0, end - length):end]
    else:
        query = pool[rng.integers(0, used, length)]
    return Codec(alphabet_size, geometry), stream, query


@given(stream_and_query())
def test_search_equals_brute_force(args):
    codec, stream, query = args
    index = SuffixIndex.build(codec, stream)
    hits = index.search(query)
    assert hits.dtype == np.int64
    assert hits.tolist() == naive.find_all(stream.tolist(), query.tolist())


@given(stream_and_query(), st.integers(1, 6))
def test_longest_suffix_equals_brute_force(args, k):
    codec, stream, query = args
    index = SuffixIndex.build(codec, stream)
    positions, lengths = index.longest_suffix(query, k)
    expect = naive.longest_suffix(stream.tolist(), query.tolist(), k)
    assert list(zip(positions.tolist(), lengths.tolist(), strict=True)) == expect


@given(stream_and_query(), st.lists(st.integers(1, 3000), max_size=5))
def test_growing_index_equals_fresh_one(args, cuts):
    codec, stream, query = args
    index = SuffixIndex(codec)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    for a, b in zip(bounds, bounds[1:], strict=False):
        index.extend(stream[a:b])
    assert len(index) == len(stream)
    assert np.array_equal(index.walk, codec.walk(stream))
    assert index.search(query).tolist() == naive.find_all(stream.tolist(), query.tolist())


@pytest.mark.parametrize("geometry", ["grid", "ring"])
def test_logarithmic_method_keeps_few_trees(geometry, monkeypatch):
    import fkvstore.index.suffix as ix  # the module that reads _BUFFER

    monkeypatch.setattr(ix, "_BUFFER", 64)
    rng = np.random.default_rng(3)
    stream = rng.integers(0, 4, 20_000)
    index = SuffixIndex(Codec(27, geometry))
    for a in range(0, 20_000, 50):
        index.extend(stream[a:a + 50])
        sizes = index.tree_sizes
        assert len(sizes) <= 2 * int(np.log2(max(2, len(index) / 64))) + 2
        assert all(x >= y / 2 for x, y in zip(sizes, sizes[1:], strict=False)) or len(sizes) < 2
    for q in ([1, 2, 3], [0, 0, 0, 0, 0], stream[777:800].tolist()):
        assert index.search(q).tolist() == naive.find_all(stream.tolist(), q)


@pytest.mark.parametrize("geometry", ["grid", "ring"])
def test_truncate_then_grow(geometry):
    rng = np.random.default_rng(5)
    stream = rng.integers(0, 3, 9000)
    index = SuffixIndex.build(Codec(256, geometry), stream)
    index.truncate(4321)
    assert index.search([0, 1, 2]).tolist() == naive.find_all(stream[:4321].tolist(), [0, 1, 2])
    other = rng.integers(0, 3, 500)
    index.extend(other)
    full = np.concatenate([stream[:4321], other])
    assert np.array_equal(index.symbols(0, len(full)), full)
    assert index.search([2, 2, 1]).tolist() == naive.find_all(full.tolist(), [2, 2, 1])


@pytest.mark.parametrize("geometry", ["grid", "ring"])
def test_time_machine_every_length_up_to_64(geometry):
    text = TEXT.read_bytes()[20_000:60_000]
    stream = np.frombuffer(text, dtype=np.uint8)
    index = SuffixIndex.build(Codec(256, geometry), stream)
    rng = np.random.default_rng(7)
    for length in range(1, 65):
        for end in rng.integers(length, len(text), 6):
            query = text[end - length:end]
            expect = [m + length - 1 for m in naive.find_bytes(text, query)]
            assert index.search(query).tolist() == expect, (length, query)



def test_text_queries_and_bad_input():
    index = SuffixIndex.build(Codec(256), np.frombuffer("naïve café".encode(), dtype=np.uint8))
    assert index.search("é").tolist() == [len("naïve café".encode()) - 1]
    assert index.search(b"ve").tolist() == [5]
    with pytest.raises(ValueError, match="empty query"):
        index.search(b"")
    with pytest.raises(ValueError, match="query must be < alphabet_size=256, got 300"):
        index.search([1, 300])
    with pytest.raises(TypeError, match="query must be integers"):
        index.search([1.5])
    with pytest.raises(ValueError, match="k must be >= 1"):
        index.longest_suffix(b"a", 0)


@pytest.mark.parametrize("geometry", ["grid", "ring"])
def test_state_round_trip_restores_trees(geometry, monkeypatch):
    import fkvstore.index.suffix as ix  # the module that reads _BUFFER

    monkeypatch.setattr(ix, "_BUFFER", 256)
    rng = np.random.default_rng(11)
    stream = rng.integers(0, 5, 6000)
    codec = Codec(27, geometry)
    index = SuffixIndex(codec)
    for a in range(0, 5000, 700):
        index.extend(stream[a:min(a + 700, 5000)])
    state = index.state()
    more = stream
    with monkeypatch.context() as m:  # restoring builds no tree
        m.setattr(SuffixIndex, "_tree", lambda *a: pytest.fail("a tree was rebuilt"))
        exact = SuffixIndex.from_state(codec, stream[:5000], state, ix.TREE_FORMAT)
    assert exact.tree_sizes == index.tree_sizes
    assert exact.search(stream[100:110]).tolist() == index.search(stream[100:110]).tolist()
    restored = SuffixIndex.from_state(codec, more, state, ix.TREE_FORMAT)
    rebuilt = SuffixIndex.from_state(codec, more, state, "scipy-0.0-leaf16")  # other scipy
    for q in ([1, 2], [0, 0, 0], stream[4990:5010].tolist(), stream[10:30].tolist()):
        expect = naive.find_all(more.tolist(), q)
        assert restored.search(q).tolist() == expect
        assert rebuilt.search(q).tolist() == expect
    damaged = dict(state, trees=state["trees"][:, ::-1].copy())
    assert SuffixIndex.from_state(codec, more, damaged, ix.TREE_FORMAT).search([1, 2]).tolist() \
        == naive.find_all(more.tolist(), [1, 2])
