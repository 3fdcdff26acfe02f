"""Block-size plans of the one-hot kernel: every shape gets operands that ``tl.dot`` accepts."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kernels._onehot_plan import MAX_ACC, MAX_OPERAND, Plan  # noqa: E402


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

    from kernels import _plan
    from kernels._validate import validate_decode_args
    from kernels.rvq_decode import triton_decode

    def problem(**kw):
        return validate_decode_args(**make_case(**kw))

    assert _plan.choose_variant(problem(batch=1, q_heads=8, kv_heads=2)) == "onehot"
    assert _plan.choose_variant(problem(batch=3, q_heads=8, kv_heads=2)) == "onehot"
    assert _plan.choose_variant(problem(batch=1, q_heads=4, kv_heads=4)) == "onehot"
    assert _plan.choose_variant(problem(batch=3, q_heads=4, kv_heads=4)) == "atomic"
    with pytest.raises(ValueError, match="variant"):
        triton_decode(problem(dtype=torch.float16), variant="fast")


@pytest.mark.parametrize("tuning", [{"block_n": 48}, {"block_c": 8}, {"block_n": 0}])
def test_bad_block_sizes_are_refused(tuning):
    from kernels_cases import make_case

    from kernels import _onehot
    from kernels._validate import validate_decode_args

    problem = validate_decode_args(**make_case())
    name = next(iter(tuning))
    with pytest.raises(ValueError, match=f"{name} must be a power of two >= 16"):
        _onehot.decode(problem, **tuning)


def test_bad_prefetch_is_refused():
    from kernels_cases import make_case

    from kernels import _onehot
    from kernels._validate import validate_decode_args

    problem = validate_decode_args(**make_case())
    with pytest.raises(ValueError, match="prefetch must be >= 0, got -1"):
        _onehot.decode(problem, prefetch=-1)


# the H200's best counts, measured on Qwen3-8B shapes (132 multiprocessors, 3 resident programs)
@pytest.mark.parametrize("programs,capacity,expected", [
    (8, 32732, 32),  # batch 1, 32K: two programs per multiprocessor beat three shorter ones
    (8, 131036, 49),  # batch 1, 128K: three per multiprocessor, one round
    (8, 4092, 16),  # batch 1, 4K: capped by the 256-position minimum
    (64, 131036, 6),  # batch 8: 384 programs, one round of three (3 splits: 1.47x slower)
    (256, 131036, 3),  # batch 32: two rounds of three, no lone program left over
    (396, 10**6, 1),  # the sequences alone fill every slot
])
def test_split_count_follows_the_measured_best(programs, capacity, expected):
    from kernels._onehot_plan import _best_splits

    assert _best_splits(programs, capacity, 132, 3, 128) == expected


def test_lone_programs_cost_more_per_position():
    from kernels._onehot_plan import LOAD_SLOWDOWN, _rounds_cost

    assert _rounds_cost(1, 3) == LOAD_SLOWDOWN[1] > 1
    assert _rounds_cost(3, 3) == 3 and _rounds_cost(6, 3) == 6
    assert _rounds_cost(4, 3) == 3 + LOAD_SLOWDOWN[1]  # a round of three, then one alone
    assert _rounds_cost(5, 3) == 3 + 2 * LOAD_SLOWDOWN[2]
    assert _rounds_cost(2, 1) == 2 * LOAD_SLOWDOWN[1]  # with one resident, every round alone


@settings(max_examples=200, deadline=None, derandomize=True)
@given(programs=st.integers(1, 4096), capacity=st.integers(1, 1 << 21),
       sms=st.integers(1, 256), resident=st.integers(1, 4),
       block_n=st.sampled_from([16, 64, 128]))
def test_split_count_is_what_the_kernel_runs(programs, capacity, sms, resident, block_n):
    from kernels._onehot_plan import MAX_SPLITS, MIN_SPLIT_LEN, _best_splits
    from kernels._plan import split_layout

    splits = _best_splits(programs, capacity, sms, resident, block_n)
    assert 1 <= splits <= MAX_SPLITS
    assert splits <= max(1, -(-capacity // MIN_SPLIT_LEN))
    # decode rounds split lengths to whole blocks: the chosen count survives that unchanged
    assert split_layout(capacity, splits, block_n)[1] == splits


def test_choose_num_splits_uses_resident_programs():
    from kernels_cases import make_case

    from kernels._onehot_plan import _best_splits, choose_num_splits, plan_for, resident_programs
    from kernels._validate import validate_decode_args

    problem = validate_decode_args(**make_case(batch=2, q_heads=8, kv_heads=2, archived=5000,
                                               archived_lengths=[5000, 10]))
    assert resident_programs(4) == 3 and resident_programs(8) == 1
    block_n = plan_for(problem).block_n
    for warps in (4, 8):  # the CPU stands in for 4 multiprocessors
        assert choose_num_splits(problem, warps) == _best_splits(
            2 * 2, 5000, 4, resident_programs(warps), block_n)


def test_centroid_block_fills_the_multiprocessors():
    from kernels_cases import make_case

    from kernels._onehot_plan import default_block_c, plan_for
    from kernels._validate import validate_decode_args

    # the CPU stands in for 4 multiprocessors: 1 x 1 x 2 stages x 1 block of 64 < 4
    small = validate_decode_args(**make_case(batch=1, q_heads=2, kv_heads=1, archived=10))
    assert default_block_c(small, plan_for(small)) == 32
    wide = validate_decode_args(**make_case(batch=2, q_heads=4, kv_heads=2, archived=10))
    assert default_block_c(wide, plan_for(wide)) == 64


@pytest.mark.parametrize("num_warps, value_stages_p, block_n, expected", [
    (4, 2, 128, 2),  # the benchmark shapes: two value stages, four warps
    (4, 1, 128, 4),
    (4, 4, 128, 1),
    (4, 8, 128, 1),  # more entries than warps already
    (8, 2, 128, 4),
    (4, 1, 32, 2),  # a run keeps the 16 positions a tensor-core product needs
    (4, 1, 16, 1),
])
def test_position_parts_give_each_warp_a_batch_entry(num_warps, value_stages_p, block_n,
                                                     expected):
    from kernels._onehot_plan import position_parts

    parts = position_parts(num_warps, value_stages_p, block_n)
    assert parts == expected
    assert block_n // parts >= 16 and block_n % parts == 0


def test_score_table_layout_follows_key_stages():
    from kernels._onehot_plan import CENTROID_MAJOR_STAGES, Plan

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


def test_one_hot_kernel_bounds_its_score_tables():
    # 8 key stages of 32,768 centroids: a 4 MB table per (sequence, kv head); 40 sequences
    # would need 320 MB of scratch, so the one-hot kernel declines (the atomic one runs)
    import torch
    from kernels_cases import make_case

    from kernels._onehot_plan import supports
    from kernels._validate import validate_decode_args

    def case(batch):
        c = make_case(batch=batch, q_heads=8, kv_heads=2, head_dim=16, archived=4,
                      code_dtype=torch.int16)
        c["key_codebooks"] = torch.randn(2, 8, 32768, 16).half()
        c["key_codes"] = torch.randint(0, 32768, (batch, 2, 4, 8), dtype=torch.int16)
        return validate_decode_args(**c)

    assert supports(case(2)) and not supports(case(40))


def test_programs_beyond_a_grid_axis_are_refused_not_launched():
    # (batch, kv head, chunk) programs share a CUDA grid axis of at most 65,535
    from kernels_cases import make_case

    from kernels import _atomic, _onehot_plan, _plan
    from kernels._validate import validate_decode_args
    from kernels.rvq_decode import triton_decode

    def case(batch):
        return validate_decode_args(**make_case(batch=batch, q_heads=1, kv_heads=1, head_dim=8,
                                                archived=1, key_stages=1, value_stages=1,
                                                sinks=None, recent=None))

    assert _atomic.supports(case(_plan.MAX_GRID_Y))
    too_many = case(_plan.MAX_GRID_Y + 1)
    assert not _atomic.supports(too_many) and not _onehot_plan.supports(too_many)
    with pytest.raises(ValueError, match="batch x kv_heads x head chunks is 65536 programs"):
        triton_decode(too_many)


def test_kernels_take_histograms_up_to_the_atomic_limit():
    import torch
    from kernels_cases import make_case

    from kernels._atomic import supports
    from kernels._validate import validate_decode_args

    fits = validate_decode_args(**make_case(codebook_size=16))
    big = make_case(codebook_size=8, code_dtype=torch.int16)
    big["value_codebooks"] = torch.randn(2, 3, 20000, 32).half()  # 3 x 32768 padded columns
    big["value_codes"] = torch.randint(0, 20000, (2, 2, 40, 3), dtype=torch.int16)
    assert supports(fits) and not supports(validate_decode_args(**big))
