"""FSQ decode attention on the CPU: the packing contract, argument checks, the RoPE angle
reduction and the torch reference against transformers' Qwen3 key path."""

from __future__ import annotations

import math

import pytest
import torch
from fsq_cases import QWEN3_THETA, assert_rows_close, make_fsq_case
from hypothesis import given
from hypothesis import strategies as st

from kernels import (
    RopeFrequencies,
    decode_fsq_problem,
    fsq_decode_attention,
    fsq_kernel_takes,
    fsq_pack,
    fsq_unpack,
    reference_fsq_decode_attention,
    validate_fsq_args,
)
from kernels._fsq_plan import (
    MAX_THETA_POSITION,
    ROPE_RADIX_BITS,
    SPLIT_TUNING,
    WS_BUFFER_CHOICES,
    WS_MAX_COLUMNS,
    WS_MAX_HEADS,
    WS_SHARED_LIMIT,
    WS_SHARED_SLACK,
    best_split_len,
    choose_num_splits,
    default_block_n,
    pow2_chunks,
    scratch_bytes,
    split_count,
    splits_for,
    theta_tables,
    uses_ws,
    ws_block_bytes,
    ws_code_columns,
    ws_heads,
    ws_limit,
    ws_shared_bytes,
)
from kernels._plan import split_layout
from kernels.fsq_reference import reconstruct_keys, rope_cos_sin


def test_bit_order_is_little_endian():
    # L=16: coordinate 2k is the low nibble of byte k
    assert fsq_pack(torch.tensor([1, 2, 3]), 16).tolist() == [0x21, 0x03]
    # L=4: two bits each, the first coordinate in the lowest bits
    assert fsq_pack(torch.tensor([1, 2, 3, 0]), 4).tolist() == [1 | 2 << 2 | 3 << 4]
    # mixed levels 8, 5, 3: 3 + 3 + 2 bits in one byte
    assert fsq_pack(torch.tensor([5, 4, 2]), [8, 5, 3]).tolist() == [5 | 4 << 3 | 2 << 6]
    assert fsq_pack(torch.tensor([200, 7]), 256).tolist() == [200, 7]
    assert fsq_pack(torch.tensor([1] * 9), 2).tolist() == [255, 1]


