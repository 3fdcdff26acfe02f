"""Left-padded batches in the codes-only cache: each sequence keeps its own window.

In a left-padded batch sequence ``b`` starts after ``pads[b]`` pads: its own position ``i`` is
the batch's position ``pads[b] + i``. Each sequence keeps the window it would keep alone
(:mod:`model_adapters.caches.window`, in its own positions): its first ``sinks`` real tokens
exact, positions ``[sinks, ends[b])`` only as codes, the rest exact. Pads are never coded, so
the codes of a sequence are its own real tokens (a rows collector, batch 1, receives exactly
those). A :class:`~model_adapters.caches.codes_only.CodesOnlyLayer` of a padded batch holds:

- ``sink_k`` / ``sink_v`` ``(batch, kv_heads, sinks, head_dim)``: each sequence's first
  ``min(sinks, n_b)`` real tokens (``n_b = length - pads[b]``);
- ``key_codes`` / ``value_codes`` ``(batch, kv_heads, capacity, stages)``: sequence ``b``'s
  archived positions in its first ``ends[b] - sinks`` entries;
- ``tail_k`` / ``tail_v``: the batch's positions ``[tail_start, length)`` exact, as the model
  hands them over (pads included); sequence ``b``'s attended recent positions are the last
  ``n_b - ends[b]``, and the ``rewind`` positions before its archive end stay for ``crop``.

A decode step reads a :class:`kernels.CodedCache` with per-sequence lengths and each
sequence's recent positions gathered to the front of its row, which is the kernels' contract
(valid entries first; :func:`kernels.decode_attention`, or the float32 look-ups of
:func:`~model_adapters.caches.codes_attention.lookup_attention`); a multi-token forward
rebuilds the batch's dense layout (:meth:`PaddedLayout.padded_dense`).
"""

from __future__ import annotations

import torch

from kernels import CodedCache
from model_adapters.caches.code_rows import add_rows
from model_adapters.caches.codes_attention import LAYER_ATTR, Transit
from model_adapters.caches.window import archive_end
from model_adapters.quant.rvq import decode

__all__ = ["PaddedLayout", "grow_positions"]


