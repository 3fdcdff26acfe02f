"""The layers of :class:`~model_adapters.caches.fsq_cache.FSQCache`: one FSQ-converted
attention layer's packed code rows (and, in the first layer, every token's RoPE position),
growing (:class:`FsqLayer`) or in buffers allocated once for a capacity
(:class:`StaticFsqLayer`: appends in place, the length also on the device, a decode step that
``torch.compile`` traces without reading anything back)."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from model_adapters.caches.static_codes import CapacityError
from model_adapters.caches.window import crop_target

__all__ = ["FsqLayer", "StaticFsqLayer"]


class FsqLayer(DynamicLayer):
    """One layer's packed codes, kept as ``keys`` ``(batch, 1, seq, packed_bytes)`` uint8 so that
    transformers' batch and beam operations (select, repeat, reorder, crop) apply unchanged.
    ``values`` holds the tokens' RoPE positions ``(batch, 1, seq, 1)`` int64 in the layer that
    keeps them (the first; 8 bytes per token for the whole cache), else an empty ``(batch, 1,
    seq, 0)`` placeholder."""

    def __init__(self, keeps_positions: bool = False):
        super().__init__()
        self.keeps_positions = keeps_positions

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError("FSQCache holds FSQ codes and serves FSQ-converted models only (this "
                        "model handed it dense keys and values)")

    def append(self, packed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Append ``(batch, n, packed_bytes)`` uint8 codes at ``(batch, n)`` int64 positions;
        returns every row, ``(batch, seq, packed_bytes)``."""
        rows = packed[:, None]
        extra = positions[:, None, :, None] if self.keeps_positions else rows[..., :0]
        DynamicLayer.update(self, rows, extra)
        return self.keys[:, 0]

    def positions(self) -> torch.Tensor:
        """``(batch, seq)`` int64 positions (the layer that keeps them)."""
        return self.values[:, 0, :, 0]

    def codes(self) -> torch.Tensor | None:
        """``(batch, seq, packed_bytes)`` uint8, or None before the first token."""
        return None if not self.is_initialized or self.keys.numel() == 0 else self.keys[:, 0]

    def crop(self, tokens_to_remove: int) -> None:
        """Both transformers conventions (:func:`~model_adapters.caches.window.crop_target`)."""
        keep = crop_target(tokens_to_remove, self.get_seq_length())
        if self.is_initialized and keep < self.get_seq_length():
            self.keys = self.keys[..., :keep, :]
            self.values = self.values[..., :keep, :]


