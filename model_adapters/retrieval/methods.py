"""The methods a retrieval run compares, one registry: a name resolves to a :class:`Method`.

Names (``--config`` on the command line):

- ``exact``: transformers' ``DynamicCache``.
- the project's residual-VQ configs (``perhead-k256-s2``, ``pooled-k256-s1``, ...; the grammar
  of :mod:`model_adapters.quant.configs`): an :class:`~model_adapters.caches.ArchivingCache`
  with codebooks fitted on the training books, codes written to an fkvstore archive.
- ``quanto-2``, ``quanto-4``, ``hqq-2``, ``hqq-4``, ``fp8``: transformers' ``QuantizedCache``.
- ``{streamingllm|knorm|snapkv|pyramidkv}-{ratio}``, e.g. ``snapkv-0.9``: a press dropping that
  fraction of the prefill's positions (:mod:`model_adapters.retrieval.presses`).

Another family plugs in with :func:`register_method` (a name pattern and a factory), e.g. FSQ
configs: ``register_method(r"fsq-.*", "fsq", make_fsq_method)``. Every method reports what it
stores the same way: bytes per token per layer after the prefill of the haystack, everything
included (codes, scales, zero points, codebooks, exact windows, the archive's own overhead for
the code stream), against 2 x kv_heads x head_dim x 2 bytes for an fp16 cache.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from model_adapters.quant.configs import parse_config

__all__ = ["Method", "MethodContext", "method_family", "register_method", "resolve_method"]


@dataclass
class MethodContext:
    """What factories may use: the model, its KV shape, the run's settings, and ``codebooks``,
    a callable ``(QuantConfig) -> KVQuantizer`` (fitted or loaded on first use)."""

    model: object
    shape: object
    codebooks: Callable | None = None
    sinks: int = 4
    recent: int = 32
    workdir: str | None = None
    bottlenecks: dict = field(default_factory=dict)  # FSQ config name -> trained bottleneck


@dataclass
class Method:
    """One compared method.

    Attributes:
        name: as given on the command line.
        family: the plot's line (``exact``, ``rvq-perhead``, ``quanto``, ``snapkv``, ...).
        new_cache: ``(measure: bool) -> cache`` for one item; ``measure`` asks for the byte count
            to be available afterwards (the RVQ cache then writes a real archive).
        prefill: ``(cache) -> context manager`` active during the haystack's forward.
        stored_bytes: ``(cache, tokens) -> int``: all bytes held for the ``tokens`` prefilled.
        info: extra fields for the JSON (bits, ratio, codebook bytes, ...).
        from_exact: for a method that compresses only after its prefill, ``(exact cache,
            captured) -> cache``: the cache its own prefill would leave, built from one shared
            exact prefill (see :func:`model_adapters.retrieval.scoring.exact_prefill`); None
            for a method whose prefill itself differs (the RVQ cache quantizes during it).
    """

    name: str
    family: str
    new_cache: Callable
    stored_bytes: Callable
    prefill: Callable = field(default=lambda cache: nullcontext())
    info: dict = field(default_factory=dict)
    from_exact: Callable | None = None
    model: object | None = None  # the model this method runs (None: the run's model)


_REGISTRY: list[tuple[re.Pattern, str, Callable]] = []
# presses.PRESSES, kept here too: this module imports the presses (and torch) only when used
_PRESS_KINDS = "streamingllm|knorm|snapkv|pyramidkv"


def register_method(pattern: str, family: str, factory: Callable) -> None:
    """Add a family: names matching ``pattern`` (a full-match regex) are built by
    ``factory(name, ctx: MethodContext) -> Method``. Later registrations win."""
    _REGISTRY.insert(0, (re.compile(pattern), family, factory))


def method_family(name: str) -> str:
    """The family a name belongs to; ValueError naming it when none matches."""
    for pattern, family, _ in _REGISTRY:
        if pattern.fullmatch(name):
            return family
    press = re.fullmatch(rf"({_PRESS_KINDS})-(.*)", name)
    if press:  # a press with a ratio its pattern does not take: say what a ratio is
        raise ValueError(f"method {name!r}: a press ratio is the fraction of the context it "
                         f"drops, a number in [0, 1) such as 0.5; got {press.group(2)!r}")
    raise ValueError(
        f"method {name!r} is none of: exact, an RVQ config (perhead-k256-s2, ...), "
        f"quanto-2/4, hqq-2/4, fp8, {{{_PRESS_KINDS}}}-RATIO, "
        "fsq-wW-LL (with --bottleneck)"
        + (", or a registered family" if len(_REGISTRY) > 5 else "")
    )


def resolve_method(name: str, ctx: MethodContext) -> Method:
    """Build the method named ``name`` (see the module docstring)."""
    method_family(name)
    for pattern, _, factory in _REGISTRY:
        if pattern.fullmatch(name):
            return factory(name, ctx)
    raise AssertionError("unreachable")


def _dynamic_bytes(cache, tokens) -> int:
    return sum(2 * (layer.keys.numel() + layer.values.numel()) for layer in cache.layers)


def _copy_into(cache, exact):
    """Feed every layer of ``exact`` (left unchanged) to ``cache`` as one update: what the
    prefill's forward would have handed it."""
    for i, layer in enumerate(exact.layers):
        cache.update(layer.keys.clone(), layer.values.clone(), i)
    return cache


def _exact(name, ctx):
    from transformers import DynamicCache

    return Method(name, "exact", lambda measure: DynamicCache(), _dynamic_bytes,
                  from_exact=lambda exact, captured: _copy_into(DynamicCache(), exact))


