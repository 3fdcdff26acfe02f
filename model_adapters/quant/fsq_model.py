"""FSQ-converted transformers models: Qwen3 and GPT-2 whose attention layers compute keys and
values through an :class:`~model_adapters.quant.fsq.FsqBottleneck` instead of their K/V
projections.

Per layer and token: ``z = FSQ(E x + e)`` (``w`` coordinates, shared by every KV head), keys
``k_norm(D_k z + d_k)`` rotated by RoPE (Qwen3; GPT-2 has neither), values ``D_v z + d_v``. The
query path, the output projection, the MLPs and everything else are the base model's, unchanged.

With an ordinary cache (``DynamicCache``) the reconstructed K/V are cached densely, which is the
model's own full-sequence forward. With a cache that holds codes (:class:`FSQCache
<model_adapters.caches.fsq_cache.FSQCache>`, recognised by its ``fsq_attention`` method) the
layer hands the cache its query and its new tokens' integer codes and the cache attends.

:func:`register_auto_classes` registers both with ``AutoConfig`` / ``AutoModelForCausalLM``
(``import model_adapters`` arranges that once transformers' auto classes load), so a saved
converted model loads with ``AutoModelForCausalLM.from_pretrained(dir)``, no remote code.
"""

from __future__ import annotations

from torch import nn
from transformers import GPT2LMHeadModel, Qwen3ForCausalLM
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.pytorch_utils import Conv1D

from model_adapters.quant.fsq import FsqBottleneck
from model_adapters.quant.fsq_config import FsqGPT2Config, FsqQwen3Config, fsq_spec

__all__ = [
    "FsqGPT2Attention",
    "FsqGPT2LMHeadModel",
    "FsqQwen3Attention",
    "FsqQwen3ForCausalLM",
    "bottlenecks",
    "register_auto_classes",
    "rope_theta",
]


def rope_theta(config) -> float | None:
    """The RoPE base of a Qwen3-style configuration (plain RoPE only), None for GPT-2.
    ValueError for a scaled RoPE, which the codes path does not reproduce."""
    if "gpt2" in config.model_type:
        return None
    params = dict(getattr(config, "rope_parameters", None) or {})
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"FSQ conversion supports plain RoPE only, got rope_parameters "
                         f"{params!r}")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("the configuration names no rope_theta")
    return float(theta)


def _attention_function(module):
    impl = getattr(module.config, "_attn_implementation", None) or "sdpa"
    if impl == "eager":
        return eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[impl]


def fsq_attend(module, query, hidden_states, attention_mask, cache, cos_sin, kwargs):
    """The K/V half of a converted attention layer and the attention itself.

    Args:
        module: the converted attention layer (``fsq``, ``head_dim``, ``scaling``,
            ``layer_idx``, ``fsq_k_norm`` (a module or None)).
        query: ``(batch, q_heads, n, head_dim)``, already normed and rotated.
        hidden_states: ``(batch, n, hidden)``, the layer's input.
        attention_mask: the model's mask for this layer (or None).
        cache: the model's cache or None.
        cos_sin: RoPE ``(cos, sin)`` ``(batch, n, head_dim)`` of the new tokens, or None.

    Returns:
        ``(batch, n, q_heads * head_dim)`` in the query's dtype.
    """
    batch, n = hidden_states.shape[:2]
    if cache is not None and hasattr(cache, "fsq_attention"):
        codes = module.fsq.codes(hidden_states)
        out = cache.fsq_attention(module, query, codes, attention_mask,
                                  position_ids=kwargs.get("position_ids"))
        return out.reshape(batch, n, -1)
    keys, values = module.fsq.decode(module.fsq.latent(hidden_states), query.dtype)
    keys = keys.view(batch, n, -1, module.head_dim)
    if module.fsq_k_norm is not None:
        keys = module.fsq_k_norm(keys)
    keys = keys.transpose(1, 2)
    values = values.view(batch, n, -1, module.head_dim).transpose(1, 2)
    if cos_sin is not None:
        _, keys = apply_rotary_pos_emb(keys, keys, *cos_sin)
    if cache is not None:
        keys, values = cache.update(keys, values, module.layer_idx)
    out, _ = _attention_function(module)(
        module, query, keys, values, attention_mask, dropout=0.0, scaling=module.scaling,
        **{k: v for k, v in kwargs.items() if k in ("position_ids", "cu_seq_lens_q",
                                                       "cu_seq_lens_k", "max_length_q",
                                                       "max_length_k")})
    return out.reshape(batch, n, -1).contiguous()