class StaticFsqLayer(FsqLayer):
    """One layer's packed codes in buffers allocated once for ``capacity`` positions (the
    layer of :class:`FSQCache` built with ``capacity=N``): ``keys`` ``(batch, 1, capacity + 1,
    packed_bytes)`` uint8 (the last row is scratch, see :meth:`step`), ``values`` the
    positions ``(batch, 1, capacity + 1, 1)`` int64 (or an empty placeholder), ``lengths`` the
    length as a ``(batch,)`` int32 tensor on the buffers' device. Appends write in place, so
    the buffers keep their address from step to step: an eager decode step's kernel call is
    captured once and replayed, and ``torch.compile`` traces a decode step (:meth:`step`)
    whose graph serves every later length (the kernel reads ``lengths`` on the device: nothing
    is read back)."""

    is_compileable = True

    def __init__(self, capacity: int, keeps_positions: bool = False):
        super().__init__(keeps_positions)
        self.capacity = capacity
        self.length: int | None = 0  # the device length, when the host knows it
        self.lengths: torch.Tensor | None = None
        self.visible: bool | None = None  # decode steps see every position (checked once)
        self.consecutive = True  # every position is its index (prompts checked, steps trusted)

    def append(self, packed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Write ``(batch, n, packed_bytes)`` codes at ``(batch, n)`` positions after the
        current length; returns the rows in use, a view ``(batch, length, packed_bytes)``.
        Past the capacity: :class:`CapacityError`, nothing written."""
        batch, n = packed.shape[:2]
        length = self.known_length()
        if length + n > self.capacity:
            raise CapacityError(f"FSQCache(capacity={self.capacity}) holds {length} "
                                f"positions; {n} more do not fit")
        if not self.is_initialized:
            self.device = packed.device
            self.keys = packed.new_zeros(batch, 1, self.capacity + 1, packed.shape[2])
            self.values = positions.new_zeros(batch, 1, self.capacity + 1,
                                              1 if self.keeps_positions else 0)
            self.lengths = torch.zeros(batch, dtype=torch.int32, device=packed.device)
            self.is_initialized = True
            self._mark_static()
        if self.keys.shape[0] != batch:
            raise ValueError(f"this FSQCache holds a batch of {self.keys.shape[0]}, got codes "
                             f"for {batch}")
        end = length + n
        if self.keeps_positions and n > 1:  # (one read-back per prompt)
            index = torch.arange(length, end, device=positions.device)
            self.consecutive = self.consecutive and bool((positions == index).all())
        self.keys[:, 0, length:end] = packed
        if self.keeps_positions:
            self.values[:, 0, length:end, 0] = positions
        self._set_length(end)
        if n > 1:
            self.visible = None  # a new prompt: its first decode step checks the mask again
        return self.keys[:, 0, :end]

    def step(self, packed: torch.Tensor, positions: torch.Tensor) -> None:
        """Append one position per sequence on the device only (what a compiled decode step
        runs): ``(batch, 1, packed_bytes)`` codes at ``(batch, 1)`` positions, written at
        row ``lengths`` (the scratch row once the capacity is reached: nothing can raise
        inside a graph, so the next eager call that learns the length raises
        :class:`CapacityError`), and the length grows by one."""
        slot = self.lengths[:1].long().clamp(max=self.capacity)
        self.keys.index_copy_(2, slot, packed[:, None])
        if self.keeps_positions:
            self.values.index_copy_(2, slot, positions[:, None, :, None])
        self.lengths.add_(1)
        self.length = None

    def attended(self) -> torch.Tensor:
        """``(batch,)`` int32 positions a decode step attends (the length, at most the
        capacity), computed on the device."""
        return self.lengths.clamp(max=self.capacity)

    def _mark_static(self) -> None:
        """Tell ``torch.compile`` the buffers keep their address (updated in place), so CUDA
        graphs read them where they are."""
        if not torch.compiler.is_compiling():
            for t in (self.keys, self.values, self.lengths):
                torch._dynamo.mark_static_address(t)

    def _set_length(self, length: int) -> None:
        self.length = length
        self.lengths.fill_(length)

    def known_length(self) -> int:
        """Positions held, as a host int (read back once after compiled steps, which the host
        does not follow). CapacityError past the capacity."""
        if self.length is None:
            held = int(self.lengths[0])
            if held > self.capacity:
                raise CapacityError(
                    f"FSQCache(capacity={self.capacity}) was given {held} positions inside "
                    f"compiled steps; the codes past the capacity were dropped: build the "
                    f"cache with a larger capacity")
            self.length = held
        return self.length

    def get_seq_length(self):
        if torch.compiler.is_compiling() and self.is_initialized:
            return self.lengths[0].long()
        return self.known_length()

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        """One query token: the whole buffer (a fixed size, so the mask of a decode step
        neither grows nor needs the length; its columns are the cache's positions, those past
        the length hidden); a prefill: the positions held and its own. Older releases pass
        cache_position (one entry per query token) instead of a length."""
        q = query_length.shape[0] if isinstance(query_length, torch.Tensor) else int(query_length)
        if q == 1:
            return self.capacity + 1, 0
        return self.known_length() + q, 0

    def get_max_length(self) -> int:
        return self.capacity

    get_max_cache_shape = get_max_length  # the name older releases ask for

    def positions(self) -> torch.Tensor:
        return self.values[:, 0, :self.known_length(), 0]

    def codes(self) -> torch.Tensor | None:
        if not self.is_initialized or self.known_length() == 0:
            return None
        return self.keys[:, 0, :self.length]

    def crop(self, tokens_to_remove: int) -> None:
        """As the growing layer's; after compiled steps past the capacity, the positions that
        fit are what is held (so a crop makes the cache usable again)."""
        held = self.length if self.length is not None else min(int(self.lengths[0]),
                                                               self.capacity)
        keep = crop_target(tokens_to_remove, held)
        if self.is_initialized and (keep < held or self.length is None):
            self._set_length(keep)

    def reset(self) -> None:
        if self.is_initialized:
            self._set_length(0)
        self.visible = None
        self.consecutive = True

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """In place (the buffers keep their address)."""
        if self.is_initialized:
            beam_idx = beam_idx.to(self.keys.device)
            self.keys.copy_(self.keys.index_select(0, beam_idx))
            self.values.copy_(self.values.index_select(0, beam_idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._rebatch(self.keys.repeat_interleave(repeats, dim=0),
                          self.values.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._rebatch(self.keys[indices], self.values[indices])

    def _rebatch(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        length = self.known_length()
        self.keys, self.values = keys, values
        self.lengths = self.lengths.new_full((keys.shape[0],), length)
        self._mark_static()
