"""The plain-torch reference of decode attention over packed FSQ codes.

:func:`reference_fsq_decode_attention` reconstructs every key and
value densely in float32 (the RoPE angles in float64) and attends with SDPA: the slow,
obviously-correct oracle of the Triton kernel and its CPU fallback.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._fsq_plan import FsqProblem, inverse_frequencies
from kernels._fsq_validate import validate_fsq_args
from kernels.fsq_codes import fsq_unpack


def rope_cos_sin(rope, positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, ...]:
    """``(cos, sin)`` ``(n, head_dim)`` float32 at ``positions`` ``(n,)``: rows of the given
    tables, or for a theta the angles ``pos * theta^(-2i/head_dim)`` in float64 (both halves
    equal, transformers' layout)."""
    if isinstance(rope, tuple):
        return rope[0][positions.long()], rope[1][positions.long()]
    inv = inverse_frequencies(rope, head_dim, positions.device)
    angles = positions.to(torch.float64)[:, None] * inv[None, :]
    angles = torch.cat([angles, angles], dim=1)
    return angles.cos().float(), angles.sin().float()


def reconstruct_keys(problem: FsqProblem, b: int, codes: torch.Tensor) -> torch.Tensor:
    """Keys ``(kv_heads, n, head_dim)`` float32 of sequence ``b``'s archived codes ``(n,
    width)``: decoder, bias, RMSNorm, RoPE (rotate-half) at their absolute positions."""
    p = problem
    keys = torch.einsum("hdw,nw->hnd", p.key_decoder.float(), codes.float())
    if p.key_bias is not None:
        keys = keys + p.key_bias.float()[:, None, :]
    if p.k_norm is not None:
        keys = keys * torch.rsqrt(keys.pow(2).mean(-1, keepdim=True) + p.eps) * p.k_norm.float()
    if p.rope is not None:
        n = codes.shape[0]
        if p.positions is not None:
            pos = p.positions[b, :n]
        else:
            pos = int(p.sink_lengths[b]) + torch.arange(n, device=codes.device)
        cos, sin = rope_cos_sin(p.rope, pos, keys.shape[-1])
        half = keys.shape[-1] // 2
        rotated = torch.cat([-keys[..., half:], keys[..., :half]], dim=-1)
        keys = keys * cos + rotated * sin
    return keys


def decode(problem: FsqProblem) -> torch.Tensor:
    """Attention of a problem on its reconstructed cache, float32 ``(batch, q_heads,
    head_dim)``."""
    p = problem
    batch, q_heads, _ = p.query.shape
    group = q_heads // p.kv_heads
    codes = fsq_unpack(p.codes, p.levels, p.width)
    out = torch.empty(p.query.shape, dtype=torch.float32, device=p.query.device)
    for b in range(batch):
        ns, na, nr = (int(x[b]) for x in (p.sink_lengths, p.archived_lengths, p.recent_lengths))
        keys = reconstruct_keys(p, b, codes[b, :na])
        values = torch.einsum("hdw,nw->hnd", p.value_decoder.float(), codes[b, :na].float())
        if p.value_bias is not None:
            values = values + p.value_bias.float()[:, None, :]
        k = torch.cat([p.sink_keys[b, :, :ns].float(), keys,
                       p.recent_keys[b, :, :nr].float()], dim=1)
        v = torch.cat([p.sink_values[b, :, :ns].float(), values,
                       p.recent_values[b, :, :nr].float()], dim=1)
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
        q = p.query[b].float()[:, None, :]
        out[b] = F.scaled_dot_product_attention(q, k, v, scale=p.scale)[:, 0]
    return out


def reference_fsq_decode_attention(query, codes, levels, key_decoder, value_decoder, *,
                                   out_dtype: torch.dtype | None = None,
                                   **kwargs) -> torch.Tensor:
    """:func:`kernels.fsq_decode_attention` computed densely in float32 (the same arguments,
    validated the same way; ``backend`` and ``num_splits`` are not taken). Returns
    ``(batch, q_heads, head_dim)`` in ``out_dtype`` (default: the query's dtype)."""
    problem = validate_fsq_args(query, codes, levels, key_decoder, value_decoder, **kwargs)
    return decode(problem).to(out_dtype or query.dtype)
