"""The Triton kernels run by Triton's CPU interpreter, against the float32 reference.

``TRITON_INTERPRET=1`` must be set before triton compiles a kernel, and setting it in a process
would change how every other test module's triton kernels run. So these tests run only in a
process that has it from the start: ``test_kernels_interpreter.py`` starts one for them, and
``TRITON_INTERPRET=1 pytest tests/kernels/test_kernels_interpreted.py`` runs them directly.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 from process start; test_kernels_interpreter.py runs "
                "this module in such a process", allow_module_level=True)

import torch  # noqa: E402
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from kernels_cases import make_case, relative_error  # noqa: E402

from kernels import _plan, reference_decode_attention, rvq_decode_attention  # noqa: E402
from kernels._validate import validate_decode_args  # noqa: E402
from kernels.rvq_decode import triton_decode  # noqa: E402

TOLERANCE = 1e-2
DTYPES = [torch.float16, torch.bfloat16]


def _assert_close(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    assert not out.isnan().any()
    err = relative_error(out, ref)
    assert err <= TOLERANCE, f"relative error {err:.2e}"


def check(case, **kwargs):
    """The public function (variant chosen per problem), then the other kernel variants."""
    out = rvq_decode_attention(**case, backend="triton", **kwargs)
    ref = reference_decode_attention(**case, out_dtype=torch.float32)
    _assert_close(out, ref, case["query"].dtype)
    problem = validate_decode_args(**case)
    for variant in _plan.VARIANTS:
        if variant != _plan.choose_variant(problem):
            other = triton_decode(problem, variant=variant,
                                  num_splits=kwargs.get("num_splits"))
            _assert_close(other, ref, case["query"].dtype)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2), (3, 1), (20, 1)])
def test_matches_reference(dtype, q_heads, kv_heads):
    case = make_case(q_heads=q_heads, kv_heads=kv_heads, dtype=dtype, archived=70,
                     key_stages=4, value_stages=2, archived_lengths=[70, 33],
                     recent_lengths=[3, 1])
    check(case, num_splits=3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int16_codes_and_unequal_codebooks(dtype):
    case = make_case(dtype=dtype, code_dtype=torch.int16, codebook_size=300, archived=50,
                     key_stages=1, value_stages=3, head_dim=24)
    check(case, num_splits=2)


def test_float32_codebooks():
    case = make_case(archived=50, q_heads=8, kv_heads=2)
    case["key_codebooks"] = case["key_codebooks"].float()
    case["value_codebooks"] = case["value_codebooks"].float()
    check(case, num_splits=2)


def test_archive_only_and_exact_only():
    check(make_case(sinks=None, recent=None, archived=30))
    check(make_case(archived=0, sinks=2, recent=5))


def test_sequence_with_empty_archive_beside_a_full_one():
    case = make_case(batch=3, archived=64, archived_lengths=[64, 0, 1], sink_lengths=[2, 0, 1],
                     recent_lengths=[0, 3, 0])
    check(case, num_splits=4)


def test_split_count_does_not_change_the_result():
    case = make_case(archived=100, q_heads=2, kv_heads=2)
    outs = [check(case, num_splits=n).float() for n in (1, 2, 7)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("q_heads,kv_heads", [(8, 2), (2, 2)])
def test_several_position_blocks_per_split(q_heads, kv_heads):
    # 300 positions: full blocks of the one-hot kernel's 128 and a partial last block
    from kernels._onehot_plan import plan_for

    case = make_case(q_heads=q_heads, kv_heads=kv_heads, archived=300, codebook_size=256,
                     head_dim=16, archived_lengths=[300, 211])
    assert 211 % plan_for(validate_decode_args(**case)).block_n != 0
    check(case, num_splits=1)


def test_merge_of_more_splits_than_one_step():
    # the value merge reads 16 splits per step here: 40 splits take two full steps and a
    # partial one (19 for the shorter sequence: one and a partial one)
    from kernels import _onehot
    from kernels._plan import split_layout

    case = make_case(q_heads=4, kv_heads=2, archived=640, archived_lengths=[640, 300])
    problem = validate_decode_args(**case)
    assert split_layout(640, 40, 16) == (16, 40)
    out = _onehot.decode(problem, num_splits=40, block_n=16)
    _assert_close(out, reference_decode_attention(**case, out_dtype=torch.float32),
                  case["query"].dtype)


def test_sixteen_heads_per_program():
    # one value stage: a program holds all 16 heads of the group, no padding rows
    from kernels._onehot_plan import plan_for

    case = make_case(q_heads=16, kv_heads=1, value_stages=1, archived=90,
                     archived_lengths=[90, 41])
    assert plan_for(validate_decode_args(**case)).block_g == 16
    check(case, num_splits=3)


@pytest.mark.parametrize("key_stages", [2, 4])
def test_both_score_table_layouts(key_stages):
    # the default layout depends on the key stages: run each layout at each count
    from kernels import _onehot

    case = make_case(q_heads=8, kv_heads=2, archived=150, key_stages=key_stages,
                     codebook_size=40, archived_lengths=[150, 77])
    problem = validate_decode_args(**case)
    ref = reference_decode_attention(**case, out_dtype=torch.float32)
    for centroid_major in (False, True):
        out = _onehot.decode(problem, num_splits=2, centroid_major=centroid_major)
        _assert_close(out, ref, case["query"].dtype)


def test_large_scores_do_not_overflow():
    # scores in the hundreds: a softmax without a running maximum would give inf / NaN
    case = make_case(archived=40)
    case["query"] = case["query"] * 40
    check(case, num_splits=2)


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([16, 20, 64]),
    archived=st.integers(0, 90),
    sinks=st.integers(0, 3),
    recent=st.integers(0, 5),
    key_stages=st.integers(1, 4),
    value_stages=st.integers(1, 3),
    codebook_size=st.sampled_from([4, 16, 33]),
    dtype=st.sampled_from(DTYPES),
    code_dtype=st.sampled_from([torch.uint8, torch.int16]),
    splits=st.integers(1, 5),
    data=st.data(),
)
def test_property_matches_reference(batch, kv_heads, group, head_dim, archived, sinks, recent,
                                    key_stages, value_stages, codebook_size, dtype, code_dtype,
                                    splits, data):
    lengths = {
        name: data.draw(st.lists(st.integers(0, full), min_size=batch, max_size=batch),
                        label=name)
        for name, full in (("archived_lengths", archived), ("sink_lengths", sinks),
                           ("recent_lengths", recent))
    }
    assume(all(sum(lengths[n][b] for n in lengths) > 0 for b in range(batch)))
    case = make_case(batch=batch, q_heads=kv_heads * group, kv_heads=kv_heads,
                     head_dim=head_dim, archived=archived, key_stages=key_stages,
                     value_stages=value_stages, codebook_size=codebook_size, sinks=sinks,
                     recent=recent, dtype=dtype, code_dtype=code_dtype, seed=archived,
                     **lengths)
    check(case, num_splits=splits)


def test_trusted_path_runs_the_kernel():
    from kernels_cases import coded_cache

    from kernels import decode_attention

    case = make_case(q_heads=8, kv_heads=2, archived_lengths=[40, 9], recent_lengths=[1, 3])
    out = decode_attention(case["query"], coded_cache(case), scale=32 ** -0.5, backend="triton")
    _assert_close(out, reference_decode_attention(**case, out_dtype=torch.float32),
                  case["query"].dtype)
