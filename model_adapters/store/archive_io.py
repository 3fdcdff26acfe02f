"""The layout of one run's archive: what the archiving cache and the evaluation write, and what
:mod:`model_adapters.store.serving_archive` builds on (it adds a token stream and checkpoints).

- stream ``codes``: one row per archived token, ``width = layers x kv_heads x (K + V stages)``
  columns ordered (layer, kv_head, K then V, stage), alphabet ``codebook_size``;
- arrays ``key_codebooks`` / ``value_codebooks`` (float32, absent on an exact side) and
  ``window_keys`` / ``window_values`` (fp16 ``(layers, kv_heads, sinks + recent, head_dim)``,
  the exact window at the end of the run);
- attrs: model type, ``config_fingerprint`` and ``weights_fingerprint`` (the model's identity,
  :class:`~model_adapters.models.ModelIdentity`; archives written before the weights were
  recorded lack the second), shape, sinks, recent, pooled, stage counts.

The store layer (this module, ``serving_archive``, ``serving_streams``) is the only part of
model_adapters that imports fkvstore, and it uses only fkvstore's public API.
"""

from __future__ import annotations

import os

import numpy as np

from model_adapters.models import KVShape, ModelIdentity, kv_shape, model_identity
from model_adapters.models import check_identity as check_model_identity
from model_adapters.quant.quantizer import KVQuantizer

__all__ = [
    "CODES_STREAM",
    "ArchiveUnavailableError",
    "archive_identity",
    "check_identity",
    "open_for_writing",
    "read_codes",
    "read_quantizer",
    "require_fkvstore",
    "stream_data_bytes",
    "window_arrays",
    "write_window",
]

CODES_STREAM = "codes"


class ArchiveUnavailableError(RuntimeError):
    """fkvstore cannot be imported (for example, its compiled codec is missing)."""


def require_fkvstore():
    """The fkvstore module, or ArchiveUnavailableError saying why it cannot be imported."""
    try:
        import fkvstore
    except ImportError as exc:  # e.g. the codec it imports is not built
        raise ArchiveUnavailableError(f"fkvstore cannot be imported: {exc}") from exc
    return fkvstore


def open_store(path, mode: str, module: str):
    """``fkvstore.open(path, mode)``; a missing file or one that exists comes back as the same
    error with advice naming ``module``'s ``create`` / ``resume`` (not ``fkvstore.open``'s
    modes, which these functions set themselves)."""
    fkv = require_fkvstore()
    try:
        return fkv.open(path, mode)
    except fkv.errors.ArchiveNotFoundError:
        raise fkv.errors.ArchiveNotFoundError(
            f"no archive at {os.fspath(path)!r}; {module}.create(...) makes one") from None
    except fkv.errors.ArchiveExistsError:
        raise fkv.errors.ArchiveExistsError(
            f"{os.fspath(path)!r} already exists; {module}.resume(...) continues it, or "
            f"{module}.create(..., mode='w') replaces it") from None


def open_for_writing(
    path, model_or_config, quantizer: KVQuantizer, *, sinks: int, recent: int, mode: str = "w",
    identity: ModelIdentity | None = None,
):
    """Create an archive for one model and quantizer; returns ``(archive, codes_stream)``.

    The codebooks and the model identity (``identity``, computed from ``model_or_config`` when
    not given) are written at once, so the file is self-contained from the first row on.
    """
    shape = kv_shape(model_or_config)
    identity = identity or model_identity(model_or_config)
    ar = open_store(path, mode, "serving_archive")
    attrs = ar.attrs
    attrs["model_type"] = shape.model_type
    attrs["config_fingerprint"] = identity.config
    if identity.weights is not None:
        attrs["weights_fingerprint"] = identity.weights
    attrs["num_layers"] = shape.num_layers
    attrs["kv_heads"] = shape.kv_heads
    attrs["head_dim"] = shape.head_dim
    attrs["sinks"] = sinks
    attrs["recent"] = recent
    attrs["pooled"] = quantizer.pooled
    attrs["codebook_size"] = quantizer.codebook_size
    attrs["key_stages"] = quantizer.key_stages
    attrs["value_stages"] = quantizer.value_stages
    for name, arr in quantizer.to_arrays().items():
        ar.put_array(name, arr)
    stream = ar.create_stream(
        CODES_STREAM,
        alphabet_size=quantizer.codebook_size,
        geometry="grid",
        width=quantizer.row_width,
    )
    return ar, stream


