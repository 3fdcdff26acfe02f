"""The plain-torch reference and the argument checks (CPU, no triton needed)."""

from __future__ import annotations

import math

import pytest
import torch
from kernels_cases import coded_cache, make_case

from kernels import dequantize_rvq, reference_decode_attention, rvq_decode_attention


def naive_attention(case) -> torch.Tensor:
    """Token-by-token float64 attention over sinks, dequantized archive and recents."""
    q = case["query"].double()
    batch, q_heads, head_dim = q.shape
    kv_heads = case["key_codebooks"].shape[0]
    group = q_heads // kv_heads
    kcb, vcb = case["key_codebooks"].double(), case["value_codebooks"].double()
    out = torch.zeros(batch, q_heads, head_dim, dtype=torch.float64)

    def length(name, full):
        return int(case[name][b]) if name in case else full

    for b in range(batch):
        for h in range(q_heads):
            kvh = h // group
            keys, values = [], []
            for seg in ("sink", "recent"):
                if f"{seg}_keys" in case:
                    n = length(f"{seg}_lengths", case[f"{seg}_keys"].shape[2])
                    keys += [case[f"{seg}_keys"][b, kvh, t].double() for t in range(n)]
                    values += [case[f"{seg}_values"][b, kvh, t].double() for t in range(n)]
            for t in range(length("archived_lengths", case["key_codes"].shape[2])):
                keys.append(sum(kcb[kvh, s, int(case["key_codes"][b, kvh, t, s])]
                                for s in range(kcb.shape[1])))
                values.append(sum(vcb[kvh, s, int(case["value_codes"][b, kvh, t, s])]
                                  for s in range(vcb.shape[1])))
            scores = [float(q[b, h] @ k) / math.sqrt(head_dim) for k in keys]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            out[b, h] = sum(w * v for w, v in zip(weights, values, strict=True)) / sum(weights)
    return out


def test_dequantize_matches_per_position_sum():
    case = make_case(archived=7, key_stages=3, code_dtype=torch.int16, codebook_size=300)
    dense = dequantize_rvq(case["key_codes"], case["key_codebooks"])
    assert dense.shape == (2, 2, 7, 32) and dense.dtype == torch.float32
    cb = case["key_codebooks"].float()
    for b, h, t in [(0, 0, 0), (1, 1, 6), (0, 1, 3)]:
        codes = case["key_codes"][b, h, t].tolist()
        expected = sum(cb[h, s, c] for s, c in enumerate(codes))
        torch.testing.assert_close(dense[b, h, t], expected)


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (6, 2), (4, 1)])
def test_reference_matches_naive(q_heads, kv_heads):
    case = make_case(batch=3, q_heads=q_heads, kv_heads=kv_heads, head_dim=8, archived=9,
                     key_stages=3, value_stages=1, archived_lengths=[9, 4, 0],
                     sink_lengths=[2, 0, 1], recent_lengths=[3, 1, 2])
    ref = reference_decode_attention(**case, out_dtype=torch.float32)
    torch.testing.assert_close(ref.double(), naive_attention(case), rtol=1e-4, atol=1e-5)


def test_cache_without_exact_parts():
    case = make_case(sinks=None, recent=None, archived=5)
    ref = reference_decode_attention(**case, out_dtype=torch.float32)
    torch.testing.assert_close(ref.double(), naive_attention(case), rtol=1e-4, atol=1e-5)


def test_auto_backend_on_cpu_is_the_reference():
    case = make_case()
    out = rvq_decode_attention(**case)
    assert out.dtype == torch.float16 and out.shape == (2, 4, 32)
    torch.testing.assert_close(out, reference_decode_attention(**case))


@pytest.mark.parametrize(
    "change,message",
    [
        ({"query": torch.zeros(2, 4, 32)}, "query must have dtype"),
        ({"query": torch.zeros(2, 4, dtype=torch.float16)}, "query must have 3 dimensions"),
        ({"key_codes": torch.zeros(2, 2, 40, 2, dtype=torch.int32)}, "key_codes must have dtype"),
        ({"value_codes": torch.zeros(2, 2, 40, 3, dtype=torch.uint8)}, "value_codes has shape"),
        ({"value_codes": torch.zeros(2, 2, 39, 2, dtype=torch.uint8)}, "same number of positions"),
        ({"key_codebooks": torch.zeros(2, 2, 16, 31)}, "key_codebooks has shape"),
        ({"key_codebooks": torch.zeros(3, 2, 16, 32)}, "not a multiple"),
        ({"key_codebooks": torch.zeros(2, 2, 300, 32)}, "addresses at most 256"),
        ({"sink_keys": None}, "must be given together"),
        ({"recent_values": torch.zeros(2, 2, 3, 32)}, "recent_values must have dtype"),
        ({"archived_lengths": [41, 0]}, "archived_lengths must lie in"),
        ({"archived_lengths": [1, 2, 3]}, "archived_lengths must have shape"),
        ({"archived_lengths": torch.tensor([1.0, 2.0])}, "must hold integers"),
        ({"archived_lengths": [0, 3], "sink_lengths": [0, 1], "recent_lengths": [0, 1]},
         "no cached position"),
        ({"scale": -1.0}, "scale must be a positive"),
        ({"scale": float("inf")}, "scale must be a positive"),
        ({"scale": 1e39}, "finite float32"),  # overflows once folded into float32 scores
        ({"scale": True}, "scale must be a positive"),
        ({"scale": "0.5"}, "scale must be a positive"),
        ({"archived_lengths": [1.9, 4.99]}, "archived_lengths must hold integers"),
        ({"archived_lengths": ["x", "y"]}, "archived_lengths must hold integers"),
        ({"archived_lengths": [True, 3]}, "archived_lengths must hold integers.*booleans"),
        ({"archived_lengths": [1, None]}, "archived_lengths must hold integers"),
        ({"archived_lengths": [2**63, 1]}, "archived_lengths must hold integers"),
        ({"num_splits": 0}, "num_splits must be None or an int"),
        ({"num_splits": 2.5}, "num_splits must be None or an int"),
        ({"num_splits": True}, "num_splits must be None or an int"),
        ({"num_splits": "3"}, "num_splits must be None or an int"),
        ({"backend": "cuda"}, "backend must be one of"),
    ],
)
def test_bad_arguments_raise_value_error(change, message):
    case = make_case()
    case.update(change)
    with pytest.raises(ValueError, match=message):
        rvq_decode_attention(**case)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_host_lengths_are_checked_even_with_check_lengths_off(as_tensor):
    # check_lengths=False only spares a read-back of GPU lengths; host lengths cost nothing
    def lengths(values):
        return torch.tensor(values) if as_tensor else values

    case = make_case()
    with pytest.raises(ValueError, match="archived_lengths must lie in"):
        rvq_decode_attention(**dict(case, archived_lengths=lengths([41, 0])),
                             check_lengths=False)
    empty = dict(case, archived_lengths=lengths([0, 3]), sink_lengths=lengths([0, 1]),
                 recent_lengths=lengths([0, 1]))
    with pytest.raises(ValueError, match=r"sequences \[0\] have no cached position"):
        rvq_decode_attention(**empty, check_lengths=False)


