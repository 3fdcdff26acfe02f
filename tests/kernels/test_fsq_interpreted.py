"""The FSQ Triton kernels run by Triton's CPU interpreter, against the float32 reference.

Runs only in a process that has ``TRITON_INTERPRET=1`` from its start:
``test_fsq_interpreter.py`` starts one (see ``test_kernels_interpreted.py`` for why).
"""

from __future__ import annotations

import operator
import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 from process start; test_fsq_interpreter.py runs "
                "this module in such a process", allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from fsq_cases import assert_rows_close, make_fsq_case  # noqa: E402
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kernels import (  # noqa: E402
    RopeFrequencies,
    decode_fsq_problem,
    fsq_decode_attention,
    reference_fsq_decode_attention,
    validate_fsq_args,
)

DTYPES = [torch.float16, torch.bfloat16]


def check(case, **kwargs):
    out = fsq_decode_attention(**case, backend="triton", **kwargs)
    assert out.dtype == case["query"].dtype
    assert_rows_close(out, reference_fsq_decode_attention(**case, out_dtype=torch.float32))
    return out


def test_interpreter_loop_bounds_accept_one_element_arrays():
    # Triton 3.5/3.6's interpreter holds scalars as 1-d arrays; kernels._common patches the
    # conversion of a loop bound (without it, NumPy 2 raises "only 0-dimensional arrays")
    import triton.language as tl
    from triton.runtime import interpreter

    import kernels._common  # noqa: F401  (installs the patch)

    if hasattr(interpreter, "_LangPatchScope"):  # Triton 3.6: patches live in a scope
        scope = interpreter._LangPatchScope()
        interpreter._patch_lang_tensor(tl.tensor, scope)
        restore = scope.restore
    else:  # Triton 3.5 sets them on the class
        saved = tl.tensor.__dict__.get("__index__")
        interpreter._patch_lang_tensor(tl.tensor)

        def restore():
            if saved is None:
                del tl.tensor.__index__
            else:
                tl.tensor.__index__ = saved
    try:
        t = tl.tensor(interpreter.TensorHandle(np.array([7], dtype=np.int32), tl.int32),
                      tl.int32)
        assert operator.index(t) == 7 and len(range(t)) == 7
    finally:
        restore()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2), (3, 1)])
def test_qwen3_path_matches_reference(dtype, q_heads, kv_heads):
    case = make_fsq_case(q_heads=q_heads, kv_heads=kv_heads, dtype=dtype, archived=150,
                         archived_lengths=[150, 77], recent_lengths=[3, 1])
    check(case, num_splits=3)


@pytest.mark.parametrize("splits,tile", [(2, 64), (4, 8192)])
def test_merge_takes_splits_in_steps(monkeypatch, splits, tile):
    # the merge reads MERGE_SPLITS splits and MERGE_TILE floats a step: shrunk here so 9
    # splits take 5 or 3 steps (the last part-masked) and the codes 8 or 1 (2 query heads per
    # kv head; the second sequence has fewer splits); the query scaled up so the splits'
    # maxima differ widely
    import kernels._fsq as fsq

    monkeypatch.setattr(fsq, "MERGE_SPLITS", splits)
    monkeypatch.setattr(fsq, "MERGE_TILE", tile)
    case = make_fsq_case(q_heads=8, kv_heads=4, width=16, archived=1100,
                         archived_lengths=[1100, 300], recent_lengths=[3, 1])
    case["query"] = case["query"] * 4
    check(case, num_splits=9)


