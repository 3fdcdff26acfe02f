"""Public entry points of decode attention over packed FSQ codes, and the one place that
decides which implementation runs.

- :func:`fsq_decode_attention`: the user-facing call, every argument validated.
- :func:`decode_fsq_problem`: the trusted per-step path over an :class:`~kernels.FsqProblem`
  built once by :func:`kernels.validate_fsq_args` (``dataclasses.replace`` it with each
  step's query and lengths); nothing is checked per call.
- :func:`fsq_kernel_takes`: the ``backend="auto"`` decision.
"""

from __future__ import annotations

import torch

from kernels._fsq_plan import FsqProblem, RopeFrequencies, kernel_limit
from kernels._fsq_validate import validate_fsq_args
from kernels._validate import ACTIVATION_DTYPES, check_num_splits
from kernels.rvq_decode import BACKENDS, require_triton, triton_available


def fsq_kernel_takes(problem: FsqProblem) -> bool:
    """Whether the Triton kernel runs this problem under ``backend="auto"``: CUDA tensors,
    triton installed, a float16/bfloat16 query, and shapes the kernel takes (uniform levels
    2, 4, 16 or 256, width <= 256, even head_dim <= 256, at most 64 query heads per kv head).
    Reads no tensor contents."""
    q = problem.query
    return (q.is_cuda and q.dtype in ACTIVATION_DTYPES and triton_available()
            and kernel_limit(problem) is None)


