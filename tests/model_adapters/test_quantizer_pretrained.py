"""The one-import API: KVQuantizer.fit / save_pretrained / from_pretrained, and the model
identity (config and weights) that binds codebooks and archives to one checkpoint."""

from __future__ import annotations

import json

import pytest
from adapters_fixtures import TINY_MODELS, torch
from serving_fixtures import random_quantizer

from model_adapters import (
    ArchivingCache,
    CodesOnlyCache,
    KVQuantizer,
    model_identity,
    use_codes_attention,
    weights_fingerprint,
)
from model_adapters.quant.quantizer import CODEBOOKS_FILE, CONFIG_FILE

IDS = torch.randint(2, 100, (300,), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """Codebooks fitted on the seed-0 tiny GPT-2 and saved to a folder."""
    model = TINY_MODELS["gpt2"]()
    q = KVQuantizer.fit(model, IDS, "perhead-k16-s2", iters=3, progress=False)
    folder = q.save_pretrained(tmp_path_factory.mktemp("codebooks"))
    return model, q, folder


def test_fit_save_and_load_round_trip(fitted):
    model, q, folder = fitted
    assert (folder / CODEBOOKS_FILE).is_file()
    meta = json.loads((folder / CONFIG_FILE).read_text())
    assert meta["quant_config"] == "perhead-k16-K2V2"
    assert meta["shape"]["num_layers"] == 2 and meta["pooled"] is False
    assert meta["model_identity"] == model_identity(model).to_dict()
    loaded = KVQuantizer.from_pretrained(folder, model)
    assert torch.equal(loaded.key_codebooks, q.key_codebooks)
    assert torch.equal(loaded.value_codebooks, q.value_codebooks)
    assert loaded.identity == q.identity == model_identity(model)
    assert loaded.config.canonical == "perhead-k16-K2V2"


def test_fit_takes_a_list_of_runs_and_matches_a_single_run():
    model = TINY_MODELS["qwen3"]()
    one = KVQuantizer.fit(model, IDS.tolist(), "pooled-k8-s1", iters=2, progress=False)
    runs = KVQuantizer.fit(model, [IDS[:150].tolist(), IDS[150:].tolist()], "pooled-k8-s1",
                           iters=2, progress=False, context=150)
    assert one.pooled and one.codebook_size == 8 and one.key_stages == one.value_stages == 1
    # the same vectors: the first 150 positions of a window do not depend on later ones, and
    # the second run starts a new window at position 0 in both
    assert torch.equal(
        KVQuantizer.fit(model, IDS, "pooled-k8-s1", iters=2, progress=False,
                        context=150).key_codebooks,
        runs.key_codebooks,
    )


def test_codebooks_of_another_checkpoint_are_refused_naming_both(fitted):
    model, _, folder = fitted
    other = TINY_MODELS["gpt2"](seed=1)  # same config, other weights
    with pytest.raises(ValueError, match="other weights") as err:
        KVQuantizer.from_pretrained(folder, other)
    assert str(model_identity(model)) in str(err.value)
    assert str(model_identity(other)) in str(err.value)
    loaded = KVQuantizer.from_pretrained(folder, other, allow_different_weights=True)
    ArchivingCache(other, loaded)  # the opt-out holds for the caches it is bound to


def test_caches_refuse_codebooks_fitted_on_another_checkpoint(fitted):
    _, q, _ = fitted
    other = TINY_MODELS["gpt2"](seed=1)
    with pytest.raises(ValueError, match="other weights"):
        ArchivingCache(other, q)
    with pytest.raises(ValueError, match="other weights"):
        CodesOnlyCache(use_codes_attention(other), q)
    ArchivingCache(other.config, q)  # a config alone cannot say which weights


def test_codebooks_of_another_architecture_are_refused(fitted):
    _, _, folder = fitted
    with pytest.raises(ValueError, match="built for"):
        KVQuantizer.from_pretrained(folder, TINY_MODELS["qwen3"]())
    with pytest.raises(ValueError, match="another model configuration"):
        KVQuantizer.from_pretrained(folder, TINY_MODELS["gpt2"](vocab_size=102))


def test_from_pretrained_refuses_a_folder_without_a_quantizer(tmp_path):
    with pytest.raises(ValueError, match=CONFIG_FILE):
        KVQuantizer.from_pretrained(tmp_path, TINY_MODELS["gpt2"]())


def test_weights_fingerprint_follows_the_weights_not_the_dtype():
    a, b = TINY_MODELS["qwen3"](), TINY_MODELS["qwen3"](seed=1)
    assert weights_fingerprint(a) != weights_fingerprint(b)
    assert weights_fingerprint(a) == weights_fingerprint(TINY_MODELS["qwen3"]())
    # a float32 and a bfloat16 load of one checkpoint are the same model for the codebooks
    assert weights_fingerprint(a) == weights_fingerprint(TINY_MODELS["qwen3"]().bfloat16())
    with torch.no_grad():
        next(a.parameters())[0, 0] += 1.0  # the first element is always sampled
    assert weights_fingerprint(a) != weights_fingerprint(TINY_MODELS["qwen3"]())


def test_a_quantizer_without_identity_checks_the_shape_only():
    model = TINY_MODELS["gpt2"]()
    q = random_quantizer(model)
    assert q.identity is None
    ArchivingCache(TINY_MODELS["gpt2"](seed=4), q)
    with pytest.raises(ValueError, match="built for"):
        ArchivingCache(TINY_MODELS["qwen3"](), q)


def test_collect_kv_windows_at_most_the_models_positions():
    from model_adapters.quant.collect import collect_kv

    model = TINY_MODELS["gpt2"]()  # 128 positions
    run = [2 + i % 50 for i in range(300)]
    keys, values = collect_kv(model, [run], progress=False)  # default context 1,024
    want_k, want_v = collect_kv(model, [run], context=128, progress=False)
    assert keys[0].shape[0] == values[-1].shape[0] == 300
    assert all(map(torch.equal, keys + values, want_k + want_v))
    with pytest.raises(ValueError, match="context must be a positive int, got 0"):
        collect_kv(model, [run], context=0)


def test_fit_refuses_token_ids_outside_the_vocabulary():
    model = TINY_MODELS["gpt2"]()
    vocab = model.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match=rf"must lie in \[0, {vocab}\).*got \[{vocab}, -1\]"):
        KVQuantizer.fit(model, [2, 3, vocab, -1], "perhead-k4-s1", progress=False)
