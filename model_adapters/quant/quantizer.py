"""Residual-VQ codebooks for every layer's keys and values of one model.

Keys and values have their own stage counts (0 keeps that side exact). Codebooks per layer are
``(kv_heads, stages, codebook_size, head_dim)`` float32; the whole set saves to and loads from
plain arrays so an archive can carry it, and to a folder (:meth:`KVQuantizer.save_pretrained`).
A quantizer may record the identity of the model it was fitted on
(:class:`~model_adapters.models.ModelIdentity`); it is then refused for another checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from model_adapters.models import (
    KVShape,
    ModelIdentity,
    check_identity,
    kv_shape,
    model_identity,
)
from model_adapters.quant.configs import QuantConfig, parse_config
from model_adapters.quant.rvq import (
    code_dtype,
    decode,
    encode_joint,
    joint_tables,
    train_rvq,
)

__all__ = ["CODEBOOKS_FILE", "CONFIG_FILE", "KVQuantizer", "shared_quantizer", "train_kv_quantizer"]

#: live quantizers by content key (:meth:`KVQuantizer.content_key`): what unpickling resolves to,
#: so every unpickled copy of one quantizer is that one object (see :meth:`KVQuantizer.__reduce__`)
_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class KVQuantizer:
    """Codebooks for all layers.

    Args:
        shape: the model's KV shape.
        key_codebooks: ``(num_layers, kv_heads, key_stages, codebook_size, head_dim)`` float, or
            None to keep keys exact.
        value_codebooks: same for values.
        pooled: whether each layer's codebook is shared by its heads (recorded, not enforced).
        identity: the model the codebooks were fitted on (None: not recorded, only the shape
            is checked when the quantizer is bound to a model).
        allow_different_weights: accept a model of the same architecture with other weights
            than ``identity``'s (set by :meth:`from_pretrained`).

    Fit, save and load like a transformers model::

        quantizer = KVQuantizer.fit(model, token_ids, "perhead-k256-s2")
        quantizer.save_pretrained("codebooks/")
        quantizer = KVQuantizer.from_pretrained("codebooks/", model)

    The codebooks are read-only once built: caches and their copies share one quantizer.
    A pickle holds the codebooks once however many caches in it use them (pickle's memo), not
    the encoder's tables (rebuilt on load), and unpickling resolves to the live quantizer of
    the same content in the process when there is one (:func:`shared_quantizer`), so caches
    unpickled from separate pickles share one storage too. ``copy.deepcopy`` of a quantizer
    alone gives an independent copy.
    """

    def __init__(
        self,
        shape: KVShape,
        key_codebooks,
        value_codebooks,
        *,
        pooled: bool = False,
        identity: ModelIdentity | None = None,
        allow_different_weights: bool = False,
    ):
        self.shape = shape
        self.pooled = bool(pooled)
        self.identity = identity
        self.allow_different_weights = bool(allow_different_weights)
        sizes = set()
        for side, books in (("key", key_codebooks), ("value", value_codebooks)):
            if books is None:
                continue
            books = torch.as_tensor(books)
            want = (shape.num_layers, shape.kv_heads, shape.head_dim)
            got = tuple(books.shape)
            if books.dim() != 5 or (got[0], got[1], got[4]) != want:
                raise ValueError(
                    f"{side} codebooks have shape {got}; this model needs (num_layers, kv_heads, "
                    "stages, codebook_size, head_dim) with (num_layers, kv_heads, head_dim) = "
                    f"{want}"
                )
            sizes.add(got[3])
        if len(sizes) > 1:
            raise ValueError(f"key and value codebook sizes differ: {sorted(sizes)}")
        self.key_codebooks = (
            None if key_codebooks is None else torch.as_tensor(key_codebooks, dtype=torch.float32)
        )
        self.value_codebooks = (
            None
            if value_codebooks is None
            else torch.as_tensor(value_codebooks, dtype=torch.float32)
        )
        self.codebook_size = sizes.pop() if sizes else 0
        self._build_tables()

    def _build_tables(self) -> None:
        """The encoder's tables, prepared once and reused by every step's :meth:`quantize`:
        per layer, the quantized sides' codebooks stacked
        (:func:`~model_adapters.quant.rvq.joint_tables`)."""
        sides = [b for b in (self.key_codebooks, self.value_codebooks) if b is not None]
        self._tables = [joint_tables([b[layer] for b in sides])
                        for layer in range(self.shape.num_layers)] if sides else []

    def table_tensors(self, layer: int) -> list[torch.Tensor]:
        """Every tensor of ``layer``'s prepared encoder tables (for marking them static)."""
        if not self._tables:
            return []
        return [*self._tables[layer].books, *self._tables[layer].norms]

    def content_key(self) -> str:
        """sha256 over the codebooks (values, shapes, device) and the shape, pooling and
        identity: equal for quantizers that quantize alike. Computed once (codebooks are
        read-only)."""
        key = self.__dict__.get("_content_key")
        if key is None:
            h = hashlib.sha256(repr((self.shape, self.pooled, self.identity,
                                     self.allow_different_weights)).encode())
            for books in (self.key_codebooks, self.value_codebooks):
                if books is None:
                    h.update(b"exact")
                    continue
                h.update(repr((tuple(books.shape), str(books.device))).encode())
                h.update(books.detach().cpu().contiguous().numpy().tobytes())
            key = self._content_key = h.hexdigest()
        return key

    def __reduce__(self):
        """Pickle as the codebooks and settings (no tables); loading goes through
        :func:`shared_quantizer`. This quantizer becomes the live one for its content."""
        key = self.content_key()
        _LIVE.setdefault(key, self)
        state = {k: v for k, v in self.__dict__.items() if k not in ("_tables", "_content_key")}
        return shared_quantizer, (key, state)

    def __deepcopy__(self, memo: dict) -> KVQuantizer:
        """An independent copy (its own codebooks and tables)."""
        clone = lambda t: None if t is None else t.clone()  # noqa: E731
        return self._like(clone(self.key_codebooks), clone(self.value_codebooks))

    @property
    def key_stages(self) -> int:
        return 0 if self.key_codebooks is None else self.key_codebooks.shape[2]

    @property
    def value_stages(self) -> int:
        return 0 if self.value_codebooks is None else self.value_codebooks.shape[2]

    @property
    def row_width(self) -> int:
        """Archive columns per token: layers x kv_heads x (key stages + value stages)."""
        return self.shape.num_layers * self.shape.kv_heads * (self.key_stages + self.value_stages)

    @property
    def code_dtype(self) -> torch.dtype:
        return code_dtype(max(self.codebook_size, 2))

    @property
    def config(self) -> QuantConfig:
        """The configuration these codebooks implement (its canonical name)."""
        cfg = QuantConfig(
            "", pooled=self.pooled, codebook_size=self.codebook_size,
            key_stages=self.key_stages, value_stages=self.value_stages,
        )
        return parse_config(cfg.canonical)

    def _like(self, key_codebooks, value_codebooks) -> KVQuantizer:
        """A quantizer with other codebooks and this one's shape, pooling and identity."""
        return KVQuantizer(
            self.shape, key_codebooks, value_codebooks, pooled=self.pooled,
            identity=self.identity, allow_different_weights=self.allow_different_weights,
        )

    def to(self, device) -> KVQuantizer:
        """The codebooks moved to ``device`` (a new object)."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return self._like(move(self.key_codebooks), move(self.value_codebooks))

    def check_model(self, model_or_config) -> None:
        """Raise ValueError unless these codebooks fit ``model_or_config``: its KV shape, and
        its identity when one is recorded (the weights only for a model, not a config, and not
        with ``allow_different_weights``). Hashes a sample of the weights: call it once when
        binding to a model, not per step."""
        shape = kv_shape(model_or_config)
        if self.shape != shape:
            raise ValueError(f"quantizer was built for {self.shape}, the model has {shape}")
        if self.identity is not None:
            check_identity(
                self.identity, model_identity(model_or_config), what="the quantizer's codebooks",
                allow_different_weights=self.allow_different_weights, warn=False,
            )

    def quantize(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        """Codes and reconstructions of one layer's positions.

        Args:
            layer: layer index.
            keys, values: ``(batch, kv_heads, n, head_dim)``.

        Returns:
            ``(key_codes, key_recon, value_codes, value_recon)``; codes are
            ``(batch, kv_heads, n, stages)`` (stages may be 0), a reconstruction is the input
            itself on an exact side.
        """
        batch, heads, n, _ = keys.shape
        exact = torch.zeros(batch, heads, n, 0, dtype=self.code_dtype, device=keys.device)
        sides = [x for books, x in zip((self.key_codebooks, self.value_codebooks),
                                       (keys, values), strict=True) if books is not None]
        coded = iter(encode_joint(sides, self._tables[layer]) if sides else [])
        out = []
        for books, x in zip((self.key_codebooks, self.value_codebooks), (keys, values),
                            strict=True):
            out += [exact, x] if books is None else list(next(coded))
        return tuple(out)

    def decode(
        self, layer: int, key_codes: torch.Tensor, value_codes: torch.Tensor, dtype=torch.float32
    ):
        """Reconstruct one layer's keys and values (None on an exact side)."""
        k = (
            None
            if self.key_codebooks is None
            else decode(key_codes, self.key_codebooks[layer], dtype)
        )
        v = (
            None
            if self.value_codebooks is None
            else decode(value_codes, self.value_codebooks[layer], dtype)
        )
        return k, v

    def rows_to_codes(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Split archive rows back into per-layer codes.

        Args:
            rows: ``(n, row_width)`` integer.

        Returns:
            ``(key_codes, value_codes)``: ``(num_layers, kv_heads, n, key_stages)`` and
            ``(num_layers, kv_heads, n, value_stages)`` int64.
        """
        rows = np.asarray(rows)
        if rows.ndim != 2 or rows.shape[1] != self.row_width:
            raise ValueError(f"rows must be (n, {self.row_width}), got {rows.shape}")
        sk, sv = self.key_stages, self.value_stages
        r = rows.reshape(rows.shape[0], self.shape.num_layers, self.shape.kv_heads, sk + sv)
        r = r.transpose(1, 2, 0, 3).astype(np.int64)
        return r[..., :sk], r[..., sk:]

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Codebooks as named float32 arrays (an exact side is absent).

        Per-head: ``(num_layers, kv_heads, stages, codebook_size, head_dim)``; pooled codebooks
        are stored once per layer, ``(num_layers, 1, stages, codebook_size, head_dim)``.
        """
        out = {}
        for name, books in (
            ("key_codebooks", self.key_codebooks),
            ("value_codebooks", self.value_codebooks),
        ):
            if books is not None:
                out[name] = (books[:, :1] if self.pooled else books).cpu().numpy()
        return out

    @classmethod
    def from_arrays(
        cls, shape: KVShape, arrays: dict, *, pooled: bool = False,
        identity: ModelIdentity | None = None,
    ) -> KVQuantizer:
        """Inverse of :meth:`to_arrays`; shapes are checked against ``shape``."""
        unknown = set(arrays) - {"key_codebooks", "value_codebooks"}
        if unknown:
            raise ValueError(f"unknown codebook arrays: {sorted(unknown)}")
        books = {}
        for name in ("key_codebooks", "value_codebooks"):
            b = None if name not in arrays else torch.from_numpy(np.asarray(arrays[name]))
            if b is not None and pooled and b.dim() == 5 and b.shape[1] == 1:
                b = b.expand(-1, shape.kv_heads, -1, -1, -1).contiguous()
            books[name] = b
        return cls(
            shape, books["key_codebooks"], books["value_codebooks"], pooled=pooled,
            identity=identity,
        )

    def prefix(self, key_stages: int, value_stages: int) -> KVQuantizer:
        """A quantizer using only the first stages of these codebooks (0 keeps a side exact)."""
        if key_stages > self.key_stages or value_stages > self.value_stages:
            raise ValueError(
                f"asked for K{key_stages}V{value_stages}, codebooks have "
                f"K{self.key_stages}V{self.value_stages}"
            )
        k = self.key_codebooks[:, :, :key_stages].contiguous() if key_stages else None
        v = self.value_codebooks[:, :, :value_stages].contiguous() if value_stages else None
        return self._like(k, v)

    # --- fit, save, load ----------------------------------------------------------------------
    @classmethod
    def fit(
        cls,
        model,
        token_ids,
        config: str | QuantConfig,
        *,
        context: int = 1024,
        iters: int = 20,
        seed: int = 0,
        max_points: int | None = None,
        progress: bool = True,
    ) -> KVQuantizer:
        """Collect the K/V ``model`` caches over ``token_ids`` and train codebooks on them.

        Args:
            model: a GPT-2 or Qwen3 causal LM.
            token_ids: one run of token ids (a sequence or 1-D tensor), or a list of runs.
            config: a configuration name (``"perhead-k256-s2"``, see
                :mod:`model_adapters.quant.configs`) or a parsed :class:`QuantConfig`.
            context: tokens per forward pass while collecting (at most the model's positions).
            iters, seed, max_points: k-means settings (:func:`train_kv_quantizer`).
            progress: show progress bars (collecting, then one step per layer and side).

        Returns:
            A quantizer on the CPU recording ``model``'s identity.
        """
        from tqdm.auto import tqdm

        from model_adapters.quant.collect import collect_kv

        cfg = parse_config(config) if isinstance(config, str) else config
        shape, identity = kv_shape(model), model_identity(model)
        runs = _segments(token_ids)
        vocab = model.get_input_embeddings().num_embeddings
        bad = [t for run in runs for t in run if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids must lie in [0, {vocab}) (the model's vocabulary), got "
                             f"{bad[:4]}")
        keys, values = collect_kv(model, runs, context=context, progress=progress)
        steps = shape.num_layers * ((cfg.key_stages > 0) + (cfg.value_stages > 0))
        with tqdm(total=steps, desc="fit codebooks", unit="layer", disable=not progress) as bar:
            q = train_kv_quantizer(
                keys, values, shape, cfg, iters=iters, seed=seed, max_points=max_points,
                progress=lambda _layer: bar.update(1),
            )
        q.identity = identity
        return q

    def save_pretrained(self, directory) -> Path:
        """Write :data:`CODEBOOKS_FILE` (safetensors, the arrays of :meth:`to_arrays`) and
        :data:`CONFIG_FILE` (JSON: configuration name, shape, pooling, model identity) into
        ``directory`` (created if needed); returns its path."""
        from safetensors.numpy import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: np.ascontiguousarray(v) for k, v in self.to_arrays().items()},
                  str(out / CODEBOOKS_FILE))
        meta = {
            "format": _FORMAT,
            "version": 1,
            "quant_config": self.config.canonical,
            "shape": asdict(self.shape),
            "pooled": self.pooled,
            "codebook_size": self.codebook_size,
            "key_stages": self.key_stages,
            "value_stages": self.value_stages,
            "model_identity": None if self.identity is None else self.identity.to_dict(),
        }
        (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        return out

    @classmethod
    def from_pretrained(
        cls, directory, model, *, allow_different_weights: bool = False
    ) -> KVQuantizer:
        """Load codebooks saved by :meth:`save_pretrained` for ``model``.

        Args:
            directory: the folder.
            model: the model to use them with (a config checks only the architecture).
            allow_different_weights: accept a model of the same architecture whose weights
                differ from those the codebooks were fitted on.

        Raises:
            ValueError: another architecture or KV shape, other weights (naming both
                identities), or a folder that does not hold a quantizer.
        """
        from safetensors.numpy import load_file

        folder = Path(directory)
        try:
            meta = json.loads((folder / CONFIG_FILE).read_text())
        except FileNotFoundError:
            raise ValueError(f"{str(folder)!r} holds no {CONFIG_FILE}") from None
        if meta.get("format") != _FORMAT:
            raise ValueError(f"{folder / CONFIG_FILE} is not a {_FORMAT} file")
        shape = KVShape(**meta["shape"])
        ident = meta.get("model_identity")
        identity = None if ident is None else ModelIdentity.from_dict(ident)
        q = cls.from_arrays(shape, load_file(str(folder / CODEBOOKS_FILE)),
                            pooled=bool(meta["pooled"]), identity=identity)
        q.allow_different_weights = allow_different_weights
        if q.shape != kv_shape(model):
            raise ValueError(
                f"codebooks in {str(folder)!r} were built for {q.shape}, the model has "
                f"{kv_shape(model)}"
            )
        if identity is not None:
            check_identity(identity, model_identity(model), what=f"codebooks in {str(folder)!r}",
                           allow_different_weights=allow_different_weights)
        return q


def shared_quantizer(key: str, state: dict) -> KVQuantizer:
    """The quantizer a pickle holds (``state``: :meth:`KVQuantizer.__reduce__`'s): the live one
    with content ``key`` if the process has one, else a new one built from ``state`` (tables
    rebuilt), which becomes the live one."""
    live = _LIVE.get(key)
    if live is not None:
        return live
    q = KVQuantizer.__new__(KVQuantizer)
    q.__dict__.update(state)
    q._build_tables()
    q._content_key = key
    return _LIVE.setdefault(key, q)


def _segments(token_ids) -> list[list[int]]:
    """Runs of token ids from one run (sequence, 1-D tensor or array) or a list of runs."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.tolist()
    if isinstance(token_ids, np.ndarray):
        token_ids = token_ids.tolist()
    runs = list(token_ids)
    if runs and isinstance(runs[0], (list, tuple, np.ndarray, torch.Tensor)):
        return [[int(t) for t in run] for run in runs]
    return [[int(t) for t in runs]]


CODEBOOKS_FILE = "codebooks.safetensors"
CONFIG_FILE = "quantizer_config.json"
_FORMAT = "fkv-kv-quantizer"


def train_kv_quantizer(
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    shape: KVShape,
    config: QuantConfig,
    *,
    iters: int = 20,
    seed: int = 0,
    init_sample: int | None = 16384,
    max_points: int | None = None,
    progress=None,
) -> KVQuantizer:
    """Train codebooks for every layer.

    Args:
        keys, values: per layer, ``(n, kv_heads, head_dim)`` training vectors (keys as cached).
        shape: the model's KV shape.
        config: pooled/per-head, codebook size and stage counts.
        iters, seed, init_sample, max_points: k-means settings (see
            :func:`model_adapters.quant.rvq.train_rvq`); layer ``l`` uses ``seed + 1000 * l`` (plus
            1 for values) so layers do not share random draws.
        progress: optional callable, called once per trained (layer, side).
    """
    if config.is_exact:
        return KVQuantizer(shape, None, None)
    if len(keys) != shape.num_layers or len(values) != shape.num_layers:
        raise ValueError(
            f"need training vectors for {shape.num_layers} layers, got {len(keys)} keys / "
            f"{len(values)} values"
        )
    sides = {}
    for side, vecs, stages, off in (
        ("k", keys, config.key_stages, 0),
        ("v", values, config.value_stages, 1),
    ):
        if stages == 0:
            sides[side] = None
            continue
        books = []
        for layer, x in enumerate(vecs):
            books.append(
                train_rvq(
                    x,
                    num_quantizers=stages,
                    codebook_size=config.codebook_size,
                    pooled=config.pooled,
                    iters=iters,
                    seed=seed + 1000 * layer + 500 * off,
                    init_sample=init_sample,
                    max_points=max_points,
                )
            )
            if progress is not None:
                progress(layer)
        sides[side] = torch.stack(books)
    return KVQuantizer(shape, sides["k"], sides["v"], pooled=config.pooled)
