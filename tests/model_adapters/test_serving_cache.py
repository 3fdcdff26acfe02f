"""The codes-only cache: same logits as the archiving cache, real memory saved, generate."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from adapters_fixtures import TINY_MODELS, torch
from hypothesis import given
from hypothesis import strategies as st
from interpreted import run_interpreted
from serving_fixtures import (
    caches,
    dense_attention,
    model_pair,
    random_quantizer,
    step_logits,
)

from kernels import CodedCache
from model_adapters.caches.archiving import ArchivingCache
from model_adapters.caches.code_rows import CodeRows
from model_adapters.caches.codes_attention import CODES_ATTENTION, lookup_attention
from model_adapters.caches.codes_only import CodesOnlyCache, dense_cache_bytes, use_codes_attention
from model_adapters.models import cache_kwarg
from model_adapters.quant.rvq import decode

DynamicCache = pytest.importorskip("transformers").DynamicCache
IDS = torch.randint(2, 100, (2, 48), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
@pytest.mark.parametrize(
    ("sinks", "recent", "prefill", "chunk"),
    [(4, 8, 20, 1), (0, 5, 1, 1), (3, 0, 16, 1), (2, 6, 10, 5)],
)
def test_logits_equal_archiving_cache(arch, sinks, recent, prefill, chunk):
    ref, model = model_pair(arch)
    q = random_quantizer(ref)
    arc, codes = caches(ref, model, q, sinks=sinks, recent=recent)
    want = step_logits(ref, arc, IDS, prefill, chunk)
    got = step_logits(model, codes, IDS, prefill, chunk)
    assert codes.archived_tokens == arc.archived_tokens == 48 - sinks - recent
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
@pytest.mark.parametrize(("block", "prefill", "chunk"), [(4, 20, 1), (3, 10, 5), (16, 1, 1)])
def test_grouped_archiving_matches_the_archiving_cache(arch, block, prefill, chunk):
    ref, model = model_pair(arch)
    q = random_quantizer(ref)
    arc, codes = caches(ref, model, q, sinks=2, recent=6, block=block)
    kw_ref, kw = cache_kwarg(ref), cache_kwarg(model)
    windows = []
    with torch.no_grad():
        for t in [0, *range(prefill, 48, chunk)]:
            ids = IDS[:, t : prefill if t == 0 else t + chunk]
            want = ref(ids, **{kw_ref: arc}).logits
            got = model(ids, **{kw: codes}).logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert codes.archived_tokens == arc.archived_tokens
            windows.append(codes.get_seq_length() - 2 - codes.archived_tokens)
    # the exact window holds recent .. recent + block - 1 positions once it is full
    assert all(w < 6 + block for w in windows)
    assert max(windows) > 6
    assert codes.archived_tokens > 0


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_codes_are_the_archiving_caches_codes(arch):
    ref, model = model_pair(arch)
    q = random_quantizer(ref)
    arc = ArchivingCache(ref.config, q, sinks=2, recent=4, rows=CodeRows(2))
    codes = CodesOnlyCache(model, q, sinks=2, recent=4, rows=CodeRows(2))
    one = IDS[:1, :30]
    step_logits(ref, arc, one, 10)
    step_logits(model, codes, one, 10)
    assert arc.rows.all_rows().shape == (24, q.row_width)
    assert (arc.rows.all_rows() == codes.rows.all_rows()).all()
    # attention's reconstruction is the archiving cache's stored one, bit for bit (the exact
    # window differs only by the rounding of earlier layers' attention)
    for layer_a, layer_c in zip(arc.layers, codes.layers, strict=True):
        k, v = layer_c.dense(torch.float32)
        assert torch.equal(k[:, :, 2:26], layer_a.keys[:, :, 2:26])
        assert torch.equal(v[:, :, 2:26], layer_a.values[:, :, 2:26])
        torch.testing.assert_close(k, layer_a.keys)
        torch.testing.assert_close(v, layer_a.values)


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_bfloat16_decode_matches_the_archiving_cache(arch):
    ref, model = model_pair(arch, torch.bfloat16)
    q = random_quantizer(ref)
    arc, codes = caches(ref, model, q, sinks=4, recent=6)
    want = step_logits(ref, arc, IDS, 12).float()
    got = step_logits(model, codes, IDS, 12).float()
    # bf16 logits: decoding adds centroids in float32, the archiving cache stores them in bf16
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    # the kernel call and the float32 look-up path agree on the same layer state
    from kernels import decode_attention, rvq_decode_attention

    layer = codes.layers[1]
    s = layer.coded_cache()
    query = torch.randn(2, model.config.num_attention_heads, 1, s.sink_keys.shape[-1])
    query = query.to(torch.bfloat16)
    kernel = rvq_decode_attention(
        query[:, :, 0], s.key_codes, s.value_codes, s.key_codebooks, s.value_codebooks,
        sink_keys=s.sink_keys, sink_values=s.sink_values, recent_keys=s.recent_keys,
        recent_values=s.recent_values, backend="torch",
    )
    scale = s.sink_keys.shape[-1] ** -0.5
    look = lookup_attention(query.float(), s, scale=scale)
    torch.testing.assert_close(kernel.float(), look[:, :, 0], rtol=2e-2, atol=2e-2)
    # the trusted per-step entry point reads the same CodedCache
    trusted = decode_attention(query[:, :, 0], s, scale=scale, backend="torch")
    torch.testing.assert_close(trusted, kernel, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_cpu_decode_takes_the_lookup_path(backend, monkeypatch):
    import kernels

    def refuse(*args, **kwargs):
        raise AssertionError("a CPU decode step called the kernel API")

    ref, model = model_pair("qwen3", torch.bfloat16)
    q = random_quantizer(ref)
    arc, codes = caches(ref, model, q, sinks=2, recent=4)
    codes.backend = backend
    monkeypatch.setattr(kernels, "rvq_decode_attention", refuse)
    monkeypatch.setattr(kernels, "decode_attention", refuse)
    want = step_logits(ref, arc, IDS, 12).float()
    got = step_logits(model, codes, IDS, 12).float()
    assert codes.archived_tokens == 48 - 6
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_kernel_routing_rule():
    from types import SimpleNamespace

    from model_adapters.caches.codes_attention import _kernel_path

    shape = (1, 4, 8)  # (batch, q_heads, head_dim): one decode step
    cuda = SimpleNamespace(is_cuda=True, shape=shape, dtype=torch.bfloat16)
    cpu = SimpleNamespace(is_cuda=False, shape=shape, dtype=torch.bfloat16)

    def state(dtype, value_stages=2, value_codebook=256):
        codes = torch.zeros(1, dtype=dtype)
        books = torch.zeros(2, value_stages, value_codebook, 8)
        return SimpleNamespace(key_codes=codes, value_codes=codes, value_codebooks=books)

    assert _kernel_path("torch", cuda, state(torch.int16))
    assert not _kernel_path("torch", cpu, state(torch.uint8))
    # codebooks over 32,768 centroids get int32 codes: the kernel API refuses them
    assert not _kernel_path("torch", cuda, state(torch.int32))
    assert not _kernel_path("auto", cuda, state(torch.int32))
    assert _kernel_path("triton", cpu, state(torch.int32))  # asked for: the API explains
    # float32 decode steps never reach the kernel API, whatever the backend
    f32 = SimpleNamespace(is_cuda=True, shape=shape, dtype=torch.float32)
    for backend in ("auto", "triton", "torch"):
        assert not _kernel_path(backend, f32, state(torch.int16))
    from kernels import triton_available

    if triton_available():
        assert _kernel_path("auto", cuda, state(torch.int16))
        # a value histogram the kernels cannot hold goes to the look-ups, not to the
        # kernel API's dequantizing reference
        assert not _kernel_path("auto", cuda, state(torch.int16, 4, value_codebook=32768))


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_generate_batch_two_with_left_padding(arch):
    ref, model = model_pair(arch)
    q = random_quantizer(ref)
    ids = IDS[:, :12].clone()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second prompt is 3 tokens shorter, left-padded
    ids[1, :3] = 0
    kw = cache_kwarg(model)
    settings = dict(
        attention_mask=mask, max_new_tokens=24, do_sample=False, output_scores=True,
        return_dict_in_generate=True, pad_token_id=0,
    )
    arc, codes = caches(ref, model, q, sinks=2, recent=5)
    with torch.no_grad():
        want = ref.generate(ids, **settings, **{kw: arc})
        got = model.generate(ids, **settings, **{kw: codes})
    assert codes.archived_tokens > 0
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores),
                               rtol=1e-4, atol=1e-4)


def test_generate_beam_search_reorders_codes():
    ref, model = model_pair("gpt2")
    q = random_quantizer(ref)
    kw = cache_kwarg(model)
    settings = dict(max_new_tokens=16, num_beams=3, do_sample=False, pad_token_id=0,
                    attention_mask=torch.ones(1, 10, dtype=torch.long))
    arc, codes = caches(ref, model, q, sinks=2, recent=4)
    with torch.no_grad():
        want = ref.generate(IDS[:1, :10], **settings, **{kw: arc})
        got = model.generate(IDS[:1, :10], **settings, **{kw: codes})
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_live_bytes_stay_flat_while_dynamic_cache_grows(arch):
    model = use_codes_attention(TINY_MODELS[arch](vocab_size=101))
    q = random_quantizer(model)
    kw = cache_kwarg(model)
    # no rewind margin (default 32 positions, as large as this whole test's window)
    codes = CodesOnlyCache(model, q, sinks=4, recent=8, rewind=0)
    dyn = DynamicCache(config=model.config)
    ids = torch.randint(2, 100, (1, 120), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(ids, **{kw: codes})
        model(ids, **{kw: dyn})
    live = codes.live_bytes()
    shape = codes.shape
    # window: sinks + recent exact positions, float32, K and V, every layer
    assert live["window"] == shape.num_layers * 2 * shape.kv_heads * 12 * shape.head_dim * 4
    # codes: one uint8 per stage, at the buffer's allocated capacity (at least what is used)
    used = shape.num_layers * shape.kv_heads * 108 * (q.key_stages + q.value_stages)
    assert used <= live["codes"] <= 256 * used // 108
    assert live["codebooks"] == q.key_codebooks.nbytes + q.value_codebooks.nbytes
    per_token_dense = shape.num_layers * 2 * shape.kv_heads * shape.head_dim * 4
    assert dense_cache_bytes(dyn) == 120 * per_token_dense
    assert live["window"] + live["codes"] < dense_cache_bytes(dyn) / 4


def test_wrong_attention_implementation_is_refused():
    model = TINY_MODELS["gpt2"]()  # still on sdpa
    q = random_quantizer(model)
    with pytest.raises(ValueError, match=CODES_ATTENTION):
        CodesOnlyCache(model, q)
    # built from a config, the cache notices on the first layer update that nobody read it
    cache = CodesOnlyCache(model.config, q, sinks=1, recent=2)
    with pytest.raises(RuntimeError, match="use_codes_attention"), torch.no_grad():
        model(IDS[:, :8], **{cache_kwarg(model): cache})


def test_bad_arguments():
    model = use_codes_attention(TINY_MODELS["gpt2"]())
    q = random_quantizer(model)
    other = random_quantizer(TINY_MODELS["qwen3"]())
    with pytest.raises(ValueError, match="quantizer was built for"):
        CodesOnlyCache(model, other)
    with pytest.raises(ValueError, match="K2V0"):
        CodesOnlyCache(model, q.prefix(2, 0))
    with pytest.raises(ValueError, match="rewind"):
        CodesOnlyCache(model, q, rewind=-1)
    with pytest.raises(ValueError, match="block must be a positive int, got 0"):
        CodesOnlyCache(model, q, block=0)
    with pytest.raises(ValueError, match="backend"):
        CodesOnlyCache(model, q, backend="cuda")
    with pytest.raises(TypeError, match="KVQuantizer"):
        CodesOnlyCache(model, q.key_codebooks)


def test_sdpa_fallback_for_other_caches():
    """A model switched to the codes attention still runs a plain DynamicCache exactly."""
    ref, model = model_pair("qwen3")
    kw = cache_kwarg(model)
    with torch.no_grad():
        want = ref(IDS, **{kw: DynamicCache(config=ref.config)}).logits
        got = model(IDS, **{kw: DynamicCache(config=model.config)}).logits
    torch.testing.assert_close(got, want)


@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    q_len=st.integers(1, 3),
    sinks=st.integers(0, 3),
    archived=st.integers(0, 9),
    recent=st.integers(1, 4),
    stages=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    size=st.integers(1, 8),
    masked=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_lookup_attention_matches_dense_oracle(
    batch, kv_heads, group, q_len, sinks, archived, recent, stages, size, masked, seed
):
    g = torch.Generator().manual_seed(seed)
    d = 8

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    kb, vb = rnd(kv_heads, stages[0], size, d), rnd(kv_heads, stages[1], size, d)
    kc = torch.randint(0, size, (batch, kv_heads, archived, stages[0]), generator=g)
    vc = torch.randint(0, size, (batch, kv_heads, archived, stages[1]), generator=g)
    kc, vc = kc.to(torch.uint8), vc.to(torch.uint8)
    sk, sv = rnd(batch, kv_heads, sinks, d), rnd(batch, kv_heads, sinks, d)
    rk, rv = rnd(batch, kv_heads, recent, d), rnd(batch, kv_heads, recent, d)
    query = rnd(batch, kv_heads * group, q_len, d)
    n = sinks + archived + recent
    mask = None
    if masked:
        mask = torch.rand(batch, 1, q_len, n, generator=g) < 0.7
        mask[..., -1] = True  # every query sees at least its own position
    keys = torch.cat([sk, decode(kc, kb), rk], 2)
    values = torch.cat([sv, decode(vc, vb), rv], 2)
    want = dense_attention(query, keys, values, mask, 0.3)
    cache = CodedCache(key_codes=kc, value_codes=vc, key_codebooks=kb, value_codebooks=vb,
                       sink_keys=sk, sink_values=sv, recent_keys=rk, recent_values=rv)
    got = lookup_attention(query, cache, mask=mask, scale=0.3)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="this process already interprets: the module runs directly")
def test_triton_path_under_the_interpreter():
    pytest.importorskip("triton")
    out = run_interpreted(Path(__file__).with_name("test_serving_interpreted.py"), timeout=600)
    assert "3 passed" in out


def test_collecting_rows_needs_batch_one_and_forbids_reset():
    _, model = model_pair("gpt2")
    q = random_quantizer(model)
    cache = CodesOnlyCache(model, q, sinks=1, recent=2, rows=CodeRows(2))
    with pytest.raises(ValueError, match="batch size 1"), torch.no_grad():
        model(IDS[:, :6], **{cache_kwarg(model): cache})
    assert cache.get_seq_length() == 0  # refused before anything was stored
    step_logits(model, cache, IDS[:1, :6], 6)
    with pytest.raises(ValueError, match="cannot reset"):
        cache.reset()
    assert cache.get_seq_length() == 6 and cache.rows.emitted == 3
    plain = CodesOnlyCache(model, q, sinks=1, recent=2)
    step_logits(model, plain, IDS[:, :6], 6)
    plain.reset()
    assert plain.get_seq_length() == 0
    step_logits(model, plain, IDS[:, :6], 6)  # usable again
    assert plain.archived_tokens == 3


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_archiving_cache_reset_starts_over_unless_codes_went_out(arch):
    ref, model = model_pair(arch)
    q = random_quantizer(model)
    cache = ArchivingCache(ref.config, q, sinks=1, recent=3, rewind=4)
    step_logits(ref, cache, IDS[:, :20], 12)
    assert cache.layers[0].archived_until > 1  # archived, with exact copies kept for crops
    cache.reset()
    assert cache.get_seq_length() == 0
    other = IDS.flip(1)[:, :24]
    want = step_logits(ref, ArchivingCache(ref.config, q, sinks=1, recent=3, rewind=4), other, 9)
    torch.testing.assert_close(step_logits(ref, cache, other, 9), want, rtol=0, atol=0)
    collected = ArchivingCache(ref.config, q, sinks=1, recent=3, rows=CodeRows(2))
    step_logits(ref, collected, IDS[:1, :12], 6)
    with pytest.raises(ValueError, match="cannot reset layer 0: positions up to .* rows"):
        collected.reset()
    assert collected.get_seq_length() == 12  # nothing changed


@pytest.mark.parametrize("kind", ["archiving", "codes-only"])
@pytest.mark.parametrize("prefill", [0, 4])  # the failing pass: a chunk of 8, one token
def test_a_rows_collector_that_raises_stops_the_cache(kind, prefill):
    # the collector raises in the last layer: its layers are out of step with the collector
    # (and the archiving cache's last layer holds overwritten positions), so the next pass
    # must refuse, naming the collector. Before, the archiving cache named the attention
    # implementation after a chunk, and both caches went on after a single token.
    ref, model = model_pair("gpt2")
    rows = CodeRows(ref.config.n_layer)
    q = random_quantizer(model)
    if kind == "archiving":
        cache = ArchivingCache(ref.config, q, sinks=1, recent=2, rows=rows)
    else:
        cache, ref = CodesOnlyCache(model, q, sinks=1, recent=2, rows=rows), model
    add, last = cache.rows.add, ref.config.n_layer - 1

    def failing_add(layer_idx, kc, vc):
        if layer_idx == last:
            raise OSError("disk full")
        add(layer_idx, kc, vc)

    if prefill:
        step_logits(ref, cache, IDS[:1, :prefill], prefill)
    cache.rows.add = failing_add
    with pytest.raises(OSError, match="disk full"):
        step_logits(ref, cache, IDS[:1, prefill : prefill + (1 if prefill else 8)], 8)
    cache.rows.add = add
    with pytest.raises(RuntimeError, match=f"rows collector raised OSError in layer {last}"):
        step_logits(ref, cache, IDS[:1, 8:10], 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_gpu_decode_runs_the_kernel_and_matches_the_reference(arch, monkeypatch):
    import kernels

    calls = []
    real = kernels.decode_attention

    def spy(query, cache, **kwargs):
        calls.append((kwargs["backend"], kernels.kernel_takes(query, cache)))
        return real(query, cache, **kwargs)

    monkeypatch.setattr(kernels, "decode_attention", spy)
    model = use_codes_attention(TINY_MODELS[arch]().to(torch.bfloat16).cuda())
    q = random_quantizer(model)
    ids = IDS.cuda()
    window = dict(sinks=2, recent=4)
    # "torch" on CUDA tensors: the dequantizing reference; "auto": the kernel
    want = step_logits(model, CodesOnlyCache(model, q, backend="torch", **window), ids, 40)
    reference_calls, calls[:] = list(calls), []
    got = step_logits(model, CodesOnlyCache(model, q, backend="auto", **window), ids, 40)
    assert reference_calls and {b for b, _ in reference_calls} == {"torch"}
    # "auto" was decided once per step (kernel_takes) and sent to the kernel as "triton"
    assert calls and all(b == "triton" and takes for b, takes in calls)
    want, got = want.float(), got.float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
