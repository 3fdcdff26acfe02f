"""Random coded caches for the kernel tests (shared by the CPU, interpreter and GPU tests)."""

from __future__ import annotations

import torch


def make_case(*, batch=2, q_heads=4, kv_heads=2, head_dim=32, archived=40, key_stages=2,
              value_stages=2, codebook_size=16, sinks=2, recent=3, dtype=torch.float16,
              code_dtype=torch.uint8, device="cpu", seed=0, archived_lengths=None,
              sink_lengths=None, recent_lengths=None):
    """Keyword arguments for ``rvq_decode_attention`` describing one random coded cache."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(dtype=dtype, device=device)

    def codes(stages):
        c = torch.randint(0, codebook_size, (batch, kv_heads, archived, stages), generator=g)
        return c.to(dtype=code_dtype, device=device)

    case = {
        "query": randn(batch, q_heads, head_dim, std=2.0),
        "key_codes": codes(key_stages),
        "value_codes": codes(value_stages),
        "key_codebooks": randn(kv_heads, key_stages, codebook_size, head_dim),
        "value_codebooks": randn(kv_heads, value_stages, codebook_size, head_dim),
    }
    return add_exact_parts(case, randn, (batch, kv_heads, head_dim), sinks, recent, device,
                           archived_lengths=archived_lengths, sink_lengths=sink_lengths,
                           recent_lengths=recent_lengths)


def add_exact_parts(case: dict, randn, dims, sinks, recent, device, **lengths) -> dict:
    """Add random exact sinks and recents (``randn(*shape)``; ``dims`` = (batch, kv_heads,
    head_dim); ``None`` leaves a segment out) and the given lengths to a case; returns it."""
    batch, kv_heads, head_dim = dims
    for seg, n in (("sink", sinks), ("recent", recent)):
        if n is not None:
            case[f"{seg}_keys"] = randn(batch, kv_heads, n, head_dim)
            case[f"{seg}_values"] = randn(batch, kv_heads, n, head_dim)
    for name, value in lengths.items():
        if value is not None:
            case[name] = torch.tensor(value, device=device)
    return case


def coded_cache(case):
    """The ``kernels.CodedCache`` of a case (absent exact segments as empty tensors)."""
    from kernels import CodedCache

    q = case["query"]
    empty = q.new_zeros(q.shape[0], case["key_codebooks"].shape[0], 0, q.shape[2])
    return CodedCache(
        case["key_codes"], case["value_codes"], case["key_codebooks"], case["value_codebooks"],
        case.get("sink_keys", empty), case.get("sink_values", empty),
        case.get("recent_keys", empty), case.get("recent_values", empty),
        sink_lengths=case.get("sink_lengths"), archived_lengths=case.get("archived_lengths"),
        recent_lengths=case.get("recent_lengths"))



def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()
