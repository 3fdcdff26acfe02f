"""Argument checks shared across model_adapters (the lowest layer: imports nothing of ours)."""

from __future__ import annotations


def count(value, name: str, low: int = 0) -> int:
    """``value`` if it is an int (not a bool) >= ``low`` (0 or 1), else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "a positive" if low >= 1 else "a non-negative"
        raise ValueError(f"{name} must be {kind} int, got {value!r}")
    return value


def token_ids(value, name: str, where: str = ""):
    """``value`` if it is a non-empty ``(rows, tokens)`` integer torch tensor, else a ValueError
    naming ``name``, what it got and ``where`` (e.g. " at step 3")."""
    import torch

    if (isinstance(value, torch.Tensor) and value.ndim == 2 and value.numel()
            and not value.is_floating_point() and not value.is_complex()
            and value.dtype != torch.bool):
        return value
    got = (f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor)
           else type(value).__name__)
    raise ValueError(f"{name} must be a non-empty (rows, tokens) integer tensor, got {got}{where}")


MODELS_EXTRA = ("torch", "transformers")
INSTALL_HINT = "pip install torch, then pip install 'fkvstore[models]'"


def missing_models_extra() -> list[str]:
    """The packages of the ``models`` extra that cannot be imported here."""
    import importlib.util

    return [name for name in MODELS_EXTRA if importlib.util.find_spec(name) is None]


def require_models_extra(what: str) -> None:
    """ImportError naming the ``models`` extra when torch or transformers is missing."""
    missing = missing_models_extra()
    if missing:
        raise ImportError(f"{what} needs the 'models' extra ({', '.join(missing)} missing): "
                          f"{INSTALL_HINT}")