class FsqQwen3Attention(Qwen3Attention):
    """Qwen3 attention with the K/V projections replaced by an FSQ bottleneck (``fsq``)."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        del self.k_proj, self.v_proj
        width, levels, _ = fsq_spec(config)
        self.fsq = FsqBottleneck(config.hidden_size, config.num_key_value_heads,
                                 self.head_dim, levels)
        self.fsq_rope_theta = rope_theta(config)

    @property
    def fsq_k_norm(self):
        return self.k_norm

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                cache=None, past_key_values=None, **kwargs):
        """As Qwen3's (either cache keyword: transformers renamed it); returns ``(output,
        None)``."""
        cache = cache if cache is not None else past_key_values
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_norm(self.q_proj(hidden_states).view(shape)).transpose(1, 2)
        cos, sin = position_embeddings
        query, _ = apply_rotary_pos_emb(query, query, cos, sin)
        out = fsq_attend(self, query, hidden_states, attention_mask, cache, (cos, sin), kwargs)
        return self.o_proj(out), None


class FsqGPT2Attention(GPT2Attention):
    """GPT-2 self-attention with the fused ``c_attn`` reduced to its query part (``q_attn``)
    and the K/V parts replaced by an FSQ bottleneck (``fsq``)."""

    def __init__(self, config, is_cross_attention=False, layer_idx=None):
        if is_cross_attention:
            raise ValueError("FSQ conversion covers GPT-2 self-attention only")
        super().__init__(config, is_cross_attention=False, layer_idx=layer_idx)
        del self.c_attn
        self.q_attn = Conv1D(self.embed_dim, self.embed_dim)
        width, levels, _ = fsq_spec(config)
        self.fsq = FsqBottleneck(self.embed_dim, self.num_heads, self.head_dim, levels)
        self.fsq_rope_theta = None
        self.fsq_k_norm = None
        self.num_key_value_groups = 1
        scaling = self.head_dim ** -0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scaling /= float(layer_idx + 1)
        self.scaling = scaling
        if config.reorder_and_upcast_attn:
            raise ValueError("FSQ conversion does not cover reorder_and_upcast_attn=True")

    def forward(self, hidden_states, cache=None, attention_mask=None, *args,
                past_key_values=None, layer_past=None, **kwargs):
        """As GPT-2's self-attention (any of its cache keywords); returns ``(output, None)``."""
        for other in (past_key_values, layer_past):
            cache = cache if cache is not None else other
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_attn(hidden_states).view(shape).transpose(1, 2)
        out = fsq_attend(self, query, hidden_states, attention_mask, cache, None, kwargs)
        return self.resid_dropout(self.c_proj(out)), None


class FsqQwen3ForCausalLM(Qwen3ForCausalLM):
    """``Qwen3ForCausalLM`` with every attention layer an :class:`FsqQwen3Attention`."""

    config_class = FsqQwen3Config
    config: FsqQwen3Config

    def __init__(self, config):
        super().__init__(config)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = FsqQwen3Attention(config, i)
        self.post_init()


class FsqGPT2LMHeadModel(GPT2LMHeadModel):
    """``GPT2LMHeadModel`` with every attention layer an :class:`FsqGPT2Attention`."""

    config_class = FsqGPT2Config
    config: FsqGPT2Config

    def __init__(self, config):
        super().__init__(config)
        for i, block in enumerate(self.transformer.h):
            block.attn = FsqGPT2Attention(config, layer_idx=i)
        self.post_init()


def bottlenecks(model) -> list[FsqBottleneck]:
    """The converted model's bottlenecks, one per layer, in layer order."""
    found = [m.fsq for m in model.modules() if isinstance(m, (FsqQwen3Attention,
                                                                FsqGPT2Attention))]
    if not found:
        raise ValueError(f"{type(model).__name__} has no FSQ attention layers (not converted)")
    return found


def attention_layers(model) -> list[nn.Module]:
    """The converted model's attention layers, in layer order."""
    return [m for m in model.modules() if isinstance(m, (FsqQwen3Attention, FsqGPT2Attention))]


_REGISTERED = []


def register_auto_classes() -> None:
    """Register the converted configurations and models with ``AutoConfig`` and
    ``AutoModelForCausalLM``. Idempotent."""
    if _REGISTERED:
        return
    _REGISTERED.append(True)
    from transformers import AutoConfig, AutoModelForCausalLM

    for config_class, model_class in ((FsqQwen3Config, FsqQwen3ForCausalLM),
                                      (FsqGPT2Config, FsqGPT2LMHeadModel)):
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)
