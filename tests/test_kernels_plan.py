"""Block-size plans of the one-hot kernel: every shape gets operands that ``tl.dot`` accepts."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kernels._rvq_onehot import MAX_ACC, MAX_OPERAND, Plan  # noqa: E402


@settings(max_examples=200, deadline=None, derandomize=True)
@given(group=st.integers(1, 64), value_stages=st.integers(1, 8),
       value_codebook=st.integers(1, 32768), key_stages=st.integers(1, 8),
       key_codebook=st.integers(1, 32768))
def test_plan_fits_tensor_core_operands(group, value_stages, value_codebook, key_stages,
                                        key_codebook):
    plan = Plan(group, value_stages, value_codebook, key_stages, key_codebook)
    assert plan.codebook_p >= value_codebook and plan.key_codebook_p >= key_codebook
    assert plan.value_stages_p >= value_stages
    assert plan.hi * plan.lo == plan.codebook_p and plan.lo == 1 << plan.lo_bits
    if not plan.supported:
        assert plan.value_stages_p * plan.codebook_p > MAX_ACC  # even one head is too many
        return
    assert plan.lo >= 16 and plan.block_g * plan.hi >= 16 and plan.block_n >= 16
    assert plan.block_g < 2 * group
    assert plan.value_stages_p * plan.block_g * plan.codebook_p <= MAX_ACC
    # both one-hot operands fit their budget, unless the block is already the smallest
    per_position = plan.value_stages_p * max(plan.block_g * plan.hi, plan.lo)
    assert per_position * plan.block_n <= MAX_OPERAND or plan.block_n == 16


@pytest.mark.parametrize("group,expect_g,expect_hi,expect_lo", [(1, 1, 16, 16), (4, 4, 8, 32)])
def test_plan_for_benchmark_shapes(group, expect_g, expect_hi, expect_lo):
    plan = Plan(group, 2, 256, 2, 256)  # GPT-2 (MHA) and Qwen3-8B (4 heads per kv head)
    assert (plan.block_g, plan.hi, plan.lo) == (expect_g, expect_hi, expect_lo)


def test_variant_choice_and_bad_variant():
    import torch
    from kernels_cases import make_case

    from kernels import _rvq_triton
    from kernels._validate import validate_decode_args

    def problem(**kw):
        return validate_decode_args(**make_case(**kw))

    assert _rvq_triton.choose_variant(problem(batch=1, q_heads=8, kv_heads=2)) == "onehot"
    assert _rvq_triton.choose_variant(problem(batch=3, q_heads=8, kv_heads=2)) == "onehot"
    assert _rvq_triton.choose_variant(problem(batch=1, q_heads=4, kv_heads=4)) == "atomic"
    assert _rvq_triton.choose_variant(problem(batch=3, q_heads=4, kv_heads=4)) == "atomic"
    with pytest.raises(ValueError, match="variant"):
        _rvq_triton.decode(problem(dtype=torch.float16), variant="fast")


@pytest.mark.parametrize("tuning", [{"block_n": 48}, {"block_c": 8}, {"block_n": 0}])
def test_bad_block_sizes_are_refused(tuning):
    from kernels_cases import make_case

    from kernels import _rvq_onehot
    from kernels._validate import validate_decode_args

    problem = validate_decode_args(**make_case())
    name = next(iter(tuning))
    with pytest.raises(ValueError, match=f"{name} must be a power of two >= 16"):
        _rvq_onehot.decode(problem, **tuning)