def test_lengths_as_list_and_tensor_agree():
    case = make_case()
    lengths = {"archived_lengths": [40, 7], "sink_lengths": [2, 0], "recent_lengths": [1, 3]}
    from_lists = rvq_decode_attention(**case, **lengths)
    from_tensors = rvq_decode_attention(
        **case, **{k: torch.tensor(v, dtype=torch.int32) for k, v in lengths.items()})
    torch.testing.assert_close(from_lists, from_tensors, rtol=0, atol=0)


def test_out_of_range_code_is_reported():
    case = make_case(codebook_size=16)
    case["value_codes"][1, 0, 5, 1] = 16
    with pytest.raises(ValueError, match="value_codes holds codes from 0 to 16"):
        rvq_decode_attention(**case)


def test_non_tensor_raises_type_error():
    case = make_case()
    case["query"] = [[1.0]]
    with pytest.raises(TypeError, match="query must be a torch.Tensor"):
        rvq_decode_attention(**case)


@pytest.mark.parametrize("scale", [0.25, None, torch.tensor(0.25)])  # None: numpy float32
def test_scale_accepts_real_numbers_and_scalar_tensors(scale):
    import numpy as np

    case = make_case()
    want = rvq_decode_attention(**case, scale=0.25)
    got = rvq_decode_attention(**case, scale=np.float32(0.25) if scale is None else scale)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_dequantize_checks_its_codes():
    case = make_case(codebook_size=4, code_dtype=torch.int16)
    codes, books = case["key_codes"].clone(), case["key_codebooks"]
    codes[0, 0, 0, 0] = -1  # would read the last centroid through negative indexing
    with pytest.raises(ValueError, match="codes holds codes from -1"):
        dequantize_rvq(codes, books)
    with pytest.raises(ValueError, match="codes must have dtype uint8 or int16"):
        dequantize_rvq(case["key_codes"].float(), books)
    dequantize_rvq(case["key_codes"], books)  # in range: fine


@pytest.mark.parametrize("kw", [
    {},
    {"sinks": None, "recent": None},
    {"archived_lengths": [40, 7], "sink_lengths": [0, 2], "recent_lengths": [3, 1]},
])
def test_trusted_path_equals_the_validated_call(kw):
    from kernels import decode_attention, validate_coded_cache

    case = make_case(**kw)
    cache = coded_cache(case)
    want = rvq_decode_attention(**case, scale=0.2, backend="torch")
    got = decode_attention(case["query"], cache, scale=0.2, backend="torch")
    assert torch.equal(got, want)
    checked = validate_coded_cache(case["query"], cache)
    assert checked.archived_lengths.dtype == torch.int32
    assert torch.equal(decode_attention(case["query"], checked, scale=0.2, backend="torch"), want)


def test_validate_coded_cache_names_what_is_wrong():
    from kernels import validate_coded_cache

    case = make_case()
    cache = coded_cache(case)
    bad = cache.__class__(**{**cache.__dict__, "value_codes": cache.value_codes[:, :, :5]})
    with pytest.raises(ValueError, match="key_codes .* and value_codes .* same number"):
        validate_coded_cache(case["query"], bad)
    too_big = cache.__class__(**{**cache.__dict__,
                                 "key_codes": cache.key_codes.clone().fill_(16)})
    with pytest.raises(ValueError, match="key_codes holds codes from 16 to 16"):
        validate_coded_cache(case["query"], too_big)
    validate_coded_cache(case["query"], too_big, check_codes=False)  # told not to look
    with pytest.raises(TypeError, match="kernels.CodedCache"):
        validate_coded_cache(case["query"], case)


def test_auto_is_one_decision_and_cpu_runs_the_reference():
    from kernels import decode_attention, kernel_takes

    case = make_case()
    cache = coded_cache(case)
    assert not kernel_takes(case["query"], cache)  # CPU tensors: never a kernel
    want = reference_decode_attention(**case)
    assert torch.equal(decode_attention(case["query"], cache, scale=32 ** -0.5), want)
    with pytest.raises(ValueError, match="backend must be one of"):
        decode_attention(case["query"], cache, scale=1.0, backend="cuda")
