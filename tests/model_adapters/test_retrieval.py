"""The retrieval benchmark: items against the training script's generator, presses and unpacking
against slow oracles, and one short CPU run of the command line on a tiny random Qwen3."""

from __future__ import annotations

import json
import lzma
import random

import numpy as np
import pytest
import torch
from adapters_fixtures import TOKENIZER_DIR, tiny_qwen3, transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from model_adapters.experiments import needles
from model_adapters.retrieval import cli, methods, peers, presses, scoring, tasks

pytestmark = pytest.mark.skipif(not TOKENIZER_DIR.is_dir(), reason="GPT-2 tokenizer absent")


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.GPT2Tokenizer(
        vocab=str(TOKENIZER_DIR / "vocab.json"), merges=str(TOKENIZER_DIR / "merges.txt")
    )


def training_script_task(length, source, wordlist, n_needles, r, enc):
    """The long-context training script's evaluation item (ask one), transcribed plainly."""
    keys = r.sample(wordlist, n_needles)
    nums = [str(r.randrange(1_000_000, 9_999_999)) for _ in keys]
    needles = [enc(f" One of the special magic numbers for {k} is: {n}.")
               for k, n in zip(keys, nums, strict=True)]
    q = r.randrange(n_needles)
    question = enc(f"\nWhat is the special magic number for {keys[q]} mentioned in the "
                   f"provided text? The special magic number for {keys[q]} mentioned in the "
                   "provided text is:")
    answer = enc(f" {nums[q]}")
    hay_len = length - sum(map(len, needles)) - len(question) - len(answer)
    s = r.randrange(0, len(source) - hay_len - 1)
    hay = source[s:s + hay_len].tolist()
    cuts = sorted(r.randrange(0, hay_len) for _ in needles)
    ids, prev = [], 0
    for c, nd in zip(cuts, needles, strict=True):
        ids += hay[prev:c] + nd
        prev = c
    ids += hay[prev:]
    return ids + question + answer, len(answer)


@pytest.mark.parametrize("task,n", [("single", 1), ("multikey", 4)])
def test_items_follow_the_training_scripts_generator(tokenizer, task, n):
    source = np.random.default_rng(0).integers(0, 50000, 5000)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"]
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    r1, r2 = random.Random(123), random.Random(123)
    for length in (300, 400, 300):
        item = tasks.make_item(task, length, source, words, tokenizer, r1)
        ids, answer_len = training_script_task(length, source, words, n, r2, enc)
        assert item.ids == ids and len(item.ids) == length and len(item.answer) == answer_len
        assert tokenizer.decode(item.answer).strip() == item.answers[0]


def test_multivalue_and_depth_items(tokenizer):
    source = np.arange(4000) % 5000
    words = ["alpha", "bravo", "charlie", "delta", "echo"]
    mv = tasks.make_item("multivalue", 400, source, words, tokenizer, random.Random(0))
    text = tokenizer.decode(mv.context)
    assert len(mv.answers) == 4 and all(f"is: {a}." in text for a in mv.answers)
    assert text.count(f"numbers for {mv.keys[0]} is:") == 4
    for depth in (0.0, 0.5, 1.0):
        it = tasks.make_item("depth", 400, source, words, tokenizer, random.Random(1), depth)
        assert abs(it.depth - depth) < 0.1 and len(it.ids) == 400
    with pytest.raises(ValueError, match="depth 2"):
        tasks.make_item("depth", 400, source, words, tokenizer, random.Random(1), 2)
    with pytest.raises(ValueError, match="'nope'"):
        tasks.make_item("nope", 400, source, words, tokenizer, random.Random(1))


def test_key_words_rule(tokenizer):
    train, held = needles.retrieval_keys(tokenizer)
    assert not set(train) & set(held) and len(held) == (len(train) + len(held)) - len(train)
    assert len(train) == (len(train) + len(held)) * 4 // 5
    assert all(w.isalpha() and w.islower() and 4 <= len(w) <= 9 for w in held)


def test_training_segments_are_spread_and_refuse_short_input():
    segs = tasks.training_segments(np.arange(100), count=4, length=10)
    assert [s[0] for s in segs] == [0, 25, 50, 75] and all(len(s) == 10 for s in segs)
    with pytest.raises(ValueError, match="cannot give 4 x 30"):
        tasks.training_segments(np.arange(100), count=4, length=30)


