"""The codec against tests/support/naive.py, lossless round trips, invalid points, bad input."""

from __future__ import annotations

import json
import math
import struct
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import naive
from fkvstore.codec import RING_ERROR, Codec, kissing_ratio
from fkvstore.errors import FkvError, InvalidPointError

GEOMS = ["grid", "ring"]
ALPHABETS = [2, 3, 4, 5, 27, 255, 256, 257, 1024, 50257, 151936, 2**18]


@st.composite
def adversarial(draw, alphabet_size, max_len):
    """Streams that stress cell boundaries, plus plain random ones."""
    n = alphabet_size
    length = draw(st.integers(0, max_len))
    kind = draw(st.sampled_from(["random", "repeat", "alternate", "neighbours", "sweep", "ends"]))
    if kind == "random":
        seed = draw(st.integers(0, 2**32 - 1))
        return np.random.default_rng(seed).integers(0, n, length)
    if kind == "repeat":
        return np.full(length, draw(st.integers(0, n - 1)), dtype=np.int64)
    if kind == "alternate":
        return np.resize(np.array([0, n - 1]), length)
    if kind == "neighbours":
        c = draw(st.integers(0, n - 1))
        seed = draw(st.integers(0, 2**32 - 1))
        steps = np.random.default_rng(seed).integers(-1, 2, length)
        return (c + np.cumsum(steps)) % n
    if kind == "sweep":
        start = draw(st.integers(0, n - 1))
        return (start + np.arange(length)) % n
    seed = draw(st.integers(0, 2**32 - 1))
    return np.random.default_rng(seed).choice([0, 1, n - 2, n - 1], length) % n


# ---------------------------------------------------------------------- against the oracle
@pytest.mark.parametrize("geometry", GEOMS)
@given(data=st.data(), alphabet_size=st.sampled_from([2, 3, 4, 5, 7, 27, 255, 256, 257, 1024]))
def test_encode_equals_oracle_bit_for_bit(geometry, data, alphabet_size):
    codec = Codec(alphabet_size, geometry)
    symbols = data.draw(adversarial(alphabet_size, 2000))
    fast = codec.encode(symbols)
    slow = naive.encode(symbols, alphabet_size, geometry, codec.span)
    assert fast.shape == (len(slow), 2)
    assert [tuple(p) for p in fast.tolist()] == slow
    assert codec.decode(fast, len(symbols)).tolist() == naive.decode(
        slow, len(symbols), alphabet_size, geometry, codec.span)


@pytest.mark.parametrize("geometry", GEOMS)
@given(data=st.data(), alphabet_size=st.sampled_from([3, 27, 256, 50257]))
def test_walk_equals_oracle(geometry, data, alphabet_size):
    codec = Codec(alphabet_size, geometry)
    symbols = data.draw(adversarial(alphabet_size, 500))
    fast = codec.walk(symbols)
    assert fast.shape == (len(symbols), 2)
    assert [tuple(p) for p in fast.tolist()] == naive.walk(symbols, alphabet_size, geometry)


@pytest.mark.parametrize("alphabet_size", [50257, 151936])
def test_large_alphabet_ring_decodes_like_oracle(alphabet_size):
    codec = Codec(alphabet_size, "ring")
    symbols = np.random.default_rng(alphabet_size).integers(0, alphabet_size, 60)
    points = codec.encode(symbols)
    assert naive.decode(points.tolist(), 60, alphabet_size, "ring", codec.span) == \
        symbols.tolist()


# ---------------------------------------------------------------------- lossless round trips
@pytest.mark.parametrize("geometry", GEOMS)
@pytest.mark.parametrize("alphabet_size", ALPHABETS)
@given(data=st.data())
def test_round_trip(geometry, alphabet_size, data):
    codec = Codec(alphabet_size, geometry)
    symbols = data.draw(adversarial(alphabet_size, 10_000))
    points = codec.encode(symbols)
    assert points.dtype == np.float64 and points.shape == (codec.num_spans(len(symbols)), 2)
    assert np.array_equal(codec.decode(points, len(symbols)), symbols)


