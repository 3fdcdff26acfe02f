"""The codes-only cache's static-shape layer: every buffer preallocated, the length on the device.

:class:`~model_adapters.caches.codes_only.CodesOnlyCache` built with ``capacity=N`` holds each
layer in a :class:`StaticCodesLayer`:

- ``sink_k``/``sink_v`` ``(batch, kv_heads, sinks, head_dim)``: the first ``sinks`` positions;
- ``window_k``/``window_v`` ``(batch, kv_heads, recent + rewind, head_dim)``: the newest exact
  positions, newest first (slot ``i`` holds position ``length - 1 - i``), so that the ``recent``
  attended ones are a prefix, as the kernels read a segment; the ``rewind`` slots behind them
  keep positions already coded, for ``crop``;
- ``key_codes``/``value_codes`` ``(batch, kv_heads, N - sinks - recent + 1, stages)``: codes by
  position (position ``sinks + j`` in slot ``j``; the last slot is scratch, never attended);
- ``length`` ``()`` int64 on the device.

A decode step (one token) is a fixed sequence of device operations: the token goes to the sinks
(while there are fewer than ``sinks``) or to the front of the window; the position that leaves
the attended window (``length - recent``) is quantized on the device and its codes written at
its slot; the length grows by one. Nothing reads a value back and no shape depends on the
length, so ``torch.compile`` traces the step without a graph break and a CUDA graph replays it
(transformers' ``generate`` compiles such a cache's decode steps on CUDA by itself). What
attention sees is the codes-only cache's with ``block=1``: the first ``sinks`` and last
``recent`` positions exact, every other position coded (chunk invariant, see
:mod:`model_adapters.caches.window`). Multi-token forwards (prefill) run eagerly on the host's
copy of the length.

Capacity: the first eager update that would pass ``capacity`` positions raises
:class:`CapacityError` before anything changes. Inside a compiled graph nothing can raise: a
step past the capacity writes its codes to the scratch slot (attention then misses the newest
archived positions) and the next eager call that learns the length (a prefill, ``crop``,
``get_seq_length``) raises.
"""

from __future__ import annotations

from dataclasses import replace

import torch

import kernels
from kernels import CodedCache
from model_adapters.caches.codes_attention import LAYER_ATTR, Transit, chunk_attention_forward
from model_adapters.caches.codes_layer import CodesLayer
from model_adapters.caches.window import archive_end, shortest_crop
from model_adapters.quant.rvq import decode

__all__ = ["CapacityError", "StaticCodesLayer"]


class CapacityError(RuntimeError):
    """A cache built with ``capacity=N`` was asked to hold more than ``N`` positions."""


def _static(*tensors: torch.Tensor) -> None:
    """Tell ``torch.compile`` these buffers keep their address (updated in place), so CUDA
    graphs read them where they are instead of copying them in every replay."""
    if not torch.compiler.is_compiling():
        for t in tensors:
            torch._dynamo.mark_static_address(t)


