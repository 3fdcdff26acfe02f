"""Batched k-means in torch: k-means++ seeding and Lloyd iterations, deterministic with a seed.

Many independent problems (one per codebook) run together as a batch: points are
``(groups, n, dim)`` and centroids ``(groups, k, dim)``. Works on any device the points live on.
"""

from __future__ import annotations

import torch

__all__ = ["assign", "kmeans", "kmeans_plus_plus"]

# Points per chunk when computing distances, so a (groups, chunk, k) block stays small.
_CHUNK = 8192


def _check_points(points: torch.Tensor, k: int) -> None:
    if not isinstance(points, torch.Tensor) or points.dim() != 3:
        shape = tuple(points.shape) if isinstance(points, torch.Tensor) else type(points).__name__
        raise ValueError(f"points must be a (groups, n, dim) tensor, got {shape}")
    if not points.is_floating_point():
        raise TypeError(f"points must be floating point, got {points.dtype}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if points.shape[1] < k:
        raise ValueError(
            f"k-means with k={k} needs at least {k} points per group, got {points.shape[1]}; "
            "collect more training tokens or use a smaller codebook_size"
        )


def assign(
    points: torch.Tensor,
    centroids: torch.Tensor,
    c_sq: torch.Tensor | None = None,
    *,
    with_dist: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Nearest centroid of every point (squared Euclidean distance, ties to the lowest index).

    Args:
        points: ``(groups, n, dim)`` float.
        centroids: ``(groups, k, dim)`` float, same dtype and device.
        c_sq: ``(groups, k)`` squared centroid norms, if already known.
        with_dist: also return the squared distances (else None).

    Returns:
        ``(index, sqdist)``: ``(groups, n)`` int64 and ``(groups, n)`` float (or None).
    """
    if c_sq is None:
        c_sq = (centroids * centroids).sum(-1)
    c_t = centroids.transpose(1, 2)
    idx_parts, dist_parts = [], []
    for start in range(0, points.shape[1], _CHUNK):
        x = points[:, start : start + _CHUNK]
        # ||x||^2 is constant per point, so the argmin only needs ||c||^2 - 2 x.c
        score = torch.baddbmm(c_sq.unsqueeze(1), x, c_t, alpha=-2.0)
        best, idx = score.min(dim=-1)
        idx_parts.append(idx)
        if with_dist:
            dist_parts.append((best + (x * x).sum(-1)).clamp_min_(0.0))
    if len(idx_parts) == 1:
        return idx_parts[0], dist_parts[0] if with_dist else None
    return torch.cat(idx_parts, 1), torch.cat(dist_parts, 1) if with_dist else None


def kmeans_plus_plus(
    points: torch.Tensor, k: int, generator: torch.Generator, sample: int | None = None
) -> torch.Tensor:
    """k-means++ seeding: each next centre drawn with probability proportional to D(x)^2.

    Args:
        points: ``(groups, n, dim)`` float.
        k: centres per group.
        generator: a seeded ``torch.Generator`` on the points' device.
        sample: seed from this many randomly chosen points per group (all points if None or
            larger than n); seeding costs k passes over the points, so large sets are subsampled.

    Returns:
        ``(groups, k, dim)`` centres, each one of the points.
    """
    _check_points(points, k)
    groups, n, dim = points.shape
    dev = points.device
    if sample is not None and sample < n:
        sample = max(sample, k)
        pick = torch.stack(
            [torch.randperm(n, generator=generator, device=dev)[:sample] for _ in range(groups)]
        )
        points = torch.gather(points, 1, pick.unsqueeze(-1).expand(-1, -1, dim))
        n = sample
    rows = torch.arange(groups, device=dev)
    centres = torch.empty(groups, k, dim, dtype=points.dtype, device=dev)
    first = torch.randint(0, n, (groups,), generator=generator, device=dev)
    centres[:, 0] = points[rows, first]
    x_sq = (points * points).sum(-1)
    best = (
        x_sq
        - 2 * torch.einsum("gnd,gd->gn", points, centres[:, 0])
        + (centres[:, 0] ** 2).sum(-1, keepdim=True)
    ).clamp_min_(0.0)
    for j in range(1, k):
        weights = best.clone()
        # A group whose points all coincide with chosen centres: any point will do.
        degenerate = weights.sum(-1) <= 0
        weights[degenerate] = 1.0
        nxt = torch.multinomial(weights, 1, generator=generator).squeeze(1)
        centres[:, j] = points[rows, nxt]
        c = centres[:, j]
        d = (
            x_sq - 2 * torch.einsum("gnd,gd->gn", points, c) + (c * c).sum(-1, keepdim=True)
        ).clamp_min_(0.0)
        torch.minimum(best, d, out=best)
    return centres


def _cluster_sums(
    points: torch.Tensor, idx: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    groups, n, dim = points.shape
    if points.device.type == "cpu":
        flat = (idx + torch.arange(groups).unsqueeze(1) * k).reshape(-1)
        sums = torch.zeros(groups * k, dim, dtype=torch.float64)
        sums.index_add_(0, flat, points.reshape(-1, dim).to(torch.float64))
        counts = torch.bincount(flat, minlength=groups * k)
        return sums.view(groups, k, dim), counts.view(groups, k)
    # Atomic scatter-adds on GPUs sum in a varying order; a one-hot matmul is reproducible.
    sums = torch.zeros(groups, k, dim, dtype=points.dtype, device=points.device)
    counts = torch.zeros(groups, k, dtype=torch.int64, device=points.device)
    for start in range(0, n, _CHUNK):
        part = idx[:, start : start + _CHUNK]
        onehot = torch.nn.functional.one_hot(part, k).to(points.dtype)
        sums += torch.bmm(onehot.transpose(1, 2), points[:, start : start + _CHUNK])
        counts += onehot.sum(1).to(torch.int64)
    return sums, counts


def kmeans(
    points: torch.Tensor,
    k: int,
    *,
    iters: int = 20,
    seed: int = 0,
    init_sample: int | None = 16384,
    progress=None,
) -> torch.Tensor:
    """Cluster each group of points into k centroids.

    Args:
        points: ``(groups, n, dim)`` float32/float64 on any device; n >= k.
        k: number of centroids per group.
        iters: at most this many Lloyd iterations (stops early once no assignment changes).
        seed: seeds the k-means++ draws; the same seed and input give the same centroids.
        init_sample: points per group used for k-means++ seeding (None: all).
        progress: optional callable ``progress(iteration)`` (e.g. a tqdm update).

    Returns:
        ``(groups, k, dim)`` centroids in the points' dtype. A cluster that loses all its
        points keeps its previous centre.
    """
    _check_points(points, k)
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise ValueError(f"iters must be a non-negative int, got {iters!r}")
    gen = torch.Generator(device=points.device)
    gen.manual_seed(int(seed))
    centroids = kmeans_plus_plus(points, k, gen, sample=init_sample)
    prev = None
    for it in range(iters):
        idx, _ = assign(points, centroids)
        if prev is not None and torch.equal(idx, prev):
            break
        sums, counts = _cluster_sums(points, idx, k)
        filled = counts > 0
        means = (sums / counts.clamp_min(1).unsqueeze(-1).to(sums.dtype)).to(points.dtype)
        centroids = torch.where(filled.unsqueeze(-1), means, centroids)
        prev = idx
        if progress is not None:
            progress(it)
    return centroids
