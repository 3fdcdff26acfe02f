"""Numba kernels of the suffix index: exact verification from stored span points, and the
brute-force ball query over the small buffer of recently appended positions."""

from __future__ import annotations

import numpy as np

from fkvstore._jit import cached_njit
from fkvstore.codec._kernels import grid_decode, ring_decode


@cached_njit(nogil=True)
def common_suffix(points, length, cands, query, ring, grid_args, ring_args, out):
    """``out[t]``: how many of the query's last symbols the stream ends with at ``cands[t]``
    (capped at the query length), decoding the stream's stored span points ``(S, 1, 2)``
    span by span backward. ``ring`` picks the geometry; the other one's args are unused.
    Returns -1, or the codec's error code for a span that does not decode."""
    span, bits, alphabet_size = grid_args
    centres, inv_ratio, radius2, origin_tol2 = ring_args
    ql = query.shape[0]
    scratch = np.empty((span, 1), dtype=np.int64)
    for t in range(cands.shape[0]):
        matched = 0
        cur = cands[t]
        while matched < ql and cur >= 0:
            base = (cur // span) * span
            if ring:
                err = ring_decode(points, 0, length, base, cur + 1, span, centres, inv_ratio,
                                  radius2, origin_tol2, scratch)
            else:
                err = grid_decode(points, 0, length, base, cur + 1, span, bits, alphabet_size,
                                  scratch)
            if err >= 0:
                return err
            i = cur
            while i >= base and matched < ql and scratch[i - base, 0] == query[ql - 1 - matched]:
                matched += 1
                i -= 1
            if i >= base:  # mismatch inside this span
                break
            cur = base - 1
        out[t] = matched
    return -1


@cached_njit(nogil=True)
def ball_brute(points, qx, qy, radius, offset):
    """Indices (plus ``offset``) of ``points (n, 2)`` within ``radius`` of ``(qx, qy)``."""
    r2 = radius * radius
    hits = np.empty(points.shape[0], dtype=np.int64)
    n = 0
    for i in range(points.shape[0]):
        dx = points[i, 0] - qx
        dy = points[i, 1] - qy
        if dx * dx + dy * dy <= r2:
            hits[n] = i + offset
            n += 1
    return hits[:n]
