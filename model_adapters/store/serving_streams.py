"""A stream that continues another one: the first ``base`` rows come from the parent.

A forked serving archive stores only what came after the fork point; reads below ``base`` go to
the parent archive (opened read-only), so two continuations share one copy of their past.
:func:`resolve_parent` checks the ``parent`` attribute that names that archive before it is
opened (an attribute of a file from elsewhere is hostile input).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["MAX_PARENTS", "ChainedStream", "file_key", "resolve_parent"]


class ChainedStream:
    """``parent[:base]`` followed by ``own``; writes and truncation touch ``own`` only.

    Args:
        own: an fkvstore stream (rows ``(n, width)``).
        parent: a stream or another :class:`ChainedStream` holding at least ``base`` rows, or
            None (then ``base`` must be 0).
        base: rows taken from the parent.
    """

    def __init__(self, own, parent=None, base: int = 0):
        if parent is None and base:
            raise ValueError(f"base {base} needs a parent stream")
        if parent is not None and len(parent) < base:
            raise ValueError(
                f"the parent holds {len(parent)} rows, fewer than the {base} this fork shares; "
                "was the parent archive cropped after the fork?"
            )
        self.own, self.parent, self.base = own, parent, int(base)

    def __len__(self) -> int:
        return self.base + len(self.own)

    @property
    def codec(self):
        return self.own.codec

    @property
    def alphabet_size(self) -> int:
        return self.own.alphabet_size

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows ``[start, stop)``, ``(n, width)`` int64."""
        stop = len(self) if stop is None else stop
        parts = []
        if start < self.base:
            parts.append(np.asarray(self.parent.read(start, min(stop, self.base))))
        if stop > self.base:
            parts.append(
                np.asarray(self.own.read(max(start, self.base) - self.base, stop - self.base))
            )
        if not parts:
            return np.asarray(self.own.read(0, 0))
        return np.concatenate(parts).astype(np.int64, copy=False)

    def __getitem__(self, idx) -> np.ndarray:
        """Rows at the integer positions ``idx`` (``(n, width)`` int64, in ``idx``'s order)."""
        idx = np.asarray(idx, dtype=np.int64)
        out = np.empty((idx.size, self.own.width), dtype=np.int64)
        below = idx < self.base
        if below.any():
            out[below] = self.parent[idx[below]]
        if (~below).any():
            out[~below] = self.own[idx[~below] - self.base]
        return out

    @property
    def width(self) -> int:
        return self.own.width

    def extend(self, rows) -> None:
        self.own.extend(rows)

    def truncate(self, n: int) -> None:
        """Keep ``n`` rows; refuses to cut into the shared part."""
        if n < self.base:
            raise ValueError(
                f"cannot cut to {n} rows: the first {self.base} belong to the parent archive "
                "(the fork point)"
            )
        self.own.truncate(n - self.base)


#: the most archives a chain of forks may reach through ``parent`` attributes
MAX_PARENTS = 64


def resolve_parent(child, value, root, seen) -> Path:
    """The file a fork's ``parent`` attribute ``value`` names, checked before it is opened.

    ``value`` must be a relative path (from ``child``'s folder) that resolves, symbolic links
    followed, inside ``root``; ``seen`` holds the :func:`file_key` of each file of the chain so
    far (``child`` first) and grows by the result's. Raises
    ``fkvstore.errors.ArchiveParentError`` naming the value: an absolute path, an escape from
    ``root`` (``..`` or a link), a file already in the chain (a cycle), or a chain longer than
    :data:`MAX_PARENTS`.
    """
    from fkvstore.errors import ArchiveParentError

    child = Path(child)
    if not isinstance(value, str) or not value or "\0" in value:
        raise ArchiveParentError(f"{child}: parent attribute {value!r} is not a file name")
    if Path(value).is_absolute():
        raise ArchiveParentError(
            f"{child}: parent {value!r} is an absolute path; a fork names its parent relative "
            "to its own folder"
        )
    if len(seen) > MAX_PARENTS:
        raise ArchiveParentError(
            f"{child}: parent {value!r} would make a chain of more than {MAX_PARENTS} forks"
        )
    root = Path(root).resolve()
    target = (child.parent / value).resolve()
    if not target.is_relative_to(root):
        raise ArchiveParentError(
            f"{child}: parent {value!r} resolves to {str(target)!r}, outside {str(root)!r}; "
            "pass root= naming a folder that holds the whole chain"
        )
    if file_key(target) in seen:
        raise ArchiveParentError(f"{child}: parent {value!r} is already in the chain (a cycle)")
    seen.append(file_key(target))
    return target


def file_key(path) -> tuple:
    """What makes two names one file: device and inode where it exists (hard links included),
    else the resolved path."""
    try:
        st = Path(path).stat()
    except OSError:
        return (str(Path(path).resolve()),)
    return (st.st_dev, st.st_ino)
