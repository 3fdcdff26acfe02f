"""Chunk invariance, the caches' defining property: however a sequence is split into forward
calls (one prefill, token by token, random chunks, verify chunks whose rejected drafts are
cropped away), every query sees each earlier position as token-by-token decoding does, so the
logits agree with the token-by-token run (the oracle) to float64 rounding."""

from __future__ import annotations

import functools
import os

import pytest
from adapters_fixtures import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from serving_fixtures import model_pair, random_quantizer

from model_adapters.caches.archiving import ArchivingCache
from model_adapters.caches.codes_attention import Transit, transit_mask
from model_adapters.caches.codes_only import CodesOnlyCache
from model_adapters.caches.window import archive_end, shortest_crop
from model_adapters.models import cache_kwarg

DynamicCache = pytest.importorskip("transformers").DynamicCache
N = 36
IDS = torch.randint(2, 100, (2, N), generator=torch.Generator().manual_seed(11))
DRAFTS = torch.randint(2, 100, (2, 8), generator=torch.Generator().manual_seed(12))


@functools.cache
def models(arch: str):
    ref, codes = model_pair(arch, torch.float64)
    return ref, codes, random_quantizer(ref)


def build(kind: str, arch: str, **window):
    ref, codes, q = models(arch)
    if kind == "archiving":
        return ref, ArchivingCache(ref, q, **window)
    return codes, CodesOnlyCache(codes, q, **window)


def tolerance(kind: str) -> dict:
    """float64 rounding; the codes-only cache's single-token steps read the codes by float32
    look-ups (codes_attention.lookup_attention), so its oracle carries float32 rounding."""
    tol = 1e-9 if kind == "archiving" else 2e-5
    return dict(rtol=tol, atol=tol)


def forward(model, cache, ids):
    with torch.no_grad():
        return model(ids, **{cache_kwarg(model): cache}).logits


@functools.cache
def oracle(kind: str, arch: str, sinks: int, recent: int, block: int) -> torch.Tensor:
    """Logits of token-by-token decoding of all N tokens."""
    model, cache = build(kind, arch, sinks=sinks, recent=recent, block=block)
    return torch.cat([forward(model, cache, IDS[:, t : t + 1]) for t in range(N)], 1)


@st.composite
def chunkings(draw):
    """Chunk sizes covering a prefix of the N tokens, each with a number of rejected draft
    tokens fed after it in the same forward and then cropped away (0: a plain chunk)."""
    sizes, total = [], 0
    while total < N and (not sizes or draw(st.integers(0, 9))):
        size = draw(st.integers(1, N - total))
        sizes.append((size, draw(st.sampled_from([0, 0, 1, 3, 8]))))
        total += size
    return sizes


@settings(max_examples=2000 if os.environ.get("FKV_DEEP") else 25)
@given(
    kind=st.sampled_from(["archiving", "codes_only"]),
    arch=st.sampled_from(["gpt2", "qwen3"]),
    sinks=st.integers(0, 3),
    recent=st.integers(0, 6),
    block=st.sampled_from([1, 1, 2, 3, 16]),
    chunks=chunkings(),
)
def test_any_chunking_computes_token_by_token_logits(kind, arch, sinks, recent, block, chunks):
    model, cache = build(kind, arch, sinks=sinks, recent=recent, block=block)
    got, start = [], 0
    for size, drafts in chunks:
        ids = torch.cat([IDS[:, start : start + size], DRAFTS[:, :drafts]], 1)
        got.append(forward(model, cache, ids)[:, :size])
        if drafts:
            cache.crop(-drafts)  # a verify step: the rejected drafts leave
        start += size
        assert cache.get_seq_length() == start
        assert cache.archived_tokens == archive_end(start, sinks, recent, block) - sinks
    want = oracle(kind, arch, sinks, recent, block)[:, :start]
    torch.testing.assert_close(torch.cat(got, 1), want, **tolerance(kind))


@pytest.mark.parametrize("kind", ["archiving", "codes_only"])
@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_one_prefill_equals_token_by_token_decoding(kind, arch):
    model, cache = build(kind, arch, sinks=2, recent=4)
    prefill = forward(model, cache, IDS)
    want = oracle(kind, arch, 2, 4, 1)
    torch.testing.assert_close(prefill, want, **tolerance(kind))
    # the codes matter (equality is not that of two exact runs)
    exact = forward(model, DynamicCache(config=model.config), IDS)
    assert (exact - want).abs().max() > 1e-3


