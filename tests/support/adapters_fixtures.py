"""Tiny random-initialised GPT-2 and Qwen3 models for the model_adapters tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def tiny_gpt2(vocab_size: int = 101, seed: int = 0):
    """GPT-2: 2 layers, 4 heads x 16, 128 positions, eval mode, float32."""
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        n_positions=128,
        vocab_size=vocab_size,
        bos_token_id=0,
        eos_token_id=1,
    )
    return transformers.GPT2LMHeadModel(cfg).eval()


def tiny_qwen3(vocab_size: int = 101, seed: int = 0):
    """Qwen3: 2 layers, 4 query heads and 2 KV heads x 16 (GQA, RoPE), eval mode, float32."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=vocab_size,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
    )
    return transformers.Qwen3ForCausalLM(cfg).eval()


TINY_MODELS = {"gpt2": tiny_gpt2, "qwen3": tiny_qwen3}


# the GPT-2 vocabulary and merges, kept with the tests (tests/data/gpt2-tokenizer/README.md)
TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "data" / "gpt2-tokenizer"


def random_quantizer(model, key_stages=2, value_stages=1, k=16, seed=0):
    """A KVQuantizer with random Gaussian codebooks shaped for ``model``."""
    from model_adapters.models import kv_shape
    from model_adapters.quant.quantizer import KVQuantizer

    shape = kv_shape(model)
    g = torch.Generator().manual_seed(seed)

    def books(stages):
        if stages == 0:
            return None
        return 0.5 * torch.randn(
            shape.num_layers, shape.kv_heads, stages, k, shape.head_dim, generator=g
        )

    return KVQuantizer(shape, books(key_stages), books(value_stages))


BOOK = """\ufeffThe Project Gutenberg eBook of Nothing
Release date: never
*** START OF THE PROJECT GUTENBERG EBOOK NOTHING ***
CONTENTS
 I Arrival
 II Departure

 I.
 Arrival

{body}
*** END OF THE PROJECT GUTENBERG EBOOK NOTHING ***
Licence text that must not be read.
"""


def make_book(words: int = 1500) -> str:
    """A small Gutenberg-style book: header, contents, chapter I, curly quotes, footer."""
    vocab = [
        "the",
        "time",
        "machine",
        "\u201cquick\u201d",
        "brown",
        "fox",
        "it\u2019s",
        "over",
        "lazy",
        "dog.",
        "and",
        "then",
    ]
    body = " ".join(vocab[(i * 7 + i // 3) % len(vocab)] for i in range(words))
    return BOOK.format(body=body)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A tiny GPT-2 saved with save_pretrained beside the GPT-2 tokenizer, and a book file."""
    if not TOKENIZER_DIR.is_dir():
        pytest.skip("GPT-2 tokenizer files not present")
    d = tmp_path_factory.mktemp("tiny-gpt2")
    tiny_gpt2(vocab_size=50257).save_pretrained(d)
    transformers.GPT2Tokenizer(
        vocab=str(TOKENIZER_DIR / "vocab.json"), merges=str(TOKENIZER_DIR / "merges.txt")
    ).save_pretrained(d)
    book = d / "book.txt"
    book.write_text(make_book(), encoding="utf-8")
    return d, book


def tiny_eval_args(model_dir, book, json_out, configs, *extra) -> list[str]:
    """Arguments of ``python -m model_adapters.eval`` for a fast run on a tiny checkpoint."""
    args = ["--model", str(model_dir), "--text", str(book), "--tokens", "64",
            "--train-tokens", "600", "--sinks", "2", "--recent", "8", "--kmeans-iters", "3",
            "--json", str(json_out), "--no-progress"]
    for config in configs:
        args += ["--config", config]
    return args + [str(e) for e in extra]
