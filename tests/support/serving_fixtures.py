"""Shared pieces of the serving tests: random codebooks, paired caches, a dense oracle."""

from __future__ import annotations

import pytest
from adapters_fixtures import TINY_MODELS, torch
from adapters_fixtures import random_quantizer as adapters_random_quantizer

from model_adapters.caches.archiving import ArchivingCache
from model_adapters.caches.codes_only import CodesOnlyCache, use_codes_attention
from model_adapters.models import cache_kwarg
from model_adapters.quant.quantizer import KVQuantizer
from model_adapters.store import serving_archive


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


# -- serving archives ---------------------------------------------------------------------
WINDOW = dict(sinks=2, recent=5, rewind=3)
IDS = torch.randint(2, 100, (1, 40), generator=torch.Generator().manual_seed(11))


def feed(model, target, ids, prefill=10):
    """Prefill, then one token at a time; ``target`` is a ServingArchive or a bare cache."""
    out = []
    for t in [0, *range(prefill, ids.shape[1])]:
        chunk = ids[:, t : (prefill if t == 0 else t + 1)]
        if isinstance(target, CodesOnlyCache):
            with torch.no_grad():
                out.append(model(chunk, **{cache_kwarg(model): target}).logits)
        else:
            out.append(target.forward(model, chunk).logits)
    return torch.cat(out, 1)


def written(tmp_path, arch, n):
    """A tiny model, its codebooks and an archive of ``IDS[:, :n]`` (closed, checkpointed)."""
    model = use_codes_attention(TINY_MODELS[arch]())
    q = random_quantizer(model)
    path = tmp_path / f"{arch}-{n}.fkv"
    with serving_archive.create(path, model, q, **WINDOW) as sa:
        feed(model, sa, IDS[:, :n])
        assert sa.cache.archived_tokens == len(sa.codes) == n - 7
    return model, q, path
