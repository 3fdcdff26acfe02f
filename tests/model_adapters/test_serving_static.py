"""The codes-only cache with a capacity (static shapes): the archiving cache's logits in
float64, chunk invariance, compiled decode steps without graph breaks, capacity errors, crops,
generate; on a GPU, generate's own compilation with CUDA graphs."""

from __future__ import annotations

import pytest
from adapters_fixtures import TINY_MODELS, torch
from serving_fixtures import caches, model_pair, random_quantizer, step_logits

from model_adapters.caches.code_rows import CodeRows
from model_adapters.caches.codes_attention import LAYER_ATTR
from model_adapters.caches.codes_only import CapacityError, CodesOnlyCache, use_codes_attention
from model_adapters.models import cache_kwarg

IDS = torch.randint(2, 100, (2, 40), generator=torch.Generator().manual_seed(3))
# (sinks, recent, rewind, prefill, chunk): no sinks, no recent window, no rewind margin, a
# prefill shorter than the sinks, chunks that cross the window's edge
WINDOWS = [(4, 8, 3, 20, 1), (0, 5, 0, 1, 1), (3, 0, 2, 16, 1), (2, 6, 4, 10, 5), (5, 3, 32, 2, 3)]


def state(cache):
    """Every buffer and the length of every layer, copied."""
    return [(int(layer.length), *(t.clone() for kind in layer.tensors().values() for t in kind))
            for layer in cache.layers]


def same_state(a, b) -> bool:
    return all(x[0] == y[0] and all(map(torch.equal, x[1:], y[1:]))
               for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
@pytest.mark.parametrize(("sinks", "recent", "rewind", "prefill", "chunk"), WINDOWS)
def test_capacity_logits_equal_the_archiving_cache(arch, sinks, recent, rewind, prefill, chunk):
    ref, model = model_pair(arch, torch.float64)
    q = random_quantizer(ref)
    window = dict(sinks=sinks, recent=recent, rewind=rewind)
    arc, _ = caches(ref, model, q, **window)
    static = CodesOnlyCache(model, q, capacity=48, **window)
    want = step_logits(ref, arc, IDS, prefill, chunk)
    got = step_logits(model, static, IDS, prefill, chunk)
    assert static.is_compileable and static.get_seq_length() == 40
    assert static.archived_tokens == arc.archived_tokens == max(0, 40 - sinks - recent)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_capacity_cache_is_chunk_invariant(arch):
    _, model = model_pair(arch, torch.float64)
    q = random_quantizer(model)
    runs = [step_logits(model, CodesOnlyCache(model, q, sinks=3, recent=5, capacity=40), IDS,
                        prefill, chunk) for prefill, chunk in ((1, 1), (13, 4), (40, 1), (2, 9))]
    for got in runs[1:]:
        torch.testing.assert_close(got, runs[0], rtol=1e-10, atol=1e-10)


def test_compiled_decode_steps_have_no_graph_break_and_match():
    _, model = model_pair("qwen3")
    q = random_quantizer(model)
    kw = cache_kwarg(model)
    window = dict(sinks=2, recent=4, rewind=2, capacity=32)
    want = step_logits(model, CodesOnlyCache(model, q, **window), IDS[:, :12], 5)
    cache = CodesOnlyCache(model, q, **window)
    torch._dynamo.reset()
    step = torch.compile(lambda ids: model(ids, **{kw: cache}).logits, fullgraph=True,
                         backend="eager")
    outs = []
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        outs.append(model(IDS[:, :5], **{kw: cache}).logits)  # prefill, eager
        outs += [step(IDS[:, t : t + 1]) for t in range(5, 12)]  # one graph for every step
    torch.testing.assert_close(torch.cat(outs, 1), want)
    assert cache.get_seq_length() == 12 and cache.archived_tokens == 6  # read back once


def test_capacity_exhaustion_raises_before_changing_anything():
    _, model = model_pair("gpt2")
    q = random_quantizer(model)
    cache = CodesOnlyCache(model, q, sinks=2, recent=3, capacity=12)
    with pytest.raises(CapacityError, match="capacity is 12"):
        step_logits(model, cache, IDS[:, :13], 13)
    assert cache.get_seq_length() == 0
    step_logits(model, cache, IDS[:, :12], 10)
    before = state(cache)
    with pytest.raises(CapacityError, match="holds 12 positions and cannot take 1 more"):
        step_logits(model, cache, IDS[:, 12:13], 1)
    with pytest.raises(CapacityError):
        step_logits(model, cache, IDS[:, 12:14], 2)
    assert same_state(state(cache), before)
    cache.crop(-2)  # room again
    step_logits(model, cache, IDS[:, 10:12], 2)
    assert cache.get_seq_length() == 12


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_crop_then_continue_is_a_fresh_run(arch):
    _, model = model_pair(arch, torch.float64)
    q = random_quantizer(model)
    window = dict(sinks=2, recent=4, rewind=5, capacity=40)
    cache = CodesOnlyCache(model, q, **window)
    step_logits(model, cache, IDS[:, :30], 20)
    cache.crop(-5)
    assert cache.get_seq_length() == 25
    got = step_logits(model, cache, IDS[:, 25:33], 1)
    fresh = CodesOnlyCache(model, q, **window)
    want = step_logits(model, fresh, IDS[:, :33], 25)[:, 25:]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    before = state(cache)
    with pytest.raises(ValueError, match="larger rewind"):
        cache.crop(-10)
    assert same_state(state(cache), before)


def test_capacity_arguments_are_checked():
    _, model = model_pair("gpt2")
    q = random_quantizer(model)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="capacity must be a positive int"):
            CodesOnlyCache(model, q, capacity=bad)
    with pytest.raises(ValueError, match="block=4"):
        CodesOnlyCache(model, q, capacity=64, block=4)
    with pytest.raises(ValueError, match="rows collector"):
        CodesOnlyCache(model, q, capacity=64, rows=CodeRows(model.config.num_hidden_layers))