def window_arrays(cache) -> tuple[np.ndarray, np.ndarray]:
    """The exact positions of a batch-1 cache that are not archived, as fp16 arrays: the sinks,
    then every later position not yet quantized (the ``recent`` window, plus the positions
    waiting for their group when the cache's ``block`` is above 1).

    Returns:
        ``(keys, values)``, each ``(num_layers, kv_heads, window, head_dim)`` float16.
    """
    sinks, recent = cache.sinks, cache.recent
    ks, vs = [], []
    for layer in cache.layers:
        seq = layer.get_seq_length()
        tail = max(seq - recent, 0)
        if getattr(layer, "quantizer", None) is not None:
            tail = min(tail, max(layer.archived_until, sinks))
        keep = sorted(set(range(min(sinks, seq))) | set(range(tail, seq)))
        ks.append(layer.keys[0][:, keep].to("cpu").half().numpy())
        vs.append(layer.values[0][:, keep].to("cpu").half().numpy())
    return np.stack(ks), np.stack(vs)


def write_window(ar, cache) -> int:
    """Store the cache's exact window (:func:`window_arrays`); returns the bytes stored."""
    k, v = window_arrays(cache)
    ar.put_array("window_keys", k)
    ar.put_array("window_values", v)
    return k.nbytes + v.nbytes


def archive_identity(ar) -> ModelIdentity:
    """The model identity an archive records (weights None in archives written before the
    weights were recorded)."""
    attrs = ar.attrs
    weights = attrs.get("weights_fingerprint")
    return ModelIdentity(
        str(attrs.get("model_type")), str(attrs.get("config_fingerprint")),
        None if weights is None else str(weights),
    )


def check_identity(
    ar, model_or_config, *, identity: ModelIdentity | None = None,
    allow_different_weights: bool = False,
) -> KVShape:
    """Raise ValueError unless the archive was written for this model: its configuration, and
    its weights where both sides know them (``allow_different_weights`` skips those). An
    archive that records only the configuration opens with a warning.

    Args:
        identity: ``model_or_config``'s identity, if already computed (it hashes the weights).
    """
    shape = kv_shape(model_or_config)
    identity = identity or model_identity(model_or_config)
    if ar.attrs.get("config_fingerprint") != identity.config:
        raise ValueError(
            f"archive was written for another model configuration (model_type "
            f"{ar.attrs.get('model_type')!r}, {ar.attrs.get('num_layers')} layers x "
            f"{ar.attrs.get('kv_heads')} kv heads x {ar.attrs.get('head_dim')}); this model is "
            f"{shape.model_type} {shape.num_layers} x {shape.kv_heads} x {shape.head_dim}"
        )
    check_model_identity(archive_identity(ar), identity, what=f"archive {ar!r}",
                         allow_different_weights=allow_different_weights)
    return shape


def read_quantizer(
    ar, model_or_config, *, identity: ModelIdentity | None = None,
    allow_different_weights: bool = False,
) -> KVQuantizer:
    """The codebooks stored in an archive, checked against the model (:func:`check_identity`);
    the quantizer records the archive's identity."""
    shape = check_identity(ar, model_or_config, identity=identity,
                           allow_different_weights=allow_different_weights)
    arrays = {}
    for name in ("key_codebooks", "value_codebooks"):
        if int(ar.attrs.get(name.split("_")[0] + "_stages", 0)):
            arrays[name] = ar.get_array(name)
    q = KVQuantizer.from_arrays(shape, arrays, pooled=bool(ar.attrs.get("pooled", False)),
                                identity=archive_identity(ar))
    q.allow_different_weights = allow_different_weights
    return q


def read_codes(ar) -> np.ndarray:
    """All code rows, ``(n, width)`` int64."""
    stream = ar[CODES_STREAM]
    return np.asarray(stream.read(), dtype=np.int64).reshape(len(stream), stream.width)


def stream_data_bytes(stream) -> int:
    """Bytes of a stream's stored data: one 16-byte point (two float64) per span of ``span``
    symbols in each of the ``width`` columns, the last, partial span included."""
    spans = -(-len(stream) // stream.span)
    return spans * stream.width * 16
