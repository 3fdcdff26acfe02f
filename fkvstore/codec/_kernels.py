"""Numba kernels of the chaos-game codec (:mod:`fkvstore.codec.chaos_game` has the definitions).

Every kernel works on a batch of W parallel streams: symbols ``(n, W)``, points ``(S, W, 2)``.
All are compiled with ``cache=True`` and without fastmath, so the float64 results are the same
on every machine for the same inputs (no reassociation, no fused multiply-add contraction).

Encoders return -1, or the flat index of the first symbol outside the alphabet (the output is
then garbage and the caller discards it). Decoders return -1, or ``span * 8 + reason`` for the
first point that does not decode to a valid span.
"""

from __future__ import annotations

import math

import numpy as np

from fkvstore._jit import cached_njit

# reasons a point is rejected (decoded by fkvstore.codec.chaos_game)
BAD_RANGE = 1  # outside the attractor's bounding region (or NaN)
BAD_FRACTION = 2  # grid: bits below the span's last digit are set
BAD_SYMBOL = 3  # grid: a cell that is no symbol (alphabet smaller than k*k)
BAD_ORIGIN = 4  # ring: the backward walk does not return to the origin
FEW_VERTICES = 32  # ring decode: up to this many symbols, classify by dot products


# --------------------------------------------------------------------------------------- grid
@cached_njit(nogil=True)
def _powers_of_k(bits, span):
    """k**j = 2**(bits*j) for j = 0..span, exact in float64."""
    out = np.empty(span + 1)
    v = 1.0
    k = float(1 << bits)
    for j in range(span + 1):
        out[j] = v
        v *= k
    return out


@cached_njit(nogil=True)
def grid_encode(symbols, init, init_count, span, bits, alphabet_size, out):
    """Encode ``symbols (n, W)`` into ``out (S, W, 2)``; the first span continues ``init``."""
    n, width = symbols.shape
    mask = (1 << bits) - 1
    up = _powers_of_k(bits, span)
    pos = 0
    s = 0
    filled = init_count
    while pos < n:
        cnt = min(span - filled, n - pos)
        scale = 1.0 / up[filled + cnt]  # exact: a power of two
        for w in range(width):
            if filled > 0:
                x = np.int64(init[w, 0] * up[filled])
                y = np.int64(init[w, 1] * up[filled])
            else:
                x = np.int64(0)
                y = np.int64(0)
            shift = bits * filled
            for i in range(cnt):
                c = np.int64(symbols[pos + i, w])
                if c < 0 or c >= alphabet_size:
                    return (pos + i) * width + w
                x |= (c & mask) << shift
                y |= (c >> bits) << shift
                shift += bits
            out[s, w, 0] = x * scale
            out[s, w, 1] = y * scale
        pos += cnt
        s += 1
        filled = 0
    return -1


@cached_njit(nogil=True)
def grid_decode(points, first_span, length, start, stop, span, bits, alphabet_size, out):
    """Decode positions ``[start, stop)`` into ``out (stop - start, W)``.

    ``points[j]`` is span ``first_span + j``; ``length`` is the stream's total length.
    """
    width = points.shape[1]
    mask = (1 << bits) - 1
    up = _powers_of_k(bits, span)
    s = start // span
    while s * span < stop:
        base = s * span
        cnt = min(span, length - base)
        scale = up[cnt]
        lo = max(start, base) - base
        hi = min(stop, base + cnt) - base
        j = s - first_span
        for w in range(width):
            fx = points[j, w, 0] * scale
            fy = points[j, w, 1] * scale
            if not (fx >= 0.0 and fx < scale and fy >= 0.0 and fy < scale):
                return s * 8 + BAD_RANGE
            x = np.int64(fx)
            y = np.int64(fy)
            if x != fx or y != fy:
                return s * 8 + BAD_FRACTION
            x >>= bits * lo
            y >>= bits * lo
            for i in range(base + lo - start, base + hi - start):
                c = (x & mask) | ((y & mask) << bits)
                if c >= alphabet_size:
                    return s * 8 + BAD_SYMBOL
                out[i, w] = c
                x >>= bits
                y >>= bits
        s += 1
    return -1


