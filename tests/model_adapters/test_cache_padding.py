"""Left padding: each sequence's window starts after its pads (its sinks are its first real
tokens, pads are never archived), so a padded prompt, alone or batched beside a longer one,
scores as the same prompt run unpadded."""

from __future__ import annotations

import pytest
from adapters_fixtures import torch
from serving_fixtures import model_pair, random_quantizer

from model_adapters.caches.archiving import ArchivingCache
from model_adapters.caches.codes_only import CodesOnlyCache
from model_adapters.models import cache_kwarg

G = torch.Generator().manual_seed(21)
LONG = torch.randint(2, 100, (1, 14), generator=G)
SHORT = torch.randint(2, 100, (1, 9), generator=G)
SETTINGS = dict(max_new_tokens=20, do_sample=False, pad_token_id=0, output_scores=True,
                return_dict_in_generate=True)


def setup(kind, arch, **window):
    ref, codes = model_pair(arch, torch.float64)
    q = random_quantizer(ref)
    if kind == "archiving":
        return ref, lambda: ArchivingCache(ref, q, sinks=2, recent=4, **window)
    return codes, lambda: CodesOnlyCache(codes, q, sinks=2, recent=4, **window)


def generate(model, cache, ids, pads):
    mask = (torch.arange(ids.shape[1])[None] >= torch.tensor(pads)[:, None]).long()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **SETTINGS, **{cache_kwarg(model): cache})
    return out.sequences[:, ids.shape[1]:], torch.stack(out.scores, 1)


def left_pad(ids, n):
    return torch.cat([torch.zeros(1, n, dtype=torch.long), ids], 1)


@pytest.mark.parametrize("kind", ["archiving", "codes_only"])
@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_padding_and_batching_leave_the_scores_alone(kind, arch):
    model, new_cache = setup(kind, arch)
    tol = dict(rtol=1e-9, atol=1e-9) if kind == "archiving" else dict(rtol=2e-5, atol=2e-5)
    short_tokens, short_scores = generate(model, new_cache(), SHORT, [0])
    long_tokens, long_scores = generate(model, new_cache(), LONG, [0])
    # the short prompt padded alone, then batched beside the longer one
    tokens, scores = generate(model, new_cache(), left_pad(SHORT, 3), [3])
    torch.testing.assert_close(scores, short_scores, **tol)
    assert torch.equal(tokens, short_tokens)
    batch = torch.cat([left_pad(SHORT, 5), LONG])
    cache = new_cache()
    tokens, scores = generate(model, cache, batch, [5, 0])
    assert cache.archived_tokens > 0
    torch.testing.assert_close(scores[:1], short_scores, **tol)
    torch.testing.assert_close(scores[1:], long_scores, **tol)
    assert torch.equal(tokens, torch.cat([short_tokens, long_tokens]))


@pytest.mark.parametrize("kind", ["archiving", "codes_only"])
@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_padded_batch_with_beams(kind, arch):
    # beams reorder the padding with the batch
    model, new_cache = setup(kind, arch)
    kw = cache_kwarg(model)
    batch = torch.cat([left_pad(SHORT, 5), LONG])
    mask = (torch.arange(14)[None] >= torch.tensor([[5], [0]])).long()
    with torch.no_grad():
        beams = model.generate(batch, attention_mask=mask, max_new_tokens=8, num_beams=2,
                               do_sample=False, pad_token_id=0, **{kw: new_cache()})
        alone = model.generate(SHORT, max_new_tokens=8, num_beams=2, do_sample=False,
                               pad_token_id=0, **{kw: new_cache()})
    assert torch.equal(beams[0, 14:], alone[0, 9:])


def test_codes_only_refuses_padding_it_cannot_lay_out():
    model, new_cache = setup("codes_only", "qwen3", block=2)
    cache = new_cache()
    with pytest.raises(ValueError, match=r"pads \[5, 0\]\) needs block=1"):
        generate(model, cache, torch.cat([left_pad(SHORT, 5), LONG]), [5, 0])
    assert all(not layer.is_initialized for layer in cache.layers)
