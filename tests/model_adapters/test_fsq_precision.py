"""The key decoder rounded as a kernel of another precision computes it (fsq_precision), and the
harnesses' ``@form`` config suffix."""

import numpy as np
import pytest
import torch
from adapters_fixtures import tiny_qwen3 as qwen3
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from model_adapters.experiments.fsq_eval import convert_or_load, is_fsq, split_form
from model_adapters.quant.fsq_convert import convert_to_fsq, save_bottleneck
from model_adapters.quant.fsq_model import bottlenecks
from model_adapters.quant.fsq_precision import (
    E4M3_EXACT_CODE,
    E4M3_MAX,
    round_key_decoders,
    rounded_key_decoder,
)

VOCAB = 101
IDS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
# every finite float8 e4m3 value, from its 256 bit patterns (NaN is 0x7f and 0xff)
E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_VALUES = E4M3_VALUES[torch.isfinite(E4M3_VALUES)].unique()


def nearest_e4m3_distance(x: torch.Tensor) -> torch.Tensor:
    """The distance from each value to its nearest e4m3 value, by search over all of them."""
    return (x[..., None] - E4M3_VALUES).abs().min(-1).values


@given(arrays(np.float32, (2, 3, 5), elements=st.floats(-1e3, 1e3, width=32)),
       st.sampled_from(["e4m3", "e4m3-head"]))
def test_e4m3_rounding_is_to_the_nearest_value_of_the_scaled_grid(weight, form):
    w = torch.from_numpy(weight)
    out = rounded_key_decoder(w, form)
    dims = (-1,) if form == "e4m3" else (-2, -1)
    scale = w.abs().amax(dim=dims, keepdim=True) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scaled, got = w / scale, out / scale
    # each result is an e4m3 value, and one of the nearest to the scaled input
    assert (nearest_e4m3_distance(got) <= 1e-5 * got.abs() + 1e-9).all()
    # (float32 division leaves a row's maximum up to an ulp of 448 off the grid)
    assert torch.allclose((scaled - got).abs(), nearest_e4m3_distance(scaled),
                          rtol=1e-5, atol=1e-6 * E4M3_MAX)
    assert (out[w == 0] == 0).all()
    assert (got.abs() <= E4M3_MAX * (1 + 1e-6)).all()


def test_bf16_form_is_the_bfloat16_rounding_and_bad_forms_are_named():
    w = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(rounded_key_decoder(w, "bf16"), w.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="'fp4'"):
        rounded_key_decoder(w, "fp4")
    with pytest.raises(ValueError, match=r"\(kv_heads, head_dim, w\)"):
        rounded_key_decoder(w[0], "e4m3")


@pytest.mark.parametrize("form", ["bf16", "e4m3", "e4m3-head"])
def test_rounding_a_model_changes_only_the_folded_key_weight(form):
    model = convert_to_fsq(qwen3(), "fsq-w8-L16", IDS)
    before = [(b.folded(), {n: p.clone() for n, p in b.named_parameters()})
              for b in bottlenecks(model)]
    with torch.no_grad():
        exact_logits = model(IDS).logits
    report = round_key_decoders(model, form)
    assert report["form"] == form and len(report["relative_error"]) == 2
    assert 0 < report["max_relative_error"] < (0.01 if form == "bf16" else 0.1)
    for b, ((kw, kb, vw, vb), params) in zip(bottlenecks(model), before, strict=True):
        new_kw, new_kb, new_vw, new_vb = b.folded()
        assert torch.allclose(new_kw, rounded_key_decoder(kw, form), rtol=1e-6, atol=1e-7)
        assert not torch.equal(new_kw, kw)
        assert torch.allclose(new_kb, kb, rtol=1e-5, atol=1e-5)  # the bias the kernels add
        assert torch.equal(new_vw, vw) and torch.equal(new_vb, vb)
        for name in ("encoder.weight", "encoder.bias", "value_decoder.weight"):
            assert torch.equal(dict(b.named_parameters())[name], params[name])
    with torch.no_grad():
        logits = model(IDS).logits
    assert not torch.equal(logits, exact_logits)
    assert torch.allclose(logits, exact_logits, atol=0.5)


def test_codes_up_to_the_exact_limit_are_exact_in_e4m3():
    codes = torch.arange(E4M3_EXACT_CODE + 2, dtype=torch.float32)
    back = codes.to(torch.float8_e4m3fn).float()
    assert torch.equal(back[:-1], codes[:-1]) and back[-1] != codes[-1]


def test_e4m3_is_refused_for_codes_not_exact_in_it_and_nothing_changes():
    model = convert_to_fsq(qwen3(), "fsq-w8-L256", IDS)
    weights = [b.key_decoder.weight.clone() for b in bottlenecks(model)]
    with pytest.raises(ValueError, match="256 levels"):
        round_key_decoders(model, "e4m3")
    with pytest.raises(ValueError, match="'e5m2'"):
        round_key_decoders(model, "e5m2")
    assert all(torch.equal(b.key_decoder.weight, w)
               for b, w in zip(bottlenecks(model), weights, strict=True))
    round_key_decoders(model, "bf16")  # 16-bit products take any codes


def test_config_suffix_names_the_form_and_loads_the_plain_bottleneck(tmp_path):
    assert is_fsq("fsq-w32-L16-tau1@e4m3") and is_fsq("fsq-w32-L16@e4m3-head")
    assert not is_fsq("fsq-w32-L16@fp4") and not is_fsq("fsq-w32-L16@")
    assert split_form("fsq-w32-L16-tau1@bf16") == ("fsq-w32-L16-tau1", "bf16")
    assert split_form("fsq-w32-L16") == ("fsq-w32-L16", None)
    base = qwen3()
    trained = convert_to_fsq(base, "fsq-w8-L16", IDS)
    folder = save_bottleneck(trained, tmp_path / "bn")
    given_for = {"fsq-w8-L16-tau1": str(folder)}
    plain = convert_or_load("fsq-w8-L16-tau1", base, bottlenecks=given_for, calibration=None)
    rounded = convert_or_load("fsq-w8-L16-tau1@e4m3", base, bottlenecks=given_for,
                              calibration=None)
    assert rounded.fsq_key_decoder_rounding["form"] == "e4m3"
    assert not hasattr(plain, "fsq_key_decoder_rounding")
    for p, r in zip(bottlenecks(plain), bottlenecks(rounded), strict=True):
        assert torch.allclose(r.folded()[0], rounded_key_decoder(p.folded()[0], "e4m3"),
                              rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="pass its trained bottleneck"):
        convert_or_load("fsq-w8-L16-tau1@e4m3", base, bottlenecks={}, calibration=None)