class StaticCodesLayer(CodesLayer):
    """One decoder layer of a codes-only cache with a fixed capacity (see the module)."""

    is_compileable = True
    is_croppable = True
    WINDOW_TENSORS = ("sink_k", "sink_v", "window_k", "window_v")

    def __init__(self, layer_idx: int, cache):
        super().__init__()
        self.layer_idx = layer_idx
        self.cache = cache
        self.capacity = cache.capacity
        self.code_slots = max(0, cache.capacity - cache.sinks - cache.recent)
        self.transit: Transit | None = None
        self.pads = self.pad_tensor = None  # always None: start_padded refuses a padded batch
        self.host_length: int | None = 0  # the device length, when the host knows it
        self.kernel_backend = "torch"
        self._captured: dict = {}  # eager decode steps captured in a CUDA graph, see attend

    def __getstate__(self) -> dict:
        """Copied and pickled without its captured calls (CUDA graphs; captured again on the
        copy's first eager step)."""
        return {**self.__dict__, "_captured": {}}

    # --- buffers ------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states=None) -> None:
        c = self.cache
        b, h, _, d = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        self.quantizer = q = c.device_quantizer(self.device)
        zeros = key_states.new_zeros
        self.sink_k, self.sink_v = zeros(b, h, c.sinks, d), zeros(b, h, c.sinks, d)
        width = c.recent + c.rewind
        self.window_k, self.window_v = zeros(b, h, width, d), zeros(b, h, width, d)
        codes = dict(dtype=q.code_dtype, device=self.device)
        self.key_codes = torch.zeros(b, h, self.code_slots + 1, q.key_stages, **codes)
        self.value_codes = torch.zeros(b, h, self.code_slots + 1, q.value_stages, **codes)
        self.length = torch.zeros((), dtype=torch.int64, device=self.device)
        self.host_length = 0
        _static(self.sink_k, self.sink_v, self.window_k, self.window_v, self.key_codes,
                self.value_codes, self.length, q.key_codebooks, q.value_codebooks,
                *q.table_tensors(self.layer_idx))
        # attention finds the layer on the tensor update returns (the window, every step)
        setattr(self.window_k, LAYER_ATTR, self)
        self.is_initialized = True
        self._choose_backend(c.q_heads)

    def _choose_backend(self, q_heads: int) -> None:
        """The path of decode steps, decided once from shapes and dtypes: the Triton kernel
        (its buffers validated here, once) or the masked torch reference."""
        b, h, _, d = self.window_k.shape
        query = self.window_k.new_zeros(b, q_heads, d)
        cache = self.coded_cache(mark_read=False)
        backend = self.backend
        if backend == "auto":
            backend = "triton" if kernels.kernel_takes(query, cache) else "torch"
        if backend == "triton":  # shapes, dtypes and devices (the lengths are all 0 yet)
            full = replace(cache, sink_lengths=None, archived_lengths=None, recent_lengths=None)
            kernels.validate_coded_cache(query, full, check_codes=False)
        self.kernel_backend = backend

    # --- transformers layer API -------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[2]
        if torch.compiler.is_compiling():  # traced: the device path only, host length unknown
            self.host_length = None
            if n != 1:
                raise NotImplementedError(
                    "a compiled forward of a capacity cache takes one token per sequence; run "
                    "multi-token forwards (prefill) eagerly")
            return self._step(key_states, value_states)
        if not self.is_initialized or (self.known_length() == 0
                                       and key_states.shape[:2] != self.window_k.shape[:2]):
            self.lazy_initialization(key_states, value_states)
        length = self.known_length()
        if length + n > self.capacity:
            raise CapacityError(
                f"layer {self.layer_idx} holds {length} positions and cannot take {n} more: "
                f"the cache's capacity is {self.capacity}; build it with a larger capacity")
        out = self._step(key_states, value_states) if n == 1 else self._chunk(
            key_states, value_states, length)
        self.host_length = length + n
        return out

    def _step(self, k: torch.Tensor, v: torch.Tensor):
        """One position per sequence, on the device only (see the module)."""
        c, length = self.cache, self.length
        sinks, recent = c.sinks, c.recent
        if sinks:
            at = length.clamp(max=sinks - 1).reshape(1)
            later = length >= sinks
            for buf, x in ((self.sink_k, k), (self.sink_v, v)):
                buf.index_copy_(2, at, torch.where(later, buf.index_select(2, at), x))
        # the position leaving the attended window now: length - recent
        if recent:
            out_k, out_v = self.window_k[:, :, recent - 1 : recent], self.window_v[
                :, :, recent - 1 : recent]
        else:
            out_k, out_v = k, v
        kc, _, vc, _ = self.quantizer.quantize(self.layer_idx, out_k, out_v)
        leaving = length - recent
        slot = torch.where(leaving >= sinks, (leaving - sinks).clamp(0, self.code_slots),
                           self.code_slots).reshape(1)
        self.key_codes.index_copy_(2, slot, kc)
        self.value_codes.index_copy_(2, slot, vc)
        if self.window_k.shape[2]:
            later = length >= sinks
            for buf, x in ((self.window_k, k), (self.window_v, v)):
                buf.copy_(torch.where(later, torch.cat([x, buf[:, :, :-1]], 2), buf))
        self.length.add_(1)
        return self.window_k, self.window_v

    def _chunk(self, k: torch.Tensor, v: torch.Tensor, length: int):
        """Several positions (eager, host ints): sinks first, then the window; the positions
        the chunk archives are quantized together, and those earlier queries of the chunk still
        see exact are handed to attention as a :class:`Transit`."""
        c = self.cache
        sinks, recent = c.sinks, c.recent
        n = k.shape[2]
        end = length + n
        take = max(0, min(n, sinks - length))
        if take:
            self.sink_k[:, :, length : length + take] = k[:, :, :take]
            self.sink_v[:, :, length : length + take] = v[:, :, :take]
        held = min(self.window_k.shape[2], max(0, length - sinks))
        # positions end-1, end-2, ... (newest first), as far back as the window held them
        seq_k = torch.cat([k[:, :, take:].flip(2), self.window_k[:, :, :held]], 2)
        seq_v = torch.cat([v[:, :, take:].flip(2), self.window_v[:, :, :held]], 2)

        def exact(lo: int, hi: int):  # positions [lo, hi) in order
            part = slice(end - hi, end - lo)
            return seq_k[:, :, part].flip(2), seq_v[:, :, part].flip(2)

        a0, a1 = archive_end(length, sinks, recent, 1), archive_end(end, sinks, recent, 1)
        if a1 > a0:
            kc, _, vc, _ = self.quantizer.quantize(self.layer_idx, *exact(a0, a1))
            self.key_codes[:, :, a0 - sinks : a1 - sinks] = kc
            self.value_codes[:, :, a0 - sinks : a1 - sinks] = vc
        lo = max(a0, archive_end(length + 1, sinks, recent, 1))
        if n > 1 and a1 > lo:
            self.transit = Transit(lo, *exact(lo, a1), sinks, recent, 1, None)
        keep = min(self.window_k.shape[2], seq_k.shape[2])
        self.window_k[:, :, :keep] = seq_k[:, :, :keep]
        self.window_v[:, :, :keep] = seq_v[:, :, :keep]
        self.length.fill_(end)
        return self.window_k, self.window_v

    def known_length(self) -> int:
        """Positions held, as a host int (read back from the device once after compiled
        steps, which the host does not follow). CapacityError past the capacity."""
        if self.host_length is None:
            self.host_length = int(self.length)
            if self.host_length > self.capacity:
                raise CapacityError(
                    f"layer {self.layer_idx} was given {self.host_length} positions inside "
                    f"compiled steps, past its capacity {self.capacity}; the codes of the "
                    "positions past it were dropped: build the cache with a larger capacity")
        return self.host_length

    def get_seq_length(self, *args):
        if not self.is_initialized:
            return 0
        if torch.compiler.is_compiling():
            return self.length
        return self.known_length()

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        # one query token: a fixed size (attention reads the lengths, not this mask); older
        # releases pass cache_position (one entry per query token) instead of a length
        q = query_length.shape[0] if isinstance(query_length, torch.Tensor) else int(query_length)
        if q == 1:
            return 1, 0
        return self.get_seq_length() + q, 0

    def get_max_length(self) -> int:
        return self.capacity

    get_max_cache_shape = get_max_length  # the name older releases ask for

    # --- what attention reads ---------------------------------------------------------------
    @property
    def archived(self) -> int:
        if not self.is_initialized:
            return 0
        c = self.cache
        return min(archive_end(self.known_length(), c.sinks, c.recent, 1) - c.sinks,
                   self.code_slots)

    def archived_counts(self) -> list[int]:
        """Archived positions of each sequence (``batch`` ints, equal: never padded)."""
        return [self.archived] * self.window_k.shape[0] if self.is_initialized else []

    def coded_cache(self, mark_read: bool = True) -> CodedCache:
        """The whole buffers with ``(batch,)`` int32 lengths computed on the device."""
        if mark_read:
            self.cache.unread_layer = None
        c, length = self.cache, self.length
        batch = self.window_k.shape[0]

        def per_sequence(n: torch.Tensor) -> torch.Tensor:
            return n.to(torch.int32).reshape(1).expand(batch).contiguous()

        return CodedCache(
            key_codes=self.key_codes, value_codes=self.value_codes,
            key_codebooks=self.quantizer.key_codebooks[self.layer_idx],
            value_codebooks=self.quantizer.value_codebooks[self.layer_idx],
            sink_keys=self.sink_k, sink_values=self.sink_v,
            recent_keys=self.window_k, recent_values=self.window_v,
            sink_lengths=per_sequence(length.clamp(max=c.sinks)),
            archived_lengths=per_sequence((length - c.recent - c.sinks).clamp(0, self.code_slots)),
            recent_lengths=per_sequence((length - c.sinks).clamp(0, c.recent)))

    def attend(self, module, query: torch.Tensor, attention_mask, *, scaling, dropout=0.0,
               **kwargs):
        """The attention function's answer for this layer (see
        :func:`~model_adapters.caches.codes_attention.codes_attention_forward`): a decode step
        reads the buffers (the mask is not read: the lengths say what is attended); several
        query tokens attend the layer's dense reconstruction, with this chunk's transit."""
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if query.shape[2] == 1:
            q = query[:, :, 0]
            if self._captures(q):
                self.cache.unread_layer = None
                return self._captured_call(q, scale)(q)[:, None], None
            out = kernels.static_decode_attention(q, self.coded_cache(), scale=scale,
                                                  backend=self.kernel_backend)
            return out[:, None], None
        transit = self.take_transit()
        dense_k, dense_v = self.dense(query.dtype)
        return chunk_attention_forward(module, query, dense_k, dense_v, attention_mask, transit,
                                       dropout=dropout, scaling=scaling, **kwargs)

    def _captures(self, q: torch.Tensor) -> bool:
        """Whether this eager decode step replays a captured call (the kernel on CUDA, outside
        ``torch.compile`` and outside a capture of the caller's own)."""
        return (getattr(self.cache, "capture_eager_steps", True) and q.is_cuda
                and self.kernel_backend == "triton" and not torch.compiler.is_compiling()
                and not torch.cuda.is_current_stream_capturing())

    def _captured_call(self, q: torch.Tensor, scale: float) -> kernels.CapturedCall:
        """The step's lengths and kernel call captured once per query shape, scale and buffer
        addresses (a buffer that moved, e.g. a new batch, gets a new capture)."""
        buffers = (*(getattr(self, name) for name in self._BUFFERS), self.length,
                   self.quantizer.key_codebooks, self.quantizer.value_codebooks)
        key = (tuple(q.shape), q.dtype, float(scale), *(t.data_ptr() for t in buffers))
        calls = self.__dict__.setdefault("_captured", {})  # (absent from older pickles)
        captured = calls.get(key)
        if captured is None:
            calls.clear()  # the old capture reads buffers that moved

            def step(query: torch.Tensor) -> torch.Tensor:
                return kernels.static_decode_attention(
                    query, self.coded_cache(mark_read=False), scale=scale,
                    backend=self.kernel_backend)

            captured = calls[key] = kernels.CapturedCall(step, q)
        return captured

    def dense(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every position's K and V, archived ones decoded: ``(batch, kv_heads, length, d)``."""
        self.cache.unread_layer = None
        dtype = dtype or self.dtype
        c = self.cache
        length = self.known_length()
        end = archive_end(length, c.sinks, c.recent, 1)
        n = min(length, c.sinks)
        ks, vs = [self.sink_k[:, :, :n].to(dtype)], [self.sink_v[:, :, :n].to(dtype)]
        if end > c.sinks:  # trusted: our encoder wrote the codes
            q = self.quantizer
            ks.append(decode(self.key_codes[:, :, : end - c.sinks], q.key_codebooks[
                self.layer_idx], dtype, trusted=True))
            vs.append(decode(self.value_codes[:, :, : end - c.sinks], q.value_codebooks[
                self.layer_idx], dtype, trusted=True))
        ks.append(self.window_k[:, :, : length - end].flip(2).to(dtype))
        vs.append(self.window_v[:, :, : length - end].flip(2).to(dtype))
        return torch.cat(ks, 2), torch.cat(vs, 2)

    # --- rewinding ----------------------------------------------------------------------------
    def crop_problem(self, length: int) -> str | None:
        """Why this layer cannot be cut back to ``length`` positions (None: it can)."""
        held = self.known_length() if self.is_initialized else 0
        if length > held:
            return f"the cache holds only {held} positions"
        c = self.cache
        oldest = held - min(self.window_k.shape[2], max(0, held - c.sinks)) if held else 0
        need = max(c.sinks, archive_end(length, c.sinks, c.recent, 1))
        if length > c.sinks and need < oldest:
            shortest = shortest_crop(oldest, c.sinks, c.recent, 1)
            return (f"positions {need}..{oldest - 1} would have to be exact again, but only "
                    f"their codes are held (rewind margin {c.rewind}); crop to at least "
                    f"{shortest} (or at most {c.sinks}), or build the cache with a larger rewind")
        return None

    def crop_to(self, length: int) -> None:
        """Cut back to ``length`` positions (check :meth:`crop_problem` first); in place."""
        if not self.is_initialized:
            return
        drop = self.known_length() - length
        if drop > 0:
            for buf in (self.window_k, self.window_v):
                kept = buf[:, :, drop:].clone()
                buf[:, :, : kept.shape[2]] = kept
            self.length.fill_(length)
            self.host_length = length

    def start_padded(self, pads: list[int], device) -> None:
        """Called by the cache for a new left-padded batch: refused (before any layer
        changes: the cache asks every layer before the first update)."""
        raise ValueError(
            f"a left-padded batch (pads {pads}) cannot use a codes-only cache with a "
            "capacity; run the sequences unpadded or build the cache without capacity")

    def end_padded(self) -> None:
        """Called by the cache for a new unpadded batch (nothing to undo here)."""

    def reset(self) -> None:
        """Empty the layer, keeping its buffers (and their addresses)."""
        if self.is_initialized:
            self.length.zero_()
        self.host_length = 0
        self.transit = self.pads = self.pad_tensor = None

    # --- batch manipulation (generate: beams, multiple return sequences) -----------------------
    _BUFFERS = WINDOW_TENSORS + CodesLayer.CODE_TENSORS

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:  # in place: the buffers keep their addresses
            for name in self._BUFFERS:
                buf = getattr(self, name)
                buf.copy_(buf.index_select(0, beam_idx.to(buf.device)))

    def _rebatch(self, fn) -> None:
        if not self.is_initialized:
            return
        for name in self._BUFFERS:
            setattr(self, name, fn(getattr(self, name)))
        _static(*(getattr(self, name) for name in self._BUFFERS))
        setattr(self.window_k, LAYER_ATTR, self)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rebatch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rebatch(lambda t: t[indices])
