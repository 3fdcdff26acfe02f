"""Left padding: each sequence's window starts after its pads (its sinks are its first real
tokens, pads are never archived), so a padded prompt, alone or batched beside a longer one,
scores as the same prompt run unpadded: for any block, with a rows collector, through crops,
and (codes-only cache) with decode steps on the codes path with per-sequence lengths."""

from __future__ import annotations

import functools
import os

import pytest
from adapters_fixtures import TINY_MODELS, torch
from hypothesis import given, settings
from hypothesis import strategies as st
from serving_fixtures import model_pair, random_quantizer

import kernels
from model_adapters.caches.archiving import ArchivingCache
from model_adapters.caches.code_rows import CodeRows
from model_adapters.caches.codes_attention import lookup_attention
from model_adapters.caches.codes_only import CodesOnlyCache, CodesOnlyLayer
from model_adapters.caches.window import archive_end
from model_adapters.models import cache_kwarg, output_cache

G = torch.Generator().manual_seed(21)
LONG = torch.randint(2, 100, (1, 14), generator=G)
SHORT = torch.randint(2, 100, (1, 9), generator=G)
SETTINGS = dict(max_new_tokens=20, do_sample=False, pad_token_id=0, output_scores=True,
                return_dict_in_generate=True)
KINDS = pytest.mark.parametrize("kind", ["archiving", "codes_only"])
ARCHS = pytest.mark.parametrize("arch", ["gpt2", "qwen3"])


def setup(kind, arch, **window):
    ref, codes = model_pair(arch, torch.float64)
    q = random_quantizer(ref)
    window = dict(sinks=2, recent=4) | window
    if kind == "archiving":
        return ref, lambda **kw: ArchivingCache(ref, q, **window, **kw)
    return codes, lambda **kw: CodesOnlyCache(codes, q, **window, **kw)


def tolerance(kind):
    # codes-only decode steps read the codes by float32 look-ups
    return dict(rtol=1e-9, atol=1e-9) if kind == "archiving" else dict(rtol=2e-5, atol=2e-5)


def generate(model, cache, ids, pads, *, return_cache=False, **settings):
    """New tokens and scores (and the returned cache) of greedy decoding of ``ids``, whose
    rows carry ``pads`` leading pads."""
    mask = (torch.arange(ids.shape[1])[None] >= torch.tensor(pads)[:, None]).long()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **(SETTINGS | settings),
                             **{cache_kwarg(model): cache})
    got = out.sequences[:, ids.shape[1]:], torch.stack(out.scores, 1)
    return (*got, output_cache(out)) if return_cache else got


def left_pad(ids, n):
    return torch.cat([torch.zeros(1, n, dtype=torch.long), ids], 1)


@KINDS
@ARCHS
@pytest.mark.parametrize("block", [1, 3])
def test_padding_and_batching_leave_the_scores_alone(kind, arch, block):
    model, new_cache = setup(kind, arch, block=block)
    short_cache, long_cache = new_cache(), new_cache()
    short_tokens, short_scores = generate(model, short_cache, SHORT, [0])
    long_tokens, long_scores = generate(model, long_cache, LONG, [0])
    # the short prompt padded alone, then batched beside the longer one
    tokens, scores = generate(model, new_cache(), left_pad(SHORT, 3), [3])
    torch.testing.assert_close(scores, short_scores, **tolerance(kind))
    assert torch.equal(tokens, short_tokens)
    batch = torch.cat([left_pad(SHORT, 5), LONG])
    cache = new_cache()
    tokens, scores = generate(model, cache, batch, [5, 0])
    torch.testing.assert_close(scores[:1], short_scores, **tolerance(kind))
    torch.testing.assert_close(scores[1:], long_scores, **tolerance(kind))
    assert torch.equal(tokens, torch.cat([short_tokens, long_tokens]))
    # each sequence's archive is its own: counted in its real tokens, pads never archived
    alone = [short_cache.archived_tokens, long_cache.archived_tokens]
    assert cache.archived_per_sequence() == alone and alone[0] < alone[1]
    assert cache.archived_tokens == max(alone)


