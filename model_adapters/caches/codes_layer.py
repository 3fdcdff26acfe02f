"""What the two layers of the codes-only cache share: no dense K/V, the transit hand-over,
crops through the cache, no offloading, the tensors held by kind."""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from model_adapters.caches.codes_attention import Transit

__all__ = ["CodesLayer", "NoDenseKeysError"]


class NoDenseKeysError(RuntimeError):
    """A codes-only layer's ``keys``/``values`` were read: it holds no dense K/V tensor."""


class CodesLayer(CacheLayerMixin):
    """Base of :class:`~model_adapters.caches.codes_only.CodesOnlyLayer` and
    :class:`~model_adapters.caches.static_codes.StaticCodesLayer`. A subclass names its
    exact tensors in ``WINDOW_TENSORS`` and its codes in ``CODE_TENSORS`` and sets
    ``layer_idx``, ``cache`` and ``transit``."""

    is_sliding = False
    WINDOW_TENSORS: tuple[str, ...] = ()
    CODE_TENSORS = ("key_codes", "value_codes")

    # transformers' DynamicLayer keeps every position in ``keys``/``values``; this layer has no
    # such tensor, and a partial one (the exact window) would be read as the whole cache
    def _no_dense(self):
        raise NoDenseKeysError(
            f"codes-only layer {self.layer_idx} holds no dense keys/values "
            f"({self.get_seq_length()} positions, most of them codes); call layer.dense() for "
            "every position's K and V (archived ones reconstructed)")

    def _set_dense(self, value) -> None:
        if value is not None:  # CacheLayerMixin.__init__ sets None; nothing else may set them
            raise NoDenseKeysError(f"codes-only layer {self.layer_idx} takes no dense keys/values")

    keys = property(_no_dense, _set_dense)
    values = property(_no_dense, _set_dense)

    @property
    def backend(self) -> str:
        return self.cache.backend

    def take_transit(self) -> Transit | None:
        """This forward's transit (None if no position left the window inside the chunk),
        handed over once: the attention function calls this."""
        transit, self.transit = self.transit, None
        return transit

    def crop(self, tokens_to_remove: int) -> None:
        self.cache.crop(tokens_to_remove)

    def offload(self):
        raise NotImplementedError("the codes-only cache does not offload (it is small already)")

    prefetch = offload

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this layer holds, by kind (``window``: exact K/V, ``codes``)."""
        if not self.is_initialized:
            return {"window": [], "codes": []}
        return {"window": [getattr(self, n) for n in self.WINDOW_TENSORS],
                "codes": [getattr(self, n) for n in self.CODE_TENSORS]}
