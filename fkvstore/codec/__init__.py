"""The codec layer: the chaos-game codec (:mod:`.chaos_game`) and its Numba kernels
(:mod:`._kernels`). Depends on ``errors`` and ``_validate`` only."""

from __future__ import annotations

from fkvstore.codec.chaos_game import (
    CONFIG_ID,
    CONFIG_VERSION,
    GEOMETRIES,
    MAX_ALPHABET,
    RING_CHECK_FACTOR,
    RING_ERROR,
    UNIT_ROUNDOFF,
    VERTEX_ULPS,
    Codec,
    kissing_ratio,
)

__all__ = [
    "CONFIG_ID",
    "CONFIG_VERSION",
    "GEOMETRIES",
    "MAX_ALPHABET",
    "RING_CHECK_FACTOR",
    "RING_ERROR",
    "UNIT_ROUNDOFF",
    "VERTEX_ULPS",
    "Codec",
    "kissing_ratio",
]