@pytest.mark.parametrize("levels,width", [(2, 40), (4, 33), (16, 84), (256, 17)])
def test_every_kernel_level(levels, width):
    check(make_fsq_case(levels=levels, width=width, archived=70), num_splits=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("levels,width,extra", [
    (16, 682, {}),  # Qwen3-8B at 12x: 11 tiles, the last part-filled
    (256, 300, {"rope": None, "k_norm": False, "bias": False}),
    (2, 1024, {"positions": 100_000, "decoder_dtype": torch.float32}),  # the widest
], ids=["12x", "8-bit-no-rope", "1-bit-widest"])
def test_codes_wider_than_a_tile_run_in_tiles(monkeypatch, dtype, levels, width, extra):
    from kernels import _fsq_wide
    from kernels._fsq_plan import TILE_WIDTH, WIDE_TUNING, splits_for

    launched = []
    kernel = _fsq_wide._split_kernel_wide

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]

    monkeypatch.setattr(_fsq_wide, "_split_kernel_wide", Spy())
    case = make_fsq_case(levels=levels, width=width, dtype=dtype, archived=300,
                         archived_lengths=[300, 77], recent_lengths=[3, 1], **extra)
    problem = validate_fsq_args(**case)
    assert problem.width > TILE_WIDTH
    count, _ = _fsq_wide.tiles(width, 8, WIDE_TUNING["tile"])
    assert (count - 1) * WIDE_TUNING["tile"] < width <= count * WIDE_TUNING["tile"]
    split_len, splits = splits_for(problem, 3)
    assert split_len % WIDE_TUNING["block_n"] == 0 and splits > 1
    check(case, num_splits=3)
    assert launched == [(splits, 2 * 2)]  # (splits, batch x kv heads)


def test_gpt2_path_no_rope_no_norm_no_bias():
    case = make_fsq_case(q_heads=4, kv_heads=4, head_dim=64, width=48, rope=None,
                         k_norm=False, bias=False, archived=90, archived_lengths=[90, 31])
    check(case, num_splits=2)


@pytest.mark.parametrize("start", [100_000, 1_000_000])
def test_positions_near_a_million_theta_and_tables(start):
    # angles exact to float32 far out: the reference takes them in float64
    case = make_fsq_case(archived=70, positions=start, head_dim=32)
    check(case, num_splits=2)
    pos = torch.arange(start + 80, dtype=torch.float64)
    inv = 1e6 ** (-torch.arange(0, 32, 2).double() / 32)
    angles = torch.cat([pos[:, None] * inv] * 2, dim=1)
    check(dict(case, rope=(angles.cos().float(), angles.sin().float())), num_splits=2)


@pytest.mark.parametrize("start", [0, 100_000])
def test_rope_by_given_inverse_frequencies(start):
    """RopeFrequencies: theta's own frequencies give theta's result exactly; a model's
    bfloat16-rounded ones rotate as float64 tables of those frequencies do."""
    case = make_fsq_case(archived=70, positions=start, head_dim=32)
    inv = 1e6 ** (-torch.arange(0, 32, 2).double() / 32)
    same = fsq_decode_attention(**dict(case, rope=RopeFrequencies(tuple(inv.tolist()))),
                                backend="triton", num_splits=2)
    assert torch.equal(same, fsq_decode_attention(**case, backend="triton", num_splits=2))
    rounded = inv.to(torch.bfloat16).double()
    check(dict(case, rope=RopeFrequencies(tuple(rounded.tolist()))), num_splits=2)
    pos = torch.arange(start + 80, dtype=torch.float64)
    angles = torch.cat([pos[:, None] * rounded] * 2, dim=1)
    tables = dict(case, rope=(angles.cos().float(), angles.sin().float()))
    assert_rows_close(fsq_decode_attention(**dict(case, rope=RopeFrequencies(
        tuple(rounded.tolist()))), backend="triton", num_splits=2),
        reference_fsq_decode_attention(**tables, out_dtype=torch.float32))


def test_ragged_positions_and_float32_decoders():
    case = make_fsq_case(archived=50, decoder_dtype=torch.float32,
                         positions=torch.randint(0, 3_000_000, (2, 50)))
    check(case, num_splits=3)


def test_archive_only_exact_only_and_empty_sequences_archive():
    check(make_fsq_case(sinks=None, recent=None, archived=30))
    check(make_fsq_case(archived=0, sinks=2, recent=5))
    check(make_fsq_case(batch=3, archived=64, archived_lengths=[64, 0, 1],
                        sink_lengths=[2, 0, 1], recent_lengths=[0, 3, 0]), num_splits=4)