def test_left_padded_batch_is_refused():
    _, model = model_pair("qwen3")
    q = random_quantizer(model)
    cache = CodesOnlyCache(model, q, sinks=1, recent=2, capacity=32)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0
    with pytest.raises(ValueError, match="left-padded"), torch.no_grad():
        model.generate(IDS[:, :8], attention_mask=mask, max_new_tokens=2, do_sample=False,
                       **{cache_kwarg(model): cache})


def test_left_padding_is_seen_when_update_gets_no_position_ids(monkeypatch):
    # transformers 5.17 hands cache.update no position ids: the forward's own, noted by the
    # hooks of use_codes_attention, tell the padding (and are forgotten after the forward)
    _, model = model_pair("qwen3")
    q = random_quantizer(model)
    update = CodesOnlyCache.update

    def update_without_positions(self, *args, **kwargs):
        kwargs.pop("position_ids", None)
        inner = kwargs.get("kwargs")
        if isinstance(inner, dict):
            kwargs["kwargs"] = {k: v for k, v in inner.items() if k != "position_ids"}
        return update(self, *args, **kwargs)

    monkeypatch.setattr(CodesOnlyCache, "update", update_without_positions)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0
    cache = CodesOnlyCache(model, q, sinks=1, recent=2, capacity=32)
    with pytest.raises(ValueError, match=r"left-padded batch \(pads \[0, 3\]\)"), \
            torch.no_grad():
        model.generate(IDS[:, :8], attention_mask=mask, max_new_tokens=2, do_sample=False,
                       **{cache_kwarg(model): cache})
    assert cache.forward_position_ids is None
    growing = CodesOnlyCache(model, q, sinks=1, recent=2)
    with torch.no_grad():
        model.generate(IDS[:, :8], attention_mask=mask, max_new_tokens=2, do_sample=False,
                       **{cache_kwarg(model): growing})
    assert growing.layers[0].pads == [0, 3] and growing.forward_position_ids is None


def test_generate_with_a_capacity_gives_the_growing_cache_tokens():
    _, model = model_pair("qwen3")
    q = random_quantizer(model)
    kw = cache_kwarg(model)
    out = {}
    for name, extra in (("growing", {}), ("static", {"capacity": 30})):
        cache = CodesOnlyCache(model, q, sinks=2, recent=3, **extra)
        with torch.no_grad():
            out[name] = model.generate(IDS[:, :10], max_new_tokens=12, do_sample=False,
                                       **{kw: cache})
    assert torch.equal(out["static"], out["growing"])