def grow_positions(buf: torch.Tensor, used: int, extra: int) -> torch.Tensor:
    """``buf`` ``(batch, heads, capacity, x)`` with room for ``extra`` more positions on dim 2
    after the first ``used`` (about 1/8 headroom; the first ``used`` are copied)."""
    need = used + extra
    if need <= buf.shape[2]:
        return buf
    cap = max(need, buf.shape[2] + buf.shape[2] // 8, 256)
    out = buf.new_zeros(*buf.shape[:2], cap, buf.shape[3])
    out[:, :, :used] = buf[:, :, :used]
    return out


class PaddedLayout:
    """The codes-only layer's methods for a left-padded batch (``pads`` is not None).

    Mixed into :class:`~model_adapters.caches.codes_only.CodesOnlyLayer`, whose attributes
    these methods read and write: ``cache`` (sinks, recent, block, rewind, rows, quantizer),
    ``length``, ``tail_k`` / ``tail_v`` / ``tail_start``, ``key_codes`` / ``value_codes``,
    ``archived_end`` (the largest sequence's archive end), plus ``pads`` (``list[int]``),
    ``pad_tensor`` (``(batch,)`` int64 on the layer's device), ``seq_ends`` (each sequence's
    archive end, in its own positions) and ``sink_k`` / ``sink_v``.
    """

    def start_padded(self, pads: list[int], device) -> None:
        """Begin a left-padded batch (an empty layer): ``pads[b]`` leading pads in row ``b``."""
        self.pads = list(pads)
        self.pad_tensor = torch.tensor(self.pads, device=device)
        self.seq_ends = [self.cache.sinks] * len(self.pads)
        self.archived_end = self.cache.sinks
        self.tail_start = 0  # every position goes to the tail; sinks are copied to sink_k

    def end_padded(self) -> None:
        """Back to an unpadded empty layer (after a crop to 0 or a reset)."""
        self.pads = self.pad_tensor = None
        self.seq_ends = []
        self.archived_end = self.tail_start = self.cache.sinks

    def archived_counts(self) -> list[int]:
        """Archived positions of each sequence (``batch`` ints; pads are never archived)."""
        if self.pads is None:
            return [self.archived_end - self.cache.sinks] * self.batch_size()
        return [e - self.cache.sinks for e in self.seq_ends]

    def batch_size(self) -> int:
        return self.tail_k.shape[0] if self.is_initialized else 0

    # --- update -------------------------------------------------------------------------------
    def update_padded(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """``update`` for a left-padded batch; returns the carrier the attention function reads
        the layer from. ``key_states`` / ``value_states`` ``(batch, kv_heads, chunk, d)``."""
        c = self.cache
        sinks, recent, block = c.sinks, c.recent, c.block
        chunk, first = key_states.shape[2], self.length
        self.tail_k = torch.cat([self.tail_k, key_states], 2)
        self.tail_v = torch.cat([self.tail_v, value_states], 2)
        self.length += chunk
        self._keep_sinks(key_states, value_states, first)
        starts = self.seq_ends
        ends = [archive_end(self.length - p, sinks, recent, block) for p in self.pads]
        # positions archived here that earlier queries of this chunk still see exact, in the
        # batch's positions (transit_mask picks, per sequence, who sees which form)
        lows = [max(a, archive_end(first + 1 - p, sinks, recent, block))
                for a, p in zip(starts, self.pads, strict=True)]
        held = [(p + lo, p + e) for p, lo, e in zip(self.pads, lows, ends, strict=True) if e > lo]
        if chunk > 1 and held:
            lo, hi = min(a for a, _ in held), max(b for _, b in held)
            a, b = lo - self.tail_start, hi - self.tail_start
            self.transit = Transit(lo, self.tail_k[:, :, a:b], self.tail_v[:, :, a:b],
                                   sinks, recent, block, self.pad_tensor)
        if any(e > a for a, e in zip(starts, ends, strict=True)):
            self._archive_padded(starts, ends)
        keys = self.tail_k[:, :, :]  # a fresh view carries the layer to the attention function
        setattr(keys, LAYER_ATTR, self)
        return keys, self.tail_v

    def _keep_sinks(self, key_states: torch.Tensor, value_states: torch.Tensor,
                    first: int) -> None:
        """Copy the sink positions this chunk (the batch's positions ``first`` on) brings to
        each sequence into ``sink_k`` / ``sink_v``."""
        sinks = self.cache.sinks
        if first == 0:
            b, h, _, d = key_states.shape
            self.sink_k = key_states.new_zeros(b, h, sinks, d)
            self.sink_v = value_states.new_zeros(b, h, sinks, d)
        for b, pad in enumerate(self.pads):
            lo, hi = max(0, first - pad), min(sinks, self.length - pad)
            if hi > lo:
                src = slice(pad + lo - first, pad + hi - first)
                self.sink_k[b, :, lo:hi] = key_states[b, :, src]
                self.sink_v[b, :, lo:hi] = value_states[b, :, src]

    def _archive_padded(self, starts: list[int], ends: list[int]) -> None:
        """Code each sequence's positions ``[starts[b], ends[b])`` (its own positions), reading
        the codebooks once for every sequence that archives."""
        c, sinks = self.cache, self.cache.sinks
        moving = [b for b in range(len(ends)) if ends[b] > starts[b]]
        width = max(ends[b] - starts[b] for b in moving)
        # tail index of each moving sequence's new positions (a shorter run repeats its last)
        index = [[self.pads[b] + min(starts[b] + i, ends[b] - 1) - self.tail_start
                  for i in range(width)] for b in moving]
        rows = torch.tensor(moving, device=self.device)
        h, d = self.tail_k.shape[1], self.tail_k.shape[3]
        at = torch.tensor(index, device=self.device)[:, None, :, None].expand(-1, h, -1, d)
        old_k = self.tail_k.index_select(0, rows).gather(2, at)
        old_v = self.tail_v.index_select(0, rows).gather(2, at)
        kc, _, vc, _ = c.device_quantizer(self.device).quantize(self.layer_idx, old_k, old_v)
        used, need = max(starts) - sinks, max(ends) - sinks
        self.key_codes = grow_positions(self.key_codes, used, need - used)
        self.value_codes = grow_positions(self.value_codes, used, need - used)
        for i, b in enumerate(moving):
            lo, n = starts[b] - sinks, ends[b] - starts[b]
            self.key_codes[b, :, lo : lo + n] = kc[i, :, :n]
            self.value_codes[b, :, lo : lo + n] = vc[i, :, :n]
            if c.rows is not None:  # batch 1 (checked before any layer changed)
                add_rows(c, c.rows, self.layer_idx, kc[i : i + 1, :, :n], vc[i : i + 1, :, :n])
        self.seq_ends = ends
        self.archived_end = max(ends)
        self._trim_padded()

    def _trim_padded(self) -> None:
        """Drop tail positions no sequence needs: below each sequence's sinks (held in
        ``sink_k``) and its last ``rewind`` archived positions."""
        c = self.cache
        keep_from = min(self.length, min(
            p + max(c.sinks, e - c.rewind) for p, e in zip(self.pads, self.seq_ends, strict=True)))
        if keep_from > self.tail_start:
            cut = keep_from - self.tail_start
            # clone: a view would keep the whole old storage alive
            self.tail_k = self.tail_k[:, :, cut:].clone()
            self.tail_v = self.tail_v[:, :, cut:].clone()
            self.tail_start = keep_from

    # --- what attention reads -----------------------------------------------------------------
    def padded_coded_cache(self, q) -> CodedCache:
        """The layer as a decode step reads it (``q``: the quantizer on the layer's device):
        per-sequence ``sink_lengths``, ``archived_lengths``, ``recent_lengths`` (int32, computed
        on the device from the padding), each sequence's recent positions first in its row."""
        c = self.cache
        sinks, recent, block = c.sinks, c.recent, c.block
        n = self.length - self.pad_tensor  # each sequence's real tokens
        ends = sinks + block * ((n - recent - sinks).clamp(min=0) // block)
        recent_lengths = (n - ends).clamp(min=0)
        width = max(max(0, self.length - p - e)
                    for p, e in zip(self.pads, self.seq_ends, strict=True))
        t, (h, d) = self.tail_k.shape[2], (self.tail_k.shape[1], self.tail_k.shape[3])
        # row b's recent positions are the tail's last recent_lengths[b]: move them to the front
        at = (t - recent_lengths[:, None] + torch.arange(width, device=n.device)).clamp(max=t - 1)
        at = at[:, None, :, None].expand(-1, h, -1, d)
        archived = self.archived_end - sinks
        return CodedCache(
            key_codes=self.key_codes[:, :, :archived],
            value_codes=self.value_codes[:, :, :archived],
            key_codebooks=q.key_codebooks[self.layer_idx],
            value_codebooks=q.value_codebooks[self.layer_idx],
            sink_keys=self.sink_k,
            sink_values=self.sink_v,
            recent_keys=self.tail_k.gather(2, at),
            recent_values=self.tail_v.gather(2, at),
            sink_lengths=n.clamp(max=sinks).int(),
            archived_lengths=(ends - sinks).int(),
            recent_lengths=recent_lengths.int(),
        )

    def padded_dense(self, q, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every position of the batch, ``(batch, kv_heads, length, d)`` in ``dtype``: each
        sequence's sinks and recent positions exact, its archived ones decoded, pads zero."""
        sinks = self.cache.sinks
        b, h, _, d = self.tail_k.shape
        k = self.tail_k.new_zeros(b, h, self.length, d, dtype=dtype)
        v = self.tail_v.new_zeros(b, h, self.length, d, dtype=dtype)
        k[:, :, self.tail_start :] = self.tail_k.to(dtype)
        v[:, :, self.tail_start :] = self.tail_v.to(dtype)
        archived = self.archived_end - sinks
        if archived:  # trusted: this cache's encoder wrote the codes
            dk = decode(self.key_codes[:, :, :archived], q.key_codebooks[self.layer_idx], dtype,
                        trusted=True)
            dv = decode(self.value_codes[:, :, :archived], q.value_codebooks[self.layer_idx],
                        dtype, trusted=True)
        for i, (p, e) in enumerate(zip(self.pads, self.seq_ends, strict=True)):
            if e > sinks:
                k[i, :, p + sinks : p + e] = dk[i, :, : e - sinks]
                v[i, :, p + sinks : p + e] = dv[i, :, : e - sinks]
            s = max(0, min(sinks, self.length - p))
            k[i, :, p : p + s] = self.sink_k[i, :, :s].to(dtype)
            v[i, :, p : p + s] = self.sink_v[i, :, :s].to(dtype)
        return k, v

    # --- rewinding ----------------------------------------------------------------------------
    def padded_ends_after(self, length: int) -> list[int]:
        c = self.cache
        return [min(e, archive_end(length - p, c.sinks, c.recent, c.block))
                for p, e in zip(self.pads, self.seq_ends, strict=True)]

    def _padded_needs_lost(self, length: int) -> bool:
        """Whether cutting back to ``length`` would need exact positions no longer held."""
        return any(min(e, length - p) > new and p + new < self.tail_start
                   for p, e, new in zip(self.pads, self.seq_ends,
                                        self.padded_ends_after(length), strict=True))

    def padded_crop_problem(self, length: int) -> str | None:
        """Why the layer cannot be cut back to ``length`` batch positions (None: it can)."""
        if 0 < length <= max(self.pads):
            return (f"a sequence of this left-padded batch (pads {self.pads}) would keep no "
                    f"token at {length} positions; crop to more than {max(self.pads)}, or to 0")
        if length == 0 or not self._padded_needs_lost(length):
            return None
        shortest = next(n for n in range(length + 1, self.length + 1)
                        if not self._padded_needs_lost(n))
        return (f"archived positions of this left-padded batch (pads {self.pads}) would have to "
                f"be exact again, but only their codes are held (rewind margin "
                f"{self.cache.rewind}); crop to at least {shortest}, or build the cache with a "
                "larger rewind")

    def padded_crop_to(self, length: int) -> None:
        """Cut back to ``length`` positions (check :meth:`padded_crop_problem` first)."""
        self.seq_ends = self.padded_ends_after(length)
        self.archived_end = max(self.seq_ends)
        keep = max(0, length - self.tail_start)
        self.tail_k, self.tail_v = self.tail_k[:, :, :keep], self.tail_v[:, :, :keep]
        self.tail_start = min(self.tail_start, length)
        self.length = length
        if length == 0:
            self.end_padded()
