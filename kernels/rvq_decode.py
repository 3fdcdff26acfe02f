"""Public entry point: decode attention over a cache whose archived part is residual-VQ codes."""

from __future__ import annotations

import functools

import torch

from kernels._validate import check_num_splits, validate_decode_args

BACKENDS = ("auto", "triton", "torch")


@functools.cache
def triton_available() -> bool:
    """Whether the triton package can be imported (it is the ``gpu`` extra)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def rvq_decode_attention(
    query: torch.Tensor,
    key_codes: torch.Tensor,
    value_codes: torch.Tensor,
    key_codebooks: torch.Tensor,
    value_codebooks: torch.Tensor,
    *,
    archived_lengths=None,
    sink_keys: torch.Tensor | None = None,
    sink_values: torch.Tensor | None = None,
    sink_lengths=None,
    recent_keys: torch.Tensor | None = None,
    recent_values: torch.Tensor | None = None,
    recent_lengths=None,
    scale: float | None = None,
    backend: str = "auto",
    num_splits: int | None = None,
    check_codes: bool = True,
    check_lengths: bool = True,
) -> torch.Tensor:
    """Attention of one new query token per sequence over sinks, RVQ-coded archive and recents.

    The cache of each sequence is three segments, all attended jointly (one softmax):
    exact sink tokens, archived positions stored as residual-VQ codes, and exact recent tokens.
    Order does not matter for a single query, so no causal mask is involved.

    Args:
        query: ``(batch, q_heads, head_dim)``, float16 or bfloat16. ``q_heads`` is a multiple of
            ``kv_heads``; query head ``h`` reads kv head ``h // (q_heads // kv_heads)``.
        key_codes: ``(batch, kv_heads, archived, key_stages)``, uint8 (codebook size <= 256) or
            int16 (<= 32768).
        value_codes: ``(batch, kv_heads, archived, value_stages)``, uint8 or int16.
        key_codebooks: ``(kv_heads, key_stages, codebook_size, head_dim)``, float16, bfloat16
            or float32. A key is the sum over stages of the centroids its codes select.
        value_codebooks: ``(kv_heads, value_stages, codebook_size, head_dim)``, likewise.
        archived_lengths: ``(batch,)`` integers, valid archived positions per sequence
            (default: all ``archived``).
        sink_keys, sink_values: ``(batch, kv_heads, sinks, head_dim)`` in the query's dtype,
            or both ``None``.
        sink_lengths: ``(batch,)`` valid sinks per sequence (default: all).
        recent_keys, recent_values: ``(batch, kv_heads, recent, head_dim)``, or both ``None``.
        recent_lengths: ``(batch,)`` valid recent tokens per sequence (default: all).
        scale: softmax scale (default ``head_dim ** -0.5``); a 0-d tensor is read back to
            the host.
        backend: ``"triton"`` (the kernel; CUDA tensors, or CPU tensors under
            ``TRITON_INTERPRET=1``), ``"torch"`` (the dequantize-then-attend reference) or
            ``"auto"`` (triton for CUDA tensors when triton is installed and a kernel takes the
            problem, else torch).
        num_splits: sequence splits of the archived part, an int in [1, 1024] (Triton path;
            default: enough to fill the GPU).
        check_codes: verify every code is below its codebook size (one reduction per call,
            read back to the host; an out-of-range code would read outside the codebook).
        check_lengths: verify lengths given as GPU tensors (each read back to the host).
            Default lengths, lists and CPU tensors are always checked, on the host.
            Unchecked, a length beyond its segment reads past it and a sequence with nothing
            cached gives an undefined result.

    With ``check_codes=False``, no GPU lengths to check (or ``check_lengths=False``) and a
    ``scale`` that is not a GPU tensor, the call never waits for the GPU, so the host can run
    ahead of it, and the Triton path can be captured in a CUDA graph
    (``tests/kernels/test_kernels_gpu.py`` does both).

    Returns:
        ``(batch, q_heads, head_dim)`` in the query's dtype.

    Raises:
        ValueError: a shape, dtype, device, length or code that does not fit, named in the
            message; or ``backend="triton"`` with a value histogram too large for the kernel.
        TypeError: an argument that is not a tensor.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_num_splits(num_splits)
    problem = validate_decode_args(
        query, key_codes, value_codes, key_codebooks, value_codebooks,
        archived_lengths=archived_lengths, sink_keys=sink_keys, sink_values=sink_values,
        sink_lengths=sink_lengths, recent_keys=recent_keys, recent_values=recent_values,
        recent_lengths=recent_lengths, scale=scale, check_codes=check_codes,
        check_lengths=check_lengths)
    if backend == "auto":
        backend = "triton" if query.is_cuda and triton_available() and _kernel_takes(problem) \
            else "torch"
    if backend == "torch":
        from kernels.reference import _decode

        return _decode(problem).to(query.dtype)
    if not triton_available():
        raise ValueError("backend='triton' needs the triton package (the 'gpu' extra)")
    from kernels import _rvq_triton

    if not query.is_cuda and not _rvq_triton.interpreted():
        raise ValueError(
            f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 from process start, "
            f"Triton's CPU interpreter); the query is on {query.device}")
    return _rvq_triton.decode(problem, num_splits=num_splits)


def _kernel_takes(problem) -> bool:
    from kernels import _rvq_triton

    return _rvq_triton.supports(problem)
