"""Public entry points of decode attention over a cache whose archived part is residual-VQ
codes, and the one place that decides which implementation runs.

- :func:`rvq_decode_attention`: the user-facing call, every argument validated.
- :func:`decode_attention`: the trusted per-step path over a :class:`~kernels.CodedCache`
  (validated once by its builder, :func:`kernels.validate_coded_cache`); nothing is checked
  per call.
- :func:`static_decode_attention`: the same over a cache of preallocated buffers whose lengths
  are device tensors, as one opaque operator (``torch.ops.fkv.coded_decode``) that
  ``torch.compile`` traces without a graph break and a CUDA graph captures.
- :func:`kernel_takes`: the ``"auto"`` decision, shared with ``model_adapters``.
"""

from __future__ import annotations

import functools

import torch

from kernels._plan import VARIANTS, choose_variant, problem_dims, supports_shape
from kernels._validate import (
    ACTIVATION_DTYPES,
    CODE_DTYPE_LIMITS,
    check_num_splits,
    validate_decode_args,
)
from kernels.coded_cache import CodedCache, DecodeProblem

BACKENDS = ("auto", "triton", "torch")
DEFAULT_VARIANT = "auto"  # choose_variant per problem


@functools.cache
def triton_available() -> bool:
    """Whether the triton package can be imported (it is the ``gpu`` extra)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def kernel_takes(query: torch.Tensor, cache: CodedCache) -> bool:
    """Whether a Triton kernel runs this decode step under ``backend="auto"``: CUDA tensors,
    triton installed, a float16/bfloat16 query, uint8/int16 codes and shapes a kernel variant
    supports (value histogram and grid limits). Reads no tensor contents."""
    if not (query.is_cuda and query.dtype in ACTIVATION_DTYPES and triton_available()):
        return False
    if cache.key_codes.dtype not in CODE_DTYPE_LIMITS \
            or cache.value_codes.dtype not in CODE_DTYPE_LIMITS:
        return False
    kv_heads, stages, size = cache.value_codebooks.shape[:3]
    return supports_shape(query.shape[0], query.shape[1], kv_heads, stages, size)


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
    return _run(problem, backend, num_splits)


def decode_attention(query: torch.Tensor, cache: CodedCache, *, scale: float,
                     backend: str = "auto", num_splits: int | None = None) -> torch.Tensor:
    """Decode attention of ``query`` ``(batch, q_heads, head_dim)`` (float16/bfloat16) over a
    trusted ``cache``; returns ``(batch, q_heads, head_dim)`` in the query's dtype.

    Nothing is validated here (:func:`kernels.validate_coded_cache` does that, once, where
    the cache is built): a code outside its codebook or a length beyond its segment reads
    outside the tensors. ``scale`` is a positive float; ``backend`` and ``num_splits`` as in
    :func:`rvq_decode_attention`. The Triton path never waits for the GPU.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return _run(DecodeProblem(query.contiguous(), cache.with_lengths(), float(scale)), backend,
                num_splits)


def _run(problem: DecodeProblem, backend: str, num_splits: int | None) -> torch.Tensor:
    query = problem.query
    if backend == "auto":
        backend = "triton" if kernel_takes(query, problem.cache) else "torch"
    if backend == "torch":
        from kernels import reference

        return reference.decode(problem).to(query.dtype)
    require_triton(query)
    return triton_decode(problem, num_splits=num_splits)


def require_triton(query: torch.Tensor) -> None:
    """ValueError unless a Triton kernel can run on ``query``'s device: triton installed, and
    CUDA tensors or Triton's CPU interpreter (``TRITON_INTERPRET=1`` from process start)."""
    if not triton_available():
        raise ValueError("backend='triton' needs the triton package (the 'gpu' extra)")
    from kernels._common import interpreted

    if not query.is_cuda and not interpreted():
        raise ValueError(
            f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 from process start, "
            f"Triton's CPU interpreter); the query is on {query.device}")


