"""Input checks shared by the public API: real exceptions that name the offending value."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np


def _first_index(mask: np.ndarray) -> tuple[int, ...]:
    idx = np.argwhere(mask)[0]
    return tuple(int(i) for i in idx)


def _fmt_index(idx: tuple[int, ...]) -> str:
    return str(idx[0]) if len(idx) == 1 else str(idx)


_BOOLS = (bool, np.bool_)


def _check_python_items(symbols, arr: np.ndarray, alphabet_size: int, name: str) -> None:
    """Raise naming the first bool, or int outside int64, among the elements of a sequence.

    ``arr`` is ``np.asarray(symbols)``, of at most 2 dimensions and not empty.
    """
    if arr.dtype.kind not in "iufO":
        return
    flat = _flat(symbols, arr)
    kinds = set(map(type, flat))  # one pass in C; the per-element loops run only on a find
    if kinds.intersection(_BOOLS):
        i = next(i for i, v in enumerate(flat) if isinstance(v, _BOOLS))
        raise TypeError(f"{name} must be integers, got {flat[i]!r} (bool) at index "
                        f"{_fmt_flat(i, arr)}")
    if arr.dtype.kind in "iu" or not all(issubclass(k, (int, np.integer)) for k in kinds):
        return  # fine, or floats, strings, ...: the checks on the array name them
    # all integers, yet numpy could not hold them in an integer dtype: some lie outside int64
    for i, v in enumerate(flat):
        v = int(v)
        if not 0 <= v < alphabet_size:
            bound = ">= 0" if v < 0 else f"< alphabet_size={alphabet_size}"
            raise ValueError(f"{name} must be {bound}, got {v} at index {_fmt_flat(i, arr)}")


def _flat(symbols, arr: np.ndarray) -> list:
    if arr.ndim == 0:
        return [symbols]
    if arr.ndim == 1:
        return list(symbols)
    return [v for row in symbols for v in row]


def _fmt_flat(i: int, arr: np.ndarray) -> str:
    return str(i) if arr.ndim <= 1 else str(divmod(i, arr.shape[1]))


def symbol_array(symbols, alphabet_size: int, *, ndim: tuple[int, ...] = (1, 2),
                 name: str = "symbols", check_range: bool = True) -> np.ndarray:
    """Return ``symbols`` as a C-contiguous integer array, or raise naming the first bad value.

    Accepts any integer array or (nested) sequence or iterator of ints; integer dtypes are kept
    (no copy when already contiguous). Floats, bools, NaN and arrays of the wrong
    dimensionality are rejected; values outside ``[0, alphabet_size)`` too unless
    ``check_range=False`` (the codec's kernels check the range in the same pass that encodes,
    then call :func:`raise_out_of_range`).
    """
    from_python = False
    if isinstance(symbols, Iterator):  # a generator: numpy would take it as one object
        symbols = list(symbols)
    if isinstance(symbols, (bytes, bytearray, memoryview)):
        arr = np.frombuffer(bytes(symbols), dtype=np.uint8)
    else:
        # only Python sequences can hide bools and ints beyond int64 from numpy; arrays,
        # tensors and lists of array rows keep the fast path (walking them costs 10^3-10^4x)
        from_python = isinstance(symbols, (list, tuple)) and not all(
            isinstance(row, np.ndarray) for row in symbols)
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
    if from_python:
        # numpy turns True into 1, mixes ints beyond int64 into float64 or object arrays: look
        # at the Python elements themselves (only for sequences; arrays keep the fast path)
        _check_python_items(symbols, arr, alphabet_size, name)
    if arr.dtype.kind == "f":
        nan = np.isnan(arr)
        if nan.any():
            raise ValueError(f"{name} contain NaN at index {_fmt_index(_first_index(nan))}")
        frac = arr != np.floor(arr)
        if frac.any():
            at = _first_index(frac)
            raise TypeError(f"{name} must be integers, got {arr[at].item()!r} "
                            f"at index {_fmt_index(at)}")
        if from_python:  # whole floats in a sequence: name the first
            for i, v in enumerate(_flat(symbols, arr)):
                if not isinstance(v, (int, np.integer)):
                    raise TypeError(f"{name} must be integers, got {v!r} ({type(v).__name__}) "
                                    f"at index {_fmt_flat(i, arr)}")
        raise TypeError(f"{name} must have an integer dtype, got {arr.dtype} "
                        "(convert with .astype(np.int64) if the values are whole numbers)")
    if arr.dtype.kind not in "iu":
        items = _flat(symbols, arr) if from_python else arr.reshape(-1).tolist()
        for i, v in enumerate(items):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{name} must be integers, got {v!r} ({type(v).__name__}) "
                                f"at index {_fmt_flat(i, arr)}")
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


_NAME = re.compile(r"^[^/.][^/]*$")


def object_name(value: object, what: str) -> str:
    """``value`` as the name of a stream or array: a non-empty str without '/' that does not
    start with '.'; TypeError/ValueError naming it."""
    if not isinstance(value, str):
        raise TypeError(f"{what} name must be a str, got {type(value).__name__} {value!r}")
    if not _NAME.match(value):
        raise ValueError(
            f"invalid {what} name {value!r}: use a non-empty name without '/' that does not "
            "start with '.'"
        )
    return value


def storable_array(array, name: str) -> np.ndarray:
    """``array`` as a numpy array HDF5 stores as is (numeric, bool or fixed-size bytes)."""
    arr = np.asarray(array)
    if arr.dtype.kind not in "biufcS":
        raise TypeError(
            f"array {name!r} has dtype {arr.dtype}, which HDF5 cannot store as is; use a numeric,"
            " bool or fixed-size bytes array (encode text with .astype('S'))"
        )
    return arr


def positive_int(value, name: str) -> int:
    """``value`` as an int >= 1; ValueError naming it for anything else (a size argument of the
    archive, where a wrong type has always been a ValueError too)."""
    try:
        return integer(value, name, low=1)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive int, got {value!r}") from None
