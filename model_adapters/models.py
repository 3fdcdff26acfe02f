"""What the rest of model_adapters needs to know about a model: its KV cache shape, its
position limit, its identity, and the name transformers gives the cache argument.

GPT-2 is multi-head attention without RoPE; Qwen3 is grouped-query attention whose cached keys
are already rotated. Both cache ``(batch, kv_heads, seq, head_dim)`` per layer.

A model's identity has two parts: :func:`config_fingerprint` (the architecture fields that give
cached K/V vectors their meaning) and :func:`weights_fingerprint` (a strided sample of every
parameter), so codebooks fitted on one checkpoint are not silently used with another of the same
architecture. Both are computed when something is bound to a model, never per forward.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import warnings
from dataclasses import asdict, dataclass, replace

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "KVShape",
    "ModelIdentity",
    "cache_kwarg",
    "check_identity",
    "config_fingerprint",
    "kv_shape",
    "max_positions",
    "model_identity",
    "output_cache",
    "weights_fingerprint",
]


@dataclass(frozen=True)
class KVShape:
    """KV cache geometry of one model.

    Attributes:
        model_type: ``"gpt2"`` or ``"qwen3"`` (``"fsq_gpt2"`` / ``"fsq_qwen3"`` for an
            FSQ-converted model, whose cache is codes: the geometry is what they decode to).
        num_layers: decoder layers.
        kv_heads: key/value heads per layer (query heads for GPT-2).
        head_dim: size of one key or value vector.
        rope: keys are cached after a rotary position embedding.
    """

    model_type: str
    num_layers: int
    kv_heads: int
    head_dim: int
    rope: bool

    @property
    def fp16_bytes_per_token(self) -> int:
        """Bytes of one token's K and V over all layers in fp16."""
        return self.num_layers * self.kv_heads * self.head_dim * 2 * 2


