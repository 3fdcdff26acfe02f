"""Residual-VQ codebooks for every layer's keys and values of one model.

Keys and values have their own stage counts (0 keeps that side exact). Codebooks per layer are
``(kv_heads, stages, codebook_size, head_dim)`` float32; the whole set saves to and loads from
plain arrays so an archive can carry it.
"""

from __future__ import annotations

import numpy as np
import torch

from model_adapters.adapters import KVShape
from model_adapters.configs import QuantConfig
from model_adapters.rvq import code_dtype, decode, encode, stage_tables, train_rvq

__all__ = ["KVQuantizer", "train_kv_quantizer"]


class KVQuantizer:
    """Codebooks for all layers.

    Args:
        shape: the model's KV shape.
        key_codebooks: ``(num_layers, kv_heads, key_stages, codebook_size, head_dim)`` float, or
            None to keep keys exact.
        value_codebooks: same for values.
        pooled: whether each layer's codebook is shared by its heads (recorded, not enforced).
    """

    def __init__(self, shape: KVShape, key_codebooks, value_codebooks, *, pooled: bool = False):
        self.shape = shape
        self.pooled = bool(pooled)
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
        # per-stage tables, prepared once and reused by every step's encode
        self._tables = [
            None if b is None else [stage_tables(layer) for layer in b]
            for b in (self.key_codebooks, self.value_codebooks)
        ]

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

    def to(self, device) -> KVQuantizer:
        """The codebooks moved to ``device`` (a new object)."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return KVQuantizer(
            self.shape, move(self.key_codebooks), move(self.value_codebooks), pooled=self.pooled
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
        out = []
        sides = zip(
            (self.key_codebooks, self.value_codebooks), (keys, values), self._tables, strict=True
        )
        for books, x, tables in sides:
            if books is None:
                out += [torch.zeros(batch, heads, n, 0, dtype=self.code_dtype, device=x.device), x]
            else:
                out += list(encode(x, books[layer], tables[layer]))
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
    def from_arrays(cls, shape: KVShape, arrays: dict, *, pooled: bool = False) -> KVQuantizer:
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
        return cls(shape, books["key_codebooks"], books["value_codebooks"], pooled=pooled)

    def prefix(self, key_stages: int, value_stages: int) -> KVQuantizer:
        """A quantizer using only the first stages of these codebooks (0 keeps a side exact)."""
        if key_stages > self.key_stages or value_stages > self.value_stages:
            raise ValueError(
                f"asked for K{key_stages}V{value_stages}, codebooks have "
                f"K{self.key_stages}V{self.value_stages}"
            )
        k = self.key_codebooks[:, :, :key_stages].contiguous() if key_stages else None
        v = self.value_codebooks[:, :, :value_stages].contiguous() if value_stages else None
        return KVQuantizer(self.shape, k, v, pooled=self.pooled)


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
            :func:`model_adapters.rvq.train_rvq`); layer ``l`` uses ``seed + 1000 * l`` (plus
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