@KINDS
@ARCHS
def test_padded_batch_with_beams(kind, arch):
    # beams reorder the padding with the batch
    model, new_cache = setup(kind, arch, block=2)
    kw = cache_kwarg(model)
    batch = torch.cat([left_pad(SHORT, 5), LONG])
    mask = (torch.arange(14)[None] >= torch.tensor([[5], [0]])).long()
    with torch.no_grad():
        beams = model.generate(batch, attention_mask=mask, max_new_tokens=8, num_beams=2,
                               do_sample=False, pad_token_id=0, **{kw: new_cache()})
        alone = model.generate(SHORT, max_new_tokens=8, num_beams=2, do_sample=False,
                               pad_token_id=0, **{kw: new_cache()})
    assert torch.equal(beams[0, 14:], alone[0, 9:])


@KINDS
@ARCHS
def test_a_returned_padded_cache_continues_like_one_run(kind, arch):
    # a second generate on the cache the first returned: the padding stays each row's
    model, new_cache = setup(kind, arch, block=2)
    batch = torch.cat([left_pad(SHORT, 5), LONG])
    first = generate(model, new_cache(), batch, [5, 0], max_new_tokens=6, return_cache=True)
    more = torch.randint(2, 100, (2, 4), generator=torch.Generator().manual_seed(3))
    follow = torch.cat([batch, first[0], more], 1)
    again = generate(model, first[2], follow, [5, 0], max_new_tokens=6)
    fresh = generate(model, new_cache(), follow, [5, 0], max_new_tokens=6)
    torch.testing.assert_close(again[1], fresh[1], **tolerance(kind))
    assert torch.equal(again[0], fresh[0])


@KINDS
@ARCHS
def test_a_padded_sequence_archives_its_own_rows(kind, arch):
    # batch 1 with left padding and a rows collector: the rows are its real tokens' codes
    model, new_cache = setup(kind, arch, block=2)
    rows = [CodeRows(model.config.num_hidden_layers, keep=True) for _ in range(2)]
    _, want = generate(model, new_cache(rows=rows[0]), SHORT, [0])
    _, got = generate(model, new_cache(rows=rows[1]), left_pad(SHORT, 4), [4])
    torch.testing.assert_close(got, want, **tolerance(kind))
    assert rows[0].emitted > 0
    assert (rows[1].all_rows() == rows[0].all_rows()).all()


@KINDS
@ARCHS
def test_assisted_decoding_of_a_padded_prompt_returns_the_greedy_tokens(kind, arch):
    # a random Qwen3 drafts (as in test_cache_chunking): most drafts are rejected, so the
    # padded cache is cropped back inside its window between verify chunks
    model, new_cache = setup(kind, arch, block=2)
    assistant = TINY_MODELS["qwen3"](seed=5).to(torch.float64)
    want, _ = generate(model, new_cache(), SHORT, [0], max_new_tokens=32)
    cache = new_cache()
    cuts = []
    crop = cache.crop

    def logged(n):
        before = cache.get_seq_length()
        crop(n)
        cuts.append(before - cache.get_seq_length())

    cache.crop = logged
    got, _ = generate(model, cache, left_pad(SHORT, 4), [4], max_new_tokens=32,
                      assistant_model=assistant)
    assert torch.equal(got, want)
    assert max(cuts) > 0 and cache.archived_per_sequence()[0] > 0


def padded_forward(model, cache, ids, pads, start):
    """Forward of ``ids`` (the batch's positions ``start`` on) with the padding's mask and
    position ids, as generate passes them."""
    total = start + ids.shape[1]
    mask = (torch.arange(total)[None] >= torch.tensor(pads)[:, None]).long()
    positions = (mask.cumsum(1) - 1).clamp(min=0)[:, start:]
    with torch.no_grad():
        return model(ids, attention_mask=mask, position_ids=positions,
                     **{cache_kwarg(model): cache}).logits


