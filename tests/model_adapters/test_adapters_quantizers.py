"""k-means and residual VQ against slow, obviously-correct versions written here."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from model_adapters.models import KVShape  # noqa: E402
from model_adapters.quant.configs import QuantConfig  # noqa: E402
from model_adapters.quant.kmeans import assign, kmeans, kmeans_plus_plus  # noqa: E402
from model_adapters.quant.quantizer import KVQuantizer, train_kv_quantizer  # noqa: E402
from model_adapters.quant.rvq import (  # noqa: E402
    code_dtype,
    decode,
    encode,
    encode_joint,
    joint_tables,
    train_rvq,
)


def naive_nearest(x: np.ndarray, centroids: np.ndarray) -> int:
    """Index of the nearest centroid, one distance at a time (first one on ties)."""
    best, best_d = 0, None
    for j, c in enumerate(centroids):
        d = float(((x.astype(np.float64) - c.astype(np.float64)) ** 2).sum())
        if best_d is None or d < best_d:
            best, best_d = j, d
    return best


def naive_lloyd_step(points: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """One Lloyd iteration; an empty cluster keeps its centre."""
    idx = [naive_nearest(p, centroids) for p in points]
    new = centroids.astype(np.float64).copy()
    for j in range(len(centroids)):
        members = [points[i] for i in range(len(points)) if idx[i] == j]
        if members:
            new[j] = np.mean(np.asarray(members, dtype=np.float64), axis=0)
    return new


def naive_rvq(x: np.ndarray, books: np.ndarray):
    """Greedy residual VQ of one vector with one head's books (stages, k, dim)."""
    residual = x.astype(np.float64)
    codes, recon = [], np.zeros_like(residual)
    for stage in books:
        j = naive_nearest(residual, stage)
        codes.append(j)
        residual = residual - stage[j]
        recon = recon + stage[j]
    return codes, recon


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 40),
    st.integers(1, 9),
    st.integers(1, 6),
    st.integers(0, 2**31 - 1),
)
def test_assign_matches_naive(groups, n, k, dim, seed):
    g = torch.Generator().manual_seed(seed)
    # integer-valued points keep distances exact, so ties are resolved the same way
    pts = torch.randint(-4, 5, (groups, n, dim), generator=g).float()
    cents = torch.randint(-4, 5, (groups, k, dim), generator=g).float()
    idx, dist = assign(pts, cents)
    for gi in range(groups):
        for i in range(n):
            j = naive_nearest(pts[gi, i].numpy(), cents[gi].numpy())
            want = float(((pts[gi, i] - cents[gi, j]) ** 2).sum())
            got = float(((pts[gi, i] - cents[gi, idx[gi, i]]) ** 2).sum())
            assert got == want
            assert dist[gi, i].item() == pytest.approx(want, abs=1e-4)


def test_kmeans_one_iteration_is_a_lloyd_step():
    g = torch.Generator().manual_seed(3)
    pts = torch.randn(2, 60, 3, generator=g, dtype=torch.float64)
    gen = torch.Generator().manual_seed(7)
    init = kmeans_plus_plus(pts, 5, gen)
    got = kmeans(pts, 5, iters=1, seed=7, init_sample=None)
    for gi in range(2):
        want = naive_lloyd_step(pts[gi].numpy(), init[gi].numpy())
        np.testing.assert_allclose(got[gi].numpy(), want, rtol=1e-12, atol=1e-12)


def test_kmeans_plus_plus_picks_distinct_data_points():
    pts = torch.randn(3, 50, 4, generator=torch.Generator().manual_seed(0))
    c = kmeans_plus_plus(pts, 8, torch.Generator().manual_seed(1))
    for gi in range(3):
        rows = {tuple(r) for r in pts[gi].numpy().tolist()}
        chosen = [tuple(r) for r in c[gi].numpy().tolist()]
        assert set(chosen) <= rows
        assert len(set(chosen)) == 8  # D^2 weighting never redraws a chosen point


def test_kmeans_deterministic_and_seed_sensitive():
    pts = torch.randn(2, 500, 8, generator=torch.Generator().manual_seed(0))
    a = kmeans(pts, 16, iters=5, seed=11)
    b = kmeans(pts, 16, iters=5, seed=11)
    c = kmeans(pts, 16, iters=5, seed=12)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_kmeans_recovers_separated_clusters():
    centres = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0], [10.0, 10.0]])
    g = torch.Generator().manual_seed(0)
    pts = (centres.repeat_interleave(50, 0) + 0.1 * torch.randn(200, 2, generator=g))[None]
    got = kmeans(pts, 4, iters=20, seed=0)[0]
    order = lambda c: c[torch.argsort(c[:, 0].round() * 100 + c[:, 1].round())]  # noqa: E731
    torch.testing.assert_close(order(got), order(centres), atol=0.1, rtol=0)


