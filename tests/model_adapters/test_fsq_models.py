"""FSQ-converted Qwen3 and GPT-2: conversion, FSQCache against the model's own forward,
saving and loading (whole model through the auto classes, bottleneck alone), finetuning."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from interpreted import run_interpreted
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel, Qwen3Config, Qwen3ForCausalLM

from model_adapters.caches.fsq_cache import CapacityError, FSQCache, fsq_torch_attention
from model_adapters.experiments.needles import needle_item, training_batches
from model_adapters.models import cache_kwarg
from model_adapters.quant.fsq_convert import convert_to_fsq, load_bottleneck, save_bottleneck
from model_adapters.quant.fsq_model import attention_layers, bottlenecks
from model_adapters.quant.fsq_train import bottleneck_parameters, finetune_fsq, steps_for_tau

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 101


def qwen3(seed=0):
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=1)).eval()


def gpt2(seed=0):
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                      n_positions=128, bos_token_id=0, eos_token_id=1)).eval()


BASES = {"qwen3": qwen3, "gpt2": gpt2}
IDS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module", params=["qwen3", "gpt2"])
def converted(request):
    base = BASES[request.param]()
    return base, convert_to_fsq(base, "fsq-w8-L16", IDS)


def test_conversion_shapes_and_what_is_kept(converted):
    base, model = converted
    layers = attention_layers(model)
    assert len(layers) == 2 and model.config.fsq_width == 8 and model.config.fsq_tau == 0.0
    for b in bottlenecks(model):
        assert b.encoder.weight.shape == (8, 64)
        assert b.key_decoder.weight.shape == b.value_decoder.weight.shape
        assert b.key_decoder.weight.shape[1] == 8
    names = {n for n, _ in model.named_parameters()}
    assert not any(".k_proj." in n or ".v_proj." in n or ".c_attn." in n for n in names)
    base_state = base.state_dict()
    for name, value in model.state_dict().items():  # everything but the bottleneck is the base's
        if name in base_state:
            assert torch.equal(value, base_state[name]), name


@pytest.mark.parametrize("bad", [IDS[0], IDS.float(), IDS[:, :0], IDS.tolist()])
def test_bad_calibration_ids_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="calibration_ids must be a non-empty \\(rows, "
                                         "tokens\\) integer tensor, got"):
        convert_to_fsq(qwen3(), "fsq-w8-L16", bad)


@pytest.mark.parametrize("kind", ["qwen3", "gpt2"])
def test_full_width_fine_levels_reproduce_the_base_model(kind):
    base = BASES[kind]()
    # w = 2 * kv_heads * head_dim spans every key and value; 256 levels leave a small error
    width = 2 * 64 if kind == "gpt2" else 2 * 2 * 16
    model = convert_to_fsq(base, f"fsq-w{width}-L256", IDS)
    coarse = convert_to_fsq(base, "fsq-w4-L4", IDS)
    with torch.no_grad():
        ref, fine, bad = (m(IDS).logits for m in (base, model, coarse))
    assert (fine - ref).abs().max() < 0.05 * ref.abs().max()
    assert (fine - ref).abs().max() < (bad - ref).abs().max()


def _through_cache(model, cache, ids, cuts):
    kw, pieces, start = cache_kwarg(model), [], 0
    with torch.no_grad():
        for cut in [*cuts, ids.shape[1]]:
            pieces.append(model(ids[:, start:cut], use_cache=True, **{kw: cache}).logits)
            start = cut
    return torch.cat(pieces, 1)


@pytest.mark.parametrize("capacity", [None, 30])
@pytest.mark.parametrize("spec", ["fsq-w8-L16", "fsq-w12-L5"])
def test_fsq_cache_logits_match_the_models_own_forward(spec, capacity):
    for make in BASES.values():
        model = convert_to_fsq(make(), spec, IDS)
        with torch.no_grad():
            full = model(IDS).logits
        cache = FSQCache(model, capacity=capacity)
        got = _through_cache(model, cache, IDS, [10, 17, *range(18, 24)])
        assert torch.allclose(got, full, atol=1e-5, rtol=1e-4)
        # packed codes (batch x layers x tokens x packed bytes) and the positions once; with a
        # capacity the buffers of that size and one scratch row
        rows = capacity + 1 if capacity else 24
        assert cache.nbytes() == 2 * 2 * rows * cache.packed_bytes + 2 * rows * 8
        assert torch.equal(cache.layer_codes(0), bottlenecks(model)[0].codes(
            model.get_input_embeddings()(IDS) * 0 + _layer0_input(model, IDS)))


def _layer0_input(model, ids):
    found = []
    layer = attention_layers(model)[0]
    handle = layer.register_forward_pre_hook(
        lambda m, a, k: found.append(k.get("hidden_states", a[0] if a else None)),
        with_kwargs=True)
    with torch.no_grad():
        model(ids)
    handle.remove()
    return found[0]


@settings(max_examples=8, deadline=None)
@given(cuts=st.lists(st.integers(1, 23), max_size=4, unique=True))
def test_fsq_cache_is_chunk_invariant(cuts):
    model = _QWEN
    a = _through_cache(model, FSQCache(model), IDS[:1], sorted(cuts))
    b = _through_cache(model, FSQCache(model), IDS[:1], [])
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


_QWEN = convert_to_fsq(qwen3(), "fsq-w8-L16", IDS)


@pytest.mark.parametrize("gqa", [1, 2])
def test_pooled_codes_equal_attention_over_decoded_values(gqa):
    g = torch.Generator().manual_seed(0)
    kv, d, w, n, seq = 2, 8, 6, 3, 11
    folded = [torch.randn(kv, d, w, generator=g), torch.randn(kv, d, generator=g),
              torch.randn(kv, d, w, generator=g), torch.randn(kv, d, generator=g)]
    codes = torch.randint(0, 16, (2, seq, w), generator=g)
    query = torch.randn(2, kv * gqa, n, d, generator=g)
    k_norm = torch.rand(d, generator=g) + 0.5
    got = fsq_torch_attention(query, codes, folded, scale=0.3, k_norm=k_norm, rope=1e4)
    # oracle: decode every key and value densely, rotate, causal SDPA
    z = codes.float()
    keys = torch.einsum("hdw,btw->bhtd", folded[0], z) + folded[1][None, :, None]
    keys = keys * torch.rsqrt(keys.pow(2).mean(-1, keepdim=True) + 1e-6) * k_norm
    pos = torch.arange(seq, dtype=torch.float64)
    inv = 1e4 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.cat([pos[:, None] * inv] * 2, -1)
    rot = torch.cat([-keys[..., d // 2:], keys[..., :d // 2]], -1)
    keys = keys * ang.cos().float() + rot * ang.sin().float()
    values = torch.einsum("hdw,btw->bhtd", folded[2], z) + folded[3][None, :, None]
    keys, values = keys.repeat_interleave(gqa, 1), values.repeat_interleave(gqa, 1)
    mask = torch.ones(n, seq, dtype=torch.bool).tril(seq - n)
    ref = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                                           scale=0.3)
    assert torch.allclose(got, ref.transpose(1, 2), atol=1e-5)


@pytest.mark.parametrize("capacity", [None, 13])
def test_generate_with_fsq_cache_equals_dynamic_cache(converted, capacity):
    _, model = converted
    kw = cache_kwarg(model)
    out = model.generate(IDS[:1, :5], max_new_tokens=8, do_sample=False,
                         **{kw: FSQCache(model, capacity=capacity)})
    ref = model.generate(IDS[:1, :5], max_new_tokens=8, do_sample=False,
                         **{kw: DynamicCache(config=model.config)})
    assert out.shape == (1, 13) and torch.equal(out, ref)


@pytest.mark.parametrize("capacity", [None, 15])
def test_left_padded_batch_generates_as_the_dense_cache(converted, capacity):
    _, model = converted
    kw = cache_kwarg(model)
    ids = IDS[:, :9].clone()
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 2, 0  # three pads on the left of the first prompt
    args = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=2)
    out = model.generate(ids, **args, **{kw: FSQCache(model, capacity=capacity)})
    ref = model.generate(ids, **args, **{kw: DynamicCache(config=model.config)})
    assert torch.equal(out, ref)


@pytest.mark.parametrize("capacity", [None, 24])
def test_cache_crop_and_batch_operations(capacity):
    model = _QWEN
    cache = FSQCache(model, capacity=capacity)
    _through_cache(model, cache, IDS, [])
    before = cache.layer_codes(1)
    cache.crop(-4)
    assert cache.get_seq_length() == 20 and torch.equal(cache.layer_codes(1), before[:, :20])
    cache.crop(18)
    assert cache.get_seq_length() == 18
    cache.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(cache.layer_codes(1), before[[1, 0], :18])
    with pytest.raises(ValueError, match="holds only 18"):
        cache.crop(30)
    with pytest.raises(TypeError, match="FSQ-converted models only"):
        cache.layers[0].update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16))
    with pytest.raises(ValueError, match="backend"):
        FSQCache(model, backend="cuda")
    with pytest.raises(ValueError, match="not an FSQ-converted"):
        FSQCache(qwen3())
    if capacity is not None:  # reordered in place: a captured kernel call still reads it
        assert cache.layers[1].keys.shape[2] == capacity + 1  # (and a scratch row)
        address = cache.layers[1].keys.data_ptr()
        cache.reorder_cache(torch.tensor([1, 1]))
        assert cache.layers[1].keys.data_ptr() == address
        assert torch.equal(cache.layer_codes(1), before[[0, 0], :18])


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "64"])
def test_capacity_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=f"capacity must be a positive int or None, got "
                                         f"{bad!r}"):
        FSQCache(_QWEN, capacity=bad)


def test_past_the_capacity_nothing_is_written():
    model = _QWEN
    cache = FSQCache(model, capacity=20)
    _through_cache(model, cache, IDS[:, :18], [])
    before = [cache.layer_codes(i).clone() for i in range(2)]
    with pytest.raises(CapacityError, match=r"capacity=20\) holds 18 positions; 3 more"):
        _through_cache(model, cache, IDS[:, 18:21], [])
    assert cache.get_seq_length() == 18
    assert all(torch.equal(cache.layer_codes(i), before[i]) for i in range(2))
    _through_cache(model, cache, IDS[:, 18:20], [])  # what fits still goes in
    assert cache.get_seq_length() == 20


def test_auto_classes_load_a_saved_model_in_a_fresh_process(tmp_path, converted):
    _, model = converted
    model.save_pretrained(tmp_path / "m")
    with torch.no_grad():
        ref = model(IDS).logits
    torch.save({"ids": IDS, "logits": ref}, tmp_path / "ref.pt")
    code = (
        "import json, sys, torch\n"
        "import model_adapters\n"
        "from transformers import AutoModelForCausalLM\n"
        "from model_adapters.caches.fsq_cache import FSQCache\n"
        "from model_adapters.models import cache_kwarg\n"
        f"d = {str(tmp_path)!r}\n"
        "m = AutoModelForCausalLM.from_pretrained(d + '/m').eval()\n"
        "r = torch.load(d + '/ref.pt')\n"
        "with torch.no_grad():\n"
        "    diff = (m(r['ids']).logits - r['logits']).abs().max().item()\n"
        "g = m.generate(r['ids'][:1, :4], max_new_tokens=3, do_sample=False,\n"
        "               **{cache_kwarg(m): FSQCache(m)})\n"
        "print(json.dumps([type(m).__name__, diff, g.shape[1]]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    name, diff, length = json.loads(out.stdout.strip().splitlines()[-1])
    assert name == type(model).__name__ and diff < 1e-5 and length == 7


def test_bottleneck_saves_and_loads_on_its_own(tmp_path, converted):
    base, model = converted
    file = save_bottleneck(model, tmp_path)
    assert file.stat().st_size < 100_000
    again = load_bottleneck(tmp_path, base)
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, model(IDS).logits)
    other = BASES[base.config.model_type](seed=1)
    with pytest.raises(ValueError, match="weights"):
        load_bottleneck(tmp_path, other)
    with pytest.raises(FileNotFoundError):
        load_bottleneck(tmp_path / "missing", base)


def test_finetuning_trains_only_the_bottleneck(converted):
    base, model = converted
    import copy

    model = copy.deepcopy(model)
    frozen = {n: p.clone() for n, p in model.named_parameters() if ".fsq." not in n}
    start = [p.clone() for p in bottleneck_parameters(model)]
    tokens = torch.randint(2, VOCAB, (4000,), generator=torch.Generator().manual_seed(2))

    def batches():
        g = torch.Generator().manual_seed(3)
        while True:
            s = torch.randint(0, 3900, (2,), generator=g)
            yield torch.stack([tokens[i:i + 32] for i in s.tolist()]), None

    log = finetune_fsq(model, batches(), steps=6, lr=1e-2, teacher=base, kl_weight=1.0,
                       log_every=1, tau=0.001)
    assert len(log) == 6 and all(r["kl"] >= 0 for r in log)
    assert model.config.fsq_tau == 0.001
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    after = bottleneck_parameters(model)
    assert any(not torch.equal(a, b) for a, b in zip(start, after, strict=True))
    assert not any(p.requires_grad for p in model.parameters())
    with pytest.raises(ValueError, match="teacher"):
        finetune_fsq(model, batches(), steps=1, kl_weight=1.0)
    # bad arguments are refused before training, bad batches when they come; either way the
    # run records no tau and leaves every parameter frozen
    for bad, match in (({"steps": 0}, "steps must be a positive int, got 0"),
                       ({"steps": -1}, "steps must be a positive int, got -1"),
                       ({"steps": 2, "lr": 0.0}, "lr must be > 0, got 0.0")):
        with pytest.raises(ValueError, match=match):
            finetune_fsq(model, batches(), tau=0.5, **bad)
    for feed, match in (([(tokens[:64].view(2, 32), None)], "ran out after 1 of steps=2"),
                        ([tokens[:64].view(2, 32)], "must yield \\(ids, answer_mask\\) pairs"),
                        ([(tokens[:64].float().view(2, 32), None)],
                         r"ids must be a non-empty \(rows, tokens\) integer tensor, got "
                         r"\(2, 32\) torch.float32 at step 0"),
                        ([(tokens[:64].view(2, 32), torch.ones(2, 31))], "of the ids' shape")):
        with pytest.raises(ValueError, match=match):
            finetune_fsq(model, iter(feed), steps=2, tau=0.5)
    assert model.config.fsq_tau == 0.001
    assert not any(p.requires_grad for p in model.parameters())


def test_tau_budget():
    assert steps_for_tau(0.25, 22_500_000, 4 * 8192) == 172
    assert steps_for_tau(0, 100, 10) == 0
    with pytest.raises(ValueError, match="tau"):
        steps_for_tau(-1, 100, 10)


def test_needle_items_follow_the_task_rules():
    import random

    def encode(s):
        return [ord(c) % 50 for c in s]

    source = torch.arange(5000) % 97
    ids, mask = needle_item(600, source, ["apple", "river"], encode, random.Random(0), needles=2)
    assert len(ids) == len(mask) == 600 and sum(mask) == len(encode(" 1234567"))
    assert mask[-sum(mask):] == [1] * sum(mask)
    x, m = next(training_batches(source, ["apple", "river", "stone"], encode, batch=3, seq=512))
    assert x.shape == m.shape == (3, 512)


def test_capacity_cache_knows_whether_positions_are_their_indices():
    """(A captured decode step then lets the kernel take positions as indices.)"""
    model = _QWEN
    kw = cache_kwarg(model)
    cache = FSQCache(model, capacity=20)
    _through_cache(model, cache, IDS[:1, :7], [5, 6])
    assert cache.layers[0].consecutive
    with torch.no_grad():
        model(IDS[:1, 7:10], position_ids=torch.arange(8, 11)[None], use_cache=True,
              **{kw: cache})
    assert not cache.layers[0].consecutive
    cache.reset()
    assert cache.layers[0].consecutive and cache.get_seq_length() == 0



def _compiled_step(model, cache):
    kw = cache_kwarg(model)
    torch._dynamo.reset()
    return torch.compile(lambda ids: model(ids, use_cache=True, **{kw: cache}).logits,
                         fullgraph=True, backend="eager")


def test_compiled_capacity_steps_have_no_graph_break_and_match(converted):
    """One graph for every decode step (no recompile as the length grows), the logits of the
    model's own forward, and the host learns the length once, after the steps."""
    _, model = converted
    with torch.no_grad():
        full = model(IDS).logits
    cache = FSQCache(model, capacity=30)
    step = _compiled_step(model, cache)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        outs = [_through_cache(model, cache, IDS[:, :10], [])]  # the prefill, eager
        outs += [step(IDS[:, t:t + 1]) for t in range(10, 22)]
    assert cache.layers[1].length is None  # (the host did not follow the compiled steps)
    outs.append(_through_cache(model, cache, IDS[:, 22:], [1]))  # eager again
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-4)
    assert cache.get_seq_length() == 24
    assert torch.equal(cache.layers[0].positions(), torch.arange(24).expand(2, 24))


