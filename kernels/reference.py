"""Plain-torch reference: dequantize the archived codes, then ordinary attention.

This is the slow, obviously-correct oracle for the Triton path and the CPU fallback of
:func:`kernels.rvq_decode_attention`. It materialises the dense K/V, which the kernel never does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._validate import CODE_DTYPE_LIMITS, check_code_range, validate_decode_args
from kernels.coded_cache import DecodeProblem


def dequantize_rvq(codes: torch.Tensor, codebooks: torch.Tensor, *,
                   check_codes: bool = True) -> torch.Tensor:
    """Sum of the selected centroids over the stages of a residual-VQ code.

    Args:
        codes: ``(batch, kv_heads, seq, stages)``, uint8 or int16, each below the codebook
            size (checked unless ``check_codes=False``).
        codebooks: ``(kv_heads, stages, codebook_size, head_dim)``, any float dtype.

    Returns:
        ``(batch, kv_heads, seq, head_dim)`` float32.

    Raises:
        ValueError: shapes that do not match, a code dtype other than uint8 / int16, or a code
            outside the codebook.
    """
    if not isinstance(codes, torch.Tensor) or not isinstance(codebooks, torch.Tensor):
        raise TypeError("codes and codebooks must be torch.Tensors")
    if codes.dtype not in CODE_DTYPE_LIMITS:
        raise ValueError(f"codes must have dtype uint8 or int16, got {codes.dtype}")
    if codes.dim() != 4 or codebooks.dim() != 4:
        raise ValueError(f"codes must be (batch, kv_heads, seq, stages) and codebooks "
                         f"(kv_heads, stages, codebook_size, head_dim); got {tuple(codes.shape)} "
                         f"and {tuple(codebooks.shape)}")
    if codes.shape[1] != codebooks.shape[0] or codes.shape[3] != codebooks.shape[1]:
        raise ValueError(f"codes {tuple(codes.shape)} do not match codebooks "
                         f"{tuple(codebooks.shape)} in kv_heads or stages")
    if codes.device != codebooks.device:
        raise ValueError(f"codes are on {codes.device}, codebooks on {codebooks.device}")
    if check_codes:
        check_code_range("codes", codes, codebooks.shape[2])
    batch, kv_heads, seq, stages = codes.shape
    books = codebooks.float()
    heads = torch.arange(kv_heads, device=codes.device)[None, :, None]
    out = torch.zeros(batch, kv_heads, seq, codebooks.shape[3], device=codes.device)
    for stage in range(stages):
        out += books[:, stage][heads, codes[..., stage].long()]
    return out


def decode(problem: DecodeProblem) -> torch.Tensor:
    """Attention of a problem (every length filled in) on its dequantized cache, float32
    ``(batch, q_heads, head_dim)``."""
    p, c = problem, problem.cache
    # the caller checked the codes (or was told not to)
    keys = dequantize_rvq(c.key_codes, c.key_codebooks, check_codes=False)
    values = dequantize_rvq(c.value_codes, c.value_codebooks, check_codes=False)
    group = p.q_heads // p.kv_heads
    out = torch.empty(p.batch, p.q_heads, p.head_dim, dtype=torch.float32, device=p.query.device)
    for b in range(p.batch):
        ns, na, nr = (int(x[b]) for x in (c.sink_lengths, c.archived_lengths, c.recent_lengths))
        k = torch.cat([c.sink_keys[b, :, :ns].float(), keys[b, :, :na],
                       c.recent_keys[b, :, :nr].float()], dim=1)
        v = torch.cat([c.sink_values[b, :, :ns].float(), values[b, :, :na],
                       c.recent_values[b, :, :nr].float()], dim=1)
        k = k.repeat_interleave(group, dim=0)  # query head h reads kv head h // group
        v = v.repeat_interleave(group, dim=0)
        q = p.query[b].float()[:, None, :]
        out[b] = F.scaled_dot_product_attention(q, k, v, scale=p.scale)[:, 0]
    return out


def reference_decode_attention(query, key_codes, value_codes, key_codebooks, value_codebooks,
                               *, out_dtype: torch.dtype | None = None, **cache) -> torch.Tensor:
    """Decode attention on the dequantized cache, computed in float32.

    Takes the same arguments as :func:`kernels.rvq_decode_attention` (keyword ``cache``
    arguments: ``archived_lengths``, ``sink_keys``, ``sink_values``, ``sink_lengths``,
    ``recent_keys``, ``recent_values``, ``recent_lengths``, ``scale``).

    Returns:
        ``(batch, q_heads, head_dim)`` in ``out_dtype`` (default: the query's dtype).
    """
    problem = validate_decode_args(query, key_codes, value_codes, key_codebooks,
                                   value_codebooks, **cache)
    return decode(problem).to(out_dtype or query.dtype)


def decode_masked(problem: DecodeProblem) -> torch.Tensor:
    """:func:`decode` without host synchronisation: every segment is attended at its full
    size with the positions past its length masked out, so the lengths stay on the device and
    the call can be traced by ``torch.compile`` and captured in a CUDA graph.

    Computed in float32, or float64 for a float64 query (the CPU oracle of the serving cache);
    returns ``(batch, q_heads, head_dim)`` in that dtype. A sequence with nothing cached gives
    NaN (as :func:`decode` does)."""
    p, c = problem, problem.cache
    dtype = torch.promote_types(p.query.dtype, torch.float32)
    keys = dequantize_rvq(c.key_codes, c.key_codebooks, check_codes=False).to(dtype)
    values = dequantize_rvq(c.value_codes, c.value_codebooks, check_codes=False).to(dtype)
    k = torch.cat([c.sink_keys.to(dtype), keys, c.recent_keys.to(dtype)], 2)
    v = torch.cat([c.sink_values.to(dtype), values, c.recent_values.to(dtype)], 2)
    visible = torch.cat([
        torch.arange(t.shape[2], device=k.device)[None, :] < n.to(k.device)[:, None]
        for t, n in ((c.sink_keys, c.sink_lengths), (c.key_codes, c.archived_lengths),
                     (c.recent_keys, c.recent_lengths))], 1)  # (batch, positions)
    group = p.q_heads // p.kv_heads
    q = p.query.to(dtype).reshape(p.batch, p.kv_heads, group, p.head_dim)
    scores = torch.einsum("bhgd,bhnd->bhgn", q, k) * p.scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgn,bhnd->bhgd", torch.softmax(scores, -1), v)
    return out.reshape(p.batch, p.q_heads, p.head_dim)
