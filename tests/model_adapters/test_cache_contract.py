"""Both caches keep transformers' Cache contract: no partial tensors, no half-updated steps,
copies that share the codebooks."""

from __future__ import annotations

import copy
import gc
import os
import pickle

import pytest
from adapters_fixtures import TINY_MODELS, torch
from serving_fixtures import model_pair, random_quantizer, step_logits

from model_adapters.caches.archiving import ArchivingCache
from model_adapters.caches.code_rows import CodeRows
from model_adapters.caches.codes_attention import use_codes_attention
from model_adapters.caches.codes_only import CodesOnlyCache, NoDenseKeysError
from model_adapters.models import cache_kwarg
from model_adapters.quant import quantizer as quantizer_module
from model_adapters.quant.rvq import decode

IDS = torch.randint(2, 100, (2, 30), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_codes_only_layer_has_no_partial_keys(arch):
    ref, model = model_pair(arch, torch.float64)
    cache = CodesOnlyCache(model, random_quantizer(ref), sinks=2, recent=5, rewind=3)
    step_logits(model, cache, IDS, 12)
    for layer in cache.layers:
        with pytest.raises(NoDenseKeysError, match=r"layer\.dense\(\)"):
            layer.keys  # noqa: B018 (the read is the test)
        with pytest.raises(NoDenseKeysError, match="30 positions"):
            layer.values  # noqa: B018
        with pytest.raises(NoDenseKeysError):
            layer.keys = torch.zeros(1)
        k, v = layer.dense()
        assert k.shape[-2] == v.shape[-2] == cache.get_seq_length() == 30
    # transformers' own paths (mask sizes, seq length, crop, reorder) keep working without them
    cache.crop(-2)
    cache.reorder_cache(torch.tensor([1, 0]))
    assert cache.get_mask_sizes(1, 0) == (29, 0)
    with torch.no_grad():
        model(IDS[:, 28:29], **{cache_kwarg(model): cache})
    assert cache.get_seq_length() == 29


def lengths(cache):
    return [layer.get_seq_length() for layer in cache.layers]


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_archiving_rows_refuse_a_batch_before_any_layer_changes(arch):
    ref, _ = model_pair(arch)
    cache = ArchivingCache(ref, random_quantizer(ref), sinks=1, recent=2, rows=CodeRows(2))
    kw = cache_kwarg(ref)
    with pytest.raises(ValueError, match="batch size 1"), torch.no_grad():
        ref(IDS[:, :8], **{kw: cache})  # archives in every layer: once failed in layer 0 only
    assert lengths(cache) == [0, 0]
    with torch.no_grad():
        ref(IDS[:1, :8], **{kw: cache})
    with pytest.raises(ValueError, match="got batch 3"):
        cache.batch_repeat_interleave(3)  # num_return_sequences after a prefill
    with pytest.raises(ValueError, match="batch size 1"), torch.no_grad():
        ref(IDS[:, 8:9], **{kw: cache})
    assert lengths(cache) == [8, 8] and cache.rows.emitted == 5
    with pytest.raises(ValueError, match="batch size 1"), torch.no_grad():
        ref.generate(IDS[:1, :8], max_new_tokens=3, num_beams=2, do_sample=False,
                     pad_token_id=0, **{kw: ArchivingCache(ref, random_quantizer(ref), sinks=1,
                                                            recent=2, rows=CodeRows(2))})
    # without codebooks nothing is archived, so nothing is collected: any batch runs
    exact = ArchivingCache(ref, None, sinks=1, recent=2, rows=CodeRows(2))
    with torch.no_grad():
        ref(IDS[:, :8], **{kw: exact})
    assert lengths(exact) == [8, 8]


def test_codes_only_rows_refuse_a_batch_before_any_layer_changes():
    _, model = model_pair("gpt2")
    kw = cache_kwarg(model)

    def new():
        return CodesOnlyCache(model, random_quantizer(model), sinks=1, recent=2, rows=CodeRows(2))

    cache = new()
    with pytest.raises(ValueError, match="batch size 1"), torch.no_grad():
        model(IDS[:, :8], **{kw: cache})
    assert lengths(cache) == [0, 0]
    with torch.no_grad():
        model(IDS[:1, :8], **{kw: cache})
    with pytest.raises(ValueError, match="got batch 3"):
        cache.batch_repeat_interleave(3)  # num_return_sequences after a prefill
    assert lengths(cache) == [8, 8] and cache.layers[0].tail_k.shape[0] == 1
    for settings in (dict(num_beams=2), dict(num_return_sequences=2, do_sample=True)):
        fresh = new()
        with pytest.raises(ValueError, match="batch size 1"), torch.no_grad():
            model.generate(IDS[:1, :8], max_new_tokens=3, pad_token_id=0, **settings,
                           **{kw: fresh})
        assert fresh.rows.emitted == 0 and lengths(fresh) == [0, 0]


@pytest.mark.parametrize("kind", ["archiving", "codes_only"])
def test_copies_share_the_codebooks_and_compute_the_same(kind):
    ref, model = model_pair("qwen3", torch.float64)
    q = random_quantizer(ref)
    if kind == "archiving":
        model, cache = ref, ArchivingCache(ref, q, sinks=2, recent=5)
    else:
        cache = CodesOnlyCache(model, q, sinks=2, recent=5)
    step_logits(model, cache, IDS[:, :20], 12)
    a, b = copy.deepcopy(cache), copy.deepcopy(cache)
    for c in (a, b):
        assert c.quantizer is q
        assert c.quantizer.key_codebooks.data_ptr() == q.key_codebooks.data_ptr()
        assert all(la.quantizer is q for la in c.layers) if kind == "archiving" else True
    # the K/V and codes are the copies' own: running one leaves the other and the source alone
    got_a = step_logits(model, a, IDS[:, 20:], 1)
    assert cache.get_seq_length() == b.get_seq_length() == 20
    got_b = step_logits(model, b, IDS[:, 20:], 1)
    want = step_logits(model, cache, IDS[:, 20:], 1)
    torch.testing.assert_close(got_a, want, rtol=0, atol=0)
    torch.testing.assert_close(got_b, want, rtol=0, atol=0)


COMPILED = [(k, p, n) for k in ("archiving", "codes_only") for p in (False, True) for n in (1, 4)
            if k == "codes_only" or os.environ.get("FKV_DEEP") or (p, n) in ((False, 1), (True, 4))]


@pytest.mark.parametrize("kind,padded,n", COMPILED)
def test_decode_steps_and_chunks_compile_as_one_graph(kind, padded, n):
    # fullgraph=True fails on any graph break (a host read such as .item() or int(tensor) in
    # the caches, the attention function or rvq.decode: once 20 per 4-token chunk); the
    # chunk archives positions inside it (a transit) and the compiled step computes as eager
    ref, model = model_pair("qwen3")
    q = random_quantizer(model)
    if kind == "archiving":
        model, cache = ref, ArchivingCache(ref, q, sinks=2, recent=4, block=2)
    else:
        cache = CodesOnlyCache(model, q, sinks=2, recent=4, block=2)
    kw = cache_kwarg(model)
    mask = torch.ones(2, 20 + n, dtype=torch.long)
    mask[0, : 5 if padded else 0] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)

    def step(ids, cache):
        end = cache.get_seq_length() + ids.shape[1]
        return model(ids, attention_mask=mask[:, :end], position_ids=positions[:, end - n : end],
                     **{kw: cache}).logits

    with torch.no_grad():
        model(IDS[:, :20], attention_mask=mask[:, :20], position_ids=positions[:, :20],
              **{kw: cache})
        assert cache.archived_per_sequence() == ([8, 14] if padded else [14, 14])
        eager = copy.deepcopy(cache)
        want = step(IDS[:, 20 : 20 + n], eager)
        torch._dynamo.reset()
        got = torch.compile(step, fullgraph=True, backend="eager")(IDS[:, 20 : 20 + n], cache)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert cache.get_seq_length() == eager.get_seq_length() == 20 + n
    assert cache.archived_per_sequence() == eager.archived_per_sequence()


