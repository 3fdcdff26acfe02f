"""Evaluation text: Gutenberg boilerplate stripped, quotes straightened, passage and training
span split so they never overlap."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Split", "clean_text", "split_tokens", "strip_gutenberg", "straighten_quotes"]

_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M)
_END = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$", re.M)
# A line holding only the first chapter's number: "I.", "I", "CHAPTER I", "Chapter I."
_CHAPTER_ONE = re.compile(r"^[ \t]*(?:chapter[ \t]+)?I\.?[ \t]*$", re.M | re.I)
_QUOTES = str.maketrans(
    {
        "\u2018": "'",
        "\u2019": "'",
        "\u201a": "'",
        "\u201b": "'",
        "\u201c": '"',
        "\u201d": '"',
        "\u201e": '"',
        "\u201f": '"',
    }
)


def strip_gutenberg(text: str) -> str:
    """The text between Project Gutenberg's START and END marker lines (all of it if absent)."""
    text = text.lstrip("\ufeff")
    start = _START.search(text)
    if start:
        text = text[start.end() :]
    end = _END.search(text)
    if end:
        text = text[: end.start()]
    return text


def straighten_quotes(text: str) -> str:
    """Curly single and double quotes replaced by ``'`` and ``"``."""
    return text.translate(_QUOTES)


def clean_text(text: str, *, keep_quotes: bool = False) -> str:
    """Gutenberg header/footer removed and (unless ``keep_quotes``) quotes straightened."""
    text = strip_gutenberg(text)
    return text if keep_quotes else straighten_quotes(text)


def chapter_one_offset(text: str) -> int | None:
    """Character offset of the first chapter's heading line, or None if there is none."""
    m = _CHAPTER_ONE.search(text)
    if m is None:
        return None
    return m.start() + (len(m.group(0)) - len(m.group(0).lstrip()))


@dataclass
class Split:
    """Token ids of the evaluation passage and of the disjoint training span.

    Attributes:
        passage: the first ``tokens`` ids from the start of chapter I.
        train_segments: contiguous runs of training ids (the book after the passage, then the
            text before chapter I), at most ``train_tokens`` ids in total.
        chapter_found: whether a chapter I heading was found (else the passage starts at the
            beginning of the cleaned text).
    """

    passage: list[int]
    train_segments: list[list[int]]
    chapter_found: bool

    @property
    def train_tokens(self) -> int:
        return sum(len(s) for s in self.train_segments)


def split_tokens(text: str, tokenizer, tokens: int, train_tokens: int) -> Split:
    """Tokenize a cleaned book into the evaluation passage and the training span.

    The passage and the text after it are tokenized together, so the passage's last token and
    the training span's first never share characters.

    Raises:
        ValueError: the text from chapter I on holds fewer than ``tokens`` tokens.
    """
    offset = chapter_one_offset(text)
    found = offset is not None
    offset = offset or 0
    after = tokenizer.encode(text[offset:], add_special_tokens=False)
    if len(after) < tokens:
        raise ValueError(
            f"the text from chapter I on has {len(after)} tokens, fewer than --tokens {tokens}"
        )
    before = tokenizer.encode(text[:offset], add_special_tokens=False) if offset else []
    segments, budget = [], train_tokens
    for seg in (after[tokens:], before):
        take = seg[:budget]
        if take:
            segments.append(take)
            budget -= len(take)
    return Split(after[:tokens], segments, found)
