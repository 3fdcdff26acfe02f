"""What the archiving code needs to know about a model architecture: its KV cache shape.

GPT-2 is multi-head attention without RoPE; Qwen3 is grouped-query attention whose cached keys
are already rotated. Both cache ``(batch, kv_heads, seq, head_dim)`` per layer.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

__all__ = ["KVShape", "SUPPORTED_MODEL_TYPES", "config_fingerprint", "kv_shape", "max_positions"]


@dataclass(frozen=True)
class KVShape:
    """KV cache geometry of one model.

    Attributes:
        model_type: ``"gpt2"`` or ``"qwen3"``.
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


_ADAPTERS = {"gpt2": _gpt2, "qwen3": _qwen3}
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


def check_window(**counts: int) -> None:
    """Raise ValueError naming the first cache-window count that is not an int >= 0 (``block``:
    >= 1, a group of positions)."""
    for name, v in counts.items():
        low = 1 if name == "block" else 0
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            kind = "a positive" if low else "a non-negative"
            raise ValueError(f"{name} must be {kind} int, got {v!r}")


def crop_target(tokens_to_remove: int, length: int) -> int:
    """The length a cache of ``length`` positions keeps under ``crop(tokens_to_remove)``, in
    both transformers conventions: ``n < 0`` drops the last ``-n`` positions, ``n > 0`` keeps
    the first ``n``, ``0`` keeps everything. TypeError for a non-int; ValueError, naming the
    length, when the cut would pass the start or ``n`` exceeds what the cache holds."""
    if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
        raise TypeError(f"crop takes an int, got {tokens_to_remove!r}")
    if tokens_to_remove == 0:
        return length
    target = tokens_to_remove if tokens_to_remove > 0 else length + tokens_to_remove
    if target < 0:
        raise ValueError(
            f"cannot remove {-tokens_to_remove} positions: the cache holds only {length}")
    if target > length:
        raise ValueError(f"cannot keep {target} positions: the cache holds only {length}")
    return target


def kv_shape(config) -> KVShape:
    """KV cache shape of a transformers model or config (GPT-2 or Qwen3)."""
    return _adapt(config)[0]


def max_positions(config) -> int:
    """Longest sequence the model's position embedding covers."""
    config = getattr(config, "config", config)
    _adapt(config)
    return int(
        config.n_positions if config.model_type == "gpt2" else config.max_position_embeddings
    )


def config_fingerprint(config) -> str:
    """sha256 (hex) over the architecture fields that decide what cached K/V vectors mean.

    Stored in an archive so codes are never decoded against a different model's codebooks.
    """
    shape, ident = _adapt(config)
    blob = json.dumps({**asdict(shape), **ident}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()
