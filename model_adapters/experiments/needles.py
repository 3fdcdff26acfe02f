"""Token files, the long-context training mixture, and a provisional one-needle scorer.

The task follows the rules the 8K stand-in (``standin-qwen3-8k``) was trained with: a needle
sentence " One of the special magic numbers for {key} is: {7 digits}." hidden at random token
offsets in book text, then the question "What is the special magic number for {key} mentioned
in the provided text? The special magic number for {key} mentioned in the provided text is:"
and the answer " {digits}". Keys are the GPT-2 vocabulary entries " word" of 4-9 lowercase
letters, sorted, shuffled with ``random.Random(1)``; the first 80% are training keys, the rest
held out (:func:`retrieval_keys`).

:func:`needle_accuracy` is provisional: teacher-forced, an item counts when the argmax at every
answer token is the answer token; held-out keys, held-out books. The retrieval benchmark
replaces it.
"""

from __future__ import annotations

import lzma
import math
import random
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "book_perplexity",
    "load_tokens",
    "needle_accuracy",
    "needle_item",
    "retrieval_keys",
    "training_batches",
]


def load_token_array(path) -> np.ndarray:
    """A ``.u16.xz`` token file (little-endian uint16 GPT-2 ids, xz-compressed) as an int64
    ``(n,)`` numpy array. ValueError naming the path when it is missing or not such a file."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"token file {str(path)!r} does not exist")
    try:
        with lzma.open(p) as f:
            raw = f.read()
    except lzma.LZMAError as exc:
        raise ValueError(f"token file {str(path)!r} is not xz-compressed: {exc}") from exc
    if len(raw) % 2:
        raise ValueError(f"token file {str(path)!r} has an odd byte count ({len(raw)})")
    return np.frombuffer(raw, dtype="<u2").astype(np.int64)


def load_tokens(path) -> torch.Tensor:
    """:func:`load_token_array` as an int64 ``(n,)`` tensor."""
    return torch.from_numpy(load_token_array(path))


def retrieval_keys(tokenizer) -> tuple[list[str], list[str]]:
    """``(training keys, held-out keys)``: the vocabulary entries ``" word"`` (lowercase
    letters, 4-9 of them), sorted, shuffled with ``random.Random(1)``; the first 80% trained
    the stand-in, the rest are for evaluation."""
    words = set()
    for i in range(len(tokenizer)):
        w = tokenizer.decode([i])
        if w.startswith(" ") and w[1:].isalpha() and w[1:].islower() and 4 <= len(w) - 1 <= 9:
            words.add(w[1:])
    ordered = sorted(words)
    random.Random(1).shuffle(ordered)
    cut = len(ordered) * 4 // 5
    return ordered[:cut], ordered[cut:]


def needle_item(length: int, source: torch.Tensor, keys: list[str], encode, rng: random.Random,
                *, needles: int = 1, ask_all: bool = False) -> tuple[list[int], list[int]]:
    """One retrieval item of exactly ``length`` tokens: ``(ids, answer_mask)``.

    ``needles`` needles with distinct keys at random offsets in a random span of ``source``;
    then the question for one needle (``ask_all``: for every needle, in random order) and its
    answer, whose tokens the mask marks.
    """
    chosen = rng.sample(keys, needles)
    numbers = [str(rng.randrange(1_000_000, 9_999_999)) for _ in chosen]
    sentences = [encode(f" One of the special magic numbers for {k} is: {n}.")
                 for k, n in zip(chosen, numbers, strict=True)]
    asked = rng.sample(range(needles), needles) if ask_all else [rng.randrange(needles)]
    qa = [(encode(f"\nWhat is the special magic number for {chosen[q]} mentioned in the "
                  f"provided text? The special magic number for {chosen[q]} mentioned in the "
                  f"provided text is:"), encode(f" {numbers[q]}")) for q in asked]
    hay = length - sum(map(len, sentences)) - sum(len(q) + len(a) for q, a in qa)
    if hay < 0:
        raise ValueError(f"length {length} is too short for {needles} needles")
    start = rng.randrange(0, len(source) - hay - 1)
    text = source[start:start + hay].tolist()
    cuts = sorted(rng.randrange(0, hay) for _ in sentences)
    ids, prev = [], 0
    for cut, sentence in zip(cuts, sentences, strict=True):
        ids += text[prev:cut] + sentence
        prev = cut
    ids += text[prev:]
    mask = [0] * len(ids)
    for question, answer in qa:
        ids += question + answer
        mask += [0] * len(question) + [1] * len(answer)
    return ids, mask


def training_batches(tokens: torch.Tensor, keys: list[str], encode, *, batch: int, seq: int,
                     task_fraction: float = 0.8, seed: int = 7):
    """Endless ``(ids, answer_mask)`` batches, ``(batch, seq)`` int64 / float32: with
    probability ``task_fraction`` a row is 1, 2, 4 or 8 retrieval items (up to 8 needles each,
    every one asked), else a plain span of ``tokens``."""
    rng = random.Random(seed)
    while True:
        rows, masks = [], []
        for _ in range(batch):
            if rng.random() < task_fraction:
                parts = rng.choice([[seq], [seq // 2] * 2, [seq // 4] * 4, [seq // 8] * 8])
                ids, mask = [], []
                for length in parts:
                    n = min(length // 256, rng.choice([1, 2, 4, 8]))
                    i, m = needle_item(length, tokens, keys, encode, rng, needles=max(1, n),
                                       ask_all=True)
                    ids += i
                    mask += m
            else:
                s = rng.randrange(0, len(tokens) - seq - 1)
                ids, mask = tokens[s:s + seq].tolist(), [0] * seq
            rows.append(ids)
            masks.append(mask)
        yield torch.tensor(rows), torch.tensor(masks, dtype=torch.float32)


@torch.no_grad()
def needle_accuracy(model, tokens: torch.Tensor, keys: list[str], encode, *, lengths,
                    items: int = 50, needles: int = 1, seed: int = 123,
                    autocast: torch.dtype | None = None) -> dict[int, float]:
    """Provisional one-needle accuracy per length (see the module), teacher-forced."""
    device = next(model.parameters()).device
    rng, out = random.Random(seed), {}
    for length in lengths:
        hits = 0
        for _ in range(items):
            ids, mask = needle_item(length, tokens, keys, encode, rng, needles=needles)
            x = torch.tensor([ids], device=device)
            with torch.autocast(device.type, dtype=autocast or torch.float32,
                                enabled=autocast is not None):
                logits = model(input_ids=x, use_cache=False).logits[0, :-1]
            m = torch.tensor(mask[1:], device=device, dtype=torch.bool)
            hits += int(torch.equal(logits.argmax(-1)[m], x[0, 1:][m]))
        out[length] = hits / items
    return out


@torch.no_grad()
def book_perplexity(model, tokens: torch.Tensor, *, length: int = 1024, windows: int = 8,
                    stride: int = 50_000, autocast: torch.dtype | None = None) -> float:
    """exp(mean NLL) over ``windows`` spans of ``length`` tokens at multiples of ``stride``
    (the stand-in's held-out protocol: 1,024 tokens, 8 windows, 50,000 apart)."""
    device = next(model.parameters()).device
    total = 0.0
    for j in range(windows):
        x = tokens[j * stride:j * stride + length][None].to(device)
        with torch.autocast(device.type, dtype=autocast or torch.float32,
                            enabled=autocast is not None):
            total += model(input_ids=x, labels=x, use_cache=False).loss.item()
    return math.exp(total / windows)
