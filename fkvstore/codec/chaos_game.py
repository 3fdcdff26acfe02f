"""The chaos-game codec: a lossless map from symbol streams to 2-D points.

A stream of symbols ``c_1, c_2, ...`` over the alphabet ``{0, ..., N-1}`` drives a walk of
points ``p_i = f_{c_i}(p_{i-1})`` where each ``f_c`` contracts the plane by the ratio ``r``
towards the symbol's vertex. The last point of a walk determines every symbol of it, most recent
first, so one float64 point pair is stored per *span* of ``m`` symbols; every span restarts at
the origin and decodes on its own.

Two geometries (``docs/codec.md`` has the definitions, the error bound and measured speed):

``"grid"`` (default)
    Vertices on a k x k lattice (k the smallest power of two with k*k >= N), ``r = 1/k``,
    ``p <- (V(c) + p) / k``. Arithmetic is exact in binary floating point; decoding is digit
    extraction, and any one symbol of a span is read without the others.
``"ring"``
    The paper's code: vertices on the unit circle, ``p <- (1 - r) V(c) + r p`` with ``r`` at or
    below the kissing ratio. The span length follows from a written rounding-error bound, and
    every decode walks back to the origin to prove it decoded correctly.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np

from fkvstore._validate import integer, raise_out_of_range, symbol_array
from fkvstore.codec import _kernels as _k
from fkvstore.errors import InvalidPointError

__all__ = ["Codec", "GEOMETRIES", "kissing_ratio"]

GEOMETRIES = ("grid", "ring")
CONFIG_ID = "fkvstore.chaos"
CONFIG_VERSION = 1

#: unit roundoff of float64
UNIT_ROUNDOFF = 2.0**-53
#: how far (in units of roundoff) another machine's cos/sin may put a vertex from ours
VERTEX_ULPS = 8
#: bound C on the error of a backward ring walk before amplification (docs/codec.md derives it):
#: 14u from rounding in the forward and backward steps, 6 * VERTEX_ULPS * u from vertices
#: computed by two different libms, and the rest (a factor 2) for the angle classification
#: (atan2, or for at most 32 symbols dot products, whose rounding needs about 39u of it).
RING_ERROR = 128 * UNIT_ROUNDOFF
#: the amplified error must stay below 1/RING_CHECK_FACTOR of the cell margin, so the final
#: "back at the origin" test still rejects damaged points
RING_CHECK_FACTOR = 4
MAX_ALPHABET = {"grid": 2**31, "ring": 2**20}
_REASONS = {
    _k.BAD_RANGE: "lies outside the attractor (or is not a finite number)",
    _k.BAD_FRACTION: "has bits set below the span's last symbol (not a grid point)",
    _k.BAD_SYMBOL: "falls in a lattice cell that is no symbol of the alphabet",
    _k.BAD_ORIGIN: "does not walk back to the span's origin",
}


def kissing_ratio(alphabet_size: int) -> float:
    """The ratio at which the N cells of the ring geometry touch: 1/(2(1 + sum cos(2 pi k/N)))."""
    n = integer(alphabet_size, "alphabet_size", low=2)
    if n <= 4:
        return 0.5
    return 1.0 / (2.0 * (1.0 + sum(math.cos(2.0 * math.pi * k / n) for k in range(1, n // 4 + 1))))


def _inradius(alphabet_size: int) -> float:
    """Distance from the centre to the cells' boundaries (the polygon's inradius; 1 for N=2)."""
    return 1.0 if alphabet_size == 2 else math.cos(math.pi / alphabet_size)


def _ring_max_span(alphabet_size: int, ratio: float) -> int:
    margin = _inradius(alphabet_size)
    span = 0
    while RING_CHECK_FACTOR * RING_ERROR / ratio ** (span + 1) <= margin:
        span += 1
    return span


@lru_cache(maxsize=16)
def _ring_centres(alphabet_size: int, ratio: float) -> np.ndarray:
    """A(c) = (1 - r) V(c) for every symbol: float64 ``(N, 2)``, read-only."""
    # math.cos/sin (the C library), so the documented definition is the whole recipe
    scale = 1.0 - ratio
    angles = [2.0 * math.pi * c / alphabet_size for c in range(alphabet_size)]
    centres = np.array([(scale * math.cos(t), scale * math.sin(t)) for t in angles])
    centres.flags.writeable = False
    return centres


class Codec:
    """Lossless chaos-game codec for integer symbol streams.

    Parameters
    ----------
    alphabet_size:
        N, the number of distinct symbols (symbols are ``0 .. N-1``); 2 <= N <= 2**31 for
        ``grid`` and 2**20 for ``ring``.
    geometry:
        ``"grid"`` (default, exact) or ``"ring"`` (the paper's N-gon walk).
    ratio:
        Contraction ratio r. ``grid`` admits only ``1/k``; ``ring`` any ``0 < r <=`` the
        kissing ratio (the default).
    span:
        Symbols per stored point, ``1 <= span <= max_span``; default ``max_span``, the most the
        error bound allows (grid: ``53 // log2(k)``).

    Shapes: a stream is ``(n,)`` or, for W parallel streams sharing the codec, ``(n, W)``;
    its points are float64 ``(S, 2)`` or ``(S, W, 2)`` with ``S = ceil(n / span)``.
    """

    __slots__ = ("_alphabet_size", "_geometry", "_ratio", "_span", "_max_span", "_bits",
                 "_centres", "_inv_ratio", "_radius2", "_origin_tol2")

    def __init__(self, alphabet_size: int, geometry: str = "grid", ratio: float | None = None,
                 span: int | None = None) -> None:
        if geometry not in GEOMETRIES:
            raise ValueError(f"geometry must be one of {GEOMETRIES}, got {geometry!r}")
        n = integer(alphabet_size, "alphabet_size", low=2, high=MAX_ALPHABET[geometry])
        self._alphabet_size = n
        self._geometry = geometry
        if geometry == "grid":
            self._bits = max(1, math.ceil(math.log2(n) / 2))
            while (1 << (2 * self._bits)) < n:  # guard log2 rounding
                self._bits += 1
            while self._bits > 1 and (1 << (2 * (self._bits - 1))) >= n:
                self._bits -= 1
            natural = 1.0 / (1 << self._bits)
            if ratio is not None and float(ratio) != natural:
                raise ValueError(f"the grid geometry's ratio is 1/k = {natural} for "
                                 f"alphabet_size={n}, got ratio={ratio!r}")
            self._ratio = natural
            self._max_span = 53 // self._bits
        else:
            self._bits = 0
            limit = kissing_ratio(n)
            if ratio is None:
                r = limit
            else:
                if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.floating)):
                    raise TypeError(f"ratio must be a float, got {ratio!r}")
                r = float(ratio)
                if not (0.0 < r <= limit):
                    raise ValueError(f"ratio must be in (0, {limit!r}] (the kissing ratio for "
                                     f"alphabet_size={n}), got {ratio!r}")
            self._ratio = r
            self._max_span = _ring_max_span(n, r)
            if self._max_span < 1:
                raise ValueError(f"ratio={r!r} is too small for float64: not even one symbol per "
                                 "point survives the error bound; use a larger ratio")
        if span is None:
            self._span = self._max_span
        else:
            self._span = integer(span, "span", low=1)
            if self._span > self._max_span:
                raise ValueError(f"span must be <= {self._max_span} (the most the float64 error "
                                 f"bound allows for this codec), got {span}")
        if geometry == "ring":
            self._centres = _ring_centres(n, self._ratio)
            self._inv_ratio = 1.0 / self._ratio
            bounds = [RING_ERROR / self._ratio**c for c in range(self._span + 1)]
            self._radius2 = (1.0 + bounds[-1]) ** 2
            self._origin_tol2 = np.array([b * b for b in bounds])

    # ------------------------------------------------------------------ parameters
    @property
    def alphabet_size(self) -> int:
        """N: symbols are ``0 .. N-1``."""
        return self._alphabet_size

    @property
    def geometry(self) -> str:
        """``"grid"`` or ``"ring"``."""
        return self._geometry

    @property
    def ratio(self) -> float:
        """The contraction ratio r of every map."""
        return self._ratio

    @property
    def span(self) -> int:
        """m: symbols per stored point."""
        return self._span

    @property
    def max_span(self) -> int:
        """The largest span the float64 error bound allows for this alphabet and ratio."""
        return self._max_span

    @property
    def bits_per_symbol(self) -> float:
        """Stored bits per symbol in full spans: 128 / span (two float64 per point)."""
        return 128.0 / self._span

    def error_bound(self, count: int | None = None) -> float:
        """Ring: the bound on the distance from the origin where a backward walk of ``count``
        symbols (default: a full span) may end; grid: 0.0 (exact)."""
        if self._geometry == "grid":
            return 0.0
        count = self._span if count is None else integer(count, "count", low=0, high=self._span)
        return RING_ERROR / self._ratio**count

    def num_spans(self, length: int) -> int:
        """Number of stored points for a stream of ``length`` symbols: ceil(length / span)."""
        return -(-length // self._span)

    def config(self) -> dict[str, Any]:
        """Plain JSON-able dict that :meth:`from_config` turns back into an equal codec."""
        return {"id": CONFIG_ID, "version": CONFIG_VERSION, "alphabet_size": self._alphabet_size,
                "geometry": self._geometry, "ratio": self._ratio, "span": self._span}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Codec:
        """Rebuild a codec from :meth:`config`'s dict (as read back from a file)."""
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict, got {type(config).__name__}")
        cfg = dict(config)
        if cfg.pop("id", CONFIG_ID) != CONFIG_ID:
            raise ValueError(f"not a {CONFIG_ID} codec config: id={config.get('id')!r}")
        version = cfg.pop("version", CONFIG_VERSION)
        if version != CONFIG_VERSION:
            raise ValueError(f"codec config version {version!r} is not supported "
                             f"(this fkvstore reads version {CONFIG_VERSION})")
        unknown = set(cfg) - {"alphabet_size", "geometry", "ratio", "span"}
        if unknown:
            raise ValueError(f"unknown codec config keys: {sorted(unknown)}")
        if "alphabet_size" not in cfg:
            raise ValueError("codec config lacks 'alphabet_size'")
        return cls(int(cfg["alphabet_size"]), cfg.get("geometry", "grid"),
                   ratio=cfg.get("ratio"), span=cfg.get("span"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and self.config() == other.config()

    def __hash__(self) -> int:
        return hash(tuple(self.config().items()))

    def __repr__(self) -> str:
        return (f"Codec(alphabet_size={self._alphabet_size}, geometry={self._geometry!r}, "
                f"ratio={self._ratio!r}, span={self._span})")

    # ------------------------------------------------------------------ encoding
    def encode(self, symbols) -> np.ndarray:
        """Encode a stream: ``(n,)`` -> float64 ``(ceil(n/span), 2)``; ``(n, W)`` ->
        ``(ceil(n/span), W, 2)``. Raises before writing anything if a symbol is invalid."""
        return self.extend(None, 0, symbols)

    def extend(self, tail_point, tail_count: int, symbols) -> np.ndarray:
        """Points of the spans from the stream's last span on, after appending ``symbols``.

        ``tail_point`` is the stored point of the stream's last span, which holds
        ``tail_count`` symbols (``0 <= tail_count < span``; pass ``None, 0`` when the stream
        ends on a span boundary). The result's first row replaces that point (or is a new span
        when ``tail_count == 0``); every earlier span is untouched and nothing is re-encoded.
        ``encode(a + b)`` equals ``encode(a)[:-1]`` followed by ``extend(encode(a)[-1], len(a)
        % span, b)`` bit for bit.
        """
        arr = symbol_array(symbols, self._alphabet_size, check_range=False)
        wide = arr.ndim == 2
        sym2 = arr if wide else arr.reshape(-1, 1)
        n, width = sym2.shape
        tail_count = integer(tail_count, "tail_count", low=0, high=self._span - 1)
        init = np.zeros((width, 2))
        if tail_count:
            init = self._check_tail(tail_point, tail_count, width, wide)
        if n == 0:
            out = init.reshape(1, width, 2) if tail_count else np.empty((0, width, 2))
            return out if wide else out[:, 0, :]
        out = np.empty((-(-(n + tail_count) // self._span), width, 2))
        if self._geometry == "grid":
            bad = _k.grid_encode(sym2, init, tail_count, self._span, self._bits,
                                 self._alphabet_size, out)
        else:
            bad = _k.ring_encode(sym2, init, tail_count, self._span, self._centres,
                                 self._ratio, out)
        if bad >= 0:
            raise_out_of_range(arr, self._alphabet_size)
        return out if wide else out[:, 0, :]

    def _check_tail(self, tail_point, tail_count: int, width: int, wide: bool) -> np.ndarray:
        want = (width, 2) if wide else (2,)
        tail = np.asarray(tail_point, dtype=np.float64)
        if tail.shape != want:
            raise ValueError(f"tail_point must have shape {want}, got {tail.shape}")
        tail = tail.reshape(1, width, 2)
        self._decode_into(tail, 0, tail_count, 0, tail_count)  # raises if it is no valid span
        return tail[0].copy()

    def append(self, points, length: int, symbols) -> tuple[np.ndarray, int]:
        """Convenience: ``(points, length)`` of the stream with ``symbols`` appended.

        Only the last (partial) span and the new spans are encoded; the earlier points are
        copied, not recomputed (the archive appends in place instead of copying).
        """
        pts = self._points(points, length)
        length = int(length)
        arr = symbol_array(symbols, self._alphabet_size, check_range=False)
        wide = pts.ndim == 3
        if (arr.ndim == 2) != wide or (wide and arr.shape[1] != pts.shape[1]):
            raise ValueError(f"symbols of shape {arr.shape} do not match points of shape "
                             f"{pts.shape}")
        tail_count = length % self._span
        keep = pts[:-1] if tail_count else pts
        new = self.extend(pts[-1] if tail_count else None, tail_count, arr)
        return np.concatenate([keep, new]), length + arr.shape[0]

    def walk(self, symbols, start=None) -> np.ndarray:
        """The continuous walk: float64 ``(n, 2)``, row i the point after symbol i, never
        restarted (the per-position points a suffix index uses). It starts at the origin, or
        continues from ``start`` (the last point of an earlier walk, shape ``(2,)``), so
        ``walk(a + b) == concat(walk(a), walk(b, start=walk(a)[-1]))`` bit for bit.

        If the ``j`` symbols before positions p and q agree, their points lie within
        ``r**j * diameter`` of each other, where the diameter of the region walked is 1 (ring,
        radius) or sqrt(2) (grid, ``[0, 1)**2``)."""
        arr = symbol_array(symbols, self._alphabet_size, ndim=(1,), check_range=False)
        origin = np.zeros(2)
        if start is not None:
            origin = np.asarray(start, dtype=np.float64)
            if origin.shape != (2,) or not np.isfinite(origin).all():
                raise ValueError(f"start must be a finite point of shape (2,), got {start!r}")
        out = np.empty((arr.shape[0], 2))
        if self._geometry == "grid":
            bad = _k.grid_walk(arr, origin[0], origin[1], self._bits, self._alphabet_size, out)
        else:
            bad = _k.ring_walk(arr, origin[0], origin[1], self._centres, self._ratio, out)
        if bad >= 0:
            raise_out_of_range(arr, self._alphabet_size)
        return out

    @property
    def walk_radius(self) -> float:
        """Largest distance of a walk point from the origin (1 for ring, sqrt(2) for grid)."""
        return math.sqrt(2.0) if self._geometry == "grid" else 1.0

    def kernel_args(self) -> tuple:
        """The codec's parameters in the form the Numba decoders take (for other kernels)."""
        if self._geometry == "grid":
            return (self._span, self._bits, self._alphabet_size)
        return (self._span, self._centres, self._inv_ratio, self._radius2,
                self._origin_tol2)

    # ------------------------------------------------------------------ decoding
    def decode(self, points, length: int) -> np.ndarray:
        """Decode a whole stream of ``length`` symbols: int64 ``(length,)`` or ``(length, W)``."""
        return self.decode_range(points, length, 0, length)

    def decode_range(self, points, length: int, start: int, stop: int) -> np.ndarray:
        """Symbols ``[start, stop)`` of a stream of ``length`` symbols stored as ``points``.

        Reads only ``points[start // span : ceil(stop / span)]`` (by slicing), so ``points`` may
        be an array-like such as an h5py dataset. Returns int64 ``(stop - start,)`` or
        ``(stop - start, W)``. Raises :class:`~fkvstore.errors.InvalidPointError` naming the
        span if a point is not a valid encoding.
        """
        if not (type(length) is int and type(start) is int and type(stop) is int):
            length = integer(length, "length", low=0)
            start = integer(start, "start", low=0)
            stop = integer(stop, "stop", low=0)
        if not 0 <= start <= stop <= length:
            integer(length, "length", low=0)
            integer(start, "start", low=0, high=length)
            integer(stop, "stop", low=start, high=length)
        shape = self._points_shape(points, length)
        first = start // self._span
        raw = points[first:-(-stop // self._span)]
        if type(raw) is not np.ndarray or raw.dtype != np.float64:
            raw = np.asarray(raw, dtype=np.float64)
        if len(shape) == 2:
            raw = raw.reshape(raw.shape[0], 1, 2)
        if not raw.flags.c_contiguous:
            raw = np.ascontiguousarray(raw)
        out = self._decode_into(raw, first, length, start, stop)
        return out if len(shape) == 3 else out[:, 0]

    def decode_position(self, points, length: int, index: int):
        """The symbol at ``index`` (negative counts from the end): decodes one span only.

        Returns a Python int, or an int64 ``(W,)`` array for W parallel streams."""
        length = integer(length, "length", low=0)
        i = integer(index, "index")
        if not -length <= i < length:
            raise IndexError(f"index {index} out of range for a stream of {length} symbols")
        i %= length
        out = self.decode_range(points, length, i, i + 1)
        return out[0] if out.ndim == 2 else int(out[0])

    def _decode_into(self, pts: np.ndarray, first: int, length: int, start: int,
                     stop: int) -> np.ndarray:
        out = np.empty((stop - start, pts.shape[1]), dtype=np.int64)
        if self._geometry == "grid":
            err = _k.grid_decode(pts, first, length, start, stop, self._span, self._bits,
                                 self._alphabet_size, out)
        else:
            err = _k.ring_decode(pts, first, length, start, stop, self._span, self._centres,
                                 self._inv_ratio, self._radius2, self._origin_tol2, out)
        if err >= 0:
            span, reason = divmod(int(err), 8)
            lo = span * self._span
            hi = min(lo + self._span, length)
            raise InvalidPointError(
                f"span {span} (positions {lo}..{hi - 1}): its point {_REASONS[reason]}; "
                "the stored data is damaged or was not written by this codec "
                f"({self!r})")
        return out

    def _points_shape(self, points, length: int) -> tuple[int, ...]:
        shape = points.shape if hasattr(points, "shape") else np.shape(points)
        if len(shape) not in (2, 3) or shape[-1] != 2:
            raise ValueError(f"points must have shape (S, 2) or (S, W, 2), got {shape}")
        if shape[0] != self.num_spans(length):
            raise ValueError(f"a stream of {length} symbols has {self.num_spans(length)} points "
                             f"with span={self._span}, got {shape[0]}")
        return shape

    def _points(self, points, length: int) -> np.ndarray:
        self._points_shape(points, integer(length, "length", low=0))
        return np.asarray(points, dtype=np.float64)