def test_codes_from_outside_are_checked_where_they_enter():
    _, model = model_pair("gpt2")
    cache = CodesOnlyCache(model, random_quantizer(model), sinks=2, recent=4)
    layer = cache.layers[0]
    exact = torch.zeros(1, 4, 2, 16)
    bad = torch.full((1, 4, 3, 2), 16, dtype=torch.uint8)  # 16 codewords: 16 is out of range
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 16\), got range \[16, 16\]"):
        layer.load_state((exact, exact), (bad, bad), (exact, exact), length=7, tail_start=5)
    assert not layer.is_initialized
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 16\)"):
        decode(bad, cache.quantizer.key_codebooks[0])  # untrusted callers keep the check


def cache_of(kind, q):
    ref, model = model_pair("qwen3", torch.float64)
    if kind == "archiving":
        return ref, ArchivingCache(ref, q, sinks=2, recent=5)
    return model, CodesOnlyCache(model, q, sinks=2, recent=5)


@pytest.mark.parametrize("kind", ["archiving", "codes_only"])
def test_pickles_hold_the_codebooks_once_and_load_shared(kind):
    q = random_quantizer(model_pair("qwen3")[0], k=256)  # codebooks large beside the K/V
    model, cache = cache_of(kind, q)
    step_logits(model, cache, IDS[:, :20], 12)
    books = q.key_codebooks.nbytes + q.value_codebooks.nbytes
    one = len(pickle.dumps(cache))
    assert books < one < 1.5 * books  # codebooks once, not the encoder's tables (as large)
    # two caches in one pickle: the second adds its own K/V and codes, not the codebooks
    assert len(pickle.dumps([cache, copy.deepcopy(cache)])) - one <= one - books
    # copies unpickled from separate pickles are on the live quantizer's storage
    a, b = (pickle.loads(pickle.dumps(c)) for c in (cache, copy.deepcopy(cache)))
    assert a.quantizer is b.quantizer is q
    if kind == "archiving":
        assert all(layer.quantizer is q for c in (a, b) for layer in c.layers)
    want = step_logits(model, cache, IDS[:, 20:], 1)
    torch.testing.assert_close(step_logits(model, a, IDS[:, 20:], 1), want, rtol=0, atol=0)


