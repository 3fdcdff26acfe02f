"""FSQCache rotates its keys with the model's own RoPE frequencies.

``model.to(torch.bfloat16)`` casts a Qwen3 rotary embedding's ``inv_freq`` buffer to bfloat16
(relative error up to 2^-9), and the model rotates its queries with those rounded frequencies.
Keys rotated with theta's exact frequencies then drift from the queries by ``position *
error``: radians at 8K positions. These tests hold the frequencies rounded as the cast rounds
them and compare FSQCache with the model's own forward at large positions.
"""

from __future__ import annotations

import torch

import model_adapters.caches.fsq_cache as fsq_cache
from kernels import RopeFrequencies
from model_adapters.caches.fsq_cache import FSQCache, rope_angles, rotary_embedding
from model_adapters.models import cache_kwarg
from model_adapters.quant.fsq_convert import convert_to_fsq
from tests.model_adapters.test_fsq_models import IDS, qwen3

OFFSET = 200  # positions 200..223: a bf16-rounded frequency is off by up to 0.4 rad there


def _rounded_rope_model():
    model = convert_to_fsq(qwen3(), "fsq-w8-L16", IDS)
    rotary = rotary_embedding(model)
    rotary.inv_freq = rotary.inv_freq.to(torch.bfloat16).float()  # as model.to(bf16) rounds
    return model


def _steps(model, cache, ids, split):
    kw, n = cache_kwarg(model), ids.shape[1]
    pos = torch.arange(OFFSET, OFFSET + n)[None].expand(ids.shape[0], n)
    with torch.no_grad():
        out = [model(ids[:, :split], position_ids=pos[:, :split], use_cache=True,
                     **{kw: cache}).logits]
        for t in range(split, n):
            out.append(model(ids[:, t:t + 1], position_ids=pos[:, t:t + 1], use_cache=True,
                             **{kw: cache}).logits)
    return torch.cat(out, 1), pos


def test_fsq_cache_follows_rounded_rope_frequencies_at_large_positions():
    model = _rounded_rope_model()
    got, pos = _steps(model, FSQCache(model, backend="torch"), IDS, 16)
    with torch.no_grad():
        full = model(IDS, position_ids=pos).logits
    assert torch.allclose(got, full, atol=1e-5, rtol=1e-4), float((got - full).abs().max())


def test_rope_angles_match_the_models_rotary_embedding():
    model = _rounded_rope_model()
    rotary = rotary_embedding(model)
    pos = torch.tensor([[0, 1, 7, 4000, 8191]])
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos)
    mine = rope_angles(rotary.inv_freq, pos[0], 16)
    assert torch.equal(mine[0], cos[0]) and torch.equal(mine[1], sin[0])
    # a float theta gives transformers' float32 frequencies
    exact = convert_to_fsq(qwen3(), "fsq-w8-L16", IDS)
    theta = exact.model.layers[0].self_attn.fsq_rope_theta
    ref = rotary_embedding(exact)(torch.zeros(1), pos)
    assert all(torch.equal(a, b[0]) for a, b in zip(rope_angles(theta, pos[0], 16), ref,
                                                     strict=True))


def test_kernel_route_gets_the_models_frequencies(monkeypatch):
    """The decode steps sent to the kernel receive the model's rounded frequencies
    (``RopeFrequencies``; theta only when the model's frequencies are theta's); the kernel's
    reference stands in for the kernel on the CPU."""
    seen = []

    def reference(*args, rope=None, backend=None, **kwargs):
        seen.append(rope)
        return fsq_cache.fsq_decode_attention.__wrapped__(*args, rope=rope, backend="torch",
                                                          **kwargs)

    reference.__wrapped__ = fsq_cache.fsq_decode_attention
    monkeypatch.setattr(fsq_cache, "fsq_decode_attention", reference)
    model = convert_to_fsq(qwen3(), "fsq-w8-L16", IDS).to(torch.bfloat16)
    assert rotary_embedding(model).inv_freq.dtype == torch.bfloat16
    kernel = FSQCache(model, backend="triton")
    got, _ = _steps(model, kernel, IDS[:1], 20)
    torch_path, _ = _steps(model, FSQCache(model, backend="torch"), IDS[:1], 20)
    assert kernel.kernel_calls == 4 * 2 and all(isinstance(r, RopeFrequencies) for r in seen)
    inv = rotary_embedding(model).inv_freq
    assert seen[-1].inv_freq == tuple(inv.double().tolist())
    assert (got.float() - torch_path.float()).abs().max() < 0.05 * torch_path.float().abs().max()
    # float32 frequencies equal to theta's: the kernel gets theta (its exact angle tables)
    seen.clear()
    exact = convert_to_fsq(qwen3(), "fsq-w8-L16", IDS).to(torch.bfloat16)
    rotary = rotary_embedding(exact)
    theta = exact.model.layers[0].self_attn.fsq_rope_theta
    rotary.inv_freq = 1.0 / theta ** (torch.arange(0, 16, 2).float() / 16)  # as computed
    _steps(exact, FSQCache(exact, backend="triton"), IDS[:1], 22)
    assert seen and all(r == theta for r in seen)
