"""Scoring retrieval items: teacher-forced (the model card's protocol) and by greedy decoding
through a cache under test, with bootstrap intervals.

Greedy decoding runs in three steps so that a method compressing after its prefill is measured
compressed: the haystack alone is prefilled through the cache (the method's prefill hooks
active), the question goes through as one more forward, then the answer is decoded one token at
a time. Positions are passed explicitly (``position_ids``), so a cache that dropped positions
still rotates the new ones by their true position. When the layers hold different numbers of
positions (PyramidKV), the question is fed one token at a time, because the attention mask of a
multi-token forward is built for the first layer's length.
"""

from __future__ import annotations

import re

import numpy as np
import torch

__all__ = ["answer_correct", "bootstrap_ci", "exact_prefill", "greedy_answer", "teacher_forced"]

_NUMBER = re.compile(r"\d+")


@torch.no_grad()
def teacher_forced(model, item, autocast: bool = True) -> bool:
    """Whether the argmax at every answer position is the answer token, given the whole
    sequence in one forward (bf16 autocast on CUDA when ``autocast``, as the training script
    measured)."""
    device = next(model.parameters()).device
    x = torch.tensor([item.ids], device=device)
    use = autocast and device.type == "cuda"
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use):
        logits = model(input_ids=x, use_cache=False).logits[0]
    start = len(item.context) + len(item.question)
    pred = logits[start - 1 : len(item.ids) - 1].argmax(-1)
    return bool(torch.equal(pred, x[0, start:]))


def answer_correct(text: str, answers) -> bool:
    """The first run of digits in ``text`` is one of ``answers`` (exact match)."""
    m = _NUMBER.search(text)
    return m is not None and m.group(0) in answers


def _forward(model, ids, positions, cache, kw):
    out = model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1,
                **{kw: cache})
    return out.logits[0, -1]


def _uneven(cache) -> bool:
    lengths = {layer.keys.shape[-2] for layer in cache.layers
               if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4}
    return len(lengths) > 1


@torch.no_grad()
def exact_prefill(model, context, keep: int = 256):
    """One exact prefill of ``context`` (token ids) shared by every method that compresses
    after its prefill. Returns ``(cache, captured)``: a ``DynamicCache`` and, per layer index,
    ``(hidden, cos, sin)`` for the last ``keep`` positions (the attention input and RoPE
    tables a press scores with)."""
    from transformers import DynamicCache

    from model_adapters.models import cache_kwarg
    from model_adapters.retrieval.presses import attention_modules

    device = next(model.parameters()).device
    captured = {}

    def hook(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs.get("position_embeddings", (None, None))
        captured[module.layer_idx] = (
            hidden[:, -keep:], None if cos is None else cos[:, -keep:],
            None if sin is None else sin[:, -keep:])

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True)
               for m in attention_modules(model)]
    cache = DynamicCache()
    try:
        n = len(context)
        _forward(model, torch.tensor([context], device=device),
                 torch.arange(n, device=device)[None], cache, cache_kwarg(model))
    finally:
        for h in handles:
            h.remove()
    return cache, captured


@torch.no_grad()
def greedy_answer(model, method, item, tokenizer, measure: bool = False, max_new_tokens=None,
                  shared=None):
    """Decode the answer to ``item`` through a fresh cache of ``method``.

    ``shared``: :func:`exact_prefill` of ``item.context``; a method with ``from_exact`` then
    builds its cache from it instead of running the prefill again (the same cache: such a
    method's prefill is exact).

    Returns ``(text, stored_bytes)``: the decoded text (stops after the number ends), and when
    ``measure`` the bytes the cache holds after the prefill (else None).
    """
    from model_adapters.models import cache_kwarg

    model = method.model if method.model is not None else model
    device = next(model.parameters()).device
    kw = cache_kwarg(model)
    n = len(item.context)
    if shared is not None and method.from_exact is not None:
        cache = method.from_exact(*shared)
    else:
        cache = method.new_cache(measure)
        ctx = torch.tensor([item.context], device=device)
        with method.prefill(cache):
            _forward(model, ctx, torch.arange(n, device=device)[None], cache, kw)
    stored = method.stored_bytes(cache, n) if measure else None
    q = torch.tensor([item.question], device=device)
    pos = torch.arange(n, n + q.shape[1], device=device)[None]
    if _uneven(cache):
        for i in range(q.shape[1]):
            logits = _forward(model, q[:, i : i + 1], pos[:, i : i + 1], cache, kw)
    else:
        logits = _forward(model, q, pos, cache, kw)
    nxt = n + q.shape[1]
    out: list[int] = []
    limit = max_new_tokens or len(item.answer) + 3
    for _ in range(limit):
        tok = int(logits.argmax())
        out.append(tok)
        text = tokenizer.decode(out).strip()
        first = _NUMBER.match(text)
        if text and (first is None or first.end() < len(text) or len(first.group(0)) > 7):
            break  # not a number, or the number has ended, or it is too long
        logits = _forward(model, torch.tensor([[tok]], device=device),
                          torch.tensor([[nxt]], device=device), cache, kw)
        nxt += 1
    return tokenizer.decode(out), stored


def bootstrap_ci(correct, samples: int = 2000, seed: int = 0, level: float = 0.95):
    """Percentile bootstrap interval ``(low, high)`` of the mean of 0/1 outcomes (None, None
    for no items)."""
    x = np.asarray(correct, dtype=np.float64)
    if x.size == 0:
        return None, None
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, (samples, x.size))].mean(1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)
