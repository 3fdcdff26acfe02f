"""Input checks shared by the public API: real exceptions that name the offending value."""

from __future__ import annotations

import numpy as np


def _first_index(mask: np.ndarray) -> tuple[int, ...]:
    idx = np.argwhere(mask)[0]
    return tuple(int(i) for i in idx)


def _fmt_index(idx: tuple[int, ...]) -> str:
    return str(idx[0]) if len(idx) == 1 else str(idx)


def symbol_array(symbols, alphabet_size: int, *, ndim: tuple[int, ...] = (1, 2),
                 name: str = "symbols", check_range: bool = True) -> np.ndarray:
    """Return ``symbols`` as a C-contiguous integer array, or raise naming the first bad value.

    Accepts any integer array or (nested) sequence of ints; integer dtypes are kept (no copy when
    already contiguous). Floats, bools, NaN and arrays of the wrong dimensionality are rejected;
    values outside ``[0, alphabet_size)`` too unless ``check_range=False`` (the codec's kernels
    check the range in the same pass that encodes, then call :func:`raise_out_of_range`).
    """
    if isinstance(symbols, (bytes, bytearray, memoryview)):
        arr = np.frombuffer(bytes(symbols), dtype=np.uint8)
    else:
        try:
            arr = np.asarray(symbols)
        except (ValueError, TypeError) as exc:  # ragged nested sequences
            raise ValueError(f"{name} must be a rectangular array of integers: {exc}") from None
    if arr.ndim not in ndim:
        want = " or ".join(f"{d}-D" for d in ndim)
        raise ValueError(f"{name} must be {want}, got shape {arr.shape}")
    if arr.size == 0:  # an empty list arrives as float64; nothing to check
        return np.zeros(arr.shape, dtype=np.int64)
    if arr.dtype.kind == "b":
        raise TypeError(f"{name} must be integers, got booleans (dtype bool)")
    if arr.dtype.kind == "f":
        nan = np.isnan(arr)
        if nan.any():
            raise ValueError(f"{name} contain NaN at index {_fmt_index(_first_index(nan))}")
        frac = arr != np.floor(arr)
        if frac.any():
            i = _first_index(frac)
            raise TypeError(f"{name} must be integers, got {arr[i].item()!r} "
                            f"at index {_fmt_index(i)}")
        raise TypeError(f"{name} must have an integer dtype, got {arr.dtype} "
                        "(convert with .astype(np.int64) if the values are whole numbers)")
    if arr.dtype.kind not in "iu":
        items = symbols if isinstance(symbols, (list, tuple)) else arr.reshape(-1).tolist()
        for i, v in enumerate(items):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{name} must be integers, got {v!r} ({type(v).__name__}) "
                                f"at index {i}")
        raise TypeError(f"{name} must be integers, got an array of dtype {arr.dtype}")
    if check_range and arr.size and (arr.min() < 0 or arr.max() >= alphabet_size):
        raise_out_of_range(arr, alphabet_size, name)
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8:
        if arr.max() >= alphabet_size:
            raise_out_of_range(arr, alphabet_size, name)
        arr = arr.astype(np.int64)  # uint64 would mix signedness in the kernels
    return np.ascontiguousarray(arr)


def raise_out_of_range(arr: np.ndarray, alphabet_size: int, name: str = "symbols") -> None:
    """Raise ValueError naming the first symbol of ``arr`` outside ``[0, alphabet_size)``."""
    bad = (arr < 0) | (arr >= alphabet_size)
    i = _first_index(bad)
    value = int(arr[i])
    bound = ">= 0" if value < 0 else f"< alphabet_size={alphabet_size}"
    raise ValueError(f"{name} must be {bound}, got {value} at index {_fmt_index(i)}")


def integer(value, name: str, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as a Python int within ``[low, high]``; TypeError/ValueError naming it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return value
