"""The codes-only cache decoding through the Triton kernel, run by Triton's CPU interpreter.

Needs ``TRITON_INTERPRET=1`` from process start (see ``test_kernels_interpreted.py``);
``test_serving_cache.py::test_triton_path_under_the_interpreter`` starts such a process.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 from process start", allow_module_level=True)

from adapters_fixtures import TINY_MODELS, torch  # noqa: E402
from serving_fixtures import (  # noqa: E402
    random_quantizer,
    step_logits,
)

from model_adapters.caches.codes_only import CodesOnlyCache, use_codes_attention  # noqa: E402
from model_adapters.models import cache_kwarg  # noqa: E402


def test_triton_decode_matches_the_lookup_path(monkeypatch):
    import kernels

    calls = []
    kernel_api = kernels.decode_attention

    def spy(*args, **kwargs):
        calls.append(kwargs["backend"])
        return kernel_api(*args, **kwargs)

    monkeypatch.setattr(kernels, "decode_attention", spy)
    import model_adapters.caches.codes_only as codes_only

    validated = []
    validate = codes_only.validate_coded_cache

    def count(*args, **kwargs):
        validated.append(1)
        return validate(*args, **kwargs)

    monkeypatch.setattr(codes_only, "validate_coded_cache", count)
    # Qwen3: grouped queries and RoPE'd keys (GPT-2's plain heads take the same kernel path)
    model = use_codes_attention(TINY_MODELS["qwen3"]().to(torch.bfloat16))
    q = random_quantizer(model)
    ids = torch.randint(2, 100, (2, 25), generator=torch.Generator().manual_seed(5))
    window = dict(sinks=2, recent=4)
    # on the CPU "torch" takes the float32 look-up path, "triton" the kernel
    want = step_logits(model, CodesOnlyCache(model, q, backend="torch", **window), ids, 22)
    assert not calls
    got = step_logits(model, CodesOnlyCache(model, q, backend="triton", **window), ids, 22)
    assert calls and set(calls) == {"triton"}
    # each layer validated its cache once, the first time it took the kernel path
    assert len(validated) == model.config.num_hidden_layers < len(calls)
    want, got = want.float(), got.float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_capacity_cache_decodes_through_the_kernel():
    """The static buffers as the kernel reads them: newest-first window, codes with a scratch
    slot, lengths on the device."""
    model = use_codes_attention(TINY_MODELS["qwen3"]().to(torch.bfloat16))
    q = random_quantizer(model)
    ids = torch.randint(2, 100, (2, 20), generator=torch.Generator().manual_seed(6))
    window = dict(sinks=2, recent=4, rewind=3, capacity=24)
    caches = {b: CodesOnlyCache(model, q, backend=b, **window) for b in ("torch", "triton")}
    want = step_logits(model, caches["torch"], ids, 15)
    got = step_logits(model, caches["triton"], ids, 15)
    assert caches["triton"].layers[0].kernel_backend == "triton"
    assert caches["torch"].layers[0].kernel_backend == "torch"
    want, got = want.float(), got.float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_padded_decode_steps_take_the_kernel_with_per_sequence_lengths(monkeypatch):
    # a left-padded batch: the kernel reads each sequence's own window through the lengths of
    # its CodedCache, and gives each row what the sequence's own (unpadded) cache gives
    import kernels

    calls = []
    kernel_api = kernels.decode_attention

    def spy(query, cache, **kwargs):  # whether the sequences' archives differ in length
        lengths = cache.with_lengths().archived_lengths.tolist()
        calls.append(len(set(lengths)) > 1)
        return kernel_api(query, cache, **kwargs)

    monkeypatch.setattr(kernels, "decode_attention", spy)
    model = use_codes_attention(TINY_MODELS["qwen3"]().to(torch.bfloat16))
    q = random_quantizer(model)
    g = torch.Generator().manual_seed(6)
    short, long = (torch.randint(2, 100, (1, n), generator=g) for n in (12, 19))
    window = dict(sinks=2, recent=4, block=2, backend="triton")
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_scores=True,
                    return_dict_in_generate=True)
    kw = cache_kwarg(model)
    with torch.no_grad():
        alone = [torch.stack(model.generate(s, **settings,
                                            **{kw: CodesOnlyCache(model, q, **window)}).scores, 1)
                 for s in (short, long)]
        assert calls and not any(calls)
        calls.clear()
        batch = torch.cat([torch.cat([torch.zeros(1, 7, dtype=torch.long), short], 1), long])
        mask = (torch.arange(19)[None] >= torch.tensor([[7], [0]])).long()
        both = torch.stack(model.generate(batch, attention_mask=mask, **settings,
                                          **{kw: CodesOnlyCache(model, q, **window)}).scores, 1)
    assert calls and all(calls)  # every decode step: the kernel, with per-sequence lengths
    for b, want in enumerate(alone):
        got, want = both[b : b + 1].float(), want.float()
        assert (got - want).abs().max() <= 0.02 * want.abs().max()
