"""Decode attention computed straight from residual-VQ codes.

The public entry point is :func:`rvq_decode_attention`; :func:`reference_decode_attention`
and :func:`dequantize_rvq` are the plain-torch reference it is checked against.

Importing this package is cheap: torch and triton load on first use of a function, so a
library that only probes for a package named ``kernels`` (transformers does) pays nothing.
The package deliberately has no ``__version__``; see ``docs/kernels.md``.
"""

from __future__ import annotations

__all__ = ["dequantize_rvq", "reference_decode_attention", "rvq_decode_attention"]

_WHERE = {
    "rvq_decode_attention": "kernels.rvq_decode",
    "reference_decode_attention": "kernels.reference",
    "dequantize_rvq": "kernels.reference",
}


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