def _rvq(name, ctx):
    cfg = parse_config(name)
    quantizer = ctx.codebooks(cfg)
    from model_adapters.caches.archiving import ArchivingCache
    from model_adapters.caches.code_rows import CodeRows
    from model_adapters.caches.codes_attention import use_codes_attention
    from model_adapters.store import archive_io

    # the archiving cache's multi-token forwards need it; other caches fall through to SDPA
    use_codes_attention(ctx.model)
    codebook_bytes = int(sum(a.nbytes for a in quantizer.to_arrays().values()))
    opened = {}

    def new_cache(measure):
        rows = None
        if measure:
            path = Path(ctx.workdir) / f"{name}.fkv"
            path.unlink(missing_ok=True)
            ar, stream = archive_io.open_for_writing(
                path, ctx.model, quantizer.to("cpu"), sinks=ctx.sinks, recent=ctx.recent
            )
            rows = CodeRows(ctx.shape.num_layers, stream.extend)
            opened["archive"] = (ar, stream)
        return ArchivingCache(ctx.model, quantizer, sinks=ctx.sinks, recent=ctx.recent, rows=rows)

    def stored(cache, tokens):
        ar, stream = opened.pop("archive")
        window = archive_io.write_window(ar, cache)
        ar.flush()
        code = archive_io.stream_data_bytes(stream)
        ar.close()
        cache.rows = None  # the question and the answer are not part of the measured haystack
        for layer in cache.layers:
            layer.rows = None
        return int(code + window + codebook_bytes)

    kind = "pooled" if cfg.pooled else "perhead"
    return Method(
        name, f"rvq-{kind}", new_cache, stored,
        info={"codebook_bytes": codebook_bytes, "codebook_size": cfg.codebook_size,
              "key_stages": cfg.key_stages, "value_stages": cfg.value_stages,
              "packed_code_bytes_per_token": quantizer.row_width
              * math.ceil(math.log2(cfg.codebook_size)) / 8},
    )


def _quantized(name, ctx):
    from model_adapters.retrieval import peers

    backend, _, bits = name.partition("-")
    nbits = int(bits) if bits else None
    if backend != "fp8" and nbits not in (2, 4):
        raise ValueError(f"method {name!r}: {backend} runs with 2 or 4 bits here")
    if not peers.backend_available(backend):
        raise ValueError(f"method {name!r}: the {backend} backend is not available here")
    config = ctx.model.config
    return Method(
        name, backend, lambda measure: peers.new_quantized_cache(backend, config, nbits),
        lambda cache, tokens: peers.quantized_bytes(backend, cache),
        from_exact=lambda exact, captured: _copy_into(
            peers.new_quantized_cache(backend, config, nbits), exact),
        info={"nbits": nbits or 8, "q_group_size": 64 if nbits else None,
              "residual_length": 128 if nbits else 0},
    )


def _press(name, ctx):
    from transformers import DynamicCache

    from model_adapters.retrieval.presses import Press, press_cache, pressing

    kind, _, ratio = name.rpartition("-")
    press = Press(kind, float(ratio))
    return Method(
        name, kind, lambda measure: DynamicCache(), _dynamic_bytes,
        prefill=lambda cache: pressing(ctx.model, press, cache),
        from_exact=lambda exact, captured: press_cache(ctx.model, press, exact, captured),
        info={"ratio": press.ratio, "window": press.window if kind in ("snapkv", "pyramidkv")
              else None},
    )


def _fsq(name, ctx):
    """The base model converted to FSQ with the trained bottleneck given for ``name``
    (``--bottleneck fsq-w32-L16=DIR``; a name with an ``@form`` suffix, e.g.
    ``fsq-w32-L16@e4m3``, takes its plain name's and rounds the key decoder), answering
    through an ``FSQCache``. Bytes: the packed codes and the positions the cache holds; the
    decoders are weights, not counted."""
    from model_adapters.caches.fsq_cache import FSQCache
    from model_adapters.experiments.fsq_eval import convert_or_load, split_form
    from model_adapters.quant.fsq_config import fsq_spec

    plain = split_form(name)[0]
    if name not in ctx.bottlenecks and plain not in ctx.bottlenecks:
        raise ValueError(f"method {name!r} needs a trained bottleneck: --bottleneck {plain}=DIR "
                         f"(given for: {sorted(ctx.bottlenecks) or 'none'})")
    converted = convert_or_load(name, ctx.model, bottlenecks=ctx.bottlenecks, calibration=None)
    width, levels, tau = fsq_spec(converted.config)
    return Method(name, "fsq", lambda measure: FSQCache(converted),
                  lambda cache, tokens: cache.nbytes(), model=converted,
                  info={"width": width, "levels": sorted(set(levels)), "tau": tau,
                        "bottleneck": str(ctx.bottlenecks.get(name, ctx.bottlenecks.get(plain))),
                        "key_decoder": getattr(converted, "fsq_key_decoder_rounding", None)})


register_method(r"exact", "exact", _exact)
register_method(r"(pooled|perhead|hybrid)-k\d+-.*", "rvq", _rvq)
register_method(r"(quanto|hqq)-\d+|fp8", "quantized-cache", _quantized)
register_method(rf"({_PRESS_KINDS})-(0?\.\d+|0)", "press", _press)
register_method(r"fsq-w\d+-L\d+(-tau[0-9.]+)?(@(bf16|e4m3|e4m3-head))?", "fsq", _fsq)
