"""A codes-only cache bound to an fkvstore archive: resume, rewind, search and rehydrate.

One archive file holds everything a later process needs to continue a sequence (batch 1):

- stream ``codes`` and the codebooks, model identity and window attributes written by
  :func:`model_adapters.store.archive_io.open_for_writing` (one row per archived token);
- stream ``tokens``: every token id fed to the model, alphabet = the model's vocabulary;
- arrays ``exact_head_keys`` / ``exact_head_values`` (``(layers, kv_heads, <=sinks, d)``) and
  ``exact_tail_keys`` / ``exact_tail_values`` (the recent window plus the rewind margin), in the
  cache's dtype (bfloat16 stored as float32, exactly), written by :meth:`ServingArchive.checkpoint`;
- attributes ``serving_length``, ``serving_archived``, ``serving_tail_start``, ``serving_rewind``,
  ``serving_block``, ``serving_dtype``: the checkpoint the arrays belong to (``serving_block``
  absent in archives written before it: 1);
- for a fork (:func:`fork`): ``parent`` (the parent file, relative to this one's folder),
  ``parent_tokens`` and ``parent_archived``: the streams here hold only what follows those.

Rows appended after the last checkpoint (a process that died mid-generation) are ignored on
resume, and dropped when the archive is reopened for writing: the checkpoint is the committed
state. :func:`resume` rebuilds the cache from codes and the exact window without running the
model over the archived text.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from model_adapters.caches.code_rows import CodeRows
from model_adapters.caches.codes_only import CodesOnlyCache
from model_adapters.models import (
    ModelIdentity,
    kv_shape,
    model_identity,
)
from model_adapters.quant.quantizer import KVQuantizer
from model_adapters.store.archive_io import (
    CODES_STREAM,
    open_for_writing,
    open_store,
    read_quantizer,
    require_fkvstore,
)
from model_adapters.store.fed_archive import TOKENS_STREAM, FedArchive, model_device, vocab_size
from model_adapters.store.serving_streams import ChainedStream, file_key, resolve_parent

__all__ = ["TOKENS_STREAM", "ServingArchive", "create", "fork", "resume"]

_WINDOW = ("exact_head_keys", "exact_head_values", "exact_tail_keys", "exact_tail_values")
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class ServingArchive(FedArchive):
    """A :class:`~model_adapters.caches.codes_only.CodesOnlyCache` (``.cache``) and the archive
    it writes.

    Build with :func:`create` or :func:`resume`; feed tokens through :meth:`forward` or
    :meth:`generate` so the token stream follows the cache. Use as a context manager;
    :meth:`close` writes a checkpoint first when the archive is writable (the feeding,
    identity checks and search are :class:`~model_adapters.store.fed_archive.FedArchive`'s).
    """

    def __init__(
        self, ar, cache: CodesOnlyCache, model, *, identity: ModelIdentity, tokenizer=None,
        views=None, parents=(), allow_different_weights: bool = False,
    ):
        codes, tokens = views or (
            ChainedStream(ar[CODES_STREAM]),
            ChainedStream(ar[TOKENS_STREAM]),
        )
        super().__init__(ar, cache, model, identity=identity, tokens=tokens, tokenizer=tokenizer,
                         parents=parents, allow_different_weights=allow_different_weights)
        self.codes = codes
        cache.archive_hooks.append(self)

    def __repr__(self) -> str:
        return (
            f"ServingArchive({self.archive!r}, length={len(self.tokens)}, "
            f"archived={self.cache.archived_tokens})"
        )

    # --- persistence --------------------------------------------------------------------------
    def checkpoint(self) -> None:
        """Write the exact window and the lengths it belongs to, then flush the archive."""
        if not self.writable:
            raise ValueError(f"{self.archive!r} is open read-only; nothing to checkpoint")
        if self._broken:
            raise ValueError(self._broken)
        cache = self.cache
        length = cache.get_seq_length()
        if len(self.tokens) != length:
            raise ValueError(
                f"the cache holds {length} positions but {len(self.tokens)} tokens were "
                "recorded: feed the model through forward()/generate() of this object"
            )
        layers = cache.layers
        dtype = layers[0].dtype if layers[0].is_initialized else torch.float32
        for name, attr in zip(_WINDOW, ("head_k", "head_v", "tail_k", "tail_v"), strict=True):
            if layers[0].is_initialized:
                stack = torch.stack([getattr(layer, attr)[0] for layer in layers])
                arr = stack.float() if dtype == torch.bfloat16 else stack
                self.archive.put_array(name, arr.cpu().numpy())
            else:
                empty = (len(layers), cache.shape.kv_heads, 0, cache.shape.head_dim)
                self.archive.put_array(name, np.zeros(empty, np.float32))
        attrs = self.archive.attrs
        attrs["serving_length"] = length
        attrs["serving_archived"] = cache.archived_tokens
        attrs["serving_tail_start"] = layers[0].tail_start
        attrs["serving_rewind"] = cache.rewind
        attrs["serving_block"] = cache.block
        attrs["serving_dtype"] = str(dtype).replace("torch.", "")
        self.archive.flush()

    # --- rewinding (hooks called by CodesOnlyCache.crop) --------------------------------------
    def check_truncate(self, target: int, cache: CodesOnlyCache) -> None:
        if not self.writable:
            raise ValueError(
                f"cannot crop: {self.archive!r} is open read-only and would no longer match"
            )
        if target < self.tokens.base or cache.archived_after(target) < self.codes.base:
            raise ValueError(
                f"cannot crop to {target} positions: this archive is a fork of its first "
                f"{self.tokens.base} positions, which belong to the parent archive"
            )

    def truncate(self, target: int, cache: CodesOnlyCache) -> None:
        kept = cache.archived_tokens
        self.codes.truncate(kept)
        if cache.rows is not None:
            cache.rows.emitted = kept
        self._truncate_tokens(min(target, len(self.tokens)))

    # --- search and rehydration ---------------------------------------------------------------
    def rehydrate(self, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of past positions: archived ones decoded from the archive's codes (from
        the cache's codes for positions archived after the archive stopped taking rows, as in a
        ``mode="r"`` continuation), window positions exact from the cache.

        Args:
            positions: int sequence, each in ``[0, length)``.

        Returns:
            ``(keys, values)``, each ``(num_layers, kv_heads, len(positions), head_dim)``
            float32 (keys as cached: after RoPE for Qwen3).
        """
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        length = self.cache.get_seq_length()
        if pos.size and (pos.min() < 0 or pos.max() >= length):
            bad = pos[(pos < 0) | (pos >= length)]
            raise IndexError(f"positions {bad.tolist()[:5]} are outside the cache [0, {length})")
        shape, q, sinks = self.cache.shape, self.cache.quantizer, self.cache.sinks
        out_k = torch.zeros(shape.num_layers, shape.kv_heads, pos.size, shape.head_dim)
        out_v = torch.zeros_like(out_k)
        layers = self.cache.layers
        end = layers[0].archived_end if layers[0].is_initialized else sinks
        coded = (pos >= sinks) & (pos < end)
        stored = coded & (pos < sinks + len(self.codes))
        if stored.any():
            kc, vc = q.rows_to_codes(self.codes[pos[stored] - sinks])
            codes = [(torch.from_numpy(kc[li]), torch.from_numpy(vc[li]))
                     for li in range(shape.num_layers)]
            self._decode_into(out_k, out_v, stored, codes)
        in_memory = coded & ~stored
        if in_memory.any():
            rel = torch.from_numpy(pos[in_memory] - sinks)
            codes = [(layer.key_codes[0][:, rel.to(layer.device)].cpu(),
                      layer.value_codes[0][:, rel.to(layer.device)].cpu()) for layer in layers]
            self._decode_into(out_k, out_v, in_memory, codes)
        for i in np.flatnonzero(~coded).tolist():
            p = int(pos[i])
            for li, layer in enumerate(layers):
                if p < sinks:
                    k, v = layer.head_k[0, :, p], layer.head_v[0, :, p]
                else:
                    t = p - layer.tail_start
                    k, v = layer.tail_k[0, :, t], layer.tail_v[0, :, t]
                out_k[li][:, i] = k.float().cpu()
                out_v[li][:, i] = v.float().cpu()
        return out_k, out_v

    def _decode_into(self, out_k, out_v, mask: np.ndarray, codes) -> None:
        """Decode per-layer ``(key_codes, value_codes)``, each ``(kv_heads, n, stages)``, into
        the columns of ``out_k`` / ``out_v`` where ``mask`` is set."""
        idx = torch.from_numpy(np.flatnonzero(mask))
        for li, (kc, vc) in enumerate(codes):
            k, v = self.cache.quantizer.decode(li, kc[None], vc[None])
            out_k[li][:, idx] = k[0]
            out_v[li][:, idx] = v[0]


def create(
    path,
    model,
    quantizer: KVQuantizer,
    *,
    sinks: int = 4,
    recent: int = 32,
    rewind: int = 0,
    backend: str = "auto",
    tokenizer=None,
    mode: str = "w-",
    block: int = 1,
) -> ServingArchive:
    """A new archive at ``path`` and an empty codes-only cache writing to it (batch 1);
    ``block`` as in :class:`~model_adapters.caches.codes_only.CodesOnlyCache` (kept by
    checkpoints)."""
    cache = CodesOnlyCache(
        model, quantizer, sinks=sinks, recent=recent, rewind=rewind, backend=backend,
        block=block,
    )
    identity = model_identity(model)
    ar, codes = open_for_writing(path, model, quantizer, sinks=sinks, recent=recent, mode=mode,
                                 identity=identity)
    ar.create_stream(TOKENS_STREAM, alphabet_size=vocab_size(model), width=1)
    cache.rows = CodeRows(kv_shape(model).num_layers, sink=codes.extend)
    return ServingArchive(ar, cache, model, identity=identity, tokenizer=tokenizer)


def resume(
    path,
    model,
    *,
    mode: str = "r+",
    quantizer: KVQuantizer | None = None,
    backend: str = "auto",
    tokenizer=None,
    allow_different_weights: bool = False,
    root=None,
) -> ServingArchive:
    """Reopen an archive and rebuild its cache from codes and the exact window (no prefill).

    Args:
        path: the archive.
        model: the model to continue with (it must use the codes attention); its configuration
            must be the one the archive was written for.
        mode: ``"r+"`` to keep writing (rows past the last checkpoint are dropped), ``"r"`` to
            continue in memory only (crop and further recording are refused).
        quantizer: if given, must equal the archive's codebooks (a check, not a replacement).
        allow_different_weights: accept a model of the archive's architecture whose weights
            differ from those it was written with.
        root: for a fork, the folder that must hold every archive of its chain of parents
            (default: ``path``'s folder); a ``parent`` attribute is never followed outside it.

    Raises:
        ValueError: another model configuration, other weights, other codebooks, no
            checkpoint, or streams shorter than the checkpoint; the archive is left unchanged.
            An archive that records only the configuration opens with a warning.
        fkvstore.errors.ArchiveParentError: a ``parent`` attribute that is absolute, leads
            outside ``root`` (``..`` or a symbolic link), closes a cycle or makes a chain longer
            than :data:`~model_adapters.store.serving_streams.MAX_PARENTS`.
    """
    if mode not in ("r", "r+"):
        raise ValueError(f"mode must be 'r' or 'r+', got {mode!r}")
    opened = []
    bind = {"identity": model_identity(model), "allow_different_weights": allow_different_weights}
    try:
        ar, codes_view, tokens = _open_chain(path, mode, model, opened, bind, root)
        cache = _rebuild(ar, model, quantizer, backend, codes_view, tokens, bind)
    except BaseException:
        for a in opened:
            a.close()
        raise
    length, archived = int(ar.attrs["serving_length"]), int(ar.attrs["serving_archived"])
    if mode == "r+":
        codes_view.truncate(archived)
        tokens.truncate(length)
        cache.rows = CodeRows(cache.shape.num_layers, sink=codes_view.extend)
        cache.rows.emitted = archived
    return ServingArchive(
        ar, cache, model, tokenizer=tokenizer, views=(codes_view, tokens), parents=opened[1:],
        **bind,
    )


def _open_chain(path, mode, model, opened, bind, root=None, seen=None):
    """Open ``path`` and, for a fork, its parents (read-only); appends every archive opened to
    ``opened`` (``path``'s first). Returns ``(archive, codes view, tokens view)``. ``bind``:
    the model's identity and ``allow_different_weights``; ``root``: the folder every parent
    must lie in (default ``path``'s); ``seen``: the files of the chain so far."""
    root = Path(path).resolve().parent if root is None else root
    seen = [file_key(path)] if seen is None else seen
    ar = open_store(path, mode, "serving_archive")
    opened.append(ar)
    attrs = ar.attrs
    if "parent" not in attrs:
        return ar, ChainedStream(ar[CODES_STREAM]), ChainedStream(ar[TOKENS_STREAM])
    fork_point = {k: _row_count(ar, k) for k in ("parent_archived", "parent_tokens")}
    parent_file = resolve_parent(path, attrs["parent"], root, seen)
    parent, p_codes, p_tokens = _open_chain(parent_file, "r", model, opened, bind, root, seen)
    mine, theirs = read_quantizer(ar, model, **bind), read_quantizer(parent, model, **bind)
    for side in ("key_codebooks", "value_codebooks"):
        if not torch.equal(getattr(mine, side), getattr(theirs, side)):
            raise ValueError(f"{ar!r} and its parent {parent!r} hold different codebooks")
    return (
        ar,
        ChainedStream(ar[CODES_STREAM], p_codes, fork_point["parent_archived"]),
        ChainedStream(ar[TOKENS_STREAM], p_tokens, fork_point["parent_tokens"]),
    )


def _row_count(ar, name) -> int:
    """Attribute ``name`` of ``ar``: a row count (a non-negative integer), else
    ``ArchiveFormatError`` naming it."""
    value = ar.attrs.get(name)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0:
        return int(value)
    shown = value.item() if isinstance(value, np.generic) else value
    raise require_fkvstore().errors.ArchiveFormatError(
        f"{ar!r}: attribute {name}={shown!r} is not a row count"
    )


def fork(
    parent_path, path, model, *, backend: str = "auto", tokenizer=None, mode: str = "w-",
    allow_different_weights: bool = False, root=None,
) -> ServingArchive:
    """A new archive at ``path`` continuing ``parent_path`` from its last checkpoint.

    The new file holds the codebooks, the identity attributes and what is written after the
    fork; the shared past stays in the parent (opened read-only while the fork is open), so
    any number of forks cost no copy of it. The parent must not be cropped below the fork point
    afterwards (a fork then refuses to open). Cropping the fork below the fork point is refused.
    ``allow_different_weights`` as in :func:`resume`. ``root`` (default: ``path``'s folder) must
    hold the parent and its own chain, as :func:`resume` of the fork will require; otherwise
    ``fkvstore.errors.ArchiveParentError`` before anything is written.
    """
    root = Path(path).resolve().parent if root is None else Path(root)
    here = Path(path).resolve().parent
    relative = os.path.relpath(Path(parent_path).resolve(), here)
    resolve_parent(Path(path).resolve(), relative, root, [file_key(path)])
    parent = resume(parent_path, model, mode="r", backend=backend,
                    allow_different_weights=allow_different_weights, root=root)
    cache = parent.cache
    cache.archive_hooks.remove(parent)
    try:
        ar, own_codes = open_for_writing(
            path, model, cache.quantizer, sinks=cache.sinks, recent=cache.recent, mode=mode,
            identity=parent.identity,
        )
    except BaseException:
        parent.close()
        raise
    ar.attrs["parent"] = relative
    ar.attrs["parent_tokens"] = len(parent.tokens)
    ar.attrs["parent_archived"] = cache.archived_tokens
    own_tokens = ar.create_stream(TOKENS_STREAM, alphabet_size=vocab_size(model), width=1)
    views = (
        ChainedStream(own_codes, parent.codes, cache.archived_tokens),
        ChainedStream(own_tokens, parent.tokens, len(parent.tokens)),
    )
    cache.rows = CodeRows(cache.shape.num_layers, sink=views[0].extend)
    cache.rows.emitted = cache.archived_tokens
    return ServingArchive(
        ar,
        cache,
        model,
        tokenizer=tokenizer or parent.tokenizer,
        views=views,
        parents=[parent.archive, *parent._parents],
        identity=parent.identity,
        allow_different_weights=allow_different_weights,
    )


def _rebuild(ar, model, quantizer, backend, codes_view, tokens, bind) -> CodesOnlyCache:
    stored = read_quantizer(ar, model, **bind)
    attrs = ar.attrs
    if "serving_length" not in attrs:
        raise ValueError(
            f"{ar!r} has no serving checkpoint (it was not written by model_adapters."
            "store.serving_archive, or was never checkpointed)"
        )
    if quantizer is not None:
        same = (
            quantizer.key_stages == stored.key_stages
            and quantizer.value_stages == stored.value_stages
            and quantizer.codebook_size == stored.codebook_size
            and torch.equal(quantizer.key_codebooks.cpu(), stored.key_codebooks)
            and torch.equal(quantizer.value_codebooks.cpu(), stored.value_codebooks)
        )
        if not same:
            raise ValueError(
                f"the given codebooks (K{quantizer.key_stages}V{quantizer.value_stages}, "
                f"size {quantizer.codebook_size}) differ from the archive's "
                f"(K{stored.key_stages}V{stored.value_stages}, size {stored.codebook_size})"
            )
    length, archived = int(attrs["serving_length"]), int(attrs["serving_archived"])
    have_codes, have_tokens = len(codes_view), len(tokens)
    if have_codes < archived or have_tokens < length:
        raise ValueError(
            f"{ar!r}: the checkpoint needs {archived} code rows and {length} tokens, the "
            f"streams hold {have_codes} and {have_tokens}"
        )
    vocab = int(tokens.alphabet_size)
    if vocab != vocab_size(model):
        raise ValueError(f"token stream alphabet {vocab} != model vocabulary {vocab_size(model)}")
    cache = CodesOnlyCache(
        model,
        stored,
        sinks=int(attrs["sinks"]),
        recent=int(attrs["recent"]),
        rewind=int(attrs["serving_rewind"]),
        backend=backend,
        # archives checkpointed before the option existed quantized every step
        block=int(attrs["serving_block"]) if "serving_block" in attrs else 1,
    )
    if length == 0:
        return cache
    device = model_device(model)
    dtype = _DTYPES[str(attrs["serving_dtype"])]
    window = [
        torch.from_numpy(np.asarray(ar.get_array(n))).to(device=device, dtype=dtype)
        for n in _WINDOW
    ]
    kc, vc = stored.rows_to_codes(codes_view.read(0, archived))
    tail_start = int(attrs["serving_tail_start"])

    def codes(c):
        return torch.from_numpy(np.ascontiguousarray(c))[None].to(
            device=device, dtype=stored.code_dtype
        )

    for li, layer in enumerate(cache.layers):
        layer.load_state(
            (window[0][li][None], window[1][li][None]),
            (codes(kc[li]), codes(vc[li])),
            (window[2][li][None], window[3][li][None]),
            length=length,
            tail_start=tail_start,
        )
    return cache