def naive_unpack(packed, bits):
    rows = []
    for i in range(8 // bits):
        rows.append([[(int(v) >> (bits * i)) & ((1 << bits) - 1) for v in row] for row in packed])
    return torch.tensor([r for block in rows for r in block], dtype=torch.uint8)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 5), st.integers(1, 5), st.sampled_from([2, 4]), st.integers(0, 2**31))
def test_unpack_matches_bit_by_bit(rows, cols, bits, seed):
    packed = torch.randint(0, 256, (rows, cols), generator=torch.Generator().manual_seed(seed),
                           dtype=torch.uint8)
    assert torch.equal(peers._unpack(packed, bits), naive_unpack(packed.tolist(), bits))


class _Layer:
    def __init__(self, keys, values):
        self.keys, self.values = keys, values


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.integers(1, 20), st.integers(1, 20), st.integers(0, 2**31))
def test_prune_keeps_each_heads_best_positions_in_order(heads, n, budget, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, heads, n, 4, generator=g)
    values = torch.randn(1, heads, n, 4, generator=g)
    score = torch.randperm(heads * n, generator=g).float().view(1, heads, n)  # no ties
    layer = _Layer(keys.clone(), values.clone())
    presses.prune_layer(layer, score, budget)
    for h in range(heads):
        best = sorted(sorted(range(n), key=lambda i: -score[0, h, i])[:budget])
        assert torch.equal(layer.keys[0, h], keys[0, h, best])
        assert torch.equal(layer.values[0, h], values[0, h, best])


@pytest.mark.parametrize("ratio", [0.0, 0.5, 0.92])
def test_pyramid_budgets_keep_the_same_mean(ratio):
    press = presses.Press("pyramidkv", ratio, window=8)
    b = presses.layer_budgets(press, 1000, 12)
    flat = presses.layer_budgets(presses.Press("snapkv", ratio), 1000, 12)
    assert b == sorted(b, reverse=True) and abs(sum(b) / 12 - flat[0]) <= 1
    assert len(set(flat)) == 1 and flat[0] == int(1000 * (1 - ratio))


def test_streamingllm_keeps_sinks_and_recent():
    keys = torch.randn(1, 2, 50, 4)
    layer = _Layer(keys.clone(), keys.clone())
    p = presses.Press("streamingllm", 0.8, sinks=4)
    presses.prune_layer(layer, presses.scores(p, None, None, None, None, keys), 10)
    assert torch.equal(layer.keys, keys[:, :, [0, 1, 2, 3, 44, 45, 46, 47, 48, 49]])


def test_answers_and_intervals():
    assert scoring.answer_correct(" 1234567.", ["1234567"])
    assert not scoring.answer_correct(" 12345678", ["1234567"])
    assert not scoring.answer_correct(" none", ["1234567"])
    lo, hi = scoring.bootstrap_ci([1, 0, 1, 1, 0, 1, 1, 1])
    assert lo <= 0.75 <= hi
    assert scoring.bootstrap_ci([1, 0, 1, 1]) == scoring.bootstrap_ci([1, 0, 1, 1])
    assert scoring.bootstrap_ci([]) == (None, None)


def test_method_registry_names_and_hook():
    assert methods.method_family("snapkv-0.9") == "press"
    assert methods.method_family("perhead-k256-s2") == "rvq"
    assert methods.method_family("hqq-2") == "quantized-cache"
    assert methods.method_family("fsq-w32-L16") == "fsq"
    assert methods.method_family("fsq-w32-L16-tau1@e4m3") == "fsq"
    from model_adapters.retrieval.presses import PRESSES

    assert tuple(methods._PRESS_KINDS.split("|")) == PRESSES  # the names kept in two places
    for bad in ("snapkv-1.5", "knorm-1", "pyramidkv-", "streamingllm-half"):
        with pytest.raises(ValueError, match=r"press ratio .* in \[0, 1\)"):
            methods.method_family(bad)
    with pytest.raises(ValueError, match="'lexical-0.5'"):
        methods.method_family("lexical-0.5")
    made = []
    methods.register_method(r"lexical-.*", "lexical", lambda name, ctx: made.append(name) or name)
    try:
        assert methods.resolve_method("lexical-0.5", None) == "lexical-0.5" and made
    finally:
        methods._REGISTRY.pop(0)


