"""Tiny random-initialised GPT-2 and Qwen3 models for the model_adapters tests."""

from __future__ import annotations

import os

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
