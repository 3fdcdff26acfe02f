"""What every serving archive shares: a cache, the archive file it is kept in, and the stream of
token ids fed through it (batch 1).

:class:`FedArchive` feeds a model through its cache (:meth:`~FedArchive.forward`,
:meth:`~FedArchive.generate`) so that the ``tokens`` stream follows the cache, checks the model
against the identity the archive records, searches the token stream (:meth:`~FedArchive.find`)
and checkpoints on close. Subclasses say what a checkpoint writes:
:class:`~model_adapters.store.serving_archive.ServingArchive` (residual-VQ codes and an exact
window) and :class:`~model_adapters.store.fsq_archive.FsqArchive` (FSQ codes only).
"""

from __future__ import annotations

import warnings
import weakref

import numpy as np
import torch

from model_adapters.models import ModelIdentity, cache_kwarg, check_identity, model_identity

__all__ = ["TOKENS_STREAM", "FedArchive", "model_device", "vocab_size"]

TOKENS_STREAM = "tokens"


def vocab_size(model) -> int:
    return int(getattr(model, "config", model).vocab_size)


def model_device(model):
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


class FedArchive:
    """A cache (``.cache``), the archive ``ar`` it is kept in and the token stream view
    ``tokens`` (an fkvstore stream or a chained view of one, one row of width 1 per token).

    ``identity`` is the bound model's (:func:`~model_adapters.models.model_identity`, computed
    once by the constructor functions); a model passed to :meth:`forward` or :meth:`generate`
    is checked against it the first time it is seen, not on every call.
    """

    def __init__(self, ar, cache, model, *, identity: ModelIdentity, tokens, tokenizer=None,
                 parents=(), allow_different_weights: bool = False):
        self.archive = ar
        self.cache = cache
        self.tokenizer = tokenizer
        self.identity = identity
        self.tokens = tokens
        self._allow_different_weights = allow_different_weights
        self._checked_models = weakref.WeakSet([model])  # models already compared with identity
        self.writable = bool(getattr(ar, "writable", True))
        self._parents = list(parents)  # read-only parent archives, closed with this one
        self._index = None
        self._broken = None  # why the cache no longer matches the token stream, if it does not

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # an error is on its way out: do not hide it behind a failed checkpoint
        try:
            self.close()
        except Exception as err:  # noqa: BLE001 - reported, the original error propagates
            warnings.warn(f"{self.archive!r} closed without a checkpoint: {err}", stacklevel=2)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.archive!r}, length={len(self.tokens)})"

    # --- subclasses -----------------------------------------------------------------------------
    def checkpoint(self) -> None:
        """Write what a later :func:`resume` needs, then flush the archive."""
        raise NotImplementedError

    def _before_feed(self) -> None:
        """Called before every model call (after the checks): bring the streams in step with
        a cache changed behind this object's back (e.g. cropped)."""

    # --- feeding the model --------------------------------------------------------------------
    def _check_model(self, model) -> None:
        """Refuse a model other than the bound one; each model object is hashed once."""
        if model in self._checked_models:
            return
        other = model_identity(model)
        if other.config != self.identity.config:
            raise ValueError(
                "this model's configuration differs from the one the archive was written for "
                f"(config fingerprint {other.config[:12]}... vs {self.identity.config[:12]}...)"
            )
        check_identity(self.identity, other, what=f"{self.archive!r}",
                       allow_different_weights=self._allow_different_weights)
        self._checked_models.add(model)

    def _check_feed(self, model, name: str, ids) -> None:
        """Refuse a call before it touches the cache: read-only, broken, or bad ids."""
        if not self.writable:
            raise ValueError(
                f"{self.archive!r} is open read-only: resume with mode='r+' to continue writing"
            )
        if self._broken:
            raise ValueError(self._broken)
        self._check_model(model)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 \
                or ids.shape[1] == 0:
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"{name} must be a (1, n) tensor with n >= 1, got {shape}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"{name} must hold integer token ids, got {ids.dtype}")
        self._before_feed()

    def _feed(self, call):
        """Run a model call on the cache. If it fails after changing some layers, the cache
        no longer matches the token stream: this object then refuses further feeding and
        checkpoints (the archive keeps its last checkpoint)."""
        before = len(self.tokens)
        try:
            with torch.no_grad():
                return call()
        except BaseException:
            if any(layer.get_seq_length() != before for layer in self.cache.layers):
                self._broken = (
                    "a model call failed after changing the cache, which no longer matches "
                    f"the {before} recorded tokens: resume from the archive's last checkpoint"
                )
            raise

    def _record(self, ids: np.ndarray) -> None:
        self.tokens.extend(ids)
        if self._index is not None:
            self._index.extend(ids)

    def forward(self, model, input_ids: torch.Tensor):
        """Run ``model`` on new tokens ``(1, n)``, n >= 1, with the cache, recording them;
        the model's output. Tokens are recorded only when the call succeeds."""
        self._check_feed(model, "input_ids", input_ids)
        out = self._feed(lambda: model(input_ids, **{cache_kwarg(model): self.cache}))
        self._record(input_ids[0].cpu().numpy().astype(np.int64))
        return out

    def generate(self, model, new_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """``model.generate`` continuing the archived text with ``new_ids`` ``(1, n)``, n >= 1.

        Returns the full sequence ``(1, length + n + generated)``; every token the model has
        consumed is recorded (the last generated token is not yet in the cache).
        """
        self._check_feed(model, "new_ids", new_ids)
        context = torch.as_tensor(self.token_ids(), device=new_ids.device)[None]
        ids = torch.cat([context, new_ids.to(context.dtype)], 1)
        kwargs.setdefault("attention_mask", torch.ones_like(ids))
        out = self._feed(lambda: model.generate(ids, **{cache_kwarg(model): self.cache},
                                                **kwargs))
        seq = out if isinstance(out, torch.Tensor) else out.sequences
        consumed = self.cache.get_seq_length()
        self._record(seq[0, len(self.tokens) : consumed].cpu().numpy().astype(np.int64))
        return out

    def token_ids(self) -> np.ndarray:
        """Every token id in the cache, ``(length,)`` int64."""
        return self.tokens.read()[:, 0]

    def close(self) -> None:
        """Checkpoint (when writable and the cache still matches the token stream) and close
        the archive."""
        if getattr(self.archive, "closed", False):
            return
        try:
            if self._broken:
                warnings.warn(f"{self.archive!r} closed without a checkpoint: {self._broken}",
                              stacklevel=2)
            elif self.writable:
                self.checkpoint()
        finally:
            self.archive.close()
            for parent in self._parents:
                parent.close()

    def find(self, query, tokenizer=None) -> np.ndarray:
        """Positions whose preceding tokens are ``query`` (token ids, or text to tokenize).

        Returns sorted int64 positions of the last token of every occurrence. Text is tokenized
        on its own, so a phrase that began with a space in the archived text needs that space.
        """
        if isinstance(query, str):
            tok = tokenizer or self.tokenizer
            if tok is None:
                raise ValueError("a text query needs a tokenizer (pass tokenizer=...)")
            query = tok.encode(query, add_special_tokens=False)
        if self._index is None:
            from fkvstore.index import SuffixIndex

            self._index = SuffixIndex.build(self.tokens.codec, self.token_ids())
        return self._index.search(np.asarray(query, dtype=np.int64))

    def _truncate_tokens(self, n: int) -> None:
        self.tokens.truncate(n)
        if self._index is not None:
            self._index.truncate(len(self.tokens))
