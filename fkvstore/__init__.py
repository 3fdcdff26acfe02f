"""fkvstore: persistent, searchable archives for quantized KV caches.

The core is a lossless iterated-map ("chaos game") codec (:mod:`fkvstore.codec`) that turns a
stream of integer symbols into 2-D points, one stored point per span of symbols.

``import fkvstore`` never imports torch, triton or transformers.
"""

from __future__ import annotations

from fkvstore.archive import Archive, Stream, TextStream, open
from fkvstore.codec import Codec
from fkvstore.collection import Collection, Hit  # imports dask only when a cluster is used
from fkvstore.errors import FkvError

__version__ = "0.1.0"

__all__ = ["Archive", "Codec", "Collection", "FkvError", "Hit", "Stream", "TextStream",
           "__version__", "open"]
