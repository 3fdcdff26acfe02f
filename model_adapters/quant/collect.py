"""Collect the K/V vectors a model caches over a token span (codebook training data)."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from model_adapters._checks import count
from model_adapters.models import cache_kwarg, kv_shape, max_positions

__all__ = ["collect_kv"]


@torch.no_grad()
def collect_kv(model, segments: list[list[int]], *, context: int = 1024, progress: bool = True):
    """Run the model over each segment in windows of ``context`` tokens and keep the cache.

    Keys are taken as the cache holds them (after RoPE for Qwen3), positions counted from the
    start of each window.

    Args:
        model: a GPT-2 or Qwen3 causal LM.
        segments: runs of token ids.
        context: tokens per forward pass, >= 1 (capped at the model's maximum positions).

    Returns:
        ``(keys, values)``: per layer, ``(n, kv_heads, head_dim)`` float32 on the CPU, n the total
        number of tokens.
    """
    context = min(count(context, "context", 1), max_positions(model))
    shape = kv_shape(model)
    device = next(model.parameters()).device
    chunks = [seg[i : i + context] for seg in segments for i in range(0, len(seg), context)]
    keys = [[] for _ in range(shape.num_layers)]
    values = [[] for _ in range(shape.num_layers)]
    kw = cache_kwarg(model)
    for chunk in tqdm(chunks, desc="collect K/V", unit="chunk", disable=not progress):
        # a plain exact cache: what the archiving cache holds before it quantizes anything
        cache = DynamicCache()
        model(torch.tensor([chunk], device=device), use_cache=True, **{kw: cache})
        for i, layer in enumerate(cache.layers):
            keys[i].append(layer.keys[0].transpose(0, 1).float().cpu())
            values[i].append(layer.values[0].transpose(0, 1).float().cpu())
    if not chunks:
        raise ValueError("no training tokens to collect K/V vectors from")
    return [torch.cat(k) for k in keys], [torch.cat(v) for v in values]