@pytest.mark.parametrize("geometry", GEOMS)
@given(data=st.data(), alphabet_size=st.sampled_from(ALPHABETS))
def test_ranges_positions_and_wide_streams(geometry, alphabet_size, data):
    codec = Codec(alphabet_size, geometry)
    width = data.draw(st.integers(1, 4))
    n = data.draw(st.integers(1, 400))
    seed = data.draw(st.integers(0, 2**32 - 1))
    rows = np.random.default_rng(seed).integers(0, alphabet_size, (n, width))
    points = codec.encode(rows)
    assert points.shape == (codec.num_spans(n), width, 2)
    for w in range(width):  # a wide stream is W independent streams
        assert np.array_equal(points[:, w, :], codec.encode(rows[:, w]))
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    assert np.array_equal(codec.decode_range(points, n, start, stop), rows[start:stop])
    i = data.draw(st.integers(-n, n - 1))
    assert np.array_equal(codec.decode_position(points, n, i), rows[i])
    col = codec.encode(rows[:, 0])
    assert codec.decode_position(col, n, i) == rows[i, 0]


@pytest.mark.parametrize("geometry", GEOMS)
@given(data=st.data(), alphabet_size=st.sampled_from([2, 5, 256, 50257]))
def test_append_never_reencodes_and_equals_one_shot(geometry, alphabet_size, data):
    codec = Codec(alphabet_size, geometry)
    symbols = data.draw(adversarial(alphabet_size, 300))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(symbols)), max_size=4)))
    points, length = codec.encode(symbols[:0]), 0
    for a, b in zip([0, *cuts], [*cuts, len(symbols)], strict=True):
        before = points.copy()
        points, length = codec.append(points, length, symbols[a:b])
        keep = max(0, codec.num_spans(a) - (1 if a % codec.span else 0))
        assert np.array_equal(points[:keep], before[:keep])  # earlier spans untouched
    assert length == len(symbols)
    assert np.array_equal(points, codec.encode(symbols))


