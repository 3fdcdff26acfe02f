"""Slow, obviously correct oracles for the fast code paths (plain Python, no Numba).

Written from the definitions in docs/codec.md, not from fkvstore's kernels.
"""

from __future__ import annotations

import math

import numpy as np


def grid_k(alphabet_size: int) -> int:
    """Smallest power of two k with k * k >= N."""
    k = 2
    while k * k < alphabet_size:
        k *= 2
    return k


def ring_ratio(alphabet_size: int) -> float:
    if alphabet_size <= 4:
        return 0.5
    cosines = 0.0  # the sum first, then 1 + sum: the order docs/codec.md defines
    for j in range(1, alphabet_size // 4 + 1):
        cosines += math.cos(2.0 * math.pi * j / alphabet_size)
    return 1.0 / (2.0 * (1.0 + cosines))


def ring_centre(c: int, alphabet_size: int, ratio: float) -> tuple[float, float]:
    """A(c) = (1 - r) V(c), V(c) on the unit circle at angle 2 pi c / N."""
    t = 2.0 * math.pi * c / alphabet_size
    return (1.0 - ratio) * math.cos(t), (1.0 - ratio) * math.sin(t)


def walk(symbols, alphabet_size: int, geometry: str, ratio: float | None = None):
    """Every point of the walk from the origin: list of (x, y)."""
    x = y = 0.0
    out = []
    if geometry == "grid":
        k = grid_k(alphabet_size)
        for c in symbols:
            x = (c % k + x) / k
            y = (c // k + y) / k
            out.append((x, y))
    else:
        r = ring_ratio(alphabet_size) if ratio is None else ratio
        for c in symbols:
            ax, ay = ring_centre(c, alphabet_size, r)
            x = ax + r * x
            y = ay + r * y
            out.append((x, y))
    return out


def encode(symbols, alphabet_size: int, geometry: str, span: int, ratio: float | None = None):
    """One point per span of ``span`` symbols, each span walked from the origin."""
    symbols = [int(c) for c in symbols]
    points = []
    for s in range(0, len(symbols), span):
        points.append(walk(symbols[s:s + span], alphabet_size, geometry, ratio)[-1])
    return points


def decode_span(point, count: int, alphabet_size: int, geometry: str,
                ratio: float | None = None) -> list[int]:
    """Walk one span's point backward ``count`` steps; the grid reads the leading base-k digit,
    the ring picks the nearest of all N cell centres (O(N) per symbol: the paper's method)."""
    x, y = point
    out = []
    if geometry == "grid":
        k = grid_k(alphabet_size)
        for _ in range(count):
            dx, dy = math.floor(x * k), math.floor(y * k)
            out.append(dy * k + dx)
            x, y = x * k - dx, y * k - dy
    else:
        r = ring_ratio(alphabet_size) if ratio is None else ratio
        idx = np.arange(alphabet_size)
        t = 2.0 * math.pi * idx / alphabet_size
        cx, cy = (1.0 - r) * np.cos(t), (1.0 - r) * np.sin(t)
        for _ in range(count):
            c = int(np.argmin((cx - x) ** 2 + (cy - y) ** 2))
            out.append(c)
            ax, ay = ring_centre(c, alphabet_size, r)
            x, y = (x - ax) / r, (y - ay) / r
    return out[::-1]


def decode(points, length: int, alphabet_size: int, geometry: str, span: int,
           ratio: float | None = None) -> list[int]:
    out: list[int] = []
    for s, point in enumerate(points):
        count = min(span, length - s * span)
        out.extend(decode_span(point, count, alphabet_size, geometry, ratio))
    return out


def find_all(haystack, needle) -> list[int]:
    """Positions of the last symbol of every occurrence of ``needle`` (overlaps included)."""
    h, n = list(haystack), list(needle)
    return [i + len(n) - 1 for i in range(len(h) - len(n) + 1) if h[i:i + len(n)] == n]


def longest_suffix(haystack, query, k: int):
    """The k (position, common-suffix length) pairs with the longest common suffix (>= 1),
    ties to the most recent position."""
    h, q = list(haystack), list(query)
    scored = []
    for p in range(len(h)):
        n = 0
        while n < len(q) and n <= p and h[p - n] == q[len(q) - 1 - n]:
            n += 1
        if n:
            scored.append((p, n))
    scored.sort(key=lambda pn: (-pn[1], -pn[0]))
    return scored[:k]


def find_bytes(data: bytes, query: bytes) -> list[int]:
    """Start offsets of every (overlapping) occurrence, by a plain ``bytes.find`` loop."""
    out, i = [], data.find(query)
    while i >= 0:
        out.append(i)
        i = data.find(query, i + 1)
    return out
