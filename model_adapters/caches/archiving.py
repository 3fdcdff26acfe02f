"""The archiving cache for transformers' cache API (a ``cache_utils.Cache`` of ``DynamicLayer``
subclasses; the codes-only cache in :mod:`model_adapters.caches.codes_only` is the other one).

Each layer keeps every position (like ``DynamicLayer``), but only the first ``sinks`` and the last
``recent`` positions stay exact: after an update, every position that has left that window has
its K and V overwritten by their residual-VQ reconstruction, and its codes go to a
:class:`~model_adapters.caches.code_rows.CodeRows` collector (one archive row per token). The
query of the step that ages a position out already sees its reconstruction.

With ``block > 1`` positions leave the window in groups of ``block`` aligned on ``sinks``
(:func:`~model_adapters.caches.window.archive_end`). The exact window then holds between
``recent`` and ``recent + block - 1`` positions, and the codebooks are read once per group
instead of once per decode step.

Chunk invariance: every query sees each earlier position as token-by-token decoding would. In
a multi-token forward, the positions archived during the chunk are handed to the attention
function with their exact copies (a :class:`~model_adapters.caches.codes_attention.Transit`),
so such forwards need the model on
:data:`~model_adapters.caches.codes_attention.CODES_ATTENTION`
(:func:`~model_adapters.caches.codes_attention.use_codes_attention`); single-token steps run
under any attention implementation.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from model_adapters.caches.code_rows import CodeRows, add_rows
from model_adapters.caches.codes_attention import (
    LAYER_ATTR,
    Transit,
    check_kv_states,
    left_pads,
    unread_error,
)
from model_adapters.caches.sharing import deepcopy_sharing
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

__all__ = ["ArchivingCache", "ArchivingLayer"]


class ArchivingLayer(DynamicLayer):
    """One decoder layer's cache: exact window, reconstructed history, codes collected.

    Keys and values are ``(batch, kv_heads, seq, head_dim)`` in the model's dtype: the leading
    positions of buffers with spare room (up to as many again, doubling when it runs out), so a
    decode step appends in place instead of copying the whole cache (what ``DynamicLayer``
    does); copies and pickles hold the positions only.
    """

    def __init__(
        self,
        layer_idx: int,
        quantizer: KVQuantizer | None,
        sinks: int,
        recent: int,
        rows: CodeRows | None,
        track_error: bool = False,
        block: int = 1,
        rewind: int = DEFAULT_REWIND,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.quantizer = quantizer
        self.sinks = sinks
        self.recent = recent
        self.block = block
        self.rewind = rewind
        self.rows = rows
        # codes handed to a collector cannot be taken back: generate must not plan on crops
        self.is_croppable = rows is None or quantizer is None
        self.track_error = track_error
        self.archived_until = 0  # positions [sinks, archived_until) hold reconstructions
        # what stopped a pass part-way in this layer (code_rows.add_rows): positions already
        # overwritten, not yet counted as archived
        self.failed: str | None = None
        self.transit: Transit | None = None  # for this forward's attention call (see update)
        # left padding per sequence (None: none), set by the cache on its first update; then
        # sequence b's window starts at pads[b] and its archive ends at seq_ends[b]
        self.pads: list[int] | None = None
        self.pad_tensor: torch.Tensor | None = None
        self.seq_ends: list[int] = []
        # exact K/V of the last ``rewind`` archived positions, [exact_from, archived_until): what
        # crop needs to make positions exact again that a fresh run would still hold exact
        self.exact_from = 0
        self.exact_k: torch.Tensor | None = None
        self.exact_v: torch.Tensor | None = None
        # per side (K, V): [squared error, sum of x, sum of x^2, vectors] of archived positions
        self.error_stats = [[0.0, None, 0.0, 0], [0.0, None, 0.0, 0]]
        # (keys buffer, values buffer, keys, values): buffers with spare positions, and the
        # leading parts of them that this layer last handed out as its keys and values, so
        # that a step appends in place (see _append)
        self._room: tuple[torch.Tensor, ...] | None = None

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """``DynamicLayer.update`` (keys and values grow by the new positions) without copying
        the whole cache each step: they are the leading positions of buffers with room to grow
        (doubling), written in place. When keys or values were replaced since (a crop, a batch
        reorder), or the room runs out, new buffers start with a copy of them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.keys.dim() != 4:  # nothing held yet
            self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
        n, add = self.keys.shape[-2], key_states.shape[-2]
        room = self._room
        if (room is None or room[2] is not self.keys or room[3] is not self.values
                or room[0].shape[-2] < n + add or room[0].shape[:2] != key_states.shape[:2]):
            cap = max(2 * (n + add), 64)
            kbuf, vbuf = (t.new_empty(*t.shape[:2], cap, t.shape[3])
                          for t in (self.keys, self.values))
            kbuf[..., :n, :], vbuf[..., :n, :] = self.keys, self.values
        else:
            kbuf, vbuf = room[0], room[1]
        kbuf[..., n : n + add, :], vbuf[..., n : n + add, :] = key_states, value_states
        self.keys, self.values = kbuf[..., : n + add, :], vbuf[..., : n + add, :]
        self._room = (kbuf, vbuf, self.keys, self.values)
        return self.keys, self.values

    def __getstate__(self) -> dict:
        """Pickles and deep copies hold the positions only, not the spare room."""
        state = dict(self.__dict__)
        if self._room is not None:
            state["keys"], state["values"] = self.keys.clone(), self.values.clone()
            state["_room"] = None
        return state

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = self._append(key_states, value_states)
        if self.quantizer is None:
            return keys, values
        if self.pads is not None:
            return self._update_padded(keys, values, key_states.shape[-2])
        length, chunk = keys.shape[-2], key_states.shape[-2]
        end = archive_end(length, self.sinks, self.recent, self.block)
        start = max(self.archived_until, self.sinks)
        # the positions archived here that earlier queries of this chunk still see exact
        lo = max(start, archive_end(length - chunk + 1, self.sinks, self.recent, self.block))
        if chunk > 1 and end > lo:
            self.transit = Transit(lo, keys[..., lo:end, :].clone(), values[..., lo:end, :].clone(),
                                   self.sinks, self.recent, self.block)
        if end > start:
            old_k, old_v = keys[..., start:end, :], values[..., start:end, :]
            kc, kr, vc, vr = self.quantizer.quantize(self.layer_idx, old_k, old_v)
            if self.track_error:
                self._track_error(0, old_k, kr)
                self._track_error(1, old_v, vr)
            self._keep_exact(start, end, old_k, old_v)
            if self.quantizer.key_stages:
                self.keys[..., start:end, :] = kr
            if self.quantizer.value_stages:
                self.values[..., start:end, :] = vr
            if self.rows is not None:
                add_rows(self, self.rows, self.layer_idx, kc, vc)
            self.archived_until = end
        return self._handed_over()

    def _update_padded(self, keys: torch.Tensor, values: torch.Tensor, chunk: int):
        """:meth:`update` for a left-padded batch: each sequence archives in its own positions
        (after its pads), so its sinks are its first real tokens and pads are never archived.
        The codebooks are read once for the union of the sequences' new positions."""
        n, (S, R, B), pads = keys.shape[-2], (self.sinks, self.recent, self.block), self.pads
        ends = [p + archive_end(n - p, S, R, B) for p in pads]
        starts = self.seq_ends or [p + S for p in pads]
        los = [max(a, p + archive_end(n - chunk + 1 - p, S, R, B))
               for a, p in zip(starts, pads, strict=True)]
        moving = [b for b in range(len(pads)) if ends[b] > starts[b]]
        held = [(lo, e) for e, lo in zip(ends, los, strict=True) if e > lo]
        if chunk > 1 and held:
            lo, hi = min(lo for lo, _ in held), max(e for _, e in held)
            self.transit = Transit(lo, keys[..., lo:hi, :].clone(), values[..., lo:hi, :].clone(),
                                   S, R, B, self.pad_tensor)
        if moving:
            # only archiving sequences count: another's end may lie past its sinks, beyond n
            u0, u1 = min(starts[b] for b in moving), max(ends[b] for b in moving)
            old_k, old_v = keys[..., u0:u1, :], values[..., u0:u1, :]
            kc, kr, vc, vr = self.quantizer.quantize(self.layer_idx, old_k, old_v)
            first = max(self.archived_until, u0)  # exact copies: see _keep_exact
            self._keep_exact(first, u1, old_k[..., first - u0 :, :], old_v[..., first - u0 :, :])
            for b in moving:
                a, e = starts[b] - u0, ends[b] - u0
                if self.track_error:
                    self._track_error(0, old_k[b, :, a:e], kr[b, :, a:e])
                    self._track_error(1, old_v[b, :, a:e], vr[b, :, a:e])
                if self.quantizer.key_stages:
                    self.keys[b, :, u0 + a : u0 + e] = kr[b, :, a:e]
                if self.quantizer.value_stages:
                    self.values[b, :, u0 + a : u0 + e] = vr[b, :, a:e]
                if self.rows is not None:  # batch 1
                    add_rows(self, self.rows, self.layer_idx, kc[:, :, a:e], vc[:, :, a:e])
            self.archived_until = max(self.archived_until, u1)
        self.seq_ends = ends
        return self._handed_over()

    def _handed_over(self) -> tuple[torch.Tensor, torch.Tensor]:
        """keys and values for the attention function; with a transit, keys are a view of
        their own that carries the layer."""
        if self.transit is None:
            return self.keys, self.values
        keys = self.keys[...]
        setattr(keys, LAYER_ATTR, self)
        return keys, self.values

    def take_transit(self) -> Transit | None:
        """This forward's transit (None if no position left the window inside the chunk),
        handed over once: the attention function calls this."""
        transit, self.transit = self.transit, None
        return transit

    def _keep_exact(self, start: int, end: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append the exact ``(batch, kv_heads, end - start, head_dim)`` K/V about to be
        overwritten, keeping only the last ``rewind`` archived positions. None kept while
        codes go to a rows collector (crop refuses to go back past archived positions then,
        and later crops past them find no copies and refuse too)."""
        if self.rows is not None:
            self.exact_k = self.exact_v = None
            return
        if self.exact_k is None or self.exact_from + self.exact_k.shape[-2] != start:
            self.exact_k, self.exact_v, self.exact_from = k[..., :0, :], v[..., :0, :], start
        first = max(self.exact_from, end - self.rewind)
        drop, skip = first - self.exact_from, max(first, start) - start
        self.exact_k = torch.cat([self.exact_k[..., drop:, :], k[..., skip:, :]], -2)
        self.exact_v = torch.cat([self.exact_v[..., drop:, :], v[..., skip:, :]], -2)
        self.exact_from = first

    def archived_counts(self) -> list[int]:
        """Archived positions of each sequence (``batch`` ints)."""
        if not self.is_initialized or self.quantizer is None:
            return [0] * (self.keys.shape[0] if self.is_initialized else 0)
        if self.pads is not None and self.seq_ends:
            return [max(0, e - p - self.sinks)
                    for e, p in zip(self.seq_ends, self.pads, strict=True)]
        return [max(0, self.archived_until - self.sinks)] * self.keys.shape[0]

    def _track_error(self, side: int, x: torch.Tensor, recon: torch.Tensor) -> None:
        x64 = x.detach().double().reshape(-1, x.shape[-1])
        st = self.error_stats[side]
        st[0] += float(((recon.double().reshape(-1, x.shape[-1]) - x64) ** 2).sum())
        st[1] = x64.sum(0) if st[1] is None else st[1] + x64.sum(0)
        st[2] += float((x64**2).sum())
        st[3] += x64.shape[0]

    def crop(self, tokens_to_remove: int) -> None:
        """``n < 0`` drops the last ``-n`` positions, ``n > 0`` keeps the first ``n`` (both
        transformers conventions, :func:`~model_adapters.caches.window.crop_target`), ``0`` does
        nothing.

        The layer is left as a fresh run on the kept tokens leaves it: archived positions at or
        past ``archive_end(keep)`` get their exact K/V back from the copies kept of the last
        ``rewind`` archived positions. ValueError, before anything changes, when that needs
        positions older than those copies, or positions whose codes already went to a rows
        collector.
        """
        length = self.get_seq_length()
        keep = crop_target(tokens_to_remove, length)
        if keep == length:
            return
        if self.pads is not None and self.quantizer is not None:
            self._crop_padded(keep)
            super().crop(keep - length)
            return
        new_until = min(self.archived_until, archive_end(keep, self.sinks, self.recent, self.block))
        if self.quantizer is not None and new_until < self.archived_until:
            if self.rows is not None:
                shortest = shortest_crop(self.archived_until, self.sinks, self.recent, self.block)
                raise ValueError(
                    f"cannot crop layer {self.layer_idx} to {keep} positions: positions up to "
                    f"{self.archived_until} are already archived and their codes went to the "
                    f"rows collector (crop to at least {shortest})"
                )
            lo_pos, hi_pos = max(new_until, self.sinks), min(self.archived_until, keep)
            if lo_pos < hi_pos:  # positions past keep are dropped, not restored
                if self.exact_k is None or lo_pos < self.exact_from:
                    lowest = self.archived_until if self.exact_k is None else self.exact_from
                    shortest = shortest_crop(lowest, self.sinks, self.recent, self.block)
                    raise ValueError(
                        f"cannot crop layer {self.layer_idx} to {keep} positions: positions up "
                        f"to {self.archived_until} are already archived and exact copies are "
                        f"kept only from {lowest} (rewind {self.rewind}; crop to at least "
                        f"{shortest}, or to at most {self.sinks})"
                    )
                lo, hi = lo_pos - self.exact_from, hi_pos - self.exact_from
                self.keys[..., lo_pos:hi_pos, :] = self.exact_k[..., lo:hi, :]
                self.values[..., lo_pos:hi_pos, :] = self.exact_v[..., lo:hi, :]
            if self.exact_k is not None:
                cut = max(0, new_until - self.exact_from)
                self.exact_k, self.exact_v = self.exact_k[..., :cut, :], self.exact_v[..., :cut, :]
            self.archived_until = new_until if new_until > self.sinks else 0
        super().crop(keep - length)

    def _crop_padded(self, keep: int) -> None:
        """:meth:`crop`'s checks and restores for a left-padded batch, sequence by sequence."""
        S, R, B = self.sinks, self.recent, self.block
        ends = [min(e, p + archive_end(keep - p, S, R, B))
                for e, p in zip(self.seq_ends, self.pads, strict=True)]
        back = [(b, max(e, p + S), min(old, keep)) for b, (e, p, old)
                in enumerate(zip(ends, self.pads, self.seq_ends, strict=True))
                if min(old, keep) > max(e, p + S)]
        if back and self.rows is not None:
            raise ValueError(f"cannot crop layer {self.layer_idx} to {keep} positions: archived "
                             "positions' codes already went to the rows collector")
        need = min((lo for _, lo, _ in back), default=None)
        if need is not None and (self.exact_k is None or need < self.exact_from):
            raise ValueError(
                f"cannot crop layer {self.layer_idx} to {keep} positions: position {need} would "
                f"have to be exact again, and exact copies are kept only from "
                f"{self.archived_until if self.exact_k is None else self.exact_from} "
                f"(rewind {self.rewind})")
        for b, lo, hi in back:
            src = slice(lo - self.exact_from, hi - self.exact_from)
            self.keys[b, :, lo:hi] = self.exact_k[b, :, src]
            self.values[b, :, lo:hi] = self.exact_v[b, :, src]
        # the largest end of a sequence that archived something (a sequence's end past its
        # sinks may lie beyond ``keep``); exact copies past it would be of dropped positions
        self.archived_until = max(
            (e for e, p in zip(ends, self.pads, strict=True) if e > p + S), default=0)
        if self.exact_k is not None:
            cut = max(0, self.archived_until - self.exact_from)
            self.exact_k, self.exact_v = self.exact_k[..., :cut, :], self.exact_v[..., :cut, :]
        self.seq_ends = ends
        if keep == 0:
            self.pads, self.pad_tensor, self.seq_ends = None, None, []

    # the exact copies and the padding follow the batch like keys and values do (beam search,
    # repeats)
    def _map_exact(self, fn, order=None) -> None:
        if self.exact_k is not None:
            self.exact_k, self.exact_v = fn(self.exact_k), fn(self.exact_v)
        if self.pads is not None and order is not None:
            self.pads = [self.pads[i] for i in order]
            self.seq_ends = [self.seq_ends[i] for i in order] if self.seq_ends else []
            self.pad_tensor = torch.tensor(self.pads, device=self.pad_tensor.device)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        order = beam_idx.tolist() if self.pads is not None else None
        self._map_exact(lambda t: t.index_select(0, beam_idx.to(t.device)), order)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        order = None if self.pads is None else [
            i for i in range(len(self.pads)) for _ in range(repeats)]
        self._map_exact(lambda t: t.repeat_interleave(repeats, dim=0), order)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        order = torch.as_tensor(indices).tolist() if self.pads is not None else None
        self._map_exact(lambda t: t[indices, ...], order)

    def reset(self) -> None:
        """Empty the layer, as a new cache starts; refused once codes went to a rows collector
        (they cannot be taken back), as :meth:`crop` refuses."""
        if not self.is_croppable and self.archived_until > self.sinks:  # (a rows collector)
            raise ValueError(
                f"cannot reset layer {self.layer_idx}: positions up to {self.archived_until} "
                "are archived and their codes went to the rows collector; start a new cache"
            )
        self.archived_until, self.transit, self.seq_ends, self._room = 0, None, [], None
        self.failed = None
        self.exact_from, self.exact_k, self.exact_v = 0, None, None
        super().reset()


class ArchivingCache(Cache):
    """A transformers ``Cache`` that quantizes and archives positions leaving an exact window.

    Args:
        model_or_config: the model (or its config): GPT-2 or Qwen3.
        quantizer: codebooks for every layer; None keeps everything exact (and archives nothing).
            Checked once against the model (:meth:`~model_adapters.quant.KVQuantizer.check_model`:
            its architecture, and its weights when the quantizer records them and a model, not
            a config, is given).
        sinks: leading positions kept exact forever (attention sinks).
        recent: most recent positions kept exact.
        rows: collector receiving one row of codes per archived token (None: codes dropped).
        track_error: accumulate reconstruction errors for :meth:`reconstruction_nmse` (costs a
            little time per step).
        block: quantize positions leaving the window in groups of this many, aligned on
            ``sinks`` (the window then holds up to ``recent + block - 1`` exact positions); 1
            quantizes each position on the step it leaves. Larger groups read the codebooks once
            per group, which is most of the per-step cost on a CPU (see docs/adapters.md).
        rewind: archived positions whose exact K/V each layer keeps a copy of, so that
            ``crop`` back by up to ``rewind - block + 1`` positions leaves the state of a fresh
            run (the default covers transformers' assistant, 20 draft tokens per round).

    A multi-token forward that archives positions shows its earlier queries those positions
    exact (chunk invariance, see the module), which needs the model on
    :data:`~model_adapters.caches.codes_attention.CODES_ATTENTION`
    (:func:`~model_adapters.caches.codes_attention.use_codes_attention`); on another attention
    implementation such a forward raises RuntimeError at the next layer's update (start a new
    cache after switching). Single-token steps, and chunks that archive nothing, run on any.

    Use as ``model(input_ids, cache=c)`` / ``model.generate(..., cache=c)`` (see
    :func:`~model_adapters.models.cache_kwarg` for the argument name this transformers version
    expects).
    """

    # the position ids of the forward in progress, set by the hooks of use_codes_attention:
    # where transformers does not hand them to update (5.17), the batch's left padding
    forward_position_ids: torch.Tensor | None = None

    def __init__(
        self,
        model_or_config,
        quantizer: KVQuantizer | None = None,
        *,
        sinks: int = 4,
        recent: int = 32,
        rows: CodeRows | None = None,
        track_error: bool = False,
        block: int = 1,
        rewind: int = DEFAULT_REWIND,
    ):
        shape: KVShape = kv_shape(model_or_config)
        check_window(sinks=sinks, recent=recent, block=block, rewind=rewind)
        if quantizer is not None:
            quantizer.check_model(model_or_config)
            if quantizer.key_stages == 0 and quantizer.value_stages == 0:
                quantizer = None

        if rows is not None and quantizer is not None and rows.num_layers != shape.num_layers:
            raise ValueError(
                f"rows collector has {rows.num_layers} layers, model has {shape.num_layers}"
            )
        self.shape = shape
        self.quantizer = quantizer
        self.sinks = sinks
        self.recent = recent
        self.rows = rows
        self.block = block
        self.rewind = rewind
        layers = [
            ArchivingLayer(i, quantizer, sinks, recent, rows, track_error, block, rewind)
            for i in range(shape.num_layers)
        ]
        super().__init__(layers=layers)

    def __deepcopy__(self, memo: dict) -> ArchivingCache:
        """A copy with its own K/V that shares the quantizer (codebooks, look-up tables)."""
        return deepcopy_sharing(self, memo, [self.quantizer] if self.quantizer else [])

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        # checked before any layer changes: a batch above 1 (beams, num_return_sequences)
        # would otherwise fail in the first layer that archives, leaving layers out of step
        check_kv_states(self.shape, key_states, layer_idx, "archiving cache")
        if self.rows is not None and self.quantizer is not None:
            self.rows.check_batch(key_states.shape[0])
        if layer_idx == 0:
            self._check_in_step()
        elif self.layers[layer_idx - 1].transit is not None:
            raise unread_error(layer_idx - 1, "archiving cache")
        if layer_idx == 0 and self.quantizer is not None and self.get_seq_length() == 0:
            # a new sequence: its left padding, once (one read-back), from the position ids
            pads = left_pads(kwargs, key_states.shape[-2], self.forward_position_ids)
            for layer in self.layers:
                layer.pads, layer.seq_ends = pads, []
                layer.pad_tensor = None if pads is None else torch.tensor(
                    pads, device=key_states.device)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check_in_step(self) -> None:
        """Before a forward pass: every layer holds as many positions and none waits to be
        read. A pass that failed part-way (attention not switched, a rows sink that raised)
        leaves the layers out of step, and going on would mix positions silently."""
        failed = [layer.failed for layer in self.layers if layer.failed]
        if failed:
            raise RuntimeError(
                f"the archiving cache is out of step after a forward pass that failed part-way "
                f"({failed[0]}); start a new cache")
        if self.layers[-1].transit is not None:
            raise unread_error(self.layers[-1].layer_idx, "archiving cache")
        lengths = [layer.get_seq_length() for layer in self.layers]
        unread = [layer.layer_idx for layer in self.layers if layer.transit is not None]
        if unread or len(set(lengths)) > 1:
            raise RuntimeError(
                f"the archiving cache is out of step after a forward pass that failed part-way "
                f"(positions per layer {lengths}"
                f"{f', unread layers {unread}' if unread else ''}); start a new cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.rows is not None and self.quantizer is not None:
            self.rows.check_batch(repeats)  # the cache holds batch 1: it would hold ``repeats``
        super().batch_repeat_interleave(repeats)

    @property
    def archived_tokens(self) -> int:
        """Positions whose K/V are reconstructions, in the sequence with the most (every
        sequence of an unpadded batch has as many; :meth:`archived_per_sequence` has each
        one's count)."""
        return max(self.archived_per_sequence(), default=0)

    def archived_per_sequence(self) -> list[int]:
        """Positions of each sequence whose K/V are reconstructions (``batch`` ints; in a
        left-padded batch counted in the sequence's own tokens, pads never archived; the same
        in every layer after a step). Empty before the first update."""
        return archived_per_sequence(self.layers)

    def reconstruction_nmse(self) -> dict[str, float | None]:
        """Squared reconstruction error of the archived keys and values, each over their total
        variance around the mean (all layers pooled); 0 on an exact side, None before any
        position was archived."""
        out = {}
        for name, side in (("keys", 0), ("values", 1)):
            err = sum(layer.error_stats[side][0] for layer in self.layers)
            n = sum(layer.error_stats[side][3] for layer in self.layers)
            if n == 0:
                out[name] = None
                continue
            var = sum(
                st[2] - float((st[1] ** 2).sum()) / st[3]
                for st in (layer.error_stats[side] for layer in self.layers)
                if st[3]
            )
            out[name] = err / var if var > 0 else None
        return out