def test_transit_mask_is_the_rule_position_by_position():
    # slow oracle: for every query p and position j, which form p sees (window.archive_end)
    sinks, recent, block, start, q_len = 1, 2, 2, 5, 6
    kv = start + q_len
    lo = archive_end(start + 1, sinks, recent, block)
    hi = archive_end(kv, sinks, recent, block)
    t = Transit(lo, torch.zeros(1, 1, hi - lo, 4), torch.zeros(1, 1, hi - lo, 4),
                sinks, recent, block)
    causal = torch.arange(kv)[None] <= torch.arange(start, kv)[:, None]
    pad = causal.expand(2, 1, q_len, kv).clone()  # a model's mask: causal, and padding
    pad[1, ..., 0] = False  # a masked column stays masked in both forms
    for mask in (None, pad):
        got = transit_mask(mask, t, q_len, kv, "cpu")
        assert got.shape[-1] == kv + hi - lo
        for b in range(2 if mask is not None else 1):
            for i in range(q_len):
                p = start + i
                bound = archive_end(p + 1, sinks, recent, block)
                for j in range(kv):
                    coded = sinks <= j < hi  # the cache column's form after the update
                    sees_coded = sinks <= j < bound
                    visible = j <= p and coded == sees_coded and (mask is None or mask[b, 0, i, j])
                    assert bool(got[b if mask is not None else 0, 0, i, j]) == visible
                for j in range(lo, hi):
                    visible = bound <= j <= p and (mask is None or mask[b, 0, i, j])
                    assert bool(got[b if mask is not None else 0, 0, i, kv + j - lo]) == visible


def test_window_rules():
    for sinks, recent, block in [(0, 0, 1), (2, 3, 1), (1, 4, 3), (4, 0, 2)]:
        ends = [archive_end(n, sinks, recent, block) for n in range(40)]
        assert ends == sorted(ends) and all(e >= sinks for e in ends)
        assert all((e - sinks) % block == 0 for e in ends)
        assert all(n - e >= min(recent, n - sinks) or e == sinks for n, e in enumerate(ends))
        for end in range(sinks, 30):
            shortest = shortest_crop(end, sinks, recent, block)
            assert archive_end(shortest, sinks, recent, block) >= end
            assert shortest == 0 or archive_end(shortest - 1, sinks, recent, block) < end


def first_divergence_is_a_near_tie(want, got) -> bool:
    """Token equality where greedy's top-2 margin exceeds 1e-4 (tiny random models have
    near-tied logits): sequences equal, or the first differing token was a near tie."""
    a, b = want.sequences[0], got.sequences[0]
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    if len(diff) == 0:
        return len(a) == len(b)
    step = int(diff[0]) - (len(a) - len(want.scores))
    top = want.scores[step][0].topk(2).values
    return float(top[0] - top[1]) < 1e-4


@pytest.mark.parametrize("kind", ["archiving", "codes_only"])
@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
@pytest.mark.parametrize("drafter", ["draft", "self"])
def test_assisted_decoding_returns_the_greedy_tokens(kind, arch, drafter):
    from adapters_fixtures import TINY_MODELS

    model, _ = build(kind, arch)
    # a random Qwen3 (same vocabulary) drafts for both: tiny random GPT-2s, with tied
    # embeddings, all tend to repeat the last token, so one would agree with the other
    assistant = TINY_MODELS["qwen3"](seed=5).to(torch.float64) if drafter == "draft" else model
    prompt = IDS[:1, :10]
    settings = dict(max_new_tokens=64, do_sample=False, pad_token_id=0, output_scores=True,
                    return_dict_in_generate=True)
    kw = cache_kwarg(model)
    with torch.no_grad():
        want = model.generate(prompt, **settings, **{kw: build(kind, arch, sinks=2, recent=5)[1]})
        cache = build(kind, arch, sinks=2, recent=5)[1]
        crops = []
        crop = cache.crop
        cache.crop = lambda n: (crops.append(n), crop(n))[1]
        got = model.generate(prompt, assistant_model=assistant, **settings, **{kw: cache})
    assert cache.archived_tokens > 0
    assert first_divergence_is_a_near_tie(want, got)
    if drafter == "draft":  # a random draft is mostly rejected: the verify chunks were cropped
        assert any(n < 0 for n in crops), crops
