"""The compiled Triton kernels on a CUDA GPU against the float32 reference (skipped without one)."""

from __future__ import annotations

import pytest
import torch
from kernels_cases import make_case, relative_error

from kernels import _plan, reference_decode_attention, rvq_decode_attention
from kernels._validate import validate_decode_args
from kernels.rvq_decode import triton_decode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DTYPES = [torch.float16, torch.bfloat16]
VARIANTS = _plan.VARIANTS


def run_variant(case, variant, num_splits=None):
    return triton_decode(validate_decode_args(**case), variant=variant, num_splits=num_splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape",
    [
        {"q_heads": 12, "kv_heads": 12, "head_dim": 64},  # GPT-2
        {"q_heads": 32, "kv_heads": 8, "head_dim": 128},  # Qwen3-8B
        {"q_heads": 40, "kv_heads": 2, "head_dim": 96},  # groups larger than one program
    ],
)
@pytest.mark.parametrize("stages", [(2, 2), (4, 2)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_matches_reference(dtype, shape, stages, variant):
    case = make_case(batch=4, archived=3000, codebook_size=256, key_stages=stages[0],
                     value_stages=stages[1], sinks=4, recent=32, dtype=dtype, device="cuda",
                     archived_lengths=[3000, 1777, 1, 0], recent_lengths=[32, 0, 5, 32],
                     **shape)
    ref = reference_decode_attention(**case, out_dtype=torch.float32)
    out = run_variant(case, variant)
    assert not out.isnan().any()
    assert relative_error(out, ref) <= 1e-2
    if variant == _plan.choose_variant(validate_decode_args(**case)):
        # backend "auto": the Triton path for CUDA tensors
        torch.testing.assert_close(rvq_decode_attention(**case), out)


def test_gpu_int16_codes_large_codebook():
    case = make_case(batch=2, archived=2000, codebook_size=4096, code_dtype=torch.int16,
                     key_stages=2, value_stages=2, device="cuda")
    out = rvq_decode_attention(**case, backend="triton")
    ref = reference_decode_attention(**case, out_dtype=torch.float32)
    assert relative_error(out, ref) <= 1e-2


def test_gpu_float32_codebooks():
    case = make_case(batch=2, q_heads=32, kv_heads=8, head_dim=128, archived=3000,
                     codebook_size=256, device="cuda")
    case["key_codebooks"] = case["key_codebooks"].float()
    case["value_codebooks"] = case["value_codebooks"].float()
    ref = reference_decode_attention(**case, out_dtype=torch.float32)
    for variant in VARIANTS:
        assert relative_error(run_variant(case, variant), ref) <= 1e-2, variant


@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_long_context_many_splits(variant):
    case = make_case(batch=1, q_heads=8, kv_heads=2, head_dim=128, archived=100_000,
                     codebook_size=256, key_stages=4, value_stages=2, device="cuda")
    ref = reference_decode_attention(**case, out_dtype=torch.float32)
    for splits in (None, 1, 700):
        out = run_variant(case, variant, splits)
        assert relative_error(out, ref) <= 1e-2, splits


def _coded_case():
    return make_case(batch=2, q_heads=32, kv_heads=8, head_dim=128, archived=5000,
                     codebook_size=256, sinks=4, recent=32, device="cuda")


def test_gpu_call_never_waits_for_the_gpu(no_gpu_sync):
    case = _coded_case()
    lengths = torch.tensor([5000, 1234], device="cuda")
    expected = rvq_decode_attention(**case, archived_lengths=lengths)  # checked: reads back
    with no_gpu_sync():
        default = rvq_decode_attention(**case, check_codes=False)
        ragged = rvq_decode_attention(**case, archived_lengths=lengths, check_codes=False,
                                      check_lengths=False)
    torch.testing.assert_close(ragged, expected, rtol=0, atol=0)
    torch.testing.assert_close(default, rvq_decode_attention(**case), rtol=0, atol=0)


def test_gpu_call_replays_from_a_cuda_graph(assert_graph_replays):
    case = _coded_case()

    def call():
        return rvq_decode_attention(**case, backend="triton", check_codes=False)

    def refill():  # new query and cache contents, same tensors
        case["query"].copy_(torch.randn_like(case["query"]))
        case["value_codes"].copy_(torch.randint_like(case["value_codes"], 256))

    assert_graph_replays(call, refill)


def test_gpu_trusted_path_runs_the_kernel_without_waiting(no_gpu_sync):
    from kernels_cases import coded_cache

    from kernels import decode_attention, kernel_takes

    case = _coded_case()
    cache = coded_cache(case)
    assert kernel_takes(case["query"], cache)
    expected = rvq_decode_attention(**case, scale=0.1)
    with no_gpu_sync():
        out = decode_attention(case["query"], cache, scale=0.1)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