def fsq_decode_attention(
    query: torch.Tensor,
    codes: torch.Tensor,
    levels,
    key_decoder: torch.Tensor,
    value_decoder: torch.Tensor,
    *,
    key_bias: torch.Tensor | None = None,
    value_bias: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    rope=None,
    k_norm: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
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
    check_positions: bool = True,
) -> torch.Tensor:
    """Attention of one new query token per sequence over sinks, a packed-FSQ archive and
    recents (one softmax over all three), without forming the archive's keys or values.

    Archived token ``n`` of sequence ``b`` holds one packed code row ``codes[b, n]``, shared by
    every kv head; with ``z`` its integer coordinates (:func:`kernels.fsq_unpack`):

    - ``key_raw[h] = key_decoder[h] @ z + key_bias[h]`` (the FSQ code-to-value affine map is
      folded into decoder and bias);
    - with ``k_norm``: ``k = key_raw * rsqrt(mean(key_raw^2) + norm_eps) * k_norm`` (Qwen3);
    - with ``rope``: rotate-half RoPE at the token's absolute position (transformers' Qwen3
      convention: halves ``x1, x2``; ``[x1 cos - x2 sin, x2 cos + x1 sin]``);
    - ``v[h] = value_decoder[h] @ z + value_bias[h]``, applied once to the softmax-weighted
      sum of the codes.

    Args:
        query: ``(batch, q_heads, head_dim)`` float16 / bfloat16; query head ``h`` reads kv
            head ``h // (q_heads // kv_heads)``.
        codes: ``(batch, seq, packed_bytes)`` uint8 (:func:`kernels.fsq_pack`'s layout).
        levels: an int (every coordinate) or ``width`` ints, each >= 2. The kernel takes a
            uniform 2, 4, 16 or 256; other levels run the reference.
        key_decoder, value_decoder: ``(kv_heads, head_dim, width)`` float16 / bfloat16 /
            float32.
        key_bias, value_bias: ``(kv_heads, head_dim)`` or ``None``.
        positions: ``(batch, seq)`` int32/int64 absolute positions of the archived tokens, or
            ``None`` meaning ``sink_lengths[b] + index``.
        rope: ``None`` (no rotation: GPT-2), a float theta (``inv_freq_i = theta^(-2i /
            head_dim)``, angles exact below position 2^22 = 4,194,304),
            :class:`kernels.RopeFrequencies` (given inverse frequencies, e.g. a bfloat16
            model's rounded ``inv_freq``, treated as a theta's), or ``(cos, sin)`` float32
            ``(max_position, head_dim)`` tables in transformers' layout.
        k_norm: ``(head_dim,)`` RMSNorm weight, or ``None``; ``norm_eps`` its epsilon.
        archived_lengths, sink_*, recent_*, scale: as in :func:`kernels.rvq_decode_attention`
            (sink and recent keys are the model's cached keys: normed and rotated).
        backend: ``"triton"``, ``"torch"`` or ``"auto"`` (triton for CUDA tensors when the
            kernel takes the problem, else the reference). On a Hopper GPU the triton path
            runs a warp-specialized split kernel (Gluon) for the problems
            ``kernels._fsq_plan.ws_limit`` accepts, else the Triton split kernel.
        num_splits: sequence splits of the archive, an int in [1, 1024] (Triton path).
        check_codes: for levels that are not powers of two, verify every coordinate is below
            its level (one read-back); power-of-two levels need no check.
        check_lengths, check_positions: verify lengths / positions given as GPU tensors (read
            back). Unchecked, a position outside the RoPE tables reads outside them.

    With no GPU lengths or positions left to check and a ``scale`` that is not a GPU tensor,
    the Triton path never waits for the GPU and can be captured in a CUDA graph.

    Returns:
        ``(batch, q_heads, head_dim)`` in the query's dtype.

    Raises:
        ValueError: a shape, dtype, device, level, length or position that does not fit,
            named in the message; or ``backend="triton"`` for a problem outside the kernel's
            limits (the message names the limit).
        TypeError: an argument that is not a tensor.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_num_splits(num_splits)
    problem = validate_fsq_args(
        query, codes, levels, key_decoder, value_decoder, key_bias=key_bias,
        value_bias=value_bias, positions=positions, rope=rope, k_norm=k_norm,
        norm_eps=norm_eps, archived_lengths=archived_lengths, sink_keys=sink_keys,
        sink_values=sink_values, sink_lengths=sink_lengths, recent_keys=recent_keys,
        recent_values=recent_values, recent_lengths=recent_lengths, scale=scale,
        check_codes=check_codes, check_lengths=check_lengths, check_positions=check_positions)
    return decode_fsq_problem(problem, backend=backend, num_splits=num_splits)


def decode_fsq_problem(problem: FsqProblem, *, backend: str = "auto",
                       num_splits: int | None = None) -> torch.Tensor:
    """Decode attention of a trusted :class:`~kernels.FsqProblem`; ``(batch, q_heads,
    head_dim)`` in the query's dtype. ``backend`` and ``num_splits`` as in
    :func:`fsq_decode_attention`. The Triton path never waits for the GPU, and under
    ``torch.compile`` it is one opaque operator (``fkv::fsq_decode``: no graph break, and
    inductor's CUDA graphs capture it); the torch reference reads the lengths back."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    query = problem.query
    if backend == "auto":
        backend = "triton" if fsq_kernel_takes(problem) else "torch"
    if backend == "torch":
        from kernels import fsq_reference

        return fsq_reference.decode(problem).to(query.dtype)
    reason = kernel_limit(problem)
    if reason is not None:
        raise ValueError(f"backend='triton': {reason}")
    require_triton(query)
    if torch.compiler.is_compiling():
        return _fsq_decode_op(*_op_args(problem), num_splits=num_splits)
    return _triton(problem, num_splits)


def _triton(problem: FsqProblem, num_splits: int | None) -> torch.Tensor:
    from kernels import _fsq

    return _fsq.decode(problem, num_splits=num_splits)


def _op_args(p: FsqProblem) -> tuple:
    """The problem as the operator's arguments (its rope split by kind)."""
    rope = p.rope
    theta = float(rope) if isinstance(rope, (int, float)) else None
    freqs = list(rope.inv_freq) if isinstance(rope, RopeFrequencies) else None
    cos, sin = rope if isinstance(rope, tuple) else (None, None)
    return (p.query, p.codes, list(p.levels), p.key_decoder, p.value_decoder, p.key_bias,
            p.value_bias, p.k_norm, p.eps, theta, freqs, cos, sin, p.positions, p.sink_keys,
            p.sink_values, p.recent_keys, p.recent_values, p.sink_lengths, p.archived_lengths,
            p.recent_lengths, p.scale)


@torch.library.custom_op("fkv::fsq_decode", mutates_args=())
def _fsq_decode_op(query: torch.Tensor, codes: torch.Tensor, levels: list[int],
                   key_decoder: torch.Tensor, value_decoder: torch.Tensor,
                   key_bias: torch.Tensor | None, value_bias: torch.Tensor | None,
                   k_norm: torch.Tensor | None, eps: float, rope_theta: float | None,
                   rope_freqs: list[float] | None, rope_cos: torch.Tensor | None,
                   rope_sin: torch.Tensor | None, positions: torch.Tensor | None,
                   sink_keys: torch.Tensor, sink_values: torch.Tensor,
                   recent_keys: torch.Tensor, recent_values: torch.Tensor,
                   sink_lengths: torch.Tensor, archived_lengths: torch.Tensor,
                   recent_lengths: torch.Tensor, scale: float,
                   num_splits: int | None = None) -> torch.Tensor:
    rope = rope_theta if rope_theta is not None else (
        RopeFrequencies(tuple(rope_freqs)) if rope_freqs is not None else (
            None if rope_cos is None else (rope_cos, rope_sin)))
    problem = FsqProblem(
        query=query, codes=codes, levels=tuple(levels), key_decoder=key_decoder,
        value_decoder=value_decoder, key_bias=key_bias, value_bias=value_bias, k_norm=k_norm,
        eps=eps, rope=rope, positions=positions, sink_keys=sink_keys, sink_values=sink_values,
        recent_keys=recent_keys, recent_values=recent_values, sink_lengths=sink_lengths,
        archived_lengths=archived_lengths, recent_lengths=recent_lengths, scale=scale)
    return _triton(problem, num_splits)


@_fsq_decode_op.register_fake
def _(query, *args, **kwargs):
    return torch.empty_like(query)