def test_kmeans_lowers_distortion_below_its_seeding():
    pts = torch.randn(1, 2000, 8, generator=torch.Generator().manual_seed(5))
    init = kmeans_plus_plus(pts, 32, torch.Generator().manual_seed(0))
    trained = kmeans(pts, 32, iters=10, seed=0)
    assert assign(pts, trained)[1].mean() < assign(pts, init)[1].mean()


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_kmeans_rejects_bad_k(bad):
    with pytest.raises(ValueError, match="k must be"):
        kmeans(torch.randn(1, 10, 2), bad)


def test_kmeans_needs_k_points():
    with pytest.raises(ValueError, match="at least 16 points"):
        kmeans(torch.randn(1, 10, 2), 16)


def test_kmeans_rejects_wrong_rank_and_dtype():
    with pytest.raises(ValueError, match="groups, n, dim"):
        kmeans(torch.randn(10, 2), 2)
    with pytest.raises(TypeError, match="floating point"):
        kmeans(torch.ones(1, 10, 2, dtype=torch.int64), 2)


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 2),
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(2, 12),
    st.integers(1, 5),
    st.integers(1, 7),
    st.integers(0, 2**31 - 1),
)
def test_encode_matches_naive_rvq(batch, heads, stages, k, dim, seq, seed):
    g = torch.Generator().manual_seed(seed)
    books = torch.randn(heads, stages, k, dim, generator=g)
    x = torch.randn(batch, heads, seq, dim, generator=g)
    codes, recon = encode(x, books)
    assert codes.shape == (batch, heads, seq, stages) and codes.dtype == torch.uint8
    for b in range(batch):
        for h in range(heads):
            for t in range(seq):
                want_codes, want_recon = naive_rvq(x[b, h, t].numpy(), books[h].numpy())
                assert codes[b, h, t].tolist() == want_codes
                np.testing.assert_allclose(recon[b, h, t].numpy(), want_recon, atol=1e-5)
    assert torch.equal(decode(codes, books), recon)


