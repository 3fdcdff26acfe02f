"""transformers' ``QuantizedCache`` as a peer method: its backends and the bytes they hold.

The cache quantizes on its first update and returns the exact states of that update (so the
prefill attends exactly), then answers every later forward from the dequantized states plus an
exact residual of at most ``residual_length`` positions (KIVI-style). Backends: ``quanto``
(optimum-quanto, 2 or 4 bits), ``hqq`` (HQQ, 2 or 4 bits), ``fp8`` (transformers 5.24 on).

optimum-quanto unpacks its 2/4-bit codes with a C++/CUDA extension that it compiles on first
use (tens of seconds on a CPU, minutes on a GPU). :func:`torch_unpack` gives it a plain torch
unpacking instead, so nothing is compiled; the values are the same.
"""

from __future__ import annotations

import importlib.util

import torch

__all__ = ["BACKENDS", "backend_available", "new_quantized_cache", "quantized_bytes",
           "torch_unpack"]

BACKENDS = {"quanto": "optimum.quanto", "hqq": "hqq", "fp8": None}
_UNPACK_REGISTERED = []


def backend_available(backend: str) -> bool:
    """Whether ``QuantizedCache(backend, ...)`` can run here (package installed, and for
    ``fp8`` a transformers release that has it)."""
    if backend not in BACKENDS:
        raise ValueError(f"QuantizedCache backend {backend!r} is not one of {sorted(BACKENDS)}")
    if backend == "fp8":
        from transformers import cache_utils

        return hasattr(cache_utils, "Fp8QuantizedLayer")
    try:
        return importlib.util.find_spec(BACKENDS[backend]) is not None
    except ModuleNotFoundError:
        return False


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``(rows, cols)`` uint8 holding ``8 // bits`` values each (lowest bits first) to
    ``(rows * 8 // bits, cols)`` uint8 values, value ``i`` of each byte in row block ``i``."""
    mask = (1 << bits) - 1
    return torch.cat([(packed >> (bits * i)) & mask for i in range(8 // bits)]).to(torch.uint8)


def torch_unpack() -> None:
    """Make optimum-quanto unpack with torch ops (idempotent): its compiled extensions (CPU,
    CUDA) get a module holding only :func:`_unpack` in place of the build they would load."""
    if _UNPACK_REGISTERED:
        return
    import types

    import optimum.quanto  # noqa: F401  (registers the extensions)
    from optimum.quanto.library.extensions import get_extension, is_extension_available

    for name in ("quanto_cpp", "quanto_cuda"):
        if is_extension_available(name):
            get_extension(name)._lib = types.SimpleNamespace(unpack=_unpack)
    _UNPACK_REGISTERED.append(True)


def new_quantized_cache(backend: str, config, nbits: int | None, residual_length: int = 128):
    """A fresh ``QuantizedCache`` (q_group_size 64, the library's default axes)."""
    from transformers import QuantizedCache

    if not backend_available(backend):
        raise ValueError(f"QuantizedCache backend {backend!r} is not installed here")
    if backend == "quanto":
        torch_unpack()
    if backend == "fp8":
        return QuantizedCache("fp8", config)
    return QuantizedCache(backend, config, nbits=nbits, residual_length=residual_length)


def _side_bytes(backend: str, q) -> int:
    """Bytes of one quantized K or V: codes as packed, scales and zero points at 2 bytes
    (fp16, the dtype they take on an fp16 model)."""
    if backend == "quanto":
        return int(q._data._data.nbytes) + 2 * (q._scale.numel() + q._shift.numel())
    if backend == "hqq":
        data, meta = q
        extra = sum(v.numel() for v in meta.values() if torch.is_tensor(v) and v.numel() > 1)
        return int(data.nbytes) + 2 * int(extra)
    data, scale = q  # fp8: one byte per value, one float32 scale
    return int(data.numel() * data.element_size()) + int(scale.numel() * 4)


def quantized_bytes(backend: str, cache) -> int:
    """Everything the cache holds, all layers: quantized K and V, their scales, and the exact
    residual (fp16)."""
    total = 0
    for layer in cache.layers:
        total += _side_bytes(backend, layer._quantized_keys)
        total += _side_bytes(backend, layer._quantized_values)
        if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4:
            total += 2 * (layer.keys.numel() + layer.values.numel())
    return total
