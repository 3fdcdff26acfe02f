"""Quantizer configuration names, one grammar.

- ``exact``: no quantization (the baseline).
- ``{pooled|perhead}-k{K}-s{S}``: K centroids per stage, S residual stages for keys and values.
- ``...-s{S}-keysonly`` / ``...-s{S}-valuesonly``: quantize only keys (values exact) or only values.
- ``{pooled|perhead}-k{K}-K{a}V{b}``: a key stages and b value stages.
- ``hybrid-k{K}-K{a}V{b}``: alias of ``perhead-k{K}-K{a}V{b}``.
- ``all``: the rows of the paper's Table 2 (:data:`ALL_CONFIGS`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["ALL_CONFIGS", "QuantConfig", "expand_configs", "parse_config"]

ALL_CONFIGS = (
    "exact",
    "pooled-k256-s1",
    "pooled-k1024-s1",
    "pooled-k1024-s2",
    "perhead-k256-s1",
    "perhead-k256-s2",
    "perhead-k256-s2-keysonly",
    "perhead-k256-s2-valuesonly",
    "hybrid-k256-K4V2",
)

_STAGES = re.compile(r"^(pooled|perhead)-k(\d+)-s(\d+)(-keysonly|-valuesonly)?$")
_SPLIT = re.compile(r"^(pooled|perhead|hybrid)-k(\d+)-K(\d+)V(\d+)$")
_MAX_CODEBOOK = 1 << 16


@dataclass(frozen=True)
class QuantConfig:
    """One quantizer setting.

    Attributes:
        name: the name as given (aliases kept, e.g. ``hybrid-k256-K4V2``).
        pooled: one codebook per layer shared by its KV heads (else one per head).
        codebook_size: centroids per stage (0 for ``exact``).
        key_stages: residual stages for keys (0: keys kept exact).
        value_stages: residual stages for values (0: values kept exact).
    """

    name: str
    pooled: bool = False
    codebook_size: int = 0
    key_stages: int = 0
    value_stages: int = 0

    @property
    def is_exact(self) -> bool:
        return self.key_stages == 0 and self.value_stages == 0

    @property
    def canonical(self) -> str:
        """The name with aliases resolved (``perhead-k256-K4V2`` for the hybrid)."""
        if self.is_exact:
            return "exact"
        kind = "pooled" if self.pooled else "perhead"
        return f"{kind}-k{self.codebook_size}-K{self.key_stages}V{self.value_stages}"


def parse_config(name: str) -> QuantConfig:
    """Parse one configuration name (see the module docstring for the grammar).

    Raises:
        ValueError: the name does not follow the grammar, or a number is out of range.
    """
    if not isinstance(name, str):
        raise TypeError(f"config name must be a str, got {type(name).__name__}")
    if name == "exact":
        return QuantConfig(name)
    m = _STAGES.match(name)
    if m:
        kind, k, s, only = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        ks = 0 if only == "-valuesonly" else s
        vs = 0 if only == "-keysonly" else s
    else:
        m = _SPLIT.match(name)
        if not m:
            raise ValueError(
                f"config {name!r} does not follow the grammar: exact, "
                "{pooled|perhead}-k{K}-s{S}[-keysonly|-valuesonly], "
                "{pooled|perhead|hybrid}-k{K}-K{a}V{b} ('all', the paper's rows, is a list "
                "of names: expand_configs)"
            )
        kind, k, ks, vs = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
        s = max(ks, vs)
    if not 2 <= k <= _MAX_CODEBOOK:
        raise ValueError(f"config {name!r}: codebook size k={k} must be in [2, {_MAX_CODEBOOK}]")
    if s < 1 or ks > 16 or vs > 16:
        raise ValueError(f"config {name!r}: stage counts must be 1..16 (at least one nonzero)")
    return QuantConfig(
        name, pooled=(kind == "pooled"), codebook_size=k, key_stages=ks, value_stages=vs
    )


def expand_configs(names) -> list[QuantConfig]:
    """Parse a list of names, expanding ``all``; duplicates are dropped, order kept."""
    out, seen = [], set()
    for name in names:
        for one in ALL_CONFIGS if name == "all" else (name,):
            cfg = parse_config(one)
            if cfg.name not in seen:
                seen.add(cfg.name)
                out.append(cfg)
    if not out:
        raise ValueError("no configuration given")
    return out
