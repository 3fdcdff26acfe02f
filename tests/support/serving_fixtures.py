"""Shared pieces of the serving tests: random codebooks, paired caches, a dense oracle."""

from __future__ import annotations

import pytest
from adapters_fixtures import TINY_MODELS, torch
from adapters_fixtures import random_quantizer as adapters_random_quantizer

from model_adapters.caches.archiving import ArchivingCache
from model_adapters.caches.codes_only import CodesOnlyCache, use_codes_attention
from model_adapters.models import cache_kwarg
from model_adapters.quant.quantizer import KVQuantizer


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run many small ops: one thread beats two, and does not fight other
    processes for the cores (with two threads these tests ran ten times slower on a busy VM)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def random_quantizer(model, key_stages=2, value_stages=2, k=16, seed=0) -> KVQuantizer:
    """:func:`adapters_fixtures.random_quantizer` with both sides quantized by default."""
    return adapters_random_quantizer(model, key_stages, value_stages, k, seed)


def model_pair(arch: str, dtype=torch.float32):
    """The same tiny model twice, both on the codes attention (which both caches need for
    multi-token forwards): one for the archiving cache, one for the codes-only cache."""
    ref = use_codes_attention(TINY_MODELS[arch]().to(dtype))
    codes = use_codes_attention(TINY_MODELS[arch]().to(dtype))
    return ref, codes


def step_logits(model, cache, ids: torch.Tensor, prefill: int, chunk: int = 1) -> torch.Tensor:
    """Logits of a prefill of ``prefill`` tokens, then chunks of ``chunk`` tokens."""
    kw = cache_kwarg(model)
    out = []
    with torch.no_grad():
        out.append(model(ids[:, :prefill], **{kw: cache}).logits)
        for t in range(prefill, ids.shape[1], chunk):
            out.append(model(ids[:, t : t + chunk], **{kw: cache}).logits)
    return torch.cat(out, 1)


def caches(ref, model, q, **window):
    return ArchivingCache(ref.config, q, **window), CodesOnlyCache(model, q, **window)


def dense_attention(query, keys, values, mask, scale):
    """Oracle: softmax(q k^T * scale + mask) v in float64, GQA by repeating kv heads.

    query ``(b, qh, q, d)``; keys/values ``(b, kvh, n, d)``; mask bool ``(b, 1, q, n)`` or None.
    """
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1)
    v = values.double().repeat_interleave(group, 1)
    scores = query.double() @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ v
