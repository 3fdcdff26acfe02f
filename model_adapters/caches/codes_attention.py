"""Attention over a layer whose archived positions are held only as residual-VQ codes.

A codes-only cache layer (:mod:`model_adapters.caches.codes_only`) cannot hand the model a dense
key tensor for its archived positions, so its ``update`` returns the exact recent keys with the
layer itself attached (attribute :data:`LAYER_ATTR`), and the attention function registered here
under :data:`CODES_ATTENTION` reads the codes from that layer:

- one query token and no masked position (plain decoding), float16/bfloat16:
  :func:`kernels.rvq_decode_attention` when the layer's ``backend`` asks for it (``"triton"``;
  ``"auto"`` for CUDA tensors with triton installed and shapes a kernel takes; ``"torch"``,
  the dequantizing reference, for CUDA tensors); everything else, a CPU included,
  :func:`lookup_attention`, which works in float32 on any device and reads a few bytes per
  archived position instead of decoding the archive (``docs/serving.md``, "Decode on a CPU");
- one query token with masked positions (left-padded batches): :func:`lookup_attention`;
- several query tokens (prefill, chunked prefill, verification of draft tokens): the layer's codes
  are decoded into a dense K/V that lives only for this call, and the usual SDPA runs with the
  model's mask. This reproduces the archiving cache, whose prefill queries also see the
  reconstructions, at the cost of one layer's dense K/V for the duration of one attention call.

Tensors that carry no layer (another cache, or no cache) go to transformers' SDPA unchanged, so a
model switched to this implementation still works with any other cache.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kernels._validate import CODE_DTYPE_LIMITS

__all__ = [
    "CODES_ATTENTION",
    "LAYER_ATTR",
    "codes_attention_forward",
    "lookup_attention",
    "register_codes_attention",
    "use_codes_attention",
]

CODES_ATTENTION = "fkv_codes"
LAYER_ATTR = "_fkv_codes_layer"
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
# codebooks over 32,768 centroids get int32 codes, which only the look-ups read
_KERNEL_CODE_DTYPES = frozenset(CODE_DTYPE_LIMITS)


def lookup_attention(
    query: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    key_codes: torch.Tensor,
    value_codes: torch.Tensor,
    key_codebooks: torch.Tensor,
    value_codebooks: torch.Tensor,
    recent_keys: torch.Tensor,
    recent_values: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    scale: float,
) -> torch.Tensor:
    """Attention over sinks, coded archive and recents by codebook look-ups, in float32.

    Keys are never rebuilt: ``q · k = Σ_stage q · C[stage, code]`` is read from a
    ``(stages, codebook_size)`` table per query; values are summed per centroid first, then
    multiplied with the codebook once.

    Args:
        query: ``(batch, q_heads, q_len, head_dim)``, any float dtype.
        sink_keys, sink_values: ``(batch, kv_heads, sinks, head_dim)`` (sinks may be 0).
        key_codes, value_codes: ``(batch, kv_heads, archived, stages)`` integer.
        key_codebooks, value_codebooks: ``(kv_heads, stages, codebook_size, head_dim)``.
        recent_keys, recent_values: ``(batch, kv_heads, recent, head_dim)``.
        mask: broadcastable to ``(batch, 1 or q_heads, q_len, sinks + archived + recent)``,
            boolean (True attends) or additive float; None attends to everything.
        scale: softmax scale.

    Returns:
        ``(batch, q_heads, q_len, head_dim)`` in the query's dtype.
    """
    batch, q_heads, q_len, dim = query.shape
    kv_heads = key_codebooks.shape[0]
    group = q_heads // kv_heads
    q = query.float().reshape(batch, kv_heads, group, q_len, dim) * scale
    pieces = [torch.einsum("bhgqd,bhnd->bhgqn", q, sink_keys.float())]
    archived = key_codes.shape[2]
    table = torch.einsum("bhgqd,hskd->bhgqsk", q, key_codebooks.float())
    coded = q.new_zeros(batch, kv_heads, group, q_len, archived)
    kidx = key_codes.long()[:, :, None, None]  # (b, h, 1, 1, n, stages)
    for stage in range(key_codebooks.shape[1]):
        idx = kidx[..., stage].expand(-1, -1, group, q_len, -1)
        coded += torch.gather(table[..., stage, :], -1, idx)
    pieces += [coded, torch.einsum("bhgqd,bhnd->bhgqn", q, recent_keys.float())]
    scores = torch.cat(pieces, -1).reshape(batch, q_heads, q_len, -1)
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.float()
    weights = torch.softmax(scores, -1).reshape(batch, kv_heads, group, q_len, -1)
    sinks = sink_keys.shape[2]
    w_sink, w_coded, w_recent = weights.split([sinks, archived, recent_keys.shape[2]], -1)
    out = torch.einsum("bhgqn,bhnd->bhgqd", w_sink, sink_values.float())
    out += torch.einsum("bhgqn,bhnd->bhgqd", w_recent, recent_values.float())
    vidx = value_codes.long()[:, :, None, None]
    size = value_codebooks.shape[2]
    for stage in range(value_codebooks.shape[1]):
        hist = w_coded.new_zeros(batch, kv_heads, group, q_len, size)
        hist.scatter_add_(-1, vidx[..., stage].expand(-1, -1, group, q_len, -1), w_coded)
        out += torch.einsum("bhgqk,hkd->bhgqd", hist, value_codebooks[:, stage].float())
    return out.reshape(batch, q_heads, q_len, dim).to(query.dtype)


def _kernel_path(backend: str, query: torch.Tensor, state) -> bool:
    """Whether a decode step goes to :func:`kernels.rvq_decode_attention` (see the module)."""
    if backend == "triton":  # on CPU tensors the kernel API explains what it needs
        return True
    if not query.is_cuda:
        return False
    if not {state.key_codes.dtype, state.value_codes.dtype} <= _KERNEL_CODE_DTYPES:
        return False
    if backend == "auto":  # the kernel if it takes these shapes, else the look-ups (never
        from kernels.rvq_decode import triton_available  # the dequantizing reference)

        if not triton_available():
            return False
        from kernels._plan import supports_shape

        kv_heads, stages, size = state.value_codebooks.shape[:3]
        return supports_shape(query.shape[0], query.shape[1], kv_heads, stages, size)
    return True


def _all_visible(mask: torch.Tensor | None) -> bool:
    if mask is None:
        return True
    if mask.dtype == torch.bool:
        return bool(mask.all())
    return bool((mask == 0).all())


def codes_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
):
    """transformers attention function (the ``AttentionInterface`` signature).

    Returns ``(attn_output, None)`` with ``attn_output`` ``(batch, q_len, q_heads, head_dim)``.
    """
    layer = getattr(key, LAYER_ATTR, None)
    if layer is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    state = layer.attention_state()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if query.shape[2] == 1 and state.archived:
        kernel = _kernel_path(layer.backend, query, state) and query.dtype in _KERNEL_DTYPES
        if kernel and _all_visible(attention_mask):
            from kernels import rvq_decode_attention

            def segment(t):
                return t if t.shape[2] else None

            sk, rk = segment(state.sink_keys), segment(state.recent_keys)
            out = rvq_decode_attention(
                query[:, :, 0],
                state.key_codes,
                state.value_codes,
                state.key_codebooks,
                state.value_codebooks,
                sink_keys=sk,
                sink_values=None if sk is None else state.sink_values,
                recent_keys=rk,
                recent_values=None if rk is None else state.recent_values,
                scale=scale,
                backend=layer.backend,
                check_codes=False,  # the codes were produced by this cache's own encoder
            )
            return out[:, None], None
        out = lookup_attention(
            query,
            state.sink_keys,
            state.sink_values,
            state.key_codes,
            state.value_codes,
            state.key_codebooks,
            state.value_codebooks,
            state.recent_keys,
            state.recent_values,
            mask=attention_mask,
            scale=scale,
        )
        return out.transpose(1, 2).contiguous(), None
    dense_k, dense_v = layer.dense(query.dtype)
    return sdpa_attention_forward(
        module, query, dense_k, dense_v, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def register_codes_attention() -> str:
    """Register :func:`codes_attention_forward` (and SDPA-style masks) under
    :data:`CODES_ATTENTION`; returns that name. Idempotent."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CODES_ATTENTION, codes_attention_forward)
    AttentionMaskInterface.register(CODES_ATTENTION, sdpa_mask)
    return CODES_ATTENTION


def use_codes_attention(model):
    """Switch ``model`` to the codes attention (registering it first); returns the model."""
    register_codes_attention()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(CODES_ATTENTION)
    else:  # releases without set_attn_implementation read the config at call time
        model.config._attn_implementation = CODES_ATTENTION
    return model