def test_decode_range_reads_only_the_spans_it_needs():
    codec = Codec(256, "ring")
    symbols = np.arange(1000) % 256
    points = codec.encode(symbols)

    class Recording:
        shape = points.shape

        def __init__(self):
            self.slices = []

        def __getitem__(self, key):
            self.slices.append(key)
            return points[key]

    rec = Recording()
    assert codec.decode_position(rec, 1000, 500) == 500 % 256
    assert rec.slices == [slice(500 // codec.span, 500 // codec.span + 1)]


# ---------------------------------------------------------------------- the error bound
@pytest.mark.parametrize("alphabet_size", [2, 3, 4, 5, 6, 27, 256, 1000, 50257, 2**18])
def test_span_is_the_largest_the_bound_allows(alphabet_size):
    codec = Codec(alphabet_size, "ring")
    r = kissing_ratio(alphabet_size)
    margin = 1.0 if alphabet_size == 2 else math.cos(math.pi / alphabet_size)
    m = codec.span
    assert 4 * RING_ERROR / r**m <= margin < 4 * RING_ERROR / r ** (m + 1)
    grid = Codec(alphabet_size, "grid")
    assert grid.span * math.log2(naive.grid_k(alphabet_size)) <= 53


@pytest.mark.parametrize("alphabet_size", [3, 5, 27, 256, 50257])
@given(data=st.data())
def test_stored_point_error_is_within_the_bound(alphabet_size, data):
    """Exact rational arithmetic: the rounding of a whole span stays below RING_ERROR / 8."""
    codec = Codec(alphabet_size, "ring")
    symbols = data.draw(adversarial(alphabet_size, codec.span)).tolist() or [0]
    point = codec.encode(symbols)[0]
    r = Fraction(codec.ratio)
    x = y = Fraction(0)
    for c in symbols:
        t = 2 * math.pi * c / alphabet_size  # exact vertices: the float cos/sin, as rationals
        x = (1 - r) * Fraction(math.cos(t)) + r * x
        y = (1 - r) * Fraction(math.sin(t)) + r * y
    err = math.hypot(float(Fraction(point[0]) - x), float(Fraction(point[1]) - y))
    assert err <= RING_ERROR / 8


# 32 and 33: the largest alphabet classified by dot products, and the smallest by atan2
@pytest.mark.parametrize("alphabet_size", [2, 3, 5, 27, 32, 33, 256, 1024, 50257])
def test_decodes_across_machines_whose_vertices_differ_by_ulps(alphabet_size):
    """Encode with vertices moved by up to 4 ulps (another libm), decode with ours."""
    codec = Codec(alphabet_size, "ring")
    other = Codec(alphabet_size, "ring")
    rng = np.random.default_rng(alphabet_size)
    centres = codec._centres.copy()
    for _ in range(4):
        centres = np.nextafter(centres, np.where(rng.random(centres.shape) < 0.5, -np.inf, np.inf))
    other._centres = centres
    for kind in range(3):
        if kind == 0:
            symbols = rng.integers(0, alphabet_size, 5000)
        elif kind == 1:
            symbols = np.resize([0, alphabet_size - 1], 5000)
        else:
            half = alphabet_size // 2
            symbols = np.resize([half, (half + 1) % alphabet_size], 5000)
        points = other.encode(symbols)
        assert np.array_equal(codec.decode(points, 5000), symbols)
        assert np.array_equal(other.decode(codec.encode(symbols), 5000), symbols)


# ---------------------------------------------------------------------- invalid points
def _flip(value: float, bit: int) -> float:
    (u,) = struct.unpack("<Q", struct.pack("<d", value))
    return struct.unpack("<d", struct.pack("<Q", u ^ (1 << bit)))[0]


@pytest.mark.parametrize("alphabet_size", [3, 5, 27, 256, 50257])
def test_random_ring_points_raise(alphabet_size):
    codec = Codec(alphabet_size, "ring")
    rng = np.random.default_rng(alphabet_size)
    for _ in range(200):
        point = rng.uniform(-1, 1, (1, 2))
        with pytest.raises(InvalidPointError, match="span 0"):
            codec.decode(point, codec.span)


@pytest.mark.parametrize("geometry", GEOMS)
@pytest.mark.parametrize("alphabet_size", [2, 4, 27, 256, 50257])
def test_points_outside_the_hull_nan_and_flipped_exponents_raise(geometry, alphabet_size):
    codec = Codec(alphabet_size, geometry)
    symbols = np.random.default_rng(1).integers(0, alphabet_size, 10 * codec.span)
    points = codec.encode(symbols)
    bad_values = [1.5, -1.5, 2.0, np.nan, np.inf, -np.inf, 1e300]
    for s in (0, 4, 9):
        for coord in (0, 1):
            for v in bad_values + [_flip(points[s, coord], 62)]:  # top exponent bit
                damaged = points.copy()
                damaged[s, coord] = v
                with pytest.raises(InvalidPointError, match=f"span {s} "):
                    codec.decode(damaged, len(symbols))
                # every other span still decodes
                ok = [i for i in range(10) if i != s]
                for i in ok[:2]:
                    lo = i * codec.span
                    assert np.array_equal(codec.decode_range(damaged, len(symbols), lo, lo + 1),
                                          symbols[lo:lo + 1])


def test_grid_points_off_the_lattice_raise():
    codec = Codec(27, "grid")  # 64 cells, 27 symbols: most cells are no symbol
    points = codec.encode(np.arange(27 * 5) % 27)
    damaged = points.copy()
    damaged[2, 0] = np.nextafter(damaged[2, 0], 1.0)  # one ulp: below the last digit
    with pytest.raises(InvalidPointError, match="span 2 .*bits set below"):
        codec.decode(damaged, 27 * 5)
    damaged = points.copy()
    damaged[3, 1] = 0.999  # cells whose y digit is 7 are not symbols
    with pytest.raises(InvalidPointError, match="span 3"):
        codec.decode(damaged, 27 * 5)


def test_errors_are_fkv_errors_and_value_errors():
    assert issubclass(InvalidPointError, FkvError) and issubclass(InvalidPointError, ValueError)


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("geometry", GEOMS)
def test_bad_symbols_name_the_value(geometry):
    codec = Codec(27, geometry)
    with pytest.raises(ValueError, match="got 27 at index 3"):
        codec.encode([1, 2, 3, 27, 4])
    with pytest.raises(ValueError, match="got -1 at index 0"):
        codec.encode(np.array([-1, 2]))
    with pytest.raises(ValueError, match="NaN at index 1"):
        codec.encode([1.0, float("nan")])
    with pytest.raises(TypeError, match="2.5 at index 1"):
        codec.encode([1.0, 2.5])
    with pytest.raises(TypeError, match="integer dtype"):
        codec.encode(np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match="'a' .str. at index 1"):
        codec.encode([1, "a"])
    with pytest.raises(TypeError, match="bool"):
        codec.encode(np.array([True, False]))
    with pytest.raises(ValueError, match="1-D or 2-D"):
        codec.encode(np.zeros((2, 2, 2), dtype=int))
    with pytest.raises(ValueError, match="1-D"):
        codec.walk(np.zeros((2, 2), dtype=int))
    with pytest.raises(ValueError, match="got 18446744073709551615 at index 0"):
        codec.encode(np.array([2**64 - 1], dtype=np.uint64))
    with pytest.raises(ValueError, match=r"got 40 at index \(1, 0\)"):
        codec.encode(np.array([[0, 1], [40, 1]]))


@pytest.mark.parametrize("geometry", GEOMS)
def test_python_sequences_are_checked_element_by_element(geometry):
    # numpy would store True as 1 and turn ints beyond int64 into object or float64 arrays
    codec = Codec(27, geometry)
    with pytest.raises(TypeError, match=r"got True \(bool\) at index 1"):
        codec.encode([1, True])
    with pytest.raises(TypeError, match=r"got False \(bool\) at index \(1, 0\)"):
        codec.encode([[1, 2], [False, 3]])
    with pytest.raises(ValueError, match=f"< alphabet_size=27, got {2**70} at index 1"):
        codec.encode([1, 2**70])
    with pytest.raises(ValueError, match=f"got {2**70} at index \\(1, 1\\)"):
        codec.encode([[1, 2], [3, 2**70]])
    with pytest.raises(ValueError, match=">= 0, got -1 at index 0"):
        codec.encode([-1, 2**63])
    with pytest.raises(ValueError, match=f"got {2**64} at index 1"):
        codec.encode([1, 2**64])
    with pytest.raises(TypeError, match=r"got 2.0 \(float\) at index 1"):
        codec.encode([1, 2.0])
    np.testing.assert_array_equal(codec.decode(codec.encode([1, 2, 26]), 3), [1, 2, 26])


def test_decode_negative_length_names_length():
    codec = Codec(27)
    with pytest.raises(ValueError, match="length must be >= 0, got -1"):
        codec.decode(np.zeros((0, 2)), -1)


def test_bad_input_leaves_points_untouched():
    codec = Codec(27, "ring")
    points = codec.encode(np.arange(20) % 27)
    before = points.copy()
    with pytest.raises(ValueError):
        codec.append(points, 20, [1, 2, 99])
    assert np.array_equal(points, before)


@pytest.mark.parametrize(("args", "kwargs", "exc", "match"), [
    ((1,), {}, ValueError, "alphabet_size must be >= 2, got 1"),
    ((2.5,), {}, TypeError, "alphabet_size must be an integer"),
    ((27,), {"geometry": "hex"}, ValueError, "'hex'"),
    ((27,), {"geometry": "ring", "ratio": 0.2}, ValueError, "kissing ratio"),
    ((27,), {"geometry": "ring", "ratio": -0.1}, ValueError, "-0.1"),
    ((27,), {"geometry": "grid", "ratio": 0.2}, ValueError, "1/k"),
    ((27,), {"span": 0}, ValueError, "span must be >= 1"),
    ((27,), {"span": 18}, ValueError, "span must be <= 17"),
    ((2**31 + 1,), {}, ValueError, "<= 2147483648"),
])
def test_bad_parameters(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        Codec(*args, **kwargs)


def test_decode_argument_checks():
    codec = Codec(256)
    points = codec.encode(np.arange(100) % 256)
    with pytest.raises(ValueError, match="has 16 points with span=13, got 8"):
        codec.decode(points, 200)
    with pytest.raises(ValueError, match="shape"):
        codec.decode(points[:, 0], 100)
    with pytest.raises(ValueError, match="stop must be <= 100"):
        codec.decode_range(points, 100, 0, 101)
    with pytest.raises(IndexError, match="index 100"):
        codec.decode_position(points, 100, 100)
    with pytest.raises(ValueError, match="tail_point must have shape"):
        codec.extend(np.zeros(3), 2, [1])


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize("geometry", GEOMS)
@pytest.mark.parametrize("alphabet_size", [2, 27, 50257])
def test_config_round_trips_through_json(geometry, alphabet_size):
    codec = Codec(alphabet_size, geometry, span=2)
    again = Codec.from_config(json.loads(json.dumps(codec.config())))
    assert again == codec and again.ratio == codec.ratio and again.span == 2
    assert repr(again) == repr(codec)


def test_config_rejects_foreign_dicts():
    cfg = Codec(27).config()
    with pytest.raises(ValueError, match="version 2"):
        Codec.from_config({**cfg, "version": 2})
    with pytest.raises(ValueError, match="unknown"):
        Codec.from_config({**cfg, "colour": 1})
    with pytest.raises(ValueError, match="id="):
        Codec.from_config({**cfg, "id": "zlib"})
