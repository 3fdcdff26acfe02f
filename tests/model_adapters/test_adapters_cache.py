"""The archiving cache on tiny random GPT-2 and Qwen3 models."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from adapters_fixtures import TINY_MODELS, random_quantizer, torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model_adapters.caches.archiving import ArchivingCache
from model_adapters.caches.code_rows import CodeRows
from model_adapters.caches.codes_attention import use_codes_attention
from model_adapters.models import cache_kwarg, config_fingerprint, kv_shape, output_cache

DynamicCache = pytest.importorskip("transformers").DynamicCache


def _hand_quantize(x: torch.Tensor, books: torch.Tensor):
    """Residual VQ of one (head_dim,) vector with (stages, k, head_dim) books, by explicit loops."""
    residual = x.clone()
    recon = torch.zeros_like(x)
    codes = []
    for stage in books:
        dists = [float(((residual - c) ** 2).sum()) for c in stage]
        j = min(range(len(dists)), key=lambda i: (dists[i], i))
        codes.append(j)
        residual = residual - stage[j]
        recon = recon + stage[j]
    return codes, recon


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_full_window_reproduces_dynamic_cache_forward(arch):
    model = TINY_MODELS[arch]()
    kw = cache_kwarg(model)
    ids = torch.randint(2, 100, (2, 24), generator=torch.Generator().manual_seed(1))
    q = random_quantizer(model)  # present, but the window covers everything
    with torch.no_grad():
        ref_cache, arc_cache = (
            DynamicCache(config=model.config),
            ArchivingCache(model, q, sinks=4, recent=64),
        )
        ref = [model(ids[:, :10], **{kw: ref_cache}).logits]
        got = [model(ids[:, :10], **{kw: arc_cache}).logits]
        for t in range(10, 24):  # then token by token
            ref.append(model(ids[:, t : t + 1], **{kw: ref_cache}).logits)
            got.append(model(ids[:, t : t + 1], **{kw: arc_cache}).logits)
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    assert arc_cache.archived_tokens == 0
    assert arc_cache.reconstruction_nmse() == {"keys": None, "values": None}
    assert arc_cache.get_seq_length() == 24


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_full_window_reproduces_dynamic_cache_generate(arch):
    model = TINY_MODELS[arch]()
    kw = cache_kwarg(model)
    ids = torch.randint(2, 100, (1, 12), generator=torch.Generator().manual_seed(2))
    rows = CodeRows(kv_shape(model).num_layers, keep=True)
    cache = ArchivingCache(model, random_quantizer(model), sinks=4, recent=40, rows=rows)
    with torch.no_grad():
        settings = dict(
            max_new_tokens=20,
            min_new_tokens=20,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
        ref = model.generate(ids, **settings, **{kw: DynamicCache(config=model.config)})
        got = model.generate(ids, **settings, **{kw: cache})
    assert torch.equal(ref.sequences, got.sequences)
    for a, b in zip(ref.scores, got.scores, strict=True):
        assert torch.equal(a, b)
    assert rows.emitted == 0


@pytest.mark.parametrize("block", [1, 4])
@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_quantized_logits_match_hand_reference(arch, block):
    model = TINY_MODELS[arch]()
    kw = cache_kwarg(model)
    shape = kv_shape(model)
    sinks, recent, n = 3, 5, 26
    q = random_quantizer(model, key_stages=2, value_stages=1, seed=4)
    ids = torch.randint(2, 100, (1, n), generator=torch.Generator().manual_seed(3))
    rows = CodeRows(shape.num_layers, keep=True)
    cache = ArchivingCache(
        model, q, sinks=sinks, recent=recent, rows=rows, track_error=True, block=block
    )
    ref_cache = DynamicCache(config=model.config)
    hand_codes = {}  # position -> row, built column by column in the documented order
    originals = {
        "keys": [[] for _ in range(shape.num_layers)],
        "values": [[] for _ in range(shape.num_layers)],
    }
    sq_err = {"keys": 0.0, "values": 0.0}
    replaced = sinks
    with torch.no_grad():
        for t in range(n):
            # the step that brings the cache to t + 1 positions ages out [sinks, t + 1 - recent)
            upto = t + 1 - recent
            if upto - replaced < block:  # positions leave the window in groups of `block`
                upto = replaced
            for p in range(replaced, max(upto, replaced)):
                row = []
                for li, layer in enumerate(ref_cache.layers):
                    for h in range(shape.kv_heads):
                        kx, vx = layer.keys[0, h, p].clone(), layer.values[0, h, p].clone()
                        kc, kr = _hand_quantize(kx, q.key_codebooks[li, h])
                        vc, vr = _hand_quantize(vx, q.value_codebooks[li, h])
                        originals["keys"][li].append(kx.double())
                        originals["values"][li].append(vx.double())
                        sq_err["keys"] += float(((kr.double() - kx.double()) ** 2).sum())
                        sq_err["values"] += float(((vr.double() - vx.double()) ** 2).sum())
                        layer.keys[0, h, p] = kr
                        layer.values[0, h, p] = vr
                        row += kc + vc
                hand_codes[p] = row
            replaced = max(replaced, upto)
            want = model(ids[:, t : t + 1], **{kw: ref_cache}).logits
            got = model(ids[:, t : t + 1], **{kw: cache}).logits
            # the newest position is never aged out in the same step (recent >= 1), so the
            # reference can replace positions before the step that needs them replaced
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    produced = rows.all_rows()
    # error over variance around each layer's mean vector, all layers pooled
    for side in ("keys", "values"):
        var = sum(
            float(((torch.stack(xs) - torch.stack(xs).mean(0)) ** 2).sum())
            for xs in originals[side]
        )
        assert cache.reconstruction_nmse()[side] == pytest.approx(sq_err[side] / var, rel=1e-6)
    end = sinks + (n - recent - sinks) // block * block  # the last group is still exact
    assert replaced == end
    assert produced.shape == (end - sinks, q.row_width)
    want_rows = np.array([hand_codes[p] for p in range(sinks, end)])
    np.testing.assert_array_equal(produced, want_rows)
    assert cache.archived_tokens == end - sinks
    # what the archive would hold decodes back to what the cache attends to
    kcodes, vcodes = q.rows_to_codes(produced)
    for li in range(shape.num_layers):
        k, v = q.decode(li, torch.from_numpy(kcodes[li])[None], torch.from_numpy(vcodes[li])[None])
        torch.testing.assert_close(k[0], cache.layers[li].keys[0, :, sinks:end], rtol=0, atol=0)
        torch.testing.assert_close(v[0], cache.layers[li].values[0, :, sinks:end], rtol=0, atol=0)


def test_keys_only_keeps_values_exact():
    model = TINY_MODELS["gpt2"]()
    kw = cache_kwarg(model)
    q = random_quantizer(model, key_stages=1, value_stages=0)
    ids = torch.randint(2, 100, (1, 20), generator=torch.Generator().manual_seed(5))
    exact, arc = (
        DynamicCache(config=model.config),
        ArchivingCache(model, q, sinks=2, recent=4, track_error=True),
    )
    with torch.no_grad():
        for t in range(20):
            model(ids[:, t : t + 1], **{kw: exact})
            model(ids[:, t : t + 1], **{kw: arc})
    # layer 0 sees the same inputs either way (later layers see outputs of quantized attention)
    le, la = exact.layers[0], arc.layers[0]
    assert torch.equal(le.values, la.values)
    assert not torch.equal(le.keys[..., 2:16, :], la.keys[..., 2:16, :])
    assert torch.equal(le.keys[..., 16:, :], la.keys[..., 16:, :])  # recent window exact
    assert torch.equal(le.keys[..., :2, :], la.keys[..., :2, :])  # sinks exact
    nmse = arc.reconstruction_nmse()
    assert nmse["values"] == 0.0 and nmse["keys"] > 0.0


def test_prefill_archives_what_token_by_token_decoding_would():
    model = TINY_MODELS["qwen3"]()
    kw = cache_kwarg(model)
    q = random_quantizer(model)
    # on plain SDPA a prefill that archives cannot show its early queries exact positions
    failed = ArchivingCache(model, q, sinks=4, recent=8)
    with pytest.raises(RuntimeError, match="use_codes_attention"), torch.no_grad():
        model(torch.arange(2, 32)[None], **{kw: failed})
    use_codes_attention(model)
    # the failed pass updated layer 0 only: the cache refuses to go on rather than mix positions
    with pytest.raises(RuntimeError, match=r"out of step .*positions per layer \[30, 0\]"), \
            torch.no_grad():
        model(torch.arange(2, 4)[None], **{kw: failed})
    rows = CodeRows(2, keep=True)
    cache = ArchivingCache(model, q, sinks=4, recent=8, rows=rows)
    with torch.no_grad():
        out = model(torch.arange(2, 32)[None], **{kw: cache})
    assert output_cache(out) is cache
    assert cache.archived_tokens == 30 - 4 - 8 and rows.emitted == 18


def test_archiving_needs_batch_one():
    model = TINY_MODELS["gpt2"]()
    cache = ArchivingCache(
        model, random_quantizer(model), sinks=1, recent=2, rows=CodeRows(2, keep=True)
    )
    with pytest.raises(ValueError, match="batch size 1"), torch.no_grad():
        model(torch.ones(2, 8, dtype=torch.long), **{cache_kwarg(model): cache})


def test_crop_refuses_archived_positions():
    model = use_codes_attention(TINY_MODELS["gpt2"]())
    cache = ArchivingCache(model, random_quantizer(model), sinks=1, recent=2, rewind=2)
    with torch.no_grad():
        model(torch.ones(1, 8, dtype=torch.long), **{cache_kwarg(model): cache})
    # archived [1, 6), exact copies of [4, 6): a fresh run of n tokens archives [1, n - 2)
    with pytest.raises(ValueError, match="already archived"):
        cache.crop(3)
    cache.crop(0)  # transformers calls this itself: nothing to do
    cache.crop(8)  # keep all 8
    assert cache.get_seq_length() == 8
    cache.crop(7)  # keep the first 7 (the older convention)...
    cache.crop(-1)  # ...or drop the last one
    assert cache.get_seq_length() == 6 and cache.layers[0].keys.shape[2] == 6
    assert cache.archived_tokens == 3
    with pytest.raises(ValueError, match="already archived"):
        cache.crop(-1)
    # past the start or beyond the length: refused like the codes-only cache (no clamping)
    with pytest.raises(ValueError, match="holds only 6"):
        cache.crop(-7)
    with pytest.raises(ValueError, match="holds only 6"):
        cache.crop(9)
    with pytest.raises(TypeError, match="int"):
        cache.crop(2.0)
    assert cache.get_seq_length() == 6


def test_cache_rejects_bad_arguments():
    gpt2, qwen3 = TINY_MODELS["gpt2"](), TINY_MODELS["qwen3"]()
    with pytest.raises(ValueError, match="recent must be a non-negative int, got -1"):
        ArchivingCache(gpt2, None, recent=-1)
    with pytest.raises(ValueError, match="block must be a positive int, got 0"):
        ArchivingCache(gpt2, None, block=0)
    with pytest.raises(ValueError, match="quantizer was built for"):
        ArchivingCache(qwen3, random_quantizer(gpt2))
    bert = pytest.importorskip("transformers").BertConfig()
    with pytest.raises(ValueError, match="model_type 'bert' is not supported"):
        ArchivingCache(bert)


def test_shapes_and_fingerprints():
    gpt2, qwen3 = TINY_MODELS["gpt2"](), TINY_MODELS["qwen3"]()
    g, q = kv_shape(gpt2), kv_shape(qwen3)
    assert (g.num_layers, g.kv_heads, g.head_dim, g.rope) == (2, 4, 16, False)
    assert (q.num_layers, q.kv_heads, q.head_dim, q.rope) == (2, 2, 16, True)
    assert g.fp16_bytes_per_token == 2 * 4 * 16 * 2 * 2
    assert config_fingerprint(gpt2) == config_fingerprint(TINY_MODELS["gpt2"](seed=9))
    assert config_fingerprint(gpt2) != config_fingerprint(TINY_MODELS["gpt2"](vocab_size=102))
    assert config_fingerprint(gpt2) != config_fingerprint(qwen3)


def test_rope_scaling_changes_the_fingerprint_and_plain_rope_keeps_the_old_one():
    import hashlib
    import json
    from dataclasses import asdict

    cfg = TINY_MODELS["qwen3"]().config
    scaled = type(cfg)(**{**cfg.to_dict(), "rope_parameters": {
        "rope_type": "linear", "factor": 4.0, "rope_theta": cfg.rope_parameters["rope_theta"]}})
    assert config_fingerprint(scaled) != config_fingerprint(cfg)
    # archives written before scaling counted store this (rope_theta only) fingerprint
    ident = {"hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_attention_heads,
             "vocab_size": cfg.vocab_size, "rope_theta": cfg.rope_parameters["rope_theta"]}
    blob = json.dumps({**asdict(kv_shape(cfg)), **ident}, sort_keys=True).encode()
    assert config_fingerprint(cfg) == hashlib.sha256(blob).hexdigest()


_OPS = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(1, 70)),
    st.tuples(st.just("crop"), st.integers(1, 20)),
    st.tuples(st.just("reorder"), st.permutations([0, 1])),
    st.tuples(st.just("copy"), st.just(0)),
), max_size=12)


@settings(max_examples=60, deadline=None)
@given(ops=_OPS, seed=st.integers(0, 2**31 - 1))
def test_layer_appends_in_place_as_dynamic_layer_concatenates(ops, seed):
    """The archiving layer's in-place append (buffers with room) against DynamicLayer's
    concatenation, through crops, batch reorders and deep copies: the same keys and values at
    every step, and what was handed out before stays as it was unless the layer changed it."""
    from transformers.cache_utils import DynamicLayer

    from model_adapters.caches.archiving import ArchivingLayer

    g = torch.Generator().manual_seed(seed)
    ours, ref = ArchivingLayer(0, None, 0, 0, None), DynamicLayer()
    handed = []
    for op, arg in ops:
        n = ref.get_seq_length()
        if op == "append":
            k, v = torch.randn(2, 3, arg, 4, generator=g), torch.randn(2, 3, arg, 4, generator=g)
            got, want = ours.update(k, v), ref.update(k, v)
            handed.append((got, [t.clone() for t in got]))
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        elif op == "crop" and n:
            ours.crop(-min(arg, n))
            ref.crop(-min(arg, n))
            handed.clear()  # positions past a crop are rewritten by the next append
        elif op == "reorder" and n:
            ours.reorder_cache(torch.tensor(arg))
            ref.reorder_cache(torch.tensor(arg))
        elif op == "copy":
            roomy = ours._room is not None
            ours = copy.deepcopy(ours)
            if roomy:  # the copy holds the positions, not the buffers' spare room
                assert ours._room is None
                assert ours.keys.untyped_storage().nbytes() == ours.keys.nbytes
        assert ours.get_seq_length() == ref.get_seq_length()
        if ref.get_seq_length():
            assert torch.equal(ours.keys, ref.keys) and torch.equal(ours.values, ref.values)
        for got, snapshot in handed:
            assert all(torch.equal(a, b) for a, b in zip(got, snapshot, strict=True))
