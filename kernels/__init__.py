"""Decode attention computed straight from residual-VQ codes.

Public names:

- :func:`rvq_decode_attention`: one query token per sequence over sinks, RVQ-coded archive and
  recents, every argument validated;
- :class:`CodedCache`, :func:`validate_coded_cache`, :func:`decode_attention`: the same over a
  cache validated once where it is built, for callers that run one step after another (the
  serving cache of ``model_adapters``); :func:`kernel_takes` is the ``backend="auto"``
  decision both paths share;
- :func:`reference_decode_attention`, :func:`dequantize_rvq`: the plain-torch reference.

Importing this package is cheap: torch and triton load on first use of a name, so a library
that only probes for a package named ``kernels`` (transformers does) pays nothing. The package
deliberately has no ``__version__``; see ``docs/kernels.md``.
"""

from __future__ import annotations

__all__ = [
    "BACKENDS",
    "CODE_DTYPE_LIMITS",
    "CodedCache",
    "decode_attention",
    "dequantize_rvq",
    "kernel_takes",
    "reference_decode_attention",
    "rvq_decode_attention",
    "triton_available",
    "validate_coded_cache",
]

_WHERE = {
    "BACKENDS": "kernels.rvq_decode",
    "CODE_DTYPE_LIMITS": "kernels._validate",
    "CodedCache": "kernels.coded_cache",
    "decode_attention": "kernels.rvq_decode",
    "dequantize_rvq": "kernels.reference",
    "kernel_takes": "kernels.rvq_decode",
    "reference_decode_attention": "kernels.reference",
    "rvq_decode_attention": "kernels.rvq_decode",
    "triton_available": "kernels.rvq_decode",
    "validate_coded_cache": "kernels._validate",
}


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
