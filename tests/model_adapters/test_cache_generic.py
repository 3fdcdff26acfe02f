"""transformers' generic Cache behaviours, run against both caches with DynamicCache as the
control: every test compares a cache with itself (padded against unpadded, cropped against
fresh, continued against one run, copied against the original), so the control passing shows
what transformers promises and the caches keeping the same promise is the test. Tiny random
models in float64: MHA (GPT-2), GQA and MQA (Qwen3)."""

from __future__ import annotations

import copy
import functools
import pickle

import pytest
from adapters_fixtures import TINY_MODELS, torch, transformers
from serving_fixtures import random_quantizer

from model_adapters.caches.archiving import ArchivingCache
from model_adapters.caches.codes_attention import use_codes_attention
from model_adapters.caches.codes_only import CodesOnlyCache
from model_adapters.models import cache_kwarg, output_cache

KINDS = ["dynamic", "archiving", "codes_only"]
ARCHS = ["gpt2", "qwen3", "qwen3-mqa"]
G = torch.Generator().manual_seed(31)
PROMPT = torch.randint(2, 100, (1, 12), generator=G)
OTHER = torch.randint(2, 100, (1, 7), generator=G)


@functools.cache
def model(arch: str):
    if arch == "qwen3-mqa":
        torch.manual_seed(0)
        cfg = transformers.Qwen3Config(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
            head_dim=16, intermediate_size=128, vocab_size=101, max_position_embeddings=256,
            bos_token_id=0, eos_token_id=1)
        m = transformers.Qwen3ForCausalLM(cfg).eval()
    else:
        m = TINY_MODELS[arch]()
    return use_codes_attention(m.to(torch.float64))


def new_cache(kind: str, arch: str):
    m = model(arch)
    if kind == "dynamic":
        return transformers.DynamicCache(config=m.config)
    q = random_quantizer(m)
    cls = ArchivingCache if kind == "archiving" else CodesOnlyCache
    return cls(m, q, sinks=2, recent=4)


def tol(kind: str) -> dict:
    t = 2e-5 if kind == "codes_only" else 1e-9  # codes-only decode steps: float32 look-ups
    return dict(rtol=t, atol=t)


def generate(kind, arch, ids, cache=None, mask=None, **settings):
    m = model(arch)
    settings = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, output_scores=True,
                    return_dict_in_generate=True) | settings
    cache = new_cache(kind, arch) if cache is None else cache
    with torch.no_grad():
        return m.generate(ids, attention_mask=mask, **settings, **{cache_kwarg(m): cache})


def forward(kind, arch, cache, ids):
    m = model(arch)
    with torch.no_grad():
        return m(ids, **{cache_kwarg(m): cache}).logits


parametrize = pytest.mark.parametrize("kind,arch", [(k, a) for k in KINDS for a in ARCHS])


@parametrize
def test_lengths_and_mask_sizes(kind, arch):
    cache = new_cache(kind, arch)
    forward(kind, arch, cache, PROMPT)
    assert cache.get_seq_length() == 12
    assert cache.get_mask_sizes(3, 0) == (15, 0)
    forward(kind, arch, cache, OTHER[:, :1])
    assert cache.get_seq_length() == 13 and cache.get_mask_sizes(1, 0) == (14, 0)
    if kind != "dynamic":
        assert cache.archived_tokens == 13 - 2 - 4


@parametrize
def test_extra_left_padding_changes_nothing(kind, arch):
    plain = generate(kind, arch, PROMPT)
    padded = torch.cat([torch.zeros(1, 6, dtype=torch.long), PROMPT], 1)
    mask = (torch.arange(18) >= 6).long()[None]
    got = generate(kind, arch, padded, mask=mask)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(plain.scores), **tol(kind))
    assert torch.equal(got.sequences[:, 18:], plain.sequences[:, 12:])


@parametrize
def test_batched_generation_equals_each_prompt_alone(kind, arch):
    alone = [generate(kind, arch, p) for p in (PROMPT, OTHER)]
    batch = torch.cat([PROMPT, torch.cat([torch.zeros(1, 5, dtype=torch.long), OTHER], 1)])
    mask = torch.ones_like(batch)
    mask[1, :5] = 0
    got = generate(kind, arch, batch, mask=mask)
    for row, one in enumerate(alone):
        n = len(one.scores)  # a prompt alone may stop early at its end-of-sequence token
        scores = torch.stack(got.scores[:n])[:, row]
        torch.testing.assert_close(scores, torch.stack(one.scores)[:, 0], **tol(kind))


@parametrize
def test_beams_and_several_returned_sequences(kind, arch):
    out = generate(kind, arch, PROMPT, num_beams=3, num_return_sequences=2, max_new_tokens=10)
    assert out.sequences.shape == (2, 22)
    assert any(len(set(b.tolist())) > 1 for b in out.beam_indices)  # reorder_cache was used


@parametrize
def test_sampling_with_several_returned_sequences(kind, arch):
    torch.manual_seed(5)
    out = generate(kind, arch, PROMPT, do_sample=True, num_return_sequences=3, max_new_tokens=8)
    assert out.sequences.shape == (3, 20)


@parametrize
def test_a_returned_cache_continues_like_one_run(kind, arch):
    first = generate(kind, arch, PROMPT, max_new_tokens=6)
    cache = output_cache(first)
    follow = torch.cat([first.sequences, OTHER], 1)
    again = generate(kind, arch, follow, cache=cache, max_new_tokens=6)
    fresh = generate(kind, arch, follow, max_new_tokens=6)
    torch.testing.assert_close(torch.stack(again.scores), torch.stack(fresh.scores), **tol(kind))


@parametrize
def test_crop_then_continue_equals_a_fresh_run(kind, arch):
    ids = torch.cat([PROMPT, OTHER], 1)
    cropped = new_cache(kind, arch)
    forward(kind, arch, cropped, ids)
    cropped.crop(-5)
    fresh = new_cache(kind, arch)
    forward(kind, arch, fresh, ids[:, :14])
    more = torch.randint(2, 100, (1, 6), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(forward(kind, arch, cropped, more),
                               forward(kind, arch, fresh, more), **tol(kind))


@parametrize
def test_batch_select_repeat_and_reorder(kind, arch):
    ids = torch.cat([PROMPT, PROMPT.flip(1)])
    base = new_cache(kind, arch)
    forward(kind, arch, base, ids)
    step = torch.tensor([[5], [6]])
    a = copy.deepcopy(base)
    a.reorder_cache(torch.tensor([1, 0]))
    torch.testing.assert_close(forward(kind, arch, a, step.flip(0)),
                               forward(kind, arch, copy.deepcopy(base), step).flip(0), **tol(kind))
    b = copy.deepcopy(base)
    b.batch_select_indices(torch.tensor([1]))
    torch.testing.assert_close(forward(kind, arch, b, step[1:]),
                               forward(kind, arch, copy.deepcopy(base), step)[1:], **tol(kind))
    c = copy.deepcopy(base)
    c.batch_repeat_interleave(2)
    got = forward(kind, arch, c, step.repeat_interleave(2, 0))
    want = forward(kind, arch, copy.deepcopy(base), step).repeat_interleave(2, 0)
    torch.testing.assert_close(got, want, **tol(kind))


@parametrize
def test_pickled_cache_continues_like_the_original(kind, arch):
    cache = new_cache(kind, arch)
    forward(kind, arch, cache, PROMPT)
    clone = pickle.loads(pickle.dumps(cache))
    torch.testing.assert_close(forward(kind, arch, clone, OTHER), forward(kind, arch, cache, OTHER),
                               rtol=0, atol=0)
