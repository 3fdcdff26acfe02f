"""Numba compilation with an on-disk cache where one can be written, and without one elsewhere.

``numba.njit(cache=True)`` raises ``RuntimeError`` when the function is defined (so at
``import fkvstore``) if no cache folder is writable: not ``__pycache__`` beside the source (a
read-only install), not ``NUMBA_CACHE_DIR``, not the user's cache folder (a read-only or
missing ``HOME``). The kernels then compile in every process instead (a few seconds on first
use), with the same results: caching changes no code.
"""

from __future__ import annotations

from collections.abc import Callable

from numba import njit

__all__ = ["cached_njit"]


def cached_njit(**options) -> Callable:
    """A decorator: ``numba.njit(cache=True, **options)``, or ``numba.njit(**options)`` where
    numba finds no writable cache folder for the function's source file."""

    def compile_(fn):
        try:
            return njit(cache=True, **options)(fn)
        except RuntimeError as exc:
            if "no locator available" not in str(exc):
                raise
            return njit(**options)(fn)

    return compile_
