"""Assemble per-layer codes into archive rows: one row per token.

Layers report their codes one after another within a forward pass; a token's row is complete once
every layer has reported it. Columns are ordered (layer, kv_head, K then V, stage).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

__all__ = ["CodeRows", "add_rows", "codes_to_rows"]


def codes_to_rows(key_codes: list[np.ndarray], value_codes: list[np.ndarray]) -> np.ndarray:
    """Rows from per-layer codes.

    Args:
        key_codes, value_codes: per layer, ``(kv_heads, n, stages)`` integer (stages may be 0).

    Returns:
        ``(n, num_layers * kv_heads * (key_stages + value_stages))`` int64.
    """
    per_layer = [
        np.concatenate([k, v], axis=-1) for k, v in zip(key_codes, value_codes, strict=True)
    ]
    stacked = np.stack(per_layer)  # (layers, heads, n, sk+sv)
    n = stacked.shape[2]
    return np.ascontiguousarray(stacked.transpose(2, 0, 1, 3).reshape(n, -1)).astype(np.int64)


def add_rows(owner, rows, layer_idx: int, key_codes: torch.Tensor,
             value_codes: torch.Tensor) -> None:
    """``rows.add(layer_idx, key_codes, value_codes)`` for a cache (or layer) ``owner``: if it
    raises, the pass stops part-way (later layers never report, the collector's layers fall
    out of step) and ``owner.failed`` says what raised, so that the owner refuses the next
    pass instead of going on."""
    try:
        rows.add(layer_idx, key_codes, value_codes)
    except BaseException as exc:
        owner.failed = f"the rows collector raised {type(exc).__name__} in layer {layer_idx}"
        raise


class CodeRows:
    """Collects codes from every layer and emits complete rows.

    Args:
        num_layers: decoder layers that report codes.
        sink: called with each batch of complete rows ``(n, width)`` int64, e.g. an archive
            stream's ``extend``; None keeps rows in :attr:`kept` only.
        keep: also keep every emitted row in memory (:meth:`all_rows`).
    """

    def __init__(
        self,
        num_layers: int,
        sink: Callable[[np.ndarray], object] | None = None,
        *,
        keep: bool = False,
    ):
        if sink is not None and not callable(sink):
            raise TypeError(f"sink must be a callable taking each batch of rows, got "
                            f"{type(sink).__name__} {sink!r}")
        self.num_layers = num_layers
        self.sink = sink
        self.keep = keep or sink is None
        self._pending: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(num_layers)]
        self._counts = [0] * num_layers
        self.kept: list[np.ndarray] = []
        self.emitted = 0

    @staticmethod
    def check_batch(batch: int) -> None:
        """ValueError unless ``batch`` is 1: one archive row describes one token of one
        sequence (caches call this before a step changes any layer)."""
        if batch != 1:
            raise ValueError(
                "a cache that hands codes to a rows collector or an archive needs batch size 1 "
                f"(one row per token), got batch {batch}"
            )

    def add(self, layer: int, key_codes: torch.Tensor, value_codes: torch.Tensor) -> None:
        """Codes of newly archived positions of one layer.

        Args:
            layer: layer index.
            key_codes, value_codes: ``(batch, kv_heads, n, stages)``; batch must be 1, since
                one archive row describes one token of one sequence.
        """
        self.check_batch(key_codes.shape[0])
        self._pending[layer].append((key_codes[0].cpu().numpy(), value_codes[0].cpu().numpy()))
        self._counts[layer] += key_codes.shape[2]
        ready = min(self._counts)
        if ready:
            self._flush(ready)

    def _flush(self, n: int) -> None:
        keys, values = [], []
        for layer in range(self.num_layers):
            k = np.concatenate([p[0] for p in self._pending[layer]], axis=1)
            v = np.concatenate([p[1] for p in self._pending[layer]], axis=1)
            keys.append(k[:, :n])
            values.append(v[:, :n])
            rest = (k[:, n:], v[:, n:])
            self._pending[layer] = [rest] if rest[0].shape[1] else []
            self._counts[layer] -= n
        rows = codes_to_rows(keys, values)
        if self.keep:
            self.kept.append(rows)
        if self.sink is not None:
            self.sink(rows)
        self.emitted += n

    def all_rows(self) -> np.ndarray:
        """Every row emitted so far, ``(n, width)`` int64 (needs ``keep``)."""
        if not self.kept:
            return np.zeros((0, 0), dtype=np.int64)
        return np.concatenate(self.kept)
