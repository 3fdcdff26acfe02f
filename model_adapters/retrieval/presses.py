"""KV-cache presses: drop cached positions after the prefill, as kvpress does (its 0.5 releases).

A press scores every cached position of a layer once that layer's attention has run over the
prefill (a forward hook on the attention module), then keeps the ``budget`` best-scoring
positions of each KV head and drops the rest. The prefill itself attends to everything; only
what comes after it (the question, the answer) sees the pruned cache. Positions keep the RoPE
rotation they were cached with, so later tokens must be given their true ``position_ids``.

Scorers (higher = kept), each on one layer's exact keys ``(batch, kv_heads, n, head_dim)``:

- ``streamingllm``: the first ``sinks`` positions and the most recent ones (StreamingLLM).
- ``knorm``: the keys of smallest L2 norm (the key-norm press).
- ``snapkv``: attention the prefill's last ``window`` queries pay to each key, averaged over the
  window and the query heads of the group, smoothed by a width-``kernel`` average pool; the
  window itself is always kept (SnapKV).
- ``pyramidkv``: SnapKV's scores with a budget falling linearly from the first layer to the last
  (same mean budget as the other presses; PyramidKV's ``beta``, kvpress's budget rule).
"""

from __future__ import annotations

import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = [
    "PRESSES", "Press", "attention_modules", "layer_budgets", "press_cache", "prune_layer",
    "pressing",
]

PRESSES = ("streamingllm", "knorm", "snapkv", "pyramidkv")


@dataclass(frozen=True)
class Press:
    """One press: ``kind`` in :data:`PRESSES`, ``ratio`` the fraction of positions dropped
    (kvpress's ``compression_ratio``, in [0, 1)).

    Attributes:
        sinks: leading positions StreamingLLM keeps.
        window: the SnapKV observation window (last prefill queries), always kept.
        kernel: SnapKV's pooling width (odd).
        beta: PyramidKV's ratio of the first layer's budget excess to the last one's.
    """

    kind: str
    ratio: float
    sinks: int = 4
    window: int = 64
    kernel: int = 5
    beta: float = 20.0

    def __post_init__(self):
        if self.kind not in PRESSES:
            raise ValueError(f"press {self.kind!r} is not one of {PRESSES}")
        if not 0.0 <= self.ratio < 1.0:
            raise ValueError(f"press ratio {self.ratio!r} must be in [0, 1)")


def layer_budgets(press: Press, n: int, num_layers: int) -> list[int]:
    """Positions kept per layer for a prefill of ``n``: ``int(n * (1 - ratio))`` (truncated, as
    kvpress does) in every layer; for ``pyramidkv`` PyramidKV's linear ramp with the same mean:
    ``m = n * (1 - ratio)``, the last layer keeps ``m / beta``, the first ``2m - m / beta``
    (capped at ``n - window``, the last then raised to keep the mean), falling back to the flat
    ``round(n * (1 - ratio))`` when the ramp leaves ``[window, n]``."""
    keep = max(1, int(n * (1.0 - press.ratio)))
    if press.kind != "pyramidkv":
        return [min(n, keep)] * num_layers
    mean = n * (1.0 - press.ratio)
    low = mean / press.beta
    high = 2 * mean - low
    if high >= n - press.window:
        high = n - press.window
        low = 2 * mean - high
    if not n >= high >= low >= press.window:
        return [max(1, round(n * (1.0 - press.ratio)))] * num_layers
    step = (high - low) / (num_layers - 1) if num_layers > 1 else 0.0
    return [round(high - i * step) for i in range(num_layers)]


