"""Rewinding the codes-only cache: crop then continue is a fresh run; refusals change nothing."""

from __future__ import annotations

import pytest
from adapters_fixtures import torch
from serving_fixtures import (
    model_pair,
    random_quantizer,
    step_logits,
)

from model_adapters.caches.archiving import ArchivingCache
from model_adapters.caches.code_rows import CodeRows
from model_adapters.caches.codes_only import CodesOnlyCache
from model_adapters.caches.window import archive_end, crop_target
from model_adapters.models import cache_kwarg

IDS = torch.randint(2, 100, (2, 44), generator=torch.Generator().manual_seed(7))
WINDOW = dict(sinks=2, recent=5, rewind=4)


def run(model, cache, upto, start=0, prefill=12, ids=IDS):
    """Feed ``ids[:, start:upto]`` (a prefill of ``prefill`` tokens first when start is 0)."""
    kw = cache_kwarg(model)
    out = []
    with torch.no_grad():
        first = start
        if start == 0:
            out.append(model(ids[:, :prefill], **{kw: cache}).logits)
            first = prefill
        for t in range(first, upto):
            out.append(model(ids[:, t : t + 1], **{kw: cache}).logits)
    return torch.cat(out, 1)


def snapshot(cache):
    state = []
    for layer in cache.layers:
        state.append((layer.length, layer.archived_end, layer.tail_start))
        state += [t.clone() for ts in layer.tensors().values() for t in ts]
    return state


def same(a, b):
    if len(a) != len(b):
        return False
    pairs = zip(a, b, strict=True)
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in pairs)


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
@pytest.mark.parametrize("back", [1, 4])
def test_crop_then_continue_equals_fresh_run(arch, back):
    _, model = model_pair(arch)
    q = random_quantizer(model)
    cropped = CodesOnlyCache(model, q, **WINDOW)
    run(model, cropped, 30)
    cropped.crop(-back)  # e.g. rejected draft tokens
    assert cropped.get_seq_length() == 30 - back
    fresh = CodesOnlyCache(model, q, **WINDOW)
    run(model, fresh, 30 - back)
    assert cropped.archived_tokens == fresh.archived_tokens == 30 - back - 7
    got = run(model, cropped, 44, start=30 - back)
    want = run(model, fresh, 44, start=30 - back)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
@pytest.mark.parametrize("back", [1, 3])
def test_grouped_crop_keeps_the_codes_below_the_window(arch, back):
    _, model = model_pair(arch)
    q = random_quantizer(model)
    cache = CodesOnlyCache(model, q, block=3, **WINDOW)
    run(model, cache, 30)
    before = [layer.dense(torch.float32) for layer in cache.layers]
    boundary = cache.archived_tokens
    cache.crop(-back)
    n = 30 - back
    kept = archive_end(n, 2, 5, 3) - 2  # a fresh run's boundary: whole groups of 3
    assert cache.get_seq_length() == n and cache.archived_tokens == kept <= boundary
    for layer, (k, v) in zip(cache.layers, before, strict=True):
        k2, v2 = layer.dense(torch.float32)
        assert k2.shape[2] == n
        assert torch.equal(k2[:, :, : 2 + kept], k[:, :, : 2 + kept])
        assert torch.equal(v2[:, :, : 2 + kept], v[:, :, : 2 + kept])
    # it continues, archiving in groups of at least 3 again
    counts = [cache.archived_tokens]
    for t in range(n, 44):
        run(model, cache, t + 1, start=t)
        counts.append(cache.archived_tokens)
    grown = [b - a for a, b in zip(counts, counts[1:], strict=False) if b != a]
    assert grown and all(g >= 3 for g in grown)


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_crop_into_the_sinks_then_continue(arch):
    _, model = model_pair(arch)
    q = random_quantizer(model)
    cache = CodesOnlyCache(model, q, sinks=6, recent=3, rewind=0)
    run(model, cache, 20, prefill=4)  # same chunks as the fresh run: bitwise comparable
    cache.crop(4)  # positive: keep the first 4 (all sinks, nothing archived any more)
    assert cache.get_seq_length() == 4 and cache.archived_tokens == 0
    fresh = CodesOnlyCache(model, q, sinks=6, recent=3, rewind=0)
    run(model, fresh, 4, prefill=4)
    got = run(model, cache, 30, start=4)
    want = run(model, fresh, 30, start=4)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_crop_takes_a_zero_dim_integer_tensor():
    # transformers 5.17's assisted decoding hands crop a 0-d tensor
    assert crop_target(torch.tensor(-1), 14) == 13
    assert crop_target(torch.tensor(9, dtype=torch.int32), 14) == 9
    for bad in (torch.tensor(-1.0), torch.tensor([1]), torch.tensor(True), 2.0):
        with pytest.raises(TypeError, match="crop takes an int"):
            crop_target(bad, 14)