def test_compiled_steps_past_the_capacity_are_reported_at_the_next_eager_call():
    model = _QWEN
    cache = FSQCache(model, capacity=12)
    step = _compiled_step(model, cache)
    with torch.no_grad():
        _through_cache(model, cache, IDS[:, :10], [])
        for t in range(10, 14):  # two steps past the capacity: nothing can raise in a graph
            step(IDS[:, t:t + 1])
    with pytest.raises(CapacityError, match=r"capacity=12\) was given 14 positions"):
        cache.get_seq_length()
    cache.crop(12)  # the positions that fit are kept
    assert cache.get_seq_length() == 12
    ref = FSQCache(model, capacity=12)
    _through_cache(model, ref, IDS[:, :12], [])
    assert torch.equal(cache.layer_codes(1), ref.layer_codes(1))


def test_compiled_steps_refuse_what_they_cannot_trace():
    # (fullgraph=True reports the refusal as dynamo's Unsupported, quoting it)
    refused = (NotImplementedError, torch._dynamo.exc.Unsupported)
    model = _QWEN
    kw = cache_kwarg(model)
    cache = FSQCache(model, capacity=20)
    step = _compiled_step(model, cache)
    with torch.no_grad(), pytest.raises(refused, match="one token per sequence"):
        step(IDS[:, :4])  # a compiled prefill
    cache = FSQCache(model, capacity=20)
    step = _compiled_step(model, cache)
    with torch.no_grad():  # a prompt whose positions are not its indices (as padding makes)
        model(IDS[:, :4], position_ids=torch.arange(1, 5)[None], use_cache=True, **{kw: cache})
        with pytest.raises(refused, match="an unpadded batch"):
            step(IDS[:, 4:5])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="this process already interprets: the module runs directly")
