"""fkvstore: persistent, searchable archives for quantized KV caches.

The core is a lossless iterated-map ("chaos game") codec (:mod:`fkvstore.codec`) that turns a
stream of integer symbols into 2-D points, one stored point per span of symbols.

``import fkvstore`` never imports torch, triton or transformers.

Layers (imports flow one way: a module imports only from its own row or rows above it)

=====  ===========================================  ==============================================
layer  modules                                      role
=====  ===========================================  ==============================================
0      ``errors``, ``_validate``, ``_progress``     exceptions, input checks, the progress bar
1      ``codec/`` (``chaos_game``, ``_kernels``)    the chaos-game codec and its Numba kernels
2      ``index/`` (``suffix``, ``_kernels``)        suffix index on the walk (needs the codec)
3      ``layout``, ``_superblock``, ``_lock``,      the HDF5 layout, superblock repair, writer
       ``_attrs``                                   lock, user attributes
4      ``_session``                                 the open file: modes, lock, recovery, SWMR,
                                                    structural changes, THE commit
5      ``_stored``, ``stream_search``, ``stream``   a stream's stored points and chunk cache;
                                                    search; Stream, TextStream
6      ``archive``                                  the facade: ``open``, ``Archive``
7      ``demo``                                     the demo (uses the public API)
8      ``cli``                                      the ``fkv`` command
=====  ===========================================  ==============================================
"""

from __future__ import annotations

from fkvstore.archive import Archive, open
from fkvstore.codec import Codec
from fkvstore.errors import FkvError
from fkvstore.stream import Stream, TextStream

__version__ = "0.1.0"

__all__ = ["Archive", "Codec", "FkvError", "Stream", "TextStream", "__version__", "open"]
