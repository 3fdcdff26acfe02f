"""The static-shape decode operator: the masked reference against the plain reference, and the
operator traced by torch.compile in one piece (CPU, no triton needed)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernels_cases import coded_cache, make_case

from kernels import reference_decode_attention, static_decode_attention
from kernels.coded_cache import DecodeProblem
from kernels.reference import decode_masked


@st.composite
def cases(draw):
    batch = draw(st.integers(1, 3))
    archived, sinks, recent = draw(st.integers(1, 12)), draw(st.integers(0, 3)), draw(
        st.integers(0, 4))
    lengths = {}
    for name, full in (("archived_lengths", archived), ("sink_lengths", sinks),
                       ("recent_lengths", recent)):
        lengths[name] = [draw(st.integers(0, full)) for _ in range(batch)]
    for b in range(batch):  # a sequence with nothing cached has no defined answer
        if not any(lengths[n][b] for n in lengths):
            lengths["archived_lengths"][b] = 1
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    return make_case(batch=batch, archived=archived, sinks=sinks, recent=recent, dtype=dtype,
                     seed=draw(st.integers(0, 2**16)), **lengths)


def with_all_segments(case):
    """The case with every length a tensor (the static operator takes no defaults)."""
    cache = coded_cache(case).with_lengths()
    return case["query"], cache


@given(cases())
def test_masked_reference_matches_the_reference(case):
    want = reference_decode_attention(**case, out_dtype=torch.float32)
    query, cache = with_all_segments(case)
    got = decode_masked(DecodeProblem(query, cache, query.shape[-1] ** -0.5))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    op = static_decode_attention(query, cache, scale=query.shape[-1] ** -0.5, backend="torch")
    assert op.dtype == query.dtype
    torch.testing.assert_close(op, want.to(query.dtype))


def test_masked_reference_keeps_float64():
    case = make_case(dtype=torch.float64)
    query, cache = with_all_segments(case)
    out = decode_masked(DecodeProblem(query, cache, 0.25))
    assert out.dtype == torch.float64


def test_operator_is_one_piece_under_compile():
    query, cache = with_all_segments(make_case(archived=9, archived_lengths=[9, 4]))

    def step(q, lengths):
        c = cache.__class__(**{**cache.__dict__, "archived_lengths": lengths})
        return static_decode_attention(q, c, scale=0.5, backend="torch")

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    for n in ([9, 4], [3, 8]):  # new lengths, same graph
        lengths = torch.tensor(n, dtype=torch.int32)
        torch.testing.assert_close(compiled(query, lengths), step(query, lengths))


def test_unknown_backend_is_refused():
    query, cache = with_all_segments(make_case())
    with pytest.raises(ValueError, match="'auto'"):
        static_decode_attention(query, cache, scale=1.0, backend="auto")