def _gpt2(config) -> tuple[KVShape, dict]:
    if config.n_embd % config.n_head:
        raise ValueError(
            f"gpt2 config: n_embd={config.n_embd} not divisible by n_head={config.n_head}"
        )
    shape = KVShape("gpt2", config.n_layer, config.n_head, config.n_embd // config.n_head, False)
    ident = {
        "n_positions": config.n_positions,
        "vocab_size": config.vocab_size,
        "n_embd": config.n_embd,
    }
    return shape, ident


def _qwen3(config) -> tuple[KVShape, dict]:
    if getattr(config, "use_sliding_window", False):
        raise ValueError(
            "qwen3 config with use_sliding_window=True is not supported (full attention only)"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = KVShape("qwen3", config.num_hidden_layers, config.num_key_value_heads, head_dim, True)
    rope = dict(getattr(config, "rope_parameters", None) or {
        "rope_theta": getattr(config, "rope_theta", None)
    })
    ident = {
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "vocab_size": config.vocab_size,
        "rope_theta": rope.pop("rope_theta", None),
    }
    # RoPE scaling changes the cached keys too; plain RoPE adds nothing, so the fingerprints
    # of archives written before scaling was part of it stay valid
    if rope.get("rope_type", "default") == "default":
        rope.pop("rope_type", None)
    if rope:
        ident["rope_parameters"] = rope
    return shape, ident


def _fsq(base):
    """An FSQ-converted model (``fsq_gpt2`` / ``fsq_qwen3``): the base model's cache geometry;
    the FSQ setting is part of the identity (its codes mean nothing under another)."""

    def adapt(config) -> tuple[KVShape, dict]:
        shape, ident = base(config)
        levels = config.fsq_levels
        ident.update(fsq_width=int(config.fsq_width),
                     fsq_levels=levels if isinstance(levels, int) else list(levels))
        return replace(shape, model_type=config.model_type), ident

    return adapt


_ADAPTERS = {"gpt2": _gpt2, "qwen3": _qwen3, "fsq_gpt2": _fsq(_gpt2), "fsq_qwen3": _fsq(_qwen3)}
SUPPORTED_MODEL_TYPES = tuple(_ADAPTERS)


def _adapt(config) -> tuple[KVShape, dict]:
    config = getattr(config, "config", config)  # a model or its config
    model_type = getattr(config, "model_type", None)
    if model_type not in _ADAPTERS:
        raise ValueError(
            f"model_type {model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return _ADAPTERS[model_type](config)


def kv_shape(config) -> KVShape:
    """KV cache shape of a transformers model or config (GPT-2 or Qwen3)."""
    return _adapt(config)[0]


def max_positions(config) -> int:
    """Longest sequence the model's position embedding covers."""
    config = getattr(config, "config", config)
    _adapt(config)
    return int(
        config.n_positions if config.model_type.endswith("gpt2") else config.max_position_embeddings
    )


def config_fingerprint(config) -> str:
    """sha256 (hex) over the architecture fields that decide what cached K/V vectors mean.

    Stored in an archive so codes are never decoded against a different model's codebooks.
    """
    shape, ident = _adapt(config)
    blob = json.dumps({**asdict(shape), **ident}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


# elements sampled per parameter tensor: enough that two checkpoints of one architecture never
# collide, few enough that a 1B-parameter model hashes in milliseconds
_WEIGHT_SAMPLES = 1024


def weights_fingerprint(model) -> str:
    """sha256 (hex) over every parameter's shape and a strided sample of its values.

    ``_WEIGHT_SAMPLES`` evenly spaced elements per tensor, in registration order, rounded to
    bfloat16 first: a checkpoint loaded in float32 and in bfloat16 has one fingerprint (a
    float16 load of a wider checkpoint rounds differently and gets another). Parameter names
    are left out so a renaming between transformers releases does not change it. Reads about
    a thousand elements per tensor, not the weights (see docs/adapters.md for the timing).
    """
    import numpy as np
    import torch

    digest = hashlib.sha256()
    samples = []
    with torch.no_grad():
        for param in model.parameters():
            flat = param.detach().reshape(-1)
            step = max(1, flat.numel() // _WEIGHT_SAMPLES)
            samples.append(flat[::step][:_WEIGHT_SAMPLES].to("cpu", torch.bfloat16))
            digest.update(repr(tuple(param.shape)).encode())
    if samples:
        digest.update(np.ascontiguousarray(torch.cat(samples).view(torch.int16).numpy()).data)
    return digest.hexdigest()


@dataclass(frozen=True)
class ModelIdentity:
    """Which model codebooks or an archive belong to.

    Attributes:
        model_type: ``"gpt2"`` or ``"qwen3"`` (``"fsq_gpt2"`` / ``"fsq_qwen3"`` for an
            FSQ-converted model, whose cache is codes: the geometry is what they decode to).
        config: :func:`config_fingerprint` (sha256 hex).
        weights: :func:`weights_fingerprint`, or None where only a configuration was seen (a
            config instead of a model, or an archive written before weights were recorded).
    """

    model_type: str
    config: str
    weights: str | None = None

    def __str__(self) -> str:
        weights = self.weights[:12] if self.weights else "unknown"
        return f"{self.model_type} (config {self.config[:12]}, weights {weights})"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelIdentity:
        return cls(str(d["model_type"]), str(d["config"]), d.get("weights"))


def model_identity(model_or_config) -> ModelIdentity:
    """The identity of a model (config and weights) or of a bare config (weights None)."""
    config = getattr(model_or_config, "config", model_or_config)
    weights = None
    if callable(getattr(model_or_config, "parameters", None)):
        weights = weights_fingerprint(model_or_config)
    return ModelIdentity(kv_shape(config).model_type, config_fingerprint(config), weights)


def check_identity(
    expected: ModelIdentity, actual: ModelIdentity, *, what: str,
    allow_different_weights: bool = False, warn: bool = True,
) -> None:
    """Refuse ``actual`` unless it is the model ``expected`` names.

    Another configuration always raises ValueError; other weights raise unless
    ``allow_different_weights``. Where either side has no weights fingerprint, only the
    configuration is compared and (with ``warn``) a warning says so.

    Args:
        expected: the identity recorded with ``what`` (codebooks, an archive).
        actual: the model's identity.
        what: names the recorded side in messages, e.g. ``"codebooks in DIR"``.
    """
    if expected.config != actual.config:
        raise ValueError(
            f"{what}: made for another model configuration, {expected}; this model is {actual}"
        )
    if expected.weights is None or actual.weights is None:
        if warn and expected.weights is None and actual.weights is not None:
            warnings.warn(
                f"{what}: only the model configuration was recorded ({expected}), not the "
                "weights, which therefore cannot be checked", stacklevel=3,
            )
        return
    if expected.weights != actual.weights and not allow_different_weights:
        raise ValueError(
            f"{what}: made for other weights of this architecture, {expected}; this model is "
            f"{actual}; pass allow_different_weights=True to use them anyway"
        )


def cache_kwarg(model) -> str:
    """Name of the keyword that passes a cache to ``model.forward`` / ``generate``.

    transformers 5.24 takes ``cache=`` (``past_key_values=`` deprecated); earlier 5.x releases
    take ``past_key_values=``.
    """
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(outputs):
    """The cache carried by a model output, whichever attribute name this version uses."""
    cache = getattr(outputs, "cache", None)
    return cache if cache is not None else outputs.past_key_values
