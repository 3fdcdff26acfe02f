"""The progress bar of ``fkv verify`` and ``fkv demo``: tqdm on stderr when it is installed."""

from __future__ import annotations

import sys

__all__ = ["progress_bar"]


def progress_bar(total: int, desc: str, enabled: bool = True, unit: str = "chunk"):
    """A tqdm bar on stderr, or a do-nothing stand-in when tqdm is missing or disabled."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    if not enabled:
        return _NoBar()
    return tqdm(
        total=total, desc=desc, unit=unit, unit_scale=unit == "B", leave=False, file=sys.stderr
    )


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass
