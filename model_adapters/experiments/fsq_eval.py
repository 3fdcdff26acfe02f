"""FSQ configurations (``fsq-w{W}-L{L}[-tau{T}]``) in the perplexity harness.

A config names an FSQ-converted form of the evaluated model. With ``--bottleneck NAME=DIR`` the
trained bottleneck saved there is used (``bench/fsq_grid.py`` and ``bench/fsq_finetune.py`` save
them; its width and levels must be the name's); without one, a ``tau``-less or ``tau0`` name is
converted on the spot from the training text (calibration only, no finetuning), cached in
``--codebook-dir`` under a key of the model's identity and the calibration tokens. A name with
``tau > 0`` needs its bottleneck: finetuning is not part of an evaluation. A suffix
``@bf16``, ``@e4m3`` or ``@e4m3-head`` evaluates the same model with its key decoder rounded as
a kernel of that precision would compute it (:mod:`model_adapters.quant.fsq_precision`); the
row's ``key_decoder`` says how far the rounding moved the weights.

The passage is scored token by token through an :class:`~model_adapters.caches.fsq_cache.
FSQCache` and its codes are written to an fkvstore archive
(:mod:`model_adapters.store.fsq_archive`); the bytes per token are that archive's code stream.
The decoders are weights of the converted model, reported separately (``decoder_weight_bytes``),
not counted as cache.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

__all__ = ["FSQ_NAME", "calibration_ids", "convert_or_load", "evaluate_fsq", "is_fsq",
           "parse_bottlenecks", "summarise_fsq"]

# an optional "@form" names the key decoder's precision (model_adapters.quant.fsq_precision)
FSQ_NAME = re.compile(r"fsq-w\d+-L\d+(-tau[0-9.]+)?(@(bf16|e4m3|e4m3-head))?")


def is_fsq(name: str) -> bool:
    return FSQ_NAME.fullmatch(name) is not None


def split_form(name: str) -> tuple[str, str | None]:
    """``"fsq-w32-L16-tau1@e4m3"`` -> ``("fsq-w32-L16-tau1", "e4m3")``; no suffix: ``None``."""
    base, _, form = name.partition("@")
    return base, form or None


def parse_bottlenecks(given: list[str]) -> dict[str, str]:
    """``["fsq-w32-L16-tau0.25=DIR", ...]`` -> ``{name: DIR}``; ValueError naming an entry that
    is not ``NAME=DIR`` with an FSQ name and an existing ``DIR``."""
    out = {}
    for entry in given:
        name, sep, folder = entry.partition("=")
        if not sep or not is_fsq(name) or not Path(folder).exists():
            raise ValueError(f"--bottleneck {entry!r} must be fsq-wW-LL[-tauT]=DIR with DIR "
                             "existing")
        out[name] = folder
    return out


def calibration_ids(segments: list[list[int]], length: int, count: int = 8):
    """Up to ``count`` non-overlapping runs of ``length`` training ids, ``(n, length)`` int64
    (the conversion's calibration); ValueError when the segments hold none."""
    import torch

    runs = [seg[i:i + length] for seg in segments for i in range(0, len(seg) - length + 1, length)]
    if not runs:
        raise ValueError(f"the training text holds no run of {length} tokens to calibrate an "
                         "FSQ conversion on")
    return torch.tensor(runs[:count], dtype=torch.long)


def convert_or_load(name: str, base, *, bottlenecks: dict, calibration, cache_dir=None):
    """The converted model ``name`` stands for (see the module).

    Args:
        base: the evaluated model (Qwen3 or GPT-2).
        bottlenecks: ``{name: DIR}`` from :func:`parse_bottlenecks`; a name with an
            ``@form`` suffix takes its own entry, else its plain name's.
        calibration: ``(sequences, tokens)`` int64 ids for an on-the-spot conversion.
        cache_dir: where conversions are kept and reused (None: not kept).
    """
    from model_adapters.models import model_identity
    from model_adapters.quant.fsq import FsqConfig
    from model_adapters.quant.fsq_config import fsq_spec
    from model_adapters.quant.fsq_convert import convert_to_fsq, load_bottleneck, save_bottleneck

    plain, form = split_form(name)
    if form is not None:  # the bottleneck of the plain name, its key decoder rounded
        from model_adapters.quant.fsq_precision import round_key_decoders

        folder = bottlenecks.get(name, bottlenecks.get(plain))
        converted = convert_or_load(plain, base, bottlenecks={} if folder is None
                                    else {plain: folder}, calibration=calibration,
                                    cache_dir=cache_dir)
        converted.fsq_key_decoder_rounding = round_key_decoders(converted, form)
        return converted
    cfg = FsqConfig.parse(name)
    if name in bottlenecks:
        converted = load_bottleneck(bottlenecks[name], base)
        width, levels, _ = fsq_spec(converted.config)
        if (width, tuple(levels)) != (cfg.width, tuple(cfg.levels)):
            raise ValueError(f"config {name!r}: the bottleneck at {bottlenecks[name]} is "
                             f"w={width}, levels {sorted(set(levels))}")
        return converted
    if cfg.tau:
        raise ValueError(f"config {name!r} is finetuned (tau {cfg.tau:g}): pass its trained "
                         f"bottleneck with --bottleneck {name}=DIR (bench/fsq_grid.py makes them)")
    spec = FsqConfig(cfg.width, cfg.levels)
    if cache_dir is None:
        return convert_to_fsq(base, spec, calibration)
    key = hashlib.sha256(json.dumps([model_identity(base).to_dict(), spec.name,
                                     calibration.tolist()]).encode()).hexdigest()[:16]
    folder = Path(cache_dir) / f"{spec.name}-{key}"
    if folder.is_dir():
        return load_bottleneck(folder, base)
    converted = convert_to_fsq(base, spec, calibration)
    save_bottleneck(converted, folder)
    return converted


def evaluate_fsq(name: str, converted, passage: list[int], archive_dir, progress: bool):
    """Token-by-token NLLs of ``passage`` through an FSQCache, and the archive its codes make.

    Returns ``(nlls (n - 1,) float64, seconds, storage dict)``.
    """
    from model_adapters.caches.fsq_cache import FSQCache
    from model_adapters.experiments.perplexity import token_nlls
    from model_adapters.quant.fsq_model import attention_layers
    from model_adapters.store import archive_io, fsq_archive

    cache = FSQCache(converted)
    t0 = time.perf_counter()
    nlls = token_nlls(converted, passage, cache, progress=progress, desc=name)
    seconds = time.perf_counter() - t0
    path = Path(archive_dir) / f"{name}.fkv"
    path.unlink(missing_ok=True)
    cached = cache.get_seq_length()
    with fsq_archive.create(path, converted, cache=cache, token_ids=passage[:cached]) as ar:
        code_bytes = archive_io.stream_data_bytes(ar.codes)
    decoders = sum(p.numel() * 2 for m in attention_layers(converted)
                   for lin in (m.fsq.key_decoder, m.fsq.value_decoder) for p in lin.parameters())
    return nlls, seconds, {
        "archived_tokens": cached, "code_stream_bytes": code_bytes,
        "packed_code_bytes_per_token": cache.packed_bytes * len(cache.layers),
        "archive": path.name, "archive_file_bytes": path.stat().st_size,
        "decoder_weight_bytes_fp16": decoders}


def summarise_fsq(name: str, converted, nlls, base, storage, shape, tokens: int,
                  seconds: float) -> dict:
    """One result row, with the keys the harness's table and figure read."""
    from model_adapters.experiments.perplexity import perplexity
    from model_adapters.quant.fsq_config import fsq_spec

    width, levels, tau = fsq_spec(converted.config)
    half = tokens // 2 - 1
    ppl, ppl2 = perplexity(nlls), perplexity(nlls[half:])
    fp16 = shape.fp16_bytes_per_token
    code_pt = storage["code_stream_bytes"] / storage["archived_tokens"]
    return {
        "config": name, "canonical": name, "family": "fsq", "fsq_width": width,
        "fsq_levels": sorted(set(levels)), "fsq_tau": tau,
        "ppl": ppl, "ppl_second_half": ppl2,
        "delta_ppl_pct": 100.0 * (ppl / base[0] - 1.0),
        "delta_ppl_pct_second_half": 100.0 * (ppl2 / base[1] - 1.0),
        "eval_seconds": seconds, "archived_tokens": storage["archived_tokens"],
        "code_bytes_per_token": code_pt,
        "packed_code_bytes_per_token": storage["packed_code_bytes_per_token"],
        "window_bytes": 0, "codebook_bytes": 0,
        "decoder_weight_bytes_fp16": storage["decoder_weight_bytes_fp16"],
        "bytes_per_token": storage["code_stream_bytes"] / tokens,
        "compression_vs_fp16": fp16 / code_pt,
        "compression_vs_fp16_total": fp16 / (storage["code_stream_bytes"] / tokens),
        "archive": storage["archive"], "archive_file_bytes": storage["archive_file_bytes"],
        "key_decoder": getattr(converted, "fsq_key_decoder_rounding", None),
    }
