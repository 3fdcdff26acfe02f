"""FSQ codes kept in an fkvstore archive: resume without prefill, crop, a checkpoint cut short,
token search and rehydration, on tiny converted Qwen3 and GPT-2 models (real HDF5 files)."""

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel, Qwen3Config, Qwen3ForCausalLM

import fkvstore
from model_adapters.caches.fsq_cache import FSQCache
from model_adapters.models import cache_kwarg
from model_adapters.quant.fsq_convert import convert_to_fsq
from model_adapters.quant.fsq_model import attention_layers
from model_adapters.store import fsq_archive

VOCAB = 61
CALIB = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))


def _qwen3():
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=1)).eval()


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=128, bos_token_id=0, eos_token_id=1)).eval()


@pytest.fixture(scope="module", params=["qwen3", "gpt2"])
def model(request):
    base = {"qwen3": _qwen3, "gpt2": _gpt2}[request.param]()
    return convert_to_fsq(base, "fsq-w6-L16", CALIB).double()


def _ids(n, seed=1):
    return torch.randint(2, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids, cache):
    with torch.no_grad():
        return model(ids, **{cache_kwarg(model): cache}).logits


def test_resume_gives_the_same_next_token_logits_without_prefill(model, tmp_path):
    ids, nxt = _ids(40), _ids(3, seed=2)
    with fsq_archive.create(tmp_path / "a.fkv", model) as ar:
        ar.forward(model, ids[:, :25])
        for t in range(25, 40):
            ar.forward(model, ids[:, t:t + 1])
        straight = _logits(model, nxt, copy.deepcopy(ar.cache))  # the writer continuing
    with fsq_archive.resume(tmp_path / "a.fkv", model) as again:
        assert again.cache.get_seq_length() == 40 and np.array_equal(again.token_ids(), ids[0])
        assert torch.equal(_logits(model, nxt, copy.deepcopy(again.cache)), straight)
    fresh = FSQCache(model)
    _logits(model, ids, fresh)
    assert torch.allclose(_logits(model, nxt, fresh), straight, atol=1e-10)


def test_generate_records_every_consumed_token_and_resumes(model, tmp_path):
    ids = _ids(12)
    with fsq_archive.create(tmp_path / "g.fkv", model) as ar:
        out = ar.generate(model, ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert len(ar.tokens) == ar.cache.get_seq_length() == 17
    with fsq_archive.resume(tmp_path / "g.fkv", model) as ar:
        assert np.array_equal(ar.token_ids(), out[0, :17].numpy())
        more = ar.generate(model, _ids(2, seed=9), max_new_tokens=3, do_sample=False,
                           pad_token_id=0)
    cont = torch.cat([out[0, :17], _ids(2, seed=9)[0]])[None]
    ref = model.generate(cont, max_new_tokens=3, do_sample=False, pad_token_id=0,
                         attention_mask=torch.ones_like(cont),
                         **{cache_kwarg(model): FSQCache(model)})
    assert torch.equal(more, ref)


def test_rows_past_the_checkpoint_are_dropped(model, tmp_path):
    path = tmp_path / "cut.fkv"
    ids = _ids(20)
    with fsq_archive.create(path, model) as ar:
        ar.forward(model, ids)
        ref = _logits(model, _ids(1, seed=3), copy.deepcopy(ar.cache))
    with fkvstore.open(path, "r+") as raw:  # a checkpoint cut short: rows, no length
        raw["codes"].extend(np.zeros((5, raw["codes"].width), np.int64))
        raw["tokens"].extend(np.full((5, 1), 7, np.int64))
    with fsq_archive.resume(path, model) as ar:
        assert len(ar.codes) == len(ar.tokens) == 20
        assert torch.equal(_logits(model, _ids(1, seed=3), copy.deepcopy(ar.cache)), ref)


def test_crop_is_followed_by_the_streams(model, tmp_path):
    path = tmp_path / "crop.fkv"
    ids = _ids(30)
    with fsq_archive.create(path, model) as ar:
        ar.forward(model, ids)
        ar.checkpoint()
        ar.cache.crop(22)
        other = _ids(4, seed=8)  # other tokens where the cropped ones were
        ar.forward(model, other)
        # a process killed now must find a checkpoint its streams still cover
        assert ar.archive.attrs["serving_length"] <= min(len(ar.codes), len(ar.tokens))
        fresh = FSQCache(model)
        _logits(model, torch.cat([ids[:, :22], other], 1), fresh)
        k, _ = ar.rehydrate([21, 22, 25])
        want, _ = ar.cache.decode(attention_layers(model)[1], fresh.layer_codes(1)[:, [21, 22, 25]],
                                  torch.tensor([[21, 22, 25]]))
        assert torch.equal(k[1], want[0])
        ar.cache.crop(22)
        ar.forward(model, ids[:, 22:26])
    with fsq_archive.resume(path, model) as ar:
        assert np.array_equal(ar.token_ids(), ids[0, :26].numpy())
        fresh = FSQCache(model)
        _logits(model, ids[:, :26], fresh)
        for i in range(len(ar.cache.layers)):
            assert torch.equal(ar.cache.layer_codes(i), fresh.layer_codes(i))


def test_rehydrate_equals_the_dense_cache_of_the_same_model(model, tmp_path):
    ids = _ids(33)
    dense = DynamicCache(config=model.config)
    _logits(model, ids, dense)
    with fsq_archive.create(tmp_path / "r.fkv", model) as ar:
        ar.forward(model, ids[:, :20])
        ar.checkpoint()  # 0-19 from the archive, 20-32 from the cache
        ar.forward(model, ids[:, 20:])
        pos = [0, 5, 19, 20, 31, 32]
        k, v = ar.rehydrate(pos)
        assert k.shape == v.shape == (2, 2 if model.config.model_type == "fsq_qwen3" else 4,
                                      len(pos), 8)
        for li, layer in enumerate(dense.layers):
            assert torch.allclose(k[li], layer.keys[0][:, pos].float(), atol=1e-5)
            assert torch.allclose(v[li], layer.values[0][:, pos].float(), atol=1e-5)
        with pytest.raises(IndexError, match="33"):
            ar.rehydrate([33])


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(2, 5), min_size=1, max_size=3), st.integers(0, 10_000))
def test_find_agrees_with_a_scan(model, tmp_path_factory, query, seed):
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(rng.integers(2, 6, size=(1, 30)))
    path = tmp_path_factory.mktemp("find") / "f.fkv"
    with fsq_archive.create(path, model) as ar:
        ar.forward(model, ids)
        got = ar.find(query)
    seq, q = ids[0].tolist(), list(query)
    want = [i + len(q) - 1 for i in range(len(seq) - len(q) + 1) if seq[i:i + len(q)] == q]
    assert got.tolist() == want