def test_fsq_cache_triton_path_under_the_interpreter():
    pytest.importorskip("triton")
    out = run_interpreted(Path(__file__).with_name("test_fsq_cache_interpreted.py"), timeout=600)
    assert "2 passed" in out


def test_generate_compiles_the_capacity_cache_by_itself(converted):
    """The cache is compileable, so ``generate`` compiles its decode steps (here forced onto
    the CPU, eager backend): one graph for every step (the decode-step mask has a fixed size),
    the eager run's tokens and logits, and no length read back during generation."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    _, model = converted
    kw = cache_kwarg(model)
    config = CompileConfig(backend="eager", fullgraph=True)
    config._compile_all_devices = True  # (generate compiles on GPUs only, otherwise)
    runs = {}
    for compiled in (False, True):
        cache = FSQCache(model, capacity=40)
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            out = model.generate(IDS[:, :12], attention_mask=torch.ones_like(IDS[:, :12]),
                                 max_new_tokens=10, do_sample=False, pad_token_id=1,
                                 disable_compile=not compiled, compile_config=config,
                                 output_logits=True, return_dict_in_generate=True,
                                 **{kw: cache})
        runs[compiled] = (out.sequences, torch.stack(out.logits, 1),
                          counters["stats"]["unique_graphs"], cache.layers[1].length)
    (tokens, logits, graphs, length), (want_tokens, want, eager_graphs, _) = runs[True], runs[False]
    assert eager_graphs == 0 and graphs == 1 and length is None
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("capacity", [None, 30])
def test_copies_and_pickles_continue_as_the_original(capacity):
    import copy
    import pickle
    import threading

    model = _QWEN
    cache = FSQCache(model, capacity=capacity)
    _through_cache(model, cache, IDS[:, :12], [])
    cache._captured[0] = (None, threading.Lock())  # (like a CUDA graph: neither copies)
    copies = [copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))]
    want = _through_cache(model, cache, IDS[:, 12:16], [1, 2])
    for other in copies:
        assert other._captured == {}
        torch.testing.assert_close(_through_cache(model, other, IDS[:, 12:16], [1, 2]), want,
                                   rtol=0, atol=0)