def chunked_with_drafts(model, cache, batch, pads, chunks, drafts):
    """Feed ``batch`` in ``chunks`` of ``(size, rejected)``: each chunk carries ``rejected``
    draft tokens cropped away afterwards, as assisted decoding does. Returns the kept
    positions' logits and the length fed."""
    got, start = [], 0
    for size, rejected in chunks:
        ids = torch.cat([batch[:, start : start + size], drafts[:, :rejected]], 1)
        got.append(padded_forward(model, cache, ids, pads, start)[:, :size])
        if rejected:
            cache.crop(-rejected)
        start += size
    return torch.cat(got, 1), start


@KINDS
@ARCHS
@pytest.mark.parametrize("block", [1, 2])
def test_padded_chunks_and_crops_compute_each_sequence_alone(kind, arch, block):
    # chunks with rejected drafts cropped away, on a padded batch: each row's logits are those
    # of its sequence decoded alone token by token
    model, new_cache = setup(kind, arch, sinks=1, recent=3, block=block)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(2, 100, (1, n), generator=g) for n in (16, 23)]
    pads = [7, 0]
    batch = torch.cat([left_pad(seqs[0], 7), seqs[1]])
    wants = []
    for s in seqs:
        cache = new_cache()
        wants.append(torch.cat([padded_forward(model, cache, s[:, t : t + 1], [0], t)
                                for t in range(s.shape[1])], 1))
    cache = new_cache()
    drafts = torch.randint(2, 100, (2, 4), generator=g)
    got, start = chunked_with_drafts(model, cache, batch, pads,
                                     [(9, 0), (3, 4), (1, 2), (5, 0), (1, 0), (4, 3)], drafts)
    assert start == 23 and cache.get_seq_length() == 23
    torch.testing.assert_close(got[:1, 7:], wants[0], **tolerance(kind))
    torch.testing.assert_close(got[1:], wants[1], **tolerance(kind))


def test_padded_decode_steps_read_the_codes(monkeypatch):
    # after the prefill, no decode step rebuilds a dense layer: the look-ups read the codes
    model, new_cache = setup("codes_only", "qwen3", block=2)
    cache = new_cache()
    batch = torch.cat([left_pad(SHORT, 5), LONG])
    padded_forward(model, cache, batch, [5, 0], 0)
    dense = []
    original = CodesOnlyLayer.dense
    monkeypatch.setattr(CodesOnlyLayer, "dense",
                        lambda self, *a: (dense.append(self.layer_idx), original(self, *a))[1])
    for t in range(6):
        padded_forward(model, cache, torch.tensor([[3 + t], [4 + t]]), [5, 0], 14 + t)
    assert dense == [] and min(cache.archived_per_sequence()) > 0