def quantized_cache_backend() -> str | None:
    """The QuantizedCache method the CPU tests run: fp8 (transformers 5.24, no extra package),
    else optimum-quanto at 2 bits when installed (importing it late in a long test process can
    trip setuptools' distutils shim, so it is only the fallback), else None."""
    if peers.backend_available("fp8"):
        return "fp8"
    return "quanto-2" if peers.backend_available("quanto") else None


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("retrieval")
    model_dir, books = d / "model", d / "books"
    model = tiny_qwen3(vocab_size=50257)
    # head_dim 64 as in the real models: quanto groups 64 values along the cached vectors
    cfg = model.config
    cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads = 64, 2, 1
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(model_dir)
    transformers.GPT2Tokenizer(vocab=str(TOKENIZER_DIR / "vocab.json"),
                               merges=str(TOKENIZER_DIR / "merges.txt")).save_pretrained(model_dir)
    books.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 2048), ("val", 3000)):
        ids = rng.integers(0, 50000, n).astype("<u2")
        (books / f"books-gpt2-{split}.u16.xz").write_bytes(lzma.compress(ids.tobytes()))
    return model_dir, books, d


def test_cli_smoke_on_a_tiny_model(tiny_run, capsys):
    model_dir, books, d = tiny_run
    configs = ["exact", "perhead-k16-s1", "snapkv-0.75", "pyramidkv-0.5", "streamingllm-0.5",
               "knorm-0.5"]
    backend = quantized_cache_backend()
    if backend is None:
        pytest.skip("no QuantizedCache backend here (fp8 needs transformers 5.24)")
    configs.append(backend)
    argv = ["--model", str(model_dir), "--books", str(books), "--lengths", "160", "256",
            "--items", "2", "--tasks", "single", "multivalue", "--repro-items", "0",
            "--json", str(d / "out.json"), "--codebook-dir", str(d / "cb")]
    for c in configs:
        argv += ["--config", c]
    assert cli.main(argv) == 0
    res = json.loads((d / "out.json").read_text())
    assert [m["method"] for m in res["methods"]] == configs
    assert (d / "out.png").stat().st_size > 0 and "**multivalue**" in capsys.readouterr().out
    by = {m["method"]: m for m in res["methods"]}
    for m in res["methods"]:
        assert "error" not in m, m.get("error")
        for n in ("160", "256"):
            r = m["tasks"]["single"][n]
            assert r["items"] == 2 and len(r["outcomes"]) == 2 and 0 <= r["accuracy"] <= 1
            assert r["ci"][0] <= r["accuracy"] <= r["ci"][1]
    assert by["exact"]["compression"]["256"] == 1.0
    assert by["snapkv-0.75"]["compression"]["256"] == pytest.approx(4.0, rel=0.05)
    fp16 = res["fp16_bytes_per_token_layer"]  # 2 (K, V) x 1 head x 64 x 2 bytes
    assert fp16 == 256 and by["streamingllm-0.5"]["bytes_per_token_layer"]["256"] == pytest.approx(
        fp16 / 2, rel=0.05)
    rvq = by["perhead-k16-s1"]
    assert rvq["bytes_per_token_layer"]["256"] * 256 * 2 > rvq["codebook_bytes"]


@pytest.mark.parametrize("args,message", [
    (["--config", "nope"], "'nope' is none of"),
    (["--tasks", "sideways"], "'sideways' is not one of"),
    (["--items", "0"], "--items 0"),
    (["--lengths", "64"], "--lengths 64 is too short"),
    (["--max-seconds", "-5"], "--max-seconds -5.0 must be > 0"),
])
def test_cli_rejects_bad_input_before_work(tiny_run, capsys, args, message):
    model_dir, books, _ = tiny_run
    assert cli.main(["--model", str(model_dir), "--books", str(books), *args]) == 2
    assert message in capsys.readouterr().err


