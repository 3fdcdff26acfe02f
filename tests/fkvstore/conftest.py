"""Fixtures of the fkvstore tests."""

from __future__ import annotations

import pytest

import fkvstore


@pytest.fixture
def tmp_archive(tmp_path):
    """A fresh writable archive (mode ``"w"``) at ``tmp_path / "archive.h5"``, closed after the
    test (closing twice is harmless, so a test may close it itself and reopen ``.path``)."""
    ar = fkvstore.open(tmp_path / "archive.h5", "w")
    yield ar
    ar.close()