@ARCHS
def test_padded_layer_keeps_the_kernels_contract(arch):
    # a padded layer's CodedCache (per-sequence lengths, valid entries first) gives, through the
    # kernel API's reference and the look-ups alike, what each sequence's own cache gives
    model, new_cache = setup("codes_only", arch, sinks=2, recent=3, block=3)
    seqs = [SHORT, LONG[:, :12]]
    cache = new_cache()
    padded_forward(model, cache, torch.cat([left_pad(SHORT, 3), seqs[1]]), [3, 0], 0)
    alone = []
    for s in seqs:
        alone.append(new_cache())
        padded_forward(model, alone[-1], s, [0], 0)
    q_heads, d = model.config.num_attention_heads, alone[0].layers[0].head_k.shape[-1]
    query = torch.randn(2, q_heads, d, generator=torch.Generator().manual_seed(1),
                        dtype=torch.float64)
    for li, layer in enumerate(cache.layers):
        coded = layer.coded_cache()
        assert coded.sink_lengths.tolist() == [2, 2]
        assert coded.archived_lengths.tolist() == [3, 6]  # 9 - 2 - 3 -> 3; 12 - 2 - 3 -> 6
        assert coded.recent_lengths.tolist() == [4, 4]
        via_kernel_api = kernels.decode_attention(query, coded, scale=0.25, backend="torch")
        via_lookups = lookup_attention(query[:, :, None], coded, scale=0.25)[:, :, 0]
        for b, own in enumerate(alone):
            want = kernels.decode_attention(query[b : b + 1], own.layers[li].coded_cache(),
                                            scale=0.25, backend="torch")
            torch.testing.assert_close(via_kernel_api[b : b + 1], want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(via_lookups[b : b + 1], want, rtol=1e-5, atol=1e-5)


def test_codes_only_refuses_padding_beside_an_archive():
    # an attached archive records one unpadded token stream: refused before any layer changes
    model, new_cache = setup("codes_only", "qwen3")
    cache = new_cache()
    cache.archive_hooks.append(object())
    with pytest.raises(ValueError, match=r"left-padded batch \(pads \[5, 0\]\) cannot run on a "
                                         r"codes-only cache with an attached archive"):
        generate(model, cache, torch.cat([left_pad(SHORT, 5), LONG]), [5, 0])
    assert all(not layer.is_initialized for layer in cache.layers)


def test_a_crop_into_the_padding_is_refused():
    model, new_cache = setup("codes_only", "gpt2")
    cache = new_cache()
    padded_forward(model, cache, torch.cat([left_pad(SHORT, 5), LONG]), [5, 0], 0)
    with pytest.raises(ValueError, match=r"pads \[5, 0\]\) would keep no token at 4 positions"):
        cache.crop(4)
    assert cache.get_seq_length() == 14
    cache.crop(0)
    assert cache.get_seq_length() == 14


N = 20  # batch positions (pads included)
ROWS = torch.randint(2, 100, (3, N), generator=torch.Generator().manual_seed(8))


@functools.cache
def alone(kind, arch, window, row, pad):
    """Token-by-token logits of row ``row``'s real tokens run alone, ``(1, N - pad, vocab)``."""
    model, new_cache = setup(kind, arch, **dict(window))
    cache, ids = new_cache(), ROWS[row : row + 1, pad:]
    return torch.cat([padded_forward(model, cache, ids[:, t : t + 1], [0], t)
                      for t in range(ids.shape[1])], 1)


@st.composite
def padded_chunkings(draw):
    """Left padding per row, then chunk sizes covering the N positions, the first holding a
    real token of every row (as generate's prompt does), each with rejected drafts after it."""
    pads = draw(st.lists(st.integers(0, 7), min_size=2, max_size=3))
    sizes, total = [], 0
    while total < N:
        low = max(pads) + 1 if not sizes else 1
        size = draw(st.integers(low, N - total))
        sizes.append((size, draw(st.sampled_from([0, 0, 1, 3, 8]))))
        total += size
    return pads, sizes


@settings(max_examples=2000 if os.environ.get("FKV_DEEP") else 20, deadline=None)
@given(
    kind=st.sampled_from(["archiving", "codes_only"]),
    arch=st.sampled_from(["gpt2", "qwen3"]),
    sinks=st.integers(0, 3),
    recent=st.integers(0, 5),
    block=st.sampled_from([1, 2, 3]),
    plan=padded_chunkings(),
)
def test_any_padding_and_chunking_computes_each_sequence_alone(kind, arch, sinks, recent,
                                                                block, plan):
    pads, chunks = plan
    window = dict(sinks=sinks, recent=recent, block=block)
    model, new_cache = setup(kind, arch, **window)
    batch = ROWS[: len(pads)].clone()
    for b, p in enumerate(pads):
        batch[b, :p] = 0
    drafts = torch.randint(2, 100, (len(pads), 8), generator=torch.Generator().manual_seed(9))
    cache = new_cache()
    got, start = chunked_with_drafts(model, cache, batch, pads, chunks, drafts)
    assert cache.archived_per_sequence() == [
        archive_end(N - p, sinks, recent, block) - sinks for p in pads]
    key = tuple(sorted(window.items()))
    for b, p in enumerate(pads):
        torch.testing.assert_close(got[b : b + 1, p:], alone(kind, arch, key, b, p),
                                   **tolerance(kind))
