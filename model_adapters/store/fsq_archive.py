"""An FSQ-converted model's cache kept in an fkvstore archive: resume, search and rehydrate.

One file holds everything a later process needs to continue a sequence (batch 1) with the same
converted model:

- stream ``codes``: one row per token, ``layers x w`` columns ordered (layer, coordinate), the
  integer FSQ codes (alphabet: the largest level count);
- stream ``tokens``: every token id fed to the model, alphabet = the model's vocabulary;
- attributes: the converted model's identity (``model_type``, ``config_fingerprint``,
  ``weights_fingerprint``: the bottlenecks' weights included), ``fsq_width``, ``fsq_levels``,
  ``num_layers``, and the checkpoint ``serving_length``.

There is no exact window and no codebook: in a converted model the decoded keys and values *are*
the model's, so the codes are the whole cache and a resumed cache equals the one that was
written, bit for bit. Code rows go to the archive at each :meth:`FsqArchive.checkpoint` (rows not
yet written are the only thing a killed process loses; rows past the checkpoint, from a
checkpoint cut short, are dropped on resume). A crop of the cache is followed by the streams at
the next model call or checkpoint, the recorded length lowered first (a process killed in between
resumes at the crop).
"""

from __future__ import annotations

import numpy as np
import torch

from model_adapters.caches.fsq_cache import FSQCache
from model_adapters.models import ModelIdentity, check_identity, model_identity
from model_adapters.quant.fsq_config import fsq_spec
from model_adapters.quant.fsq_model import attention_layers
from model_adapters.store.archive_io import (
    CODES_STREAM,
    archive_identity,
    open_store,
)
from model_adapters.store.fed_archive import TOKENS_STREAM, FedArchive, model_device, vocab_size

__all__ = ["FsqArchive", "create", "resume"]


class FsqArchive(FedArchive):
    """An :class:`~model_adapters.caches.fsq_cache.FSQCache` (``.cache``) and the archive it is
    kept in (see the module). Build with :func:`create` or :func:`resume`; feed tokens through
    :meth:`forward` / :meth:`generate`; use as a context manager (closing checkpoints)."""

    def __init__(self, ar, cache: FSQCache, model, *, identity: ModelIdentity, tokenizer=None,
                 allow_different_weights: bool = False):
        super().__init__(ar, cache, model, identity=identity, tokens=ar[TOKENS_STREAM],
                         tokenizer=tokenizer, allow_different_weights=allow_different_weights)
        self.codes = ar[CODES_STREAM]
        self.width = int(ar.attrs["fsq_width"])
        self._modules = attention_layers(model)

    def _before_feed(self) -> None:
        """After a crop, cut both streams to the cache's length (rows of cropped positions
        would otherwise be read as those fed next). The checkpoint's length is lowered and
        flushed first, so a process killed in between leaves an archive that resumes."""
        length = self.cache.get_seq_length()
        if len(self.tokens) <= length and len(self.codes) <= length:
            return
        if int(self.archive.attrs.get("serving_length", 0)) > length:
            self.archive.attrs["serving_length"] = length
            self.archive.flush()
        if len(self.tokens) > length:
            self._truncate_tokens(length)
        if len(self.codes) > length:
            self.codes.truncate(length)

    def checkpoint(self) -> None:
        """Append the code rows not yet in the archive (or cut rows a crop removed), record the
        length, flush."""
        if not self.writable:
            raise ValueError(f"{self.archive!r} is open read-only; nothing to checkpoint")
        if self._broken:
            raise ValueError(self._broken)
        self._before_feed()
        length = self.cache.get_seq_length()
        if len(self.tokens) != length:
            raise ValueError(
                f"the cache holds {length} positions but {len(self.tokens)} tokens were "
                "recorded: feed the model through forward()/generate() of this object"
            )
        stored = len(self.codes)
        if length > stored:
            self.codes.extend(self._rows(stored, length))
        self.archive.attrs["serving_length"] = length
        self.archive.flush()

    def _rows(self, start: int, stop: int) -> np.ndarray:
        """The cache's code rows ``[start, stop)``, ``(stop - start, layers x w)`` int64."""
        parts = [self.cache.layer_codes(i)[0, start:stop] for i in range(len(self.cache.layers))]
        return torch.cat(parts, dim=1).cpu().numpy().astype(np.int64)

    def layer_codes(self, positions) -> np.ndarray:
        """Integer codes of past positions, ``(layers, len(positions), w)`` int64: from the
        archive where written, from the cache after that."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        length = self.cache.get_seq_length()
        if pos.size and (pos.min() < 0 or pos.max() >= length):
            bad = pos[(pos < 0) | (pos >= length)]
            raise IndexError(f"positions {bad.tolist()[:5]} are outside the cache [0, {length})")
        rows = np.empty((pos.size, len(self.cache.layers) * self.width), np.int64)
        stored = pos < min(len(self.codes), length)
        if stored.any():
            rows[stored] = np.asarray(self.codes[pos[stored]])
        for i in np.flatnonzero(~stored).tolist():
            rows[i] = self._rows(int(pos[i]), int(pos[i]) + 1)[0]
        return rows.reshape(pos.size, -1, self.width).transpose(1, 0, 2)

    def rehydrate(self, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of past positions decoded from their codes by the bound model's
        decoders (keys as attended: after k_norm and RoPE for Qwen3).

        Args:
            positions: int sequence, each in ``[0, length)``.

        Returns:
            ``(keys, values)``, each ``(num_layers, kv_heads, len(positions), head_dim)``
            float32 on the CPU.
        """
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        codes = self.layer_codes(pos)
        device = model_device(self._modules[0])
        where = torch.from_numpy(pos)[None].to(device)
        keys, values = [], []
        for module, c in zip(self._modules, codes, strict=True):
            k, v = self.cache.decode(module, torch.from_numpy(c)[None].to(device), where)
            keys.append(k[0].cpu())
            values.append(v[0].cpu())
        return torch.stack(keys), torch.stack(values)


