"""Residual-VQ codes for a Hugging Face model's KV cache: quantizers, caches, archives.

The public surface, in one import::

    from model_adapters import ArchivingCache, CodesOnlyCache, KVQuantizer

    quantizer = KVQuantizer.fit(model, token_ids, "perhead-k256-s2")
    quantizer.save_pretrained("codebooks/")
    quantizer = KVQuantizer.from_pretrained("codebooks/", model)

FSQ-converted models (docs/fsq.md)::

    from model_adapters import FSQCache, convert_to_fsq, finetune_fsq

    fsq_model = convert_to_fsq(model, "fsq-w32-L16", calibration_ids)
    fsq_model.generate(ids, cache=FSQCache(fsq_model))

Importing the package also registers the converted models with transformers' auto classes
(once transformers loads them; see ``model_adapters._auto``).

Names load on first use (a module ``__getattr__``), so ``import model_adapters`` and
``python -m model_adapters.eval --help`` do not import torch or transformers.

Layers, each importing only those to its left:
``models`` <- ``quant`` <- ``caches`` <- ``store`` (the only one importing fkvstore) <-
``experiments``.
"""

from __future__ import annotations

import importlib

from model_adapters._auto import install as _install_auto_classes
from model_adapters._checks import require_models_extra

_WHERE = {
    # models: what the code needs to know about an architecture
    "KVShape": "models",
    "ModelIdentity": "models",
    "SUPPORTED_MODEL_TYPES": "models",
    "cache_kwarg": "models",
    "config_fingerprint": "models",
    "kv_shape": "models",
    "max_positions": "models",
    "model_identity": "models",
    "output_cache": "models",
    "weights_fingerprint": "models",
    # quant: configurations, codebooks and their training
    "KVQuantizer": "quant.quantizer",
    "QuantConfig": "quant.configs",
    "collect_kv": "quant.collect",
    "expand_configs": "quant.configs",
    "parse_config": "quant.configs",
    "train_kv_quantizer": "quant.quantizer",
    # quant: the FSQ bottleneck, converted models, finetuning
    "FSQ": "quant.fsq",
    "FsqBottleneck": "quant.fsq",
    "FsqConfig": "quant.fsq",
    "FsqGPT2LMHeadModel": "quant.fsq_model",
    "FsqQwen3ForCausalLM": "quant.fsq_model",
    "convert_to_fsq": "quant.fsq_convert",
    "finetune_fsq": "quant.fsq_train",
    "load_bottleneck": "quant.fsq_convert",
    "save_bottleneck": "quant.fsq_convert",
    # caches: transformers caches and the codes attention
    "ArchivingCache": "caches.archiving",
    "CODES_ATTENTION": "caches.codes_attention",
    "CodeRows": "caches.code_rows",
    "CodesOnlyCache": "caches.codes_only",
    "FSQCache": "caches.fsq_cache",
    "lookup_attention": "caches.codes_attention",
    "use_codes_attention": "caches.codes_attention",
    # store: archives on disk
    "FsqArchive": "store.fsq_archive",
    "ServingArchive": "store.serving_archive",
}
_MODULES = {"fsq_archive": "store.fsq_archive", "serving_archive": "store.serving_archive"}

__all__ = sorted([*_WHERE, *_MODULES])


_install_auto_classes()  # FSQ-converted models load through transformers' auto classes


def __getattr__(name: str):
    if name in _WHERE or name in _MODULES:
        require_models_extra(f"model_adapters.{name}")
    if name in _WHERE:
        module = importlib.import_module(f"{__name__}.{_WHERE[name]}")
        value = getattr(module, name)
    elif name in _MODULES:
        value = importlib.import_module(f"{__name__}.{_MODULES[name]}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