def test_bad_input_is_refused_before_anything_changes(model, tmp_path):
    with pytest.raises(ValueError, match="not an FSQ-converted"):
        fsq_archive.create(tmp_path / "x.fkv", _qwen3())
    assert not (tmp_path / "x.fkv").exists()
    path = tmp_path / "a.fkv"
    with fsq_archive.create(path, model) as ar:
        ar.forward(model, _ids(10))
    other = convert_to_fsq(_qwen3() if model.config.model_type == "fsq_qwen3" else _gpt2(),
                           "fsq-w6-L16", CALIB[:, :12]).double()
    before = path.read_bytes()
    with pytest.raises(ValueError, match="weights"):
        fsq_archive.resume(path, other)
    assert path.read_bytes() == before
    with fsq_archive.resume(path, other, allow_different_weights=True, mode="r") as ar:
        assert ar.cache.get_seq_length() == 10
        with pytest.raises(ValueError, match="read-only"):
            ar.forward(other, _ids(1))
    with pytest.raises(ValueError, match="mode"):
        fsq_archive.resume(path, model, mode="w")
    with pytest.raises(FileNotFoundError, match=r"no archive at .*fsq_archive.create\(...\)"):
        fsq_archive.resume(tmp_path / "missing.fkv", model)
    with pytest.raises(FileExistsError, match=r"fsq_archive.resume\(...\) continues it"):
        fsq_archive.create(path, model)
    assert path.read_bytes() == before
    cache = FSQCache(model)
    _logits(model, _ids(4), cache)
    with pytest.raises(ValueError, match="4 positions"):
        fsq_archive.create(tmp_path / "y.fkv", model, cache=cache, token_ids=[1, 2])
    with fsq_archive.create(tmp_path / "y.fkv", model, cache=cache,
                            token_ids=_ids(4)[0], mode="w") as ar:
        assert len(ar.codes) == 4


def test_the_public_surface_names_the_archive():
    import model_adapters

    assert model_adapters.FsqArchive is fsq_archive.FsqArchive
    assert model_adapters.fsq_archive is fsq_archive


def test_levels_that_are_not_powers_of_two_round_trip(tmp_path):
    model = convert_to_fsq(_qwen3(), "fsq-w5-L5", CALIB).double()  # mixed-radix packing
    ids = _ids(18)
    with fsq_archive.create(tmp_path / "l5.fkv", model) as ar:
        ar.forward(model, ids)
        want = [ar.cache.layer_codes(i) for i in range(2)]
        assert ar.codes.alphabet_size == 5
    with fsq_archive.resume(tmp_path / "l5.fkv", model) as ar:
        for i in range(2):
            assert torch.equal(ar.cache.layer_codes(i), want[i])
            assert int(want[i].max()) <= 4