def test_split_count_does_not_change_the_result():
    case = make_fsq_case(archived=200)
    outs = [check(case, num_splits=n).float() for n in (1, 2, 5)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("tuning", [{"block_n": 16, "prefetch": False},
                                    {"block_n": 64, "prefetch": True, "num_warps": 4},
                                    {"no_licm": False}])
def test_every_split_kernel_setting_the_sweep_tries(monkeypatch, tuning):
    # bench/fsq_kernels.py --sweep times these knobs on the GPU; each must stay correct
    from kernels import _fsq_plan

    for name, value in tuning.items():
        monkeypatch.setitem(_fsq_plan.SPLIT_TUNING, name, value)
    check(make_fsq_case(archived=150, positions=7, archived_lengths=[150, 33]), num_splits=3)
    check(make_fsq_case(archived=90, levels=2, width=40), num_splits=2)


def test_consecutive_positions_past_the_low_table():
    # positions sinks + n run past 2^11: each block's base angle takes the high table, its
    # offsets the low table's first rows
    check(make_fsq_case(archived=2300, q_heads=2, kv_heads=1, head_dim=16, width=16,
                        archived_lengths=[2300, 2100]), num_splits=3)


def test_large_scores_do_not_overflow():
    case = make_fsq_case(archived=60)
    case["query"] = case["query"] * 30
    check(case, num_splits=2)


def test_trusted_path_runs_the_kernel():
    problem = validate_fsq_args(**make_fsq_case(archived=40, archived_lengths=[40, 9]))
    assert_rows_close(decode_fsq_problem(problem, backend="triton"),
                      decode_fsq_problem(problem, backend="torch").float())


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 2, 5]),
    head_dim=st.sampled_from([16, 20, 64]),
    width=st.one_of(st.integers(1, 70), st.integers(250, 600)),  # (past 256: in tiles)
    levels=st.sampled_from([2, 4, 16, 256]),
    archived=st.integers(0, 140),
    sinks=st.integers(0, 3),
    recent=st.integers(0, 4),
    rope=st.sampled_from([None, 10_000.0]),
    dtype=st.sampled_from(DTYPES),
    splits=st.integers(1, 4),
    data=st.data(),
)
def test_property_matches_reference(batch, kv_heads, group, head_dim, width, levels, archived,
                                    sinks, recent, rope, dtype, splits, data):
    lengths = {
        name: data.draw(st.lists(st.integers(0, full), min_size=batch, max_size=batch),
                        label=name)
        for name, full in (("archived_lengths", archived), ("sink_lengths", sinks),
                           ("recent_lengths", recent))
    }
    assume(all(sum(lengths[n][b] for n in lengths) > 0 for b in range(batch)))
    case = make_fsq_case(batch=batch, q_heads=kv_heads * group, kv_heads=kv_heads,
                         head_dim=head_dim, width=width, levels=levels, archived=archived,
                         sinks=sinks, recent=recent, rope=rope, dtype=dtype, seed=archived,
                         k_norm=rope is not None, **lengths)
    check(case, num_splits=splits)


@pytest.mark.parametrize("rope", ["theta", "frequencies", "tables", None])
def test_trusted_path_is_one_operator_under_compile(rope):
    """Under torch.compile the Triton path is the operator fkv::fsq_decode (no graph break),
    computing what the launched call does, for every form of rope; the operator passes
    torch.library.opcheck (schema, fake tensors, autograd registration)."""
    from dataclasses import replace

    from kernels.fsq_decode import _op_args

    case = make_fsq_case(archived=40, archived_lengths=[40, 9], positions=3)
    inv = 1e6 ** (-torch.arange(0, 32, 2).double() / 32)
    angles = torch.cat([torch.arange(60).double()[:, None] * inv] * 2, dim=1)
    case["rope"] = {"theta": 1e6, "frequencies": RopeFrequencies(tuple(inv.tolist())),
                    "tables": (angles.cos().float(), angles.sin().float()), None: None}[rope]
    problem = validate_fsq_args(**case)
    want = decode_fsq_problem(problem, backend="triton")
    torch._dynamo.reset()
    step = torch.compile(lambda q: decode_fsq_problem(replace(problem, query=q),
                                                      backend="triton"),
                         fullgraph=True, backend="eager")
    assert torch.equal(step(problem.query), want)
    torch.library.opcheck(torch.ops.fkv.fsq_decode.default, _op_args(problem))
