"""The codes-only cache on an fkvstore archive: resume, crop, search, rehydrate, refusals."""

from __future__ import annotations

import pytest
from adapters_fixtures import TINY_MODELS, torch
from serving_fixtures import IDS, WINDOW, feed, random_quantizer, written

from model_adapters.caches.codes_only import CodesOnlyCache, use_codes_attention
from model_adapters.models import cache_kwarg, model_identity
from model_adapters.store import serving_archive


def state(ar_path):
    import fkvstore

    with fkvstore.open(ar_path, "r") as ar:
        return {k: ar.attrs[k] for k in ar.attrs}, {n: len(ar[n]) for n in ar}


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_resume_continues_with_the_live_caches_logits(arch, tmp_path):
    model, q, path = written(tmp_path, arch, 30)
    live = CodesOnlyCache(model, q, **WINDOW)  # the same computation, never interrupted
    want = feed(model, live, IDS)[:, 30:]
    resumed = serving_archive.resume(path, model)
    assert (resumed.token_ids() == IDS[0, :30].numpy()).all()
    assert resumed.cache.get_seq_length() == 30 and resumed.cache.archived_tokens == 23
    got = torch.cat([resumed.forward(model, IDS[:, t : t + 1]).logits for t in range(30, 40)], 1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    resumed.close()
    assert state(path)[1] == {"codes": 33, "tokens": 40}


def test_resume_keeps_the_grouping(tmp_path):
    model = use_codes_attention(TINY_MODELS["gpt2"]())
    q = random_quantizer(model)
    path = tmp_path / "grouped.fkv"
    with serving_archive.create(path, model, q, block=4, **WINDOW) as sa:
        feed(model, sa, IDS[:, :30])
        # 3 positions past the window after the prefill wait; groups of 4 leave it at
        # lengths 11, 15, ..., 27
        assert sa.cache.archived_tokens == len(sa.codes) == 20
    live = CodesOnlyCache(model, q, block=4, **WINDOW)
    want = feed(model, live, IDS)[:, 30:]
    resumed = serving_archive.resume(path, model)
    assert resumed.cache.block == 4
    got = torch.cat([resumed.forward(model, IDS[:, t : t + 1]).logits for t in range(30, 40)], 1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert resumed.cache.archived_tokens == live.archived_tokens == 32  # at 31, 35, 39
    resumed.close()


def test_archives_without_the_grouping_attribute_resume_ungrouped(tmp_path):
    import fkvstore

    model, q, path = written(tmp_path, "gpt2", 20)
    with fkvstore.open(path, "r+") as ar:  # as checkpoints wrote them before the option
        del ar.attrs["serving_block"]
    resumed = serving_archive.resume(path, model)
    assert resumed.cache.block == 1 and resumed.cache.archived_tokens == 13
    resumed.close()


def test_resume_generates_like_the_live_cache(tmp_path):
    model, q, path = written(tmp_path, "qwen3", 20)
    live = CodesOnlyCache(model, q, **WINDOW)
    feed(model, live, IDS[:, :20])
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(IDS[:, :21], attention_mask=torch.ones(1, 21, dtype=torch.long),
                              **{cache_kwarg(model): live}, **settings)
    with serving_archive.resume(path, model) as sa:
        got = sa.generate(model, IDS[:, 20:21], **settings)
        assert torch.equal(got, want)
        assert len(sa.tokens) == sa.cache.get_seq_length() == 32


def test_rows_after_the_last_checkpoint_are_dropped(tmp_path):
    model = use_codes_attention(TINY_MODELS["gpt2"]())
    q = random_quantizer(model)
    path = tmp_path / "crash.fkv"
    sa = serving_archive.create(path, model, q, **WINDOW)
    feed(model, sa, IDS[:, :25])
    sa.checkpoint()
    for t in range(25, 31):  # more tokens reach the archive, but no checkpoint follows
        sa.forward(model, IDS[:, t : t + 1])
    sa.archive.close()  # as a killed process would leave it (rows committed, no checkpoint)
    assert state(path)[1] == {"codes": 24, "tokens": 31}
    live = CodesOnlyCache(model, q, **WINDOW)
    want = feed(model, live, IDS[:, :26])[:, -1]
    with serving_archive.resume(path, model) as sa:
        assert sa.cache.get_seq_length() == 25
        torch.testing.assert_close(sa.forward(model, IDS[:, 25:26]).logits[:, -1], want)
    assert state(path)[1] == {"codes": 19, "tokens": 26}


def test_crop_truncates_cache_and_archive_together(tmp_path):
    model = use_codes_attention(TINY_MODELS["qwen3"]())
    q = random_quantizer(model)
    path = tmp_path / "crop.fkv"
    with serving_archive.create(path, model, q, **WINDOW) as sa:
        feed(model, sa, IDS[:, :30])
        before = (dict(sa.archive.attrs), len(sa.codes), len(sa.tokens))
        with pytest.raises(ValueError, match="crop to at least"):
            sa.cache.crop(-4)  # past the rewind margin of 3
        assert (dict(sa.archive.attrs), len(sa.codes), len(sa.tokens)) == before
        sa.cache.crop(-3)
        assert (len(sa.codes), len(sa.tokens)) == (20, 27)
        assert sa.cache.archived_tokens == 20
        got = torch.cat([sa.forward(model, IDS[:, t : t + 1]).logits for t in range(27, 34)], 1)
    fresh = CodesOnlyCache(model, q, **WINDOW)
    want = feed(model, fresh, IDS[:, :34])[:, 27:]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with serving_archive.resume(path, model, mode="r") as sa:
        assert (sa.token_ids() == IDS[0, :34].numpy()).all()
        with pytest.raises(ValueError, match="read-only"):
            sa.cache.crop(-1)
        assert sa.cache.get_seq_length() == 34
        with pytest.raises(ValueError, match="read-only"):
            sa.forward(model, IDS[:, 34:35])


def test_find_and_rehydrate_return_the_reconstructions(tmp_path):
    model = use_codes_attention(TINY_MODELS["gpt2"]())
    q = random_quantizer(model)
    phrase = [7, 8, 9]
    ids = IDS.clone()
    for at in (3, 17, 33):  # one in the sinks/archive boundary zone, one archived, one recent
        ids[0, at : at + 3] = torch.tensor(phrase)
    ids[0, ids[0] == 7] = 6  # no other 7 anywhere...
    for at in (3, 17, 33):
        ids[0, at] = 7  # ...except where the phrase starts
    path = tmp_path / "find.fkv"
    with serving_archive.create(path, model, q, **WINDOW) as sa:
        feed(model, sa, ids)
        hits = sa.find(phrase)
        assert hits.tolist() == [5, 19, 35]
        assert sa.find([7, 8, 9, 7]).size == 0
        positions = [0, 1, 5, 19, 30, 35, 39]
        keys, values = sa.rehydrate(positions)
        for li, layer in enumerate(sa.cache.layers):
            dk, dv = layer.dense(torch.float32)
            assert torch.equal(keys[li], dk[0][:, positions])
            assert torch.equal(values[li], dv[0][:, positions])
        with pytest.raises(IndexError, match="outside"):
            sa.rehydrate([40])
    with serving_archive.resume(path, model, mode="r") as sa:  # also from disk alone
        assert sa.find(phrase).tolist() == [5, 19, 35]
        k2, v2 = sa.rehydrate(positions)
        assert torch.equal(k2, keys) and torch.equal(v2, values)


def test_find_text_with_a_tokenizer(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = "the time traveller held in his hand a glittering metallic framework".split()
    vocab = {w: i + 2 for i, w in enumerate(sorted(set(words)))} | {"[UNK]": 1}
    raw = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    model = use_codes_attention(TINY_MODELS["qwen3"]())
    text = "the time traveller held in his hand a glittering metallic framework " * 2
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    q = random_quantizer(model)
    with serving_archive.create(tmp_path / "t.fkv", model, q, tokenizer=tok, **WINDOW) as sa:
        feed(model, sa, ids, prefill=4)
        assert sa.find("glittering metallic").tolist() == [9, 20]


def test_refusals_leave_the_archive_unchanged(tmp_path):
    gpt2, q, path = written(tmp_path, "gpt2", 20)
    before = state(path)
    qwen = use_codes_attention(TINY_MODELS["qwen3"]())
    with pytest.raises(ValueError, match="another model configuration"):
        serving_archive.resume(path, qwen)
    wider = use_codes_attention(TINY_MODELS["gpt2"](vocab_size=120))
    with pytest.raises(ValueError, match="another model configuration"):
        serving_archive.resume(path, wider)
    with pytest.raises(ValueError, match="differ from the archive's"):
        serving_archive.resume(path, gpt2, quantizer=random_quantizer(gpt2, seed=5))
    with pytest.raises(ValueError, match="differ from the archive's"):
        serving_archive.resume(path, gpt2, quantizer=random_quantizer(gpt2, value_stages=1))
    with pytest.raises(ValueError, match="mode"):
        serving_archive.resume(path, gpt2, mode="w")
    assert state(path) == before
    with serving_archive.resume(path, gpt2, quantizer=q) as sa:  # the right ones still work
        with pytest.raises(ValueError, match="configuration differs"):
            sa.forward(wider, IDS[:, 20:21])
        assert sa.cache.get_seq_length() == 20 and len(sa.tokens) == 20
    # an archive from the evaluation tools (no serving checkpoint)
    from model_adapters.store.archive_io import open_for_writing

    ar, _ = open_for_writing(tmp_path / "eval.fkv", gpt2, q, sinks=2, recent=5)
    ar.create_stream("tokens", alphabet_size=101)
    ar.close()
    with pytest.raises(ValueError, match="no serving checkpoint"):
        serving_archive.resume(tmp_path / "eval.fkv", gpt2)


def test_forks_share_the_parent_and_continue_independently(tmp_path):
    model, q, parent = written(tmp_path, "qwen3", 24)
    before = state(parent)
    branches = {"a": IDS[:, 24:32], "b": IDS[:, 32:40]}
    for name, more in branches.items():
        with serving_archive.fork(parent, tmp_path / f"{name}.fkv", model) as sa:
            for t in range(more.shape[1]):
                sa.forward(model, more[:, t : t + 1])
    assert state(parent) == before
    # each fork stores only what followed the fork point
    assert state(tmp_path / "a.fkv")[1] == {"codes": 8, "tokens": 8}
    for name, more in branches.items():
        ids = torch.cat([IDS[:, :24], more], 1)
        live = CodesOnlyCache(model, q, **WINDOW)
        want = feed(model, live, torch.cat([ids, IDS[:, :1]], 1))[:, -1]
        with serving_archive.resume(tmp_path / f"{name}.fkv", model) as sa:
            assert (sa.token_ids() == ids[0].numpy()).all()
            assert sa.find(ids[0, 20:27].tolist()).tolist() == [26]  # across the fork point
            keys, values = sa.rehydrate([3, 10, 20, 30])  # 3, 10: parent rows; 30: window
            for li, layer in enumerate(sa.cache.layers):
                dk, dv = layer.dense(torch.float32)
                assert torch.equal(keys[li], dk[0][:, [3, 10, 20, 30]])
                assert torch.equal(values[li], dv[0][:, [3, 10, 20, 30]])
            got = sa.forward(model, IDS[:, :1]).logits[:, -1]
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            sa.cache.crop(-1)
            assert len(sa.tokens) == 32 and len(sa.codes) == 25


def test_a_fork_whose_parent_was_cut_back_refuses_to_open(tmp_path):
    model, q, parent = written(tmp_path, "gpt2", 24)
    with serving_archive.fork(parent, tmp_path / "child.fkv", model) as sa:
        sa.forward(model, IDS[:, 24:26])
        with pytest.raises(ValueError, match="belong to the parent"):
            sa.cache.crop(-3)  # legal for the cache (rewind 3), not below the fork point
        assert (sa.cache.get_seq_length(), len(sa.tokens), len(sa.codes)) == (26, 26, 19)
        sa.cache.crop(-2)  # back to the fork point exactly
        assert (len(sa.tokens), len(sa.codes)) == (24, 17)
        sa.forward(model, IDS[:, 24:25])
    with serving_archive.resume(parent, model) as sa:
        sa.cache.crop(-2)
    with pytest.raises(ValueError, match="fewer than the"):
        serving_archive.resume(tmp_path / "child.fkv", model)


def test_bad_or_failing_calls_keep_tokens_and_cache_in_step(tmp_path):
    model, q, path = written(tmp_path, "gpt2", 20)
    with serving_archive.resume(path, model) as sa:
        for bad in (IDS[0, 20:22], IDS[:, 20:20], IDS[:, 20:22].float(), [[3, 4]]):
            with pytest.raises(ValueError, match="input_ids must"):
                sa.forward(model, bad)
        with pytest.raises(ValueError, match="new_ids must"):
            sa.generate(model, IDS[:, 20:20], max_new_tokens=2)
        # an id outside the vocabulary fails in the embedding, before the cache changes
        with pytest.raises(IndexError):
            sa.forward(model, torch.tensor([[500]]))
        assert len(sa.tokens) == sa.cache.get_seq_length() == 20
        sa.forward(model, IDS[:, 20:22])
    with serving_archive.resume(path, model, mode="r") as sa:
        assert sa.token_ids().tolist() == IDS[0, :22].tolist()


def test_a_call_failing_after_changing_the_cache_keeps_the_last_checkpoint(tmp_path):
    model, q, path = written(tmp_path, "gpt2", 20)
    before = state(path)

    def fail(*args):
        raise RuntimeError("out of memory, say")

    sa = serving_archive.resume(path, model)
    hook = model.transformer.h[-1].register_forward_pre_hook(fail)  # after layer 0 updated
    with pytest.raises(RuntimeError, match="out of memory"):
        sa.forward(model, IDS[:, 20:23])
    hook.remove()
    for call in (lambda: sa.forward(model, IDS[:, 20:21]), sa.checkpoint):
        with pytest.raises(ValueError, match="no longer matches the 20 recorded tokens"):
            call()
    with pytest.warns(UserWarning, match="without a checkpoint"):
        sa.close()
    assert state(path) == before
    with serving_archive.resume(path, model, mode="r") as again:
        assert again.cache.get_seq_length() == 20


def test_rehydrate_after_a_read_only_continuation(tmp_path):
    model, q, path = written(tmp_path, "qwen3", 24)
    with serving_archive.resume(path, model, mode="r") as sa:
        with torch.no_grad():  # continuing in memory: the archive takes no new rows
            model(IDS[:, 24:34], **{cache_kwarg(model): sa.cache})
        assert sa.cache.archived_tokens > len(sa.codes)
        positions = [0, 5, 20, 24, 26, 33]
        keys, values = sa.rehydrate(positions)
        for li, layer in enumerate(sa.cache.layers):
            dk, dv = layer.dense(torch.float32)
            assert torch.equal(keys[li], dk[0][:, positions])
            assert torch.equal(values[li], dv[0][:, positions])


def test_another_checkpoint_is_refused_unless_allowed(tmp_path):
    gpt2, _, path = written(tmp_path, "gpt2", 20)
    before = state(path)
    assert before[0]["weights_fingerprint"] == model_identity(gpt2).weights
    other = use_codes_attention(TINY_MODELS["gpt2"](seed=2))  # same config, other weights
    with pytest.raises(ValueError, match="other weights") as err:
        serving_archive.resume(path, other)
    assert str(model_identity(gpt2)) in str(err.value)
    assert str(model_identity(other)) in str(err.value)
    assert state(path) == before
    with serving_archive.resume(path, gpt2) as sa:  # and as a model passed to forward
        with pytest.raises(ValueError, match="other weights"):
            sa.forward(other, IDS[:, 20:21])
    with serving_archive.resume(path, other, allow_different_weights=True) as sa:
        sa.forward(other, IDS[:, 20:21])
        assert len(sa.tokens) == 21


def test_archives_with_only_a_config_fingerprint_open_with_a_warning(tmp_path):
    import fkvstore

    model, _, path = written(tmp_path, "gpt2", 20)
    with fkvstore.open(path, "r+") as ar:  # as archives were written before the weights
        del ar.attrs["weights_fingerprint"]
    with pytest.warns(UserWarning, match="only the model configuration was recorded"):
        resumed = serving_archive.resume(path, model)
    with resumed:
        resumed.forward(model, IDS[:, 20:21])
    # the configuration is still checked
    with pytest.raises(ValueError, match="another model configuration"):
        serving_archive.resume(path, use_codes_attention(TINY_MODELS["qwen3"]()))


def test_the_model_is_fingerprinted_once_per_binding_not_per_forward(tmp_path, monkeypatch):
    import model_adapters.models

    model, q, path = written(tmp_path, "gpt2", 12)
    calls = []

    def counting(config, _real=model_adapters.models.config_fingerprint):
        calls.append(1)
        return _real(config)

    # archives built before this check bound the name in their own module
    monkeypatch.setattr(model_adapters.models, "config_fingerprint", counting)
    monkeypatch.setattr(serving_archive, "config_fingerprint", counting, raising=False)
    with serving_archive.resume(path, model) as sa:
        bound = len(calls)
        assert bound >= 1
        for t in range(12, 20):
            sa.forward(model, IDS[:, t : t + 1])
        sa.generate(model, IDS[:, 20:21], max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert len(calls) == bound
