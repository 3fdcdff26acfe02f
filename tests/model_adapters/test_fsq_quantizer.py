"""The FSQ quantiser: codes, straight-through rounding, packing (bit and mixed-radix), folding."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import fsq_pack
from model_adapters.quant.fsq import FSQ, FsqBottleneck, FsqConfig, radix_groups

levels_lists = st.lists(st.integers(2, 300), min_size=1, max_size=40)
pow2_lists = st.lists(st.sampled_from([2, 4, 8, 16, 256]), min_size=1, max_size=40)


def _random_codes(levels, rows, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, v, (rows,), generator=g) for v in levels], -1)


@settings(max_examples=60, deadline=None)
@given(levels=levels_lists, rows=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_pack_unpack_round_trip_any_levels(levels, rows, seed):
    fsq = FSQ(levels)
    codes = _random_codes(levels, rows, seed)
    packed = fsq.pack(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, fsq.packed_bytes)
    assert torch.equal(fsq.unpack(packed), codes)


@settings(max_examples=40, deadline=None)
@given(levels=pow2_lists, seed=st.integers(0, 2**16))
def test_power_of_two_levels_use_the_kernels_bit_stream(levels, seed):
    fsq = FSQ(levels)
    codes = _random_codes(levels, 3, seed)
    assert torch.equal(fsq.pack(codes), fsq_pack(codes, levels))
    assert fsq.packed_bytes == math.ceil(sum(int(math.log2(v)) for v in levels) / 8)


@settings(max_examples=60, deadline=None)
@given(levels=levels_lists)
def test_mixed_radix_costs_at_most_one_bit_per_group(levels):
    fsq = FSQ(levels)
    if fsq.power_of_two:
        return
    groups = radix_groups(fsq.levels)
    assert [a for a, _ in groups][1:] == [b for _, b in groups][:-1]
    assert all(math.prod(fsq.levels[a:b]) <= 2**31 for a, b in groups)
    ideal = sum(math.log2(v) for v in levels)
    assert fsq.packed_bytes <= math.ceil((ideal + len(groups)) / 8)
    assert fsq.packed_bytes <= math.ceil(sum((v - 1).bit_length() for v in levels) / 8)


def test_w32_l16_is_16_bytes_and_l5_saves_against_bit_packing():
    assert FsqConfig.parse("fsq-w32-L16").packed_bytes == 16
    assert FsqConfig(32, 5).packed_bytes == 10  # 12 bit-packed, 9.3 ideal


def test_codes_in_range_and_straight_through_gradient():
    fsq = FSQ([4, 5, 16])
    a = (torch.randn(100, 3) * 3).requires_grad_()
    codes = fsq.codes(a)
    assert codes.min() >= 0 and bool((codes < torch.tensor([4, 5, 16])).all())
    z = fsq(a)
    assert torch.allclose(z, fsq.values(codes))
    assert z.min() >= -1 and z.max() <= 1
    (z * torch.arange(3.0)).sum().backward()
    # the rounding passes the gradient unchanged: d z / d a = (1 - tanh^2) m / m
    expected = (1 - torch.tanh(a.detach()) ** 2) * torch.arange(3.0)
    assert torch.allclose(a.grad, expected, atol=1e-6)


def test_folded_decoders_read_integer_codes():
    torch.manual_seed(0)
    b = FsqBottleneck(24, 2, 8, [4, 16, 5, 7])
    x = torch.randn(10, 24)
    z = b.latent(x)
    keys, values = b.decode(z, torch.float32)
    wk, bk, wv, bv = b.folded()
    c = b.codes(x).float()
    assert torch.allclose(torch.einsum("hdw,nw->nhd", wk, c) + bk, keys.view(10, 2, 8), atol=1e-5)
    assert torch.allclose(torch.einsum("hdw,nw->nhd", wv, c) + bv, values.view(10, 2, 8),
                          atol=1e-5)


@pytest.mark.parametrize("bad,match", [
    ("fsq-w32", "not an FSQ config"), ("fsq-w0-L16", "width"), ("fsq-w4-L1", "level"),
    ("rvq-w4-L16", "not an FSQ config"), (7, "not an FSQ config")])
def test_config_names(bad, match):
    with pytest.raises(ValueError, match=match):
        FsqConfig.parse(bad)


def test_config_round_trip_and_tau():
    cfg = FsqConfig.parse("fsq-w32-L16-tau0.25")
    assert (cfg.width, cfg.levels[0], cfg.tau) == (32, 16, 0.25)
    assert cfg.name == "fsq-w32-L16-tau0.25"
    assert FsqConfig.parse(cfg.name) == cfg


def test_bad_codes_are_refused():
    fsq = FSQ([3, 5])
    with pytest.raises(ValueError, match="outside"):
        fsq.pack(torch.tensor([[3, 0]]))
    with pytest.raises(ValueError, match="integer tensor"):
        fsq.pack(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="outside"):
        FSQ([4, 4]).pack(torch.tensor([[4, 0]]))
