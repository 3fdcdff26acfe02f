"""The library version (one place: the package and the files it writes both read it)."""

__version__ = "0.1.0"