@given(
    levels=st.one_of(st.sampled_from([2, 4, 16, 256, 3, 5, 8, 1000]),
                     st.lists(st.integers(2, 300), min_size=1, max_size=12)),
    rows=st.integers(0, 3),
    width=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_pack_round_trip(levels, rows, width, seed):
    if not isinstance(levels, int):
        width = len(levels)
    g = torch.Generator().manual_seed(seed)
    top = torch.tensor(levels if not isinstance(levels, int) else [levels] * width)
    codes = torch.randint(0, 1 << 20, (rows, width), generator=g) % top
    packed = fsq_pack(codes, levels)
    bits = sum(math.ceil(math.log2(v)) for v in top.tolist())
    assert packed.dtype == torch.uint8 and packed.shape == (rows, math.ceil(bits / 8))
    assert torch.equal(fsq_unpack(packed, levels, width), codes)


def test_pack_and_unpack_refuse_what_does_not_fit():
    with pytest.raises(ValueError, match="outside"):
        fsq_pack(torch.tensor([16]), 16)
    with pytest.raises(ValueError, match="outside"):
        fsq_pack(torch.tensor([-1]), 16)
    with pytest.raises(ValueError, match="integer"):
        fsq_pack(torch.tensor([1.0]), 16)
    with pytest.raises(ValueError, match="levels has 2 entries"):
        fsq_pack(torch.tensor([1, 2, 3]), [4, 4])
    with pytest.raises(ValueError, match=">= 2"):
        fsq_pack(torch.tensor([0]), 1)
    with pytest.raises(ValueError, match="packed must be uint8"):
        fsq_unpack(torch.zeros(3, dtype=torch.uint8), 16, 3)


def _raises(match, **changes):
    case = make_fsq_case()
    case.update(changes)
    with pytest.raises(ValueError, match=match):
        fsq_decode_attention(**case)


def test_arguments_are_checked_and_named():
    case = make_fsq_case()
    q, kd = case["query"], case["key_decoder"]
    _raises("codes must have dtype", codes=case["codes"].to(torch.int16))
    _raises("codes has shape .*packed bytes", codes=case["codes"][..., :-1])
    _raises("levels has 3 entries", levels=[16, 16, 16])
    # levels are checked once per value and then cached: values equal to a cached tuple
    # (a float, a bool) are still refused
    width = case["key_decoder"].shape[2]
    fsq_decode_attention(**dict(case, levels=(16,) * width))
    _raises("levels must hold ints", levels=(16.0,) + (16,) * (width - 1))
    _raises("levels must hold ints", levels=(True,) + (16,) * (width - 1))
    _raises("value_decoder has shape", value_decoder=case["value_decoder"][..., :-1])
    _raises("key_decoder has shape", key_decoder=kd[:, :-1])
    _raises("not a multiple", query=q[:, :3])
    _raises("key_bias must have shape", key_bias=case["key_bias"][:, :-1])
    _raises("k_norm has shape", k_norm=case["k_norm"][:-1])
    _raises("norm_eps", norm_eps=0.0)
    _raises("rope must be None", rope="theta")
    _raises("rope must be None", rope=True)
    _raises(r"needs 16 inverse frequencies \(head_dim / 2\), got 3",
            rope=RopeFrequencies((1.0, 0.5, 0.25)))
    _raises("must be positive finite floats, got -1.0", rope=RopeFrequencies((-1.0,) * 16))
    _raises("must be positive finite floats, got nan", rope=RopeFrequencies((float("nan"),) * 16))
    _raises("rope cos must have dtype", rope=(torch.ones(100, 32).half(), torch.ones(100, 32)))
    _raises("positions must have shape", positions=torch.zeros(2, 3, dtype=torch.int64))
    _raises("positions hold values from", positions=torch.full((2, 40), MAX_THETA_POSITION))
    _raises("RoPE tables' rows", positions=torch.full((2, 40), 100),
            rope=(torch.ones(100, 32), torch.ones(100, 32)))
    _raises("default positions", rope=(torch.ones(30, 32), torch.ones(30, 32)))
    _raises("default positions", rope=(torch.ones(30, 32), torch.ones(30, 32)),
            archived_lengths=torch.tensor([5, 40]))  # (lengths known on the host as a tensor)
    _raises("archived_lengths must lie", archived_lengths=[41, 2])
    _raises("backend must be", backend="cuda")
    _raises("num_splits", num_splits=0)
    bad = fsq_pack(torch.zeros(2, 40, 24, dtype=torch.int64), [5] * 24)
    bad[0, 0, 0] = 7  # coordinate 0 of level 5 holds 7
    _raises("codes hold 1 coordinates at or above", levels=[5] * 24, codes=bad)


@pytest.mark.parametrize("change,limit", [
    ({"width": 1030}, "exceeds the kernel's limit of 1024"),
    ({"levels": 8}, "not one uniform level"),
    ({"levels": [16] * 23 + [4]}, "not one uniform level"),
])
def test_triton_names_the_kernel_limit(change, limit):
    case = make_fsq_case(**({"width": len(change["levels"])} if "levels" in change and
                            not isinstance(change["levels"], int) else {}), **change)
    with pytest.raises(ValueError, match=limit):
        fsq_decode_attention(**case, backend="triton")
    # auto runs the reference instead
    assert not fsq_kernel_takes(validate_fsq_args(**case))
    out = fsq_decode_attention(**case)
    torch.testing.assert_close(out, reference_fsq_decode_attention(**case))


@pytest.mark.parametrize("change,reason", [
    ({"decoder_dtype": torch.float32}, "float16/bfloat16 query and key decoder"),
    ({"decoder_dtype": torch.float16}, "float16/bfloat16 query and key decoder"),
    ({"levels": 4}, "16- or 256-level codes"),
    ({"head_dim": 24}, "head_dim a power of two in [32, 128]"),
    ({"head_dim": 16}, "head_dim a power of two in [32, 128]"),
    ({"head_dim": 256, "width": 64}, "head_dim a power of two in [32, 128]"),
    ({"q_heads": 34}, "at most 16 query heads per kv head"),
    ({"positions": 5}, "RoPE by theta at consecutive positions"),
    ({"width": 257}, "at most 256 code coordinates"),
    ({}, "needs a Hopper GPU"),  # everything else fits: these tensors are on the CPU
    ({"rope": None, "positions": 5}, "needs a Hopper GPU"),  # explicit positions, no RoPE
])
def test_warp_specialized_kernel_names_what_it_needs(change, reason):
    case = make_fsq_case(**{"dtype": torch.bfloat16, **change})
    problem = validate_fsq_args(**case)
    assert reason in ws_limit(problem)
    assert not uses_ws(problem)


def test_warp_specialized_kernel_needs_triton_3_6(monkeypatch):
    from kernels import _fsq_plan

    problem = validate_fsq_args(**make_fsq_case(dtype=torch.bfloat16))
    monkeypatch.setattr(_fsq_plan, "_triton_version", lambda: (3, 5))
    assert "needs Triton >= 3.6 (Gluon), found 3.5" in ws_limit(problem)
    monkeypatch.setattr(_fsq_plan, "_triton_version", lambda: (3, 6))
    assert "needs a Hopper GPU" in ws_limit(problem)


def test_warp_specialized_kernel_head_dims_and_shared_memory():
    # head_dim 256 would need 128 accumulator registers per thread for a block's keys
    big = validate_fsq_args(**make_fsq_case(head_dim=256, width=64, dtype=torch.bfloat16))
    assert "needs head_dim a power of two in [32, 128]" in ws_limit(big)
    # the widest codes at the largest head_dim fit a Hopper block's shared memory
    widest = validate_fsq_args(**make_fsq_case(head_dim=128, width=256, levels=256,
                                               dtype=torch.bfloat16))
    assert "needs a Hopper GPU" in ws_limit(widest)  # every other requirement holds
    assert ws_shared_bytes(256, 128, 8) + WS_SHARED_SLACK <= WS_SHARED_LIMIT


def test_kv_heads_per_program_of_the_warp_specialized_kernel():
    # Qwen3-8B (8 kv heads x 4 query heads, head_dim 128) and GPT-2 (12 x 1, head_dim 64):
    # (kv heads per program, code buffers, key buffers)
    assert ws_heads(8, 4, 256, 128, 4) == (2, 2, 1)  # 32x: two decoders fit with 2 + 1
    assert ws_heads(8, 4, 84, 128, 4) == (2, 3, 4)  # 97.5x: 8 query heads, four key buffers
    assert ws_heads(12, 1, 192, 64, 4) == (4, 2, 2)  # four decoders fit beside two code buffers
    assert ws_heads(6, 1, 84, 64, 4)[0] == 2  # (a power of two dividing the kv heads)
    assert ws_heads(2, 16, 40, 64, 8) == (1, 3, 2)  # 16 query heads: one kv head


@given(kv_heads=st.integers(1, 16), group=st.integers(1, 16), width=st.integers(1, 256),
       head_dim=st.sampled_from([32, 64, 128]), bits=st.sampled_from([4, 8]),
       norm=st.booleans(), bias=st.booleans())
def test_kv_heads_per_program_are_the_most_that_fit(kv_heads, group, width, head_dim, bits,
                                                    norm, bias):
    def buffers(heads):  # the first (code, key) buffers that fit, in the plan's order
        fit = [(z, k) for z, k in WS_BUFFER_CHOICES
               if ws_shared_bytes(width, head_dim, bits, norm, heads, z, "mma" if bias else None,
                                  k)
               + WS_SHARED_SLACK <= WS_SHARED_LIMIT]
        return fit[0] if fit else None

    allowed = [h for h in (1, 2, 4) if h == 1 or (
        h <= WS_MAX_HEADS and kv_heads % h == 0 and h * group <= WS_MAX_COLUMNS
        and buffers(h) is not None)]
    heads, code_stages, key_stages = ws_heads(kv_heads, group, width, head_dim, bits, norm,
                                              bias)
    assert heads == max(allowed)
    assert (code_stages, key_stages) == ((3, 2) if heads == 1 else buffers(heads))


@given(start=st.integers(0, 64).map(lambda i: 16 * i), count=st.integers(0, 512))
def test_pow2_chunks_cover_whole_mma_steps(start, count):
    chunks = pow2_chunks(start, count)
    sizes = [size for _, size in chunks]
    assert sum(sizes) == -(-count // 16) * 16  # whole steps of 16, nothing more
    assert all(size >= 16 and size & (size - 1) == 0 for size in sizes)
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    assert [first for first, _ in chunks] == [start + sum(sizes[:i]) for i in range(len(sizes))]


def _tile_product(width, bits, fast, words, bias, bias_pad, trim, codes, decoder, rng):
    """One position's key product as the warp-specialized kernel forms it, in integers: the
    unpack's code tile (the row's bytes; for shifted words the next row's bytes up to the
    word's end; 1 from there on) times the decoder rows the prologue stores, over the
    columns ``ws_code_columns`` keeps."""
    step, nbytes = 8 // bits, math.ceil(width * bits / 8)
    block_b = ws_block_bytes(width, bits)
    bias_code, chunks = ws_code_columns(width, bits, nbytes, fast, words, bias is not None,
                                        bias_pad, trim)
    row = [0] * nbytes
    for k, code in enumerate(codes):
        row[k // step] |= code << (bits * (k % step))
    first_pad = -(-nbytes // 4) * 4 if words else nbytes
    row += [int(b) for b in rng.integers(0, 256, first_pad - nbytes)]  # the next row's
    row += [1] * (block_b - len(row))
    columns = range(2 * block_b) if fast else range(block_b * step)
    coordinate = [2 * (c % block_b) + c // block_b if fast else c for c in columns]
    value = [(row[k // step] >> (bits * (k % step))) & ((1 << bits) - 1) for k in coordinate]
    high, low = (bias // 3, bias - bias // 3) if bias is not None else (0, 0)

    def decoder_row(k):
        if k < width:
            return decoder[k]
        return high if k == bias_code else low if bias_code >= 0 and k == bias_code + step else 0

    kept = [c for first, count in chunks for c in range(first, first + count)] or columns
    assert all(c < len(columns) for c in kept) and len(set(kept)) == len(kept)
    product = sum(value[c] * decoder_row(coordinate[c]) for c in kept)
    return product + (bias if bias is not None and bias_code < 0 else 0), bias_code, chunks


@given(width=st.integers(1, 256), bits=st.sampled_from([4, 8]), data=st.data(),
       bias_pad=st.booleans(), trim=st.booleans(), with_bias=st.booleans())
def test_code_columns_of_the_warp_specialized_kernel_keep_the_product(width, bits, data,
                                                                      bias_pad, trim,
                                                                      with_bias):
    """The bias carried by the padding bytes' ones and the trimmed columns give the product
    over all codes plus the bias, whatever the next row's bytes are."""
    import numpy as np

    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    fast = bits == 4 and ws_block_bytes(width, bits) >= 64 and data.draw(st.booleans())
    words = fast and data.draw(st.booleans())
    codes = [int(c) for c in rng.integers(0, 1 << bits, width)]
    decoder = [int(d) for d in rng.integers(-1000, 1000, width)]
    bias = int(rng.integers(-10**6, 10**6)) if with_bias else None
    product, bias_code, chunks = _tile_product(width, bits, fast, words, bias, bias_pad, trim,
                                               codes, decoder, rng)
    assert product == sum(c * d for c, d in zip(codes, decoder, strict=True)) + (bias or 0)
    assert bias_code < 0 or (with_bias and bias_pad)
    assert chunks == () or trim


def test_code_columns_of_the_models():
    # Qwen3-8B at 97.5x (84 codes, 42-byte rows read as shifted words): the bias in the codes
    # of pad bytes 44 and 45, 96 of the 128 columns multiplied (6 MMA steps of 16)
    assert ws_code_columns(84, 4, 42, True, True, True) == (
        88, ((0, 32), (32, 16), (64, 32), (96, 16)))
    # GPT-2 (192 codes, 96-byte rows of whole words): 208 of 256 columns, 13 steps of 16
    assert ws_code_columns(192, 4, 96, True, False, True) == (
        192, ((0, 64), (64, 32), (96, 16), (128, 64), (192, 32)))
    # Qwen3-8B at 32x (256 codes fill the 128-byte rows): no padding, every column
    assert ws_code_columns(256, 4, 128, True, False, True) == (-1, ())


def test_routing_on_a_pretend_hopper(monkeypatch):
    # the decisions decode() takes, with the launchers replaced by recorders
    pytest.importorskip("triton")
    from kernels import _fsq, _fsq_plan, _fsq_ws

    monkeypatch.setattr(_fsq_plan, "_is_hopper", lambda device: True)
    monkeypatch.setattr(_fsq_plan, "_triton_version", lambda: (3, 6))
    calls = []
    monkeypatch.setattr(_fsq_ws, "launch_split", lambda p, codes, acc, ml, split_len, splits:
                        calls.append(("ws", split_len, splits)))
    monkeypatch.setattr(_fsq, "_launch_split", lambda p, codes, acc, ml, split_len, splits,
                        block_n, num_warps, num_stages:
                        calls.append(("triton", split_len, splits, block_n, num_warps)))
    monkeypatch.setattr(_fsq, "_merge", lambda p, acc, ml, split_len: acc)
    problem = validate_fsq_args(**make_fsq_case(dtype=torch.bfloat16, archived=5000))
    assert uses_ws(problem) and default_block_n(problem) == 64
    _fsq.decode(problem)
    assert calls[-1] == ("ws", *splits_for(problem, None))  # what the scratch bound counts
    _fsq.decode(problem, num_warps=8)  # a knob: the Triton split kernel at its own block
    block = SPLIT_TUNING["block_n"]
    assert calls[-1] == ("triton", *splits_for(problem, None, block), block, 8)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "TRITON_INTERPRET" in ws_limit(problem)
    _fsq.decode(problem)
    assert calls[-1][0] == "triton" and calls[-1][3] == block
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setitem(SPLIT_TUNING, "ws", False)
    assert not uses_ws(problem) and default_block_n(problem) == block
    _fsq.decode(problem)
    assert calls[-1][0] == "triton"


def test_explicit_rope_tables_are_not_for_the_warp_specialized_kernel():
    case = make_fsq_case(dtype=torch.float16)
    cos, sin = rope_cos_sin(QWEN3_THETA, torch.arange(100), 32)
    problem = validate_fsq_args(**dict(case, rope=(cos.float(), sin.float())))
    assert "RoPE by theta" in ws_limit(problem)


@given(st.integers(1, 400), st.integers(1, 400))
def test_warp_specialized_loads_are_aligned_and_as_wide_as_allowed(nbytes, stride):
    pytest.importorskip("triton.experimental.gluon")
    from kernels._fsq_ws_unpack import byte_vector

    vec = byte_vector(nbytes, stride)
    assert vec in (1, 2, 4, 8, 16) and nbytes % vec == 0 and stride % vec == 0
    assert vec == 16 or nbytes % (2 * vec) or stride % (2 * vec)


def test_triton_on_cpu_tensors_needs_the_interpreter():
    pytest.importorskip("triton")
    from kernels._common import interpreted

    if interpreted():
        pytest.skip("this process interprets")
    with pytest.raises(ValueError, match="CUDA tensors"):
        fsq_decode_attention(**make_fsq_case(), backend="triton")


def test_theta_tables_reduce_angles_exactly():
    # the kernel's angle sum at pos = hi * 2^11 + lo, emulated in float32, against float64
    head_dim = 128
    cos_lo, sin_lo, cos_hi, sin_hi = theta_tables(QWEN3_THETA, head_dim, "cpu")
    pos = torch.tensor([0, 1, 2047, 2048, 99_999, 100_000, 131_071, 999_999, 1_000_000,
                        MAX_THETA_POSITION - 1])
    lo, hi = pos & ((1 << ROPE_RADIX_BITS) - 1), pos >> ROPE_RADIX_BITS
    cos = cos_lo[lo] * cos_hi[hi] - sin_lo[lo] * sin_hi[hi]
    sin = sin_lo[lo] * cos_hi[hi] + cos_lo[lo] * sin_hi[hi]
    exact_cos, exact_sin = rope_cos_sin(QWEN3_THETA, pos, head_dim)
    assert (cos - exact_cos[:, :64]).abs().max() < 1e-6
    assert (sin - exact_sin[:, :64]).abs().max() < 1e-6
    # a float32 product of position and frequency (transformers' way) is off by far more
    inv = (QWEN3_THETA ** (-torch.arange(0, head_dim, 2).float() / head_dim))
    naive = (pos[:, None].float() * inv[None, :]).cos()
    assert (naive - exact_cos[:, :64]).abs().max() > 1e-3


@pytest.mark.parametrize("positions", [None, 100_000, 1_000_000])
def test_reference_keys_match_transformers_qwen3(positions):
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    case = make_fsq_case(head_dim=64, width=20, archived=30, decoder_dtype=torch.float32,
                         positions=positions, sinks=3)
    problem = validate_fsq_args(**case)
    codes = fsq_unpack(case["codes"], 16, 20)[0].float()
    raw = torch.einsum("hdw,nw->hnd", case["key_decoder"], codes) + case["key_bias"][:, None]
    norm = qwen3.Qwen3RMSNorm(64, eps=1e-6)
    norm.weight.data.copy_(case["k_norm"])
    pos = (torch.arange(30) + (3 if positions is None else positions)).double()
    inv = QWEN3_THETA ** (-torch.arange(0, 64, 2).double() / 64)
    angles = torch.cat([pos[:, None] * inv, pos[:, None] * inv], dim=1)
    cos, sin = angles.cos().float()[None], angles.sin().float()[None]
    normed = norm(raw)[None]
    expected, _ = qwen3.apply_rotary_pos_emb(normed, normed, cos, sin)
    torch.testing.assert_close(reconstruct_keys(problem, 0, codes), expected[0],
                               rtol=1e-4, atol=1e-4)


def test_reference_against_dense_attention_and_tables_equal_theta():
    case = make_fsq_case(archived=25, archived_lengths=[25, 9], recent_lengths=[1, 3],
                         )
    pos = torch.arange(64, dtype=torch.float64)
    inv = QWEN3_THETA ** (-torch.arange(0, 32, 2).double() / 32)
    angles = torch.cat([pos[:, None] * inv] * 2, dim=1)
    tables = (angles.cos().float(), angles.sin().float())
    by_theta = reference_fsq_decode_attention(**case, out_dtype=torch.float32)
    by_tables = reference_fsq_decode_attention(**dict(case, rope=tables),
                                               out_dtype=torch.float32)
    torch.testing.assert_close(by_tables, by_theta, rtol=1e-5, atol=1e-5)
    # values: the decoder applied to the weighted code sum equals attention over dense values
    problem = validate_fsq_args(**case)
    assert_rows_close(decode_fsq_problem(problem, backend="torch"), by_theta)


def test_gpt2_shapes_without_rope_or_norm():
    case = make_fsq_case(q_heads=3, kv_heads=3, head_dim=16, rope=None, k_norm=False,
                         bias=False, levels=4, width=10)
    out = fsq_decode_attention(**case)
    assert out.shape == (2, 3, 16) and out.dtype == torch.float16


def _modelled_time(pairs, capacity, sms, block_n, wanted):
    # the documented model, written out: whole blocks per split, no empty split, one
    # program per multiprocessor at a time, each split's positions + 128 of fixed work
    split_len = max(block_n, -(-capacity // (wanted * block_n)) * block_n)
    splits = -(-capacity // split_len)
    return -(-pairs * splits // sms) * (split_len + 128)


@given(pairs=st.integers(1, 3000), capacity=st.integers(1, 400_000),
       sms=st.sampled_from([4, 78, 132, 170]), block_n=st.sampled_from([16, 64, 128]))
def test_split_count_is_near_the_modelled_best_and_keeps_256_positions(pairs, capacity, sms,
                                                                        block_n):
    most = max(1, min(-(-capacity // 256), 1024))
    best = min(_modelled_time(pairs, capacity, sms, block_n, w) for w in range(1, most + 1))
    count = split_count(pairs, capacity, sms, block_n)
    # the 3% margin towards fewer programs, and the capacity rounded up by <= 1/32 for caching
    assert _modelled_time(pairs, capacity, sms, block_n, count) <= best * 1.07
    assert split_layout(capacity, count, block_n)[1] <= most


def test_split_count_fills_whole_waves_of_an_h200():
    # 132 multiprocessors, Qwen3-8B (8 kv heads) and GPT-2 (12) shapes, 128-position blocks,
    # 4 sinks + 32 recent tokens outside the archive
    assert split_count(8, 32732, 132, 128) == 16  # batch 1: 128 programs, one wave
    assert split_count(64, 131036, 132, 128) == 2  # batch 8: one wave, not 4.4
    assert split_count(12, 32732, 132, 128) == 11  # GPT-2 batch 1: 132 programs
    assert split_count(96, 131036, 132, 128) == 4  # GPT-2 batch 8: three full waves
    assert split_count(256, 131036, 132, 128) == 1  # batch 32: two waves


def test_a_growing_archive_finds_its_split_count_cached():
    best_split_len.cache_clear()
    counts = {split_count(8, n, 132, 128) for n in range(100_000, 100_500)}
    # (one boundary of 2,048 positions crossed: three buckets, each once)
    assert best_split_len.cache_info().misses <= 3 and len(counts) <= 2


def test_the_kernel_runs_the_counted_splits():
    problem = validate_fsq_args(**make_fsq_case(batch=1, kv_heads=1, archived=300))
    assert splits_for(problem, None) == (256, 2)  # never shorter than 256 positions
    assert splits_for(problem, None, 64) == split_layout(300, choose_num_splits(problem, 64), 64)


def test_split_layout_defaults_to_the_tuned_block():
    problem = validate_fsq_args(**make_fsq_case(archived=5000))
    split_len, splits = splits_for(problem, 7)  # no block given: the kernel's default
    assert split_len % SPLIT_TUNING["block_n"] == 0 and split_len * splits >= 5000


def test_scratch_does_not_grow_with_positions():
    short = validate_fsq_args(**make_fsq_case(archived=10))
    long = validate_fsq_args(**make_fsq_case(archived=5000))
    assert scratch_bytes(short, 4) == scratch_bytes(long, 4) == 2 * 4 * 4 * (32 + 2) * 4