@given(
    st.lists(st.integers(1, 4), min_size=1, max_size=3),
    st.integers(1, 2),
    st.integers(1, 3),
    st.integers(2, 12),
    st.integers(1, 9),
    st.sampled_from([torch.float32, torch.float64, torch.float16]),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_joint_encode_matches_encode_per_set(stages, batch, heads, k, seq, dtype, ties, seed):
    """One stacked search for a layer's keys and values gives each side what encoding it alone
    gives, bit for bit (codes, reconstruction, dtypes), whatever their stage counts."""
    g = torch.Generator().manual_seed(seed)
    dim = 8
    sets = [torch.randn(heads, s, k, dim, generator=g) for s in stages]
    if ties:  # duplicated centroids: the first of equal candidates must win on both paths
        sets = [torch.cat([b[:, :, : k // 2], b[:, :, : k - k // 2]], 2) for b in sets]
    xs = [torch.randn(batch, heads, seq, dim, generator=g).to(dtype) for _ in stages]
    got = encode_joint(xs, joint_tables(sets))
    for x, books, (codes, recon) in zip(xs, sets, got, strict=True):
        want_codes, want_recon = encode(x, books)
        assert codes.dtype == want_codes.dtype and recon.dtype == want_recon.dtype
        assert torch.equal(codes, want_codes)
        assert torch.equal(recon, want_recon)


def test_joint_encode_refuses_mismatched_inputs():
    books = [torch.randn(2, 2, 4, 8), torch.randn(2, 1, 4, 8)]
    tables = joint_tables(books)
    with pytest.raises(ValueError, match="2 codebook sets, 1 inputs"):
        encode_joint([torch.randn(1, 2, 3, 8)], tables)
    with pytest.raises(ValueError, match=r"inputs must all be \(batch, 2, seq, 8\)"):
        encode_joint([torch.randn(1, 2, 3, 8), torch.randn(1, 2, 4, 8)], tables)
    with pytest.raises(ValueError, match="equal"):
        joint_tables([torch.randn(2, 1, 4, 8), torch.randn(3, 1, 4, 8)])


def test_train_rvq_shapes_pooled_and_prefix():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 3, 4, generator=g)
    deep = train_rvq(x, num_quantizers=3, codebook_size=8, iters=4, seed=5)
    shallow = train_rvq(x, num_quantizers=2, codebook_size=8, iters=4, seed=5)
    assert deep.shape == (3, 3, 8, 4)
    assert torch.equal(deep[:, :2], shallow)  # greedy stages: a prefix is a shallower training
    pooled = train_rvq(x, num_quantizers=2, codebook_size=8, iters=4, seed=5, pooled=True)
    assert pooled.shape == (3, 2, 8, 4)
    assert torch.equal(pooled[0], pooled[1]) and torch.equal(pooled[1], pooled[2])
    # more stages never increase the training error
    errs = [
        ((encode(x.permute(1, 0, 2)[None], deep[:, :s])[1][0].permute(1, 0, 2) - x) ** 2)
        .mean()
        .item()
        for s in (1, 2, 3)
    ]
    assert errs[0] > errs[1] > errs[2]


def test_code_dtype_widths():
    assert code_dtype(256) == torch.uint8
    assert code_dtype(257) == torch.int16
    assert code_dtype(1024) == torch.int16
    assert code_dtype(40000) == torch.int32


def test_encode_decode_shape_errors():
    books = torch.randn(2, 1, 4, 8)
    with pytest.raises(ValueError, match=r"x must be \(batch, 2, seq, 8\)"):
        encode(torch.randn(1, 3, 5, 8), books)
    with pytest.raises(ValueError, match="codes must be"):
        decode(torch.zeros(1, 2, 5, 2, dtype=torch.uint8), books)
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 4\)"):
        decode(torch.full((1, 2, 5, 1), 9, dtype=torch.uint8), books)


SHAPE = KVShape("gpt2", 2, 3, 4, False)


def test_kv_quantizer_arrays_round_trip_and_rows():
    g = torch.Generator().manual_seed(1)
    keys = [torch.randn(200, 3, 4, generator=g) for _ in range(2)]
    values = [torch.randn(200, 3, 4, generator=g) for _ in range(2)]
    q = train_kv_quantizer(
        keys,
        values,
        SHAPE,
        QuantConfig("x", codebook_size=8, key_stages=2, value_stages=1),
        iters=3,
    )
    arrays = q.to_arrays()
    assert arrays["key_codebooks"].shape == (2, 3, 2, 8, 4)
    assert arrays["value_codebooks"].shape == (2, 3, 1, 8, 4)
    back = KVQuantizer.from_arrays(SHAPE, arrays)
    assert torch.equal(back.key_codebooks, q.key_codebooks)
    assert back.row_width == 2 * 3 * 3
    kc, kr, vc, vr = back.quantize(
        1, keys[1][:5].permute(1, 0, 2)[None], values[1][:5].permute(1, 0, 2)[None]
    )
    assert kc.shape == (1, 3, 5, 2) and vc.shape == (1, 3, 5, 1)
    k_only = q.prefix(1, 0)
    assert k_only.value_codebooks is None and k_only.key_stages == 1
    assert set(k_only.to_arrays()) == {"key_codebooks"}
    pooled = train_kv_quantizer(
        keys,
        values,
        SHAPE,
        QuantConfig("p", pooled=True, codebook_size=8, key_stages=1, value_stages=1),
        iters=3,
    )
    stored = pooled.to_arrays()
    assert stored["key_codebooks"].shape == (2, 1, 1, 8, 4)  # one codebook per layer on disk
    back = KVQuantizer.from_arrays(SHAPE, stored, pooled=True)
    assert torch.equal(back.key_codebooks, pooled.key_codebooks)
    assert back.key_codebooks.shape == (2, 3, 1, 8, 4)


def test_kv_quantizer_rejects_codebook_shape_mismatch():
    wrong_heads = np.zeros((2, 5, 1, 8, 4), dtype=np.float32)
    with pytest.raises(ValueError, match=r"key codebooks have shape \(2, 5, 1, 8, 4\)"):
        KVQuantizer.from_arrays(SHAPE, {"key_codebooks": wrong_heads})
    ok = np.zeros((2, 3, 1, 8, 4), dtype=np.float32)
    other_k = np.zeros((2, 3, 1, 16, 4), dtype=np.float32)
    with pytest.raises(ValueError, match="codebook sizes differ"):
        KVQuantizer.from_arrays(SHAPE, {"key_codebooks": ok, "value_codebooks": other_k})
    with pytest.raises(ValueError, match="unknown codebook arrays"):
        KVQuantizer.from_arrays(SHAPE, {"codebooks": ok})
    with pytest.raises(ValueError, match="asked for K3V0"):
        KVQuantizer.from_arrays(SHAPE, {"key_codebooks": ok}).prefix(3, 0)
