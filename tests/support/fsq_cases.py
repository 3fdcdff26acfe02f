"""Random packed-FSQ caches for the FSQ kernel tests (CPU, interpreter and GPU)."""

from __future__ import annotations

import torch
from kernels_cases import add_exact_parts

QWEN3_THETA = 1_000_000.0


def make_fsq_case(*, batch=2, q_heads=4, kv_heads=2, head_dim=32, width=24, levels=16,
                  archived=40, sinks=2, recent=3, dtype=torch.float16, decoder_dtype=None,
                  device="cpu", seed=0, rope=QWEN3_THETA, k_norm=True, bias=True,
                  positions=None, archived_lengths=None, sink_lengths=None,
                  recent_lengths=None):
    """Keyword arguments of ``fsq_decode_attention`` for one random cache (random packed
    bytes: every bit pattern is a valid code for power-of-two levels). The decoders are
    scaled so that raw keys and values are of order one; ``positions`` is passed through
    (a tensor, or an int: the first archived position, consecutive after it)."""
    from kernels import fsq_pack

    g = torch.Generator().manual_seed(seed)
    decoder_dtype = decoder_dtype or dtype

    def randn(*shape, std=1.0, as_dtype=dtype):
        return (torch.randn(*shape, generator=g) * std).to(dtype=as_dtype, device=device)

    level = levels if isinstance(levels, int) else max(levels)
    if isinstance(levels, int) and levels & (levels - 1) == 0:
        # any byte is a valid row (bits past the last coordinate are ignored): no packing
        size = -(-width * (levels.bit_length() - 1) // 8)
        codes = torch.randint(0, 256, (batch, archived, size), generator=g).to(torch.uint8)
    else:
        ints = torch.randint(0, 1 << 30, (batch, archived, width), generator=g)
        codes = fsq_pack(ints % torch.tensor(levels if not isinstance(levels, int)
                                             else [levels] * width), levels)
    std = 2.0 / (level * width ** 0.5)
    case = {
        "query": randn(batch, q_heads, head_dim, std=1.0),
        "codes": codes.to(device),
        "levels": levels,
        "key_decoder": randn(kv_heads, head_dim, width, std=std, as_dtype=decoder_dtype),
        "value_decoder": randn(kv_heads, head_dim, width, std=std, as_dtype=decoder_dtype),
        "rope": rope,
    }
    if bias:
        case["key_bias"] = randn(kv_heads, head_dim, std=0.5, as_dtype=decoder_dtype)
        case["value_bias"] = randn(kv_heads, head_dim, std=0.5, as_dtype=decoder_dtype)
    if k_norm:
        case["k_norm"] = (torch.rand(head_dim, generator=g) * 2 + 0.5).to(decoder_dtype).to(
            device)
    if isinstance(positions, int):
        positions = positions + torch.arange(archived).repeat(batch, 1)
    if positions is not None:
        case["positions"] = positions.to(device)
    return add_exact_parts(case, randn, (batch, kv_heads, head_dim), sinks, recent, device,
                           archived_lengths=archived_lengths, sink_lengths=sink_lengths,
                           recent_lengths=recent_lengths)


def assert_rows_close(out: torch.Tensor, ref: torch.Tensor, *, rel=1e-2, max_abs=None):
    """Relative error <= ``rel`` on every (batch, head) row, and the largest absolute error
    <= ``max_abs`` (default ``2 * rel`` times the reference's largest magnitude)."""
    assert out.shape == ref.shape and not out.isnan().any()
    diff = out.float() - ref.float()
    rows = diff.norm(dim=-1) / ref.float().norm(dim=-1).clamp_min(1e-6)
    assert rows.max().item() <= rel, f"worst row relative error {rows.max().item():.2e}"
    bound = 2 * rel * ref.abs().max().item() if max_abs is None else max_abs
    assert diff.abs().max().item() <= bound, f"max abs error {diff.abs().max().item():.2e}"
