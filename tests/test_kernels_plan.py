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
    assert _rvq_triton.choose_variant(problem(batch=1, q_heads=4, kv_heads=4)) == "onehot"
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


def test_bad_prefetch_is_refused():
    from kernels_cases import make_case

    from kernels import _rvq_onehot
    from kernels._validate import validate_decode_args

    problem = validate_decode_args(**make_case())
    with pytest.raises(ValueError, match="prefetch must be >= 0, got -1"):
        _rvq_onehot.decode(problem, prefetch=-1)


@pytest.mark.parametrize("programs,capacity,slots,expected", [
    (1, 10**6, 396, 391),  # one program per split: one wave, 391 of 396 slots (whole blocks)
    (396, 10**6, 396, 1),  # the sequences alone fill a wave
    (256, 131036, 396, 3),  # 2 splits would leave a second wave 29% full
    (64, 131036, 396, 6),  # 384 archive programs: one wave, not 5 splits' 320
    (8, 32732, 396, 32),  # capped by the 1024-position minimum
])
def test_split_count_fills_whole_waves(programs, capacity, slots, expected):
    from kernels._rvq_onehot import _best_splits

    assert _best_splits(programs, capacity, slots, 128) == expected


@settings(max_examples=200, deadline=None, derandomize=True)
@given(programs=st.integers(1, 4096), capacity=st.integers(1, 1 << 21),
       slots=st.integers(1, 2048), block_n=st.sampled_from([16, 64, 128]))
def test_split_count_is_what_the_kernel_runs(programs, capacity, slots, block_n):
    from kernels._rvq_onehot import MAX_SPLITS, MIN_SPLIT_LEN, _best_splits
    from kernels._rvq_triton import split_layout

    splits = _best_splits(programs, capacity, slots, block_n)
    assert 1 <= splits <= MAX_SPLITS
    assert splits <= max(1, -(-capacity // MIN_SPLIT_LEN))
    # decode rounds split lengths to whole blocks: the chosen count survives that unchanged
    assert split_layout(capacity, splits, block_n)[1] == splits


def test_choose_num_splits_uses_resident_programs():
    from kernels_cases import make_case

    from kernels._rvq_onehot import _best_splits, choose_num_splits, plan_for, resident_programs
    from kernels._validate import validate_decode_args

    problem = validate_decode_args(**make_case(batch=2, q_heads=8, kv_heads=2, archived=5000,
                                               archived_lengths=[5000, 10]))
    assert resident_programs(4) == 3 and resident_programs(8) == 1
    block_n = plan_for(problem).block_n
    for warps in (4, 8):  # the CPU stands in for 4 multiprocessors
        assert choose_num_splits(problem, warps) == _best_splits(
            2 * 2, 5000, resident_programs(warps) * 4, block_n)


def test_score_table_layout_follows_key_stages():
    from kernels._rvq_onehot import CENTROID_MAJOR_STAGES, Plan

    assert not Plan(4, 2, 256, CENTROID_MAJOR_STAGES - 1, 256).centroid_major
    assert Plan(4, 2, 256, CENTROID_MAJOR_STAGES, 256).centroid_major
    assert not Plan(1, 2, 256, CENTROID_MAJOR_STAGES, 256).centroid_major  # one head
    assert not Plan(4, 2, 256, 8, 256, centroid_major=False).centroid_major
    assert Plan(1, 1, 16, 1, 16, centroid_major=True).centroid_major


def test_triton_backend_on_cpu_tensors_needs_the_interpreter():
    import os

    from kernels_cases import make_case

    from kernels import rvq_decode_attention

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process interprets: the CPU launch is legal here")
    with pytest.raises(ValueError, match="needs CUDA tensors .*TRITON_INTERPRET=1.* on cpu"):
        rvq_decode_attention(**make_case(), backend="triton")


def test_kernels_take_histograms_up_to_the_atomic_limit():
    import torch
    from kernels_cases import make_case

    from kernels._rvq_triton import supports
    from kernels._validate import validate_decode_args

    fits = validate_decode_args(**make_case(codebook_size=16))
    big = make_case(codebook_size=8, code_dtype=torch.int16)
    big["value_codebooks"] = torch.randn(2, 3, 20000, 32).half()  # 3 x 32768 padded columns
    big["value_codes"] = torch.randint(0, 20000, (2, 2, 40, 3), dtype=torch.int16)
    assert supports(fits) and not supports(validate_decode_args(**big))
