"""User attributes of an archive or a stream, and the check that HDF5 can store them."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping

import h5py

from fkvstore import layout
from fkvstore.errors import ChecksumError

__all__ = ["Attrs", "check_attrs_storable"]


class Attrs(MutableMapping):
    """User attributes of an archive or stream (names starting with ``fkv_`` are reserved).

    ``session``: the archive's :class:`~fkvstore._session.Session`; ``group_path``: the HDF5
    group whose attributes these are (``"/"`` for the archive)."""

    def __init__(self, session, group_path: str):
        self._session = session
        self._path = group_path

    def _group(self) -> h5py.Group:
        return self._session.h5[self._path]

    def _check_key(self, key: object) -> str:
        if not isinstance(key, str):
            raise TypeError(f"attribute names are str, got {type(key).__name__} {key!r}")
        if key.startswith(layout.RESERVED_PREFIX):
            raise ValueError(
                f"attribute name {key!r} is reserved (prefix {layout.RESERVED_PREFIX!r}); "
                "choose another name"
            )
        return key

    def __getitem__(self, key: str):
        if not isinstance(key, str) or key.startswith(layout.RESERVED_PREFIX):
            raise KeyError(key)
        with layout.damaged_metadata(f"attribute {key!r} of {self._path!r}"):
            present = key in self._group().attrs
            value = self._group().attrs[key] if present else None
        if not present:
            raise KeyError(key)
        self._check()
        return value.decode("utf-8") if isinstance(value, bytes) else value

    def __setitem__(self, key: str, value) -> None:
        key = self._check_key(key)
        if (isinstance(value, str) and "\0" in value) or (isinstance(value, bytes)
                                                           and b"\0" in value):
            raise ValueError(f"attribute {key!r}: HDF5 strings cannot hold a NUL character "
                             f"({value!r}); store it as a uint8 array instead")
        check_attrs_storable({key: value}, repr(self._path))  # before the file is touched
        with self._session.structural():
            self._check()  # never seal damage in
            self._group().attrs[key] = value
            layout.seal_attrs(self._group())

    def __delitem__(self, key: str) -> None:
        key = self._check_key(key)
        if key not in self:
            raise KeyError(key)
        with self._session.structural():
            self._check()
            del self._group().attrs[key]
            layout.seal_attrs(self._group())

    def __iter__(self) -> Iterator[str]:
        with layout.damaged_metadata(f"the attributes of {self._path!r}"):
            keys = list(self._group().attrs.keys())
        return iter([k for k in keys if not k.startswith(layout.RESERVED_PREFIX)])

    def _check(self) -> None:
        """ChecksumError when the user attributes do not match their stored CRC-32."""
        problem = layout.attrs_problem(self._group(), user=True)
        if problem is not None:
            raise ChecksumError(problem)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"<fkvstore attrs {dict(self.items())!r}>"


def check_attrs_storable(attrs: dict, what: str) -> None:
    """Raise (TypeError, ValueError) for an attribute HDF5 cannot store, before the file is
    touched: the values are tried on a throwaway in-memory HDF5 file."""
    if not attrs:
        return
    with h5py.File(f"fkv-attr-check-{id(attrs)}", "w", driver="core", backing_store=False) as f:
        for k, v in attrs.items():
            if not isinstance(k, str):
                raise TypeError(f"attribute names of {what} must be str, got {k!r}")
            try:
                f.attrs[k] = v
            except (TypeError, ValueError) as exc:
                raise type(exc)(
                    f"attribute {k!r} of {what} cannot be stored by HDF5 ({exc}); nothing was "
                    "written"
                ) from exc