@cached_njit(nogil=True)
def grid_walk(symbols, px, py, bits, alphabet_size, out):
    """Continuous walk p <- (V(c) + p) / k from ``(px, py)``, never restarted: ``out (n, 2)``."""
    mask = (1 << bits) - 1
    inv_k = 1.0 / (1 << bits)
    for i in range(symbols.shape[0]):
        c = np.int64(symbols[i])
        if c < 0 or c >= alphabet_size:
            return i
        px = (float(c & mask) + px) * inv_k
        py = (float(c >> bits) + py) * inv_k
        out[i, 0] = px
        out[i, 1] = py
    return -1


# --------------------------------------------------------------------------------------- ring
@cached_njit(nogil=True)
def ring_encode(symbols, init, init_count, span, centres, ratio, out):
    """Encode with p <- A(c) + r p, A(c) = (1 - r) V(c) = ``centres[c]``; the first span
    continues ``init``. ``centres (N, 2)``: x and y side by side, one cache line per look-up."""
    n, width = symbols.shape
    alphabet_size = centres.shape[0]
    pos = 0
    s = 0
    filled = init_count
    while pos < n:
        cnt = min(span - filled, n - pos)
        for w in range(width):
            px = init[w, 0] if filled > 0 else 0.0
            py = init[w, 1] if filled > 0 else 0.0
            for i in range(cnt):
                c = np.int64(symbols[pos + i, w])
                if c < 0 or c >= alphabet_size:
                    return (pos + i) * width + w
                px = centres[c, 0] + ratio * px
                py = centres[c, 1] + ratio * py
            out[s, w, 0] = px
            out[s, w, 1] = py
        pos += cnt
        s += 1
        filled = 0
    return -1


@cached_njit(nogil=True)
def ring_decode(points, first_span, length, start, stop, span, centres, inv_ratio,
                radius2, origin_tol2, out):
    """Decode positions ``[start, stop)`` by walking each span backward to its origin.

    The cell of a point is its nearest vertex by angle (O(1)); every step checks the point lies
    within ``sqrt(radius2)`` of the centre and the walk must end within ``sqrt(origin_tol2[cnt])``
    of the origin, so a damaged point raises instead of decoding to wrong symbols.
    """
    width = points.shape[1]
    alphabet_size = centres.shape[0]
    per_radian = alphabet_size / (2.0 * math.pi)
    few = alphabet_size <= FEW_VERTICES
    s = start // span
    while s * span < stop:
        base = s * span
        cnt = min(span, length - base)
        lo = max(start, base) - base
        hi = min(stop, base + cnt) - base
        j = s - first_span
        for w in range(width):
            px = points[j, w, 0]
            py = points[j, w, 1]
            for i in range(cnt - 1, -1, -1):
                if not (px * px + py * py <= radius2):
                    return s * 8 + BAD_RANGE
                if few:
                    # largest dot product with the centres: the nearest vertex by angle,
                    # cheaper than atan2 for a handful of vertices
                    k = 0
                    best = px * centres[0, 0] + py * centres[0, 1]
                    for c in range(1, alphabet_size):
                        d = px * centres[c, 0] + py * centres[c, 1]
                        if d > best:
                            best = d
                            k = c
                else:
                    k = np.int64(math.floor(math.atan2(py, px) * per_radian + 0.5))
                    if k < 0:
                        k += alphabet_size
                    elif k >= alphabet_size:
                        k -= alphabet_size
                if i < hi and i >= lo:
                    out[base + i - start, w] = k
                px = (px - centres[k, 0]) * inv_ratio
                py = (py - centres[k, 1]) * inv_ratio
            if not (px * px + py * py <= origin_tol2[cnt]):
                return s * 8 + BAD_ORIGIN
        s += 1
    return -1


@cached_njit(nogil=True)
def ring_walk(symbols, px, py, centres, ratio, out):
    """Continuous walk p <- A(c) + r p from ``(px, py)``, never restarted: ``out (n, 2)``."""
    alphabet_size = centres.shape[0]
    for i in range(symbols.shape[0]):
        c = np.int64(symbols[i])
        if c < 0 or c >= alphabet_size:
            return i
        px = centres[c, 0] + ratio * px
        py = centres[c, 1] + ratio * py
        out[i, 0] = px
        out[i, 1] = py
    return -1
