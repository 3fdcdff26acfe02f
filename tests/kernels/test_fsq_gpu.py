"""The compiled FSQ Triton kernels on a CUDA GPU against the float32 reference, their memory,
and their sync-free / CUDA-graph guarantees (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from fsq_cases import assert_rows_close, make_fsq_case

from kernels import (
    fsq_decode_attention,
    fsq_kernel_takes,
    reference_fsq_decode_attention,
    validate_fsq_args,
)
from kernels._fsq_plan import (
    SPLIT_TUNING,
    WS_TUNING,
    scratch_bytes,
    splits_for,
    uses_ws,
    ws_code_columns,
    ws_limit,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
QWEN3 = {"q_heads": 32, "kv_heads": 8, "head_dim": 128}
HOPPER = (torch.cuda.is_available() and torch.version.hip is None
          and torch.cuda.get_device_capability()[0] == 9)
GPT2 = {"q_heads": 12, "kv_heads": 12, "head_dim": 64}


def check(case, **kwargs):
    out = fsq_decode_attention(**case, backend="triton", **kwargs)
    assert_rows_close(out, reference_fsq_decode_attention(**case, out_dtype=torch.float32))
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("width", [682, 256, 84])  # Qwen3-8B at 12x (tiled), 32x, 97.5x
def test_gpu_qwen3_matches_reference(dtype, width):
    case = make_fsq_case(batch=3, width=width, archived=3000, sinks=4, recent=32, dtype=dtype,
                         device="cuda", archived_lengths=[3000, 1777, 1],
                         recent_lengths=[32, 0, 5], **QWEN3)
    out = check(case)
    assert fsq_kernel_takes(validate_fsq_args(**case))
    torch.testing.assert_close(fsq_decode_attention(**case), out)  # auto: the kernel


@pytest.mark.parametrize("levels,width", [(16, 192), (2, 256), (4, 100), (256, 64),
                                          (256, 300), (2, 1024)])
def test_gpu_gpt2_and_every_level(levels, width):
    case = make_fsq_case(batch=2, width=width, levels=levels, archived=2500, rope=None,
                         k_norm=False, device="cuda", **GPT2)
    check(case)


def test_gpu_float32_decoders_and_ragged_positions():
    case = make_fsq_case(batch=2, width=128, archived=2000, decoder_dtype=torch.float32,
                         device="cuda", positions=torch.randint(0, 4_000_000, (2, 2000)),
                         **QWEN3)
    check(case)


@pytest.mark.parametrize("start", [100_000, 1_000_000])
def test_gpu_long_context_far_positions(start):
    # theta angles and explicit tables at positions around 1e5 and 1e6, many splits
    case = make_fsq_case(batch=1, q_heads=8, kv_heads=2, head_dim=128, width=84,
                         archived=60_000, positions=start, device="cuda")
    for splits in (None, 1, 300):
        check(case, num_splits=splits)
    pos = torch.arange(start + 60_000, dtype=torch.float64, device="cuda")
    inv = 1e6 ** (-torch.arange(0, 128, 2, device="cuda").double() / 128)
    angles = torch.cat([pos[:, None] * inv] * 2, dim=1)
    check(dict(case, rope=(angles.cos().float(), angles.sin().float())))


@pytest.mark.parametrize("width", [256, 682])  # (682: codes in tiles)
def test_gpu_peak_memory_holds_no_per_position_keys_or_values(width):
    case = make_fsq_case(batch=2, width=width, archived=100_000, sinks=4, recent=32,
                         device="cuda", **QWEN3)
    problem = validate_fsq_args(**case)
    fsq_decode_attention(**case)  # compile, fill the RoPE table cache
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fsq_decode_attention(**case, check_codes=False)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    bound = scratch_bytes(problem, splits_for(problem, None)[1]) + (1 << 20)
    assert extra <= bound, (extra, bound)
    dense = 2 * 8 * 100_000 * 128 * 2 * 2
    assert extra < dense / 100


def _case(positions=True):
    # explicit positions run the Triton split kernel, consecutive ones (on Hopper) the
    # warp-specialized one
    return make_fsq_case(batch=2, width=256, archived=5000, sinks=4, recent=32, device="cuda",
                         positions=torch.arange(5000).repeat(2, 1) + 7 if positions else None,
                         **QWEN3)


@pytest.mark.parametrize("positions", [True, False])
def test_gpu_call_never_waits_for_the_gpu(no_gpu_sync, positions):
    case = _case(positions)
    assert uses_ws(validate_fsq_args(**case)) == (HOPPER and not positions)
    lengths = torch.tensor([5000, 1234], device="cuda")
    expected = fsq_decode_attention(**case, archived_lengths=lengths)  # checked: reads back
    with no_gpu_sync():
        out = fsq_decode_attention(**case, archived_lengths=lengths, check_lengths=False,
                                   check_positions=False)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("positions", [True, False])
def test_gpu_call_replays_from_a_cuda_graph(assert_graph_replays, positions):
    case = _case(positions)
    assert uses_ws(validate_fsq_args(**case)) == (HOPPER and not positions)

    def call():
        return fsq_decode_attention(**case, backend="triton", check_positions=False)

    def refill():  # new query and cache contents, same tensors
        case["query"].copy_(torch.randn_like(case["query"]))
        case["codes"].copy_(torch.randint_like(case["codes"], 256))

    assert_graph_replays(call, refill)



def _split_kernel(case, ws, **kwargs):
    saved = SPLIT_TUNING["ws"]
    SPLIT_TUNING["ws"] = ws
    try:
        return fsq_decode_attention(**case, backend="triton", **kwargs)
    finally:
        SPLIT_TUNING["ws"] = saved


@pytest.mark.skipif(not HOPPER, reason="the warp-specialized kernel needs a Hopper GPU")
@pytest.mark.parametrize("shape,width,levels,dtype,rope", [
    (QWEN3, 256, 16, torch.bfloat16, True),  # Qwen3-8B at 32x
    (QWEN3, 84, 16, torch.float16, True),  # and 97.5x
    (GPT2, 192, 16, torch.bfloat16, False),  # one query head per kv head, no RoPE or norm
    ({"q_heads": 32, "kv_heads": 2, "head_dim": 64}, 40, 256, torch.bfloat16, True),  # 16/kv
    ({"q_heads": 6, "kv_heads": 3, "head_dim": 32}, 100, 16, torch.float16, True),
])
@pytest.mark.parametrize("knobs", [{}, {"key_ahead": True}, {"halves": True, "key_ahead": True},
                                   {"fold_norm": False}, {"pv_ahead": True}],
                         ids=["shipped", "next-head-ahead", "pipelined-halves", "norm-unfolded",
                              "product-ahead"])
def test_gpu_warp_specialized_kernel_matches_the_split_kernel(ws_tuning, knobs, shape, width,
                                                              levels, dtype, rope):
    ws_tuning(**knobs)
    case = make_fsq_case(batch=3, width=width, levels=levels, archived=3000, sinks=4,
                         recent=8, dtype=dtype, device="cuda", rope=1e6 if rope else None,
                         k_norm=rope, archived_lengths=[3000, 65, 0], **shape)
    problem = validate_fsq_args(**case)
    assert ws_limit(problem) is None and uses_ws(problem)
    ref = reference_fsq_decode_attention(**case, out_dtype=torch.float32)
    split = _split_kernel(case, ws=False)
    for splits in (None, 1, 40):
        out = _split_kernel(case, ws=True, num_splits=splits)
        assert_rows_close(out, ref)
        torch.testing.assert_close(out, split, rtol=2e-2, atol=2e-3)


@pytest.fixture
def ws_tuning():
    """Sets ``WS_TUNING`` knobs for one test and puts the shipped ones back."""
    saved = dict(WS_TUNING)

    def set_knobs(**knobs):
        WS_TUNING.update(knobs)
        ws_code_columns.cache_clear()

    yield set_knobs
    set_knobs(**saved)


@pytest.mark.skipif(not HOPPER, reason="the warp-specialized kernel needs a Hopper GPU")
@pytest.mark.parametrize("knobs", [{}, {"bias_pad": False, "bias_mma": True}, {"trim": False},
                                   {"bias_pad": False},
                                   {"halves": True, "key_ahead": True, "bias_mma": True},
                                   {"halves": True, "key_ahead": True, "bias_pad": False}],
                         ids=["shipped", "bias-step", "all-columns", "bias-in-float",
                              "pipelined-halves", "pipelined-halves-bias-in-float"])
@pytest.mark.parametrize("width,bias,offset", [
    (84, True, 0),  # 42-byte rows read as shifted words: the bias in pad bytes 44 and 45
    (83, True, 0),  # an odd width: the last byte's high nibble is no code
    (84, True, 2),  # codes 2 bytes past a word: the byte-wise unpack, pad bytes from 42
    (84, False, 0),
    (192, True, 0),  # whole words
    (256, True, 0),  # no padding: the bias in float (or by one more MMA step)
])
def test_gpu_warp_specialized_code_columns(ws_tuning, knobs, width, bias, offset):
    # the bias carried by the padding bytes' codes (else by one more MMA step, else added
    # to the keys) and the trimmed key product, each on and off, whatever the bytes past a
    # row hold (random codes fill every byte)
    ws_tuning(**knobs)
    case = make_fsq_case(batch=3, width=width, archived=700, sinks=4, recent=8,
                         dtype=torch.bfloat16, device="cuda", bias=bias,
                         archived_lengths=[700, 130, 3], **QWEN3)
    codes = case["codes"]
    case["codes"] = torch.randint(0, 256, (codes.numel() + offset,), dtype=torch.uint8,
                                  device="cuda")[offset:].view(codes.shape)
    case["codes"][..., -1] &= 0x0F if width % 2 else 0xFF  # (fsq_pack's zero nibble)
    assert uses_ws(validate_fsq_args(**case))
    for splits in (None, 1):
        check(case, num_splits=splits)


@pytest.mark.skipif(not HOPPER, reason="the warp-specialized kernel needs a Hopper GPU")
def test_gpu_warp_specialized_kernel_long_context():
    # consecutive positions up to 70,011: 35 rows of the high angle table; 1,094 blocks in
    # one split
    case = make_fsq_case(batch=1, q_heads=8, kv_heads=2, head_dim=128, width=84,
                         archived=70_000, sinks=4, recent=8, device="cuda")
    assert uses_ws(validate_fsq_args(**case))
    for splits in (None, 1):
        check(case, num_splits=splits)