def triton_decode(problem: DecodeProblem, *, num_splits: int | None = None, num_warps: int = 4,
                  variant: str | None = None) -> torch.Tensor:
    """Run a kernel variant on a problem; returns ``(batch, q_heads, head_dim)``.

    ``variant``: ``"onehot"`` (``kernels/_onehot.py``: histogram by one-hot products),
    ``"atomic"`` (``kernels/_atomic.py``: histogram by atomic adds) or ``"auto"``
    (:func:`kernels._plan.choose_variant`); ``None`` means ``DEFAULT_VARIANT``. Problems the
    one-hot kernel cannot hold (value histograms above its register budget) run the atomic one.
    """
    variant = DEFAULT_VARIANT if variant is None else variant
    key = (problem_dims(problem), problem.cache.key_codes.shape[2], problem.query.device,
           num_splits, num_warps, variant)
    module = _VARIANT_MODULES.get(key)
    if module is None:
        module = _variant_module(problem, num_splits, num_warps, variant)
        if len(_VARIANT_MODULES) >= 1024:
            _VARIANT_MODULES.clear()
        _VARIANT_MODULES[key] = module
    return module.decode(problem, num_splits=num_splits, num_warps=num_warps)


_VARIANT_MODULES: dict = {}  # the variant of each shape (decided once: decode steps repeat)


def _variant_module(problem: DecodeProblem, num_splits, num_warps, variant: str):
    if variant not in (*VARIANTS, "auto"):
        raise ValueError(f"variant must be one of {(*VARIANTS, 'auto')}, got {variant!r}")
    if variant == "auto":
        variant = choose_variant(problem)
    if variant == "onehot":
        from kernels import _onehot, _onehot_plan

        if _onehot_plan.supports(problem, num_splits, num_warps):
            return _onehot
    from kernels import _atomic

    return _atomic


@torch.library.custom_op("fkv::coded_decode", mutates_args=())
def _coded_decode_op(query: torch.Tensor, key_codes: torch.Tensor, value_codes: torch.Tensor,
                     key_codebooks: torch.Tensor, value_codebooks: torch.Tensor,
                     sink_keys: torch.Tensor, sink_values: torch.Tensor,
                     recent_keys: torch.Tensor, recent_values: torch.Tensor,
                     sink_lengths: torch.Tensor, archived_lengths: torch.Tensor,
                     recent_lengths: torch.Tensor, scale: float, backend: str) -> torch.Tensor:
    cache = CodedCache(key_codes, value_codes, key_codebooks, value_codebooks, sink_keys,
                       sink_values, recent_keys, recent_values, sink_lengths,
                       archived_lengths, recent_lengths)
    return _run_static(DecodeProblem(query, cache, scale), backend)


def _run_static(problem: DecodeProblem, backend: str) -> torch.Tensor:
    if backend == "triton":
        return triton_decode(problem)
    from kernels import reference

    return reference.decode_masked(problem).to(problem.query.dtype)


@_coded_decode_op.register_fake
def _(query, *args, **kwargs):
    return torch.empty_like(query)


def static_decode_attention(query: torch.Tensor, cache: CodedCache, *, scale: float,
                            backend: str) -> torch.Tensor:
    """Decode attention of ``query`` ``(batch, q_heads, head_dim)`` over a trusted ``cache``
    whose three lengths are ``(batch,)`` int32 tensors on the query's device; returns
    ``(batch, q_heads, head_dim)`` in the query's dtype.

    ``backend`` is ``"triton"`` (the kernel; float16/bfloat16 on CUDA or under Triton's
    interpreter) or ``"torch"`` (:func:`kernels.reference.decode_masked`: any float dtype, any
    device, the whole capacity dequantized). Nothing is validated and nothing waits for the
    device: a serving cache validates its buffers once and then calls this every step, inside
    ``torch.compile`` (one operator, no graph break) and CUDA graphs."""
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")
    c = cache
    if not torch.compiler.is_compiling():  # eager: the operator's body, without the dispatcher
        return _run_static(DecodeProblem(query.contiguous(), cache, float(scale)), backend)
    return _coded_decode_op(query.contiguous(), c.key_codes, c.value_codes, c.key_codebooks,
                            c.value_codebooks, c.sink_keys, c.sink_values, c.recent_keys,
                            c.recent_values, c.sink_lengths, c.archived_lengths,
                            c.recent_lengths, float(scale), backend)