def _check_model(model) -> tuple[int, tuple[int, ...]]:
    width, levels, _ = fsq_spec(model.config)  # ValueError for an unconverted model
    return width, levels


def create(path, model, *, tokenizer=None, backend: str = "auto", mode: str = "w-",
           cache: FSQCache | None = None, token_ids=None) -> FsqArchive:
    """A new archive at ``path`` for the converted ``model`` (batch 1).

    Args:
        cache: an :class:`FSQCache` of ``model`` already fed ``token_ids`` (``(length,)`` ints,
            one per cached position) to keep, e.g. after an evaluation ran the model on it;
            None starts empty (``backend`` as in :class:`FSQCache`).

    Raises:
        ValueError: ``model`` is not FSQ-converted, or ``cache`` and ``token_ids`` disagree
            (nothing is created then).
    """
    width, levels = _check_model(model)
    layers = len(attention_layers(model))
    if cache is None:
        cache, token_ids = FSQCache(model, backend=backend), []
    ids = np.asarray([] if token_ids is None else token_ids, dtype=np.int64).reshape(-1)
    if ids.size != cache.get_seq_length() or cache.get_seq_length() and \
            cache.layers[0].codes().shape[0] != 1:
        raise ValueError(f"the cache holds {cache.get_seq_length()} positions (batch 1 needed) "
                         f"but {ids.size} token ids were given")
    identity = model_identity(model)
    ar = open_store(path, mode, "fsq_archive")
    try:
        attrs = ar.attrs
        attrs["model_type"] = identity.model_type
        attrs["config_fingerprint"] = identity.config
        attrs["weights_fingerprint"] = identity.weights
        attrs["fsq_width"] = width
        attrs["fsq_levels"] = list(levels)
        attrs["num_layers"] = layers
        ar.create_stream(CODES_STREAM, alphabet_size=max(levels), geometry="grid",
                         width=layers * width)
        ar.create_stream(TOKENS_STREAM, alphabet_size=vocab_size(model), width=1)
        out = FsqArchive(ar, cache, model, identity=identity, tokenizer=tokenizer)
        if ids.size:
            out._record(ids)
        out.checkpoint()
    except BaseException:
        ar.close()
        raise
    return out


def resume(path, model, *, mode: str = "r+", backend: str = "auto", tokenizer=None,
           allow_different_weights: bool = False) -> FsqArchive:
    """Reopen an archive and rebuild its cache from the codes (no prefill): the next token's
    logits equal those of the process that wrote it.

    Args:
        mode: ``"r+"`` to keep writing (rows past the last checkpoint are dropped), ``"r"`` to
            continue in memory only.
        allow_different_weights: accept a converted model of the archive's configuration whose
            weights (bottlenecks included) differ from those it was written with.

    Raises:
        ValueError: another configuration, other weights, no checkpoint, or streams shorter
            than the checkpoint; the archive is left unchanged.
    """
    if mode not in ("r", "r+"):
        raise ValueError(f"mode must be 'r' or 'r+', got {mode!r}")
    width, levels = _check_model(model)
    ar = open_store(path, mode, "fsq_archive")
    try:
        identity = model_identity(model)
        recorded = archive_identity(ar)
        if recorded.config != identity.config:
            raise ValueError(f"{ar!r} was written for another model configuration "
                             f"({recorded.model_type}, fingerprint {recorded.config[:12]}...)")
        check_identity(recorded, identity, what=f"{ar!r}",
                       allow_different_weights=allow_different_weights)
        if "serving_length" not in ar.attrs:
            raise ValueError(f"{ar!r} has no checkpoint (serving_length missing)")
        length = int(ar.attrs["serving_length"])
        codes, tokens = ar[CODES_STREAM], ar[TOKENS_STREAM]
        if len(codes) < length or len(tokens) < length:
            raise ValueError(f"{ar!r}: the checkpoint needs {length} code rows and tokens, the "
                             f"streams hold {len(codes)} and {len(tokens)}")
        if codes.width != len(attention_layers(model)) * width:
            raise ValueError(f"{ar!r}: code rows of {codes.width} columns, the model needs "
                             f"{len(attention_layers(model))} x {width}")
        cache = FSQCache(model, backend=backend)
        if length:
            rows = np.asarray(codes.read(0, length), dtype=np.int64).reshape(length, -1, width)
            if (rows >= np.asarray(levels)).any() or (rows < 0).any():
                raise ValueError(f"{ar!r}: a stored code lies outside the levels {levels}")
            device = model_device(model)
            per_layer = torch.from_numpy(np.ascontiguousarray(rows.transpose(1, 0, 2)))
            cache.load([c[None].to(device) for c in per_layer],
                       torch.arange(length, device=device)[None])
        if mode == "r+":
            codes.truncate(length)
            tokens.truncate(length)
    except BaseException:
        ar.close()
        raise
    return FsqArchive(ar, cache, model, identity=identity, tokenizer=tokenizer,
                      allow_different_weights=allow_different_weights)