def test_pickles_loaded_without_the_original_share_one_rebuilt_quantizer():
    model, cache = cache_of("codes_only", random_quantizer(model_pair("qwen3")[0], seed=7))
    step_logits(model, cache, IDS[:, :20], 12)
    want = step_logits(model, copy.deepcopy(cache), IDS[:, 20:], 1)
    data = pickle.dumps(cache)
    key = cache.quantizer.content_key()
    del cache
    gc.collect()
    assert key not in quantizer_module._LIVE  # nothing left of the original
    a, b = pickle.loads(data), pickle.loads(data)
    assert a.quantizer is b.quantizer and a.quantizer.content_key() == key
    assert a.quantizer.key_codebooks.data_ptr() == b.quantizer.key_codebooks.data_ptr()
    torch.testing.assert_close(step_logits(model, a, IDS[:, 20:], 1), want, rtol=0, atol=0)


def test_a_deep_copy_of_a_quantizer_alone_is_its_own():
    q = random_quantizer(model_pair("gpt2")[0])
    c = copy.deepcopy(q)
    assert c is not q and c.key_codebooks.data_ptr() != q.key_codebooks.data_ptr()
    assert c.content_key() == q.content_key()
    torch.testing.assert_close(c.value_codebooks, q.value_codebooks, rtol=0, atol=0)


def test_a_rows_sink_that_cannot_be_called_is_refused_when_built():
    with pytest.raises(TypeError, match="sink must be a callable .* got int 5"):
        CodeRows(2, sink=5)


@pytest.mark.parametrize("make", ["archiving", "codes-only"])
def test_a_cache_built_for_another_model_is_refused_by_name(make):
    gpt2 = use_codes_attention(TINY_MODELS["gpt2"]())
    qwen3 = use_codes_attention(TINY_MODELS["qwen3"]())
    q = random_quantizer(gpt2)
    cls = ArchivingCache if make == "archiving" else CodesOnlyCache
    cache = cls(gpt2, q, sinks=1, recent=2)
    with pytest.raises(ValueError, match="built for a model of .* but layer 0 hands it"), \
            torch.no_grad():
        qwen3(IDS[:1, :6], **{cache_kwarg(qwen3): cache})
    assert cache.get_seq_length() == 0  # refused before anything changed
    with torch.no_grad():  # and it still serves its own model
        gpt2(IDS[:1, :6], **{cache_kwarg(gpt2): cache})
    assert cache.get_seq_length() == 6
