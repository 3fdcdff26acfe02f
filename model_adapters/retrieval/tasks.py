"""Needle-in-a-haystack items from held-out books, in the format the 8K stand-in was trained on.

Every item is deterministic given its random generator. The single-needle and multi-key items
follow the long-context training script's generator call for call (keys sampled, 7-digit numbers
drawn, the asked needle, the haystack offset, the needle offsets), so a ``random.Random(123)``
stream of single-needle items reproduces the model card's teacher-forced evaluation. The other
variants (multi-value, needle depth swept) are RULER's, in the same sentence format.

Token ids are plain ``list[int]`` (GPT-2 BPE); a source text is a 1-D integer array.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = [
    "DEPTHS",
    "TASKS",
    "Item",
    "make_item",
    "task_items",
    "training_segments",
]

TASKS = ("single", "multikey", "multivalue", "depth")
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
NEEDLE = " One of the special magic numbers for {key} is: {number}."
QUESTION = (
    "\nWhat is the special magic number for {key} mentioned in the provided text? "
    "The special magic number for {key} mentioned in the provided text is:"
)
MULTI_NEEDLES = 4  # needles in a multi-key or multi-value item


@dataclass
class Item:
    """One retrieval item.

    Attributes:
        task: one of :data:`TASKS`.
        length: total tokens (context + question + answer), as the training script counts them.
        context: the haystack with its needles (prefilled alone).
        question: the question tokens (one forward after the prefill).
        answer: the asked needle's number as tokens (``" 1234567"``), the teacher-forced target.
        answers: every accepted number (one; several for multi-value items).
        depth: where the asked needle starts, as a fraction of the context.
    """

    task: str
    length: int
    context: list[int]
    question: list[int]
    answer: list[int]
    answers: list[str]
    depth: float
    keys: list[str] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        """Context, question and answer: the teacher-forced sequence."""
        return self.context + self.question + self.answer


def _encoder(tokenizer):
    return lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]


def make_item(task, length, source, words, tokenizer, r: random.Random, depth=None) -> Item:
    """One item of ``length`` tokens drawn with ``r``.

    ``single`` and ``multikey`` (four needles with distinct keys, one asked) consume ``r``
    exactly like the training script's ``task(length, source, words, n, r)``; ``multivalue``
    hides four numbers for one key (any of them is accepted); ``depth`` puts one needle's start
    at ``depth`` (a fraction in [0, 1]) of the haystack.
    """
    if task not in TASKS:
        raise ValueError(f"task {task!r} is not one of {TASKS}")
    enc = _encoder(tokenizer)
    n = MULTI_NEEDLES if task in ("multikey", "multivalue") else 1
    if task == "multivalue":
        keys = [r.choice(words)] * n
    else:
        keys = r.sample(words, n)
    nums = [str(r.randrange(1_000_000, 9_999_999)) for _ in keys]
    needles = [enc(NEEDLE.format(key=k, number=v)) for k, v in zip(keys, nums, strict=True)]
    asked = r.randrange(n)
    question = enc(QUESTION.format(key=keys[asked]))
    answer = enc(f" {nums[asked]}")
    hay_len = length - sum(map(len, needles)) - len(question) - len(answer)
    if hay_len < 1:
        raise ValueError(f"length {length} is too short for a {task!r} item")
    start = r.randrange(0, len(source) - hay_len - 1)
    hay = [int(t) for t in source[start : start + hay_len]]
    if task == "depth":
        if depth is None or not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth {depth!r} must be a fraction in [0, 1]")
        cuts = [round(depth * hay_len)]
    else:
        cuts = sorted(r.randrange(0, hay_len) for _ in needles)
    ids, prev, starts = [], 0, []
    for c, nd in zip(cuts, needles, strict=True):
        ids += hay[prev:c]
        starts.append(len(ids))
        ids += nd
        prev = c
    ids += hay[prev:]
    answers = sorted(set(nums)) if task == "multivalue" else [nums[asked]]
    return Item(
        task=task,
        length=length,
        context=ids,
        question=question,
        answer=answer,
        answers=answers,
        depth=starts[asked] / max(1, len(ids)),
        keys=[keys[asked]],
    )


def task_items(task, length, count, source, words, tokenizer, seed=0) -> list[Item]:
    """``count`` items of one task and length, from a generator seeded by (seed, task, length);
    depth items cycle through :data:`DEPTHS`."""
    r = random.Random(f"{seed}-{task}-{length}")
    return [
        make_item(task, length, source, words, tokenizer, r,
                  depth=DEPTHS[i % len(DEPTHS)] if task == "depth" else None)
        for i in range(count)
    ]


def training_segments(tokens, count: int = 4, length: int = 8192) -> list[list[int]]:
    """``count`` runs of ``length`` tokens at evenly spaced offsets of the training books: the
    text the codebooks are fitted on (never the held-out books the items come from)."""
    if len(tokens) < count * length:
        raise ValueError(f"{len(tokens)} training tokens cannot give {count} x {length}")
    step = len(tokens) // count
    return [[int(t) for t in tokens[i * step : i * step + length]] for i in range(count)]
