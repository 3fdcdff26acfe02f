"""Argument checks of FSQ decode attention (shared by the Triton path and the torch reference).

Every check raises ``ValueError`` (``TypeError`` for a non-tensor) naming the argument; the
sink / recent parts, lengths and scale are checked as for the RVQ kernel (``_validate``).
"""

from __future__ import annotations

import functools
import math
import numbers

import torch

from kernels._fsq_plan import (
    MAX_THETA_POSITION,
    FsqProblem,
    RopeFrequencies,
    level_bits,
    level_list,
    packed_bytes,
)
from kernels._validate import (
    ACTIVATION_DTYPES,
    _expect_dim,
    _scale,
    _tensor,
    exact_segments,
)
from kernels.fsq_codes import fsq_unpack

DECODER_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
POSITION_DTYPES = (torch.int32, torch.int64)


def _on(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the query on {device}")


def _decoder(name: str, t, kv_heads: int | None, head_dim: int, device) -> torch.Tensor:
    _tensor(name, t, 3, DECODER_DTYPES)
    if kv_heads is not None:
        _expect_dim(name, t, 0, kv_heads, "kv_heads, as in key_decoder")
    _expect_dim(name, t, 1, head_dim, "head_dim, as in the query")
    if min(t.shape) < 1:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; every dimension must be >= 1")
    _on(name, t, device)
    return t.contiguous()


def _bias(name: str, t, kv_heads: int, head_dim: int, device) -> torch.Tensor | None:
    if t is None:
        return None
    _tensor(name, t, 2, DECODER_DTYPES)
    if tuple(t.shape) != (kv_heads, head_dim):
        raise ValueError(f"{name} must have shape ({kv_heads}, {head_dim}) (kv_heads, "
                         f"head_dim), got {tuple(t.shape)}")
    _on(name, t, device)
    return t.contiguous()


def _rope(rope, head_dim: int, device):
    """``None``, a positive finite theta (float), :class:`RopeFrequencies`, or ``(cos, sin)``
    float32 tables."""
    if rope is None:
        return None
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    if isinstance(rope, RopeFrequencies):
        inv = rope.inv_freq
        if not isinstance(inv, tuple) or len(inv) != head_dim // 2:
            raise ValueError(f"RopeFrequencies needs {head_dim // 2} inverse frequencies "
                             f"(head_dim / 2), got {len(inv) if isinstance(inv, tuple) else inv!r}")
        bad = [f for f in inv if isinstance(f, bool) or not isinstance(f, numbers.Real)
               or not (math.isfinite(float(f)) and float(f) > 0)]
        if bad:
            raise ValueError(f"RopeFrequencies must be positive finite floats, got {bad[0]!r}")
        return rope
    if isinstance(rope, (tuple, list)):
        if len(rope) != 2:
            raise ValueError(f"rope tables must be a pair (cos, sin), got {len(rope)} items")
        for name, t in zip(("rope cos", "rope sin"), rope, strict=True):
            _tensor(name, t, 2, (torch.float32,))
            _expect_dim(name, t, 1, head_dim, "head_dim")
            if t.shape[0] < 1:
                raise ValueError(f"{name} table has no rows")
            _on(name, t, device)
        if rope[0].shape != rope[1].shape:
            raise ValueError(f"rope cos {tuple(rope[0].shape)} and sin {tuple(rope[1].shape)} "
                             "must have the same shape")
        return (rope[0].contiguous(), rope[1].contiguous())
    if isinstance(rope, bool) or not isinstance(rope, numbers.Real) \
            or not (math.isfinite(float(rope)) and float(rope) > 1):
        raise ValueError(f"rope must be None, a theta > 1, RopeFrequencies or (cos, sin) "
                         f"tables; got {rope!r}")
    return float(rope)


def _positions(positions, batch: int, seq: int, limit: int, device, check: bool):
    if positions is None:
        return None
    _tensor("positions", positions, 2, POSITION_DTYPES)
    if tuple(positions.shape) != (batch, seq):
        raise ValueError(f"positions must have shape ({batch}, {seq}) (batch, archived seq), "
                         f"got {tuple(positions.shape)}")
    _on("positions", positions, device)
    if (positions.device.type == "cpu" or check) and positions.numel():
        low, high = torch.stack(torch.aminmax(positions)).tolist()  # one read-back
        if low < 0 or high >= limit:
            raise ValueError(f"positions hold values from {low} to {high}; they must lie in "
                             f"[0, {limit}) (the RoPE tables' rows)")
    return positions.contiguous()


@functools.lru_cache(maxsize=64)
def _powers_of_two(levels: tuple[int, ...]) -> bool:
    return all(v == 1 << b for v, b in zip(levels, level_bits(levels), strict=True))


def check_fsq_codes(codes: torch.Tensor, levels: tuple[int, ...]) -> None:
    """ValueError unless every packed coordinate is below its level (only levels that are not
    powers of two can overflow; one read-back then)."""
    if _powers_of_two(levels) or not codes.numel():
        return
    unpacked = fsq_unpack(codes, levels, len(levels))
    over = unpacked >= torch.tensor(levels, device=codes.device)
    if bool(over.any()):
        raise ValueError(f"codes hold {int(over.sum())} coordinates at or above their level "
                         f"(levels {list(levels)[:8]})")


def validate_fsq_args(query, codes, levels, key_decoder, value_decoder, *, key_bias=None,
                      value_bias=None, positions=None, rope=None, k_norm=None, norm_eps=1e-6,
                      archived_lengths=None, sink_keys=None, sink_values=None,
                      sink_lengths=None, recent_keys=None, recent_values=None,
                      recent_lengths=None, scale=None, check_codes: bool = True,
                      check_lengths: bool = True, check_positions: bool = True) -> FsqProblem:
    """Check every argument of :func:`kernels.fsq_decode_attention` and return them as a
    :class:`~kernels.FsqProblem`. Reads the GPU back only for lengths or positions given as
    GPU tensors with their checks on, a GPU-tensor scale, or codes of non-power-of-two levels
    with ``check_codes``."""
    _tensor("query", query, 3, ACTIVATION_DTYPES)
    batch, q_heads, head_dim = query.shape
    if min(query.shape) < 1:
        raise ValueError(f"query has shape {tuple(query.shape)}; every dimension must be >= 1")
    device = query.device
    key_decoder = _decoder("key_decoder", key_decoder, None, head_dim, device)
    kv_heads, _, width = key_decoder.shape
    value_decoder = _decoder("value_decoder", value_decoder, kv_heads, head_dim, device)
    _expect_dim("value_decoder", value_decoder, 2, width, "code width, as in key_decoder")
    if q_heads % kv_heads:
        raise ValueError(f"query has {q_heads} heads, which is not a multiple of the "
                         f"{kv_heads} kv_heads of the decoders")
    levels = level_list(levels, width)
    _tensor("codes", codes, 3, (torch.uint8,))
    _expect_dim("codes", codes, 0, batch, "batch")
    _expect_dim("codes", codes, 2, packed_bytes(levels), f"packed bytes of {width} "
                f"coordinates at {sum(level_bits(levels))} bits")
    _on("codes", codes, device)
    if codes.stride(2) != 1:
        codes = codes.contiguous()
    if check_codes:
        check_fsq_codes(codes, levels)
    key_bias = _bias("key_bias", key_bias, kv_heads, head_dim, device)
    value_bias = _bias("value_bias", value_bias, kv_heads, head_dim, device)
    if k_norm is not None:
        _tensor("k_norm", k_norm, 1, DECODER_DTYPES)
        _expect_dim("k_norm", k_norm, 0, head_dim, "head_dim")
        _on("k_norm", k_norm, device)
        k_norm = k_norm.contiguous()
    if isinstance(norm_eps, bool) or not isinstance(norm_eps, numbers.Real) \
            or not (0 < float(norm_eps) < 1):
        raise ValueError(f"norm_eps must be a number in (0, 1), got {norm_eps!r}")
    rope = _rope(rope, head_dim, device)
    limit = rope[0].shape[0] if isinstance(rope, tuple) else MAX_THETA_POSITION
    positions = _positions(positions, batch, codes.shape[1], limit, device, check_positions)
    (sink_keys, sink_values, recent_keys, recent_values, sink_lengths, archived_lengths,
     recent_lengths, known) = exact_segments(
        query, kv_heads, codes.shape[1], sink_keys, sink_values, recent_keys, recent_values,
        sink_lengths, archived_lengths, recent_lengths, check_lengths)
    if known is not None and positions is None and rope is not None:
        sink_host, archived_host = known
        if isinstance(sink_host, int) and isinstance(archived_host, int):  # (the defaults)
            top = sink_host + archived_host
        else:
            top = int((torch.as_tensor(sink_host) + torch.as_tensor(archived_host)).max())
        if top > limit:
            raise ValueError(f"default positions (sink length + index) reach {top - 1}; "
                             f"the RoPE tables cover [0, {limit})")
    return FsqProblem(
        query=query.contiguous(), codes=codes, levels=levels, key_decoder=key_decoder,
        value_decoder=value_decoder, key_bias=key_bias, value_bias=value_bias, k_norm=k_norm,
        eps=float(norm_eps), rope=rope, positions=positions, sink_keys=sink_keys,
        sink_values=sink_values, recent_keys=recent_keys, recent_values=recent_values,
        sink_lengths=sink_lengths, archived_lengths=archived_lengths,
        recent_lengths=recent_lengths, scale=float(_scale(scale, head_dim)))

