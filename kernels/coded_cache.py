"""One layer's cache as decode attention reads it, and one decode call over it.

:class:`CodedCache` is the single representation of a decode step's cache shared by the kernel
API, the torch reference and the codes-only serving cache of ``model_adapters``: exact sink
tokens, archived positions held as residual-VQ codes, exact recent tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CodedCache:
    """Sinks, RVQ-coded archive and recents of one layer, all attended jointly.

    Attributes:
        key_codes: ``(batch, kv_heads, archived, key_stages)``, uint8 (codebook size <= 256)
            or int16 (<= 32768).
        value_codes: ``(batch, kv_heads, archived, value_stages)``, likewise.
        key_codebooks: ``(kv_heads, key_stages, codebook_size, head_dim)``, float16, bfloat16
            or float32; a key is the sum over stages of the centroids its codes select.
        value_codebooks: ``(kv_heads, value_stages, codebook_size, head_dim)``, likewise.
        sink_keys, sink_values: ``(batch, kv_heads, sinks, head_dim)`` in the query's dtype;
            ``sinks`` may be 0 (never ``None``).
        recent_keys, recent_values: ``(batch, kv_heads, recent, head_dim)``, likewise.
        sink_lengths, archived_lengths, recent_lengths: ``(batch,)`` int32 on the query's
            device, the valid entries of each segment per sequence; ``None`` means all of it.

    Building one checks nothing: :func:`kernels.validate_coded_cache` does, once, for a cache
    whose contents come from outside (the serving cache validates its codebooks when built
    and then trusts the codes its own encoder produces).
    """

    key_codes: torch.Tensor
    value_codes: torch.Tensor
    key_codebooks: torch.Tensor
    value_codebooks: torch.Tensor
    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    recent_keys: torch.Tensor
    recent_values: torch.Tensor
    sink_lengths: torch.Tensor | None = None
    archived_lengths: torch.Tensor | None = None
    recent_lengths: torch.Tensor | None = None

    @property
    def archived(self) -> int:
        """Archived positions held (the codes' capacity; the valid ones per sequence are
        ``archived_lengths``)."""
        return self.key_codes.shape[2]

    @property
    def kv_heads(self) -> int:
        return self.key_codebooks.shape[0]

    def with_lengths(self) -> CodedCache:
        """This cache with every ``None`` length filled in (the whole segment), int32 on the
        codes' device."""
        batch, device = self.key_codes.shape[0], self.key_codes.device

        def full(lengths, n):
            if lengths is not None:
                return lengths
            return torch.full((batch,), n, dtype=torch.int32, device=device)

        return CodedCache(
            self.key_codes, self.value_codes, self.key_codebooks, self.value_codebooks,
            self.sink_keys, self.sink_values, self.recent_keys, self.recent_values,
            full(self.sink_lengths, self.sink_keys.shape[2]),
            full(self.archived_lengths, self.archived),
            full(self.recent_lengths, self.recent_keys.shape[2]))


@dataclass(frozen=True)
class DecodeProblem:
    """One decode call: ``query`` ``(batch, q_heads, head_dim)`` float16/bfloat16 over
    ``cache`` (every length filled in) with softmax ``scale``."""

    query: torch.Tensor
    cache: CodedCache
    scale: float

    @property
    def batch(self) -> int:
        return self.query.shape[0]

    @property
    def q_heads(self) -> int:
        return self.query.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.cache.kv_heads

    @property
    def head_dim(self) -> int:
        return self.query.shape[2]
