"""Converting a pretrained Qwen3 or GPT-2 into its FSQ form, and the bottleneck's own file.

:func:`convert_to_fsq` keeps every weight of the base model except the K/V projections, which it
replaces per layer by an :class:`~model_adapters.quant.fsq.FsqBottleneck` initialised so that
the converted model already works before any finetuning (``tau = 0``):

1. ``X``: the layer's attention inputs on calibration tokens (rows sampled up to ``max_rows``),
   or, without calibration tokens, standard normal rows (a weights-only initialisation).
2. ``Y = [s_k (X W_k^T + b_k), s_v (X W_v^T + b_v)]``, the stacked keys (before k_norm and RoPE)
   and values, each side scaled to unit RMS (``s_k``, ``s_v``) so neither dominates.
3. ``U``: the top ``w`` principal directions of ``Y`` (mean ``mu``), i.e. the truncated SVD of the
   stacked K/V weights seen through the data. The latent is ``y = U^T (Y - mu)``.
4. Per coordinate a scale ``m_i``, calibrated on the data: the one among ``std(y_i)`` times
   0.5-6 that minimises ``E[(y_i - m_i Q(tanh(y_i / m_i)))^2]``, with ``Q`` the L-level grid.
5. Encoder ``E = diag(1/m) U^T [s_k W_k; s_v W_v]`` (bias likewise), decoders
   ``D_k = U_k diag(m) / s_k`` with bias ``mu_k / s_k`` (values alike).

:func:`save_bottleneck` / :func:`load_bottleneck` store only the bottlenecks (a few hundred
kilobytes for a 22.5M-parameter stand-in) with the base model's identity, so a bottleneck trained
elsewhere is re-attached to the same base model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from model_adapters._checks import token_ids
from model_adapters.models import check_identity, model_identity
from model_adapters.quant.fsq import FsqBottleneck, FsqConfig
from model_adapters.quant.fsq_config import FSQ_MODEL_TYPES, fsq_spec
from model_adapters.quant.fsq_model import (
    FsqGPT2LMHeadModel,
    FsqQwen3ForCausalLM,
    attention_layers,
    bottlenecks,
)

__all__ = ["convert_to_fsq", "load_bottleneck", "save_bottleneck"]

_MODELS = {"qwen3": FsqQwen3ForCausalLM, "gpt2": FsqGPT2LMHeadModel}
_SCALES = torch.linspace(0.5, 6.0, 23)
BOTTLENECK_FILE = "fsq_bottleneck.safetensors"


def _spec(spec) -> FsqConfig:
    if isinstance(spec, FsqConfig):
        return spec
    if isinstance(spec, str):
        return FsqConfig.parse(spec)
    raise ValueError(f"spec must be an FsqConfig or a name like 'fsq-w32-L16', got {spec!r}")


def _base_attention(model):
    kind = model.config.model_type
    if kind == "qwen3":
        return [layer.self_attn for layer in model.model.layers]
    return [block.attn for block in model.transformer.h]


def _kv_weights(model, attn) -> tuple[torch.Tensor, ...]:
    """``(W_k, b_k, W_v, b_v)`` float32, weights ``(kv_heads * head_dim, hidden)``."""
    if model.config.model_type == "qwen3":
        out = []
        for proj in (attn.k_proj, attn.v_proj):
            bias = proj.bias if proj.bias is not None else torch.zeros(proj.out_features)
            out += [proj.weight.detach().float().cpu(), bias.detach().float().cpu()]
        return tuple(out)
    c = attn.embed_dim
    weight = attn.c_attn.weight.detach().float().cpu()
    bias = attn.c_attn.bias.detach().float().cpu()
    return (weight[:, c:2 * c].T, bias[c:2 * c], weight[:, 2 * c:].T, bias[2 * c:])


@torch.no_grad()
def _attention_inputs(model, ids: torch.Tensor, max_rows: int) -> list[torch.Tensor]:
    """Per layer ``(rows, hidden)`` float32 CPU: the attention layer's inputs on ``ids``."""
    layers = _base_attention(model)
    found: list[list[torch.Tensor]] = [[] for _ in layers]

    def hook(i):
        def grab(module, args, kwargs):
            x = kwargs.get("hidden_states", args[0] if args else None)
            found[i].append(x.detach().reshape(-1, x.shape[-1]).float().cpu())
        return grab

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True)
               for i, m in enumerate(layers)]
    try:
        device = next(model.parameters()).device
        for row in ids:
            model(row[None].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    g = torch.Generator().manual_seed(0)
    out = []
    for rows in found:
        x = torch.cat(rows)
        if x.shape[0] > max_rows:
            x = x[torch.randperm(x.shape[0], generator=g)[:max_rows]]
        out.append(x)
    return out


def _grid_error(y: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Mean squared error per (scale, coordinate) of ``scale * Q(tanh(y / scale))``."""
    half = (levels.float() - 1) / 2
    t = torch.tanh(y[None] / scale[:, None, :])
    q = torch.round((t + 1) * half) / half - 1
    return ((y[None] - scale[:, None, :] * q) ** 2).mean(1)


def _initialise(bottleneck: FsqBottleneck, x: torch.Tensor, weights) -> None:
    wk, bk, wv, bv = weights
    width = bottleneck.fsq.width
    if width > wk.shape[0] + wv.shape[0]:
        raise ValueError(f"width {width} exceeds the stacked K/V size {wk.shape[0] + wv.shape[0]}")
    yk, yv = x @ wk.T + bk, x @ wv.T + bv
    sk = yk.pow(2).mean().rsqrt().clamp(max=1e6)
    sv = yv.pow(2).mean().rsqrt().clamp(max=1e6)
    y = torch.cat([yk * sk, yv * sv], 1).double()
    mu = y.mean(0)
    _, vecs = torch.linalg.eigh((y - mu).T @ (y - mu) / y.shape[0])
    u = vecs[:, -width:].flip(1).float()  # (2D, w), largest first
    mu = mu.float()
    latent = (y.float() - mu) @ u
    std = latent.std(0).clamp(min=1e-6)
    levels = torch.tensor(bottleneck.fsq.levels)
    candidates = _SCALES[:, None] * std[None]
    best = candidates[_grid_error(latent, candidates, levels).argmin(0), torch.arange(width)]
    ws = torch.cat([wk * sk, wv * sv])
    bs = torch.cat([bk * sk, bv * sv])
    d = wk.shape[0]
    with torch.no_grad():
        bottleneck.encoder.weight.copy_((u.T @ ws) / best[:, None])
        bottleneck.encoder.bias.copy_((u.T @ (bs - mu)) / best)
        bottleneck.key_decoder.weight.copy_(u[:d] * best / sk)
        bottleneck.key_decoder.bias.copy_(mu[:d] / sk)
        bottleneck.value_decoder.weight.copy_(u[d:] * best / sv)
        bottleneck.value_decoder.bias.copy_(mu[d:] / sv)


def convert_to_fsq(model, spec, calibration_ids: torch.Tensor | None = None, *,
                   max_rows: int = 65536, initialise: bool = True):
    """The FSQ form of a Qwen3 or GPT-2 causal LM (a new model; ``model`` is left as it is).

    Args:
        model: ``Qwen3ForCausalLM`` or ``GPT2LMHeadModel``.
        spec: :class:`~model_adapters.quant.fsq.FsqConfig` or its name (``"fsq-w32-L16"``).
        calibration_ids: ``(sequences, tokens)`` int64 token ids to calibrate on, or None
            (weights only: standard normal inputs).
        max_rows: attention inputs kept per layer for the calibration.
        initialise: False leaves the bottlenecks at their random initialisation (for loading
            trained ones over them).

    Returns:
        The converted model (``FsqQwen3ForCausalLM`` / ``FsqGPT2LMHeadModel``) on the base
        model's device and dtype, in eval mode, ``config.fsq_tau = 0``.
    """
    spec = _spec(spec)
    kind = getattr(model.config, "model_type", None)
    if kind not in _MODELS:
        raise ValueError(f"convert_to_fsq takes a qwen3 or gpt2 model, got model_type {kind!r}")
    if calibration_ids is not None:
        token_ids(calibration_ids, "calibration_ids")
    param = next(model.parameters())
    base = {k: v for k, v in model.config.to_dict().items()
            if k not in ("model_type", "architectures", "transformers_version")}
    config = FSQ_MODEL_TYPES[kind](**{
        **base, "fsq_width": spec.width, "fsq_levels": list(spec.levels),
        "fsq_tau": 0.0, "fsq_base_identity": model_identity(model).to_dict()})
    config.architectures = [_MODELS[kind].__name__]
    config._attn_implementation = getattr(model.config, "_attn_implementation", None) or "sdpa"
    converted = _MODELS[kind](config)
    state = {k: v for k, v in model.state_dict().items()
             if not any(p in k for p in (".k_proj.", ".v_proj.", ".c_attn."))}
    missing, unexpected = converted.load_state_dict(state, strict=False)
    if unexpected or any(".fsq." not in k and ".q_attn." not in k for k in missing):
        raise RuntimeError(f"conversion mismatch: missing {missing[:4]}, unexpected "
                           f"{unexpected[:4]}")
    base_layers = _base_attention(model)
    if kind == "gpt2":
        for base, new in zip(base_layers, attention_layers(converted), strict=True):
            c = base.embed_dim
            with torch.no_grad():
                new.q_attn.weight.copy_(base.c_attn.weight[:, :c])
                new.q_attn.bias.copy_(base.c_attn.bias[:c])
    if initialise:
        if calibration_ids is not None:
            inputs = _attention_inputs(model, calibration_ids, max_rows)
        else:
            g = torch.Generator().manual_seed(0)
            hidden = model.config.hidden_size
            inputs = [torch.randn(min(max_rows, 4 * hidden), hidden, generator=g)
                      for _ in base_layers]
        for x, base, bottleneck in zip(inputs, base_layers, bottlenecks(converted),
                                             strict=True):
            _initialise(bottleneck, x, _kv_weights(model, base))
    return converted.to(param.device, param.dtype).eval()


def save_bottleneck(model, path) -> Path:
    """Write the converted model's bottlenecks alone to ``path`` (a directory): one safetensors
    file, its metadata the FSQ spec and the base model's identity. Returns the file."""
    from safetensors.torch import save_file

    width, levels, tau = fsq_spec(model.config)
    tensors = {f"layers.{i}.{k}": v.detach().float().cpu().contiguous()
               for i, b in enumerate(bottlenecks(model)) for k, v in b.state_dict().items()}
    meta = {"fsq_width": width, "fsq_levels": list(levels), "fsq_tau": tau,
            "base_model_type": model.config.model_type.removeprefix("fsq_"),
            "base_identity": getattr(model.config, "fsq_base_identity", None)}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    out = path / BOTTLENECK_FILE
    save_file(tensors, str(out), metadata={"fsq": json.dumps(meta)})
    return out


def load_bottleneck(path, base_model, *, allow_different_weights: bool = False):
    """The converted model made of ``base_model`` and the bottlenecks saved at ``path`` (a
    directory from :func:`save_bottleneck`, or its file). ValueError when they were trained
    on another base model (configuration always; weights unless ``allow_different_weights``)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    file = path / BOTTLENECK_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no FSQ bottleneck file at {file}")
    with safe_open(str(file), "pt") as f:
        meta = json.loads((f.metadata() or {}).get("fsq", "null") or "null")
    if not isinstance(meta, dict):
        raise ValueError(f"{file} has no FSQ metadata (not written by save_bottleneck)")
    if meta.get("base_identity"):
        from model_adapters.models import ModelIdentity

        check_identity(ModelIdentity.from_dict(meta["base_identity"]), model_identity(base_model),
                       what=f"FSQ bottleneck {file}",
                       allow_different_weights=allow_different_weights)
    spec = FsqConfig(meta["fsq_width"], tuple(meta["fsq_levels"]), meta.get("fsq_tau"))
    converted = convert_to_fsq(base_model, spec, initialise=False)
    converted.config.fsq_tau = meta.get("fsq_tau")
    tensors = load_file(str(file))
    layers = bottlenecks(converted)
    for i, b in enumerate(layers):
        own = {k: tensors.pop(f"layers.{i}.{k}") for k in b.state_dict()}
        b.load_state_dict({k: v.to(b.encoder.weight.dtype) for k, v in own.items()})
    if tensors:
        raise ValueError(f"{file} holds {len(tensors)} tensors for layers this model lacks "
                         f"(e.g. {next(iter(tensors))})")
    return converted
