"""Token-by-token perplexity through a cache (the paper's protocol)."""

from __future__ import annotations

import math

import numpy as np
import torch
from tqdm.auto import tqdm

from model_adapters.models import cache_kwarg

__all__ = ["perplexity", "token_nlls"]


@torch.no_grad()
def token_nlls(model, ids: list[int], cache, *, progress: bool = True, desc: str = "eval"):
    """Negative log-likelihood of every token after the first, feeding one token per step.

    Args:
        model: a causal LM.
        ids: the passage, n token ids.
        cache: the cache to run with (fresh).

    Returns:
        ``(n - 1,)`` float64: entry t is -log p(ids[t+1] | ids[:t+1]).
    """
    device = next(model.parameters()).device
    kw = cache_kwarg(model)
    tokens = torch.tensor(ids, device=device).unsqueeze(0)
    out = np.empty(len(ids) - 1, dtype=np.float64)
    for t in tqdm(range(len(ids) - 1), desc=desc, unit="tok", disable=not progress, leave=False):
        logits = model(tokens[:, t : t + 1], use_cache=True, **{kw: cache}).logits[0, -1]
        out[t] = -torch.log_softmax(logits.double(), -1)[ids[t + 1]].item()
    return out


def perplexity(nlls: np.ndarray) -> float:
    """exp of the mean negative log-likelihood."""
    return float(math.exp(float(np.mean(nlls))))
