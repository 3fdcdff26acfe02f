"""Everything model_adapters writes to or reads from an fkvstore archive goes through here.

An archive of one run holds:

- stream ``codes``: one row per archived token, ``width = layers x kv_heads x (K + V stages)``
  columns ordered (layer, kv_head, K then V, stage), alphabet ``codebook_size``;
- arrays ``key_codebooks`` / ``value_codebooks`` (float32, absent on an exact side) and
  ``window_keys`` / ``window_values`` (fp16 ``(layers, kv_heads, sinks + recent, head_dim)``,
  the exact window at the end of the run);
- attrs: model type, config fingerprint, shape, sinks, recent, pooled, stage counts.

Only fkvstore's public API is used.
"""

from __future__ import annotations

import numpy as np

from model_adapters.adapters import KVShape, config_fingerprint, kv_shape
from model_adapters.quantizer import KVQuantizer

__all__ = [
    "CODES_STREAM",
    "ArchiveUnavailableError",
    "archive_available",
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
    """The installed fkvstore has no persistent archive (``fkvstore.open``)."""


def require_fkvstore():
    """The fkvstore module, or ArchiveUnavailableError when it cannot write archives."""
    try:
        import fkvstore
    except ImportError as exc:  # e.g. the codec it imports is not built
        raise ArchiveUnavailableError(f"fkvstore cannot be imported: {exc}") from exc
    if not hasattr(fkvstore, "open"):
        raise ArchiveUnavailableError("this fkvstore has no persistent archive (fkvstore.open)")
    return fkvstore


def archive_available() -> bool:
    """Whether the installed fkvstore can write archives."""
    try:
        require_fkvstore()
    except ArchiveUnavailableError:
        return False
    return True


def open_for_writing(
    path, model_or_config, quantizer: KVQuantizer, *, sinks: int, recent: int, mode: str = "w"
):
    """Create an archive for one model and quantizer; returns ``(archive, codes_stream)``.

    The codebooks and the model identity are written at once, so the file is self-contained
    from the first row on.
    """
    fkv = require_fkvstore()
    shape = kv_shape(model_or_config)
    ar = fkv.open(path, mode)
    attrs = ar.attrs
    attrs["model_type"] = shape.model_type
    attrs["config_fingerprint"] = config_fingerprint(model_or_config)
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


def check_identity(ar, model_or_config) -> KVShape:
    """Raise ValueError unless the archive was written for this model's configuration."""
    shape = kv_shape(model_or_config)
    want = config_fingerprint(model_or_config)
    got = ar.attrs.get("config_fingerprint")
    if got != want:
        raise ValueError(
            f"archive was written for another model configuration (model_type "
            f"{ar.attrs.get('model_type')!r}, {ar.attrs.get('num_layers')} layers x "
            f"{ar.attrs.get('kv_heads')} kv heads x {ar.attrs.get('head_dim')}); this model is "
            f"{shape.model_type} {shape.num_layers} x {shape.kv_heads} x {shape.head_dim}"
        )
    return shape


def read_quantizer(ar, model_or_config) -> KVQuantizer:
    """The codebooks stored in an archive, checked against the model."""
    shape = check_identity(ar, model_or_config)
    arrays = {}
    for name in ("key_codebooks", "value_codebooks"):
        if int(ar.attrs.get(name.split("_")[0] + "_stages", 0)):
            arrays[name] = ar.get_array(name)
    return KVQuantizer.from_arrays(shape, arrays, pooled=bool(ar.attrs.get("pooled", False)))


def read_codes(ar) -> np.ndarray:
    """All code rows, ``(n, width)`` int64."""
    stream = ar[CODES_STREAM]
    return np.asarray(stream.read(), dtype=np.int64).reshape(len(stream), stream.width)


def stream_data_bytes(stream) -> int:
    """Bytes of a stream's stored data: one 16-byte point (two float64) per span of ``span``
    symbols in each of the ``width`` columns, the last, partial span included."""
    spans = -(-len(stream) // stream.span)
    return spans * stream.width * 16
