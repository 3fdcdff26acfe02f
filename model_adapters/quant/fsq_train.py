"""Finetuning an FSQ-converted model: the backbone frozen, only the bottlenecks train.

The budget is ``tau`` tokens per parameter of the *original* model (:func:`steps_for_tau`). The
loss per batch is the mean next-token cross-entropy, plus ``answer_weight`` times the mean over
answer tokens (the retrieval items' masks, as the long-context stand-in was trained), plus
optionally ``kl_weight`` times the mean per-token KL divergence ``KL(teacher || model)`` to the
original model's next-token distribution (a distillation term: it asks the converted model to
reproduce the base model's whole distribution, not only the observed token).

Optimiser: AdamW on the bottleneck parameters, linear warm-up over ``warmup`` of the steps, then
cosine decay to ``final`` of the peak, gradients clipped to norm 1.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from model_adapters._checks import count, token_ids
from model_adapters.quant.fsq_model import bottlenecks

__all__ = ["bottleneck_parameters", "finetune_fsq", "steps_for_tau"]


def steps_for_tau(tau: float, base_parameters: int, tokens_per_step: int) -> int:
    """Optimiser steps that see ``tau * base_parameters`` tokens (at least one for tau > 0)."""
    if not (isinstance(tau, (int, float)) and tau >= 0):
        raise ValueError(f"tau must be a number >= 0, got {tau!r}")
    if tokens_per_step < 1:
        raise ValueError(f"tokens_per_step must be >= 1, got {tokens_per_step!r}")
    return math.ceil(tau * base_parameters / tokens_per_step) if tau > 0 else 0


def bottleneck_parameters(model) -> list[torch.nn.Parameter]:
    """The converted model's trainable parameters (every bottleneck's), in layer order."""
    return [p for b in bottlenecks(model) for p in b.parameters()]


def _kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean over positions of ``KL(softmax(teacher) || softmax(student))``; ``(..., vocab)``."""
    s = F.log_softmax(student.float(), -1)
    t = F.log_softmax(teacher.float(), -1)
    return (t.exp() * (t - s)).sum(-1).mean()


def _next_batch(it, step: int, steps: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The next ``(ids, answer_mask)`` pair, checked; ValueError when ``batches`` ran out or
    yields something else."""
    try:
        batch = next(it)
    except StopIteration:
        raise ValueError(f"batches ran out after {step} of steps={steps}") from None
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ValueError(f"batches must yield (ids, answer_mask) pairs, got "
                         f"{type(batch).__name__} at step {step}")
    ids, answer = batch
    token_ids(ids, "ids", f" at step {step}")
    if answer is not None and (not isinstance(answer, torch.Tensor) or answer.shape != ids.shape):
        shape = (str(tuple(answer.shape)) if isinstance(answer, torch.Tensor)
                 else type(answer).__name__)
        raise ValueError(f"answer_mask must be None or a tensor of the ids' shape "
                         f"{tuple(ids.shape)}, got {shape} at step {step}")
    return ids, answer


def finetune_fsq(model, batches: Iterable, *, steps: int, lr: float = 2e-3,
                 warmup: float = 0.05, final: float = 0.05, weight_decay: float = 0.0,
                 teacher=None, kl_weight: float = 0.0, answer_weight: float = 1.0,
                 autocast: torch.dtype | None = None, log_every: int = 25,
                 tau: float | None = None) -> list[dict]:
    """Train the bottlenecks of ``model`` for ``steps`` batches; returns the log.

    Args:
        model: an FSQ-converted causal LM (its other parameters are frozen here and stay so).
        batches: yields ``(ids, answer_mask)``: ``(batch, tokens)`` int64 and ``(batch,
            tokens)`` float (1 on answer tokens) or None.
        steps: optimiser steps (``steps_for_tau``), >= 1; ``batches`` must yield as many.
        teacher: the original model, for ``kl_weight > 0``.
        autocast: a dtype to autocast the forward passes to (e.g. ``torch.bfloat16`` on CUDA).
        tau: recorded as ``model.config.fsq_tau`` when training ends.

    Returns:
        ``[{"step", "loss", "lm", "answer", "kl", "seconds"}, ...]`` every ``log_every`` steps
        and at the last.
    """
    if kl_weight > 0 and teacher is None:
        raise ValueError("kl_weight > 0 needs the teacher (the original model)")
    count(steps, "steps", 1)
    count(log_every, "log_every", 1)
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    params = bottleneck_parameters(model)
    train = {id(p) for p in params}
    for p in model.parameters():
        p.requires_grad_(id(p) in train)
    model.eval()  # no dropout in the frozen backbone; the FSQ rounding is the same in both modes
    device = params[0].device
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    warm = max(1, int(warmup * steps))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, steps - warm)
        return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    ctx = (torch.autocast(device.type, dtype=autocast) if autocast is not None
           else torch.autocast(device.type, enabled=False))
    log, t0, it = [], time.time(), iter(batches)
    try:  # the backbone's parameters end frozen, also when a batch is refused
        for step in range(steps):
            ids, answer = _next_batch(it, step, steps)
            ids = ids.to(device)
            with ctx:
                logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
            nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                  ids[:, 1:].reshape(-1), reduction="none").view(ids.shape[0], -1)
            lm = nll.mean()
            loss = lm
            ans = torch.zeros((), device=device)
            if answer is not None and answer_weight:
                mask = answer.to(device)[:, 1:].float()
                ans = (nll * mask).sum() / mask.sum().clamp(min=1)
                loss = loss + answer_weight * ans
            kl = torch.zeros((), device=device)
            if kl_weight > 0:
                with torch.no_grad(), ctx:
                    target = teacher(input_ids=ids, use_cache=False).logits[:, :-1]
                kl = _kl(logits, target)
                loss = loss + kl_weight * kl
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            if step % log_every == 0 or step == steps - 1:
                log.append({"step": step, "loss": round(loss.item(), 4), "lm": round(lm.item(), 4),
                            "answer": round(ans.item(), 4), "kl": round(kl.item(), 4),
                            "seconds": round(time.time() - t0, 1)})
    finally:
        for p in params:
            p.requires_grad_(False)
    if tau is not None:
        model.config.fsq_tau = float(tau)
    return log
