"""Registration of the FSQ-converted models with transformers' auto classes, without importing
transformers (or torch) at ``import model_adapters``.

:func:`install` runs once from the package facade. If transformers' ``modeling_auto`` is loaded
already, it registers at once; otherwise a ``sys.meta_path`` finder waits for it and registers
the configurations (``AutoConfig``) and the models (``AutoModelForCausalLM``, through a stand-in
class that imports the real one on first use) right after it finishes loading. That module
loads with any transformers model class, or with the auto model classes; a bare
``AutoConfig.from_pretrained`` before either needs ``register_auto_classes()`` first
(:mod:`model_adapters.quant.fsq_model`). Registering after ``configuration_auto`` is not
possible: configuration classes themselves import ``modeling_auto`` while it is still loading.
So, after ``import model_adapters``, ``AutoModelForCausalLM.from_pretrained(converted_dir)``
works offline, no remote code.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_MODELING = "transformers.models.auto.modeling_auto"


def _register_configs() -> None:
    from transformers.models.auto.configuration_auto import AutoConfig

    from model_adapters.quant.fsq_config import FSQ_MODEL_TYPES

    for config_class in FSQ_MODEL_TYPES.values():
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)


class _Deferred:
    """Stands in the auto mapping for a converted model class and imports it on first use:
    ``modeling_auto`` loads while transformers' own modeling modules are still loading, so the
    real class (a subclass of one of them) cannot be imported at that moment."""

    _target = ("", "")
    config_class: type | None = None

    @classmethod
    def _real(cls):
        module, name = cls._target
        return getattr(importlib.import_module(module), name)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return cls._real().from_pretrained(*args, **kwargs)

    @classmethod
    def _from_config(cls, *args, **kwargs):
        return cls._real()._from_config(*args, **kwargs)

    @classmethod
    def register_for_auto_class(cls, *args, **kwargs):
        return cls._real().register_for_auto_class(*args, **kwargs)


_MODELS = {"fsq_qwen3": "FsqQwen3ForCausalLM", "fsq_gpt2": "FsqGPT2LMHeadModel"}


def _register_models() -> None:
    _register_configs()
    from transformers.models.auto.modeling_auto import AutoModelForCausalLM

    from model_adapters.quant.fsq_config import FSQ_MODEL_TYPES

    for config_class in FSQ_MODEL_TYPES.values():
        name = _MODELS[config_class.model_type]
        stand_in = type(name, (_Deferred,), {
            "_target": ("model_adapters.quant.fsq_model", name), "config_class": config_class})
        AutoModelForCausalLM.register(config_class, stand_in, exist_ok=True)


_AFTER = {_MODELING: _register_models}


class _Loader(importlib.abc.Loader):
    """Wraps the real loader of one auto module; registers after it executes."""

    def __init__(self, loader, after):
        self.loader, self.after = loader, after

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.after()


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the two auto modules it asks the other finders and wraps the
    loader they give."""

    def find_spec(self, name, path=None, target=None):
        after = _AFTER.get(name)
        if after is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, after)
                return spec
        return None


_FINDER = _Finder()


def install() -> None:
    """Register now if transformers' auto modules are loaded, else when they load. Idempotent;
    does nothing where transformers is not installed."""
    if _MODELING in sys.modules and "model_adapters.quant.fsq_model" not in sys.modules:
        _register_models()
    if _MODELING not in sys.modules and _FINDER not in sys.meta_path:
        if importlib.util.find_spec("transformers") is not None:
            sys.meta_path.insert(0, _FINDER)