def _snapkv_scores(module, hidden, cos, sin, keys, press: Press) -> torch.Tensor:
    """SnapKV scores ``(batch, kv_heads, n)`` from the layer's attention input ``hidden``
    ``(batch, n, hidden)``, the RoPE tables ``cos``/``sin`` ``(batch, n, head_dim)`` and the
    exact cached ``keys``."""
    if not hasattr(module, "q_proj"):
        raise ValueError(
            f"{press.kind} needs a q_proj attention (Qwen3-style); {type(module).__name__} has none"
        )
    b, kv, n, d = keys.shape
    w = min(press.window, n)
    q = module.q_proj(hidden[:, -w:]).view(b, w, -1, d)
    if hasattr(module, "q_norm"):
        q = module.q_norm(q)
    q = q.transpose(1, 2)
    rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
    q, _ = rope(q, q, cos[:, -w:], sin[:, -w:])
    groups = q.shape[1] // kv
    k = keys.repeat_interleave(groups, dim=1).to(q.dtype)
    logits = (q @ k.transpose(-1, -2)).float() / math.sqrt(d)  # (b, heads, w, n)
    qpos = torch.arange(n - w, n, device=keys.device)[:, None]
    logits = logits.masked_fill(torch.arange(n, device=keys.device)[None, :] > qpos, -math.inf)
    attn = logits.softmax(-1)[..., : n - w].mean(-2)  # (b, heads, n - w)
    if n - w > 0 and press.kernel > 1:
        attn = torch.nn.functional.avg_pool1d(
            attn.reshape(-1, 1, n - w), press.kernel, stride=1, padding=press.kernel // 2
        ).reshape(b, -1, n - w)
    attn = attn.view(b, kv, groups, n - w).mean(2)
    top = attn.amax() + 1.0 if attn.numel() else torch.tensor(1.0, device=keys.device)
    return torch.cat([attn, top.expand(b, kv, w)], dim=-1)


def scores(press: Press, module, hidden, cos, sin, keys) -> torch.Tensor:
    """``(batch, kv_heads, n)`` float scores of one layer's cached positions (higher: kept)."""
    b, kv, n, _ = keys.shape
    if press.kind == "streamingllm":
        pos = torch.arange(n, device=keys.device, dtype=torch.float32)
        s = torch.where(pos < press.sinks, float(n) + pos, pos)  # sinks first, then the newest
        return s.expand(b, kv, n)
    if press.kind == "knorm":
        return -keys.float().norm(dim=-1)
    return _snapkv_scores(module, hidden, cos, sin, keys, press)


def prune_layer(layer, score: torch.Tensor, budget: int) -> None:
    """Keep the ``budget`` best-scoring positions of each KV head of a ``DynamicLayer``
    (in their cached order); ties go to the earlier position."""
    n = layer.keys.shape[-2]
    if budget >= n:
        return
    idx = score.topk(budget, dim=-1, sorted=False).indices.sort(-1).values
    idx = idx[..., None].expand(-1, -1, -1, layer.keys.shape[-1])
    layer.keys = layer.keys.gather(2, idx)
    layer.values = layer.values.gather(2, idx)


def attention_modules(model) -> list:
    """The model's attention modules, in layer order (each has ``layer_idx``)."""
    mods = [m for _, m in model.named_modules() if hasattr(m, "layer_idx")
            and type(m).__name__.endswith("Attention")]
    if not mods:
        raise ValueError(f"no attention modules with a layer_idx in {type(model).__name__}")
    return sorted(mods, key=lambda m: m.layer_idx)


@contextmanager
def pressing(model, press: Press, cache):
    """While active, each attention layer's forward prunes ``cache``'s layer right after it ran
    (one multi-token forward: the prefill). Hooks are removed on exit, errors included."""
    mods = attention_modules(model)

    def hook(module, args, kwargs, output):
        layer = cache.layers[module.layer_idx]
        keys = layer.keys
        n = keys.shape[-2]
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs.get("position_embeddings", (None, None))
        budget = layer_budgets(press, n, len(mods))[module.layer_idx]
        with torch.no_grad():
            prune_layer(layer, scores(press, module, hidden, cos, sin, keys), budget)
        return output

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in mods]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def press_cache(model, press: Press, exact, captured) -> object:
    """The cache :func:`pressing` leaves after a prefill, built from that prefill's exact cache
    ``exact`` (left unchanged) and ``captured``: per layer ``(hidden, cos, sin)``, the attention
    input and RoPE tables of the prefill's last positions (at least ``press.window``)."""
    from transformers import DynamicCache

    mods = attention_modules(model)
    cache = DynamicCache()
    n = exact.layers[0].keys.shape[-2]
    for module in mods:
        src = exact.layers[module.layer_idx]
        cache.update(src.keys.clone(), src.values.clone(), module.layer_idx)
        hidden, cos, sin = captured[module.layer_idx]
        budget = layer_budgets(press, n, len(mods))[module.layer_idx]
        with torch.no_grad():
            score = scores(press, module, hidden, cos, sin, src.keys)
            prune_layer(cache.layers[module.layer_idx], score, budget)
    return cache
