"""Finite scalar quantisation (FSQ) of a K/V bottleneck: the quantiser, its packing, and the
bottleneck module a converted attention layer computes its keys and values through.

A token's hidden state ``x`` (``hidden``) is encoded to ``w`` coordinates ``a = E x + e``; each
coordinate ``i`` is bounded by a scaled tanh onto ``(0, L_i - 1)`` and rounded to an integer code
``c_i`` in ``[0, L_i)`` (a straight-through estimator in training: the forward pass rounds, the
backward pass sees the identity). The decoders read the centred value ``z_i = c_i / m_i - 1``
with ``m_i = (L_i - 1) / 2`` (so ``z`` lies on a grid in ``[-1, 1]``); since that map is affine,
``W z + b = (W / m) c + (b - W 1)``: :meth:`FsqBottleneck.folded` gives decoders that read the
integer codes directly, which is what a cache and the decode kernel see.

Packing (:meth:`FSQ.pack`): when every level is a power of two, the codes are bit-packed by
:func:`kernels.fsq_pack` (``ceil(sum log2 L_i / 8)`` bytes per token: ``w = 32, L = 16`` is 16
bytes). Otherwise coordinates are grouped greedily (in order) into mixed-radix digits whose
product stays at or below ``2^31``; each group is one integer ``sum_j c_j prod_{k<j} L_k`` below
that product, and the group integers are bit-packed by :func:`kernels.fsq_pack` with the group
products as their levels. Each group wastes less than one bit against ``log2`` of its product,
so the row costs at most ``ceil((sum_i log2 L_i + groups) / 8)`` bytes instead of
``ceil(sum_i ceil(log2 L_i) / 8)`` (``w = 32, L = 5``: 10 bytes against 12, ideal 9.3); packing
and unpacking cost one integer multiply-add (divmod) per coordinate.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from kernels import fsq_pack, fsq_unpack

__all__ = ["FSQ", "FsqBottleneck", "FsqConfig", "radix_groups"]

_GROUP_LIMIT = 1 << 31  # a group integer stays below this: int32 in kernels.fsq_unpack
_NAME = re.compile(r"^fsq-w(\d+)-L(\d+)(?:-tau([0-9]*\.?[0-9]+))?$")


def _levels(levels, width: int) -> tuple[int, ...]:
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be a positive int, got {width!r}")
    if isinstance(levels, int) and not isinstance(levels, bool):
        out = (levels,) * width
    else:
        try:
            out = tuple(levels)
        except TypeError:
            raise ValueError(f"levels must be an int or {width} ints, got {levels!r}") from None
        if len(out) != width:
            raise ValueError(f"levels has {len(out)} entries; the width is {width}")
    bad = [v for v in out if isinstance(v, bool) or not isinstance(v, int) or not 2 <= v <= 1 << 16]
    if bad:
        raise ValueError(f"every level must be an int in [2, 65536], got {bad[:4]!r}")
    return out


@dataclass(frozen=True)
class FsqConfig:
    """One FSQ bottleneck setting: ``fsq-w{W}-L{L}[-tau{T}]``.

    Attributes:
        width: code coordinates per token per layer (``w``).
        levels: per-coordinate levels, ``width`` ints.
        tau: finetuning tokens per original model parameter (None: not finetuned yet / unstated).
    """

    width: int
    levels: tuple[int, ...]
    tau: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "levels", _levels(self.levels, self.width))
        if self.tau is not None and not (isinstance(self.tau, (int, float)) and self.tau >= 0):
            raise ValueError(f"tau must be a number >= 0 or None, got {self.tau!r}")

    @classmethod
    def parse(cls, name: str) -> FsqConfig:
        """``fsq-w32-L16`` or ``fsq-w32-L16-tau0.25``; ValueError naming the grammar otherwise."""
        m = _NAME.match(name) if isinstance(name, str) else None
        if m is None:
            raise ValueError(f"not an FSQ config name: {name!r} (expected fsq-w{{W}}-L{{L}}"
                             f"[-tau{{T}}], e.g. fsq-w32-L16-tau0.25)")
        tau = float(m.group(3)) if m.group(3) is not None else None
        return cls(int(m.group(1)), int(m.group(2)), tau)

    @property
    def name(self) -> str:
        if len(set(self.levels)) != 1:
            raise ValueError("mixed levels have no short name")
        tail = "" if self.tau is None else f"-tau{self.tau:g}"
        return f"fsq-w{self.width}-L{self.levels[0]}{tail}"

    @property
    def packed_bytes(self) -> int:
        """Bytes of one token's packed code in one layer."""
        return FSQ(self.levels).packed_bytes