def test_refused_crops_change_nothing():
    _, model = model_pair("qwen3")
    q = random_quantizer(model)
    cache = CodesOnlyCache(model, q, **WINDOW)
    twin = CodesOnlyCache(model, q, **WINDOW)
    run(model, cache, 30)
    run(model, twin, 30)
    before = snapshot(cache)
    # archived end is 25 and exact K/V is held from 21: the shortest legal length is 26
    with pytest.raises(ValueError, match="crop to at least 26"):
        cache.crop(-5)
    with pytest.raises(ValueError, match="holds only 30"):
        cache.crop(31)
    with pytest.raises(ValueError, match="cannot remove 31"):
        cache.crop(-31)
    with pytest.raises(TypeError, match="int"):
        cache.crop(2.0)
    cache.crop(0)
    assert same(snapshot(cache), before)
    # still the same computation as an untouched twin
    torch.testing.assert_close(
        run(model, cache, 36, start=30), run(model, twin, 36, start=30), rtol=0, atol=0
    )


def test_crop_refuses_to_take_back_collected_rows():
    _, model = model_pair("gpt2")
    q = random_quantizer(model)
    cache = CodesOnlyCache(model, q, **WINDOW, rows=CodeRows(2))
    one = IDS[:1]
    step_logits(model, cache, one[:, :20], 12)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="rows collector"):
        cache.crop(-2)
    assert same(snapshot(cache), before)
    short = CodesOnlyCache(model, q, **WINDOW, rows=CodeRows(2))
    step_logits(model, short, one[:, :6], 6)  # nothing archived yet: nothing to take back
    short.crop(-2)
    assert short.get_seq_length() == 4 and short.rows.emitted == 0


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
@pytest.mark.parametrize("back", [1, 2, 5])
def test_archiving_crop_then_continue_equals_fresh_run(arch, back):
    # the archiving cache once left positions that a fresh run holds exact as reconstructions
    ref, _ = model_pair(arch, torch.float64)
    q = random_quantizer(ref)
    cropped = ArchivingCache(ref, q, sinks=2, recent=5)
    run(ref, cropped, 30)
    cropped.crop(-back)
    fresh = ArchivingCache(ref, q, sinks=2, recent=5)
    run(ref, fresh, 30 - back)
    assert cropped.get_seq_length() == 30 - back
    got = run(ref, cropped, 44, start=30 - back)
    want = run(ref, fresh, 44, start=30 - back)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert cropped.archived_tokens == fresh.archived_tokens == 44 - 2 - 5


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_archiving_crop_after_a_beam_reorder(arch):
    # the exact copies a crop restores follow the batch order, like keys and values
    ref, _ = model_pair(arch, torch.float64)
    q = random_quantizer(ref)
    cache = ArchivingCache(ref, q, sinks=2, recent=5)
    run(ref, cache, 30)
    cache.reorder_cache(torch.tensor([1, 0]))
    cache.crop(-4)
    fresh = ArchivingCache(ref, q, sinks=2, recent=5)
    swapped = IDS.flip(0)
    run(ref, fresh, 26, ids=swapped)
    want = run(ref, fresh, 40, start=26, ids=swapped)
    got = run(ref, cache, 40, start=26, ids=swapped)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_archiving_crop_refusals_change_nothing():
    ref, _ = model_pair("qwen3", torch.float64)
    q = random_quantizer(ref)
    cache = ArchivingCache(ref, q, sinks=2, recent=5, rewind=5)
    run(ref, cache, 30)
    before = [(t.clone(), layer.archived_until) for layer in cache.layers for t in layer.keys]
    # archived up to 25, exact copies of [20, 25): a fresh run of keep tokens archives keep - 5
    with pytest.raises(ValueError, match=r"kept only from 20 \(rewind 5; crop to at least 25, "
                                         "or to at most 2"):
        cache.crop(-6)
    after = [(t.clone(), layer.archived_until) for layer in cache.layers for t in layer.keys]
    assert all(torch.equal(a, b) and x == y for (a, x), (b, y) in zip(before, after, strict=True))
    cache.crop(-5)  # the oldest legal length: 25 = 20 + 5
    assert cache.get_seq_length() == 25 and cache.archived_tokens == 25 - 7
    sinks = [layer.keys[..., :2, :].clone() for layer in cache.layers]
    cache.crop(2)  # into the sinks: nothing archived is left, nothing needs restoring
    assert cache.get_seq_length() == 2 and cache.archived_tokens == 0
    assert all(torch.equal(k, layer.keys) for k, layer in zip(sinks, cache.layers, strict=True))


def test_archiving_crop_refuses_to_take_back_collected_rows():
    ref, _ = model_pair("gpt2", torch.float64)
    q = random_quantizer(ref)
    cache = ArchivingCache(ref, q, sinks=2, recent=5, rows=CodeRows(2))
    step_logits(ref, cache, IDS[:1, :20], 12)
    assert not cache.is_croppable  # generate refuses an assistant up front
    for back in (1, 2):
        with pytest.raises(ValueError, match="rows collector .crop to at least 20"):
            cache.crop(-back)
    assert cache.get_seq_length() == 20 and cache.archived_tokens == 20 - 7
    assert cache.rows.emitted == 13
