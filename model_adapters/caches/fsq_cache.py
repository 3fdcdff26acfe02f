"""The cache of an FSQ-converted model: one bit-packed integer code row per token per layer.

:class:`FSQCache` is a transformers ``Cache`` whose layers (:class:`FsqLayer`) hold only the
packed codes, ``(batch, seq, packed_bytes)`` uint8 per layer (``w = 32, L = 16``: 16 bytes per
token per layer), shared by every KV head; nothing else grows with the context. A converted
attention layer (:mod:`model_adapters.quant.fsq_model`) recognises it by :meth:`FSQCache.
fsq_attention` and hands it the query and the new tokens' integer codes:

- one query token, CUDA, float16/bfloat16, nothing masked, and a problem the kernel takes:
  :func:`kernels.fsq_decode_attention` (Triton; no dense K/V in memory);
- everything else (prefill, chunks, masks, CPU): :func:`fsq_torch_attention`, which reconstructs
  the keys (decoder, k_norm, RoPE at each position) and applies the value decoder once to the
  attention-pooled codes: ``sum_t p_t (W c_t + b) = W (sum_t p_t c_t) + b`` since the weights sum
  to one, so this equals attending over decoded values (tested).

Codes are computed per token from the layer input, so appending in any chunking gives the same
rows (chunk invariant). No exact sink/recent window: in a converted model the decoded K/V *are*
the model's keys and values (the base model's projections are gone), so there is nothing more
exact to keep.

Positions: the model's ``position_ids`` of each token are kept once for the whole cache (8
bytes per token, in the first layer), so left-padded batches rotate keys where the model's own
forward does.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kernels import fsq_decode_attention
from kernels.fsq_reference import rope_cos_sin
from model_adapters.caches.window import crop_target
from model_adapters.quant.fsq import FSQ
from model_adapters.quant.fsq_config import fsq_spec
from model_adapters.quant.fsq_model import attention_layers

__all__ = ["FSQCache", "FsqLayer", "fsq_torch_attention"]

_BACKENDS = ("auto", "torch", "triton")


class FsqLayer(DynamicLayer):
    """One layer's packed codes, kept as ``keys`` ``(batch, 1, seq, packed_bytes)`` uint8 so that
    transformers' batch and beam operations (select, repeat, reorder, crop) apply unchanged.
    ``values`` holds the tokens' RoPE positions ``(batch, 1, seq, 1)`` int64 in the layer that
    keeps them (the first; 8 bytes per token for the whole cache), else an empty ``(batch, 1,
    seq, 0)`` placeholder."""

    def __init__(self, keeps_positions: bool = False):
        super().__init__()
        self.keeps_positions = keeps_positions

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError("FSQCache holds FSQ codes and serves FSQ-converted models only (this "
                        "model handed it dense keys and values)")

    def append(self, packed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Append ``(batch, n, packed_bytes)`` uint8 codes at ``(batch, n)`` int64 positions;
        returns every row, ``(batch, seq, packed_bytes)``."""
        rows = packed[:, None]
        extra = positions[:, None, :, None] if self.keeps_positions else rows[..., :0]
        DynamicLayer.update(self, rows, extra)
        return self.keys[:, 0]

    def positions(self) -> torch.Tensor:
        """``(batch, seq)`` int64 positions (the layer that keeps them)."""
        return self.values[:, 0, :, 0]

    def codes(self) -> torch.Tensor | None:
        """``(batch, seq, packed_bytes)`` uint8, or None before the first token."""
        return None if not self.is_initialized or self.keys.numel() == 0 else self.keys[:, 0]

    def crop(self, tokens_to_remove: int) -> None:
        """Both transformers conventions (:func:`~model_adapters.caches.window.crop_target`)."""
        keep = crop_target(tokens_to_remove, self.get_seq_length())
        if self.is_initialized and keep < self.get_seq_length():
            self.keys = self.keys[..., :keep, :]
            self.values = self.values[..., :keep, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


def fsq_torch_attention(query: torch.Tensor, codes: torch.Tensor, folded, *, scale: float,
                        k_norm: torch.Tensor | None = None, norm_eps: float = 1e-6,
                        rope_theta: float | None = None, positions: torch.Tensor | None = None,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``n`` new queries over ``seq`` cached codes, in float32.

    Args:
        query: ``(batch, q_heads, n, head_dim)``, normed and rotated; the new tokens are the
            last ``n`` of the ``seq`` cached ones.
        codes: ``(batch, seq, w)`` integer codes.
        folded: ``(key_weight, key_bias, value_weight, value_bias)``, weights ``(kv_heads,
            head_dim, w)`` and biases ``(kv_heads, head_dim)`` reading integer codes
            (:meth:`~model_adapters.quant.fsq.FsqBottleneck.folded`).
        scale: softmax scale. k_norm / norm_eps: Qwen3's key RMSNorm weight ``(head_dim,)``.
        rope_theta: RoPE base, or None.
        positions: ``(batch, seq)`` RoPE positions of the cached tokens (None: their indices).
        mask: broadcastable to ``(batch, q_heads, n, seq)``, boolean (True attends) or additive;
            None means causal.

    Returns:
        ``(batch, n, q_heads, head_dim)`` in the query's dtype.
    """
    wk, bk, wv, bv = (t.float() for t in folded)
    batch, q_heads, n, dim = query.shape
    kv_heads, seq = wk.shape[0], codes.shape[1]
    z = codes.float()
    keys = torch.einsum("hdw,btw->bhtd", wk, z) + bk[None, :, None]
    if k_norm is not None:
        keys = keys * torch.rsqrt(keys.pow(2).mean(-1, keepdim=True) + norm_eps) * k_norm.float()
    if rope_theta is not None:
        if positions is None:
            positions = torch.arange(seq, device=codes.device).expand(batch, seq)
        cos, sin = rope_cos_sin(rope_theta, positions.reshape(-1), dim)
        cos, sin = cos.view(batch, 1, seq, dim), sin.view(batch, 1, seq, dim)
        keys = keys * cos + _rotate_half(keys) * sin
    group = q_heads // kv_heads
    q = query.float().reshape(batch, kv_heads, group, n, dim)
    scores = torch.einsum("bhgnd,bhtd->bhgnt", q, keys).reshape(batch, q_heads, n, seq) * scale
    if mask is None:
        rows = torch.arange(n, device=codes.device)[:, None] + (seq - n)
        scores = scores.masked_fill(torch.arange(seq, device=codes.device) > rows, float("-inf"))
    elif mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask[..., -seq:], float("-inf"))
    else:
        scores = scores + mask[..., -seq:].float()
    # a query that sees nothing (a pad row of a left-padded batch) gets zeros, not NaN
    weights = torch.softmax(scores, -1).nan_to_num(0.0).reshape(batch, kv_heads, group, n, seq)
    pooled = torch.einsum("bhgnt,btw->bhgnw", weights, z)
    out = torch.einsum("bhgnw,hdw->bhgnd", pooled, wv) + bv[None, :, None, None]
    return out.reshape(batch, q_heads, n, dim).transpose(1, 2).to(query.dtype)


def _all_visible(mask) -> bool:
    if mask is None:
        return True
    return bool(mask.all()) if mask.dtype == torch.bool else bool((mask == 0).all())


class FSQCache(Cache):
    """The packed-code cache of an FSQ-converted model (see the module).

    Args:
        model: an FSQ-converted model (``FsqQwen3ForCausalLM`` / ``FsqGPT2LMHeadModel``) or its
            configuration's model.
        backend: ``"auto"`` (the Triton kernel for CUDA float16/bfloat16 decode steps it takes,
            else torch), ``"torch"``, or ``"triton"`` (the kernel for every decode step without
            masked positions; ValueError from the kernel where it cannot).
    """

    def __init__(self, model, *, backend: str = "auto"):
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        width, levels, _ = fsq_spec(model.config)
        n_layers = len(attention_layers(model))
        super().__init__(layers=[FsqLayer(keeps_positions=i == 0) for i in range(n_layers)])
        self.fsq = FSQ(levels)
        self.backend = backend
        self.kernel_calls = 0  # decode steps (per layer) sent to kernels.fsq_decode_attention

    @property
    def packed_bytes(self) -> int:
        """Bytes of one token's code row in one layer."""
        return self.fsq.packed_bytes

    def nbytes(self) -> int:
        """Bytes the cache holds: every layer's packed codes, and the positions once."""
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers
                   if layer.is_initialized and layer.keys is not None)

    def layer_codes(self, layer_idx: int) -> torch.Tensor | None:
        """Layer ``layer_idx``'s integer codes ``(batch, seq, w)`` int64 (None when empty)."""
        packed = self.layers[layer_idx].codes()
        return None if packed is None else self.fsq.unpack(packed)

    @torch.no_grad()
    def fsq_attention(self, module, query: torch.Tensor, codes: torch.Tensor,
                      attention_mask: torch.Tensor | None,
                      position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Called by a converted attention layer: append ``codes`` ``(batch, n, w)`` and attend.

        Args:
            module: the converted attention layer (bottleneck, k_norm, RoPE base, scale).
            query: ``(batch, q_heads, n, head_dim)``, normed and rotated.
            codes: ``(batch, n, w)`` integer codes of the new tokens.
            attention_mask: the model's mask for this layer.
            position_ids: ``(batch or 1, n)`` RoPE positions of the new tokens (None: their
                indices in the cache). Kept once for all layers: left-padded batches work.

        Returns:
            ``(batch, n, q_heads, head_dim)`` in the query's dtype.
        """
        layer = self.layers[module.layer_idx]
        batch, n = codes.shape[:2]
        if position_ids is None:
            start = layer.get_seq_length()
            position_ids = torch.arange(start, start + n, device=codes.device)
        position_ids = position_ids.to(codes.device, torch.long).expand(batch, n)
        packed = layer.append(self.fsq.pack(codes), position_ids)
        positions = self.layers[0].positions()
        folded = module.fsq.folded()
        norm = module.fsq_k_norm
        k_norm = None if norm is None else norm.weight
        eps = 1e-6 if norm is None else float(getattr(norm, "variance_epsilon", 1e-6))
        step = query.shape[2] == 1
        if step and self.backend != "torch" and query.dtype in (torch.float16, torch.bfloat16) \
                and (query.is_cuda or self.backend == "triton") and _all_visible(attention_mask):
            self.kernel_calls += 1
            out = fsq_decode_attention(
                query[:, :, 0], packed, self.fsq.levels, folded[0], folded[2],
                key_bias=folded[1], value_bias=folded[3], rope=module.fsq_rope_theta,
                positions=positions if module.fsq_rope_theta is not None else None,
                k_norm=k_norm, norm_eps=eps, scale=module.scaling, backend=self.backend)
            return out[:, None]
        return fsq_torch_attention(query, self.fsq.unpack(packed), folded, scale=module.scaling,
                                   k_norm=k_norm, norm_eps=eps,
                                   rope_theta=module.fsq_rope_theta, positions=positions,
                                   mask=attention_mask)
