"""Decode attention computed straight from residual-VQ codes.

Public names:

- :func:`rvq_decode_attention`: one query token per sequence over sinks, RVQ-coded archive and
  recents, every argument validated;
- :class:`CodedCache`, :func:`validate_coded_cache`, :func:`decode_attention`: the same over a
  cache validated once where it is built, for callers that run one step after another (the
  serving cache of ``model_adapters``); :func:`static_decode_attention`, the same over
  preallocated buffers with device lengths, one operator for ``torch.compile`` and CUDA graphs;
  :func:`kernel_takes` is the ``backend="auto"`` decision both paths share;
- :func:`reference_decode_attention`, :func:`dequantize_rvq`: the plain-torch reference;
- :func:`fsq_decode_attention`: the same over a cache of packed FSQ codes (one row per token,
  shared by the kv heads; keys reconstructed on the tensor cores), with :func:`fsq_pack` /
  :func:`fsq_unpack` (the packing contract), :func:`validate_fsq_args` /
  :class:`FsqProblem` / :func:`decode_fsq_problem` (validate once, then the trusted path),
  :func:`fsq_kernel_takes` and :func:`reference_fsq_decode_attention`;
- :class:`CapturedCall`: one decode call captured in a CUDA graph and replayed (the eager
  per-step path's launches paid once).

Importing this package is cheap: torch and triton load on first use of a name, so a library
that only probes for a package named ``kernels`` (transformers does) pays nothing. The package
deliberately has no ``__version__``; see ``docs/kernels.md``.
"""

from __future__ import annotations

__all__ = [
    "BACKENDS",
    "CODE_DTYPE_LIMITS",
    "CapturedCall",
    "CodedCache",
    "FsqProblem",
    "RopeFrequencies",
    "decode_attention",
    "dequantize_rvq",
    "decode_fsq_problem",
    "fsq_decode_attention",
    "fsq_kernel_takes",
    "fsq_pack",
    "fsq_unpack",
    "kernel_takes",
    "reference_decode_attention",
    "reference_fsq_decode_attention",
    "rvq_decode_attention",
    "static_decode_attention",
    "triton_available",
    "validate_coded_cache",
    "validate_fsq_args",
]

_WHERE = {
    "BACKENDS": "kernels.rvq_decode",
    "CODE_DTYPE_LIMITS": "kernels._validate",
    "CapturedCall": "kernels.captured",
    "CodedCache": "kernels.coded_cache",
    "decode_attention": "kernels.rvq_decode",
    "dequantize_rvq": "kernels.reference",
    "FsqProblem": "kernels._fsq_plan",
    "RopeFrequencies": "kernels._fsq_plan",
    "decode_fsq_problem": "kernels.fsq_decode",
    "fsq_decode_attention": "kernels.fsq_decode",
    "fsq_kernel_takes": "kernels.fsq_decode",
    "fsq_pack": "kernels.fsq_codes",
    "fsq_unpack": "kernels.fsq_codes",
    "reference_fsq_decode_attention": "kernels.fsq_reference",
    "validate_fsq_args": "kernels._fsq_validate",
    "kernel_takes": "kernels.rvq_decode",
    "reference_decode_attention": "kernels.reference",
    "rvq_decode_attention": "kernels.rvq_decode",
    "static_decode_attention": "kernels.rvq_decode",
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
