"""fkvstore: persistent, searchable archives for quantized KV caches.

The core is a lossless iterated-map ("chaos game") codec (:mod:`fkvstore.codec`) that turns a
stream of integer symbols into 2-D points, one stored point per span of symbols.

``import fkvstore`` never imports torch, triton or transformers.

The modules form layers (the README's "Architecture" table, which ``tests/test_layers.py``
checks against every import): errors and input checks; the codec (``codec/``); the suffix
index (``index/``); the HDF5 layout, object storage (``_remote``: reads through a block cache,
the upload) and the copy laid out for it (``_repack``); the open file (``_session``: modes,
lock, recovery, SWMR, the one commit); a stream's stored points (``_stored``), search and
``Stream``; the ``Archive`` facade; search across many archives (``collection``, Dask only
when a cluster is used); then the demo and the ``fkv`` command.
"""

from __future__ import annotations

from fkvstore._version import __version__
from fkvstore.archive import Archive, copy, open
from fkvstore.codec import Codec
from fkvstore.collection import Collection, Hit  # imports dask only when a cluster is used
from fkvstore.errors import FkvError
from fkvstore.stream import Stream, TextStream

__all__ = ["Archive", "Codec", "Collection", "FkvError", "Hit", "Stream", "TextStream",
           "__version__", "copy", "open"]
