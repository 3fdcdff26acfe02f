"""A transformers cache whose archived positions live only as residual-VQ codes.

Positions follow the archiving cache (:mod:`model_adapters.caches.archiving`): the first
``sinks`` and the last ``recent`` positions are exact (up to ``recent + block - 1`` with
``block``), every position in between is archived. Here an archived position keeps only its
codes, ``(batch, kv_heads, archived, stages)`` uint8/int16 per side, and the codebooks are held
once; attention reads them through the function registered by
:mod:`model_adapters.caches.codes_attention`, which the model must use
(:func:`use_codes_attention`).

Chunk invariance: every query sees each earlier position as token-by-token decoding would (see
:mod:`model_adapters.caches.window`); a multi-token forward hands the positions it archives to
the attention function with their exact copies (a
:class:`~model_adapters.caches.codes_attention.Transit`).

Rewinding: ``crop`` can only restore positions whose exact K/V is still held. ``rewind`` extra
exact positions are kept behind the recent window for that (speculative decoding needs as many
as the assistant drafts); with them, crop-then-continue is the same computation as a fresh run
on the shorter prefix, wherever the crop point falls.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from kernels import BACKENDS, CodedCache, validate_coded_cache
from model_adapters._checks import count
from model_adapters.caches.code_rows import add_rows
from model_adapters.caches.codes_attention import (
    CODES_ATTENTION,  # noqa: F401 (named in the docstrings; importable from here as before)
    LAYER_ATTR,
    Transit,
    check_kv_states,
    left_pads,
    require_codes_attention,
    unread_error,
    use_codes_attention,
)
from model_adapters.caches.codes_layer import CodesLayer, NoDenseKeysError
from model_adapters.caches.padded import PaddedLayout
from model_adapters.caches.padded import grow_positions as _grow
from model_adapters.caches.sharing import deepcopy_sharing
from model_adapters.caches.static_codes import CapacityError, StaticCodesLayer
from model_adapters.caches.window import (
    DEFAULT_REWIND,
    archive_end,
    archived_per_sequence,
    check_window,
    crop_target,
    shortest_crop,
)
from model_adapters.models import KVShape, kv_shape
from model_adapters.quant.quantizer import KVQuantizer
from model_adapters.quant.rvq import check_codes, decode

__all__ = [
    "CapacityError",
    "CodesOnlyCache",
    "CodesOnlyLayer",
    "NoDenseKeysError",
    "StaticCodesLayer",
    "use_codes_attention",
]


class CodesOnlyLayer(PaddedLayout, CodesLayer):
    """One decoder layer: exact sinks, codes for archived positions, exact recent tail.

    Positions ``[0, sinks)`` are in ``head``; ``[sinks, archived_end)`` are codes;
    ``[tail_start, length)`` are in ``tail`` (exact, ``tail_start <= archived_end``: the part
    below ``archived_end`` is the rewind margin, never attended to). A left-padded batch keeps
    each sequence's window in its own positions (:class:`~model_adapters.caches.padded.
    PaddedLayout`).
    """

    is_compileable = False
    WINDOW_TENSORS = ("head_k", "head_v", "tail_k", "tail_v")

    @property
    def is_croppable(self) -> bool:
        """Codes handed to a rows collector cannot be taken back (those in an attached archive
        can): generate must not plan on crops then."""
        return self.cache.rows is None or bool(self.cache.archive_hooks)

    def __init__(self, layer_idx: int, cache: CodesOnlyCache):
        super().__init__()
        self.layer_idx = layer_idx
        self.cache = cache
        self.transit: Transit | None = None  # for this forward's attention call (see update)
        # left padding per sequence (None: none), set by the cache on its first update
        # (start_padded; the layout is model_adapters.caches.padded's)
        self.pads: list[int] | None = None
        self.pad_tensor: torch.Tensor | None = None
        self.seq_ends: list[int] = []
        self.length = 0
        self.archived_end = cache.sinks
        self.tail_start = cache.sinks

    # --- transformers layer API -------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states=None) -> None:
        self._kernel_checked = False  # see checked_for_kernels
        self.device = key_states.device
        self.dtype = key_states.dtype
        b, h, _, d = key_states.shape
        empty = key_states.new_zeros(b, h, 0, d)
        self.head_k = self.head_v = self.tail_k = self.tail_v = empty
        q = self.cache.quantizer
        self.key_codes = torch.zeros(b, h, 0, q.key_stages, dtype=q.code_dtype, device=self.device)
        self.value_codes = torch.zeros(
            b, h, 0, q.value_stages, dtype=q.code_dtype, device=self.device
        )
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.pads is not None:
            return self.update_padded(key_states, value_states)
        sinks, recent = self.cache.sinks, self.cache.recent
        take = max(0, min(key_states.shape[2], sinks - self.length))
        if take:
            self.head_k = torch.cat([self.head_k, key_states[:, :, :take]], 2)
            self.head_v = torch.cat([self.head_v, value_states[:, :, :take]], 2)
        if key_states.shape[2] > take:
            self.tail_k = torch.cat([self.tail_k, key_states[:, :, take:]], 2)
            self.tail_v = torch.cat([self.tail_v, value_states[:, :, take:]], 2)
        self.length += key_states.shape[2]
        c = self.cache
        end = archive_end(self.length, sinks, recent, c.block)
        # the positions archived here that earlier queries of this chunk still see exact (the
        # tail still holds them: it is trimmed to the rewind margin only in _archive)
        lo = max(self.archived_end, archive_end(self.length - key_states.shape[2] + 1, sinks,
                                                recent, c.block))
        if key_states.shape[2] > 1 and end > lo:
            a, b = lo - self.tail_start, end - self.tail_start
            self.transit = Transit(lo, self.tail_k[:, :, a:b], self.tail_v[:, :, a:b],
                                   sinks, recent, c.block, self.pad_tensor)
        if end > self.archived_end:
            self._archive(end)
        # the layer rides on a fresh view so the attention function can find the codes
        keys = self.tail_k[:, :, self.archived_end - self.tail_start :]
        values = self.tail_v[:, :, self.archived_end - self.tail_start :]
        setattr(keys, LAYER_ATTR, self)
        return keys, values

    def _archive(self, end: int) -> None:
        start = self.archived_end
        lo, hi = start - self.tail_start, end - self.tail_start
        q = self.cache.device_quantizer(self.device)
        kc, _, vc, _ = q.quantize(
            self.layer_idx, self.tail_k[:, :, lo:hi], self.tail_v[:, :, lo:hi]
        )
        used = start - self.cache.sinks
        self.key_codes = _grow(self.key_codes, used, end - start)
        self.value_codes = _grow(self.value_codes, used, end - start)
        self.key_codes[:, :, used : used + end - start] = kc
        self.value_codes[:, :, used : used + end - start] = vc
        self.archived_end = end
        if self.cache.rows is not None:
            add_rows(self.cache, self.cache.rows, self.layer_idx, kc, vc)
        self._trim_tail()

    def _trim_tail(self) -> None:
        keep_from = max(self.cache.sinks, self.archived_end - self.cache.rewind)
        if keep_from > self.tail_start:
            cut = keep_from - self.tail_start
            # clone: a view would keep the whole old storage alive
            self.tail_k = self.tail_k[:, :, cut:].clone()
            self.tail_v = self.tail_v[:, :, cut:].clone()
            self.tail_start = keep_from

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        # older releases pass cache_position (one entry per query token) instead of a length
        q = query_length.shape[0] if isinstance(query_length, torch.Tensor) else int(query_length)
        return self.length + q, 0

    def get_seq_length(self, *args) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # the name older releases ask for

    # --- what attention reads ---------------------------------------------------------------
    @property
    def archived(self) -> int:
        return self.archived_end - self.cache.sinks

    def coded_cache(self) -> CodedCache:
        """The layer as the attention function reads it (marks the layer read): exact sinks,
        the codes in use and this layer's float32 codebooks, the attended recent positions;
        every length None (all valid)."""
        self.cache.unread_layer = None
        q = self.cache.device_quantizer(self.device)
        if self.pads is not None:
            return self.padded_coded_cache(q)
        n = self.archived
        cut = self.archived_end - self.tail_start
        return CodedCache(
            key_codes=self.key_codes[:, :, :n],
            value_codes=self.value_codes[:, :, :n],
            key_codebooks=q.key_codebooks[self.layer_idx],
            value_codebooks=q.value_codebooks[self.layer_idx],
            sink_keys=self.head_k,
            sink_values=self.head_v,
            recent_keys=self.tail_k[:, :, cut:],
            recent_values=self.tail_v[:, :, cut:],
        )

    def checked_for_kernels(self, query: torch.Tensor, cache: CodedCache) -> CodedCache:
        """``cache`` validated by :func:`kernels.validate_coded_cache` against ``query``
        ``(batch, q_heads, head_dim)`` the first time this layer takes the kernel path
        (codebook and code dtypes, every shape; a ValueError names what is wrong), then
        trusted: this cache's own encoder wrote the codes and its buffers keep their shapes,
        so a decode step runs :func:`kernels.decode_attention` without checks."""
        if not self._kernel_checked:
            cache = validate_coded_cache(query, cache, check_codes=False)
            self._kernel_checked = True
        return cache

    def dense(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every position's K and V, archived ones decoded: ``(batch, kv_heads, length, d)``.

        Allocates the dense layer; used for prefill chunks and rehydration, never kept.
        """
        self.cache.unread_layer = None
        dtype = dtype or self.dtype
        q = self.cache.device_quantizer(self.device)
        if self.pads is not None:
            return self.padded_dense(q, dtype)
        n, cut = self.archived, self.archived_end - self.tail_start
        ks, vs = [self.head_k.to(dtype)], [self.head_v.to(dtype)]
        if n:  # trusted: our encoder wrote the codes, or load_state checked them
            kb, vb = q.key_codebooks[self.layer_idx], q.value_codebooks[self.layer_idx]
            ks.append(decode(self.key_codes[:, :, :n], kb, dtype, trusted=True))
            vs.append(decode(self.value_codes[:, :, :n], vb, dtype, trusted=True))
        ks.append(self.tail_k[:, :, cut:].to(dtype))
        vs.append(self.tail_v[:, :, cut:].to(dtype))
        return torch.cat(ks, 2), torch.cat(vs, 2)

    def load_state(
        self,
        head: tuple[torch.Tensor, torch.Tensor],
        codes: tuple[torch.Tensor, torch.Tensor],
        tail: tuple[torch.Tensor, torch.Tensor],
        *,
        length: int,
        tail_start: int,
    ) -> None:
        """Install a saved state (resume): exact ``head`` ``(batch, kv_heads, <=sinks, d)``,
        ``codes`` ``(batch, kv_heads, archived, stages)`` per side, exact ``tail`` covering
        positions ``[tail_start, length)``. ValueError for a code outside the codebooks (checked
        here, once, so that decoding them later needs no check)."""
        for c in codes:
            check_codes(c, self.cache.quantizer.codebook_size)
        self.lazy_initialization(head[0], head[1])
        self.head_k, self.head_v = head
        self.key_codes, self.value_codes = codes
        self.tail_k, self.tail_v = tail
        self.length = length
        self.archived_end = self.cache.sinks + codes[0].shape[2]
        self.tail_start = tail_start

    # --- rewinding ----------------------------------------------------------------------------
    def crop_problem(self, length: int) -> str | None:
        """Why this layer cannot be cut back to ``length`` positions (None: it can)."""
        if length > self.length:
            return f"the cache holds only {self.length} positions"
        if self.pads is not None:
            return self.padded_crop_problem(length)
        c = self.cache
        sinks = c.sinks
        new_end = min(self.archived_end, archive_end(length, sinks, c.recent, c.block))
        if min(self.archived_end, length) > new_end and self.tail_start > new_end:
            shortest = shortest_crop(self.tail_start, sinks, c.recent, c.block)
            return (
                f"positions {new_end}..{self.tail_start - 1} would have to be exact again, but "
                f"only their codes are held (rewind margin {self.cache.rewind}); crop to at "
                f"least {shortest} (or at most {sinks}), or build the cache with a larger rewind"
            )
        return None

    def crop_to(self, length: int) -> None:
        """Cut back to ``length`` positions (check :meth:`crop_problem` first)."""
        if not self.is_initialized or length == self.length:
            return
        if self.pads is not None:
            return self.padded_crop_to(length)
        c = self.cache
        sinks = c.sinks
        self.head_k, self.head_v = self.head_k[:, :, :length], self.head_v[:, :, :length]
        self.archived_end = min(self.archived_end, archive_end(length, sinks, c.recent, c.block))
        keep = max(0, length - self.tail_start)
        self.tail_k, self.tail_v = self.tail_k[:, :, :keep], self.tail_v[:, :, :keep]
        if length <= sinks:
            self.tail_start = sinks
        self.length = length
        self._trim_tail()

    def reset(self) -> None:
        self.is_initialized = False
        self.transit = None
        self.length = 0
        self.end_padded()

    # --- batch manipulation (generate: beams, multiple return sequences) -----------------------
    def _map_batch(self, fn, order=None) -> None:
        if not self.is_initialized:
            return
        names = ["head_k", "head_v", "tail_k", "tail_v", "key_codes", "value_codes"]
        if self.pads is not None:
            names += ["sink_k", "sink_v"]
            self.pads = [self.pads[i] for i in order]
            self.seq_ends = [self.seq_ends[i] for i in order]
            self.pad_tensor = torch.tensor(self.pads, device=self.pad_tensor.device)
        for name in names:
            setattr(self, name, fn(getattr(self, name)))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        order = beam_idx.tolist() if self.pads is not None else None
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)), order)

    def batch_repeat_interleave(self, repeats: int) -> None:
        order = None if self.pads is None else [
            i for i in range(len(self.pads)) for _ in range(repeats)]
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0), order)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        order = torch.as_tensor(indices).tolist() if self.pads is not None else None
        self._map_batch(lambda t: t[indices], order)

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this layer holds, by kind (``window``: exact K/V, ``codes``); a padded
        batch's per-sequence sinks count as window."""
        out = super().tensors()
        if self.is_initialized and self.pads is not None:
            out["window"] += [self.sink_k, self.sink_v]
        return out


class CodesOnlyCache(Cache):
    """A transformers ``Cache`` keeping archived positions only as residual-VQ codes.

    Args:
        model_or_config: the model (which must use :data:`CODES_ATTENTION`; see
            :func:`use_codes_attention`) or its config: GPT-2 or Qwen3.
        quantizer: codebooks for keys and values (both sides must be quantized: an exact side
            would have to be kept dense, which is the archiving cache's job).
        sinks: leading positions kept exact forever.
        recent: most recent positions kept exact.
        rewind: extra exact positions kept behind the recent window so that ``crop`` back by up
            to ``rewind - block + 1`` positions leaves the state of a fresh run (the default
            covers transformers' assistant, 20 draft tokens per round).
        block: quantize positions leaving the recent window in groups of this many, aligned on
            ``sinks`` (as :class:`~model_adapters.caches.archiving.ArchivingCache` does): the
            window then holds ``recent`` to ``recent + block - 1`` exact positions, and the
            codebooks are read and the exact tail trimmed once per group instead of every step.
            The boundary depends only on the length (:func:`~model_adapters.caches.window.
            archive_end`), so prefill, chunks and crops agree with token-by-token decoding.
        rows: collector receiving one row of codes per archived token
            (:class:`~model_adapters.caches.code_rows.CodeRows`; batch 1 only).
        capacity: the most positions the cache will hold, or None (grow as needed). With a
            capacity every buffer is allocated once at that size and the length lives on the
            device (:class:`~model_adapters.caches.static_codes.StaticCodesLayer`): a decode
            step quantizes on the device and never waits for it, ``torch.compile`` traces it
            without a graph break, and transformers' ``generate`` compiles the decode steps
            with CUDA graphs on CUDA by itself (``is_compileable``). Needs ``block=1``, no
            ``rows`` and unpadded batches; past the capacity, :class:`CapacityError`. Eager
            decode steps on the Triton kernel replay each layer's kernel call from a CUDA graph
            captured on the first step (:class:`kernels.CapturedCall`; set
            ``cache.capture_eager_steps = False`` to launch the kernels every step instead).
        backend: the path of float16/bfloat16 decode steps: ``"triton"``, the Triton kernel of
            :func:`kernels.decode_attention` (CUDA tensors, or Triton's CPU interpreter);
            ``"auto"``, that kernel where :func:`kernels.kernel_takes` says one runs the step;
            ``"torch"``, the kernel API's dequantizing reference for CUDA tensors. Every other
            decode step takes the float32 look-up path
            (:func:`~model_adapters.caches.codes_attention.lookup_attention`).

    Attention sees exactly what the archiving cache's does (sinks and recent exact, the
    reconstruction in between), so logits agree with
    :class:`~model_adapters.caches.archiving.ArchivingCache` up to floating-point rounding.
    """

    # the position ids of the forward in progress, set by the hooks of use_codes_attention:
    # where transformers does not hand them to update (5.17), the batch's left padding
    forward_position_ids: torch.Tensor | None = None

    def __init__(
        self,
        model_or_config,
        quantizer: KVQuantizer,
        *,
        sinks: int = 4,
        recent: int = 32,
        rewind: int = DEFAULT_REWIND,
        rows=None,
        backend: str = "auto",
        block: int = 1,
        capacity: int | None = None,
    ):
        shape: KVShape = kv_shape(model_or_config)
        check_window(sinks=sinks, recent=recent, rewind=rewind, block=block)
        if not isinstance(quantizer, KVQuantizer):
            raise TypeError(f"quantizer must be a KVQuantizer, got {type(quantizer).__name__}")
        quantizer.check_model(model_or_config)
        if not (quantizer.key_stages and quantizer.value_stages):
            raise ValueError(
                f"the codes-only cache needs codebooks for keys and values, got K"
                f"{quantizer.key_stages}V{quantizer.value_stages}; use ArchivingCache to keep "
                "a side exact"
            )
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        require_codes_attention(model_or_config, "codes-only cache")
        if capacity is not None:
            count(capacity, "capacity", low=1)
            if block != 1 or rows is not None:
                raise ValueError(
                    f"a codes-only cache with a capacity ({capacity}) needs block=1 and no rows "
                    f"collector (got block={block}, rows={type(rows).__name__}); build it "
                    "without capacity for those")
        if rows is not None and rows.num_layers != shape.num_layers:
            raise ValueError(
                f"rows collector has {rows.num_layers} layers, model has {shape.num_layers}"
            )
        self.shape = shape
        self.quantizer = quantizer
        self.sinks, self.recent, self.rewind, self.block = sinks, recent, rewind, block
        self.rows = rows
        self.backend = backend
        self.capacity = capacity
        self.capture_eager_steps = True  # capacity layers: see the capacity argument
        config = getattr(model_or_config, "config", model_or_config)
        self.q_heads = getattr(config, "num_attention_heads", shape.kv_heads)
        self.archive_hooks: list = []
        self._on_device: dict = {}
        self.unread_layer: int | None = None
        self.failed: str | None = None  # what stopped a pass part-way (code_rows.add_rows)
        layer_class = CodesOnlyLayer if capacity is None else StaticCodesLayer
        super().__init__(layers=[layer_class(i, self) for i in range(shape.num_layers)])

    def __deepcopy__(self, memo: dict) -> CodesOnlyCache:
        """A copy with its own codes and exact K/V that shares the quantizer and its device
        copies (codebooks, look-up tables)."""
        return deepcopy_sharing(self, memo, [self.quantizer, *self._on_device.values()])

    def __getstate__(self) -> dict:
        """Pickled without the codebooks' device copies (made again on first use); the
        quantizer pickles once per pickle and loads shared (:class:`KVQuantizer`)."""
        return {**self.__dict__, "_on_device": {}}

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        check_kv_states(self.shape, key_states, layer_idx, "codes-only cache")
        if self.failed:  # its layers and the collector are out of step
            raise RuntimeError(
                f"the codes-only cache is out of step after a forward pass that failed part-way "
                f"({self.failed}); start a new cache")
        if self.rows is not None:
            self.rows.check_batch(key_states.shape[0])
        if self.unread_layer is not None:
            raise unread_error(self.unread_layer, "codes-only cache")
        # traced steps (capacity caches only) never start a sequence: prefill runs eagerly
        if layer_idx == 0 and not torch.compiler.is_compiling() and self.get_seq_length() == 0:
            self._start_sequence(key_states, kwargs)
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        self.unread_layer = layer_idx
        return out

    def _start_sequence(self, key_states: torch.Tensor, update_kwargs: dict) -> None:
        """A new sequence: its left padding, once (one read-back), from the position ids.
        ValueError, before any layer changes, for a padded batch on a cache with an attached
        archive (whose token stream holds one unpadded sequence)."""
        pads = left_pads(update_kwargs, key_states.shape[2], self.forward_position_ids)
        if pads is not None and self.archive_hooks:
            raise ValueError(
                f"a left-padded batch (pads {pads}) cannot run on a codes-only cache with an "
                "attached archive (its token stream is one unpadded sequence); feed the "
                "tokens unpadded"
            )
        for layer in self.layers:
            if pads is None:
                layer.end_padded()
            else:
                layer.start_padded(pads, key_states.device)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every sequence ``repeats`` times (``num_return_sequences``, beams); with a
        rows collector (batch 1) refused for ``repeats > 1`` before any layer changes."""
        if self.rows is not None:
            self.rows.check_batch(repeats)
        super().batch_repeat_interleave(repeats)

    def reset(self) -> None:
        """Empty every layer; refused once codes went to a collector or an archive."""
        if self.archive_hooks or (self.rows is not None and self.rows.emitted):
            raise ValueError(
                "cannot reset a cache whose codes went to a rows collector or an archive; "
                "crop it, or start a new cache"
            )
        super().reset()
        self.unread_layer = self.failed = None

    def device_quantizer(self, device) -> KVQuantizer:
        """The codebooks on ``device`` (moved once, then reused)."""
        device = torch.device(device)
        if self.quantizer.key_codebooks.device == device:
            return self.quantizer
        if device not in self._on_device:
            self._on_device[device] = self.quantizer.to(device)
        return self._on_device[device]

    @property
    def archived_tokens(self) -> int:
        """Positions held only as codes, of the sequence with the most (every sequence of an
        unpadded batch has as many; :meth:`archived_per_sequence` has each one's count)."""
        return max(self.archived_per_sequence(), default=0)

    def archived_per_sequence(self) -> list[int]:
        """Positions each sequence of the batch holds only as codes (``batch`` ints; in a
        left-padded batch counted in the sequence's own tokens, pads never archived; the same
        in every layer between forward passes). Empty before the first update."""
        return archived_per_sequence(self.layers)

    def archived_after(self, length: int) -> int:
        """Archived positions left, in the sequence with the most, after cutting the cache back
        to ``length`` (batch positions, pads included)."""
        layer = self.layers[0]
        if layer.pads is None:
            end = archive_end(length, self.sinks, self.recent, self.block)
            return min(self.archived_tokens, end - self.sinks)
        return max(layer.padded_ends_after(length)) - self.sinks

    def crop(self, tokens_to_remove: int) -> None:
        """Cut the cache back: ``n > 0`` keeps the first ``n`` positions, ``n < 0`` drops the
        last ``-n``, ``0`` does nothing (both transformers conventions).

        Attached archives (``archive_hooks``) are truncated to the archived positions kept.
        Raises ValueError, changing nothing, when a position would have to become exact again
        but only its codes are held, or when cutting past the start.
        """
        length = self.get_seq_length()
        target = crop_target(tokens_to_remove, length)
        if target == length:
            return
        for layer in self.layers:
            problem = layer.crop_problem(target)
            if problem is not None:
                raise ValueError(f"cannot crop to {target} positions: {problem}")
        kept = self.archived_after(target)
        if self.rows is not None and kept < self.archived_tokens and not self.archive_hooks:
            raise ValueError(
                f"cannot crop to {target} positions: {self.archived_tokens - kept} archived "
                "positions were already handed to the rows collector, which cannot take them back"
            )
        for hook in self.archive_hooks:
            hook.check_truncate(target, self)
        for layer in self.layers:
            layer.crop_to(target)
        for hook in self.archive_hooks:
            hook.truncate(target, self)

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor the cache holds, by kind: ``window``, ``codes``, ``codebooks``."""
        out = {"window": [], "codes": [], "codebooks": []}
        for layer in self.layers:
            for kind, ts in layer.tensors().items():
                out[kind] += ts
        for q in (self.quantizer, *self._on_device.values()):
            out["codebooks"] += [q.key_codebooks, q.value_codebooks]
        return out

    def live_bytes(self) -> dict[str, int]:
        """Bytes of the storage allocated behind :meth:`tensors`, by kind, plus ``total``.

        Storage is counted once even when several tensors view it; buffers count at their
        allocated capacity, not only the part in use.
        """
        seen: set = set()
        out = {}
        for kind, ts in self.tensors().items():
            total = 0
            for t in ts:
                storage = t.untyped_storage()
                key = (storage.data_ptr(), str(t.device))
                if key not in seen and storage.nbytes():
                    seen.add(key)
                    total += storage.nbytes()
            out[kind] = total
        out["total"] = sum(out.values())
        return out


def dense_cache_bytes(cache) -> int:
    """Bytes of the keys and values a ``DynamicCache`` holds (storage actually allocated)."""
    seen, total = set(), 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is None:
                continue
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total