def radix_groups(levels: tuple[int, ...]) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: consecutive coordinates whose level product is at most 2^31
    (the mixed-radix digits of :meth:`FSQ.pack` for levels that are not all powers of two)."""
    groups, start, product = [], 0, 1
    for i, level in enumerate(levels):
        if product * level > _GROUP_LIMIT:
            groups.append((start, i))
            start, product = i, 1
        product *= level
    groups.append((start, len(levels)))
    return groups


class FSQ(nn.Module):
    """The quantiser: per-coordinate levels, scaled-tanh bound, rounding (straight-through in
    training), integer codes and their packing. Has no parameters."""

    def __init__(self, levels):
        super().__init__()
        if isinstance(levels, int):
            raise ValueError("FSQ takes per-coordinate levels; use FsqConfig for a uniform level")
        self.levels = _levels(tuple(levels), len(tuple(levels)))
        self.width = len(self.levels)
        self._half = [(v - 1) / 2 for v in self.levels]
        self.power_of_two = all(v & (v - 1) == 0 for v in self.levels)
        self.groups = None if self.power_of_two else radix_groups(self.levels)

    def extra_repr(self) -> str:
        return f"width={self.width}, levels={self.levels[:4]}{'...' if self.width > 4 else ''}"

    def half(self, device=None) -> torch.Tensor:
        """``m = (L - 1) / 2`` per coordinate, float32 ``(w,)`` (a plain list underneath, not a
        buffer: nothing to load, nothing a dtype cast can round)."""
        return torch.tensor(self._half, dtype=torch.float32, device=device)

    # --- quantisation ---------------------------------------------------------------------------
    def scaled(self, a: torch.Tensor) -> torch.Tensor:
        """The bounded, unrounded code ``(tanh(a) + 1) m`` in ``(0, L - 1)``; ``a`` ``(..., w)``."""
        return (torch.tanh(a.float()) + 1) * self.half(a.device)

    def codes(self, a: torch.Tensor) -> torch.Tensor:
        """Integer codes ``(..., w)`` int64 in ``[0, L)`` of encoder outputs ``a`` ``(..., w)``
        (a NaN, e.g. from a padding row, codes as the centre)."""
        return torch.round(self.scaled(a.nan_to_num(0.0))).long()

    def values(self, codes: torch.Tensor) -> torch.Tensor:
        """Centred values ``codes / m - 1`` in ``[-1, 1]``, float32 ``(..., w)``."""
        return codes.float() / self.half(codes.device) - 1

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        """Quantised centred values ``(..., w)`` float32: rounded forward, identity gradient
        through the rounding (straight-through estimator)."""
        u = self.scaled(a)
        q = u + (torch.round(u) - u).detach()
        return q / self.half(a.device) - 1

    # --- packing --------------------------------------------------------------------------------
    @property
    def packed_bytes(self) -> int:
        if self.power_of_two:
            return math.ceil(sum((v - 1).bit_length() for v in self.levels) / 8)
        products = [math.prod(self.levels[a:b]) for a, b in self.groups]
        return math.ceil(sum((p - 1).bit_length() for p in products) / 8)

    def _group_levels(self) -> list[int]:
        return [math.prod(self.levels[a:b]) for a, b in self.groups]

    def pack(self, codes: torch.Tensor, *, check: bool = True) -> torch.Tensor:
        """``(..., w)`` integer codes to ``(..., packed_bytes)`` uint8 (ValueError for a code
        outside its level, from :func:`kernels.fsq_pack`'s check or this one; ``check=False``
        for codes in range by construction, e.g. :meth:`codes`': no read-back)."""
        if self.power_of_two:
            return fsq_pack(codes, self.levels, check=check)
        if not isinstance(codes, torch.Tensor) or codes.dtype.is_floating_point \
                or codes.shape[-1:] != (self.width,):
            raise ValueError(f"codes must be an integer tensor (..., {self.width}), got "
                             f"{getattr(codes, 'dtype', type(codes))} "
                             f"{tuple(getattr(codes, 'shape', ()))}")
        codes = codes.long()
        if check and codes.numel() and bool(((codes < 0) | (codes >= torch.tensor(
                self.levels, device=codes.device))).any()):
            raise ValueError(f"codes outside [0, level) for levels {list(self.levels)[:8]}")
        digits = []
        for a, b in self.groups:
            value = torch.zeros(codes.shape[:-1], dtype=torch.long, device=codes.device)
            for i in reversed(range(a, b)):
                value = value * self.levels[i] + codes[..., i]
            digits.append(value)
        return fsq_pack(torch.stack(digits, -1), self._group_levels(), check=False)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`pack`: ``(..., packed_bytes)`` uint8 to ``(..., w)`` int64."""
        if self.power_of_two:
            return fsq_unpack(packed, self.levels, self.width)
        digits = fsq_unpack(packed, self._group_levels(), len(self.groups))
        out = []
        for g, (a, b) in enumerate(self.groups):
            value = digits[..., g]
            for i in range(a, b):
                out.append(value % self.levels[i])
                value = value // self.levels[i]
        return torch.stack(out, -1)


class FsqBottleneck(nn.Module):
    """Encoder ``hidden -> w``, :class:`FSQ`, and key/value decoders ``w -> kv_heads * head_dim``.

    Args:
        hidden: model width.
        kv_heads, head_dim: the attention's key/value geometry.
        levels: ``w`` per-coordinate levels.
    """

    def __init__(self, hidden: int, kv_heads: int, head_dim: int, levels):
        super().__init__()
        self.fsq = FSQ(levels)
        w = self.fsq.width
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.encoder = nn.Linear(hidden, w)
        self.key_decoder = nn.Linear(w, kv_heads * head_dim)
        self.value_decoder = nn.Linear(w, kv_heads * head_dim)

    def latent(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Quantised centred values ``(..., w)`` float32 of ``hidden_states`` ``(..., hidden)``."""
        return self.fsq(self.encoder(hidden_states).float())

    def codes(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Integer codes ``(..., w)`` int64 of ``hidden_states`` ``(..., hidden)``."""
        return self.fsq.codes(self.encoder(hidden_states).float())

    def decode(self, z: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw keys and values ``(..., kv_heads * head_dim)`` in ``dtype`` from centred values."""
        z = z.to(self.key_decoder.weight.dtype)
        return self.key_decoder(z).to(dtype), self.value_decoder(z).to(dtype)

    def folded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decoders that read integer codes: ``(key_weight, key_bias, value_weight, value_bias)``
        float32, weights ``(kv_heads, head_dim, w)``, biases ``(kv_heads, head_dim)`` (the
        kernel's layout): ``W z + b = (W / m) c + (b - W 1)``."""
        half = self.fsq.half(self.key_decoder.weight.device)
        out = []
        for dec in (self.key_decoder, self.value_decoder):
            weight = dec.weight.float()
            bias = dec.bias.float() - weight.sum(1)
            out += [(weight / half).view(self.kv_heads, self.head_dim, -1),
                    bias.view(self.kv_heads, self.head_dim)]
        return tuple(out)  # type: ignore[return-value]
