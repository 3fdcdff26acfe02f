"""Bit packing of FSQ codes: the layout contract between the model side and the decode kernel
(bit order in ``kernels/_fsq_plan.py``: coordinate ``i`` at stream bits ``[o_i, o_i + b_i)``,
least significant bit first, byte ``j`` holding stream bits ``8j .. 8j + 7``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._fsq_plan import level_bits, level_list, packed_bytes


def _layout(levels: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each bit of the stream: its coordinate and its bit within that coordinate."""
    bits = torch.tensor(level_bits(levels), device=device)
    coord = torch.repeat_interleave(torch.arange(len(levels), device=device), bits)
    start = torch.cumsum(bits, 0) - bits
    return coord, torch.arange(coord.numel(), device=device) - start[coord]


def fsq_pack(codes: torch.Tensor, levels, *, check: bool = True) -> torch.Tensor:
    """Pack FSQ codes, little-endian bit order (see ``kernels/_fsq_plan.py``).

    Args:
        codes: ``(..., width)`` integer tensor, coordinate ``i`` in ``[0, levels[i])``
            (checked: one read-back).
        levels: an int (uniform) or ``width`` ints, each >= 2.
        check: verify the codes' range (False: the caller's codes are in range by
            construction, e.g. an FSQ quantiser's; nothing is read back, so the call can be
            traced by ``torch.compile`` and captured in a CUDA graph).

    Returns:
        ``(..., ceil(sum_i ceil(log2 L_i) / 8))`` uint8 on the codes' device.

    Raises:
        ValueError: a float / bool codes tensor, bad levels, or a code outside its level.
        TypeError: codes that are not a tensor.
    """
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"codes must be a torch.Tensor, got {type(codes).__name__}")
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool \
            or codes.dim() < 1:
        raise ValueError(f"codes must be an integer tensor (..., width), got dtype "
                         f"{codes.dtype} and shape {tuple(codes.shape)}")
    levels = level_list(levels, codes.shape[-1])
    codes = codes.long()
    if check and codes.numel():
        over = (codes < 0) | (codes >= torch.tensor(levels, device=codes.device))
        if bool(over.any()):
            raise ValueError(f"codes hold {int(over.sum())} values outside [0, level) "
                             f"(levels {list(levels)[:8]})")
    coord, bit = _layout(levels, codes.device)
    nbytes = packed_bytes(levels)
    stream = (codes[..., coord] >> bit) & 1
    stream = F.pad(stream, (0, nbytes * 8 - stream.shape[-1]))
    stream = stream.reshape(*codes.shape[:-1], nbytes, 8)
    weights = 1 << torch.arange(8, device=codes.device)
    return (stream * weights).sum(-1).to(torch.uint8)


def fsq_unpack(packed: torch.Tensor, levels, width: int) -> torch.Tensor:
    """Inverse of :func:`fsq_pack`: ``(..., packed_bytes)`` uint8 to ``(..., width)`` int64
    (exact; bits past the last coordinate are ignored).

    Raises:
        ValueError: a dtype other than uint8, or a last dimension that does not hold
            ``width`` coordinates of these levels.
    """
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"packed must be a torch.Tensor, got {type(packed).__name__}")
    levels = level_list(levels, width)
    if packed.dtype != torch.uint8 or packed.dim() < 1 \
            or packed.shape[-1] != packed_bytes(levels):
        raise ValueError(f"packed must be uint8 (..., {packed_bytes(levels)}) for {width} "
                         f"coordinates of these levels, got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    coord, bit = _layout(levels, packed.device)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = (packed[..., :, None].to(torch.int32) >> shifts) & 1
    stream = stream.flatten(-2)[..., :coord.numel()]
    out = torch.zeros(*packed.shape[:-1], width, dtype=torch.int32, device=packed.device)
    out.index_add_(out.dim() - 1, coord, stream << bit.to(torch.int32))
    return out.long()