def gpu_qwen3():
    """The tiny Qwen3 in bf16 on the GPU, switched to the codes attention, and a random
    quantizer for it."""
    model = use_codes_attention(TINY_MODELS["qwen3"]().to(torch.bfloat16).cuda())
    return model, random_quantizer(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_generate_compiles_with_cuda_graphs_and_matches_eager():
    from torch._dynamo.utils import counters

    model, q = gpu_qwen3()
    kw = cache_kwarg(model)
    ids = IDS[:, :16].cuda()
    runs = {}
    for name, compile_off in (("eager", True), ("compiled", False)):
        cache = CodesOnlyCache(model, q, sinks=2, recent=4, capacity=64)
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=24, do_sample=False,
                                 disable_compile=compile_off, output_logits=True,
                                 return_dict_in_generate=True, **{kw: cache})
        runs[name] = (torch.stack(out.logits, 1).float(), counters["stats"]["unique_graphs"],
                      cache.layers[0].kernel_backend)
    (want, eager_graphs, backend), (got, graphs, _) = runs["eager"], runs["compiled"]
    assert backend == "triton"  # the kernel runs the decode steps
    assert eager_graphs == 0 and graphs >= 1  # generate compiled the decode step by itself
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_captured_eager_steps_match_launched_steps():
    # eager decode steps replay each layer's captured kernel call; a new batch moves the
    # buffers (repeat_interleave), which must bring a new capture, not a stale replay
    model, q = gpu_qwen3()
    kw = cache_kwarg(model)
    runs = {}
    for capture in (False, True):
        cache = CodesOnlyCache(model, q, sinks=2, recent=4, capacity=64)
        cache.capture_eager_steps = capture
        ids, logits, captures = IDS[:1, :16].cuda(), [], []
        with torch.no_grad():
            for step in range(14):
                if step == 8:
                    cache.batch_repeat_interleave(2)
                    ids = ids.repeat_interleave(2, dim=0)
                feed = ids if step == 0 else ids[:, -1:]
                out = model(feed, **{kw: cache}).logits[:, -1].float()
                logits.append(out.repeat(2 // out.shape[0], 1))
                ids = torch.cat([ids, out.argmax(-1, keepdim=True)], dim=1)
                captures.append(len(cache.layers[0]._captured))
        runs[capture] = (torch.stack(logits), captures, cache.layers[0].kernel_backend)
    (want, none, backend), (got, captures, _) = runs[False], runs[True]
    assert backend == "triton" and set(none) == {0}
    assert captures[1:] == [1] * 13  # one live capture per layer, renewed for the new batch
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def reorder_select_crop_reset(model, cache):
    """Decode steps around a beam reorder, a batch selection, a crop and a reset (batch 2):
    each step's logits and the layer-0 captures alive after it."""
    kw = cache_kwarg(model)
    swap = torch.tensor([1, 0], device="cuda")
    logits, captures = [], []

    def prefill(ids):
        model(ids[:, :-1], **{kw: cache})
        return ids

    def steps(ids, n):
        for _ in range(n):
            out = model(ids[:, -1:], **{kw: cache}).logits[:, -1].float()
            logits.append(out)
            captures.append(len(cache.layers[0]._captured))
            ids = torch.cat([ids, out.argmax(-1, keepdim=True)], dim=1)
        return ids

    with torch.no_grad():
        ids = steps(prefill(IDS[:, :16].cuda()), 4)
        cache.reorder_cache(swap)  # in place: the same capture reads the new contents
        ids = steps(ids[swap], 3)
        cache.batch_select_indices(swap)  # new buffers of the same shape: a new capture
        ids = steps(ids[swap], 3)
        cache.crop(-2)  # lengths change in place
        ids = steps(ids[:, :-2], 3)
        cache.reset()
        steps(prefill(IDS[:, 20:32].cuda()), 3)
    return torch.stack(logits), captures


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_captured_steps_follow_reorder_select_crop_and_reset():
    model, q = gpu_qwen3()
    runs = {}
    for capture in (False, True):
        cache = CodesOnlyCache(model, q, sinks=2, recent=3, rewind=2, capacity=48)
        cache.capture_eager_steps = capture
        runs[capture] = reorder_select_crop_reset(model, cache)
    (want, none), (got, captures) = runs[False], runs[True]
    assert set(none) == {0} and captures == [1] * len(captures)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_compiled_steps_past_the_capacity_are_reported_at_the_next_eager_call():
    _, model = model_pair("gpt2")
    q = random_quantizer(model)
    kw = cache_kwarg(model)
    cache = CodesOnlyCache(model, q, sinks=1, recent=2, capacity=8)
    torch._dynamo.reset()
    step = torch.compile(lambda ids: model(ids, **{kw: cache}).logits, fullgraph=True,
                         backend="eager")
    with torch.no_grad():
        model(IDS[:, :6], **{kw: cache})
        for t in range(6, 10):  # two steps past the capacity: nothing can raise in a graph
            step(IDS[:, t : t + 1])
    with pytest.raises(CapacityError, match="past its capacity 8"):
        cache.get_seq_length()


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_beam_search_and_reset_match_the_growing_cache(arch):
    _, model = model_pair(arch)
    q = random_quantizer(model)
    kw = cache_kwarg(model)
    out = {}
    for name, extra in (("growing", {}), ("static", {"capacity": 40})):
        cache = CodesOnlyCache(model, q, sinks=2, recent=3, **extra)
        with torch.no_grad():
            beams = model.generate(IDS[:, :10], max_new_tokens=8, num_beams=3, do_sample=False,
                                   **{kw: cache})
            cache.reset()
            again = model.generate(IDS[:, :12], max_new_tokens=6, do_sample=False, **{kw: cache})
        out[name] = (beams, again)
    assert all(map(torch.equal, out["static"], out["growing"]))


def test_a_deep_copy_continues_like_the_original():
    import copy

    _, model = model_pair("qwen3", torch.float64)
    q = random_quantizer(model)
    cache = CodesOnlyCache(model, q, sinks=2, recent=3, rewind=2, capacity=40)
    step_logits(model, cache, IDS[:, :20], 12)
    cache.layers[0]._captured["key"] = object()  # stands for a captured call (a CUDA graph)
    twin = copy.deepcopy(cache)
    assert twin.layers[0]._captured == {}  # a copy captures its own calls, on its buffers
    assert len(cache.layers[0]._captured) == 1
    for mine, its in zip(twin.layers, cache.layers, strict=True):
        assert mine.window_k.data_ptr() != its.window_k.data_ptr()
        assert getattr(mine.window_k, LAYER_ATTR) is mine  # attention reads the copy's buffers
    torch.testing.assert_close(step_logits(model, twin, IDS[:, 20:30], 1),
                               step_logits(model, cache, IDS[:, 20:30], 1))
