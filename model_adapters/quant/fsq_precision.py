"""A converted model's key decoder at the precision a decode kernel would reconstruct keys in.

The FSQ decode kernels (:func:`kernels.fsq_decode_attention`) multiply each block's integer
codes by the folded key decoder (:meth:`~model_adapters.quant.fsq.FsqBottleneck.folded`) on
the tensor cores. That product is 16-bit today: the decoder rounded to the query's dtype. An
fp8 product (e4m3 operands, float32 accumulation) would double the tensor-core ceiling. Codes
below 16 are exact in e4m3. The decoder is not, so an fp8 kernel computes a different model.
:func:`round_key_decoders` puts that rounding into a converted model's weights, so the
harnesses (``model_adapters.eval``, ``model_adapters.retrieval``: a config name's
``@form`` suffix) measure what it costs before any kernel is written:

- ``"bf16"``: the folded key decoder rounded to bfloat16, as the shipped kernels compute it
  in a bfloat16 model (the harnesses' float32 runs otherwise keep it exact).
- ``"e4m3"``: each ``(kv head, head dim)`` row divided by its scale (the row's absolute
  maximum / 448, e4m3's largest value), rounded to e4m3 and multiplied back. A kernel would
  apply the scale to its float32 product before the bias, as one multiply-add in place of
  the bias add it does now.
- ``"e4m3-head"``: one scale per kv head, over all its rows.

The key bias and the value decoder are left exact. The kernels add the key bias in float (or
as two 16-bit parts, exact to ~2^-16), and apply the value decoder once after the softmax,
in float.
"""

from __future__ import annotations

import torch

from model_adapters.quant.fsq_model import bottlenecks

__all__ = ["E4M3_MAX", "KEY_DECODER_FORMS", "round_key_decoders", "rounded_key_decoder"]

KEY_DECODER_FORMS = ("bf16", "e4m3", "e4m3-head")
E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value
E4M3_EXACT_CODE = 16  # the largest integer code exact in e4m3 with all below it (3 mantissa bits)


def _check_form(form: str) -> None:
    if form not in KEY_DECODER_FORMS:
        raise ValueError(f"key decoder form must be one of {KEY_DECODER_FORMS}, got {form!r}")


def rounded_key_decoder(weight: torch.Tensor, form: str) -> torch.Tensor:
    """``weight`` ``(kv_heads, head_dim, w)`` (a folded key decoder) as ``form`` holds it,
    float32 of the same shape (see the module for the forms). All-zero rows stay zero."""
    _check_form(form)
    if weight.dim() != 3:
        raise ValueError(f"weight must be (kv_heads, head_dim, w), got shape "
                         f"{tuple(weight.shape)}")
    weight = weight.float()
    if form == "bf16":
        return weight.to(torch.bfloat16).float()
    dims = (-1,) if form == "e4m3" else (-2, -1)
    scale = weight.abs().amax(dim=dims, keepdim=True) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (weight / scale).to(torch.float8_e4m3fn).float() * scale


@torch.no_grad()
def round_key_decoders(model, form: str) -> dict:
    """Round every layer's folded key decoder of a converted model to ``form``, in place,
    keeping the folded key bias (what the kernels add) and the value decoder unchanged.

    Returns ``{"form", "relative_error": [per layer ||rounded - exact|| / ||exact|| of the
    folded weight], "max_relative_error"}``. ValueError for an unknown form, or for an e4m3
    form on codes of more than 17 levels (their codes are not exact in e4m3); nothing is
    changed then.
    """
    layers = bottlenecks(model)
    _check_form(form)
    if form.startswith("e4m3"):
        top = max(max(b.fsq.levels) for b in layers)
        if top - 1 > E4M3_EXACT_CODE:
            raise ValueError(f"form {form!r} needs codes exact in e4m3 (at most "
                             f"{E4M3_EXACT_CODE + 1} levels); the model has {top} levels")
    errors = []
    for b in layers:
        dec = b.key_decoder
        exact_w, exact_b = b.folded()[:2]
        rounded = rounded_key_decoder(exact_w, form)
        errors.append(float((rounded - exact_w).norm() / exact_w.norm().clamp_min(1e-30)))
        # unfold (W = folded * m) and pick the bias that keeps the folded bias b - W 1
        weight = rounded.reshape(dec.weight.shape) * b.fsq.half(dec.weight.device)
        dec.weight.copy_(weight.to(dec.weight.dtype))
        dec.bias.copy_((exact_b.reshape(-1) + weight.sum(1)).to(dec.bias.dtype))
    return {"form": form, "relative_error": errors, "max_relative_error": max(errors)}