def test_cli_rejects_missing_books(tiny_run, tmp_path, capsys):
    model_dir, books, _ = tiny_run
    assert cli.main(["--model", str(model_dir), "--books", str(tmp_path)]) == 2
    assert "lacks books-gpt2-train.u16.xz" in capsys.readouterr().err
    # the training books fit RVQ codebooks: without an RVQ config only the held-out ones count
    (tmp_path / "books-gpt2-val.u16.xz").write_bytes((books / "books-gpt2-val.u16.xz").read_bytes())
    out = tmp_path / "exact.json"
    assert cli.main(["--model", str(model_dir), "--books", str(tmp_path), "--lengths", "160",
                     "--items", "1", "--tasks", "single", "--repro-items", "0", "--config",
                     "exact", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["methods"][0]["tasks"]["single"]["160"]["items"] == 1
    assert cli.main(["--model", str(model_dir), "--books", str(tmp_path), "--config",
                     "perhead-k16-s1"]) == 2
    assert "lacks books-gpt2-train.u16.xz" in capsys.readouterr().err


def test_cached_codebooks_with_more_stages_serve_fewer(tmp_path):
    from model_adapters.experiments.eval import train_codebook_sets
    from model_adapters.quant.configs import expand_configs

    model = tiny_qwen3()
    segments = [list(range(2, 100)), list(range(3, 101))]
    kw = dict(codebook_dir=str(tmp_path), kmeans_iters=2, seed=0, kmeans_points=0, context=64,
              progress=False)
    deep, collect_s, _ = train_codebook_sets(expand_configs(["perhead-k8-s2"]), model, segments,
                                             **kw)
    assert collect_s is not None
    again, collect_s, train_s = train_codebook_sets(expand_configs(["perhead-k8-s1"]), model,
                                                    segments, **kw)
    assert collect_s is None and train_s is None  # loaded, nothing fitted
    a, b = again[(False, 8)].to_arrays(), deep[(False, 8)].to_arrays()
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_shared_exact_prefill_builds_the_same_caches(tiny_run, tokenizer):
    """Methods that compress after their prefill: the cache built from one shared exact prefill
    equals the one their own prefill leaves, bit for bit."""
    from model_adapters.models import cache_kwarg, kv_shape

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_run[0]).eval()
    ctx = methods.MethodContext(model, kv_shape(model))
    names = ["exact", "snapkv-0.75", "pyramidkv-0.5", "knorm-0.5", "streamingllm-0.6"]
    names += [b for b in (quantized_cache_backend(),) if b]
    source = np.random.default_rng(1).integers(0, 50000, 3000)
    item = tasks.make_item("single", 250, source, ["alpha", "bravo"], tokenizer,
                           random.Random(0))
    shared = scoring.exact_prefill(model, item.context)
    for name in names:
        m = methods.resolve_method(name, ctx)
        own = m.new_cache(False)
        n = len(item.context)
        with torch.no_grad(), m.prefill(own):
            model(input_ids=torch.tensor([item.context]), position_ids=torch.arange(n)[None],
                  use_cache=True, **{cache_kwarg(model): own})
        built = m.from_exact(*shared)
        assert m.stored_bytes(built, n) == m.stored_bytes(own, n), name
        for a, b in zip(own.layers, built.layers, strict=True):
            for attr in ("keys", "values"):
                x, y = getattr(a, attr, None), getattr(b, attr, None)
                assert (x is None and y is None) or torch.equal(x, y), (name, attr)
        with_shared = scoring.greedy_answer(model, m, item, tokenizer, shared=shared)
        assert with_shared == scoring.greedy_answer(model, m, item, tokenizer), name


def test_fsq_method_answers_like_the_converted_model(tiny_run, tokenizer, tmp_path):
    """``fsq-wW-LL`` runs the converted model on an FSQCache: its greedy answer equals the
    converted model's own with an exact DynamicCache (float32), and it stores the packed codes
    and the positions alone."""
    from transformers import DynamicCache

    from model_adapters.models import kv_shape
    from model_adapters.quant.fsq_convert import convert_to_fsq, save_bottleneck

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_run[0]).eval()
    save_bottleneck(convert_to_fsq(model, "fsq-w8-L16"), tmp_path / "b")
    ctx = methods.MethodContext(model, kv_shape(model), bottlenecks={"fsq-w8-L16": tmp_path / "b"})
    with pytest.raises(ValueError, match="fsq-w16-L16=DIR"):
        methods.resolve_method("fsq-w16-L16", ctx)
    m = methods.resolve_method("fsq-w8-L16", ctx)
    assert m.family == "fsq" and m.model is not model
    # the same bottleneck with its key decoder as an fp8 kernel would compute it
    fp8 = methods.resolve_method("fsq-w8-L16@e4m3", ctx)
    assert fp8.info["key_decoder"]["form"] == "e4m3" and m.info["key_decoder"] is None
    assert fp8.info["bottleneck"] == m.info["bottleneck"]
    source = np.random.default_rng(2).integers(0, 50000, 3000)
    item = tasks.make_item("single", 200, source, ["alpha", "bravo"], tokenizer,
                           random.Random(1))
    dense = methods.Method("dense", "exact", lambda measure: DynamicCache(),
                           lambda cache, tokens: 0, model=m.model)
    text, stored = scoring.greedy_answer(model, m, item, tokenizer, measure=True)
    assert text == scoring.greedy_answer(model, dense, item, tokenizer)[0]
    layers = model.config.num_hidden_layers
    assert stored == len(item.context) * (4 * layers + 8)  # 8 coordinates x 4 bits; positions
